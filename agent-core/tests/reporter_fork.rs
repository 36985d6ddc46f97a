//! After fork() the child has no reporter thread: its sends must return false
//! at once (never block, never touch the parent's locks), and the parent's
//! reporter keeps working.

use oomscope_agent_core::pb;
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};

#[test]
fn a_forked_child_sends_nothing_and_does_not_hang() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
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
