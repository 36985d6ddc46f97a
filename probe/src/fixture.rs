//! `oomscope.fixture/v1`: the request shapes that reproduce a failure, to
//! replay it against a server before and after a fix. Only sizes are kept,
//! never text: a replay sends distinct synthetic prompts sized to the same
//! token counts.
//!
//! ```json
//! {"schema": "oomscope.fixture/v1",
//!  "source": "probe concurrency step 8 x 256 tokens",
//!  "requests": [{"prompt_tokens": 256, "output_tokens": 16}, ...],
//!  "concurrency": 8,
//!  "repeats": 1}
//! ```
//! A replay sends `requests` in order, `concurrency` at a time (each group
//! a burst that starts together), and the whole list `repeats` times.
//!
//! A failure at start-up (a server killed while it reserved its KV cache,
//! before any request) reproduces at launch, not by a load: its fixture
//! carries `"at_start": "why"` (an optional field added within v1: a
//! reader of an older file gets None, and the shapes stay as they were), and
//! its `requests` are [`startup_load`], the small load a launch that starts
//! must then serve. The unchanged server reproduces it by dying while
//! starting; a fixed one must start, answer that load, and not be killed.
//! Pure: what to replay, from a probe report or a list of shapes.

use oomscope_proto::{CauseKind, TriggerKind};
use serde::{Deserialize, Serialize};

use crate::report::{ProbeReport, Step};

/// The fixture's schema name; a reader refuses any other.
pub const SCHEMA: &str = "oomscope.fixture/v1";

/// The most requests one fixture may send in all (requests x repeats): a
/// replay is a bounded reproduction, not a load test.
pub const MAX_REPLAY_REQUESTS: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub prompt_tokens: u64,
    pub output_tokens: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fixture {
    pub schema: String,
    /// Where the shapes came from (a probe step, an incident).
    pub source: String,
    /// In the order they are sent.
    pub requests: Vec<Request>,
    /// At most this many in flight at once.
    pub concurrency: usize,
    /// How many times the whole list is sent.
    pub repeats: usize,
    /// The failure reproduces at launch: why the unchanged server died
    /// while starting (the incident's verdict). None: the replay reproduces it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_start: Option<String>,
}

impl Fixture {
    /// Reads a fixture, refusing another schema and a shape that cannot be sent.
    pub fn parse(text: &str) -> Result<Fixture, String> {
        let f: Fixture =
            serde_json::from_str(text).map_err(|e| format!("not an {SCHEMA} fixture: {e}"))?;
        if f.schema != SCHEMA {
            return Err(format!(
                "schema {:?}; this oomscope reads {SCHEMA:?}",
                f.schema
            ));
        }
        if f.requests.is_empty() || f.concurrency == 0 || f.repeats == 0 {
            return Err("a fixture needs requests, a concurrency and repeats of at least 1".into());
        }
        if f.requests.len().saturating_mul(f.repeats) > MAX_REPLAY_REQUESTS {
            return Err(format!(
                "{} requests x {} repeats is over the {MAX_REPLAY_REQUESTS} a replay sends",
                f.requests.len(),
                f.repeats
            ));
        }
        Ok(f)
    }

    /// The groups a replay sends, in order: `concurrency` requests at a time.
    pub fn waves(&self) -> impl Iterator<Item = &[Request]> {
        (0..self.repeats).flat_map(move |_| self.requests.chunks(self.concurrency.max(1)))
    }
}

/// Output tokens per request of a fixture derived from an incident, whose
/// load counts prompt and generated tokens together: a short answer, as the
/// probe's own requests (16), so that nearly all of each request's share of
/// the tokens at the failure is its prompt.
pub const INCIDENT_OUTPUT_TOKENS: u64 = 16;

/// The fixture of an incident, from its load at the failure: as many
/// requests as it had sequences, at once, each holding an even share of its
/// active tokens (prompt plus [`INCIDENT_OUTPUT_TOKENS`]); with a
/// `repeated_requests` trigger, the list sent as many times as the
/// requests it served before. Err: why the incident gives no fixture.
pub fn from_failure(
    incident: &str,
    trigger: &str,
    f: &crate::pb::Failure,
) -> Result<Fixture, String> {
    let (Some(n), Some(tokens)) = (
        f.active_sequences.filter(|&n| n > 0),
        f.active_tokens.filter(|&t| t > 0),
    ) else {
        return Err(format!(
            "incident {incident} recorded no load at its failure (active sequences and tokens): no request shapes to replay"
        ));
    };
    let per = tokens.div_ceil(n);
    let output = INCIDENT_OUTPUT_TOKENS.min(per.saturating_sub(1)).max(1);
    let concurrency = usize::try_from(n).map_err(|e| e.to_string())?;
    let repeated = trigger.parse::<TriggerKind>().ok() == Some(TriggerKind::RepeatedRequests);
    let repeats = match (repeated, f.requests_done) {
        (true, Some(done)) if done > 0 => usize::try_from(done).map_err(|e| e.to_string())?,
        _ => 1,
    };
    let fx = Fixture {
        schema: SCHEMA.into(),
        source: format!(
            "incident {incident}: {tokens} active tokens in {n} sequences at the failure ({trigger})"
        ),
        requests: vec![
            Request {
                prompt_tokens: per.saturating_sub(output).max(1),
                output_tokens: output,
            };
            concurrency
        ],
        concurrency,
        repeats,
        at_start: None,
    };
    // The same bounds a reader applies.
    Fixture::parse(&serde_json::to_string(&fx).map_err(|e| e.to_string())?)
}

/// The load a start-up failure's fixture replays on a launch that starts:
/// a few requests at once, enough that the KV pool a fix leaves serves
/// concurrent sequences (a pool too small to hold them preempts or refuses,
/// which the replay sees), small enough for a CPU server to answer within
/// seconds and to fit any context a fix would set (a prompt of 256 tokens
/// plus its answer under a 1024-token `--max-model-len`).
pub const STARTUP_REQUESTS: usize = 4;
pub const STARTUP_PROMPT_TOKENS: u64 = 256;

/// The fixture of an incident that failed while starting, before any
/// request (`why`: the verdict's reading of it): the failure reproduces at
/// launch, and [`STARTUP_REQUESTS`] of [`STARTUP_PROMPT_TOKENS`] (plus
/// [`INCIDENT_OUTPUT_TOKENS`]) at once are what a fixed launch must serve.
pub fn startup_load(incident: &str, why: &str) -> Fixture {
    Fixture {
        schema: SCHEMA.into(),
        source: format!(
            "incident {incident}: failed while starting, before any request (reproduces at launch); {STARTUP_REQUESTS} requests of {STARTUP_PROMPT_TOKENS} tokens at once for a launch that starts"
        ),
        requests: vec![
            Request {
                prompt_tokens: STARTUP_PROMPT_TOKENS,
                output_tokens: INCIDENT_OUTPUT_TOKENS,
            };
            STARTUP_REQUESTS
        ],
        concurrency: STARTUP_REQUESTS,
        repeats: 1,
        at_start: Some(why.to_string()),
    }
}

/// Why an incident failed while starting, before any request, where its
/// diagnosis says so: its leading cause is a reservation that did not fit
/// at start (`kv_reservation`) or a start-up failure (`startup_failure`),
/// and its failure counted no request done and none running. That cause's
/// first evidence line is the reason; None for a failure under load.
pub fn startup_reason(d: &crate::pb::Diagnosis) -> Option<String> {
    let f = d.failure.clone().unwrap_or_default();
    if f.requests_done.unwrap_or(0) > 0 || f.active_sequences.unwrap_or(0) > 0 {
        return None;
    }
    let lead = d.causes.first()?;
    let at_start = matches!(
        lead.kind.parse(),
        Ok(CauseKind::KvReservation | CauseKind::StartupFailure)
    );
    at_start.then(|| {
        lead.evidence
            .first()
            .cloned()
            .unwrap_or_else(|| lead.kind.clone())
    })
}

/// The suites whose steps are request shapes at a size and a concurrency.
const SHAPED_SUITES: [&str; 4] = [
    "long-context",
    "concurrency",
    "concurrency-at-max-context",
    "repeated",
];

/// Whether a step failed on the server's side (an error, a death, no
/// answer); a clean refusal (429/503) or a rejected size is the server
/// handling its limits, not the failure to reproduce.
pub fn step_failed(s: &Step) -> bool {
    s.server_errors + s.unreachable + s.timeouts > 0
}

/// The fixture for the first step of `r` that failed, with `output_tokens`
/// per request (what the probe asked for); None when no shaped step failed.
pub fn from_report(r: &ProbeReport, output_tokens: u64) -> Option<Fixture> {
    r.suites
        .iter()
        .filter(|s| SHAPED_SUITES.contains(&s.suite.as_str()))
        .find_map(|s| {
            let st = s.steps.iter().find(|st| step_failed(st))?;
            let tokens = st.context_tokens.or(st.prompt_tokens)?;
            let concurrency = st.concurrency.max(1);
            Some(Fixture {
                schema: SCHEMA.into(),
                source: format!("probe {} step {}", s.suite, st.label),
                requests: vec![
                    Request {
                        prompt_tokens: tokens,
                        output_tokens,
                    };
                    concurrency
                ],
                concurrency,
                repeats: (st.calls / concurrency).max(1),
                at_start: None,
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{Status, SuiteReport};

    fn suite(name: &str, steps: Vec<Step>) -> SuiteReport {
        SuiteReport {
            suite: name.into(),
            status: Status::Fail,
            verdict: String::new(),
            reason: None,
            steps,
            findings: serde_json::json!({}),
            duration_s: 0.0,
            budget_s: None,
        }
    }

    fn step(conc: usize, tokens: u64, errors: usize) -> Step {
        Step {
            label: format!("{conc} x {tokens} tokens"),
            context_tokens: Some(tokens),
            concurrency: conc,
            calls: conc,
            server_errors: errors,
            ..Default::default()
        }
    }

    #[test]
    fn the_first_failed_step_becomes_the_fixture() {
        let mut r: ProbeReport = serde_json::from_value(serde_json::json!({
            "schema": "x", "endpoint": "e", "model": null, "agent": null, "started_ns": 0,
            "duration_s": 0.0, "settings": {}, "verdict": "unsafe", "suites": [], "envelope": null,
            "warnings": []
        }))
        .unwrap();
        r.suites = vec![
            suite("smoke", vec![step(1, 8, 0)]),
            suite(
                "concurrency",
                vec![step(1, 256, 0), step(2, 256, 0), step(4, 256, 3)],
            ),
        ];
        let f = from_report(&r, 16).unwrap();
        assert_eq!(f.concurrency, 4);
        assert_eq!(f.repeats, 1);
        assert_eq!(f.requests.len(), 4);
        assert!(f
            .requests
            .iter()
            .all(|q| q.prompt_tokens == 256 && q.output_tokens == 16));
        assert_eq!(f.source, "probe concurrency step 4 x 256 tokens");
        // Round trip through its text.
        let again = Fixture::parse(&serde_json::to_string(&f).unwrap()).unwrap();
        assert_eq!(again, f);
        // Nothing failed on the server's side: no fixture.
        r.suites[1].steps[2].server_errors = 0;
        r.suites[1].steps[2].refused = 4;
        assert!(from_report(&r, 16).is_none());
    }

    #[test]
    fn an_incident_load_becomes_its_share_of_tokens_per_sequence() {
        let f = crate::pb::Failure {
            active_sequences: Some(4),
            active_tokens: Some(14848),
            requests_done: Some(7),
            ..Default::default()
        };
        let fx = from_failure("inc-1", "concurrency_dependent", &f).unwrap();
        assert_eq!((fx.concurrency, fx.repeats, fx.requests.len()), (4, 1, 4));
        let total: u64 = fx
            .requests
            .iter()
            .map(|q| q.prompt_tokens + q.output_tokens)
            .sum();
        assert_eq!(total, 14848);
        assert_eq!(fx.requests[0].output_tokens, INCIDENT_OUTPUT_TOKENS);
        // A leak's requests are repeated as often as it served them.
        let leak = from_failure("inc-2", "repeated_requests", &f).unwrap();
        assert_eq!(leak.repeats, 7);
        // No load recorded: no shapes, and it says so.
        let none = crate::pb::Failure::default();
        assert!(from_failure("inc-3", "", &none)
            .unwrap_err()
            .contains("no load"));
    }

    #[test]
    fn a_start_up_failure_reproduces_at_launch_with_a_small_default_load() {
        let fx = startup_load(
            "inc-4",
            "the kernel killed VLLM::Worker while vLLM was starting",
        );
        assert_eq!(
            fx.at_start.as_deref(),
            Some("the kernel killed VLLM::Worker while vLLM was starting")
        );
        assert_eq!((fx.concurrency, fx.repeats), (STARTUP_REQUESTS, 1));
        assert!(fx
            .requests
            .iter()
            .all(|q| q.prompt_tokens == STARTUP_PROMPT_TOKENS
                && q.output_tokens == INCIDENT_OUTPUT_TOKENS));
        // Written and read back as v1, the field kept...
        let text = serde_json::to_string(&fx).unwrap();
        assert!(text.contains("\"at_start\""), "{text}");
        assert_eq!(Fixture::parse(&text).unwrap(), fx);
        // ...and a v1 file without it (an older writer's) is a replay fixture.
        let old = serde_json::json!({"schema": SCHEMA, "source": "", "concurrency": 1, "repeats": 1,
            "requests": [{"prompt_tokens": 8, "output_tokens": 2}]});
        assert_eq!(Fixture::parse(&old.to_string()).unwrap().at_start, None);
        // A replay fixture writes no such field.
        let replay = from_failure(
            "inc-5",
            "",
            &crate::pb::Failure {
                active_sequences: Some(2),
                active_tokens: Some(100),
                ..Default::default()
            },
        )
        .unwrap();
        assert!(!serde_json::to_string(&replay).unwrap().contains("at_start"));
    }

    #[test]
    fn a_start_up_reservation_or_failure_is_read_as_failing_at_start() {
        let cause = |kind: &str| crate::pb::Cause {
            kind: kind.into(),
            evidence: vec![format!("{kind}: the first line")],
            ..Default::default()
        };
        let d = |kinds: &[&str], failure: crate::pb::Failure| crate::pb::Diagnosis {
            causes: kinds.iter().map(|k| cause(k)).collect(),
            failure: Some(failure),
            ..Default::default()
        };
        let none = crate::pb::Failure::default();
        assert_eq!(
            startup_reason(&d(&["kv_reservation", "cgroup_limit"], none.clone())).as_deref(),
            Some("kv_reservation: the first line")
        );
        assert!(startup_reason(&d(&["startup_failure"], none.clone())).is_some());
        // Another lead, or a failure that had served, is no start-up failure.
        assert!(startup_reason(&d(&["host_growth", "kv_reservation"], none.clone())).is_none());
        let served = crate::pb::Failure {
            requests_done: Some(3),
            ..Default::default()
        };
        assert!(startup_reason(&d(&["kv_reservation"], served)).is_none());
        assert!(startup_reason(&d(&[], none)).is_none());
    }

    #[test]
    fn a_fixture_is_sent_in_waves_of_its_concurrency_repeats_times() {
        let q = |t| Request {
            prompt_tokens: t,
            output_tokens: 4,
        };
        let f = Fixture {
            schema: SCHEMA.into(),
            source: String::new(),
            requests: vec![q(1), q(2), q(3)],
            concurrency: 2,
            repeats: 2,
            at_start: None,
        };
        let waves: Vec<Vec<u64>> = f
            .waves()
            .map(|w| w.iter().map(|r| r.prompt_tokens).collect())
            .collect();
        assert_eq!(waves, vec![vec![1, 2], vec![3], vec![1, 2], vec![3]]);
    }

    #[test]
    fn another_schema_or_an_unbounded_fixture_is_refused() {
        let text = |schema: &str, n: usize, repeats: usize| {
            serde_json::json!({"schema": schema, "source": "", "concurrency": 1, "repeats": repeats,
                "requests": vec![serde_json::json!({"prompt_tokens": 1, "output_tokens": 1}); n]})
            .to_string()
        };
        assert!(Fixture::parse(&text(SCHEMA, 2, 3)).is_ok());
        assert!(Fixture::parse(&text("oomscope.fixture/v0", 2, 3))
            .unwrap_err()
            .contains("schema"));
        assert!(Fixture::parse(&text(SCHEMA, 0, 1)).is_err());
        assert!(Fixture::parse(&text(SCHEMA, 2, MAX_REPLAY_REQUESTS))
            .unwrap_err()
            .contains("over"));
    }
}
