//! Host limits other than a plain kill, on real processes under `oomscope
//! run` with a real collector: a full /dev/shm (a 32 MiB tmpfs mounted on
//! /dev/shm in a private mount namespace, for the supervisor and its child
//! only; the host's /dev/shm is never touched) that a Python write and a
//! real torch DataLoader run into, and a real RLIMIT_DATA.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::*;
use serde_json::Value;

const MIB: f64 = 1048576.0;

fn cause<'a>(d: &'a Value, kind: &str) -> &'a Value {
    d["causes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} cause: {d:#}"))
}

fn metric(c: &Value, name: &str) -> f64 {
    c["metrics"][name]
        .as_f64()
        .unwrap_or_else(|| panic!("no metric {name}: {c:#}"))
}

/// The incident of `name` that its failed exit's text made, diagnosed.
fn diagnose_text_exit(col: &Collector, name: &str) -> Value {
    let incs = col.incidents_of(name, 1, Duration::from_secs(10));
    let inc = incs
        .iter()
        .find(|i| i["kind"] == "exit_oom_text")
        .unwrap_or_else(|| panic!("no exit_oom_text incident for {name}: {incs:#?}"));
    col.json(&["diagnose", inc["id"].as_str().unwrap()])
}

/// The /dev/shm lines of this process's mount table.
fn host_dev_shm() -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.split(' ').nth(4) == Some("/dev/shm"))
        .map(str::to_string)
        .collect()
}

/// `oomscope run ... -- cmd` with a 32 MiB tmpfs on /dev/shm in a private
/// mount namespace: the mount lives and dies with the supervisor and its child.
fn run_with_small_shm(col: &Collector, name: &str, cmd: &[&str]) -> Output {
    let host = host_dev_shm();
    let mut c = Command::new("unshare");
    isolate(&mut c);
    let out = c
        .args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs -o size=32m tmpfs /dev/shm && exec \"$0\" \"$@\"",
            bin(),
        ])
        .args(run_args(&col.url, name))
        .arg("--")
        .args(cmd)
        .output()
        .expect("unshare");
    assert_eq!(host_dev_shm(), host, "the host's /dev/shm is untouched");
    out
}

#[test]
fn enospc_on_a_full_dev_shm_is_shm() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    // 1 MiB every 20 ms, so the 50 ms samples see it fill.
    let script = "import time\nf=open('/dev/shm/oomscope-fill','wb')\n\
                  while True:\n    f.write(b'x'*(1<<20)); f.flush(); time.sleep(0.02)\n";
    let out = run_with_small_shm(&col, "shm-enospc", &["python3", "-c", script]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("No space left on device"), "{stderr}");

    let d = diagnose_text_exit(&col, "shm-enospc");
    assert_eq!(d["domain"], "shm", "{d:#}");
    let ev = evidence_text(&d);
    assert!(ev.contains("[Errno 28] No space left on device"), "{ev}");
    let c = cause(&d, "shm_full");
    assert_eq!(d["causes"][0]["kind"], "shm_full", "{d:#}");
    assert_eq!(metric(c, "shm_total_bytes"), 32.0 * MIB);
    // The peak before the death: the file filled the tmpfs (less the
    // tmpfs's own few pages).
    assert!(metric(c, "shm_used_bytes") >= 28.0 * MIB, "{c:#}");
    assert_eq!(
        metric(c, "writer_pid"),
        d["victim"]["pid"].as_f64().unwrap()
    );
    let fixes = d["fixes"].to_string();
    assert!(
        fixes.contains("--shm-size") && fixes.contains("file_system"),
        "{fixes}"
    );
}

#[test]
fn a_torch_dataloader_in_a_small_dev_shm_is_shm() {
    let torch = python();
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    // Two workers pass 32 MiB batches (4 tensors of 8 MiB) over shared memory.
    let script = "import torch\nfrom torch.utils.data import Dataset, DataLoader\n\
                  class Big(Dataset):\n    def __len__(self): return 64\n    \
                  def __getitem__(self, i): return torch.ones(2 << 20)\n\
                  for b in DataLoader(Big(), batch_size=4, num_workers=2): pass\n";
    let out = run_with_small_shm(&col, "shm-torch", &[&torch, "-c", script]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");

    let d = diagnose_text_exit(&col, "shm-torch");
    assert_eq!(d["domain"], "shm", "{d:#}");
    let c = cause(&d, "shm_full");
    assert_eq!(metric(c, "shm_total_bytes"), 32.0 * MIB);
    // A worker created the segment (its pid is in the name), not the main process.
    let writer = metric(c, "writer_pid");
    assert!(writer > 0.0, "{c:#}");
    assert_ne!(
        writer,
        d["victim"]["pid"].as_f64().unwrap(),
        "a worker, not the main process: {d:#}"
    );
    let ev = evidence_text(&d);
    assert!(ev.contains("shared memory"), "{ev}");
    let fixes = d["fixes"].to_string();
    assert!(
        fixes.contains("num_workers") && fixes.contains("--shm-size"),
        "{fixes}"
    );
}

#[test]
fn rlimit_data_on_a_growing_process_is_data_limit() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let script =
        "import time\nb=[]\nwhile True:\n    b.append(bytearray(4<<20)); time.sleep(0.01)\n";
    let out = run(
        &col.url,
        "data-limit",
        &[],
        &["prlimit", "--data=209715200", "python3", "-c", script],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("MemoryError"), "{stderr}");

    let d = diagnose_text_exit(&col, "data-limit");
    assert_eq!(d["domain"], "address_space", "{d:#}");
    assert_eq!(d["causes"][0]["kind"], "data_limit", "{d:#}");
    let c = cause(&d, "data_limit");
    assert_eq!(metric(c, "limit_bytes"), 209715200.0);
    let ev = evidence_text(&d);
    assert!(
        ev.contains("RLIMIT_DATA 200.0 MiB (209715200 bytes)"),
        "{ev}"
    );
    assert!(
        !ev.contains("no RLIMIT_AS, no strict overcommit"),
        "RLIMIT_DATA explains it: {ev}"
    );
}
