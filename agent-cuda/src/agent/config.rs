//! The agent's settings, resolved as the Python agent's are: what the
//! program set first, then the `OOMSCOPE_*` environment (what `oomscope run`
//! passes its child), then the defaults.

use std::path::PathBuf;
use std::time::Duration;

use oomscope_agent_core::agent::{check_interval, IntervalTooShort};
use oomscope_agent_core::reporter::check_collector_url;
use oomscope_proto::Role;

use crate::pb;

/// A full reading (host domains and allocator) this often; the collector
/// can change it with a SetSampleInterval directive. At least
/// [`oomscope_agent_core::agent::MIN_SAMPLE_INTERVAL`]. A leak is found
/// from the readings taken at each request's end, not from these.
pub const DEFAULT_SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
/// How long an OOM waits for the collector's ack before the error returns:
/// long enough for a loopback or LAN round trip, short enough that a dead
/// collector delays the failing request by at most this.
pub const DEFAULT_OOM_ACK_WAIT: Duration = Duration::from_secs(2);
/// How long [`crate::Agent::shutdown`] waits for the collector's acks when
/// the program passes this: what is not acked by then stays in the spool
/// (if any). Shutdown returns within its wait plus the time to stop two
/// threads that never block on the network (tens of ms).
pub const DEFAULT_SHUTDOWN_WAIT: Duration = Duration::from_secs(2);
/// The collector's address, overriding the default local collector.
pub const COLLECTOR_ENV: &str = "OOMSCOPE_COLLECTOR";
/// The service's name, overriding the one the program gave (`oomscope run
/// --name` sets it for its child).
pub const NAME_ENV: &str = "OOMSCOPE_NAME";
/// A directory to spool unacked messages in while the collector is away.
pub const SPOOL_ENV: &str = "OOMSCOPE_SPOOL";
/// Set by `oomscope run` to its own agent id: this process is its child's.
pub const SUPERVISOR_ENV: &str = "OOMSCOPE_SUPERVISOR_AGENT";

#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The service's name; `OOMSCOPE_NAME` wins when set.
    pub name: String,
    /// None: `OOMSCOPE_COLLECTOR`, else the default local collector.
    pub collector_url: Option<String>,
    pub role: String,
    pub models: Vec<pb::Model>,
    pub sample_interval: Duration,
    pub oom_ack_wait: Duration,
    /// None: `OOMSCOPE_SPOOL`, else unacked messages stay in memory only.
    pub spool_dir: Option<PathBuf>,
    pub labels: Vec<(String, String)>,
}

/// Why [`crate::Agent::start`] refused: the program's settings, never the
/// collector's absence (that is a warning and a spool).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("oomscope: sample interval: {0}")]
    Interval(#[from] IntervalTooShort),
    #[error("oomscope: {0}")]
    CollectorUrl(String),
    /// Another agent runs in this process (its name): one serves every
    /// pool and device; share it (`Agent` is `Clone`, `attach` more pools)
    /// or shut it down first.
    #[error("oomscope: an agent already runs in this process (\"{0}\"); share it (Agent is Clone; attach more pools to it) or shut it down before starting another")]
    AlreadyRunning(String),
}

/// The settings the agent runs with, every source applied.
pub(crate) struct Resolved {
    pub name: String,
    pub url: String,
    pub spool_dir: Option<PathBuf>,
    pub interval: Duration,
    pub labels: Vec<(String, String)>,
}

fn env(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|s| !s.is_empty())
}

impl AgentConfig {
    pub fn new(name: impl Into<String>) -> Self {
        AgentConfig {
            name: name.into(),
            collector_url: None,
            role: Role::Server.into(),
            models: Vec::new(),
            sample_interval: DEFAULT_SAMPLE_INTERVAL,
            oom_ack_wait: DEFAULT_OOM_ACK_WAIT,
            spool_dir: None,
            labels: Vec::new(),
        }
    }

    /// Every source applied and checked: a bad interval or collector URL
    /// is an error here, at start.
    pub(crate) fn resolve(&self) -> Result<Resolved, StartError> {
        self.resolve_from(env)
    }

    /// [`AgentConfig::resolve`] with `env` standing for the environment.
    fn resolve_from(&self, env: impl Fn(&str) -> Option<String>) -> Result<Resolved, StartError> {
        let interval = check_interval(self.sample_interval)?;
        let url = self
            .collector_url
            .clone()
            .or_else(|| env(COLLECTOR_ENV))
            .unwrap_or_else(|| oomscope_proto::DEFAULT_COLLECTOR_URL.to_string());
        check_collector_url(&url).map_err(StartError::CollectorUrl)?;
        let mut labels = self.labels.clone();
        // The supervisor's incident takes this process's OOMs by this label.
        if let Some(sup) = env(SUPERVISOR_ENV) {
            labels.push(("supervisor_agent".into(), sup));
        }
        Ok(Resolved {
            name: env(NAME_ENV).unwrap_or_else(|| self.name.clone()),
            url,
            spool_dir: self
                .spool_dir
                .clone()
                .or_else(|| env(SPOOL_ENV).map(PathBuf::from)),
            interval,
            labels,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| pairs.iter().find(|p| p.0 == k).map(|p| p.1.to_string())
    }

    #[test]
    fn the_environment_names_the_collector_the_service_and_the_spool() {
        let env = env_of(&[
            (COLLECTOR_ENV, "http://10.0.0.1:4317"),
            (NAME_ENV, "from-run"),
            (SPOOL_ENV, "/var/spool/oomscope"),
            (SUPERVISOR_ENV, "supervisor-x"),
        ]);
        let r = AgentConfig::new("given").resolve_from(&env).unwrap();
        assert_eq!(r.url, "http://10.0.0.1:4317");
        assert_eq!(
            r.name, "from-run",
            "OOMSCOPE_NAME wins, as `oomscope run --name` sets it"
        );
        assert_eq!(r.spool_dir, Some(PathBuf::from("/var/spool/oomscope")));
        assert!(r
            .labels
            .contains(&("supervisor_agent".into(), "supervisor-x".into())));
        // What the program set wins over the environment, but the name.
        let mut cfg = AgentConfig::new("given");
        cfg.collector_url = Some("http://127.0.0.1:9".into());
        cfg.spool_dir = Some("/tmp/s".into());
        let r = cfg.resolve_from(&env).unwrap();
        assert_eq!(
            (r.url.as_str(), r.spool_dir),
            ("http://127.0.0.1:9", Some("/tmp/s".into()))
        );
        // Nothing set: the defaults.
        let r = AgentConfig::new("given").resolve_from(env_of(&[])).unwrap();
        assert_eq!(
            (r.name.as_str(), r.url.as_str()),
            ("given", oomscope_proto::DEFAULT_COLLECTOR_URL)
        );
        assert_eq!((r.spool_dir, r.labels.len()), (None, 0));
    }

    #[test]
    fn a_bad_url_or_interval_is_an_error_at_start() {
        let e = AgentConfig::new("x")
            .resolve_from(env_of(&[(COLLECTOR_ENV, "localhost:4317")]))
            .err()
            .unwrap();
        assert!(
            matches!(&e, StartError::CollectorUrl(m) if m.contains("http://")),
            "{e}"
        );
        let mut cfg = AgentConfig::new("x");
        cfg.sample_interval = Duration::from_millis(1);
        assert!(matches!(
            cfg.resolve_from(env_of(&[])),
            Err(StartError::Interval(_))
        ));
    }
}
