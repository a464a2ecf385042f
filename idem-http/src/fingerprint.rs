//! The fingerprint of a request: what a duplicate must match to be
//! answered with the recorded response (else `422`).

use http::header::CONTENT_TYPE;
use idem_core::Fingerprint;

use crate::json;

/// The fingerprint of a request: SHA-256 over its method, its path and
/// query, the essence of its media type (`application/json`, without
/// parameters such as `charset`), and its body: the canonical JSON of a
/// JSON body (`application/json` or `+json`), so that field order and
/// whitespace never make a mismatch, or else the body's bytes. A JSON body
/// keeps its numbers' exact text (see the `json` module): two requests that
/// differ only in a digit never share a fingerprint.
pub(crate) fn fingerprint(parts: &http::request::Parts, body: &[u8]) -> Fingerprint {
    let target = original_uri(parts)
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let media = media_type(&parts.headers);
    let canonical = is_json(&media).then(|| json::canonical(body)).flatten();
    let (form, body) = match &canonical {
        Some(canonical) => (&b"json"[..], canonical.as_slice()),
        None => (&b"bytes"[..], body),
    };
    // Method, target and media type hold no newline (HTTP forbids it).
    let mut bytes = Vec::with_capacity(body.len() + target.len() + media.len() + 32);
    for part in [
        parts.method.as_str().as_bytes(),
        target.as_bytes(),
        &media,
        form,
    ] {
        bytes.extend_from_slice(part);
        bytes.push(b'\n');
    }
    bytes.extend_from_slice(body);
    Fingerprint::of_bytes(&bytes)
}

/// The request's URI as the client sent it. Inside a nested axum router
/// the URI handed to the layer has lost the nest's prefix
/// (`/accounts/1/transfer` arrives as `/transfer`); axum keeps the whole
/// one as `OriginalUri`, which keys and fingerprints must use, or two
/// accounts' requests would share a key.
pub(crate) fn original_uri(parts: &http::request::Parts) -> &http::Uri {
    #[cfg(feature = "axum")]
    if let Some(original) = parts.extensions.get::<axum::extract::OriginalUri>() {
        return &original.0;
    }
    &parts.uri
}

/// The media type of `Content-Type` without its parameters, lowercased;
/// empty without one.
fn media_type(headers: &http::HeaderMap) -> Vec<u8> {
    let Some(value) = headers.get(CONTENT_TYPE) else {
        return Vec::new();
    };
    let essence = value.as_bytes().split(|&b| b == b';').next().unwrap_or(b"");
    essence.trim_ascii().to_ascii_lowercase()
}

/// `application/json` or a `+json` structured syntax suffix.
fn is_json(media: &[u8]) -> bool {
    media == b"application/json" || (media.ends_with(b"+json") && media.contains(&b'/'))
}

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;

    fn fp(content_type: &str, body: &str) -> Fingerprint {
        fp_at("POST", "/p?q=1", content_type, body)
    }

    fn fp_at(method: &str, target: &str, content_type: &str, body: &str) -> Fingerprint {
        let mut builder = Request::builder().method(method).uri(target);
        if !content_type.is_empty() {
            builder = builder.header(CONTENT_TYPE, content_type);
        }
        let (parts, ()) = builder
            .body(())
            .unwrap_or_else(|e| panic!("{e}"))
            .into_parts();
        fingerprint(&parts, body.as_bytes())
    }

    #[test]
    fn json_fingerprints_ignore_order_and_whitespace_only() {
        let json = "application/json";
        assert_eq!(
            fp(json, r#"{"a":1,"b":"x"}"#),
            fp(json, "{ \"b\":\"x\",\n \"a\": 1 }")
        );
        assert_eq!(
            fp(json, r#"{"a":1}"#),
            fp("Application/JSON; charset=utf-8", r#"{ "a":1 }"#)
        );
        assert_eq!(
            fp("application/merge-patch+json", r#"{"a":1,"b":2}"#),
            fp("application/merge-patch+json", r#"{"b":2,"a":1}"#)
        );
        assert_ne!(
            fp(json, r#"{"a":12345678901234567890123}"#),
            fp(json, r#"{"a":12345678901234567890124}"#)
        );
        assert_ne!(fp(json, r#"{"a":1}"#), fp(json, r#"{"a":1.0}"#));
        // Not JSON: the bytes, so whitespace counts.
        assert_ne!(
            fp("text/plain", r#"{"a":1}"#),
            fp("text/plain", r#"{ "a":1}"#)
        );
        assert_ne!(fp(json, "{oops"), fp(json, "{oops "));
        assert_eq!(fp(json, "{oops"), fp(json, "{oops"));
        // The media type, method and target count.
        assert_ne!(fp(json, r#"{"a":1}"#), fp("text/plain", r#"{"a":1}"#));
        assert_ne!(fp("", "x"), fp("text/plain", "x"));
        assert_ne!(
            fp_at("POST", "/p", json, "{}"),
            fp_at("PATCH", "/p", json, "{}")
        );
        assert_ne!(
            fp_at("POST", "/p?a=1", json, "{}"),
            fp_at("POST", "/p?a=2", json, "{}")
        );
        // An invalid JSON body never equals a canonical one.
        assert_ne!(fp(json, "[1,]"), fp(json, "[1]"));
    }
}
