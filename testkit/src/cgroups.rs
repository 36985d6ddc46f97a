//! Memory cgroups a test makes for itself, under the test's own memory
//! cgroup (we run as root), and removes afterwards. The own cgroup is found
//! from /proc/self, independently of the agent's readers under test.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// A memory cgroup made for one test under the test's own memory cgroup, and
/// removed afterwards (after its processes have ended).
pub struct TestCgroup {
    pub dir: PathBuf,
    /// The path as /proc/<pid>/cgroup names it.
    pub path: String,
    pub version: &'static str,
}

impl TestCgroup {
    /// Our own memory cgroup: (directory, path, version). None without a
    /// memory controller.
    pub fn own() -> Option<(PathBuf, String, &'static str)> {
        let (dir, path, version) = own_memory_cgroup()?;
        dir.exists().then_some((dir, path, version))
    }

    /// A child of `parent` (or of our own cgroup) with an optional limit;
    /// its name is `name` and our pid, so tests running at once never share one.
    pub fn create(parent: Option<&TestCgroup>, name: &str, limit: Option<u64>) -> TestCgroup {
        let (pdir, ppath, version) = match parent {
            Some(p) => (p.dir.clone(), p.path.clone(), p.version),
            None => {
                let (d, p, v) = Self::own().expect("this test needs a memory cgroup controller");
                if v == "v2" {
                    delegate_v2(&d);
                }
                (d, p, v)
            }
        };
        let unique = format!("{name}-{}", std::process::id());
        let dir = pdir.join(&unique);
        let _ = std::fs::remove_dir(&dir);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let path = format!("{}/{unique}", ppath.trim_end_matches('/'));
        if version == "v2" && parent.is_some() {
            // A v2 parent hands the controller down; a leaf must not enable it
            // for its own children, or it could hold no processes.
            std::fs::write(pdir.join("cgroup.subtree_control"), "+memory").unwrap();
        }
        let cg = TestCgroup { dir, path, version };
        if let Some(l) = limit {
            let (file, swapfile) = if version == "v1" {
                ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
            } else {
                ("memory.max", "memory.swap.max")
            };
            std::fs::write(cg.dir.join(file), l.to_string()).unwrap();
            // No swap escape hatch: the limit must bite (ignored where swap accounting is off).
            let _ = std::fs::write(
                cg.dir.join(swapfile),
                if version == "v1" {
                    l.to_string()
                } else {
                    "0".into()
                },
            );
        }
        cg
    }

    /// `sh -c` that moves itself into this cgroup, then execs `argv`
    /// (isolated from oomscope's variables: [`crate::isolate`]).
    pub fn command(&self, argv: &[&str]) -> Command {
        let mut c = Command::new("sh");
        crate::isolate(&mut c);
        c.arg("-c")
            .arg(format!(
                "echo $$ > {}/cgroup.procs && exec \"$@\"",
                self.dir.display()
            ))
            .arg("sh")
            .args(argv);
        c
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Processes may take a moment to leave after they were killed.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!(
            "warning: could not remove test cgroup {}",
            self.dir.display()
        );
    }
}

/// The memory line of /proc/self/cgroup and the mount that holds it:
/// (directory, path, version). v1's memory hierarchy wins over the v2 line
/// (a hybrid host); v2 counts only where its mount carries the controller.
fn own_memory_cgroup() -> Option<(PathBuf, String, &'static str)> {
    let lines = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    // mountinfo: ID PARENT MAJ:MIN ROOT POINT OPTIONS [TAGS...] - FSTYPE SOURCE SUPER
    let mounts: Vec<(&str, &str, &str, &str)> = mounts
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let left: Vec<&str> = left.split_whitespace().collect();
            let right: Vec<&str> = right.split_whitespace().collect();
            Some((
                *left.get(3)?,
                *left.get(4)?,
                *right.first()?,
                *right.get(2)?,
            ))
        })
        .collect();
    let entries = lines.lines().filter_map(|l| {
        let mut parts = l.splitn(3, ':');
        Some((parts.next()?, parts.next()?, parts.next()?))
    });
    let mut v2_path = None;
    for (hierarchy, controllers, path) in entries {
        if hierarchy == "0" && controllers.is_empty() {
            v2_path = Some(path.to_string());
        } else if controllers.split(',').any(|c| c == "memory") {
            let mount = mounts.iter().find(|(_, _, fstype, opts)| {
                *fstype == "cgroup" && opts.split(',').any(|o| o == "memory")
            });
            if let Some((root, point, _, _)) = mount {
                return Some((under_mount(root, point, path), path.to_string(), "v1"));
            }
        }
    }
    let path = v2_path?;
    mounts
        .iter()
        .filter(|(_, _, fstype, _)| *fstype == "cgroup2")
        .find(|(_, point, _, _)| {
            std::fs::read_to_string(Path::new(point).join("cgroup.controllers"))
                .is_ok_and(|t| t.split_whitespace().any(|c| c == "memory"))
        })
        .map(|(root, point, _, _)| (under_mount(root, point, &path), path.clone(), "v2"))
}

/// The directory of cgroup `path` on a mount of the cgroup `root` at `point`.
fn under_mount(root: &str, point: &str, path: &str) -> PathBuf {
    let root = root.trim_end_matches('/');
    let rel = match path.strip_prefix(root) {
        Some(rest) if root.is_empty() || rest.is_empty() || rest.starts_with('/') => rest,
        _ => path,
    };
    let rel = rel.trim_start_matches('/');
    if rel.is_empty() {
        PathBuf::from(point)
    } else {
        Path::new(point).join(rel)
    }
}

/// v2 allows no processes in a cgroup that hands the memory controller to its
/// children: move ours into a leaf, then enable the controller below our own
/// cgroup (creating test cgroups under the root is refused in some containers).
fn delegate_v2(own: &Path) {
    let enabled = std::fs::read_to_string(own.join("cgroup.subtree_control")).unwrap_or_default();
    if enabled.split_whitespace().any(|c| c == "memory") {
        return;
    }
    let leaf = own.join("oomscope-init");
    let _ = std::fs::create_dir(&leaf);
    for pid in std::fs::read_to_string(own.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
    {
        let _ = std::fs::write(leaf.join("cgroup.procs"), pid);
    }
    std::fs::write(own.join("cgroup.subtree_control"), "+memory")
        .expect("enable the memory controller for test cgroups");
}
