//! One sampling-interval rule for every agent and every way to set it.

use std::time::Duration;

/// The shortest interval any agent samples at. A full reading (procfs, the
/// cgroup files, NVML, the allocator's counters) costs up to a millisecond;
/// below 10 ms the agent would spend more than a tenth of a core on itself.
pub const MIN_SAMPLE_INTERVAL: Duration = Duration::from_millis(10);

/// An interval below [`MIN_SAMPLE_INTERVAL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the sample interval must be at least {} ms, not {} ms",
    MIN_SAMPLE_INTERVAL.as_millis(),
    .0.as_secs_f64() * 1000.0
)]
pub struct IntervalTooShort(pub Duration);

/// `interval` if the rule allows it.
pub fn check_interval(interval: Duration) -> Result<Duration, IntervalTooShort> {
    if interval < MIN_SAMPLE_INTERVAL {
        Err(IntervalTooShort(interval))
    } else {
        Ok(interval)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_ms_is_the_floor_and_the_error_says_so() {
        assert_eq!(
            check_interval(Duration::from_millis(10)),
            Ok(Duration::from_millis(10))
        );
        let e = check_interval(Duration::from_millis(5)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the sample interval must be at least 10 ms, not 5 ms"
        );
        assert!(check_interval(Duration::ZERO).is_err());
    }
}
