//! The shapes of PyTorch's CUDA caching allocator, as oomscope sends them.
//!
//! The PyTorch agent (the pyo3 extension) and `oomscope replay` both call these
//! functions with the dicts PyTorch hands out (`torch.cuda.memory_stats()`,
//! `torch.cuda.memory._snapshot()`, the OOM observer's arguments, the request
//! context), so a replayed capture and a live server send the same messages.
//!
//! Every function here takes whatever it is given: missing keys, wrong types
//! and odd numbers give zero or an absent field, never a panic.

use std::collections::{BTreeMap, HashMap};

use serde_json::{Map, Value};

use crate::pb;

/// `SnapshotSummary.segments_free` keeps at most this many segments, those
/// with the largest free block first: enough to show fragmentation, small
/// enough for one message even with tens of thousands of segments.
pub const MAX_SEGMENTS_FREE: usize = 64;

/// `live_by_site` and `live_by_tag` keep at most this many entries (largest
/// first); the rest are folded into one [`OTHER_SITES`] entry so the list
/// still sums to the live bytes.
pub const MAX_SITES: usize = 32;

/// The entry that holds the live bytes of the sites beyond [`MAX_SITES`].
pub const OTHER_SITES: &str = "(other sites)";

/// The site of a live block recorded without a stack (history was off).
pub const NO_STACK: &str = "(no stack)";

/// The CUDA driver's CUDA_ERROR_OUT_OF_MEMORY (the runtime's
/// cudaErrorMemoryAllocation has the same value).
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;

/// A JSON number as an i64 when it is an integer: integral floats within
/// range count, fractions, NaN, text and booleans do not.
pub fn json_i64(v: &Value) -> Option<i64> {
    let n = v.as_number()?;
    if let Some(i) = n.as_i64() {
        return Some(i);
    }
    if n.is_u64() {
        return None; // above i64::MAX
    }
    let f = n.as_f64()?;
    // -2^63 is exact in f64; 2^63 is the first value out of range.
    const LIMIT: f64 = 9_223_372_036_854_775_808.0;
    (f.is_finite() && f.fract() == 0.0 && (-LIMIT..LIMIT).contains(&f)).then_some(f as i64)
}

/// A JSON value as a byte count: integers and integral floats >= 0.
fn json_u64(v: &Value) -> Option<u64> {
    json_i64(v)
        .and_then(|i| u64::try_from(i).ok())
        .or_else(|| v.as_u64())
}

fn field_u64(m: &Map<String, Value>, key: &str) -> u64 {
    m.get(key).and_then(json_u64).unwrap_or(0)
}

/// A value as text for a label: strings verbatim, anything else as JSON.
pub fn json_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The integer entries of a `memory_stats()` dict; entries that are not
/// integers are skipped.
pub fn stats_map(memory_stats: &Map<String, Value>) -> BTreeMap<String, i64> {
    memory_stats
        .iter()
        .filter_map(|(k, v)| json_i64(v).map(|i| (k.clone(), i)))
        .collect()
}

/// `torch.cuda.memory_stats(device)` (and `torch.cuda.mem_get_info()` as
/// `(free, total)`) as an [`pb::AllocatorStats`]. Every key also goes into
/// `raw` verbatim, so nothing PyTorch reports is lost.
pub fn allocator_stats(
    device: i32,
    memory_stats: &BTreeMap<String, i64>,
    mem_get_info: Option<(u64, u64)>,
) -> pb::AllocatorStats {
    // Negative counters do not exist in PyTorch; treat one as absent.
    let get = |key: &str| {
        memory_stats
            .get(key)
            .map_or(0, |v| u64::try_from(*v).unwrap_or(0))
    };
    let (driver_free_bytes, driver_total_bytes) = mem_get_info.unwrap_or((0, 0));
    pb::AllocatorStats {
        device,
        allocated_bytes: get("allocated_bytes.all.current"),
        allocated_peak_bytes: get("allocated_bytes.all.peak"),
        reserved_bytes: get("reserved_bytes.all.current"),
        reserved_peak_bytes: get("reserved_bytes.all.peak"),
        active_bytes: get("active_bytes.all.current"),
        active_peak_bytes: get("active_bytes.all.peak"),
        inactive_split_bytes: get("inactive_split_bytes.all.current"),
        inactive_split_peak_bytes: get("inactive_split_bytes.all.peak"),
        requested_bytes: get("requested_bytes.all.current"),
        requested_peak_bytes: get("requested_bytes.all.peak"),
        num_alloc_retries: get("num_alloc_retries"),
        num_ooms: get("num_ooms"),
        num_device_alloc: get("num_device_alloc"),
        num_device_free: get("num_device_free"),
        segments: get("segment.all.current"),
        segments_peak: get("segment.all.peak"),
        allocations: get("allocation.all.current"),
        inactive_split_blocks: get("inactive_split.all.current"),
        driver_free_bytes,
        driver_total_bytes,
        raw: memory_stats.iter().map(|(k, v)| (k.clone(), *v)).collect(),
        raw_changes: None,
        device_uuid: String::new(),
        pci_bus_id: String::new(),
    }
}

/// [`allocator_stats`] for a `memory_stats()` dict read as JSON, with
/// `mem_get_info` as `{"free", "total"}` when known.
pub fn allocator_stats_from_json(
    device: i32,
    memory_stats: &Map<String, Value>,
    mem_get_info: Option<&Value>,
) -> pb::AllocatorStats {
    let info = mem_get_info.and_then(Value::as_object).and_then(|m| {
        Some((
            m.get("free").and_then(json_u64)?,
            m.get("total").and_then(json_u64)?,
        ))
    });
    allocator_stats(device, &stats_map(memory_stats), info)
}

/// The allocator's configuration from a snapshot's `allocator_settings`
/// dict. Keys without a field go into `other` as text. Where the dict lacks
/// a setting that its `PYTORCH_CUDA_ALLOC_CONF` string names, the string's
/// value is used. `max_split_size_bytes` is PyTorch's own number: -1 means no
/// limit, 0 that it is not known.
pub fn allocator_settings(v: &Value) -> pb::AllocatorSettings {
    let mut s = pb::AllocatorSettings::default();
    let Some(m) = v.as_object() else { return s };
    let (mut has_expandable, mut has_split, mut has_gc, mut has_backend) =
        (false, false, false, false);
    for (key, val) in m {
        match key.as_str() {
            "PYTORCH_CUDA_ALLOC_CONF" | "alloc_conf" => s.alloc_conf = json_text(val),
            "expandable_segments" if json_bool(val).is_some() => {
                s.expandable_segments = json_bool(val).unwrap_or(false);
                has_expandable = true;
            }
            "max_split_size" if json_i64(val).is_some() => {
                s.max_split_size_bytes = json_i64(val).unwrap_or(0);
                has_split = true;
            }
            "garbage_collection_threshold" if val.as_f64().is_some() => {
                s.garbage_collection_threshold = val.as_f64().unwrap_or(0.0);
                has_gc = true;
            }
            "backend" => {
                s.backend = json_text(val);
                has_backend = true;
            }
            _ => {
                s.other.insert(key.clone(), json_text(val));
            }
        }
    }
    let conf = alloc_conf_settings(&s.alloc_conf);
    if !has_expandable {
        s.expandable_segments = conf.expandable_segments;
    }
    if !has_split {
        s.max_split_size_bytes = conf.max_split_size_bytes;
    }
    if !has_gc {
        s.garbage_collection_threshold = conf.garbage_collection_threshold;
    }
    if !has_backend {
        s.backend = conf.backend;
    }
    for (key, value) in conf.other {
        s.other.entry(key).or_insert(value);
    }
    s
}

/// The settings a `PYTORCH_CUDA_ALLOC_CONF` string names, e.g.
/// `"expandable_segments:True,max_split_size_mb:128"`. Unknown options go into
/// `other`; malformed ones are kept there verbatim.
pub fn alloc_conf_settings(conf: &str) -> pb::AllocatorSettings {
    let mut s = pb::AllocatorSettings {
        alloc_conf: conf.to_string(),
        ..Default::default()
    };
    for option in conf.split(',').map(str::trim).filter(|o| !o.is_empty()) {
        let (key, value) = option.split_once(':').unwrap_or((option, ""));
        let (key, value) = (key.trim(), value.trim());
        match key {
            "expandable_segments" => s.expandable_segments = value.eq_ignore_ascii_case("true"),
            "max_split_size_mb" => match value.parse::<i64>() {
                Ok(mb) => s.max_split_size_bytes = mb.saturating_mul(1 << 20),
                Err(_) => {
                    s.other.insert(key.to_string(), value.to_string());
                }
            },
            "garbage_collection_threshold" => match value.parse::<f64>() {
                Ok(t) => s.garbage_collection_threshold = t,
                Err(_) => {
                    s.other.insert(key.to_string(), value.to_string());
                }
            },
            "backend" => s.backend = value.to_string(),
            _ => {
                s.other.insert(key.to_string(), value.to_string());
            }
        }
    }
    s
}

fn json_bool(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::String(t) if t.eq_ignore_ascii_case("true") => Some(true),
        Value::String(t) if t.eq_ignore_ascii_case("false") => Some(false),
        Value::Number(_) => json_i64(v).map(|i| i != 0),
        _ => None,
    }
}

/// A digest of `torch.cuda.memory._snapshot()` (or the older list of
/// segments of `torch.cuda.memory_snapshot()`) for one device: segments and
/// reserved bytes, blocks by state, the largest free (`inactive`) block per
/// segment and overall, live bytes by allocation site and by tag, the trace
/// actions and the allocator settings. Segments of private pools (CUDA
/// graphs, `MemPool`) count in the reserved and allocated bytes and, apart,
/// in `private_pool_reserved_bytes`/`private_pool_free_bytes`; the overall
/// largest free block is the general pool's, the one a failed request could
/// have taken.
///
/// `segments_free` lists at most [`MAX_SEGMENTS_FREE`] segments that have
/// free space, largest free block first. `live_by_site` names the innermost
/// frame outside PyTorch itself as `"file:line func"` (paths shortened after
/// `site-packages/`); both site and tag lists are capped at [`MAX_SITES`].
pub fn snapshot_summary(snapshot: &Value, device: i32) -> pb::SnapshotSummary {
    let (segments, traces, settings) = match snapshot {
        Value::Object(m) => (
            m.get("segments").and_then(Value::as_array),
            m.get("device_traces").and_then(Value::as_array),
            m.get("allocator_settings"),
        ),
        Value::Array(list) => (Some(list), None, None),
        _ => (None, None, None),
    };
    let trace = usize::try_from(device)
        .ok()
        .and_then(|d| traces?.get(d))
        .and_then(Value::as_array);

    let mut summary = pb::SnapshotSummary {
        device,
        ..Default::default()
    };
    if let Some(settings) = settings {
        summary.settings = Some(allocator_settings(settings));
    }
    let tag_by_address = trace.map(|t| alloc_tags(t)).unwrap_or_default();
    let mut by_state: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut sites: HashMap<String, (u64, u64)> = HashMap::new();
    let mut tags: HashMap<String, (u64, u64)> = HashMap::new();
    let mut segments_free = Vec::new();
    let mut expandable = false;

    for seg in segments.into_iter().flatten().filter_map(Value::as_object) {
        if let Some(d) = seg.get("device").and_then(json_i64) {
            if d != i64::from(device) {
                continue;
            }
        }
        summary.segments += 1;
        let total = field_u64(seg, "total_size");
        summary.reserved_bytes = summary.reserved_bytes.saturating_add(total);
        expandable |= seg
            .get("is_expandable")
            .and_then(json_bool)
            .unwrap_or(false);

        let (mut allocated, mut requested, mut largest_free) = (0u64, 0u64, 0u64);
        match seg.get("blocks").and_then(Value::as_array) {
            Some(blocks) => {
                for block in blocks.iter().filter_map(Value::as_object) {
                    let state = block
                        .get("state")
                        .and_then(Value::as_str)
                        .unwrap_or("unknown"); // vocab: a block state
                    let size = field_u64(block, "size");
                    let entry = by_state.entry(state.to_string()).or_default();
                    entry.0 += 1;
                    entry.1 = entry.1.saturating_add(size);
                    match state {
                        "active_allocated" => {
                            allocated = allocated.saturating_add(size);
                            requested =
                                requested.saturating_add(field_u64(block, "requested_size"));
                            add_site(&mut sites, block_site(block), size);
                            let address = field_u64(block, "address");
                            if let Some(tag) =
                                block_tag(block).or_else(|| tag_by_address.get(&address).cloned())
                            {
                                add_site(&mut tags, tag, size);
                            }
                        }
                        "inactive" => largest_free = largest_free.max(size),
                        _ => {}
                    }
                }
            }
            // A segment listed without its blocks still says how much of it is used.
            None => {
                allocated = field_u64(seg, "allocated_size");
                requested = field_u64(seg, "requested_size");
            }
        }
        summary.allocated_bytes = summary.allocated_bytes.saturating_add(allocated);
        summary.requested_bytes = summary.requested_bytes.saturating_add(requested);
        let private_pool = in_private_pool(seg);
        if private_pool {
            summary.private_pool_reserved_bytes =
                summary.private_pool_reserved_bytes.saturating_add(total);
            summary.private_pool_free_bytes = summary
                .private_pool_free_bytes
                .saturating_add(total.saturating_sub(allocated));
        } else {
            // A private pool's free block serves only its owner (a graph's
            // replay, a MemPool's scope), never the request that failed.
            summary.largest_free_block_bytes = summary.largest_free_block_bytes.max(largest_free);
        }
        if total > allocated || largest_free > 0 {
            segments_free.push(pb::SegmentFree {
                address: field_u64(seg, "address"),
                total_bytes: total,
                allocated_bytes: allocated,
                largest_free_block_bytes: largest_free,
                pool: seg.get("segment_type").map(json_text).unwrap_or_default(),
                private_pool,
            });
        }
    }

    segments_free.sort_by(|a, b| {
        b.largest_free_block_bytes
            .cmp(&a.largest_free_block_bytes)
            .then(
                (b.total_bytes - b.allocated_bytes.min(b.total_bytes))
                    .cmp(&(a.total_bytes - a.allocated_bytes.min(a.total_bytes))),
            )
            .then(a.address.cmp(&b.address))
    });
    segments_free.truncate(MAX_SEGMENTS_FREE);
    summary.segments_free = segments_free;
    summary.blocks = by_state
        .into_iter()
        .map(|(state, (count, bytes))| pb::BlockStateCount {
            state,
            count,
            bytes,
        })
        .collect();
    summary.live_by_site = top_sites(sites);
    summary.live_by_tag = top_sites(tags);
    summary.expandable_segments = expandable
        || summary
            .settings
            .as_ref()
            .is_some_and(|s| s.expandable_segments);
    for action in trace
        .into_iter()
        .flatten()
        .filter_map(|e| e.get("action")?.as_str())
    {
        *summary.trace_actions.entry(action.to_string()).or_default() += 1;
    }
    summary
}

/// The segment belongs to a private pool (a CUDA graph's, a
/// `torch.cuda.MemPool`): its `segment_pool_id` is a pair other than
/// (0, 0), the general pool's. A segment without the key (older PyTorch)
/// is taken as the general pool's.
fn in_private_pool(seg: &Map<String, Value>) -> bool {
    seg.get("segment_pool_id")
        .and_then(Value::as_array)
        .is_some_and(|id| id.iter().any(|part| json_u64(part).is_some_and(|n| n != 0)))
}

/// Counts one block of `bytes` at `site` (or tag) for [`top_sites`].
pub fn add_site(map: &mut HashMap<String, (u64, u64)>, site: String, bytes: u64) {
    let entry = map.entry(site).or_default();
    entry.0 = entry.0.saturating_add(bytes);
    entry.1 += 1;
}

/// Largest first, at most [`MAX_SITES`] entries: past that, the rest fold
/// into one [`OTHER_SITES`] entry, so the list still sums to the live bytes.
/// The PyTorch digest and agent-cuda's pool share it.
pub fn top_sites(map: HashMap<String, (u64, u64)>) -> Vec<pb::SiteBytes> {
    let mut list: Vec<pb::SiteBytes> = map
        .into_iter()
        .map(|(site, (bytes, blocks))| pb::SiteBytes {
            site,
            bytes,
            blocks,
        })
        .collect();
    list.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.site.cmp(&b.site)));
    if list.len() > MAX_SITES {
        let rest = list.split_off(MAX_SITES - 1);
        list.push(pb::SiteBytes {
            site: OTHER_SITES.to_string(),
            bytes: rest.iter().fold(0u64, |s, r| s.saturating_add(r.bytes)),
            blocks: rest.iter().map(|r| r.blocks).sum(),
        });
    }
    list
}

/// Where a block was allocated: the innermost frame outside PyTorch's own
/// code (the model line, not `torch/nn/modules/module.py`), else the
/// innermost frame.
fn block_site(block: &Map<String, Value>) -> String {
    let frames: Vec<&Map<String, Value>> = block
        .get("frames")
        .and_then(Value::as_array)
        .map(|f| f.iter().filter_map(Value::as_object).collect())
        .unwrap_or_default();
    let filename = |f: &Map<String, Value>| {
        f.get("filename")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let chosen = frames
        .iter()
        .find(|f| !is_torch_internal(&filename(f)))
        .or_else(|| frames.first());
    match chosen {
        None => NO_STACK.to_string(),
        Some(f) => {
            let file = filename(f);
            let file = ["site-packages/", "dist-packages/"]
                .iter()
                .find_map(|p| file.rfind(p).map(|i| file[i + p.len()..].to_string()))
                .unwrap_or(file);
            let line = f.get("line").and_then(json_i64).unwrap_or(0);
            let name = f.get("name").and_then(Value::as_str).unwrap_or("?");
            format!("{file}:{line} {name}")
        }
    }
}

fn is_torch_internal(filename: &str) -> bool {
    filename.contains("/torch/") || filename.starts_with("torch/") || filename.is_empty()
}

/// A tag a block carries itself (`tag`, or the `user_metadata` PyTorch
/// attaches with `torch.cuda.memory._set_memory_metadata`).
fn block_tag(block: &Map<String, Value>) -> Option<String> {
    ["tag", "user_metadata"]
        .iter()
        .filter_map(|k| block.get(*k).and_then(Value::as_str))
        .find(|t| !t.is_empty())
        .map(str::to_string)
}

/// The `user_metadata` of the last `alloc` at each address in a device trace:
/// PyTorch keeps the tag in the trace, not in the block.
fn alloc_tags(trace: &[Value]) -> HashMap<u64, String> {
    let mut tags = HashMap::new();
    for entry in trace.iter().filter_map(Value::as_object) {
        if entry.get("action").and_then(Value::as_str) != Some("alloc") {
            continue;
        }
        let Some(address) = entry.get("addr").and_then(json_u64) else {
            continue;
        };
        match entry
            .get("user_metadata")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
        {
            Some(tag) => tags.insert(address, tag.to_string()),
            None => tags.remove(&address),
        };
    }
    tags
}

/// The OOM observer's four arguments `(device, alloc, device_allocated,
/// device_free)` from a JSON object with those names.
pub fn oom_observer(v: &Value) -> Option<pb::OomObserver> {
    let m = v.as_object()?;
    let get = |k: &str| m.get(k).and_then(json_i64).unwrap_or(0);
    Some(pb::OomObserver {
        device: get("device"),
        alloc: get("alloc"),
        device_allocated: get("device_allocated"),
        device_free: get("device_free"),
    })
}

/// An [`pb::Oom`] event body. The requested size is the observer's `alloc`;
/// without an observer it is read from the text ("Tried to allocate 96.00
/// MiB"). `driver_error` is 2 when the text names the driver's out-of-memory
/// error.
pub fn oom_event(
    observer: Option<pb::OomObserver>,
    error_type: &str,
    error_text: &str,
    stats: Option<pb::AllocatorStats>,
    snapshot: Option<pb::SnapshotSummary>,
    context: Option<pb::RequestContext>,
) -> pb::Oom {
    let requested_bytes = observer
        .as_ref()
        .and_then(|o| u64::try_from(o.alloc).ok())
        .filter(|b| *b > 0)
        .or_else(|| tried_to_allocate(error_text))
        .unwrap_or(0);
    let device = observer
        .as_ref()
        .and_then(|o| i32::try_from(o.device).ok())
        .or_else(|| stats.as_ref().map(|s| s.device))
        .or_else(|| snapshot.as_ref().map(|s| s.device))
        .unwrap_or(0);
    pb::Oom {
        device,
        requested_bytes,
        observer,
        error_type: error_type.to_string(),
        error_text: error_text.to_string(),
        stats,
        snapshot,
        context,
        driver_error: driver_error(error_text),
        device_uuid: String::new(),
    }
}

/// 2 when the text names CUDA's out-of-memory error code, else 0. The
/// caching allocator's own "CUDA out of memory. Tried to allocate" is not a
/// driver error.
pub fn driver_error(text: &str) -> i32 {
    const MARKERS: [&str; 3] = [
        "CUDA_ERROR_OUT_OF_MEMORY",
        "cudaErrorMemoryAllocation",
        "CUDA error: out of memory",
    ];
    if MARKERS.iter().any(|m| text.contains(m)) {
        CUDA_ERROR_OUT_OF_MEMORY
    } else {
        0
    }
}

/// The size in PyTorch's "Tried to allocate 96.00 MiB" as bytes (rounded:
/// the text has two decimals). Under `backend:cudaMallocAsync` PyTorch
/// words it differently (c10/cuda/CUDAMallocAsyncAllocator.cpp): "Allocation
/// on device 0 would exceed allowed memory. (out of memory)\nCurrently
/// allocated     : 9.43 GiB\nRequested               : 640.00 MiB\n...".
pub fn tried_to_allocate(text: &str) -> Option<u64> {
    const MARK: &str = "Tried to allocate ";
    let rest = match text.find(MARK) {
        Some(i) => &text[i + MARK.len()..],
        None => async_requested(text)?,
    };
    let mut words = rest.split_whitespace();
    let number: f64 = words.next()?.parse().ok()?;
    let unit = words.next()?.trim_end_matches(['.', ';', ',']);
    let scale: f64 = match unit {
        "B" | "byte" | "bytes" => 1.0,
        "KiB" | "KB" => 1024.0,
        "MiB" | "MB" => 1024.0 * 1024.0,
        "GiB" | "GB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" | "TB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "PiB" | "PB" => 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    let bytes = (number * scale).round();
    (bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64).then_some(bytes as u64)
}

/// What follows "Requested               : " in cudaMallocAsync's message.
fn async_requested(text: &str) -> Option<&str> {
    const FORM: &str = "would exceed allowed memory";
    const FIELD: &str = "Requested";
    let body = &text[text.find(FORM)?..];
    let rest = &body[body.find(FIELD)? + FIELD.len()..];
    rest.trim_start().strip_prefix(':')
}

/// The request context a server reports (`oomscope.set_context(...)`, or a
/// capture's `context`). Known keys fill their fields (`kv_bytes` is
/// `kv_cache_bytes`); every other number goes into `numbers` and every other
/// value, as text, into `labels`. A known key with a value its field cannot
/// hold (a negative count, a text) goes there too, so no key is lost.
pub fn request_context(ctx: &Map<String, Value>) -> pb::RequestContext {
    let mut c = pb::RequestContext::default();
    for (key, val) in ctx {
        let text_slot = match key.as_str() {
            "phase" => Some(&mut c.phase),
            "request_id" => Some(&mut c.request_id),
            _ => None,
        };
        if let (Some(slot), Value::String(s)) = (text_slot, val) {
            *slot = s.clone();
            continue;
        }
        if let Some(slot) = count_slot(&mut c, key) {
            if let Some(n) = json_u64(val) {
                *slot = n;
                continue;
            }
        }
        match val.as_f64() {
            Some(n) if val.is_number() => {
                c.numbers.insert(key.clone(), n);
            }
            _ => {
                c.labels.insert(key.clone(), json_text(val));
            }
        }
    }
    c
}

fn count_slot<'a>(c: &'a mut pb::RequestContext, key: &str) -> Option<&'a mut u64> {
    Some(match key {
        "prompt_tokens" => &mut c.prompt_tokens,
        "output_tokens" => &mut c.output_tokens,
        "active_sequences" => &mut c.active_sequences,
        "active_tokens" => &mut c.active_tokens,
        "queued" => &mut c.queued,
        "batch_size" => &mut c.batch_size,
        "kv_bytes" | "kv_cache_bytes" => &mut c.kv_cache_bytes,
        "kv_cache_capacity_bytes" => &mut c.kv_cache_capacity_bytes,
        "requests_done" => &mut c.requests_done,
        "live_tensors" => &mut c.live_tensors,
        "live_tensor_bytes" => &mut c.live_tensor_bytes,
        "weight_bytes" => &mut c.weight_bytes,
        "loaded_bytes" => &mut c.loaded_bytes,
        _ => return None,
    })
}
