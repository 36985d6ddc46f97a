//! This machine's real memory cgroup. Here it is v1 (hybrid host); the tests
//! create real child cgroups under our own one (we run as root) and remove
//! them afterwards, also on failure.

use std::fs;
use std::path::PathBuf;

use oomscope_agent_core::readers::cgroup::{self, MemoryCgroup, Version};
use oomscope_agent_core::readers::HostPaths;
use oomscope_testkit::TestCgroup;

const LIMIT_64_MIB: u64 = 64 * 1024 * 1024;

/// The memory line of /proc/self/cgroup, read independently of the reader.
fn own_memory_path() -> Option<String> {
    let text = fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then(|| path.to_string())
    })
}

fn own_v1() -> Option<MemoryCgroup> {
    let cg = cgroup::locate(&HostPaths::system(), std::process::id())?;
    if cg.version != Version::V1 {
        eprintln!(
            "skipping: this host's memory controller is {:?}, these checks need v1",
            cg.version
        );
        return None;
    }
    Some(cg)
}

/// The test cgroup `cg` (removed when it drops, also on failure) as the
/// readers see it: on the mount of our own.
fn as_read(own: &MemoryCgroup, cg: &TestCgroup) -> MemoryCgroup {
    MemoryCgroup {
        path: cg.path.clone(),
        dir: cg.dir.clone(),
        ..own.clone()
    }
}

#[test]
fn locates_own_cgroup_and_reads_its_levels() {
    let paths = HostPaths::system();
    let cg = cgroup::locate(&paths, std::process::id()).expect("a memory controller on this host");
    let expected = own_memory_path();
    if cg.version == Version::V1 {
        // Hybrid host: the v1 memory line wins over the `0::/` line.
        assert_eq!(Some(cg.path.clone()), expected);
        assert_eq!(cg.mount, PathBuf::from("/sys/fs/cgroup/memory"));
    }
    assert!(cg.dir.is_dir(), "{} exists", cg.dir.display());

    let levels = cgroup::read_levels(&paths, &cg);
    assert_eq!(levels[0].path, cg.path);
    assert!(
        levels[0].usage_bytes > 0,
        "our own cgroup charges our memory"
    );
    assert!(!levels[0].partial);
    assert_eq!(levels.last().unwrap().path, "/");
    let depth = cg.path.split('/').filter(|c| !c.is_empty()).count();
    assert_eq!(
        levels.len(),
        depth + 1,
        "own level, each ancestor, the root"
    );
}

#[test]
fn a_child_limit_below_the_parent_owns_the_limit() {
    let Some(own) = own_v1() else { return };
    let paths = HostPaths::system();
    let cg = TestCgroup::create(None, "oomscope-readers-child", None);
    fs::write(
        cg.dir.join("memory.limit_in_bytes"),
        LIMIT_64_MIB.to_string(),
    )
    .unwrap();

    let child = as_read(&own, &cg);
    let level = cgroup::read_level(&child.dir, &child.path, Version::V1);
    assert_eq!(level.limit_bytes, LIMIT_64_MIB);
    assert!(!level.partial);
    assert_eq!(level.usage_bytes, 0, "no task in it yet");

    let levels = cgroup::read_levels(&paths, &child);
    assert_eq!(levels.len(), cgroup::read_levels(&paths, &own).len() + 1);
    let tightest_above = levels[1..]
        .iter()
        .map(|l| l.limit_bytes)
        .filter(|&l| l > 0)
        .min();
    let info = cgroup::info(&levels, &child);
    if tightest_above.is_none_or(|l| l >= LIMIT_64_MIB) {
        assert_eq!(info.limit_bytes, LIMIT_64_MIB);
        assert_eq!(info.limit_owner, child.path);
    } else {
        assert_eq!(Some(info.limit_bytes), tightest_above);
    }
    assert_eq!(info.version, "v1");
    assert_eq!(info.path, child.path);
}

#[test]
fn a_parent_limit_is_owned_by_the_parent() {
    let Some(own) = own_v1() else { return };
    let paths = HostPaths::system();
    // Declared parent first: the child is removed first.
    let parent_cg = TestCgroup::create(None, "oomscope-readers-parent", None);
    fs::write(
        parent_cg.dir.join("memory.limit_in_bytes"),
        LIMIT_64_MIB.to_string(),
    )
    .unwrap();
    let child_cg = TestCgroup::create(Some(&parent_cg), "child", None);

    let parent = as_read(&own, &parent_cg);
    let child = as_read(&own, &child_cg);
    let levels = cgroup::read_levels(&paths, &child);
    assert_eq!(levels[0].path, child.path);
    assert_eq!(levels[0].limit_bytes, 0, "the child itself is unlimited");
    assert_eq!(levels[1].path, parent.path);
    assert_eq!(levels[1].limit_bytes, LIMIT_64_MIB);

    let info = cgroup::info(&levels, &child);
    assert_eq!(info.limit_bytes, LIMIT_64_MIB);
    assert_eq!(info.limit_owner, parent.path);
}
