//! (in progress) A tracking caching pool over cudarc.
