//! The collector's Prometheus metrics (`--metrics ADDR`, path `/metrics`),
//! named as Prometheus asks: the `oomscope_` prefix, base units, `_bytes`,
//! `_seconds`, `_total`.
//!
//! Per-agent series (the latest reading of each memory domain) are kept for
//! [`AGENT_SERIES_TTL`] after the agent's last sample, then removed, so a
//! fleet whose agents come and go keeps a bounded number of series.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use crate::pb;

/// How long an agent's series stay after its last sample: Prometheus marks
/// a series stale after 5 minutes without a sample, so keeping them as long
/// lets every scrape in that window see the agent's last reading.
pub const AGENT_SERIES_TTL: Duration = Duration::from_secs(5 * 60);

/// One agent's reading of one figure of one memory domain.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AgentFigure {
    pub agent: String,
    pub name: String,
    pub host: String,
    /// gpu, allocator, process, cgroup, swap.
    pub domain: String,
    /// used/total, allocated/reserved, rss, usage/limit.
    pub figure: String,
    /// The GPU or allocator device; empty for host domains.
    pub device: String,
}

/// One agent, for the series that have one value per agent.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AgentLabels {
    pub agent: String,
    pub name: String,
    pub host: String,
}

/// What `/metrics` shows of one agent, and when it last sent a sample.
struct AgentSeries {
    seen: Instant,
    figures: Vec<AgentFigure>,
    /// Set while its newest sample carried its backlog.
    backlog: Option<AgentLabels>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct IncidentLabels {
    domain: String,
    cause: String,
}

/// The collector's metrics; cheap to update from any task.
pub struct Metrics {
    registry: Registry,
    ingest_messages: Counter,
    ingest_bytes: Counter,
    conflicting: Counter,
    incidents: Family<IncidentLabels, Counter>,
    connected: Gauge,
    store_write: Histogram,
    agent_bytes: Family<AgentFigure, Gauge<f64, AtomicU64>>,
    backlog_bytes: Family<AgentLabels, Gauge>,
    backlog_messages: Family<AgentLabels, Gauge>,
    /// Each agent's series and when it last sent a sample.
    agents: Mutex<HashMap<String, AgentSeries>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("oomscope");
        let ingest_messages = Counter::default();
        registry.register(
            "ingest_messages",
            "Samples, events and Goodbyes received from agents",
            ingest_messages.clone(),
        );
        let ingest_bytes = Counter::default();
        registry.register_with_unit(
            "ingest",
            "Size of the messages received, encoded with complete counters",
            Unit::Bytes,
            ingest_bytes.clone(),
        );
        let conflicting = Counter::default();
        registry.register(
            "ingest_conflicting_resends",
            "Resent seqs refused because their content differs from the stored message",
            conflicting.clone(),
        );
        let incidents = Family::<IncidentLabels, Counter>::default();
        registry.register(
            "incidents",
            "Incidents recorded, by memory domain and cause",
            incidents.clone(),
        );
        let connected = Gauge::default();
        registry.register(
            "connected_agents",
            "Agents with an open stream to this collector",
            connected.clone(),
        );
        // 100 us .. ~3 s: a group commit is one fsync, milliseconds on SSD.
        let store_write = Histogram::new(exponential_buckets(0.0001, 2.0, 16));
        registry.register_with_unit(
            "store_write",
            "Time from a batch's arrival at the writer to its durable commit",
            Unit::Seconds,
            store_write.clone(),
        );
        let agent_bytes = Family::<AgentFigure, Gauge<f64, AtomicU64>>::default();
        registry.register_with_unit(
            "agent_memory",
            "Each agent's latest reading of each memory domain",
            Unit::Bytes,
            agent_bytes.clone(),
        );
        let backlog_bytes = Family::<AgentLabels, Gauge>::default();
        registry.register_with_unit(
            "agent_spool_backlog",
            "Each agent's unacked messages (in memory and in its spool) when it took its newest sample, encoded",
            Unit::Bytes,
            backlog_bytes.clone(),
        );
        let backlog_messages = Family::<AgentLabels, Gauge>::default();
        registry.register(
            "agent_spool_backlog_messages",
            "Each agent's unacked messages (in memory and in its spool) when it took its newest sample",
            backlog_messages.clone(),
        );
        Metrics {
            registry,
            ingest_messages,
            ingest_bytes,
            conflicting,
            incidents,
            connected,
            store_write,
            agent_bytes,
            backlog_bytes,
            backlog_messages,
            agents: Mutex::new(HashMap::new()),
        }
    }

    /// A batch of `messages` (`bytes` encoded) arrived.
    pub fn received(&self, messages: u64, bytes: u64) {
        self.ingest_messages.inc_by(messages);
        self.ingest_bytes.inc_by(bytes);
    }

    pub fn conflicting(&self, n: u64) {
        self.conflicting.inc_by(n);
    }

    pub fn incident(&self, inc: &pb::Incident) {
        self.incidents
            .get_or_create(&IncidentLabels {
                domain: inc.domain.clone(),
                cause: inc.kind.clone(),
            })
            .inc();
    }

    pub fn store_write(&self, took: Duration) {
        self.store_write.observe(took.as_secs_f64());
    }

    /// The agent's newest sample replaces its series.
    pub fn sample(&self, hello: &pb::Hello, sample: &pb::Sample, now: Instant) {
        let figures = figures_of(sample);
        let mut agents = self.agents.lock();
        let entry = agents
            .entry(hello.agent_id.clone())
            .or_insert_with(|| AgentSeries {
                seen: now,
                figures: Vec::new(),
                backlog: None,
            });
        let mut kept = Vec::with_capacity(figures.len());
        for (domain, figure, device, value) in figures {
            let labels = AgentFigure {
                agent: hello.agent_id.clone(),
                name: hello.name.clone(),
                host: hello.host.clone(),
                domain: domain.into(),
                figure: figure.into(),
                device,
            };
            self.agent_bytes.get_or_create(&labels).set(value);
            kept.push(labels);
        }
        // A figure the agent no longer reports goes now.
        for old in &entry.figures {
            if !kept.contains(old) {
                self.agent_bytes.remove(old);
            }
        }
        let labels = AgentLabels {
            agent: hello.agent_id.clone(),
            name: hello.name.clone(),
            host: hello.host.clone(),
        };
        if let Some(old) = entry.backlog.take().filter(|old| *old != labels) {
            self.remove_backlog(&old);
        }
        match &sample.backlog {
            Some(b) => {
                let clamp = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
                self.backlog_bytes
                    .get_or_create(&labels)
                    .set(clamp(b.bytes));
                self.backlog_messages
                    .get_or_create(&labels)
                    .set(clamp(b.messages));
                entry.backlog = Some(labels);
            }
            None => self.remove_backlog(&labels),
        }
        entry.seen = now;
        entry.figures = kept;
    }

    fn remove_backlog(&self, labels: &AgentLabels) {
        self.backlog_bytes.remove(labels);
        self.backlog_messages.remove(labels);
    }

    /// Drops the series of agents silent for longer than `ttl`.
    pub fn expire(&self, now: Instant, ttl: Duration) {
        self.agents.lock().retain(|_, series| {
            let keep = now.saturating_duration_since(series.seen) <= ttl;
            if !keep {
                for s in series.figures.iter() {
                    self.agent_bytes.remove(s);
                }
                if let Some(b) = &series.backlog {
                    self.remove_backlog(b);
                }
            }
            keep
        });
    }

    /// The text exposition, with `connected` agents, after expiring
    /// silent agents' series.
    pub fn render(&self, connected: i64) -> String {
        self.expire(Instant::now(), AGENT_SERIES_TTL);
        self.connected.set(connected);
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// (domain, figure, device, bytes) of what a sample read.
fn figures_of(s: &pb::Sample) -> Vec<(&'static str, &'static str, String, f64)> {
    let mut out = Vec::new();
    for g in &s.gpus {
        if g.total_bytes > 0 {
            let d = g.index.to_string();
            out.push(("gpu", "used", d.clone(), g.used_bytes as f64));
            out.push(("gpu", "total", d, g.total_bytes as f64));
        }
    }
    for a in &s.allocator {
        let d = a.device.to_string();
        out.push((
            "allocator",
            "allocated",
            d.clone(),
            a.allocated_bytes as f64,
        ));
        out.push(("allocator", "reserved", d, a.reserved_bytes as f64));
    }
    if let Some(p) = &s.process {
        out.push(("process", "rss", String::new(), p.vm_rss_bytes as f64));
        out.push((
            "swap",
            "process_used",
            String::new(),
            p.vm_swap_bytes as f64,
        ));
    }
    // The binding level: the tightest limit of the cgroup path.
    let binding = s
        .cgroup
        .iter()
        .filter(|c| c.limit_bytes > 0)
        .min_by_key(|c| c.limit_bytes)
        .or(s.cgroup.first());
    if let Some(c) = binding {
        out.push(("cgroup", "usage", String::new(), c.usage_bytes as f64));
        if c.limit_bytes > 0 {
            out.push(("cgroup", "limit", String::new(), c.limit_bytes as f64));
        }
    }
    if let Some(sys) = &s.system {
        if sys.swap_total_bytes > 0 {
            let used = sys.swap_total_bytes.saturating_sub(sys.swap_free_bytes);
            out.push(("swap", "host_used", String::new(), used as f64));
            out.push((
                "swap",
                "host_total",
                String::new(),
                sys.swap_total_bytes as f64,
            ));
        }
    }
    out
}

/// Serves `GET /metrics` on `listener` until `shutdown` completes; each
/// scrape answers what `render` returns (`Collector::render_metrics`).
pub async fn serve(
    listener: tokio::net::TcpListener,
    render: impl Fn() -> String + Clone + Send + Sync + 'static,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use axum::routing::get;
    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let render = render.clone();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    render(),
                )
            }
        }),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

/// Binds the metrics address (before the store opens: a taken port fails
/// first).
pub async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    use anyhow::Context;
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen for /metrics on {addr}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(id: &str) -> pb::Hello {
        pb::Hello {
            agent_id: id.into(),
            name: "svc".into(),
            host: "h".into(),
            ..Default::default()
        }
    }

    fn sample(limit: u64, usage: u64) -> pb::Sample {
        pb::Sample {
            cgroup: vec![
                pb::CgroupLevel {
                    limit_bytes: 0,
                    usage_bytes: 9 << 30,
                    ..Default::default()
                },
                pb::CgroupLevel {
                    limit_bytes: limit,
                    usage_bytes: usage,
                    ..Default::default()
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn an_agents_series_hold_its_latest_reading_and_expire_after_the_ttl() {
        let m = Metrics::new();
        let t0 = Instant::now();
        m.sample(&hello("a1"), &sample(64 << 20, 10 << 20), t0);
        m.sample(&hello("a1"), &sample(64 << 20, 20 << 20), t0);
        let text = m.render(1);
        assert!(
            text.contains(
                "oomscope_agent_memory_bytes{agent=\"a1\",name=\"svc\",host=\"h\",domain=\"cgroup\",figure=\"limit\",device=\"\"} 67108864.0"
            ),
            "{text}"
        );
        assert!(
            text.contains("figure=\"usage\",device=\"\"} 20971520.0"),
            "{text}"
        );
        assert!(text.contains("oomscope_connected_agents 1"), "{text}");
        assert!(
            !text.contains("agent_spool_backlog_bytes{"),
            "no backlog sent: {text}"
        );
        let mut with_backlog = sample(64 << 20, 20 << 20);
        with_backlog.backlog = Some(pb::Backlog {
            messages: 7,
            bytes: 3000,
        });
        m.sample(&hello("a1"), &with_backlog, t0);
        let text = m.render(1);
        assert!(
            text.contains(
                "oomscope_agent_spool_backlog_bytes{agent=\"a1\",name=\"svc\",host=\"h\"} 3000"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "oomscope_agent_spool_backlog_messages{agent=\"a1\",name=\"svc\",host=\"h\"} 7"
            ),
            "{text}"
        );
        m.expire(t0 + AGENT_SERIES_TTL, AGENT_SERIES_TTL);
        assert!(m.render(0).contains("agent=\"a1\""));
        m.expire(
            t0 + AGENT_SERIES_TTL + Duration::from_secs(1),
            AGENT_SERIES_TTL,
        );
        assert!(!m.render(0).contains("agent=\"a1\""));
    }

    #[test]
    fn a_sample_without_a_backlog_removes_the_agents_backlog_series() {
        let m = Metrics::new();
        let t0 = Instant::now();
        let mut s = sample(64 << 20, 1 << 20);
        s.backlog = Some(pb::Backlog {
            messages: 2,
            bytes: 100,
        });
        m.sample(&hello("a2"), &s, t0);
        assert!(m
            .render(1)
            .contains("oomscope_agent_spool_backlog_messages{"));
        s.backlog = None;
        m.sample(&hello("a2"), &s, t0);
        let text = m.render(1);
        assert!(
            !text.contains("oomscope_agent_spool_backlog_messages{"),
            "{text}"
        );
        assert!(
            !text.contains("oomscope_agent_spool_backlog_bytes{"),
            "{text}"
        );
    }
}
