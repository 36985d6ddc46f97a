//! `oomscope report`: fetch one run (an incident, or an agent's timeline)
//! from the collector and write it as a self-contained HTML page or Markdown.
//! Also the fetch that `oomscope compare` shares.

use std::path::Path;

use anyhow::{bail, Context};
use oomscope_client::Client;
use oomscope_proto::v1 as pb;
use oomscope_report::Run;

/// Samples fetched for one run: the collector thins longer timelines evenly
/// and keeps every reply under the gRPC limit (their figures when whole
/// samples would not fit, see `collector/STORAGE.md`), which bounds the page
/// and the memory used; at a 250 ms interval this is over an hour of samples.
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
    let timeline = c
        .timeline(pb::TimelineRequest {
            agent: agent.clone(),
            from_ns: 0,
            to_ns: 0,
            max_points: MAX_POINTS,
        })
        .map_err(|e| match e.is_not_found() {
            true => anyhow::Error::new(e).context(format!("no incident or agent {agent:?}")),
            false => anyhow::Error::new(e).context(format!("fetching the timeline of {agent:?}")),
        })?;
    let agent_id = timeline
        .hello
        .as_ref()
        .map(|h| h.agent_id.clone())
        .unwrap_or(agent);
    // An agent named on its own stands for its latest incident, if it had one.
    let incident = match incident {
        Some(i) => Some(i),
        None => latest(
            c.incidents(pb::IncidentsRequest {
                agent: agent_id.clone(),
            })?
            .incidents,
        ),
    };
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
        (None, true) => crate::query::print_out(&oomscope_report::markdown(&input))?,
        (None, false) => bail!("choose a form: --html OUT.html or --md"),
    }
    Ok(0)
}

/// Writes `bytes` to `path` through a new temporary file in the same
/// directory, moved into place whole. Never through a symlink (one planted
/// in a shared directory must not aim a root-run report at another file):
/// without `force` an existing `path` of any kind is refused, and with it
/// the entry itself is replaced, never what a link points to.
fn write_page(path: &Path, bytes: &[u8], force: bool) -> anyhow::Result<()> {
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
