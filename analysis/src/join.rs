//! Joining one member's readings to another's samples: the supervisor's
//! process tree and the serving process's context (a vLLM API server's KV
//! pool and queue) onto the main agent's samples, so that one timeline holds
//! the instance. Pure: the collector reads the readings, this joins them.

use crate::pb;

/// Gives each sample the latest context of `theirs` at or before it (a
/// sample with a context of its own takes only what it lacks: see
/// [`fill_missing`]) (no older than [`TREE_JOIN_MAX_AGE_NS`]), with
/// the KV pool at its fullest over `theirs` since the sample before: the
/// highest usage, bytes and queue. The serving process reads more often than
/// the main agent samples (a vLLM API server at each request end), and a
/// pool full between two samples is the evidence of a saturation.
pub fn join_context(samples: &mut [pb::TimedSample], theirs: &[pb::TimedSample]) {
    let with_context: Vec<(&pb::Sample, &pb::RequestContext)> = theirs
        .iter()
        .filter_map(|s| s.sample.as_ref())
        .filter_map(|s| Some((s, s.context.as_ref()?)))
        .collect();
    let mut next = 0;
    for s in samples.iter_mut() {
        let Some(sample) = s.sample.as_mut() else {
            continue;
        };
        let mut fullest = KvFullest::default();
        while next < with_context.len() && with_context[next].0.time_ns <= sample.time_ns {
            fullest.see(with_context[next].1);
            next += 1;
        }
        if next == 0 {
            continue;
        }
        let (latest, c) = with_context[next - 1];
        if !(0..=TREE_JOIN_MAX_AGE_NS).contains(&(sample.time_ns - latest.time_ns)) {
            continue;
        }
        let mut c = c.clone();
        fullest.apply(&mut c);
        match sample.context.as_mut() {
            Some(own) => fill_missing(own, c),
            None => sample.context = Some(c),
        }
    }
}

/// A sample with a context of its own (a vLLM GPU worker's: its share of
/// the KV pool, from the plugin's worker hook) takes what only the serving
/// process knows (how full the pool is, the queue, the running requests)
/// and keeps its own figures. Its own pool size wins over the instance's
/// (a tensor-parallel worker holds its shard), and the bytes in use are the
/// usage of that pool.
fn fill_missing(own: &mut pb::RequestContext, theirs: pb::RequestContext) {
    let own_pool = crate::kv_pool_figures::own_pool_bytes(own);
    for (k, v) in theirs.numbers {
        own.numbers.entry(k).or_insert(v);
    }
    for (k, v) in theirs.labels {
        own.labels.entry(k).or_insert(v);
    }
    let fill = |mine: &mut u64, theirs: u64| {
        if *mine == 0 {
            *mine = theirs;
        }
    };
    // A process that counts requests itself keeps its counts whole: a 0
    // there is its own reading, not a gap.
    let counts_requests = !own.phase.is_empty()
        || own.requests_done > 0
        || own.active_sequences > 0
        || own.active_tokens > 0
        || own.queued > 0;
    if !counts_requests {
        own.phase = theirs.phase;
        own.active_sequences = theirs.active_sequences;
        own.active_tokens = theirs.active_tokens;
        own.queued = theirs.queued;
        own.batch_size = theirs.batch_size;
        own.requests_done = theirs.requests_done;
    }
    match own_pool {
        Some(pool) => {
            own.kv_cache_capacity_bytes = pool;
            if own.kv_cache_bytes == 0 {
                if let Some(u) = own.numbers.get("kv_cache_usage").filter(|u| u.is_finite()) {
                    own.kv_cache_bytes = (u.clamp(0.0, 1.0) * pool as f64) as u64;
                }
            }
        }
        None => {
            fill(
                &mut own.kv_cache_capacity_bytes,
                theirs.kv_cache_capacity_bytes,
            );
            fill(&mut own.kv_cache_bytes, theirs.kv_cache_bytes);
        }
    }
}

/// The fullest the KV pool was over a run of readings.
#[derive(Default)]
struct KvFullest {
    usage: Option<f64>,
    bytes: u64,
    queued: u64,
}

impl KvFullest {
    fn see(&mut self, c: &pb::RequestContext) {
        if let Some(&u) = c.numbers.get("kv_cache_usage").filter(|u| u.is_finite()) {
            self.usage = Some(self.usage.map_or(u, |m| m.max(u)));
        }
        self.bytes = self.bytes.max(c.kv_cache_bytes);
        self.queued = self.queued.max(c.queued);
    }

    fn apply(&self, c: &mut pb::RequestContext) {
        if let Some(u) = self.usage {
            c.numbers.insert("kv_cache_usage".into(), u);
        }
        c.kv_cache_bytes = c.kv_cache_bytes.max(self.bytes);
        c.queued = c.queued.max(self.queued);
    }
}

/// Gives each sample the supervisor's process tree as it was at that moment
/// (its latest reading at or before the sample, if no older than
/// [`TREE_JOIN_MAX_AGE_NS`]). Both lists are in time order.
pub fn join_tree(samples: &mut [pb::TimedSample], tree: &[pb::TimedSample]) {
    let mut j = 0;
    for s in samples.iter_mut() {
        let Some(sample) = s.sample.as_mut() else {
            continue;
        };
        while j + 1 < tree.len() && time_of(&tree[j + 1]) <= sample.time_ns {
            j += 1;
        }
        let Some(reading) = tree.get(j).and_then(|t| t.sample.as_ref()) else {
            continue;
        };
        let age = sample.time_ns - reading.time_ns;
        if (0..=TREE_JOIN_MAX_AGE_NS).contains(&age) && !reading.tree.is_empty() {
            sample.tree = reading.tree.clone();
            sample.tree_rss_bytes = reading.tree_rss_bytes;
            sample.tree_pss_bytes = reading.tree_pss_bytes;
        }
    }
}

/// A supervisor's reading older than this says nothing about a sample: a few
/// of its intervals.
pub const TREE_JOIN_MAX_AGE_NS: i64 = 5_000_000_000;

fn time_of(s: &pb::TimedSample) -> i64 {
    s.sample.as_ref().map_or(i64::MIN, |s| s.time_ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t: i64, tree_rss: u64) -> pb::TimedSample {
        pb::TimedSample {
            seq: t as u64,
            sample: Some(pb::Sample {
                time_ns: t,
                tree_rss_bytes: tree_rss,
                tree: if tree_rss > 0 {
                    vec![pb::ProcessInfo {
                        pid: 7,
                        rss_bytes: tree_rss,
                        ..Default::default()
                    }]
                } else {
                    vec![]
                },
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_sample_without_context_takes_the_serving_processs_latest() {
        let ctx = |t: i64, queued: u64| pb::TimedSample {
            seq: t as u64,
            sample: Some(pb::Sample {
                time_ns: t,
                context: Some(pb::RequestContext {
                    queued,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let theirs = [ctx(100, 1), ctx(200, 2)];
        let mut main = vec![sample(50, 0), sample(250, 0), ctx(260, 9)];
        join_context(&mut main, &theirs);
        let queued: Vec<Option<u64>> = main
            .iter()
            .map(|s| {
                s.sample
                    .as_ref()
                    .unwrap()
                    .context
                    .as_ref()
                    .map(|c| c.queued)
            })
            .collect();
        assert_eq!(queued, [None, Some(2), Some(9)]);
    }

    #[test]
    fn a_joined_context_keeps_the_pools_fullest_moment_since_the_sample_before() {
        let ctx = |t: i64, usage: f64, queued: u64, running: u64| pb::TimedSample {
            seq: t as u64,
            sample: Some(pb::Sample {
                time_ns: t,
                context: Some(pb::RequestContext {
                    queued,
                    active_sequences: running,
                    numbers: [("kv_cache_usage".to_string(), usage)].into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        // The API server's readings: full for a moment at 150, between the
        // main agent's samples at 50 and 210.
        let theirs = [
            ctx(100, 0.5, 1, 3),
            ctx(150, 0.95, 6, 9),
            ctx(200, 0.4, 0, 2),
            ctx(400, 0.3, 0, 1),
        ];
        let mut main = vec![
            sample(50, 0),
            sample(210, 0),
            sample(300, 0),
            sample(450, 0),
        ];
        join_context(&mut main, &theirs);
        let got: Vec<Option<(f64, u64, u64)>> = main
            .iter()
            .map(|s| {
                let c = s.sample.as_ref().unwrap().context.as_ref()?;
                Some((c.numbers["kv_cache_usage"], c.queued, c.active_sequences))
            })
            .collect();
        assert_eq!(
            got,
            [
                None,
                // The fullest usage and queue since 50; the running count as of 200.
                Some((0.95, 6, 2)),
                // Nothing new since 210: the latest as it was.
                Some((0.4, 0, 2)),
                Some((0.3, 0, 1)),
            ]
        );
    }

    #[test]
    fn each_sample_gets_the_trees_reading_at_or_before_it_when_recent() {
        let tree = [sample(100, 1), sample(200, 2), sample(300, 3)];
        let mut main = vec![
            sample(50, 0),
            sample(150, 0),
            sample(300, 0),
            sample(300 + TREE_JOIN_MAX_AGE_NS + 1, 0),
        ];
        join_tree(&mut main, &tree);
        let got: Vec<u64> = main
            .iter()
            .map(|s| s.sample.as_ref().unwrap().tree_rss_bytes)
            .collect();
        assert_eq!(got, [0, 1, 3, 0]);
        assert_eq!(main[1].sample.as_ref().unwrap().tree[0].pid, 7);
    }
}
