//! `QueryService`: what people and tools ask the collector. Thin: resolve the
//! agent, read the store on a blocking thread, hand evidence to the analysis.

use anyhow::Result;
use tonic::{Request, Response, Status};

use crate::pb;
use crate::pb::query_service_server::QueryService;
use crate::server::Collector;
use crate::store::Store;
use crate::verdict::{diagnose, incident_ref};

/// The most samples one diagnosis reads: at ~10 KB decoded per GPU sample
/// this bounds a query to ~200 MB however long the agent ran, and it is
/// still hours of 1 s samples, or thousands of requests' boundary samples,
/// more than any trigger or leak test needs.
pub const DIAGNOSE_MAX_SAMPLES: u32 = 20_000;

pub struct QueryApi {
    collector: Collector,
}

impl QueryApi {
    pub fn new(collector: Collector) -> QueryApi {
        QueryApi { collector }
    }

    async fn read<R, F>(&self, f: F) -> Result<R, Status>
    where
        F: FnOnce(&mut Store) -> Result<R, Status> + Send + 'static,
        R: Send + 'static,
    {
        // Two layers: the outer error is the store task's, the inner the query's.
        match self.collector.with_reader_store(move |s| Ok(f(s))).await {
            Ok(r) => r,
            Err(e) => Err(internal(e)),
        }
    }
}

#[tonic::async_trait]
impl QueryService for QueryApi {
    async fn list_agents(
        &self,
        _request: Request<pb::ListAgentsRequest>,
    ) -> Result<Response<pb::ListAgentsResponse>, Status> {
        let agents = self.read(|s| s.list_agents().map_err(internal)).await?;
        Ok(Response::new(pb::ListAgentsResponse { agents }))
    }

    async fn timeline(
        &self,
        request: Request<pb::TimelineRequest>,
    ) -> Result<Response<pb::TimelineResponse>, Status> {
        let req = request.into_inner();
        if req.agent.is_empty() {
            return Err(Status::invalid_argument("name an agent (its id or name)"));
        }
        let timeline = self
            .read(move |s| {
                let id = resolve(s, &req.agent)?;
                s.timeline(&id, req.from_ns, req.to_ns, req.max_points)
                    .map_err(internal)
            })
            .await?;
        Ok(Response::new(timeline))
    }

    async fn incidents(
        &self,
        request: Request<pb::IncidentsRequest>,
    ) -> Result<Response<pb::IncidentsResponse>, Status> {
        let agent = request.into_inner().agent;
        let incidents = self
            .read(move |s| {
                let id = if agent.is_empty() {
                    None
                } else {
                    Some(resolve(s, &agent)?)
                };
                s.incidents(id.as_deref()).map_err(internal)
            })
            .await?;
        Ok(Response::new(pb::IncidentsResponse { incidents }))
    }

    async fn diagnose(
        &self,
        request: Request<pb::DiagnoseRequest>,
    ) -> Result<Response<pb::Diagnosis>, Status> {
        let req = request.into_inner();
        let diagnosis = self.read(move |s| diagnose_request(s, &req)).await?;
        Ok(Response::new(diagnosis))
    }
}

/// Picks the evidence a DiagnoseRequest names and diagnoses it:
/// an incident id; else, with an agent and a range, that range of its
/// timeline, up to its latest incident when one falls inside the range; else
/// the latest incident (of the agent, when named); else, with an agent that
/// had no incident, its whole timeline (a leak hunt).
pub fn diagnose_request(store: &Store, req: &pb::DiagnoseRequest) -> Result<pb::Diagnosis, Status> {
    let agent = if req.agent.is_empty() {
        None
    } else {
        Some(resolve(store, &req.agent)?)
    };
    let incident = if !req.incident.is_empty() {
        let inc = store
            .incident(&req.incident)
            .map_err(internal)?
            .ok_or_else(|| {
                Status::not_found(format!(
                    "no incident {:?}; `oomscope incidents` lists them",
                    req.incident
                ))
            })?;
        Some(inc)
    } else if agent.is_some() && (req.from_ns != 0 || req.to_ns != 0) {
        // A range (`--since`): the agent's latest incident inside it, if any.
        let to = if req.to_ns == 0 { i64::MAX } else { req.to_ns };
        store
            .latest_incident(agent.as_deref())
            .map_err(internal)?
            .filter(|inc| (req.from_ns..=to).contains(&inc.time_ns))
    } else {
        match store.latest_incident(agent.as_deref()).map_err(internal)? {
            Some(inc) => Some(inc),
            None if agent.is_some() => None,
            None => {
                return Err(Status::not_found(
                    "no incidents recorded yet; name an agent to diagnose its timeline",
                ))
            }
        }
    };
    let (agent_id, from_ns, to_ns) = match &incident {
        // From the range's start where one was given, else from the beginning.
        Some(inc) if req.from_ns != 0 => (inc.agent_id.clone(), req.from_ns, inc.time_ns),
        Some(inc) => (inc.agent_id.clone(), i64::MIN, inc.time_ns),
        None => {
            let to = if req.to_ns == 0 { i64::MAX } else { req.to_ns };
            (agent.unwrap_or_default(), req.from_ns, to)
        }
    };
    // A week-long agent holds millions of samples; the analysis reads the
    // newest DIAGNOSE_MAX_SAMPLES of them (and the events in that span).
    let window_from = store
        .window_start(&agent_id, from_ns, to_ns, DIAGNOSE_MAX_SAMPLES)
        .map_err(internal)?;
    let history = store
        .history(&agent_id, window_from, to_ns)
        .map_err(internal)?;
    let mut diagnosis = diagnose(&history.into_evidence(incident.as_ref().map(incident_ref)))?;
    if window_from > from_ns {
        diagnosis.evidence.push(format!(
            "read the newest {DIAGNOSE_MAX_SAMPLES} samples, from {} (earlier ones are in `oomscope timeline`)",
            oomscope_analysis::units::time(window_from)
        ));
    }
    if diagnosis.agent.is_none() {
        diagnosis.agent = Some(agent_id);
    }
    if let Some(inc) = incident {
        diagnosis.incident = Some(inc.id);
    }
    Ok(diagnosis)
}

fn resolve(store: &Store, agent: &str) -> Result<String, Status> {
    store
        .resolve_agent(agent)
        .map_err(internal)?
        .ok_or_else(|| {
            Status::not_found(format!(
                "no agent with id or name {agent:?}; `oomscope agents` lists them"
            ))
        })
}

fn internal(e: anyhow::Error) -> Status {
    tracing::error!("query failed: {e:#}");
    Status::internal(format!("{e:#}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::agent_message::Body;

    /// An agent with `n` samples one second apart (time_ns 1 s, 2 s, ...).
    fn agent_with_samples(n: u64) -> Store {
        let mut store = Store::open_in_memory().unwrap();
        let hello = pb::Hello {
            agent_id: "a1".into(),
            name: "long-lived".into(),
            ..Default::default()
        };
        store.upsert_agent(&hello, 1).unwrap();
        let batch: Vec<pb::AgentMessage> = (1..=n)
            .map(|seq| pb::AgentMessage {
                seq,
                body: Some(Body::Sample(pb::Sample {
                    time_ns: seq as i64 * 1_000_000_000,
                    ..Default::default()
                })),
            })
            .collect();
        store.insert_batch("a1", &batch).unwrap();
        store
    }

    #[test]
    fn the_window_holds_the_newest_samples() {
        let store = agent_with_samples(10);
        let s = |n| store.window_start("a1", i64::MIN, i64::MAX, n).unwrap();
        assert_eq!(s(3), 8_000_000_000, "samples 8, 9, 10");
        assert_eq!(s(10), 1_000_000_000);
        assert_eq!(s(11), i64::MIN, "the range holds fewer: all of it");
        assert_eq!(
            store
                .window_start("a1", 9_500_000_000, i64::MAX, 3)
                .unwrap(),
            9_500_000_000,
            "never before the range asked for"
        );
        assert_eq!(
            store
                .window_start("a1", i64::MIN, 5_000_000_000, 2)
                .unwrap(),
            4_000_000_000,
            "the newest before the range's end"
        );
    }

    #[test]
    fn a_long_history_is_diagnosed_from_its_newest_samples_and_says_so() {
        let n = u64::from(DIAGNOSE_MAX_SAMPLES) + 500;
        let store = agent_with_samples(n);
        let req = pb::DiagnoseRequest {
            agent: "long-lived".into(),
            ..Default::default()
        };
        let d = diagnose_request(&store, &req).unwrap();
        let note = d
            .evidence
            .iter()
            .find(|l| l.starts_with("read the newest"))
            .unwrap_or_else(|| panic!("{:?}", d.evidence));
        assert!(note.contains(&DIAGNOSE_MAX_SAMPLES.to_string()), "{note}");
        assert!(
            note.contains("1970-01-01T00:08:21"),
            "sample 501 at 501 s: {note}"
        );

        let short = agent_with_samples(100);
        let d = diagnose_request(&short, &req).unwrap();
        assert!(d.evidence.iter().all(|l| !l.starts_with("read the newest")));
    }
}
