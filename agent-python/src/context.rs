//! What the server says it is doing: requests in flight and done, the
//! runtime's own numbers (`set_context`), the models it loaded. Pure state;
//! every sample and OOM event carries a copy as a `RequestContext`.

use std::collections::BTreeMap;

use oomscope_agent_core::pb;

use crate::config::ModelSpec;

/// Requests in flight tracked by id; a server that never closes its
/// requests must not grow this map without end.
pub const MAX_IN_FLIGHT: usize = 65_536;

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

    /// A model that finished loading, with the device bytes the load added.
    pub fn loaded(&mut self, model: ModelSpec, bytes: u64) {
        self.models
            .retain(|(m, _)| m.name != model.name || m.revision != model.revision);
        self.models.push((model, bytes));
    }

    /// The context as a message, with `phase` naming the moment (a
    /// sample's "periodic", "after_request", "oom", ...).
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
        for (key, value) in &self.runtime {
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
