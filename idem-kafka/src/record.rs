//! The record as the handler gets it, where its key comes from, and the
//! typed errors of bad input.

use std::panic::AssertUnwindSafe;

use idem_core::{Fingerprint, IdempotencyKey, KeyError, PayloadFingerprint};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use serde::de::DeserializeOwned;

/// One Kafka record, as the handler gets it (an owned copy: the handler
/// runs in a task of its own).
///
/// ```
/// use idem_kafka::{KafkaRecord, RecordError};
///
/// let record = KafkaRecord {
///     key: Some(b"order-1".to_vec()),
///     payload: Some(br#"{"amount": 1999}"#.to_vec()),
///     headers: vec![("trace".to_owned(), Some(b"t-1".to_vec()))],
///     ..KafkaRecord::default()
/// };
/// assert_eq!(record.key_text(), Ok("order-1"));
/// assert_eq!(record.header_text("trace"), Ok("t-1"));
/// let amount: serde_json::Value = record.json().unwrap_or_default();
/// assert_eq!(amount["amount"], 1999);
/// assert!(matches!(record.header_text("missing"), Err(RecordError::NoHeader(_))));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KafkaRecord {
    /// The topic it was read from.
    pub topic: String,
    /// Its partition.
    pub partition: i32,
    /// Its offset in the partition.
    pub offset: i64,
    /// The record key (`None`: a record without a key).
    pub key: Option<Vec<u8>>,
    /// The value (`None`: a tombstone).
    pub payload: Option<Vec<u8>>,
    /// The headers, in order (a name may appear more than once; a value
    /// may be null).
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// The record's timestamp in milliseconds since the Unix epoch, if it
    /// has one.
    pub timestamp: Option<i64>,
    /// The acquisition's attempt number: 1, or more when an earlier run of
    /// this key was cut off (its consumer died) and its lease taken over.
    pub attempt: u32,
    /// The acquisition's fence: strictly greater than every earlier
    /// acquisition's of this key. Give it to a downstream system that
    /// refuses lower fences.
    pub fence: u64,
}

impl KafkaRecord {
    /// The value of the first header named `name` (`None` if there is no
    /// such header, or its value is null).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_deref())
    }

    /// The first header named `name` as UTF-8 text.
    pub fn header_text(&self, name: &str) -> Result<&str, RecordError> {
        let value = self
            .header(name)
            .ok_or_else(|| RecordError::NoHeader(name.to_owned()))?;
        std::str::from_utf8(value).map_err(|_| RecordError::HeaderNotUtf8(name.to_owned()))
    }

    /// The record key as UTF-8 text.
    pub fn key_text(&self) -> Result<&str, RecordError> {
        let key = self.key.as_deref().ok_or(RecordError::NoKey)?;
        std::str::from_utf8(key).map_err(|_| RecordError::KeyNotUtf8)
    }

    /// The value as UTF-8 text.
    pub fn text(&self) -> Result<&str, RecordError> {
        let payload = self.payload.as_deref().ok_or(RecordError::NoPayload)?;
        std::str::from_utf8(payload).map_err(|_| RecordError::PayloadNotUtf8)
    }

    /// The value parsed as JSON. A handler that returns this error (or a
    /// `Box<dyn Error + Send + Sync>` holding it) has its record
    /// dead-lettered at once: the same bytes never parse.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, RecordError> {
        let payload = self.payload.as_deref().ok_or(RecordError::NoPayload)?;
        serde_json::from_slice(payload).map_err(|e| RecordError::Json(e.to_string()))
    }

    /// An owned copy of a message as read, or why it cannot be given to
    /// the handler. rdkafka panics on a header name that is not UTF-8
    /// (`Headers::get`); that panic is caught here and becomes
    /// [`RecordError::HeaderNameNotUtf8`], and the record is dead-lettered
    /// without its headers.
    pub(crate) fn read(message: &BorrowedMessage<'_>) -> (KafkaRecord, Option<RecordError>) {
        let mut record = KafkaRecord {
            topic: message.topic().to_owned(),
            partition: message.partition(),
            offset: message.offset(),
            key: message.key().map(<[u8]>::to_vec),
            payload: message.payload().map(<[u8]>::to_vec),
            headers: Vec::new(),
            timestamp: message.timestamp().to_millis(),
            attempt: 0,
            fence: 0,
        };
        let headers = std::panic::catch_unwind(AssertUnwindSafe(|| {
            message
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default()
        }));
        match headers {
            Ok(headers) => {
                record.headers = headers;
                (record, None)
            }
            Err(_) => (record, Some(RecordError::HeaderNameNotUtf8)),
        }
    }
}

/// Bad input: a record the handler cannot use. Never a panic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// The key comes from the record key, and the record has none.
    #[error("the record has no key")]
    NoKey,
    /// The record key is not UTF-8.
    #[error("the record key is not UTF-8")]
    KeyNotUtf8,
    /// No header of that name (or its value is null).
    #[error("the record has no header {0:?} with a value")]
    NoHeader(String),
    /// The header's value is not UTF-8.
    #[error("the value of the header {0:?} is not UTF-8")]
    HeaderNotUtf8(String),
    /// A header name is not UTF-8 (the Kafka protocol says it is a string;
    /// rdkafka cannot read it).
    #[error("a header name of the record is not UTF-8")]
    HeaderNameNotUtf8,
    /// The record has no value (a tombstone).
    #[error("the record has no value")]
    NoPayload,
    /// The value is not UTF-8.
    #[error("the record value is not UTF-8")]
    PayloadNotUtf8,
    /// The value does not parse as the JSON the handler expects.
    #[error("the record value does not parse: {0}")]
    Json(String),
    /// The key read from the record is not a valid idempotency key (empty,
    /// over 512 bytes, a control character).
    #[error("invalid idempotency key: {0}")]
    Key(#[from] KeyError),
}

/// Where a record's idempotency key comes from: set with
/// [`KafkaConsumer::key_from_record_key`](crate::KafkaConsumer::key_from_record_key),
/// [`key_header`](crate::KafkaConsumer::key_header) or
/// [`key_from_content`](crate::KafkaConsumer::key_from_content).
///
/// ```
/// use idem_kafka::KeySource;
///
/// assert_ne!(KeySource::RecordKey, KeySource::Header("message-id".to_owned()));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// The record key, as UTF-8 (the default). Only right when the
    /// producer gives each message a key of its own: a key that names an
    /// entity (an account ID) would make its second message a duplicate
    /// of the first.
    RecordKey,
    /// The first header of this name (a message ID set by the producer).
    Header(String),
    /// A SHA-256 of the record key and value: copies sent with identical
    /// content share a key. Headers are left out (they often carry a
    /// per-send trace ID). With a [`fingerprint`](crate::KafkaConsumer::fingerprint)
    /// of parts of the value, the value counts by those parts: copies that
    /// differ elsewhere share a key.
    Content,
}

impl KeySource {
    pub(crate) fn key_of(
        &self,
        scope: &str,
        record: &KafkaRecord,
        what: &PayloadFingerprint,
    ) -> Result<IdempotencyKey, RecordError> {
        match self {
            KeySource::RecordKey => {
                let key = record.key.as_deref().ok_or(RecordError::NoKey)?;
                if std::str::from_utf8(key).is_err() {
                    return Err(RecordError::KeyNotUtf8);
                }
                Ok(IdempotencyKey::from_utf8(scope, key)?)
            }
            KeySource::Header(name) => {
                let value = record.header_text(name)?;
                Ok(IdempotencyKey::new(scope, value)?)
            }
            KeySource::Content => {
                let hash = Fingerprint::of_bytes(&content_bytes(record, what)).to_hex();
                Ok(IdempotencyKey::new(scope, hash)?)
            }
        }
    }
}

/// The record key and value, each with a presence byte and its length:
/// no two different (key, value) pairs give the same bytes. With `what`
/// other than the whole payload, the value stands as its fingerprint (the
/// part that counts), after a byte 2.
fn content_bytes(record: &KafkaRecord, what: &PayloadFingerprint) -> Vec<u8> {
    let mut out = Vec::new();
    let value_part;
    let value = match record.payload.as_deref() {
        Some(value) if !what.is_whole() => {
            out.push(2);
            value_part = what.fingerprint(value);
            Some(value_part.as_bytes().as_slice())
        }
        value => value,
    };
    for part in [record.key.as_deref(), value] {
        match part {
            None => out.push(0),
            Some(bytes) => {
                out.push(1);
                out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
                out.extend_from_slice(bytes);
            }
        }
    }
    out
}

/// The fingerprint of a tombstone (a record without a value): 32 zero
/// bytes, the SHA-256 of no known input, so never the fingerprint of a
/// value (an empty value's is SHA-256 of nothing). A record with a value
/// after a tombstone of its key is a mismatch, not the tombstone's replay.
const TOMBSTONE: Fingerprint = Fingerprint::from_array([0; 32]);

/// The fingerprint of a record: of its value's bytes (the whole value, or
/// the part `what` selects), or [`TOMBSTONE`] when it has no value.
pub(crate) fn fingerprint_of(
    record: &KafkaRecord,
    what: &PayloadFingerprint,
) -> Option<Fingerprint> {
    Some(
        record
            .payload
            .as_deref()
            .map_or(TOMBSTONE, |value| what.fingerprint(value)),
    )
}

/// The default scope of a topic's keys: `kafka.{topic}` when that is a
/// valid scope, else `kafka:` and the first 24 bytes of the SHA-256 of the
/// name in hex. Two topics never share a default scope.
///
/// ```
/// use idem_kafka::default_scope;
///
/// assert_eq!(default_scope("payments"), "kafka.payments");
/// assert!(default_scope(&"t".repeat(200)).starts_with("kafka:"));
/// ```
pub fn default_scope(topic: &str) -> String {
    let scope = format!("kafka.{topic}");
    if IdempotencyKey::new(scope.clone(), "x").is_ok() {
        return scope;
    }
    let hash = Fingerprint::of_bytes(topic.as_bytes()).to_hex();
    format!("kafka:{}", &hash[..48])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: Option<&[u8]>, payload: Option<&[u8]>) -> KafkaRecord {
        KafkaRecord {
            key: key.map(<[u8]>::to_vec),
            payload: payload.map(<[u8]>::to_vec),
            ..KafkaRecord::default()
        }
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        let r = record(None, Some(b"x"));
        assert_eq!(
            KeySource::RecordKey
                .key_of("s", &r, &PayloadFingerprint::Whole)
                .err(),
            Some(RecordError::NoKey)
        );
        let r = record(Some(b"\xff\xfe"), Some(b"x"));
        assert_eq!(
            KeySource::RecordKey
                .key_of("s", &r, &PayloadFingerprint::Whole)
                .err(),
            Some(RecordError::KeyNotUtf8)
        );
        let r = record(Some(b""), None);
        assert!(matches!(
            KeySource::RecordKey.key_of("s", &r, &PayloadFingerprint::Whole),
            Err(RecordError::Key(_))
        ));
        let mut r = record(Some(b"k"), Some(b"{not json"));
        r.headers = vec![
            ("id".to_owned(), Some(b"\xff".to_vec())),
            ("null".to_owned(), None),
        ];
        assert_eq!(
            KeySource::Header("id".into())
                .key_of("s", &r, &PayloadFingerprint::Whole)
                .err(),
            Some(RecordError::HeaderNotUtf8("id".into()))
        );
        assert_eq!(
            KeySource::Header("null".into())
                .key_of("s", &r, &PayloadFingerprint::Whole)
                .err(),
            Some(RecordError::NoHeader("null".into()))
        );
        assert!(matches!(
            r.json::<serde_json::Value>(),
            Err(RecordError::Json(_))
        ));
        assert_eq!(record(None, None).text(), Err(RecordError::NoPayload));
    }

    #[test]
    fn content_keys_tell_key_and_value_apart() {
        let a = KeySource::Content.key_of(
            "s",
            &record(Some(b"ab"), Some(b"c")),
            &PayloadFingerprint::Whole,
        );
        let b = KeySource::Content.key_of(
            "s",
            &record(Some(b"a"), Some(b"bc")),
            &PayloadFingerprint::Whole,
        );
        let c =
            KeySource::Content.key_of("s", &record(None, Some(b"abc")), &PayloadFingerprint::Whole);
        let a2 = KeySource::Content.key_of(
            "s",
            &record(Some(b"ab"), Some(b"c")),
            &PayloadFingerprint::Whole,
        );
        assert!(a.is_ok() && b.is_ok() && c.is_ok());
        assert_ne!(a, b);
        assert_ne!(b, c);
        assert_eq!(a, a2);
    }

    #[test]
    fn default_scopes_are_valid() {
        assert_eq!(default_scope("orders"), "kafka.orders");
        let long = "t".repeat(249);
        let s = default_scope(&long);
        assert!(IdempotencyKey::new(s.clone(), "x").is_ok(), "{s}");
        assert_ne!(default_scope(&long), default_scope(&"u".repeat(249)));
    }
}
