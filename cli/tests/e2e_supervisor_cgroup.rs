//! The supervisor outlives the OOM it records: `oomscope run` started inside
//! a capped memory cgroup moves itself out and starts its child back in it;
//! a supervisor kept in (the test-only switch) and killed first is still read
//! as a cgroup OOM from its last readings. And one's own pressure: a kill
//! while another cgroup thrashes is not the victim's thrash.
//! Real v1/v2 cgroups, real processes, a real collector.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const MIB: u64 = 1 << 20;

/// The README's cgroup example: the `sh` block after "To see a cgroup verdict".
fn readme_cgroup_example() -> String {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .unwrap();
    let at = readme
        .find("To see a cgroup verdict")
        .expect("the README's cgroup example");
    let rest = &readme[at..];
    let start = rest.find("```sh\n").unwrap() + 6;
    let end = start + rest[start..].find("```").unwrap();
    rest[start..end].to_string()
}

/// The memory line's path of /proc/<pid>/cgroup (v1), or the v2 line's.
fn memory_cgroup_of(cgroup_file: &str) -> String {
    let lines: Vec<&str> = cgroup_file.lines().collect();
    lines
        .iter()
        .find_map(|l| {
            let mut p = l.splitn(3, ':');
            let (_, ctrl, path) = (p.next()?, p.next()?, p.next()?);
            ctrl.split(',')
                .any(|c| c == "memory")
                .then(|| path.to_string())
        })
        .or_else(|| {
            lines
                .iter()
                .find_map(|l| l.strip_prefix("0::").map(str::to_string))
        })
        .unwrap_or_default()
}

/// (before, after) of "memory.failcnt B -> A" in `text`.
fn failcnt_pair(text: &str) -> (u64, u64) {
    let at = text.find("memory.failcnt ").expect("a failcnt line") + "memory.failcnt ".len();
    let mut words = text[at..].split_whitespace();
    let b = words.next().unwrap().parse().unwrap();
    assert_eq!(words.next(), Some("->"));
    let a = words.next().unwrap().parse().unwrap();
    (b, a)
}

#[test]
fn the_readme_cgroup_example_ten_times_is_always_a_cgroup_oom() {
    let Some((own_dir, own_path, version)) = TestCgroup::own() else {
        panic!("this test needs a memory cgroup controller");
    };
    assert_eq!(version, "v1", "the README shows cgroup v1");
    let example = readme_cgroup_example();
    assert!(
        example.contains("/sys/fs/cgroup/memory/demo") && example.contains("oomscope run"),
        "{example}"
    );
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let bin_dir = Path::new(bin()).parent().unwrap().to_path_buf();
    let path_var = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut seen = 0;
    for run in 0..10 {
        // Ours, not the host's /demo: the same example under the test's own cgroup.
        let name = format!("oomscope-readme-{}-{run}", std::process::id());
        let cg = TestCgroup {
            dir: own_dir.join(&name),
            path: format!("{}/{name}", own_path.trim_end_matches('/')),
            version,
        };
        let script = example.replace("/sys/fs/cgroup/memory/demo", &cg.dir.display().to_string());
        let mut sh = Command::new("sh");
        isolate(&mut sh);
        let out = sh
            .args(["-c", &script])
            .env("PATH", &path_var)
            .env("OOMSCOPE_COLLECTOR", &col.url)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "run {run}: {stdout}\n{stderr}");
        assert!(
            stdout.contains("Memory domain: cgroup"),
            "run {run}: {stdout}\n{stderr}"
        );
        assert!(
            !stderr.contains("stays in the memory cgroup"),
            "run {run}: the supervisor could move: {stderr}"
        );
        // Every incident this run made (the kernel's kill, the child's end) is a cgroup OOM.
        let incs = col.incidents_of("demo", seen + 1, Duration::from_secs(10));
        assert!(incs.len() > seen, "run {run}: no new incident: {incs:#?}");
        for inc in &incs[seen..] {
            let id = inc["id"].as_str().unwrap().to_string();
            let d = col.json(&["diagnose", &id]);
            assert_eq!(d["domain"], "cgroup", "run {run}: {d:#}");
            assert_eq!(d["cgroup"]["limit_bytes"], 64 * MIB, "run {run}: {d:#}");
            assert_eq!(d["cgroup"]["owner_level"], cg.path.as_str(), "run {run}");
            assert_ne!(
                d["failure"]["kind"], "agent_lost",
                "run {run}: the supervisor lived: {d:#}"
            );
        }
        seen = incs.len();
        // The supervisor cleaned up the cgroup it made beside /demo, named
        // after its pid. Only this example's supervisors are looked for: the
        // other tests here run theirs beside their own cgroups at the same time.
        let agents = col.json(&["agents"]);
        let ours: Vec<PathBuf> = agents
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["hello"]["name"] == "demo" && a["hello"]["role"] == "supervisor")
            .map(|a| {
                let pid = a["hello"]["pid"].as_u64().expect("a supervisor's pid");
                own_dir.join(format!("oomscope-supervisor-{pid}"))
            })
            .collect();
        assert!(
            ours.len() > run,
            "run {run}: its supervisor is not listed: {agents:#}"
        );
        let left: Vec<&PathBuf> = ours.iter().filter(|d| d.exists()).collect();
        assert!(left.is_empty(), "run {run}: left behind: {left:?}");
        drop(cg);
    }
}

#[test]
fn the_supervisor_leaves_the_capped_cgroup_and_its_child_stays_in_it() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let cg = TestCgroup::create(None, "oomscope-place", Some(256 * MIB));
    let mut argv = vec![bin()];
    argv.extend(run_args(&col.url, "place"));
    // The child prints its parent's (the supervisor's) cgroup, then its own.
    argv.extend([
        "--",
        "sh",
        "-c",
        "cat /proc/$PPID/cgroup; echo ---; cat /proc/self/cgroup",
    ]);
    let out = cg.command(&argv).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (sup, child) = stdout.split_once("---").unwrap();
    assert_eq!(
        memory_cgroup_of(child),
        cg.path,
        "the child runs in its cgroup: {stdout}"
    );
    let sup = memory_cgroup_of(sup);
    let parent = &cg.path[..cg.path.rfind('/').unwrap()];
    // The supervisor's pid is the sh's parent: its cgroup is named after it.
    assert!(
        sup.starts_with(&format!("{parent}/oomscope-supervisor-")),
        "the supervisor moved beside it: {sup} (child's {})",
        cg.path
    );
    let made = cg
        .dir
        .parent()
        .unwrap()
        .join(sup.rsplit('/').next().unwrap());
    assert!(!made.exists(), "{} removed at exit", made.display());
}

/// A child that reads `file` into its page cache (charged to its cgroup),
/// then grows by 1 MiB every 20 ms until it is killed: reclaim of that cache
/// runs at the limit for a while, as under a server with its weights cached.
fn grower(file: &Path) -> String {
    format!(
        "import os,time\n\
         fd=os.open('{f}',os.O_RDONLY)\nos.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED)\n\
         while os.read(fd,1<<20): pass\n\
         b=[]\n\
         while True:\n    b.append(bytearray(1<<20)); time.sleep(0.02)\n",
        f = file.display()
    )
}

fn write_file(path: &Path, mib: usize) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![7u8; MIB as usize];
    for _ in 0..mib {
        f.write_all(&chunk).unwrap();
    }
    f.sync_all().unwrap();
}

fn tmp_file(tag: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{tag}-{}", std::process::id()))
}

fn read_u64(p: &Path) -> u64 {
    std::fs::read_to_string(p).unwrap().trim().parse().unwrap()
}

#[test]
fn a_supervisor_kept_in_the_cgroup_and_killed_first_still_reads_a_cgroup_oom() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let limit = 96 * MIB;
    let cg = TestCgroup::create(None, "oomscope-stay", Some(limit));
    if cg.version == "v1" {
        // memory.failcnt counts where the memory counter fails; with memsw at
        // the same value the memsw counter fails first (this host has no swap).
        let _ = std::fs::write(cg.dir.join("memory.memsw.limit_in_bytes"), "-1");
    }
    let file = tmp_file("stay-cache");
    write_file(&file, 48);
    let script = grower(&file);
    let mut argv = vec![bin()];
    argv.extend(run_args(&col.url, "stay"));
    argv.extend(["--", "python3", "-c", &script]);
    let mut c = cg.command(&argv);
    c.env("OOMSCOPE_TEST_STAY_IN_CGROUP", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let out = c.output().unwrap();
    let _ = std::fs::remove_file(&file);
    let stderr = String::from_utf8_lossy(&out.stderr);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        out.status.signal(),
        Some(9),
        "the kernel killed the supervisor first: {stderr}"
    );
    // Its child lives on until the next OOM kill takes it too.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(cg.dir.join("cgroup.procs"))
        .unwrap()
        .trim()
        .is_empty()
    {
        assert!(
            Instant::now() < deadline,
            "the orphaned child was not killed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let final_failcnt = if cg.version == "v1" {
        read_u64(&cg.dir.join("memory.failcnt"))
    } else {
        0
    };

    let incs = col.incidents_of("stay", 1, Duration::from_secs(15));
    assert_eq!(incs.len(), 1, "{incs:#?}");
    assert_eq!(incs[0]["kind"], "agent_lost", "{incs:#?}");
    let id = incs[0]["id"].as_str().unwrap().to_string();
    let d = col.json(&["diagnose", &id]);
    assert_eq!(d["domain"], "cgroup", "{d:#}");
    assert_eq!(d["cgroup"]["limit_bytes"], limit, "{d:#}");
    assert_eq!(d["cgroup"]["owner_level"], cg.path.as_str());
    let ev = evidence_text(&d);
    assert!(
        ev.contains("likely killed by a cgroup OOM (confidence 0.70"),
        "{ev}"
    );
    assert!(
        ev.contains(&format!("the supervisor stayed in {}", cg.path)),
        "the verdict says where the supervisor was: {ev}"
    );
    let cause = d["causes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["kind"] == "cgroup_limit")
        .expect("a cgroup_limit cause");
    assert_eq!(cause["confidence"], 0.7);
    if cg.version == "v1" {
        let (before, after) = failcnt_pair(&ev);
        assert!(
            before < after && after <= final_failcnt,
            "failcnt {before} -> {after} in the last readings, {final_failcnt} at the end: {ev}"
        );
    }
}

#[test]
fn a_kill_while_another_cgroup_thrashes_is_external_not_the_victims_thrash() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    // The neighbour: a 32 MiB cgroup re-reading a 128 MiB file (no swap
    // here, so its page cache is evicted and refaulted over and over).
    let data = tmp_file("neighbour-thrash");
    write_file(&data, 128);
    let neighbour = TestCgroup::create(None, "oomscope-neighbour", Some(32 * MIB));
    let thrash = format!(
        "import mmap,os,time\n\
         fd=os.open('{p}',os.O_RDONLY)\nn=128<<20\nos.posix_fadvise(fd,0,n,os.POSIX_FADV_DONTNEED)\n\
         m=mmap.mmap(fd,n,prot=mmap.PROT_READ)\nend=time.time()+12\ns=0\n\
         while time.time()<end:\n    for i in range(0,n,4096): s+=m[i]\n",
        p = data.display()
    );
    let mut thrasher = neighbour
        .command(&["python3", "-c", &thrash])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));

    // The victim, in a cgroup of its own without a limit, idle.
    let victim = TestCgroup::create(None, "oomscope-victim", None);
    let pidfile = tmp.path().join("child.pid");
    let child_cmd = format!(
        "echo $$ > {}; exec python3 -c 'import time; time.sleep(60)'",
        pidfile.display()
    );
    let sup = victim
        .command(&[
            bin(),
            "run",
            "--collector",
            &col.url,
            "--name",
            "bystander",
            "--interval",
            "250ms",
            "--",
            "sh",
            "-c",
            &child_cmd,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(6));
    let child: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // The test started this process (through the supervisor it started).
    unsafe { libc::kill(child, libc::SIGKILL) };
    let out = sup.wait_with_output().unwrap();
    let _ = thrasher.kill();
    let _ = thrasher.wait();
    let _ = std::fs::remove_file(&data);
    assert_eq!(
        out.status.code(),
        Some(137),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let incs = col.incidents_of("bystander", 1, Duration::from_secs(10));
    let id = incs.last().unwrap()["id"].as_str().unwrap().to_string();
    let d = col.json(&["diagnose", &id]);
    let ev = evidence_text(&d);
    assert_eq!(d["domain"], "external_kill", "{ev}");
    assert!(
        d["causes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["kind"] != "swap_thrash"),
        "{d:#}"
    );
    // The host did thrash (the rule that once blamed the victim held), and it is said as context.
    let line = ev
        .lines()
        .find(|l| l.starts_with("neighbour_pressure: the host thrashed (system refaults +"))
        .unwrap_or_else(|| panic!("no neighbour_pressure line: {ev}"));
    let pages: u64 = line["neighbour_pressure: the host thrashed (system refaults +".len()..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(pages >= 4096, "{line}");
    assert!(line.contains("major faults +"), "{line}");
    drop(victim);
    drop(neighbour);
}

#[test]
fn a_supervisor_that_cannot_move_says_so_once_and_the_oom_is_still_a_cgroup_oom() {
    let tmp = tempdir();
    let col = Collector::start(&tmp.path().join("db"));
    let limit = 96 * MIB;
    let cg = TestCgroup::create(None, "oomscope-ro", Some(limit));
    if cg.version == "v1" {
        let _ = std::fs::write(cg.dir.join("memory.memsw.limit_in_bytes"), "-1");
    }
    // The cgroup filesystem's mount point: the directory less the cgroup path.
    let dir = cg.dir.display().to_string();
    let mount = dir
        .strip_suffix(&cg.path)
        .expect("the dir ends with the path");
    let file = tmp_file("ro-cache");
    write_file(&file, 48);
    let script = grower(&file);
    // In the cgroup first, then a private mount namespace whose cgroupfs is read-only.
    let remount = format!("mount -o remount,ro,bind {mount} && exec \"$@\"");
    let mut argv = vec![
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        &remount,
        "sh",
        bin(),
    ];
    argv.extend(run_args(&col.url, "readonly"));
    argv.extend(["--", "python3", "-c", &script]);
    let out = cg
        .command(&argv)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let said = stderr
        .matches("the supervisor stays in the memory cgroup it watches")
        .count();
    assert_eq!(said, 1, "said once: {stderr}");
    assert!(stderr.contains("Read-only file system"), "{stderr}");
    // Whether the kernel took the supervisor too or not, every process ends.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(cg.dir.join("cgroup.procs"))
        .unwrap()
        .trim()
        .is_empty()
    {
        assert!(Instant::now() < deadline, "the child was not killed");
        std::thread::sleep(Duration::from_millis(100));
    }
    let incs = col.incidents_of("readonly", 1, Duration::from_secs(15));
    assert!(!incs.is_empty());
    for inc in &incs {
        let d = col.json(&["diagnose", inc["id"].as_str().unwrap()]);
        assert_eq!(d["domain"], "cgroup", "{d:#}");
        assert_eq!(d["cgroup"]["limit_bytes"], limit, "{d:#}");
        let ev = evidence_text(&d);
        if d["failure"]["kind"] == "agent_lost" {
            assert!(
                ev.contains(&format!(
                    "the supervisor stayed in {}, the cgroup it watches: cannot create",
                    cg.path
                )),
                "{ev}"
            );
        }
    }
}
