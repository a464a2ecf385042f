//! Dead letters: a poison message published to the dead-letter subject,
//! its payload and headers kept, the reason added in headers.

use async_nats::jetstream;
use async_nats::HeaderMap;

use crate::error::NatsError;
use crate::message::MESSAGE_ID_HEADER;
use crate::NatsMessage;

/// The longest `Idem-Reason` value, in bytes.
const MAX_REASON: usize = 1024;

/// The headers a dead letter gets, beside the message's own.
pub const REASON_HEADER: &str = "Idem-Reason";
/// The delivery count of the message when it was dead-lettered.
pub const DELIVERED_HEADER: &str = "Idem-Delivered";
/// The stream the message came from.
pub const STREAM_HEADER: &str = "Idem-Stream";
/// Its sequence in that stream.
pub const SEQUENCE_HEADER: &str = "Idem-Stream-Sequence";
/// The subject it was published to.
pub const SUBJECT_HEADER: &str = "Idem-Subject";
/// The durable consumer that dead-lettered it.
pub const CONSUMER_HEADER: &str = "Idem-Consumer";

/// A header value: control characters (a line break would end the header)
/// become spaces, cut to `max` bytes on a character boundary.
fn header_value(text: &str, max: usize) -> String {
    let mut value: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if value.len() > max {
        let mut end = max;
        while !value.is_char_boundary(end) {
            end -= 1;
        }
        value.truncate(end);
    }
    value
}

/// The headers of the dead letter of `message`: its own, then the
/// `Idem-*` ones. Its `Nats-Msg-Id` is kept, or set to
/// `idem-dead.{stream}.{sequence}`, so that a dead letter published again
/// (a crash between the publish and the ack) is dropped as a duplicate by
/// the dead-letter stream within its duplicate window.
pub(crate) fn headers(message: &NatsMessage, durable: &str, reason: &str) -> HeaderMap {
    let mut headers = message.headers.clone();
    if message.header(MESSAGE_ID_HEADER).is_none() {
        headers.insert(
            MESSAGE_ID_HEADER,
            format!("idem-dead.{}.{}", message.stream, message.stream_sequence),
        );
    }
    headers.insert(REASON_HEADER, header_value(reason, MAX_REASON));
    let delivered = message
        .delivered
        .map_or("unknown".to_owned(), |n| n.to_string());
    headers.insert(DELIVERED_HEADER, delivered);
    headers.insert(STREAM_HEADER, header_value(&message.stream, 256));
    headers.insert(SEQUENCE_HEADER, message.stream_sequence.to_string());
    headers.insert(SUBJECT_HEADER, header_value(&message.subject, MAX_REASON));
    headers.insert(CONSUMER_HEADER, header_value(durable, 256));
    headers
}

/// Publishes the dead letter of `message` to `subject` and waits for
/// JetStream's ack.
pub(crate) async fn publish(
    js: &jetstream::Context,
    subject: &str,
    durable: &str,
    message: &NatsMessage,
    reason: &str,
) -> Result<(), NatsError> {
    let headers = headers(message, durable, reason);
    let ack = js
        .publish_with_headers(subject.to_owned(), headers, message.payload.clone())
        .await
        .map_err(|e| NatsError::new("dead-letter publish", true, e))?;
    ack.await
        .map_err(|e| NatsError::new("dead-letter publish", true, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_one_bounded_line() {
        let message = NatsMessage {
            stream: "S".into(),
            stream_sequence: 9,
            ..NatsMessage::default()
        };
        let long = format!("line\r\nInjected: yes {}", "é".repeat(1000));
        let h = headers(&message, "d", &long);
        let reason = h
            .get(REASON_HEADER)
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default();
        assert!(reason.starts_with("line  Injected: yes"));
        assert!(reason.len() <= MAX_REASON && !reason.contains('\n'));
        assert_eq!(
            h.get(MESSAGE_ID_HEADER).map(|v| v.as_str()),
            Some("idem-dead.S.9")
        );
        assert_eq!(h.get(DELIVERED_HEADER).map(|v| v.as_str()), Some("unknown"));
    }
}
