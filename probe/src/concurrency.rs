//! Effective concurrency: how many requests a server really had in service
//! at once, as opposed to how many the probe sent at once. A server that
//! answers 64 concurrent requests one at a time has a concurrency of 1 (its
//! p99 rises linearly); one whose KV pool holds 5 sequences runs 5 however
//! many wait. Pure: the inputs are the calls' timings and the server's load.

use serde::{Deserialize, Serialize};

use crate::metrics::Load;

/// One answered request's times, in ms from the step's start.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    pub start_ms: f64,
    /// The first streamed token, when the server streamed.
    pub first_token_ms: Option<f64>,
    pub end_ms: f64,
}

/// How many requests were in service at once at one step, and how that was known.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Effective {
    pub value: u64,
    /// "server_metrics", "collector", "first_token" or "latency_scaling".
    pub method: String,
    pub detail: String,
}

/// The most intervals open at one moment (an interval that ends as another
/// begins does not overlap it).
pub fn max_overlap(intervals: &[(f64, f64)]) -> usize {
    let mut edges: Vec<(f64, i32)> = Vec::with_capacity(intervals.len() * 2);
    for &(a, b) in intervals {
        if b > a {
            edges.push((a, 1));
            edges.push((b, -1));
        }
    }
    // Ends before starts at the same instant.
    edges.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
    let (mut open, mut most) = (0i32, 0i32);
    for (_, d) in edges {
        open += d;
        most = most.max(open);
    }
    most as usize
}

/// With streaming: a request is decoding from its first token to its end,
/// so the most such intervals open at once were served together. None
/// unless every call streamed.
pub fn from_first_tokens(calls: &[Timing]) -> Option<usize> {
    let iv: Option<Vec<(f64, f64)>> = calls
        .iter()
        .map(|c| c.first_token_ms.map(|f| (f, c.end_ms)))
        .collect();
    let iv = iv?;
    (!iv.is_empty()).then(|| max_overlap(&iv).max(1))
}

/// Without streaming or the server's word: `n` requests sent together took
/// `makespan_ms`, and the first of them to finish took `fastest_ms`, so
/// about `n * fastest / makespan` were served at once. A server serving `c`
/// at a time ends its first wave after `fastest` and its last after `n / c`
/// waves: 1 for a server that serializes, `n` for one that batches them all
/// (however much the batch slows each request). The reference is the
/// step's own, so a first request that paid for warm-up, or a machine
/// busier at one rung than at another, does not skew it.
pub fn from_scaling(n: usize, makespan_ms: f64, fastest_ms: f64) -> usize {
    if n == 0 || makespan_ms <= 0.0 || fastest_ms <= 0.0 {
        return n.max(1);
    }
    ((n as f64 * fastest_ms / makespan_ms).round() as usize).clamp(1, n)
}

/// The effective concurrency of a step of `n` answered requests: the
/// server's own count where it gave one (its metrics, else its agent's
/// context at the collector) and the first tokens where it streamed, the
/// larger of the two (each can only miss requests in service: a poll
/// between peaks, a prefill before the first token), else latency scaling
/// ([`from_scaling`]).
pub fn effective(n: usize, calls: &[Timing], load: Option<&Load>) -> Effective {
    if n <= 1 {
        return Effective {
            value: 1,
            method: "one_request".into(),
            detail: "one request at a time".into(),
        };
    }
    let counted = load.filter(|l| l.readings > 0).and_then(|l| {
        let r = l.max_running.filter(|&r| r > 0)?;
        let mut detail = format!(
            "{} said at most {r} running",
            l.source.trim_start_matches("collector: ")
        );
        if let Some(w) = l.max_waiting.filter(|&w| w > 0) {
            detail.push_str(&format!(", {w} waiting"));
        }
        let method = if l.source.starts_with("collector") {
            "collector"
        } else {
            "server_metrics"
        };
        Some(Effective {
            value: r.min(n as u64),
            method: method.into(),
            detail,
        })
    });
    let streamed = from_first_tokens(calls).map(|v| Effective {
        value: v.min(n) as u64,
        method: "first_token".into(),
        detail: format!("at most {v} of {n} streamed requests were past their first token at once"),
    });
    match (counted, streamed) {
        (Some(c), Some(s)) if s.value > c.value => return s,
        (Some(c), _) => return c,
        (None, Some(s)) => return s,
        (None, None) => {}
    }
    let start = calls
        .iter()
        .map(|c| c.start_ms)
        .fold(f64::INFINITY, f64::min);
    let end = calls.iter().map(|c| c.end_ms).fold(0.0, f64::max);
    let fastest = calls
        .iter()
        .map(|c| c.end_ms - c.start_ms)
        .fold(f64::INFINITY, f64::min);
    if !start.is_finite() || !fastest.is_finite() {
        return Effective {
            value: n as u64,
            method: "not_measured".into(),
            detail:
                "no server metrics, no streaming and no answered request: all counted as in service"
                    .into(),
        };
    }
    let makespan = end - start;
    let v = from_scaling(n, makespan, fastest);
    Effective {
        value: v as u64,
        method: "latency_scaling".into(),
        detail: format!(
            "{n} requests together took {makespan:.0} ms and the first of them to finish {fastest:.0} ms (about {:.1} served at once)",
            n as f64 * fastest / makespan.max(1.0)
        ),
    }
}

/// Why fewer requests were in service than were sent: the `bounded_by` of
/// a concurrency figure whose value (the effective concurrency) is below
/// what the probe offered, with the evidence. None when nothing queued.
pub fn queue_bound(
    value: u64,
    offered: u64,
    load: Option<&Load>,
    kv_setting: &str,
    seq_setting: &str,
) -> Option<(String, Vec<String>)> {
    if value >= offered {
        return None;
    }
    if let Some(l) = load.filter(|l| l.kv_bound()) {
        return Some((
            "kv_pool".into(),
            vec![format!(
                "the KV pool was {:.0} % full with {} running, {} waiting and {} preempted ({}): no room for another sequence, so the pool, not compute, held concurrency at {value}; the setting is {kv_setting}",
                100.0 * l.max_kv_usage.unwrap_or(0.0),
                l.max_running.unwrap_or(0),
                l.max_waiting.unwrap_or(0),
                l.preemptions.unwrap_or(0),
                l.source
            )],
        ));
    }
    if value == 1 {
        return Some((
            "serialized".into(),
            vec![format!("the server served one request at a time: of {offered} sent together, the rest waited")],
        ));
    }
    Some((
        "max_sequences_setting".into(),
        vec![format!("the server ran {value} requests at once and queued the rest of {offered}; the setting is {seq_setting}")],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Runtime;

    fn t(start: f64, first: Option<f64>, end: f64) -> Timing {
        Timing {
            start_ms: start,
            first_token_ms: first,
            end_ms: end,
        }
    }

    #[test]
    fn overlap_counts_what_is_open_together() {
        assert_eq!(max_overlap(&[(0.0, 10.0), (10.0, 20.0), (20.0, 30.0)]), 1);
        assert_eq!(
            max_overlap(&[(0.0, 10.0), (1.0, 11.0), (2.0, 12.0), (12.0, 20.0)]),
            3
        );
        assert_eq!(max_overlap(&[]), 0);
    }

    #[test]
    fn a_serializing_server_is_one_by_first_tokens_and_by_scaling() {
        // 8 sent at once, served one after another, 100 ms each.
        let calls: Vec<Timing> = (0..8)
            .map(|i| t(0.0, Some(i as f64 * 100.0 + 20.0), (i + 1) as f64 * 100.0))
            .collect();
        assert_eq!(from_first_tokens(&calls), Some(1));
        let plain: Vec<Timing> = calls
            .iter()
            .map(|c| Timing {
                first_token_ms: None,
                ..*c
            })
            .collect();
        let e = effective(8, &plain, None);
        assert_eq!((e.value, e.method.as_str()), (1, "latency_scaling"));
        assert_eq!(
            queue_bound(1, 8, None, "kv", "seqs").unwrap().0,
            "serialized"
        );
    }

    #[test]
    fn four_slots_are_four_whatever_was_sent() {
        // 16 sent, 4 decode at once, in waves.
        let calls: Vec<Timing> = (0..16)
            .map(|i| {
                let wave = (i / 4) as f64;
                t(0.0, Some(wave * 100.0 + 30.0), wave * 100.0 + 100.0)
            })
            .collect();
        assert_eq!(effective(16, &calls, None).value, 4);
        let plain: Vec<Timing> = calls
            .iter()
            .map(|c| Timing {
                first_token_ms: None,
                ..*c
            })
            .collect();
        assert_eq!(effective(16, &plain, None).value, 4);
        let (b, ev) = queue_bound(
            4,
            16,
            None,
            Runtime::Vllm.kv_setting(),
            Runtime::Vllm.sequences_setting(),
        )
        .unwrap();
        assert_eq!(b, "max_sequences_setting");
        assert!(ev[0].contains("--max-num-seqs"), "{ev:?}");
    }

    #[test]
    fn the_servers_word_wins_and_a_full_pool_names_its_setting() {
        let load = Load {
            source: "vLLM /metrics".into(),
            readings: 12,
            max_running: Some(5),
            max_waiting: Some(157),
            max_kv_usage: Some(0.99),
            preemptions: Some(3),
        };
        let calls = vec![t(0.0, None, 50.0); 64];
        let e = effective(64, &calls, Some(&load));
        assert_eq!((e.value, e.method.as_str()), (5, "server_metrics"));
        // A poll that missed the peak is no lower than the first tokens say.
        let sparse = Load {
            max_running: Some(1),
            ..load.clone()
        };
        let streamed: Vec<Timing> = (0..4)
            .map(|i| t(0.0, Some(10.0 + i as f64), 100.0))
            .collect();
        let e = effective(4, &streamed, Some(&sparse));
        assert_eq!((e.value, e.method.as_str()), (4, "first_token"));
        let (b, ev) = queue_bound(
            5,
            64,
            Some(&load),
            Runtime::Vllm.kv_setting(),
            Runtime::Vllm.sequences_setting(),
        )
        .unwrap();
        assert_eq!(b, "kv_pool");
        assert!(ev[0].contains("--gpu-memory-utilization"), "{ev:?}");
        assert!(queue_bound(64, 64, Some(&load), "kv", "seqs").is_none());
    }

    #[test]
    fn batching_without_slowdown_is_all_in_service() {
        let calls: Vec<Timing> = (0..8).map(|_| t(0.0, None, 105.0)).collect();
        assert_eq!(effective(8, &calls, None).value, 8);
        // A batch that slows each request 3x still has all 8 in service.
        let slowed: Vec<Timing> = (0..8).map(|_| t(0.0, None, 300.0)).collect();
        assert_eq!(effective(8, &slowed, None).value, 8);
    }

    #[test]
    fn a_serializing_rung_is_one_whatever_one_request_took_before() {
        // Seen on the reference server with --max-active 1: a lone request
        // took 104 ms (warm-up), then two sent together ended at 50 and 96
        // ms. Against the lone request that read as 2.2 in service.
        let two = [t(0.0, None, 50.0), t(0.0, None, 96.0)];
        let e = effective(2, &two, Some(&Load::default()));
        assert_eq!(
            (e.value, e.method.as_str()),
            (1, "latency_scaling"),
            "{e:?}"
        );
        assert!(e.detail.contains("first of them to finish 50 ms"), "{e:?}");
        // The server's count with none running at its samples is no count.
        let idle = Load {
            readings: 3,
            max_running: Some(0),
            max_waiting: Some(1),
            ..Load::default()
        };
        assert_eq!(effective(2, &two, Some(&idle)).method, "latency_scaling");
    }
}
