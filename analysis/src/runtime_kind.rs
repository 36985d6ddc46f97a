//! Which runtime produced the evidence, as far as the fixes must know: is
//! the process Python, does it have a GPU, and which allocator read its
//! device (the Hello says: PyTorch's caching allocator, the Rust agent's
//! `TrackingPool`, none). A fix names settings and tools of that runtime
//! only: no PyTorch setting for a `TrackingPool`, no Python tool for a Rust
//! process, no allocator remedy where there is no GPU.

use crate::evidence::Evidence;
use crate::pb;
use crate::pb::event::Kind;
use oomscope_proto::{Role, RUNTIME_CUDARC, RUNTIME_PYTORCH, RUNTIME_RUST, TRACKING_POOL_BACKEND};

/// The device allocator whose readings the evidence holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allocator {
    /// PyTorch's CUDA caching allocator (the Python agent's readings).
    TorchCaching,
    /// The Rust agent's `TrackingPool`.
    TrackingPool,
    /// An agent that reads no device allocator (a host-only Rust agent).
    None,
    /// No agent said (`oomscope run` alone, a probe).
    Unknown,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuntimeKind {
    pub allocator: Allocator,
    /// Some(false): an agent said it is a Rust process; None: nobody said.
    pub python: Option<bool>,
    /// A device was seen: a GPU in a Hello, an allocator or GPU reading,
    /// a device OOM.
    pub gpu: bool,
}

impl RuntimeKind {
    /// Python's tools (heap census, tracemalloc) apply: Python, or nobody said.
    pub fn python_tools(&self) -> bool {
        self.python != Some(false)
    }

    /// PyTorch's allocator settings apply: its readings, or nobody said and
    /// there is a GPU.
    pub fn torch_allocator(&self) -> bool {
        match self.allocator {
            Allocator::TorchCaching => true,
            Allocator::Unknown => self.gpu && self.python_tools(),
            Allocator::TrackingPool | Allocator::None => false,
        }
    }
}

/// Where to look for what a process keeps on the host, in its language's
/// tools, for a cause's evidence line.
pub fn host_holder_hint(rk: &RuntimeKind) -> &'static str {
    if rk.python_tools() {
        "a heap census, tracemalloc, growing Python lists or caches"
    } else {
        "a collection that grows with each request, a cache without a bound; heaptrack or dhat names the allocation site that holds it"
    }
}

/// The device leak's evidence line: what the live bytes are, in the
/// allocator's words.
pub fn live_bytes_line(rk: &RuntimeKind) -> &'static str {
    match rk.allocator {
        Allocator::TrackingPool => "these bytes are live TrackingPool blocks: TrackingPool::empty_cache() cannot return them; find what holds them (their tags and allocation sites)",
        _ => "these bytes are live tensors: empty_cache cannot return them; find what holds them (allocation site, Python type)",
    }
}

/// The device leak's evidence line where no allocator was read, only
/// NVML's figure for the process: where the bytes are, in the runtime's
/// words.
pub fn unread_device_line(rk: &RuntimeKind) -> &'static str {
    if rk.python_tools() {
        "no device allocator reading here: NVML's figure for this process is what its framework holds on the device (tensors, its caching pool, the CUDA context); find what keeps tensors alive across requests"
    } else {
        "no device allocator reading here: NVML's figure for this process is what the framework holds on the device (candle's tensors through cudarc, the CUDA context); find what keeps tensors alive across requests (a cache or collection of them), or route the memory you want named per block through a TrackingPool"
    }
}

/// The Hellos of the agents in the evidence (its own, its members'), the
/// supervisor's left out: it reads no runtime.
fn agent_hellos(e: &Evidence) -> Vec<&pb::Hello> {
    std::iter::once(e)
        .chain(e.members.iter())
        .filter_map(|m| m.hello.as_ref())
        .filter(|h| h.role != Role::Supervisor)
        .collect()
}

fn all_evidence(e: &Evidence) -> impl Iterator<Item = &Evidence> {
    std::iter::once(e).chain(e.members.iter())
}

pub fn of(e: &Evidence) -> RuntimeKind {
    let hellos = agent_hellos(e);
    let said = |name: &str| hellos.iter().any(|h| h.runtime == name);
    let rust = said(RUNTIME_RUST) || said(RUNTIME_CUDARC);
    let python = if said(RUNTIME_PYTORCH) {
        Some(true)
    } else if rust {
        Some(false)
    } else {
        child_is_python(e)
    };
    let pool = hellos.iter().any(|h| {
        h.allocator_settings
            .as_ref()
            .is_some_and(|s| s.backend == TRACKING_POOL_BACKEND)
    });
    let gpu = hellos.iter().any(|h| !h.gpus.is_empty())
        || all_evidence(e).any(|m| {
            m.samples
                .iter()
                .any(|s| !s.allocator.is_empty() || !s.gpus.is_empty())
                || m.events
                    .iter()
                    .any(|ev| matches!(ev.kind, Some(Kind::Oom(_))))
        });
    let allocator = if pool {
        Allocator::TrackingPool
    } else if said(RUNTIME_PYTORCH) && gpu {
        Allocator::TorchCaching
    } else if rust || said(RUNTIME_PYTORCH) {
        Allocator::None
    } else {
        Allocator::Unknown
    };
    RuntimeKind {
        allocator,
        python,
        gpu,
    }
}

/// What `oomscope run` started, where no agent said: a Python interpreter
/// by its argv[0]. Anything else stays unknown (None): a shell or a native
/// binary may be any language, so it keeps the generic words.
fn child_is_python(e: &Evidence) -> Option<bool> {
    let command = e.events.iter().find_map(|ev| match &ev.kind {
        Some(Kind::ChildStart(s)) => s.command.first(),
        _ => None,
    })?;
    let exe = command.rsplit('/').next().unwrap_or(command);
    (exe.starts_with("python") || exe.starts_with("pytest")).then_some(true)
}
