//! `oomscope run`: supervise one child process, the process to be diagnosed.
//!
//! The supervisor watches from outside: it samples the child's memory domains,
//! keeps the tail of its stderr, and reads its status and limits at the end
//! *before reaping it* (`waitid` with `WNOWAIT`), because a `prlimit`/`ulimit`
//! inside the command is only visible late, and a fast failure is gone before
//! the first periodic sample.
//!
//! Each sample carries the whole supervised tree (the child and its
//! descendants), and the kernel's log is polled for OOM kills of any process
//! of that tree: the kernel's record is the authoritative figure at the kill.
//! The supervisor leaves the capped memory cgroup it watches (see `place`)
//! and shields itself from the OOM killer (oom_score_adj -1000, giving the
//! child its own value back), so that it is never the victim that takes the
//! evidence with it. It signals nothing but its own child,
//! and that only to pass on a stop signal it received.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use oomscope_agent_core::agent::{
    check_interval, Flow, Identity, Readers, SamplingLoop, INSTANCE_ENV,
};
use oomscope_agent_core::readers::kmsg::KmsgReader;
use oomscope_agent_core::readers::tree::TreeWatch;
use oomscope_agent_core::readers::{process, HostPaths, HostReader};
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
use oomscope_agent_core::{now_ns, pb};
use oomscope_analysis::units::signal_name;

mod members;
mod place;
use members::{name_processes, Members, MEMBER_EXITS_LABEL};
pub use place::STAY_IN_CGROUP_ENV;
use place::{join_cgroup, Placement};

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
/// At the child's end, how long a kill record the kernel is still writing
/// (its first lines read, not its "Killed process") is waited for, so that
/// the kill comes before the exit in the timeline.
const KMSG_DRAIN: Duration = Duration::from_millis(100);
/// The Hello label that says whether the kernel's OOM records can be read:
/// "readable", or "unreadable: <reason>" (an unprivileged container).
pub const KERNEL_LOG_LABEL: &str = "kernel_log";
/// The supervisor's own oom_score_adj: the OOM killer never chooses it.
const SUPERVISOR_OOM_SCORE_ADJ: i32 = -1000;
/// Where a process sets its own OOM-killer bias.
const OOM_SCORE_ADJ_PATH: &str = "/proc/self/oom_score_adj";

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
    let me = HostReader::new(paths.clone(), std::process::id());
    // Read before the supervisor leaves its cgroup: the Hello's cgroup is the child's.
    let mut hello = hello(&cfg, &me);
    let placement = Placement::engage(&paths);
    hello.labels.insert(
        oomscope_analysis::SUPERVISOR_CGROUP_LABEL.to_string(),
        placement.description.clone(),
    );
    let shield = if placement.test_stay {
        OomShield::expose()
    } else {
        OomShield::engage()
    };
    // Opened before the first child: kills logged before are not ours.
    let mut kmsg = KmsgReader::open();
    if let Some(why) = kmsg.unavailable() {
        eprintln!(
            "oomscope: the kernel log is unreadable ({why}); OOM kills are inferred \
             without the kernel's record of them"
        );
    }
    let mut members = Members::open();
    hello
        .labels
        .insert(KERNEL_LOG_LABEL.to_string(), kmsg.describe());
    hello
        .labels
        .insert(MEMBER_EXITS_LABEL.to_string(), members.describe());
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
            child_oom_score_adj: shield.child_value(),
            child_cgroup: placement.child_cgroup_procs(),
        };
        let ending = run_once(
            &ctx,
            attempt,
            last_try,
            &mut sampling,
            &mut kmsg,
            &mut members,
        )?;
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

fn hello(cfg: &RunConfig, me: &HostReader) -> pb::Hello {
    let mut hello = Identity {
        name: cfg.name.clone(),
        role: oomscope_proto::Role::Supervisor.into(),
        rank: 0,
        runtime: "supervisor".into(), // vocab: the runtime's name
    }
    .hello(me);
    // Its CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER are the child's: the
    // child inherits them (`run_once` adds only OOMSCOPE_* variables).
    // The supervisor is its instance: every process it starts joins it.
    hello.instance = hello.agent_id.clone();
    hello.gpus = me.gpu().placements();
    hello.command = cfg.command.clone();
    hello
        .labels
        .extend(memory_env_labels(|name| std::env::var(name).ok()));
    hello
}

/// The memory variables the child inherits (`settings::MEMORY_ENV`, e.g.
/// `VLLM_CPU_KVCACHE_SPACE`), as Hello labels `env.NAME`: the analysis reads
/// them with the command line, so that a fix can name their values.
fn memory_env_labels(get: impl Fn(&str) -> Option<String>) -> Vec<(String, String)> {
    oomscope_analysis::settings::MEMORY_ENV
        .iter()
        .filter_map(|name| {
            get(name).map(|v| {
                (
                    format!("{}{name}", oomscope_analysis::settings::ENV_LABEL_PREFIX),
                    v,
                )
            })
        })
        .collect()
}

pub(crate) fn event(kind: pb::event::Kind) -> pb::Event {
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
    /// The cgroup.procs the child joins before exec, where the supervisor left it.
    child_cgroup: Option<&'a std::ffi::CString>,
    /// The oom_score_adj the child gets back, where the supervisor changed its own.
    child_oom_score_adj: Option<i32>,
}

/// Spawns the child once, samples it until it ends, reports its end.
fn run_once(
    ctx: &Supervision,
    attempt: u32,
    last_try: bool,
    sampling: &mut SamplingLoop,
    kmsg: &mut KmsgReader,
    members: &mut Members,
) -> anyhow::Result<Ending> {
    let Supervision {
        cfg,
        paths,
        reporter,
        agent_id,
        child_oom_score_adj,
        child_cgroup,
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
    if let Some(procs) = child_cgroup.cloned() {
        // SAFETY: the closure only calls open/write/close (async-signal-safe)
        // on memory allocated before the fork; a failure stops the exec.
        unsafe {
            cmd.pre_exec(move || join_cgroup(&procs));
        }
    }
    if let Some(adj) = child_oom_score_adj {
        // Formatted before the fork: the child may only make raw system calls.
        let value = format!("{adj}\n").into_bytes();
        // SAFETY: the closure only calls open/write/close (async-signal-safe)
        // on memory allocated before the fork.
        unsafe {
            cmd.pre_exec(move || {
                write_own_oom_score_adj(&value);
                Ok(())
            });
        }
    }
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
    let probe = HostReader::new(paths.clone(), pid);
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
        tree: TreeWatch::new(paths.clone(), pid),
        probe,
        pid,
        last_process,
        kmsg,
        stop_signal: None,
        members,
        paths,
        main_alive: true,
        tree_empty: false,
    };
    sampling.run(&mut watch, None);
    // A kill the kernel is still logging comes before the exit, and so do
    // the ends of members reported meanwhile.
    watch
        .members
        .follow_events(&mut watch.tree, pid, &|| watch.probe.counters());
    watch.drain_kills(reporter);
    watch.members.send_ends(reporter);

    // The child has ended but is not reaped: read what it left.
    let after = watch.probe.counters();
    let final_process = match process::read(paths, pid) {
        Ok(p) => merge_process(watch.last_process, p),
        Err(_) => watch.last_process.unwrap_or_default(),
    };
    let plist = watch.probe.process_list(TOP_PROCESSES);
    let stop_signal = watch.stop_signal;

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
        stop_signal,
        ..Default::default()
    };
    reporter.send_event(event(pb::event::Kind::ChildExit(exit)));
    outlive(&mut watch, reporter, sampling, describe(ending));
    Ok(ending)
}

/// After the child ended: processes of its tree that live on (orphans the
/// supervisor adopted as the tree's subreaper) keep the instance open. The
/// supervisor says so, samples them and records how each ends, passes a
/// stop signal it receives on to all of them, and returns once none is left.
fn outlive(watch: &mut ChildWatch, reporter: &Reporter, sampling: &mut SamplingLoop, how: String) {
    let survivors = watch.members.survivors(watch.paths);
    if survivors.is_empty() {
        return;
    }
    eprintln!(
        "oomscope: the child {how}, but {} process(es) of its tree live on: {}; \
         the instance stays open until they end (a stop signal to oomscope passes on to them)",
        survivors.len(),
        name_processes(&survivors)
    );
    let me = std::process::id();
    watch.tree.watch_descendants_of(me);
    watch.probe = HostReader::new(watch.paths.clone(), survivors[0].pid);
    watch.last_process = None;
    watch.main_alive = false;
    sampling.run(watch, None);
    watch.drain_kills(reporter);
}

/// The child seen from outside, on the agent skeleton's sampling loop: a
/// sample (with the whole tree) every interval, and between samples a poll
/// for its end, for a stop signal to pass on, for new processes of its tree
/// and for the kernel's OOM records. It has no allocator to snapshot and no
/// heap to census, so other directives are ignored.
struct ChildWatch<'k> {
    probe: HostReader,
    pid: u32,
    /// The latest reading of the child, whose limits and peaks a zombie no longer shows.
    last_process: Option<pb::ProcessMemory>,
    /// The child's tree, and every pid seen in it during this run.
    tree: TreeWatch,
    /// Shared by every run: opened once, at the supervisor's start.
    kmsg: &'k mut KmsgReader,
    /// The stop signal passed on to the child before it ended.
    stop_signal: Option<i32>,
    /// The rest of the tree's processes: how each ended.
    members: &'k mut Members,
    paths: &'k HostPaths,
    /// False once the child has ended and its tree lives on (see `outlive`).
    main_alive: bool,
    /// Set when a reading after the child's end found none of its tree.
    tree_empty: bool,
}

impl ChildWatch<'_> {
    /// Sends the kernel's records of kills of this run's processes; kills
    /// of other processes are not this instance's evidence.
    fn send_kills(&mut self, reporter: &Reporter) {
        for kill in self.kmsg.read_new() {
            if kill.pid == self.pid || self.tree.owns(kill.pid) {
                reporter.send_event(event(pb::event::Kind::KernelOomKill(kill)));
            }
        }
        self.send_alloc_failures(reporter, false);
    }

    /// The kernel's "page allocation failure" warnings of this run's
    /// processes (a high-order allocation refused without a kill); with
    /// `all`, also one whose free lists are still being logged.
    fn send_alloc_failures(&mut self, reporter: &Reporter, all: bool) {
        for failure in self.kmsg.take_alloc_failures(all) {
            if failure.pid == self.pid || self.tree.owns(failure.pid) {
                reporter.send_event(event(pb::event::Kind::KernelAllocFailure(failure)));
            }
        }
    }

    /// At the child's end: the records logged so far, and a kill still
    /// being logged, waited for up to [`KMSG_DRAIN`].
    fn drain_kills(&mut self, reporter: &Reporter) {
        let deadline = Instant::now() + KMSG_DRAIN;
        loop {
            self.send_kills(reporter);
            if !self.kmsg.has_pending() || Instant::now() >= deadline {
                self.send_alloc_failures(reporter, true);
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Readers for ChildWatch<'_> {
    type Job = Infallible;

    fn tick(&mut self, reporter: &Reporter) {
        let mut s = self.probe.sample();
        if let Some(p) = &s.process {
            self.last_process = Some(merge_process(self.last_process.take(), *p));
        }
        let reading = self.tree.read();
        self.tree_empty = !self.main_alive && reading.processes.is_empty();
        reading.fill(&mut s);
        reporter.send_sample(s);
        let probe = &self.probe;
        self.members
            .tick(&self.tree, self.pid, self.paths, reporter, &|| {
                probe.counters()
            });
    }

    fn poll(&mut self, reporter: &Reporter) -> Flow {
        let pid = self.pid;
        // New processes first, and pids taken by others forgotten, so that
        // a kill is matched to the process that holds its pid now.
        self.tree.refresh_children();
        let probe = &self.probe;
        self.members
            .follow_events(&mut self.tree, pid, &|| probe.counters());
        self.send_kills(reporter);
        self.members.send_ends(reporter);
        if !self.main_alive {
            return self.poll_survivors(reporter);
        }
        let exited = wait_exited_nowait(pid);
        if !matches!(exited, Ok(true)) {
            let sig = PENDING_SIGNAL.swap(0, Ordering::Relaxed);
            if sig != 0 {
                // The instance is stopping from now on: what ends after this is no failure.
                reporter.send_event(event(pb::event::Kind::StopForwarded(pb::StopForwarded {
                    signal: sig,
                })));
                // The supervisor started this child: passing a stop signal on is its job.
                // SAFETY: kill(2) on our own, not yet reaped, child.
                unsafe { libc::kill(pid as libc::pid_t, sig) };
                self.stop_signal.get_or_insert(sig);
                eprintln!(
                    "oomscope: passed signal {sig} ({}) on to the child {pid}",
                    signal_name(sig)
                );
            }
        }
        match exited {
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

impl ChildWatch<'_> {
    /// A poll once the child has ended and its tree lives on: a stop signal
    /// goes to every process of the tree (all descend from the child the
    /// supervisor started), and the watch ends when none is left.
    fn poll_survivors(&mut self, reporter: &Reporter) -> Flow {
        let sig = PENDING_SIGNAL.swap(0, Ordering::Relaxed);
        if sig != 0 {
            let pids = self.tree.members();
            reporter.send_event(event(pb::event::Kind::StopForwarded(pb::StopForwarded {
                signal: sig,
            })));
            for p in &pids {
                // SAFETY: kill(2) on a process of the tree we started (an
                // orphan we adopted, or one of its descendants).
                unsafe { libc::kill(*p as libc::pid_t, sig) };
            }
            eprintln!(
                "oomscope: passed signal {sig} ({}) on to the {} process(es) of the tree",
                signal_name(sig),
                pids.len()
            );
        }
        if self.tree_empty {
            Flow::Stop
        } else {
            Flow::Continue
        }
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

/// The supervisor out of the OOM killer's reach: it holds the evidence, and
/// a victim chosen among the instance's processes must never be it.
struct OomShield {
    /// The value it had before, where it lowered its own: the child's.
    previous: Option<i32>,
}

impl OomShield {
    /// Sets the supervisor's own oom_score_adj to -1000. Lowering it needs
    /// CAP_SYS_RESOURCE (below the floor the last privileged writer left);
    /// without it, it goes as low as permitted, which still ranks it below
    /// its child, and says once what that risks.
    fn engage() -> Self {
        let previous = match std::fs::read_to_string(OOM_SCORE_ADJ_PATH) {
            Ok(t) => match parse_oom_score_adj(&t) {
                Some(v) => v,
                None => {
                    warn_unshielded(&format!("{OOM_SCORE_ADJ_PATH} reads {:?}", t.trim()), None);
                    return OomShield { previous: None };
                }
            },
            Err(e) => {
                warn_unshielded(&e.to_string(), None);
                return OomShield { previous: None };
            }
        };
        let mut refused = None;
        let now = lowest_permitted(previous, |v| match set_own_oom_score_adj(v) {
            Ok(()) => true,
            Err(e) => {
                refused.get_or_insert(e);
                false
            }
        });
        if now != SUPERVISOR_OOM_SCORE_ADJ {
            let why = refused.map_or_else(|| "refused".to_string(), |e| e.to_string());
            warn_unshielded(&why, (now < previous).then_some(now));
        }
        OomShield {
            previous: (now < previous).then_some(previous),
        }
    }

    /// Test only ([`STAY_IN_CGROUP_ENV`]): the supervisor the OOM killer's
    /// first choice (raising needs no privilege), the child at the value
    /// the supervisor had.
    fn expose() -> Self {
        let previous = std::fs::read_to_string(OOM_SCORE_ADJ_PATH)
            .ok()
            .and_then(|t| parse_oom_score_adj(&t));
        match (previous, set_own_oom_score_adj(1000)) {
            (Some(p), Ok(())) => OomShield { previous: Some(p) },
            (_, Err(e)) => {
                eprintln!("oomscope: cannot raise the supervisor's oom_score_adj to 1000: {e}");
                OomShield { previous: None }
            }
            (None, Ok(())) => OomShield { previous: Some(0) },
        }
    }

    /// The value the child must get back, where the supervisor changed its own.
    fn child_value(&self) -> Option<i32> {
        self.previous
    }
}

/// The lowest value in [-1000, `current`] that `try_set` accepts, trying
/// -1000 first and then searching (the kernel accepts every value from a
/// floor up, and a refused write changes nothing). The value set last is the
/// one returned, so the process ends at it.
fn lowest_permitted(current: i32, mut try_set: impl FnMut(i32) -> bool) -> i32 {
    if current <= SUPERVISOR_OOM_SCORE_ADJ || try_set(SUPERVISOR_OOM_SCORE_ADJ) {
        return SUPERVISOR_OOM_SCORE_ADJ;
    }
    // Invariant: `lo` refused, `hi` accepted (or the current value).
    let (mut lo, mut hi) = (SUPERVISOR_OOM_SCORE_ADJ, current);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if try_set(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

fn set_own_oom_score_adj(v: i32) -> std::io::Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(OOM_SCORE_ADJ_PATH)?
        .write_all(v.to_string().as_bytes())
}

fn warn_unshielded(why: &str, lowered_to: Option<i32>) {
    let partly = match lowered_to {
        Some(v) => format!(", only to {v} (still below its child)"),
        None => String::new(),
    };
    eprintln!(
        "oomscope: cannot set the supervisor's oom_score_adj to {SUPERVISOR_OOM_SCORE_ADJ} \
         ({why}){partly}: under memory pressure the kernel may choose the supervisor as the \
         OOM victim and take the evidence with it"
    );
}

/// The value of an oom_score_adj file ("-1000\n").
fn parse_oom_score_adj(text: &str) -> Option<i32> {
    text.trim().parse().ok()
}

/// Between fork and exec: writes `value` to the child's own oom_score_adj.
/// Only raw system calls (async-signal-safe); a failure leaves the child
/// with the supervisor's value, which only makes it harder to kill.
fn write_own_oom_score_adj(value: &[u8]) {
    // SAFETY: a NUL-terminated path literal and a buffer we own.
    unsafe {
        let fd = libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        if fd >= 0 {
            libc::write(fd, value.as_ptr().cast(), value.len());
            libc::close(fd);
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
        agent_heap_bytes: pick(late.agent_heap_bytes, e.agent_heap_bytes),
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
    fn the_memory_variables_become_env_labels() {
        let labels = memory_env_labels(|name| {
            (name == "VLLM_CPU_KVCACHE_SPACE" || name == "HOME").then(|| "1".to_string())
        });
        assert_eq!(
            labels,
            [("env.VLLM_CPU_KVCACHE_SPACE".to_string(), "1".to_string())]
        );
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let i = Duration::from_millis(100);
        let m = Duration::from_millis(1000);
        let d: Vec<_> = (0..6).map(|a| backoff(i, m, a).as_millis()).collect();
        assert_eq!(d, vec![100, 200, 400, 800, 1000, 1000]);
    }

    #[test]
    fn the_lowest_permitted_oom_score_adj_is_found_and_left_set() {
        for floor in [-1000, -999, -1, 0, 37, 100] {
            let mut value = 100;
            let got = lowest_permitted(100, |v| {
                let ok = v >= floor;
                if ok {
                    value = v;
                }
                ok
            });
            assert_eq!((got, value), (floor, floor), "floor {floor}");
        }
        // Already at the bottom: nothing to write.
        assert_eq!(lowest_permitted(-1000, |_| panic!("no write")), -1000);
    }

    #[test]
    fn oom_score_adj_values() {
        assert_eq!(parse_oom_score_adj("-1000\n"), Some(-1000));
        assert_eq!(parse_oom_score_adj(" 100 "), Some(100));
        assert_eq!(parse_oom_score_adj("x"), None);
        assert_eq!(
            OOM_SCORE_ADJ_PATH.as_bytes(),
            c"/proc/self/oom_score_adj".to_bytes(),
            "the pre-exec path is the same file"
        );
    }

    #[test]
    fn shell_status_of_a_signal_is_128_plus_n() {
        assert_eq!(Ending::Signaled(9).shell_status(), 137);
        assert_eq!(Ending::Exited(3).shell_status(), 3);
        assert!(!Ending::Signaled(9).is_clean());
    }
}
