//! Dead letters: a poison message published to the dead-letter subject,
//! its payload and headers kept, the reason added in headers; and what is
//! left out when JetStream or the server's `max_payload` refuses that.

use std::error::Error as _;
use std::str::FromStr;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{self, context::PublishError};
use async_nats::{HeaderMap, HeaderName};
use bytes::Bytes;

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
/// The message's own `Nats-Msg-Id`, when it had one (the dead letter's
/// `Nats-Msg-Id` is `idem-dead.{durable}.{stream}.{sequence}`).
pub const ORIGINAL_ID_HEADER: &str = "Idem-Msg-Id";
/// The prefix under which the message's other JetStream headers
/// (`Nats-Expected-Stream`, `Nats-Rollup`, `Nats-TTL`, every `Nats-*`) are
/// kept: `Idem-Orig-Nats-Expected-Stream`. JetStream would act on them
/// (refuse the dead letter, purge the dead-letter stream, expire it).
pub const ORIGINAL_PREFIX: &str = "Idem-Orig-";
/// What a dead letter leaves out of the message, when JetStream refused
/// it whole or it did not fit the server's `max_payload`: `payload tail`
/// (the payload cut to fit), `headers` (the message's own headers),
/// `headers, payload tail`, or `headers, payload` (no payload at all).
pub const DROPPED_HEADER: &str = "Idem-Dropped";
/// The size of the message's payload in bytes, on a dead letter whose
/// payload was cut or left out.
pub const PAYLOAD_SIZE_HEADER: &str = "Idem-Payload-Size";

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

/// The `Nats-Msg-Id` of the dead letter of `message` written by `durable`:
/// the same for every publish of it (a crash between the publish and the
/// ack), so the dead-letter stream's duplicate window drops the second;
/// distinct for two consumers dead-lettering one message to one subject.
pub(crate) fn dead_letter_id(message: &NatsMessage, durable: &str) -> String {
    format!(
        "idem-dead.{durable}.{}.{}",
        message.stream, message.stream_sequence
    )
}

/// Which of the message's headers a dead letter keeps, and its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Form {
    /// Its headers (those JetStream acts on renamed), its payload (cut to
    /// fit `max_payload` if need be).
    Whole,
    /// Only the `Idem-*` headers, its payload (cut to fit if need be).
    WithoutHeaders,
    /// Only the `Idem-*` headers, no payload.
    WithoutPayload,
}

/// The headers and payload of the dead letter of `message` in `form`, or
/// `None` when it cannot fit `max_payload` (0: no limit known) in that
/// form.
pub(crate) fn letter(
    message: &NatsMessage,
    durable: &str,
    reason: &str,
    form: Form,
    max_payload: usize,
) -> Option<(HeaderMap, Bytes)> {
    let mut headers = HeaderMap::new();
    if form == Form::Whole {
        for (name, values) in message.headers.iter() {
            let text: &str = name.as_ref();
            if text.eq_ignore_ascii_case(MESSAGE_ID_HEADER) {
                // Kept below, as `Idem-Msg-Id`.
                continue;
            }
            let jetstream_header = text
                .get(..5)
                .is_some_and(|p| p.eq_ignore_ascii_case("nats-"));
            let name = if jetstream_header {
                match HeaderName::from_str(&format!("{ORIGINAL_PREFIX}{text}")) {
                    Ok(renamed) => renamed,
                    Err(_) => continue,
                }
            } else {
                name.clone()
            };
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
    }
    headers.insert(MESSAGE_ID_HEADER, dead_letter_id(message, durable));
    if let Some(id) = message.header(MESSAGE_ID_HEADER) {
        headers.insert(ORIGINAL_ID_HEADER, header_value(id, MAX_REASON));
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
    let size = message.payload.len();
    // What is left out; with the payload's size when it is cut or left
    // out.
    let marked = |mut headers: HeaderMap, dropped: &str| {
        headers.insert(DROPPED_HEADER, dropped);
        if dropped.contains("payload") {
            headers.insert(PAYLOAD_SIZE_HEADER, size.to_string());
        }
        headers
    };
    let fits = |headers: &HeaderMap, payload: usize| {
        max_payload == 0 || wire_len(headers) + payload <= max_payload
    };
    let without_headers = form != Form::Whole;
    if form == Form::WithoutPayload {
        let headers = marked(headers, "headers, payload");
        return fits(&headers, 0).then_some((headers, Bytes::new()));
    }
    let whole = if without_headers {
        marked(headers.clone(), "headers")
    } else {
        headers.clone()
    };
    if fits(&whole, size) {
        return Some((whole, message.payload.clone()));
    }
    let cut = marked(
        headers,
        if without_headers {
            "headers, payload tail"
        } else {
            "payload tail"
        },
    );
    let room = max_payload.checked_sub(wire_len(&cut))?;
    Some((cut, message.payload.slice(..room.min(size))))
}

/// The size of `headers` on the wire (`NATS/1.0`, each `name: value`
/// line, the blank line), as the server counts it against `max_payload`
/// with the payload.
fn wire_len(headers: &HeaderMap) -> usize {
    if headers.is_empty() {
        return 0;
    }
    let mut len = "NATS/1.0\r\n".len() + "\r\n".len();
    for (name, values) in headers.iter() {
        let name: &str = name.as_ref();
        for value in values {
            len += name.len() + ": ".len() + value.as_str().len() + "\r\n".len();
        }
    }
    len
}

/// Why a dead letter was not published.
#[derive(Debug)]
pub(crate) enum NotPublished {
    /// It may go out later (the server away, the dead-letter stream full
    /// for now, a timeout): the message is handed back.
    Passing(NatsError),
    /// Refused for good in every form (JetStream answered 4xx, or it does
    /// not fit `max_payload` even without its payload).
    Refused(NatsError),
}

/// Whether JetStream (or the client) refuses `e` for good: the same dead
/// letter would be refused again. A JetStream API error with a 4xx code
/// (an expected-header mismatch, a message over the stream's size limit,
/// a rollup or a TTL the stream does not allow), or a message over
/// `max_payload`. A full stream (503), a timeout or no responders are
/// not.
fn refused_for_good(e: &PublishError) -> bool {
    match e.kind() {
        PublishErrorKind::MaxPayloadExceeded
        | PublishErrorKind::WrongLastMessageId
        | PublishErrorKind::WrongLastSequence => true,
        PublishErrorKind::Other => e
            .source()
            .and_then(|s| s.downcast_ref::<jetstream::Error>())
            .is_some_and(|api| (400..500).contains(&api.code())),
        _ => false,
    }
}

/// Publishes one form and waits for JetStream's ack; `Err(true)`: refused
/// for good.
async fn send(
    js: &jetstream::Context,
    subject: &str,
    headers: HeaderMap,
    payload: Bytes,
) -> Result<(), (bool, NatsError)> {
    let failed = |e: PublishError| {
        let good = refused_for_good(&e);
        (good, NatsError::new("dead-letter publish", !good, e))
    };
    let ack = js
        .publish_with_headers(subject.to_owned(), headers, payload)
        .await
        .map_err(failed)?;
    ack.await.map_err(failed)?;
    Ok(())
}

/// Publishes the dead letter of `message` to `subject` and waits for
/// JetStream's ack: whole first; refused for good, without the message's
/// headers; refused again, without its payload. A form that cannot fit
/// the server's `max_payload` is not sent; a payload that does not fit is
/// cut to fit. What the dead letter that went out left out of the message
/// (its [`DROPPED_HEADER`]; `None`: nothing), or why none went out.
pub(crate) async fn publish(
    js: &jetstream::Context,
    subject: &str,
    durable: &str,
    message: &NatsMessage,
    reason: &str,
) -> Result<Option<String>, NotPublished> {
    let max_payload = js.client().max_payload();
    let mut refusal = None;
    for form in [Form::Whole, Form::WithoutHeaders, Form::WithoutPayload] {
        let Some((headers, payload)) = letter(message, durable, reason, form, max_payload) else {
            continue;
        };
        let dropped = headers.get(DROPPED_HEADER).map(|v| v.as_str().to_owned());
        match send(js, subject, headers, payload).await {
            Ok(()) => return Ok(dropped),
            Err((true, e)) => {
                tracing::warn!(error = %e, ?form, "JetStream refused the dead letter for good: trying it with less of the message");
                refusal = Some(e);
            }
            Err((false, e)) => return Err(NotPublished::Passing(e)),
        }
    }
    Err(NotPublished::Refused(refusal.unwrap_or_else(|| {
        NatsError::new(
            "dead-letter publish",
            false,
            format!("the dead letter does not fit the server's max_payload ({max_payload} bytes) even without the message's payload"),
        )
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
        h.get(name).map(|v| v.as_str())
    }

    #[test]
    fn reasons_are_one_bounded_line() {
        let message = NatsMessage {
            stream: "S".into(),
            stream_sequence: 9,
            ..NatsMessage::default()
        };
        let long = format!("line\r\nInjected: yes {}", "é".repeat(1000));
        let (h, _) = letter(&message, "d", &long, Form::Whole, 0).unwrap_or_default();
        let reason = get(&h, REASON_HEADER).unwrap_or_default();
        assert!(reason.starts_with("line  Injected: yes"));
        assert!(reason.len() <= MAX_REASON && !reason.contains('\n'));
        assert_eq!(get(&h, MESSAGE_ID_HEADER), Some("idem-dead.d.S.9"));
        assert_eq!(get(&h, DELIVERED_HEADER), Some("unknown"));
        assert_eq!(get(&h, ORIGINAL_ID_HEADER), None);
    }

    #[test]
    fn jetstream_headers_are_renamed_and_the_id_names_the_consumer() {
        let mut headers = HeaderMap::new();
        headers.insert(MESSAGE_ID_HEADER, "order-7");
        headers.insert("Nats-Expected-Stream", "ORDERS");
        headers.insert("nats-rollup", "all");
        headers.insert("Nats-TTL", "1s");
        headers.append("trace", "a");
        headers.append("trace", "b");
        let message = NatsMessage {
            stream: "ORDERS".into(),
            stream_sequence: 3,
            payload: "{}".into(),
            headers,
            ..NatsMessage::default()
        };
        let (h, payload) = letter(&message, "billing", "r", Form::Whole, 0).unwrap_or_default();
        assert_eq!(payload, "{}");
        assert_eq!(
            get(&h, MESSAGE_ID_HEADER),
            Some("idem-dead.billing.ORDERS.3")
        );
        assert_eq!(get(&h, ORIGINAL_ID_HEADER), Some("order-7"));
        assert_eq!(get(&h, "Nats-Expected-Stream"), None);
        assert_eq!(get(&h, "Idem-Orig-Nats-Expected-Stream"), Some("ORDERS"));
        assert_eq!(get(&h, "Idem-Orig-nats-rollup"), Some("all"));
        assert_eq!(get(&h, "Idem-Orig-Nats-TTL"), Some("1s"));
        assert_eq!(h.get_all("trace").count(), 2);
        assert_eq!(get(&h, DROPPED_HEADER), None);
        let (other, _) = letter(&message, "shipping", "r", Form::Whole, 0).unwrap_or_default();
        assert_ne!(get(&other, MESSAGE_ID_HEADER), get(&h, MESSAGE_ID_HEADER));
        let (bare, payload) =
            letter(&message, "billing", "r", Form::WithoutHeaders, 0).unwrap_or_default();
        assert_eq!(payload, "{}");
        assert_eq!(get(&bare, "trace"), None);
        assert_eq!(get(&bare, "Idem-Orig-Nats-TTL"), None);
        assert_eq!(get(&bare, DROPPED_HEADER), Some("headers"));
        assert_eq!(get(&bare, PAYLOAD_SIZE_HEADER), None);
        assert_eq!(get(&bare, ORIGINAL_ID_HEADER), Some("order-7"));
        let (empty, payload) =
            letter(&message, "billing", "r", Form::WithoutPayload, 0).unwrap_or_default();
        assert!(payload.is_empty());
        assert_eq!(get(&empty, DROPPED_HEADER), Some("headers, payload"));
        assert_eq!(get(&empty, PAYLOAD_SIZE_HEADER), Some("2"));
    }

    #[test]
    fn a_letter_fits_max_payload_or_is_not_made() {
        let message = NatsMessage {
            stream: "S".into(),
            payload: Bytes::from(vec![b'x'; 10_000]),
            ..NatsMessage::default()
        };
        let max = 4_000;
        let (h, payload) = letter(&message, "d", "r", Form::Whole, max).unwrap_or_default();
        assert_eq!(wire_len(&h) + payload.len(), max);
        assert_eq!(get(&h, DROPPED_HEADER), Some("payload tail"));
        assert_eq!(get(&h, PAYLOAD_SIZE_HEADER), Some("10000"));
        let (h, payload) =
            letter(&message, "d", "r", Form::WithoutHeaders, 20_000).unwrap_or_default();
        assert_eq!(payload.len(), 10_000);
        assert_eq!(get(&h, DROPPED_HEADER), Some("headers"));
        // Headers alone over the limit: no letter in any form.
        for form in [Form::Whole, Form::WithoutHeaders, Form::WithoutPayload] {
            assert!(letter(&message, "d", "r", form, 50).is_none(), "{form:?}");
        }
        // The wire length is the one the client counts.
        let mut h = HeaderMap::new();
        h.insert("a", "bc");
        assert_eq!(wire_len(&h), "NATS/1.0\r\na: bc\r\n\r\n".len());
    }
}
