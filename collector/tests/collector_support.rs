//! Shared by the collector's gRPC tests: a real collector on 127.0.0.1:0 over
//! a real SQLite file, and an agent that speaks the stream by hand.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use oomscope_collector::ingest::Collector;
use oomscope_collector::pb;
use oomscope_collector::pb::agent_message::Body;
use oomscope_collector::serve::{serve_with_limits, ConnectionLimits};
use oomscope_collector::store::Store;
/// An agent's stream by hand: the one connect set-up, shared with the cli's tests.
pub use oomscope_testkit::agent_stream::AgentStream;
use tokio::sync::oneshot;
use tonic::transport::Channel;

pub const MIB: u64 = 1024 * 1024;

pub struct Running {
    pub addr: SocketAddr,
    pub db: PathBuf,
    pub collector: Collector,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// Starts a collector over a fresh `c.db` in `dir`, with a 5 s lost grace.
pub async fn start_in(dir: &tempfile::TempDir) -> Running {
    start(&dir.path().join("c.db"), Duration::from_secs(5)).await
}

/// Starts a collector on an ephemeral loopback port over `db`.
pub async fn start(db: &Path, lost_grace: Duration) -> Running {
    start_with(
        db,
        lost_grace,
        oomscope_collector::fleet::FleetPolicy::default(),
    )
    .await
}

/// The same, with the fleet detectors' windows set by the test.
pub async fn start_with(
    db: &Path,
    lost_grace: Duration,
    fleet: oomscope_collector::fleet::FleetPolicy,
) -> Running {
    let store = Store::open(db).expect("open store");
    serving(db, Collector::with_fleet_policy(store, lost_grace, fleet)).await
}

/// Serves `collector` (over the store at `db`) on an ephemeral loopback port.
pub async fn serving(db: &Path, collector: Collector) -> Running {
    serving_limited(db, collector, ConnectionLimits::default()).await
}

/// The same, holding clients to `limits`.
pub async fn serving_limited(db: &Path, collector: Collector, limits: ConnectionLimits) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve_with_limits(
        listener,
        collector.clone(),
        limits,
        async move {
            let _ = stopped.await;
        },
    ));
    Running {
        addr,
        db: db.to_path_buf(),
        collector,
        stop: Some(stop),
        task,
    }
}

impl Running {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Graceful shutdown; fails the test if the server does not stop within 10 s
    /// (open agent streams must not hold it up).
    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("collector did not shut down within 10 s")
            .expect("server task")
            .expect("serve returned an error");
    }

    pub async fn channel(&self) -> Channel {
        oomscope_testkit::agent_stream::channel(&self.url()).await
    }

    pub async fn query(&self) -> pb::query_service_client::QueryServiceClient<Channel> {
        pb::query_service_client::QueryServiceClient::new(self.channel().await)
    }

    pub async fn agent(&self, hello: pb::Hello) -> AgentStream {
        AgentStream::connect(&self.url(), hello, Vec::new()).await
    }
}

pub fn hello(agent_id: &str, name: &str) -> pb::Hello {
    pb::Hello {
        agent_id: agent_id.into(),
        name: name.into(),
        host: "testhost".into(),
        pid: 4242,
        runtime: "pytorch".into(),
        ..Default::default()
    }
}

/// A sample at `time_ns` whose RSS and allocator figures encode `seq`, so a
/// test can check the numbers that come back.
pub fn sample(seq: u64, time_ns: i64) -> pb::AgentMessage {
    pb::AgentMessage {
        seq,
        body: Some(Body::Sample(pb::Sample {
            time_ns,
            process: Some(pb::ProcessMemory {
                pid: 4242,
                vm_rss_bytes: seq * MIB,
                ..Default::default()
            }),
            allocator: vec![pb::AllocatorStats {
                device: 0,
                allocated_bytes: seq * 8 * MIB,
                reserved_bytes: seq * 16 * MIB,
                ..Default::default()
            }],
            step: seq,
            ..Default::default()
        })),
    }
}

pub fn event(seq: u64, time_ns: i64, kind: pb::event::Kind) -> pb::AgentMessage {
    pb::AgentMessage {
        seq,
        body: Some(Body::Event(pb::Event {
            time_ns,
            kind: Some(kind),
        })),
    }
}

/// The fragmentation_oom capture's failure: 96 MiB under a 2 GiB cap with
/// 800 MiB allocated and 1.17 GiB reserved but unallocated.
pub fn oom(seq: u64, time_ns: i64) -> pb::AgentMessage {
    event(
        seq,
        time_ns,
        pb::event::Kind::Oom(pb::Oom {
            device: 0,
            requested_bytes: 96 * MIB,
            observer: Some(pb::OomObserver { device: 0, alloc: (96 * MIB) as i64, device_allocated: (2048 * MIB) as i64, device_free: 0 }),
            error_type: "torch.OutOfMemoryError".into(),
            error_text: "CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity of 139.80 GiB \
                         of which 137.5 GiB is free. Of the allocated memory 800.00 MiB is allocated by PyTorch, and \
                         1.17 GiB is reserved by PyTorch but unallocated."
                .into(),
            stats: Some(pb::AllocatorStats {
                device: 0,
                allocated_bytes: 800 * MIB,
                reserved_bytes: 800 * MIB + 1200 * MIB,
                inactive_split_bytes: 1200 * MIB,
                ..Default::default()
            }),
            ..Default::default()
        }),
    )
}

/// A process of a multi-process server: its own agent, in `instance`.
pub fn member(agent_id: &str, name: &str, instance: &str, pid: u32, role: &str) -> pb::Hello {
    pb::Hello {
        pid,
        role: role.into(),
        instance: instance.into(),
        ..hello(agent_id, name)
    }
}

pub fn supervisor(agent_id: &str, name: &str) -> pb::Hello {
    pb::Hello {
        pid: 100,
        role: "supervisor".into(),
        runtime: "supervisor".into(),
        instance: agent_id.into(),
        ..hello(agent_id, name)
    }
}

pub fn child_start(seq: u64, time_ns: i64, pid: u32) -> pb::AgentMessage {
    event(
        seq,
        time_ns,
        pb::event::Kind::ChildStart(pb::ChildStart {
            pid,
            ..Default::default()
        }),
    )
}

pub fn child_exit(seq: u64, time_ns: i64, x: pb::ChildExit) -> pb::AgentMessage {
    event(seq, time_ns, pb::event::Kind::ChildExit(x))
}

/// The supervisor's record of its GPU worker (pid 401) exiting 1: a
/// `member_failed`.
pub fn worker_failed(seq: u64, time_ns: i64) -> pb::AgentMessage {
    child_exit(
        seq,
        time_ns,
        pb::ChildExit {
            pid: 401,
            exit_code: Some(1),
            member: true,
            title: "GpuWorker-0".into(),
            status_from: "proc_events".into(),
            ..Default::default()
        },
    )
}

/// Samples 1..=100, 1 ms apart from `t0`; seqs 10, 30 and 51 state drops
/// before them: (samples, requests, stride) of [`DROPS_STATED`].
pub fn samples_stating_drops(t0: i64) -> Vec<pb::AgentMessage> {
    (1..=100u64)
        .map(|seq| {
            let mut m = sample(seq, t0 + seq as i64 * 1_000_000);
            if let (Some(Body::Sample(s)), Some((_, samples, requests, stride))) =
                (m.body.as_mut(), DROPS_STATED.iter().find(|d| d.0 == seq))
            {
                s.dropped_before = Some(pb::DroppedBefore {
                    samples: *samples,
                    requests: *requests,
                    stride: *stride,
                    ..Default::default()
                });
            }
            m
        })
        .collect()
}

/// A drop statement on a sample: (seq, samples, requests, stride).
pub type DropStated = (u64, u64, u64, u32);

/// (seq, samples, requests, stride) that [`samples_stating_drops`] states.
pub const DROPS_STATED: [DropStated; 3] = [(10, 4, 40, 2), (30, 6, 60, 4), (51, 1, 0, 1)];

/// Each drop statement of a thinned timeline's points, as (seq, samples,
/// requests, stride), and what [`DROPS_STATED`] folds to on those points:
/// each statement on the first kept point at or after it, summed.
pub fn folded_drops(samples: &[pb::TimedSample]) -> (Vec<DropStated>, Vec<DropStated>) {
    let got = samples
        .iter()
        .filter_map(|p| {
            let d = p.sample.as_ref()?.dropped_before?;
            Some((p.seq, d.samples, d.requests, d.stride))
        })
        .collect();
    let kept: Vec<u64> = samples.iter().map(|p| p.seq).collect();
    let mut want: Vec<DropStated> = Vec::new();
    for (seq, s, r, k) in DROPS_STATED {
        let at = *kept
            .iter()
            .find(|&&p| p >= seq)
            .expect("a point after each drop");
        match want.iter_mut().find(|e| e.0 == at) {
            Some(e) => (e.1, e.2, e.3) = (e.1 + s, e.2 + r, e.3.max(k)),
            None => want.push((at, s, r, k)),
        }
    }
    (got, want)
}

pub fn goodbye(seq: u64) -> pb::AgentMessage {
    pb::AgentMessage {
        seq,
        body: Some(Body::Goodbye(pb::Goodbye {
            reason: "exit".into(),
            exit_code: 0,
        })),
    }
}

pub async fn incidents(run: &Running, agent: &str) -> Vec<pb::Incident> {
    run.query()
        .await
        .incidents(pb::IncidentsRequest {
            agent: agent.into(),
            ..Default::default()
        })
        .await
        .expect("Incidents")
        .into_inner()
        .incidents
}

/// The whole timeline of an agent (by id, or the newest of a name).
pub async fn timeline(run: &Running, agent: &str) -> pb::TimelineResponse {
    run.query()
        .await
        .timeline(pb::TimelineRequest {
            agent: agent.into(),
            ..Default::default()
        })
        .await
        .expect("Timeline")
        .into_inner()
}

/// The RSS a stored sample carries (what [`sample`] encodes its seq in).
pub fn rss(s: &pb::TimedSample) -> u64 {
    s.sample
        .as_ref()
        .and_then(|s| s.process.as_ref())
        .expect("a sample with process memory")
        .vm_rss_bytes
}

/// Every agent the collector lists, oldest first.
pub async fn all_agents(run: &Running) -> Vec<pb::AgentSummary> {
    run.query()
        .await
        .list_agents(pb::ListAgentsRequest::default())
        .await
        .expect("ListAgents")
        .into_inner()
        .agents
}

pub async fn agent_summary(run: &Running, agent_id: &str) -> pb::AgentSummary {
    all_agents(run)
        .await
        .into_iter()
        .find(|a| a.hello.as_ref().is_some_and(|h| h.agent_id == agent_id))
        .unwrap_or_else(|| panic!("agent {agent_id} not listed"))
}

/// Polls `check` every 50 ms until it returns Some, for at most `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Rows stored for an agent, read through a separate SQLite connection.
#[allow(unused_imports)] // Not every test file that includes this reads rows.
pub use oomscope_testkit::store_rows::stored_seqs;

/// The request that opens an agent stream (`AgentService.Connect`), for a
/// test that speaks HTTP/2 by hand.
pub fn connect_request(addr: SocketAddr) -> http::Request<()> {
    http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/oomscope.v1.AgentService/Connect"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}
