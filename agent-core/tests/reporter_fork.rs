//! After fork() the child has no reporter thread: its sends must return false
//! at once (never block, never touch the parent's locks), and the parent's
//! reporter keeps working.

use oomscope_agent_core::pb;
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};

#[test]
fn a_forked_child_sends_nothing_and_does_not_hang() {
    let port = oomscope_testkit::free_port();
    let r = Reporter::start(
        ReporterConfig::new(format!("http://127.0.0.1:{port}")),
        pb::Hello {
            agent_id: format!("fork-{port}"),
            ..Default::default()
        },
    );
    assert!(r.send_sample(pb::Sample::default()), "the parent can send");
    // SAFETY: the child only calls send_sample (an atomic check) and _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let sent = r.send_sample(pb::Sample::default());
        unsafe { libc::_exit(if sent { 1 } else { 0 }) };
    }
    let mut status = 0;
    // A hang in the child would hang here: the test runner's timeout catches it.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(libc::WIFEXITED(status), "the child exited normally");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child's send returned false"
    );
    assert!(
        r.send_sample(pb::Sample::default()),
        "the parent still sends after the fork"
    );
    assert_eq!(
        r.stats().dropped,
        0,
        "the child's refusal is not counted in the parent"
    );
}

/// Whether this process holds a socket whose peer is `port` on loopback
/// (raw system calls only: safe in a forked child).
fn holds_a_socket_to(port: u16) -> bool {
    (0..1024).any(|fd| {
        let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: getpeername writes at most `len` bytes into `addr`.
        let ok = unsafe { libc::getpeername(fd, (&raw mut addr).cast(), &mut len) == 0 };
        ok && i32::from(addr.sin_family) == libc::AF_INET && u16::from_be(addr.sin_port) == port
    })
}

#[test]
fn a_forked_child_closes_its_copy_of_the_parents_connection() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let r = Reporter::start(
        ReporterConfig::new(format!("http://127.0.0.1:{port}")),
        pb::Hello {
            agent_id: format!("fork-conn-{port}"),
            ..Default::default()
        },
    );
    // The TCP connection is up once accepted (no HTTP/2 answers it: the
    // reporter keeps it open for its connect timeout, then tries again).
    let (_accepted, _) = listener.accept().unwrap();
    assert!(holds_a_socket_to(port), "the parent's connection is open");
    // SAFETY: the child only makes raw system calls, then _exit()s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let kept = holds_a_socket_to(port);
        unsafe { libc::_exit(if kept { 1 } else { 0 }) };
    }
    let mut status = 0;
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(libc::WIFEXITED(status), "the child exited normally");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child kept its copy of the parent's connection"
    );
    assert!(
        holds_a_socket_to(port),
        "the parent's connection stays open"
    );
    drop(r);
}
