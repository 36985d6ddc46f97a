//! Memory outside PyTorch: what this process holds on the failing device
//! beside PyTorch's caching allocator (the CUDA context, NCCL's buffers,
//! cuBLAS/cuDNN workspaces, instantiated CUDA graphs, pluggable allocators
//! such as vLLM's sleep-mode allocator).
//!
//! Measured per process and device, never as the device's use minus
//! reserved (that counts every other process too): PyTorch's own "this
//! process has X memory in use" (NVML's figure for this pid, written at the
//! failure) minus reserved, else NVML's reading of this process on that
//! device minus the reserved bytes of the same moment.
//!
//! It is a cause when it explains the failure: the non-PyTorch bytes are at
//! least what the request lacked (requested − free).

use super::cause;
use crate::domain::{Domain, DomainVerdict};
use crate::findings::Findings;
use crate::pb;
use crate::torch_text::TorchOomText;
use crate::units::{bytes, bytes_short};
use oomscope_proto::CauseKind;

/// About what a bare CUDA context takes (0.49 GiB beside PyTorch on the
/// H200 captures): unavoidable, so memory only this large explains a
/// failure without anything to change.
const CONTEXT_BYTES: u64 = 512 << 20;
/// Confidence where more than a context explains the failure; the share of
/// the device held outside PyTorch adds to it.
const BASE_CONFIDENCE: f64 = 0.6;
const MAX_CONFIDENCE: f64 = 0.9;
/// Each share of the device outside PyTorch adds this many times itself.
const SHARE_WEIGHT: f64 = 3.0;
/// Where a context's worth alone explains it: a fact, rarely the story.
const CONTEXT_ONLY_CONFIDENCE: f64 = 0.25;

/// This process's memory on a device outside PyTorch's caching allocator.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct OutsideTorch {
    pub bytes: u64,
    /// The process's whole use of the device, non-PyTorch memory included.
    pub process_bytes: u64,
    /// PyTorch's reserved bytes it was set against.
    pub reserved_bytes: u64,
    /// Where `process_bytes` was read.
    pub source: String,
}

/// The process's non-PyTorch memory on the failing device: from PyTorch's
/// text of the failure, else from NVML's per-process reading of this
/// process, newest at or before `at_ns`. `reserved` is PyTorch's reserved at
/// the failure; `device_uuid` the failing device where known. None where
/// neither figure exists or the reading is not clearly this process's.
pub(crate) fn measure(
    f: &Findings,
    text: &TorchOomText,
    reserved: u64,
    at_ns: i64,
    device_uuid: &str,
) -> Option<OutsideTorch> {
    if let Some(p) = text.process_bytes {
        return Some(OutsideTorch {
            bytes: p.saturating_sub(reserved),
            process_bytes: p,
            reserved_bytes: reserved,
            source: "PyTorch's message: \"this process has … memory in use\"".to_string(),
        });
    }
    let own = f.evidence.own_pids();
    let failing_pid = f.evidence.hello.as_ref().map(|h| h.pid);
    f.evidence
        .samples
        .iter()
        .rev()
        .filter(|s| s.time_ns <= at_ns)
        .find_map(|s| {
            let mut mine: Vec<(&pb::GpuDevice, &pb::GpuProcessUsage, u64)> = s
                .gpus
                .iter()
                .filter(|g| device_uuid.is_empty() || g.uuid == device_uuid)
                .flat_map(|g| g.processes.iter().map(move |p| (g, p)))
                .filter(|(_, p)| match p.view() {
                    pb::PidView::Own => true,
                    pb::PidView::Unspecified => own.contains(&p.pid),
                    _ => false,
                })
                .filter_map(|(g, p)| Some((g, p, p.used_bytes?)))
                .collect();
            // The failing process itself where its tree has several.
            if mine.len() > 1 {
                mine.retain(|(_, p, _)| Some(p.pid) == failing_pid);
            }
            let [(g, p, used)] = mine[..] else {
                return None;
            };
            // PyTorch's reserved of the same moment, where the same sample read it.
            let reserved_then = s
                .allocator
                .iter()
                .find(|a| !g.uuid.is_empty() && a.device_uuid == g.uuid)
                .map_or(reserved, |a| a.reserved_bytes);
            Some(OutsideTorch {
                bytes: used.saturating_sub(reserved_then),
                process_bytes: used,
                reserved_bytes: reserved_then,
                source: format!("NVML's reading of pid {}", p.pid),
            })
        })
}

/// The failure's figures: what was asked, what was free on the device.
struct Shortfall {
    requested: u64,
    free: u64,
    total: Option<u64>,
}

fn shortfall(f: &Findings) -> Option<Shortfall> {
    let x = f.failure.as_ref()?;
    let oom = f.oom.map(|(_, o)| o);
    let stats = oom.and_then(|o| o.stats.as_ref());
    let free = x
        .text
        .free_bytes
        .or_else(|| {
            oom.and_then(|o| o.observer.as_ref())
                .map(|o| o.device_free.max(0) as u64)
        })
        .or_else(|| {
            stats
                .filter(|s| s.driver_total_bytes > 0)
                .map(|s| s.driver_free_bytes)
        })?;
    let total = x
        .text
        .total_bytes
        .or_else(|| stats.map(|s| s.driver_total_bytes).filter(|&t| t > 0))
        .or(Some(f.device_limit).filter(|&t| t > 0));
    Some(Shortfall {
        requested: x.requested_bytes,
        free,
        total,
    })
}

pub fn non_pytorch_memory(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    if v.domain != Domain::GpuVram {
        return None;
    }
    let x = f.failure.as_ref()?;
    let sf = shortfall(f)?;
    // The device had room: a cap or the allocator's own state refused it.
    if sf.requested <= sf.free {
        return None;
    }
    let lacked = sf.requested - sf.free;
    let uuid = f.oom.map_or("", |(_, o)| o.device_uuid.as_str());
    let outside = measure(f, &x.text, x.reserved_bytes, x.time_ns, uuid)?;
    if outside.bytes < lacked {
        return None;
    }
    let device = match (f.oom.map(|(_, o)| o.device), uuid) {
        (Some(d), "") => format!("GPU {d}"),
        (Some(d), u) => format!("GPU {d} ({u})"),
        (None, _) => "the failing GPU".to_string(),
    };
    let mut evidence = vec![
        format!(
            "this process held {} on {device} outside PyTorch's caching allocator: {} in use by the process ({}) − {} reserved by PyTorch",
            bytes(outside.bytes),
            bytes_short(outside.process_bytes),
            outside.source,
            bytes_short(outside.reserved_bytes)
        ),
        format!(
            "the allocation of {} failed with {} free on the device: it lacked {}, less than the {} outside PyTorch",
            bytes_short(sf.requested),
            bytes_short(sf.free),
            bytes_short(lacked),
            bytes_short(outside.bytes)
        ),
    ];
    let beyond = outside.bytes.saturating_sub(CONTEXT_BYTES);
    let beyond_context = beyond >= lacked;
    let share = sf.total.map_or(0.0, |t| outside.bytes as f64 / t as f64);
    let confidence = if beyond_context {
        evidence.push(
            "memory outside the caching allocator is the CUDA context (about 0.5 GiB), NCCL's buffers, cuBLAS/cuDNN workspaces, instantiated CUDA graphs and pluggable allocators (vLLM's sleep mode): more than a context's worth of it, enough to explain the failure"
                .to_string(),
        );
        (BASE_CONFIDENCE + SHARE_WEIGHT * share).min(MAX_CONFIDENCE)
    } else {
        evidence.push(format!(
            "no more than about a CUDA context's worth ({}): the context cannot be given back, so this explains the failure without anything to change",
            bytes_short(CONTEXT_BYTES)
        ));
        CONTEXT_ONLY_CONFIDENCE
    };
    let mut metrics = vec![
        ("non_pytorch_bytes", outside.bytes as f64),
        ("requested_bytes", sf.requested as f64),
        ("free_bytes", sf.free as f64),
        ("lacked_bytes", lacked as f64),
        // Beyond a bare context: what a fix can give back.
        ("beyond_context_bytes", beyond as f64),
        ("process_bytes", outside.process_bytes as f64),
        ("reserved_bytes", outside.reserved_bytes as f64),
    ];
    if let Some(t) = sf.total {
        metrics.push(("total_bytes", t as f64));
    }
    Some(cause(
        CauseKind::NonPytorchMemory,
        confidence,
        evidence,
        &metrics,
    ))
}
