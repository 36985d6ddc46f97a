//! The whole verdict for one incident.

use crate::capacity;
use crate::causes;
use crate::domain::decide;
use crate::evidence::Evidence;
use crate::failure;
use crate::findings::Findings;
use crate::fixes;
use crate::pb;
use crate::trigger;

/// Domain, trigger, exit, cgroup, evidence, causes, fixes and capacity for
/// one incident, or for one agent's timeline without one (a leak hunt: no
/// domain, but trigger and causes still apply).
pub fn diagnose(e: &Evidence) -> pb::Diagnosis {
    let f = Findings::gather(e);
    let mut verdict = decide(&f);
    let causes = causes::analyze(&f, &verdict);
    let trigger = trigger::decide(&f, &verdict);
    if let Some((t, line)) = &trigger {
        verdict
            .evidence
            .push(format!("trigger {}: {line}", t.as_str()));
    }
    let fixes = if verdict.failed || !causes.is_empty() {
        fixes::rank(&f, &verdict, &causes)
    } else {
        Vec::new()
    };
    let capacity_json = capacity::estimate(e, &f.timeline, f.failure.as_ref())
        .and_then(|c| serde_json::to_string(&c).ok())
        .unwrap_or_default();
    // The agent's name, as `incidents` and `--agent` use it; its id when it has none.
    let agent = e
        .hello
        .as_ref()
        .map(|h| h.name.clone())
        .filter(|n| !n.is_empty())
        .or_else(|| e.incident.as_ref().map(|i| i.agent.clone()))
        .filter(|a| !a.is_empty())
        .or_else(|| {
            e.hello
                .as_ref()
                .map(|h| h.agent_id.clone())
                .filter(|a| !a.is_empty())
        });
    pb::Diagnosis {
        incident: e
            .incident
            .as_ref()
            .map(|i| i.id.clone())
            .filter(|i| !i.is_empty()),
        agent,
        domain: verdict.failed.then(|| verdict.domain.as_str().to_string()),
        trigger: trigger.map(|(t, _)| t.as_str().to_string()),
        causes,
        fixes,
        capacity_json,
        evidence: verdict.evidence,
        exit: f.exit.map(|(_, x)| pb::ExitStatus {
            code: x.exit_code,
            signal: x.signal,
        }),
        cgroup: verdict.cgroup,
        failure: failure::of_incident(e),
        victim: None,
    }
}
