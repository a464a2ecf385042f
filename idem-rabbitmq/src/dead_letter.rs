//! Poison messages published to a dead-letter exchange of the consumer's
//! choice, with their reason, and confirmed before the ack.

use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, LongString, ShortString};
use lapin::{Channel, Confirmation};

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
    exchange: &str,
    routing_key: &str,
    queue: &str,
    message: &RabbitMessage,
    reason: &str,
) -> Result<(), String> {
    let mut headers = message.properties.headers().clone().unwrap_or_default();
    headers.insert(
        REASON_HEADER.into(),
        AMQPValue::LongString(LongString::from(cut(reason))),
    );
    headers.insert(
        SOURCE_QUEUE_HEADER.into(),
        AMQPValue::LongString(LongString::from(queue)),
    );
    if let Some(n) = message.delivery_count {
        headers.insert(
            DELIVERY_COUNT_HEADER.into(),
            AMQPValue::LongLongInt(i64::from(n)),
        );
    }
    let properties = message.properties.clone().with_headers(headers);
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

/// `reason`, cut to [`MAX_REASON`] bytes at a character boundary.
fn cut(reason: &str) -> String {
    if reason.len() <= MAX_REASON {
        return reason.to_owned();
    }
    let mut end = MAX_REASON;
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
        assert_eq!(cut("short"), "short");
        let long = "é".repeat(5000);
        let c = cut(&long);
        assert!(c.len() <= MAX_REASON + "…".len());
        assert!(c.ends_with('…'));
    }
}
