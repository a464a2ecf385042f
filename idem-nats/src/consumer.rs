//! [`NatsConsumer`]: its settings and the builder methods that set them.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use idem_core::{
    saturate, Codec, Idempotency, IdempotencyKey, IdempotencyStore, JsonCodec, PayloadFingerprint,
};

use crate::message::is_header_name;
use crate::shared::Shared;
use crate::{default_scope, ConsumerStats, KeySource, NatsConsumerError};

/// The default of [`NatsConsumer::max_deliveries`].
///
/// ```
/// assert_eq!(idem_nats::DEFAULT_MAX_DELIVERIES, 10);
/// ```
pub const DEFAULT_MAX_DELIVERIES: u32 = 10;

/// The most messages in flight at once ([`NatsConsumer::concurrency`] and
/// [`NatsConsumer::max_ack_pending`] are lowered to it): far above what a
/// consumer can hold, far below what a semaphore refuses.
pub const MAX_CONCURRENCY: usize = 1 << 20;

/// The most messages one pull request asks for ([`NatsConsumer::batch`]).
pub const MAX_BATCH: usize = 1024;

/// The shortest ack wait ([`NatsConsumer::ack_wait`] is raised to it).
pub const MIN_ACK_WAIT: Duration = Duration::from_millis(100);

/// The longest ack wait ([`NatsConsumer::ack_wait`] is lowered to it).
pub const MAX_ACK_WAIT: Duration = Duration::from_secs(24 * 60 * 60);

/// The shortest and longest pull expiry ([`NatsConsumer::pull_wait`]).
pub(crate) const MIN_PULL_WAIT: Duration = Duration::from_millis(100);
pub(crate) const MAX_PULL_WAIT: Duration = Duration::from_secs(60);

/// The longest delay of a message handed back ([`NatsConsumer::retry_delay`]).
pub(crate) const MAX_RETRY_DELAY: Duration = Duration::from_secs(24 * 60 * 60);

/// An idempotent JetStream consumer; see the [crate docs](crate).
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_nats::{NatsConsumer, NatsMessage};
///
/// # async fn run(js: idem_nats::async_nats::jetstream::Context) -> Result<(), Box<dyn std::error::Error>> {
/// let consumer = NatsConsumer::new(js, "ORDERS", "billing", Idempotency::new(MemoryStore::new()))
///     .key_from_content()
///     .concurrency(64)
///     .retry_delay(Duration::from_secs(5)); // a failed message comes back after 5 s
/// let stats = consumer
///     .run(
///         |message: NatsMessage| async move { Ok::<_, std::io::Error>(message.payload.len()) },
///         async { let _ = tokio::signal::ctrl_c().await; }, // stop on Ctrl-C
///     )
///     .await?;
/// println!("{stats:?}");
/// # Ok(()) }
/// ```
pub struct NatsConsumer<S: ?Sized, C = JsonCodec> {
    pub(crate) jetstream: jetstream::Context,
    pub(crate) stream: String,
    pub(crate) durable: String,
    pub(crate) filter_subject: Option<String>,
    pub(crate) idem: Idempotency<S, C>,
    pub(crate) key: KeySource,
    pub(crate) scope: String,
    pub(crate) batch: usize,
    pub(crate) concurrency: usize,
    pub(crate) max_ack_pending: usize,
    pub(crate) ack_wait: Duration,
    pub(crate) progress_acks: bool,
    pub(crate) pull_wait: Duration,
    pub(crate) retry_delay: Duration,
    pub(crate) max_deliveries: u32,
    pub(crate) dead_letter: Option<String>,
    pub(crate) fingerprint: PayloadFingerprint,
    pub(crate) shutdown_wait: Duration,
    pub(crate) transaction_wait: Duration,
    pub(crate) shared: Arc<Shared>,
}

impl<S: ?Sized, C> fmt::Debug for NatsConsumer<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConsumer")
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("filter_subject", &self.filter_subject)
            .field("key", &self.key)
            .field("scope", &self.scope)
            .field("batch", &self.batch)
            .field("concurrency", &self.concurrency)
            .field("max_ack_pending", &self.max_ack_pending)
            .field("ack_wait", &self.ack_wait)
            .field("progress_acks", &self.progress_acks)
            .field("pull_wait", &self.pull_wait)
            .field("retry_delay", &self.retry_delay)
            .field("max_deliveries", &self.max_deliveries)
            .field("dead_letter", &self.dead_letter)
            .field("fingerprint", &self.fingerprint)
            .field("shutdown_wait", &self.shutdown_wait)
            .finish_non_exhaustive()
    }
}

impl<S: IdempotencyStore + ?Sized, C: Codec> NatsConsumer<S, C> {
    /// A consumer of the durable pull consumer `durable` of the stream
    /// `stream`, over a JetStream context you built
    /// (`async_nats::jetstream::new(client)`). Nothing is sent until
    /// [`run`](Self::run), which creates the durable consumer, or updates
    /// it to these settings (give every process that runs it the same
    /// ones: each `run` updates it to its own).
    ///
    /// Defaults: the key is the `Nats-Msg-Id` header
    /// ([`KeySource::MessageId`]), scope `nats.{stream}.{durable}` (when
    /// valid, else `nats:` and a hash: [`default_scope`]), pulls of up to
    /// 64 messages that wait up to 5 s, up to 64 messages in flight here,
    /// a `max_ack_pending` of 1,000 for the durable consumer, an ack wait
    /// of 30 s with in-progress acks every third of it while a message is
    /// held, a message handed back with a delay of 1 s, dead-lettered
    /// after [`DEFAULT_MAX_DELIVERIES`] deliveries, no dead-letter subject
    /// (poison is terminated, `+TERM`, and logged), and up to 30 s for
    /// the messages in flight at shutdown.
    pub fn new(
        jetstream: jetstream::Context,
        stream: impl Into<String>,
        durable: impl Into<String>,
        idem: Idempotency<S, C>,
    ) -> Self {
        let stream = stream.into();
        let durable = durable.into();
        let scope = default_scope(&stream, &durable);
        let shared = Arc::new(Shared::new(&durable));
        NatsConsumer {
            jetstream,
            stream,
            durable,
            filter_subject: None,
            // A key whose completion the consumer gave up writing is never
            // acquired again here (its handler ran).
            idem: idem.waits_for_finishing(shared.finishing.clone()),
            key: KeySource::MessageId,
            scope,
            batch: 64,
            concurrency: 64,
            max_ack_pending: 1000,
            ack_wait: Duration::from_secs(30),
            progress_acks: true,
            pull_wait: Duration::from_secs(5),
            retry_delay: Duration::from_secs(1),
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            dead_letter: None,
            fingerprint: PayloadFingerprint::Whole,
            shutdown_wait: Duration::from_secs(30),
            transaction_wait: idem_core::DEFAULT_TRANSACTION_WAIT,
            shared,
        }
    }

    /// Takes each message's key from this header: a message without it is
    /// dead-lettered. `run` refuses a name that is not a valid header name
    /// (empty, whitespace, ':', a control or non-ASCII character).
    pub fn key_header(mut self, name: impl Into<String>) -> Self {
        self.key = KeySource::Header(name.into());
        self
    }

    /// Takes each message's key from its `Nats-Msg-Id` header (the
    /// default): a message without it is dead-lettered.
    pub fn key_from_message_id(mut self) -> Self {
        self.key = KeySource::MessageId;
        self
    }

    /// Takes each message's key from a SHA-256 of its payload.
    pub fn key_from_content(mut self) -> Self {
        self.key = KeySource::Content;
        self
    }

    /// The scope of the keys (default `nats.{stream}.{durable}`, see
    /// [`default_scope`]). `run` refuses a scope that is not valid.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = scope.into();
        self
    }

    /// Only the messages of the stream whose subject matches this filter
    /// (the durable consumer's `filter_subject`; default: every subject of
    /// the stream). `run` refuses an empty one.
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subject = Some(subject.into());
        self
    }

    /// The most messages one pull request asks for (default 64, from 1 to
    /// [`MAX_BATCH`]); a pull asks for no more than the room left.
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.clamp(1, MAX_BATCH);
        self
    }

    /// Messages in flight at once in this consumer (default 64, from 1 to
    /// [`MAX_CONCURRENCY`]).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.clamp(1, MAX_CONCURRENCY);
        self
    }

    /// The durable consumer's `max_ack_pending`: the most messages
    /// delivered and not yet acked, over every process that consumes it
    /// (default 1,000, from 1 to [`MAX_CONCURRENCY`]). JetStream delivers
    /// no more until some are acked.
    pub fn max_ack_pending(mut self, n: usize) -> Self {
        self.max_ack_pending = n.clamp(1, MAX_CONCURRENCY);
        self
    }

    /// The durable consumer's `ack_wait`: how long JetStream waits for an
    /// ack (or an in-progress ack) before it delivers a message again
    /// (default 30 s, from [`MIN_ACK_WAIT`] to [`MAX_ACK_WAIT`]). With
    /// [`progress_acks`](Self::progress_acks) on, a message held longer is
    /// kept by in-progress acks every third of it.
    pub fn ack_wait(mut self, wait: Duration) -> Self {
        self.ack_wait = wait.clamp(MIN_ACK_WAIT, MAX_ACK_WAIT);
        self
    }

    /// Whether to send in-progress acks (`+WPI`) every third of the ack
    /// wait while a message is held: while its handler runs, and while
    /// its completion is written after a store outage (default on).
    /// Without them, a handler that runs longer than the ack wait has its
    /// message delivered again meanwhile: the redelivery gets "in
    /// progress" (handed back) and, once the first run recorded, the
    /// replay.
    pub fn progress_acks(mut self, on: bool) -> Self {
        self.progress_acks = on;
        self
    }

    /// How long a pull request waits for messages (its `expires`; default
    /// 5 s, from 100 ms to 60 s).
    pub fn pull_wait(mut self, wait: Duration) -> Self {
        self.pull_wait = wait.clamp(MIN_PULL_WAIT, MAX_PULL_WAIT);
        self
    }

    /// The delay of a message handed back (`-NAK` with this delay: its
    /// handler failed, its key is in progress elsewhere, the store is
    /// away); default 1 s, at most 24 h; zero: delivered again at once.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay.min(MAX_RETRY_DELAY);
        self
    }

    /// How many deliveries a message whose handler fails gets before it is
    /// dead-lettered (default [`DEFAULT_MAX_DELIVERIES`]; at least 1). The
    /// count is JetStream's delivery count of the message, which every
    /// delivery increases: deliveries answered "in progress", or that
    /// found the store unavailable, count too, but only a failure of the
    /// handler at or past the limit dead-letters the message. The durable
    /// consumer is made with no `max_deliver` of its own (JetStream's
    /// would stop delivering a message silently, without a dead letter).
    pub fn max_deliveries(mut self, n: u32) -> Self {
        self.max_deliveries = n.max(1);
        self
    }

    /// What of a message's payload its fingerprint covers (default: the
    /// whole payload). With [`PayloadFingerprint::json_pointers`], only the
    /// parts of a JSON payload the pointers name count.
    pub fn fingerprint(mut self, what: PayloadFingerprint) -> Self {
        self.fingerprint = what;
        self
    }

    /// The subject poison messages are published to, with the reason in
    /// their headers (default: none, poison is terminated with `+TERM`
    /// and logged). A stream must capture the subject (`run` fails when
    /// none does): the publish waits for JetStream's ack, and a dead
    /// letter that could not be published for now is handed back and
    /// tried again on the next delivery; one JetStream refuses for good
    /// goes out without the message's headers, then without its payload,
    /// else the message is terminated (`+TERM`, an error logged). See the
    /// [crate docs](crate#dead-letters).
    pub fn dead_letter(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter = Some(subject.into());
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
    /// (default 10 s): then the message is handed back.
    pub fn transaction_wait(mut self, wait: Duration) -> Self {
        self.transaction_wait = wait;
        self
    }

    /// The JetStream context.
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.jetstream
    }

    /// The stream's name.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The durable consumer's name.
    pub fn durable(&self) -> &str {
        &self.durable
    }

    /// What this consumer did so far.
    pub fn stats(&self) -> ConsumerStats {
        self.shared.counters.read()
    }

    pub(crate) fn check(&self) -> Result<(), NatsConsumerError> {
        let config = |s: String| Err(NatsConsumerError::Config(s));
        if !is_name(&self.stream) {
            return config(format!("the stream name {:?} is not valid (empty, or with whitespace, '.', '*', '>', '/' or '\\\\')", self.stream));
        }
        if !is_name(&self.durable) {
            return config(format!("the consumer name {:?} is not valid (empty, or with whitespace, '.', '*', '>', '/' or '\\\\')", self.durable));
        }
        if let Some(filter) = &self.filter_subject {
            if !is_subject(filter, true) {
                return config(format!("the filter subject {filter:?} is not valid"));
            }
        }
        if let Some(dead) = &self.dead_letter {
            if !is_subject(dead, false) {
                return config(format!(
                    "the dead-letter subject {dead:?} is not valid (empty, a wildcard, whitespace)"
                ));
            }
            if let Some(filter) = &self.filter_subject {
                if subject_matches(filter, dead) {
                    return config(format!(
                        "the dead-letter subject {dead:?} is read by this consumer (filter {filter:?}): poison would come back"
                    ));
                }
            }
        }
        // A name no header can have: every message would be "no usable
        // key" (async-nats panics on a lookup by such a name).
        if let KeySource::Header(name) = &self.key {
            if !is_header_name(name) {
                return config(format!("the key header name {name:?} is not valid (empty, or with whitespace, ':', a control or non-ASCII character)"));
            }
        }
        // An invalid scope would make every message "no usable key", and
        // dead-letter the whole stream.
        if let Err(e) = IdempotencyKey::new(self.scope.clone(), "x") {
            return config(format!("the scope {:?} is not valid: {e}", self.scope));
        }
        Ok(())
    }
}

/// A JetStream stream or consumer name.
fn is_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || ".*>/\\".contains(c))
}

/// A subject: dot-separated tokens, none empty, no whitespace; wildcards
/// (`*` a token, `>` the last token) only when `wildcards`.
pub(crate) fn is_subject(subject: &str, wildcards: bool) -> bool {
    if subject.is_empty() || subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return false;
    }
    let tokens: Vec<&str> = subject.split('.').collect();
    tokens.iter().enumerate().all(|(i, t)| match *t {
        "" => false,
        "*" => wildcards,
        ">" => wildcards && i + 1 == tokens.len(),
        t => !t.contains(['*', '>']),
    })
}

/// Whether `subject` matches the subject filter `pattern` (`*` one token,
/// `>` one or more at the end).
pub(crate) fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut subject = subject.split('.');
    for p in pattern.split('.') {
        match (p, subject.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (p, Some(s)) if p == s => {}
            _ => return false,
        }
    }
    subject.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_match_as_nats_does() {
        assert!(subject_matches("orders.*", "orders.eu"));
        assert!(!subject_matches("orders.*", "orders.eu.1"));
        assert!(subject_matches("orders.>", "orders.eu.1"));
        assert!(!subject_matches("orders.>", "orders"));
        assert!(subject_matches("orders", "orders"));
        assert!(!subject_matches("orders", "orders.dead"));
        assert!(is_subject("a.b", false) && is_subject("a.*.>", true));
        for bad in ["", "a..b", "a b", "a.>.b", ".a", "a.", "a\nb"] {
            assert!(!is_subject(bad, true), "{bad:?}");
        }
        assert!(!is_subject("a.*", false));
        assert!(is_name("ORDERS") && !is_name("a.b") && !is_name("") && !is_name("a b"));
    }
}
