//! Who is calling: the tenant a request's key is scoped by.

use base64::Engine as _;
use http::header::{HeaderName, AUTHORIZATION};
use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::config::ConfigError;

/// The identity of a TLS client, put in each request's extensions by the
/// listener when TLS is terminated here with client certificates.
#[derive(Debug, Clone)]
pub struct ClientCertificate(pub String);

/// Where the tenant comes from.
#[derive(Debug, Clone)]
pub enum TenantSource {
    /// No tenant: every request is anonymous (refused unless anonymous use
    /// is allowed).
    None,
    /// A request header's value (an API key), stored as its SHA-256.
    Header(HeaderName),
    /// The `iss` and `sub` of the bearer JWT in `Authorization`, not
    /// verified.
    JwtSubject,
    /// The client certificate's SHA-256.
    ClientCert,
}

fn hashed(kind: &str, bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    format!("{kind}:{}", hex::encode(&digest[..16]))
}

impl TenantSource {
    pub(crate) fn choose(
        header: Option<&str>,
        jwt: bool,
        cert: bool,
    ) -> Result<TenantSource, ConfigError> {
        match (header, jwt, cert) {
            (None, false, false) => Ok(TenantSource::None),
            (Some(name), false, false) => HeaderName::from_bytes(name.as_bytes())
                .map(TenantSource::Header)
                .map_err(|_| ConfigError::Invalid {
                    option: "--tenant-header",
                    reason: format!("`{name}` is not a header name"),
                }),
            (None, true, false) => Ok(TenantSource::JwtSubject),
            (None, false, true) => Ok(TenantSource::ClientCert),
            _ => Err(ConfigError::Invalid {
                option: "--tenant-header",
                reason: "one of --tenant-header, --tenant-jwt and --tenant-client-cert".into(),
            }),
        }
    }

    /// Whether the request carries what the tenant is read from (the
    /// header, an `Authorization`, a client certificate), usable or not.
    /// A request that carries it but has no tenant ([`of`](Self::of) is
    /// `None`: the header twice or empty, a token that is not a JWT) is
    /// never anonymous: its answer could hold what the credential opened.
    pub fn offered(&self, parts: &Parts) -> bool {
        match self {
            TenantSource::None => false,
            TenantSource::Header(name) => parts.headers.contains_key(name),
            TenantSource::JwtSubject => parts.headers.contains_key(AUTHORIZATION),
            TenantSource::ClientCert => parts.extensions.get::<ClientCertificate>().is_some(),
        }
    }

    /// The tenant of a request, `None` when it has none.
    pub fn of(&self, parts: &Parts) -> Option<String> {
        match self {
            TenantSource::None => None,
            TenantSource::Header(name) => {
                let mut values = parts.headers.get_all(name).iter();
                let value = values.next()?;
                // Two values: which one is the caller? Neither.
                if values.next().is_some() || value.is_empty() {
                    return None;
                }
                Some(hashed("key", value.as_bytes()))
            }
            TenantSource::JwtSubject => jwt_subject(parts),
            TenantSource::ClientCert => parts
                .extensions
                .get::<ClientCertificate>()
                .map(|c| c.0.clone()),
        }
    }
}

/// `iss` and `sub` of `Authorization: Bearer <jwt>`, read, not verified.
fn jwt_subject(parts: &Parts) -> Option<String> {
    let mut values = parts.headers.get_all(AUTHORIZATION).iter();
    let value = values.next()?.to_str().ok()?;
    if values.next().is_some() {
        return None;
    }
    let (scheme, token) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let mut segments = token.trim().split('.');
    let (_header, payload, _signature) = (segments.next()?, segments.next()?, segments.next()?);
    if segments.next().is_some() {
        return None;
    }
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&json).ok()?;
    let sub = claims.get("sub")?.as_str().filter(|s| !s.is_empty())?;
    // An issuer that is not a string names no one: no tenant (never the
    // tenant of the tokens without one).
    let iss = match claims.get("iss") {
        None => "",
        Some(iss) => iss.as_str()?,
    };
    // Length-prefixed, so no issuer and subject pair reads as another.
    Some(format!("jwt:{}:{iss}{sub}", iss.len()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut b = http::Request::post("/");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    fn jwt(claims: &str) -> String {
        let e = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        format!("Bearer {}.{}.sig", e(r#"{"alg":"none"}"#), e(claims))
    }

    #[test]
    fn a_jwt_names_its_issuer_and_subject_and_a_bad_one_names_nobody() {
        let t = TenantSource::JwtSubject;
        let a = t.of(&parts(&[(
            "authorization",
            &jwt(r#"{"sub":"alice","iss":"x"}"#),
        )]));
        let b = t.of(&parts(&[(
            "authorization",
            &jwt(r#"{"sub":"alice","iss":"y"}"#),
        )]));
        assert!(a.is_some() && a != b);
        assert_eq!(
            t.of(&parts(&[("authorization", &jwt(r#"{"iss":"x"}"#))])),
            None
        );
        assert_eq!(t.of(&parts(&[("authorization", "Bearer not-a-jwt")])), None);
        assert_eq!(t.of(&parts(&[("authorization", "Basic YTpi")])), None);
        assert_eq!(t.of(&parts(&[])), None);
    }

    #[test]
    fn an_api_key_is_hashed_and_two_of_them_name_nobody() {
        let t = TenantSource::Header(HeaderName::from_static("x-api-key"));
        let a = t.of(&parts(&[("x-api-key", "secret")])).unwrap();
        assert!(!a.contains("secret"));
        assert_eq!(
            t.of(&parts(&[("x-api-key", "a"), ("x-api-key", "b")])),
            None
        );
        assert_eq!(t.of(&parts(&[("x-api-key", "")])), None);
    }
}
