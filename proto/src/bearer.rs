//! The token a client presents to a collector: `authorization: Bearer
//! <secret>` on every call, from `OOMSCOPE_TOKEN` (the CLI's `--token` sets
//! it too). The collector's side is `oomscope_collector::auth`.

use tonic::metadata::{Ascii, MetadataValue};
use tonic::{Request, Status};

/// The environment variable every client of a collector reads its token from.
pub const TOKEN_ENV: &str = "OOMSCOPE_TOKEN";

/// Adds the token, if any, to each call (a tonic interceptor).
#[derive(Clone, Debug, Default)]
pub struct Bearer {
    header: Option<MetadataValue<Ascii>>,
}

impl Bearer {
    /// The token in `secret`; Err when it cannot go in a header.
    pub fn new(secret: Option<&str>) -> Result<Bearer, String> {
        let header = match secret.map(str::trim).filter(|s| !s.is_empty()) {
            None => None,
            Some(s) => Some(format!("Bearer {s}").parse().map_err(|_| {
                format!("{TOKEN_ENV}: a token must be printable ASCII without spaces")
            })?),
        };
        Ok(Bearer { header })
    }

    /// The token in `OOMSCOPE_TOKEN`, if set.
    pub fn from_env() -> Result<Bearer, String> {
        Bearer::new(std::env::var(TOKEN_ENV).ok().as_deref())
    }

    /// Adds the header to `request`.
    pub fn stamp<T>(&self, request: &mut Request<T>) {
        if let Some(h) = &self.header {
            request.metadata_mut().insert("authorization", h.clone());
        }
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        self.stamp(&mut request);
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_becomes_one_bearer_header() {
        let mut r = Request::new(());
        Bearer::new(Some(" s3cret-s3cret-s3cret \n"))
            .unwrap()
            .stamp(&mut r);
        assert_eq!(
            r.metadata().get("authorization").unwrap(),
            "Bearer s3cret-s3cret-s3cret"
        );
        let mut r = Request::new(());
        Bearer::new(Some("")).unwrap().stamp(&mut r);
        assert!(r.metadata().get("authorization").is_none());
        assert!(Bearer::new(Some("bad\u{1}token")).is_err());
    }
}
