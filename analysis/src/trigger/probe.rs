//! A death while `oomscope probe` drove the instance: the probe's requests
//! (its member's boundaries) say what the server was doing when it died. The
//! step that killed it is the one that went past what had been served: a
//! longer prompt than any answered (size), or more requests at once at no
//! longer a prompt (concurrency). A server with no agent of its own has no
//! other record of its load, and memory that the runtime reserved up front
//! need not rise with the load for the load to kill it.

use crate::evidence::Evidence;
use crate::pb;
use crate::pb::event::Kind;

use oomscope_proto::TriggerKind;

/// A probe request that ended this little before the death ended with it
/// (its error is the connection the death broke).
pub const DEATH_SLACK_NS: i64 = 1_000_000_000;

/// One request of the probe: when, how long a prompt, and how it ended.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeRequest {
    pub start_ns: i64,
    pub end_ns: Option<i64>,
    /// The probe's count of the prompt when it sent it.
    pub prompt_tokens: u64,
    /// The server's own count, where its answer gave one.
    pub server_tokens: Option<u64>,
    /// Answered without an error.
    pub ok: bool,
}

impl ProbeRequest {
    /// The prompt's size by the best count known.
    fn tokens(&self) -> u64 {
        self.server_tokens.unwrap_or(self.prompt_tokens)
    }
}

/// The requests of the probe that drove the instance, oldest first (from the
/// member whose Hello has the probe's role).
pub fn requests(e: &Evidence) -> Vec<ProbeRequest> {
    let probe = e.members.iter().filter(|m| {
        m.hello
            .as_ref()
            .is_some_and(|h| h.role == oomscope_proto::Role::Probe)
    });
    let mut out: Vec<(String, ProbeRequest)> = Vec::new();
    for ev in probe.flat_map(|m| m.events.iter()) {
        let Some(Kind::Request(b)) = &ev.kind else {
            continue;
        };
        if b.start {
            out.push((
                b.request_id.clone(),
                ProbeRequest {
                    start_ns: ev.time_ns,
                    end_ns: None,
                    prompt_tokens: b.prompt_tokens,
                    server_tokens: None,
                    ok: false,
                },
            ));
        } else if let Some((_, r)) = out
            .iter_mut()
            .rev()
            .find(|(id, r)| *id == b.request_id && r.end_ns.is_none())
        {
            end(r, ev.time_ns, b);
        }
    }
    let mut reqs: Vec<ProbeRequest> = out.into_iter().map(|(_, r)| r).collect();
    reqs.sort_by_key(|r| r.start_ns);
    reqs
}

fn end(r: &mut ProbeRequest, at: i64, b: &pb::RequestBoundary) {
    r.end_ns = Some(at);
    r.ok = b.error.is_empty();
    // The probe repeats its own estimate where the server gave no count.
    r.server_tokens = Some(b.prompt_tokens).filter(|&t| t > 0 && t != r.prompt_tokens);
}

/// The most requests answered at once: the sweep over the answered ones.
fn most_at_once(reqs: &[&ProbeRequest]) -> usize {
    reqs.iter()
        .map(|r| {
            reqs.iter()
                .filter(|o| o.start_ns <= r.start_ns && o.end_ns.is_some_and(|e| e > r.start_ns))
                .count()
        })
        .max()
        .unwrap_or(0)
}

/// The trigger of a death at `died_at` during the probe, if the probe's
/// requests were in flight then and the fatal step went past what had been
/// served.
pub fn decide(e: &Evidence, died_at: i64) -> Option<(TriggerKind, String)> {
    let reqs = requests(e);
    let in_flight: Vec<&ProbeRequest> = reqs
        .iter()
        .filter(|r| {
            r.start_ns <= died_at
                && r.end_ns.is_none_or(|end| end >= died_at - DEATH_SLACK_NS)
                && !(r.ok && r.end_ns.is_some_and(|end| end <= died_at))
        })
        .collect();
    let longest = in_flight.iter().copied().max_by_key(|r| r.prompt_tokens)?;
    let served: Vec<&ProbeRequest> = reqs
        .iter()
        .filter(|r| r.ok && r.end_ns.is_some_and(|end| end < died_at))
        .collect();
    // The step is judged in one unit, the probe's own count; the lines
    // quote the server's where it gave one.
    let served_estimate = served.iter().map(|r| r.prompt_tokens).max().unwrap_or(0);
    let served_tokens = served.iter().map(|r| r.tokens()).max().unwrap_or(0);
    let served_at_once = most_at_once(&served);
    let at_kill = size_line(longest, &served);
    let before = match served.len() {
        0 => "no request of the probe had been answered before it".to_string(),
        n => format!(
            "before it the server had answered {n} of the probe's requests, prompts of up to {served_tokens} tokens, at most {served_at_once} at once"
        ),
    };
    if longest.prompt_tokens > served_estimate {
        return Some((
            TriggerKind::SizeDependent,
            format!(
                "the server died while serving the probe's prompt of {at_kill} ({} request(s) in flight); {before}: the longer prompt set it off",
                in_flight.len()
            ),
        ));
    }
    if in_flight.len() > served_at_once {
        return Some((
            TriggerKind::ConcurrencyDependent,
            format!(
                "the server died with {} of the probe's requests in flight, prompts of up to {at_kill}; {before}: more at once, not a longer prompt, set it off",
                in_flight.len()
            ),
        ));
    }
    None
}

/// "20652 tokens (the server's count; the probe estimated 4096)", or the
/// probe's count, scaled by the server's counts of earlier prompts where
/// they differ from the probe's.
fn size_line(r: &ProbeRequest, served: &[&ProbeRequest]) -> String {
    if let Some(t) = r.server_tokens {
        return format!(
            "{t} tokens (the server's count; the probe estimated {})",
            r.prompt_tokens
        );
    }
    let mut ratios: Vec<f64> = served
        .iter()
        .filter_map(|s| Some(s.server_tokens? as f64 / s.prompt_tokens.max(1) as f64))
        .collect();
    ratios.sort_by(f64::total_cmp);
    match ratios.get(ratios.len() / 2) {
        Some(&k) if (k - 1.0).abs() > 0.05 => format!(
            "about {} tokens by the server's counts of the earlier prompts ({k:.2} of the probe's estimate of {})",
            (r.prompt_tokens as f64 * k).round() as u64,
            r.prompt_tokens
        ),
        _ => format!("{} tokens", r.prompt_tokens),
    }
}
