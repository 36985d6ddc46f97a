//! The request and phase marks a program holds: made by
//! [`Agent::request`] and [`Agent::phase`], ended when dropped, as
//! Python's `with oomscope.request(...)` ends at the block's end.

use crate::pb;

use super::Agent;

/// The phase of a request-end reading: a reading between requests, the
/// baseline a leak raises.
pub const AFTER_REQUEST_PHASE: &str = "after_request";

/// One request in flight. Dropping it ends the request: its reading (the
/// RSS, every attached pool's counters, the context) goes into the boundary
/// ring at once, on this thread, without touching the network.
#[must_use = "the request ends when this is dropped"]
pub struct Request {
    agent: Agent,
    boundary: pb::RequestBoundary,
}

impl Request {
    pub(super) fn begin(agent: &Agent, id: String, prompt_tokens: u64) -> Request {
        let boundary = pb::RequestBoundary {
            request_id: id,
            prompt_tokens,
            ..Default::default()
        };
        agent.request_boundary(pb::RequestBoundary {
            start: true,
            ..boundary.clone()
        });
        Request {
            agent: agent.clone(),
            boundary,
        }
    }

    pub fn id(&self) -> &str {
        &self.boundary.request_id
    }

    /// The tokens generated, reported at the request's end.
    pub fn set_output_tokens(&mut self, tokens: u64) {
        self.boundary.output_tokens = tokens;
    }

    pub fn set_max_tokens(&mut self, tokens: u64) {
        self.boundary.max_tokens = tokens;
    }

    /// Marks the request failed; the text goes with its end.
    pub fn fail(&mut self, error: impl std::fmt::Display) {
        self.boundary.error = error.to_string();
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        let boundary = std::mem::take(&mut self.boundary);
        self.agent.end_request(boundary);
    }
}

/// A phase of the program's life (a weights load: "load"): its start was
/// sent when made, its end goes when dropped. Samples taken inside it carry
/// its name, so the analysis does not read a load as growth.
#[must_use = "the phase ends when this is dropped"]
pub struct Phase {
    agent: Agent,
    name: String,
    model: Option<pb::Model>,
    error: String,
    /// The context's phase before this one, restored at the end.
    outer: String,
}

impl Phase {
    pub(super) fn begin(agent: &Agent, name: String, model: Option<pb::Model>) -> Phase {
        let mut outer = String::new();
        agent.set_context(|c| outer = std::mem::replace(&mut c.phase, name.clone()));
        agent.phase_edge(&name, true, model.clone(), "");
        Phase {
            agent: agent.clone(),
            name,
            model,
            error: String::new(),
            outer,
        }
    }

    /// Marks the phase failed; the text goes with its end.
    pub fn fail(&mut self, error: impl std::fmt::Display) {
        self.error = error.to_string();
    }
}

impl Drop for Phase {
    fn drop(&mut self) {
        self.agent
            .phase_edge(&self.name, false, self.model.take(), &self.error);
        let outer = std::mem::take(&mut self.outer);
        self.agent.set_context(|c| c.phase = outer);
    }
}
