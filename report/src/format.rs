//! Text renderings for people. `--json` is each message's serde form.

use std::fmt::Write;

use crate::pb;
use oomscope_analysis::Domain;

/// "64.00 MiB", "1.17 GiB", "512 B" and "2026-11-30 00:12:03.123Z" (UTC, to the
/// millisecond): the table renderings of the analysis crate's units.
pub use oomscope_analysis::units::{bytes_table as bytes, time_table as time};

/// One line per instance (a service's run, however many processes), its
/// processes indented under it, oldest first.
pub fn agents(agents: &[pb::AgentSummary]) -> String {
    let mut out = String::new();
    if agents.is_empty() {
        out.push_str("no agents yet\n");
        return out;
    }
    let _ = writeln!(
        out,
        "{:<40} {:<20} {:<12} {:>8} {:>8} {:>7}  last seen",
        "INSTANCE / AGENT", "NAME / ROLE", "STATE", "SAMPLES", "EVENTS", "PID"
    );
    let id_of = |a: &pb::AgentSummary| {
        a.hello
            .as_ref()
            .map_or(String::new(), |h| h.agent_id.clone())
    };
    let instance_of = |a: &pb::AgentSummary| {
        if a.instance.is_empty() {
            id_of(a)
        } else {
            a.instance.clone()
        }
    };
    let mut instances: Vec<String> = Vec::new();
    for a in agents {
        let i = instance_of(a);
        if !instances.contains(&i) {
            instances.push(i);
        }
    }
    for inst in instances {
        let members: Vec<&pb::AgentSummary> =
            agents.iter().filter(|a| instance_of(a) == inst).collect();
        let name = members[0].hello.as_ref().map_or("", |h| h.name.as_str());
        // The instance is up while any of its processes streams.
        let state = if members.iter().any(|a| a.state == "connected") {
            "connected"
        } else {
            members[0].state.as_str()
        };
        // The server's pid: the supervised child's, else the founding process's.
        let pid = members
            .iter()
            .filter_map(|a| a.hello.as_ref())
            .find(|h| h.role != oomscope_proto::Role::Supervisor)
            .map_or(0, |h| h.pid);
        let _ = writeln!(
            out,
            "{:<40} {:<20} {:<12} {:>8} {:>8} {:>7}  {}",
            terminal(&inst),
            terminal(name),
            state,
            members.iter().map(|a| a.samples).sum::<u64>(),
            members.iter().map(|a| a.events).sum::<u64>(),
            pid,
            time(members.iter().map(|a| a.last_seen_ns).max().unwrap_or(0))
        );
        if members.len() == 1 && id_of(members[0]) == inst {
            continue;
        }
        for a in members {
            let h = a.hello.clone().unwrap_or_default();
            let role = if h.title.is_empty() {
                h.role.clone()
            } else {
                format!("{} ({})", h.role, h.title)
            };
            let _ = writeln!(
                out,
                "  {:<38} {:<20} {:<12} {:>8} {:>8} {:>7}  {}",
                terminal(&h.agent_id),
                terminal(&role),
                state_of(a),
                a.samples,
                a.events,
                h.pid,
                time(a.last_seen_ns)
            );
        }
    }
    out
}

/// An agent's state; one that said Goodbye with a failing status shows it
/// ("exit 1"): a server that gave up after a worker died is no clean stop.
fn state_of(a: &pb::AgentSummary) -> String {
    match &a.goodbye {
        Some(g) if a.state == "disconnected" && g.exit_code != 0 => format!("exit {}", g.exit_code),
        _ => a.state.clone(),
    }
}

/// A whole rendering for a terminal: control characters other than its own
/// line breaks shown visibly, as [`terminal`] shows them. The CLI passes
/// every text it prints through it, behind the escaping of each
/// agent-supplied field here (which also shows their newlines).
pub fn terminal_text(s: &str) -> String {
    shown(s, |c| c != '\n' && c.is_control())
}

/// An agent-supplied string as a terminal should see it: control
/// characters (escapes, bells, newlines) shown visibly, never acted on.
pub fn terminal(s: &str) -> String {
    shown(s, char::is_control)
}

/// `s` with each character `hide` picks written as its escape. One pass
/// and one allocation: a 13 MB `timeline --json` goes through it.
fn shown(s: &str, hide: impl Fn(char) -> bool) -> String {
    let mut out = String::with_capacity(s.len());
    let mut plain = 0;
    for (i, c) in s.char_indices() {
        if hide(c) {
            out.push_str(&s[plain..i]);
            out.extend(c.escape_default());
            plain = i + c.len_utf8();
        }
    }
    out.push_str(&s[plain..]);
    out
}

pub fn incidents(list: &[pb::Incident]) -> String {
    let mut out = String::new();
    if list.is_empty() {
        out.push_str("no incidents\n");
        return out;
    }
    let _ = writeln!(
        out,
        "{:<15} {:<24} {:<20} {:<14} {:<14}  summary",
        "ID", "TIME", "AGENT", "KIND", "DOMAIN"
    );
    // Each root, and the consequences joined to it under it.
    let mut row = |prefix: &str, width: usize, i: &pb::Incident, domain: &str| {
        let _ = writeln!(
            out,
            "{prefix}{:<width$} {:<24} {:<20} {:<14} {:<14}  {}",
            terminal(&i.id),
            time(i.time_ns),
            terminal(&i.agent_name),
            terminal(&i.kind),
            terminal(domain),
            terminal(&i.summary)
        );
    };
    for i in list {
        row("", 15, i, if i.domain.is_empty() { "-" } else { &i.domain });
        for p in &i.parts {
            row("  +- ", 10, p, "(part)");
        }
    }
    out
}

fn event_label(e: &pb::Event) -> String {
    use pb::event::Kind;
    match &e.kind {
        Some(Kind::Phase(p)) => {
            format!("phase {} {}", p.name, if p.start { "start" } else { "end" })
        }
        Some(Kind::Gc(g)) => format!("gc gen{} collected {}", g.generation, g.collected),
        Some(Kind::CacheRelease(c)) => format!(
            "empty_cache {} -> {}",
            bytes(c.reserved_before_bytes),
            bytes(c.reserved_after_bytes)
        ),
        Some(Kind::Oom(o)) => format!(
            "OOM requesting {} on device {}",
            bytes(o.requested_bytes),
            o.device
        ),
        Some(Kind::ProcessList(p)) => format!(
            "process list ({} host, {} gpu)",
            p.host_top_rss.len(),
            p.gpu.len()
        ),
        Some(Kind::Snapshot(s)) => format!(
            "snapshot: {} segments, largest free block {}",
            s.segments,
            bytes(s.largest_free_block_bytes)
        ),
        Some(Kind::HeapCensus(h)) => format!("heap census: {} types", h.types.len()),
        Some(Kind::ChildStart(c)) => format!("child {} started: {}", c.pid, c.command.join(" ")),
        Some(Kind::ChildExit(c)) => {
            let who = match c.member {
                true => format!("member {} ({})", c.pid, terminal(&c.title)),
                false => format!("child {}", c.pid),
            };
            match (c.exit_code, c.signal) {
                (_, Some(s)) => format!("{who} killed by signal {s}"),
                (Some(code), _) => format!("{who} exited {code}"),
                _ => format!("{who} ended (status unknown: {})", c.status_from),
            }
        }
        Some(Kind::StopForwarded(s)) => {
            format!("oomscope run passed signal {} on: stopping", s.signal)
        }
        Some(Kind::Request(r)) => format!(
            "request {} {}",
            r.request_id,
            if r.start { "start" } else { "end" }
        ),
        Some(Kind::KernelOomKill(k)) => format!(
            "kernel OOM kill of {} ({}): anon-rss {} ({})",
            k.pid,
            k.task,
            bytes(k.anon_rss_bytes),
            k.constraint
        ),
        Some(Kind::KernelAllocFailure(a)) => format!(
            "kernel page allocation failure of {} ({}): order {}",
            a.pid, a.task, a.order
        ),
        None => "event".into(),
    }
}

pub fn timeline(t: &pb::TimelineResponse) -> String {
    let mut out = String::new();
    let h = t.hello.clone().unwrap_or_default();
    let _ = writeln!(
        out,
        "agent {} ({}) on {}, pid {}, runtime {}",
        terminal(&h.agent_id),
        terminal(&h.name),
        terminal(&h.host),
        h.pid,
        terminal(&h.runtime)
    );
    if t.events_cut_ns != 0 {
        let _ = writeln!(
            out,
            "(events before {} left out: over the reply's size; ask a shorter --since)",
            time(t.events_cut_ns)
        );
    }
    // Thinned points stand for a stretch each: show its peaks beside the reading.
    let thinned = t.samples.iter().any(|s| s.high.is_some());
    let serving = ServingColumns::of(&t.samples);
    let _ = write!(
        out,
        "{:<24} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11}",
        "TIME", "SEQ", "RSS", "CGROUP", "AVAILABLE", "GPU ALLOC", "GPU RESV"
    );
    serving.header(&mut out);
    let _ = writeln!(
        out,
        "{}",
        if thinned {
            "    RSS MAX  ALLOC MAX"
        } else {
            ""
        }
    );
    let mut events = event_rows(&t.events).into_iter().peekable();
    for s in &t.samples {
        let smp = s.sample.clone().unwrap_or_default();
        while let Some(e) = events.next_if(|e| e.time_ns <= smp.time_ns) {
            e.write(&mut out);
        }
        if let Some(d) = &smp.dropped_before {
            // The agent's memory bound during a collector outage (or its spool's).
            let _ = writeln!(
                out,
                "  ... the agent dropped {} samples and {} events here, unsent, with {} requests' ends ({} past its spool's bound; 1 in {} kept)",
                d.samples, d.events, d.requests, d.by_spool, d.stride
            );
        }
        let rss = smp
            .process
            .as_ref()
            .map(|p| bytes(p.vm_rss_bytes))
            .unwrap_or_else(|| "-".into());
        let cg = smp
            .cgroup
            .first()
            .map(|c| bytes(c.usage_bytes))
            .unwrap_or_else(|| "-".into());
        let avail = smp
            .system
            .as_ref()
            .map(|m| bytes(m.mem_available_bytes))
            .unwrap_or_else(|| "-".into());
        let (alloc, resv) = smp
            .allocator
            .first()
            .map(|a| (bytes(a.allocated_bytes), bytes(a.reserved_bytes)))
            .unwrap_or_else(|| ("-".into(), "-".into()));
        let _ = write!(
            out,
            "{:<24} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11}",
            time(smp.time_ns),
            s.seq,
            rss,
            cg,
            avail,
            alloc,
            resv
        );
        serving.cells(smp.context.as_ref(), &mut out);
        match s.high.as_ref().filter(|_| thinned) {
            Some(high) => {
                let rss = high.process.as_ref().map(|p| bytes(p.vm_rss_bytes));
                let alloc = high.allocator.first().map(|a| bytes(a.allocated_bytes));
                let _ = writeln!(
                    out,
                    " {:>10} {:>10}",
                    rss.as_deref().unwrap_or("-"),
                    alloc.as_deref().unwrap_or("-")
                );
            }
            None => out.push('\n'),
        }
    }
    for e in events {
        e.write(&mut out);
    }
    out
}

/// The serving context's columns of the text timeline (the KV pool, the
/// running and waiting requests, preemptions): shown where some sample's
/// context has them, so a timeline without a serving runtime keeps its width.
struct ServingColumns {
    shown: bool,
    /// Only vLLM's context counts preemptions.
    preemptions: bool,
}

impl ServingColumns {
    fn of(samples: &[pb::TimedSample]) -> ServingColumns {
        let contexts = || samples.iter().filter_map(|s| serving(s.sample.as_ref()?));
        ServingColumns {
            shown: contexts().next().is_some(),
            preemptions: contexts().any(|c| c.numbers.contains_key(PREEMPTIONS)),
        }
    }

    fn header(&self, out: &mut String) {
        if self.shown {
            let _ = write!(
                out,
                " {:>7} {:>11} {:>7} {:>7}",
                "KV USE", "KV CACHE", "ACTIVE", "QUEUED"
            );
        }
        if self.preemptions {
            let _ = write!(out, " {:>8}", "PREEMPT");
        }
    }

    fn cells(&self, context: Option<&pb::RequestContext>, out: &mut String) {
        if !self.shown {
            return;
        }
        let c = context.filter(|c| has_serving(c));
        let usage = c
            .and_then(oomscope_analysis::kv_pool_usage)
            .map(|u| format!("{:.1}%", u * 100.0));
        let kv = c
            .filter(|c| c.kv_cache_bytes > 0 || c.kv_cache_capacity_bytes > 0)
            .map(|c| bytes(c.kv_cache_bytes));
        let _ = write!(
            out,
            " {:>7} {:>11} {:>7} {:>7}",
            usage.as_deref().unwrap_or("-"),
            kv.as_deref().unwrap_or("-"),
            c.map_or("-".into(), |c| c.active_sequences.to_string()),
            c.map_or("-".into(), |c| c.queued.to_string()),
        );
        if self.preemptions {
            let n = c.and_then(|c| c.numbers.get(PREEMPTIONS));
            let _ = write!(out, " {:>8}", n.map_or("-".into(), |n| format!("{n:.0}")));
        }
    }
}

/// The vLLM plugin's cumulative preemption count, in the context's numbers.
const PREEMPTIONS: &str = "preemptions";

/// A sample's context where it says anything of serving (a phase alone does not).
fn serving(s: &pb::Sample) -> Option<&pb::RequestContext> {
    s.context.as_ref().filter(|c| has_serving(c))
}

fn has_serving(c: &pb::RequestContext) -> bool {
    c.numbers.contains_key("kv_cache_usage")
        || c.numbers.contains_key(PREEMPTIONS)
        || c.kv_cache_bytes > 0
        || c.kv_cache_capacity_bytes > 0
        || c.active_sequences > 0
        || c.queued > 0
}

/// One event line of the text timeline.
struct EventRow {
    time_ns: i64,
    seq: u64,
    label: String,
}

impl EventRow {
    fn write(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "{:<24} {:>6}   * {}",
            time(self.time_ns),
            self.seq,
            terminal(&self.label)
        );
    }
}

const MINUTE_NS: i64 = 60_000_000_000;

/// A process's gc collections in one minute of the clock, as one line.
#[derive(Default)]
struct GcMinute {
    row: usize,
    count: u64,
    /// Collections by generation.
    generations: std::collections::BTreeMap<i32, u64>,
    collected: u64,
    uncollectable: u64,
    longest_ns: u64,
    last_ns: i64,
}

impl GcMinute {
    fn label(&self) -> String {
        let generations: Vec<String> = self
            .generations
            .iter()
            .map(|(g, n)| format!("gen{g} {n}"))
            .collect();
        let mut label = format!(
            "gc x{} to {} ({}): collected {}",
            self.count,
            // The time of day: the line's own time gives the date.
            time(self.last_ns).get(11..).unwrap_or_default(),
            generations.join(", "),
            self.collected
        );
        if self.uncollectable > 0 {
            let _ = write!(label, ", {} uncollectable", self.uncollectable);
        }
        let _ = write!(label, ", longest {:.2} ms", self.longest_ns as f64 / 1e6);
        label
    }
}

/// The events as lines, oldest first. A Python server collects garbage many
/// times a second: each process's gc collections of one minute are one line,
/// at the first of them (their count, what they collected, the longest),
/// so they do not bury the events around them.
fn event_rows(events: &[pb::TimedEvent]) -> Vec<EventRow> {
    let mut rows = Vec::with_capacity(events.len());
    let mut minutes: std::collections::HashMap<(&str, i64), GcMinute> = Default::default();
    for e in events {
        let ev = e.event.clone().unwrap_or_default();
        let row = EventRow {
            time_ns: ev.time_ns,
            seq: e.seq,
            label: event_label(&ev),
        };
        let Some(pb::event::Kind::Gc(gc)) = &ev.kind else {
            rows.push(row);
            continue;
        };
        let minute = minutes
            .entry((e.agent_id.as_str(), ev.time_ns.div_euclid(MINUTE_NS)))
            .or_insert_with(|| GcMinute {
                row: rows.len(),
                ..Default::default()
            });
        if minute.count == 0 {
            rows.push(row);
        }
        minute.count += 1;
        *minute.generations.entry(gc.generation).or_default() += 1;
        minute.collected += gc.collected;
        minute.uncollectable += gc.uncollectable;
        minute.longest_ns = minute.longest_ns.max(gc.duration_ns);
        minute.last_ns = minute.last_ns.max(ev.time_ns);
    }
    for minute in minutes.values().filter(|m| m.count > 1) {
        rows[minute.row].label = minute.label();
    }
    rows
}

/// What ended the instance, unescaped (the text, HTML and Markdown forms
/// escape it their own way). With the kernel's record of an OOM kill, the
/// kill comes first: a server whose worker the kernel killed may still exit
/// with code 0, and "code 0" alone reads as a clean end.
pub fn exit_line(d: &pb::Diagnosis) -> Option<String> {
    let status = d.exit.and_then(|e| match (e.code, e.signal) {
        (_, Some(s)) => Some(format!(
            "killed by signal {s} ({})",
            oomscope_analysis::units::signal_name(s)
        )),
        (Some(c), _) => Some(format!("code {c}")),
        _ => None,
    });
    let Some(k) = &d.kernel_report else {
        // Another process of the instance died first: it, then the main one.
        let Some((v, s)) = d.victim.as_ref().and_then(|v| Some((v, v.status?))) else {
            return status;
        };
        let how = match (s.code, s.signal) {
            (_, Some(sig)) => format!(
                "was killed by signal {sig} ({})",
                oomscope_analysis::units::signal_name(sig)
            ),
            (Some(c), _) => format!("exited with code {c}"),
            _ => "ended".to_string(),
        };
        let title = match v.title.is_empty() {
            true => String::new(),
            false => format!(" ({})", v.title),
        };
        let then = match d.exit.map(|e| (e.code, e.signal)) {
            Some((_, Some(sig))) => format!(
                ", then the main process was killed by signal {sig} ({})",
                oomscope_analysis::units::signal_name(sig)
            ),
            Some((Some(c), None)) => format!(", then the main process exited with code {c}"),
            _ => String::new(),
        };
        return Some(format!("member pid {}{title} {how}{then}", v.pid));
    };
    let killed = if k.command.is_empty() {
        format!("the kernel killed pid {} for memory", k.pid)
    } else {
        format!("the kernel killed pid {} ({})", k.pid, k.command)
    };
    Some(match d.exit.map(|e| (e.code, e.signal)) {
        Some((_, Some(_))) => format!(
            "{killed}; the main process was {}",
            status.unwrap_or_default()
        ),
        Some((Some(c), None)) => {
            format!("{killed}, then the main process exited with code {c}")
        }
        _ => killed,
    })
}

pub fn diagnosis(d: &pb::Diagnosis) -> String {
    let mut out = String::new();
    let who = terminal(d.agent.as_deref().unwrap_or("-"));
    match &d.incident {
        Some(i) => {
            let _ = writeln!(out, "Incident {} (agent {who})", terminal(i));
        }
        None => {
            let _ = writeln!(out, "Agent {who} (no incident)");
        }
    }
    match &d.domain {
        Some(dom) => {
            let _ = writeln!(
                out,
                "Memory domain: {}: {}",
                terminal(dom),
                Domain::from_wire(dom).title()
            );
        }
        None => {
            let _ = writeln!(
                out,
                "Memory domain: - ({})",
                oomscope_analysis::no_domain_reason(d)
            );
        }
    }
    if let Some(t) = &d.trigger {
        let _ = writeln!(out, "Trigger: {}", terminal(t));
    }
    if let Some(line) = exit_line(d) {
        let _ = writeln!(out, "Exit: {}", terminal(&line));
    }
    if let Some(c) = &d.cgroup {
        let _ = writeln!(
            out,
            "Cgroup: {} (limit {} set on {})",
            terminal(&c.path),
            bytes(c.limit_bytes),
            terminal(&c.owner_level)
        );
    }
    if !d.evidence.is_empty() {
        out.push_str("Evidence:\n");
        for e in &d.evidence {
            let _ = writeln!(out, "  - {}", terminal(e));
        }
    }
    if !d.causes.is_empty() {
        out.push_str("Causes (most likely first):\n");
        for (i, c) in d.causes.iter().enumerate() {
            let _ = writeln!(
                out,
                "  {}. {} (confidence {:.2})",
                i + 1,
                terminal(&c.kind),
                c.confidence
            );
            for e in &c.evidence {
                let _ = writeln!(out, "       {}", terminal(e));
            }
            for p in &c.processes {
                let _ = writeln!(
                    out,
                    "       pid {} holds {} ({})",
                    p.pid,
                    bytes(p.bytes),
                    terminal(p.command.as_deref().unwrap_or_default())
                );
            }
        }
    }
    if !d.fixes.is_empty() {
        out.push_str("Fixes (least risky first):\n");
        for (i, f) in d.fixes.iter().enumerate() {
            let _ = writeln!(
                out,
                "  {}. [{} risk] {}",
                i + 1,
                terminal(&f.risk),
                terminal(&f.action)
            );
            let _ = writeln!(out, "       retest: {}", terminal(&f.retest));
            if let Some(c) = &f.caveat {
                let _ = writeln!(out, "       caveat: {}", terminal(c));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(id: &str, instance: &str, role: &str, pid: u32, state: &str) -> pb::AgentSummary {
        pb::AgentSummary {
            hello: Some(pb::Hello {
                agent_id: id.into(),
                name: "vllm".into(),
                role: role.into(),
                pid,
                ..Default::default()
            }),
            instance: instance.into(),
            state: state.into(),
            samples: 10,
            ..Default::default()
        }
    }

    #[test]
    fn agents_are_listed_one_instance_per_line_with_its_processes_under_it() {
        let mut api = agent("api", "sup", "api_server", 11, "disconnected");
        api.goodbye = Some(pb::Goodbye {
            reason: "interpreter exit".into(),
            exit_code: 1,
        });
        let text = agents(&[
            agent("sup", "sup", "supervisor", 10, "disconnected"),
            api,
            agent("worker", "sup", "worker", 12, "connected"),
            agent("solo", "solo", "server", 20, "connected"),
        ]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1 + 4 + 1, "{text}");
        // The instance: connected while a process streams, the server's pid, the samples summed.
        assert!(
            lines[1].starts_with("sup ") && lines[1].contains("connected"),
            "{text}"
        );
        assert!(
            lines[1].contains(" 30 ") && lines[1].contains(" 11 "),
            "{text}"
        );
        assert!(
            lines[2].starts_with("  sup ") && lines[4].starts_with("  worker "),
            "{text}"
        );
        // How the API server ended: its Goodbye's status.
        assert!(
            lines[2].contains(" disconnected ") && lines[3].contains(" exit 1 "),
            "{text}"
        );
        // A single-process instance is one line.
        assert!(lines[5].starts_with("solo "), "{text}");
    }

    fn gc_event(agent_id: &str, seq: u64, time_ns: i64, collected: u64) -> pb::TimedEvent {
        pb::TimedEvent {
            seq,
            agent_id: agent_id.into(),
            event: Some(pb::Event {
                time_ns,
                kind: Some(pb::event::Kind::Gc(pb::GcCollection {
                    generation: 0,
                    collected,
                    uncollectable: seq % 2,
                    duration_ns: seq * 100_000,
                })),
            }),
        }
    }

    #[test]
    fn each_process_has_its_own_gc_line_per_minute() {
        const MIN: i64 = 60_000_000_000;
        let t = pb::TimelineResponse {
            events: vec![
                gc_event("", 1, MIN, 10),
                gc_event("worker", 2, MIN + 1, 1),
                gc_event("", 3, MIN + 2, 20),
                gc_event("", 4, 2 * MIN - 1, 30),
                gc_event("", 5, 2 * MIN, 40),
            ],
            ..Default::default()
        };
        let text = timeline(&t);
        let gcs: Vec<&str> = text.lines().filter(|l| l.contains("* gc")).collect();
        assert_eq!(gcs.len(), 3, "{text}");
        // The server's three of the first minute: their sums, at the first of them.
        assert!(
            gcs[0].contains(" 1   * gc x3 to 00:01:59.999Z (gen0 3): collected 60, 2 uncollectable, longest 0.40 ms"),
            "{text}"
        );
        // The worker's one, and the server's next minute, as single events.
        assert!(gcs[1].contains("gc gen0 collected 1"), "{text}");
        assert!(gcs[2].contains(" 5   * gc gen0 collected 40"), "{text}");
    }

    #[test]
    fn what_the_agent_dropped_during_an_outage_is_said_before_the_sample_after_it() {
        let sample = |seq: u64, dropped_before| pb::TimedSample {
            seq,
            sample: Some(pb::Sample {
                time_ns: seq as i64 * 1_000_000_000,
                dropped_before,
                ..Default::default()
            }),
            ..Default::default()
        };
        let t = pb::TimelineResponse {
            samples: vec![
                sample(1, None),
                sample(
                    9,
                    Some(pb::DroppedBefore {
                        samples: 5,
                        events: 2,
                        by_spool: 0,
                        stride: 8,
                        requests: 400,
                    }),
                ),
            ],
            ..Default::default()
        };
        let text = timeline(&t);
        let lines: Vec<&str> = text.lines().collect();
        let said = lines
            .iter()
            .position(|l| l.contains("dropped 5 samples and 2 events"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(lines[said].contains("1 in 8 kept"), "{text}");
        assert!(lines[said].contains("with 400 requests' ends"), "{text}");
        assert!(
            lines[said - 1].contains(" 1 ") && lines[said + 1].contains(" 9 "),
            "{text}"
        );
        assert_eq!(text.matches("dropped").count(), 1, "{text}");
    }

    #[test]
    fn an_incidents_parts_are_listed_under_it_in_its_columns() {
        let inc = |id: &str, kind: &str, summary: &str| pb::Incident {
            id: id.into(),
            agent_name: "ref".into(),
            kind: kind.into(),
            domain: "external_kill".into(),
            summary: summary.into(),
            ..Default::default()
        };
        let mut root = inc("inc-000001", "member_died", "member pid 7 killed");
        root.parts = vec![inc("inc-000002", "agent_lost", "stream broke")];
        let text = incidents(&[root]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[1].starts_with("inc-000001 ") && lines[1].contains("external_kill"));
        assert!(lines[2].starts_with("  +- inc-000002 "), "{text}");
        assert!(lines[2].contains("(part)") && lines[2].ends_with("stream broke"));
        // The kind column lines up under the root's.
        assert_eq!(lines[1].find("member_died"), lines[2].find("agent_lost"));
    }

    #[test]
    fn terminal_text_shows_control_characters_visibly() {
        assert_eq!(terminal("a\x1b[31mred\x07\nb"), "a\\u{1b}[31mred\\u{7}\\nb");
        assert_eq!(terminal_text("a\x1b[2J\nb\r\n"), "a\\u{1b}[2J\nb\\r\n");
    }

    fn kernel_killed_worker() -> pb::Diagnosis {
        pb::Diagnosis {
            exit: Some(pb::ExitStatus {
                code: Some(0),
                signal: None,
            }),
            kernel_report: Some(pb::KernelReport {
                pid: 123,
                command: "VLLM::Worker".into(),
                anon_rss_bytes: 2 << 30,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_exit_says_the_kernel_killed_first() {
        let d = kernel_killed_worker();
        assert!(
            diagnosis(&d).contains(
                "\nExit: the kernel killed pid 123 (VLLM::Worker), then the main process exited with code 0\n"
            ),
            "{}",
            diagnosis(&d)
        );
        // Killed itself: the kill, then the signal.
        let mut killed = d.clone();
        killed.exit = Some(pb::ExitStatus {
            code: None,
            signal: Some(9),
        });
        assert_eq!(
            exit_line(&killed).as_deref(),
            Some("the kernel killed pid 123 (VLLM::Worker); the main process was killed by signal 9 (SIGKILL)")
        );
        // No exit seen (an in-process agent): the kill alone.
        let mut no_exit = d.clone();
        no_exit.exit = None;
        assert_eq!(
            exit_line(&no_exit).as_deref(),
            Some("the kernel killed pid 123 (VLLM::Worker)")
        );
        // Without a kernel record, the status as before.
        let mut plain = d;
        plain.kernel_report = None;
        assert!(diagnosis(&plain).contains("\nExit: code 0\n"));
    }

    #[test]
    fn bytes_are_human() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(64 << 20), "64.00 MiB");
        assert_eq!(bytes(1_256_194_048), "1.17 GiB");
    }

    #[test]
    fn time_is_utc() {
        assert_eq!(time(0), "1970-01-01 00:00:00.000Z");
        // 2026-11-30 00:00:00 UTC
        assert_eq!(
            time(1_796_000_000_000_000_000 - (1_796_000_000 % 86_400) * 1_000_000_000),
            "2026-11-30 00:00:00.000Z"
        );
    }
}
