//! What decides between domains of a machine-wide kill, read from the
//! kernel's records: the allowed nodes (nodemask, cpuset, mems_allowed),
//! the failed allocation's order, the zones' free lists and watermarks; and
//! "page allocation failure" warnings. The records are constructed from the
//! kernel's format strings (tests/fixtures/kmsg/construct.py, see README.md).

use oomscope_agent_core::pb;
use oomscope_agent_core::readers::kmsg::{
    parse_alloc_failures, parse_kills, parse_records, OomRecordParser,
};

const KIB: u64 = 1024;

fn fixture(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/kmsg")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn only_kill(name: &str) -> pb::KernelOomKill {
    let kills = parse_kills(&fixture(name));
    assert_eq!(kills.len(), 1, "{name}: {kills:#?}");
    kills.into_iter().next().unwrap()
}

fn zone<'a>(zones: &'a [pb::KernelZoneFree], node: u32, name: &str) -> &'a pb::KernelZoneFree {
    zones
        .iter()
        .find(|z| z.node == node && z.zone == name)
        .unwrap_or_else(|| panic!("no node {node} {name} in {zones:#?}"))
}

#[test]
fn a_cpuset_bound_kill_keeps_its_nodes_and_the_free_lists_of_those_nodes() {
    let k = only_kill("numa_cpuset.kmsg");
    assert_eq!(k.constraint, "CONSTRAINT_CPUSET");
    assert_eq!(k.nodemask, "(null)");
    assert_eq!(k.cpuset, "numa0");
    assert_eq!(
        k.mems_allowed, "0",
        "global_oom ends the list, it is not part of it"
    );
    assert_eq!(k.task_memcg, "/system.slice/vllm.service");
    assert!(k.oom_memcg.is_empty());
    assert_eq!((k.pid, k.task.as_str()), (5120, "VLLM::Worker"));
    assert_eq!(k.order, Some(0));
    assert_eq!(k.gfp_mask, "0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP)");
    assert_eq!(k.anon_rss_bytes, 62914560 * KIB);
    // Only node 0 is shown: the kernel filters the nodes the kill may not use.
    assert_eq!(k.zones.len(), 3, "{:#?}", k.zones);
    assert!(k.zones.iter().all(|z| z.node == 0));
    let normal = zone(&k.zones, 0, "Normal");
    assert_eq!(normal.blocks[..4], [900, 310, 40, 2]);
    assert_eq!(normal.blocks.len(), 11);
    assert_eq!(normal.page_bytes, 4 * KIB);
    assert_eq!(normal.free_bytes, 6784 * KIB);
    assert_eq!(
        (normal.min_bytes, normal.high_bytes),
        (42256 * KIB, 63384 * KIB)
    );
    // Sum of count x size equals the kernel's own total.
    let sum: u64 = normal
        .blocks
        .iter()
        .enumerate()
        .map(|(o, n)| n * (normal.page_bytes << o))
        .sum();
    assert_eq!(sum, normal.free_bytes);
}

#[test]
fn a_memory_policy_kill_names_its_nodemask() {
    let k = only_kill("numa_mempolicy.kmsg");
    assert_eq!(k.constraint, "CONSTRAINT_MEMORY_POLICY");
    assert_eq!(k.nodemask, "1");
    assert_eq!((k.cpuset.as_str(), k.mems_allowed.as_str()), ("/", "0-1"));
    assert_eq!(k.zones.len(), 1);
    assert_eq!(zone(&k.zones, 1, "Normal").free_bytes, 6784 * KIB);
}

#[test]
fn a_high_order_kill_keeps_its_order_and_the_blocks_by_order() {
    let k = only_kill("high_order_kill.kmsg");
    assert_eq!(k.order, Some(3));
    assert_eq!(k.constraint, "CONSTRAINT_NONE");
    let normal = zone(&k.zones, 0, "Normal");
    assert_eq!(normal.free_bytes, 2449600 * KIB);
    assert_eq!(normal.blocks[..4], [412000, 96000, 2100, 0]);
    assert!(normal.blocks[3..].iter().all(|&n| n == 0));
    // The earlier kills' lines are unchanged (the fixture is whole).
    assert_eq!(
        k.lines.len(),
        3,
        "invoked, oom-kill, Killed: {:#?}",
        k.lines
    );
}

#[test]
fn a_page_allocation_failure_is_read_with_its_pid_and_free_lists() {
    let text = fixture("page_alloc_failure.kmsg");
    assert!(parse_kills(&text).is_empty(), "a warning is not a kill");
    let fs = parse_alloc_failures(&text);
    assert_eq!(fs.len(), 1, "{fs:#?}");
    let f = &fs[0];
    assert_eq!((f.pid, f.task.as_str(), f.order), (4242, "python3", 4));
    assert_eq!(f.gfp_mask, "0x40dc0(GFP_KERNEL|__GFP_COMP|__GFP_ZERO)");
    assert_eq!(
        (
            f.nodemask.as_str(),
            f.cpuset.as_str(),
            f.mems_allowed.as_str()
        ),
        ("(null)", "/", "0")
    );
    assert_eq!(f.kernel_time_us, 12800000400);
    assert!(f
        .line
        .starts_with("python3: page allocation failure: order:4"));
    assert_eq!(f.zones.len(), 2);
    assert_eq!(zone(&f.zones, 0, "DMA32").free_bytes, 18720 * KIB);
}

#[test]
fn a_failure_ends_at_pages_ram_and_waits_until_then() {
    let text = fixture("page_alloc_failure.kmsg");
    let recs: Vec<_> = parse_records(&text).collect();
    let ram = recs
        .iter()
        .position(|r| r.message.ends_with("pages RAM"))
        .unwrap();
    let mut p = OomRecordParser::new();
    for r in &recs[..ram] {
        assert!(p.push(r).is_none());
    }
    assert!(p.has_pending(), "the free lists may still be coming");
    assert!(p.take_completed_alloc_failures().is_empty());
    p.push(&recs[ram]);
    assert!(!p.has_pending());
    let done = p.take_completed_alloc_failures();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].zones.len(), 2);
}

#[test]
fn node_lists_with_commas_and_odd_lines_stay_whole() {
    let text = "\
4,1,10,-;app: page allocation failure: order:9, mode:0x2dc2(GFP_KERNEL|__GFP_HIGHMEM|__GFP_NOWARN|__GFP_ZERO), nodemask=0-1,3,cpuset=a,b,mems_allowed=0-1,3
6,2,11,-;Node 0 active_anon:123kB inactive_anon:5kB
6,3,12,-;Node 0 hugepages_total=0 hugepages_free=0 hugepages_surp=0 hugepages_size=2048kB
6,4,13,-;Node 0 Normal: garbage = 1kB
4,5,14,-;x invoked oom-killer: gfp_mask=0x100cca(GFP_HIGHUSER_MOVABLE), order=2, oom_score_adj=0
6,6,15,-;oom-kill:constraint=CONSTRAINT_MEMORY_POLICY,nodemask=0-1,3,cpuset=/,mems_allowed=0-3,global_oom,task_memcg=/,task=x,pid=9,uid=0
3,7,16,-;Out of memory: Killed process 9 (x) total-vm:8kB, anon-rss:4kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:4kB oom_score_adj:0
";
    let fs = parse_alloc_failures(text);
    assert_eq!(fs.len(), 1, "the kill's start ends the failure");
    let f = &fs[0];
    assert_eq!(f.order, 9);
    assert_eq!(f.nodemask, "0-1,3");
    assert_eq!(f.cpuset, "a,b");
    assert_eq!(f.mems_allowed, "0-1,3");
    assert!(f.zones.is_empty(), "{:#?}", f.zones);
    assert_eq!(f.pid, 0, "no stack dump: the pid is unknown, not guessed");
    let k = &parse_kills(text)[0];
    assert_eq!((k.order, k.nodemask.as_str()), (Some(2), "0-1,3"));
    assert_eq!(k.mems_allowed, "0-3");
}

#[test]
fn a_real_memcg_kill_of_this_kernel_gives_the_same_fields() {
    // Captured on this host (capture.py): the formats the constructed files follow.
    let k = only_kill("cgroup_v1_own_level.kmsg");
    assert_eq!(k.order, Some(0));
    assert_eq!(k.gfp_mask, "0xcc0(GFP_KERNEL)");
    assert_eq!(
        (
            k.nodemask.as_str(),
            k.cpuset.as_str(),
            k.mems_allowed.as_str()
        ),
        ("(null)", "/", "0")
    );
    assert!(k.zones.is_empty(), "a memcg kill prints no free lists");
}

#[test]
fn memory_oom_group_marks_the_tasks_killed_with_the_victim() {
    let kills = parse_kills(&fixture("cgroup_v2_oom_group.kmsg"));
    assert_eq!(kills.len(), 3, "{kills:#?}");
    let pod = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1f2e.slice/cri-containerd-7a41.scope";
    let v = &kills[0];
    assert_eq!(
        (v.pid, v.task.as_str(), v.oom_score_adj),
        (311, "python3", 968)
    );
    assert!(
        v.oom_group.is_empty(),
        "the victim was chosen, not taken with the group"
    );
    assert_eq!(v.oom_memcg, pod);
    assert_eq!(v.memcg_limit_bytes, 8388608 * KIB);
    assert_eq!(v.mems_allowed, "0-1");
    let taken: Vec<(u32, &str, &str)> = kills[1..]
        .iter()
        .map(|k| (k.pid, k.task.as_str(), k.oom_group.as_str()))
        .collect();
    assert_eq!(taken, [(7, "tini", pod), (312, "python3", pod)]);
    assert!(kills[1..]
        .iter()
        .all(|k| k.constraint == "CONSTRAINT_MEMCG"));
}
