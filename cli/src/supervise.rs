//! `oomscope run`: supervise one child process, the process to be diagnosed.
//!
//! The supervisor watches from outside: it samples the child's memory domains,
//! keeps the tail of its stderr, and reads its status and limits at the end
//! *before reaping it* (`waitid` with `WNOWAIT`), because a `prlimit`/`ulimit`
//! inside the command is only visible late, and a fast failure is gone before
//! the first periodic sample. It never signals the child: it only waits.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::io::{Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use oomscope_agent_core::agent::{
    check_interval, Flow, Identity, Readers, SamplingLoop, INSTANCE_ENV,
};
use oomscope_agent_core::probe::{process, HostPaths, HostProbe};
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
use oomscope_agent_core::{now_ns, pb};
use oomscope_analysis::units::signal_name;

/// How much of the child's stderr is kept as evidence. 64 KiB holds a full
/// Python traceback or a CUDA OOM message with room to spare.
pub const DEFAULT_STDERR_TAIL_BYTES: usize = 64 * 1024;
/// How often the child is sampled from outside. Reading procfs and the cgroup
/// files costs well under a millisecond, so 4 Hz is cheap and still catches
/// growth that kills a process within a few seconds.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(250);
/// How often `waitid` is polled for the child's end (and a stop signal passed
/// on) between samples, so that the end is read within this delay even when
/// the sample interval is long.
const EXIT_POLL: Duration = Duration::from_millis(10);
/// The longest wait for the collector to ack everything before exiting.
pub const DEFAULT_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// Restart backoff: first delay and the cap. Doubling from 0.5 s reaches the
/// cap after 6 restarts; a crash loop is reported once `--restart` is spent.
pub const DEFAULT_BACKOFF_INITIAL: Duration = Duration::from_millis(500);
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// How many processes a ProcessList at the child's end names.
const TOP_PROCESSES: usize = 10;

pub struct RunConfig {
    pub command: Vec<String>,
    pub name: String,
    pub collector_url: String,
    pub restart: u32,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub interval: Duration,
    pub stderr_tail_bytes: usize,
    pub flush_timeout: Duration,
    pub spool_dir: Option<PathBuf>,
}

/// How one run of the child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Exited(i32),
    Signaled(i32),
}

impl Ending {
    /// The status a shell would report: the code, or 128+N for signal N.
    pub fn shell_status(self) -> i32 {
        match self {
            Ending::Exited(c) => c,
            Ending::Signaled(s) => 128 + s,
        }
    }
    pub fn is_clean(self) -> bool {
        self == Ending::Exited(0)
    }
}

/// Runs the child (restarting it as configured) and returns the status to exit with.
pub fn run(cfg: RunConfig) -> anyhow::Result<i32> {
    let interval = check_interval(cfg.interval)?;
    let paths = HostPaths::system();
    let me = HostProbe::new(paths.clone(), std::process::id());
    let hello = hello(&cfg, &me);
    let reporter = Reporter::start(
        ReporterConfig {
            collector_url: cfg.collector_url.clone(),
            spool_dir: cfg.spool_dir.clone(),
            ..ReporterConfig::default()
        },
        hello,
    );
    let agent_id = reporter.agent_id().to_string();
    let directives = reporter.directives();
    install_forwarding();
    // One loop for every restart: an interval the collector set stays set.
    let mut sampling = SamplingLoop::new(&reporter, directives.as_ref(), interval);

    let mut attempt = 0u32;
    let ending = loop {
        let last_try = attempt >= cfg.restart;
        let ctx = Supervision {
            cfg: &cfg,
            paths: &paths,
            reporter: &reporter,
            agent_id: &agent_id,
        };
        let ending = run_once(&ctx, attempt, last_try, &mut sampling)?;
        if stop_requested() {
            // Someone asked the supervisor to stop: the child got the signal; no restart.
            break ending;
        }
        if ending.is_clean() || last_try {
            if !ending.is_clean() && cfg.restart > 0 {
                eprintln!(
                    "oomscope: crash loop: `{}` failed {} times in a row (last: {}); \
                     not restarting again. Run `oomscope diagnose` to see why.",
                    cfg.command.join(" "),
                    attempt + 1,
                    describe(ending)
                );
            }
            break ending;
        }
        let delay = backoff(cfg.backoff_initial, cfg.backoff_max, attempt);
        eprintln!(
            "oomscope: child {}; restart {}/{} in {:.1} s",
            describe(ending),
            attempt + 1,
            cfg.restart,
            delay.as_secs_f64()
        );
        std::thread::sleep(delay);
        if stop_requested() {
            // Asked to stop while waiting to restart: the child is already gone.
            break ending;
        }
        attempt += 1;
    };

    let goodbye = pb::Goodbye {
        reason: format!("child {}", describe(ending)),
        exit_code: ending.shell_status(),
    };
    if !reporter.shutdown(goodbye, cfg.flush_timeout) {
        eprintln!(
            "oomscope: the collector at {} did not ack everything within {:.1} s; \
             {}",
            cfg.collector_url,
            cfg.flush_timeout.as_secs_f64(),
            match &cfg.spool_dir {
                Some(d) => format!("the unsent evidence stays in the spool at {}", d.display()),
                None =>
                    "the unsent evidence is lost (pass --spool DIR to keep it on disk)".to_string(),
            }
        );
    }
    Ok(ending.shell_status())
}

/// Delay before restart `attempt + 1`: doubling, capped.
pub fn backoff(initial: Duration, max: Duration, attempt: u32) -> Duration {
    initial.saturating_mul(1u32 << attempt.min(20)).min(max)
}

pub fn describe(e: Ending) -> String {
    match e {
        Ending::Exited(c) => format!("exited with code {c}"),
        Ending::Signaled(s) => format!("was killed by signal {s} ({})", signal_name(s)),
    }
}

fn hello(cfg: &RunConfig, me: &HostProbe) -> pb::Hello {
    let mut hello = Identity {
        name: cfg.name.clone(),
        role: "supervisor".into(),
        rank: 0,
        runtime: "supervisor".into(),
    }
    .hello(me);
    // The supervisor is its instance: every process it starts joins it.
    hello.instance = hello.agent_id.clone();
    hello.gpus = me.gpu().placements();
    hello.command = cfg.command.clone();
    hello
}

fn event(kind: pb::event::Kind) -> pb::Event {
    pb::Event {
        time_ns: now_ns(),
        kind: Some(kind),
    }
}

/// What stays the same across restarts of the child.
struct Supervision<'a> {
    cfg: &'a RunConfig,
    paths: &'a HostPaths,
    reporter: &'a Reporter,
    agent_id: &'a str,
}

/// Spawns the child once, samples it until it ends, reports its end.
fn run_once(
    ctx: &Supervision,
    attempt: u32,
    last_try: bool,
    sampling: &mut SamplingLoop,
) -> anyhow::Result<Ending> {
    let Supervision {
        cfg,
        paths,
        reporter,
        agent_id,
    } = *ctx;
    let started = Instant::now();
    let mut cmd = Command::new(&cfg.command[0]);
    cmd.args(&cfg.command[1..])
        .env("OOMSCOPE_COLLECTOR", &cfg.collector_url)
        .env("OOMSCOPE_NAME", &cfg.name)
        .env("OOMSCOPE_SUPERVISOR_AGENT", agent_id)
        .env(INSTANCE_ENV, agent_id)
        .stdin(Stdio::inherit())
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped());
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            // As a shell would: 127 for "not found", 126 for "cannot execute".
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
            eprintln!("oomscope: cannot start `{}`: {e}", cfg.command[0]);
            return Ok(Ending::Exited(code));
        }
    };
    let pid = child.id();
    let probe = HostProbe::new(paths.clone(), pid);
    let before = probe.counters();
    let last_process = process::read(paths, pid).ok();
    reporter.send_event(event(pb::event::Kind::ChildStart(pb::ChildStart {
        pid,
        command: cfg.command.clone(),
        counters: Some(before.clone()),
        process: last_process,
    })));

    let tail = Arc::new(Mutex::new(VecDeque::with_capacity(cfg.stderr_tail_bytes)));
    let stderr_thread = child.stderr.take().map(|pipe| {
        let tail = tail.clone();
        let cap = cfg.stderr_tail_bytes;
        std::thread::Builder::new()
            .name("oomscope-stderr".into())
            .spawn(move || tee_stderr(pipe, &tail, cap))
            .expect("spawn stderr thread")
    });

    // Sample until the child ends; leave it unreaped so /proc/<pid> stays readable.
    let mut watch = ChildWatch {
        probe,
        pid,
        last_process,
    };
    sampling.run(&mut watch, None);
    let ChildWatch {
        probe,
        last_process,
        ..
    } = watch;

    // The child has ended but is not reaped: read what it left.
    let after = probe.counters();
    let final_process = match process::read(paths, pid) {
        Ok(p) => merge_process(last_process, p),
        Err(_) => last_process.unwrap_or_default(),
    };
    let plist = probe.process_list(TOP_PROCESSES);

    let status = child.wait().context("reaping the child")?;
    let ending = match (status.code(), status.signal()) {
        (Some(c), _) => Ending::Exited(c),
        (None, Some(s)) => Ending::Signaled(s),
        (None, None) => Ending::Exited(-1),
    };
    if let Some(t) = stderr_thread {
        join_bounded(t, Duration::from_secs(1));
    }
    let stderr_tail = {
        let t = tail.lock().unwrap_or_else(|p| p.into_inner());
        String::from_utf8_lossy(&t.iter().copied().collect::<Vec<u8>>()).into_owned()
    };

    reporter.send_event(event(pb::event::Kind::ProcessList(plist)));
    let crash_loop = !ending.is_clean() && last_try && cfg.restart > 0;
    let exit = pb::ChildExit {
        pid,
        exit_code: match ending {
            Ending::Exited(c) => Some(c),
            _ => None,
        },
        signal: match ending {
            Ending::Signaled(s) => Some(s),
            _ => None,
        },
        core_dumped: status.core_dumped(),
        stderr_tail,
        before: Some(before),
        after: Some(after),
        process: Some(final_process),
        attempt,
        crash_loop,
        runtime_ns: started.elapsed().as_nanos() as u64,
        stop_signal: None,
    };
    reporter.send_event(event(pb::event::Kind::ChildExit(exit)));
    Ok(ending)
}

/// The child seen from outside, on the agent skeleton's sampling loop: a
/// sample every interval, and between samples a poll for its end and for a
/// stop signal to pass on. It has no allocator to snapshot and no heap to
/// census, so other directives are ignored.
struct ChildWatch {
    probe: HostProbe,
    pid: u32,
    /// The latest reading of the child, whose limits and peaks a zombie no longer shows.
    last_process: Option<pb::ProcessMemory>,
}

impl Readers for ChildWatch {
    type Job = Infallible;

    fn tick(&mut self, reporter: &Reporter) {
        let s = self.probe.sample();
        if let Some(p) = &s.process {
            self.last_process = Some(merge_process(self.last_process.take(), *p));
        }
        reporter.send_sample(s);
    }

    fn poll(&mut self, _: &Reporter) -> Flow {
        let pid = self.pid;
        let sig = PENDING_SIGNAL.swap(0, Ordering::Relaxed);
        if sig != 0 {
            // The supervisor started this child: passing a stop signal on is its job.
            // SAFETY: kill(2) on our own, not yet reaped, child.
            unsafe { libc::kill(pid as libc::pid_t, sig) };
            eprintln!(
                "oomscope: passed signal {sig} ({}) on to the child {pid}",
                signal_name(sig)
            );
        }
        match wait_exited_nowait(pid) {
            Ok(false) => Flow::Continue,
            Ok(true) => Flow::Stop,
            Err(e) => {
                tracing::warn!("waitid({pid}) failed: {e}; falling back to a reaping wait");
                Flow::Stop
            }
        }
    }

    fn next_wake(&self) -> Option<Instant> {
        Some(Instant::now() + EXIT_POLL)
    }
}

/// A stop signal (SIGTERM, SIGINT, SIGHUP) the supervisor received and has
/// yet to pass on to its child; 0 = none.
static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);
/// Set once any stop signal arrived: the supervisor then restarts nothing.
static STOP_REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(sig: libc::c_int) {
    // Async-signal-safe: two atomic stores; the sampling loop does the rest.
    PENDING_SIGNAL.store(sig, Ordering::Relaxed);
    STOP_REQUESTED.store(true, Ordering::Relaxed);
}

fn stop_requested() -> bool {
    STOP_REQUESTED.load(Ordering::Relaxed)
}

/// `oomscope run` stands in for its child: a stop signal meant for the
/// service is passed on, the child's end is recorded as usual, and then the
/// supervisor exits with the child's status instead of restarting it.
fn install_forwarding() {
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: installs a handler that only stores to atomics.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_stop_signal as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            sa.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// True once `pid` has exited, without reaping it.
fn wait_exited_nowait(pid: u32) -> std::io::Result<bool> {
    // SAFETY: waitid writes into a zeroed siginfo_t that we own.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let rc = libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOWAIT | libc::WNOHANG,
        );
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(info.si_pid() != 0)
    }
}

/// Keeps the limits and peaks a zombie no longer shows (its mm is gone):
/// values read late win when present, earlier samples fill the gaps.
fn merge_process(earlier: Option<pb::ProcessMemory>, late: pb::ProcessMemory) -> pb::ProcessMemory {
    let Some(e) = earlier else { return late };
    let pick = |l: u64, e: u64| if l != 0 { l } else { e };
    pb::ProcessMemory {
        pid: late.pid,
        vm_rss_bytes: pick(late.vm_rss_bytes, e.vm_rss_bytes),
        vm_hwm_bytes: late.vm_hwm_bytes.max(e.vm_hwm_bytes),
        vm_size_bytes: pick(late.vm_size_bytes, e.vm_size_bytes),
        vm_peak_bytes: late.vm_peak_bytes.max(e.vm_peak_bytes),
        vm_swap_bytes: pick(late.vm_swap_bytes, e.vm_swap_bytes),
        major_faults: late.major_faults.max(e.major_faults),
        address_space_limit_bytes: pick(
            late.address_space_limit_bytes,
            e.address_space_limit_bytes,
        ),
        data_limit_bytes: pick(late.data_limit_bytes, e.data_limit_bytes),
        rss_anon_bytes: pick(late.rss_anon_bytes, e.rss_anon_bytes),
        rss_shmem_bytes: pick(late.rss_shmem_bytes, e.rss_shmem_bytes),
    }
}

/// Passes the child's stderr through unchanged and keeps its last `cap` bytes.
fn tee_stderr(mut pipe: impl Read, tail: &Mutex<VecDeque<u8>>, cap: usize) {
    let mut buf = [0u8; 8192];
    let mut out = std::io::stderr();
    loop {
        match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let _ = out.write_all(&buf[..n]);
                let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
                t.extend(&buf[..n]);
                let excess = t.len().saturating_sub(cap);
                t.drain(..excess);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
}

/// A grandchild may keep the pipe open after the child died; don't wait on it forever.
fn join_bounded(t: std::thread::JoinHandle<()>, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !t.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    if t.is_finished() {
        let _ = t.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let i = Duration::from_millis(100);
        let m = Duration::from_millis(1000);
        let d: Vec<_> = (0..6).map(|a| backoff(i, m, a).as_millis()).collect();
        assert_eq!(d, vec![100, 200, 400, 800, 1000, 1000]);
    }

    #[test]
    fn shell_status_of_a_signal_is_128_plus_n() {
        assert_eq!(Ending::Signaled(9).shell_status(), 137);
        assert_eq!(Ending::Exited(3).shell_status(), 3);
        assert!(!Ending::Signaled(9).is_clean());
    }
}
