//! A full /dev/shm said in the process's own words, strict overcommit judged
//! at its peak before the death, and RLIMIT_DATA: recorded evidence shaped
//! like `oomscope run`'s, each checked for its verdict and the numbers behind it.

mod common;

use common::*;
use oomscope_analysis::pb;
use oomscope_analysis::{diagnose, Evidence};

const OWN: &str = "/oomtest/child";

fn levels() -> Vec<pb::CgroupLevel> {
    vec![v1(OWN, V1_UNLIMITED, 300 * MIB, 310 * MIB, 0, 0)]
}

/// A supervised exit with `stderr` and `samples` before it; `edit` sets the
/// system readings of each sample (by index) and of the reading after the
/// death (None).
fn recorded(
    code: i32,
    stderr: &str,
    n_samples: usize,
    proc_: Option<pb::ProcessMemory>,
    edit: impl Fn(Option<usize>, &mut pb::SystemMemory),
) -> Evidence {
    let before = counters(T0, levels(), system(0, 12 * GIB));
    let mut after_sys = system(0, 12 * GIB);
    edit(None, &mut after_sys);
    let after = counters(T0 + 3 * SEC, levels(), after_sys);
    let mut e = supervised(
        exit(Some(code), None, stderr, before, after, proc_),
        "exit_oom_text",
    );
    e.samples = (0..n_samples)
        .map(|i| {
            let mut s = system(0, 12 * GIB);
            edit(Some(i), &mut s);
            sample(T0 + (i as i64 + 1) * SEC / 2, levels(), s)
        })
        .collect();
    e
}

#[test]
fn enospc_on_dev_shm_is_shm_with_the_peak_before_the_death() {
    let stderr = "Traceback (most recent call last):\n  File \"<string>\", line 4, in <module>\nOSError: [Errno 28] No space left on device: '/dev/shm/batch-7'\n";
    // A 32 MiB /dev/shm that fills while the child writes; its segment is
    // unlinked by the time the supervisor reads after the death.
    let e = recorded(1, stderr, 4, None, |i, s| {
        s.shm_total_bytes = 32 * MIB;
        s.shm_used_bytes = match i {
            Some(i) => [4, 16, 28, 32][i] * MIB,
            None => 0,
        };
    });
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("shm"), "{:#?}", d.evidence);
    has(
        &d.evidence,
        "stderr: OSError: [Errno 28] No space left on device: '/dev/shm/batch-7'",
    );
    has(&d.evidence, "/dev/shm used 32.0 MiB (33554432 bytes) of 32.0 MiB (33554432 bytes) (100.0%), the peak of 4 samples before the death");
    has(&d.evidence, "the writer: pid 4242");
    let c = cause(&d, "shm_full");
    assert_eq!(d.causes[0].kind, "shm_full");
    assert_eq!(metric(c, "shm_used_bytes"), (32 * MIB) as f64);
    assert_eq!(metric(c, "shm_total_bytes"), (32 * MIB) as f64);
    assert_eq!(metric(c, "shm_used_after_bytes"), 0.0);
    assert_eq!(metric(c, "writer_pid"), 4242.0);
    assert_eq!(c.confidence, 0.9);
    let actions: Vec<&str> = d.fixes.iter().map(|f| f.action.as_str()).collect();
    for want in ["--shm-size", "medium Memory", "num_workers", "file_system"] {
        assert!(
            actions.iter().any(|a| a.contains(want)),
            "no fix names {want}: {actions:#?}"
        );
    }
    assert!(
        !actions.iter().any(|a| a.contains("Rerun under")),
        "{actions:#?}"
    );
}

#[test]
fn torchs_shm_text_decides_without_a_full_reading_and_names_the_creator() {
    // The DataLoader's batch segment was refused; the samples (50 ms apart)
    // never caught /dev/shm full. The text decides; the fill only supports it.
    let stderr = "RuntimeError: unable to allocate shared memory(shm) for file </torch_5120_3046393498_0>: No space left on device (28)\n";
    let e = recorded(1, stderr, 3, None, |_, s| {
        s.shm_total_bytes = 64 * MIB;
        s.shm_used_bytes = 20 * MIB;
    });
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("shm"), "{:#?}", d.evidence);
    has(&d.evidence, "the writer: pid 5120, named in the text");
    let c = cause(&d, "shm_full");
    assert_eq!(metric(c, "writer_pid"), 5120.0);
    assert_eq!(metric(c, "shm_used_bytes"), (20 * MIB) as f64);
    has(&c.evidence, "the process's words decide");
    assert_eq!(c.confidence, 0.9);
    // The same evidence without the shm words is no shm verdict.
    let e = recorded(1, "RuntimeError: bad batch\n", 3, None, |_, s| {
        s.shm_total_bytes = 64 * MIB;
        s.shm_used_bytes = 20 * MIB;
    });
    let d = diagnose(&e);
    assert_ne!(d.domain.as_deref(), Some("shm"), "{:#?}", d.evidence);
    assert!(
        d.causes.iter().all(|c| c.kind != "shm_full"),
        "{:#?}",
        d.causes
    );
}

#[test]
fn strict_overcommit_is_judged_at_its_peak_before_the_death() {
    // A process held a 10 GiB reservation under mode 2 and failed the next
    // one; after its death Committed_AS is back to 84 MiB.
    let stderr = "OSError: [Errno 12] Cannot allocate memory\n";
    let peak = 10_100 * MIB;
    let e = recorded(1, stderr, 3, None, |i, s| {
        s.overcommit_mode = 2;
        s.commit_limit_bytes = 10_500 * MIB;
        s.committed_as_bytes = match i {
            Some(0) => 2 * GIB,
            Some(_) => peak,
            None => 84 * MIB,
        };
    });
    let d = diagnose(&e);
    assert_eq!(
        d.domain.as_deref(),
        Some("address_space"),
        "{:#?}",
        d.evidence
    );
    has(&d.evidence, "Committed_AS 9.9 GiB (10590617600 bytes) of CommitLimit 10.3 GiB (11010048000 bytes) (96.2%), the peak of 3 samples before the death");
    has(&d.evidence, "84.0 MiB (88080384 bytes) after the death");
    let c = cause(&d, "overcommit_limit");
    assert_eq!(metric(c, "committed_as_bytes"), peak as f64);
    assert_eq!(metric(c, "committed_as_after_bytes"), (84 * MIB) as f64);
    assert_eq!(c.confidence, 0.85);
}

#[test]
fn one_large_request_refused_under_strict_overcommit_is_overcommit_at_any_share() {
    let stderr = "Traceback (most recent call last):\nnumpy.core._exceptions._ArrayMemoryError: Unable to allocate 7.45 GiB for an array with shape (1000000000,) and data type float64\n";
    let e = recorded(1, stderr, 3, None, |_, s| {
        s.overcommit_mode = 2;
        s.commit_limit_bytes = 10 * GIB;
        s.committed_as_bytes = 6 * GIB;
    });
    let d = diagnose(&e);
    assert_eq!(
        d.domain.as_deref(),
        Some("address_space"),
        "{:#?}",
        d.evidence
    );
    let c = cause(&d, "overcommit_limit");
    assert_eq!(d.causes[0].kind, "overcommit_limit");
    assert_eq!(metric(c, "committed_as_bytes"), (6 * GIB) as f64);
    assert_eq!(metric(c, "commit_room_bytes"), (4 * GIB) as f64);
    assert_eq!(metric(c, "requested_bytes"), (7.45 * GIB as f64).round());
    has(
        &c.evidence,
        "below 90% of CommitLimit: one request larger than the 4.0 GiB",
    );
    has(&c.evidence, "the failed request: 7.5 GiB");
    assert!(
        d.fixes
            .iter()
            .any(|f| f.action.contains("CommitLimit had 4.0 GiB left")
                && f.action.contains("the failed request: 7.5 GiB")),
        "{:#?}",
        d.fixes
    );

    // A plain MemoryError gives no size: the same verdict, no request figure.
    let e = recorded(
        1,
        "Traceback (most recent call last):\nMemoryError\n",
        3,
        None,
        |_, s| {
            s.overcommit_mode = 2;
            s.commit_limit_bytes = 10 * GIB;
            s.committed_as_bytes = 3 * GIB;
        },
    );
    let d = diagnose(&e);
    assert_eq!(
        d.domain.as_deref(),
        Some("address_space"),
        "{:#?}",
        d.evidence
    );
    let c = cause(&d, "overcommit_limit");
    assert_eq!(metric(c, "commit_share"), 0.3);
    assert!(!c.metrics.contains_key("requested_bytes"), "{c:#?}");

    // Heuristic overcommit (mode 0) at the same figures: no commit verdict.
    let e = recorded(1, stderr, 3, None, |_, s| {
        s.overcommit_mode = 0;
        s.commit_limit_bytes = 10 * GIB;
        s.committed_as_bytes = 6 * GIB;
    });
    let d = diagnose(&e);
    assert_eq!(d.domain.as_deref(), Some("unknown"));
    assert!(d.causes.iter().all(|c| c.kind != "overcommit_limit"));
}

#[test]
fn rlimit_data_is_an_address_space_limit_of_its_own() {
    let mut p = process(CHILD_PID, 0, 230 * MIB, 228 * MIB);
    p.data_limit_bytes = 200 * MIB;
    let e = recorded(
        1,
        "Traceback (most recent call last):\nMemoryError\n",
        2,
        Some(p),
        |_, _| {},
    );
    let d = diagnose(&e);
    assert_eq!(
        d.domain.as_deref(),
        Some("address_space"),
        "{:#?}",
        d.evidence
    );
    has(&d.evidence, "RLIMIT_DATA 200.0 MiB (209715200 bytes)");
    let c = cause(&d, "data_limit");
    assert_eq!(d.causes[0].kind, "data_limit");
    assert_eq!(metric(c, "limit_bytes"), (200 * MIB) as f64);
    assert_eq!(metric(c, "vm_peak_bytes"), (230 * MIB) as f64);
    assert!(d.causes.iter().all(|c| c.kind != "address_space_limit"));
    assert!(
        d.fixes
            .iter()
            .any(|f| f.action.contains("RLIMIT_DATA (200.0 MiB)")),
        "{:#?}",
        d.fixes
    );
}
