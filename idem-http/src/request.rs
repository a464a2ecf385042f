//! Reading a request before the store is asked: the client's key (from
//! the key header or a key function, checked as the draft says) and the
//! body, up to the layer's limit.

use bytes::Bytes;
use http::header::{HeaderName, CONTENT_LENGTH};
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::layer::{Config, KeySource};
use crate::response::BoxError;
#[cfg(doc)]
use crate::IdempotencyLayer;
use crate::{Problem, ProblemKind};

/// The request header that carries the key (unless
/// [`IdempotencyLayer::header_name`] names another).
///
/// ```
/// use axum::{body::Body, routing::post, Router};
/// use http::Request;
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_http::{IdempotencyLayer, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
/// use tower::ServiceExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new())).allow_anonymous(true);
/// let app = Router::new().route("/pay", post(|| async { "paid" })).layer(layer);
/// let pay = || Request::post("/pay").header(IDEMPOTENCY_KEY, "k-1").body(Body::empty());
/// let first = app.clone().oneshot(pay()?).await?;
/// assert!(first.headers().get(IDEMPOTENT_REPLAYED).is_none());
/// let again = app.oneshot(pay()?).await?;
/// assert_eq!(again.headers()[IDEMPOTENT_REPLAYED], "true");
/// # Ok(()) }
/// ```
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest key accepted, in bytes (quotes not counted); a longer one
/// gets `400`.
///
/// ```
/// use axum::{body::Body, routing::post, Router};
/// use http::Request;
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_http::IdempotencyLayer;
/// use tower::ServiceExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new())).allow_anonymous(true);
/// let app = Router::new().route("/pay", post(|| async { "paid" })).layer(layer);
/// let pay = |key: String| Request::post("/pay").header("idempotency-key", key).body(Body::empty());
/// let longest = "k".repeat(idem_http::MAX_KEY_LEN);
/// assert_eq!(app.clone().oneshot(pay(longest.clone())?).await?.status(), 200);
/// assert_eq!(app.oneshot(pay(longest + "k")?).await?.status(), 400);
/// # Ok(()) }
/// ```
pub const MAX_KEY_LEN: usize = 255;

/// The client's key as found, before it is checked.
pub(crate) enum RawKey {
    /// No key: no header, or the key function returned `None`.
    Missing,
    /// A value, to check with [`parse_key_str`].
    Value(String),
    /// A header value that is not visible ASCII.
    Malformed,
    /// The key function panicked.
    Panicked,
}

/// The key from the header `name`. A header sent twice is malformed: the
/// draft's field holds one item, and picking one of two keys could key a
/// request by another one than a proxy or the handler saw.
pub(crate) fn header_key(headers: &http::HeaderMap, name: &HeaderName) -> RawKey {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (None, _) => RawKey::Missing,
        (Some(_), Some(_)) => RawKey::Malformed,
        (Some(value), None) => match value.to_str() {
            Ok(value) => RawKey::Value(value.to_owned()),
            Err(_) => RawKey::Malformed,
        },
    }
}

/// Runs a key function; a panic is caught (and is the server's fault).
pub(crate) fn run_extractor(key: impl FnOnce() -> Option<String>) -> RawKey {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(key)) {
        Ok(Some(value)) => RawKey::Value(value),
        Ok(None) => RawKey::Missing,
        Err(_) => RawKey::Panicked,
    }
}

/// The key from the header: a token, or a quoted string (the draft's
/// structured-field form), of visible ASCII.
pub(crate) fn parse_key_str(raw: &str) -> Option<&str> {
    let raw = raw.trim();
    let key = match raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
        Some(inner) => inner,
        None => raw,
    };
    let visible = key.bytes().all(|b| (0x21..=0x7e).contains(&b) && b != b'"');
    (visible && (1..=MAX_KEY_LEN).contains(&key.len())).then_some(key)
}

pub(crate) fn malformed_key(source: &KeySource) -> Problem {
    let problem = Problem::new(ProblemKind::KeyMalformed);
    match source {
        KeySource::Header(name) => problem.with_detail(format!(
            "The {} header must be 1 to {MAX_KEY_LEN} visible ASCII characters (a string, \
             optionally quoted).",
            display_header(name)
        )),
        _ => problem.with_detail(format!(
            "The idempotency key must be 1 to {MAX_KEY_LEN} visible ASCII characters (a string, \
             optionally quoted)."
        )),
    }
}

/// `Idempotency-Key` for the default header (as the draft spells it),
/// the name as configured otherwise.
pub(crate) fn display_header(name: &HeaderName) -> &str {
    if name == IDEMPOTENCY_KEY {
        "Idempotency-Key"
    } else {
        name.as_str()
    }
}

/// Reads the request body up to the layer's limit.
pub(crate) async fn read_body<S: ?Sized, C, B>(
    config: &Config<S, C>,
    parts: &http::request::Parts,
    body: B,
) -> Result<Bytes, Problem>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        Problem::new(ProblemKind::BodyTooLarge).with_detail(format!(
            "The body must be at most {} bytes.",
            config.max_body_bytes
        ))
    };
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > config.max_body_bytes as u64) {
        return Err(too_large());
    }
    match Limited::new(body, config.max_body_bytes).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Err(e) => {
            tracing::debug!(error = %e, "idempotency layer: the request body could not be read");
            Err(Problem::new(ProblemKind::BodyUnreadable))
        }
    }
}

/// Headers refused by [`IdempotencyLayer::header_name`].
pub(crate) fn is_forbidden_key_header(name: &HeaderName) -> bool {
    const FORBIDDEN: &[&str] = &[
        // Hop-by-hop and framing: proxies drop or rewrite them.
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
        "expect",
        // Not settable by a browser (Fetch's forbidden request headers).
        "accept-charset",
        "accept-encoding",
        "access-control-request-headers",
        "access-control-request-method",
        "cookie2",
        "date",
        "dnt",
        "origin",
        "referer",
        "set-cookie",
        "via",
        // Credentials: the key is stored in the record's id and logged.
        "authorization",
        "cookie",
    ];
    let name = name.as_str();
    FORBIDDEN.contains(&name) || name.starts_with("proxy-") || name.starts_with("sec-")
}

/// Why [`IdempotencyLayer::header_name`] refused a header.
///
/// ```
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_http::IdempotencyLayer;
///
/// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()));
/// let refused = layer.header_name(http::header::TRANSFER_ENCODING).unwrap_err();
/// assert_eq!(refused.name(), "transfer-encoding");
/// ```
#[derive(Debug, thiserror::Error)]
#[error(
    "the header `{0}` cannot carry an idempotency key (hop-by-hop, not settable by clients, or a \
     credential)"
)]
pub struct ForbiddenHeaderName(pub(crate) HeaderName);

impl ForbiddenHeaderName {
    /// The header that was refused.
    pub fn name(&self) -> &HeaderName {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use http::header::HeaderValue;

    use super::*;

    #[test]
    fn header_names_that_cannot_carry_a_key_are_refused() {
        for name in [
            "connection",
            "transfer-encoding",
            "upgrade",
            "te",
            "host",
            "content-length",
            "authorization",
            "cookie",
            "set-cookie",
            "proxy-authorization",
            "proxy-anything",
            "sec-fetch-site",
        ] {
            assert!(
                is_forbidden_key_header(&HeaderName::from_static(name)),
                "{name}"
            );
        }
        for name in [
            "idempotency-key",
            "x-request-id",
            "x-idempotency-key",
            "request-id",
        ] {
            assert!(
                !is_forbidden_key_header(&HeaderName::from_static(name)),
                "{name}"
            );
        }
    }

    #[test]
    fn keys_are_tokens_or_quoted_strings_of_visible_ascii() {
        let parse = |s: &str| {
            HeaderValue::from_str(s)
                .ok()
                .and_then(|v| v.to_str().ok().and_then(parse_key_str).map(str::to_owned))
        };
        assert_eq!(parse("abc-123").as_deref(), Some("abc-123"));
        assert_eq!(
            parse("\"8e03978e-40d5-43e8-bc93-6894a57f9324\"").as_deref(),
            Some("8e03978e-40d5-43e8-bc93-6894a57f9324")
        );
        assert_eq!(parse(""), None);
        assert_eq!(parse("\"\""), None);
        assert_eq!(parse("a b"), None);
        assert_eq!(
            parse(&"k".repeat(MAX_KEY_LEN)).map(|k| k.len()),
            Some(MAX_KEY_LEN)
        );
        assert_eq!(parse(&"k".repeat(MAX_KEY_LEN + 1)), None);
        // What a key function returns is read the same way.
        assert_eq!(parse_key_str(" \"k\" "), Some("k"));
        for bad in [
            "a\u{1}b",
            "a\u{7f}",
            "caf\u{e9}",
            "\"\"",
            "a\"b",
            &"k".repeat(10 * 1024),
        ] {
            assert_eq!(parse_key_str(bad), None, "{bad:?}");
        }
    }
}
