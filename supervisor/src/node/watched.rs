//! One watched cgroup: its own agent stream (a stable identity, its
//! timeline), its OOM-kill counter, and the kills the kernel's log and the
//! counter each report, matched so that one kill is one incident.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use oomscope_agent_core::agent::agent_id;
use oomscope_agent_core::pb;
use oomscope_agent_core::readers::cgroup::{read_level_in, refresh_counters_in, LevelDir, Version};
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};
use oomscope_agent_core::{hostname, now_ns};

use super::discover::Found;
use super::identity::{identify, ContainerIdentity};
use super::oom_count::{kills, Count};
use crate::kill_event;

/// How long a kernel record read before the counter moved waits for it: the
/// kernel counts the kill and logs it within the same call, so a record the
/// counter never matches is stale after this.
const KERNEL_CREDIT_TTL: Duration = Duration::from_secs(5);
/// Kernel records held per cgroup awaiting the counter: a bound, not a figure.
const MAX_KERNEL_CREDITS: usize = 16;
/// Counted kills held per cgroup awaiting the kernel's record.
const MAX_UNEXPLAINED: usize = 16;
/// The Hello label naming the cgroup the stream watches.
pub const CGROUP_PATH_LABEL: &str = "container.cgroup";
/// The Hello label, on every stream, saying the open-file limit holds
/// fewer cgroups than `--max-cgroups` asks (absent when it does not).
pub const CGROUP_CAP_LABEL: &str = "node.cgroup_cap";

/// A counted kill whose kernel record has not come (yet).
struct Unexplained {
    /// When it is reported from the counter alone.
    due: Instant,
    before: u64,
    now: u64,
}

pub(super) struct Watched {
    pub found: Found,
    /// `found.dir` held open, with its counter files: its files are
    /// opened relative to it, the counters read in place.
    dir: LevelDir,
    pub version: Version,
    reporter: Reporter,
    /// The counters at the last reading.
    pub count: Count,
    /// The kernel records sent that the counter has not shown yet.
    kernel_credits: VecDeque<Instant>,
    unexplained: VecDeque<Unexplained>,
    last_level: pb::CgroupLevel,
    /// The last reading put on the timeline.
    last_sent: Option<pb::CgroupLevel>,
}

impl Watched {
    /// Starts the cgroup's stream. `baseline`: its counters as they are
    /// now are the start (a cgroup there when the watcher started); else
    /// it counts from zero (one that appeared since, whose kills all count).
    pub fn start(
        found: Found,
        version: Version,
        collector_url: &str,
        status: &[(&str, String)],
        baseline: bool,
    ) -> Watched {
        let dir = LevelDir::open(&found.dir, version);
        let level = read_level_in(&dir, &found.path, version);
        let identity = identify(&found.path);
        let count = if baseline {
            kills(&level)
        } else {
            Count {
                local: kills(&level).local.map(|_| 0),
                total: 0,
            }
        };
        let hello = hello(&found, &identity, &level, status);
        let reporter = Reporter::start(ReporterConfig::new(collector_url), hello);
        Watched {
            found,
            dir,
            version,
            reporter,
            count,
            kernel_credits: VecDeque::new(),
            unexplained: VecDeque::new(),
            last_level: level,
            last_sent: None,
        }
    }

    /// Its directory's link count (2 + its subdirectories), read from the
    /// directory held open: None when it is not held.
    pub fn links(&self) -> Option<u64> {
        self.dir.links()
    }

    pub fn agent_id(&self) -> &str {
        self.reporter.agent_id()
    }

    /// Reads the cgroup's files (all of them when `whole`, else the usage
    /// and the OOM counters over the last whole reading); None once it is
    /// gone.
    pub fn read(&mut self, whole: bool) -> Option<pb::CgroupLevel> {
        let mut level = self.read_files(whole);
        if level.partial {
            // Gone, or a new cgroup at the same path (the held directory is
            // the old one's): the path says which. Asked only then, not on
            // every sweep: a stat of the whole path per cgroup was a sixth
            // of a sweep's path walks.
            if !self.found.dir.exists() {
                return None;
            }
            self.dir = LevelDir::open(&self.found.dir, self.version);
            level = self.read_files(whole);
        }
        self.last_level = level.clone();
        Some(level)
    }

    fn read_files(&self, whole: bool) -> pb::CgroupLevel {
        match whole {
            true => read_level_in(&self.dir, &self.found.path, self.version),
            false => refresh_counters_in(&self.dir, &self.last_level, self.version),
        }
    }

    /// The memory reading on the cgroup's timeline, with the GPU devices
    /// where its processes run (only its processes listed). A reading equal
    /// to the last one sent, with no GPU process, is not sent unless
    /// `whole`: an idle cgroup's line is drawn from one point every whole
    /// reading, and the sweep's cost stays with the cgroups that move.
    pub fn send_sample(&mut self, level: pb::CgroupLevel, gpus: Vec<pb::GpuDevice>, whole: bool) {
        if !whole && gpus.is_empty() && self.last_sent.as_ref() == Some(&level) {
            return;
        }
        self.last_sent = Some(level.clone());
        self.reporter.send_sample(pb::Sample {
            time_ns: now_ns(),
            cgroup: vec![level],
            gpus,
            ..Default::default()
        });
    }

    /// The kernel's record of a kill of a task of this cgroup: the
    /// incident's evidence. A kill the counter already showed is explained.
    pub fn kernel_kill(&mut self, kill: pb::KernelOomKill, now: Instant) {
        self.reporter.send_event(kill_event(kill));
        if self.unexplained.pop_front().is_none() && self.kernel_credits.len() < MAX_KERNEL_CREDITS
        {
            self.kernel_credits.push_back(now);
        }
    }

    /// `own` new kills the counter shows (from `before` to `now`): those the
    /// kernel's log already reported are done; the rest wait until `due`
    /// for their record.
    pub fn counted(&mut self, own: u64, before: u64, now_count: u64, due: Instant, now: Instant) {
        while self
            .kernel_credits
            .front()
            .is_some_and(|t| now.duration_since(*t) > KERNEL_CREDIT_TTL)
        {
            self.kernel_credits.pop_front();
        }
        for _ in 0..own {
            if self.kernel_credits.pop_front().is_some() {
                continue;
            }
            if self.unexplained.len() < MAX_UNEXPLAINED {
                self.unexplained.push_back(Unexplained {
                    due,
                    before,
                    now: now_count,
                });
            }
        }
    }

    /// Counted kills whose record did not come in time, reported from the
    /// cgroup's files: no victim pid or figures, and the record says why.
    pub fn report_unexplained(&mut self, now: Instant, kernel_log: &str) {
        while self.unexplained.front().is_some_and(|u| u.due <= now) {
            let u = self.unexplained.pop_front().expect("front checked");
            let kill = counted_kill(
                &self.found.path,
                &self.last_level,
                u.before,
                u.now,
                kernel_log,
            );
            self.reporter.send_event(kill_event(kill));
        }
    }

    /// Ends the stream: the cgroup is gone, or the watcher stops.
    pub fn finish(self, reason: &str, timeout: Duration) -> bool {
        self.reporter.shutdown(
            pb::Goodbye {
                reason: reason.to_string(),
                exit_code: 0,
            },
            timeout,
        )
    }
}

/// A kill known only from the cgroup's counter: the cgroup at its limit (the
/// counter counts memcg kills), the victim unnamed, and a line saying where
/// it comes from and why the kernel's own record is missing.
fn counted_kill(
    path: &str,
    level: &pb::CgroupLevel,
    before: u64,
    now: u64,
    kernel_log: &str,
) -> pb::KernelOomKill {
    let file = match level.version.as_str() {
        "v1" => "memory.oom_control",
        _ => "memory.events",
    };
    pb::KernelOomKill {
        counted_only: true,
        constraint: "CONSTRAINT_MEMCG".into(),
        oom_memcg: path.to_string(),
        task_memcg: path.to_string(),
        memcg_limit_bytes: level.limit_bytes,
        lines: vec![format!(
            "{path} {file} oom_kill {before} -> {now}: counted by the cgroup; \
             the kernel's record of the kill was not read (kernel log {kernel_log})"
        )],
        ..Default::default()
    }
}

/// The cgroup's Hello: a stream per cgroup, named by what runs there, in an
/// instance that stays the same across the watcher's restarts (host and
/// cgroup path), so the collector keeps one timeline per container.
fn hello(
    found: &Found,
    identity: &ContainerIdentity,
    level: &pb::CgroupLevel,
    status: &[(&str, String)],
) -> pb::Hello {
    let host = hostname().unwrap_or_else(|| "localhost".into());
    let pid = std::process::id();
    let start = now_ns();
    let name = identity.name(&found.path);
    // Two cgroups may share a name (a leaf "app" under two parents): the id
    // carries a digest of the path too.
    let id_name = format!("{name}-{:08x}", fnv1a(found.path.as_bytes()) as u32);
    let mut labels: std::collections::HashMap<String, String> =
        identity.labels().into_iter().collect();
    labels.insert(CGROUP_PATH_LABEL.into(), found.path.clone());
    labels.extend(status.iter().map(|(k, v)| (k.to_string(), v.clone())));
    pb::Hello {
        agent_id: agent_id("node", &id_name, &host, pid, start),
        name,
        instance: format!("node:{host}:{}", found.path),
        host,
        pid,
        start_time_ns: start,
        role: oomscope_proto::Role::Other("container".into()).into(), // vocab: a container seen from outside
        runtime: "node".into(),                                       // vocab: the runtime's name
        versions: [(
            "oomscope".to_string(),
            env!("CARGO_PKG_VERSION").to_string(),
        )]
        .into_iter()
        .collect(),
        cgroup: Some(pb::CgroupInfo {
            version: level.version.clone(),
            path: found.path.clone(),
            limit_bytes: level.limit_bytes,
            limit_owner: if level.limit_bytes > 0 {
                found.path.clone()
            } else {
                String::new()
            },
        }),
        labels,
        ..Default::default()
    }
}

/// A stable 64-bit digest (FNV-1a): the same path gives the same id part
/// on every run and build, which std's hasher does not promise.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
