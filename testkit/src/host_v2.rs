//! The GPU machine's pure cgroup-v2 files (`tests/fixtures/host-v2`), laid
//! out under a temporary directory as a fake `/proc` and `/sys/fs/cgroup`,
//! so v2 readers and writers run on this CI machine, whose memory
//! controller is v1.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The captured files and the process's mounts, written for one pid.
pub struct HostV2 {
    /// Removes the tree when dropped.
    pub dir: tempfile::TempDir,
    /// The capture itself (its `/proc/...` texts and `files`).
    pub fixture: Value,
    pub proc_root: PathBuf,
    pub cgroup_root: PathBuf,
}

/// Writes `text` at `path`, making its directories.
pub fn write(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
}

/// The capture, parsed.
pub fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/host-v2/host_cgroup_v2.json"
    );
    serde_json::from_str(&fs::read_to_string(path).expect("fixture present"))
        .expect("fixture is JSON")
}

impl HostV2 {
    /// Every readable cgroup file of the capture, and `/proc/<pid>/mounts`.
    /// (`memory.reclaim` is write-only: the capture recorded its read error,
    /// and it is left out.)
    pub fn materialise(pid: u32) -> HostV2 {
        let fixture = fixture();
        let dir = tempfile::tempdir().unwrap();
        let proc_root = dir.path().join("proc");
        let cgroup_root = dir.path().join("sys/fs/cgroup");
        for (name, text) in fixture["files"].as_object().unwrap() {
            let text = text.as_str().unwrap();
            if text.starts_with("ERROR ") {
                continue;
            }
            let rel = name.strip_prefix("/sys/fs/cgroup/").expect("cgroup file");
            write(&cgroup_root.join(rel), text);
        }
        let mounts: String = fixture["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_str().unwrap())
            .collect();
        write(&proc_root.join(pid.to_string()).join("mounts"), &mounts);
        HostV2 {
            dir,
            fixture,
            proc_root,
            cgroup_root,
        }
    }

    /// `/proc/<pid>/<name>`.
    pub fn pid_file(&self, pid: u32, name: &str) -> PathBuf {
        self.proc_root.join(pid.to_string()).join(name)
    }
}
