//! Delivers what dead agents left in their spools.
//!
//! Agent ids are per process, so a process that dies (SIGKILL, the OOM
//! killer, a crash) leaves a spool that no later run of the same id will
//! ever resend: its unacked evidence, often the last seconds before the
//! death, would stay on disk for good. So every reporter with a spool also
//! watches the other spools under its root. A spool whose lock is free
//! belongs to a dead process; if it was writing to the same collector, this
//! thread resends it under the dead agent's own id and Hello (marked
//! `recovery`, so the collector does not take the agent for alive). Acked
//! segments go as usual; the directory stays with its small state file (the
//! seq high-water mark), so an agent that does come back with the same id
//! (a caller-chosen one) goes on above its old seqs instead of repeating
//! them, which the collector would drop as duplicates.
//! Nothing here touches the caller's threads or the live reporter's queue.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::pb;
use crate::reporter::{Liveness, Reporter, ReporterConfig};
use crate::spool::{Spool, SpoolError};

/// How often the spool root is scanned: a sibling process that dies while
/// this one runs has its evidence delivered within about this long.
pub const RESCAN_INTERVAL: Duration = Duration::from_secs(60);
/// How long one dead agent's spool may take to deliver before it is left
/// for the next scan (a slow or flapping collector).
pub const DELIVERY_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the thread looks at its reporter (stopped? connected?).
const POLL: Duration = Duration::from_millis(200);

/// What one pass over the spool root did, for logs and tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pass {
    /// Spools of dead agents resent and acked.
    pub delivered: Vec<String>,
    /// Spools with nothing left to send.
    pub settled: Vec<String>,
    /// Spools left in place: locked by a live process, written for another
    /// collector, without an origin to resend them as, or not delivered in
    /// time.
    pub left: Vec<String>,
}

impl Reporter {
    /// Starts the worker thread and returns at once, whether or not the
    /// collector is reachable. Opens the spool first (local disk only) so
    /// that seqs continue after the previous run's; a spool that cannot be
    /// opened is logged and the reporter runs memory-only.
    ///
    /// With a spool, it also delivers (in the background, once connected)
    /// what dead agents of the same collector left in other spools under
    /// the same root. That is why it is defined here and not with the rest
    /// of the reporter: this module uses reporters to deliver those spools,
    /// and the reporter knows nothing of it.
    pub fn start(cfg: ReporterConfig, hello: pb::Hello) -> Reporter {
        let reporter = Reporter::open(cfg.clone(), hello);
        if reporter.has_spool() {
            spawn(cfg, &reporter);
        }
        reporter
    }
}

/// Starts the watcher thread for `reporter`; it ends when the reporter does.
fn spawn(cfg: ReporterConfig, reporter: &Reporter) {
    let Some(root) = cfg.spool_dir.clone() else {
        return;
    };
    let own = reporter.agent_id().to_string();
    let live = reporter.liveness();
    let spawned = std::thread::Builder::new()
        .name("oomscope-recovery".into())
        .spawn(move || watch(&cfg, &root, &own, &live));
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "oomscope: cannot start the spool recovery thread; dead agents' spools stay on disk");
    }
}

fn watch(cfg: &ReporterConfig, root: &Path, own: &str, live: &Liveness) {
    loop {
        // Resending competes with nothing while the collector is down.
        while !live.connected() {
            if !sleep(live, POLL) {
                return;
            }
        }
        let pass = recover(cfg, root, own, &|| live.stopped());
        if !pass.delivered.is_empty() {
            tracing::info!(delivered = ?pass.delivered, "oomscope: delivered the spools of dead agents");
        }
        if !sleep(live, RESCAN_INTERVAL) {
            return;
        }
    }
}

/// Sleeps up to `d`; false when the reporter stopped meanwhile.
fn sleep(live: &Liveness, d: Duration) -> bool {
    let until = Instant::now() + d;
    while Instant::now() < until {
        if live.stopped() {
            return false;
        }
        std::thread::sleep(POLL.min(until.saturating_duration_since(Instant::now())));
    }
    !live.stopped()
}

/// One pass over the spools under `root` other than `own`'s. Public so a
/// tool (or a test) can run it once; `stop` is polled between steps.
pub fn recover(cfg: &ReporterConfig, root: &Path, own: &str, stop: &dyn Fn() -> bool) -> Pass {
    let mut pass = Pass::default();
    for id in Spool::recover(root) {
        if id == own {
            continue;
        }
        if stop() {
            break;
        }
        let outcome = match recover_one(cfg, root, &id, stop) {
            Ok(o) => o,
            Err(e) => {
                tracing::debug!(agent_id = id, error = %e, "oomscope: cannot recover a spool");
                Outcome::Left
            }
        };
        match outcome {
            Outcome::Delivered => pass.delivered.push(id),
            Outcome::Settled => pass.settled.push(id),
            Outcome::Left => pass.left.push(id),
        }
    }
    pass
}

enum Outcome {
    Delivered,
    Settled,
    Left,
}

fn recover_one(
    cfg: &ReporterConfig,
    root: &Path,
    id: &str,
    stop: &dyn Fn() -> bool,
) -> Result<Outcome, SpoolError> {
    let spool = match Spool::open(root, id, cfg.spool_max_bytes) {
        Ok(s) => s,
        // Its process is alive (or another reporter is delivering it).
        Err(SpoolError::Locked { .. }) => return Ok(Outcome::Left),
        Err(e) => return Err(e),
    };
    if spool.is_settled() {
        return Ok(Outcome::Settled);
    }
    let origin = match spool.origin() {
        Some(o) if o.collector_url == cfg.collector_url => o,
        // Another collector's evidence, or no Hello to send it as.
        _ => return Ok(Outcome::Left),
    };
    let mut hello = origin.hello;
    hello.recovery = true;
    let rcfg = ReporterConfig {
        spool_dir: Some(PathBuf::from(root)),
        ..cfg.clone()
    };
    let reporter = Reporter::launch(rcfg, hello, Some(spool), None);
    let deadline = Instant::now() + DELIVERY_TIMEOUT;
    let delivered = loop {
        if reporter.flush(POLL) {
            break true;
        }
        if stop() || Instant::now() >= deadline {
            break false;
        }
    };
    // Dropping the last handle stops the worker without a Goodbye (the
    // agent did not say one) and releases the spool.
    drop(reporter);
    Ok(if delivered {
        Outcome::Delivered
    } else {
        Outcome::Left
    })
}
