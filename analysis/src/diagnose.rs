//! The whole verdict for one incident.

use crate::causes;
use crate::domain::decide;
use crate::evidence::Evidence;
use crate::findings::Findings;
use crate::fixes;
use crate::pb;

/// Domain, exit, cgroup, evidence, causes and fixes for one incident.
///
/// `trigger` stays unset: telling immediate from size-, concurrency- or
/// repeat-dependent failures needs the allocator timeline analysis.
pub fn diagnose(e: &Evidence) -> pb::Diagnosis {
    let f = Findings::gather(e);
    let verdict = decide(&f);
    let causes = causes::analyze(&f, &verdict);
    let fixes = if verdict.failed {
        fixes::rank(&f, &verdict, &causes)
    } else {
        Vec::new()
    };
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
        trigger: None,
        causes: if verdict.failed { causes } else { Vec::new() },
        fixes,
        capacity_json: String::new(),
        evidence: verdict.evidence,
        exit: f.exit.map(|(_, x)| pb::ExitStatus {
            code: x.exit_code,
            signal: x.signal,
        }),
        cgroup: verdict.cgroup,
    }
}
