//! The consumer and its settings: how it is made ([`connect`](KafkaConsumer::connect),
//! [`new`](KafkaConsumer::new)) and its builder methods.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{
    saturate, Codec, Idempotency, IdempotencyKey, IdempotencyStore, JsonCodec, KeyError,
    PayloadFingerprint,
};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::FutureProducer;

use crate::context::IdemContext;
use crate::error::KafkaConsumerError;
#[cfg(doc)]
use crate::record::default_scope;
use crate::record::KeySource;
use crate::shared::Shared;
use crate::stats::Counters;

/// The most records `concurrency`, `partition_concurrency` and `batch` let
/// be in flight or acquired together (1,048,576): larger settings are
/// clamped to it (a semaphore cannot hold `usize::MAX` permits).
pub const MAX_IN_FLIGHT: usize = 1 << 20;

/// The default of [`KafkaConsumer::max_deliveries`].
pub const DEFAULT_MAX_DELIVERIES: u32 = 10;

/// An idempotent consumer-group member; see the [crate docs](crate).
pub struct KafkaConsumer<S: ?Sized, C = JsonCodec> {
    pub(crate) consumer: Arc<StreamConsumer<IdemContext>>,
    pub(crate) producer: FutureProducer,
    pub(crate) group: String,
    pub(crate) topics: Vec<String>,
    pub(crate) idem: Idempotency<S, C>,
    pub(crate) key: KeySource,
    pub(crate) scope: Option<String>,
    pub(crate) batch: usize,
    pub(crate) concurrency: usize,
    pub(crate) partition_concurrency: usize,
    pub(crate) max_deliveries: u32,
    pub(crate) dead_letter: Option<String>,
    pub(crate) fingerprint: PayloadFingerprint,
    pub(crate) revoke_wait: Duration,
    pub(crate) transaction_wait: Duration,
    pub(crate) commit_interval: Duration,
    pub(crate) retry_backoff: (Duration, Duration),
    pub(crate) call_timeout: Duration,
    pub(crate) shared: Arc<Shared>,
}

impl<S: ?Sized, C> fmt::Debug for KafkaConsumer<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("group", &self.group)
            .field("topics", &self.topics)
            .field("key", &self.key)
            .field("scope", &self.scope)
            .field("batch", &self.batch)
            .field("concurrency", &self.concurrency)
            .field("partition_concurrency", &self.partition_concurrency)
            .field("max_deliveries", &self.max_deliveries)
            .field("dead_letter", &self.dead_letter)
            .field("fingerprint", &self.fingerprint)
            .field("revoke_wait", &self.revoke_wait)
            .finish_non_exhaustive()
    }
}

/// Settings of the consumer's configuration copied to the dead-letter
/// producer: the connection and its security.
fn producer_config(config: &ClientConfig) -> ClientConfig {
    let mut out = ClientConfig::new();
    for (k, v) in config.config_map() {
        if k == "bootstrap.servers"
            || k == "metadata.broker.list"
            || k == "client.id"
            || k.starts_with("security.")
            || k.starts_with("sasl.")
            || k.starts_with("ssl.")
            || k.starts_with("socket.")
            || k.starts_with("broker.")
        {
            out.set(k, v);
        }
    }
    out
}

impl<S: IdempotencyStore + ?Sized, C: Codec> KafkaConsumer<S, C> {
    /// A consumer of `topics` in `group` on `brokers` (`host:port,...`),
    /// with librdkafka's defaults but `auto.offset.reset=earliest`,
    /// `session.timeout.ms=10000` and `heartbeat.interval.ms=1000`; for
    /// anything else (security, other timeouts) use [`new`](Self::new).
    pub fn connect(
        brokers: &str,
        group: &str,
        topics: &[&str],
        idem: Idempotency<S, C>,
    ) -> Result<Self, KafkaConsumerError> {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", brokers)
            .set("group.id", group)
            .set("session.timeout.ms", "10000")
            .set("heartbeat.interval.ms", "1000");
        Self::new(&config, topics, idem)
    }

    /// A consumer made from your client configuration (it must set
    /// `bootstrap.servers` and `group.id`), subscribed to `topics`. It sets
    /// `enable.auto.commit=false` and `enable.auto.offset.store=false`
    /// (commits are the consumer's), and `auto.offset.reset=earliest`
    /// unless you set it. The dead-letter producer gets the connection and
    /// security settings of the same configuration. Must be called inside
    /// a tokio runtime.
    ///
    /// Defaults: key from the record key, scope [`default_scope`] of each
    /// record's topic, each record acquired on its own (`batch(1)`), 64
    /// records in flight, 16 per partition, [`DEFAULT_MAX_DELIVERIES`],
    /// dead letters to `{topic}.dead`, 10 s `revoke_wait`, commits every
    /// 100 ms at most, retries after 50 ms doubling to 2 s, 10 s for a dead
    /// letter's produce.
    pub fn new(
        config: &ClientConfig,
        topics: &[&str],
        idem: Idempotency<S, C>,
    ) -> Result<Self, KafkaConsumerError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(KafkaConsumerError::Config(
                "KafkaConsumer::new must be called inside a tokio runtime".to_owned(),
            ));
        }
        let group = config
            .get("group.id")
            .filter(|g| !g.is_empty())
            .ok_or_else(|| KafkaConsumerError::Config("group.id is not set".to_owned()))?
            .to_owned();
        if topics.is_empty() || topics.iter().any(|t| t.is_empty() || t.contains('\0')) {
            return Err(KafkaConsumerError::Config(format!(
                "topics must be a non-empty list of names without NUL: {topics:?}"
            )));
        }
        let mut config = config.clone();
        config
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false");
        if config.get("auto.offset.reset").is_none() {
            config.set("auto.offset.reset", "earliest");
        }
        let shared = Arc::new(Shared {
            keys: Mutex::default(),
            seq: AtomicU64::new(0),
            tracks: Mutex::default(),
            counters: Counters::default(),
            confirmed: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            recommit: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            left: AtomicBool::new(false),
            committing: AtomicBool::new(false),
            commit_lock: Mutex::new(()),
            revoke_wait_ms: AtomicU64::new(10_000),
            partition_concurrency: AtomicU64::new(16),
            finishing: Arc::default(),
        });
        let consumer: StreamConsumer<IdemContext> = config.create_with_context(IdemContext {
            shared: shared.clone(),
            cooperative: config
                .get("partition.assignment.strategy")
                .is_some_and(|s| s.contains("cooperative")),
        })?;
        consumer.subscribe(topics)?;
        let producer: FutureProducer = producer_config(&config).create()?;
        Ok(KafkaConsumer {
            consumer: Arc::new(consumer),
            producer,
            group,
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            // A key whose completion the consumer gave up writing is
            // never acquired again here (its handler ran).
            idem: idem.waits_for_finishing(shared.finishing.clone()),
            key: KeySource::RecordKey,
            scope: None,
            batch: 1,
            concurrency: 64,
            partition_concurrency: 16,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            dead_letter: None,
            fingerprint: PayloadFingerprint::Whole,
            revoke_wait: Duration::from_secs(10),
            transaction_wait: idem_core::DEFAULT_TRANSACTION_WAIT,
            commit_interval: Duration::from_millis(100),
            retry_backoff: (Duration::from_millis(50), Duration::from_secs(2)),
            call_timeout: Duration::from_secs(10),
            shared,
        })
    }

    /// Takes each record's key from its record key (the default).
    pub fn key_from_record_key(mut self) -> Self {
        self.key = KeySource::RecordKey;
        self
    }

    /// Takes each record's key from the first header of this name.
    pub fn key_header(mut self, name: impl Into<String>) -> Self {
        self.key = KeySource::Header(name.into());
        self
    }

    /// Takes each record's key from a hash of its record key and value (of
    /// the parts of the value that count, with a
    /// [`fingerprint`](Self::fingerprint) of parts: copies that differ
    /// elsewhere share a key).
    pub fn key_from_content(mut self) -> Self {
        self.key = KeySource::Content;
        self
    }

    /// One scope for the keys of every topic (default: [`default_scope`]
    /// of each record's topic). A scope that is not valid (DESIGN 2: 1 to
    /// 64 bytes of `[A-Za-z0-9._:-]`) is refused here, before any record
    /// is read: every record's key would be refused.
    pub fn scope(mut self, scope: impl Into<String>) -> Result<Self, KeyError> {
        let scope = scope.into();
        IdempotencyKey::new(scope.clone(), "-")?;
        self.scope = Some(scope);
        Ok(self)
    }

    /// Records of one partition acquired together (default 1: each record
    /// on its own). With `n` above 1, consecutive records of a partition
    /// read together (up to `n`, the partition's concurrency and the
    /// overall one) go through
    /// [`Idempotency::process_batch_with_detached`]: one `acquire_many`,
    /// and one `complete_many` when their handlers end together; a record
    /// settles when its batch returns, so a slow record holds up the
    /// others of its batch. Records that need a retry go on on their own.
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.clamp(1, MAX_IN_FLIGHT);
        self
    }

    /// Records in flight at once, all partitions together (default 64; at
    /// least 1, at most [`MAX_IN_FLIGHT`]).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.clamp(1, MAX_IN_FLIGHT);
        self
    }

    /// Records of one partition in flight at once (default 16; at least
    /// 1, at most [`MAX_IN_FLIGHT`]). 1 runs a partition's records one
    /// after the other.
    pub fn partition_concurrency(mut self, n: usize) -> Self {
        self.partition_concurrency = n.clamp(1, MAX_IN_FLIGHT);
        self
    }

    /// How many failed runs a record gets before it is dead-lettered
    /// (default [`DEFAULT_MAX_DELIVERIES`]; at least 1); see the
    /// [crate docs](crate#delivery-counts) for how they are counted.
    pub fn max_deliveries(mut self, n: u32) -> Self {
        self.max_deliveries = n.max(1);
        self
    }

    /// What of a record's value its fingerprint covers (default: the
    /// whole value's bytes). With [`PayloadFingerprint::json_pointers`],
    /// only the parts of a JSON value the pointers name count, so a
    /// producer's resend that differs elsewhere (a timestamp set on each
    /// send) is a duplicate, replayed, not a payload mismatch
    /// dead-lettered; a value that is not JSON counts whole. A tombstone
    /// (no value) keeps its own fingerprint. A record of a key recorded
    /// before a change of this is a mismatch.
    pub fn fingerprint(mut self, what: PayloadFingerprint) -> Self {
        self.fingerprint = what;
        self
    }

    /// One dead-letter topic for every topic (default `{topic}.dead`).
    pub fn dead_letter(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter = Some(topic.into());
        self
    }

    /// How long a revoke waits for the revoked partitions' running records
    /// (default 10 s). Saturated to
    /// [`MAX_DURATION`](idem_core::MAX_DURATION); keep it well under
    /// `max.poll.interval.ms`.
    pub fn revoke_wait(mut self, wait: Duration) -> Self {
        self.revoke_wait = saturate(wait);
        self
    }

    /// In the in-transaction form
    /// ([`run_in_transaction`](Self::run_in_transaction)), how long a
    /// record's claim waits for another transaction holding its key
    /// (default 10 s, at least 1 ms): then the record is retried in place.
    pub fn transaction_wait(mut self, wait: Duration) -> Self {
        self.transaction_wait = wait;
        self
    }

    /// The shortest time between two asynchronous commits (default
    /// 100 ms); `Duration::ZERO` commits as soon as a commit point moves.
    pub fn commit_interval(mut self, every: Duration) -> Self {
        self.commit_interval = saturate(every);
        self
    }

    /// The pause before a record's first retry, doubling up to `max`
    /// (default 50 ms to 2 s).
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        let first = saturate(first).max(Duration::from_millis(1));
        self.retry_backoff = (first, saturate(max).max(first));
        self
    }

    /// How long producing a dead letter may take, its delivery report
    /// included, before it is tried again (default 10 s). A produce given
    /// up may still reach the broker later: a dead letter can then appear
    /// twice.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = saturate(timeout).max(Duration::from_millis(1));
        self
    }

    /// The rdkafka consumer (to read its assignment or metadata; do not
    /// commit or seek with it).
    pub fn client(&self) -> &StreamConsumer<IdemContext> {
        &self.consumer
    }
}
