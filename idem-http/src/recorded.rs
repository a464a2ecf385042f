//! What the layer records for a response, and the bodies it sends back.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use base64::Engine;
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONNECTION};
use http::{HeaderMap, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::{self, Serializer};
use serde::{Deserialize, Serialize};

use crate::{BoxError, LayerBody};

/// A response as recorded and replayed: the status, the headers but the
/// hop-by-hop and per-caller ones, and the body.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Recorded {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, Blob)>,
    pub(crate) body: Blob,
    /// The request headers the response varies on (`Vary`), each with the
    /// values the recorded request sent (none: it did not send it): a
    /// duplicate is replayed only if it sends the same.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) vary: Vec<(String, Option<Blob>)>,
}

/// The request headers a response varies on (lowercased), or `None` for
/// `Vary: *` (it varies on more than headers: never replayed).
pub(crate) fn varies_on(response: &HeaderMap) -> Option<Vec<String>> {
    let mut names = Vec::new();
    for value in response.get_all(http::header::VARY) {
        for name in value.as_bytes().split(|&b| b == b',') {
            let name = String::from_utf8_lossy(name.trim_ascii()).to_ascii_lowercase();
            if name == "*" {
                return None;
            }
            if !name.is_empty() && !names.contains(&name) {
                names.push(name);
            }
        }
    }
    Some(names)
}

/// The values a request sent for `name`, joined as one (`None`: not sent).
fn values_of(request: &HeaderMap, name: &str) -> Option<Blob> {
    let mut values = request.get_all(name).iter().peekable();
    values.peek()?;
    let mut joined = Vec::new();
    for (i, value) in values.enumerate() {
        if i > 0 {
            joined.extend_from_slice(b", ");
        }
        joined.extend_from_slice(value.as_bytes());
    }
    Some(Blob(Bytes::from(joined)))
}

/// Request headers that carry credentials: a response that varies on one
/// is recorded with the SHA-256 of the value the request sent, never the
/// value itself (a bearer token or a session cookie at rest in the store).
fn is_credential(name: &str) -> bool {
    matches!(name, "authorization" | "proxy-authorization" | "cookie")
}

/// What is recorded of, and compared with, a request's `name` values.
fn vary_value(request: &HeaderMap, name: &str) -> Option<Blob> {
    let sent = values_of(request, name)?;
    if !is_credential(name) {
        return Some(sent);
    }
    let digest = idem_core::Fingerprint::of_bytes(&sent.0).to_hex();
    Some(Blob(Bytes::from(format!("sha256:{digest}"))))
}

/// The framing of a body read whole: its `Content-Length` says the length
/// of the bytes that follow (a handler's or an upstream's that says
/// otherwise would cut the body, or leave its rest on the connection as
/// the next answer). A `HEAD` answer keeps its own (it has no body and its
/// length is the `GET`'s), and so do the statuses that never have a body
/// (1xx, `204`, `304`: a `304`'s length is the representation's).
pub(crate) fn frame_by_body(parts: &mut http::response::Parts, head: bool, len: usize) {
    let bodiless = parts.status.is_informational()
        || parts.status == http::StatusCode::NO_CONTENT
        || parts.status == http::StatusCode::NOT_MODIFIED;
    if head || bodiless {
        return;
    }
    let headers = &mut parts.headers;
    let says = headers.get(http::header::CONTENT_LENGTH);
    if says.is_some_and(|v| v.as_bytes() != len.to_string().as_bytes())
        || headers
            .get_all(http::header::CONTENT_LENGTH)
            .iter()
            .nth(1)
            .is_some()
    {
        headers.insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(len));
    }
}

impl Recorded {
    /// The copy of a response to record: `skip` and every header named in
    /// `Connection` are left out.
    pub(crate) fn of(
        status: StatusCode,
        headers: &HeaderMap,
        body: Bytes,
        skip: &[HeaderName],
        vary: &[String],
        request: &HeaderMap,
    ) -> Recorded {
        let named_in_connection: Vec<String> = headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(|name| name.trim().to_ascii_lowercase())
            .filter(|name| !name.is_empty())
            .collect();
        Recorded {
            status: status.as_u16(),
            headers: headers
                .iter()
                .filter(|(name, _)| {
                    !skip.contains(name) && !named_in_connection.iter().any(|n| n == name.as_str())
                })
                .map(|(name, value)| {
                    (
                        name.as_str().to_owned(),
                        Blob(Bytes::copy_from_slice(value.as_bytes())),
                    )
                })
                .collect(),
            body: Blob(body),
            vary: vary
                .iter()
                .map(|name| (name.clone(), vary_value(request, name)))
                .collect(),
        }
    }

    /// For the answer to a `HEAD` (`head`): its `Content-Length` (left out with the
    /// framing) is the length of the body a `GET` would get, not of its
    /// own empty body, so it is kept and the replay says it too.
    pub(crate) fn with_head_length_if(mut self, head: bool, headers: &HeaderMap) -> Recorded {
        if let Some(length) = headers.get(http::header::CONTENT_LENGTH).filter(|_| head) {
            self.headers.push((
                http::header::CONTENT_LENGTH.as_str().to_owned(),
                Blob(Bytes::copy_from_slice(length.as_bytes())),
            ));
        }
        self
    }

    /// Whether `request` sends what the recorded request sent for every
    /// header the response varies on.
    pub(crate) fn matches(&self, request: &HeaderMap) -> bool {
        self.vary
            .iter()
            .all(|(name, sent)| vary_value(request, name) == *sent)
    }

    /// The headers to replay; a name or value that does not parse (only a
    /// damaged record) is left out and logged.
    pub(crate) fn header_map(&self) -> HeaderMap {
        let mut map = HeaderMap::with_capacity(self.headers.len());
        for (name, value) in &self.headers {
            match (
                HeaderName::try_from(name.as_str()),
                HeaderValue::from_maybe_shared(value.0.clone()),
            ) {
                (Ok(name), Ok(value)) => {
                    map.append(name, value);
                }
                _ => {
                    tracing::warn!(header = %name, "idempotency layer: a recorded header does not parse; left out of the replay")
                }
            }
        }
        map
    }
}

/// What the handler's run leaves to record: the response, or why it is
/// not recordable. `NotRecordable` refuses to serialize, so the executor
/// completes the key with its "not replayable" marker: the handler ran, the
/// key is never released, and duplicates get
/// [`IdemError::ResultUnavailable`](idem_core::IdemError::ResultUnavailable).
#[derive(Debug)]
pub(crate) enum Outcome {
    Recorded(Recorded),
    NotRecordable(String),
}

impl Serialize for Outcome {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Outcome::Recorded(recorded) => recorded.serialize(serializer),
            Outcome::NotRecordable(reason) => Err(ser::Error::custom(reason)),
        }
    }
}

impl<'de> Deserialize<'de> for Outcome {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Recorded::deserialize(deserializer).map(Outcome::Recorded)
    }
}

/// Bytes (a body, a header value) as the codec likes them best: for a
/// human-readable codec (JSON), the text itself when it is UTF-8 (escaped by
/// the codec, not inflated by a third as base64 would), base64 when it is
/// not; for a binary codec, the bytes as they are.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Blob(pub(crate) Bytes);

impl fmt::Debug for Blob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Blob({} bytes)", self.0.len())
    }
}

const BLOB: &str = "Blob";

impl Serialize for Blob {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if serializer.is_human_readable() {
            match std::str::from_utf8(&self.0) {
                Ok(text) => serializer.serialize_newtype_variant(BLOB, 0, "text", text),
                Err(_) => serializer.serialize_newtype_variant(
                    BLOB,
                    1,
                    "base64",
                    &base64::engine::general_purpose::STANDARD.encode(&self.0),
                ),
            }
        } else {
            serializer.serialize_newtype_variant(BLOB, 2, "bytes", &RawBytes(&self.0))
        }
    }
}

struct RawBytes<'a>(&'a [u8]);

impl Serialize for RawBytes<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(self.0)
    }
}

#[derive(Deserialize)]
enum BlobRepr {
    #[serde(rename = "text")]
    Text(String),
    #[serde(rename = "base64")]
    Base64(String),
    #[serde(rename = "bytes")]
    Bytes(ByteBuf),
}

impl<'de> Deserialize<'de> for Blob {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(Blob(match BlobRepr::deserialize(deserializer)? {
            BlobRepr::Text(text) => Bytes::from(text),
            BlobRepr::Base64(b64) => base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map(Bytes::from)
                .map_err(de::Error::custom)?,
            BlobRepr::Bytes(ByteBuf(bytes)) => Bytes::from(bytes),
        }))
    }
}

/// Bytes from `serialize_bytes` (or a sequence of bytes, which is what a
/// self-describing format may give back).
struct ByteBuf(Vec<u8>);

impl<'de> Deserialize<'de> for ByteBuf {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ByteBuf;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<ByteBuf, E> {
                Ok(ByteBuf(v.to_vec()))
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<ByteBuf, E> {
                Ok(ByteBuf(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ByteBuf, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
                while let Some(b) = seq.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(ByteBuf(out))
            }
        }
        deserializer.deserialize_byte_buf(V)
    }
}

/// A response body read up to a limit.
pub(crate) enum Buffered {
    /// The whole body, within the limit.
    Complete(Bytes),
    /// The body went past the limit, or holds trailers: what was read,
    /// then the rest, to stream to the caller.
    Streamed {
        read: VecDeque<Frame<Bytes>>,
        rest: LayerBody,
        why: String,
    },
    /// The body failed after `read`.
    Failed {
        read: VecDeque<Frame<Bytes>>,
        error: BoxError,
    },
    /// The next frame was not there yet (with `stream`): the data frames
    /// read so far (`size` bytes, within the limit), then the rest.
    Pending {
        read: VecDeque<Frame<Bytes>>,
        size: usize,
        rest: LayerBody,
    },
}

/// Reads `body` while it is no longer than `limit` bytes. With `stream`,
/// stops at the first frame that is not there yet ([`Buffered::Pending`]):
/// a body that streams goes to its caller as it comes, not once it ended.
pub(crate) async fn buffer(mut body: LayerBody, limit: usize, stream: bool) -> Buffered {
    let mut read: VecDeque<Frame<Bytes>> = VecDeque::new();
    let mut size = 0usize;
    loop {
        let next = if stream {
            let polled =
                std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await;
            match polled {
                Poll::Ready(next) => next,
                Poll::Pending => {
                    return Buffered::Pending {
                        read,
                        size,
                        rest: body,
                    }
                }
            }
        } else {
            body.frame().await
        };
        match next {
            None => {
                let mut all = Vec::with_capacity(size);
                for frame in read {
                    if let Ok(data) = frame.into_data() {
                        all.extend_from_slice(&data);
                    }
                }
                return Buffered::Complete(Bytes::from(all));
            }
            Some(Ok(frame)) => {
                let is_data = frame.is_data();
                size = size.saturating_add(frame.data_ref().map_or(0, Bytes::len));
                read.push_back(frame);
                if !is_data {
                    return Buffered::Streamed {
                        read,
                        rest: body,
                        why: "the response has trailers, which are not recorded".to_owned(),
                    };
                }
                if size > limit {
                    return Buffered::Streamed {
                        read,
                        rest: body,
                        why: format!(
                            "the response body is larger than max_response_bytes ({limit} bytes)"
                        ),
                    };
                }
            }
            Some(Err(error)) => return Buffered::Failed { read, error },
        }
    }
}

/// The frames already read, then an error or the rest of the body.
pub(crate) struct Prefixed {
    read: VecDeque<Frame<Bytes>>,
    error: Option<BoxError>,
    rest: Option<LayerBody>,
}

impl Prefixed {
    pub(crate) fn new(
        read: VecDeque<Frame<Bytes>>,
        error: Option<BoxError>,
        rest: Option<LayerBody>,
    ) -> Self {
        Prefixed { read, error, rest }
    }
}

impl Body for Prefixed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(frame) = this.read.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        if let Some(error) = this.error.take() {
            return Poll::Ready(Some(Err(error)));
        }
        match this.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.read.is_empty()
            && self.error.is_none()
            && match &self.rest {
                Some(rest) => rest.is_end_stream(),
                None => true,
            }
    }

    fn size_hint(&self) -> SizeHint {
        let read: u64 = self
            .read
            .iter()
            .filter_map(|f| f.data_ref())
            .map(|d| d.len() as u64)
            .sum();
        let rest = match &self.rest {
            Some(rest) if self.error.is_none() => rest.size_hint(),
            _ => SizeHint::with_exact(0),
        };
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(read));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(read));
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{Codec, JsonCodec};

    #[test]
    fn text_is_kept_as_text_and_other_bytes_as_base64() {
        let codec = JsonCodec;
        let text = Blob(Bytes::from_static(b"{\"a\":\"caf\xc3\xa9\"}"));
        let encoded = codec.encode(&text).unwrap_or_default();
        assert_eq!(encoded, r#"{"text":"{\"a\":\"café\"}"}"#.as_bytes());
        let binary = Blob(Bytes::from_static(b"caf\xe9\x00\xff"));
        let encoded = codec.encode(&binary).unwrap_or_default();
        assert!(encoded.starts_with(br#"{"base64":"#));
        for blob in [text, binary, Blob(Bytes::new())] {
            let encoded = codec.encode(&blob).unwrap_or_default();
            let decoded: Option<Blob> = codec.decode(&encoded).ok();
            assert_eq!(decoded, Some(blob));
        }
    }

    #[test]
    fn a_not_recordable_outcome_does_not_encode() {
        let codec = JsonCodec;
        assert!(codec
            .encode(&Outcome::NotRecordable("streamed".into()))
            .is_err());
        let recorded = Outcome::Recorded(Recorded {
            status: 201,
            headers: vec![("x".into(), Blob(Bytes::from_static(b"\xe9")))],
            body: Blob(Bytes::from_static(b"ok")),
            vary: Vec::new(),
        });
        let encoded = codec.encode(&recorded).unwrap_or_default();
        let decoded: Option<Outcome> = codec.decode(&encoded).ok();
        assert!(
            matches!(decoded, Some(Outcome::Recorded(r)) if r.status == 201 && r.body.0 == "ok")
        );
    }

    #[test]
    fn a_credential_varied_on_is_recorded_as_its_digest_and_still_matched() {
        let mut response = HeaderMap::new();
        response.insert(
            http::header::VARY,
            "Authorization, Accept"
                .parse()
                .unwrap_or_else(|_| unreachable!()),
        );
        let request = |token: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(
                http::header::AUTHORIZATION,
                http::HeaderValue::from_static(token),
            );
            h.insert(
                http::header::ACCEPT,
                http::HeaderValue::from_static("application/json"),
            );
            h
        };
        let vary = varies_on(&response).unwrap_or_default();
        let recorded = Recorded::of(
            StatusCode::OK,
            &response,
            Bytes::new(),
            &[],
            &vary,
            &request("Bearer secret-token"),
        );
        let stored = format!(
            "{:?}",
            recorded
                .vary
                .iter()
                .map(|(_, v)| v.as_ref().map(|b| b.0.clone()))
                .collect::<Vec<_>>()
        );
        assert!(
            !stored.contains("secret-token"),
            "the token is at rest: {stored}"
        );
        assert!(recorded.matches(&request("Bearer secret-token")));
        assert!(!recorded.matches(&request("Bearer forged-token")));
    }

    #[test]
    fn per_caller_and_connection_named_headers_are_not_recorded() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("set-cookie", "a=1"),
            ("connection", "close, X-Private"),
            ("x-private", "secret"),
            ("x-kept", "yes"),
            ("date", "today"),
        ] {
            headers.append(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        let skip = [
            http::header::SET_COOKIE,
            http::header::DATE,
            http::header::CONNECTION,
        ];
        let recorded = Recorded::of(
            StatusCode::OK,
            &headers,
            Bytes::new(),
            &skip,
            &[],
            &HeaderMap::new(),
        );
        let names: Vec<&str> = recorded.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, vec!["x-kept"]);
    }
}
