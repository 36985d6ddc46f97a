//! The kernel's OOM record parser on real records captured on this kernel
//! (tests/fixtures/kmsg, see its README), and on truncated or garbled input.

use oomscope_agent_core::pb;
use oomscope_agent_core::readers::kmsg::{
    parse_kills, parse_record, parse_records, KmsgReader, OomRecordParser,
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

#[test]
fn a_record_header_and_its_escapes() {
    let r = parse_record("3,827,1448937921,-;Killed process 1 (a\\x20b)\n SUBSYSTEM=x").unwrap();
    assert_eq!((r.level, r.seq, r.time_us), (3, 827, 1448937921));
    assert_eq!(r.message, "Killed process 1 (a b)");
    // The facility is not part of the level; extra header fields are allowed.
    let r = parse_record("14,5,6,-,caller=T1;hello").unwrap();
    assert_eq!((r.level, r.message.as_str()), (6, "hello"));
    assert!(parse_record("no header").is_none());
    assert!(parse_record("x,1,2,-;m").is_none());
    assert!(parse_record("").is_none());
    // Continuation lines are not records.
    assert_eq!(parse_records("6,1,2,-;a\n KEY=v\n6,2,3,-;b\n").count(), 2);
}

#[test]
fn own_level_limit_python_killed() {
    let k = only_kill("cgroup_v1_own_level.kmsg");
    let cg = "/process_api/ddeec585f366d13a4275011560eecc79/oomcap-test";
    assert_eq!(k.pid, 18173);
    assert_eq!(k.task, "python3");
    assert_eq!(k.invoked_by, "python3");
    assert_eq!(k.constraint, "CONSTRAINT_MEMCG");
    assert_eq!((k.oom_memcg.as_str(), k.task_memcg.as_str()), (cg, cg));
    assert_eq!(k.total_vm_bytes, 221368 * KIB);
    assert_eq!(k.anon_rss_bytes, 65280 * KIB);
    assert_eq!(k.file_rss_bytes, 6656 * KIB);
    assert_eq!(k.shmem_rss_bytes, 0);
    assert_eq!(k.oom_score_adj, 0);
    assert_eq!(k.memcg_usage_bytes, 65536 * KIB);
    assert_eq!(k.memcg_limit_bytes, 64 << 20);
    assert_eq!(
        k.kernel_time_us, 1448937921,
        "the Killed process line's time"
    );
    // The four lines that matter, in order, never the task table or the stack.
    assert_eq!(k.lines.len(), 4, "{:#?}", k.lines);
    assert!(k.lines[0].starts_with("python3 invoked oom-killer:"));
    assert!(k.lines[1].starts_with("memory: usage 65536kB, limit 65536kB"));
    assert!(k.lines[2].starts_with("oom-kill:constraint=CONSTRAINT_MEMCG"));
    assert!(k.lines[3].starts_with("Memory cgroup out of memory: Killed process 18173"));
}

#[test]
fn limit_on_a_parent_level_grandchild_killed() {
    // sh -> python3 in <parent>/leaf, the 64 MiB limit on <parent>.
    let k = only_kill("cgroup_v1_parent_level.kmsg");
    assert_eq!((k.pid, k.task.as_str()), (32667, "python3"));
    assert_eq!(k.constraint, "CONSTRAINT_MEMCG");
    assert!(k.oom_memcg.ends_with("/kcap-parent"), "{}", k.oom_memcg);
    assert!(
        k.task_memcg.ends_with("/kcap-parent/leaf"),
        "{}",
        k.task_memcg
    );
    assert_eq!(k.anon_rss_bytes, 65024 * KIB);
    assert_eq!(k.memcg_limit_bytes, 64 << 20);
    assert!(
        !k.lines
            .iter()
            .any(|l| l.starts_with('[') || l.ends_with(" sh")),
        "the task table (which lists the sh) is not kept: {:#?}",
        k.lines
    );
}

#[test]
fn two_processes_the_bigger_is_killed_not_the_one_that_asked() {
    // "big" holds 44 MiB and sleeps; "small" allocates until the limit.
    let k = only_kill("cgroup_v1_bigger_chosen.kmsg");
    assert_eq!(k.invoked_by, "small");
    assert_eq!((k.pid, k.task.as_str()), (32709, "big"));
    assert_eq!(k.anon_rss_bytes, 51840 * KIB);
    assert_eq!(k.total_vm_bytes, 61632 * KIB);
}

#[test]
fn records_split_across_reads_and_kills_back_to_back() {
    // The parser keeps a half-read kill until its end arrives.
    let text = fixture("cgroup_v1_own_level.kmsg") + &fixture("cgroup_v1_bigger_chosen.kmsg");
    let records: Vec<_> = parse_records(&text).collect();
    let mut p = OomRecordParser::new();
    let mut kills = Vec::new();
    for (i, r) in records.iter().enumerate() {
        if let Some(k) = p.push(r) {
            kills.push(k);
        }
        if i == 5 {
            assert!(p.has_pending(), "a kill begun is pending");
        }
    }
    assert!(!p.has_pending());
    let pids: Vec<u32> = kills.iter().map(|k| k.pid).collect();
    assert_eq!(pids, vec![18173, 32709]);
}

#[test]
fn global_oom_and_a_killed_line_alone() {
    let text = "\
4,1,10,-;java invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, oom_score_adj=0
6,2,11,-;oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,task_memcg=/user.slice/a,b,task=my (weird) name,pid=777,uid=1000
3,3,12,-;Out of memory: Killed process 777 (my (weird) name) total-vm:2048kB, anon-rss:1024kB, file-rss:0kB, shmem-rss:4kB, UID:1000 pgtables:8kB oom_score_adj:500
3,4,20,-;Memory cgroup out of memory: Killed process 888 (solo) total-vm:10kB, anon-rss:5kB, file-rss:1kB, shmem-rss:0kB, UID:0 pgtables:1kB oom_score_adj:-5
";
    let kills = parse_kills(text);
    assert_eq!(kills.len(), 2, "{kills:#?}");
    let g = &kills[0];
    assert_eq!((g.pid, g.task.as_str()), (777, "my (weird) name"));
    assert_eq!(g.constraint, "CONSTRAINT_NONE");
    assert_eq!(g.task_memcg, "/user.slice/a,b", "commas stay in a value");
    assert_eq!(g.invoked_by, "java");
    assert_eq!((g.anon_rss_bytes, g.shmem_rss_bytes), (1024 * KIB, 4 * KIB));
    assert_eq!(g.oom_score_adj, 500);
    assert_eq!(g.memcg_limit_bytes, 0, "a global OOM has no memcg line");
    // Its beginning was never read (an old kernel, or a reader opened mid-kill).
    let s = &kills[1];
    assert_eq!((s.pid, s.task.as_str(), s.oom_score_adj), (888, "solo", -5));
    assert_eq!(
        s.constraint, "CONSTRAINT_MEMCG",
        "said by the line's prefix"
    );
    assert!(s.invoked_by.is_empty());
    assert_eq!(s.lines.len(), 1);
    assert_eq!(s.kernel_time_us, 20);
}

#[test]
fn truncated_and_garbage_input_never_panics() {
    let real = fixture("cgroup_v1_own_level.kmsg");
    // Every prefix of the real record: a kill only once its last line is whole.
    for cut in (0..real.len()).step_by(7) {
        let Some(prefix) = real.get(..cut) else {
            continue;
        };
        for k in parse_kills(prefix) {
            assert_eq!(k.pid, 18173);
        }
    }
    for junk in [
        "",
        "\n\n\n",
        ";;;;",
        "1,2,3;",
        "3,1,1,-;Killed process ",
        "3,1,1,-;Killed process x (y) total-vm:1kB",
        "3,1,1,-;Killed process 12 no-paren",
        "3,1,1,-;Killed process 12 (unterminated",
        "3,1,1,-;Killed process 4294967296 (big)",
        "6,1,1,-;memory: usage kB, limit",
        "6,1,1,-;oom-kill:",
        "6,1,1,-;oom-kill:=,=,pid=,task",
        "4,1,1,-; invoked oom-killer:",
        "4,1,1,-;\\x\\xZZ\\x4",
        "99999999999999999999,1,1,-;x",
        "\u{0}\u{1}\u{ffff}",
    ] {
        let _ = parse_kills(junk);
    }
    // A Killed line without a number does not end a pending kill.
    let text = "4,1,1,-;a invoked oom-killer: x\n3,2,2,-;Killed process x (y)\n";
    let mut p = OomRecordParser::new();
    for r in parse_records(text) {
        assert!(p.push(&r).is_none());
    }
    assert!(p.has_pending());
}

#[test]
fn the_lines_kept_are_bounded() {
    let long = "x".repeat(100_000);
    let text = format!(
        "4,1,1,-;a invoked oom-killer: {long}\n6,2,2,-;oom-kill:constraint=CONSTRAINT_MEMCG,oom_memcg=/{long},task=a,pid=5,uid=0\n3,3,3,-;Memory cgroup out of memory: Killed process 5 (a) total-vm:1kB, anon-rss:1kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:0kB oom_score_adj:0\n"
    );
    let k = parse_kills(&text).pop().unwrap();
    assert_eq!(k.pid, 5);
    assert!(k.lines.len() <= 4);
    assert!(k.lines.iter().all(|l| l.chars().count() <= 1024));
}

#[test]
fn a_reader_says_why_it_cannot_read() {
    let r = KmsgReader::open_path("/nonexistent/kmsg");
    let why = r.unavailable().expect("unavailable");
    assert!(why.contains("/nonexistent/kmsg"), "{why}");
    assert!(r.describe().starts_with("unreadable: "));
    let mut r = r;
    assert!(r.read_new().is_empty());
    assert!(!r.has_pending());
}

#[test]
fn the_real_log_opens_at_its_end() {
    // Root reads /dev/kmsg here; elsewhere the reader says why not.
    let mut r = KmsgReader::open();
    match r.unavailable() {
        None => {
            assert_eq!(r.describe(), "readable");
            // Opened at the end: kills from before now are not reported.
            // (A kill logged by another test in between would be; that is
            // fine, it is a real kill with a real pid.)
            for k in r.read_new() {
                assert!(k.pid > 0);
            }
        }
        Some(why) => eprintln!("kernel log unreadable here: {why}"),
    }
}

#[test]
fn a_record_is_placed_when_the_kernel_logged_it() {
    use oomscope_agent_core::readers::kmsg::{logged_at_now, logged_at_ns, monotonic_ns};
    let now = 1_800_000_000_000_000_000;
    let mono = 5_000_000_000_000; // 5,000 s since boot
                                  // Logged 1.5 s before it was read.
    assert_eq!(now - logged_at_ns(4_998_500_000, now, mono), 1_500_000_000);
    // A stamp in the future, or older than the clocks can be trusted: the
    // read time.
    assert_eq!(logged_at_ns(5_000_100_000, now, mono), now);
    assert_eq!(logged_at_ns(4_000_000_000, now, mono), now);
    // The real clocks: a record stamped now is placed now.
    let placed = logged_at_now((monotonic_ns() / 1000) as u64);
    assert!((oomscope_agent_core::now_ns() - placed).abs() < 1_000_000_000);
}
