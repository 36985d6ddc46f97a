//! The instance's other processes (#28): a worker that leaks while the
//! cgroup sits at its limit (page cache fills it, so the cgroup's series
//! shows no growth) is named as the leak, ahead of the limit, when the
//! kernel's kill took it; its agent's own growth is the incident's cause,
//! without a runway for a process that is dead; a flat worker is no cause.

mod common;

use common::*;
use oomscope_analysis::pb::{self, event::Kind};
use oomscope_analysis::{diagnose, Evidence};

const API_PID: u32 = CHILD_PID;
const WORKER_PID: u32 = 4243;
const OWN: &str = "/oomtest/child";
const STEPS_PER_SAMPLE: u64 = 5;

/// The worker's kill under a 2.5 GiB cgroup; the API server exits 0 after.
fn killed_worker_with_tree(worker_per_step: u64) -> Evidence {
    let limit = 5 * GIB / 2;
    let level = |usage: u64| v2(OWN, limit, usage, usage, V2Events::default());
    let before = counters(T0 - 60 * SEC, vec![level(2 * GIB)], system(3, 12 * GIB));
    let after = counters(
        T0 + 3 * SEC,
        vec![v2(
            OWN,
            limit,
            380 * MIB,
            limit,
            V2Events {
                max: 40,
                oom: 1,
                oom_kill: 1,
                local_oom: 1,
                local_oom_kill: 1,
            },
        )],
        system(3, 12 * GIB),
    );
    let mut e = supervised(
        exit(Some(0), None, "", before, after, None),
        "kernel_oom_kill",
    );
    e.events.insert(
        0,
        pb::Event {
            time_ns: T0 + 2 * SEC,
            kind: Some(Kind::KernelOomKill(pb::KernelOomKill {
                pid: WORKER_PID,
                task: "VLLM::Worker".into(),
                constraint: "CONSTRAINT_MEMCG".into(),
                oom_memcg: OWN.into(),
                task_memcg: OWN.into(),
                anon_rss_bytes: 2 * GIB,
                memcg_usage_bytes: limit,
                memcg_limit_bytes: limit,
                ..Default::default()
            })),
        },
    );
    e.incident.as_mut().unwrap().time_ns = T0 + 2 * SEC;
    // 40 readings over 40 s before the kill: the cgroup pinned near its
    // limit by page cache, the API server flat, the worker rising per step
    // with a little allocator noise.
    for i in 0..40u64 {
        let steps = (i + 1) * STEPS_PER_SAMPLE;
        let noise = (i * 7919 % 13) * 64 * 1024;
        let worker = 900 * MIB + steps * worker_per_step + noise;
        let mut s = sample(
            T0 - 40 * SEC + i as i64 * SEC,
            vec![level(limit - 2 * MIB)],
            system(3, 12 * GIB),
        );
        s.process = Some(pb::ProcessMemory {
            pid: API_PID,
            vm_rss_bytes: GIB,
            ..Default::default()
        });
        s.context = Some(pb::RequestContext {
            requests_done: i / 4,
            numbers: [("engine_steps".to_string(), steps as f64)].into(),
            ..Default::default()
        });
        s.tree = vec![
            pb::ProcessInfo {
                pid: API_PID,
                rss_bytes: GIB,
                title: "python3".into(),
                ..Default::default()
            },
            pb::ProcessInfo {
                pid: WORKER_PID,
                parent_pid: API_PID,
                rss_bytes: worker,
                title: "VLLM::Worker".into(),
                command: "python3 -m vllm serve".into(),
                ..Default::default()
            },
        ];
        e.samples.push(s);
    }
    e
}

#[test]
fn a_worker_that_grows_per_step_is_the_first_cause_of_its_kill() {
    let per_step = 3 * MIB;
    let d = diagnose(&killed_worker_with_tree(per_step));
    assert_eq!(d.domain.as_deref(), Some("cgroup"), "{:#?}", d.evidence);
    let first = &d.causes[0];
    assert_eq!(first.kind, "host_growth", "{:#?}", d.causes);
    let got = first.metrics["bytes_per_step"];
    assert!(
        (got - per_step as f64).abs() <= 0.2 * per_step as f64,
        "{got} bytes per step against {per_step} planted"
    );
    assert_eq!(first.metrics["member_pid"], f64::from(WORKER_PID));
    assert!(
        first.evidence[0].contains("VLLM::Worker (pid 4243)"),
        "{:#?}",
        first.evidence
    );
    assert!(first
        .evidence
        .iter()
        .any(|l| l.contains("the failure took this process")));
    assert!(
        first.evidence.iter().all(|l| !l.starts_with("runway:")),
        "a dead process has no runway: {:#?}",
        first.evidence
    );
    assert!(first.confidence > d.causes[1].confidence);
    assert!(
        d.causes.iter().any(|c| c.kind == "cgroup_limit"),
        "the limit is still named, after the growth: {:#?}",
        d.causes
    );
    assert_eq!(d.trigger.as_deref(), Some("repeated_requests"));
    assert!(
        d.evidence
            .iter()
            .any(|l| l.starts_with("trigger repeated_requests: process 4243")),
        "{:#?}",
        d.evidence
    );
}

#[test]
fn a_flat_worker_is_no_cause_and_the_limit_leads() {
    let d = diagnose(&killed_worker_with_tree(0));
    assert_eq!(d.causes[0].kind, "cgroup_limit", "{:#?}", d.causes);
    assert!(d.causes.iter().all(|c| c.kind != "host_growth"));
}

/// The worker's own agent: its RSS rose 2 MiB a request between requests.
fn worker_agent(per_request: u64) -> Evidence {
    let mut samples = Vec::new();
    for i in 0..40u64 {
        samples.push(pb::Sample {
            time_ns: T0 - 40 * SEC + i as i64 * SEC,
            process: Some(pb::ProcessMemory {
                pid: WORKER_PID,
                vm_rss_bytes: 900 * MIB + i * per_request + (i * 31 % 7) * 4096,
                ..Default::default()
            }),
            context: Some(pb::RequestContext {
                requests_done: i + 1,
                phase: "request_end".into(),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    Evidence {
        hello: Some(pb::Hello {
            agent_id: "worker-agent".into(),
            pid: WORKER_PID,
            role: "worker".into(),
            title: "VLLM::Worker".into(),
            // It loaded its model for a minute before serving: its warm-up
            // window (the first 30 s) ended before the first request.
            start_time_ns: T0 - 100 * SEC,
            ..Default::default()
        }),
        samples,
        ..Default::default()
    }
}

#[test]
fn the_victims_own_agent_names_its_growth_without_a_runway() {
    let mut e = killed_worker_with_tree(0);
    e.members.push(worker_agent(2 * MIB));
    let d = diagnose(&e);
    let first = &d.causes[0];
    assert_eq!(first.kind, "host_growth", "{:#?}", d.causes);
    assert_eq!(first.metrics["member_pid"], f64::from(WORKER_PID));
    let got = first.metrics["bytes_per_request"];
    assert!(
        (got - (2 * MIB) as f64).abs() <= 0.1 * (2 * MIB) as f64,
        "{got}"
    );
    assert!(
        first.evidence[0]
            .contains("the worker VLLM::Worker (pid 4243), the process the failure took")
            && first.evidence[0].contains("agent worker-agent"),
        "{:#?}",
        first.evidence
    );
    assert!(first.evidence.iter().all(|l| !l.starts_with("runway")));
    assert!(!first.metrics.contains_key("requests_to_limit"));

    // The same agent's growth where its process lives on: named, after the
    // kill's own cause, with its runway where its own evidence has one.
    let mut alive = killed_worker_with_tree(0);
    let mut other = worker_agent(2 * MIB);
    other.hello.as_mut().unwrap().pid = 5000;
    alive.members.push(other);
    let d = diagnose(&alive);
    assert_eq!(d.causes[0].kind, "cgroup_limit", "{:#?}", d.causes);
    let c = d
        .causes
        .iter()
        .find(|c| c.kind == "host_growth")
        .unwrap_or_else(|| panic!("{:#?}", d.causes));
    assert!(c
        .evidence
        .iter()
        .any(|l| l.contains("in the worker VLLM::Worker (pid 5000)")));
}

#[test]
fn a_process_that_has_ended_has_no_runway() {
    let live = diagnose(&worker_agent(2 * MIB));
    let c = &live.causes[0];
    assert_eq!(c.kind, "host_growth", "{:#?}", live.causes);
    assert!(
        c.evidence.iter().any(|l| l.starts_with("runway")),
        "{:#?}",
        c.evidence
    );

    let mut e = worker_agent(2 * MIB);
    e.ended = true;
    let d = diagnose(&e);
    let c = &d.causes[0];
    assert_eq!(c.kind, "host_growth");
    assert!(
        c.evidence.iter().all(|l| !l.starts_with("runway")),
        "{:#?}",
        c.evidence
    );
    assert!(d
        .evidence
        .iter()
        .any(|l| l == "the process has ended: its growth has no runway left"));
}

/// A member's agent whose own RSS is flat while its cgroup's usage rises
/// (another process of the instance grows): its verdict reads the shared
/// cgroup's growth, which is not this member's to carry.
#[test]
fn a_members_reading_of_the_shared_cgroup_is_not_its_growth() {
    let mut api = worker_agent(0);
    {
        let h = api.hello.as_mut().unwrap();
        h.pid = 5000;
        h.role = "api_server".into();
    }
    for (i, s) in api.samples.iter_mut().enumerate() {
        let usage = GIB + i as u64 * 48 * MIB;
        s.cgroup = vec![v2(OWN, 5 * GIB, usage, usage, V2Events::default())];
    }
    let own = diagnose(&api);
    let c = own
        .causes
        .iter()
        .find(|c| c.kind == "host_growth")
        .unwrap_or_else(|| {
            panic!(
                "its own verdict reads the cgroup's growth: {:#?}",
                own.causes
            )
        });
    assert_eq!(c.metrics["measured_on_cgroup_usage"], 1.0);

    let mut e = killed_worker_with_tree(3 * MIB);
    e.members.push(api);
    let d = diagnose(&e);
    let growth: Vec<f64> = d
        .causes
        .iter()
        .filter(|c| c.kind == "host_growth")
        .map(|c| c.metrics["member_pid"])
        .collect();
    assert_eq!(growth, [f64::from(WORKER_PID)], "{:#?}", d.causes);
}

/// The kernel takes the main process too, a few ms after the worker (the
/// worker's memory still charged): the main's end is its own kill, not the
/// worker death's consequence.
#[test]
fn a_main_process_the_kernel_killed_too_is_no_consequence() {
    let mut e = killed_worker_with_tree(0);
    // The worker's end as oomscope run read it, at the kill.
    e.events.push(pb::Event {
        time_ns: T0 + 2 * SEC,
        kind: Some(Kind::ChildExit(pb::ChildExit {
            pid: WORKER_PID,
            signal: Some(9),
            member: true,
            title: "VLLM::Worker".into(),
            ..Default::default()
        })),
    });
    let line = |e: &Evidence| {
        diagnose(e)
            .evidence
            .into_iter()
            .find(|l| l.starts_with("member pid 4243 (VLLM::Worker)"))
            .unwrap_or_else(|| panic!("no member line"))
    };
    assert!(line(&e).contains("exited with code 0: a consequence, not a clean stop"));
    // The main process killed by the kernel as well: its own record.
    let mut both = e.clone();
    for ev in &mut both.events {
        if let Some(Kind::ChildExit(x)) = &mut ev.kind {
            if !x.member {
                x.exit_code = None;
                x.signal = Some(9);
            }
        }
    }
    both.events.push(pb::Event {
        time_ns: T0 + 2 * SEC + 10_000_000,
        kind: Some(Kind::KernelOomKill(pb::KernelOomKill {
            pid: CHILD_PID,
            task: "python".into(),
            constraint: "CONSTRAINT_MEMCG".into(),
            ..Default::default()
        })),
    });
    let l = line(&both);
    assert!(l.contains("was OOM-killed by the kernel too"), "{l}");
    assert!(!l.contains("a consequence"), "{l}");
}

/// The worker's own agent counts no work (a vLLM worker's agent sees no
/// requests): its verdict is growth against time. The supervised tree reads
/// the same process against the instance's engine steps: that is the
/// verdict, per step, and the agent's rate is its support.
#[test]
fn a_members_growth_against_time_yields_to_the_trees_per_step_fit() {
    let per_step = 3 * MIB;
    let mut worker = worker_agent(0);
    for (i, s) in worker.samples.iter_mut().enumerate() {
        let steps = (i as u64 + 1) * STEPS_PER_SAMPLE;
        s.context = None;
        s.process.as_mut().unwrap().vm_rss_bytes = 900 * MIB + steps * per_step;
    }
    let own = diagnose(&worker);
    let c = own
        .causes
        .iter()
        .find(|c| c.kind == "host_growth")
        .unwrap_or_else(|| panic!("{:#?}", own.causes));
    let per_s = c.metrics["bytes_per_second"];
    assert!(
        per_s > 0.0,
        "its own verdict is against time: {:#?}",
        c.metrics
    );

    let mut e = killed_worker_with_tree(per_step);
    e.members.push(worker);
    let d = diagnose(&e);
    let first = &d.causes[0];
    assert_eq!(first.kind, "host_growth", "{:#?}", d.causes);
    assert_eq!(first.metrics["member_pid"], f64::from(WORKER_PID));
    let got = first.metrics["bytes_per_step"];
    assert!(
        (got - per_step as f64).abs() <= 0.2 * per_step as f64,
        "{got} bytes per step against {per_step} planted: {:#?}",
        first.metrics
    );
    assert!(!first.metrics.contains_key("bytes_per_second"));
    assert!(
        first
            .evidence
            .iter()
            .any(|l| l.contains("its own agent (agent worker-agent)") && l.ends_with("/s")),
        "{:#?}",
        first.evidence
    );
    assert_eq!(
        d.causes.iter().filter(|c| c.kind == "host_growth").count(),
        1,
        "one cause for one process: {:#?}",
        d.causes
    );
}
