//! The key a request is recorded under: (tenant, method, path or route
//! template, client key) under the layer's scope.

use idem_core::{Fingerprint, IdempotencyKey, KeyError};

use crate::fingerprint::original_uri;
use crate::request::parse_key_str;
#[cfg(doc)]
use crate::IdempotencyLayer;

/// Put in a request's extensions by what runs before the layer (a proxy
/// that compares paths in a normal form): the request is keyed by this
/// path in place of its own (and of its route template). Its fingerprint
/// keeps the request's own path, so two paths keyed alike with one key
/// get `422` for the second, never the first one's replay.
///
/// ```
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(idem_http::KeyPath::new("/pay"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyPath(String);

impl KeyPath {
    /// The path to key by.
    pub fn new(path: impl Into<String>) -> KeyPath {
        KeyPath(path.into())
    }

    /// The path.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The path a request is keyed by: a [`KeyPath`] put in front, else its
/// route template if asked for and known, else the path as the client
/// sent it.
pub(crate) fn key_path(parts: &http::request::Parts, route_template: bool) -> &str {
    if let Some(path) = parts.extensions.get::<KeyPath>() {
        return path.as_str();
    }
    #[cfg(feature = "axum")]
    if route_template {
        if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
            return matched.as_str();
        }
    }
    #[cfg(not(feature = "axum"))]
    let _ = route_template;
    original_uri(parts).path()
}

/// The longest tenant, method or path (once `%` and `/` are escaped) kept
/// as it is in a key id.
const MAX_RAW_PART: usize = 64;

/// The id of a request's key: tenant, method and path, each escaped (`%`
/// and `/` percent-encoded) or, when longer than [`MAX_RAW_PART`] or
/// holding a control character, replaced by `sha256:` and its hex SHA-256
/// (71 bytes, so never equal to a part kept as it is); then the header
/// value as it is. The parts hold no `/`, so the id splits back into them
/// at its first three `/`: two different requests never share an id (short
/// of a SHA-256 collision). At most 3 × 71 + 3 + 255 = 471 bytes, under the
/// key's 512, whatever the lengths of the path and tenant.
///
/// The method is keyed in upper case: `post` and `POST` with one key are
/// one key, so where a server reads methods without regard to case a
/// retry spelt otherwise never runs again (the fingerprint keeps the
/// method as sent: it gets `422`).
pub(crate) fn key_id(tenant: &str, method: &str, path: &str, client_key: &str) -> String {
    let mut id = String::with_capacity(3 * 72 + client_key.len());
    // Standard methods come in upper case already: no copy for them.
    let method: std::borrow::Cow<'_, str> = if method.bytes().any(|b| b.is_ascii_lowercase()) {
        method.to_ascii_uppercase().into()
    } else {
        method.into()
    };
    for part in [tenant, &*method, path] {
        let mut escaped = String::with_capacity(part.len());
        for ch in part.chars() {
            match ch {
                '%' => escaped.push_str("%25"),
                '/' => escaped.push_str("%2F"),
                c => escaped.push(c),
            }
        }
        if escaped.len() <= MAX_RAW_PART && !part.chars().any(char::is_control) {
            id.push_str(&escaped);
        } else {
            id.push_str("sha256:");
            id.push_str(&Fingerprint::of_bytes(part.as_bytes()).to_hex());
        }
        id.push('/');
    }
    id.push_str(client_key);
    id
}

/// The key under which the layer records a request: what an operator
/// tool needs to find one request's record.
///
/// `scope` is the layer's scope (default `"http"`), `tenant` what the
/// layer's tenant function returned (`""` for anonymous use), `method` the
/// request's (in any case: `post` is keyed as `POST`), `path` the request's path as the client sent it (before any
/// nesting stripped it, no query) or, with
/// [`route_template(true)`](IdempotencyLayer::route_template), the route
/// template it matched (`/accounts/{id}/transfer`; the concrete path for a
/// request that matched none), and `header_value` the client's key as it
/// was sent: the key header's value (a token or a quoted string; the
/// header's name does not matter), or what the
/// [`key_from`](IdempotencyLayer::key_from) or
/// [`key_from_body`](IdempotencyLayer::key_from_body) function returned.
/// Two different requests never share a key.
///
/// ```
/// use idem_http::request_key;
///
/// let key = request_key("http", "tenant-1", "POST", "/payments", "\"k-1\"")?;
/// assert_eq!(key.scope(), "http");
/// assert_eq!(key, request_key("http", "tenant-1", "POST", "/payments", "k-1")?);
/// assert_ne!(key, request_key("http", "tenant-2", "POST", "/payments", "k-1")?);
/// // A layer with `.route_template(true)`:
/// let key = request_key("http", "tenant-1", "POST", "/accounts/{id}/transfer", "k-1")?;
/// # let _ = key;
/// assert!(request_key("http", "tenant-1", "POST", "/p", "has space").is_err());
/// # Ok::<(), idem_http::RequestKeyError>(())
/// ```
pub fn request_key(
    scope: &str,
    tenant: &str,
    method: &str,
    path: &str,
    header_value: &str,
) -> Result<IdempotencyKey, RequestKeyError> {
    let client_key = parse_key_str(header_value).ok_or(RequestKeyError::MalformedHeader)?;
    IdempotencyKey::new(scope, key_id(tenant, method, path, client_key))
        .map_err(RequestKeyError::Key)
}

/// Why [`request_key`] could not build a key.
///
/// ```
/// use idem_http::{request_key, RequestKeyError};
///
/// assert!(matches!(
///     request_key("http", "t", "POST", "/p", &"k".repeat(256)),
///     Err(RequestKeyError::MalformedHeader)
/// ));
/// assert!(matches!(request_key("bad scope", "t", "POST", "/p", "k"), Err(RequestKeyError::Key(_))));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RequestKeyError {
    /// The header value is not 1 to 255 visible ASCII characters, as a
    /// token or a quoted string: the layer answers such a request 400.
    #[error(
        "the Idempotency-Key value must be 1 to 255 visible ASCII characters, optionally quoted"
    )]
    MalformedHeader,
    /// The scope is not a valid key scope.
    #[error(transparent)]
    Key(#[from] KeyError),
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use http::Request;
    use idem_core::{Idempotency, IdempotencyStore};

    use super::*;
    use crate::IdempotencyLayer;

    #[test]
    fn key_ids_fit_and_never_collide() {
        let long = "/".repeat(300);
        let key = "%/".repeat(127) + "%";
        let id = key_id(&long, &"M".repeat(100), &long, &key);
        assert!(id.len() <= idem_core::MAX_ID_LEN, "{}", id.len());
        assert!(IdempotencyKey::new("s", id).is_ok());
        // Raw and hashed parts never meet: a raw part is at most 64 bytes.
        let hashed = key_id(&"t".repeat(65), "POST", "/p", "k");
        let raw_like = format!("{}/POST/%2Fp/k", &hashed[..71]);
        assert_eq!(hashed, raw_like, "the hashed form is 71 bytes");
        assert_ne!(key_id(&hashed[..71], "POST", "/p", "k"), hashed);
        // Separators inside parts are escaped.
        assert_ne!(
            key_id("a/b", "POST", "/p", "k"),
            key_id("a", "b/POST", "/p", "k")
        );
        assert_ne!(
            key_id("a", "POST", "/p", "k/x"),
            key_id("a", "POST", "/p/k", "x")
        );
        assert_ne!(
            key_id("t", "POST", &("/".to_owned() + &"p".repeat(99) + "a"), "k"),
            key_id("t", "POST", &("/".to_owned() + &"p".repeat(99) + "b"), "k")
        );
        // A control character in a tenant is hashed, never refused.
        assert!(IdempotencyKey::new("s", key_id("a\nb", "POST", "/", "k")).is_ok());
    }

    /// A layer inside a nested router, keyed by route template: the
    /// template is the whole one (`/accounts/{id}/transfer`), as
    /// `request_key` is told to take it.
    #[tokio::test]
    async fn a_nested_route_template_is_the_whole_template() {
        use axum::{body::Body, routing::post, Router};
        use idem_core::MemoryStore;
        use tower::ServiceExt;

        let store = Arc::new(MemoryStore::new());
        let layer = IdempotencyLayer::new(Idempotency::new(store.clone()))
            .allow_anonymous(true)
            .route_template(true);
        let app: Router = Router::new().nest(
            "/accounts/{id}",
            Router::new()
                .route("/transfer", post(|| async { "moved" }))
                .layer(layer),
        );
        let request = Request::post("/accounts/7/transfer")
            .header("idempotency-key", "k")
            .body(Body::empty())
            .unwrap_or_else(|e| panic!("{e}"));
        let response = app.oneshot(request).await.unwrap_or_else(|e| match e {});
        assert_eq!(response.status(), 200);
        let key = request_key("http", "", "POST", "/accounts/{id}/transfer", "k")
            .unwrap_or_else(|e| panic!("{e}"));
        let record = store.get(&key).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(record.is_some(), "recorded under the whole template");
    }
}
