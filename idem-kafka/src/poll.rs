//! The run loop: reads records from the broker, hands them to record
//! tasks within the concurrency limits, commits as commit points move,
//! and at shutdown waits for the records in flight, commits and leaves the
//! group.

use std::fmt;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use idem_core::{
    Codec, IdempotencyStore, LeaseRunner, Runner, SharedTx, TransactionalStore, TxRunner,
};
use rdkafka::consumer::Consumer;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::task::JoinSet;

use crate::consumer::KafkaConsumer;
use crate::error::KafkaConsumerError;
use crate::record::{KafkaRecord, RecordError};
use crate::shared::{lock, Shared};
use crate::stats::ConsumerStats;
use crate::track::Track;
use crate::work::{Job, Work};

/// Records taken from the client at once (at least).
const READ_AHEAD: usize = 64;

impl<S: IdempotencyStore + ?Sized, C: Codec> KafkaConsumer<S, C> {
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
        self.run_with(LeaseRunner, move |record, ()| handler(record), shutdown)
            .await
    }

    /// The in-transaction form of [`run`](Self::run): each record runs in
    /// a transaction of the store's database (a [`TransactionalStore`],
    /// such as `PgStore`), handed to the handler; the claim of its key,
    /// the handler's writes and its result commit together before its
    /// offset may be committed. A consumer killed anywhere before that
    /// commit leaves nothing: the redelivery runs the record cleanly, with
    /// no lease and no window, so effects in that database happen exactly
    /// once. A commit that fails for a passing reason (a lost connection)
    /// leaves the record to be retried in place; one the database refuses
    /// (a deferred constraint) counts as a failed run: dead-lettered with the reason after `max_deliveries`. A crash
    /// leaves no trace in the transaction, so the runs cut off are counted
    /// apart (the record's `attempt`): a record that kills every member is
    /// dead-lettered after `max_deliveries` such runs. A handler's `Err` or panic rolls
    /// everything back. The rest as [`run`](Self::run); see [`TxRunner`]
    /// for what each outcome of the handler does.
    ///
    /// ```no_run
    /// use idem_core::Idempotency;
    /// use idem_kafka::{KafkaConsumer, KafkaRecord};
    /// use idem_postgres::{sqlx, PgStore, PgTx};
    ///
    /// # async fn run(store: PgStore) -> Result<(), Box<dyn std::error::Error>> {
    /// let consumer = KafkaConsumer::connect("127.0.0.1:9092", "billing", &["payments"], Idempotency::new(store))?
    ///     .key_header("message-id");
    /// consumer
    ///     .run_in_transaction(
    ///         |record: KafkaRecord, tx: PgTx| async move {
    ///             let amount: i64 = record.json()?;
    ///             let mut tx = tx.lock().await?;
    ///             sqlx::query("INSERT INTO ledger (amount, fence) VALUES ($1, $2)")
    ///                 .bind(amount)
    ///                 .bind(record.fence as i64)
    ///                 .execute(&mut *tx)
    ///                 .await?;
    ///             Ok::<_, Box<dyn std::error::Error + Send + Sync>>(amount)
    ///         },
    ///         async { let _ = tokio::signal::ctrl_c().await; },
    ///     )
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn run_in_transaction<F, Fut, T, E>(
        &self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, KafkaConsumerError>
    where
        S: TransactionalStore,
        F: Fn(KafkaRecord, SharedTx<S::Tx>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let runner = TxRunner::new().wait(self.transaction_wait);
        self.run_with(runner, handler, shutdown).await
    }

    /// [`run`](Self::run) with handlers run by `runner`.
    async fn run_with<M, F, Fut, T, E>(
        &self,
        runner: M,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, KafkaConsumerError>
    where
        M: Runner<S, C>,
        F: Fn(KafkaRecord, M::With) -> Fut + Send + Sync + 'static,
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
            runner,
            handler,
            key: self.key.clone(),
            scope: self.scope.clone(),
            max_deliveries: self.max_deliveries,
            dead_letter: self.dead_letter.clone(),
            fingerprint: self.fingerprint.clone(),
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
pub(crate) struct RecordRead {
    pub(crate) record: KafkaRecord,
    pub(crate) unusable: Option<RecordError>,
    /// The assignment of its partition when it was read.
    pub(crate) track: Option<Arc<Track>>,
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
