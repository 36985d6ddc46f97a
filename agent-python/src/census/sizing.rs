//! Which objects a census sizes (issue #33). Every object it reaches is
//! counted by type; a census on suspicion sizes only what can say where the
//! growth is: tensors, arrays and `bytes`/`bytearray` always (a few large
//! objects grow less in count than many small ones), and the containers of
//! the types that grew most in count since the previous census. Any other
//! type's bytes are estimated from its last measured mean size, and the
//! census says so (`TypeCount.bytes_estimated`). Pure: no Python here.

use std::collections::{HashMap, HashSet};

use super::reasons::Why;

/// How a census sizes what it counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sizing {
    /// Every object: the baselines (the means later censuses estimate by),
    /// a call of `oomscope.census()` and the collector's directive.
    All,
    /// Every object counted; sized: tensors, arrays and buffers, and the
    /// containers of the [`TOP_SIZED_GROWERS`] types grown most in count
    /// since the previous census, or of a type with no mean on record.
    Growers,
}

impl Sizing {
    /// A baseline sizes everything (the means the censuses on suspicion
    /// estimate by); so do a call and a directive, whose reader asked for
    /// the heap as it is. The censuses a growth raises size its growers.
    pub fn of(why: Why) -> Sizing {
        match why {
            Why::Baseline | Why::Call | Why::Directive => Sizing::All,
            Why::Suspicion(_) | Why::Interval | Why::Every => Sizing::Growers,
        }
    }

    /// `oomscope.census(sizing=...)`: "all" or "growers".
    pub fn parse(s: &str) -> Option<Sizing> {
        match s {
            "all" => Some(Sizing::All),
            "growers" => Some(Sizing::Growers),
            _ => None,
        }
    }
}

/// The types grown most in count a census on suspicion sizes: the leaking
/// type and the few that come with it (its container, its instances'
/// dicts), with room for a clean server's churn (a handful of types whose
/// counts move by a few every census).
pub const TOP_SIZED_GROWERS: usize = 8;

/// The names among `unmeasured` (types whose containers a census left
/// unsized) to size after all: those among the [`TOP_SIZED_GROWERS`] types
/// grown most in count (`now`, by name) since `before`, and any without a
/// mean size on record.
pub fn growers_to_size(
    now: &HashMap<String, u64>,
    unmeasured: &HashSet<String>,
    before: &HashMap<String, (u64, u64)>,
    means: &HashMap<String, f64>,
) -> HashSet<String> {
    count_growers(now.iter().map(|(n, c)| (n, *c)), before)
        .into_iter()
        .chain(unmeasured.iter().filter(|n| !means.contains_key(*n)))
        .filter(|n| unmeasured.contains(*n))
        .cloned()
        .collect()
}

/// The [`TOP_SIZED_GROWERS`] types grown most in count from `before` to
/// `now` (counts by name). A census keeps them: the next on suspicion sizes
/// their containers as it counts them (a leak goes on growing the same
/// types), and only a type new among the growers in a second pass.
pub fn count_growers<'a>(
    now: impl IntoIterator<Item = (&'a String, u64)>,
    before: &HashMap<String, (u64, u64)>,
) -> Vec<&'a String> {
    let mut grown: Vec<(&String, u64)> = now
        .into_iter()
        .filter_map(|(name, count)| {
            let was = before.get(name).map_or(0, |b| b.0);
            (count > was).then_some((name, count - was))
        })
        .collect();
    grown.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    grown
        .into_iter()
        .take(TOP_SIZED_GROWERS)
        .map(|(n, _)| n)
        .collect()
}

/// One type's bytes when `sized` of its `count` objects were sized, at
/// `sized_bytes`: the rest at the mean of those sized, else at `mean` (its
/// last measured), else at `basicsize`. Returns (bytes, estimated).
pub fn with_unsized(
    count: u64,
    sized: u64,
    sized_bytes: u64,
    mean: Option<f64>,
    basicsize: u64,
) -> (u64, bool) {
    if sized >= count {
        return (sized_bytes, false);
    }
    let mean = if sized > 0 {
        sized_bytes as f64 / sized as f64
    } else {
        mean.unwrap_or(basicsize as f64)
    };
    let rest = ((count - sized) as f64 * mean).round() as u64;
    (sized_bytes.saturating_add(rest), true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map<V: Copy>(pairs: &[(&str, V)]) -> HashMap<String, V> {
        pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect()
    }

    fn names(n: &[&str]) -> HashSet<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_top_growers_by_count_and_types_with_no_mean_are_sized() {
        let mut now = map(&[
            ("dict", 30_000u64),
            ("list", 10_100),
            ("steady", 500),
            ("bytes", 900),
        ]);
        let mut before = map(&[
            ("dict", (27_000u64, 0u64)),
            ("list", (10_000, 0)),
            ("steady", (500, 0)),
            ("bytes", (800, 0)),
        ]);
        let mut means = map(&[("dict", 232.0), ("list", 80.0), ("steady", 64.0)]);
        let mut unmeasured = names(&["dict", "list", "steady"]);
        // Ten more growers, each by fewer than dict, list and bytes.
        for i in 0..10u64 {
            let n = format!("churn{i}");
            now.insert(n.clone(), 100 + i);
            before.insert(n.clone(), (90, 0));
            means.insert(n.clone(), 56.0);
            unmeasured.insert(n);
        }
        now.insert("new_type".into(), 3);
        unmeasured.insert("new_type".into());
        let picked = growers_to_size(&now, &unmeasured, &before, &means);
        assert!(
            picked.contains("dict") && picked.contains("list"),
            "{picked:?}"
        );
        assert!(!picked.contains("steady"), "{picked:?}");
        // `bytes` ranks among the top growers by count but is sized as it
        // is counted: it takes a place, and is not picked again.
        assert!(!picked.contains("bytes"), "{picked:?}");
        // Seven growers to size, plus the type never measured (it grew,
        // but ranks under the cut by count).
        assert!(picked.contains("new_type"));
        assert_eq!(picked.len(), TOP_SIZED_GROWERS, "{picked:?}");
        assert!(!picked.contains("churn4") && picked.contains("churn5"));
    }

    #[test]
    fn a_container_that_did_not_grow_in_count_is_left_unsized() {
        // A dict of `bytes`: the buffers grow (sized as counted), the dict
        // holding them does not in count.
        let now = map(&[("bytes", 900u64), ("dict", 27_000)]);
        let before = map(&[("bytes", (800u64, 0u64)), ("dict", (27_000, 0))]);
        let means = map(&[("dict", 232.0)]);
        assert!(growers_to_size(&now, &names(&["dict"]), &before, &means).is_empty());
    }

    #[test]
    fn without_a_previous_census_every_type_is_sized() {
        let now = map(&[("dict", 5u64), ("list", 1)]);
        let none = HashMap::new();
        let picked = growers_to_size(&now, &names(&["dict", "list"]), &none, &HashMap::new());
        assert_eq!(picked.len(), 2);
    }

    #[test]
    fn unsized_objects_take_the_mean_of_the_sized_then_the_last_measured() {
        assert_eq!(with_unsized(10, 10, 1000, Some(5.0), 8), (1000, false));
        // Half sized at 100 each: the rest at 100.
        assert_eq!(with_unsized(10, 5, 500, Some(5.0), 8), (1000, true));
        // None sized: the last measured mean, else the type's basic size.
        assert_eq!(with_unsized(10, 0, 0, Some(232.5), 8), (2325, true));
        assert_eq!(with_unsized(10, 0, 0, None, 56), (560, true));
    }

    #[test]
    fn the_baselines_size_everything_and_suspicion_its_growers() {
        assert_eq!(Sizing::of(Why::Baseline), Sizing::All);
        assert_eq!(Sizing::of(Why::Call), Sizing::All);
        assert_eq!(Sizing::of(Why::Suspicion("rss")), Sizing::Growers);
        assert_eq!(Sizing::parse("growers"), Some(Sizing::Growers));
        assert_eq!(Sizing::parse("some"), None);
    }
}
