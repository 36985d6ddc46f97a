//! `QueryService`: what people and tools ask the collector. Thin: resolve the
//! agent or instance, read the store on a blocking thread, hand evidence to
//! the analysis.
//!
//! A name or an instance id means the whole instance (see
//! `store/instances.rs`): its main agent's samples, with the supervisor's
//! process tree joined to them, and every member's events and incidents.

use anyhow::Result;
use tonic::{Request, Response, Status};

use crate::ingest::Collector;
use crate::pb;
use crate::pb::query_service_server::QueryService;
use crate::store::{AgentFilter, IncidentFilter, Instance, Store, Target};
use crate::verdict::{diagnose, incident_ref};
use oomscope_analysis::join::{join_context, join_tree, TREE_JOIN_MAX_AGE_NS};
use oomscope_proto::{IncidentKind, Role};

/// The most samples one diagnosis reads, as their figures (the samples less
/// their `raw` allocator dicts, see `collector/STORAGE.md`): this bounds a
/// diagnosis's memory however long the agent ran, and it is still hours of
/// 1 s samples, or thousands of requests' boundary samples, more than any
/// trigger or leak test needs.
pub const DIAGNOSE_MAX_SAMPLES: u32 = 20_000;

/// The most samples of the history before that window the analysis reads,
/// thinned evenly in time: the start of a slow trend, at a tenth of the
/// window's cost.
pub const DIAGNOSE_OLDER_SAMPLES: u32 = 2_000;

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

/// Whom a timeline or a diagnosis is about (see [`QueryApi::read_about`]).
enum About {
    /// An agent id, or the newest agent of a name.
    Agent(String),
    /// An incident id.
    Incident(String),
    /// The latest incident's agent.
    Latest,
}

/// The most messages of one agent a query reads from a shared store into
/// its snapshot: the diagnosis's own bound ([`DIAGNOSE_MAX_SAMPLES`]), so a
/// query holds at most a few tens of MB however long the agent ran.
pub const MAX_SNAPSHOT_MESSAGES: u32 = DIAGNOSE_MAX_SAMPLES;

impl QueryApi {
    /// Runs `f` on this collector's own store; with a shared store of
    /// record, on a snapshot of the agent `about` names instead, built from
    /// what every collector stored (an empty store when nothing matches, so
    /// `f` answers "not found" as it does on its own store).
    async fn read_about<R, F>(&self, about: About, f: F) -> Result<R, Status>
    where
        F: FnOnce(&mut Store) -> Result<R, Status> + Send + 'static,
        R: Send + 'static,
    {
        self.read_about_with(about, MAX_SNAPSHOT_MESSAGES, DIAGNOSE_OLDER_SAMPLES, f)
            .await
    }

    /// [`QueryApi::read_about`] with a snapshot of at most `messages`
    /// messages and `older` samples before them per member (none for a
    /// question about incidents only).
    async fn read_about_with<R, F>(
        &self,
        about: About,
        messages: u32,
        older: u32,
        f: F,
    ) -> Result<R, Status>
    where
        F: FnOnce(&mut Store) -> Result<R, Status> + Send + 'static,
        R: Send + 'static,
    {
        let Some(shared) = self.collector.shared_store() else {
            return self.read(f).await;
        };
        let snapshot = shared_read(move || {
            let agent = match about {
                About::Agent(x) => member_named(&shared.list_agents()?, &x),
                About::Incident(id) => shared.incident_agent(&id)?,
                About::Latest => shared.incidents(None)?.pop().map(|i| i.agent_id),
            };
            let snapshot = match agent {
                Some(a) => shared.snapshot(&a, messages, older)?,
                None => None,
            };
            match snapshot {
                Some(s) => Ok(s),
                None => Store::open_in_memory(),
            }
        })
        .await?;
        match tokio::task::spawn_blocking(move || {
            let mut snapshot = snapshot;
            f(&mut snapshot)
        })
        .await
        {
            Ok(r) => r,
            Err(e) => Err(Status::internal(format!("a store task failed: {e}"))),
        }
    }
}

/// An agent of what `x` names among `agents` (see `Store::resolve`): the
/// agent of that id, else a member of the instance of that id, else a
/// member of the newest instance (the one whose first process started
/// last) with an agent of that name. Its instance's snapshot then resolves
/// `x` as the embedded store does.
fn member_named(agents: &[pb::AgentSummary], x: &str) -> Option<String> {
    let id = |a: &pb::AgentSummary| a.hello.as_ref().map(|h| h.agent_id.clone());
    if let Some(a) = agents
        .iter()
        .find(|a| a.hello.as_ref().is_some_and(|h| h.agent_id == x))
    {
        return id(a);
    }
    if let Some(a) = agents.iter().find(|a| a.instance == x) {
        return id(a);
    }
    let named: std::collections::BTreeSet<&str> = agents
        .iter()
        .filter(|a| a.hello.as_ref().is_some_and(|h| h.name == x))
        .map(|a| a.instance.as_str())
        .collect();
    let started = |instance: &str| {
        agents
            .iter()
            .filter(|a| a.instance == instance)
            .map(|a| a.first_seen_ns)
            .min()
    };
    let newest = named.into_iter().max_by_key(|i| started(i))?;
    agents.iter().find(|a| a.instance == newest).and_then(id)
}

#[tonic::async_trait]
impl QueryService for QueryApi {
    async fn list_agents(
        &self,
        request: Request<pb::ListAgentsRequest>,
    ) -> Result<Response<pb::ListAgentsResponse>, Status> {
        let filter = AgentFilter::from(request.get_ref());
        if let Some(shared) = self.collector.shared_store() {
            // The whole fleet from the store of record; each agent's latest
            // load where this collector serves (or served) its stream.
            let agents = shared_read(move || shared.agents_where(&filter)).await?;
            let agents = self
                .read(|s| latest_contexts(s, agents).map_err(internal))
                .await?;
            return Ok(Response::new(pb::ListAgentsResponse { agents }));
        }
        let agents = self
            .read(move |s| {
                s.agents_where(&filter)
                    .and_then(|a| latest_contexts(s, a))
                    .map_err(internal)
            })
            .await?;
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
            .read_about(About::Agent(req.agent.clone()), move |s| {
                let target = resolve(s, &req.agent)?;
                let mut t = s
                    .timeline(target.main_agent(), req.from_ns, req.to_ns, req.max_points)
                    .map_err(internal)?;
                if let Target::Instance(inst) = &target {
                    instance_view(s, inst, &mut t, req.from_ns, req.to_ns).map_err(internal)?;
                }
                Ok(t)
            })
            .await?;
        Ok(Response::new(timeline))
    }

    async fn incidents(
        &self,
        request: Request<pb::IncidentsRequest>,
    ) -> Result<Response<pb::IncidentsResponse>, Status> {
        let filter = IncidentFilter::from(request.get_ref());
        let agent = request.into_inner().agent;
        if let (Some(shared), true) = (self.collector.shared_store(), agent.is_empty()) {
            // Every collector's incidents, with their parts.
            let incidents = shared_read(move || {
                let mut roots = shared.incidents_where(None, &filter)?;
                let ids: Vec<String> = roots.iter().map(|i| i.id.clone()).collect();
                let mut parts: std::collections::HashMap<String, Vec<pb::Incident>> =
                    std::collections::HashMap::new();
                for (leader, part) in shared.parts_of(&ids)? {
                    parts.entry(leader).or_default().push(part);
                }
                for i in &mut roots {
                    i.parts = parts.remove(&i.id).unwrap_or_default();
                }
                Ok(roots)
            })
            .await?;
            return Ok(Response::new(pb::IncidentsResponse { incidents }));
        }
        // A shared store's: from a snapshot of the instance named, as the
        // embedded store answers.
        let about = About::Agent(agent.clone());
        let incidents = self
            .read_about_with(about, 0, 0, move |s| {
                let roots = if agent.is_empty() {
                    s.incidents_where(None, &filter)
                } else {
                    match resolve(s, &agent)? {
                        Target::Agent(a) => s.incidents_where(Some(&a), &filter),
                        Target::Instance(i) => instance_incidents(s, &i.id, &filter),
                    }
                };
                with_parts(s, roots.map_err(internal)?).map_err(internal)
            })
            .await?;
        Ok(Response::new(pb::IncidentsResponse { incidents }))
    }

    async fn diagnose(
        &self,
        request: Request<pb::DiagnoseRequest>,
    ) -> Result<Response<pb::Diagnosis>, Status> {
        let req = request.into_inner();
        let about = match (req.incident.is_empty(), req.agent.is_empty()) {
            (false, _) => About::Incident(req.incident.clone()),
            (true, false) => About::Agent(req.agent.clone()),
            (true, true) => About::Latest,
        };
        let diagnosis = self
            .read_about(about, move |s| diagnose_request(s, &req))
            .await?;
        Ok(Response::new(diagnosis))
    }
}

/// An instance's incidents that `filter` admits (gathered across its
/// members, so filtered here rather than in one query).
fn instance_incidents(
    s: &Store,
    instance: &str,
    filter: &IncidentFilter,
) -> Result<Vec<pb::Incident>> {
    let all = s.incidents_of_instance(instance, i64::MIN, i64::MAX)?;
    if filter == &IncidentFilter::default() {
        return Ok(all);
    }
    let on_host: std::collections::HashSet<String> = s
        .agents_where(&filter.agents())?
        .into_iter()
        .filter_map(|a| a.hello.map(|h| h.agent_id))
        .collect();
    Ok(all
        .into_iter()
        .filter(|i| filter.admits(i, |id| on_host.contains(id)))
        .collect())
}

/// Reads the shared store of record on a blocking thread.
async fn shared_read<R: Send + 'static>(
    f: impl FnOnce() -> Result<R> + Send + 'static,
) -> Result<R, Status> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(internal),
        Err(e) => Err(Status::internal(format!("a store task failed: {e}"))),
    }
}

/// Each agent's latest load: its newest sample's context (an index seek per
/// agent), unset when that sample carried none.
fn latest_contexts(
    store: &Store,
    mut agents: Vec<pb::AgentSummary>,
) -> Result<Vec<pb::AgentSummary>> {
    for a in &mut agents {
        let id = a
            .hello
            .as_ref()
            .map(|h| h.agent_id.as_str())
            .unwrap_or_default();
        a.context = store
            .sample_at(id, i64::MAX, i64::MAX)?
            .and_then(|s| s.context);
    }
    Ok(agents)
}

/// Picks the evidence a DiagnoseRequest names and diagnoses it:
/// an incident id; else, with an agent (or instance) and a range, that range
/// of its timeline, up to its latest incident when one falls inside the
/// range; else the latest incident (of the agent or instance, when named);
/// else, with an agent that had no incident, its main agent's whole
/// timeline (a leak hunt).
pub fn diagnose_request(store: &Store, req: &pb::DiagnoseRequest) -> Result<pb::Diagnosis, Status> {
    let target = if req.agent.is_empty() {
        None
    } else {
        Some(resolve(store, &req.agent)?)
    };
    let latest = |t: Option<&Target>| -> Result<Option<pb::Incident>, Status> {
        match t {
            None => store.latest_incident(None),
            Some(Target::Agent(a)) => store.latest_incident(Some(a)),
            Some(Target::Instance(i)) => store.latest_incident_of_instance(&i.id),
        }
        .map_err(internal)
    };
    let agent = target.as_ref().map(|t| t.main_agent().to_string());
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
        latest(target.as_ref())?.filter(|inc| (req.from_ns..=to).contains(&inc.time_ns))
    } else {
        match latest(target.as_ref())? {
            Some(inc) => Some(inc),
            None if agent.is_some() => None,
            None => {
                return Err(Status::not_found(
                    "no incidents recorded yet; name an agent to diagnose its timeline",
                ))
            }
        }
    };
    let end_of = |inc: &pb::Incident| incident_end(store, inc);
    let (agent_id, from_ns, to_ns) = match &incident {
        // From the range's start where one was given, else from the beginning.
        Some(inc) if req.from_ns != 0 => (inc.agent_id.clone(), req.from_ns, end_of(inc)?),
        Some(inc) => (inc.agent_id.clone(), i64::MIN, end_of(inc)?),
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
    let mut history = store
        .history(&agent_id, window_from, to_ns)
        .map_err(internal)?;
    // A leak hunt on an instance: its main agent's samples, with the
    // supervisor's process tree and the serving process's context joined.
    // An incident: the failed agent's samples with the serving context (a
    // server with no in-process agent has the probe's requests, if any).
    match (&incident, &target) {
        (None, Some(Target::Instance(inst))) => join_members(
            store,
            inst,
            &agent_id,
            &mut history.samples,
            window_from,
            to_ns,
        )
        .map_err(internal)?,
        (Some(_), _) => {
            let inst = match store.instance_of(&agent_id).map_err(internal)? {
                Some(id) => store.instance(&id).map_err(internal)?,
                None => None,
            };
            if let Some(inst) = inst {
                join_serving_context(
                    store,
                    &inst,
                    &agent_id,
                    &mut history.samples,
                    window_from,
                    to_ns,
                )
                .map_err(internal)?;
            }
        }
        _ => {}
    }
    // Before the window, the history summarized: its samples' figures
    // thinned evenly in time (none joined), so a slow trend has its start.
    let older = match window_from > from_ns {
        true => store
            .thinned_figures(&agent_id, from_ns, window_from - 1, DIAGNOSE_OLDER_SAMPLES)
            .map_err(internal)?,
        false => Vec::new(),
    };
    let older_note = older.first().and_then(|s| s.sample.as_ref()).map(|first| {
        format!(
            ", and {} earlier ones thinned evenly from {}",
            older.len(),
            oomscope_analysis::units::time(first.time_ns)
        )
    });
    history.samples.splice(0..0, older);
    let mut evidence = history.into_evidence(incident.as_ref().map(incident_ref));
    evidence.ended = matches!(
        store.state(&agent_id).map_err(internal)?.as_deref(),
        Some("lost")
    );
    // The instance's other processes with an agent of their own, for the
    // analysis to judge (a worker's leak is in no other timeline).
    let instance = match &target {
        Some(Target::Instance(inst)) if incident.is_none() => Some(inst.clone()),
        _ => match store.instance_of(&agent_id).map_err(internal)? {
            Some(id) => store.instance(&id).map_err(internal)?,
            None => None,
        },
    };
    if let Some(inst) = &instance {
        evidence.members = member_evidence(store, inst, &agent_id, from_ns, to_ns)?;
    }
    let mut diagnosis = diagnose(&evidence)?;
    if window_from > from_ns {
        diagnosis.evidence.push(format!(
            "read the newest {DIAGNOSE_MAX_SAMPLES} samples in full, from {}{} (every one is in `oomscope timeline`)",
            oomscope_analysis::units::time(window_from),
            older_note.unwrap_or_default()
        ));
    }
    if diagnosis.agent.is_none() {
        diagnosis.agent = Some(agent_id);
    }
    if let Some(inc) = incident {
        // An incident joined to another answers with its root's verdict.
        if !req.incident.is_empty() && req.incident != inc.id {
            diagnosis.evidence.insert(
                0,
                format!(
                    "{} is part of incident {} ({}): a consequence of the same failure, so this is {}'s verdict",
                    req.incident, inc.id, inc.kind, inc.id
                ),
            );
        }
        diagnosis.incident = Some(inc.id);
    }
    Ok(diagnosis)
}

/// Each incident with the incidents joined to it as its consequences.
fn with_parts(store: &Store, roots: Vec<pb::Incident>) -> Result<Vec<pb::Incident>> {
    roots
        .into_iter()
        .map(|mut i| {
            i.parts = store.merged_into(&i.id)?;
            Ok(i)
        })
        .collect()
}

/// Each other member of `inst` with an agent of its own (not the
/// supervisor, whose tree `main`'s samples carry), as its own evidence over
/// the same span: its newest [`DIAGNOSE_MAX_SAMPLES`]. A probe that drove
/// the instance is one too: the analysis reads its requests for the trigger
/// of a death during it, and judges no process of it.
fn member_evidence(
    store: &Store,
    inst: &Instance,
    main: &str,
    from_ns: i64,
    to_ns: i64,
) -> Result<Vec<oomscope_analysis::Evidence>, Status> {
    let mut out = Vec::new();
    for m in inst
        .members
        .iter()
        .filter(|m| m.agent_id != main && m.role != Role::Supervisor)
    {
        let from = store
            .window_start(&m.agent_id, from_ns, to_ns, DIAGNOSE_MAX_SAMPLES)
            .map_err(internal)?;
        let history = store.history(&m.agent_id, from, to_ns).map_err(internal)?;
        out.push(history.into_evidence(None));
    }
    Ok(out)
}

/// How long after the kernel's record of a kill (or a member's death) the
/// main process's end is still part of it: the death comes first, the exit
/// the supervisor reads follows.
pub const KILL_SETTLE_NS: i64 = 5_000_000_000;

/// Where the evidence of an incident ends: at its moment, or at the last of
/// the parts merged into it (a worker's lost stream, the server's exit), and
/// for a kernel kill a little after, to hold the end it caused.
fn incident_end(store: &Store, inc: &pb::Incident) -> Result<i64, Status> {
    let parts = store.merged_into(&inc.id).map_err(internal)?;
    let mut end = parts.iter().map(|p| p.time_ns).fold(inc.time_ns, i64::max);
    if matches!(
        inc.kind.parse(),
        Ok(IncidentKind::KernelOomKill | IncidentKind::MemberDied | IncidentKind::MemberFailed)
    ) {
        end = end.max(inc.time_ns.saturating_add(KILL_SETTLE_NS));
    }
    Ok(end)
}

/// An instance's timeline: `t` holds its main agent's samples and events;
/// this joins the supervisor's process tree to each sample (the instance's
/// host memory, summed over its processes) and adds every other member's
/// events (tagged with their agent) and the members themselves.
fn instance_view(
    store: &Store,
    inst: &Instance,
    t: &mut pb::TimelineResponse,
    from_ns: i64,
    to_ns: i64,
) -> anyhow::Result<()> {
    let to_ns = if to_ns == 0 { i64::MAX } else { to_ns };
    let main = inst.main().agent_id.clone();
    join_members(store, inst, &main, &mut t.samples, from_ns, to_ns)?;
    for m in inst.members.iter().filter(|m| m.agent_id != main) {
        let (events, cut_ns) = store.events_of(&m.agent_id, from_ns, to_ns)?;
        t.events.extend(events);
        t.events_cut_ns = t.events_cut_ns.max(cut_ns);
    }
    t.events
        .sort_by_key(|e| (e.event.as_ref().map_or(0, |e| e.time_ns), e.seq));
    let order = |id: &str| inst.members.iter().position(|m| m.agent_id == id);
    let mut members = store.agents_of_instance(&inst.id)?;
    // The main agent first, then the rest as they started.
    members.sort_by_key(|a| {
        let id = a.hello.as_ref().map_or("", |h| h.agent_id.as_str());
        (id != main, order(id))
    });
    t.members = members;
    Ok(())
}

/// Joins to the main agent's `samples` what other members see: the
/// supervisor's process tree, and the context of the process that serves
/// requests (a vLLM API server's KV and queue, through its plugin) where
/// the main agent has none.
fn join_members(
    store: &Store,
    inst: &Instance,
    main: &str,
    samples: &mut [pb::TimedSample],
    from_ns: i64,
    to_ns: i64,
) -> anyhow::Result<()> {
    if let Some(sup) = inst.supervisor().filter(|s| s.agent_id != main) {
        let tree = readings_for(store, &sup.agent_id, samples, from_ns, to_ns)?;
        join_tree(samples, &tree);
    }
    join_serving_context(store, inst, main, samples, from_ns, to_ns)
}

/// Joins to `main`'s samples the context of the member that serves
/// requests (a vLLM API server through its plugin), else of an `oomscope
/// probe` that drove the instance: the requests it sent are the only
/// workload a server with no in-process agent has.
fn join_serving_context(
    store: &Store,
    inst: &Instance,
    main: &str,
    samples: &mut [pb::TimedSample],
    from_ns: i64,
    to_ns: i64,
) -> anyhow::Result<()> {
    let others = || inst.members.iter().filter(|m| m.agent_id != main);
    let serving = others()
        .find(|m| m.role == Role::ApiServer || m.role == Role::Server)
        .or_else(|| others().find(|m| m.role == Role::Probe));
    if let Some(m) = serving {
        let theirs = readings_for(store, &m.agent_id, samples, from_ns, to_ns)?;
        join_context(samples, &theirs);
    }
    Ok(())
}

/// The readings of `agent_id` that `samples` (oldest first) can join: its
/// samples from [`TREE_JOIN_MAX_AGE_NS`] before the first to the last, in
/// one range read when they number at most [`JOIN_RANGE_FACTOR`] times
/// `samples`, else the latest before each (a thinned timeline of a long
/// history), so that the work follows what is shown, not the history.
fn readings_for(
    store: &Store,
    agent_id: &str,
    samples: &[pb::TimedSample],
    from_ns: i64,
    to_ns: i64,
) -> anyhow::Result<Vec<pb::TimedSample>> {
    let (Some(first), Some(last)) = (samples.first(), samples.last()) else {
        return Ok(Vec::new());
    };
    let from = time_of(first)
        .saturating_sub(TREE_JOIN_MAX_AGE_NS)
        .max(from_ns);
    let to = time_of(last).min(to_ns);
    let limit = samples.len().saturating_mul(JOIN_RANGE_FACTOR);
    if let Some(range) = store.history_samples(agent_id, from, to, limit)? {
        return Ok(range);
    }
    let mut out: Vec<pb::TimedSample> = Vec::new();
    for s in samples {
        let Some(reading) = store.sample_at(agent_id, time_of(s), TREE_JOIN_MAX_AGE_NS)? else {
            continue;
        };
        if out.last().and_then(|r| r.sample.as_ref()) != Some(&reading) {
            out.push(pb::TimedSample {
                seq: 0,
                sample: Some(reading),
                ..Default::default()
            });
        }
    }
    Ok(out)
}

/// See [`readings_for`]: a member sampling this many times more often than
/// the samples shown is read sample by sample instead.
pub const JOIN_RANGE_FACTOR: usize = 4;

fn time_of(s: &pb::TimedSample) -> i64 {
    s.sample.as_ref().map_or(i64::MIN, |s| s.time_ns)
}

fn resolve(store: &Store, agent: &str) -> Result<Target, Status> {
    store.resolve(agent).map_err(internal)?.ok_or_else(|| {
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
            note.contains("from 1970-01-01T00:08:21"),
            "sample 501 at 501 s: {note}"
        );
        assert!(
            note.contains("and 500 earlier ones thinned evenly from 1970-01-01T00:00:01"),
            "the 500 before it, from sample 1 at 1 s: {note}"
        );

        let short = agent_with_samples(100);
        let d = diagnose_request(&short, &req).unwrap();
        assert!(d.evidence.iter().all(|l| !l.starts_with("read the newest")));
    }
}
