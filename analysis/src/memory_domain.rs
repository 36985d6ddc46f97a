//! The memory domains an allocation can fail in, by name: the vocabulary
//! every verdict uses. Which one ran out is decided in `domain.rs`.

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Domain {
    GpuVram,
    HostRam,
    Cgroup,
    AddressSpace,
    SwapThrash,
    Shm,
    ExternalKill,
    Unknown,
}

impl Domain {
    pub fn as_str(self) -> &'static str {
        match self {
            Domain::GpuVram => "gpu_vram",
            Domain::HostRam => "host_ram",
            Domain::Cgroup => "cgroup",
            Domain::AddressSpace => "address_space",
            Domain::SwapThrash => "swap_thrash",
            Domain::Shm => "shm",
            Domain::ExternalKill => "external_kill",
            Domain::Unknown => "unknown",
        }
    }

    /// The domain a diagnosis names on the wire (`Diagnosis.domain`). A name
    /// this build does not know (a newer collector's) reads as `Unknown`.
    pub fn from_wire(s: &str) -> Domain {
        Domain::ALL
            .into_iter()
            .find(|d| d.as_str() == s)
            .unwrap_or(Domain::Unknown)
    }

    /// What ran out, for people: the headline of a report.
    pub fn title(self) -> &'static str {
        match self {
            Domain::GpuVram => "GPU memory (VRAM)",
            Domain::HostRam => "system RAM (a global out-of-memory kill)",
            Domain::Cgroup => "a container/cgroup memory limit",
            Domain::AddressSpace => "the process address space (RLIMIT_AS / overcommit)",
            Domain::SwapThrash => "swap/page-cache thrash (slow, not dead)",
            Domain::Shm => "/dev/shm (shared memory) full",
            Domain::ExternalKill => "none: killed from outside (SIGKILL, no memory counter moved)",
            Domain::Unknown => "unknown: the evidence does not decide",
        }
    }

    pub const ALL: [Domain; 8] = [
        Domain::GpuVram,
        Domain::HostRam,
        Domain::Cgroup,
        Domain::AddressSpace,
        Domain::SwapThrash,
        Domain::Shm,
        Domain::ExternalKill,
        Domain::Unknown,
    ];
}
