//! Finding the memory controller of a pid: `/proc/<pid>/cgroup` says which
//! hierarchy and path, mountinfo says where that hierarchy is mounted.
//!
//! Detection is per controller, because hosts can be hybrid: a v1 `memory`
//! hierarchy beside a cgroup2 mount without the memory controller, while
//! `/proc/<pid>/cgroup` still shows a `0::/` line.

use std::path::{Path, PathBuf};

use super::{MemoryCgroup, Version, SYSTEM_CGROUP_ROOT};
use crate::readers::text::read_opt;
use crate::readers::HostPaths;

/// One line of `/proc/<pid>/cgroup`: `hierarchy-id:controllers:path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupLine {
    pub hierarchy: String,
    /// Empty for the v2 line (`0::/path`).
    pub controllers: Vec<String>,
    pub path: String,
}

/// A cgroup or cgroup2 filesystem mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupMount {
    /// "cgroup" (v1) or "cgroup2".
    pub fstype: String,
    /// The cgroup that is mounted there (mountinfo field 4); "/" from /proc/mounts.
    pub root: String,
    pub mount_point: PathBuf,
    /// Mount and superblock options together (v1 names its controllers here).
    pub options: Vec<String>,
}

/// Parses `/proc/<pid>/cgroup`; malformed lines are skipped.
pub fn parse_proc_cgroup(text: &str) -> Vec<CgroupLine> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let hierarchy = parts.next()?.trim().to_string();
            let controllers = parts.next()?;
            let path = parts.next()?.trim().to_string();
            if hierarchy.is_empty() || path.is_empty() {
                return None;
            }
            let controllers = controllers
                .split(',')
                .filter(|c| !c.is_empty())
                .map(str::to_string)
                .collect();
            Some(CgroupLine {
                hierarchy,
                controllers,
                path,
            })
        })
        .collect()
}

/// The cgroup mounts of a `/proc/<pid>/mountinfo` text:
/// `id parent maj:min root mount_point opts [optional...] - fstype source super_opts`.
pub fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split_whitespace().collect();
            let mut right = right.split_whitespace();
            let fstype = right.next()?;
            if fstype != "cgroup" && fstype != "cgroup2" {
                return None;
            }
            let _source = right.next();
            let super_opts = right.next().unwrap_or("");
            let (root, mount_point, opts) =
                (left.get(3)?, left.get(4)?, left.get(5).unwrap_or(&""));
            Some(CgroupMount {
                fstype: fstype.to_string(),
                root: unescape(root),
                mount_point: PathBuf::from(unescape(mount_point)),
                options: split_opts(opts).chain(split_opts(super_opts)).collect(),
            })
        })
        .collect()
}

/// The cgroup mounts of a `/proc/mounts` text (`source mount_point fstype opts 0 0`).
/// It has no root field, so the mount is taken to hold the whole hierarchy.
pub fn parse_mounts(text: &str) -> Vec<CgroupMount> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let fstype = *f.get(2)?;
            if fstype != "cgroup" && fstype != "cgroup2" {
                return None;
            }
            Some(CgroupMount {
                fstype: fstype.to_string(),
                root: "/".to_string(),
                mount_point: PathBuf::from(unescape(f.get(1)?)),
                options: split_opts(f.get(3).unwrap_or(&"")).collect(),
            })
        })
        .collect()
}

fn split_opts(opts: &str) -> impl Iterator<Item = String> + '_ {
    opts.split(',')
        .filter(|o| !o.is_empty())
        .map(str::to_string)
}

/// Undoes the kernel's octal escapes in mount fields (`\040` for a space).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|o| o.iter().all(|b| (b'0'..=b'7').contains(b)));
        if let (b'\\', Some(o)) = (bytes[i], octal) {
            let value = (o[0] - b'0') as u32 * 64 + (o[1] - b'0') as u32 * 8 + (o[2] - b'0') as u32;
            if let Ok(b) = u8::try_from(value) {
                out.push(b);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Where the memory controller of `pid` lives, or None when there is none
/// (non-Linux, a container without one, a pid that is gone).
pub fn locate(paths: &HostPaths, pid: u32) -> Option<MemoryCgroup> {
    let lines = parse_proc_cgroup(&read_opt(&paths.pid_file(pid, "cgroup"))?);
    let mounts = read_mounts(paths, pid);

    // v1: the hierarchy that names `memory` wins over the v2 line.
    if let Some(line) = lines
        .iter()
        .find(|l| l.hierarchy != "0" && l.controllers.iter().any(|c| c == "memory"))
    {
        let mount = mounts
            .iter()
            .find(|m| m.fstype == "cgroup" && m.options.iter().any(|o| o == "memory"));
        if let Some(mount) = mount {
            return Some(build(paths, Version::V1, &line.path, mount));
        }
    }
    // v2: only where a cgroup2 mount actually carries the memory controller.
    let line = lines
        .iter()
        .find(|l| l.hierarchy == "0" && l.controllers.is_empty())?;
    mounts
        .iter()
        .filter(|m| m.fstype == "cgroup2")
        .find(|m| {
            read_opt(&rebase(paths, &m.mount_point).join("cgroup.controllers"))
                .is_some_and(|t| t.split_whitespace().any(|c| c == "memory"))
        })
        .map(|mount| build(paths, Version::V2, &line.path, mount))
}

/// The pid's view of the mounts: mountinfo (has the root field) first, then
/// its mounts, then the host's.
fn read_mounts(paths: &HostPaths, pid: u32) -> Vec<CgroupMount> {
    if let Some(t) = read_opt(&paths.pid_file(pid, "mountinfo")) {
        return parse_mountinfo(&t);
    }
    read_opt(&paths.pid_file(pid, "mounts"))
        .or_else(|| read_opt(&paths.proc_root.join("mounts")))
        .map(|t| parse_mounts(&t))
        .unwrap_or_default()
}

/// Mount points under the real cgroup root are re-rooted at `paths.cgroup_root`.
fn rebase(paths: &HostPaths, mount_point: &Path) -> PathBuf {
    match mount_point.strip_prefix(SYSTEM_CGROUP_ROOT) {
        Ok(rest) if rest.as_os_str().is_empty() => paths.cgroup_root.clone(),
        Ok(rest) => paths.cgroup_root.join(rest),
        Err(_) => mount_point.to_path_buf(),
    }
}

/// Maps the cgroup path onto the mount: the mount holds the cgroup `mount.root`,
/// so the directory is the mount point plus what follows that root.
fn build(paths: &HostPaths, version: Version, path: &str, mount: &CgroupMount) -> MemoryCgroup {
    let mount_dir = rebase(paths, &mount.mount_point);
    let root = mount.root.trim_end_matches('/');
    let rel = match path.strip_prefix(root) {
        Some(rest) if root.is_empty() || rest.is_empty() || rest.starts_with('/') => rest,
        // The path lies outside the mounted subtree (a cgroup namespace seen
        // from outside): the best guess is that it is relative to the mount.
        _ => path,
    };
    let rel = rel.trim_start_matches('/');
    let dir = if rel.is_empty() {
        mount_dir.clone()
    } else {
        mount_dir.join(rel)
    };
    MemoryCgroup {
        version,
        path: path.to_string(),
        dir,
        mount: mount_dir,
        mount_root: if root.is_empty() {
            "/".to_string()
        } else {
            root.to_string()
        },
    }
}
