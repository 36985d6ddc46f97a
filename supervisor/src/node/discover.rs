//! Which memory cgroups a root holds: the hierarchy (v1's memory mount or
//! v2's unified one) found from the root given, each cgroup's path as the
//! kernel names it (relative to its mount, as in the OOM record's
//! `task_memcg=`), bounded by a cap.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use oomscope_agent_core::readers::cgroup::Version;

/// The file every v1 memory cgroup has (the root too).
const V1_MARKER: &str = "memory.oom_control";
/// The file every v2 cgroup with the memory controller has (not the root).
const V2_MARKER: &str = "memory.events";
/// The file every v2 cgroup has, the root too.
const V2_ANY: &str = "cgroup.controllers";

/// The hierarchy to watch: where its cgroups are on disk and how the kernel names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    pub version: Version,
    /// The directory the watch starts at (the root given, or its memory mount).
    pub top: PathBuf,
    /// The mount holding it: paths are named relative to it.
    pub mount: PathBuf,
}

/// One memory cgroup found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub dir: PathBuf,
    /// As the kernel names it: "/kubepods/pod.../<id>".
    pub path: String,
}

impl Hierarchy {
    /// The memory hierarchy at or under `root`: `root` itself when it is a
    /// memory cgroup (a subtree), else a v1 host's `root/memory`, else a v2
    /// host's `root`. None when `root` holds no memory controller.
    pub fn find(root: &Path) -> Option<Hierarchy> {
        let at = |top: PathBuf, version: Version| {
            let marker = match version {
                Version::V1 => V1_MARKER,
                Version::V2 => V2_ANY,
            };
            let mount = mount_of(&top, marker);
            Some(Hierarchy {
                version,
                top,
                mount,
            })
        };
        if root.join(V1_MARKER).exists() {
            return at(root.to_path_buf(), Version::V1);
        }
        if root.join("memory").join(V1_MARKER).exists() {
            return at(root.join("memory"), Version::V1);
        }
        let controllers = std::fs::read_to_string(root.join(V2_ANY)).ok()?;
        controllers
            .split_whitespace()
            .any(|c| c == "memory")
            .then(|| at(root.to_path_buf(), Version::V2))?
    }

    /// The memory cgroups from the top down (breadth first, so a cap keeps
    /// the upper levels), at most `max`; the second value is true when the
    /// cap left some out. Every directory is listed.
    pub fn discover(&self, max: usize) -> (Vec<Found>, bool) {
        self.discover_with(max, &mut Listings::default(), &HashMap::new())
    }

    /// [`discover`](Self::discover) that lists again only what may have
    /// changed: `links` holds the link count, read now, of each watched
    /// cgroup's directory (held open), and a directory whose count is the
    /// one it had when `listings` took its subdirectories, all of them
    /// still watched, has the same subdirectories (a cgroup filesystem
    /// counts them in its links). A walk of 200 unchanged cgroups is then
    /// 200 `fstat`s, not 200 directory listings and marker lookups.
    pub fn discover_with(
        &self,
        max: usize,
        listings: &mut Listings,
        links: &HashMap<PathBuf, u64>,
    ) -> (Vec<Found>, bool) {
        let marker = match self.version {
            Version::V1 => V1_MARKER,
            Version::V2 => V2_MARKER,
        };
        let mut found = Vec::new();
        let mut queue = std::collections::VecDeque::from([self.top.clone()]);
        let mut capped = false;
        let mut walked = HashMap::new();
        while let Some(dir) = queue.pop_front() {
            let now = links.get(&dir).copied();
            // A watched directory is a memory cgroup; any other is asked.
            if now.is_some() || dir.join(marker).exists() {
                if found.len() >= max {
                    capped = true;
                    break;
                }
                found.push(Found {
                    path: path_under(&self.mount, &dir),
                    dir: dir.clone(),
                });
            }
            let kept = listings.0.remove(&dir).filter(|l| {
                now.is_some_and(|n| n == l.links) && l.subdirs.iter().all(|d| links.contains_key(d))
            });
            let listing = match kept {
                Some(l) => l,
                None => match list_subdirs(&dir) {
                    Some(subdirs) => Listing {
                        // Unheld (not watched): listed at every walk.
                        links: now.unwrap_or(0),
                        subdirs,
                    },
                    None => continue,
                },
            };
            queue.extend(listing.subdirs.iter().cloned());
            if now.is_some() {
                walked.insert(dir, listing);
            }
        }
        // Only the directories of this walk: the cache stays as large as the tree.
        listings.0 = walked;
        (found, capped)
    }
}

/// The subdirectories of the directories a walk listed, by directory, with
/// the link count each had then: what the next walk may reuse.
#[derive(Debug, Default)]
pub struct Listings(HashMap<PathBuf, Listing>);

#[derive(Debug)]
struct Listing {
    links: u64,
    subdirs: Vec<PathBuf>,
}

/// `dir`'s subdirectories, sorted; None when it cannot be listed.
fn list_subdirs(dir: &Path) -> Option<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).ok()?;
    let mut subdirs: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    subdirs.sort();
    Some(subdirs)
}

/// The cgroup path of `dir` on the mount at `mount`: "/" + the rest.
pub fn path_under(mount: &Path, dir: &Path) -> String {
    let rel = dir.strip_prefix(mount).unwrap_or(dir);
    format!("/{}", rel.to_string_lossy().trim_matches('/'))
}

/// The top of the cgroup mount holding `dir`: the highest ancestor on the
/// same filesystem that still has `marker` (each cgroup mount is its own
/// filesystem, and the directory above it has no cgroup files).
fn mount_of(dir: &Path, marker: &str) -> PathBuf {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev()).ok();
    let own = dev(&dir);
    let mut top = dir.clone();
    while let Some(parent) = top.parent() {
        if dev(parent) != own || !parent.join(marker).exists() {
            break;
        }
        top = parent.to_path_buf();
    }
    top
}
