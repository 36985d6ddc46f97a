//! One process's memory: `/proc/<pid>/status`, `/proc/<pid>/stat` (major
//! faults) and `/proc/<pid>/limits` (RLIMIT_AS and friends).

use super::text::{kb_line_bytes, read_opt};
use super::HostPaths;
use crate::pb;

/// Reads the process's status, stat and limits, and for this process the
/// agent's own heap (see `own_heap`). Errors only when the status file itself
/// cannot be read (the process is gone, or no such pid); a missing stat or
/// limits file leaves those fields 0.
pub fn read(paths: &HostPaths, pid: u32) -> std::io::Result<pb::ProcessMemory> {
    let status = std::fs::read_to_string(paths.pid_file(pid, "status"))?;
    let mut out = pb::ProcessMemory {
        pid,
        ..Default::default()
    };
    parse_status(&status, &mut out);
    out.pid = pid;
    if let Some(faults) = read_opt(&paths.pid_file(pid, "stat"))
        .as_deref()
        .and_then(parse_stat_major_faults)
    {
        out.major_faults = faults;
    }
    if let Some(limits) = read_opt(&paths.pid_file(pid, "limits")) {
        parse_limits(&limits, &mut out);
    }
    if pid == std::process::id() {
        out.agent_heap_bytes = crate::own_heap::bytes();
    }
    Ok(out)
}

/// Fills the Vm* and Rss* fields from `/proc/<pid>/status` (values in kB).
/// Unknown, missing or garbled lines leave their field untouched.
pub fn parse_status(text: &str, out: &mut pb::ProcessMemory) {
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        if key == "Pid" {
            if let Ok(pid) = rest.trim().parse() {
                out.pid = pid;
            }
            continue;
        }
        let field = match key {
            "VmRSS" => &mut out.vm_rss_bytes,
            "VmHWM" => &mut out.vm_hwm_bytes,
            "VmSize" => &mut out.vm_size_bytes,
            "VmPeak" => &mut out.vm_peak_bytes,
            "VmSwap" => &mut out.vm_swap_bytes,
            "RssAnon" => &mut out.rss_anon_bytes,
            "RssShmem" => &mut out.rss_shmem_bytes,
            _ => continue,
        };
        if let Some(bytes) = kb_line_bytes(rest) {
            *field = bytes;
        }
    }
}

/// Fills the address-space and data soft limits from `/proc/<pid>/limits`
/// (bytes, or "unlimited" = 0).
pub fn parse_limits(text: &str, out: &mut pb::ProcessMemory) {
    if let Some(v) = soft_limit(text, "Max address space") {
        out.address_space_limit_bytes = v;
    }
    if let Some(v) = soft_limit(text, "Max data size") {
        out.data_limit_bytes = v;
    }
}

/// The memory rlimits of `pid`; all 0 (unlimited) when the file is unreadable.
pub fn rlimits(paths: &HostPaths, pid: u32) -> pb::Rlimits {
    read_opt(&paths.pid_file(pid, "limits"))
        .map(|t| parse_rlimits(&t))
        .unwrap_or_default()
}

/// The memory soft limits of a `/proc/<pid>/limits` text; 0 = unlimited.
pub fn parse_rlimits(text: &str) -> pb::Rlimits {
    pb::Rlimits {
        address_space_bytes: soft_limit(text, "Max address space").unwrap_or(0),
        data_bytes: soft_limit(text, "Max data size").unwrap_or(0),
        rss_bytes: soft_limit(text, "Max resident set").unwrap_or(0),
        stack_bytes: soft_limit(text, "Max stack size").unwrap_or(0),
    }
}

/// The soft-limit column of the line named `name`: Some(0) for "unlimited",
/// None when the line is missing or its value is not a number. Names contain
/// spaces and the columns are padded, so match the name as a prefix and take
/// the first token after it.
fn soft_limit(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let rest = &line[name.len()..];
    // "Max address space" must not match a longer name such as "Max address spaces".
    if !rest.starts_with(char::is_whitespace) {
        return None;
    }
    match rest.split_whitespace().next()? {
        "unlimited" => Some(0),
        v => v.parse().ok(),
    }
}

/// Field 12 (majflt) of `/proc/<pid>/stat`. The comm field (2) may hold
/// spaces and parentheses, so count fields after the *last* ')'.
pub fn parse_stat_major_faults(text: &str) -> Option<u64> {
    let after_comm = &text[text.rfind(')')? + 1..];
    // after_comm starts at field 3 (state); field 12 is 9 further on.
    after_comm.split_whitespace().nth(9)?.parse().ok()
}
