//! [`SqsConsumer`]: its settings and the builder methods that set them.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::Client;
use idem_core::{
    saturate, Codec, Idempotency, IdempotencyKey, IdempotencyStore, JsonCodec, PayloadFingerprint,
};

use crate::queue::MAX_BATCH;
use crate::shared::Shared;
use crate::{default_scope, queue_name, ConsumerStats, KeySource, SqsConsumerError};

/// The default of [`SqsConsumer::max_deliveries`].
///
/// ```
/// assert_eq!(idem_sqs::DEFAULT_MAX_DELIVERIES, 10);
/// ```
pub const DEFAULT_MAX_DELIVERIES: u32 = 10;

const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// SQS's longest long poll.
pub(crate) const MAX_WAIT_SECONDS: u64 = 20;
/// SQS's longest visibility timeout (12 hours).
pub(crate) const MAX_VISIBILITY_SECONDS: u64 = 43_200;

/// The most messages in flight at once ([`SqsConsumer::concurrency`] is
/// lowered to it): far above what a consumer can hold, far below what a
/// semaphore refuses.
pub const MAX_CONCURRENCY: usize = 1 << 20;

/// An idempotent SQS consumer; see the [crate docs](crate).
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_sqs::{SqsConsumer, SqsMessage};
///
/// # async fn run(client: idem_sqs::aws_sdk_sqs::Client, url: &str) -> Result<(), Box<dyn std::error::Error>> {
/// let consumer = SqsConsumer::new(client, url, Idempotency::new(MemoryStore::new()))
///     .key_from_content()
///     .concurrency(64)
///     .retry_visibility(Duration::from_secs(5)); // a failed message comes back after 5 s
/// let stats = consumer
///     .run(
///         |message: SqsMessage| async move { Ok::<_, std::io::Error>(message.body.len()) },
///         async { let _ = tokio::signal::ctrl_c().await; }, // stop on Ctrl-C
///     )
///     .await?;
/// println!("{stats:?}");
/// # Ok(()) }
/// ```
pub struct SqsConsumer<S: ?Sized, C = JsonCodec> {
    pub(crate) client: Client,
    pub(crate) queue_url: String,
    pub(crate) idem: Idempotency<S, C>,
    pub(crate) key: KeySource,
    pub(crate) scope: String,
    pub(crate) batch: usize,
    pub(crate) concurrency: usize,
    pub(crate) wait_time: Duration,
    pub(crate) visibility: Duration,
    pub(crate) heartbeat: bool,
    pub(crate) retry_visibility: Option<Duration>,
    pub(crate) max_deliveries: u32,
    pub(crate) dead_letter: Option<String>,
    pub(crate) fingerprint: PayloadFingerprint,
    pub(crate) call_timeout: Duration,
    pub(crate) shutdown_wait: Duration,
    pub(crate) transaction_wait: Duration,
    pub(crate) shared: Arc<Shared>,
}

impl<S: ?Sized, C> fmt::Debug for SqsConsumer<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqsConsumer")
            .field("queue_url", &self.queue_url)
            .field("key", &self.key)
            .field("scope", &self.scope)
            .field("batch", &self.batch)
            .field("concurrency", &self.concurrency)
            .field("wait_time", &self.wait_time)
            .field("visibility_timeout", &self.visibility)
            .field("heartbeat", &self.heartbeat)
            .field("retry_visibility", &self.retry_visibility)
            .field("max_deliveries", &self.max_deliveries)
            .field("dead_letter", &self.dead_letter)
            .field("fingerprint", &self.fingerprint)
            .field("call_timeout", &self.call_timeout)
            .field("shutdown_wait", &self.shutdown_wait)
            .finish_non_exhaustive()
    }
}

/// Whole seconds, rounded up, at most `max`.
pub(crate) fn seconds(d: Duration, max: u64) -> i32 {
    let s = d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0));
    // `max` is at most 43 200: the cast cannot truncate.
    s.min(max) as i32
}

impl<S: IdempotencyStore + ?Sized, C: Codec> SqsConsumer<S, C> {
    /// A consumer of the queue at `queue_url`, over a client you built.
    /// Nothing is sent until [`run`](Self::run).
    ///
    /// Defaults: the key is the message ID ([`KeySource::MessageId`]),
    /// scope `sqs.{queue name}` (when valid, else `sqs:` and a hash of the
    /// name: [`default_scope`]), receives of 10 messages, up to 40
    /// messages in flight, long polls of 20 s, a visibility timeout of
    /// 30 s renewed by the heartbeat, no change of visibility for a
    /// message left for redelivery, dead-lettered after
    /// [`DEFAULT_MAX_DELIVERIES`] receives, no dead-letter queue (poison is
    /// left to the queue's redrive policy), 5 s per call, and up to 30 s
    /// for the messages in flight at shutdown.
    pub fn new(client: Client, queue_url: impl Into<String>, idem: Idempotency<S, C>) -> Self {
        let queue_url = queue_url.into();
        let scope = default_scope(queue_name(&queue_url));
        let shared = Arc::<Shared>::default();
        SqsConsumer {
            client,
            queue_url,
            // A key whose completion the consumer gave up writing is never
            // acquired again here (its handler ran).
            idem: idem.waits_for_finishing(shared.finishing.clone()),
            key: KeySource::MessageId,
            scope,
            batch: MAX_BATCH,
            concurrency: 40,
            wait_time: Duration::from_secs(MAX_WAIT_SECONDS),
            visibility: Duration::from_secs(30),
            heartbeat: true,
            retry_visibility: None,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            dead_letter: None,
            fingerprint: PayloadFingerprint::Whole,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            shutdown_wait: Duration::from_secs(30),
            transaction_wait: idem_core::DEFAULT_TRANSACTION_WAIT,
            shared,
        }
    }

    /// Takes each message's key from this message attribute (of type
    /// `String`): a message without it is dead-lettered.
    pub fn key_attribute(mut self, name: impl Into<String>) -> Self {
        self.key = KeySource::Attribute(name.into());
        self
    }

    /// Takes each message's key from its SQS message ID (the default).
    pub fn key_from_message_id(mut self) -> Self {
        self.key = KeySource::MessageId;
        self
    }

    /// Takes each message's key from a SHA-256 of its body (of the parts
    /// of it that count, with a [`fingerprint`](Self::fingerprint) of
    /// parts: copies that differ elsewhere share a key).
    pub fn key_from_content(mut self) -> Self {
        self.key = KeySource::Content;
        self
    }

    /// The scope of the keys (default `sqs.{queue name}`, see
    /// [`default_scope`]). `run` refuses a scope that is not valid.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = scope.into();
        self
    }

    /// Messages asked for per `ReceiveMessage` (default and at most 10, at
    /// least 1).
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.clamp(1, MAX_BATCH);
        self
    }

    /// Messages in flight at once, over several receives (default 40, at
    /// least 1). A receive asks for no more than the room left.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.clamp(1, MAX_CONCURRENCY);
        self
    }

    /// How long a receive waits for messages (`WaitTimeSeconds`: whole
    /// seconds, rounded up, at most 20; default 20). Zero is a short poll,
    /// with a pause of 100 ms after an empty answer.
    pub fn wait_time(mut self, wait: Duration) -> Self {
        self.wait_time = Duration::from_secs(seconds(wait, MAX_WAIT_SECONDS) as u64);
        self
    }

    /// The visibility timeout every receive asks for (whole seconds,
    /// rounded up, from 1 s to 12 h; default 30 s). The heartbeat renews
    /// it every third of it while a message is being handled; without the
    /// heartbeat, set it longer than your handler's longest run.
    pub fn visibility_timeout(mut self, timeout: Duration) -> Self {
        let s = seconds(timeout, MAX_VISIBILITY_SECONDS).max(1);
        self.visibility = Duration::from_secs(s as u64);
        self
    }

    /// Whether to renew the visibility of messages in flight (default on).
    pub fn heartbeat(mut self, on: bool) -> Self {
        self.heartbeat = on;
        self
    }

    /// When a message is left for redelivery (its handler failed, its key
    /// is in progress elsewhere, the store is away), set its visibility to
    /// this (whole seconds, rounded up, at most 12 h; zero: visible at
    /// once), so it comes back sooner than its visibility timeout. Default:
    /// unset (it comes back when its visibility timeout runs out).
    pub fn retry_visibility(mut self, after: Duration) -> Self {
        let s = seconds(after, MAX_VISIBILITY_SECONDS);
        self.retry_visibility = Some(Duration::from_secs(s as u64));
        self
    }

    /// How many receives a message whose handler fails gets before it is
    /// dead-lettered (default [`DEFAULT_MAX_DELIVERIES`]; at least 1). The
    /// count is SQS's `ApproximateReceiveCount`, which every receive
    /// increases: receives answered "in progress", or that found the
    /// store unavailable, count too, but only a failure of the handler at
    /// or past the limit dead-letters the message. A message whose count
    /// is missing or not a number is left for redelivery on a failure
    /// (with `max_deliveries(1)`: dead-lettered). Set it below the queue's
    /// `maxReceiveCount` if the queue has a redrive policy, or SQS moves
    /// the message first, without a reason.
    pub fn max_deliveries(mut self, n: u32) -> Self {
        self.max_deliveries = n.max(1);
        self
    }

    /// What of a message's body its fingerprint covers (default: the whole
    /// body's bytes). With [`PayloadFingerprint::json_pointers`], only the
    /// parts of a JSON body the pointers name count, so a producer's
    /// resend that differs elsewhere (a timestamp set on each send) is a
    /// duplicate, replayed and deleted, not a payload mismatch
    /// dead-lettered; a body that is not JSON counts whole. A message of a
    /// key recorded before a change of this is a mismatch.
    pub fn fingerprint(mut self, what: PayloadFingerprint) -> Self {
        self.fingerprint = what;
        self
    }

    /// The URL of the queue that poison messages are sent to, with the
    /// reason (default: none, poison is left to the queue's redrive
    /// policy; see the [crate docs](crate#dead-letters)).
    pub fn dead_letter(mut self, queue_url: impl Into<String>) -> Self {
        self.dead_letter = Some(queue_url.into());
        self
    }

    /// How long one SQS call may take (on top of a receive's wait) before
    /// it counts as failed (default 5 s, at least 1 ms).
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = saturate(timeout).max(Duration::from_millis(1));
        self
    }

    /// How long `run` waits at shutdown for the messages in flight
    /// (default 30 s). Saturated to [`MAX_DURATION`](idem_core::MAX_DURATION).
    pub fn shutdown_wait(mut self, wait: Duration) -> Self {
        self.shutdown_wait = saturate(wait);
        self
    }

    /// In the in-transaction form
    /// ([`run_in_transaction`](Self::run_in_transaction)), how long a
    /// message's claim waits for another transaction holding its key
    /// (default 10 s, at least 1 ms): then the message is left for
    /// redelivery.
    pub fn transaction_wait(mut self, wait: Duration) -> Self {
        self.transaction_wait = wait;
        self
    }

    /// The client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The queue URL.
    pub fn queue_url(&self) -> &str {
        &self.queue_url
    }

    /// What this consumer did so far.
    pub fn stats(&self) -> ConsumerStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerStats {
            received: get(&c.received),
            executed: get(&c.executed),
            replayed: get(&c.replayed),
            in_progress: get(&c.in_progress),
            deleted: get(&c.deleted),
            delete_failures: get(&c.delete_failures),
            poison: get(&c.poison),
            dead_lettered: get(&c.dead_lettered),
            dead_letter_failures: get(&c.dead_letter_failures),
            left_for_redelivery: get(&c.left_for_redelivery),
            heartbeats: get(&c.heartbeats),
            heartbeat_failures: get(&c.heartbeat_failures),
            abandoned: get(&c.abandoned),
        }
    }

    pub(crate) fn check(&self) -> Result<(), SqsConsumerError> {
        if self.queue_url.trim().is_empty() {
            return Err(SqsConsumerError::Config("the queue URL is empty".into()));
        }
        if let Some(dead) = &self.dead_letter {
            if dead.trim().is_empty() {
                return Err(SqsConsumerError::Config(
                    "the dead-letter queue URL is empty".into(),
                ));
            }
            if dead == &self.queue_url {
                return Err(SqsConsumerError::Config(
                    "the dead-letter queue is the queue itself: poison would come back".into(),
                ));
            }
        }
        // An invalid scope would make every message "no usable key", and
        // dead-letter the whole queue.
        if let Err(e) = IdempotencyKey::new(self.scope.clone(), "x") {
            return Err(SqsConsumerError::Config(format!(
                "the scope {:?} is not valid: {e}",
                self.scope
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_become_whole_seconds_within_limits() {
        assert_eq!(seconds(Duration::ZERO, 20), 0);
        assert_eq!(seconds(Duration::from_millis(1), 20), 1);
        assert_eq!(seconds(Duration::from_millis(1500), 20), 2);
        assert_eq!(seconds(Duration::MAX, MAX_VISIBILITY_SECONDS), 43_200);
    }
}
