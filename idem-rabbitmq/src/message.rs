//! The message as the handler gets it, where its key comes from, and the
//! typed errors of bad input.

use idem_core::{Fingerprint, IdempotencyKey, KeyError, PayloadFingerprint};
use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use serde::de::DeserializeOwned;

/// The header RabbitMQ's quorum queues count a message's earlier
/// deliveries in.
pub const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// One AMQP message, as the handler gets it (an owned copy: the handler
/// runs in a task of its own).
///
/// ```
/// use idem_rabbitmq::{MessageError, RabbitMessage};
/// use idem_rabbitmq::lapin::types::{AMQPValue, FieldTable};
/// use idem_rabbitmq::lapin::BasicProperties;
///
/// let mut headers = FieldTable::default();
/// headers.insert("order".into(), AMQPValue::LongString("o-7".into()));
/// let message = RabbitMessage {
///     body: br#"{"amount": 1999}"#.to_vec(),
///     properties: BasicProperties::default().with_headers(headers),
///     ..RabbitMessage::default()
/// };
/// assert_eq!(message.header_text("order").as_deref(), Ok("o-7"));
/// let amount: serde_json::Value = message.json().unwrap_or_default();
/// assert_eq!(amount["amount"], 1999);
/// assert!(matches!(message.header_text("missing"), Err(MessageError::NoHeader(_))));
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RabbitMessage {
    /// The body, as published.
    pub body: Vec<u8>,
    /// Its properties (`message_id`, `headers`, `content_type`, ...).
    pub properties: BasicProperties,
    /// The exchange it was published to (empty: the default exchange).
    pub exchange: String,
    /// The routing key it was published with.
    pub routing_key: String,
    /// Whether the broker delivered it before (to this consumer or another).
    pub redelivered: bool,
    /// How many times the broker delivered it, this delivery included, as
    /// its `x-delivery-count` header says (plus one; quorum queues set it
    /// from the second delivery on); `None` without one. Informational:
    /// a publisher may set the header, and the consumer counts failures
    /// in the store instead.
    pub delivery_count: Option<u32>,
    /// The acquisition's attempt number: 1, or more when an earlier run of
    /// this key was cut off (its process died) and its lease taken over.
    pub attempt: u32,
    /// The acquisition's fence: strictly greater than every earlier
    /// acquisition's of this key. Give it to a downstream system that
    /// refuses lower fences.
    pub fence: u64,
}

impl RabbitMessage {
    /// The `message_id` property, if it is set and not empty.
    pub fn message_id(&self) -> Option<&str> {
        self.properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str())
            .filter(|id| !id.is_empty())
    }

    /// The header named `name`.
    pub fn header(&self, name: &str) -> Option<&AMQPValue> {
        header_of(self.properties.headers().as_ref(), name)
    }

    /// The header named `name` as text: a string header (long or short)
    /// that is UTF-8, or a number written in decimal.
    pub fn header_text(&self, name: &str) -> Result<String, MessageError> {
        let value = self
            .header(name)
            .ok_or_else(|| MessageError::NoHeader(name.to_owned()))?;
        let not_text = || MessageError::HeaderNotText(name.to_owned());
        Ok(match value {
            AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes())
                .map_err(|_| not_text())?
                .to_owned(),
            AMQPValue::ShortString(s) => s.as_str().to_owned(),
            AMQPValue::ByteArray(b) => std::str::from_utf8(b.as_slice())
                .map_err(|_| not_text())?
                .to_owned(),
            other => match integer(other) {
                Some(n) => n.to_string(),
                None => return Err(not_text()),
            },
        })
    }

    /// The body as UTF-8 text.
    pub fn text(&self) -> Result<&str, MessageError> {
        std::str::from_utf8(&self.body).map_err(|_| MessageError::NotUtf8)
    }

    /// The body parsed as JSON. A handler that returns this error (or a
    /// `Box<dyn Error + Send + Sync>` holding it) has its message
    /// dead-lettered at once: the same bytes never parse.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, MessageError> {
        serde_json::from_slice(&self.body).map_err(|e| MessageError::Json(e.to_string()))
    }

    /// An owned copy of a delivery (its body moved, not copied), and the
    /// delivery's acker.
    pub(crate) fn read(delivery: Delivery) -> (RabbitMessage, lapin::Acker) {
        let delivery_count = header_of(
            delivery.properties.headers().as_ref(),
            DELIVERY_COUNT_HEADER,
        )
        .and_then(integer)
        .and_then(|n| u32::try_from(n).ok())
        .map(|n| n.saturating_add(1));
        let message = RabbitMessage {
            body: delivery.data,
            exchange: delivery.exchange.to_string(),
            routing_key: delivery.routing_key.to_string(),
            redelivered: delivery.redelivered,
            properties: delivery.properties,
            delivery_count,
            attempt: 0,
            fence: 0,
        };
        (message, delivery.acker)
    }
}

fn header_of<'a>(headers: Option<&'a FieldTable>, name: &str) -> Option<&'a AMQPValue> {
    headers?.inner().get(name)
}

/// An integer header, whatever its AMQP width.
pub(crate) fn integer(value: &AMQPValue) -> Option<i128> {
    Some(match value {
        AMQPValue::ShortShortInt(n) => i128::from(*n),
        AMQPValue::ShortShortUInt(n) => i128::from(*n),
        AMQPValue::ShortInt(n) => i128::from(*n),
        AMQPValue::ShortUInt(n) => i128::from(*n),
        AMQPValue::LongInt(n) => i128::from(*n),
        AMQPValue::LongUInt(n) => i128::from(*n),
        AMQPValue::LongLongInt(n) => i128::from(*n),
        AMQPValue::Timestamp(n) => i128::from(*n),
        _ => return None,
    })
}

/// Bad input: a message the handler cannot use. Never a panic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// The key is the `message_id` property, and the message has none.
    #[error("the message has no message_id property")]
    NoMessageId,
    /// No header of that name.
    #[error("the message has no header {0:?}")]
    NoHeader(String),
    /// The header is not text (a table, an array, a float, bytes that are
    /// not UTF-8).
    #[error("the message header {0:?} is not text")]
    HeaderNotText(String),
    /// The body is not UTF-8.
    #[error("the message body is not UTF-8")]
    NotUtf8,
    /// The body does not parse as the JSON the handler expects.
    #[error("the message body does not parse: {0}")]
    Json(String),
    /// The key read from the message is not a valid key (empty, over 512
    /// bytes, control characters).
    #[error("{0}")]
    Key(#[from] KeyError),
}

/// Where a message's idempotency key comes from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum KeySource {
    /// The `message_id` property, as the publisher set it (the default; a
    /// message without one is dead-lettered: it has no usable key).
    #[default]
    MessageId,
    /// A header of the publisher's choice (text, or an integer).
    Header(String),
    /// A SHA-256 of the body: copies of the same body are duplicates,
    /// whatever their properties.
    Content,
}

impl KeySource {
    /// The key of `message` in `scope`.
    ///
    /// ```
    /// use idem_rabbitmq::{KeySource, MessageError, RabbitMessage};
    /// let message = RabbitMessage::default();
    /// assert_eq!(KeySource::MessageId.key_of("s", &message).err(), Some(MessageError::NoMessageId));
    /// assert!(KeySource::Content.key_of("s", &message).is_ok());
    /// ```
    pub fn key_of(
        &self,
        scope: &str,
        message: &RabbitMessage,
    ) -> Result<IdempotencyKey, MessageError> {
        match self {
            KeySource::MessageId => {
                let id = message.message_id().ok_or(MessageError::NoMessageId)?;
                Ok(IdempotencyKey::new(scope, id)?)
            }
            KeySource::Header(name) => Ok(IdempotencyKey::new(scope, message.header_text(name)?)?),
            KeySource::Content => {
                let hash = Fingerprint::of_bytes(&message.body).to_hex();
                Ok(IdempotencyKey::new(scope, hash)?)
            }
        }
    }

    /// The key, where a key from the content with a fingerprint of parts
    /// of the body is the hash of those parts (copies that differ
    /// elsewhere share a key, as they share a fingerprint).
    pub(crate) fn key_with(
        &self,
        scope: &str,
        message: &RabbitMessage,
        fingerprint: &PayloadFingerprint,
    ) -> Result<IdempotencyKey, MessageError> {
        if matches!(self, KeySource::Content) && !fingerprint.is_whole() {
            let hash = fingerprint.fingerprint(&message.body).to_hex();
            return Ok(IdempotencyKey::new(scope, hash)?);
        }
        self.key_of(scope, message)
    }
}

/// The default scope of a queue's keys: `amqp.{queue}` when that is a
/// valid scope, else `amqp:` and a hash of the name (a queue name may hold
/// characters a scope may not, or be longer).
///
/// ```
/// assert_eq!(idem_rabbitmq::default_scope("payments"), "amqp.payments");
/// assert!(idem_rabbitmq::default_scope("pay ments").starts_with("amqp:"));
/// ```
pub fn default_scope(queue: &str) -> String {
    let scope = format!("amqp.{queue}");
    if IdempotencyKey::new(scope.clone(), "x").is_ok() {
        return scope;
    }
    let hash = Fingerprint::of_bytes(queue.as_bytes()).to_hex();
    format!("amqp:{}", &hash[..48])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_headers(pairs: &[(&str, AMQPValue)]) -> RabbitMessage {
        let mut headers = FieldTable::default();
        for (k, v) in pairs {
            headers.insert((*k).into(), v.clone());
        }
        RabbitMessage {
            properties: BasicProperties::default().with_headers(headers),
            ..RabbitMessage::default()
        }
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        let m = with_headers(&[
            ("bytes", AMQPValue::LongString(vec![0xff, 0xfe].into())),
            ("float", AMQPValue::Double(1.5)),
            ("long", AMQPValue::LongString("k".repeat(513).into())),
            ("empty", AMQPValue::LongString("".into())),
            ("n", AMQPValue::LongLongInt(-42)),
        ]);
        let by = |name: &str| KeySource::Header(name.to_owned()).key_of("s", &m);
        assert_eq!(
            by("nope").err(),
            Some(MessageError::NoHeader("nope".into()))
        );
        assert_eq!(
            by("bytes").err(),
            Some(MessageError::HeaderNotText("bytes".into()))
        );
        assert_eq!(
            by("float").err(),
            Some(MessageError::HeaderNotText("float".into()))
        );
        assert!(matches!(
            by("long"),
            Err(MessageError::Key(KeyError::IdTooLong { .. }))
        ));
        assert!(matches!(by("empty"), Err(MessageError::Key(_))));
        assert_eq!(by("n").map(|k| k.id().to_owned()), Ok("-42".to_owned()));
        let empty_id = RabbitMessage {
            properties: BasicProperties::default().with_message_id("".into()),
            ..RabbitMessage::default()
        };
        assert_eq!(
            KeySource::MessageId.key_of("s", &empty_id).err(),
            Some(MessageError::NoMessageId)
        );
        let not_utf8 = RabbitMessage {
            body: vec![0xff],
            ..RabbitMessage::default()
        };
        assert_eq!(not_utf8.text().err(), Some(MessageError::NotUtf8));
        assert!(matches!(not_utf8.json::<u8>(), Err(MessageError::Json(_))));
        assert!(KeySource::Content.key_of("s", &not_utf8).is_ok());
    }

    #[test]
    fn content_keys_ignore_properties() {
        let a = RabbitMessage {
            body: b"x".to_vec(),
            ..with_headers(&[("t", AMQPValue::LongInt(1))])
        };
        let b = RabbitMessage {
            body: b"x".to_vec(),
            ..with_headers(&[("t", AMQPValue::LongInt(2))])
        };
        let c = RabbitMessage {
            body: b"y".to_vec(),
            ..RabbitMessage::default()
        };
        let key = |m: &RabbitMessage| KeySource::Content.key_of("s", m);
        assert_eq!(key(&a), key(&b));
        assert_ne!(key(&a), key(&c));
    }

    #[test]
    fn scopes_of_any_queue_name_are_valid() {
        for name in ["", "a b", &"q".repeat(255), "ünï", "a/b"] {
            let scope = default_scope(name);
            assert!(
                IdempotencyKey::new(scope.clone(), "x").is_ok(),
                "{name:?} -> {scope}"
            );
        }
    }
}
