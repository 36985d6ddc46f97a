//! cgroup v2 details read through the real level reader from the
//! constructed readings of tests/fixtures/host-v2 (see its README):
//! memory.events `high`, memory.pressure, memory.swap.max, memory.oom.group.
//! And per-node meminfo, laid out as /sys/devices/system/node.

use std::fs;
use std::path::Path;

use oomscope_agent_core::readers::cgroup::{read_level, Version};
use oomscope_agent_core::readers::numa::{node_root, parse_node_meminfo, read_nodes};
use oomscope_agent_core::readers::HostPaths;
use serde_json::Value;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/host-v2")
        .join(name);
    serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap()
}

fn read(fx: &Value, i: usize) -> oomscope_agent_core::pb::CgroupLevel {
    let tmp = tempfile::tempdir().unwrap();
    for (name, text) in fx["readings"][i]["files"].as_object().unwrap() {
        fs::write(tmp.path().join(name), text.as_str().unwrap()).unwrap();
    }
    read_level(tmp.path(), fx["own_path"].as_str().unwrap(), Version::V2)
}

#[test]
fn memory_high_its_events_and_the_stall() {
    let fx = fixture("memory_high_throttled.json");
    let (b, a) = (read(&fx, 0), read(&fx, 1));
    assert!(!a.partial, "{a:#?}");
    assert_eq!((a.high_bytes, a.limit_bytes), (6 * GIB, 8 * GIB));
    assert_eq!((b.events_high, a.events_high), (0, 1843));
    let (pb_, pa) = (b.pressure.unwrap(), a.pressure.unwrap());
    assert_eq!(pa.some_total_us - pb_.some_total_us, 14_400_000);
    assert_eq!(pa.some_avg10, 31.5);
    assert_eq!(a.swap_limit_bytes, Some(0), "memory.swap.max 0: no swap");
    assert!(a.oom_group);
    assert_eq!(a.peak_bytes, 6350 * MIB);
}

#[test]
fn memory_oom_group_and_its_group_kill() {
    let fx = fixture("oom_group_kill.json");
    let (b, a) = (read(&fx, 0), read(&fx, 1));
    assert!(a.oom_group);
    assert_eq!((b.events_oom_group_kill, a.events_oom_group_kill), (0, 1));
    assert_eq!((a.events_oom, a.events_oom_kill), (1, 3));
    assert_eq!(a.high_bytes, 0, "memory.high max: unlimited");
    // The GPU machine's real capture has it off.
    let real = fixture("host_cgroup_v2.json");
    let text = real["files"]["/sys/fs/cgroup/app.slice/inference-server/memory.oom.group"]
        .as_str()
        .unwrap();
    assert_eq!(text.trim(), "0");
}

#[test]
fn per_node_meminfo_is_read_beside_the_cgroup_mount_and_missing_is_empty() {
    let tmp = tempfile::tempdir().unwrap();
    let paths = HostPaths {
        proc_root: tmp.path().join("proc"),
        cgroup_root: tmp.path().join("sys/fs/cgroup"),
    };
    let root = node_root(&paths);
    assert_eq!(root, tmp.path().join("sys/devices/system/node"));
    assert!(
        read_nodes(&root).is_empty(),
        "no NUMA directory: no nodes, no error"
    );
    for (n, free_kb) in [(1u32, 60817408u64), (0, 92160)] {
        let dir = root.join(format!("node{n}"));
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("meminfo"),
            format!(
                "Node {n} MemTotal:       67108864 kB\nNode {n} MemFree:        {free_kb} kB\nNode {n} MemUsed:        1 kB\nNode {n} FilePages:        204800 kB\nNode {n} HugePages_Total:     8\nNode {n} HugePages_Free:      8\n"
            ),
        )
        .unwrap();
    }
    fs::create_dir_all(root.join("power")).unwrap();
    let nodes = read_nodes(&root);
    assert_eq!(nodes.len(), 2);
    assert_eq!(nodes[0].node, 0, "sorted by node");
    assert_eq!(nodes[0].mem_free_bytes, 92160 * 1024);
    assert_eq!(nodes[1].mem_total_bytes, 64 * GIB);
    assert_eq!(nodes[1].file_bytes, 200 * MIB);
    assert_eq!(nodes[1].huge_pages_total, 8);
    // This host's own node 0, where it has one.
    if let Ok(t) = fs::read_to_string("/sys/devices/system/node/node0/meminfo") {
        let n = parse_node_meminfo(0, &t);
        assert!(
            n.mem_total_bytes > 0 && n.mem_free_bytes <= n.mem_total_bytes,
            "{n:?}"
        );
    }
}
