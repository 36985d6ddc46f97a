//! Two `oomscope collector` processes on one PostgreSQL (a throwaway cluster
//! of the test's own): an agent given both URLs streams to the first; the
//! test SIGKILLs it, and the agent continues its seqs on the second. Every
//! seq is stored exactly once, no agent_lost is recorded, the incident the
//! first collector recorded is listed once by the second, queries of
//! either collector see the whole fleet, and a query verb given both URLs
//! asks the second once the first is gone.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
use oomscope_collector::store::{Backend, PgStore};
use oomscope_proto::v1 as pb;
use oomscope_testkit::cli::{oomscope_bin, query_json};
use oomscope_testkit::postgres::PgCluster;
use oomscope_testkit::CollectorProcess;

const MIB: u64 = 1024 * 1024;
/// The lost grace CollectorProcess gives its collectors: the agent must be
/// back within it.
const GRACE: Duration = Duration::from_secs(1);

fn collector(pg: &PgCluster) -> CollectorProcess {
    CollectorProcess::start_with(
        || {
            let mut c = Command::new(oomscope_bin());
            oomscope_testkit::isolate(&mut c);
            c
        },
        Path::new(pg.url()),
        &[],
        None,
    )
}

fn sample(i: u64) -> pb::Sample {
    pb::Sample {
        time_ns: oomscope_proto::now_ns(),
        process: Some(pb::ProcessMemory {
            pid: std::process::id(),
            vm_rss_bytes: i * MIB,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn oom() -> pb::Event {
    pb::Event {
        time_ns: oomscope_proto::now_ns(),
        kind: Some(pb::event::Kind::Oom(pb::Oom {
            device: 0,
            requested_bytes: 96 * MIB,
            error_type: "torch.OutOfMemoryError".into(),
            error_text: "CUDA out of memory. Tried to allocate 96.00 MiB.".into(),
            ..Default::default()
        })),
    }
}

fn agent_row<'a>(agents: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    agents
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["hello"]["agent_id"] == id)
        .unwrap_or_else(|| panic!("agent {id} not listed: {agents}"))
}

#[test]
fn an_agent_continues_on_the_second_collector_when_its_own_is_killed() {
    let pg = PgCluster::start().expect("a PostgreSQL cluster for the test");
    let mut first = collector(&pg);
    let second = collector(&pg);
    let id = format!("fleet-{}", std::process::id());
    let reporter = Reporter::start(
        ReporterConfig {
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_millis(200),
            ..ReporterConfig::new(format!("{},{}", first.url, second.url))
        },
        pb::Hello {
            agent_id: id.clone(),
            name: "fleet".into(),
            pid: std::process::id(),
            ..Default::default()
        },
    );
    for i in 1..=20 {
        assert!(reporter.send_sample(sample(i)));
    }
    assert!(reporter.send_event(oom()));
    assert!(
        reporter.flush(Duration::from_secs(30)),
        "{:?}",
        reporter.stats()
    );
    assert_eq!(reporter.stats().reconnects, 0, "all on the first collector");
    let on_first = agent_row(&query_json(&first.url, &["agents"]), &id).clone();
    assert_eq!(on_first["last_seq"], 21, "{on_first}");

    first.kill(); // SIGKILL
    for i in 22..=40 {
        assert!(reporter.send_sample(sample(i)));
    }
    assert!(
        reporter.flush(Duration::from_secs(30)),
        "{:?}",
        reporter.stats()
    );
    let stats = reporter.stats();
    assert!(stats.reconnects >= 1, "{stats:?}");
    assert_eq!((stats.rejected, stats.dropped), (0, 0), "{stats:?}");

    // Every seq once: 40 rows, 39 samples and the OOM, seqs 1..=40.
    let store = PgStore::connect(pg.url(), 1).unwrap();
    assert_eq!(store.message_count(&id).unwrap(), 40);
    // Query verbs given both URLs: the first is dead, the second answers.
    let both = format!("{},{}", first.url, second.url);
    let agents = query_json(&both, &["agents"]);
    let row = agent_row(&agents, &id);
    assert_eq!(
        (&row["samples"], &row["events"], &row["last_seq"]),
        (&39.into(), &1.into(), &40.into()),
        "{row}"
    );
    // The OOM the first collector recorded, listed once by the second.
    let incidents = query_json(&both, &["incidents"]);
    let kinds: Vec<&str> = incidents
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["oom"], "{incidents}");
    assert_eq!(incidents[0]["seq"], 21, "{incidents}");

    // Past the grace, still no agent_lost: the agent came back in time.
    std::thread::sleep(GRACE + Duration::from_secs(1));
    let incidents = query_json(&second.url, &["incidents"]);
    assert_eq!(incidents.as_array().unwrap().len(), 1, "{incidents}");
    assert_eq!(store.state(&id).unwrap().as_deref(), Some("connected"));
    assert!(reporter.shutdown(
        pb::Goodbye {
            reason: "exit".into(),
            exit_code: 0,
        },
        Duration::from_secs(10)
    ));
    assert_eq!(store.state(&id).unwrap().as_deref(), Some("disconnected"));
}
