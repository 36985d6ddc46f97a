//! oomscope's messages as JSON, for Python: what `oomscope.snapshot()` and
//! `oomscope.census()` return, and what `oomscope.query` reads back from a
//! collector (every field the tests and tools look at, by its proto name).

use oomscope_agent_core::pb;
use serde_json::{json, Value};

pub fn allocator(a: &pb::AllocatorStats) -> Value {
    json!({
        "device": a.device, "allocated_bytes": a.allocated_bytes, "allocated_peak_bytes": a.allocated_peak_bytes,
        "reserved_bytes": a.reserved_bytes, "reserved_peak_bytes": a.reserved_peak_bytes,
        "active_bytes": a.active_bytes, "active_peak_bytes": a.active_peak_bytes,
        "inactive_split_bytes": a.inactive_split_bytes, "inactive_split_peak_bytes": a.inactive_split_peak_bytes,
        "requested_bytes": a.requested_bytes, "requested_peak_bytes": a.requested_peak_bytes,
        "num_alloc_retries": a.num_alloc_retries, "num_ooms": a.num_ooms,
        "num_device_alloc": a.num_device_alloc, "num_device_free": a.num_device_free,
        "segments": a.segments, "segments_peak": a.segments_peak, "allocations": a.allocations,
        "inactive_split_blocks": a.inactive_split_blocks,
        "driver_free_bytes": a.driver_free_bytes, "driver_total_bytes": a.driver_total_bytes,
        "raw": a.raw,
    })
}

pub fn context(c: &pb::RequestContext) -> Value {
    json!({
        "phase": c.phase, "request_id": c.request_id, "prompt_tokens": c.prompt_tokens,
        "output_tokens": c.output_tokens, "active_sequences": c.active_sequences,
        "active_tokens": c.active_tokens, "queued": c.queued, "batch_size": c.batch_size,
        "kv_cache_bytes": c.kv_cache_bytes, "kv_cache_capacity_bytes": c.kv_cache_capacity_bytes,
        "requests_done": c.requests_done, "live_tensors": c.live_tensors,
        "live_tensor_bytes": c.live_tensor_bytes, "weight_bytes": c.weight_bytes,
        "loaded_bytes": c.loaded_bytes, "numbers": c.numbers, "labels": c.labels,
    })
}

pub fn settings(s: &pb::AllocatorSettings) -> Value {
    json!({
        "backend": s.backend, "alloc_conf": s.alloc_conf, "expandable_segments": s.expandable_segments,
        "max_split_size_bytes": s.max_split_size_bytes,
        "garbage_collection_threshold": s.garbage_collection_threshold, "other": s.other,
    })
}

pub fn snapshot(s: &pb::SnapshotSummary) -> Value {
    let sites = |l: &[pb::SiteBytes]| -> Vec<Value> {
        l.iter()
            .map(|x| json!({"site": x.site, "bytes": x.bytes, "blocks": x.blocks}))
            .collect()
    };
    json!({
        "device": s.device, "segments": s.segments, "reserved_bytes": s.reserved_bytes,
        "allocated_bytes": s.allocated_bytes, "requested_bytes": s.requested_bytes,
        "blocks": s.blocks.iter().map(|b| json!({"state": b.state, "count": b.count, "bytes": b.bytes})).collect::<Vec<_>>(),
        "largest_free_block_bytes": s.largest_free_block_bytes,
        "segments_free": s.segments_free.iter().map(|f| json!({
            "address": f.address, "total_bytes": f.total_bytes, "allocated_bytes": f.allocated_bytes,
            "largest_free_block_bytes": f.largest_free_block_bytes, "pool": f.pool})).collect::<Vec<_>>(),
        "live_by_site": sites(&s.live_by_site), "live_by_tag": sites(&s.live_by_tag),
        "expandable_segments": s.expandable_segments, "trace_actions": s.trace_actions,
        "settings": s.settings.as_ref().map(settings),
    })
}

pub fn census(c: &pb::HeapCensus) -> Value {
    json!({
        "types": c.types.iter().map(|t| json!({"type_name": t.type_name, "count": t.count, "bytes": t.bytes})).collect::<Vec<_>>(),
        "gc_gen0": c.gc_gen0, "gc_gen1": c.gc_gen1, "gc_gen2": c.gc_gen2, "garbage": c.garbage,
        "duration_ns": c.duration_ns, "objects_scanned": c.objects_scanned, "referrer_chain": c.referrer_chain,
    })
}

fn process(p: &pb::ProcessMemory) -> Value {
    json!({"pid": p.pid, "vm_rss_bytes": p.vm_rss_bytes, "vm_hwm_bytes": p.vm_hwm_bytes,
           "vm_size_bytes": p.vm_size_bytes, "vm_swap_bytes": p.vm_swap_bytes})
}

fn model(m: &pb::Model) -> Value {
    json!({"name": m.name, "revision": m.revision, "quantization": m.quantization, "dtype": m.dtype, "bytes": m.bytes})
}

pub fn sample(s: &pb::Sample) -> Value {
    json!({
        "time_ns": s.time_ns, "t_s": s.t_s, "step": s.step,
        "process": s.process.as_ref().map(process),
        "cgroup_usage_bytes": s.cgroup.first().map(|c| c.usage_bytes),
        "mem_available_bytes": s.system.as_ref().map(|m| m.mem_available_bytes),
        "gpus": s.gpus.len(),
        "allocator": s.allocator.iter().map(allocator).collect::<Vec<_>>(),
        "context": s.context.as_ref().map(context),
    })
}

pub fn event(e: &pb::Event) -> Value {
    use pb::event::Kind;
    let (kind, body) = match &e.kind {
        Some(Kind::Phase(p)) => (
            "phase",
            json!({"name": p.name, "start": p.start, "model": p.model.as_ref().map(model),
            "allocated_bytes": p.allocated_bytes, "host_rss_bytes": p.host_rss_bytes, "error": p.error}),
        ),
        Some(Kind::Gc(g)) => (
            "gc",
            json!({"generation": g.generation, "collected": g.collected,
            "uncollectable": g.uncollectable, "duration_ns": g.duration_ns}),
        ),
        Some(Kind::CacheRelease(c)) => (
            "cache_release",
            json!({"device": c.device,
            "reserved_before_bytes": c.reserved_before_bytes, "reserved_after_bytes": c.reserved_after_bytes, "caller": c.caller}),
        ),
        Some(Kind::Oom(o)) => (
            "oom",
            json!({"device": o.device, "requested_bytes": o.requested_bytes,
            "observer": o.observer.as_ref().map(|b| json!({"device": b.device, "alloc": b.alloc,
                "device_allocated": b.device_allocated, "device_free": b.device_free})),
            "error_type": o.error_type, "error_text": o.error_text, "driver_error": o.driver_error,
            "stats": o.stats.as_ref().map(allocator), "snapshot": o.snapshot.as_ref().map(snapshot),
            "context": o.context.as_ref().map(context)}),
        ),
        Some(Kind::ProcessList(p)) => (
            "process_list",
            json!({
            "host_top_rss": p.host_top_rss.iter().map(|h| json!({"pid": h.pid, "command": h.command, "rss_bytes": h.rss_bytes})).collect::<Vec<_>>(),
            "gpu": p.gpu.iter().map(|g| json!({"device": g.device, "pid": g.pid, "used_bytes": g.used_bytes})).collect::<Vec<_>>()}),
        ),
        Some(Kind::Snapshot(s)) => ("snapshot", snapshot(s)),
        Some(Kind::HeapCensus(c)) => ("heap_census", census(c)),
        Some(Kind::ChildStart(c)) => ("child_start", json!({"pid": c.pid, "command": c.command})),
        Some(Kind::ChildExit(c)) => (
            "child_exit",
            json!({"pid": c.pid, "exit_code": c.exit_code, "signal": c.signal}),
        ),
        Some(Kind::Request(r)) => (
            "request",
            json!({"request_id": r.request_id, "start": r.start,
            "prompt_tokens": r.prompt_tokens, "max_tokens": r.max_tokens, "output_tokens": r.output_tokens, "error": r.error}),
        ),
        None => ("none", Value::Null),
    };
    json!({"time_ns": e.time_ns, "kind": kind, kind: body})
}

pub fn hello(h: &pb::Hello) -> Value {
    json!({
        "agent_id": h.agent_id, "name": h.name, "host": h.host, "pid": h.pid, "start_time_ns": h.start_time_ns,
        "role": h.role, "rank": h.rank, "runtime": h.runtime, "versions": h.versions,
        "models": h.models.iter().map(model).collect::<Vec<_>>(),
        "gpus": h.gpus.iter().map(|g| json!({"index": g.index, "name": g.name, "total_bytes": g.total_bytes, "cap_bytes": g.cap_bytes})).collect::<Vec<_>>(),
        "allocator_settings": h.allocator_settings.as_ref().map(settings),
        "labels": h.labels, "command": h.command,
    })
}

pub fn timeline(t: &pb::TimelineResponse) -> Value {
    json!({
        "hello": t.hello.as_ref().map(hello),
        "samples": t.samples.iter().map(|s| {
            let mut v = s.sample.as_ref().map(sample).unwrap_or(Value::Null);
            if let Value::Object(m) = &mut v { m.insert("seq".into(), s.seq.into()); }
            v
        }).collect::<Vec<_>>(),
        "events": t.events.iter().map(|e| {
            let mut v = e.event.as_ref().map(event).unwrap_or(Value::Null);
            if let Value::Object(m) = &mut v { m.insert("seq".into(), e.seq.into()); }
            v
        }).collect::<Vec<_>>(),
    })
}

pub fn agents(r: &pb::ListAgentsResponse) -> Value {
    Value::Array(
        r.agents
            .iter()
            .map(|a| {
                json!({
                    "hello": a.hello.as_ref().map(hello), "state": a.state, "samples": a.samples,
                    "events": a.events, "last_seq": a.last_seq,
                })
            })
            .collect(),
    )
}
