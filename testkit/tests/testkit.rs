//! testkit's own promises: no production crate links it, and a test cgroup
//! is a real child of our own memory cgroup, limited, entered by the
//! commands it makes, and gone once dropped.

use std::path::Path;

use oomscope_testkit::TestCgroup;

/// Where a Cargo.toml names testkit outside a dev-dependencies table (and
/// the workspace's list of its crates): the tables that do, by name.
fn non_dev_uses(manifest: &str) -> Vec<String> {
    let mut table = String::new();
    let mut found = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            table = line.trim_matches(|c| c == '[' || c == ']').to_string();
        } else if line.starts_with("oomscope-testkit")
            && !table.ends_with("dev-dependencies")
            && table != "workspace.dependencies"
        {
            found.push(table.clone());
        }
    }
    found
}

#[test]
fn the_manifest_check_finds_a_normal_dependency() {
    let manifest = "[dependencies]\noomscope-testkit.workspace = true\n\
                    [dev-dependencies]\noomscope-testkit.workspace = true\n\
                    [target.'cfg(unix)'.build-dependencies]\noomscope-testkit = { path = \"x\" }\n";
    assert_eq!(
        non_dev_uses(manifest),
        ["dependencies", "target.'cfg(unix)'.build-dependencies"]
    );
}

#[test]
fn no_production_crate_depends_on_testkit() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let workspace = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let members = workspace
        .split_once("members = [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .expect("the workspace's members")
        .0;
    let mut checked = 0;
    for member in members.split(',').map(|m| m.trim().trim_matches('"')) {
        if member.is_empty() {
            continue;
        }
        let manifest = std::fs::read_to_string(root.join(member).join("Cargo.toml"))
            .unwrap_or_else(|e| panic!("{member}/Cargo.toml: {e}"));
        assert_eq!(
            non_dev_uses(&manifest),
            Vec::<String>::new(),
            "{member} may use testkit in its tests only"
        );
        checked += 1;
    }
    assert_eq!(non_dev_uses(&workspace), Vec::<String>::new());
    assert!(checked >= 10, "every member read: {checked}");
}

/// The memory line of a /proc/<pid>/cgroup: v1's memory hierarchy, else v2's.
fn memory_line(proc_cgroup: &str) -> String {
    let lines: Vec<(&str, &str, &str)> = proc_cgroup
        .lines()
        .filter_map(|l| {
            let mut p = l.splitn(3, ':');
            Some((p.next()?, p.next()?, p.next()?))
        })
        .collect();
    lines
        .iter()
        .find(|(_, c, _)| c.split(',').any(|c| c == "memory"))
        .or_else(|| lines.iter().find(|(h, _, _)| *h == "0"))
        .map(|(_, _, p)| p.to_string())
        .expect("a memory line")
}

#[test]
fn a_test_cgroup_is_ours_limited_entered_and_removed() {
    let (own_dir, own_path, version) =
        TestCgroup::own().expect("this test needs a memory cgroup controller");
    let own_line = memory_line(&std::fs::read_to_string("/proc/self/cgroup").unwrap());
    assert_eq!(own_path, own_line, "our own cgroup, as the kernel names it");

    const LIMIT: u64 = 48 << 20;
    let cg = TestCgroup::create(None, "oomscope-testkit", Some(LIMIT));
    let dir = cg.dir.clone();
    assert_eq!(dir.parent(), Some(own_dir.as_path()));
    let limit_file = if version == "v1" {
        "memory.limit_in_bytes"
    } else {
        "memory.max"
    };
    let limit = std::fs::read_to_string(dir.join(limit_file)).unwrap();
    assert_eq!(limit.trim().parse::<u64>().unwrap(), LIMIT);

    let out = cg.command(&["cat", "/proc/self/cgroup"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        memory_line(&String::from_utf8_lossy(&out.stdout)),
        cg.path,
        "the command runs in the test cgroup"
    );

    drop(cg);
    assert!(!dir.exists(), "{} removed", dir.display());
}
