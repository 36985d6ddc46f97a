//! Capture files (tests/fixtures/README.md) read back as the messages a live
//! PyTorch agent would have sent, for `oomscope replay`.
//!
//! A capture holds a timeline of `torch.cuda.memory_stats()` readings with the
//! request context, the OOM observer's arguments, the error text and allocator
//! snapshots. Each part goes through the same `agent_core::torch` functions the
//! live agent uses, so replayed and live messages cannot drift apart.
//!
//! Files without a timeline (raw facts such as `driver_and_nvml.json`) are
//! valid captures too: a Hello that carries their facts as labels.

use std::io::Read;
use std::path::Path;

use anyhow::{bail, Result};
use serde_json::{Map, Value};

use oomscope_agent_core::{pb, torch};
use oomscope_proto::Role;

/// A decompressed capture larger than this is refused rather than read.
pub const MAX_CAPTURE_BYTES: u64 = 1 << 30;

/// The phase of the sample made from a capture's `final` reading.
pub const FINAL_PHASE: &str = "final";
/// Context phases that mean "loading weights" (`load_start`, `load`,
/// `loading`, ...): entering and leaving them gives `Phase` events.
pub const LOAD_PHASE_PREFIX: &str = "load";

/// The name of the `Phase` events for a model load.
pub const LOAD_PHASE: &str = "load";

/// One message of the replayed stream.
// Unboxed on purpose: a capture holds a few hundred items, and callers hand
// the bodies straight to the reporter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum CaptureItem {
    Sample(pb::Sample),
    Event(pb::Event),
}

impl CaptureItem {
    fn set_time_ns(&mut self, time_ns: i64) {
        match self {
            CaptureItem::Sample(s) => s.time_ns = time_ns,
            CaptureItem::Event(e) => e.time_ns = time_ns,
        }
    }
}

/// A capture file as an agent's stream: the Hello, then Samples and Events in
/// time order, each with the capture's `t_s` (seconds since the capture began).
#[derive(Clone, Debug, PartialEq)]
pub struct Capture {
    pub scenario: String,
    pub hello: pb::Hello,
    pub items: Vec<(f64, CaptureItem)>,
    /// False for a file of raw facts with no `timeline`.
    pub has_timeline: bool,
}

impl Capture {
    /// True when the file had a timeline (it may still be empty).
    pub fn is_timeline(&self) -> bool {
        self.has_timeline
    }

    pub fn samples(&self) -> impl Iterator<Item = &pb::Sample> {
        self.items.iter().filter_map(|(_, item)| match item {
            CaptureItem::Sample(s) => Some(s),
            CaptureItem::Event(_) => None,
        })
    }

    pub fn events(&self) -> impl Iterator<Item = &pb::Event> {
        self.items.iter().filter_map(|(_, item)| match item {
            CaptureItem::Event(e) => Some(e),
            CaptureItem::Sample(_) => None,
        })
    }

    /// Re-times every message as `base_ns + t_s * 1e9`, and the Hello's start
    /// as `base_ns`.
    pub fn rebase(&mut self, base_ns: i64) {
        self.hello.start_time_ns = base_ns;
        for (t_s, item) in &mut self.items {
            item.set_time_ns(time_ns(base_ns, *t_s));
        }
    }

    /// Replaces the agent name (and id) taken from the scenario.
    pub fn set_name(&mut self, name: &str) {
        self.hello.name = name.to_string();
        self.hello.agent_id = agent_id(name);
    }

    /// The stream a live agent would send: the Hello at seq 0, then every
    /// item numbered from seq 1.
    pub fn messages(&self) -> Vec<pb::AgentMessage> {
        use pb::agent_message::Body;
        let hello = pb::AgentMessage {
            seq: 0,
            body: Some(Body::Hello(self.hello.clone())),
        };
        std::iter::once(hello)
            .chain(
                self.items
                    .iter()
                    .zip(1u64..)
                    .map(|((_, item), seq)| pb::AgentMessage {
                        seq,
                        body: Some(match item {
                            CaptureItem::Sample(s) => Body::Sample(s.clone()),
                            CaptureItem::Event(e) => Body::Event(e.clone()),
                        }),
                    }),
            )
            .collect()
    }
}

/// Reads a capture (`.json` or `.json.gz`, told apart by content) with
/// `time_ns = base_ns + t_s * 1e9` (see [`Capture::rebase`]). Errors name the
/// file and what is wrong with it.
pub fn load(path: &Path, base_ns: i64) -> Result<Capture> {
    let origin = path.display().to_string();
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => bail!("{origin}: cannot read the capture: {e}"),
    };
    let mut capture = parse(&bytes, &origin, base_ns)?;
    if let Some(file) = path.file_name() {
        capture
            .hello
            .labels
            .insert("capture_file".into(), file.to_string_lossy().into_owned());
    }
    Ok(capture)
}

/// Parses a capture from its bytes (plain or gzipped JSON); `origin` names it
/// in errors.
pub fn parse(bytes: &[u8], origin: &str, base_ns: i64) -> Result<Capture> {
    let json = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        let read = flate2::read::GzDecoder::new(bytes)
            .take(MAX_CAPTURE_BYTES + 1)
            .read_to_end(&mut out);
        if let Err(e) = read {
            bail!("{origin}: corrupt or truncated gzip: {e}");
        }
        if out.len() as u64 > MAX_CAPTURE_BYTES {
            bail!("{origin}: decompresses to more than {MAX_CAPTURE_BYTES} bytes");
        }
        out
    } else {
        bytes.to_vec()
    };
    let value: Value = match serde_json::from_slice(&json) {
        Ok(v) => v,
        Err(e) => bail!("{origin}: not JSON: {e}"),
    };
    from_json(&value, origin, base_ns)
}

/// Builds the stream from a capture already parsed as JSON.
pub fn from_json(v: &Value, origin: &str, base_ns: i64) -> Result<Capture> {
    let Some(top) = v.as_object() else {
        bail!(
            "{origin}: not a capture: the top level is {}, not an object",
            kind(v)
        );
    };
    let Some(scenario) = top.get("scenario").and_then(Value::as_str) else {
        bail!("{origin}: not a capture: no \"scenario\" string at the top level");
    };
    let empty = Map::new();
    let notes = match top.get("notes") {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(m)) => m,
        Some(other) => bail!("{origin}: \"notes\" is {}, not an object", kind(other)),
    };
    let timeline = match top.get("timeline") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(a),
        Some(other) => bail!("{origin}: \"timeline\" is {}, not an array", kind(other)),
    };
    let entries = timeline
        .map(|t| check_entries(t, origin))
        .transpose()?
        .unwrap_or_default();

    let mut hello = hello(scenario, notes, top, base_ns);
    if timeline.is_none() {
        // Raw facts: everything but the scenario is a label.
        for (key, val) in top
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "scenario" | "notes"))
        {
            hello.labels.insert(key.clone(), torch::json_text(val));
        }
        if let Some(pid) = top
            .get("self_pid")
            .and_then(torch::json_i64)
            .and_then(|p| u32::try_from(p).ok())
        {
            hello.pid = pid;
        }
    }
    let mut builder = Builder {
        base_ns,
        pid: hello.pid,
        items: Vec::new(),
    };
    let model = load_model(notes);
    let mut in_load = false;
    let mut last: Option<(f64, pb::Sample)> = None;
    for entry in &entries {
        let sample = builder.sample(entry);
        let phase = sample.context.as_ref().map_or("", |c| c.phase.as_str());
        let now_load = phase.starts_with(LOAD_PHASE_PREFIX);
        if now_load != in_load {
            builder.phase(
                entry.t_s,
                now_load,
                &sample,
                model_for(&model, entry.context),
                "",
            );
            in_load = now_load;
        }
        builder.push(entry.t_s, CaptureItem::Sample(sample.clone()));
        last = Some((entry.t_s, sample));
    }
    let last_t = last.as_ref().map_or(0.0, |(t, _)| *t);

    let oom = optional_object(top, "oom", origin)?; // vocab: the capture's key
    let error = optional_object(top, "error", origin)?;
    let mut failure_t = None;
    if oom.is_some() || error.is_some() {
        let t = match oom.and_then(|o| o.get("t_s")) {
            None | Some(Value::Null) => last_t,
            Some(t) => seconds(t).ok_or_else(|| {
                anyhow::anyhow!("{origin}: \"oom.t_s\" is not a number of seconds")
            })?,
        };
        let observer = oom
            .and_then(|o| o.get("observer"))
            .and_then(torch::oom_observer);
        let device = observer
            .as_ref()
            .and_then(|o| i32::try_from(o.device).ok())
            .unwrap_or(0);
        let text = |k: &str| {
            error
                .and_then(|e| e.get(k))
                .map(torch::json_text)
                .unwrap_or_default()
        };
        let snapshot = oom
            .and_then(|o| o.get("snapshot_at_oom"))
            .filter(|s| !s.is_null())
            .map(|s| torch::snapshot_summary(s, device));
        let (stats, mut context) = match &last {
            Some((_, s)) => (s.allocator.first().cloned(), s.context.clone()),
            None => (None, None),
        };
        if let Some(at) = notes.get("failed_at").and_then(Value::as_object) {
            context = Some(failed_at_context(context.unwrap_or_default(), at));
        }
        let body = torch::oom_event(
            observer,
            &text("type"),
            &text("message"),
            stats,
            snapshot,
            context,
        );
        builder.event(t, pb::event::Kind::Oom(body));
        if in_load {
            // The load never finished: close it with the error.
            if let Some((_, sample)) = &last {
                builder.phase(t, false, sample, model.clone(), &text("message"));
            }
        }
        failure_t = Some(t);
    }

    if let Some(procs) = notes.get("nvml_procs_at_failure") {
        match gpu_processes(procs, 0) {
            Some(gpu) => builder.event(
                failure_t.unwrap_or(last_t),
                pb::event::Kind::ProcessList(pb::ProcessList {
                    host_top_rss: Vec::new(),
                    gpu,
                }),
            ),
            None => {
                hello
                    .labels
                    .insert("nvml_procs_at_failure".into(), torch::json_text(procs));
            }
        }
    }

    // `final`: the allocator after the scenario ended (after the OOM, after
    // gc or empty_cache), as one last sample marked with phase "final".
    let end = builder.items.iter().map(|(t, _)| *t).fold(last_t, f64::max);
    if let Some(fin) = optional_object(top, "final", origin)? {
        if let Some(memory_stats) = fin.get("memory_stats").and_then(Value::as_object) {
            let entry = Entry {
                t_s: end,
                step: entries.last().map_or(0, |e| e.step + 1),
                context: None,
                memory_stats,
                mem_get_info: fin.get("mem_get_info"),
                host: None,
            };
            let mut sample = builder.sample(&entry);
            sample.context = Some(pb::RequestContext {
                phase: FINAL_PHASE.into(),
                ..Default::default()
            });
            builder.push(end, CaptureItem::Sample(sample));
        }
    }

    if let Some(snapshot) = top.get("final_snapshot").filter(|s| !s.is_null()) {
        builder.event(
            end,
            pb::event::Kind::Snapshot(torch::snapshot_summary(snapshot, 0)),
        );
    }

    let mut items = builder.items;
    // Stable: items at the same instant keep the order they were made in.
    items.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(Capture {
        scenario: scenario.to_string(),
        hello,
        items,
        has_timeline: timeline.is_some(),
    })
}

/// The request context at the failure: the last sample's, with the counts
/// the capture noted at the failure (`notes.failed_at`: active sequences or
/// batch, active and prompt tokens), which a live agent's context would hold.
fn failed_at_context(mut ctx: pb::RequestContext, at: &Map<String, Value>) -> pb::RequestContext {
    let count = |k: &str| {
        at.get(k)
            .and_then(torch::json_i64)
            .and_then(|v| u64::try_from(v).ok())
    };
    if let Some(n) = count("active_sequences").or_else(|| count("batch")) {
        ctx.active_sequences = n;
    }
    if let Some(n) = count("active_tokens") {
        ctx.active_tokens = n;
    }
    if let Some(n) = count("prompt_tokens") {
        ctx.prompt_tokens = n;
    }
    ctx
}

/// A timeline entry after its shape was checked.
struct Entry<'a> {
    t_s: f64,
    step: u64,
    context: Option<&'a Map<String, Value>>,
    memory_stats: &'a Map<String, Value>,
    mem_get_info: Option<&'a Value>,
    host: Option<&'a Map<String, Value>>,
}

fn check_entries<'a>(timeline: &'a [Value], origin: &str) -> Result<Vec<Entry<'a>>> {
    let mut entries = Vec::with_capacity(timeline.len());
    for (i, v) in timeline.iter().enumerate() {
        let Some(e) = v.as_object() else {
            bail!("{origin}: timeline[{i}] is {}, not an object", kind(v));
        };
        let Some(t_s) = e.get("t_s").and_then(seconds) else {
            bail!("{origin}: timeline[{i}].t_s is missing or not a number of seconds");
        };
        let Some(memory_stats) = e.get("memory_stats").and_then(Value::as_object) else {
            bail!("{origin}: timeline[{i}].memory_stats is missing or not an object");
        };
        let object = |key: &str| -> Result<Option<&'a Map<String, Value>>> {
            match e.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Object(m)) => Ok(Some(m)),
                Some(other) => bail!(
                    "{origin}: timeline[{i}].{key} is {}, not an object",
                    kind(other)
                ),
            }
        };
        let context = object("context")?;
        let host = object("host")?;
        let mem_get_info = object("mem_get_info")?.map(|_| &e["mem_get_info"]);
        let step = e
            .get("step")
            .and_then(torch::json_i64)
            .and_then(|s| u64::try_from(s).ok())
            .unwrap_or(i as u64);
        entries.push(Entry {
            t_s,
            step,
            context,
            memory_stats,
            mem_get_info,
            host,
        });
    }
    Ok(entries)
}

struct Builder {
    base_ns: i64,
    pid: u32,
    items: Vec<(f64, CaptureItem)>,
}

impl Builder {
    fn sample(&self, e: &Entry) -> pb::Sample {
        let process = e.host.map(|h| {
            let get = |k: &str| {
                h.get(k)
                    .and_then(torch::json_i64)
                    .and_then(|v| u64::try_from(v).ok())
                    .unwrap_or(0)
            };
            pb::ProcessMemory {
                pid: self.pid,
                vm_rss_bytes: get("vmrss"),
                vm_hwm_bytes: get("vmhwm"),
                vm_size_bytes: get("vmsize"),
                ..Default::default()
            }
        });
        pb::Sample {
            time_ns: time_ns(self.base_ns, e.t_s),
            process,
            allocator: vec![torch::allocator_stats_from_json(
                0,
                e.memory_stats,
                e.mem_get_info,
            )],
            context: e.context.map(torch::request_context),
            t_s: e.t_s,
            step: e.step,
            ..Default::default()
        }
    }

    fn push(&mut self, t_s: f64, item: CaptureItem) {
        self.items.push((t_s, item));
    }

    fn event(&mut self, t_s: f64, kind: pb::event::Kind) {
        let event = pb::Event {
            time_ns: time_ns(self.base_ns, t_s),
            kind: Some(kind),
        };
        self.push(t_s, CaptureItem::Event(event));
    }

    /// A load edge, with the device and host memory of the sample at it.
    fn phase(
        &mut self,
        t_s: f64,
        start: bool,
        at: &pb::Sample,
        model: Option<pb::Model>,
        error: &str,
    ) {
        let phase = pb::Phase {
            name: LOAD_PHASE.to_string(),
            start,
            model,
            allocated_bytes: at.allocator.first().map_or(0, |a| a.allocated_bytes),
            host_rss_bytes: at.process.as_ref().map_or(0, |p| p.vm_rss_bytes),
            error: error.to_string(),
        };
        self.event(t_s, pb::event::Kind::Phase(phase));
    }
}

/// The Hello of a capture: identity from the scenario, versions, GPU and
/// allocator settings from the notes, every other note as a label.
fn hello(
    scenario: &str,
    notes: &Map<String, Value>,
    top: &Map<String, Value>,
    base_ns: i64,
) -> pb::Hello {
    let text = |k: &str| notes.get(k).and_then(Value::as_str).map(str::to_string);
    let bytes = |k: &str| {
        notes
            .get(k)
            .and_then(torch::json_i64)
            .and_then(|v| u64::try_from(v).ok())
    };
    let mut hello = pb::Hello {
        agent_id: agent_id(scenario),
        name: scenario.to_string(),
        start_time_ns: base_ns,
        role: Role::Replay.into(),
        runtime: "replay".into(), // vocab: the runtime's name
        pid: notes
            .get("self_pid")
            .and_then(torch::json_i64)
            .and_then(|p| u32::try_from(p).ok())
            .unwrap_or(0),
        ..Default::default()
    };
    hello
        .versions
        .insert("oomscope".into(), env!("CARGO_PKG_VERSION").into());
    for key in ["torch", "cuda"] {
        if let Some(v) = text(key) {
            hello.versions.insert(key.into(), v);
        }
    }
    if notes.contains_key("device_name") || notes.contains_key("total_memory") {
        hello.gpus.push(pb::GpuPlacement {
            index: 0,
            name: text("device_name").unwrap_or_default(),
            total_bytes: bytes("total_memory").unwrap_or(0),
            cap_bytes: bytes("cap_bytes").unwrap_or(0),
            ..Default::default()
        });
    }
    let from_snapshot = top
        .get("final_snapshot")
        .and_then(|s| s.get("allocator_settings"))
        .filter(|s| s.is_object())
        .map(torch::allocator_settings);
    hello.allocator_settings = match (from_snapshot, text("alloc_conf")) {
        (Some(mut s), Some(conf)) => {
            if s.alloc_conf.is_empty() {
                s.alloc_conf = conf;
            }
            Some(s)
        }
        (Some(s), None) => Some(s),
        (None, Some(conf)) => Some(torch::alloc_conf_settings(&conf)),
        (None, None) => None,
    };
    if let Some(model) = load_model(notes) {
        hello.models.push(model);
    }
    const USED: [&str; 7] = [
        "torch",
        "cuda",
        "device_name",
        "total_memory",
        "cap_bytes",
        "alloc_conf",
        "nvml_procs_at_failure",
    ];
    for (key, val) in notes.iter().filter(|(k, _)| !USED.contains(&k.as_str())) {
        hello.labels.insert(key.clone(), torch::json_text(val));
    }
    hello
}

/// The model a capture describes in `notes.model` (its config), if any.
fn load_model(notes: &Map<String, Value>) -> Option<pb::Model> {
    let m = notes.get("model")?.as_object()?;
    Some(pb::Model {
        name: m
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        dtype: m
            .get("dtype")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        ..Default::default()
    })
}

/// The notes' model, named and sized by the context where the context says
/// (`model`, `model_bytes`).
fn model_for(base: &Option<pb::Model>, ctx: Option<&Map<String, Value>>) -> Option<pb::Model> {
    let name = ctx.and_then(|c| c.get("model")).and_then(Value::as_str);
    let bytes = ctx
        .and_then(|c| c.get("model_bytes"))
        .and_then(torch::json_i64)
        .and_then(|b| u64::try_from(b).ok());
    if base.is_none() && name.is_none() && bytes.is_none() {
        return None;
    }
    let mut model = base.clone().unwrap_or_default();
    if let Some(name) = name {
        model.name = name.to_string();
    }
    if let Some(bytes) = bytes {
        model.bytes = bytes;
    }
    Some(model)
}

/// GPU processes from an NVML process list, as JSON (`[{"pid": 1,
/// "usedGpuMemory": 2}]`) or as the Python repr text a capture may hold
/// (`"[{'pid': 1, 'usedGpuMemory': 2}]"`, or pynvml's
/// `c_nvmlProcessInfo_t(pid: 1, usedGpuMemory: 2 B)`). None when it cannot be
/// read in full: a half-read list would hide a process.
pub fn gpu_processes(v: &Value, device: i32) -> Option<Vec<pb::GpuProcess>> {
    let records: Vec<Vec<(String, String)>> = match v {
        Value::Array(list) => list
            .iter()
            .map(|r| {
                r.as_object().map(|m| {
                    m.iter()
                        .map(|(k, v)| (k.clone(), torch::json_text(v)))
                        .collect()
                })
            })
            .collect::<Option<_>>()?,
        Value::String(text) => repr_records(text)?,
        _ => return None,
    };
    records
        .iter()
        .map(|fields| {
            let get = |names: &[&str]| {
                fields
                    .iter()
                    .find(|(k, _)| names.contains(&k.as_str()))
                    .map(|(_, v)| v.as_str())
            };
            let pid = get(&["pid"])?.parse::<u32>().ok()?;
            let used_bytes = match get(&[
                "usedGpuMemory",
                "used_gpu_memory",
                "used_memory",
                "usedMemory",
            ]) {
                // NVML reports None where it cannot see the usage (no permission).
                None | Some("None") | Some("null") => None,
                Some(v) => Some(v.trim_end_matches(" B").trim().parse::<u64>().ok()?),
            };
            Some(pb::GpuProcess {
                device,
                pid,
                used_bytes,
                ..Default::default()
            })
        })
        .collect()
}

/// The records of a Python repr list: each `{...}` or `Name(...)` holds
/// `key: value` pairs; quotes around keys and text values are dropped.
fn repr_records(text: &str) -> Option<Vec<Vec<(String, String)>>> {
    let body = text.trim().strip_prefix('[')?.strip_suffix(']')?;
    let mut records = Vec::new();
    let mut rest = body;
    while let Some(open) = rest.find(['{', '(']) {
        // A record's own name (pynvml's `c_nvmlProcessInfo_t`) may precede it;
        // anything else between records is a shape we do not know.
        let before = rest[..open].trim().trim_start_matches(',').trim();
        let is_dict = rest.as_bytes()[open] == b'{';
        let named = before
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_');
        if (is_dict && !before.is_empty()) || !named {
            return None;
        }
        let close_char = if is_dict { '}' } else { ')' };
        let close = open + rest[open..].find(close_char)?;
        let inner = &rest[open + 1..close];
        let fields = inner
            .split(',')
            .map(str::trim)
            .filter(|f| !f.is_empty())
            .map(|f| {
                let (k, v) = f.split_once(':')?;
                let unquote =
                    |s: &str| s.trim().trim_matches(|c| c == '\'' || c == '"').to_string();
                Some((unquote(k), unquote(v)))
            })
            .collect::<Option<Vec<_>>>()?;
        records.push(fields);
        rest = &rest[close + 1..];
    }
    // Anything but separators between records means a shape we do not know.
    if !rest.trim().trim_matches(',').trim().is_empty() {
        return None;
    }
    Some(records)
}

fn optional_object<'a>(
    top: &'a Map<String, Value>,
    key: &str,
    origin: &str,
) -> Result<Option<&'a Map<String, Value>>> {
    match top.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(m)) => Ok(Some(m)),
        Some(other) => bail!(
            "{origin}: \"{key}\" is {}, not an object or null",
            kind(other)
        ),
    }
}

fn seconds(v: &Value) -> Option<f64> {
    v.as_f64().filter(|t| t.is_finite())
}

fn time_ns(base_ns: i64, t_s: f64) -> i64 {
    // `as` saturates, so an absurd t_s cannot overflow.
    base_ns.saturating_add((t_s * 1e9).round() as i64)
}

fn agent_id(name: &str) -> String {
    format!("replay-{name}")
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
