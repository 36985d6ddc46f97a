//! Why each census ran, for `stats()`: counts by reason and the latest few.
//! Pure state, no Python.

use std::collections::{BTreeMap, VecDeque};

/// The latest censuses `stats()` lists with their reason: enough to see a
/// run's baselines and what followed, bounded however long it runs.
pub const MAX_RECENT: usize = 16;

/// Why a census ran. `Suspicion` names the cheap series that grew
/// (`suspicion::Reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// Requests 10 and 50 (`suspicion::BASELINE_AT`): something to grow from.
    Baseline,
    Suspicion(&'static str),
    /// `census_interval_s` passed with no other census.
    Interval,
    /// Every `census_every` requests.
    Every,
    /// The collector asked (`RunHeapCensus`).
    Directive,
    /// The program called `oomscope.census()`.
    Call,
}

impl Why {
    pub fn label(self) -> String {
        match self {
            Why::Baseline => "baseline".into(),
            Why::Suspicion(series) => format!("suspicion: {series}"),
            Why::Interval => "interval".into(),
            Why::Every => "census_every".into(),
            Why::Directive => "directive".into(),
            Why::Call => "call".into(),
        }
    }
}

/// Censuses by reason, and the latest [`MAX_RECENT`] with the requests done
/// when each ran.
#[derive(Debug, Default)]
pub struct Reasons {
    pub counts: BTreeMap<String, u64>,
    pub recent: VecDeque<(String, u64)>,
}

impl Reasons {
    pub fn record(&mut self, why: Why, requests_done: u64) {
        let label = why.label();
        *self.counts.entry(label.clone()).or_default() += 1;
        if self.recent.len() >= MAX_RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((label, requests_done));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_every_census_and_keeps_the_latest_few() {
        let mut r = Reasons::default();
        r.record(Why::Baseline, 10);
        r.record(Why::Baseline, 50);
        for i in 0..20 {
            r.record(Why::Suspicion("rss"), 60 + i);
        }
        assert_eq!(r.counts["baseline"], 2);
        assert_eq!(r.counts["suspicion: rss"], 20);
        assert_eq!(r.recent.len(), MAX_RECENT);
        assert_eq!(r.recent.back(), Some(&("suspicion: rss".to_string(), 79)));
    }
}
