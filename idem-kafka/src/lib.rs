//! An idempotent Kafka consumer for [idem](https://docs.rs/idem): it reads
//! topics in a consumer group, runs each record through
//! [`Idempotency`] (the handler detached, the key from the record key, a
//! header or a hash of the content), and commits a partition's offset only
//! over records whose result is recorded, replayed or dead-lettered, and
//! only contiguously: the committed offset never passes a record still
//! running.
//!
//! ```no_run
//! use idem_core::{Idempotency, MemoryStore};
//! use idem_kafka::{KafkaConsumer, KafkaRecord};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let idem = Idempotency::new(MemoryStore::new());
//! let consumer = KafkaConsumer::connect("127.0.0.1:9092", "billing", &["payments"], idem)?
//!     .key_header("message-id")
//!     .concurrency(64)
//!     .max_deliveries(5); // then to the topic "payments.dead"
//! let shutdown = async { let _ = tokio::signal::ctrl_c().await; };
//! let stats = consumer
//!     .run(
//!         |record: KafkaRecord| async move {
//!             let amount: u64 = record.json()?;
//!             Ok::<_, idem_kafka::RecordError>(format!("charged {amount}"))
//!         },
//!         shutdown,
//!     )
//!     .await?;
//! println!("{stats:?}");
//! # Ok(()) }
//! ```
//!
//! It uses only standard Kafka protocol features (consumer groups with the
//! eager protocol, offset commits, fetch, produce for the dead letters)
//! through [`rdkafka`] (librdkafka, built from source by default). Its
//! tests run on Tansu, an Apache-Kafka-protocol broker.
//!
//! # What happens to a record
//!
//! | outcome | the record |
//! |---|---|
//! | executed, replayed, or completed earlier without a replayable result | settled: its offset may be committed |
//! | the key is in progress (another consumer runs it: a rebalance moved the partition), the store is unavailable, or the lease was lost | retried in place with a backoff, until settled; the partition's commit point waits |
//! | the handler ran but the store was away until its lease ended ([`IdemError::Unrecorded`]) | never run again: its completion is written with its own lease ([`Idempotency::finish`]) once the store is back, then it settles |
//! | the handler failed or panicked | retried in place until it failed [`max_deliveries`](KafkaConsumer::max_deliveries) times, then dead-lettered |
//! | can never succeed: no usable key, payload mismatch, a corrupt record, a [`RecordError`] from the handler | dead-lettered at once |
//! | its partition is revoked, or the consumer shuts down, while it waits for a retry | abandoned: never committed by this consumer, redelivered to the next owner |
//!
//! Dead-lettering produces the record (key, value, headers) to the
//! dead-letter topic (default `{topic}.dead`; it must exist, or the broker
//! must create topics) with the headers `idem.topic`, `idem.partition`,
//! `idem.offset`, `idem.group`, `idem.deliveries` and `idem.reason`, waits
//! for the broker's acknowledgement, then settles the record. A crash
//! between the two dead-letters it again on its redelivery.
//!
//! # Delivery counts
//!
//! Kafka keeps no delivery count, so the consumer counts with idem: each
//! failed run of a key takes over a counter record of its own in the store
//! (scope `idem.failures`, a hash of the key as ID, a 1 ms lease, never
//! completed), whose attempt number is the count of failures, across
//! restarts and consumers; deleted when the record settles. And a run cut off by a crash is counted by the
//! key's own attempt number: an acquisition whose attempt is past
//! `max_deliveries` does not run the handler and dead-letters the record
//! (a poison record that kills its consumer does not kill every next one).
//!
//! # Commits
//!
//! `enable.auto.commit` and `enable.auto.offset.store` are turned off. A
//! partition's commit point moves over the contiguous prefix of settled
//! records. Commits are synchronous calls on a blocking thread, one at a
//! time, at most every [`commit_interval`](KafkaConsumer::commit_interval)
//! (rdkafka did not report asynchronous commits of a `StreamConsumer`
//! back, and a commit must never overtake a later one), and again at a
//! revoke and at shutdown. A commit that fails (a rebalance under way) is
//! sent again with every commit point; in the worst case the records after
//! the last commit are redelivered, and replayed.
//!
//! # Rebalances
//!
//! On revoke (every rebalance revokes everything with the eager protocol),
//! the consumer stops taking records of the revoked partitions, waits up
//! to [`revoke_wait`](KafkaConsumer::revoke_wait) for their running
//! records (on a multi-thread runtime: the rebalance callback runs inside
//! the consumer's poll and blocks its thread with
//! `tokio::task::block_in_place`; on a current-thread runtime it cannot
//! wait, as the handlers would need that thread), commits what settled, and
//! lets the partitions go. Records that did not finish are not committed:
//! the new owner reads them again, and idem answers it with the replay,
//! or "in progress" (it retries until the detached handler here has
//! recorded its result), never a second run. A lost assignment (the
//! session timed out) is not committed at all.
//!
//! # Handlers run detached
//!
//! Each record runs through [`Idempotency::process_with_detached`], or,
//! with [`batch`](KafkaConsumer::batch) above 1, the records of a
//! partition read together run through
//! [`Idempotency::process_batch_with_detached`] (one `acquire_many` and
//! one `complete_many`). A consumer whose `run` future is dropped does not
//! cut the handlers off; their results are recorded and their records
//! replayed on redelivery. Records of one key taken by this consumer run in
//! the order read, one after the other.
//!
//! # Shutdown
//!
//! When `shutdown` completes, `run` stops reading, lets the running
//! handlers finish for up to [`revoke_wait`](KafkaConsumer::revoke_wait)
//! (records waiting for a retry give up; records still running then are
//! given up uncommitted, their detached handlers go on and record their
//! results, so the next owner gets the replay), commits, and
//! leaves the group (it unsubscribes and serves the revoke itself, so
//! that dropping the client has nothing to give back: librdkafka can hang
//! forever in a revoke served while its client closes, librdkafka #4041).
//! A later `run` subscribes again.
//!
//! # Concurrency
//!
//! At most [`concurrency`](KafkaConsumer::concurrency) records are in
//! flight, at most
//! [`partition_concurrency`](KafkaConsumer::partition_concurrency) of one
//! partition. When a partition has its maximum in flight, the consumer
//! waits for one of them before it reads further (records of other
//! partitions wait too).
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod commit;
mod context;
mod dead_letter;
mod error;
mod failures;
mod finishing;
mod outcome;
mod record;
mod shared;
mod stats;
mod track;
mod work;

#[doc(hidden)]
pub use context::IdemContext;
pub use error::KafkaConsumerError;
pub use rdkafka;
pub use record::{default_scope, KafkaRecord, KeySource, RecordError};

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use idem_core::{saturate, Codec, Idempotency, IdempotencyStore, JsonCodec};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, StreamConsumer};
use rdkafka::producer::FutureProducer;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::util::Timeout;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::task::JoinSet;

use shared::{lock, Shared};
pub use stats::ConsumerStats;
use stats::Counters;
use track::Track;
use work::{Job, Work};

// For the links of the crate docs.
#[cfg(doc)]
use idem_core::IdemError;

/// Records taken from the client at once (at least).
const READ_AHEAD: usize = 64;

/// The default of [`KafkaConsumer::max_deliveries`].
pub const DEFAULT_MAX_DELIVERIES: u32 = 10;

/// An idempotent consumer-group member; see the [crate docs](crate).
pub struct KafkaConsumer<S: ?Sized, C = JsonCodec> {
    consumer: Arc<StreamConsumer<IdemContext>>,
    producer: FutureProducer,
    group: String,
    topics: Vec<String>,
    idem: Idempotency<S, C>,
    key: KeySource,
    scope: Option<String>,
    batch: usize,
    concurrency: usize,
    partition_concurrency: usize,
    max_deliveries: u32,
    dead_letter: Option<String>,
    revoke_wait: Duration,
    commit_interval: Duration,
    retry_backoff: (Duration, Duration),
    call_timeout: Duration,
    shared: Arc<Shared>,
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
            finishing: Mutex::default(),
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
            idem,
            key: KeySource::RecordKey,
            scope: None,
            batch: 1,
            concurrency: 64,
            partition_concurrency: 16,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            dead_letter: None,
            revoke_wait: Duration::from_secs(10),
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

    /// Takes each record's key from a hash of its record key and value.
    pub fn key_from_content(mut self) -> Self {
        self.key = KeySource::Content;
        self
    }

    /// One scope for the keys of every topic (default: [`default_scope`]
    /// of each record's topic).
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
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
        self.batch = n.max(1);
        self
    }

    /// Records in flight at once, all partitions together (default 64; at
    /// least 1).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Records of one partition in flight at once (default 16; at least
    /// 1). 1 runs a partition's records one after the other.
    pub fn partition_concurrency(mut self, n: usize) -> Self {
        self.partition_concurrency = n.max(1);
        self
    }

    /// How many failed runs a record gets before it is dead-lettered
    /// (default [`DEFAULT_MAX_DELIVERIES`]; at least 1); see the
    /// [crate docs](crate#delivery-counts) for how they are counted.
    pub fn max_deliveries(mut self, n: u32) -> Self {
        self.max_deliveries = n.max(1);
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

    /// The group's lag on the partitions assigned to this consumer now:
    /// the high watermark minus the committed offset (the low watermark
    /// if nothing is committed), per partition.
    pub async fn lag(&self) -> Result<BTreeMap<(String, i32), i64>, KafkaConsumerError> {
        let consumer = self.consumer.clone();
        let timeout = self.call_timeout;
        tokio::task::spawn_blocking(move || {
            let assignment = consumer.assignment()?;
            lag_of(&*consumer, assignment, timeout)
        })
        .await
        .map_err(|e| KafkaConsumerError::Config(format!("the lag task failed: {e}")))?
    }

    /// Reads and processes records until `shutdown` completes, then waits
    /// for the records in flight (their handlers, their results recorded;
    /// records waiting for a retry give up), commits synchronously, and
    /// returns what it did, with the lag. Fails when the executor's
    /// configuration is refused (nothing could succeed); broker errors are
    /// logged and librdkafka retries them.
    pub async fn run<F, Fut, T, E>(
        &self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, KafkaConsumerError>
    where
        F: Fn(KafkaRecord) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        if let Some(dead) = &self.dead_letter {
            if dead.is_empty() || dead.contains('\0') {
                return Err(KafkaConsumerError::Config(format!(
                    "the dead-letter topic {dead:?} is not a topic name"
                )));
            }
        }
        let shared = &self.shared;
        // Subscribed in `new`; again after an earlier `run` left the group.
        if shared.left.swap(false, Ordering::SeqCst) {
            let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
            self.consumer.subscribe(&topics)?;
        }
        shared.stopping.store(false, Ordering::SeqCst);
        shared
            .revoke_wait_ms
            .store(self.revoke_wait.as_millis() as u64, Ordering::Relaxed);
        shared
            .partition_concurrency
            .store(self.partition_concurrency as u64, Ordering::Relaxed);
        let work = Arc::new(Work {
            idem: self.idem.clone(),
            handler,
            key: self.key.clone(),
            scope: self.scope.clone(),
            max_deliveries: self.max_deliveries,
            dead_letter: self.dead_letter.clone(),
            group: self.group.clone(),
            producer: self.producer.clone(),
            retry_backoff: self.retry_backoff,
            call_timeout: self.call_timeout,
            shared: shared.clone(),
            fatal: Mutex::new(None),
        });
        let overall = Arc::new(tokio::sync::Semaphore::new(self.concurrency));
        let mut tasks = JoinSet::new();
        let shutdown = shutdown.fuse();
        futures_util::pin_mut!(shutdown);
        let mut last_commit = tokio::time::Instant::now();
        let mut commit_due: Option<tokio::time::Instant> = None;
        'read: loop {
            if lock(&work.fatal).is_some() {
                break;
            }
            let due = commit_due;
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = shared.wake.notified() => {
                    let now = tokio::time::Instant::now();
                    let at = last_commit + self.commit_interval;
                    if now >= at {
                        self.commit_async();
                        last_commit = now;
                        commit_due = None;
                    } else {
                        commit_due.get_or_insert(at);
                    }
                }
                () = async { if let Some(at) = due { tokio::time::sleep_until(at).await } }, if due.is_some() => {
                    self.commit_async();
                    last_commit = tokio::time::Instant::now();
                    commit_due = None;
                }
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                message = self.consumer.recv() => {
                    let mut batch = Vec::new();
                    match message {
                        Ok(m) => batch.push(RecordRead::of(&m, shared)),
                        Err(e) => {
                            tracing::warn!(error = %e, "kafka consumer error (librdkafka retries)");
                            continue 'read;
                        }
                    }
                    while batch.len() < self.batch.max(READ_AHEAD) {
                        match self.consumer.recv().now_or_never() {
                            Some(Ok(m)) => batch.push(RecordRead::of(&m, shared)),
                            Some(Err(e)) => {
                                tracing::warn!(error = %e, "kafka consumer error (librdkafka retries)");
                                break;
                            }
                            None => break,
                        }
                    }
                    shared.counters.received.fetch_add(batch.len() as u64, Ordering::Relaxed);
                    let chunk_max = self
                        .batch
                        .min(self.partition_concurrency)
                        .min(self.concurrency);
                    for (track, chunk) in chunks(self.owned(batch), chunk_max) {
                        // Permits of its partition, then overall ones (only
                        // this loop takes them: no deadlock).
                        let n = chunk.len() as u32;
                        let permits = async {
                            let p = track.permits.clone().acquire_many_owned(n).await;
                            let o = overall.clone().acquire_many_owned(n).await;
                            (p, o)
                        };
                        let permits = tokio::select! {
                            biased;
                            () = &mut shutdown => break 'read,
                            p = permits => p,
                        };
                        let (Ok(p), Ok(o)) = permits else { break 'read };
                        let jobs: Vec<Job> = chunk
                            .into_iter()
                            .map(|read| {
                                track.begin(read.record.offset);
                                work.prepare(read)
                            })
                            .collect();
                        let work = work.clone();
                        if jobs.len() == 1 {
                            let job = jobs.into_iter().next();
                            tasks.spawn(async move {
                                if let Some(job) = job {
                                    work.run_record(track, job).await;
                                }
                                drop((p, o));
                            });
                        } else {
                            tasks.spawn(async move {
                                work.run_chunk(track, jobs).await;
                                drop((p, o));
                            });
                        }
                    }
                }
            }
        }
        // Shutdown: records waiting for a retry give up; running ones get
        // `revoke_wait` to finish. Past it they are given up (their
        // handlers run on in their own tasks, detached, and record their
        // results; the records are not committed here, so the next owner
        // gets the replay, or "in progress" while they still run).
        shared.stopping.store(true, Ordering::SeqCst);
        let bound = tokio::time::sleep(self.revoke_wait);
        futures_util::pin_mut!(bound);
        loop {
            tokio::select! {
                next = tasks.join_next() => if next.is_none() { break },
                () = &mut bound => {
                    let running: usize = lock(&shared.tracks).values().map(|t| t.running()).sum();
                    tracing::warn!(running, wait = ?self.revoke_wait, "records still running at shutdown after revoke_wait: given up, not committed");
                    shared
                        .counters
                        .abandoned
                        .fetch_add(running as u64, Ordering::Relaxed);
                    tasks.abort_all();
                    while tasks.join_next().await.is_some() {}
                    break;
                }
            }
        }
        self.commit_sync().await;
        // The lag of the partitions still assigned, before leaving the
        // group (after it, nothing is assigned: the sum would read 0).
        let lag = self.lag().await.ok().map(|m| m.values().sum());
        self.leave().await;
        let fatal = lock(&work.fatal).take();
        if let Some(e) = fatal {
            return Err(e.into());
        }
        let mut stats = self.stats();
        stats.lag = lag;
        Ok(stats)
    }

    /// The track of each record's partition, in read order. A record read
    /// while its partition was not assigned here, or whose partition was
    /// revoked since it was read (a rebalance ran inside a later read of
    /// the same batch), is skipped: never run or committed in an
    /// assignment it does not belong to; its owner reads it again from the
    /// committed offset.
    fn owned(&self, batch: Vec<RecordRead>) -> Vec<(Arc<Track>, RecordRead)> {
        let mut out = Vec::with_capacity(batch.len());
        for mut read in batch {
            match read.track.take() {
                Some(track) if !track.revoked() => out.push((track, read)),
                _ => {
                    tracing::debug!(topic = %read.record.topic, partition = read.record.partition, offset = read.record.offset, "record of a partition not assigned here (any more): skipped");
                }
            }
        }
        out
    }

    /// Leaves the group at the end of `run`: unsubscribes and serves the
    /// revoke that follows here, bounded by `revoke_wait` plus the call
    /// timeout, so that dropping the client later has no assignment to
    /// give back (librdkafka can hang forever in a revoke served while the
    /// client closes, librdkafka #4041). Records read meanwhile are not
    /// run: they were never taken, so never committed here.
    async fn leave(&self) {
        self.consumer.unsubscribe();
        self.shared.left.store(true, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + self.revoke_wait + self.call_timeout;
        // The revoke runs inside a poll, which returns only with a
        // message: polled in short slices, the assignment checked between.
        while !lock(&self.shared.tracks).is_empty() {
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!("the revoke after unsubscribe did not come in time");
                return;
            }
            let _ = tokio::time::timeout(Duration::from_millis(20), self.consumer.recv()).await;
        }
    }
}

/// The lag of `partitions` for the consumer's group, per partition.
fn lag_of<K: Consumer<X>, X: ConsumerContext>(
    consumer: &K,
    partitions: TopicPartitionList,
    timeout: Duration,
) -> Result<BTreeMap<(String, i32), i64>, KafkaConsumerError> {
    let committed = consumer.committed_offsets(partitions, Timeout::After(timeout))?;
    let mut out = BTreeMap::new();
    for e in committed.elements() {
        let (low, high) =
            consumer.fetch_watermarks(e.topic(), e.partition(), Timeout::After(timeout))?;
        let at = match e.offset() {
            Offset::Offset(o) => o,
            _ => low,
        };
        out.insert((e.topic().to_owned(), e.partition()), (high - at).max(0));
    }
    Ok(out)
}

/// A client of its own made from `config` (which must set
/// `bootstrap.servers` and `group.id`; it does not join the group), and
/// the partitions of `topic`.
fn group_reader(
    config: &ClientConfig,
    topic: &str,
    timeout: Duration,
) -> Result<(BaseConsumer, TopicPartitionList), KafkaConsumerError> {
    let consumer: BaseConsumer = config.create()?;
    let metadata = consumer.fetch_metadata(Some(topic), Timeout::After(timeout))?;
    let mut tpl = TopicPartitionList::new();
    for t in metadata.topics() {
        for p in t.partitions() {
            tpl.add_partition(t.name(), p.id());
        }
    }
    Ok((consumer, tpl))
}

/// The committed lag of a consumer group on a topic, per partition: the
/// high watermark minus the committed offset (the low watermark when
/// nothing is committed). Some brokers under-report the high watermark
/// (Tansu 0.6 answers a multi-record batch's base offset + 1): compare
/// [`group_committed`] with the producer's delivery reports there.
pub async fn group_lag(
    config: &ClientConfig,
    topic: &str,
    timeout: Duration,
) -> Result<BTreeMap<(String, i32), i64>, KafkaConsumerError> {
    let config = config.clone();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let (consumer, tpl) = group_reader(&config, &topic, timeout)?;
        lag_of(&consumer, tpl, timeout)
    })
    .await
    .map_err(|e| KafkaConsumerError::Config(format!("the lag task failed: {e}")))?
}

/// The offsets a consumer group committed on a topic, per partition
/// (partitions without a commit are left out).
pub async fn group_committed(
    config: &ClientConfig,
    topic: &str,
    timeout: Duration,
) -> Result<BTreeMap<(String, i32), i64>, KafkaConsumerError> {
    let config = config.clone();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let (consumer, tpl) = group_reader(&config, &topic, timeout)?;
        let committed = consumer.committed_offsets(tpl, Timeout::After(timeout))?;
        Ok(committed
            .elements()
            .iter()
            .filter_map(|e| match e.offset() {
                Offset::Offset(o) => Some(((e.topic().to_owned(), e.partition()), o)),
                _ => None,
            })
            .collect())
    })
    .await
    .map_err(|e| KafkaConsumerError::Config(format!("the offsets task failed: {e}")))?
}

/// Consecutive records of one partition, at most `max` together.
fn chunks(reads: Vec<(Arc<Track>, RecordRead)>, max: usize) -> Vec<(Arc<Track>, Vec<RecordRead>)> {
    let mut out: Vec<(Arc<Track>, Vec<RecordRead>)> = Vec::new();
    for (track, read) in reads {
        match out.last_mut() {
            Some((t, chunk)) if Arc::ptr_eq(t, &track) && chunk.len() < max => chunk.push(read),
            _ => out.push((track, vec![read])),
        }
    }
    out
}

/// A record as read, or why it cannot be given to the handler.
struct RecordRead {
    record: KafkaRecord,
    unusable: Option<RecordError>,
    /// The assignment of its partition when it was read.
    track: Option<Arc<Track>>,
}

impl RecordRead {
    fn of(message: &rdkafka::message::BorrowedMessage<'_>, shared: &Shared) -> Self {
        let (record, unusable) = KafkaRecord::read(message);
        let track = shared.track(&record.topic, record.partition);
        RecordRead {
            record,
            unusable,
            track,
        }
    }
}

impl<S, C, F> Work<S, C, F>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
{
}
