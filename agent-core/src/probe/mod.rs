//! Host-domain probes: process, cgroup (v1 and v2), system, GPU (NVML), and
//! the other processes on the host. Read-only: nothing here signals anyone.
