//! Dead letters: a poison message sent to the dead-letter queue with the
//! reason in its attributes (or left to the queue's redrive policy).

use std::collections::HashMap;

use aws_sdk_sqs::types::MessageAttributeValue;
use idem_core::Fingerprint;

use crate::error::SqsError;
use crate::queue::{call, Queue};
use crate::stats::add;
use crate::SqsMessage;

/// The most message attributes a message may carry: SQS's limit.
pub const MAX_ATTRIBUTES: usize = 10;

/// The longest `idem.reason` (and `idem.dropped`) value, in bytes.
const MAX_REASON: usize = 1024;

/// The names of the attributes a dead letter gets.
const REASON: &str = "idem.reason";
const RECEIVE_COUNT: &str = "idem.receive_count";
const SOURCE_QUEUE: &str = "idem.source_queue";
const MESSAGE_ID: &str = "idem.message_id";
const DROPPED: &str = "idem.dropped";

impl Queue {
    /// Dead-letters these messages (the sends at once); returns the
    /// receipts of those sent, to delete, and of those not sent, to leave
    /// for redelivery. Without a dead-letter queue, none is sent: they are
    /// left to the queue's redrive policy.
    pub(crate) async fn dead_letter(
        &self,
        dead: Vec<(SqsMessage, String, String)>,
    ) -> (Vec<String>, Vec<String>) {
        if dead.is_empty() {
            return (Vec::new(), Vec::new());
        }
        add(&self.shared.counters.poison, dead.len());
        let Some(target) = &self.dead_letter else {
            let left = dead
                .into_iter()
                .map(|(message, receipt, reason)| {
                    tracing::warn!(queue = %self.url, message_id = %message.message_id, receive_count = ?message.receive_count, %reason, "poison message left to the queue's redrive policy (no dead-letter queue set)");
                    receipt
                })
                .collect();
            return (Vec::new(), left);
        };
        let sends = dead.into_iter().map(|(message, receipt, reason)| async move {
            match self.send_dead_letter(target, &message, &reason).await {
                Ok(()) => {
                    tracing::warn!(queue = %self.url, message_id = %message.message_id, dead_letter = %target, %reason, "message dead-lettered");
                    Ok(receipt)
                }
                Err(e) => {
                    tracing::warn!(queue = %self.url, message_id = %message.message_id, dead_letter = %target, error = %e, "could not dead-letter: left for redelivery");
                    Err(receipt)
                }
            }
        });
        let (mut sent, mut failed) = (Vec::new(), Vec::new());
        for result in futures_util::future::join_all(sends).await {
            match result {
                Ok(receipt) => sent.push(receipt),
                Err(receipt) => failed.push(receipt),
            }
        }
        add(&self.shared.counters.dead_letter_failures, failed.len());
        add(&self.shared.counters.dead_lettered, sent.len());
        (sent, failed)
    }

    /// Sends the dead letter of `message`: with its original attributes
    /// first; if SQS refuses that copy (too large with the attributes
    /// added), without them; if it refuses that too (a body at the size
    /// limit of the dead-letter queue), with no attribute at all, the
    /// reason then only in the log.
    async fn send_dead_letter(
        &self,
        target: &str,
        message: &SqsMessage,
        reason: &str,
    ) -> Result<(), SqsError> {
        let mut level = DeadCopy::WithOriginals;
        loop {
            let attributes = match level {
                DeadCopy::WithOriginals | DeadCopy::OursOnly => dead_letter_attributes(
                    &self.url,
                    message,
                    reason,
                    matches!(level, DeadCopy::WithOriginals),
                    self.key_attribute.as_deref(),
                ),
                DeadCopy::Bare => HashMap::new(),
            };
            let mut request = self
                .client
                .send_message()
                .queue_url(target)
                .message_body(message.body.as_str())
                .set_message_attributes(Some(attributes).filter(|a| !a.is_empty()));
            if target.ends_with(".fifo") {
                let group = message
                    .message_group_id
                    .clone()
                    .unwrap_or_else(|| "idem.dead-letter".to_owned());
                let seed = if message.message_id.is_empty() {
                    message.body.as_bytes()
                } else {
                    message.message_id.as_bytes()
                };
                request = request
                    .message_group_id(group)
                    .message_deduplication_id(Fingerprint::of_bytes(seed).to_hex());
            }
            let e = match call("SendMessage", self.call_timeout, request.send()).await {
                Ok(_) => return Ok(()),
                Err(e) if e.is_transient() => return Err(e),
                Err(e) => e,
            };
            level = match level {
                DeadCopy::WithOriginals if !message.attributes.is_empty() => {
                    tracing::warn!(queue = %self.url, message_id = %message.message_id, error = %e, "dead letter refused with the original attributes: sent again without them");
                    DeadCopy::OursOnly
                }
                DeadCopy::WithOriginals | DeadCopy::OursOnly => {
                    tracing::warn!(queue = %self.url, message_id = %message.message_id, error = %e, %reason, "dead letter refused with the reason attributes: sent again with none (the reason is only in this log)");
                    DeadCopy::Bare
                }
                DeadCopy::Bare => return Err(e),
            };
        }
    }
}

/// Which copy of a poison message is sent to the dead-letter queue.
#[derive(Clone, Copy)]
enum DeadCopy {
    WithOriginals,
    OursOnly,
    Bare,
}

/// A `String` attribute, its value made acceptable to SQS: at most
/// `MAX_REASON` bytes, characters SQS refuses replaced by `?`, never empty.
fn text_attribute(value: &str) -> Option<MessageAttributeValue> {
    let mut clean: String = value
        .chars()
        .map(|c| match c {
            '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' => c,
            c if c >= '\u{10000}' => c,
            _ => '?',
        })
        .collect();
    if clean.len() > MAX_REASON {
        let mut end = MAX_REASON - 3;
        while !clean.is_char_boundary(end) {
            end -= 1;
        }
        clean.truncate(end);
        clean.push_str("...");
    }
    if clean.is_empty() {
        clean.push('-');
    }
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(clean)
        .build()
        .ok()
}

/// The message attributes of a dead letter: ours, then the message's own
/// (the key attribute `first`, then by name) as far as SQS's limit of 10
/// leaves room (the last ones dropped first, named in `idem.dropped`), or
/// none of them.
fn dead_letter_attributes(
    source_queue: &str,
    message: &SqsMessage,
    reason: &str,
    with_originals: bool,
    first: Option<&str>,
) -> HashMap<String, MessageAttributeValue> {
    let receive_count = message
        .receive_count
        .map_or_else(|| "unknown".to_owned(), |n| n.to_string());
    let message_id = if message.message_id.is_empty() {
        "unknown"
    } else {
        message.message_id.as_str()
    };
    let ours = [
        (REASON, reason),
        (RECEIVE_COUNT, receive_count.as_str()),
        (SOURCE_QUEUE, source_queue),
        (MESSAGE_ID, message_id),
    ];
    let mut out: HashMap<String, MessageAttributeValue> = ours
        .iter()
        .filter_map(|(name, value)| Some(((*name).to_owned(), text_attribute(value)?)))
        .collect();
    let mut originals: Vec<(&String, &MessageAttributeValue)> = message
        .attributes
        .iter()
        .filter(|(name, _)| !ours.iter().any(|(n, _)| n == name) && name.as_str() != DROPPED)
        .collect();
    originals.sort_by_key(|(name, _)| (Some(name.as_str()) != first, name.as_str()));
    let room = MAX_ATTRIBUTES - out.len();
    let keep = if !with_originals {
        0
    } else if originals.len() <= room {
        originals.len()
    } else {
        room - 1
    };
    let dropped: Vec<&str> = originals[keep..].iter().map(|(n, _)| n.as_str()).collect();
    for (name, value) in &originals[..keep] {
        out.insert((*name).clone(), (*value).clone());
    }
    if !dropped.is_empty() {
        let list = format!(
            "{} of the original attributes: {}",
            dropped.len(),
            dropped.join(", ")
        );
        if let Some(value) = text_attribute(&list) {
            out.insert(DROPPED.to_owned(), value);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(value: &str) -> MessageAttributeValue {
        text_attribute(value).unwrap_or_else(|| panic!("{value:?}"))
    }

    fn message_with(n: usize) -> SqsMessage {
        SqsMessage {
            message_id: "m-1".to_owned(),
            body: "b".to_owned(),
            attributes: (0..n).map(|i| (format!("a{i:02}"), text("v"))).collect(),
            receive_count: Some(3),
            ..SqsMessage::default()
        }
    }

    #[test]
    fn dead_letters_keep_within_ten_attributes_and_name_what_they_drop() {
        for n in [0, 6, 7, 10] {
            let out = dead_letter_attributes("q", &message_with(n), "why", true, None);
            assert!(out.len() <= MAX_ATTRIBUTES, "{n}: {}", out.len());
            for name in [REASON, RECEIVE_COUNT, SOURCE_QUEUE, MESSAGE_ID] {
                assert!(out.contains_key(name), "{n}: {name}");
            }
            let dropped = out.get(DROPPED).and_then(|v| v.string_value());
            if n <= 6 {
                assert_eq!(out.len(), 4 + n);
                assert_eq!(dropped, None);
            } else {
                assert_eq!(out.len(), MAX_ATTRIBUTES);
                // The first 5 by name kept, the rest named.
                assert!(out.contains_key("a04") && !out.contains_key("a05"));
                let dropped = dropped.unwrap_or_else(|| panic!("{n}: nothing named"));
                assert!(dropped.starts_with(&format!("{} of", n - 5)), "{dropped}");
                assert!(dropped.contains("a05"), "{dropped}");
            }
        }
        // The key attribute first, whatever its name.
        let keyed = dead_letter_attributes("q", &message_with(10), "why", true, Some("a09"));
        assert!(keyed.contains_key("a09") && keyed.contains_key("a03"));
        assert!(!keyed.contains_key("a04"));
        let none = dead_letter_attributes("q", &message_with(3), "why", false, None);
        assert_eq!(none.len(), 5);
        assert!(none
            .get(DROPPED)
            .and_then(|v| v.string_value())
            .is_some_and(|d| d.contains("a00, a01, a02")));
        let count = none.get(RECEIVE_COUNT).and_then(|v| v.string_value());
        assert_eq!(count, Some("3"));
    }

    #[test]
    fn attribute_values_are_cut_cleaned_and_never_empty() {
        let long = "é".repeat(2000);
        let v = text(&long);
        let s = v.string_value().unwrap_or_default();
        assert!(s.len() <= MAX_REASON && s.ends_with("..."), "{}", s.len());
        assert_eq!(text("a\u{1}b").string_value(), Some("a?b"));
        assert_eq!(text("").string_value(), Some("-"));
    }
}
