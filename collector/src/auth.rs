//! Bearer tokens on both gRPC services.
//!
//! `--token-file` holds one named token per line, `name:secret`. Every call
//! must carry `authorization: Bearer <secret>` of one of them, or it is
//! answered `Unauthenticated` before any handler (and so any write) runs.
//! The name of the token a call presented travels to the handler as a
//! [`TokenName`] extension: an agent id is bound to the first token that
//! used it (`Store::bind_token`), so one client cannot write as another.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use tonic::{Request, Status};

/// The shortest secret accepted: 16 characters of a random token are ~95
/// bits as base64, far beyond guessing over a network.
pub const MIN_SECRET_LEN: usize = 16;

/// The name of the token that authenticated a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenName(pub String);

/// The named tokens a collector accepts.
#[derive(Clone, Debug)]
pub struct Tokens {
    /// (name, secret), in file order.
    named: Arc<Vec<(String, String)>>,
}

impl Tokens {
    /// Parses `name:secret` lines; blank lines and `#` comments are skipped.
    pub fn parse(text: &str) -> Result<Tokens> {
        let mut named: Vec<(String, String)> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((name, secret)) = line.split_once(':') else {
                bail!("line {}: expected name:secret", i + 1);
            };
            let (name, secret) = (name.trim(), secret.trim());
            if name.is_empty() {
                bail!("line {}: a token without a name", i + 1);
            }
            if secret.len() < MIN_SECRET_LEN {
                bail!(
                    "line {}: the secret of {name:?} is shorter than {MIN_SECRET_LEN} characters",
                    i + 1
                );
            }
            if named.iter().any(|(n, _)| n == name) {
                bail!("line {}: the name {name:?} is used twice", i + 1);
            }
            if named.iter().any(|(_, s)| s == secret) {
                bail!("line {}: {name:?} has the secret of another token", i + 1);
            }
            named.push((name.to_string(), secret.to_string()));
        }
        if named.is_empty() {
            bail!("no tokens (expected lines of name:secret)");
        }
        Ok(Tokens {
            named: Arc::new(named),
        })
    }

    /// Reads a token file (see [`Tokens::parse`]).
    pub fn read(path: &Path) -> Result<Tokens> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the token file {}", path.display()))?;
        Tokens::parse(&text).with_context(|| format!("the token file {}", path.display()))
    }

    /// The name of the token whose secret is `secret`. Every secret is
    /// compared in full, in constant time, so timing tells nothing.
    pub fn name_of(&self, secret: &str) -> Option<&str> {
        let mut found = None;
        for (name, s) in self.named.iter() {
            if constant_time_eq(s.as_bytes(), secret.as_bytes()) {
                found = Some(name.as_str());
            }
        }
        found
    }

    /// Checks a call's `authorization` header; on success the call carries
    /// its [`TokenName`].
    pub fn check<T>(&self, mut request: Request<T>) -> Result<Request<T>, Status> {
        let header = request
            .metadata()
            .get("authorization")
            .ok_or_else(|| {
                Status::unauthenticated(
                    "this collector needs a token: set OOMSCOPE_TOKEN (or --token) to a secret \
                     of its --token-file",
                )
            })?
            .to_str()
            .map_err(|_| Status::unauthenticated("the authorization header is not text"))?;
        let secret = header
            .strip_prefix("Bearer ")
            .ok_or_else(|| Status::unauthenticated("expected authorization: Bearer <token>"))?;
        let name = self.name_of(secret.trim()).ok_or_else(|| {
            Status::unauthenticated("the token is not one this collector accepts")
        })?;
        let name = TokenName(name.to_string());
        request.extensions_mut().insert(name);
        Ok(request)
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The interceptor for a service: every call passes [`Tokens::check`], or
/// every call passes when the collector has no tokens.
pub fn interceptor(
    tokens: Option<Tokens>,
) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |request| match &tokens {
        Some(t) => t.check(request),
        None => Ok(request),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_file_names_its_tokens_and_refuses_bad_lines() {
        let t = Tokens::parse("# fleet\nteam-a:0123456789abcdef\n\n team-b : fedcba9876543210 \n")
            .unwrap();
        assert_eq!(t.name_of("0123456789abcdef"), Some("team-a"));
        assert_eq!(t.name_of("fedcba9876543210"), Some("team-b"));
        assert_eq!(t.name_of("0123456789abcdeX"), None);
        assert_eq!(t.name_of(""), None);
        for (bad, why) in [
            ("nocolon", "name:secret"),
            (":0123456789abcdef", "without a name"),
            ("a:short", "shorter"),
            ("a:0123456789abcdef\na:fedcba9876543210", "twice"),
            (
                "a:0123456789abcdef\nb:0123456789abcdef",
                "secret of another",
            ),
            ("# only a comment\n", "no tokens"),
        ] {
            let err = format!("{:#}", Tokens::parse(bad).unwrap_err());
            assert!(err.contains(why), "{bad:?}: {err}");
        }
    }

    #[test]
    fn a_call_passes_only_with_a_known_bearer_token() {
        let t = Tokens::parse("a:0123456789abcdef").unwrap();
        let with = |value: Option<&str>| {
            let mut r = Request::new(());
            if let Some(v) = value {
                r.metadata_mut().insert("authorization", v.parse().unwrap());
            }
            t.check(r)
        };
        let ok = with(Some("Bearer 0123456789abcdef")).unwrap();
        assert_eq!(
            ok.extensions().get::<TokenName>(),
            Some(&TokenName("a".into()))
        );
        for v in [
            None,
            Some("Bearer wrong-wrong-wrong!"),
            Some("0123456789abcdef"),
        ] {
            assert_eq!(
                with(v).unwrap_err().code(),
                tonic::Code::Unauthenticated,
                "{v:?}"
            );
        }
    }
}
