//! The other processes of the supervised tree (an API server's engine, its
//! workers, a `multiprocessing` Manager): how each one ended, and the ones
//! that outlive the child.
//!
//! How a member's status is read, most reliable first:
//! - the kernel's process events (`readers::exits`), which report every exit
//!   with its wait status whoever reaps it: the engine a vLLM API server
//!   reaps within milliseconds included;
//! - `waitpid` on orphans: `oomscope run` is the tree's child subreaper
//!   (`PR_SET_CHILD_SUBREAPER`), so a member whose parent died becomes its
//!   child, and its status waits for it however late it looks;
//! - without either, a member that left the tree and /proc is "vanished",
//!   with no status (a container without CAP_NET_ADMIN).
//!
//! Each end is sent as a `ChildExit` with `member` set, for members a full
//! tree reading listed, within a budget. A non-zero exit of a process that
//! lived less than [`MEMBER_MIN_LIFETIME`] is a helper's answer, not a
//! death of the instance, and is not sent: a reading is an instant, and
//! one can list a process that lives a millisecond (pyenv's `python3` shim
//! runs `readlink`s that exit 1; `ctypes.util.find_library` runs `ldconfig`
//! and `gcc`).
//!
//! Which process a pid is, the process events' forks say: a pid of the
//! tree that a process outside it takes again (pids are reused) is
//! forgotten, so that neither its end nor the kernel's kill of it is ever
//! recorded as the instance's, and a pid the tree reuses is a new member
//! whose end is read afresh.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use oomscope_agent_core::pb;
use oomscope_agent_core::readers::exits::{split_wait_status, ProcEvent, ProcessEvents};
use oomscope_agent_core::readers::tree::{descendants, describe, parse_children, Fork, TreeWatch};
use oomscope_agent_core::readers::HostPaths;
use oomscope_agent_core::reporter::Reporter;

use super::event;

/// The Hello label that says how members' ends are read: "process events",
/// or `"reaped orphans only: <why>"`.
pub const MEMBER_EXITS_LABEL: &str = "member_exits";
/// The most member ends sent per minute, failed ones and others each: a
/// server whose helpers end in a loop must not flood the collector (a
/// failed end may be an incident).
pub const MEMBER_ENDS_PER_MINUTE: u32 = 60;
/// Stop signals: how servers stop their own workers (and SIGPIPE: its
/// reader went first). A member ended by one is recorded, never a failure
/// by itself.
const STOP_SIGNALS: [i32; 4] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGPIPE];
/// The shortest life after which a non-zero exit is a member's failure:
/// a server's helpers (a shell's `readlink`, `ldconfig`, a compiler probe)
/// answer within a second; a member that serves lives longer. A kill by a
/// signal is a death however short the life (a helper is seldom killed;
/// a kill by the kernel's OOM killer has its own record anyway).
pub const MEMBER_MIN_LIFETIME: Duration = Duration::from_secs(1);
/// The most processes the survivors' message names.
const SURVIVORS_NAMED: usize = 8;

/// (exit code, signal, core dumped) of one end.
type Status = (Option<i32>, Option<i32>, bool);

/// Whether an end is a failure: a signal other than a stop, or a non-zero
/// exit. An unknown status (vanished) is not one by itself.
pub fn is_failure(status: Option<Status>) -> bool {
    match status {
        Some((_, Some(sig), _)) => !STOP_SIGNALS.contains(&sig),
        Some((Some(code), None, _)) => code != 0,
        _ => false,
    }
}

/// A non-zero exit after less than [`MEMBER_MIN_LIFETIME`] (or after a
/// life of unknown length): a helper's answer, no member's failure.
fn is_helper_answer(status: Option<Status>, lived: Option<Duration>) -> bool {
    matches!(status, Some((Some(code), None, _)) if code != 0)
        && lived.is_none_or(|l| l < MEMBER_MIN_LIFETIME)
}

pub(super) struct Members {
    events: Option<ProcessEvents>,
    /// Why there are no process events, where there are none.
    no_events: Option<String>,
    /// Members whose end was sent (or judged not worth sending), until
    /// their pid begins a new life.
    reported: HashSet<u32>,
    /// Failed ends, and the others, left to send this minute: apart, so
    /// that helpers ending well in a loop never crowd out a death.
    failures: Budget,
    ends: Budget,
    /// Ends read from the process events, to send after the kernel's kill records.
    pending: Vec<pb::Event>,
    me: u32,
}

impl Members {
    /// Becomes the child subreaper and subscribes to process exits; says
    /// once on stderr what it cannot read.
    pub fn open() -> Members {
        // SAFETY: prctl with integer arguments only.
        let reaper = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } == 0;
        if !reaper {
            tracing::warn!(
                "PR_SET_CHILD_SUBREAPER failed: {}",
                std::io::Error::last_os_error()
            );
        }
        let (events, no_events) = match ProcessEvents::open() {
            Ok(e) => (Some(e), None),
            Err(why) => {
                eprintln!(
                    "oomscope: the kernel's process events are unavailable ({why}); how a \
                     process of the tree other than the child ended is read only for orphans \
                     (as the tree's subreaper), else it is recorded as vanished"
                );
                (None, Some(why))
            }
        };
        Members {
            events,
            no_events,
            reported: HashSet::new(),
            failures: Budget::new(),
            ends: Budget::new(),
            pending: Vec::new(),
            me: std::process::id(),
        }
    }

    /// For the Hello's [`MEMBER_EXITS_LABEL`].
    pub fn describe(&self) -> String {
        match &self.no_events {
            None => "process events".to_string(),
            Some(why) => format!("reaped orphans only: {why}"),
        }
    }

    /// At each poll, first: the forks and the ends the kernel reported, in
    /// its order. Forks tell `tree` which pids are its processes; the ends
    /// of those other than `main` (whose end the supervisor reads itself)
    /// wait for [`Members::send_ends`], so that the kernel's record of a
    /// kill, read in between, comes before the end it caused.
    pub fn follow_events(
        &mut self,
        tree: &mut TreeWatch,
        main: u32,
        counters: &dyn Fn() -> pb::HostCounters,
    ) {
        let Some(events) = self.events.as_mut() else {
            return;
        };
        for e in events.read() {
            match e {
                ProcEvent::Fork { parent, child } => match tree.forked(parent, child) {
                    // The pid's earlier life in the tree ended: its next end is news.
                    Fork::Ours if self.reported.remove(&child) => tree.renew(child),
                    Fork::Taken => {
                        self.reported.remove(&child);
                    }
                    Fork::Ours | Fork::Unrelated => {}
                },
                ProcEvent::Exit(x) => {
                    if x.pid != main && x.pid != self.me && tree.owns(x.pid) {
                        let end =
                            self.end_of(tree, x.pid, Some(x.status()), "proc_events", counters);
                        self.pending.extend(end);
                    }
                }
            }
        }
    }

    /// Sends the ends [`Members::follow_events`] found.
    pub fn send_ends(&mut self, reporter: &Reporter) {
        for end in self.pending.drain(..) {
            reporter.send_event(end);
        }
    }

    /// At each tick: orphans that ended are reaped (their status read);
    /// without process events, members that left the tree and /proc are
    /// recorded as vanished.
    pub fn tick(
        &mut self,
        tree: &TreeWatch,
        main: u32,
        paths: &HostPaths,
        reporter: &Reporter,
        counters: &dyn Fn() -> pb::HostCounters,
    ) {
        let mut ends = Vec::new();
        for pid in own_children(paths, self.me) {
            if pid == main {
                continue;
            }
            let mut status = 0;
            // SAFETY: waitpid on our own child (an adopted orphan), non-blocking.
            let rc = unsafe { libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG) };
            if rc == pid as libc::pid_t {
                let status = Some(split_wait_status(status as u32));
                ends.extend(self.end_of(tree, pid, status, "reaped", counters));
            }
        }
        if self.events.is_none() {
            for p in tree.gone() {
                let alive = paths.proc_root.join(p.pid.to_string()).exists();
                if !alive && p.pid != main {
                    ends.extend(self.end_of(tree, p.pid, None, "vanished", counters));
                }
            }
        }
        for end in ends {
            reporter.send_event(end);
        }
    }

    /// The event that records how member `pid` ended, if it is to be sent.
    fn end_of(
        &mut self,
        tree: &TreeWatch,
        pid: u32,
        status: Option<Status>,
        from: &str,
        counters: &dyn Fn() -> pb::HostCounters,
    ) -> Option<pb::Event> {
        if !self.reported.insert(pid) {
            return None;
        }
        // Only members a full reading listed: it knows what they were.
        let listed = tree.last_listed(pid)?;
        // Servers run helpers that fail as a matter of course, and a
        // reading may catch one in its millisecond; a process the OOM
        // killer takes that fast has the kernel's record of its kill.
        let lived = tree.first_seen(pid).map(|t| t.elapsed());
        if is_helper_answer(status, lived) {
            tracing::debug!(
                pid,
                title = listed.title,
                ?lived,
                "a helper's non-zero exit: not sent"
            );
            return None;
        }
        let failed = is_failure(status);
        let budget = match failed {
            true => &mut self.failures,
            false => &mut self.ends,
        };
        if !budget.take() {
            tracing::warn!(
                pid,
                failed,
                "member ends over {MEMBER_ENDS_PER_MINUTE}/min: not sent"
            );
            return None;
        }
        let info = listed.clone();
        let (exit_code, signal, core_dumped) = status.unwrap_or((None, None, false));
        let exit = pb::ChildExit {
            pid,
            exit_code,
            signal,
            core_dumped,
            after: Some(counters()),
            runtime_ns: lived.map_or(0, |l| l.as_nanos() as u64),
            member: true,
            parent_pid: info.parent_pid,
            title: info.title,
            command: info.command,
            status_from: from.to_string(),
            ..Default::default()
        };
        Some(event(pb::event::Kind::ChildExit(exit)))
    }

    /// The processes of the tree still alive besides the supervisor (its
    /// child excluded, which has ended): orphans it adopted and theirs.
    pub fn survivors(&self, paths: &HostPaths) -> Vec<pb::ProcessInfo> {
        descendants(paths, self.me, 256)
            .into_iter()
            .filter(|&p| p != self.me)
            .filter_map(|p| describe(paths, p))
            .collect()
    }
}

/// Ends left to send in the current minute.
struct Budget {
    left: u32,
    since: Instant,
}

impl Budget {
    fn new() -> Budget {
        Budget {
            left: MEMBER_ENDS_PER_MINUTE,
            since: Instant::now(),
        }
    }

    fn take(&mut self) -> bool {
        if self.since.elapsed() >= Duration::from_secs(60) {
            *self = Budget::new();
        }
        let ok = self.left > 0;
        self.left = self.left.saturating_sub(1);
        ok
    }
}

/// "pid 12 (VLLM::Worker), pid 13 (python3)" for at most [`SURVIVORS_NAMED`].
pub fn name_processes(ps: &[pb::ProcessInfo]) -> String {
    let mut s: Vec<String> = ps
        .iter()
        .take(SURVIVORS_NAMED)
        .map(|p| format!("pid {} ({})", p.pid, p.title))
        .collect();
    if ps.len() > SURVIVORS_NAMED {
        s.push(format!("{} more", ps.len() - SURVIVORS_NAMED));
    }
    s.join(", ")
}

/// The supervisor's own children, from each of its threads' `children`
/// file: a subreaper's adopted orphans are children of whichever thread.
fn own_children(paths: &HostPaths, me: u32) -> Vec<u32> {
    let task = paths.proc_root.join(me.to_string()).join("task");
    let Ok(threads) = std::fs::read_dir(&task) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for t in threads.flatten() {
        if let Ok(text) = std::fs::read_to_string(t.path().join("children")) {
            out.extend(parse_children(&text));
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_is_a_kill_a_crash_or_a_nonzero_exit_and_a_stop_is_not() {
        assert!(is_failure(Some((None, Some(libc::SIGKILL), false))));
        assert!(is_failure(Some((None, Some(libc::SIGSEGV), true))));
        assert!(is_failure(Some((Some(1), None, false))));
        assert!(!is_failure(Some((Some(0), None, false))));
        assert!(!is_failure(Some((None, Some(libc::SIGTERM), false))));
        assert!(!is_failure(None), "vanished: no status");
    }

    #[test]
    fn a_nonzero_exit_after_a_short_life_is_a_helpers_answer_and_a_kill_a_death() {
        let exit1 = Some((Some(1), None, false));
        let ms = Duration::from_millis;
        assert!(is_helper_answer(exit1, Some(ms(2))), "readlink");
        assert!(is_helper_answer(exit1, Some(ms(999))));
        assert!(is_helper_answer(exit1, None), "a life of unknown length");
        assert!(!is_helper_answer(exit1, Some(MEMBER_MIN_LIFETIME)));
        assert!(!is_helper_answer(
            Some((None, Some(libc::SIGKILL), false)),
            Some(ms(2))
        ));
        assert!(!is_helper_answer(Some((Some(0), None, false)), Some(ms(2))));
        assert!(!is_helper_answer(None, Some(ms(2))), "vanished");
    }
}
