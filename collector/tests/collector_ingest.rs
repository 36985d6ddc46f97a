//! Ingest over real gRPC on loopback into a real SQLite file: acks follow
//! durable writes, resends are stored once, queries return the numbers sent,
//! and the data outlives a collector restart.

#[path = "collector_support.rs"]
mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use oomscope_collector::pb;
use oomscope_collector::pb::collector_message::Body as Reply;
use support::*;

const T0: i64 = 1_700_000_000_000_000_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_samples_are_acked_after_storage_and_queryable() {
    let dir = tempfile::tempdir().unwrap();
    let run = start_in(&dir).await;
    let mut agent = run.agent(hello("agent-1", "llama-server")).await;
    for seq in 1..=100u64 {
        agent.send(sample(seq, T0 + seq as i64 * 1_000_000)).await;
    }
    let want: BTreeSet<u64> = (1..=100).collect();
    let db = run.db.clone();
    let acks = agent
        .acks_covering(&want, |ack| {
            // At the moment an ack arrives, another connection to the file
            // must already see every seq it covers.
            let stored: BTreeSet<u64> = stored_seqs(&db, "agent-1").into_iter().collect();
            for seq in ack.from_seq..=ack.to_seq {
                assert!(
                    stored.contains(&seq),
                    "seq {seq} acked ({ack:?}) before it was in the file"
                );
            }
        })
        .await;
    assert!(
        acks.iter().all(|a| a.from_seq >= 1 && a.to_seq <= 100),
        "{acks:?}"
    );
    assert_eq!(
        stored_seqs(&run.db, "agent-1"),
        (1..=100).collect::<Vec<_>>()
    );

    let tl = timeline(&run, "agent-1").await;
    assert_eq!(tl.hello.as_ref().unwrap().name, "llama-server");
    assert_eq!(tl.samples.len(), 100);
    for (i, ts) in tl.samples.iter().enumerate() {
        let seq = i as u64 + 1;
        let s = ts.sample.as_ref().unwrap();
        assert_eq!(ts.seq, seq);
        assert_eq!(s.time_ns, T0 + seq as i64 * 1_000_000);
        assert_eq!(rss(ts), seq * MIB);
        assert_eq!(s.allocator[0].allocated_bytes, seq * 8 * MIB);
    }

    // By name (the newest agent of that name), thinned to 10 points, with a range.
    let mut q = run.query().await;
    let thin = q
        .timeline(pb::TimelineRequest {
            agent: "llama-server".into(),
            max_points: 10,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let seqs: Vec<u64> = thin.samples.iter().map(|s| s.seq).collect();
    assert_eq!(seqs, vec![1, 12, 23, 34, 45, 56, 67, 78, 89, 100]);
    let ranged = q
        .timeline(pb::TimelineRequest {
            agent: "agent-1".into(),
            from_ns: T0 + 20_000_000,
            to_ns: T0 + 29_000_000,
            max_points: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        ranged.samples.iter().map(|s| s.seq).collect::<Vec<_>>(),
        (20..=29).collect::<Vec<_>>()
    );

    let missing = q
        .timeline(pb::TimelineRequest {
            agent: "nobody".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound);
    assert!(
        missing.message().contains("nobody"),
        "{}",
        missing.message()
    );

    // No incident: a diagnosis of its whole timeline, with nothing failed.
    let d = q
        .diagnose(pb::DiagnoseRequest {
            agent: "agent-1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (d.incident, d.agent.as_deref(), d.domain),
        (None, Some("llama-server"), None),
        "a diagnosis names the agent by its name"
    );
    let none = q
        .diagnose(pb::DiagnoseRequest::default())
        .await
        .unwrap_err();
    assert_eq!(none.code(), tonic::Code::NotFound, "{none:?}");

    let summary = agent_summary(&run, "agent-1").await;
    assert_eq!(summary.state, "connected");
    assert_eq!(
        (summary.samples, summary.events, summary.last_seq),
        (100, 0, 100)
    );
    assert!(summary.first_seen_ns > 0 && summary.last_seen_ns >= summary.first_seen_ns);
    assert_eq!(summary.hello.as_ref().unwrap().pid, 4242);

    agent.send(goodbye(101)).await;
    agent.acks_covering(&BTreeSet::from([101]), |_| {}).await;
    agent.close();
    assert_eq!(
        agent.next().await.unwrap(),
        None,
        "the collector ends the stream after we close ours"
    );
    assert_eq!(agent_summary(&run, "agent-1").await.state, "disconnected");
    run.stop().await;
}

/// A sample of [`sample`] whose allocator carries 40 raw counters, one of
/// them moving with `seq`: on a stream the counters travel as changes.
fn counted_sample(seq: u64) -> pb::AgentMessage {
    let mut msg = sample(seq, T0 + seq as i64);
    if let Some(pb::agent_message::Body::Sample(s)) = &mut msg.body {
        s.allocator[0].raw = (0..40)
            .map(|i| {
                (
                    format!("counter.{i:02}"),
                    i * 1000 + i64::from(i == 7) * seq as i64,
                )
            })
            .collect();
    }
    msg
}

/// Replies until every seq of `want` is acked and `rejects` Rejects came.
async fn acks_and_rejects(
    agent: &mut AgentStream,
    want: &BTreeSet<u64>,
    rejects: usize,
) -> (BTreeSet<u64>, Vec<pb::Reject>) {
    let (mut acked, mut refused) = (BTreeSet::new(), Vec::new());
    while !want.is_subset(&acked) || refused.len() < rejects {
        match agent.next().await {
            Ok(Some(pb::CollectorMessage {
                body: Some(Reply::Ack(a)),
            })) => acked.extend(a.from_seq..=a.to_seq),
            Ok(Some(pb::CollectorMessage {
                body: Some(Reply::Reject(r)),
            })) => refused.push(r),
            other => panic!("acked {acked:?}, refused {refused:?}, then {other:?}"),
        }
    }
    (acked, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resent_seqs_are_acked_again_only_with_the_same_content() {
    let dir = tempfile::tempdir().unwrap();
    let run = start_in(&dir).await;
    // The first stream sends the counters as changes, as agents do.
    let mut first = run.agent(hello("agent-r", "svc")).await;
    let mut encoder = oomscope_proto::delta::Encoder::new();
    for seq in 1..=10u64 {
        let wire = encoder.encode(counted_sample(seq));
        if seq > 1 {
            let stats = match &wire.body {
                Some(pb::agent_message::Body::Sample(s)) => &s.allocator[0],
                _ => unreachable!(),
            };
            assert!(
                stats.raw.is_empty() && stats.raw_changes.is_some(),
                "{stats:?}"
            );
        }
        first.send(wire).await;
    }
    first.acks_covering(&(1..=10).collect(), |_| {}).await;
    first.close();
    drop(first);

    // The reconnected agent never saw acks for 5..=10 (say) and resends
    // them, complete this time (other bytes, the same content), except seq 8,
    // which now says something else; then it goes on with 11..=15.
    let mut again = run.agent(hello("agent-r", "svc")).await;
    for seq in 5..=15u64 {
        let mut msg = counted_sample(seq);
        if seq == 8 {
            msg = counted_sample(seq + 1000);
            msg.seq = seq;
        }
        again.send(msg).await;
    }
    let want: BTreeSet<u64> = (5..=15).filter(|&s| s != 8).collect();
    let (acked, refused) = acks_and_rejects(&mut again, &want, 1).await;
    assert!(
        !acked.contains(&8),
        "a differing seq 8 was acked: {acked:?}"
    );
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].seq, 8);
    assert!(
        refused[0]
            .reason
            .contains("already stored with other content"),
        "{}",
        refused[0].reason
    );
    assert_eq!(run.collector.conflicting_resends(), 1);
    assert_eq!(
        stored_seqs(&run.db, "agent-r"),
        (1..=15).collect::<Vec<_>>()
    );

    let tl = timeline(&run, "agent-r").await;
    assert_eq!(tl.samples.len(), 15);
    // The acked write stays: seq 8 keeps the RSS it was first stored with.
    let eight = tl.samples.iter().find(|s| s.seq == 8).unwrap();
    assert_eq!(rss(eight), 8 * MIB);
    assert_eq!(agent_summary(&run, "agent-r").await.last_seq, 15);
    run.stop().await;
}

/// An impostor that stored seq 5 first: the real agent's OOM event at seq 5
/// is refused, not acked and dropped, and raises no incident from the
/// impostor's sample.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_at_a_seq_already_stored_is_refused_not_acked() {
    let dir = tempfile::tempdir().unwrap();
    let run = start_in(&dir).await;
    let mut impostor = run.agent(hello("agent-i", "svc")).await;
    impostor.send(sample(5, T0 + 5)).await;
    impostor.acks_covering(&BTreeSet::from([5]), |_| {}).await;
    impostor.close();
    drop(impostor);

    let mut real = run.agent(hello("agent-i", "svc")).await;
    real.send(oom(5, T0 + 5)).await;
    real.send(oom(6, T0 + 6)).await;
    let (acked, refused) = acks_and_rejects(&mut real, &BTreeSet::from([6]), 1).await;
    assert!(!acked.contains(&5), "{acked:?}");
    assert_eq!(refused[0].seq, 5, "{refused:?}");
    let found = incidents(&run, "agent-i").await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].domain, "gpu_vram", "{found:?}");
    assert_eq!(run.collector.conflicting_resends(), 1);
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_message_must_be_hello() {
    let dir = tempfile::tempdir().unwrap();
    let run = start_in(&dir).await;
    let mut client = pb::agent_service_client::AgentServiceClient::new(run.channel().await);
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(sample(1, T0)).await.unwrap();
    let mut replies = client
        .connect(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    match replies.message().await {
        Ok(Some(pb::CollectorMessage {
            body: Some(Reply::Reject(r)),
        })) => {
            assert_eq!(r.seq, 1);
            assert!(r.reason.contains("Hello"), "{}", r.reason);
        }
        other => panic!("expected a Reject, got {other:?}"),
    }
    let status = replies.message().await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(run
        .query()
        .await
        .list_agents(pb::ListAgentsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .agents
        .is_empty());
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn directives_reach_a_connected_agent() {
    let dir = tempfile::tempdir().unwrap();
    let run = start_in(&dir).await;
    let mut agent = run.agent(hello("agent-d", "svc")).await;
    agent.send(sample(1, T0)).await;
    agent.acks_covering(&BTreeSet::from([1]), |_| {}).await;
    assert_eq!(run.collector.connected(), vec!["agent-d".to_string()]);

    let snap = pb::Directive {
        kind: Some(pb::directive::Kind::TakeSnapshot(pb::TakeSnapshot {
            device: 3,
        })),
    };
    run.collector.directive("agent-d", snap).unwrap();
    match agent.next().await {
        Ok(Some(pb::CollectorMessage {
            body: Some(Reply::Directive(d)),
        })) => assert_eq!(d, snap),
        other => panic!("expected the directive, got {other:?}"),
    }
    let err = run.collector.directive("agent-x", snap).unwrap_err();
    assert!(err.to_string().contains("not connected"), "{err}");
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_survives_a_restart_on_the_same_file() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("c.db");
    let run = start(&db, Duration::from_millis(300)).await;
    let mut agent = run.agent(hello("agent-p", "persist")).await;
    for seq in 1..=20u64 {
        agent.send(sample(seq, T0 + seq as i64 * 1000)).await;
    }
    agent.send(oom(21, T0 + 21_000)).await;
    agent.acks_covering(&(1..=21).collect(), |_| {}).await;
    // The stream is still open: shutdown must end it rather than wait for it.
    run.stop().await;
    match agent.next().await {
        Err(status) => assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}"),
        Ok(other) => panic!("expected the shutdown status, got {other:?}"),
    }

    let run = start(&db, Duration::from_millis(300)).await;
    let summary = agent_summary(&run, "agent-p").await;
    assert_eq!(
        (summary.samples, summary.events, summary.last_seq),
        (20, 1, 21)
    );
    let tl = timeline(&run, "persist").await;
    assert_eq!(tl.samples.len(), 20);
    assert_eq!(rss(&tl.samples[19]), 20 * MIB);
    assert_eq!(tl.events.len(), 1);
    let kinds: Vec<String> = incidents(&run, "agent-p")
        .await
        .into_iter()
        .map(|i| i.kind)
        .collect();
    assert_eq!(kinds, vec!["oom"]);

    // It was streaming when the collector went down and never came back:
    // after the grace it is lost, its samples kept.
    let lost = eventually(Duration::from_secs(5), || async {
        incidents(&run, "agent-p")
            .await
            .into_iter()
            .find(|i| i.kind == "agent_lost")
    })
    .await
    .expect("an agent_lost incident after the restart grace");
    assert_eq!(lost.seq, 0);
    assert_eq!(agent_summary(&run, "agent-p").await.state, "lost");
    assert_eq!(agent_summary(&run, "agent-p").await.samples, 20);
    run.stop().await;
}

/// Group commit: sixteen agents sending at once have their batches written
/// in shared transactions (fewer commits than batches), and each ack still
/// follows the commit that made its seqs durable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_agents_share_commits_and_acks_follow_them() {
    const AGENTS: u64 = 16;
    const SAMPLES: u64 = 60;
    let dir = tempfile::tempdir().unwrap();
    let run = start_in(&dir).await;
    let mut agents = Vec::new();
    for a in 0..AGENTS {
        agents.push(run.agent(hello(&format!("agent-g{a}"), "grouped")).await);
    }
    let mut tasks = Vec::new();
    for (a, mut agent) in agents.into_iter().enumerate() {
        let db = run.db.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("agent-g{a}");
            for seq in 1..=SAMPLES {
                agent.send(sample(seq, T0 + seq as i64 * 1_000_000)).await;
            }
            let want: BTreeSet<u64> = (1..=SAMPLES).collect();
            agent
                .acks_covering(&want, |ack| {
                    let stored: BTreeSet<u64> = stored_seqs(&db, &id).into_iter().collect();
                    for seq in ack.from_seq..=ack.to_seq {
                        assert!(stored.contains(&seq), "{id} seq {seq} acked before commit");
                    }
                })
                .await;
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let (groups, batches) = run.collector.group_commits();
    eprintln!("{batches} batches of {AGENTS} agents in {groups} commits");
    assert!(batches >= AGENTS, "{batches} batches");
    assert!(
        groups < batches,
        "{groups} commits for {batches} batches: none shared"
    );
    for a in 0..AGENTS {
        assert_eq!(
            stored_seqs(&run.db, &format!("agent-g{a}")),
            (1..=SAMPLES).collect::<Vec<_>>()
        );
    }
    run.stop().await;
}

/// Gathering: a group waits for the batches of the other streams (up to the
/// gather wait) so paced agents share a commit, stops waiting once every
/// stream's batch is in, and never holds a lone stream's batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_gathers_every_streams_batch_and_no_longer() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("c.db");
    // Far longer than any ack may take (10 s): an ack that comes at all
    // came without waiting the gather out.
    let collector = oomscope_collector::ingest::Collector::new(
        oomscope_collector::store::Store::open(&db).unwrap(),
        Duration::from_secs(5),
    )
    .with_gather_wait(Duration::from_secs(60));
    let run = serving(&db, collector).await;
    let mut lone = run.agent(hello("agent-lone", "gathered")).await;
    lone.send(sample(1, T0)).await;
    lone.acks_covering(&BTreeSet::from([1]), |_| {}).await;
    assert_eq!(run.collector.group_commits(), (1, 1));

    let mut others = Vec::new();
    for a in 0..3 {
        others.push(run.agent(hello(&format!("agent-o{a}"), "gathered")).await);
    }
    eventually(Duration::from_secs(10), || async {
        (run.collector.connected().len() == 4).then_some(())
    })
    .await
    .expect("four streams connected");
    // Spread out: without the gather each would commit alone.
    lone.send(sample(2, T0 + 1_000_000)).await;
    for (a, agent) in others.iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(150)).await;
        agent.send(sample(1, T0 + a as i64)).await;
    }
    lone.acks_covering(&BTreeSet::from([2]), |_| {}).await;
    for agent in &mut others {
        agent.acks_covering(&BTreeSet::from([1]), |_| {}).await;
    }
    assert_eq!(
        run.collector.group_commits(),
        (2, 5),
        "the four streams' batches in one group"
    );
    run.stop().await;

    // A stream that sends nothing holds a group for the gather wait only.
    let db = dir.path().join("bounded.db");
    let wait = Duration::from_millis(400);
    let collector = oomscope_collector::ingest::Collector::new(
        oomscope_collector::store::Store::open(&db).unwrap(),
        Duration::from_secs(5),
    )
    .with_gather_wait(wait);
    let run = serving(&db, collector).await;
    let mut sender = run.agent(hello("agent-s", "gathered")).await;
    let _silent = run.agent(hello("agent-q", "gathered")).await;
    eventually(Duration::from_secs(10), || async {
        (run.collector.connected().len() == 2).then_some(())
    })
    .await
    .expect("two streams connected");
    let sent = std::time::Instant::now();
    sender.send(sample(1, T0)).await;
    sender.acks_covering(&BTreeSet::from([1]), |_| {}).await;
    let took = sent.elapsed();
    assert!(took >= wait, "acked after {took:?}, before the gather wait");
    assert_eq!(run.collector.group_commits(), (1, 1));
    run.stop().await;
}
