//! The supervisor's life: it starts the child, restarts it after a failure
//! (doubling backoff) until `--restart` is spent and reports the crash loop,
//! and says goodbye with the child's status.

use std::time::Duration;

use oomscope_agent_core::agent::{check_interval, SamplingLoop};
use oomscope_agent_core::pb;
use oomscope_agent_core::readers::kmsg::KmsgReader;
use oomscope_agent_core::readers::{HostPaths, HostReader};
use oomscope_agent_core::reporter::{Reporter, ReporterConfig};

use crate::child::{describe, run_once, Supervision};
use crate::config::RunConfig;
use crate::hello::{hello, KERNEL_LOG_LABEL};
use crate::limit::LimitCgroup;
use crate::members::{Members, MEMBER_EXITS_LABEL};
use crate::place::Placement;
use crate::shield::OomShield;
use crate::signals::{install_forwarding, stop_requested};

/// Runs the child (restarting it as configured) and returns the status to exit with.
pub fn run(cfg: RunConfig) -> anyhow::Result<i32> {
    let interval = check_interval(cfg.interval)?;
    let paths = HostPaths::system();
    // Made first and dropped last: `placement` goes back into it before it is removed.
    let _limit = match cfg.memory_limit_bytes {
        Some(bytes) => Some(LimitCgroup::create(&paths, bytes)?),
        None => None,
    };
    let me = HostReader::new(paths.clone(), std::process::id());
    // Read before the supervisor leaves its cgroup: the Hello's cgroup is the child's.
    let mut hello = hello(&cfg, &me);
    let placement = Placement::engage(&paths);
    hello.labels.insert(
        oomscope_analysis::SUPERVISOR_CGROUP_LABEL.to_string(),
        placement.description.clone(),
    );
    let shield = if placement.test_stay {
        OomShield::expose()
    } else {
        OomShield::engage()
    };
    // Opened before the first child: kills logged before are not ours.
    let mut kmsg = KmsgReader::open();
    if let Some(why) = kmsg.unavailable() {
        eprintln!(
            "oomscope: the kernel log is unreadable ({why}); OOM kills are inferred \
             without the kernel's record of them"
        );
    }
    let mut members = Members::open();
    hello
        .labels
        .insert(KERNEL_LOG_LABEL.to_string(), kmsg.describe());
    hello
        .labels
        .insert(MEMBER_EXITS_LABEL.to_string(), members.describe());
    let reporter = Reporter::start(
        ReporterConfig {
            collector_url: cfg.collector_url.clone(),
            spool_dir: cfg.spool_dir.clone(),
            ..ReporterConfig::default()
        },
        hello,
    );
    let agent_id = reporter.agent_id().to_string();
    let directives = reporter.directives();
    install_forwarding();
    // One loop for every restart: an interval the collector set stays set.
    let mut sampling = SamplingLoop::new(&reporter, directives.as_ref(), interval);

    let mut attempt = 0u32;
    let ending = loop {
        let last_try = attempt >= cfg.restart;
        let ctx = Supervision {
            cfg: &cfg,
            paths: &paths,
            reporter: &reporter,
            agent_id: &agent_id,
            child_oom_score_adj: shield.child_value(),
            child_cgroup: placement.child_cgroup_procs(),
        };
        let ending = run_once(
            &ctx,
            attempt,
            last_try,
            &mut sampling,
            &mut kmsg,
            &mut members,
        )?;
        if stop_requested() {
            // Someone asked the supervisor to stop: the child got the signal; no restart.
            break ending;
        }
        if ending.is_clean() || last_try {
            if !ending.is_clean() && cfg.restart > 0 {
                eprintln!(
                    "oomscope: crash loop: `{}` failed {} times in a row (last: {}); \
                     not restarting again. Run `oomscope diagnose` to see why.",
                    cfg.command.join(" "),
                    attempt + 1,
                    describe(ending)
                );
            }
            break ending;
        }
        let delay = backoff(cfg.backoff_initial, cfg.backoff_max, attempt);
        eprintln!(
            "oomscope: child {}; restart {}/{} in {:.1} s",
            describe(ending),
            attempt + 1,
            cfg.restart,
            delay.as_secs_f64()
        );
        std::thread::sleep(delay);
        if stop_requested() {
            // Asked to stop while waiting to restart: the child is already gone.
            break ending;
        }
        attempt += 1;
    };

    let goodbye = pb::Goodbye {
        reason: format!("child {}", describe(ending)),
        exit_code: ending.shell_status(),
    };
    if !reporter.shutdown(goodbye, cfg.flush_timeout) {
        eprintln!(
            "oomscope: the collector at {} did not ack everything within {:.1} s; \
             {}",
            cfg.collector_url,
            cfg.flush_timeout.as_secs_f64(),
            match &cfg.spool_dir {
                Some(d) => format!("the unsent evidence stays in the spool at {}", d.display()),
                None =>
                    "the unsent evidence is lost (pass --spool DIR to keep it on disk)".to_string(),
            }
        );
    }
    Ok(ending.shell_status())
}

/// Delay before restart `attempt + 1`: doubling, capped.
pub fn backoff(initial: Duration, max: Duration, attempt: u32) -> Duration {
    initial.saturating_mul(1u32 << attempt.min(20)).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let i = Duration::from_millis(100);
        let m = Duration::from_millis(1000);
        let d: Vec<_> = (0..6).map(|a| backoff(i, m, a).as_millis()).collect();
        assert_eq!(d, vec![100, 200, 400, 800, 1000, 1000]);
    }
}
