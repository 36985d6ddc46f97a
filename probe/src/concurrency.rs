//! Effective concurrency: how many requests a server really had in service
//! at once, as opposed to how many the probe sent at once. A server that
//! answers 64 concurrent requests one at a time has a concurrency of 1 (its
//! p99 rises linearly); one whose KV pool holds 5 sequences runs 5 however
//! many wait. Pure: the inputs are the calls' timings and the server's load.

use serde::{Deserialize, Serialize};

use oomscope_analysis::settings::{Knob, Settings};

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

/// Overlaps of decoding spans shorter than this share of the shortest span
/// are the stream's tail, not two requests served together: a server that
/// serializes starts the next request's prefill as soon as the last token is
/// made, while the finished request's final chunks are still on their way
/// (transformers serve without continuous batching, under load, showed 2 of
/// 4 "at once" this way). Requests served together overlap for most of
/// their spans.
pub const STREAM_TAIL_SHARE: f64 = 0.1;

/// With streaming: a request is decoding from its first token to its end,
/// so the most such intervals open at once (less each one's stream tail,
/// [`STREAM_TAIL_SHARE`]) were served together. None unless every call
/// streamed.
pub fn from_first_tokens(calls: &[Timing]) -> Option<usize> {
    let iv: Option<Vec<(f64, f64)>> = calls
        .iter()
        .map(|c| c.first_token_ms.map(|f| (f, c.end_ms)))
        .collect();
    let iv = iv?;
    let shortest = iv
        .iter()
        .map(|(f, e)| e - f)
        .filter(|d| *d > 0.0)
        .fold(f64::INFINITY, f64::min);
    let tail = if shortest.is_finite() {
        STREAM_TAIL_SHARE * shortest
    } else {
        0.0
    };
    let iv: Vec<(f64, f64)> = iv.iter().map(|&(f, e)| (f, (e - tail).max(f))).collect();
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

/// How many sequences of a size the KV pool set on the server's command
/// line holds: a pool sized in tokens (SGLang's `--max-total-tokens`, TGI's
/// `--max-batch-total-tokens`) or in blocks of a set size (`transformers
/// serve`'s `--cb-num-blocks` × `--cb-block-size`; a sequence takes whole
/// blocks). For a server with no load reading, the pool is what explains a
/// batch that stops short of what was sent.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolFit {
    /// Sequences that fit whole: prompt and answer.
    pub sequences: u64,
    /// Sequences that fit at their prompts: a server that takes KV room as
    /// a sequence grows runs this many until their answers need more.
    pub at_prompt: u64,
    /// "--cb-num-blocks 48 blocks of --cb-block-size 16 tokens hold 5 sequences of 131 tokens ..."
    pub line: String,
}

impl PoolFit {
    /// Whether `value` sequences at once is what the pool holds (one either
    /// way: the measure of what was in service is coarse).
    fn explains(&self, value: u64) -> bool {
        (self.sequences.saturating_sub(1)..=self.at_prompt + 1).contains(&value)
    }
}

pub fn pool_fit(s: &Settings, prompt_tokens: u64, answer_tokens: u64) -> Option<PoolFit> {
    let (setting, size) = oomscope_analysis::kv_pool_figures::token_pool(s)?;
    if prompt_tokens == 0 || size < 1.0 {
        return None;
    }
    // A pool in blocks holds whole blocks a sequence; in tokens, tokens.
    let (block, held) = match setting.unit {
        "tokens" => (1, format!("{} {size} tokens", s.spelling(setting))),
        "blocks" => {
            let (block_setting, block) = s.get(Knob::KvBlockSize)?;
            let block = block.parse::<u64>().ok().filter(|&b| b > 0)?;
            let held = format!(
                "{} {size} blocks of {} {block} tokens",
                s.spelling(setting),
                s.spelling(block_setting)
            );
            (block, held)
        }
        _ => return None,
    };
    let fit = |tokens: u64| size as u64 / tokens.div_ceil(block);
    let whole = prompt_tokens + answer_tokens;
    let (sequences, at_prompt) = (fit(whole), fit(prompt_tokens));
    Some(PoolFit {
        sequences,
        at_prompt,
        line: format!(
            "{held} hold {sequences} sequences of {whole} tokens (prompt and answer), {at_prompt} at their prompts' {prompt_tokens}"
        ),
    })
}

/// Why fewer requests were in service than were sent: the `bounded_by` of
/// a concurrency figure whose value (the effective concurrency) is below
/// what the probe offered, with the evidence. None when nothing queued.
pub fn queue_bound(
    value: u64,
    offered: u64,
    load: Option<&Load>,
    pool: Option<&PoolFit>,
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
    // No reading of the pool: its size on the command line, where the
    // batch the server ran is what it holds.
    if let Some(p) = pool.filter(|p| p.sequences < offered && p.explains(value)) {
        return Some((
            "kv_pool".into(),
            vec![format!(
                "the server ran {value} requests at once and queued the rest of {offered}: {}, so the pool, not a cap on sequences, held the batch (no load reading; from the command line)",
                p.line
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
    fn requests_decoding_together_for_most_of_their_spans_count_together() {
        // 4 batched: first tokens 10-40 ms, ends 100-130 ms.
        let calls: Vec<Timing> = (0..4)
            .map(|i| t(0.0, Some(10.0 + 10.0 * i as f64), 100.0 + 10.0 * i as f64))
            .collect();
        assert_eq!(from_first_tokens(&calls), Some(4));
        // Two that overlap for 20 ms of 80: together.
        let two = [t(0.0, Some(20.0), 100.0), t(0.0, Some(80.0), 160.0)];
        assert_eq!(from_first_tokens(&two), Some(2));
    }

    #[test]
    fn a_serializing_server_is_one_by_first_tokens_and_by_scaling() {
        // 8 sent at once, served one after another, 100 ms each.
        let calls: Vec<Timing> = (0..8)
            .map(|i| t(0.0, Some(i as f64 * 100.0 + 20.0), (i + 1) as f64 * 100.0))
            .collect();
        assert_eq!(from_first_tokens(&calls), Some(1));
        // The next request's first token 5 ms before the last one's final
        // chunk (its stream tail): still one at a time.
        let tails: Vec<Timing> = calls
            .iter()
            .map(|c| t(0.0, c.first_token_ms.map(|f| f - 5.0), c.end_ms))
            .collect();
        assert_eq!(from_first_tokens(&tails), Some(1));
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
            queue_bound(1, 8, None, None, "kv", "seqs").unwrap().0,
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
            None,
            Runtime::Vllm.kv_setting(),
            Runtime::Vllm.sequences_setting(),
        )
        .unwrap();
        assert_eq!(b, "kv_pool");
        assert!(ev[0].contains("--gpu-memory-utilization"), "{ev:?}");
        assert!(queue_bound(64, 64, Some(&load), None, "kv", "seqs").is_none());
    }

    fn launched(line: &str) -> Settings {
        let words: Vec<String> = line.split(' ').map(String::from).collect();
        oomscope_analysis::settings::parse(&words, &Default::default())
    }

    #[test]
    fn a_pool_set_in_blocks_explains_the_batch_it_holds_and_no_other() {
        let s = launched(
            "transformers serve m --continuous-batching --cb-num-blocks 48 --cb-block-size 16",
        );
        // 123 + 8 tokens: 9 blocks each whole, 5 in 48 blocks; 8 blocks at
        // the prompt, 6 at once until their answers need a ninth.
        let fit = pool_fit(&s, 123, 8).expect("a pool in blocks with its block size");
        assert_eq!((fit.sequences, fit.at_prompt), (5, 6), "{fit:?}");
        assert!(
            fit.line.contains(
                "--cb-num-blocks 48 blocks of --cb-block-size 16 tokens hold 5 sequences of 131 tokens"
            ),
            "{}",
            fit.line
        );
        for value in [4, 5, 6, 7] {
            let (b, ev) = queue_bound(value, 16, None, Some(&fit), "kv", "seqs").unwrap();
            assert_eq!(b, "kv_pool", "{value}");
            assert!(ev[0].contains("6 at their prompts' 123"), "{ev:?}");
        }
        // A batch the pool does not explain keeps the other readings.
        assert_eq!(
            queue_bound(3, 16, None, Some(&fit), "kv", "seqs")
                .unwrap()
                .0,
            "max_sequences_setting"
        );
        assert_eq!(
            queue_bound(1, 16, None, Some(&fit), "kv", "seqs")
                .unwrap()
                .0,
            "serialized"
        );
        // Without its block size, blocks say nothing of tokens.
        let bare = launched("transformers serve m --continuous-batching --cb-num-blocks 48");
        assert!(pool_fit(&bare, 120, 8).is_none());
        // A pool in tokens: SGLang's.
        let sglang =
            launched("python -m sglang.launch_server --model-path m --max-total-tokens 4096");
        assert_eq!(pool_fit(&sglang, 1000, 24).map(|f| f.sequences), Some(4));
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
