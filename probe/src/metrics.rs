//! The server's own account of its load: how many requests it is running and
//! how many wait, how full its KV pool is, and whether it preempted. From
//! its Prometheus `/metrics` (vLLM, SGLang, llama.cpp) or llama.cpp's
//! `/slots`, polled while a step runs. The parsing is pure; [`Scraper`] is
//! the polling.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::http::{request, Endpoint};

/// How often the scraper reads the server's metrics during a step: often
/// enough to see a peak of a step that lasts a second.
pub const DEFAULT_POLL: Duration = Duration::from_millis(100);

/// A KV pool at least this full, with requests waiting or preempted, is
/// what bounds the concurrency.
pub const KV_FULL: f64 = 0.9;

/// The runtimes whose load the probe can read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Runtime {
    Vllm,
    Sglang,
    LlamaCpp,
}

impl Runtime {
    pub fn name(self) -> &'static str {
        match self {
            Runtime::Vllm => "vLLM",
            Runtime::Sglang => "SGLang",
            Runtime::LlamaCpp => "llama.cpp",
        }
    }

    /// The setting that sizes the KV pool, as the runtime spells it.
    pub fn kv_setting(self) -> &'static str {
        match self {
            Runtime::Vllm => {
                "--gpu-memory-utilization (or --num-gpu-blocks-override, --kv-cache-dtype)"
            }
            Runtime::Sglang => "--mem-fraction-static (or --max-total-tokens)",
            Runtime::LlamaCpp => "--ctx-size (shared by the --parallel slots)",
        }
    }

    /// The setting that caps the sequences run at once.
    pub fn sequences_setting(self) -> &'static str {
        match self {
            Runtime::Vllm => "--max-num-seqs (and --max-num-batched-tokens)",
            Runtime::Sglang => "--max-running-requests",
            Runtime::LlamaCpp => "--parallel",
        }
    }
}

/// One reading of the server's load.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reading {
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    /// 0..=1.
    pub kv_usage: Option<f64>,
    /// A counter since the server started.
    pub preemptions: Option<f64>,
}

/// Every sample of a Prometheus text exposition, summed over label sets.
pub fn parse_prometheus(text: &str) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) if line.as_bytes()[i] == b'{' => match line[i..].find('}') {
                Some(j) => (&line[..i], &line[i + j + 1..]),
                None => continue,
            },
            Some(i) => (&line[..i], &line[i..]),
            None => continue,
        };
        let Some(v) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        match out.iter_mut().find(|(n, _)| n == name) {
            Some((_, sum)) => *sum += v,
            None => out.push((name.to_string(), v)),
        }
    }
    out
}

/// The runtime a metrics page belongs to.
pub fn detect(text: &str) -> Option<Runtime> {
    if text.contains("vllm:") {
        Some(Runtime::Vllm)
    } else if text.contains("sglang:") {
        Some(Runtime::Sglang)
    } else if text.contains("llamacpp:") {
        Some(Runtime::LlamaCpp)
    } else {
        None
    }
}

/// The load in a metrics page of `rt`.
pub fn reading(rt: Runtime, text: &str) -> Reading {
    let all = parse_prometheus(text);
    let get = |names: &[&str]| {
        names
            .iter()
            .find_map(|n| all.iter().find(|(k, _)| k == n).map(|(_, v)| *v))
    };
    match rt {
        Runtime::Vllm => Reading {
            running: get(&["vllm:num_requests_running"]),
            waiting: get(&["vllm:num_requests_waiting"]),
            kv_usage: get(&["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]),
            preemptions: get(&["vllm:num_preemptions_total", "vllm:num_preemptions"]),
        },
        Runtime::Sglang => Reading {
            running: get(&["sglang:num_running_reqs"]),
            waiting: get(&["sglang:num_queue_reqs"]),
            kv_usage: get(&["sglang:token_usage"]),
            preemptions: get(&["sglang:num_retracted_reqs"]),
        },
        Runtime::LlamaCpp => Reading {
            running: get(&["llamacpp:requests_processing"]),
            waiting: get(&["llamacpp:requests_deferred"]),
            kv_usage: get(&["llamacpp:kv_cache_usage_ratio"]),
            preemptions: None,
        },
    }
}

/// llama.cpp's `/slots`: the slots processing now.
pub fn slots_reading(v: &serde_json::Value) -> Option<Reading> {
    let slots = v.as_array()?;
    if !slots.iter().any(|s| s.get("is_processing").is_some()) {
        return None;
    }
    let busy = slots
        .iter()
        .filter(|s| s["is_processing"].as_bool() == Some(true))
        .count();
    Some(Reading {
        running: Some(busy as f64),
        ..Default::default()
    })
}

/// The load over one step: the peaks, and the preemptions during it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Load {
    /// Where it was read: "vLLM /metrics", "collector: the server's agent", ...
    pub source: String,
    pub readings: usize,
    pub max_running: Option<u64>,
    pub max_waiting: Option<u64>,
    pub max_kv_usage: Option<f64>,
    pub preemptions: Option<u64>,
}

impl Load {
    /// The peaks of `readings` (in time order).
    pub fn of(source: &str, readings: &[Reading]) -> Load {
        let max = |f: &dyn Fn(&Reading) -> Option<f64>| {
            readings
                .iter()
                .filter_map(f)
                .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
        };
        let counts: Vec<f64> = readings.iter().filter_map(|r| r.preemptions).collect();
        Load {
            source: source.into(),
            readings: readings.len(),
            max_running: max(&|r| r.running).map(|v| v.round() as u64),
            max_waiting: max(&|r| r.waiting).map(|v| v.round() as u64),
            max_kv_usage: max(&|r| r.kv_usage),
            preemptions: match (counts.first(), counts.last()) {
                (Some(a), Some(b)) => Some((b - a).max(0.0).round() as u64),
                _ => None,
            },
        }
    }

    /// The KV pool was full while requests waited, or the server preempted:
    /// full is at least [`KV_FULL`], or too full for one more sequence the
    /// size of those running (2 long prompts at 82 % leave no room for a
    /// third). A preemption is itself the proof: vLLM's scheduler preempts
    /// (SGLang retracts) only when no free block is left, and the counter
    /// keeps it where the gauge's full moment fell between two polls.
    pub fn kv_bound(&self) -> bool {
        let full = match (self.max_kv_usage, self.max_running) {
            (Some(u), Some(r)) if r > 0 => u >= KV_FULL || u * (r + 1) as f64 / r as f64 > 1.0,
            (Some(u), _) => u >= KV_FULL,
            _ => false,
        };
        (full && self.max_waiting.unwrap_or(0) > 0) || self.preemptions.unwrap_or(0) > 0
    }

    /// One step's load read two ways (the polled `/metrics` and the agent's
    /// contexts at the collector): the peaks of both, since each can only
    /// miss a peak, never invent one.
    pub fn merge(self, other: Load) -> Load {
        let max_u = |a: Option<u64>, b: Option<u64>| a.max(b);
        let max_f = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        Load {
            source: format!("{} and {}", self.source, other.source),
            readings: self.readings + other.readings,
            max_running: max_u(self.max_running, other.max_running),
            max_waiting: max_u(self.max_waiting, other.max_waiting),
            max_kv_usage: max_f(self.max_kv_usage, other.max_kv_usage),
            preemptions: max_u(self.preemptions, other.preemptions),
        }
    }
}

/// Where the server's load can be read.
#[derive(Clone, Debug)]
pub enum Source {
    Metrics(Runtime),
    Slots,
}

/// Finds the server's load: `/metrics` of a known runtime, else llama.cpp's `/slots`.
pub fn discover(ep: &Endpoint, timeout: Duration) -> Option<Source> {
    let root = ep.root();
    if let Ok(r) = request(&root, "GET", "/metrics", None, &[], timeout) {
        if r.status == 200 {
            if let Some(rt) = detect(&String::from_utf8_lossy(&r.body)) {
                return Some(Source::Metrics(rt));
            }
        }
    }
    match request(&root, "GET", "/slots", None, &[], timeout) {
        Ok(r) if r.status == 200 => r
            .json()
            .ok()
            .and_then(|v| slots_reading(&v))
            .map(|_| Source::Slots),
        _ => None,
    }
}

impl Source {
    pub fn runtime(&self) -> Runtime {
        match self {
            Source::Metrics(rt) => *rt,
            Source::Slots => Runtime::LlamaCpp,
        }
    }

    pub fn label(&self) -> String {
        match self {
            Source::Metrics(rt) => format!("{} /metrics", rt.name()),
            Source::Slots => "llama.cpp /slots".into(),
        }
    }

    pub fn read(&self, ep: &Endpoint, timeout: Duration) -> Option<Reading> {
        let root = ep.root();
        match self {
            Source::Metrics(rt) => {
                let r = request(&root, "GET", "/metrics", None, &[], timeout).ok()?;
                (r.status == 200).then(|| reading(*rt, &String::from_utf8_lossy(&r.body)))
            }
            Source::Slots => {
                let r = request(&root, "GET", "/slots", None, &[], timeout).ok()?;
                slots_reading(&r.json().ok()?)
            }
        }
    }
}

/// Polls the server's load on a thread while `work` runs; returns what
/// `work` returned and the load over it.
pub fn during<T>(
    ep: &Endpoint,
    src: Option<&Source>,
    poll: Duration,
    work: impl FnOnce() -> T,
) -> (T, Option<Load>) {
    let Some(src) = src else {
        return (work(), None);
    };
    let stop = AtomicBool::new(false);
    let readings = Mutex::new(Vec::new());
    let out = std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                if let Some(r) = src.read(ep, poll.max(Duration::from_millis(500))) {
                    readings.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                }
                std::thread::sleep(poll);
            }
        });
        let out = work();
        stop.store(true, Ordering::Relaxed);
        out
    });
    let readings = readings.into_inner().unwrap_or_else(|p| p.into_inner());
    (out, Some(Load::of(&src.label(), &readings)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 5.0
vllm:num_requests_waiting{engine="0",model_name="m"} 157.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.975
vllm:num_preemptions_total{engine="0",model_name="m"} 12.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 1.2e+06
"#;

    #[test]
    fn vllm_metrics_read_as_load() {
        assert_eq!(detect(VLLM), Some(Runtime::Vllm));
        let r = reading(Runtime::Vllm, VLLM);
        assert_eq!(
            r,
            Reading {
                running: Some(5.0),
                waiting: Some(157.0),
                kv_usage: Some(0.975),
                preemptions: Some(12.0)
            }
        );
        let load = Load::of(
            "vLLM /metrics",
            &[
                Reading {
                    preemptions: Some(10.0),
                    ..r.clone()
                },
                r,
            ],
        );
        assert_eq!(
            (load.max_running, load.max_waiting, load.preemptions),
            (Some(5), Some(157), Some(2))
        );
        assert!(load.kv_bound());
    }

    #[test]
    fn label_sets_sum_and_other_runtimes_parse() {
        let two = "vllm:num_requests_running{engine=\"0\"} 2\nvllm:num_requests_running{engine=\"1\"} 3 1700000000\n";
        assert_eq!(reading(Runtime::Vllm, two).running, Some(5.0));
        let sg = "sglang:num_running_reqs{model_name=\"m\"} 4\nsglang:num_queue_reqs{model_name=\"m\"} 0\nsglang:token_usage{model_name=\"m\"} 0.31\n";
        assert_eq!(detect(sg), Some(Runtime::Sglang));
        let r = reading(Runtime::Sglang, sg);
        assert_eq!(
            (r.running, r.waiting, r.kv_usage),
            (Some(4.0), Some(0.0), Some(0.31))
        );
        let ll = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 7\nllamacpp:kv_cache_usage_ratio 0.5\n";
        assert_eq!(detect(ll), Some(Runtime::LlamaCpp));
        assert_eq!(reading(Runtime::LlamaCpp, ll).waiting, Some(7.0));
        assert_eq!(detect("process_cpu_seconds_total 3"), None);
        let slots = serde_json::json!([{"id": 0, "is_processing": true}, {"id": 1, "is_processing": false}]);
        assert_eq!(slots_reading(&slots).unwrap().running, Some(1.0));
        assert!(slots_reading(&serde_json::json!({"data": []})).is_none());
    }

    #[test]
    fn a_pool_with_no_room_for_one_more_sequence_is_the_bound() {
        // Seen on vLLM's CPU build: two 2027-token prompts fill 82 %, two wait.
        let two = Load {
            source: "x".into(),
            readings: 9,
            max_running: Some(2),
            max_waiting: Some(2),
            max_kv_usage: Some(0.82),
            preemptions: Some(0),
        };
        assert!(two.kv_bound());
        // Four short prompts at 20 % with others waiting: a sequence cap, not the pool.
        let capped = Load {
            max_running: Some(4),
            max_kv_usage: Some(0.2),
            ..two
        };
        assert!(!capped.kv_bound());
    }

    #[test]
    fn a_preemption_between_polls_is_the_bound_and_merged_peaks_keep_it() {
        // Seen on vLLM's CPU build: 32 prompts on a 40-block pool, the polls
        // at 49 % while the preemption counter rose by 3.
        let polled = Load {
            source: "vLLM /metrics".into(),
            readings: 3,
            max_running: Some(10),
            max_waiting: Some(6),
            max_kv_usage: Some(0.49),
            preemptions: Some(3),
        };
        assert!(polled.kv_bound());
        let none = Load {
            preemptions: Some(0),
            ..polled.clone()
        };
        assert!(!none.kv_bound());
        // The agent saw the full moment the polls missed.
        let agent = Load {
            source: "collector: the server's agent".into(),
            readings: 4,
            max_running: Some(7),
            max_waiting: Some(15),
            max_kv_usage: Some(0.95),
            preemptions: None,
        };
        let both = none.merge(agent);
        assert_eq!(
            (
                both.readings,
                both.max_running,
                both.max_waiting,
                both.max_kv_usage,
                both.preemptions
            ),
            (7, Some(10), Some(15), Some(0.95), Some(0))
        );
        assert_eq!(
            both.source,
            "vLLM /metrics and collector: the server's agent"
        );
        assert!(both.kv_bound());
    }

    #[test]
    fn a_full_pool_without_waiting_is_no_kv_bound() {
        let full = Reading {
            running: Some(3.0),
            waiting: Some(0.0),
            kv_usage: Some(0.95),
            preemptions: Some(0.0),
        };
        assert!(!Load::of("x", &[full.clone(), full]).kv_bound());
    }
}
