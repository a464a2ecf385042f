//! The record tasks: a record's key and its turn among the records of
//! that key, and the loop that drives a record (or a batch of a
//! partition's records) until it is settled or given up.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{
    Codec, Context, Fingerprint, Finished, FinishingGuard, IdemError, Idempotency, IdempotencyKey,
    IdempotencyStore, PayloadFingerprint, Processed, Runner, StoreError, Unrecorded,
};
use rdkafka::producer::FutureProducer;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::failures::failure_counter;
use crate::outcome::{Run, Settle};
use crate::poll::RecordRead;
use crate::record::{self, default_scope, KafkaRecord, KeySource};
use crate::shared::{lock, Shared};
use crate::track::Track;

/// A record ready to run: its key (or why it is dead-lettered at once),
/// and its place in the chain of the records of the same key.
pub(crate) struct Job {
    record: KafkaRecord,
    key: Result<IdempotencyKey, String>,
    /// The previous record of the same key taken by this consumer: this
    /// one runs after it ends, so records of one key run in the order
    /// read (the first of two payloads wins, the second is the mismatch).
    after: Option<(u64, tokio::sync::oneshot::Receiver<()>)>,
    /// Ends this record's turn for the next one (when dropped), with its
    /// number in the chain.
    turn: Option<(u64, tokio::sync::oneshot::Sender<()>)>,
}

/// Ends a record's turn in its key's chain when dropped: the next record
/// of the key may run, and the chain's entry goes if it was the last.
struct Turn {
    shared: Arc<Shared>,
    key: Option<IdempotencyKey>,
    turn: Option<(u64, tokio::sync::oneshot::Sender<()>)>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let (Some(key), Some((seq, _))) = (&self.key, &self.turn) {
            let mut keys = lock(&self.shared.keys);
            if keys.get(key).is_some_and(|(s, _)| s == seq) {
                keys.remove(key);
            }
        }
    }
}

/// What the record tasks share: the executor, how it runs the handler
/// (with a lease, or in a transaction), the handler, the settings.
pub(crate) struct Work<S: ?Sized, C, F, M> {
    pub(crate) idem: Idempotency<S, C>,
    pub(crate) runner: M,
    pub(crate) handler: F,
    pub(crate) key: KeySource,
    pub(crate) scope: Option<String>,
    pub(crate) max_deliveries: u32,
    pub(crate) dead_letter: Option<String>,
    pub(crate) fingerprint: PayloadFingerprint,
    pub(crate) group: String,
    pub(crate) producer: FutureProducer,
    pub(crate) retry_backoff: (Duration, Duration),
    pub(crate) call_timeout: Duration,
    pub(crate) shared: Arc<Shared>,
    pub(crate) fatal: Mutex<Option<StoreError>>,
}

impl<S, C, F, M> Work<S, C, F, M>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
    M: Runner<S, C>,
{
    fn scope_of(&self, topic: &str) -> String {
        self.scope.clone().unwrap_or_else(|| default_scope(topic))
    }

    /// The record's key, and its turn after the previous record of that
    /// key (called in read order).
    pub(crate) fn prepare(&self, read: RecordRead) -> Job {
        let scope = self.scope_of(&read.record.topic);
        let key = match read.unusable {
            Some(e) => Err(e.to_string()),
            None => self
                .key
                .key_of(&scope, &read.record, &self.fingerprint)
                .map_err(|e| format!("no usable key: {e}")),
        };
        let (mut after, mut turn) = (None, None);
        if let Ok(k) = &key {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let seq = self.shared.seq.fetch_add(1, Ordering::Relaxed);
            after = lock(&self.shared.keys).insert(k.clone(), (seq, rx));
            turn = Some((seq, tx));
        }
        Job {
            record: read.record,
            key,
            after,
            turn,
        }
    }

    /// Runs one record until it is settled or given up.
    pub(crate) async fn run_record<Fut, T, E>(self: Arc<Self>, track: Arc<Track>, job: Job)
    where
        F: Fn(KafkaRecord, M::With) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let Job {
            record,
            key,
            after,
            turn,
        } = job;
        // The record's turn ends whatever way this task ends (dropped too).
        let _turn = Turn {
            shared: self.shared.clone(),
            key: key.as_ref().ok().cloned(),
            turn,
        };
        if let Some((_, after)) = after {
            let _ = after.await;
        }
        let fingerprint = record::fingerprint_of(&record, &self.fingerprint);
        self.drive(&track, record, key, fingerprint, None).await;
    }

    /// A record's run for its own key (the first one's outcome given when
    /// it ran in a batch).
    fn item<Fut, T, E>(
        self: &Arc<Self>,
        record: &KafkaRecord,
    ) -> impl FnOnce(Context, M::With) -> futures_util::future::BoxFuture<'static, Result<T, Run<E>>>
           + Send
           + 'static
    where
        F: Fn(KafkaRecord, M::With) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: Send + 'static,
    {
        let max = self.max_deliveries;
        let work = self.clone();
        let mut copy = record.clone();
        move |ctx: Context, with: M::With| {
            copy.attempt = ctx.attempt;
            copy.fence = ctx.fence;
            let fut = (ctx.attempt <= max).then(|| (work.handler)(copy, with));
            Box::pin(async move {
                match fut {
                    Some(fut) => fut.await.map_err(Run::Handler),
                    None => Err(Run::TooManyAttempts(ctx.attempt)),
                }
            })
        }
    }

    /// Runs a chunk of one partition's records as one batch (one
    /// `acquire_many`, one `complete_many` when the handlers end
    /// together); each record that did not settle goes on on its own.
    pub(crate) async fn run_chunk<Fut, T, E>(self: Arc<Self>, track: Arc<Track>, jobs: Vec<Job>)
    where
        F: Fn(KafkaRecord, M::With) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let mut turns = Vec::with_capacity(jobs.len());
        let mut records = Vec::with_capacity(jobs.len());
        // Waits for earlier records of the same keys outside the chunk; a
        // key twice in the chunk runs in order inside the batch.
        let ours: HashSet<u64> = jobs
            .iter()
            .filter_map(|j| j.turn.as_ref().map(|(seq, _)| *seq))
            .collect();
        for job in jobs {
            turns.push(Turn {
                shared: self.shared.clone(),
                key: job.key.as_ref().ok().cloned(),
                turn: job.turn,
            });
            if let Some((seq, after)) = job.after {
                if !ours.contains(&seq) {
                    let _ = after.await;
                }
            }
            // Computed once: a `PayloadFingerprint::with` function runs
            // once per record.
            let fingerprint = record::fingerprint_of(&job.record, &self.fingerprint);
            records.push((job.record, job.key, fingerprint));
        }
        let items: Vec<_> = records
            .iter()
            .filter_map(|(record, key, fingerprint)| {
                let key = key.as_ref().ok()?;
                Some((key.clone(), *fingerprint, self.item(record)))
            })
            .collect();
        let mut results = self
            .runner
            .process_batch(&self.idem, items)
            .await
            .into_iter();
        let drives = records.into_iter().map(|(record, key, fingerprint)| {
            let first = key.is_ok().then(|| results.next()).flatten();
            self.drive(&track, record, key, fingerprint, first)
        });
        futures_util::future::join_all(drives).await;
        drop(turns);
    }

    /// Drives a record until it is settled (recorded, replayed,
    /// dead-lettered) or given up; `fingerprint` is its payload's
    /// (`record::fingerprint_of`); `first` is its first run's outcome if it
    /// already ran.
    async fn drive<Fut, T, E>(
        self: &Arc<Self>,
        track: &Track,
        record: KafkaRecord,
        key: Result<IdempotencyKey, String>,
        fingerprint: Option<Fingerprint>,
        mut first: Option<Result<Processed<T>, IdemError<Run<E>>>>,
    ) where
        F: Fn(KafkaRecord, M::With) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let (key, mut dead) = match key {
            Ok(k) => (Some(k), None),
            Err(reason) => (None, Some((0u32, reason))),
        };
        let mut backoff = self.retry_backoff.0;
        // A run whose completion is still to be written.
        let mut unfinished: Option<(Box<Unrecorded>, FinishingGuard)> = None;
        // Whether a failed run of the key was counted (the counter goes
        // when the record settles, so a later record of the key, or the
        // record re-driven from its dead letter, counts from zero).
        let mut counted = false;
        // With a completion to write, when a revoke or shutdown stops
        // waiting for it.
        let mut finish_by: Option<tokio::time::Instant> = None;
        loop {
            // Another record of the key waits for its completion to be
            // written: this one waits too (its run would take the key over
            // once the lease is over). Not for a batch's first outcome,
            // which already ran.
            let held = unfinished.is_none()
                && first.is_none()
                && key
                    .as_ref()
                    .is_some_and(|k| self.shared.finishing.contains(k));
            if let Some((u, _)) = &unfinished {
                match self.idem.try_finish(u).await {
                    Ok(Finished::Recorded) => {
                        self.shared
                            .counters
                            .executed
                            .fetch_add(1, Ordering::Relaxed);
                        self.settled(track, &record, key.as_ref(), counted).await;
                        return;
                    }
                    // Taken over after the lease ended: the new holder
                    // records; the record's next run gets its answer.
                    Ok(Finished::TakenOver) => unfinished = None,
                    // The store refuses the completion for good: the
                    // handler ran, so the record is never run again.
                    Ok(Finished::Refused(e) | Finished::GaveUp(e)) => {
                        // Given up before the key is let go, so the later
                        // records of the key, which wait for it, are
                        // settled as duplicates, never run.
                        if let Some((u, _)) = &unfinished {
                            let retention = self.idem.retention_period();
                            self.shared.finishing.given_up().insert(
                                u.lease().key.clone(),
                                u.lease().fingerprint,
                                retention,
                            );
                        }
                        unfinished = None;
                        dead = Some((
                            0,
                            format!("the handler ran but its result could not be recorded: {e}"),
                        ));
                    }
                    Err(_) => {
                        self.shared.counters.retried.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else if held {
                self.shared.counters.retried.fetch_add(1, Ordering::Relaxed);
            } else if let (Some(k), None) = (&key, &dead) {
                let result = match first.take() {
                    Some(r) => r,
                    None => {
                        self.runner
                            .process_one(&self.idem, k, fingerprint, self.item(&record))
                            .await
                    }
                };
                match self.settle_of(&record, result) {
                    Settle::Done => {
                        self.settled(track, &record, key.as_ref(), counted).await;
                        return;
                    }
                    Settle::Dead(reason) => dead = Some((0, reason)),
                    Settle::Failed(reason) => {
                        match self.failures(k).await.inspect(|_| counted = true) {
                            Some(n) if n >= self.max_deliveries => {
                                let reason = format!(
                                    "{reason} (failed {n} times, max_deliveries {})",
                                    self.max_deliveries
                                );
                                dead = Some((n, reason));
                            }
                            _ => {
                                self.shared.counters.retried.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Settle::Retry => {
                        self.shared.counters.retried.fetch_add(1, Ordering::Relaxed);
                    }
                    Settle::Finish(u) => {
                        self.shared.counters.retried.fetch_add(1, Ordering::Relaxed);
                        let guard = self.shared.finishing.hold(k.clone(), None);
                        unfinished = Some((u, guard));
                    }
                    Settle::Fatal(e) => {
                        lock(&self.fatal).get_or_insert(e);
                        self.shared.wake.notify_one();
                        track.abandon(record.offset);
                        return;
                    }
                }
            }
            if let Some((n, reason)) = &dead {
                if self.dead_letter_one(&record, *n, reason).await {
                    if let Some(k) = &key {
                        self.runner.forget(&self.idem, k).await;
                    }
                    self.settled(track, &record, key.as_ref(), counted).await;
                    return;
                }
            }
            let mut give_up = track.revoked()
                || self.shared.stopping.load(Ordering::SeqCst)
                || lock(&self.fatal).is_some();
            if give_up && unfinished.is_some() {
                // Its handler ran: given up, its key would be taken over
                // and run again by the next owner once the lease is over.
                // Finishing goes on for as long as a running record may
                // hold a revoke or a shutdown (`revoke_wait`).
                let wait =
                    Duration::from_millis(self.shared.revoke_wait_ms.load(Ordering::Relaxed));
                let by = *finish_by.get_or_insert_with(|| tokio::time::Instant::now() + wait);
                give_up = tokio::time::Instant::now() >= by;
            }
            if give_up {
                if unfinished.is_some() {
                    tracing::warn!(topic = %record.topic, partition = record.partition, offset = record.offset, "given up with its result not recorded (the store is away): after the lease its next owner runs it again");
                }
                self.shared
                    .counters
                    .abandoned
                    .fetch_add(1, Ordering::Relaxed);
                track.abandon(record.offset);
                return;
            }
            // A completion to write goes in soon after the store is back
            // (a pause of at most 200 ms): after the lease, anyone may
            // take the key over.
            let pause = if unfinished.is_some() {
                backoff.min(Duration::from_millis(200))
            } else {
                backoff
            };
            tokio::time::sleep(pause).await;
            backoff = backoff.saturating_mul(2).min(self.retry_backoff.1);
        }
    }

    /// A record is settled: its partition's commit point may move; the
    /// failure counter of its key goes if a failure was counted.
    async fn settled(
        &self,
        track: &Track,
        record: &KafkaRecord,
        key: Option<&IdempotencyKey>,
        counted: bool,
    ) {
        if track.settle(record.offset) {
            self.shared.wake.notify_one();
        }
        if let (true, Some(key)) = (counted, key) {
            if let Some(counter) = failure_counter(key) {
                if let Err(e) = self.idem.store().delete(&counter).await {
                    tracing::warn!(error = %e, "could not reset a failure counter (it counts on for this key)");
                }
            }
        }
    }
}
