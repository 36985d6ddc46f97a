//! What `oomscope agents` and `incidents` ask the collector for
//! (`ListAgentsRequest`, `IncidentsRequest`): filters each store backend
//! applies in its own query, so a fleet's answer carries only what matched.
//! An empty field matches everything.

use crate::pb;

/// Which agents `ListAgents` answers with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentFilter {
    /// Last seen at or after this (collector clock); 0: any.
    pub since_ns: i64,
    /// The host its Hello names; empty: any.
    pub host: String,
}

/// Which incidents `Incidents` answers with (besides its agent).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IncidentFilter {
    /// At or after this; 0: any.
    pub since_ns: i64,
    /// `Incident.domain`; empty: any.
    pub domain: String,
    /// `Incident.kind`; empty: any.
    pub cause: String,
    /// The host of the incident's agent; empty: any.
    pub host: String,
}

impl AgentFilter {
    /// Whether an agent's decoded Hello is on the host asked for (the host
    /// lives in the Hello, so it is checked once the Hello is decoded).
    pub fn admits_host(&self, hello: &pb::Hello) -> bool {
        self.host.is_empty() || hello.host == self.host
    }
}

impl IncidentFilter {
    /// The agents an incident's host must be one of: those on `host`.
    pub fn agents(&self) -> AgentFilter {
        AgentFilter {
            since_ns: 0,
            host: self.host.clone(),
        }
    }

    /// Whether `incident` passes (for incidents gathered another way than
    /// the store's filtered query: an instance's); `on_host` says whether
    /// its agent is on the host asked for.
    pub fn admits(&self, incident: &pb::Incident, on_host: impl Fn(&str) -> bool) -> bool {
        incident.time_ns >= self.since_ns
            && (self.domain.is_empty() || incident.domain == self.domain)
            && (self.cause.is_empty() || incident.kind == self.cause)
            && (self.host.is_empty() || on_host(&incident.agent_id))
    }
}

impl From<&pb::ListAgentsRequest> for AgentFilter {
    fn from(r: &pb::ListAgentsRequest) -> Self {
        AgentFilter {
            since_ns: r.since_ns,
            host: r.host.clone(),
        }
    }
}

impl From<&pb::IncidentsRequest> for IncidentFilter {
    fn from(r: &pb::IncidentsRequest) -> Self {
        IncidentFilter {
            since_ns: r.since_ns,
            domain: r.domain.clone(),
            cause: r.cause.clone(),
            host: r.host.clone(),
        }
    }
}
