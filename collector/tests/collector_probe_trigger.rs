//! A kill during `oomscope probe`, over real gRPC and a real SQLite file:
//! the probe's requests (a member of the server's instance with the probe's
//! role) reach the diagnosis of the kill, which reads the step that went past
//! what the server had answered as its trigger; the probe itself is judged
//! as no process of the instance.

#[path = "collector_support.rs"]
mod support;

use std::time::Duration;

use oomscope_collector::pb;
use oomscope_collector::pb::event::Kind;
use support::*;

const GRACE: Duration = Duration::from_millis(300);
const MS: i64 = 1_000_000;

fn boundary(seq: u64, time_ns: i64, b: pb::RequestBoundary) -> pb::AgentMessage {
    event(seq, time_ns, Kind::Request(b))
}

/// The probe's request `id`: its start with the probe's count, its end
/// with the count the server's answer carried and the error, if any.
fn request(
    seq: u64,
    id: u32,
    start: i64,
    end: Option<(i64, u64, &str)>,
    est: u64,
) -> Vec<pb::AgentMessage> {
    let request_id = format!("probe-{id}");
    let mut out = vec![boundary(
        seq,
        start,
        pb::RequestBoundary {
            request_id: request_id.clone(),
            start: true,
            prompt_tokens: est,
            max_tokens: 16,
            ..Default::default()
        },
    )];
    if let Some((at, counted, error)) = end {
        out.push(boundary(
            seq + 1,
            at,
            pb::RequestBoundary {
                request_id,
                start: false,
                prompt_tokens: counted,
                error: error.into(),
                ..Default::default()
            },
        ));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_during_the_probes_longer_prompt_is_size_dependent() {
    let dir = tempfile::tempdir().unwrap();
    let run = start(&dir.path().join("c.db"), GRACE).await;
    let t = oomscope_collector::store::now_ns();
    let mut sup = run
        .agent(pb::Hello {
            pid: 100,
            role: "supervisor".into(),
            runtime: "supervisor".into(),
            instance: "sup".into(),
            ..hello("sup", "srv")
        })
        .await;
    sup.send(event(
        1,
        t,
        Kind::ChildStart(pb::ChildStart {
            pid: 200,
            ..Default::default()
        }),
    ))
    .await;
    sup.acks_covering(&[1].into(), |_| {}).await;

    // The probe: 512 and 1024 words answered (the server counting about
    // five tokens a word), then 4096 words sent, never answered.
    let mut probe = run
        .agent(pb::Hello {
            pid: 9000,
            role: oomscope_proto::PROBE_ROLE.into(),
            instance: "sup".into(),
            ..hello("probe-1", "srv.probe")
        })
        .await;
    let mut msgs = request(1, 0, t + 100 * MS, Some((t + 400 * MS, 2590, "")), 512);
    msgs.extend(request(
        3,
        1,
        t + 500 * MS,
        Some((t + 1000 * MS, 5170, "")),
        1024,
    ));
    msgs.extend(request(5, 2, t + 2000 * MS, None, 4096));
    for m in msgs {
        probe.send(m).await;
    }
    probe.acks_covering(&[1, 2, 3, 4, 5].into(), |_| {}).await;

    // The kernel kills the server in its cgroup at +3 s.
    sup.send(event(
        2,
        t + 3000 * MS,
        Kind::KernelOomKill(pb::KernelOomKill {
            pid: 200,
            task: "server".into(),
            constraint: "CONSTRAINT_MEMCG".into(),
            oom_memcg: "/test/limit".into(),
            ..Default::default()
        }),
    ))
    .await;
    sup.send(event(
        3,
        t + 3100 * MS,
        Kind::ChildExit(pb::ChildExit {
            pid: 200,
            signal: Some(9),
            runtime_ns: 3_100_000_000,
            ..Default::default()
        }),
    ))
    .await;
    sup.acks_covering(&[2, 3].into(), |_| {}).await;

    let incs = incidents(&run, "").await;
    assert_eq!(incs.len(), 1, "{incs:#?}");
    assert_eq!(incs[0].kind, "kernel_oom_kill", "{incs:#?}");
    let d = run
        .query()
        .await
        .diagnose(pb::DiagnoseRequest {
            incident: incs[0].id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    assert_eq!(
        d.trigger.as_deref(),
        Some("size_dependent"),
        "{:#?}",
        d.evidence
    );
    // The median of the server's counts (5170 / 1024 and 2590 / 512, upper:
    // 5.06) scales the 4096 words in flight.
    let line = d
        .evidence
        .iter()
        .find(|l| l.starts_with("trigger size_dependent:"))
        .unwrap_or_else(|| panic!("{:#?}", d.evidence));
    assert!(
        line.contains("prompt of about 20720 tokens by the server's counts of the earlier prompts (5.06 of the probe's estimate of 4096)")
            && line.contains("answered 2 of the probe's requests, prompts of up to 5170 tokens"),
        "{line}"
    );
    // The probe is no process of the instance: no cause names it.
    assert!(
        d.causes
            .iter()
            .all(|c| c.processes.iter().all(|p| p.pid != 9000)),
        "{:#?}",
        d.causes
    );
    drop((sup, probe));
    run.stop().await;
}
