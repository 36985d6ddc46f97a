//! The kernel's own record of an OOM kill, from `/dev/kmsg`.
//!
//! The kernel prints one kill as many log records (each its own
//! `PRIO,SEQ,TIME_US,FLAGS;message` line): "X invoked oom-killer", a stack,
//! the memcg's usage and limit, its stats, the task table, the `oom-kill:`
//! summary and "Killed process". Only four of them carry what a diagnosis
//! needs; [`OomRecordParser`] folds those into one [`pb::KernelOomKill`] and
//! keeps them for quoting, never the task table (it names every process of
//! the cgroup).
//!
//! It also reads what decides between domains of a machine-wide kill: the
//! failed allocation's order and the allowed nodes (nodemask, cpuset,
//! mems_allowed), and the zones' free lists the kernel prints with it; and
//! the kernel's "page allocation failure" warnings (a high-order allocation
//! refused without a kill), folded into [`pb::KernelAllocFailure`].
//!
//! The parser is pure and incremental (records in, kills out), because a
//! reader polling the log may see the first half of a kill in one read and
//! the rest in the next. [`KmsgReader`] is the thin I/O shell around it.

use std::fs::File;
use std::io::Read;

use crate::pb;

/// Where the kernel's log is read.
pub const KMSG_PATH: &str = "/dev/kmsg";
/// One read of /dev/kmsg returns one record, and fails with EINVAL when the
/// buffer is smaller than the record. Records are at most 8 KiB
/// (CONSOLE_EXT_LOG_MAX) with their dictionary; twice that is safe.
const READ_BUFFER_BYTES: usize = 16 * 1024;
/// Records read in one `read_new` at most: a kernel flooding its log must
/// not hold the caller's loop; the rest is read on the next call.
const MAX_RECORDS_PER_READ: usize = 4096;
/// Lines of one kill kept for quoting: invoked, memory usage, oom-kill and
/// Killed process.
const MAX_LINES: usize = 4;
/// A kept line is cut here: a kernel line is short, but a cgroup path in
/// the oom-kill line can be long, and the evidence must stay bounded.
const MAX_LINE_CHARS: usize = 1024;
/// Zones kept per record: a few per node, and machines have few nodes; the
/// evidence must stay bounded on a large one.
const MAX_ZONES: usize = 64;
/// Orders kept per zone: the kernel has 11 (MAX_PAGE_ORDER 10), some
/// configurations more.
const MAX_ORDERS: usize = 16;
/// Allocation failures held until taken: the kernel rate-limits them, and a
/// reader takes them every poll.
const MAX_FAILURES: usize = 16;

/// One /dev/kmsg record: its header fields and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KmsgRecord {
    /// The syslog level (0 = emerg .. 7 = debug), without the facility.
    pub level: u8,
    pub seq: u64,
    /// Microseconds since boot.
    pub time_us: u64,
    /// The message with the kernel's `\xNN` escapes undone.
    pub message: String,
}

/// Parses one record's first line, `PRIO,SEQ,TIME_US,FLAGS[,...];message`.
/// Continuation lines (dictionary entries such as ` SUBSYSTEM=...`, which
/// start with a space) are not part of the message and are ignored. None
/// for anything that does not have that shape.
pub fn parse_record(text: &str) -> Option<KmsgRecord> {
    let line = text.split('\n').next()?;
    let (header, message) = line.split_once(';')?;
    let mut fields = header.split(',');
    let prio: u32 = fields.next()?.trim().parse().ok()?;
    let seq = fields.next()?.trim().parse().ok()?;
    let time_us = fields.next()?.trim().parse().ok()?;
    Some(KmsgRecord {
        level: (prio & 7) as u8,
        seq,
        time_us,
        message: unescape(message),
    })
}

/// Splits a text of records (one per line, as the fixtures store them and
/// `dmesg -r`-like dumps show them) into records, skipping continuation
/// lines and garbage.
pub fn parse_records(text: &str) -> impl Iterator<Item = KmsgRecord> + '_ {
    text.lines()
        .filter(|l| !l.starts_with(' '))
        .filter_map(parse_record)
}

/// Undoes the kernel's `\xNN` escaping of non-printable bytes (a process
/// name may hold any byte but NUL and '/'); invalid UTF-8 is replaced.
fn unescape(s: &str) -> String {
    if !s.contains("\\x") {
        return s.to_string();
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && b.get(i + 1) == Some(&b'x') {
            if let Some(v) = s
                .get(i + 2..i + 4)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Folds the records of OOM kills into one message per kill. A kill begins
/// at "invoked oom-killer" and ends at "Killed process"; lines between them
/// that are not OOM lines (the stack, the stats, other drivers' messages)
/// are skipped. A "Killed process" without its beginning (the reader opened
/// mid-kill, or an old kernel) still gives a kill with what that line holds.
#[derive(Debug, Default)]
pub struct OomRecordParser {
    /// Boxed: a reader holds a parser, and is mostly idle.
    pending: Option<Box<pb::KernelOomKill>>,
    /// A "page allocation failure" whose stack and free lists are still
    /// coming; it ends at show_mem's "pages RAM" line or the next record's start.
    failure: Option<Box<pb::KernelAllocFailure>>,
    /// Completed failures, until taken.
    failures: Vec<pb::KernelAllocFailure>,
    /// The group memory.oom.group is killing after the last victim: the
    /// "Killed process" lines that follow name its other tasks.
    group: Option<String>,
}

impl OomRecordParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// True while a kill has begun and its "Killed process" line has not
    /// come yet: a reader at a process's end waits briefly for the rest.
    pub fn has_pending(&self) -> bool {
        self.pending.is_some() || self.failure.is_some()
    }

    /// The "page allocation failure" records completed so far (oldest
    /// first), and any still open: a reader at a process's end takes them all.
    pub fn take_alloc_failures(&mut self) -> Vec<pb::KernelAllocFailure> {
        self.finish_failure();
        std::mem::take(&mut self.failures)
    }

    /// The failures completed so far; one still being logged stays.
    pub fn take_completed_alloc_failures(&mut self) -> Vec<pb::KernelAllocFailure> {
        std::mem::take(&mut self.failures)
    }

    fn finish_failure(&mut self) {
        if let Some(f) = self.failure.take() {
            if self.failures.len() < MAX_FAILURES {
                self.failures.push(*f);
            }
        }
    }

    /// Takes one record; returns the kill it completes, if any.
    pub fn push(&mut self, rec: &KmsgRecord) -> Option<pb::KernelOomKill> {
        let msg = rec.message.as_str();
        if let Some((task, rest)) = msg.split_once(": page allocation failure: ") {
            self.finish_failure();
            let mut f = pb::KernelAllocFailure {
                task: task.trim().to_string(),
                line: msg.chars().take(MAX_LINE_CHARS).collect(),
                kernel_time_us: rec.time_us,
                ..Default::default()
            };
            parse_alloc_failure_fields(rest, &mut f);
            self.failure = Some(Box::new(f));
        } else if let Some((invoker, rest)) = msg.split_once(" invoked oom-killer:") {
            // A new kill: one that never reached its "Killed process" (no
            // killable task was found) is dropped.
            self.finish_failure();
            self.group = None;
            let mut kill = pb::KernelOomKill {
                invoked_by: invoker.trim().to_string(),
                ..Default::default()
            };
            parse_invoked_fields(rest, &mut kill);
            self.pending = Some(Box::new(kill));
            self.keep_line(msg);
        } else if let Some(group) = msg
            .strip_prefix("Tasks in ")
            .and_then(|r| r.strip_suffix(" are going to be killed due to memory.oom.group set"))
        {
            self.group = Some(group.chars().take(MAX_LINE_CHARS).collect());
        } else if let Some(pid) = stack_pid(msg) {
            // The stack dump's header names the failing task's pid.
            if let Some(f) = self.failure.as_mut().filter(|f| f.pid == 0) {
                f.pid = pid;
            }
        } else if let Some(zone) = parse_zone_free(msg).or_else(|| parse_zone_watermarks(msg)) {
            // The failure being logged, else the kill: show_mem prints for whichever began.
            let zones = match (self.failure.as_mut(), self.pending.as_mut()) {
                (Some(f), _) => Some(&mut f.zones),
                (None, Some(p)) => Some(&mut p.zones),
                _ => None,
            };
            if let Some(zones) = zones {
                merge_zone(zones, zone);
            }
        } else if msg.trim_end().ends_with(" pages RAM") {
            // show_mem's summary follows the free lists: the failure's record is whole.
            self.finish_failure();
        } else if let Some(rest) = msg.strip_prefix("memory: usage ") {
            if let Some(p) = self.pending.as_mut() {
                if p.memcg_limit_bytes == 0 {
                    if let Some((usage, limit)) = parse_memory_usage(rest) {
                        p.memcg_usage_bytes = usage;
                        p.memcg_limit_bytes = limit;
                        self.keep_line(msg);
                    }
                }
            }
        } else if let Some(rest) = msg.strip_prefix("oom-kill:") {
            let p = self.pending.get_or_insert_with(Default::default);
            parse_oom_kill_fields(rest, p);
            self.keep_line(msg);
        } else if let Some(rest) = msg.split_once("Killed process ").map(|(_, r)| r) {
            let begun = self.pending.is_some();
            let mut kill = *self.pending.take().unwrap_or_default();
            if !begun {
                // Killed with the victim's group, not chosen.
                kill.oom_group = self.group.clone().unwrap_or_default();
            }
            if !parse_killed_process(rest, &mut kill) {
                // Not the line it looked like: keep waiting for the real one.
                self.pending = Some(Box::new(kill));
                return None;
            }
            if kill.constraint.is_empty() && msg.starts_with("Memory cgroup out of memory") {
                // Kernels before 4.19 print no oom-kill line; the prefix still says memcg.
                kill.constraint = "CONSTRAINT_MEMCG".into();
            }
            push_line(&mut kill, msg);
            kill.kernel_time_us = rec.time_us;
            return Some(kill);
        }
        None
    }

    fn keep_line(&mut self, msg: &str) {
        if let Some(p) = self.pending.as_mut() {
            push_line(p, msg);
        }
    }
}

fn push_line(kill: &mut pb::KernelOomKill, msg: &str) {
    if kill.lines.len() < MAX_LINES {
        kill.lines.push(msg.chars().take(MAX_LINE_CHARS).collect());
    }
}

/// Every kill completed by `text`, a dump of records one per line.
pub fn parse_kills(text: &str) -> Vec<pb::KernelOomKill> {
    let mut parser = OomRecordParser::new();
    parse_records(text)
        .filter_map(|r| parser.push(&r))
        .collect()
}

/// Every "page allocation failure" in `text`, a dump of records one per line.
pub fn parse_alloc_failures(text: &str) -> Vec<pb::KernelAllocFailure> {
    let mut parser = OomRecordParser::new();
    for r in parse_records(text) {
        parser.push(&r);
    }
    parser.take_alloc_failures()
}

/// ` gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0` (the flag names
/// are joined by '|', so ", " separates the fields).
fn parse_invoked_fields(rest: &str, out: &mut pb::KernelOomKill) {
    for piece in rest.split(", ") {
        match piece.trim().split_once('=') {
            Some(("gfp_mask", v)) => out.gfp_mask = v.to_string(),
            Some(("order", v)) => out.order = v.trim().parse().ok(),
            _ => {}
        }
    }
}

/// The keys of a "page allocation failure" line; as in the oom-kill line, a
/// piece that does not begin with one belongs to the previous value (a node
/// list such as "0-1,3" holds commas).
const ALLOC_FAILURE_KEYS: &[&str] = &["order", "mode", "nodemask", "cpuset", "mems_allowed"];

/// `order:4, mode:0x40dc0(GFP_KERNEL|__GFP_COMP|__GFP_ZERO), nodemask=(null),cpuset=/,mems_allowed=0`.
fn parse_alloc_failure_fields(rest: &str, out: &mut pb::KernelAllocFailure) {
    let mut fields: Vec<(&str, String)> = Vec::new();
    for piece in rest.split(',') {
        let kv = piece
            .trim_start()
            .split_once([':', '='])
            .filter(|(k, _)| ALLOC_FAILURE_KEYS.contains(k));
        match kv {
            Some((k, v)) => fields.push((k, v.to_string())),
            None => {
                if let Some((_, v)) = fields.last_mut() {
                    v.push(',');
                    v.push_str(piece);
                }
            }
        }
    }
    for (k, v) in fields {
        let v = v.trim().to_string();
        match k {
            "order" => out.order = v.parse().unwrap_or(0),
            "mode" => out.gfp_mask = v,
            "nodemask" => out.nodemask = v,
            "cpuset" => out.cpuset = v,
            "mems_allowed" => out.mems_allowed = v,
            _ => {}
        }
    }
}

/// The pid of a stack dump's header: `CPU: 3 UID: 0 PID: 4242 Comm: python3
/// Not tainted ...` (kernels before 6.10 print no UID).
fn stack_pid(msg: &str) -> Option<u32> {
    let rest = msg.strip_prefix("CPU: ")?;
    let (_, after) = rest.split_once(" PID: ")?;
    after.split_whitespace().next()?.parse().ok()
}

/// Folds one line's reading of a zone into the zone's entry: the
/// watermark line and the free-list line each fill their own fields.
fn merge_zone(zones: &mut Vec<pb::KernelZoneFree>, z: pb::KernelZoneFree) {
    let at = zones
        .iter()
        .position(|e| e.node == z.node && e.zone == z.zone);
    match at {
        Some(i) => {
            let e = &mut zones[i];
            if !z.blocks.is_empty() {
                e.blocks = z.blocks;
                e.page_bytes = z.page_bytes;
                e.free_bytes = z.free_bytes;
            }
            if z.high_bytes > 0 {
                e.min_bytes = z.min_bytes;
                e.high_bytes = z.high_bytes;
                if e.free_bytes == 0 {
                    e.free_bytes = z.free_bytes;
                }
            }
        }
        None if zones.len() < MAX_ZONES => zones.push(z),
        None => {}
    }
}

/// A zone's watermark line: `Node 0 Normal free:2449600kB boost:0kB
/// min:42256kB low:52820kB high:63384kB reserved_highatomic:0KB ...`.
fn parse_zone_watermarks(msg: &str) -> Option<pb::KernelZoneFree> {
    let rest = msg.strip_prefix("Node ")?;
    let (node, rest) = rest.split_once(' ')?;
    let (zone, rest) = rest.split_once(" free:")?;
    if zone.is_empty() || zone.contains(' ') {
        return None;
    }
    let mut out = pb::KernelZoneFree {
        node: node.parse().ok()?,
        zone: zone.to_string(),
        ..Default::default()
    };
    let mut tokens = rest.split_whitespace();
    out.free_bytes = kb_value(tokens.next()?)?;
    for t in tokens {
        match t.split_once(':') {
            Some(("min", v)) => out.min_bytes = kb_value(v)?,
            Some(("high", v)) => out.high_bytes = kb_value(v)?,
            _ => {}
        }
    }
    (out.high_bytes > 0).then_some(out)
}

/// A zone's free lists as show_mem prints them:
/// `Node 0 Normal: 1063*4kB (UME) 523*8kB (UME) 0*16kB ... = 14452kB`.
/// None for the other "Node N ..." lines (`Node 0 DMA free:...`,
/// `Node 0 active_anon:...`, the hugepages line).
fn parse_zone_free(msg: &str) -> Option<pb::KernelZoneFree> {
    let rest = msg.strip_prefix("Node ")?;
    let (node, rest) = rest.split_once(' ')?;
    let node = node.parse().ok()?;
    let (zone, lists) = rest.split_once(": ")?;
    if zone.is_empty() || zone.contains(' ') {
        return None;
    }
    let (lists, total) = lists.rsplit_once("= ")?;
    let mut out = pb::KernelZoneFree {
        node,
        zone: zone.to_string(),
        free_bytes: kb_value(total.trim())?,
        ..Default::default()
    };
    for token in lists.split_whitespace() {
        // Migration types ("(UME)") follow a non-empty count.
        if token.starts_with('(') {
            continue;
        }
        let (count, size) = token.split_once('*')?;
        let size = kb_value(size)?;
        if out.blocks.is_empty() {
            out.page_bytes = size;
        }
        if out.blocks.len() < MAX_ORDERS {
            out.blocks.push(count.parse().ok()?);
        }
    }
    (!out.blocks.is_empty()).then_some(out)
}

/// `65536kB, limit 65536kB, failcnt 76` -> (usage, limit) in bytes.
fn parse_memory_usage(rest: &str) -> Option<(u64, u64)> {
    let mut parts = rest.split(',').map(str::trim);
    let usage = kb_value(parts.next()?)?;
    let limit = kb_value(parts.next()?.strip_prefix("limit ")?)?;
    Some((usage, limit))
}

/// `65536kB` -> bytes.
fn kb_value(s: &str) -> Option<u64> {
    let n: u64 = s.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(n.saturating_mul(1024))
}

/// The keys of the oom-kill line: a piece after a comma that does not begin
/// with one of them belongs to the previous value (a cgroup path or a task
/// name may hold commas).
const OOM_KILL_KEYS: &[&str] = &[
    "constraint",
    "nodemask",
    "cpuset",
    "mems_allowed",
    "oom_memcg",
    "task_memcg",
    "task",
    "pid",
    "uid",
];

/// `constraint=CONSTRAINT_MEMCG,nodemask=(null),...,task=python3,pid=18173,uid=0`.
fn parse_oom_kill_fields(rest: &str, out: &mut pb::KernelOomKill) {
    let mut fields: Vec<(&str, String)> = Vec::new();
    for piece in rest.split(',') {
        match piece.split_once('=') {
            Some((k, v)) if OOM_KILL_KEYS.contains(&k) => fields.push((k, v.to_string())),
            // A global kill says so in place of oom_memcg=; it ends mems_allowed's list.
            None if piece == "global_oom" => fields.push(("global_oom", String::new())),
            _ => {
                if let Some((_, v)) = fields.last_mut() {
                    v.push(',');
                    v.push_str(piece);
                }
            }
        }
    }
    for (k, v) in fields {
        match k {
            "constraint" => out.constraint = v,
            "oom_memcg" => out.oom_memcg = v,
            "task_memcg" => out.task_memcg = v,
            "task" => out.task = v,
            "pid" => {
                if let Ok(p) = v.trim().parse() {
                    out.pid = p;
                }
            }
            "nodemask" => out.nodemask = v,
            "cpuset" => out.cpuset = v,
            "mems_allowed" => out.mems_allowed = v,
            _ => {}
        }
    }
}

/// `18173 (python3) total-vm:221368kB, anon-rss:65280kB, file-rss:6656kB,
/// shmem-rss:0kB, UID:0 pgtables:188kB oom_score_adj:0`. False when the
/// pid or the name is missing. The name may hold spaces and parentheses, so
/// it ends at the *last* ") " before the numbers.
fn parse_killed_process(rest: &str, out: &mut pb::KernelOomKill) -> bool {
    let Some((pid, after_pid)) = rest.split_once(' ') else {
        return false;
    };
    let Ok(pid) = pid.parse::<u32>() else {
        return false;
    };
    let Some(named) = after_pid.strip_prefix('(') else {
        return false;
    };
    let (name, figures) = match named.find(") total-vm:") {
        Some(i) => (&named[..i], &named[i + 2..]),
        None => match named.rfind(')') {
            Some(i) => (&named[..i], &named[i + 1..]),
            None => return false,
        },
    };
    out.pid = pid;
    out.task = name.to_string();
    for token in figures.split([',', ' ']).filter(|t| !t.is_empty()) {
        let Some((k, v)) = token.split_once(':') else {
            continue;
        };
        match k {
            "total-vm" => set_kb(&mut out.total_vm_bytes, v),
            "anon-rss" => set_kb(&mut out.anon_rss_bytes, v),
            "file-rss" => set_kb(&mut out.file_rss_bytes, v),
            "shmem-rss" => set_kb(&mut out.shmem_rss_bytes, v),
            "oom_score_adj" => {
                if let Ok(a) = v.parse() {
                    out.oom_score_adj = a;
                }
            }
            _ => {}
        }
    }
    true
}

fn set_kb(field: &mut u64, v: &str) {
    if let Some(b) = kb_value(v) {
        *field = b;
    }
}

/// The farthest back a record's own stamp may place it from when it was
/// read: beyond this the kernel's clock and ours disagree (a VM's
/// sched_clock can drift from CLOCK_MONOTONIC), and the read time is used.
pub const MAX_RECORD_AGE_NS: i64 = 60_000_000_000;

/// When the kernel logged a record stamped `kernel_time_us` (its
/// microseconds since boot), on the wall clock, given the wall and
/// monotonic clocks read now. Not the time it was read: a reader polling
/// on a loaded machine can read a kill a second or more late, past the
/// second within which the analysis takes a request that ended as the one
/// the death broke. The read time where the stamp is in the future or older
/// than [`MAX_RECORD_AGE_NS`].
pub fn logged_at_ns(kernel_time_us: u64, now_ns: i64, monotonic_now_ns: i64) -> i64 {
    let age = monotonic_now_ns.saturating_sub((kernel_time_us as i64).saturating_mul(1000));
    if (0..=MAX_RECORD_AGE_NS).contains(&age) {
        now_ns - age
    } else {
        now_ns
    }
}

/// [`logged_at_ns`] with the clocks read now.
pub fn logged_at_now(kernel_time_us: u64) -> i64 {
    logged_at_ns(kernel_time_us, crate::now_ns(), monotonic_ns())
}

/// CLOCK_MONOTONIC, the clock /dev/kmsg's stamps count (since boot, without
/// suspend), in nanoseconds; 0 where it cannot be read.
pub fn monotonic_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write into.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec)
}

/// Reads the OOM kills the kernel logs from now on. `Unavailable` where the
/// log cannot be read (EACCES/EPERM in an unprivileged container, or not
/// Linux): the evidence then says why, once, instead of guessing.
#[derive(Debug)]
pub enum KmsgReader {
    Open {
        file: File,
        parser: OomRecordParser,
        buf: Vec<u8>,
    },
    Unavailable(String),
}

impl KmsgReader {
    /// Opens /dev/kmsg at its end: kills logged before now are not ours to report.
    pub fn open() -> Self {
        Self::open_path(KMSG_PATH)
    }

    /// As `open`, for another kmsg-like device.
    pub fn open_path(path: &str) -> Self {
        match open_at_end(path) {
            Ok(file) => KmsgReader::Open {
                file,
                parser: OomRecordParser::new(),
                buf: vec![0; READ_BUFFER_BYTES],
            },
            Err(e) => KmsgReader::Unavailable(format!("{path}: {e}")),
        }
    }

    /// Why the log cannot be read; None when it can.
    pub fn unavailable(&self) -> Option<&str> {
        match self {
            KmsgReader::Open { .. } => None,
            KmsgReader::Unavailable(r) => Some(r),
        }
    }

    /// "readable", or "unreadable: <reason>": what the evidence says about
    /// the kernel's log.
    pub fn describe(&self) -> String {
        match self.unavailable() {
            None => "readable".into(),
            Some(r) => format!("unreadable: {r}"),
        }
    }

    /// True while a kill has been read in part.
    pub fn has_pending(&self) -> bool {
        matches!(self, KmsgReader::Open { parser, .. } if parser.has_pending())
    }

    /// The "page allocation failure" records read by `read_new` so far; with
    /// `all`, also one whose free lists are still coming (at a process's end).
    pub fn take_alloc_failures(&mut self, all: bool) -> Vec<pb::KernelAllocFailure> {
        match self {
            KmsgReader::Open { parser, .. } if all => parser.take_alloc_failures(),
            KmsgReader::Open { parser, .. } => parser.take_completed_alloc_failures(),
            KmsgReader::Unavailable(_) => Vec::new(),
        }
    }

    /// The kills completed by the records logged since the last call. Never
    /// blocks. Records the kernel overwrote before they were read (EPIPE)
    /// are skipped; any other error ends this call, not the reader.
    pub fn read_new(&mut self) -> Vec<pb::KernelOomKill> {
        let KmsgReader::Open { file, parser, buf } = self else {
            return Vec::new();
        };
        let mut kills = Vec::new();
        for _ in 0..MAX_RECORDS_PER_READ {
            match file.read(buf) {
                Ok(0) => break,
                Ok(n) => {
                    let text = String::from_utf8_lossy(&buf[..n]);
                    if let Some(kill) = parse_record(&text).and_then(|r| parser.push(&r)) {
                        kills.push(kill);
                    }
                }
                Err(e) => match e.raw_os_error() {
                    // Nothing new.
                    Some(libc::EAGAIN) => break,
                    // Overwritten before we read them: the next read goes on
                    // from the oldest record still there.
                    Some(libc::EPIPE) => continue,
                    Some(libc::EINTR) => continue,
                    // EINVAL (a record larger than the buffer) and anything
                    // else: stop here; the next call tries again.
                    _ => {
                        tracing::debug!("reading {KMSG_PATH}: {e}");
                        break;
                    }
                },
            }
        }
        kills
    }
}

#[cfg(target_os = "linux")]
fn open_at_end(path: &str) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::io::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    // SAFETY: lseek on a descriptor we own. On /dev/kmsg, SEEK_END moves the
    // reader past every record logged so far.
    if unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_END) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

#[cfg(not(target_os = "linux"))]
fn open_at_end(_path: &str) -> std::io::Result<File> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "the kernel log is read only on Linux",
    ))
}
