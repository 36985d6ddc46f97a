//! Host-wide memory: `/proc/meminfo`, `/proc/vmstat`, `/proc/pressure/memory`,
//! `/proc/sys/vm/overcommit_memory` and the `/dev/shm` filesystem.

use std::path::Path;

use super::text::{kb_line_bytes, key_values, read_opt};
use super::HostPaths;
use crate::pb;

/// Where POSIX shared memory lives; a full one kills with SIGBUS, not OOM.
pub const SHM_PATH: &str = "/dev/shm";

/// Reads every host-wide file; a missing one leaves its fields 0 (PSI is
/// absent on kernels built without it).
pub fn read(paths: &HostPaths) -> pb::SystemMemory {
    let proc_file = |name: &str| read_opt(&paths.proc_root.join(name));
    let mut out = pb::SystemMemory::default();
    if let Some(t) = proc_file("meminfo") {
        parse_meminfo(&t, &mut out);
    }
    if let Some(t) = proc_file("vmstat") {
        parse_vmstat(&t, &mut out);
    }
    out.pressure = proc_file("pressure/memory").map(|t| parse_pressure(&t));
    if let Some(mode) = proc_file("sys/vm/overcommit_memory").and_then(|t| t.trim().parse().ok()) {
        out.overcommit_mode = mode;
    }
    if let Some((total, used)) = fs_usage(Path::new(SHM_PATH)) {
        out.shm_total_bytes = total;
        out.shm_used_bytes = used;
    }
    out
}

/// Fills totals from `/proc/meminfo` (kB there, bytes here).
pub fn parse_meminfo(text: &str, out: &mut pb::SystemMemory) {
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let field = match key {
            "MemTotal" => &mut out.mem_total_bytes,
            "MemAvailable" => &mut out.mem_available_bytes,
            "CommitLimit" => &mut out.commit_limit_bytes,
            "Committed_AS" => &mut out.committed_as_bytes,
            "SwapTotal" => &mut out.swap_total_bytes,
            "SwapFree" => &mut out.swap_free_bytes,
            _ => continue,
        };
        if let Some(bytes) = kb_line_bytes(rest) {
            *field = bytes;
        }
    }
}

/// Fills the OOM, swap and refault counters from `/proc/vmstat`.
pub fn parse_vmstat(text: &str, out: &mut pb::SystemMemory) {
    for (key, value) in key_values(text) {
        match key {
            "oom_kill" => out.vmstat_oom_kill = value,
            "pswpin" => out.vmstat_pswpin = value,
            "pswpout" => out.vmstat_pswpout = value,
            "pgmajfault" => out.vmstat_pgmajfault = value,
            "workingset_refault_anon" => out.vmstat_workingset_refault_anon = value,
            "workingset_refault_file" => out.vmstat_workingset_refault_file = value,
            _ => {}
        }
    }
}

/// Parses PSI text (`some avg10=.. avg60=.. avg300=.. total=..` and the same
/// for `full`). Missing lines or keys stay 0.
pub fn parse_pressure(text: &str) -> pb::Pressure {
    let mut out = pb::Pressure::default();
    for line in text.lines() {
        let mut it = line.split_whitespace();
        let kind = it.next();
        for kv in it {
            let Some((key, value)) = kv.split_once('=') else {
                continue;
            };
            match (kind, key) {
                (Some("some"), "avg10") => out.some_avg10 = value.parse().unwrap_or(0.0),
                (Some("full"), "avg10") => out.full_avg10 = value.parse().unwrap_or(0.0),
                (Some("some"), "total") => out.some_total_us = value.parse().unwrap_or(0),
                (Some("full"), "total") => out.full_total_us = value.parse().unwrap_or(0),
                _ => {}
            }
        }
    }
    out
}

/// (total, used) bytes of the filesystem at `path`, via statvfs.
pub fn fs_usage(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes into the zeroed struct we own; the path is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    let frsize = st.f_frsize as u64;
    let total = (st.f_blocks as u64).saturating_mul(frsize);
    let free = (st.f_bfree as u64).saturating_mul(frsize);
    Some((total, total.saturating_sub(free)))
}
