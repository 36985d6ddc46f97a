//! A blocking client of the collector's `QueryService`, shared by the CLI's
//! query verbs, the probe's evidence source and the Python agent's
//! `oomscope.query`.
//!
//! Each `Client` owns a one-thread runtime: a tonic connection lives on the
//! runtime that made it, so a caller with several queries keeps one client.
//! Every call has a deadline, so a collector that accepts the connection and
//! then says nothing cannot hang the caller.

use std::future::Future;
use std::time::Duration;

use oomscope_proto::bearer::Bearer;
use oomscope_proto::v1 as pb;
use pb::query_service_client::QueryServiceClient;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

/// How long connecting may take before the collector counts as unreachable.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long one query may take. Queries read a bounded window of history,
/// so a minute is a stuck collector, not a slow one.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a query got no answer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("`{url}` is not a collector URL (expected e.g. {example}): {reason}", example = oomscope_proto::DEFAULT_COLLECTOR_URL)]
    BadUrl { url: String, reason: String },
    #[error("cannot reach the collector at {url}: is `oomscope collector` running? ({reason})")]
    Unreachable { url: String, reason: String },
    #[error("the collector did not answer within {} s", .0.as_secs_f64())]
    Timeout(Duration),
    #[error("{} ({:?})", .0.message(), .0.code())]
    Status(#[from] tonic::Status),
    #[error("{} ({:?}){hint}", status.message(), status.code())]
    Explained {
        status: tonic::Status,
        hint: &'static str,
    },
    #[error("{0}")]
    BadToken(String),
    #[error("cannot start a runtime for the query: {0}")]
    Runtime(#[from] std::io::Error),
}

impl Error {
    /// The collector answered, and the answer was "not found" (no such agent or incident).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::Status(s) if s.code() == tonic::Code::NotFound)
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// A channel whose calls carry the token of `OOMSCOPE_TOKEN`, if set.
type Authed = InterceptedService<Channel, Bearer>;

/// A connection to one collector's `QueryService`.
pub struct Client {
    rt: tokio::runtime::Runtime,
    inner: QueryServiceClient<Authed>,
    call_timeout: Duration,
    url: String,
}

impl Client {
    /// Connects to the collector at `url` (e.g. `http://127.0.0.1:7433`).
    pub fn connect(url: &str) -> Result<Client> {
        Client::connect_with(url, DEFAULT_CONNECT_TIMEOUT, DEFAULT_CALL_TIMEOUT)
    }

    /// Connects with explicit deadlines for the connection and for each call.
    ///
    /// `url` may be the agents' comma-separated list of collectors sharing
    /// one store: any of them answers for the whole fleet, so they are
    /// tried in order and the first that accepts the connection is asked.
    pub fn connect_with(url: &str, connect: Duration, call: Duration) -> Result<Client> {
        let urls: Vec<&str> = url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        let urls = if urls.is_empty() { vec![url] } else { urls };
        if let [one] = urls[..] {
            return Client::connect_one(one, connect, call);
        }
        let mut unreachable = Vec::new();
        for u in &urls {
            match Client::connect_one(u, connect, call) {
                Err(Error::Unreachable { url, reason }) => {
                    unreachable.push(format!("{url}: {reason}"))
                }
                other => return other,
            }
        }
        Err(Error::Unreachable {
            url: urls.join(", "),
            reason: unreachable.join("; "),
        })
    }

    fn connect_one(url: &str, connect: Duration, call: Duration) -> Result<Client> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let endpoint = Endpoint::from_shared(url.to_string())
            .map_err(|e| Error::BadUrl {
                url: url.to_string(),
                reason: e.to_string(),
            })?
            .connect_timeout(connect);
        let endpoint =
            oomscope_proto::tls::secure(endpoint, url).map_err(|reason| Error::BadUrl {
                url: url.to_string(),
                reason,
            })?;
        let channel = rt
            .block_on(async { tokio::time::timeout(connect, endpoint.connect()).await })
            .map_err(|_| Error::Unreachable {
                url: url.to_string(),
                reason: format!("no connection within {} s", connect.as_secs_f64()),
            })?
            .map_err(|e| Error::Unreachable {
                url: url.to_string(),
                reason: oomscope_proto::tls::error_chain(&e),
            })?;
        let bearer = Bearer::from_env().map_err(Error::BadToken)?;
        let inner = QueryServiceClient::with_interceptor(channel, bearer)
            .max_decoding_message_size(oomscope_proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(oomscope_proto::MAX_MESSAGE_BYTES);
        Ok(Client {
            rt,
            inner,
            call_timeout: call,
            url: url.to_string(),
        })
    }

    fn call<T, F, Fut>(&mut self, f: F) -> Result<T>
    where
        F: FnOnce(QueryServiceClient<Authed>) -> Fut,
        Fut: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = self.call_timeout;
        let fut = f(self.inner.clone());
        // The timer needs the runtime's context: make it inside block_on.
        match self
            .rt
            .block_on(async move { tokio::time::timeout(deadline, fut).await })
        {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(status)) => match oomscope_proto::tls::hint(&self.url, &format!("{status:?}")) {
                "" => Err(Error::Status(status)),
                hint => Err(Error::Explained { status, hint }),
            },
            Err(_) => Err(Error::Timeout(deadline)),
        }
    }

    /// Every agent the collector knows.
    pub fn agents(&mut self) -> Result<pb::ListAgentsResponse> {
        self.agents_where(pb::ListAgentsRequest::default())
    }

    /// The agents the request's filters admit (the collector filters).
    pub fn agents_where(&mut self, req: pb::ListAgentsRequest) -> Result<pb::ListAgentsResponse> {
        self.call(|mut c| async move { c.list_agents(req).await })
    }

    /// Incidents, all or one agent's.
    pub fn incidents(&mut self, req: pb::IncidentsRequest) -> Result<pb::IncidentsResponse> {
        self.call(|mut c| async move { c.incidents(req).await })
    }

    /// One agent's samples and events.
    pub fn timeline(&mut self, req: pb::TimelineRequest) -> Result<pb::TimelineResponse> {
        self.call(|mut c| async move { c.timeline(req).await })
    }

    /// The verdict on an incident, or on an agent's timeline.
    pub fn diagnose(&mut self, req: pb::DiagnoseRequest) -> Result<pb::Diagnosis> {
        self.call(|mut c| async move { c.diagnose(req).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_url_and_an_absent_collector_are_told_apart() {
        let e = Client::connect("not a url").err().expect("refused");
        assert!(matches!(e, Error::BadUrl { .. }), "{e}");
        // A port nothing listens on: bind one, then free it.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        drop(l);
        let e = Client::connect(&url).err().expect("refused");
        assert!(matches!(e, Error::Unreachable { .. }), "{e}");
        assert!(
            e.to_string().contains("is `oomscope collector` running?"),
            "{e}"
        );
    }

    #[test]
    fn a_list_of_collectors_is_tried_in_order_and_each_is_named() {
        let dead = || {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let url = format!("http://{}", l.local_addr().unwrap());
            drop(l);
            url
        };
        let (a, b) = (dead(), dead());
        let e = Client::connect(&format!("{a}, {b}"))
            .err()
            .expect("refused");
        let Error::Unreachable { url, reason } = &e else {
            panic!("{e}");
        };
        assert_eq!(url, &format!("{a}, {b}"));
        assert!(reason.contains(&format!("{a}: ")), "{reason}");
        assert!(reason.contains(&format!("; {b}: ")), "{reason}");
    }

    #[test]
    fn a_collector_that_never_answers_times_out() {
        // Accepts connections (the kernel's backlog) but never speaks HTTP/2.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let r = Client::connect_with(&url, Duration::from_millis(300), Duration::from_millis(300))
            .and_then(|mut c| c.agents().map(|_| ()));
        let e = r.expect_err("no answer");
        assert!(
            matches!(
                e,
                Error::Timeout(_) | Error::Unreachable { .. } | Error::Status(_)
            ),
            "{e}"
        );
        drop(l);
    }
}
