//! `oomscope report`: fetch one run (an incident, or an agent's timeline)
//! from the collector and write it as a self-contained HTML page or Markdown.
//! Also the fetch that `oomscope compare` shares.

use std::path::Path;

use anyhow::{bail, Context};
use oomscope_client::Client;
use oomscope_proto::v1 as pb;
use oomscope_report::Run;

/// Samples spread over a run's whole history, for the charts: the collector
/// thins longer timelines evenly by time.
pub const OVERVIEW_POINTS: u32 = 2_000;

/// The stretch before a run's end (its incident, else its newest sample)
/// read at full resolution, and as long after an incident: the failure, the
/// readings just before it and the load's edges.
pub const RECENT_WINDOW_NS: i64 = 10 * 60 * 1_000_000_000;

/// The most samples of that stretch fetched (at a 250 ms interval it holds
/// 2,400). The collector keeps every reply under the gRPC limit besides
/// (their figures when whole samples would not fit, see
/// `collector/STORAGE.md`), which bounds the page and the memory used.
pub const MAX_POINTS: u32 = 20_000;

/// What names a run on the command line.
pub enum Which {
    /// The latest incident of all.
    Latest,
    Incident(String),
    Agent(String),
    /// An incident id if one has it, else an agent id or name.
    IncidentOrAgent(String),
}

pub fn fetch(c: &mut Client, which: Which) -> anyhow::Result<Run> {
    let mut all = || -> anyhow::Result<Vec<pb::Incident>> {
        Ok(c.incidents(pb::IncidentsRequest::default())?.incidents)
    };
    let (incident, agent) = match which {
        Which::Latest => match latest(all()?) {
            Some(i) => (Some(i), None),
            None => bail!("no incidents recorded yet; name one, or an agent with --agent"),
        },
        Which::Incident(id) => match all()?.into_iter().find(|i| i.id == id) {
            Some(i) => (Some(i), None),
            None => bail!("no incident {id:?}; `oomscope incidents` lists them"),
        },
        Which::IncidentOrAgent(x) => match all()?.into_iter().find(|i| i.id == x) {
            Some(i) => (Some(i), None),
            None => (None, Some(x)),
        },
        Which::Agent(a) => (None, Some(a)),
    };
    let agent = match (&incident, agent) {
        (Some(i), _) => i.agent_id.clone(),
        (None, Some(a)) => a,
        (None, None) => unreachable!("every branch names an incident or an agent"),
    };
    let overview = c
        .timeline(pb::TimelineRequest {
            agent: agent.clone(),
            from_ns: 0,
            to_ns: 0,
            max_points: OVERVIEW_POINTS,
        })
        .map_err(|e| match e.is_not_found() {
            true => anyhow::Error::new(e).context(format!("no incident or agent {agent:?}")),
            false => anyhow::Error::new(e).context(format!("fetching the timeline of {agent:?}")),
        })?;
    let agent_id = overview
        .hello
        .as_ref()
        .map(|h| h.agent_id.clone())
        .unwrap_or(agent.clone());
    // An agent named on its own stands for its latest incident, if it had one.
    let incident = match incident {
        Some(i) => Some(i),
        None => latest(
            c.incidents(pb::IncidentsRequest {
                agent: agent_id.clone(),
                ..Default::default()
            })?
            .incidents,
        ),
    };
    let (from_ns, to_ns) = match (&incident, overview.samples.last()) {
        (Some(i), _) => (
            i.time_ns.saturating_sub(RECENT_WINDOW_NS),
            i.time_ns.saturating_add(RECENT_WINDOW_NS),
        ),
        (None, Some(s)) => (
            s.sample
                .as_ref()
                .map_or(0, |s| s.time_ns)
                .saturating_sub(RECENT_WINDOW_NS),
            0,
        ),
        (None, None) => (0, 0),
    };
    let recent = c
        .timeline(pb::TimelineRequest {
            agent: agent.clone(),
            from_ns: from_ns.max(1),
            to_ns,
            max_points: MAX_POINTS,
        })
        .with_context(|| format!("fetching the newest samples of {agent:?}"))?;
    let timeline = merge(overview, recent);
    let diagnosis = c.diagnose(pb::DiagnoseRequest {
        incident: incident.as_ref().map(|i| i.id.clone()).unwrap_or_default(),
        agent: if incident.is_some() {
            String::new()
        } else {
            agent_id
        },
        from_ns: 0,
        to_ns: 0,
    })?;
    Ok(Run {
        timeline,
        diagnosis,
        incident,
    })
}

/// One timeline of the overview's samples and the recent window's (each
/// once, oldest first), and both replies' events (each once).
fn merge(overview: pb::TimelineResponse, recent: pb::TimelineResponse) -> pb::TimelineResponse {
    let mut t = overview;
    // Within the recent window its own readings (and, if it was thinned,
    // its own envelopes) show the stretch: an overview point's envelope
    // there would draw minutes of range as one stroke among them.
    let time = |s: &pb::TimedSample| s.sample.as_ref().map(|s| s.time_ns);
    if let (Some(from), Some(to)) = (
        recent.samples.first().and_then(time),
        recent.samples.last().and_then(time),
    ) {
        for s in &mut t.samples {
            if time(s).is_some_and(|at| (from..=to).contains(&at)) {
                (s.low, s.high) = (None, None);
            }
        }
    }
    t.samples.extend(recent.samples);
    t.samples
        .sort_by_key(|s| (s.sample.as_ref().map_or(i64::MIN, |s| s.time_ns), s.seq));
    t.samples.dedup_by_key(|s| s.seq);
    t.events.extend(recent.events);
    t.events.sort_by(|a, b| {
        let key = |e: &pb::TimedEvent| (e.event.as_ref().map_or(i64::MIN, |e| e.time_ns), e.seq);
        key(a)
            .cmp(&key(b))
            .then_with(|| a.agent_id.cmp(&b.agent_id))
    });
    t.events
        .dedup_by(|a, b| a.seq == b.seq && a.agent_id == b.agent_id);
    t
}

fn latest(list: Vec<pb::Incident>) -> Option<pb::Incident> {
    list.into_iter().max_by_key(|i| i.time_ns)
}

pub fn run(
    url: &str,
    incident: Option<String>,
    agent: Option<String>,
    html_out: Option<&Path>,
    markdown: bool,
    force: bool,
) -> anyhow::Result<i32> {
    let which = match (incident, agent) {
        (Some(_), Some(_)) => bail!("name an incident or --agent, not both"),
        (Some(i), None) => Which::Incident(i),
        (None, Some(a)) => Which::Agent(a),
        (None, None) => Which::Latest,
    };
    let input = fetch(&mut Client::connect(url)?, which)?;
    match (html_out, markdown) {
        (Some(path), _) => {
            write_page(path, oomscope_report::html(&input).as_bytes(), force)
                .with_context(|| format!("cannot write the report to {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        (None, true) => crate::output::print_out(&oomscope_report::markdown(&input))?,
        (None, false) => bail!("choose a form: --html OUT.html or --md"),
    }
    Ok(0)
}

/// Writes `bytes` to `path` through a new temporary file in the same
/// directory, moved into place whole. Never through a symlink (one planted
/// in a shared directory must not aim a root-run report at another file):
/// without `force` an existing `path` of any kind is refused, and with it
/// the entry itself is replaced, never what a link points to.
pub(crate) fn write_page(path: &Path, bytes: &[u8], force: bool) -> anyhow::Result<()> {
    use std::io::Write;
    if !force {
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => bail!(
                "it is a symlink (to {}); oomscope does not write through links: name another \
                 path, or --force to replace the link itself",
                std::fs::read_link(path).map_or("?".into(), |t| t.display().to_string())
            ),
            Ok(_) => bail!("it exists; --force replaces it"),
            Err(_) => {}
        }
    }
    let name = path
        .file_name()
        .with_context(|| "the path names no file")?
        .to_string_lossy();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    // create_new: never opens an existing file or follows a link at this name.
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    let placed = file
        .write_all(bytes)
        .and_then(|()| file.sync_all())
        .and_then(|()| match force {
            true => std::fs::rename(&tmp, path),
            // A link fails if the name was taken since the check above.
            false => std::fs::hard_link(&tmp, path),
        });
    // Gone already after a rename; the spare name after a link or a failure.
    let _ = std::fs::remove_file(&tmp);
    placed.map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => anyhow::anyhow!("it exists; --force replaces it"),
        _ => e.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeline(samples: &[(u64, i64)], events: &[(u64, &str)]) -> pb::TimelineResponse {
        pb::TimelineResponse {
            samples: samples
                .iter()
                .map(|&(seq, time_ns)| pb::TimedSample {
                    seq,
                    sample: Some(pb::Sample {
                        time_ns,
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
            events: events
                .iter()
                .map(|&(seq, agent)| pb::TimedEvent {
                    seq,
                    event: Some(pb::Event {
                        time_ns: seq as i64 * 10,
                        kind: None,
                    }),
                    agent_id: agent.into(),
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn the_recent_window_fills_in_the_overview_once() {
        let overview = timeline(&[(1, 10), (50, 500), (100, 1000)], &[(7, ""), (60, "")]);
        let recent = timeline(
            &[(98, 980), (99, 990), (100, 1000)],
            &[(60, ""), (60, "w1")],
        );
        let t = merge(overview, recent);
        let seqs: Vec<u64> = t.samples.iter().map(|s| s.seq).collect();
        assert_eq!(seqs, [1, 50, 98, 99, 100]);
        let events: Vec<(u64, &str)> = t
            .events
            .iter()
            .map(|e| (e.seq, e.agent_id.as_str()))
            .collect();
        assert_eq!(
            events,
            [(7, ""), (60, ""), (60, "w1")],
            "one per sender and seq"
        );
    }

    #[test]
    fn overview_envelopes_stop_where_the_recent_window_starts() {
        let mut overview = timeline(&[(1, 10), (50, 500), (100, 1000)], &[]);
        for s in &mut overview.samples {
            s.low = s.sample.clone();
            s.high = s.sample.clone();
        }
        let recent = timeline(&[(60, 600), (100, 1000)], &[]);
        let t = merge(overview, recent);
        let enveloped: Vec<u64> = t
            .samples
            .iter()
            .filter(|s| s.high.is_some())
            .map(|s| s.seq)
            .collect();
        assert_eq!(enveloped, [1, 50], "seq 100 lies in the recent window");
    }
}
