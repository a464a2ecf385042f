//! The message as the handler gets it, where its key comes from, and the
//! typed errors of bad input.

use std::collections::HashMap;

use aws_sdk_sqs::types::{Message, MessageAttributeValue, MessageSystemAttributeName};
use idem_core::{Fingerprint, IdempotencyKey, KeyError, PayloadFingerprint};
use serde::de::DeserializeOwned;

/// One SQS message, as the handler gets it (an owned copy: the handler
/// runs in a task of its own).
///
/// ```
/// use idem_sqs::{MessageError, SqsMessage};
/// use idem_sqs::aws_sdk_sqs::types::MessageAttributeValue;
///
/// let trace = MessageAttributeValue::builder()
///     .data_type("String")
///     .string_value("t-1")
///     .build()
///     .expect("a data type is set");
/// let message = SqsMessage {
///     message_id: "5fea7756-0ea4-451a-a703-a558b933e274".to_owned(),
///     body: r#"{"amount": 1999}"#.to_owned(),
///     attributes: [("trace".to_owned(), trace)].into(),
///     ..SqsMessage::default()
/// };
/// assert_eq!(message.attribute_text("trace"), Ok("t-1"));
/// let amount: serde_json::Value = message.json().unwrap_or_default();
/// assert_eq!(amount["amount"], 1999);
/// assert!(matches!(message.attribute_text("missing"), Err(MessageError::NoAttribute(_))));
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SqsMessage {
    /// The message ID SQS gave it when it was sent (empty if the reply had
    /// none).
    pub message_id: String,
    /// The body (SQS bodies are text; an absent body is empty here).
    pub body: String,
    /// Its message attributes, by name.
    pub attributes: HashMap<String, MessageAttributeValue>,
    /// `ApproximateReceiveCount`: how many times SQS handed the message
    /// out, this delivery included (`None` when the reply had no count,
    /// or one that is not a positive number).
    pub receive_count: Option<u32>,
    /// The message group of a message of a FIFO queue.
    pub message_group_id: Option<String>,
    /// The acquisition's attempt number: 1, or more when an earlier run of
    /// this key was cut off (its process died) and its lease taken over.
    pub attempt: u32,
    /// The acquisition's fence: strictly greater than every earlier
    /// acquisition's of this key. Give it to a downstream system that
    /// refuses lower fences.
    pub fence: u64,
}

impl SqsMessage {
    /// The message attribute named `name`.
    pub fn attribute(&self, name: &str) -> Option<&MessageAttributeValue> {
        self.attributes.get(name)
    }

    /// The text of the message attribute named `name` (of type `String`
    /// or `Number`, custom types such as `String.uuid` included).
    pub fn attribute_text(&self, name: &str) -> Result<&str, MessageError> {
        let value = self
            .attribute(name)
            .ok_or_else(|| MessageError::NoAttribute(name.to_owned()))?;
        value
            .string_value()
            .ok_or_else(|| MessageError::AttributeNotText(name.to_owned()))
    }

    /// The body parsed as JSON. A handler that returns this error (or a
    /// `Box<dyn Error + Send + Sync>` holding it) has its message
    /// dead-lettered at once: the same bytes never parse.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, MessageError> {
        serde_json::from_str(&self.body).map_err(|e| MessageError::Json(e.to_string()))
    }

    /// An owned copy of a message as received, and its receipt handle.
    pub(crate) fn read(message: Message) -> (SqsMessage, Option<String>) {
        let receive_count = message
            .attributes
            .as_ref()
            .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
            .and_then(|n| n.trim().parse::<u32>().ok())
            .filter(|n| *n > 0);
        let message_group_id = message
            .attributes
            .as_ref()
            .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
            .cloned();
        let read = SqsMessage {
            message_id: message.message_id.unwrap_or_default(),
            body: message.body.unwrap_or_default(),
            attributes: message.message_attributes.unwrap_or_default(),
            receive_count,
            message_group_id,
            attempt: 0,
            fence: 0,
        };
        (read, message.receipt_handle.filter(|h| !h.is_empty()))
    }
}

/// Bad input: a message the handler cannot use. Never a panic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// The key is the message ID, and the reply gave the message none.
    #[error("the message has no message ID")]
    NoMessageId,
    /// No message attribute of that name.
    #[error("the message has no attribute {0:?}")]
    NoAttribute(String),
    /// The attribute is of type `Binary`: it has no text.
    #[error("the message attribute {0:?} is binary, not text")]
    AttributeNotText(String),
    /// The body does not parse as the JSON the handler expects.
    #[error("the message body does not parse: {0}")]
    Json(String),
    /// The key read from the message is not a valid idempotency key
    /// (empty, over 512 bytes, a control character).
    #[error("{0}")]
    Key(#[from] KeyError),
}

/// Where a message's idempotency key comes from: set with
/// [`SqsConsumer::key_attribute`](crate::SqsConsumer::key_attribute),
/// [`key_from_message_id`](crate::SqsConsumer::key_from_message_id) or
/// [`key_from_content`](crate::SqsConsumer::key_from_content).
///
/// ```
/// use idem_sqs::KeySource;
///
/// assert_eq!(KeySource::default(), KeySource::MessageId);
/// assert_ne!(KeySource::Content, KeySource::Attribute("message-id".to_owned()));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum KeySource {
    /// The message ID that SQS gave the message (the default). It tells
    /// SQS's own redeliveries of one message apart from other messages,
    /// but a producer that sends the same thing twice gets two message
    /// IDs: for those, use an attribute or the content.
    #[default]
    MessageId,
    /// The text of this message attribute (a message ID set by the
    /// producer, of type `String`).
    Attribute(String),
    /// A SHA-256 of the body: copies sent with the same body share a key.
    /// Attributes are left out (they often carry a per-send trace ID).
    Content,
}

impl KeySource {
    /// The key of `message` in `scope`, or why it has none.
    ///
    /// ```
    /// use idem_sqs::{KeySource, MessageError, SqsMessage};
    ///
    /// let message = SqsMessage { message_id: "m-1".to_owned(), body: "{}".to_owned(), ..SqsMessage::default() };
    /// let key = KeySource::MessageId.key_of("sqs.orders", &message).expect("a message ID");
    /// assert_eq!(key.id(), "m-1");
    /// assert!(matches!(
    ///     KeySource::Attribute("id".into()).key_of("sqs.orders", &message),
    ///     Err(MessageError::NoAttribute(_))
    /// ));
    /// ```
    pub fn key_of(
        &self,
        scope: &str,
        message: &SqsMessage,
    ) -> Result<IdempotencyKey, MessageError> {
        match self {
            KeySource::MessageId => {
                if message.message_id.is_empty() {
                    return Err(MessageError::NoMessageId);
                }
                Ok(IdempotencyKey::new(scope, message.message_id.as_str())?)
            }
            KeySource::Attribute(name) => {
                let value = message.attribute_text(name)?;
                Ok(IdempotencyKey::new(scope, value)?)
            }
            KeySource::Content => {
                let hash = Fingerprint::of_bytes(message.body.as_bytes()).to_hex();
                Ok(IdempotencyKey::new(scope, hash)?)
            }
        }
    }
}

/// The fingerprint of a message: the SHA-256 of its body's bytes (the
/// whole body, or the part `what` selects). A second message with the key
/// of a first one and a different body (part) is a payload mismatch.
pub(crate) fn fingerprint_of(message: &SqsMessage, what: &PayloadFingerprint) -> Fingerprint {
    what.fingerprint(message.body.as_bytes())
}

/// The default scope of a queue's keys: `sqs.{queue name}` when that is a
/// valid scope, else `sqs:` and the first 24 bytes of the SHA-256 of the
/// name in hex (a queue name may be up to 80 bytes long, a scope 64). Two
/// queues never share a default scope.
///
/// ```
/// use idem_sqs::default_scope;
///
/// assert_eq!(default_scope("payments"), "sqs.payments");
/// assert_eq!(default_scope("payments.fifo"), "sqs.payments.fifo");
/// assert!(default_scope(&"q".repeat(80)).starts_with("sqs:"));
/// ```
pub fn default_scope(queue_name: &str) -> String {
    let scope = format!("sqs.{queue_name}");
    if IdempotencyKey::new(scope.clone(), "x").is_ok() {
        return scope;
    }
    let hash = Fingerprint::of_bytes(queue_name.as_bytes()).to_hex();
    format!("sqs:{}", &hash[..48])
}

/// The queue name in a queue URL: its last path segment
/// (`https://sqs.us-east-1.amazonaws.com/123456789012/orders` gives
/// `orders`), or the whole string when it has no `/`.
///
/// ```
/// use idem_sqs::queue_name;
///
/// assert_eq!(queue_name("https://sqs.us-east-1.amazonaws.com/123456789012/orders"), "orders");
/// assert_eq!(queue_name("http://127.0.0.1:4566/000000000000/jobs.fifo/"), "jobs.fifo");
/// assert_eq!(queue_name("orders"), "orders");
/// ```
pub fn queue_name(queue_url: &str) -> &str {
    let trimmed = queue_url.trim_end_matches('/');
    match trimmed.rsplit_once('/') {
        Some((_, name)) if !name.is_empty() => name,
        _ => trimmed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(value: &str) -> MessageAttributeValue {
        MessageAttributeValue::builder()
            .data_type("String")
            .string_value(value)
            .build()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn message(body: &str, attributes: &[(&str, MessageAttributeValue)]) -> SqsMessage {
        SqsMessage {
            message_id: "m-1".to_owned(),
            body: body.to_owned(),
            attributes: attributes
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect(),
            ..SqsMessage::default()
        }
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        let binary = MessageAttributeValue::builder()
            .data_type("Binary")
            .binary_value(aws_sdk_sqs::primitives::Blob::new(vec![0xff]))
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        let m = message("", &[("bin", binary), ("long", text(&"k".repeat(513)))]);
        let by = |name: &str| KeySource::Attribute(name.to_owned()).key_of("s", &m);
        assert_eq!(
            by("nope").err(),
            Some(MessageError::NoAttribute("nope".into()))
        );
        assert_eq!(
            by("bin").err(),
            Some(MessageError::AttributeNotText("bin".into()))
        );
        assert!(matches!(
            by("long"),
            Err(MessageError::Key(KeyError::IdTooLong { .. }))
        ));
        let no_id = SqsMessage::default();
        assert_eq!(
            KeySource::MessageId.key_of("s", &no_id).err(),
            Some(MessageError::NoMessageId)
        );
        assert!(matches!(
            m.json::<serde_json::Value>(),
            Err(MessageError::Json(_))
        ));
        // An empty body has a key from its content all the same.
        assert!(KeySource::Content.key_of("s", &m).is_ok());
    }

    #[test]
    fn content_keys_ignore_attributes() {
        let a = KeySource::Content.key_of("s", &message("x", &[("trace", text("1"))]));
        let b = KeySource::Content.key_of("s", &message("x", &[("trace", text("2"))]));
        let c = KeySource::Content.key_of("s", &message("y", &[]));
        assert!(a.is_ok() && c.is_ok());
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn receive_counts_that_are_not_numbers_are_unknown() {
        for (raw, want) in [
            ("3", Some(3)),
            ("0", None),
            ("-1", None),
            ("x", None),
            ("", None),
        ] {
            let m = Message::builder()
                .message_id("m")
                .receipt_handle("r")
                .attributes(MessageSystemAttributeName::ApproximateReceiveCount, raw)
                .build();
            let (read, receipt) = SqsMessage::read(m);
            assert_eq!(read.receive_count, want, "{raw:?}");
            assert_eq!(receipt.as_deref(), Some("r"));
        }
        let (read, receipt) = SqsMessage::read(Message::builder().build());
        assert_eq!(
            (read.body.as_str(), read.receive_count, receipt),
            ("", None, None)
        );
    }

    #[test]
    fn default_scopes_are_distinct_and_valid() {
        assert_eq!(default_scope("orders"), "sqs.orders");
        assert_eq!(default_scope("orders_eu-1"), "sqs.orders_eu-1");
        let (a, b) = (
            default_scope(&"q".repeat(80)),
            default_scope(&"r".repeat(61)),
        );
        assert_ne!(a, b);
        // A name that is not a queue name (SQS would refuse it) all the same.
        for s in [&a, &b, &default_scope("a b/c")] {
            assert!(s.starts_with("sqs:") && s.len() == 52, "{s}");
            assert!(IdempotencyKey::new(s.clone(), "x").is_ok(), "{s}");
        }
    }
}
