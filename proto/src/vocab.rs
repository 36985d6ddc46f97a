//! The names the crates share: cause kinds, agent roles, incident kinds and
//! trigger kinds. The messages keep their string fields (`Cause.kind`,
//! `Hello.role`, `Incident.kind`, `Diagnosis.trigger`), so the wire and the
//! store carry exactly these strings; code parses and spells them only here.
//! `tests/vocab.rs` fails where production code spells one as a literal.

use std::fmt;
use std::str::FromStr;

/// A name this build does not know, for an enum that names every value it
/// can meet. Says which vocabulary and which name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownName {
    pub vocabulary: &'static str,
    pub name: String,
}

impl fmt::Display for UnknownName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown {} {:?}", self.vocabulary, self.name)
    }
}

impl std::error::Error for UnknownName {}

/// A closed vocabulary: the enum, `ALL`, `as_str`, `FromStr` (an unknown
/// name is an [`UnknownName`]) and `Display`.
macro_rules! vocabulary {
    (
        $(#[$meta:meta])*
        $name:ident, $what:literal {
            $($(#[$vmeta:meta])* $variant:ident = $text:literal,)+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// The name on the wire and in the store.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }

        impl FromStr for $name {
            type Err = UnknownName;
            fn from_str(s: &str) -> Result<Self, UnknownName> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(UnknownName { vocabulary: $what, name: s.to_string() }),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl PartialEq<$name> for str {
            fn eq(&self, other: &$name) -> bool {
                self == other.as_str()
            }
        }

        impl PartialEq<$name> for String {
            fn eq(&self, other: &$name) -> bool {
                self == other.as_str()
            }
        }

        impl PartialEq<$name> for &str {
            fn eq(&self, other: &$name) -> bool {
                *self == other.as_str()
            }
        }
    };
}

vocabulary! {
    /// Why a memory domain ran out (`Cause.kind`). Closed: only the analysis
    /// makes causes, and a reader of a newer collector's diagnosis (the
    /// report, the probe) asks whether a cause is one it knows; a name it
    /// does not know is no such cause, which `parse().ok()` says.
    CauseKind, "cause kind" {
        /// The device's live bytes grow with every request and are not freed.
        Leak = "leak",
        /// Garbage that a collection reclaims: reference cycles held the bytes.
        GcRetained = "gc_retained",
        /// The allocator's cache (reserved) grew far more than the live bytes.
        CacheRetention = "cache_retention",
        /// The host's memory (RSS, a limited cgroup's usage) grows between
        /// requests while the device's live bytes do not.
        HostGrowth = "host_growth",
        /// Growth too slow to explain a failure on its own: a runway in days.
        SlowGrowth = "slow_growth",
        /// The free bytes were there, but in blocks too small for the request.
        Fragmentation = "fragmentation",
        /// Memory on the device outside PyTorch's allocator (CUDA context,
        /// NCCL, cuBLAS workspaces, other libraries) left too little.
        NonPytorchMemory = "non_pytorch_memory",
        /// The KV cache grew with concurrency or context until it filled the device.
        KvGrowth = "kv_growth",
        /// The weights alone (plus the failed request) filled the limit.
        WeightsTooLarge = "weights_too_large",
        /// Another process held the memory that ran out.
        OtherProcess = "other_process",
        /// A cgroup's memory limit was reached: the kernel killed in it.
        CgroupLimit = "cgroup_limit",
        /// The machine's RAM ran out: a global OOM kill.
        HostRamExhausted = "host_ram_exhausted",
        /// RLIMIT_AS refused a mapping.
        AddressSpaceLimit = "address_space_limit",
        /// RLIMIT_DATA refused brk and private writable mappings (malloc's
        /// arenas, anonymous mmap) past it.
        DataLimit = "data_limit",
        /// Strict overcommit (mode 2) refused a reservation.
        OvercommitLimit = "overcommit_limit",
        /// /dev/shm ran out: a SIGBUS on a shared page, or ENOSPC there.
        ShmFull = "shm_full",
        /// Swap or page-cache thrash: slow, not dead.
        SwapThrash = "swap_thrash",
        /// Killed from outside (a SIGKILL no memory counter explains).
        ExternalKill = "external_kill",
        /// A kill confined to some NUMA nodes: those nodes ran out, whatever
        /// the host had free elsewhere.
        NumaBinding = "numa_binding",
        /// A high-order host allocation failed with memory free: the blocks
        /// were too small, not the memory too little.
        HostFragmentation = "host_fragmentation",
        /// memory.high throttling: a slowdown on its own, and the warning
        /// before an OOM at memory.max.
        MemoryHighThrottling = "memory_high_throttling",
        /// The KV pool's reservation did not fit beside the rest of the server
        /// (a runtime's text, or a kill while the pool was being filled).
        KvReservation = "kv_reservation",
        /// The runtime found no memory at all left for its cache blocks (vLLM).
        KvNoRoom = "kv_no_room",
        /// One request's context needs more KV cache than the pool holds.
        ContextOverKv = "context_over_kv",
        /// The runtime's own check found KV pool slots never returned (SGLang).
        KvPoolLeak = "kv_pool_leak",
        /// The runtime's KV pool filled and it retracted requests (SGLang).
        KvPoolFull = "kv_pool_full",
        /// A full KV pool bounded the load: requests waited or were preempted.
        KvPoolSaturation = "kv_pool_saturation",
        /// llama.cpp's compute buffer did not fit.
        ComputeBuffer = "compute_buffer",
        /// llama.cpp could not allocate one of its buffers.
        BufferReservation = "buffer_reservation",
        /// The prefill batch of the runtime's warm-up did not fit (TGI).
        PrefillBatch = "prefill_batch",
        /// An activation peak outgrew the headroom left beside the KV pool.
        ActivationHeadroom = "activation_headroom",
        /// Another process took memory after the runtime sized its pool from it.
        TakenAfterProfiling = "taken_after_profiling",
        /// The process failed while starting, and no memory explains it.
        StartupFailure = "startup_failure",
    }
}

vocabulary! {
    /// What kind of failure an incident records (`Incident.kind`,
    /// `Failure.kind`). Closed: the collector alone raises incidents and reads
    /// them back from its own store.
    IncidentKind, "incident kind" {
        /// An allocator OOM the agent reported (an `Oom` event).
        Oom = "oom",
        /// The child `oomscope run` started was killed by a signal.
        Signal = "signal",
        /// A process of the instance other than the one `oomscope run` started
        /// (an engine, a worker) was killed by a signal, as the supervisor saw.
        MemberDied = "member_died",
        /// Such a process exited with a non-zero code: it gave up, often for a
        /// reason another process prints (an API server's out-of-memory text).
        MemberFailed = "member_failed",
        /// The child exited non-zero with an out-of-memory text (or ENOSPC
        /// on a full /dev/shm) in its stderr.
        ExitOomText = "exit_oom_text",
        /// The child `oomscope run` started exited non-zero within the start-up
        /// window (`oomscope_analysis::STARTUP_WINDOW_NS`) with no memory text:
        /// it failed while starting. Failed starts of one service in a row are
        /// a crash loop, whether one `oomscope run --restart N` or separate
        /// runs made them.
        FailedStart = "failed_start",
        /// `oomscope run --restart N` gave up restarting, or one service's
        /// agents died again and again within a window (the fleet detector).
        CrashLoop = "crash_loop",
        /// An agent's stream broke without a goodbye.
        AgentLost = "agent_lost",
        /// Many agents of one service restarting together, then a request burst.
        RestartStorm = "restart_storm",
        /// The kernel's OOM killer took a process of the instance (its own record).
        KernelOomKill = "kernel_oom_kill",
        /// Many agents lost together: one incident, not one each (see `correlate`).
        MassDisconnect = "mass_disconnect",
    }
}

vocabulary! {
    /// What set the failure off (`Diagnosis.trigger`), from the pattern of
    /// growth before it. Closed: only the analysis decides it.
    TriggerKind, "trigger kind" {
        /// At once: at start-up, or with no growth before the failure.
        Immediate = "immediate",
        /// The bytes rose with the prompt or context size.
        SizeDependent = "size_dependent",
        /// The bytes rose with the number of requests in flight.
        ConcurrencyDependent = "concurrency_dependent",
        /// Growth per request, request after request.
        RepeatedRequests = "repeated_requests",
        /// Growth against time, where nothing marks requests (`time_growth`).
        GrowthOverTime = "growth_over_time",
        /// The evidence shows no pattern.
        Unknown = "unknown",
    }
}

/// The state (`AgentSummary.state`) of an agent that said Goodbye but whose
/// messages just before it never arrived: its process ended (a
/// multiprocessing child's `os._exit`, a Goodbye on SIGTERM whose acks ran
/// out of time) with evidence still unsent. Not "disconnected": what is in
/// its timeline stops short of its end. The other states are "connected",
/// "disconnected" (said Goodbye), "lost" (went silent) and "ended" (a
/// probe's stream, or a member's that ended with its instance's clean stop).
pub const EVIDENCE_INCOMPLETE_STATE: &str = "evidence_incomplete";

/// `Role::Probe`'s name as a constant, for a `Hello` built in a const or a test.
pub const PROBE_ROLE: &str = "probe";

/// What part an agent's process plays in its instance (`Hello.role`). Open:
/// a user or a runtime plugin names the role (`oomscope.start(role=...)`,
/// `OOMSCOPE_ROLE`, vLLM's plugin), so any name can arrive; the ones code
/// acts on are variants, the rest are `Other` and round-trip unchanged.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// A serving process: the default of every agent.
    Server,
    /// A process that runs the model for a server (a rank of it).
    Worker,
    /// `oomscope run`'s own agent: it starts the server and sees it end.
    Supervisor,
    /// `oomscope probe`'s stream: the requests it sends a server, as that
    /// server's workload context. It observes the instance it joins, so its
    /// end is never the instance's death.
    Probe,
    /// A replayed capture's stream.
    Replay,
    /// `oomscope bench ingest`'s generated load.
    Bench,
    /// The HTTP front of a multi-process server (vLLM's API server).
    ApiServer,
    /// vLLM's engine core process.
    EngineCore,
    /// A process that manages workers for a server.
    Manager,
    /// A process that launches the server's processes and waits on them.
    Launcher,
    /// Any other name, as sent.
    Other(String),
}

impl Role {
    /// The roles this build names.
    pub const KNOWN: &'static [Role] = &[
        Role::Server,
        Role::Worker,
        Role::Supervisor,
        Role::Probe,
        Role::Replay,
        Role::Bench,
        Role::ApiServer,
        Role::EngineCore,
        Role::Manager,
        Role::Launcher,
    ];

    /// The name on the wire and in the store.
    pub fn as_str(&self) -> &str {
        match self {
            Role::Server => "server",
            Role::Worker => "worker",
            Role::Supervisor => "supervisor",
            Role::Probe => PROBE_ROLE,
            Role::Replay => "replay",
            Role::Bench => "bench",
            Role::ApiServer => "api_server",
            Role::EngineCore => "engine_core",
            Role::Manager => "manager",
            Role::Launcher => "launcher",
            Role::Other(s) => s,
        }
    }

    /// The role a `Hello.role` names; never fails (see the enum).
    pub fn parse(s: &str) -> Role {
        Role::KNOWN
            .iter()
            .find(|r| r.as_str() == s)
            .cloned()
            .unwrap_or_else(|| Role::Other(s.to_string()))
    }
}

impl FromStr for Role {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Role::parse(s))
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<Role> for String {
    fn from(r: Role) -> String {
        match r {
            Role::Other(s) => s,
            r => r.as_str().to_string(),
        }
    }
}

impl PartialEq<Role> for str {
    fn eq(&self, other: &Role) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<Role> for String {
    fn eq(&self, other: &Role) -> bool {
        self == other.as_str()
    }
}
