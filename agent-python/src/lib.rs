//! (in progress) The oomscope Python extension.
