//! The fallback fix "Rerun under `oomscope run`" is for evidence that lacks
//! what `oomscope run` records; it is never proposed to someone whose
//! evidence came from `oomscope run` already.

mod common;

use common::*;
use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{diagnose, Evidence};

fn proposes_rerun(e: &Evidence) -> bool {
    diagnose(e)
        .fixes
        .iter()
        .any(|f| f.action.starts_with("Rerun under `oomscope run`"))
}

/// A Python server's own agent, lost mid-run with nothing on record that
/// names a domain: host samples only, no exit status, no kernel record.
fn lost_server(hello: pb::Hello) -> Evidence {
    let samples = (0..5)
        .map(|i| {
            let mut s = sample(T0 + i * SEC, vec![], system(10, 12 * GIB));
            s.process = Some(process(CHILD_PID, 0, GIB, GIB));
            s
        })
        .collect();
    Evidence {
        members: Vec::new(),
        ended: false,
        hello: Some(hello),
        samples,
        events: vec![],
        incident: incident("agent_lost", T0 + 5 * SEC),
    }
}

fn server_hello() -> pb::Hello {
    pb::Hello {
        agent_id: "agent-srv1".into(),
        name: "web".into(),
        host: "gpu-01".into(),
        pid: CHILD_PID,
        role: "server".into(),
        runtime: "pytorch".into(),
        ..Default::default()
    }
}

#[test]
fn an_agent_started_on_its_own_is_told_to_rerun_under_oomscope_run() {
    let d = diagnose(&lost_server(server_hello()));
    assert!(
        d.causes.is_empty(),
        "this evidence names no cause: {:#?}",
        d.causes
    );
    assert!(
        proposes_rerun(&lost_server(server_hello())),
        "{:#?}",
        d.fixes
    );
    // A probe's agent is handed the probed server's instance, not a
    // supervisor's: that says nothing about `oomscope run`.
    let probe = pb::Hello {
        role: oomscope_proto::PROBE_ROLE.into(),
        instance: "agent-srv0".into(),
        ..server_hello()
    };
    assert!(proposes_rerun(&lost_server(probe)));
}

#[test]
fn evidence_from_oomscope_run_is_not_told_to_rerun_under_it() {
    // The supervisor's own Hello.
    assert!(!proposes_rerun(&lost_server(hello())));
    // An in-process agent of a process `oomscope run` started: it was handed
    // the supervisor's agent id and instance.
    let mut handed_supervisor = server_hello();
    handed_supervisor
        .labels
        .insert("supervisor_agent".into(), "agent-7f3a".into());
    assert!(!proposes_rerun(&lost_server(handed_supervisor)));
    let in_supervised_instance = pb::Hello {
        instance: "agent-7f3a".into(),
        ..server_hello()
    };
    assert!(!proposes_rerun(&lost_server(in_supervised_instance)));
    // The supervisor's child events, even where its Hello is missing.
    let mut e = lost_server(server_hello());
    e.hello = None;
    e.events.push(pb::Event {
        time_ns: T0,
        kind: Some(Kind::ChildStart(pb::ChildStart {
            pid: CHILD_PID,
            command: vec!["python".into(), "server.py".into()],
            ..Default::default()
        })),
    });
    assert!(!proposes_rerun(&e));
}

#[test]
fn a_supervised_child_that_failed_for_no_named_reason_gets_no_rerun_fix() {
    // Exit 1 with nothing on stderr: a failure, no domain named.
    let before = counters(T0, vec![], system(10, 12 * GIB));
    let after = counters(T0 + 3 * SEC, vec![], system(10, 12 * GIB));
    let e = supervised(exit(Some(1), None, "", before, after, None), "exit");
    let d = diagnose(&e);
    assert!(!proposes_rerun(&e), "{:#?}", d.fixes);
    // The same exit reported without its Hello still came from the
    // supervisor: its ChildExit says so.
    let mut no_hello = e.clone();
    no_hello.hello = None;
    assert!(!proposes_rerun(&no_hello));
}
