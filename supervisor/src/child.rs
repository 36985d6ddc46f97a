//! One run of the child on the agent skeleton's sampling loop: spawn it,
//! sample it and its tree until it ends, read what it left before reaping
//! it, report its end, and watch the processes of its tree that outlive it.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use oomscope_agent_core::agent::{Flow, Readers, SamplingLoop, INSTANCE_ENV};
use oomscope_agent_core::pb;
use oomscope_agent_core::readers::kmsg::KmsgReader;
use oomscope_agent_core::readers::tree::TreeWatch;
use oomscope_agent_core::readers::{process, HostPaths, HostReader};
use oomscope_agent_core::reporter::Reporter;
use oomscope_analysis::units::signal_name;

use crate::config::RunConfig;
use crate::members::{name_processes, Members};
use crate::place::join_cgroup;
use crate::shield::write_own_oom_score_adj;
use crate::signals::take_pending_signal;
use crate::{event, kill_event};

/// How often `waitid` is polled for the child's end (and a stop signal passed
/// on) between samples, so that the end is read within this delay even when
/// the sample interval is long.
const EXIT_POLL: Duration = Duration::from_millis(10);
/// How many processes a ProcessList at the child's end names.
const TOP_PROCESSES: usize = 10;
/// At the child's end, how long a kill record the kernel is still writing
/// (its first lines read, not its "Killed process") is waited for, so that
/// the kill comes before the exit in the timeline.
const KMSG_DRAIN: Duration = Duration::from_millis(100);

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

pub fn describe(e: Ending) -> String {
    match e {
        Ending::Exited(c) => format!("exited with code {c}"),
        Ending::Signaled(s) => format!("was killed by signal {s} ({})", signal_name(s)),
    }
}

/// What stays the same across restarts of the child.
pub(crate) struct Supervision<'a> {
    pub(crate) cfg: &'a RunConfig,
    pub(crate) paths: &'a HostPaths,
    pub(crate) reporter: &'a Reporter,
    pub(crate) agent_id: &'a str,
    /// The cgroup.procs the child joins before exec, where the supervisor left it.
    pub(crate) child_cgroup: Option<&'a std::ffi::CString>,
    /// The oom_score_adj the child gets back, where the supervisor changed its own.
    pub(crate) child_oom_score_adj: Option<i32>,
}

/// Spawns the child once, samples it until it ends, reports its end.
pub(crate) fn run_once(
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
    let reader = HostReader::new(paths.clone(), pid);
    let before = reader.counters();
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
        reader,
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
        .follow_events(&mut watch.tree, pid, &|| watch.reader.counters());
    watch.drain_kills(reporter);
    watch.members.send_ends(reporter);

    // The child has ended but is not reaped: read what it left.
    let after = watch.reader.counters();
    let final_process = match process::read(paths, pid) {
        Ok(p) => merge_process(watch.last_process, p),
        Err(_) => watch.last_process.unwrap_or_default(),
    };
    let plist = watch.reader.process_list(TOP_PROCESSES);
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
    watch.reader = HostReader::new(watch.paths.clone(), survivors[0].pid);
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
    reader: HostReader,
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
                reporter.send_event(kill_event(kill));
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
        let mut s = self.reader.sample();
        if let Some(p) = &s.process {
            self.last_process = Some(merge_process(self.last_process.take(), *p));
        }
        let reading = self.tree.read();
        self.tree_empty = !self.main_alive && reading.processes.is_empty();
        reading.fill(&mut s);
        reporter.send_sample(s);
        let reader = &self.reader;
        self.members
            .tick(&self.tree, self.pid, self.paths, reporter, &|| {
                reader.counters()
            });
    }

    fn poll(&mut self, reporter: &Reporter) -> Flow {
        let pid = self.pid;
        // New processes first, and pids taken by others forgotten, so that
        // a kill is matched to the process that holds its pid now.
        self.tree.refresh_children();
        let reader = &self.reader;
        self.members
            .follow_events(&mut self.tree, pid, &|| reader.counters());
        self.send_kills(reporter);
        self.members.send_ends(reporter);
        if !self.main_alive {
            return self.poll_survivors(reporter);
        }
        let exited = wait_exited_nowait(pid);
        if !matches!(exited, Ok(true)) {
            let sig = take_pending_signal();
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
        let sig = take_pending_signal();
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
    fn shell_status_of_a_signal_is_128_plus_n() {
        assert_eq!(Ending::Signaled(9).shell_status(), 137);
        assert_eq!(Ending::Exited(3).shell_status(), 3);
        assert!(!Ending::Signaled(9).is_clean());
    }
}
