//! Pure diagnosis: from evidence (oomscope.v1 messages) to a verdict.
//!
//! No I/O here: the collector gathers the evidence and prints the verdict.
//!
//! The flow: `Findings` measures everything once (counter movement, the
//! cgroup that owns a hit limit, thrash over the sample window, limits, error
//! text, the kernel's OOM record, the allocator timeline and the state at
//! the failed allocation); `domain` decides which memory ran out; `trigger`
//! what set it off; `causes` says why, each analyzer on its own (a runtime's
//! own memory text names its domain and cause through the one table in
//! `oom_texts`; runtimes that preallocate their KV pool have their own
//! verdicts in `causes::kv_pool`, measured by `kv_pool_figures`); `fixes` ranks what
//! to change, least risky first, in the runtime's own settings where the
//! evidence names the runtime (`settings`, `setting_fixes`); `capacity`
//! sizes what fits.

pub use oomscope_proto::v1 as pb;

mod before_death;
mod capacity;
mod causes;
mod census;
mod counters;
pub mod devices;
mod diagnose;
mod domain;
pub mod error_line;
mod evidence;
mod failure;
mod findings;
mod fixes;
pub mod growth;
pub mod join;
mod kernel_constraints;
mod kv_fit;
pub mod kv_pool_figures;
pub mod launch;
mod members;
mod memory_domain;
mod memory_high;
pub mod oom_texts;
pub mod request_readings;
mod runtime_kind;
pub mod runway;
mod setting_fixes;
pub mod settings;
pub mod stats;
mod thrash;
mod time_growth;
mod timeline;
mod torch_text;
mod trigger;
pub mod units;
pub mod warmup;

pub use capacity::{capacity, Capacity};
pub use causes::startup_failure::STARTUP_WINDOW_NS;
pub use counters::LIMIT_SLACK_BYTES;
pub use diagnose::{diagnose, memory_domain, no_domain_reason};
pub use domain::{attribute_domain, Domain, DomainVerdict};
pub use evidence::{is_finite_limit, Evidence, IncidentRef, SUPERVISOR_CGROUP_LABEL};
pub use kernel_constraints::HIGH_ORDER_MIN;
pub use kv_pool_figures::usage as kv_pool_usage;
pub use oom_texts::{
    enospc_on_full_shm, is_cuda_oom_text, is_oom_text, oom_line, RuntimeText, RUNTIME_TEXTS,
};
pub use thrash::{
    OWN_MIN_MAJOR_FAULTS, THRASH_MIN_REFAULT_PAGES, THRASH_MIN_REFAULT_SHARE,
    THRASH_MIN_SOME_AVG10, THRASH_MIN_STALL_SHARE,
};
pub use torch_text::ordinal as oom_text_ordinal;
