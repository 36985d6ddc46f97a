//! One level of the memory cgroup hierarchy, v1 or v2 files.

use std::path::Path;

use super::Version;
use crate::pb;
use crate::readers::system::parse_pressure;
use crate::readers::text::{first_u64, key_values, open_at, pread_text, read_at, read_opt};

/// v1 writes PAGE_COUNTER_MAX rounded to pages (9223372036854771712) for
/// "no limit"; anything this large cannot be a real limit.
const V1_UNLIMITED_FLOOR: u64 = 1 << 60;

/// Reads the level's files. A missing or garbled required file leaves its
/// fields 0 and sets `partial`; optional files (peak, swap, memsw, PSI) that
/// kernels may lack leave fields 0 silently.
pub fn read_level(dir: &Path, path: &str, version: Version) -> pb::CgroupLevel {
    read_level_files(
        LevelFiles {
            dir,
            handle: None,
            held: &[],
            partial: false,
        },
        path,
        version,
    )
}

/// A cgroup directory held open, for a watcher that reads it every sweep:
/// its files are opened relative to it (see `text::read_at`), and the
/// counter files [`refresh_counters_in`] reads are held open themselves and
/// read from offset 0 (see `text::pread_text`): a sweep's reading of a
/// cgroup is three `pread`s, with no open or close.
#[derive(Debug)]
pub struct LevelDir {
    path: std::path::PathBuf,
    /// None when it could not be opened: its files are read by path.
    handle: Option<std::fs::File>,
    /// The counter files by name; one that could not be opened is read by
    /// name like any other.
    held: Vec<(&'static str, std::fs::File)>,
}

/// The descriptors a [`LevelDir`] holds at most: the directory and its
/// three counter files.
pub const LEVEL_DIR_DESCRIPTORS: usize = 1 + 3;

impl LevelDir {
    pub fn open(path: &Path, version: Version) -> LevelDir {
        let handle = std::fs::File::open(path).ok();
        let held = handle.as_ref().map_or_else(Vec::new, |dir| {
            counter_files(version)
                .into_iter()
                .filter_map(|name| Some((name, open_at(dir, name)?)))
                .collect()
        });
        LevelDir {
            path: path.to_path_buf(),
            handle,
            held,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory's link count: on a cgroup filesystem (kernfs), as on
    /// tmpfs, 2 plus its subdirectories, so an unchanged count says no child
    /// cgroup was made or removed (without listing the directory). None
    /// when it is not held.
    pub fn links(&self) -> Option<u64> {
        use std::os::unix::fs::MetadataExt;
        Some(self.handle.as_ref()?.metadata().ok()?.nlink())
    }

    fn files(&self) -> LevelFiles<'_> {
        LevelFiles {
            dir: &self.path,
            handle: self.handle.as_ref(),
            held: &self.held,
            partial: false,
        }
    }
}

/// The files that move with a kill, in the order [`refresh_counters`] reads them.
fn counter_files(version: Version) -> [&'static str; 3] {
    match version {
        Version::V1 => [
            Version::V1.usage_file(),
            "memory.failcnt",
            "memory.oom_control",
        ],
        Version::V2 => [
            Version::V2.usage_file(),
            "memory.events",
            "memory.events.local",
        ],
    }
}

/// [`read_level`] of a directory held open.
pub fn read_level_in(dir: &LevelDir, path: &str, version: Version) -> pb::CgroupLevel {
    read_level_files(dir.files(), path, version)
}

fn read_level_files(mut files: LevelFiles, path: &str, version: Version) -> pb::CgroupLevel {
    let mut level = pb::CgroupLevel {
        path: path.to_string(),
        version: version.as_str().to_string(),
        ..Default::default()
    };
    match version {
        Version::V1 => read_v1(&mut files, &mut level),
        Version::V2 => read_v2(&mut files, &mut level),
    }
    level.partial = files.partial;
    level
}

/// `last` (a [`read_level`] of the same directory) with what a kill moves
/// read again: the usage and the OOM counters (v1 `memory.failcnt` and
/// `memory.oom_control`, v2 `memory.events` and `memory.events.local`),
/// three files instead of seven to eleven. A watcher of hundreds of cgroups
/// reads them whole only every so often: limits, peaks and the stat
/// breakdown change slowly, and a kill is seen by these.
pub fn refresh_counters(dir: &Path, last: &pb::CgroupLevel, version: Version) -> pb::CgroupLevel {
    refresh_files(
        LevelFiles {
            dir,
            handle: None,
            held: &[],
            partial: false,
        },
        last,
        version,
    )
}

/// [`refresh_counters`] of a directory held open.
pub fn refresh_counters_in(
    dir: &LevelDir,
    last: &pb::CgroupLevel,
    version: Version,
) -> pb::CgroupLevel {
    refresh_files(dir.files(), last, version)
}

fn refresh_files(
    mut files: LevelFiles,
    last: &pb::CgroupLevel,
    version: Version,
) -> pb::CgroupLevel {
    let mut level = last.clone();
    let [usage, second, third] = counter_files(version);
    level.usage_bytes = files.number(usage, first_u64);
    match version {
        Version::V1 => {
            level.failcnt = files.number(second, first_u64);
            if let Some(t) = files.required(third) {
                parse_v1_oom_control(&t, &mut level);
            }
        }
        Version::V2 => {
            if let Some(t) = files.required(second) {
                parse_v2_events(&t, &mut level);
            }
            if let Some(t) = files.required(third) {
                parse_v2_events_local(&t, &mut level);
            }
        }
    }
    level.partial = files.partial;
    level
}

struct LevelFiles<'a> {
    dir: &'a Path,
    /// `dir` held open: files are opened relative to it.
    handle: Option<&'a std::fs::File>,
    /// Files held open, read from offset 0.
    held: &'a [(&'static str, std::fs::File)],
    partial: bool,
}

impl LevelFiles<'_> {
    fn required(&mut self, name: &str) -> Option<String> {
        let text = self.optional(name);
        self.partial |= text.is_none();
        text
    }

    fn optional(&self, name: &str) -> Option<String> {
        if let Some((_, file)) = self.held.iter().find(|(held, _)| *held == name) {
            return pread_text(file);
        }
        match self.handle {
            Some(dir) => read_at(dir, name),
            None => read_opt(&self.dir.join(name)),
        }
    }

    /// A required single-number file, parsed by `parse`; garbled counts as missing.
    fn number(&mut self, name: &str, parse: fn(&str) -> Option<u64>) -> u64 {
        let value = self.required(name).map(|t| parse(&t));
        match value {
            Some(Some(v)) => v,
            Some(None) => {
                self.partial = true;
                0
            }
            None => 0,
        }
    }
}

fn read_v1(files: &mut LevelFiles, level: &mut pb::CgroupLevel) {
    let limit_raw = files.number("memory.limit_in_bytes", first_u64);
    level.limit_bytes = v1_limit(limit_raw);
    level.usage_bytes = files.number(Version::V1.usage_file(), first_u64);
    level.peak_bytes = files.number("memory.max_usage_in_bytes", first_u64);
    level.failcnt = files.number("memory.failcnt", first_u64);
    if let Some(t) = files.required("memory.oom_control") {
        parse_v1_oom_control(&t, level);
    }
    if let Some(t) = files.required("memory.stat") {
        parse_v1_stat(&t, level);
    }
    // memsw files exist only with swap accounting on.
    if let Some(memsw) = files
        .optional("memory.memsw.limit_in_bytes")
        .as_deref()
        .and_then(first_u64)
    {
        // memsw bounds memory plus swap; at the same value as the memory
        // limit it leaves no room to swap (Some(0), not "unlimited").
        if v1_limit(memsw) != 0 {
            level.swap_limit_bytes = Some(memsw.saturating_sub(limit_raw));
        }
    }
}

fn read_v2(files: &mut LevelFiles, level: &mut pb::CgroupLevel) {
    level.limit_bytes = files.number("memory.max", parse_v2_max);
    level.usage_bytes = files.number(Version::V2.usage_file(), first_u64);
    level.high_bytes = files.number("memory.high", parse_v2_max);
    // memory.peak arrived in Linux 5.19.
    level.peak_bytes = files
        .optional("memory.peak")
        .as_deref()
        .and_then(first_u64)
        .unwrap_or(0);
    if let Some(t) = files.required("memory.events") {
        parse_v2_events(&t, level);
    }
    if let Some(t) = files.required("memory.events.local") {
        parse_v2_events_local(&t, level);
    }
    if let Some(t) = files.required("memory.stat") {
        parse_v2_stat(&t, level);
    }
    // memory.oom.group arrived in Linux 4.19.
    level.oom_group = files
        .optional("memory.oom.group")
        .as_deref()
        .and_then(first_u64)
        .is_some_and(|v| v == 1);
    // The swap files are absent without swap accounting, PSI without CONFIG_PSI.
    level.swap_bytes = files
        .optional("memory.swap.current")
        .as_deref()
        .and_then(first_u64)
        .unwrap_or(0);
    // "max" (no number) is unlimited: None; "0" forbids swap: Some(0).
    level.swap_limit_bytes = files
        .optional("memory.swap.max")
        .as_deref()
        .and_then(first_u64);
    level.pressure = files
        .optional("memory.pressure")
        .map(|t| parse_pressure(&t));
}

/// A v1 limit in bytes, with the "no limit" sentinel mapped to 0.
pub fn v1_limit(raw: u64) -> u64 {
    if raw >= V1_UNLIMITED_FLOOR {
        0
    } else {
        raw
    }
}

/// A v2 `memory.max`/`memory.high`/`memory.swap.max` value: "max" = 0 (unlimited).
pub fn parse_v2_max(text: &str) -> Option<u64> {
    match text.split_whitespace().next()? {
        "max" => Some(0),
        v => v.parse().ok(),
    }
}

/// v1 `memory.oom_control`: `oom_kill` counts victims in this very cgroup.
pub fn parse_v1_oom_control(text: &str, level: &mut pb::CgroupLevel) {
    for (key, value) in key_values(text) {
        match key {
            "oom_kill" => level.oom_control_oom_kill = value,
            "under_oom" => level.under_oom = value != 0,
            _ => {}
        }
    }
}

/// v1 `memory.stat`. The `total_*` keys are hierarchical like `usage_in_bytes`
/// (and like v2's memory.stat), so they win over the local keys when present.
/// v1 calls anonymous memory `rss` and page cache `cache`.
pub fn parse_v1_stat(text: &str, level: &mut pb::CgroupLevel) {
    let mut saw_total = std::collections::HashSet::new();
    // The key first: seven of its fifty-odd lines are used, and only their
    // values are parsed.
    for line in text.lines() {
        let mut it = line.split_whitespace();
        let Some(key) = it.next() else { continue };
        let (name, is_total) = match key.strip_prefix("total_") {
            Some(name) => (name, true),
            None => (key, false),
        };
        let field = match name {
            "rss" => &mut level.anon_bytes,
            "cache" => &mut level.file_bytes,
            "shmem" => &mut level.shmem_bytes,
            "swap" => &mut level.swap_bytes,
            "workingset_refault_anon" => &mut level.workingset_refault_anon,
            "workingset_refault_file" => &mut level.workingset_refault_file,
            "pgmajfault" => &mut level.pgmajfault,
            _ => continue,
        };
        let Some(value) = it.next().and_then(|v| v.parse().ok()) else {
            continue;
        };
        if is_total {
            saw_total.insert(name);
            *field = value;
        } else if !saw_total.contains(name) {
            *field = value;
        }
    }
}

/// v2 `memory.stat` (hierarchical).
pub fn parse_v2_stat(text: &str, level: &mut pb::CgroupLevel) {
    for (key, value) in key_values(text) {
        match key {
            "anon" => level.anon_bytes = value,
            "file" => level.file_bytes = value,
            "shmem" => level.shmem_bytes = value,
            "workingset_refault_anon" => level.workingset_refault_anon = value,
            "workingset_refault_file" => level.workingset_refault_file = value,
            "pgmajfault" => level.pgmajfault = value,
            _ => {}
        }
    }
}

/// v2 `memory.events` (hierarchical: counts this level and its descendants).
pub fn parse_v2_events(text: &str, level: &mut pb::CgroupLevel) {
    for (key, value) in key_values(text) {
        match key {
            "high" => level.events_high = value,
            "max" => level.events_max = value,
            "oom" => level.events_oom = value, // vocab: memory.events' key
            "oom_kill" => level.events_oom_kill = value,
            "oom_group_kill" => level.events_oom_group_kill = value,
            _ => {}
        }
    }
}

/// v2 `memory.events.local` (this level only).
pub fn parse_v2_events_local(text: &str, level: &mut pb::CgroupLevel) {
    for (key, value) in key_values(text) {
        match key {
            "oom" => level.local_oom = value, // vocab: memory.events' key
            "oom_kill" => level.local_oom_kill = value,
            _ => {}
        }
    }
}
