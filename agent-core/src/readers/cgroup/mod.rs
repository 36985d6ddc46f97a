//! The memory cgroup domain, v1 and v2: where the pid's memory controller
//! is, each level from the pid's own up to the mount root, and which level
//! owns the tightest limit.

mod level;
mod locate;

pub use level::{
    parse_v1_oom_control, parse_v1_stat, parse_v2_events, parse_v2_events_local, parse_v2_max,
    parse_v2_stat, read_level, read_level_in, refresh_counters, refresh_counters_in, v1_limit,
    LevelDir, LEVEL_DIR_DESCRIPTORS,
};
pub use locate::{
    locate, parse_mountinfo, parse_mounts, parse_proc_cgroup, CgroupLine, CgroupMount,
};

use std::path::PathBuf;

use crate::pb;

/// Where cgroup filesystems are mounted on a normal host.
pub const SYSTEM_CGROUP_ROOT: &str = "/sys/fs/cgroup";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

impl Version {
    /// The file holding a level's current usage in bytes.
    pub fn usage_file(self) -> &'static str {
        match self {
            Version::V1 => "memory.usage_in_bytes",
            Version::V2 => "memory.current",
        }
    }

    /// As the proto spells it: "v1" or "v2".
    pub fn as_str(self) -> &'static str {
        match self {
            Version::V1 => "v1",
            Version::V2 => "v2",
        }
    }
}

/// Where the *memory* controller of a pid lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryCgroup {
    pub version: Version,
    /// As /proc/<pid>/cgroup names it, e.g. "/process_api/abc".
    pub path: String,
    /// Its directory on disk.
    pub dir: PathBuf,
    /// The directory of the mount that holds it (re-rooted under `HostPaths::cgroup_root`).
    pub mount: PathBuf,
    /// The cgroup path that the mount shows at its top ("/" unless the mount
    /// holds only a subtree, as inside some containers).
    pub mount_root: String,
}

/// The pid's own level first, then each ancestor up to the mount root (the
/// root level included when its files exist; on v2 it lacks memory.max and
/// memory.current, so it reads `partial`).
pub fn read_levels(_paths: &crate::readers::HostPaths, cg: &MemoryCgroup) -> Vec<pb::CgroupLevel> {
    // `_paths` is kept for symmetry with the other readers: `cg` already holds resolved directories.
    level_dirs(cg)
        .iter()
        .map(|(dir, path)| read_level(dir, path, cg.version))
        .collect()
}

/// `last` (a `read_levels` of the same cgroup) with each level's usage read
/// again: one file a level instead of six or more. What else a level says
/// (limits, stat, events) changes slowly or only matters at an event, and a
/// full reading follows within the sampling interval. None when `last` is
/// not this cgroup's levels (empty, or the hierarchy changed), so the caller
/// reads them whole.
pub fn refresh_usage(cg: &MemoryCgroup, last: &[pb::CgroupLevel]) -> Option<Vec<pb::CgroupLevel>> {
    let dirs = level_dirs(cg);
    if dirs.len() != last.len() || dirs.iter().zip(last).any(|((_, p), l)| *p != l.path) {
        return None;
    }
    let levels = dirs
        .iter()
        .zip(last)
        .map(|((dir, _), l)| {
            let usage = crate::readers::text::read_opt(&dir.join(cg.version.usage_file()))
                .as_deref()
                .and_then(crate::readers::text::first_u64);
            pb::CgroupLevel {
                usage_bytes: usage.unwrap_or(0),
                partial: l.partial || usage.is_none(),
                ..l.clone()
            }
        })
        .collect();
    Some(levels)
}

/// Each level's directory and cgroup path, the pid's own first.
fn level_dirs(cg: &MemoryCgroup) -> Vec<(PathBuf, String)> {
    let mut levels = vec![(cg.dir.clone(), cg.path.clone())];
    if !cg.dir.starts_with(&cg.mount) {
        return levels;
    }
    let mut dir = cg.dir.clone();
    let mut path = cg.path.clone();
    while dir != cg.mount {
        if !dir.pop() {
            break;
        }
        path = parent_path(&path);
        if dir == cg.mount {
            // Normally path == mount_root here; name the level as the mount shows it.
            if dir.join("memory.stat").exists() {
                levels.push((dir.clone(), cg.mount_root.clone()));
            }
            break;
        }
        levels.push((dir.clone(), path.clone()));
    }
    levels
}

/// "/a/b" -> "/a", "/a" -> "/", "/" -> "/".
fn parent_path(path: &str) -> String {
    match path.trim_end_matches('/').rfind('/') {
        Some(0) | None => "/".to_string(),
        Some(i) => path[..i].to_string(),
    }
}

/// The version and path of `cg`, the tightest limit among `levels` and the
/// level that owns it. On a tie the deeper level (earlier in `levels`) owns it.
pub fn info(levels: &[pb::CgroupLevel], cg: &MemoryCgroup) -> pb::CgroupInfo {
    let owner =
        levels
            .iter()
            .filter(|l| l.limit_bytes > 0)
            .fold(None::<&pb::CgroupLevel>, |best, l| match best {
                Some(b) if b.limit_bytes <= l.limit_bytes => Some(b),
                _ => Some(l),
            });
    pb::CgroupInfo {
        version: cg.version.as_str().to_string(),
        path: cg.path.clone(),
        limit_bytes: owner.map_or(0, |l| l.limit_bytes),
        limit_owner: owner.map(|l| l.path.clone()).unwrap_or_default(),
    }
}
