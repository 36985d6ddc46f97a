//! The kernel's figures first: where the kernel recorded its OOM kill, the
//! diagnosis carries the record (`kernel_report`) and the host causes quote
//! the victim's memory at the kill before any cgroup file read after it
//! (by then the victim's pages were freed: memory.stat shows what was left).

mod common;

use common::*;
use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{diagnose, Evidence};

const OWN: &str = "/oomtest/child";
const WORKER_PID: u32 = 4243;

/// The worker's kill as vLLM under a 2.5 GiB cgroup saw it: anon-rss 2.0 GiB.
fn worker_record() -> pb::KernelOomKill {
    pb::KernelOomKill {
        pid: WORKER_PID,
        task: "VLLM::Worker".into(),
        constraint: "CONSTRAINT_MEMCG".into(),
        oom_memcg: OWN.into(),
        task_memcg: OWN.into(),
        total_vm_bytes: 9 * GIB,
        anon_rss_bytes: 2 * GIB,
        file_rss_bytes: 12 * MIB,
        shmem_rss_bytes: 0,
        oom_score_adj: 500,
        memcg_usage_bytes: 5 * GIB / 2,
        memcg_limit_bytes: 5 * GIB / 2,
        ..Default::default()
    }
}

/// A v2 cgroup of 2.5 GiB whose memory.events.local oom rose; read again
/// at the exit, after the kill: 7.1 MiB anon and 366 MiB of page cache left.
/// The API server (the child) exits with code 0 once its worker is gone.
fn killed_worker(kernel: bool) -> Evidence {
    let limit = 5 * GIB / 2;
    let before = counters(
        T0,
        vec![v2(OWN, limit, 400 * MIB, 400 * MIB, V2Events::default())],
        system(3, 12 * GIB),
    );
    let mut after_level = v2(
        OWN,
        limit,
        380 * MIB,
        limit,
        V2Events {
            max: 40,
            oom: 1,
            oom_kill: 1,
            local_oom: 1,
            local_oom_kill: 1,
        },
    );
    after_level.anon_bytes = 7_444_889;
    after_level.file_bytes = 366 * MIB;
    let after = counters(T0 + 3 * SEC, vec![after_level], system(3, 12 * GIB));
    let mut e = supervised(exit(Some(0), None, "", before, after, None), "signal");
    if kernel {
        e.events.insert(
            0,
            pb::Event {
                time_ns: T0 + 2 * SEC,
                kind: Some(Kind::KernelOomKill(worker_record())),
            },
        );
    }
    e
}

fn position(lines: &[String], needle: &str) -> usize {
    lines
        .iter()
        .position(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no line contains {needle:?} in {lines:#?}"))
}

#[test]
fn the_cgroup_cause_quotes_the_kernels_figures_before_files_read_after_the_kill() {
    let d = diagnose(&killed_worker(true));
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    let c = d
        .causes
        .iter()
        .find(|c| c.kind == "cgroup_limit")
        .unwrap_or_else(|| panic!("{:#?}", d.causes));
    assert_eq!(
        c.evidence[0],
        "the kernel's record at the kill: victim pid 4243 (VLLM::Worker) anon-rss 2.0 GiB, file-rss 12.0 MiB, shmem-rss 0 B; cgroup /oomtest/child usage 2.5 GiB of limit 2.5 GiB"
    );
    let after = position(&c.evidence, "memory.stat, read after the kill");
    assert!(after > 0, "{:#?}", c.evidence);
    assert!(
        c.evidence[after].contains("anon 7.1 MiB") && c.evidence[after].contains("file 366.0 MiB")
    );
    assert_eq!(c.metrics["victim_anon_rss_bytes"], (2 * GIB) as f64);
    assert_eq!(c.metrics["victim_file_rss_bytes"], (12 * MIB) as f64);
    assert_eq!(c.metrics["anon_bytes"], 7_444_889.0);

    // The record itself, whole, in the diagnosis and its JSON.
    let k = d.kernel_report.as_ref().expect("kernel_report");
    assert_eq!((k.pid, k.command.as_str()), (WORKER_PID, "VLLM::Worker"));
    assert_eq!(k.anon_rss_bytes, 2 * GIB);
    assert_eq!(k.file_rss_bytes, 12 * MIB);
    assert_eq!(k.total_vm_bytes, 9 * GIB);
    assert_eq!(k.constraint, "CONSTRAINT_MEMCG");
    assert_eq!((k.oom_memcg.as_str(), k.task_memcg.as_str()), (OWN, OWN));
    assert_eq!(k.memcg_usage_bytes, 5 * GIB / 2);
    assert_eq!(k.memcg_limit_bytes, 5 * GIB / 2);
    assert_eq!(k.oom_score_adj, 500);
    let j = to_json(&d);
    assert_eq!(j["kernel_report"]["anon_rss_bytes"], 2 * GIB);
    assert_eq!(j["kernel_report"]["command"], "VLLM::Worker");
    assert_eq!(j["kernel_report"]["oom_score_adj"], 500);
}

#[test]
fn without_a_kernel_record_the_files_speak_unlabelled() {
    // A SIGKILL and the counters alone (without the record, a code 0 exit
    // would be a clean end).
    let mut e = killed_worker(false);
    for ev in &mut e.events {
        if let Some(Kind::ChildExit(x)) = &mut ev.kind {
            (x.exit_code, x.signal) = (None, Some(9));
        }
    }
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    assert!(d.kernel_report.is_none());
    assert!(to_json(&d)["kernel_report"].is_null());
    let c = d
        .causes
        .iter()
        .find(|c| c.kind == "cgroup_limit")
        .unwrap_or_else(|| panic!("{:#?}", d.causes));
    assert!(
        c.evidence.iter().all(|l| !l.contains("kernel's record")),
        "{:#?}",
        c.evidence
    );
    let stat = position(&c.evidence, "memory.stat");
    assert!(
        c.evidence[stat].starts_with("cgroup /oomtest/child memory.stat: anon 7.1 MiB"),
        "{:#?}",
        c.evidence
    );
    assert!(!c.metrics.contains_key("victim_anon_rss_bytes"));
}

#[test]
fn the_host_ram_cause_quotes_the_kernels_figures_first() {
    let levels = vec![v1(OWN, V1_UNLIMITED, 200 * MIB, 210 * MIB, 0, 0)];
    let before = counters(T0, levels.clone(), system(7, 12 * GIB));
    let after = counters(T0 + 3 * SEC, levels, system(8, 12 * GIB));
    let mut record = worker_record();
    record.pid = CHILD_PID;
    record.task = "python3".into();
    record.constraint = "CONSTRAINT_NONE".into();
    record.oom_memcg = "/".into();
    record.memcg_usage_bytes = 0;
    record.memcg_limit_bytes = 0;
    let mut e = supervised(exit(None, Some(9), "", before, after, None), "signal");
    e.events.push(pb::Event {
        time_ns: T0 + 3 * SEC,
        kind: Some(Kind::KernelOomKill(record)),
    });
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("host_ram"), "{:#?}", d.evidence);
    let c = d
        .causes
        .iter()
        .find(|c| c.kind == "host_ram_exhausted")
        .unwrap_or_else(|| panic!("{:#?}", d.causes));
    // No cgroup limit in a global record: the victim's figures alone.
    assert_eq!(
        c.evidence[0],
        "the kernel's record at the kill: victim pid 4242 (python3) anon-rss 2.0 GiB, file-rss 12.0 MiB, shmem-rss 0 B"
    );
    assert!(position(&c.evidence, "(read after the death)") > 0);
    assert_eq!(c.metrics["victim_anon_rss_bytes"], (2 * GIB) as f64);
    assert_eq!(
        d.kernel_report.as_ref().unwrap().constraint,
        "CONSTRAINT_NONE"
    );
}
