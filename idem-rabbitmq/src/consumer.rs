//! [`RabbitConsumer`]: its settings and the builder methods that set them.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    saturate, Codec, Idempotency, IdempotencyKey, IdempotencyStore, JsonCodec, PayloadFingerprint,
    DEFAULT_TRANSACTION_WAIT,
};
use lapin::types::ShortString;
use lapin::ConnectionProperties;

use crate::shared::Shared;
use crate::{default_scope, ConsumerStats, KeySource, RabbitConsumerError};

/// The default of [`RabbitConsumer::max_deliveries`].
///
/// ```
/// assert_eq!(idem_rabbitmq::DEFAULT_MAX_DELIVERIES, 10);
/// ```
pub const DEFAULT_MAX_DELIVERIES: u32 = 10;

/// The default of [`RabbitConsumer::prefetch`]: how many unacked messages
/// the broker hands this consumer at once.
pub const DEFAULT_PREFETCH: u16 = 32;

/// Where a poison message goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadLetter {
    /// Rejected without requeue (`basic.nack`, `requeue=false`): the
    /// broker moves it to the queue's own dead-letter exchange
    /// (`x-dead-letter-exchange`, with its `x-death` header), or **drops
    /// it** when the queue has none. The reason is in the log only.
    QueuePolicy,
    /// Published by the consumer to this exchange with this routing key
    /// (the empty exchange and a queue's name send it straight to that
    /// queue), with publisher confirms, the same body and properties and
    /// the headers `idem-reason`, `idem-source-queue` and
    /// `idem-delivery-count` added; acked once the broker confirmed it.
    Exchange {
        /// The exchange (empty: the default exchange).
        exchange: String,
        /// The routing key.
        routing_key: String,
    },
}

/// An idempotent RabbitMQ consumer; see the [crate docs](crate).
///
/// ```no_run
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_rabbitmq::{RabbitConsumer, RabbitMessage};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let idem = Idempotency::new(MemoryStore::new());
/// let consumer = RabbitConsumer::new("amqp://guest:guest@127.0.0.1:5672/%2f", "payments", idem)
///     .prefetch(64)
///     .dead_letter_queue("payments-dead");
/// let stats = consumer
///     .run(
///         |message: RabbitMessage| async move { Ok::<_, std::io::Error>(message.body.len()) },
///         async { let _ = tokio::signal::ctrl_c().await; }, // stop on Ctrl-C
///     )
///     .await?;
/// println!("{stats:?}");
/// # Ok(()) }
/// ```
pub struct RabbitConsumer<S: ?Sized, C = JsonCodec> {
    pub(crate) uri: String,
    pub(crate) queue: String,
    pub(crate) idem: Idempotency<S, C>,
    pub(crate) key: KeySource,
    pub(crate) scope: String,
    pub(crate) prefetch: u16,
    pub(crate) max_deliveries: u32,
    pub(crate) dead_letter: DeadLetter,
    pub(crate) requeue_delay: Duration,
    pub(crate) fingerprint: PayloadFingerprint,
    pub(crate) shutdown_wait: Duration,
    pub(crate) transaction_wait: Duration,
    pub(crate) consumer_tag: String,
    pub(crate) properties: Arc<dyn Fn() -> ConnectionProperties + Send + Sync>,
    pub(crate) shared: Arc<Shared>,
}

impl<S: ?Sized, C> fmt::Debug for RabbitConsumer<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitConsumer")
            .field("queue", &self.queue)
            .field("key", &self.key)
            .field("scope", &self.scope)
            .field("prefetch", &self.prefetch)
            .field("max_deliveries", &self.max_deliveries)
            .field("dead_letter", &self.dead_letter)
            .field("requeue_delay", &self.requeue_delay)
            .field("fingerprint", &self.fingerprint)
            .field("shutdown_wait", &self.shutdown_wait)
            .finish_non_exhaustive()
    }
}

impl<S: IdempotencyStore + ?Sized, C: Codec> RabbitConsumer<S, C> {
    /// A consumer of `queue` on the broker at `uri`
    /// (`amqp://user:password@host:5672/vhost`, `amqps://` for TLS). Nothing
    /// is sent until [`run`](Self::run), which connects, and connects again
    /// whenever the connection is lost.
    ///
    /// Defaults: the key is the `message_id` property
    /// ([`KeySource::MessageId`]), scope `amqp.{queue}` (when valid, else
    /// `amqp:` and a hash of the name: [`default_scope`]), a prefetch of
    /// [`DEFAULT_PREFETCH`], dead-lettered after [`DEFAULT_MAX_DELIVERIES`]
    /// deliveries to the queue's own dead-letter exchange
    /// ([`DeadLetter::QueuePolicy`]), a message held 1 s before it is
    /// requeued, and up to 30 s for the messages in flight at shutdown.
    pub fn new(uri: impl Into<String>, queue: impl Into<String>, idem: Idempotency<S, C>) -> Self {
        let queue = queue.into();
        let scope = default_scope(&queue);
        let shared = Arc::<Shared>::default();
        RabbitConsumer {
            uri: uri.into(),
            // A key whose completion the consumer gave up writing is never
            // acquired again here (its handler ran).
            idem: idem.waits_for_finishing(shared.finishing.clone()),
            queue,
            key: KeySource::MessageId,
            scope,
            prefetch: DEFAULT_PREFETCH,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            dead_letter: DeadLetter::QueuePolicy,
            requeue_delay: Duration::from_secs(1),
            fingerprint: PayloadFingerprint::Whole,
            shutdown_wait: Duration::from_secs(30),
            transaction_wait: DEFAULT_TRANSACTION_WAIT,
            consumer_tag: String::new(),
            properties: Arc::new(ConnectionProperties::default),
            shared,
        }
    }

    /// Where keys come from (default [`KeySource::MessageId`]).
    pub fn key(mut self, key: KeySource) -> Self {
        self.key = key;
        self
    }

    /// Keys from the header `name` ([`KeySource::Header`]).
    pub fn key_header(self, name: impl Into<String>) -> Self {
        self.key(KeySource::Header(name.into()))
    }

    /// Keys from a hash of the body ([`KeySource::Content`]).
    pub fn key_from_content(self) -> Self {
        self.key(KeySource::Content)
    }

    /// The scope of the keys (default `amqp.{queue}`). Checked by
    /// [`run`](Self::run): an invalid scope is refused, never a queue
    /// dead-lettered for want of a key.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = scope.into();
        self
    }

    /// How many unacked messages the broker hands this consumer at once
    /// (`basic.qos`; default [`DEFAULT_PREFETCH`]). It bounds the messages in
    /// flight: handlers running, messages held before a requeue, results
    /// being finished. Zero (no limit, in AMQP) is raised to 1.
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// A message is dead-lettered once its handler failed on its
    /// `max_deliveries`-th delivery, or its key was acquired more than this
    /// many times (the runs before were cut off: their consumer died).
    /// Failed runs are counted in the store, on every kind of queue (see
    /// the [crate docs](crate#delivery-counts)). Zero is raised to 1.
    pub fn max_deliveries(mut self, n: u32) -> Self {
        self.max_deliveries = n.max(1);
        self
    }

    /// Where poison goes (default [`DeadLetter::QueuePolicy`]).
    pub fn dead_letter(mut self, dead_letter: DeadLetter) -> Self {
        self.dead_letter = dead_letter;
        self
    }

    /// Poison is published to the queue `queue` (through the default
    /// exchange), with its reason in the `idem-reason` header.
    pub fn dead_letter_queue(self, queue: impl Into<String>) -> Self {
        self.dead_letter(DeadLetter::Exchange {
            exchange: String::new(),
            routing_key: queue.into(),
        })
    }

    /// How long a message that cannot be settled now is held (unacked, so
    /// no other consumer gets it) before it is tried again: in place when
    /// its key is in progress elsewhere or the store is away (never
    /// requeued for that), or requeued when its handler failed (default
    /// 1 s; at least 10 ms between two tries in place; zero requeues a
    /// failed message at once). Saturated at the longest duration the
    /// runtime can sleep.
    pub fn requeue_delay(mut self, delay: Duration) -> Self {
        self.requeue_delay = saturate(delay);
        self
    }

    /// What of the body is fingerprinted (default the whole body).
    pub fn fingerprint(mut self, what: PayloadFingerprint) -> Self {
        self.fingerprint = what;
        self
    }

    /// How long [`run`](Self::run) waits at shutdown for the messages in
    /// flight (default 30 s).
    pub fn shutdown_wait(mut self, wait: Duration) -> Self {
        self.shutdown_wait = saturate(wait);
        self
    }

    /// How long [`run_in_transaction`](Self::run_in_transaction) waits for
    /// a key held by another transaction (default
    /// [`DEFAULT_TRANSACTION_WAIT`]).
    pub fn transaction_wait(mut self, wait: Duration) -> Self {
        self.transaction_wait = wait;
        self
    }

    /// The consumer tag (default: one the broker picks).
    pub fn consumer_tag(mut self, tag: impl Into<String>) -> Self {
        self.consumer_tag = tag.into();
        self
    }

    /// The properties of each connection (a connection name, an auth
    /// provider, client properties); called at each connect.
    pub fn connection_properties(
        mut self,
        properties: impl Fn() -> ConnectionProperties + Send + Sync + 'static,
    ) -> Self {
        self.properties = Arc::new(properties);
        self
    }

    /// The queue.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// What this consumer did so far.
    pub fn stats(&self) -> ConsumerStats {
        self.shared.counters.snapshot()
    }

    pub(crate) fn check(&self) -> Result<(), RabbitConsumerError> {
        let config = |s: String| Err(RabbitConsumerError::Config(s));
        if self.uri.trim().is_empty() {
            return config("the broker URI is empty".into());
        }
        if let Err(e) = self.uri.parse::<lapin::uri::AMQPUri>() {
            return config(format!("the broker URI does not parse: {e}"));
        }
        if self.queue.is_empty() {
            return config("the queue name is empty".into());
        }
        for (what, name) in [
            ("queue name", &self.queue),
            ("consumer tag", &self.consumer_tag),
        ] {
            if ShortString::try_new(name.as_str()).is_err() {
                return config(format!("the {what} is over 255 bytes"));
            }
        }
        if let DeadLetter::Exchange {
            exchange,
            routing_key,
        } = &self.dead_letter
        {
            if ShortString::try_new(exchange.as_str()).is_err()
                || ShortString::try_new(routing_key.as_str()).is_err()
            {
                return config("the dead-letter exchange or routing key is over 255 bytes".into());
            }
            if exchange.is_empty() && routing_key.is_empty() {
                return config("the dead-letter queue name is empty".into());
            }
            if exchange.is_empty() && routing_key == &self.queue {
                return config(
                    "the dead-letter queue is the queue itself: poison would come back".into(),
                );
            }
        }
        // An invalid scope would make every message "no usable key", and
        // dead-letter the whole queue.
        if let Err(e) = IdempotencyKey::new(self.scope.clone(), "x") {
            return config(format!("the scope {:?} is not valid: {e}", self.scope));
        }
        Ok(())
    }
}
