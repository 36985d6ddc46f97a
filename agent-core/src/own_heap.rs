//! The agent's own heap, as its embedder counts it. An agent that lives in
//! someone's server takes memory of its own (census tables, queues, spool
//! buffers); a reading of the server's RSS that includes it would show the
//! agent's steps as the server's growth. Only an embedder whose allocator
//! serves the agent alone can count it (the Python extension, whose Rust
//! heap is all agent); a Rust server sharing its allocator leaves it unset.

use std::sync::OnceLock;

static READER: OnceLock<fn() -> u64> = OnceLock::new();

/// Registers how to read the agent's live heap bytes; the first call wins.
pub fn set_reader(read: fn() -> u64) {
    let _ = READER.set(read);
}

/// The agent's live heap bytes; 0 where no reader is registered.
pub fn bytes() -> u64 {
    READER.get().map_or(0, |read| read())
}
