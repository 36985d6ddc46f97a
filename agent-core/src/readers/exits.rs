//! How the processes of a tree began and ended, for processes that are not
//! our children: the kernel's process events connector (`cn_proc`, netlink)
//! reports every process's fork with its parent, and its exit with its wait
//! status, whoever reaps it.
//!
//! `oomscope run` can `waitid` only its own child (and, as the tree's child
//! subreaper, orphans reparented to it). A vLLM EngineCore or Worker is a
//! child of the API server, which reaps it within milliseconds, so its
//! status is otherwise lost: this reader keeps it. It needs CAP_NET_ADMIN in
//! the initial network namespace (root on a host, not an unprivileged
//! container); where it cannot subscribe, [`ProcessEvents::open`] says why and
//! the supervisor falls back to reading zombies and, last, to "vanished".
//!
//! The events are host-wide and name processes by their pids in the initial
//! PID namespace. A pid says which process it is only with its fork: once
//! a process ends, its pid is free for anyone's next process (32768 pids by
//! default), so whoever keeps pids across events must follow the forks.
//! [`ProcessEvents::open`] checks that the events speak of this process's
//! own pids (a supervisor in another PID namespace would read strangers'
//! pids as its own) by forking a child and finding its fork among them.
//!
//! The socket is non-blocking and drained at each poll; a burst larger than
//! its receive buffer loses events (ENOBUFS): a lost exit goes down the
//! same fallbacks, and a lost fork leaves that pid to the tree's readings.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Netlink's connector family, and the connector's process-events channel.
const NETLINK_CONNECTOR: libc::c_int = 11;
const CN_IDX_PROC: u32 = 1;
const CN_VAL_PROC: u32 = 1;
const PROC_CN_MCAST_LISTEN: u32 = 1;
/// `proc_event.what` for a fork and for an exit.
const PROC_EVENT_FORK: u32 = 0x0000_0001;
const PROC_EVENT_EXIT: u32 = 0x8000_0000;
/// nlmsghdr (16 bytes) + cn_msg header (20 bytes): where the event starts.
const EVENT_OFFSET: usize = 36;
/// The receive buffer asked for: a few thousand events between two polls.
const RECEIVE_BUFFER_BYTES: libc::c_int = 1 << 20;
/// How long [`ProcessEvents::open`] waits for the fork of its test child.
const SELF_CHECK_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// One event of a whole process (a thread's fork or exit is none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcEvent {
    /// `parent` started `child`: a new life of the pid `child`.
    Fork {
        parent: u32,
        child: u32,
    },
    Exit(ProcExit),
}

/// One process's end as the kernel reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcExit {
    pub pid: u32,
    /// The wait status (`WIFSIGNALED`/`WEXITSTATUS` apply).
    pub wait_status: u32,
}

impl ProcExit {
    /// (exit code, signal, core dumped), as `waitpid` would give them.
    pub fn status(&self) -> (Option<i32>, Option<i32>, bool) {
        split_wait_status(self.wait_status)
    }
}

/// A wait status split into (exit code, signal, core dumped).
pub fn split_wait_status(status: u32) -> (Option<i32>, Option<i32>, bool) {
    let sig = (status & 0x7f) as i32;
    if sig == 0 {
        (Some(((status >> 8) & 0xff) as i32), None, false)
    } else {
        (None, Some(sig), status & 0x80 != 0)
    }
}

/// A subscription to the kernel's process forks and exits.
#[derive(Debug)]
pub struct ProcessEvents {
    socket: OwnedFd,
}

impl ProcessEvents {
    /// Subscribes; Err says why not (no netlink connector, no privilege, a
    /// network namespace other than the host's, events that do not name
    /// this process's pids).
    pub fn open() -> Result<ProcessEvents, String> {
        // SAFETY: plain socket(2); the fd is owned right after.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                NETLINK_CONNECTOR,
            )
        };
        if fd < 0 {
            return Err(format!(
                "netlink connector socket: {}",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: fd is a fresh socket nobody else owns.
        let socket = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_nl zeroed then filled; sizes are the struct's own.
        unsafe {
            let mut addr: libc::sockaddr_nl = std::mem::zeroed();
            addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
            addr.nl_groups = CN_IDX_PROC;
            // nl_pid 0: the kernel assigns a unique port id.
            if libc::bind(
                fd,
                &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            ) != 0
            {
                return Err(format!(
                    "netlink connector bind: {}",
                    std::io::Error::last_os_error()
                ));
            }
            let size = RECEIVE_BUFFER_BYTES;
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                &size as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        let listen = listen_message();
        // SAFETY: sends our own buffer.
        let sent =
            unsafe { libc::send(fd, listen.as_ptr() as *const libc::c_void, listen.len(), 0) };
        if sent < 0 {
            return Err(format!(
                "process events subscription: {}",
                std::io::Error::last_os_error()
            ));
        }
        let mut events = ProcessEvents { socket };
        events.check_own_pids()?;
        Ok(events)
    }

    /// Forks a child that exits at once and waits for its fork among the
    /// events, with this process as its parent: the kernel ignores a
    /// subscriber outside the initial PID namespace or sends it pids that
    /// are not the ones it knows, and either way its events would be wrong.
    fn check_own_pids(&mut self) -> Result<(), String> {
        // SAFETY: the child only calls _exit (async-signal-safe), whatever
        // threads the parent has.
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: see above.
            unsafe { libc::_exit(0) };
        }
        if child < 0 {
            return Err(format!(
                "fork for the process events check: {}",
                std::io::Error::last_os_error()
            ));
        }
        let mut status = 0;
        // SAFETY: reaps our own child.
        unsafe { libc::waitpid(child, &mut status, 0) };
        let me = std::process::id();
        let deadline = std::time::Instant::now() + SELF_CHECK_WAIT;
        loop {
            let seen = self.read().into_iter().any(|e| {
                e == ProcEvent::Fork {
                    parent: me,
                    child: child as u32,
                }
            });
            if seen {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "the process events never reported the fork of this process's own \
                     child within {} s (another PID namespace than the host's?)",
                    SELF_CHECK_WAIT.as_secs()
                ));
            }
            let mut pfd = libc::pollfd {
                fd: self.socket.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd we own.
            unsafe { libc::poll(&mut pfd, 1, left.as_millis().max(1) as libc::c_int) };
        }
    }

    /// The forks and exits reported since the last call (whole processes
    /// only, not single threads), in the kernel's order. Never blocks.
    pub fn read(&mut self) -> Vec<ProcEvent> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: receives into our own buffer, non-blocking.
            let n = unsafe {
                libc::recv(
                    self.socket.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                // EAGAIN: drained. ENOBUFS: some were lost; the rest go on.
                if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOBUFS) {
                    tracing::debug!("process events overflowed: some exits were lost");
                    continue;
                }
                return out;
            }
            out.extend(parse_datagram(&buf[..n as usize]));
        }
    }
}

/// nlmsghdr + cn_msg + PROC_CN_MCAST_LISTEN, in native byte order.
fn listen_message() -> Vec<u8> {
    let payload = PROC_CN_MCAST_LISTEN.to_ne_bytes();
    let total = 16 + 20 + payload.len();
    let mut m = Vec::with_capacity(total);
    m.extend((total as u32).to_ne_bytes()); // nlmsg_len
    m.extend((libc::NLMSG_DONE as u16).to_ne_bytes()); // nlmsg_type
    m.extend(0u16.to_ne_bytes()); // nlmsg_flags
    m.extend(0u32.to_ne_bytes()); // nlmsg_seq
    m.extend(std::process::id().to_ne_bytes()); // nlmsg_pid
    m.extend(CN_IDX_PROC.to_ne_bytes());
    m.extend(CN_VAL_PROC.to_ne_bytes());
    m.extend(0u32.to_ne_bytes()); // seq
    m.extend(0u32.to_ne_bytes()); // ack
    m.extend((payload.len() as u16).to_ne_bytes());
    m.extend(0u16.to_ne_bytes()); // flags
    m.extend(payload);
    m
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The fork or exit in one datagram, if it reports one of a whole process:
/// the event is `what`, `cpu`, `timestamp_ns`, then for a fork
/// `parent_pid`, `parent_tgid`, `child_pid`, `child_tgid`, and for an exit
/// `pid`, `tgid`, `exit_code` (a wait status), `exit_signal`.
pub fn parse_datagram(b: &[u8]) -> Option<ProcEvent> {
    let data = EVENT_OFFSET + 16;
    match u32_at(b, EVENT_OFFSET)? {
        PROC_EVENT_FORK => {
            let parent = u32_at(b, data + 4)?;
            let child = u32_at(b, data + 8)?;
            let child_tgid = u32_at(b, data + 12)?;
            // A new thread is no new process.
            (child == child_tgid).then_some(ProcEvent::Fork { parent, child })
        }
        PROC_EVENT_EXIT => {
            let pid = u32_at(b, data)?;
            let tgid = u32_at(b, data + 4)?;
            let wait_status = u32_at(b, data + 8)?;
            // A thread's exit is not the process's.
            (pid == tgid).then_some(ProcEvent::Exit(ProcExit { pid, wait_status }))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn datagram(what: u32, fields: [u32; 4]) -> Vec<u8> {
        let mut b = vec![0u8; EVENT_OFFSET];
        b.extend(what.to_ne_bytes());
        b.extend(0u32.to_ne_bytes());
        b.extend(0u64.to_ne_bytes());
        for v in fields {
            b.extend(v.to_ne_bytes());
        }
        b
    }

    fn exit_datagram(pid: u32, tgid: u32, status: u32) -> Vec<u8> {
        datagram(PROC_EVENT_EXIT, [pid, tgid, status, 17])
    }

    #[test]
    fn an_exit_datagram_gives_the_process_and_its_wait_status() {
        let e = parse_datagram(&exit_datagram(42, 42, 9)).unwrap();
        let exit = ProcExit {
            pid: 42,
            wait_status: 9,
        };
        assert_eq!(e, ProcEvent::Exit(exit));
        assert_eq!(exit.status(), (None, Some(9), false));
        assert!(
            parse_datagram(&exit_datagram(43, 42, 0)).is_none(),
            "a thread"
        );
        assert!(
            parse_datagram(&exit_datagram(42, 42, 9)[..50]).is_none(),
            "cut"
        );
        let mut exec = exit_datagram(42, 42, 0);
        exec[EVENT_OFFSET..EVENT_OFFSET + 4].copy_from_slice(&2u32.to_ne_bytes());
        assert!(parse_datagram(&exec).is_none(), "an exec: neither");
    }

    #[test]
    fn a_fork_datagram_gives_the_parent_process_and_the_child() {
        // parent_pid is the forking thread (11), parent_tgid its process (10).
        let fork = datagram(PROC_EVENT_FORK, [11, 10, 42, 42]);
        assert_eq!(
            parse_datagram(&fork),
            Some(ProcEvent::Fork {
                parent: 10,
                child: 42
            })
        );
        let thread = datagram(PROC_EVENT_FORK, [10, 10, 43, 42]);
        assert!(parse_datagram(&thread).is_none(), "a new thread");
    }

    #[test]
    fn wait_statuses_split_as_waitpid_reads_them() {
        assert_eq!(split_wait_status(0), (Some(0), None, false));
        assert_eq!(split_wait_status(1 << 8), (Some(1), None, false));
        assert_eq!(split_wait_status(0x86), (None, Some(6), true));
        assert_eq!(split_wait_status(15), (None, Some(15), false));
    }

    /// On a host where we may subscribe (root in the host's network and PID
    /// namespaces), a child's fork is reported with us as its parent, then
    /// its SIGKILL with its status; elsewhere the reason is given and
    /// nothing else is checked.
    #[test]
    fn a_killed_process_is_reported_where_the_kernel_lets_us_subscribe() {
        let mut events = match ProcessEvents::open() {
            Ok(e) => e,
            Err(why) => {
                eprintln!("process events unavailable here: {why}");
                return;
            }
        };
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        child.kill().unwrap();
        child.wait().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut seen = Vec::new();
        let exit = loop {
            seen.extend(events.read().into_iter().filter(|e| match e {
                ProcEvent::Fork { child, .. } => *child == pid,
                ProcEvent::Exit(x) => x.pid == pid,
            }));
            if let Some(ProcEvent::Exit(x)) = seen.last() {
                break *x;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the kill was reported: {seen:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        assert_eq!(
            seen[0],
            ProcEvent::Fork {
                parent: std::process::id(),
                child: pid
            },
            "the fork comes first, from this process"
        );
        assert_eq!(exit.status(), (None, Some(9), false));
    }
}
