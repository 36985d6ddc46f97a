//! What the server says it is doing: requests in flight and done, the
//! runtime's own numbers (`set_context`), the models it loaded. Pure state;
//! every sample and OOM event carries a copy as a `RequestContext`.

use std::collections::BTreeMap;

use oomscope_agent_core::pb;

use crate::config::ModelSpec;

/// Requests in flight tracked by id; a server that never closes its
/// requests must not grow this map without end.
/// The phase of a sample taken on the clock rather than at a boundary.
pub const PERIODIC_PHASE: &str = "periodic";

pub const MAX_IN_FLIGHT: usize = 65_536;

/// The `set_context` numbers a context carries at their peak since the
/// previous one taken ([`ContextState::take_pb`]), not at their last value:
/// how full the KV pool was, how many waited, and the largest batch run in
/// one step. A runtime sets them at each engine step, many times between
/// two samples, and a pool full between two samples is the evidence of a
/// saturation (vLLM's was full for a few engine steps of a 0.4 s burst on
/// CI, and the next step's value overwrote it). `active_sequences` is not
/// one: it is what runs now, so a request's end can read as between
/// requests; a batch at its peak says how many were served together (a
/// step that finishes one of 4 leaves 3 running, and request ends sample
/// exactly those steps).
pub const PEAK_NUMBERS: [&str; 4] = ["kv_cache_usage", "kv_cache_bytes", "queued", "batch_size"];

#[derive(Debug, Default, Clone)]
pub struct InFlight {
    pub prompt_tokens: u64,
    pub max_tokens: u64,
}

#[derive(Debug, Default)]
pub struct ContextState {
    pub phase: String,
    pub in_flight: BTreeMap<String, InFlight>,
    pub requests_done: u64,
    pub requests_failed: u64,
    /// The last request that started (the one an OOM most likely belongs to).
    pub last_request: String,
    pub last_prompt_tokens: u64,
    pub last_output_tokens: u64,
    /// `set_context(...)` values by their own names.
    pub runtime: BTreeMap<String, f64>,
    /// The [`PEAK_NUMBERS`] set since the last [`ContextState::take_pb`].
    peaks: BTreeMap<String, f64>,
    /// The runtime's own text facts (a plugin's resolved settings).
    pub labels: BTreeMap<String, String>,
    pub models: Vec<(ModelSpec, u64)>,
}

impl ContextState {
    pub fn begin(&mut self, id: &str, prompt_tokens: u64, max_tokens: u64) {
        if self.in_flight.len() < MAX_IN_FLIGHT {
            self.in_flight.insert(
                id.to_string(),
                InFlight {
                    prompt_tokens,
                    max_tokens,
                },
            );
        }
        self.last_request = id.to_string();
        self.last_prompt_tokens = prompt_tokens;
    }

    pub fn end(&mut self, id: &str, output_tokens: u64, failed: bool) {
        self.in_flight.remove(id);
        self.requests_done += 1;
        if failed {
            self.requests_failed += 1;
        }
        self.last_output_tokens = output_tokens;
    }

    /// The runtime's own numbers (`set_context`): the last value of each,
    /// and the peak of those in [`PEAK_NUMBERS`].
    pub fn set(&mut self, values: impl IntoIterator<Item = (String, f64)>) {
        for (key, value) in values {
            if PEAK_NUMBERS.contains(&key.as_str()) {
                let peak = self.peaks.entry(key.clone()).or_insert(value);
                *peak = peak.max(value);
            }
            self.runtime.insert(key, value);
        }
    }

    /// [`ContextState::to_pb`] for a sample that is sent (or folded into
    /// one that is, `handoff.rs`): the peaks start again after it.
    pub fn take_pb(&mut self, phase: &str) -> pb::RequestContext {
        let c = self.to_pb(phase);
        self.peaks.clear();
        c
    }

    /// A model that finished loading, with the device bytes the load added.
    pub fn loaded(&mut self, model: ModelSpec, bytes: u64) {
        self.models
            .retain(|(m, _)| m.name != model.name || m.revision != model.revision);
        self.models.push((model, bytes));
    }

    /// The context as a message, with `phase` naming the moment (a
    /// sample's "periodic", "after_request", "oom", ...): the runtime's
    /// numbers at their last value, those in [`PEAK_NUMBERS`] at their peak
    /// since the last [`ContextState::take_pb`].
    pub fn to_pb(&self, phase: &str) -> pb::RequestContext {
        let mut c = pb::RequestContext {
            phase: if phase.is_empty() {
                self.phase.clone()
            } else {
                phase.to_string()
            },
            request_id: self.last_request.clone(),
            prompt_tokens: self.last_prompt_tokens,
            output_tokens: self.last_output_tokens,
            requests_done: self.requests_done,
            ..Default::default()
        };
        let tokens: u64 = self
            .in_flight
            .values()
            .map(|r| r.prompt_tokens + r.max_tokens)
            .sum();
        c.numbers
            .insert("requests_in_flight".into(), self.in_flight.len() as f64);
        c.numbers
            .insert("requests_failed".into(), self.requests_failed as f64);
        c.numbers
            .insert("in_flight_tokens_max".into(), tokens as f64);
        c.labels
            .extend(self.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
        for (key, last) in &self.runtime {
            let value = &self.peaks.get(key).map_or(*last, |p| p.max(*last));
            let slot = match key.as_str() {
                "active_sequences" => Some(&mut c.active_sequences),
                "active_tokens" => Some(&mut c.active_tokens),
                "queued" => Some(&mut c.queued),
                "batch_size" => Some(&mut c.batch_size),
                "kv_cache_bytes" => Some(&mut c.kv_cache_bytes),
                "kv_cache_capacity_bytes" => Some(&mut c.kv_cache_capacity_bytes),
                "weight_bytes" => Some(&mut c.weight_bytes),
                "live_tensors" => Some(&mut c.live_tensors),
                "live_tensor_bytes" => Some(&mut c.live_tensor_bytes),
                _ => None,
            };
            match slot {
                Some(slot) if *value >= 0.0 && value.is_finite() => *slot = *value as u64,
                _ => {
                    c.numbers.insert(key.clone(), *value);
                }
            }
        }
        if !self.models.is_empty() {
            c.loaded_bytes = self.models.iter().map(|(_, b)| *b).sum();
            let names: Vec<String> = self.models.iter().map(|(m, _)| model_label(m)).collect();
            c.labels.insert("active_models".into(), names.join(", "));
        }
        c
    }
}

/// Carries into `newer` the peaks of an `older` context it replaces unsent
/// (the hand-off keeps the newest request end only): the message fields of
/// [`PEAK_NUMBERS`].
pub fn fold_peaks(newer: &mut pb::RequestContext, older: &pb::RequestContext) {
    newer.kv_cache_bytes = newer.kv_cache_bytes.max(older.kv_cache_bytes);
    newer.queued = newer.queued.max(older.queued);
    newer.batch_size = newer.batch_size.max(older.batch_size);
    if let Some(&usage) = older.numbers.get("kv_cache_usage") {
        let n = newer
            .numbers
            .entry("kv_cache_usage".into())
            .or_insert(usage);
        *n = n.max(usage);
    }
}

/// `name@revision (quantization, dtype)`, leaving out what is unknown.
pub fn model_label(m: &ModelSpec) -> String {
    let mut s = m.name.clone();
    if !m.revision.is_empty() {
        s.push('@');
        s.push_str(&m.revision);
    }
    let extra: Vec<&str> = [m.quantization.as_str(), m.dtype.as_str()]
        .into_iter()
        .filter(|x| !x.is_empty())
        .collect();
    if !extra.is_empty() {
        s.push_str(&format!(" ({})", extra.join(", ")));
    }
    s
}

pub fn model_pb(m: &ModelSpec, bytes: u64) -> pb::Model {
    pb::Model {
        name: m.name.clone(),
        revision: m.revision.clone(),
        quantization: m.quantization.clone(),
        dtype: m.dtype.clone(),
        bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_counted_and_the_runtime_numbers_fill_their_fields() {
        let mut s = ContextState::default();
        s.begin("a", 100, 20);
        s.begin("b", 50, 10);
        s.end("a", 17, false);
        s.runtime.insert("active_sequences".into(), 3.0);
        s.runtime.insert("kv_cache_bytes".into(), 4096.0);
        s.runtime.insert("custom".into(), 1.5);
        let c = s.to_pb("after_request");
        assert_eq!(c.phase, "after_request");
        assert_eq!(c.requests_done, 1);
        assert_eq!(c.request_id, "b");
        assert_eq!(c.prompt_tokens, 50);
        assert_eq!(c.output_tokens, 17);
        assert_eq!(c.active_sequences, 3);
        assert_eq!(c.kv_cache_bytes, 4096);
        assert_eq!(c.numbers["custom"], 1.5);
        assert_eq!(c.numbers["requests_in_flight"], 1.0);
        assert_eq!(c.numbers["in_flight_tokens_max"], 60.0);
    }

    fn numbers(pairs: &[(&str, f64)]) -> Vec<(String, f64)> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn the_pool_numbers_carry_their_peak_since_the_last_context_taken() {
        let mut s = ContextState::default();
        // A step of 20 with the pool full and 12 waiting, then one that
        // finished all 20 and freed it.
        let full = [
            ("kv_cache_usage", 1.0),
            ("kv_cache_bytes", 4096.0),
            ("queued", 12.0),
        ];
        s.set(numbers(&[("active_sequences", 20.0), ("batch_size", 20.0)]));
        s.set(numbers(&full));
        s.set(numbers(&[
            ("active_sequences", 0.0),
            ("batch_size", 0.0),
            ("kv_cache_usage", 0.05),
            ("kv_cache_bytes", 200.0),
            ("queued", 0.0),
        ]));
        // An OOM event's context takes nothing: the sample after has it too.
        let oom = s.to_pb("oom");
        let taken = s.take_pb("after_request");
        for c in [&oom, &taken] {
            assert_eq!(c.numbers["kv_cache_usage"], 1.0);
            assert_eq!(c.kv_cache_bytes, 4096);
            assert_eq!(c.queued, 12);
            assert_eq!(c.batch_size, 20);
            // Not a peak: what runs now.
            assert_eq!(c.active_sequences, 0);
        }
        // After a take, the last values until a fuller one is set.
        let next = s.take_pb("periodic");
        assert_eq!(next.numbers["kv_cache_usage"], 0.05);
        assert_eq!((next.kv_cache_bytes, next.queued), (200, 0));
        s.set(numbers(&[("queued", 3.0)]));
        s.set(numbers(&[("queued", 1.0)]));
        assert_eq!(s.take_pb("periodic").queued, 3);
    }

    #[test]
    fn a_folded_context_keeps_the_peaks_of_the_one_it_replaced() {
        let mut s = ContextState::default();
        s.set(numbers(&[
            ("kv_cache_usage", 0.97),
            ("kv_cache_bytes", 4000.0),
            ("queued", 9.0),
        ]));
        let older = s.take_pb("after_request");
        s.set(numbers(&[
            ("kv_cache_usage", 0.1),
            ("kv_cache_bytes", 400.0),
            ("queued", 0.0),
        ]));
        let mut newer = s.take_pb("after_request");
        fold_peaks(&mut newer, &older);
        assert_eq!(newer.numbers["kv_cache_usage"], 0.97);
        assert_eq!((newer.kv_cache_bytes, newer.queued), (4000, 9));
        // Each of PEAK_NUMBERS is folded: set alone, it survives the fold.
        for key in PEAK_NUMBERS {
            let mut s = ContextState::default();
            s.set(numbers(&[(key, 7.0)]));
            let older = s.take_pb("");
            let mut newer = ContextState::default().take_pb("");
            fold_peaks(&mut newer, &older);
            assert_eq!(newer, older, "{key}");
        }
    }

    #[test]
    fn loaded_models_are_listed_once_each() {
        let mut s = ContextState::default();
        let m = ModelSpec {
            name: "tiny".into(),
            revision: "r1".into(),
            quantization: "".into(),
            dtype: "float16".into(),
        };
        s.loaded(m.clone(), 1000);
        s.loaded(m, 1200);
        let c = s.to_pb("");
        assert_eq!(c.loaded_bytes, 1200);
        assert_eq!(c.labels["active_models"], "tiny@r1 (float16)");
    }
}
