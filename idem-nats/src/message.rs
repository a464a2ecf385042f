//! The message as the handler gets it, where its key comes from, and the
//! typed errors of bad input.

use std::str::FromStr;

use async_nats::{HeaderMap, HeaderName};
use bytes::Bytes;
use idem_core::{Fingerprint, IdempotencyKey, KeyError, PayloadFingerprint};
use serde::de::DeserializeOwned;

/// The header JetStream deduplicates publishes by, and the default key of
/// a message ([`KeySource::MessageId`]).
pub const MESSAGE_ID_HEADER: &str = "Nats-Msg-Id";

/// One JetStream message, as the handler gets it (an owned copy: the
/// handler runs in a task of its own).
///
/// ```
/// use idem_nats::{MessageError, NatsMessage};
///
/// let mut headers = idem_nats::async_nats::HeaderMap::new();
/// headers.insert("Nats-Msg-Id", "order-7");
/// let message = NatsMessage {
///     subject: "orders.created".to_owned(),
///     payload: r#"{"amount": 1999}"#.into(),
///     headers,
///     ..NatsMessage::default()
/// };
/// assert_eq!(message.header("Nats-Msg-Id"), Some("order-7"));
/// let body: serde_json::Value = message.json().unwrap_or_default();
/// assert_eq!(body["amount"], 1999);
/// assert!(matches!(message.header_text("missing"), Err(MessageError::NoHeader(_))));
/// ```
#[derive(Debug, Clone, Default)]
pub struct NatsMessage {
    /// The subject it was published to.
    pub subject: String,
    /// The payload.
    pub payload: Bytes,
    /// Its headers (empty when it has none).
    pub headers: HeaderMap,
    /// The stream it is stored in.
    pub stream: String,
    /// Its sequence in the stream: the same on every redelivery.
    pub stream_sequence: u64,
    /// How many times the JetStream consumer delivered it, this delivery
    /// included (the message metadata's delivery count; `None` when its
    /// reply subject did not carry one).
    pub delivered: Option<u32>,
    /// The acquisition's attempt number: 1, or more when an earlier run of
    /// this key was cut off (its process died) and its lease taken over.
    pub attempt: u32,
    /// The acquisition's fence: strictly greater than every earlier
    /// acquisition's of this key. Give it to a downstream system that
    /// refuses lower fences.
    pub fence: u64,
}

impl NatsMessage {
    /// The (first) value of the header `name`; `None` too when `name` is
    /// not a valid header name (empty, whitespace, ':', a control or
    /// non-ASCII character), which no message carries.
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = HeaderName::from_str(name).ok()?;
        self.headers.get(name).map(|v| v.as_str())
    }

    /// The value of the header `name`, or [`MessageError::NoHeader`]
    /// (also for a name that is not valid: see [`header`](Self::header)).
    pub fn header_text(&self, name: &str) -> Result<&str, MessageError> {
        self.header(name)
            .ok_or_else(|| MessageError::NoHeader(name.to_owned()))
    }

    /// The payload as UTF-8 text.
    pub fn text(&self) -> Result<&str, MessageError> {
        std::str::from_utf8(&self.payload).map_err(|_| MessageError::NotText)
    }

    /// The payload parsed as JSON. A handler that returns this error (or a
    /// `Box<dyn Error + Send + Sync>` holding it) has its message
    /// dead-lettered at once: the same bytes never parse.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, MessageError> {
        serde_json::from_slice(&self.payload).map_err(|e| MessageError::Json(e.to_string()))
    }

    /// An owned copy of a message as delivered.
    pub(crate) fn read(message: &async_nats::jetstream::Message) -> NatsMessage {
        let (stream, stream_sequence, delivered) = match message.info() {
            Ok(info) => (
                info.stream.to_owned(),
                info.stream_sequence,
                u32::try_from(info.delivered).ok().filter(|n| *n > 0),
            ),
            Err(_) => (String::new(), 0, None),
        };
        NatsMessage {
            subject: message.subject.to_string(),
            payload: message.payload.clone(),
            headers: message.headers.clone().unwrap_or_default(),
            stream,
            stream_sequence,
            delivered,
            attempt: 0,
            fence: 0,
        }
    }
}

/// Bad input: a message the handler cannot use. Never a panic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// The key is the `Nats-Msg-Id` header, and the message has none.
    #[error("the message has no Nats-Msg-Id header")]
    NoMessageId,
    /// No header of that name.
    #[error("the message has no header {0:?}")]
    NoHeader(String),
    /// The payload is not UTF-8.
    #[error("the message payload is not UTF-8 text")]
    NotText,
    /// The payload does not parse as the JSON the handler expects.
    #[error("the message payload does not parse: {0}")]
    Json(String),
    /// The key read from the message is not a valid idempotency key
    /// (empty, over 512 bytes, a control character).
    #[error("{0}")]
    Key(#[from] KeyError),
}

/// Where a message's idempotency key comes from: set with
/// [`NatsConsumer::key_header`](crate::NatsConsumer::key_header),
/// [`key_from_message_id`](crate::NatsConsumer::key_from_message_id) or
/// [`key_from_content`](crate::NatsConsumer::key_from_content).
///
/// ```
/// use idem_nats::KeySource;
///
/// assert_eq!(KeySource::default(), KeySource::MessageId);
/// assert_ne!(KeySource::Content, KeySource::Header("Order-Id".to_owned()));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum KeySource {
    /// The `Nats-Msg-Id` header (the default): the ID the publisher gave
    /// the message, which JetStream also deduplicates publishes by within
    /// the stream's duplicate window. Past that window, a resend with the
    /// same ID is a duplicate here too.
    #[default]
    MessageId,
    /// The value of this header.
    Header(String),
    /// A SHA-256 of the payload: copies published with the same payload
    /// share a key. Headers are left out (they often carry a per-send
    /// trace ID).
    Content,
}

impl KeySource {
    /// The key of `message` in `scope`, or why it has none.
    ///
    /// ```
    /// use idem_nats::{KeySource, MessageError, NatsMessage};
    ///
    /// let mut message = NatsMessage { payload: "{}".into(), ..NatsMessage::default() };
    /// assert_eq!(KeySource::MessageId.key_of("nats.orders", &message), Err(MessageError::NoMessageId));
    /// message.headers.insert("Nats-Msg-Id", "m-1");
    /// let key = KeySource::MessageId.key_of("nats.orders", &message).expect("a message ID");
    /// assert_eq!(key.id(), "m-1");
    /// ```
    pub fn key_of(
        &self,
        scope: &str,
        message: &NatsMessage,
    ) -> Result<IdempotencyKey, MessageError> {
        match self {
            KeySource::MessageId => {
                let id = message
                    .header(MESSAGE_ID_HEADER)
                    .ok_or(MessageError::NoMessageId)?;
                Ok(IdempotencyKey::new(scope, id)?)
            }
            KeySource::Header(name) => {
                let value = message.header_text(name)?;
                Ok(IdempotencyKey::new(scope, value)?)
            }
            KeySource::Content => {
                let hash = Fingerprint::of_bytes(&message.payload).to_hex();
                Ok(IdempotencyKey::new(scope, hash)?)
            }
        }
    }
}

/// Whether `name` is a header name NATS takes: not empty, printable
/// ASCII, no whitespace and no ':'.
pub(crate) fn is_header_name(name: &str) -> bool {
    !name.is_empty() && HeaderName::from_str(name).is_ok()
}

/// The fingerprint of a message: the SHA-256 of its payload (the whole
/// payload, or the part `what` selects).
pub(crate) fn fingerprint_of(message: &NatsMessage, what: &PayloadFingerprint) -> Fingerprint {
    what.fingerprint(&message.payload)
}

/// The default scope of a durable consumer's keys: `nats.{stream}.{durable}`
/// when that is a valid scope, else `nats:` and the first 24 bytes of the
/// SHA-256 of both names in hex. Two consumers never share a default
/// scope.
///
/// ```
/// use idem_nats::default_scope;
///
/// assert_eq!(default_scope("ORDERS", "billing"), "nats.ORDERS.billing");
/// assert!(default_scope(&"S".repeat(60), "d").starts_with("nats:"));
/// ```
pub fn default_scope(stream: &str, durable: &str) -> String {
    let scope = format!("nats.{stream}.{durable}");
    if IdempotencyKey::new(scope.clone(), "x").is_ok() {
        return scope;
    }
    let hash = Fingerprint::of_bytes(format!("{stream}\n{durable}").as_bytes()).to_hex();
    format!("nats:{}", &hash[..48])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(payload: &str, headers: &[(&str, &str)]) -> NatsMessage {
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.insert(*k, *v);
        }
        NatsMessage {
            payload: Bytes::copy_from_slice(payload.as_bytes()),
            headers: map,
            ..NatsMessage::default()
        }
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        let long = "k".repeat(513);
        let m = message("{", &[("long", long.as_str())]);
        let by = |name: &str| KeySource::Header(name.to_owned()).key_of("s", &m);
        assert_eq!(
            by("nope").err(),
            Some(MessageError::NoHeader("nope".into()))
        );
        assert!(matches!(
            by("long"),
            Err(MessageError::Key(KeyError::IdTooLong { .. }))
        ));
        assert_eq!(
            KeySource::MessageId.key_of("s", &m).err(),
            Some(MessageError::NoMessageId)
        );
        assert!(matches!(
            m.json::<serde_json::Value>(),
            Err(MessageError::Json(_))
        ));
        let binary = NatsMessage {
            payload: Bytes::from_static(&[0xff, 0xfe]),
            ..NatsMessage::default()
        };
        assert_eq!(binary.text(), Err(MessageError::NotText));
        // An empty payload has a key from its content all the same.
        assert!(KeySource::Content
            .key_of("s", &NatsMessage::default())
            .is_ok());
    }

    #[test]
    fn any_header_name_is_looked_up_without_a_panic() {
        let m = message("{}", &[("order-id", "o-1")]);
        for bad in ["order id", "a:b", "ordér", "", "tab\there", "line\n"] {
            assert_eq!(m.header(bad), None, "{bad:?}");
            assert_eq!(
                m.header_text(bad),
                Err(MessageError::NoHeader(bad.to_owned()))
            );
            assert!(!is_header_name(bad), "{bad:?}");
        }
        assert_eq!(m.header("order-id"), Some("o-1"));
        assert!(is_header_name("Order-Id"));
    }

    #[test]
    fn content_keys_ignore_headers() {
        let a = KeySource::Content.key_of("s", &message("x", &[("trace", "1")]));
        let b = KeySource::Content.key_of("s", &message("x", &[("trace", "2")]));
        let c = KeySource::Content.key_of("s", &message("y", &[]));
        assert!(a.is_ok() && c.is_ok());
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn default_scopes_are_distinct_and_valid() {
        assert_eq!(default_scope("ORDERS", "billing"), "nats.ORDERS.billing");
        let (a, b) = (
            default_scope(&"S".repeat(70), "d"),
            default_scope(&"S".repeat(69), "Sd"),
        );
        assert_ne!(a, b);
        for s in [&a, &b, &default_scope("a b", "c")] {
            assert!(s.starts_with("nats:") && s.len() == 53, "{s}");
            assert!(IdempotencyKey::new(s.clone(), "x").is_ok(), "{s}");
        }
    }
}
