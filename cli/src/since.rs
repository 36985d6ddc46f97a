//! `--since` of the query verbs, as the collector's time base.

use std::time::Duration;

use oomscope_proto::now_ns;

/// `--since`: that long before now, in epoch nanoseconds; 0 (everything)
/// without it. `args::parse_since` keeps it within i64; saturating all the
/// same, so that no input wraps into the future.
pub(crate) fn since_ns(since: Option<Duration>) -> i64 {
    since
        .map(|d| now_ns().saturating_sub(oomscope_proto::duration_ns(d).unwrap_or(i64::MAX)))
        .unwrap_or(0)
}
