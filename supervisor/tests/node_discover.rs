//! Where the memory cgroups are: a v2 tree and a v1 memory hierarchy (made
//! of plain files in a temporary directory, as the kernel lays them out),
//! each cgroup named as the kernel's OOM record names it, and the cap; a
//! walk that lists only the directories whose link count moved.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use oomscope_agent_core::readers::cgroup::Version;
use oomscope_supervisor::node::{Hierarchy, Listings};

fn touch(dir: &Path, file: &str) {
    write(dir, file, "");
}

fn write(dir: &Path, file: &str, text: &str) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(file), text).unwrap();
}

#[test]
fn a_v2_tree_names_each_memory_cgroup_from_its_mount() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    std::fs::write(
        root.join("cgroup.controllers"),
        "cpuset cpu io memory pids\n",
    )
    .unwrap();
    let pod = root.join("kubepods.slice/kubepods-podab.slice");
    for d in [
        root.join("kubepods.slice"),
        pod.clone(),
        pod.join("cri-containerd-1.scope"),
    ] {
        // The controllers its parent hands down.
        write(&d, "cgroup.controllers", "cpu memory\n");
        touch(&d, "memory.events");
    }
    // A cgroup without the memory controller is not watched.
    touch(&root.join("init.scope"), "cgroup.controllers");
    let h = Hierarchy::find(root).expect("a v2 hierarchy");
    assert_eq!(h.version, Version::V2);
    let (found, capped) = h.discover(10);
    let paths: Vec<&str> = found.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/kubepods.slice",
            "/kubepods.slice/kubepods-podab.slice",
            "/kubepods.slice/kubepods-podab.slice/cri-containerd-1.scope"
        ]
    );
    assert!(!capped);
    // A subtree keeps the names of the whole mount.
    let sub = Hierarchy::find(&pod).unwrap();
    let (found, _) = sub.discover(10);
    assert_eq!(found[0].path, "/kubepods.slice/kubepods-podab.slice");
    // The cap keeps the upper levels and says it cut.
    let (found, capped) = h.discover(2);
    assert_eq!(found.len(), 2);
    assert_eq!(found[0].path, "/kubepods.slice");
    assert!(capped);
}

#[test]
fn a_v1_host_is_watched_at_its_memory_mount() {
    let t = tempfile::tempdir().unwrap();
    let mem = t.path().join("memory");
    for d in [mem.clone(), mem.join("docker"), mem.join("docker/abc")] {
        touch(&d, "memory.oom_control");
    }
    let h = Hierarchy::find(t.path()).expect("a v1 hierarchy");
    assert_eq!(h.version, Version::V1);
    let (found, _) = h.discover(10);
    let paths: Vec<&str> = found.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, ["/", "/docker", "/docker/abc"]);
    assert!(Hierarchy::find(&t.path().join("nowhere")).is_none());
}

/// The link count of each found directory, as the watcher reads it from
/// the directories it holds open.
fn links_of(found: &[oomscope_supervisor::node::Found]) -> HashMap<PathBuf, u64> {
    found
        .iter()
        .map(|f| (f.dir.clone(), std::fs::metadata(&f.dir).unwrap().nlink()))
        .collect()
}

#[test]
fn a_walk_that_reuses_listings_still_finds_what_was_made_and_replaced() {
    let t = tempfile::tempdir().unwrap();
    let mem = t.path().join("memory");
    for d in [mem.clone(), mem.join("a"), mem.join("b")] {
        touch(&d, "memory.oom_control");
    }
    let h = Hierarchy::find(t.path()).unwrap();
    let mut listings = Listings::default();
    let paths = |found: &[oomscope_supervisor::node::Found]| -> Vec<String> {
        found.iter().map(|f| f.path.clone()).collect()
    };
    let (first, _) = h.discover_with(10, &mut listings, &HashMap::new());
    assert_eq!(paths(&first), ["/", "/a", "/b"]);
    // Unchanged: the same cgroups, from the listings kept.
    let (again, _) = h.discover_with(10, &mut listings, &links_of(&first));
    assert_eq!(again, first);

    // A child made under a watched cgroup: its link count moved.
    touch(&mem.join("a/new"), "memory.oom_control");
    let (grown, _) = h.discover_with(10, &mut listings, &links_of(&first));
    assert_eq!(paths(&grown), ["/", "/a", "/b", "/a/new"]);

    // One removed and another made in its place: the count is the same, but
    // the removed one is no longer watched, so its parent is listed again.
    std::fs::remove_dir_all(mem.join("b")).unwrap();
    touch(&mem.join("c"), "memory.oom_control");
    let still: Vec<_> = grown.into_iter().filter(|f| f.path != "/b").collect();
    let (replaced, capped) = h.discover_with(10, &mut listings, &links_of(&still));
    assert_eq!(paths(&replaced), ["/", "/a", "/c", "/a/new"]);
    assert!(!capped);
    // Reused listings and the cap: the upper levels still come first.
    let (capped_found, capped) = h.discover_with(2, &mut listings, &links_of(&replaced));
    assert_eq!(paths(&capped_found), ["/", "/a"]);
    assert!(capped);
}
