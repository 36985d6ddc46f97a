//! The `oomscope.v1` wire format.
//!
//! The `.proto` files under `proto/` are the source of truth. The Rust code in
//! `src/generated/` is generated from them and committed, so building needs no
//! `protoc` and no build script; `tests/bootstrap.rs` regenerates it and fails
//! when the committed copy is stale (run `cargo test -p oomscope-proto` and
//! commit the result).
//!
//! With the `serde` feature every generated type is `Serialize` and
//! `Deserialize`, for JSON and Python objects (see `tests/bootstrap.rs`):
//! fields by their proto names, a oneof's member by its own field name in the
//! enclosing message (as in the proto3 JSON mapping), enum fields as their
//! lowercase value names (`"own"` for `PID_VIEW_OWN`), maps in key order, an
//! unset message or `optional` field as null, and a field missing from the
//! input as its proto default. This is the one JSON shape: every `--json` of
//! the CLI and every Python query is it (see [`serde_forms`] for the fields
//! that need more than the derive).

pub mod bearer;
pub mod delta;
#[cfg(feature = "serde")]
pub mod serde_forms;
pub mod tls;
pub mod vocab;

pub use vocab::{
    CauseKind, IncidentKind, Role, TriggerKind, UnknownName, EVIDENCE_INCOMPLETE_STATE, PROBE_ROLE,
};

#[allow(clippy::all, missing_docs)]
#[rustfmt::skip]
pub mod v1 {
    include!("generated/oomscope.v1.rs");
}

/// The largest message either side accepts, in bytes. A sample is a few KiB
/// and an OOM event with a snapshot summary a few hundred KiB at most, so 16 MiB
/// leaves room while bounding what a malformed peer can make us allocate.
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// Where collectors listen unless told otherwise.
pub const DEFAULT_COLLECTOR_ADDR: &str = "127.0.0.1:7433";
/// The URL agents and the CLI use unless `--collector` or `OOMSCOPE_COLLECTOR` says otherwise.
pub const DEFAULT_COLLECTOR_URL: &str = "http://127.0.0.1:7433";

/// `Hello.runtime` of the Python agent (PyTorch's caching allocator when it
/// has CUDA) and of the Rust agent without and with a `TrackingPool`: the
/// analysis words its fixes for the runtime that produced the evidence.
pub const RUNTIME_PYTORCH: &str = "pytorch";
pub const RUNTIME_RUST: &str = "rust";
pub const RUNTIME_CUDARC: &str = "cudarc";
/// `AllocatorSettings.backend` of the Rust agent's `TrackingPool`.
pub const TRACKING_POOL_BACKEND: &str = "oomscope-pool";

/// The `Sample.phase` of a heap census's sample: the Python agent sends it,
/// the analysis reads censuses by it.
pub const CENSUS_PHASE: &str = "census";

/// The `RequestContext.phase` of the probe's context samples.
pub const PROBE_PHASE: &str = "probe"; // vocab: a phase, not the role
/// The probe's stream is named after the server it probes with this suffix:
/// a member of the server's instance, but never the service a name stands
/// for, nor one of its starts or requests when the collector looks for a
/// restart storm.
pub const PROBE_NAME_SUFFIX: &str = ".probe";

/// A duration in nanoseconds, as the messages' i64 times count them; None
/// past i64::MAX (about 292 years), so that no conversion ever wraps.
pub fn duration_ns(d: std::time::Duration) -> Option<i64> {
    i64::try_from(d.as_nanos()).ok()
}

/// Nanoseconds since the Unix epoch, the time base of every message.
pub fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
