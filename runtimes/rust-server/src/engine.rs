//! The model: weights loaded layer by layer, sequences whose KV cache grows
//! one page per decode step, and the scenario switches. Every device byte
//! comes from the tracking pool; the agent sees each step. Requests and
//! the load are marked with the agent's guards (`Agent::request`,
//! `Agent::load`, `Agent::phase`), as a Rust program uses them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use oomscope_agent_core::lock;
use oomscope_agent_cuda::{pb, Agent, DeviceMemory, PoolError, Tag, TrackedSlice, TrackingPool};

use crate::config::Config;

/// --fragment's prefix-cache entries: three fit one 20 MiB large-pool
/// segment with a 2 MiB tail, so freeing every other one leaves holes of at
/// most 8 MiB, smaller than the decode workspace.
const FRAGMENT_ENTRY_BYTES: u64 = 6 << 20;
const FRAGMENT_ENTRIES_PER_SEGMENT: u64 = 3;

#[derive(Default)]
struct Active {
    sequences: u64,
    tokens: u64,
    kv_bytes: u64,
}

pub struct Engine<D: DeviceMemory> {
    pub pool: TrackingPool<D>,
    pub agent: Agent,
    cfg: Config,
    weights: Mutex<Vec<TrackedSlice<u8>>>,
    weight_bytes: AtomicU64,
    active: Mutex<Active>,
    /// --leak: one block per finished request, never freed.
    leaked: Mutex<Vec<TrackedSlice<u8>>>,
    /// --fragment: the prefix-cache entries that were kept.
    kept_scratch: Mutex<Vec<TrackedSlice<u8>>>,
    next_id: AtomicU64,
}

#[derive(Debug, serde::Serialize)]
pub struct Completion {
    pub id: u64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub kv_bytes: u64,
}

impl<D: DeviceMemory> Engine<D> {
    pub fn new(pool: TrackingPool<D>, agent: Agent, cfg: Config) -> Self {
        Engine {
            pool,
            agent,
            cfg,
            weights: Mutex::new(Vec::new()),
            weight_bytes: AtomicU64::new(0),
            active: Mutex::new(Active::default()),
            leaked: Mutex::new(Vec::new()),
            kept_scratch: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
        }
    }

    pub fn model(&self) -> pb::Model {
        pb::Model {
            name: "oomscope-demo".into(),
            dtype: "bfloat16".into(),
            bytes: self.cfg.model_bytes,
            ..Default::default()
        }
    }

    /// Loads the weights layer by layer, inside the agent's `load` phase
    /// (ended when its guard drops, failed with the pool's error), with a
    /// sample after each layer.
    pub fn load(&self) -> Result<(), PoolError> {
        let layers = self.cfg.layers.max(1);
        let per_layer = self.cfg.model_bytes.div_ceil(layers);
        let mut load = self.agent.load(self.model());
        self.agent.set_context(|c| {
            c.loaded_bytes = 0;
            c.numbers
                .insert("model_bytes".into(), self.cfg.model_bytes as f64);
        });
        self.agent.sample();
        for layer in 0..layers {
            let bytes = per_layer.min(self.cfg.model_bytes - layer * per_layer);
            match self.pool.alloc::<u8>(bytes as usize, Tag::Weights) {
                Ok(w) => lock(&self.weights).push(w),
                Err(e) => {
                    load.fail(&e);
                    return Err(e);
                }
            }
            let loaded = self.weight_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
            self.agent.set_context(|c| {
                c.loaded_bytes = loaded;
                c.numbers.insert("layers_loaded".into(), (layer + 1) as f64);
            });
            self.agent.sample();
        }
        drop(load);
        let weights = self.weight_bytes.load(Ordering::Relaxed);
        self.agent.set_context(|c| c.weight_bytes = weights);
        self.agent.sample();
        if self.cfg.fragment {
            self.warm_prefix_cache()?;
        }
        Ok(())
    }

    /// --fragment: fills the free device memory with prefix-cache entries
    /// and keeps every other one. Live bytes stay flat afterwards (no
    /// leak); the free half is in holes too small for a workspace.
    fn warm_prefix_cache(&self) -> Result<(), PoolError> {
        let _warm = self.agent.phase("prefix_cache_warm");
        let (free, _) = self.pool.device().mem_get_info()?;
        let segments = free / oomscope_agent_cuda::pool::LARGE_BUFFER;
        let mut entries = Vec::new();
        for _ in 0..segments * FRAGMENT_ENTRIES_PER_SEGMENT {
            entries.push(
                self.pool
                    .alloc::<u8>(FRAGMENT_ENTRY_BYTES as usize, Tag::label("prefix_cache"))?,
            );
        }
        let mut kept = lock(&self.kept_scratch);
        kept.extend(entries.into_iter().step_by(2));
        drop(kept);
        self.agent.sample();
        Ok(())
    }

    /// Copies the shared counters into the agent's context (the agent
    /// counts the requests done itself, at each request guard's drop).
    fn set_counters(&self, request_id: u64) {
        let a = lock(&self.active);
        let weights = self.weight_bytes.load(Ordering::Relaxed);
        self.agent.set_context(|c| {
            c.request_id = request_id.to_string();
            c.active_sequences = a.sequences;
            c.active_tokens = a.tokens;
            c.kv_cache_bytes = a.kv_bytes;
            c.weight_bytes = weights;
            c.loaded_bytes = weights;
        });
    }

    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// One sequence: prefill, then one KV page per decode step until
    /// `prompt + max_tokens` tokens. Blocking (runs on a blocking thread).
    /// The agent's request guard marks it: its drop is the request's end
    /// reading, after the KV pages went back to the pool.
    pub fn generate(
        &self,
        id: u64,
        prompt_tokens: u64,
        max_tokens: u64,
    ) -> Result<Completion, PoolError> {
        let mut request = self.agent.request(id, prompt_tokens);
        request.set_max_tokens(max_tokens);
        lock(&self.active).sequences += 1;
        let mut seq = Sequence::default();
        let result = self.run(id, prompt_tokens, max_tokens, &mut seq);
        {
            let mut a = lock(&self.active);
            a.sequences -= 1;
            a.tokens -= seq.tokens;
            a.kv_bytes -= seq.kv_bytes;
        }
        let kv_bytes = seq.kv_bytes;
        drop(seq); // the KV pages go back to the pool's cache
        if result.is_ok() && self.cfg.leak {
            if let Ok(b) = self
                .pool
                .alloc::<u8>(self.cfg.leak_bytes as usize, Tag::Request(id))
            {
                lock(&self.leaked).push(b);
            }
        }
        self.set_counters(id);
        match &result {
            Ok(output_tokens) => request.set_output_tokens(*output_tokens),
            Err(e) => request.fail(e),
        }
        drop(request);
        result.map(|output_tokens| Completion {
            id,
            prompt_tokens,
            output_tokens,
            kv_bytes,
        })
    }

    fn run(
        &self,
        id: u64,
        prompt_tokens: u64,
        max_tokens: u64,
        seq: &mut Sequence,
    ) -> Result<u64, PoolError> {
        let page = self.cfg.page_tokens.max(1);
        let total = prompt_tokens + max_tokens;
        while seq.tokens < total {
            let step = page.min(total - seq.tokens);
            let bytes = step * self.cfg.kv_bytes_per_token;
            let kv = self.pool.alloc::<u8>(bytes as usize, Tag::KvCache)?;
            let _workspace = if self.cfg.fragment {
                Some(
                    self.pool
                        .alloc::<u8>(self.cfg.workspace_bytes as usize, Tag::Workspace)?,
                )
            } else {
                None
            };
            seq.pages.push(kv);
            seq.tokens += step;
            seq.kv_bytes += bytes;
            {
                let mut a = lock(&self.active);
                a.tokens += step;
                a.kv_bytes += bytes;
            }
            // A point inside the request (its sequences and tokens).
            self.set_counters(id);
            self.agent.sample();
            std::thread::sleep(Duration::from_millis(self.cfg.step_ms));
        }
        Ok(seq.tokens.saturating_sub(prompt_tokens))
    }
}

#[derive(Default)]
struct Sequence {
    pages: Vec<TrackedSlice<u8>>,
    tokens: u64,
    kv_bytes: u64,
}
