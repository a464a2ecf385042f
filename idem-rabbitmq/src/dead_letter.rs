//! Poison messages published to a dead-letter exchange of the consumer's
//! choice, with their reason, and confirmed before the ack.

use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation};

use crate::RabbitMessage;

/// The header holding why a message was dead-lettered.
pub const REASON_HEADER: &str = "idem-reason";
/// The header naming the queue a dead letter came from.
pub const SOURCE_QUEUE_HEADER: &str = "idem-source-queue";
/// The header holding how many times the broker delivered a dead letter
/// (when the queue counts: quorum queues).
pub const DELIVERY_COUNT_HEADER: &str = "idem-delivery-count";

/// The longest reason kept in the header (a reason quoting a long handler
/// error is cut, at a character boundary).
const MAX_REASON: usize = 4096;

/// How long the broker may take to confirm a dead letter.
const CONFIRM_WAIT: Duration = Duration::from_secs(10);

/// Publishes `message` to `exchange` with `routing_key` (mandatory: an
/// unroutable dead letter is an error, never dropped), with the same body
/// and properties and the reason headers added, and waits for the
/// broker's confirm.
pub(crate) async fn publish(
    channel: &Channel,
    frame_max: u32,
    exchange: &str,
    routing_key: &str,
    queue: &str,
    message: &RabbitMessage,
    reason: &str,
) -> Result<(), String> {
    let properties = copy_of(message, queue, reason, frame_max);
    // Checked by the consumer's `check`: at most 255 bytes each.
    let (Ok(exchange), Ok(routing_key)) = (
        ShortString::try_new(exchange),
        ShortString::try_new(routing_key),
    ) else {
        return Err("the dead-letter exchange or routing key is over 255 bytes".into());
    };
    let send = async {
        let confirm = channel
            .basic_publish(
                exchange,
                routing_key,
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &message.body,
                properties,
            )
            .await
            .map_err(|e| e.to_string())?;
        match confirm.await.map_err(|e| e.to_string())? {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err("the broker could not route it (no queue is bound to the dead-letter exchange and routing key)".into()),
            Confirmation::Nack(_) => Err("the broker refused it (nack)".into()),
            Confirmation::NotRequested => Err("the publisher channel has no confirms".into()),
        }
    };
    match tokio::time::timeout(CONFIRM_WAIT, send).await {
        Ok(sent) => sent,
        Err(_) => Err(format!("no confirm within {CONFIRM_WAIT:?}")),
    }
}

/// The header holding the message's `expiration`, which its copy does not
/// keep (a dead letter must not expire with the message's TTL).
pub const EXPIRATION_HEADER: &str = "idem-original-expiration";
/// The header holding the message's `user_id`, which its copy does not
/// keep (the broker refuses a `user_id` other than the connection's).
pub const USER_ID_HEADER: &str = "idem-original-user-id";
/// The header naming how many of the message's own headers its copy left
/// out: they did not fit in a frame beside the reason.
pub const HEADERS_DROPPED_HEADER: &str = "idem-headers-dropped";

/// Room for the frame's own bytes and the fixed-size properties.
const OTHER_PROPERTIES: usize = 256;

/// The dead letter's properties: the message's, but for `expiration` and
/// `user_id` (kept as headers), with the reason headers added, and
/// without `x-delivery-count` (a quorum queue counts the copy's
/// deliveries anew). When the message's own headers and the added ones
/// would not fit in a frame of `frame_max` bytes (a frame too large closes
/// the connection, and every ack on it), the message's own headers are
/// left out and counted in [`HEADERS_DROPPED_HEADER`].
fn copy_of(message: &RabbitMessage, queue: &str, reason: &str, frame_max: u32) -> BasicProperties {
    let p = &message.properties;
    let mut added = FieldTable::default();
    added.insert(
        SOURCE_QUEUE_HEADER.into(),
        AMQPValue::LongString(LongString::from(queue)),
    );
    if let Some(n) = message.delivery_count {
        added.insert(
            DELIVERY_COUNT_HEADER.into(),
            AMQPValue::LongLongInt(i64::from(n)),
        );
    }
    if let Some(e) = p.expiration() {
        added.insert(
            EXPIRATION_HEADER.into(),
            AMQPValue::LongString(e.as_str().into()),
        );
    }
    if let Some(u) = p.user_id() {
        added.insert(
            USER_ID_HEADER.into(),
            AMQPValue::LongString(u.as_str().into()),
        );
    }
    // The properties other than the headers, as sent (short strings, at
    // most 255 bytes each), and the frame's own bytes.
    let others = OTHER_PROPERTIES
        + [
            p.content_type(),
            p.content_encoding(),
            p.correlation_id(),
            p.reply_to(),
            p.message_id(),
            p.kind(),
            p.app_id(),
            p.cluster_id(),
        ]
        .iter()
        .map(|v| v.as_ref().map_or(0, |v| 1 + v.as_str().len()))
        .sum::<usize>();
    // The reason is cut to what a frame leaves beside the other added
    // headers (a small `frame_max` leaves it short, never the frame too
    // large).
    let room = if frame_max == 0 {
        MAX_REASON
    } else {
        (frame_max as usize).saturating_sub(
            others
                + table_len(&added)
                + REASON_HEADER.len()
                + 16
                + HEADERS_DROPPED_HEADER.len()
                + 16,
        )
    };
    added.insert(
        REASON_HEADER.into(),
        AMQPValue::LongString(LongString::from(cut(reason, room.min(MAX_REASON)))),
    );
    let mut own = p.headers().clone().unwrap_or_default();
    let own_len = table_len(&own);
    let fits = frame_max == 0 || own_len + table_len(&added) + others <= frame_max as usize;
    let mut headers = if fits {
        let mut inner = std::mem::take(&mut own).inner().clone();
        inner.remove(crate::message::DELIVERY_COUNT_HEADER);
        FieldTable::from(inner)
    } else {
        let mut t = FieldTable::default();
        t.insert(
            HEADERS_DROPPED_HEADER.into(),
            AMQPValue::LongLongInt(i64::try_from(own.inner().len()).unwrap_or(i64::MAX)),
        );
        t
    };
    for (k, v) in added.inner() {
        headers.insert(k.clone(), v.clone());
    }
    let mut copy = BasicProperties::default().with_headers(headers);
    macro_rules! keep {
        ($get:ident, $with:ident) => {
            if let Some(v) = p.$get() {
                copy = copy.$with(v.clone());
            }
        };
    }
    keep!(content_type, with_content_type);
    keep!(content_encoding, with_content_encoding);
    keep!(delivery_mode, with_delivery_mode);
    keep!(priority, with_priority);
    keep!(correlation_id, with_correlation_id);
    keep!(reply_to, with_reply_to);
    keep!(message_id, with_message_id);
    keep!(timestamp, with_timestamp);
    keep!(kind, with_type);
    keep!(app_id, with_app_id);
    keep!(cluster_id, with_cluster_id);
    copy
}

/// The encoded size of a field table, in bytes.
fn table_len(table: &FieldTable) -> usize {
    4 + table
        .inner()
        .iter()
        .map(|(k, v)| 1 + k.as_str().len() + value_len(v))
        .sum::<usize>()
}

/// The encoded size of a field value with its type byte, in bytes.
fn value_len(value: &AMQPValue) -> usize {
    1 + match value {
        AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
        AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
        AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
        AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
        AMQPValue::DecimalValue(_) => 5,
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::LongString(s) => 4 + s.len(),
        AMQPValue::ByteArray(b) => 4 + b.as_slice().len(),
        AMQPValue::FieldArray(a) => 4 + a.as_slice().iter().map(value_len).sum::<usize>(),
        AMQPValue::FieldTable(t) => table_len(t),
        AMQPValue::Void => 0,
    }
}

/// `reason`, cut to `max` bytes (its mark included) at a character boundary.
fn cut(reason: &str, max: usize) -> String {
    if reason.len() <= max {
        return reason.to_owned();
    }
    // Room for the mark that says it was cut.
    let mut end = max.saturating_sub('…'.len_utf8());
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &reason[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_reasons_are_cut_at_a_character_boundary() {
        assert_eq!(cut("short", MAX_REASON), "short");
        let long = "é".repeat(5000);
        let c = cut(&long, MAX_REASON);
        assert!(c.len() <= MAX_REASON);
        assert!(c.ends_with('…'));
    }
}
