//! `oomscope node`: every memory cgroup of a host watched from outside,
//! without wrapping anything. Each cgroup gets its own agent stream (a
//! timeline of its memory: usage, limit, anon/file/shmem, swap); an OOM kill
//! in it becomes an incident whose evidence is the kernel's own record (read
//! by the same [`KmsgReader`] as `oomscope run`), or, where the kernel's log
//! cannot be read, the cgroup's kill counter, saying so.
//!
//! Only increments are incidents: the counters of cgroups there at the start
//! are the baseline, the kernel's log is read from its end, and a cgroup
//! that appears later counts from zero. The watcher shields itself from the
//! OOM killer as the supervisor does, starts nothing and signals nothing.
//!
//! One role per file: where the cgroups are (`discover`), what each is
//! (`identity`), which kills are a level's own (`oom_count`), one cgroup's
//! stream (`watched`); the loop is here.

mod descriptors;
mod discover;
mod gpus;
mod identity;
mod oom_count;
mod watched;

pub use descriptors::{cgroups_within, DESCRIPTORS_PER_CGROUP, RESERVED_DESCRIPTORS};
pub use discover::{path_under, Found, Hierarchy, Listings};
pub use identity::{identify, ContainerIdentity};
pub use watched::{CGROUP_CAP_LABEL, CGROUP_PATH_LABEL};

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use oomscope_agent_core::agent::check_interval;
use oomscope_agent_core::pb;
use oomscope_agent_core::readers::gpu::GpuReader;
use oomscope_agent_core::readers::kmsg::KmsgReader;

use crate::hello::KERNEL_LOG_LABEL;
use crate::shield::OomShield;
use crate::signals::{install_forwarding, stop_requested};
use oom_count::{increase, kills, own_increase};
use watched::Watched;

/// How often each cgroup is sampled. 1 s: a container's memory changes over
/// seconds, and 200 cgroups at this rate stay a small share of one core
/// (BENCHMARKS.md).
pub const DEFAULT_NODE_INTERVAL: Duration = Duration::from_secs(1);
/// Watched cgroups at most: each has its own stream; a node runs a few
/// hundred containers, and past the cap the upper levels are kept. Each
/// holds [`DESCRIPTORS_PER_CGROUP`] open files: 512 need an open-file limit
/// of about 4,700, which the usual hard limit allows (the soft one is raised
/// to it at the start).
pub const DEFAULT_MAX_CGROUPS: usize = 512;
/// How often the kernel's log is read: a kill's record is in the timeline
/// well within the 2 s the issue asks of an incident.
const KMSG_POLL: Duration = Duration::from_millis(100);
/// The counters are read at least this often, whatever the sampling
/// interval, so that a kill seen only by them is an incident within 2 s.
const MAX_COUNT_DELAY: Duration = Duration::from_secs(1);
/// How often the cgroup tree is walked for new cgroups (a kernel record
/// naming an unknown cgroup walks it at once): walking a few hundred
/// directories each sweep cost more than reading them.
const DISCOVERY_PERIOD: Duration = Duration::from_secs(2);
/// Samples between whole readings of a cgroup's files (limits, peak, the
/// stat breakdown, swap, PSI): 10 s at the default interval. The usage and
/// the OOM counters are read at every sweep.
pub const FULL_READ_EVERY: u64 = 10;
/// How long a counted kill waits for its kernel record before it is
/// reported from the counter alone. The kernel counts the kill just before
/// it logs "Killed process", so the record normally follows within one
/// read of the log (100 ms); a loaded host can delay the watcher itself,
/// and a record after a counted kill would be a second incident. 1 s keeps
/// a counted kill within the 2 s the issue allows when the counter is read
/// within 1 s of the kill.
const KERNEL_RECORD_WAIT: Duration = Duration::from_secs(1);
/// Test only: holds each kernel record read for this many milliseconds
/// before it is routed, as a loaded host delays the watcher, so that a
/// test can make a real kill's record come after its counted kill was
/// reported. Never set it in production.
pub const TEST_KMSG_DELAY_ENV: &str = "OOMSCOPE_TEST_KMSG_DELAY_MS";
/// The longest wait, at the end, for each stream's collector to ack.
pub const DEFAULT_NODE_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// What `oomscope node` is told.
pub struct NodeConfig {
    pub collector_url: String,
    /// "/sys/fs/cgroup", or a subtree of a memory hierarchy.
    pub cgroup_root: PathBuf,
    pub interval: Duration,
    pub max_cgroups: usize,
    /// The kernel's log ("/dev/kmsg").
    pub kmsg_path: String,
    pub flush_timeout: Duration,
}

/// Watches until a stop signal; returns the exit status.
pub fn watch(cfg: NodeConfig) -> anyhow::Result<i32> {
    let interval = check_interval(cfg.interval)?;
    let hierarchy = Hierarchy::find(&cfg.cgroup_root).ok_or_else(|| {
        anyhow::anyhow!(
            "no memory cgroup controller at {} (v1: a memory mount or one of its \
             cgroups; v2: a cgroup2 mount with the memory controller)",
            cfg.cgroup_root.display()
        )
    })?;
    // Before anything is opened: the cap is what the descriptors hold.
    let budget = descriptors::raise_to_hard();
    let short = budget.cgroups < cfg.max_cgroups;
    let cap = cfg.max_cgroups.min(budget.cgroups);
    let mut status = Vec::new();
    if short {
        let why = format!(
            "at most {cap} cgroups, not --max-cgroups {}: the open-file limit {} holds \
             {cap} at {DESCRIPTORS_PER_CGROUP} descriptors a cgroup ({RESERVED_DESCRIPTORS} kept \
             for the rest)",
            cfg.max_cgroups, budget.soft
        );
        eprintln!("oomscope: watching {why}; raise the hard open-file limit (ulimit -Hn, LimitNOFILE=) to watch more");
        status.push((CGROUP_CAP_LABEL, why));
    } else if let Some(from) = budget.raised_from {
        tracing::debug!("open-file limit raised from {from} to {}", budget.soft);
    }
    // Never the victim: it holds every container's evidence.
    let _shield = OomShield::engage_as("the node watcher", "");
    // From its end: kills logged before the start are not incidents.
    let mut kmsg = KmsgReader::open_path(&cfg.kmsg_path);
    if let Some(why) = kmsg.unavailable() {
        eprintln!(
            "oomscope: the kernel log is unreadable ({why}); OOM kills are recorded from \
             the cgroups' counters, without the kernel's record (victim pid, anon-rss)"
        );
    }
    let kernel_log = kmsg.describe();
    status.push((KERNEL_LOG_LABEL, kernel_log.clone()));
    // Absent (never an error) without a GPU, its driver or NVML.
    let gpu = GpuReader::open();
    install_forwarding();
    let mut node = Node {
        hierarchy,
        cfg: &cfg,
        cap,
        fd_capped: short,
        kernel_log,
        status,
        watched: HashMap::new(),
        listings: Listings::default(),
        finishing: Arc::new(AtomicUsize::new(0)),
        gpu,
        capped_said: false,
        next_discovery: Instant::now() + DISCOVERY_PERIOD,
        samples: 0,
    };
    node.discover(true);
    eprintln!(
        "oomscope: watching {} memory cgroup(s) under {} ({}), sampling every {:.1} s; {}",
        node.watched.len(),
        node.hierarchy.top.display(),
        node.hierarchy.version.as_str(),
        interval.as_secs_f64(),
        if node.gpu.is_present() {
            "GPU processes through NVML"
        } else {
            "no GPU seen through NVML"
        }
    );
    let check = interval.min(MAX_COUNT_DELAY);
    let mut next_check = Instant::now() + check;
    let mut next_sample = Instant::now();
    let delay = test_kmsg_delay();
    // Records read, each with when it is routed (at once but under the test hook).
    let mut held: std::collections::VecDeque<(Instant, pb::KernelOomKill)> = Default::default();
    while !stop_requested() {
        let now = Instant::now();
        held.extend(kmsg.read_new().into_iter().map(|k| (now + delay, k)));
        let due = held.iter().take_while(|(at, _)| *at <= now).count();
        if due > 0 {
            node.route_kills(held.drain(..due).map(|(_, k)| k).collect(), now);
        }
        if now >= next_sample || now >= next_check {
            let sample = now >= next_sample;
            node.sweep(sample, kmsg.unavailable().is_none(), now);
            next_check = now + check;
            if sample {
                next_sample = now + interval;
            }
        }
        for w in node.watched.values_mut() {
            w.report_unexplained(now, &node.kernel_log);
        }
        let wake = next_check.min(next_sample).min(now + KMSG_POLL);
        std::thread::sleep(wake.saturating_duration_since(Instant::now()));
    }
    node.finish();
    Ok(0)
}

struct Node<'a> {
    hierarchy: Hierarchy,
    cfg: &'a NodeConfig,
    /// Watched cgroups at most: `--max-cgroups`, or fewer where the
    /// open-file limit holds fewer (`fd_capped`).
    cap: usize,
    fd_capped: bool,
    kernel_log: String,
    /// The watcher's state on each stream's Hello (its labels).
    status: Vec<(&'static str, String)>,
    /// By cgroup path.
    watched: HashMap<String, Watched>,
    /// What the last discovery listed, for the next to reuse.
    listings: Listings,
    /// Streams of removed cgroups still flushing, off the loop: their
    /// descriptors count against the cap until they end.
    finishing: Arc<AtomicUsize>,
    /// NVML: each sample carries its cgroup's GPU processes.
    gpu: GpuReader,
    capped_said: bool,
    next_discovery: Instant,
    /// Sample sweeps so far (every FULL_READ_EVERY-th reads whole).
    samples: u64,
}

impl Node<'_> {
    /// Starts streams for cgroups not watched yet; `at_start`: their
    /// counters are the baseline.
    fn discover(&mut self, at_start: bool) {
        let links: HashMap<PathBuf, u64> = self
            .watched
            .values()
            .filter_map(|w| Some((w.found.dir.clone(), w.links()?)))
            .collect();
        let room = self
            .cap
            .saturating_sub(self.finishing.load(Ordering::Relaxed));
        let (found, capped) = self
            .hierarchy
            .discover_with(room, &mut self.listings, &links);
        if capped && !self.capped_said {
            eprintln!(
                "oomscope: more than {room} memory cgroups under {}; watching the first {room} ({})",
                self.hierarchy.top.display(),
                if self.fd_capped {
                    "the open-file limit holds no more"
                } else {
                    "raise --max-cgroups"
                }
            );
            self.capped_said = true;
        }
        for f in found {
            if self.watched.contains_key(&f.path) || self.watched.len() >= room {
                continue;
            }
            let w = Watched::start(
                f.clone(),
                self.hierarchy.version,
                &self.cfg.collector_url,
                &self.status,
                at_start,
            );
            tracing::debug!("watching {} as {}", f.path, w.agent_id());
            self.watched.insert(f.path, w);
        }
    }

    /// The kernel's records, each to the cgroup of its victim. A record for
    /// a cgroup not watched yet (made and killed between two sweeps) is
    /// routed after a discovery; one outside the watched root is not ours.
    fn route_kills(&mut self, kills: Vec<pb::KernelOomKill>, now: Instant) {
        let mut discovered = false;
        for kill in kills {
            if self.find(&kill.task_memcg).is_none() && !discovered {
                self.discover(false);
                discovered = true;
            }
            match self.find(&kill.task_memcg) {
                Some(path) => {
                    let w = self.watched.get_mut(&path).expect("found");
                    w.kernel_kill(kill, now);
                }
                None => tracing::debug!(
                    "kernel OOM kill of pid {} in {} is outside the watched cgroups",
                    kill.pid,
                    kill.task_memcg
                ),
            }
        }
    }

    /// The watched cgroup the kernel's `memcg` names: the same path, else
    /// one that ends with it or that it ends with (a cgroup namespace
    /// shortens one side).
    fn find(&self, memcg: &str) -> Option<String> {
        if memcg.is_empty() {
            return None;
        }
        if self.watched.contains_key(memcg) {
            return Some(memcg.to_string());
        }
        self.watched
            .keys()
            .filter(|p| p.len() > 1 && (p.ends_with(memcg) || memcg.ends_with(p.as_str())))
            .max_by_key(|p| p.len())
            .cloned()
    }

    /// Reads every watched cgroup: new kills from the counters, and a
    /// sample on the timeline when `sample`; streams of cgroups gone end,
    /// and new cgroups are found.
    fn sweep(&mut self, sample: bool, kernel_readable: bool, now: Instant) {
        if now >= self.next_discovery {
            self.discover(false);
            self.next_discovery = now + DISCOVERY_PERIOD;
        }
        let mut readings = Vec::with_capacity(self.watched.len());
        let mut gone = Vec::new();
        // Every file on every sample cost 3.3 % of a core at 200 cgroups and
        // 1 s (7 v1 files each); the usage and the OOM counters are read
        // every sweep, the rest every FULL_READ_EVERY samples.
        let whole = sample && self.samples.is_multiple_of(FULL_READ_EVERY);
        if sample {
            self.samples += 1;
        }
        for (path, w) in self.watched.iter_mut() {
            match w.read(whole) {
                Some(level) => readings.push((path.clone(), level)),
                None => gone.push(path.clone()),
            }
        }
        // Each level's increase of the hierarchical count, for its parent.
        let mut child_increase: HashMap<String, u64> = HashMap::new();
        for (path, level) in &readings {
            let w = &self.watched[path];
            let d = increase(w.count.total, kills(level).total);
            if path != "/" {
                *child_increase.entry(parent(path)).or_default() += d;
            }
        }
        // One NVML reading a sample, split by each process's cgroup.
        let mut gpus = if sample && self.gpu.is_present() {
            let version = self.hierarchy.version;
            gpus::by_cgroup(&self.gpu.read(), |pid| gpus::memory_cgroup_of(pid, version))
        } else {
            HashMap::new()
        };
        let due = if kernel_readable {
            now + KERNEL_RECORD_WAIT
        } else {
            now
        };
        for (path, level) in readings {
            let w = self.watched.get_mut(&path).expect("read above");
            let count = kills(&level);
            let own = own_increase(
                w.count,
                count,
                child_increase.get(&path).copied().unwrap_or(0),
            );
            if own > 0 {
                w.counted(own, w.count.total, count.total, due, now);
            }
            w.count = count;
            if sample {
                w.send_sample(level, gpus.remove(&path).unwrap_or_default(), whole);
            }
        }
        for path in gone {
            if let Some(mut w) = self.watched.remove(&path) {
                // A kill counted just before it went still gets its incident.
                w.report_unexplained(now + KERNEL_RECORD_WAIT, &self.kernel_log);
                let timeout = self.cfg.flush_timeout;
                let finishing = self.finishing.clone();
                finishing.fetch_add(1, Ordering::Relaxed);
                // Off this loop: the collector may be slow to ack.
                std::thread::spawn(move || {
                    w.finish("cgroup removed", timeout);
                    finishing.fetch_sub(1, Ordering::Relaxed);
                });
            }
        }
    }

    /// Every stream's goodbye, flushed at once.
    fn finish(self) {
        let timeout = self.cfg.flush_timeout;
        let url = &self.cfg.collector_url;
        let unacked = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .watched
                .into_values()
                .map(|w| s.spawn(move || w.finish("oomscope node stopped", timeout)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(false))
                .filter(|acked| !acked)
                .count()
        });
        if unacked > 0 {
            eprintln!(
                "oomscope: {unacked} cgroup stream(s) were not acked by the collector at {url} \
                 within {:.1} s; their unsent evidence is lost",
                timeout.as_secs_f64()
            );
        }
    }
}

/// The test hook's delay ([`TEST_KMSG_DELAY_ENV`]); zero when unset.
fn test_kmsg_delay() -> Duration {
    std::env::var(TEST_KMSG_DELAY_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::ZERO, Duration::from_millis)
}

/// "/a/b" -> "/a", "/a" -> "/".
fn parent(path: &str) -> String {
    match path.trim_end_matches('/').rfind('/') {
        Some(0) | None => "/".to_string(),
        Some(i) => path[..i].to_string(),
    }
}
