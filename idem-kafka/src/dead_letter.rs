//! Dead-lettering: a record produced to its dead-letter topic with the
//! `idem.*` headers, made smaller until it fits.

use std::sync::atomic::Ordering;

use idem_core::{Codec, IdempotencyStore};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::util::Timeout;

use crate::record::KafkaRecord;
use crate::work::Work;

impl<S, C, F, M> Work<S, C, F, M>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
{
    /// Produces the record to the dead-letter topic; whether the broker
    /// acknowledged it within `call_timeout`.
    ///
    /// The dead letter carries the `idem.*` headers first, then the
    /// record's own headers; a record that was a dead letter before (it
    /// was re-driven) has its old `idem.*` headers renamed
    /// `idem.previous.*` (one generation kept), so the first *and* the last
    /// `idem.reason` are the new one. A copy over the producer's size limit
    /// (the headers added to a record just under it) goes without its
    /// value, then without its headers, then without its key, each step
    /// said in `idem.dropped`: a dead letter is never refused for its size.
    pub(crate) async fn dead_letter_one(&self, record: &KafkaRecord, n: u32, reason: &str) -> bool {
        let topic = self
            .dead_letter
            .clone()
            .unwrap_or_else(|| format!("{}.dead", record.topic));
        let partition = record.partition.to_string();
        let offset = record.offset.to_string();
        let deliveries = n.to_string();
        let ours = [
            ("idem.topic", record.topic.as_str()),
            ("idem.partition", partition.as_str()),
            ("idem.offset", offset.as_str()),
            ("idem.group", self.group.as_str()),
            ("idem.deliveries", deliveries.as_str()),
            ("idem.reason", reason),
        ];
        // Old idem.* headers of a re-driven dead letter, renamed.
        let theirs: Vec<(String, Option<&[u8]>)> = record
            .headers
            .iter()
            .filter(|(name, _)| !name.starts_with("idem.previous."))
            .map(|(name, value)| {
                let name =
                    if ours.iter().any(|(n, _)| *n == name.as_str()) || name == "idem.dropped" {
                        format!("idem.previous.{}", &name["idem.".len()..])
                    } else {
                        name.clone()
                    };
                (name, value.as_deref())
            })
            .collect();
        let steps = ["", "value", "value, headers", "value, headers, key"];
        for (step, dropped) in steps.iter().enumerate() {
            let mut headers = OwnedHeaders::new_with_capacity(theirs.len() + ours.len() + 1);
            for (name, value) in ours {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value),
                });
            }
            if step > 0 {
                headers = headers.insert(Header {
                    key: "idem.dropped",
                    value: Some(*dropped),
                });
            }
            if step < 2 {
                for (name, value) in &theirs {
                    headers = headers.insert(Header {
                        key: name,
                        value: *value,
                    });
                }
            }
            let mut out: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&topic).headers(headers);
            if step < 3 {
                if let Some(k) = record.key.as_deref() {
                    out = out.key(k);
                }
            }
            if step < 1 {
                if let Some(p) = record.payload.as_deref() {
                    out = out.payload(p);
                }
            }
            let send = self.producer.send(out, Timeout::After(self.call_timeout));
            let error = match tokio::time::timeout(self.call_timeout, send).await {
                Ok(Ok(_)) => {
                    tracing::warn!(topic = %record.topic, partition = record.partition, offset = record.offset, dead_letter = %topic, %reason, dropped = %dropped, "record dead-lettered");
                    self.shared
                        .counters
                        .dead_lettered
                        .fetch_add(1, Ordering::Relaxed);
                    return true;
                }
                Ok(Err((e, _))) => e,
                Err(_) => KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut),
            };
            self.shared
                .counters
                .dead_letter_failures
                .fetch_add(1, Ordering::Relaxed);
            let too_large = matches!(
                error.rdkafka_error_code(),
                Some(
                    RDKafkaErrorCode::MessageSizeTooLarge
                        | RDKafkaErrorCode::InvalidMessageSize
                        | RDKafkaErrorCode::MessageBatchTooLarge
                )
            );
            if !too_large {
                tracing::warn!(topic = %record.topic, offset = record.offset, dead_letter = %topic, error = %error, "could not dead-letter: tried again");
                return false;
            }
            tracing::warn!(topic = %record.topic, offset = record.offset, dead_letter = %topic, error = %error, "the dead letter is too large: sent again with less of the record");
        }
        false
    }
}
