//! How the processes of a tree ended, for processes that are not our
//! children: the kernel's process events connector (`cn_proc`, netlink)
//! reports every process's exit with its wait status, whoever reaps it.
//!
//! `oomscope run` can `waitid` only its own child (and, as the tree's child
//! subreaper, orphans reparented to it). A vLLM EngineCore or Worker is a
//! child of the API server, which reaps it within milliseconds, so its
//! status is otherwise lost: this reader keeps it. It needs CAP_NET_ADMIN in
//! the initial network namespace (root on a host, not an unprivileged
//! container); where it cannot subscribe, [`ExitEvents::open`] says why and
//! the supervisor falls back to reading zombies and, last, to "vanished".
//!
//! The socket is non-blocking and drained at each poll; a burst larger than
//! its receive buffer loses events (ENOBUFS), which only sends those exits
//! down the same fallbacks.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Netlink's connector family, and the connector's process-events channel.
const NETLINK_CONNECTOR: libc::c_int = 11;
const CN_IDX_PROC: u32 = 1;
const CN_VAL_PROC: u32 = 1;
const PROC_CN_MCAST_LISTEN: u32 = 1;
/// `proc_event.what` for an exit.
const PROC_EVENT_EXIT: u32 = 0x8000_0000;
/// nlmsghdr (16 bytes) + cn_msg header (20 bytes): where the event starts.
const EVENT_OFFSET: usize = 36;
/// The receive buffer asked for: a few thousand exits between two polls.
const RECEIVE_BUFFER_BYTES: libc::c_int = 1 << 20;

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

/// A subscription to the kernel's process exits.
#[derive(Debug)]
pub struct ExitEvents {
    socket: OwnedFd,
}

impl ExitEvents {
    /// Subscribes; Err says why not (no netlink connector, no privilege, a
    /// network namespace other than the host's).
    pub fn open() -> Result<ExitEvents, String> {
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
        Ok(ExitEvents { socket })
    }

    /// The exits reported since the last call (whole processes only, not
    /// single threads). Never blocks.
    pub fn read(&mut self) -> Vec<ProcExit> {
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

/// The exit in one datagram, if it reports one of a whole process: the
/// event is `what`, `cpu`, `timestamp_ns`, then for an exit `pid`, `tgid`,
/// `exit_code` (a wait status), `exit_signal`.
pub fn parse_datagram(b: &[u8]) -> Option<ProcExit> {
    if u32_at(b, EVENT_OFFSET)? != PROC_EVENT_EXIT {
        return None;
    }
    let data = EVENT_OFFSET + 16;
    let pid = u32_at(b, data)?;
    let tgid = u32_at(b, data + 4)?;
    let wait_status = u32_at(b, data + 8)?;
    // A thread's exit is not the process's.
    (pid == tgid).then_some(ProcExit { pid, wait_status })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit_datagram(pid: u32, tgid: u32, status: u32) -> Vec<u8> {
        let mut b = vec![0u8; EVENT_OFFSET];
        b.extend(PROC_EVENT_EXIT.to_ne_bytes());
        b.extend(0u32.to_ne_bytes());
        b.extend(0u64.to_ne_bytes());
        for v in [pid, tgid, status, 17] {
            b.extend(v.to_ne_bytes());
        }
        b
    }

    #[test]
    fn an_exit_datagram_gives_the_process_and_its_wait_status() {
        let e = parse_datagram(&exit_datagram(42, 42, 9)).unwrap();
        assert_eq!(
            e,
            ProcExit {
                pid: 42,
                wait_status: 9
            }
        );
        assert_eq!(e.status(), (None, Some(9), false));
        assert!(
            parse_datagram(&exit_datagram(43, 42, 0)).is_none(),
            "a thread"
        );
        assert!(
            parse_datagram(&exit_datagram(42, 42, 9)[..50]).is_none(),
            "cut"
        );
        let mut fork = exit_datagram(42, 42, 0);
        fork[EVENT_OFFSET..EVENT_OFFSET + 4].copy_from_slice(&1u32.to_ne_bytes());
        assert!(parse_datagram(&fork).is_none(), "not an exit");
    }

    #[test]
    fn wait_statuses_split_as_waitpid_reads_them() {
        assert_eq!(split_wait_status(0), (Some(0), None, false));
        assert_eq!(split_wait_status(1 << 8), (Some(1), None, false));
        assert_eq!(split_wait_status(0x86), (None, Some(6), true));
        assert_eq!(split_wait_status(15), (None, Some(15), false));
    }

    /// On a host where we may subscribe (root in the host's network
    /// namespace), a child's SIGKILL is reported with its status; elsewhere
    /// the reason is given and nothing else is checked.
    #[test]
    fn a_killed_process_is_reported_where_the_kernel_lets_us_subscribe() {
        let mut events = match ExitEvents::open() {
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
        let mut seen = None;
        while seen.is_none() && std::time::Instant::now() < deadline {
            seen = events.read().into_iter().find(|e| e.pid == pid);
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let e = seen.expect("the kill was reported");
        assert_eq!(e.status(), (None, Some(9), false));
    }
}
