//! Pure diagnosis: from evidence (oomscope.v1 messages) to a verdict.
//!
//! No I/O here: the collector gathers the evidence and prints the verdict.

pub use oomscope_proto::v1 as pb;
