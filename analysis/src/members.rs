//! The other processes of a multi-process server. A vLLM or a Python serving
//! framework holds most of its memory outside the process whose timeline
//! is read (an engine, a worker, a Manager), and the kernel kills whichever
//! of them it picks: a verdict read from the main process and the cgroup's
//! total alone misses a worker that leaks, since the cgroup sits at its
//! limit (page cache fills it) while only the worker grows.
//!
//! Two sources, both judged here and nowhere else:
//! - the supervised tree (`Sample.tree`, `oomscope run`'s reading of every
//!   process): each member's RSS fitted against the instance's work (engine
//!   steps where the runtime counts them, else completed requests) with the
//!   same trend test as the main process's;
//! - members with an in-process agent of their own (`Evidence::members`):
//!   their own verdicts' growth causes (a leak with its type and holder),
//!   which no other member's timeline holds.
//!
//! A member's growth outranks a limit when the failure took that member, and
//! a member that died has no runway: only a live process has time left.

use crate::causes::cause;
use crate::causes::host_growth::CGROUP_SERIES_METRIC;
use crate::evidence::Evidence;
use crate::findings::Findings;
use crate::growth::{self, Trend};
use crate::pb;
use crate::runtime_kind;
use crate::runway::{RUNWAY_PREFIX, RUNWAY_UNKNOWN};
use crate::time_growth::{self, PER_SECOND_METRIC};
use crate::units::bytes_short;
use oomscope_proto::CauseKind;

/// Causes a member's own timeline shows that the instance's main timeline
/// cannot: growth inside that process.
const MEMBER_GROWTH_KINDS: &[CauseKind] = &[
    CauseKind::Leak,
    CauseKind::HostGrowth,
    CauseKind::GcRetained,
];

/// A member's growth that the failure's own process explains: it died of it.
/// Above `cgroup_limit` (0.95 with the kernel record): the limit was where the growth ran out, the
/// growth is why.
pub const VICTIM_GROWTH_CONFIDENCE: f64 = 0.97;
/// A member's growth when another process failed, or nothing failed yet.
pub const MEMBER_GROWTH_CONFIDENCE: f64 = 0.75;

pub use crate::evidence::ENGINE_STEPS;

/// The pid the failure took: the kernel's victim, else a member's or the
/// child's end, else none.
fn victim_pid(f: &Findings) -> Option<u32> {
    if !f.failed {
        return None;
    }
    f.kernel
        .map(|(_, k)| k.pid)
        .or_else(|| f.exit.map(|(_, x)| x.pid))
}

/// The unit of work member growth is measured against, per sample.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Work {
    Steps,
    Requests,
}

impl Work {
    fn per(self) -> &'static str {
        match self {
            Work::Steps => "engine step",
            Work::Requests => "request",
        }
    }
    fn metric(self) -> &'static str {
        match self {
            Work::Steps => "bytes_per_step",
            Work::Requests => "bytes_per_request",
        }
    }
}

/// (work done, the sample) for the samples that say how much work was done:
/// engine steps where any sample counts them, else completed requests.
fn work_axis(e: &Evidence) -> Option<(Work, Vec<(f64, &pb::Sample)>)> {
    let steps = |s: &pb::Sample| {
        s.context
            .as_ref()
            .and_then(|c| c.numbers.get(ENGINE_STEPS).copied())
            .filter(|&n| n > 0.0)
    };
    let not_loading = |s: &&pb::Sample| {
        !s.context
            .as_ref()
            .is_some_and(|c| c.phase.starts_with("load"))
    };
    let axis = |work: Work, x: &dyn Fn(&pb::Sample) -> Option<f64>| {
        let pts: Vec<(f64, &pb::Sample)> = e
            .samples
            .iter()
            .filter(not_loading)
            .filter(|s| !s.tree.is_empty())
            .filter_map(|s| Some((x(s)?, s)))
            .collect();
        (pts.len() >= growth::MIN_TREND_POINTS).then_some((work, pts))
    };
    axis(Work::Steps, &steps).or_else(|| {
        axis(Work::Requests, &|s| {
            s.context
                .as_ref()
                .map(|c| c.requests_done as f64)
                .filter(|&n| n > 0.0)
        })
    })
}

/// One member's certain growth in the supervised tree.
struct TreeGrowth<'a> {
    process: &'a pb::ProcessInfo,
    trend: Trend,
    work: Work,
}

/// The members of the supervised tree whose RSS grows with the work, the
/// main process (the samples' own `process`) left out: its growth is
/// `host_growth`'s.
fn tree_growth(e: &Evidence) -> Vec<TreeGrowth<'_>> {
    let Some((work, pts)) = work_axis(e) else {
        return Vec::new();
    };
    let main: Vec<u32> = e
        .samples
        .iter()
        .filter_map(|s| s.process.as_ref().map(|p| p.pid))
        .collect();
    let mut pids: Vec<u32> = pts
        .iter()
        .flat_map(|(_, s)| s.tree.iter().map(|p| p.pid))
        .filter(|pid| !main.contains(pid))
        .collect();
    pids.sort_unstable();
    pids.dedup();
    let mut out = Vec::new();
    for pid in pids {
        let series: Vec<(f64, f64)> = pts
            .iter()
            .filter_map(|(x, s)| {
                let p = s.tree.iter().find(|p| p.pid == pid)?;
                (p.rss_bytes > 0).then_some((*x, p.rss_bytes as f64))
            })
            .collect();
        let Some(trend) = growth::trend(&series).filter(|t| t.host_certain()) else {
            continue;
        };
        let process = pts
            .iter()
            .rev()
            .find_map(|(_, s)| s.tree.iter().find(|p| p.pid == pid))
            .expect("the pid came from these samples");
        out.push(TreeGrowth {
            process,
            trend,
            work,
        });
    }
    out
}

/// The role a member's own agent announced for `pid`, if it has one.
fn role_of(e: &Evidence, pid: u32) -> Option<&str> {
    e.members
        .iter()
        .filter_map(|m| m.hello.as_ref())
        .find(|h| h.pid == pid && !h.role.is_empty())
        .map(|h| h.role.as_str())
}

fn who(title: &str, role: Option<&str>, pid: u32) -> String {
    match (role, title.is_empty()) {
        (Some(r), false) => format!("the {r} {title} (pid {pid})"),
        (Some(r), true) => format!("the {r} (pid {pid})"),
        (None, false) => format!("{title} (pid {pid})"),
        (None, true) => format!("pid {pid}"),
    }
}

/// The growth causes of the instance's other processes, most likely first:
/// each names its member, and the one the failure took outranks a limit.
/// `theirs` are the verdicts of the members with an agent of their own
/// (`Evidence::members`), each with its Hello.
pub fn causes(
    f: &Findings,
    own: &[pb::Cause],
    theirs: Vec<(&pb::Hello, pb::Diagnosis)>,
) -> Vec<pb::Cause> {
    let e = f.evidence;
    let victim = victim_pid(f);
    let tree = tree_growth(e);
    let mut out = Vec::new();
    // What members' own agents saw grow against time (they count no work
    // of theirs), where the tree reads the same process against the
    // instance's work: the work fit is the verdict, this its support.
    let mut over_time: Vec<(u32, String)> = Vec::new();
    // A member's rise against time while the instance died starting is its
    // loading (a worker filling its KV pool), not growth: the instance's
    // own cause (the reservation) explains it (`time_growth::died_starting`).
    let loading = time_growth::died_starting(f);
    // Members with an agent of their own: their verdicts' growth causes.
    for (hello, theirs) in theirs {
        let died = victim == Some(hello.pid);
        // A growth of the cgroup's usage is the instance's, whichever
        // member's agent read it: the main timeline judges it.
        for mut c in theirs.causes.into_iter().filter(|c| {
            MEMBER_GROWTH_KINDS.iter().any(|k| c.kind == *k)
                && !c.metrics.contains_key(CGROUP_SERIES_METRIC)
        }) {
            if loading && c.metrics.contains_key(PER_SECOND_METRIC) {
                continue;
            }
            if let Some(per_s) = c.metrics.get(PER_SECOND_METRIC) {
                if tree.iter().any(|g| g.process.pid == hello.pid) {
                    over_time.push((
                        hello.pid,
                        format!(
                            "its own agent (agent {}), which counts no work of its own, saw it grow {}/s",
                            hello.agent_id,
                            bytes_short(per_s.max(0.0).round() as u64)
                        ),
                    ));
                    continue;
                }
            }
            let name = who(&hello.title, Some(&hello.role), hello.pid);
            if died {
                strip_runway(&mut c);
                c.evidence.insert(
                    0,
                    format!(
                        "in {name}, the process the failure took: its own agent's evidence (agent {}); no runway, it already died",
                        hello.agent_id
                    ),
                );
                c.confidence = c.confidence.max(VICTIM_GROWTH_CONFIDENCE);
            } else {
                let at = usize::from(
                    c.evidence
                        .first()
                        .is_some_and(|l| l.starts_with(RUNWAY_PREFIX)),
                );
                c.evidence.insert(
                    at,
                    format!(
                        "in {name}: its own agent's evidence (agent {})",
                        hello.agent_id
                    ),
                );
            }
            c.metrics.insert("member_pid".into(), f64::from(hello.pid));
            out.push(c);
        }
    }
    // The supervised tree: members' RSS against the work, where no agent of
    // theirs already named the growth.
    for g in tree {
        let pid = g.process.pid;
        let named = out
            .iter()
            .any(|c| c.metrics.get("member_pid") == Some(&f64::from(pid)));
        if named {
            continue;
        }
        let died = victim == Some(pid);
        let name = who(&g.process.title, role_of(e, pid), pid);
        let t = &g.trend;
        let mut evidence = vec![format!(
            "{name}, a process of the instance, grew from {} to {} over {} {}s: {} per {} (Theil–Sen over {} readings of the supervised tree; Mann–Kendall p = {:.1e}; still rising in the later half)",
            bytes_short(t.first_bytes.max(0.0) as u64),
            bytes_short(t.last_bytes.max(0.0) as u64),
            t.span,
            g.work.per(),
            bytes_short(t.bytes_per_request().max(0.0).round() as u64),
            g.work.per(),
            t.points,
            t.p_value
        )];
        evidence.extend(
            over_time
                .iter()
                .filter(|(p, _)| *p == pid)
                .map(|(_, l)| l.clone()),
        );
        if died {
            evidence.push(
                "the failure took this process: its growth is why the limit was reached; no runway, it already died"
                    .to_string(),
            );
        }
        evidence.push(format!(
            "find what that process keeps ({}); a larger limit only delays the failure",
            runtime_kind::host_holder_hint(&runtime_kind::of(f.evidence))
        ));
        let mut c = cause(
            CauseKind::HostGrowth,
            if died {
                VICTIM_GROWTH_CONFIDENCE
            } else {
                MEMBER_GROWTH_CONFIDENCE
            },
            evidence,
            &[
                (g.work.metric(), t.bytes_per_request().round()),
                ("p_value", t.p_value),
                ("member_pid", f64::from(pid)),
            ],
        );
        c.processes.push(pb::CauseProcess {
            pid,
            bytes: g.process.rss_bytes,
            user: None,
            command: Some(g.process.command.clone()).filter(|c| !c.is_empty()),
        });
        out.push(c);
    }
    // A kind the main timeline already gives with more confidence stays its.
    out.retain(|c| {
        !own.iter()
            .any(|o| o.kind == c.kind && o.confidence >= c.confidence)
    });
    out
}

/// A cause of a process that has ended, without its runway: only a live
/// process has time left.
pub fn strip_runway(c: &mut pb::Cause) {
    c.evidence
        .retain(|l| !l.starts_with(RUNWAY_PREFIX) && l != RUNWAY_UNKNOWN);
    c.metrics.retain(|k, _| !is_runway_metric(k));
}

fn is_runway_metric(k: &str) -> bool {
    matches!(
        k,
        "requests_to_limit"
            | "limit_bytes"
            | "limit_share_per_request"
            | "requests_per_s"
            | "seconds_to_limit"
    )
}

/// The trigger line for a member's growth cause: growth over repeated work.
pub fn trigger_line(c: &pb::Cause) -> Option<String> {
    let (metric, per) = if let Some(b) = c.metrics.get("bytes_per_step") {
        (*b, "engine step")
    } else {
        (*c.metrics.get("bytes_per_request")?, "request")
    };
    c.metrics.get("member_pid").map(|pid| {
        format!(
            "process {} of the instance grew {} per {per} until the failure",
            *pid as u32,
            bytes_short(metric.max(0.0) as u64)
        )
    })
}
