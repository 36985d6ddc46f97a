//! Pure diagnosis: from evidence (oomscope.v1 messages) to a verdict.
//!
//! No I/O here: the collector gathers the evidence and prints the verdict.
//!
//! The flow: `Findings` measures everything once (counter movement, the
//! cgroup that owns a hit limit, thrash over the sample window, limits, error
//! text); `domain` decides which memory ran out; `causes` says why, each
//! analyzer on its own; `fixes` ranks what to change, least risky first.

pub use oomscope_proto::v1 as pb;

mod causes;
mod counters;
mod diagnose;
mod domain;
mod evidence;
mod findings;
mod fixes;
mod json;
mod oom_text;
mod thrash;
pub mod units;

pub use counters::LIMIT_SLACK_BYTES;
pub use diagnose::diagnose;
pub use domain::{attribute_domain, Domain, DomainVerdict};
pub use evidence::{is_finite_limit, Evidence, IncidentRef};
pub use json::to_json;
pub use oom_text::{is_cuda_oom_text, is_oom_text};
pub use thrash::{THRASH_MIN_REFAULT_PAGES, THRASH_MIN_SOME_AVG10, THRASH_MIN_STALL_US};
