//! The agent's settings: `oomscope.start(...)` arguments first, then the
//! `OOMSCOPE_*` environment (what `oomscope run` passes to its child), then
//! the defaults below.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use oomscope_agent_core::agent::boundary_ring::MIN_BATCH_SPACING;
use oomscope_agent_core::agent::check_interval;
use oomscope_agent_core::{reporter, spool};
use oomscope_proto::Role;

/// One sample a second: a period that shows growth
/// within a minute, at ~200 µs of GIL per sample with CUDA.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
/// The most an OOM may hold up its request thread waiting for the
/// collector's ack (the event is already synced to the spool, if any).
pub const DEFAULT_OOM_WAIT: Duration = Duration::from_millis(200);
/// A heap census every this many completed requests besides those on
/// suspicion (0 = none by count: censuses come on growth, see `census_auto`).
pub const DEFAULT_CENSUS_EVERY: u64 = 0;
/// Censuses on suspicion (`suspicion.rs`): baselines after requests 10 and
/// 50, and a census whenever the cheap signals read at every request
/// boundary (allocated blocks, RSS) grow for certain; all within a 10 %
/// duty cycle. Off: only `census_every`, `census_interval_s` and on demand.
pub const DEFAULT_CENSUS_AUTO: bool = true;
/// After each census, hand the memory it freed back to the system
/// (`malloc_trim`, see `own_heap`): otherwise glibc keeps its lists and
/// tables resident, 1 to 7 MiB a census (measured), and they add up. Off
/// leaves the process's allocator untouched.
pub const DEFAULT_CENSUS_TRIM: bool = true;
/// And one every this long (0 = never), only when no other census ran in
/// it: an idle server's heap is still on record, and a busy one (whose
/// baselines and suspicions already ran) pays nothing more.
pub const DEFAULT_CENSUS_INTERVAL: Duration = Duration::from_secs(3600);
/// A census's total time holding the GIL, over all its slices (each at most
/// `census::SLICE`); it stops scanning, partial, when this runs out. One
/// scan of 160k objects with torch imported takes 95 to 180 ms on an idle
/// machine; a loaded one took 550 to 840 ms. A partial census is left out
/// of the analysis, so the budget is generous: in slices, it costs CPU, not
/// latency.
pub const DEFAULT_CENSUS_BUDGET: Duration = Duration::from_secs(2);
/// The spacing of the agent's boundary messages (`boundary_min_interval_s`):
/// each carries the readings of every request that began or ended since the
/// last (agent-core `boundary_ring`), with one host reading. A value below
/// agent-core's `MIN_BATCH_SPACING` (50 ms: at most 20 messages a second at
/// any request rate) is raised to it; a larger one spaces them further.
pub const DEFAULT_BOUNDARY_MIN_INTERVAL: Duration = MIN_BATCH_SPACING;
/// At exit, how long the Goodbye may wait for the collector's acks.
pub const DEFAULT_EXIT_FLUSH: Duration = Duration::from_secs(2);
/// How long an autostarted agent (the `.pth` hook, in every Python process
/// that has `OOMSCOPE_COLLECTOR`) under a supervisor (`oomscope run`, see
/// [`Config::supervised`]) stays silent unless its process makes a
/// request, hits an OOM or uses CUDA first. The autostart also runs in
/// every helper a server starts (`python -c` one-liners, compile workers,
/// a launcher's probes), which live well under a second or two; a server
/// lives for minutes. Held, an agent keeps its samples in memory, so a
/// process that lasts only pays two seconds of delay, and one that does not
/// last leaves no agent at the collector and no spool. Without a supervisor
/// a process is no server for living long alone (a load generator run from
/// the same shell lives as long as its server): it stays held until one of
/// those signs. 0 turns holding off (`OOMSCOPE_HOLD_S`).
pub const DEFAULT_AUTOSTART_HOLD: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub collector: String,
    pub name: String,
    pub role: String,
    pub rank: i32,
    pub model: Option<ModelSpec>,
    pub interval: Duration,
    pub boundary_min_interval: Duration,
    pub spool_dir: Option<PathBuf>,
    /// Memory for unacked messages (`buffer_max_bytes`); past it the older
    /// samples are thinned (agent-core's `reporter::DEFAULT_UNACKED_MAX_BYTES`).
    pub buffer_max_bytes: u64,
    /// The spool's disk bound (`spool_max_bytes`; `spool::DEFAULT_SPOOL_MAX_BYTES`).
    pub spool_max_bytes: u64,
    pub oom_wait: Duration,
    pub census_every: u64,
    pub census_auto: bool,
    pub census_trim: bool,
    /// The nice value of the agent's threads (0 to 19; 0, the default,
    /// leaves them at the process's): see agent-core's `priority`.
    pub thread_nice: i32,
    pub census_interval: Duration,
    pub census_budget: Duration,
    pub exit_flush: Duration,
    /// A held start (see [`DEFAULT_AUTOSTART_HOLD`]): this long after the
    /// agent starts, when supervised; zero = not held. Only the autostart
    /// keeps it.
    pub hold: Duration,
    /// The environment names the supervisor `oomscope run` started this
    /// process (or its ancestor) under: `OOMSCOPE_SUPERVISOR_AGENT` or
    /// `OOMSCOPE_INSTANCE`. Every process of a supervised server is the
    /// server's, so a held one that lasts joins; elsewhere lasting proves
    /// nothing.
    pub supervised: bool,
    /// Started by the `.pth` autostart, not by the app's own `start()`.
    pub autostarted: bool,
    /// `torch.cuda.memory._record_memory_history(max_entries=N)`; 0 = off.
    pub history_max_entries: u64,
    /// The role a forked child takes.
    pub fork_role: String,
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelSpec {
    pub name: String,
    pub revision: String,
    pub quantization: String,
    pub dtype: String,
}

/// Where each setting comes from when `start()` did not give it.
pub trait Source {
    fn get(&self, key: &str) -> Option<String>;
}

/// The process environment: `OOMSCOPE_<KEY>` in upper case.
pub struct Env;

impl Source for Env {
    fn get(&self, key: &str) -> Option<String> {
        std::env::var(format!("OOMSCOPE_{}", key.to_ascii_uppercase()))
            .ok()
            .filter(|v| !v.is_empty())
    }
}

impl Config {
    /// `given` holds start()'s arguments as text (None = not given); `env`
    /// fills the rest. Bad values are errors that name the setting.
    pub fn resolve(
        given: &BTreeMap<String, String>,
        env: &dyn Source,
        default_name: &str,
    ) -> Result<Config, String> {
        let get = |k: &str| given.get(k).cloned().or_else(|| env.get(k));
        let secs = |k: &str, default: Duration| -> Result<Duration, String> {
            match get(k) {
                None => Ok(default),
                Some(v) => v
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s >= 0.0)
                    .map(Duration::from_secs_f64)
                    .ok_or_else(|| {
                        format!("oomscope: {k} must be a number of seconds >= 0, not {v:?}")
                    }),
            }
        };
        let count = |k: &str, default: u64| -> Result<u64, String> {
            match get(k) {
                None => Ok(default),
                Some(v) => v
                    .trim()
                    .parse::<u64>()
                    .map_err(|_| format!("oomscope: {k} must be a whole number >= 0, not {v:?}")),
            }
        };
        let flag = |k: &str, default: bool| -> Result<bool, String> {
            match get(k).as_deref().map(str::trim) {
                None => Ok(default),
                Some("1" | "true" | "True") => Ok(true),
                Some("0" | "false" | "False") => Ok(false),
                Some(v) => Err(format!(
                    "oomscope: {k} must be true or false (1 or 0), not {v:?}"
                )),
            }
        };
        let interval = check_interval(secs("interval_s", DEFAULT_INTERVAL)?)
            .map_err(|e| format!("oomscope: interval_s: {e}"))?;
        let rank = match get("rank").or_else(|| std::env::var("RANK").ok()) {
            None => 0,
            Some(v) => v
                .trim()
                .parse::<i32>()
                .map_err(|_| format!("oomscope: rank must be an integer, not {v:?}"))?,
        };
        let model = get("model").map(|name| ModelSpec {
            name,
            revision: get("revision").unwrap_or_default(),
            quantization: get("quantization").unwrap_or_default(),
            dtype: get("dtype").unwrap_or_default(),
        });
        let mut labels = BTreeMap::new();
        let supervisor = env.get("supervisor_agent");
        let supervised = supervisor.is_some() || env.get("instance").is_some();
        if let Some(sup) = supervisor {
            labels.insert("supervisor_agent".to_string(), sup);
        }
        Ok(Config {
            collector: get("collector")
                .unwrap_or_else(|| oomscope_proto::DEFAULT_COLLECTOR_URL.to_string()),
            name: get("name").unwrap_or_else(|| default_name.to_string()),
            role: get("role").unwrap_or_else(|| Role::Server.into()),
            rank,
            model,
            interval,
            boundary_min_interval: secs("boundary_min_interval_s", DEFAULT_BOUNDARY_MIN_INTERVAL)?
                .max(MIN_BATCH_SPACING),
            spool_dir: get("spool").or_else(|| get("spool_dir")).map(PathBuf::from),
            buffer_max_bytes: count(
                "buffer_max_bytes",
                reporter::DEFAULT_UNACKED_MAX_BYTES as u64,
            )?,
            spool_max_bytes: count("spool_max_bytes", spool::DEFAULT_SPOOL_MAX_BYTES)?,
            oom_wait: secs("oom_wait_s", DEFAULT_OOM_WAIT)?,
            census_every: count("census_every", DEFAULT_CENSUS_EVERY)?,
            thread_nice: match get("thread_nice") {
                None => 0,
                Some(v) => v
                    .trim()
                    .parse::<i32>()
                    .ok()
                    .filter(|n| (0..=19).contains(n))
                    .ok_or_else(|| {
                        format!(
                            "oomscope: thread_nice must be a whole number from 0 to 19, not {v:?}"
                        )
                    })?,
            },
            census_auto: flag("census_auto", DEFAULT_CENSUS_AUTO)?,
            census_trim: flag("census_trim", DEFAULT_CENSUS_TRIM)?,
            census_interval: secs("census_interval_s", DEFAULT_CENSUS_INTERVAL)?,
            census_budget: secs("census_budget_s", DEFAULT_CENSUS_BUDGET)?,
            exit_flush: secs("exit_flush_s", DEFAULT_EXIT_FLUSH)?,
            hold: secs("hold_s", DEFAULT_AUTOSTART_HOLD)?,
            supervised,
            autostarted: false,
            history_max_entries: count("history_max_entries", 0)?,
            fork_role: get("fork_role").unwrap_or_else(|| Role::Worker.into()),
            labels,
        })
    }
}

impl Config {
    /// Whether `other` says the same as this in everything a running agent
    /// cannot change: all but its identity ([`Config::same_identity`]) and
    /// how it was started.
    pub fn same_settings(&self, other: &Config) -> bool {
        let mut o = other.clone();
        o.name.clone_from(&self.name);
        o.role.clone_from(&self.role);
        o.rank = self.rank;
        o.model.clone_from(&self.model);
        o.labels.clone_from(&self.labels);
        o.hold = self.hold;
        o.supervised = self.supervised;
        o.autostarted = self.autostarted;
        *self == o
    }

    /// Whether the Hello says the same: name, role, rank, model, labels.
    pub fn same_identity(&self, other: &Config) -> bool {
        (&self.name, &self.role, self.rank, &self.model, &self.labels)
            == (
                &other.name,
                &other.role,
                other.rank,
                &other.model,
                &other.labels,
            )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake(BTreeMap<String, String>);
    impl Source for Fake {
        fn get(&self, key: &str) -> Option<String> {
            self.0.get(key).cloned()
        }
    }
    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn arguments_win_over_the_environment_and_defaults_fill_the_rest() {
        let env = Fake(map(&[
            ("collector", "http://env:1"),
            ("name", "env-name"),
            ("interval_s", "0.5"),
        ]));
        let c = Config::resolve(&map(&[("name", "given")]), &env, "python").unwrap();
        assert_eq!(c.collector, "http://env:1");
        assert_eq!(c.name, "given");
        assert_eq!(c.interval, Duration::from_millis(500));
        assert_eq!(c.oom_wait, DEFAULT_OOM_WAIT);
        assert_eq!(c.census_every, DEFAULT_CENSUS_EVERY);
        assert_eq!(c.boundary_min_interval, DEFAULT_BOUNDARY_MIN_INTERVAL);
        assert_eq!(c.thread_nice, 0);
        assert_eq!(c.role, "server");
        assert!(c.model.is_none());
        assert_eq!(
            c.hold, DEFAULT_AUTOSTART_HOLD,
            "what the autostart holds for"
        );
        let c = Config::resolve(&map(&[("hold_s", "0")]), &env, "python").unwrap();
        assert_eq!(c.hold, Duration::ZERO);
    }

    #[test]
    fn a_supervisor_or_an_instance_in_the_environment_is_supervised() {
        let none = Fake(BTreeMap::new());
        let c = Config::resolve(&BTreeMap::new(), &none, "p").unwrap();
        assert!(!c.supervised && !c.autostarted);
        for key in ["supervisor_agent", "instance"] {
            let env = Fake(map(&[(key, "supervisor-ref-host-1-2")]));
            let c = Config::resolve(&BTreeMap::new(), &env, "p").unwrap();
            assert!(c.supervised, "{key}");
        }
    }

    #[test]
    fn identity_and_settings_are_told_apart() {
        let none = Fake(BTreeMap::new());
        let base = Config::resolve(&BTreeMap::new(), &none, "python").unwrap();
        let renamed = Config::resolve(
            &map(&[
                ("name", "app"),
                ("role", "worker"),
                ("rank", "3"),
                ("model", "m"),
            ]),
            &none,
            "python",
        )
        .unwrap();
        assert!(base.same_settings(&renamed) && !base.same_identity(&renamed));
        let mut started = base.clone();
        (started.hold, started.autostarted) = (Duration::ZERO, true);
        assert!(base.same_settings(&started) && base.same_identity(&started));
        let slower = Config::resolve(&map(&[("interval_s", "5")]), &none, "python").unwrap();
        assert!(!base.same_settings(&slower) && base.same_identity(&slower));
        let elsewhere =
            Config::resolve(&map(&[("collector", "http://other:1")]), &none, "python").unwrap();
        assert!(!base.same_settings(&elsewhere));
    }

    #[test]
    fn bad_values_are_errors_that_name_the_setting() {
        let none = Fake(BTreeMap::new());
        let e = Config::resolve(&map(&[("interval_s", "fast")]), &none, "p").unwrap_err();
        assert!(e.contains("interval_s") && e.contains("fast"), "{e}");
        let e = Config::resolve(&map(&[("interval_s", "0")]), &none, "p").unwrap_err();
        assert!(
            e.contains("interval_s") && e.contains("at least 10 ms"),
            "{e}"
        );
        let e = Config::resolve(&map(&[("census_every", "-3")]), &none, "p").unwrap_err();
        assert!(e.contains("census_every"), "{e}");
        for bad in ["-5", "20", "low"] {
            let e = Config::resolve(&map(&[("thread_nice", bad)]), &none, "p").unwrap_err();
            assert!(e.contains("thread_nice") && e.contains(bad), "{e}");
        }
        let c = Config::resolve(&map(&[("thread_nice", "0")]), &none, "p").unwrap();
        assert_eq!(c.thread_nice, 0);
        let e = Config::resolve(&map(&[("census_auto", "maybe")]), &none, "p").unwrap_err();
        assert!(e.contains("census_auto") && e.contains("maybe"), "{e}");
        let c = Config::resolve(&map(&[("census_auto", "0")]), &none, "p").unwrap();
        assert!(!c.census_auto);
        let e = Config::resolve(&map(&[("census_trim", "yes")]), &none, "p").unwrap_err();
        assert!(e.contains("census_trim") && e.contains("yes"), "{e}");
        let c = Config::resolve(&map(&[("census_trim", "false")]), &none, "p").unwrap();
        assert!(!c.census_trim && c.census_auto);
        for key in ["buffer_max_bytes", "spool_max_bytes"] {
            let e = Config::resolve(&map(&[(key, "16M")]), &none, "p").unwrap_err();
            assert!(e.contains(key) && e.contains("16M"), "{e}");
        }
        let e = Config::resolve(&map(&[("oom_wait_s", "nan")]), &none, "p").unwrap_err();
        assert!(e.contains("oom_wait_s"), "{e}");
        let e =
            Config::resolve(&map(&[("boundary_min_interval_s", "-1")]), &none, "p").unwrap_err();
        assert!(e.contains("boundary_min_interval_s"), "{e}");
        let c = Config::resolve(&map(&[("boundary_min_interval_s", "0")]), &none, "p").unwrap();
        assert_eq!(
            c.boundary_min_interval, MIN_BATCH_SPACING,
            "0 is raised to the cap of 20 messages a second"
        );
        let c = Config::resolve(&map(&[("boundary_min_interval_s", "5")]), &none, "p").unwrap();
        assert_eq!(c.boundary_min_interval, Duration::from_secs(5));
    }

    #[test]
    fn a_model_carries_its_revision_quantization_and_dtype() {
        let none = Fake(BTreeMap::new());
        let c = Config::resolve(
            &map(&[
                ("model", "llama"),
                ("revision", "abc"),
                ("dtype", "bfloat16"),
            ]),
            &none,
            "p",
        )
        .unwrap();
        assert_eq!(
            c.model,
            Some(ModelSpec {
                name: "llama".into(),
                revision: "abc".into(),
                quantization: "".into(),
                dtype: "bfloat16".into()
            })
        );
    }
}
