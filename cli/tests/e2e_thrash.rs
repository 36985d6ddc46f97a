//! Thrash: a slowdown without death. A child in a small memory cgroup maps a
//! file larger than its limit and re-reads it, so its page cache is evicted
//! and refaulted over and over. Nothing dies; the verdict comes from samples.

mod common;

use common::*;

#[test]
fn file_refault_pressure_is_swap_thrash() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    // On disk, not tmpfs: tmpfs pages could not be evicted without swap.
    let data = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("thrash-{}", std::process::id()));
    let cg = TestCgroup::create(None, "oomscope-thrash", Some(32 << 20));
    let script = format!(
        "import mmap,os,time\n\
         p='{p}'\nn=128<<20\n\
         b=os.urandom(1<<20)\nwith open(p,'wb') as f:\n    for _ in range(128): f.write(b)\n    f.flush(); os.fsync(f.fileno())\n\
         fd=os.open(p,os.O_RDONLY)\nos.posix_fadvise(fd,0,n,os.POSIX_FADV_DONTNEED)\n\
         m=mmap.mmap(fd,n,prot=mmap.PROT_READ)\n\
         end=time.time()+4\ns=0\n\
         while time.time()<end:\n    for i in range(0,n,4096): s+=m[i]\n\
         print('passes done', s>0)\n",
        p = data.display()
    );
    let argv = [
        bin(),
        "run",
        "--collector",
        &col.url,
        "--name",
        "thrash",
        "--interval",
        "250ms",
        "--",
        "python3",
        "-c",
        &script,
    ];
    let out = cg.command(&argv).output().unwrap();
    let _ = std::fs::remove_file(&data);
    assert_eq!(
        out.status.code(),
        Some(0),
        "no death: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        col.incidents_of("thrash", 1, std::time::Duration::from_millis(500))
            .is_empty(),
        "thrash is not an incident"
    );

    let d = col.json(&["diagnose", "--agent", "thrash"]);
    assert_eq!(d["domain"], "swap_thrash", "{d:#}");
    let ev: String = d["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(ev.contains("refault"), "refault evidence: {ev}");
    assert!(
        ev.to_lowercase().contains("psi") || ev.contains("pressure"),
        "PSI evidence: {ev}"
    );
    let thrash = d["causes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["kind"] == "swap_thrash")
        .expect("a swap_thrash cause");
    assert!(
        thrash["metrics"]["refaults_per_s"].as_f64().unwrap() > 100.0,
        "{thrash:#}"
    );
}
