//! The fingerprint of a request: what a duplicate must match to be
//! answered with the recorded response (else `422`).

use http::header::CONTENT_TYPE;
use idem_core::{json, Fingerprint, PayloadFingerprint};

/// Put in a request's extensions by what runs before the layer: more of
/// the request its fingerprint covers (a proxy in front of an upstream
/// that serves several hosts puts the `Host` here), so a request that
/// differs in it under one key gets `422`, never the other's replay.
///
/// ```
/// let mut request = http::Request::new(());
/// request
///     .extensions_mut()
///     .insert(idem_http::FingerprintExtra::new("host: shop.example"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FingerprintExtra(Vec<u8>);

impl FingerprintExtra {
    /// These bytes count in the fingerprint too.
    pub fn new(bytes: impl Into<Vec<u8>>) -> FingerprintExtra {
        FingerprintExtra(bytes.into())
    }
}

/// The fingerprint of a request: SHA-256 over its method, its path and
/// query, its media type, and its body: the canonical JSON of a JSON body
/// (`application/json` or `+json`, whose parameters such as `charset` do
/// not count: JSON is UTF-8), so that field order and whitespace never
/// make a mismatch, or else the body's bytes with the media type's
/// parameters (the same bytes under another `charset` are another text). A JSON body
/// keeps its numbers' exact text (see `idem_core::json`): two requests that
/// differ only in a digit never share a fingerprint. With `what` other
/// than [`PayloadFingerprint::Whole`], the part of the body it selects
/// stands for the body (a body it selects nothing of counts as above).
pub(crate) fn fingerprint(
    parts: &http::request::Parts,
    body: &[u8],
    what: &PayloadFingerprint,
) -> Fingerprint {
    let target = original_uri(parts)
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let essence = media_type(&parts.headers);
    let json = is_json(&essence);
    // A function's part: any body; JSON pointers read a JSON body only.
    let part = match what {
        PayloadFingerprint::JsonPointers(_) if !json => None,
        _ => what.selected(body),
    };
    let canonical = part
        .is_none()
        .then(|| json.then(|| json::canonical(body)).flatten())
        .flatten();
    let (form, body) = match (&part, &canonical) {
        (Some(part), _) => (&b"part"[..], part.as_slice()),
        (None, Some(canonical)) => (&b"json"[..], canonical.as_slice()),
        (None, None) => (&b"bytes"[..], body),
    };
    // Bytes mean another text under another charset: for a body other than
    // JSON (which is UTF-8 whatever it says), the parameters count.
    let media = if json {
        essence
    } else {
        with_parameters(essence, &parts.headers)
    };
    // Method, target and media type hold no newline (HTTP forbids it).
    let mut bytes = Vec::with_capacity(body.len() + target.len() + media.len() + 32);
    for part in [parts.method.as_str().as_bytes(), target.as_bytes(), &media] {
        bytes.extend_from_slice(part);
        bytes.push(b'\n');
    }
    // What a layer in front adds, length-prefixed, where a request without
    // it has its form (`part`, `json` or `bytes`): the two never read
    // alike, and fingerprints without it are what they were.
    if let Some(extra) = parts.extensions.get::<FingerprintExtra>() {
        bytes.extend_from_slice(format!("extra {}\n", extra.0.len()).as_bytes());
        bytes.extend_from_slice(&extra.0);
        bytes.push(b'\n');
    }
    bytes.extend_from_slice(form);
    bytes.push(b'\n');
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

/// `essence` followed by the parameters of `Content-Type`, normalized as
/// media types compare: names lowercased, quoted values unquoted (a `;`
/// inside quotes stays in the value, `\x` is `x`), `charset` values
/// lowercased (they have no case), sorted by name. A piece without `=`
/// is kept as it is, never dropped. Each name and value is written with
/// its length, so two parameter lists never read alike.
fn with_parameters(mut essence: Vec<u8>, headers: &http::HeaderMap) -> Vec<u8> {
    let Some(value) = headers.get(CONTENT_TYPE) else {
        return essence;
    };
    let mut parameters: Vec<(Vec<u8>, Vec<u8>)> = split_parameters(value.as_bytes())
        .into_iter()
        .skip(1)
        .filter(|(name, value)| !(name.is_empty() && value.is_empty()))
        .map(|(name, value)| {
            let name = name.to_ascii_lowercase();
            let value = if name == b"charset" {
                value.to_ascii_lowercase()
            } else {
                value
            };
            (name, value)
        })
        .collect();
    parameters.sort();
    for (name, value) in parameters {
        essence.extend_from_slice(format!(";{}:", name.len()).as_bytes());
        essence.extend_from_slice(&name);
        essence.extend_from_slice(format!("={}:", value.len()).as_bytes());
        essence.extend_from_slice(&value);
    }
    essence
}

/// The `;`-separated pieces of a header value as (name, value), a quoted
/// value unquoted: a `;` or `=` inside quotes belongs to the value, and a
/// backslash takes the next byte as it is. A piece without `=` is its
/// trimmed text as the name, with an empty value. The first piece is the
/// media type itself.
fn split_parameters(raw: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut pieces = Vec::new();
    let (mut name, mut value) = (Vec::new(), Vec::new());
    // In the value; inside its quotes; after a backslash there; the value
    // was quoted (kept as it is, whitespace after the quote dropped).
    let (mut in_value, mut quoted, mut escaped, mut was_quoted) = (false, false, false, false);
    for &b in raw {
        if quoted {
            if escaped {
                value.push(b);
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                quoted = false;
            } else {
                value.push(b);
            }
            continue;
        }
        match b {
            b';' => {
                pieces.push(finish_piece(&mut name, &mut value, was_quoted));
                (in_value, was_quoted) = (false, false);
            }
            b'=' if !in_value => in_value = true,
            b'"' if in_value && !was_quoted && value.iter().all(u8::is_ascii_whitespace) => {
                value.clear();
                (quoted, was_quoted) = (true, true);
            }
            _ if was_quoted && b.is_ascii_whitespace() => {}
            _ if in_value => value.push(b),
            _ => name.push(b),
        }
    }
    pieces.push(finish_piece(&mut name, &mut value, was_quoted));
    pieces
}

fn finish_piece(name: &mut Vec<u8>, value: &mut Vec<u8>, was_quoted: bool) -> (Vec<u8>, Vec<u8>) {
    let n = std::mem::take(name).trim_ascii().to_vec();
    let v = std::mem::take(value);
    // An unquoted value is trimmed; a quoted one is kept as it is.
    let v = if was_quoted {
        v
    } else {
        v.trim_ascii().to_vec()
    };
    (n, v)
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
        fingerprint(&parts, body.as_bytes(), &PayloadFingerprint::Whole)
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

    /// Bytes mean another text under another charset: the same bytes as
    /// `iso-8859-1` and as `koi8-r` are two requests. Parameters are
    /// compared as media types are: names and charset values without case,
    /// in any order, quoted or not. JSON is UTF-8 whatever it says.
    #[test]
    fn media_type_parameters_count_for_bodies_hashed_as_bytes() {
        let body = "\u{e9}t\u{e9}";
        assert_ne!(
            fp("text/plain; charset=iso-8859-1", body),
            fp("text/plain; charset=koi8-r", body)
        );
        assert_ne!(
            fp("text/plain; charset=koi8-r", body),
            fp("text/plain", body)
        );
        assert_eq!(
            fp("text/plain; charset=KOI8-R; format=flowed", body),
            fp("Text/Plain;Format=flowed ;CHARSET=\"koi8-r\"", body)
        );
        assert_ne!(
            fp("text/plain; format=flowed", body),
            fp("text/plain; format=Flowed", body),
            "values other than charset keep their case"
        );
        assert_eq!(
            fp("application/json; charset=utf-8", r#"{"a":1}"#),
            fp("application/json", r#"{"a":1}"#)
        );
        // A `;` or `=` inside a quoted value belongs to it.
        assert_ne!(
            fp(r#"text/plain; note="a;b""#, body),
            fp(r#"text/plain; note="a;c""#, body)
        );
        assert_ne!(
            fp(r#"multipart/form-data; boundary="x;1""#, body),
            fp(r#"multipart/form-data; boundary="x;2""#, body)
        );
        assert_ne!(
            fp(r#"text/plain; a="b=c""#, body),
            fp(r#"text/plain; a="b=d""#, body)
        );
        assert_eq!(
            fp(r#"text/plain; a="b\"c""#, body),
            fp(r#"text/plain; a="b\"c" "#, body)
        );
        assert_ne!(
            fp(r#"text/plain; a=" b""#, body),
            fp(r#"text/plain; a="b""#, body),
            "whitespace inside quotes counts"
        );
        // A piece without `=` is kept, never dropped.
        assert_ne!(
            fp("text/plain; flowed", body),
            fp("text/plain; fixed", body)
        );
    }
}
