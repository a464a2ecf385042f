//! The processing of one message: its key, the run through the executor
//! (or a transaction), then the ack, the hand-back, the dead letter or the
//! finish that its outcome calls for (`idem_core::delivery`).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use idem_core::delivery::{is_permanent, settle, Attempted, Done, Settle};
use idem_core::{
    Codec, Fingerprint, Finished, FinishingGuard, IdemError, Idempotency, IdempotencyKey,
    IdempotencyStore, Pauses, PayloadFingerprint, Runner, Unrecorded,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::OwnedSemaphorePermit;
use tracing::Instrument;

use crate::dead_letter::NotPublished;
use crate::message::fingerprint_of;
use crate::shared::{lock, Shared};
use crate::stats::Event;
use crate::{KeySource, MessageError, NatsMessage};

/// The first and longest pause between two tries of a completion after a
/// store outage (cut short when the store answers another call).
const FINISH_PAUSES: (Duration, Duration) = (Duration::from_millis(50), Duration::from_millis(250));

/// What a message task needs: the executor, the handler, the settings.
pub(crate) struct Work<S: ?Sized, C, F, M> {
    pub(crate) idem: Idempotency<S, C>,
    /// How the handler runs: with a lease, or in a transaction.
    pub(crate) runner: M,
    pub(crate) handler: Arc<F>,
    pub(crate) jetstream: jetstream::Context,
    pub(crate) durable: String,
    pub(crate) key: KeySource,
    pub(crate) scope: String,
    pub(crate) fingerprint: PayloadFingerprint,
    pub(crate) max_deliveries: u32,
    pub(crate) retry_delay: Duration,
    pub(crate) dead_letter: Option<String>,
    /// Every how long an in-progress ack goes out while a message is held
    /// (`None`: never).
    pub(crate) progress_every: Option<Duration>,
    pub(crate) shared: Arc<Shared>,
}

impl<S, C, F, M> Work<S, C, F, M>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
    M: Runner<S, C>,
{
    /// Handles one delivered message (held in [`Shared::held`] as `id`),
    /// from its key to its ack, holding `permit` (its room in the
    /// consumer) until then.
    pub(crate) async fn handle<Fut, T, E>(
        self: Arc<Self>,
        raw: jetstream::Message,
        id: u64,
        permit: OwnedSemaphorePermit,
    ) where
        F: Fn(NatsMessage, M::With) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let _permit = permit;
        let message = NatsMessage::read(&raw);
        let span = tracing::debug_span!(
            "idem_nats.message",
            consumer = %self.durable,
            subject = %message.subject,
            stream_sequence = message.stream_sequence,
            delivered = ?message.delivered,
        );
        async move {
            // In-progress acks while the message is held: its handler's
            // run, its dead letter's publish, the finish of an unrecorded
            // result.
            let (key, outcome, contended) = self.kept(&raw, self.process(&message)).await;
            let fingerprint = Some(fingerprint_of(&message, &self.fingerprint));
            match outcome {
                Settle::Done(done) => {
                    // The store answered: a finisher pausing tries again.
                    self.shared.finishing.store_answered();
                    // Given up here, its dead letter owed (its first
                    // publish failed): published now, then acked.
                    let owed = match (done, &key) {
                        (Done::ResultUnavailable, Some(key)) => {
                            lock(&self.shared.owed).get(key).cloned()
                        }
                        _ => None,
                    };
                    if let Some(reason) = owed {
                        self.dead(key.as_ref(), &raw, &message, &reason).await;
                    } else {
                        self.shared.counters.add(
                            match done {
                                Done::Executed | Done::ExecutedNotReplayable => Event::Executed,
                                Done::Replayed | Done::ResultUnavailable => Event::Replayed,
                            },
                            1,
                        );
                        self.ack(&raw).await;
                    }
                }
                Settle::Retry(reason) => {
                    tracing::debug!(%reason, "handed back");
                    if contended {
                        self.shared.counters.add(Event::InProgress, 1);
                    }
                    self.hand_back(&raw).await;
                }
                Settle::Failed(reason) => {
                    let spent = match message.delivered {
                        Some(n) => n >= self.max_deliveries,
                        None => self.max_deliveries == 1,
                    };
                    if spent {
                        let reason = format!(
                            "the handler failed on delivery {} (max_deliveries {}): {reason}",
                            message.delivered.unwrap_or(1),
                            self.max_deliveries
                        );
                        self.dead(key.as_ref(), &raw, &message, &reason).await;
                    } else {
                        tracing::info!(%reason, "the handler failed: handed back");
                        self.hand_back(&raw).await;
                    }
                }
                Settle::Dead(reason) => {
                    self.dead(key.as_ref(), &raw, &message, &reason).await;
                }
                Settle::Finish(unrecorded) => {
                    // In a task of its own, which a `run` future dropped
                    // meanwhile does not abort: the key held (never run
                    // again here) until the completion is written. It
                    // lets the message go (`release`) when it ends.
                    let key = unrecorded.lease().key.clone();
                    let fingerprint = unrecorded.lease().fingerprint.or(fingerprint);
                    let guard = self.shared.finishing.hold(key.clone(), fingerprint);
                    self.shared.finishing(id, key, fingerprint);
                    let finish = self
                        .clone()
                        .finish(id, raw, message, fingerprint, guard, *unrecorded)
                        .in_current_span();
                    let _ = tokio::spawn(finish).await;
                    return;
                }
                Settle::Fatal(e) => {
                    tracing::error!(error = %e, "the executor's configuration is refused: the consumer stops");
                    lock(&self.shared.fatal).get_or_insert(e);
                    self.hand_back(&raw).await;
                }
            }
            self.shared.release(id);
        }
        .instrument(span)
        .await;
    }

    /// The message's key, the outcome of its run, and whether its key was
    /// held by another run (in progress with another worker, or being
    /// finished here).
    async fn process<Fut, T, E>(
        &self,
        message: &NatsMessage,
    ) -> (Option<IdempotencyKey>, Settle, bool)
    where
        F: Fn(NatsMessage, M::With) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let key = match self.key.key_of(&self.scope, message) {
            Ok(key) => key,
            Err(e) => return (None, Settle::Dead(format!("no usable key: {e}")), false),
        };
        let fingerprint = fingerprint_of(message, &self.fingerprint);
        // A key this consumer is finishing: the store would hand its
        // expired lease over and run the handler again.
        if self.shared.finishing.holds(&key, &fingerprint) {
            let reason = "its key's completion is being written here".to_owned();
            return (Some(key), Settle::Retry(reason), true);
        }
        let handler = self.handler.clone();
        let max_deliveries = self.max_deliveries;
        let mut copy = message.clone();
        let result = self
            .runner
            .process_one(
                &self.idem,
                &key,
                Some(fingerprint),
                move |context, with| async move {
                    Attempted::guard(context, max_deliveries, |context| {
                        copy.attempt = context.attempt;
                        copy.fence = context.fence;
                        handler(copy, with)
                    })
                    .await
                },
            )
            .await;
        let contended = matches!(
            result,
            Err(IdemError::InProgress { .. } | IdemError::WaitTimeout { .. })
        );
        let outcome = settle(result, is_permanent::<MessageError, E>, max_deliveries);
        (Some(key), outcome, contended)
    }

    /// Awaits `work`, sending an in-progress ack for `raw` every
    /// `progress_every` meanwhile (in this task: no task of its own per
    /// message).
    async fn kept<T>(&self, raw: &jetstream::Message, work: impl Future<Output = T>) -> T {
        let Some(every) = self.progress_every else {
            return work.await;
        };
        futures_util::pin_mut!(work);
        let mut next = tokio::time::Instant::now() + every;
        loop {
            tokio::select! {
                biased;
                out = &mut work => return out,
                () = tokio::time::sleep_until(next) => {
                    // Bounded: a client whose queue is full (the server
                    // away) must not hold `work` up.
                    let sent = tokio::time::timeout(every, raw.ack_with(AckKind::Progress)).await;
                    match sent {
                        Ok(Ok(())) => self.shared.counters.add(Event::ProgressAcks, 1),
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "in-progress ack failed");
                            self.shared.counters.add(Event::ProgressFailures, 1);
                        }
                        Err(_) => {
                            tracing::debug!("in-progress ack not sent in time");
                            self.shared.counters.add(Event::ProgressFailures, 1);
                        }
                    }
                    next = tokio::time::Instant::now() + every;
                }
            }
        }
    }

    /// Acks `raw`; a failure is counted (it comes back and is replayed).
    async fn ack(&self, raw: &jetstream::Message) {
        match raw.ack_with(AckKind::Ack).await {
            Ok(()) => self.shared.counters.add(Event::Acked, 1),
            Err(e) => {
                tracing::warn!(error = %e, "ack failed: the message comes back after the ack wait and is replayed");
                self.shared.counters.add(Event::AckFailures, 1);
            }
        }
    }

    /// Hands `raw` back (`-NAK` with the retry delay).
    pub(crate) async fn hand_back(&self, raw: &jetstream::Message) {
        self.shared.counters.add(Event::HandedBack, 1);
        let delay = (!self.retry_delay.is_zero()).then_some(self.retry_delay);
        if let Err(e) = raw.ack_with(AckKind::Nak(delay)).await {
            tracing::warn!(error = %e, "hand-back failed: the message comes back after the ack wait");
            self.shared.counters.add(Event::AckFailures, 1);
        }
    }

    /// Dead-letters `raw` with `reason`, then acks it; handed back when
    /// the dead letter could not be published (it may be later), and
    /// terminated (`+TERM`, an error logged) when JetStream refuses it for
    /// good in every form (`dead_letter::publish`).
    async fn dead(
        &self,
        key: Option<&IdempotencyKey>,
        raw: &jetstream::Message,
        message: &NatsMessage,
        reason: &str,
    ) {
        self.shared.counters.add(Event::Poison, 1);
        let Some(subject) = &self.dead_letter else {
            tracing::warn!(%reason, "poison message terminated (+TERM; no dead-letter subject set)");
            self.settled_poison(key).await;
            self.terminate(raw).await;
            return;
        };
        let publish =
            crate::dead_letter::publish(&self.jetstream, subject, &self.durable, message, reason);
        match self.kept(raw, publish).await {
            Ok(dropped) => {
                match dropped {
                    None => {
                        tracing::warn!(%reason, dead_letter = %subject, "poison message dead-lettered");
                    }
                    Some(dropped) => {
                        tracing::warn!(%reason, dead_letter = %subject, %dropped, "poison message dead-lettered without part of it (JetStream refused it whole, or it did not fit max_payload)");
                    }
                }
                self.shared.counters.add(Event::DeadLettered, 1);
                self.settled_poison(key).await;
                self.ack(raw).await;
            }
            Err(NotPublished::Passing(e)) => {
                tracing::warn!(error = %e, %reason, "the dead letter could not be published: handed back");
                self.shared.counters.add(Event::DeadLetterFailures, 1);
                self.hand_back(raw).await;
            }
            Err(NotPublished::Refused(e)) => {
                tracing::error!(error = %e, %reason, dead_letter = %subject, "JetStream refuses the dead letter for good, even without the message's headers and payload: the message is terminated (+TERM), its reason only in this log");
                self.shared.counters.add(Event::DeadLetterFailures, 1);
                self.settled_poison(key).await;
                self.terminate(raw).await;
            }
        }
    }

    /// A poison message settled for good (dead-lettered or terminated):
    /// what the runner kept of its key is let go, and no dead letter is
    /// owed for it any more.
    async fn settled_poison(&self, key: Option<&IdempotencyKey>) {
        if let Some(key) = key {
            self.runner.forget(&self.idem, key).await;
            lock(&self.shared.owed).remove(key);
        }
    }

    /// Terminates `raw` (`+TERM`: JetStream delivers it no more).
    async fn terminate(&self, raw: &jetstream::Message) {
        match raw.ack_with(AckKind::Term).await {
            Ok(()) => self.shared.counters.add(Event::Acked, 1),
            Err(e) => {
                tracing::warn!(error = %e, "terminating a poison message failed: it comes back and is dead-lettered again");
                self.shared.counters.add(Event::AckFailures, 1);
            }
        }
    }

    /// A handler that ran while the store was away until its lease ended:
    /// its key held here (`guard`) and its message kept (in-progress
    /// acks) while its completion is written with the run's own lease,
    /// then acked. Runs in a task of its own (it owns all it needs), so a
    /// `run` future dropped meanwhile does not cut it off; a shutdown past
    /// its wait gives it up (the message is left to come back after the
    /// ack wait, the key given up here). Lets held message `id` go.
    async fn finish(
        self: Arc<Self>,
        id: u64,
        raw: jetstream::Message,
        message: NatsMessage,
        fingerprint: Option<Fingerprint>,
        guard: FinishingGuard,
        unrecorded: Unrecorded,
    ) {
        let key = guard.key().clone();
        tracing::warn!(error = %unrecorded.cause(), "the handler ran but its result is not recorded: kept while its completion is written");
        let (first, longest) = FINISH_PAUSES;
        let finishing = self.idem.finish_until_woken(
            &unrecorded,
            Pauses::new(first, longest),
            self.shared.given_up_at_shutdown(),
            &self.shared.finishing,
        );
        let finished = self.kept(&raw, finishing).await;
        match finished {
            Finished::Recorded => {
                drop(guard);
                self.shared.counters.add(Event::Executed, 1);
                self.shared.counters.add(Event::FinishedLate, 1);
                self.ack(&raw).await;
            }
            Finished::TakenOver => {
                drop(guard);
                tracing::warn!("unrecorded run taken over by another worker: handed back");
                self.hand_back(&raw).await;
            }
            Finished::GaveUp(e) => {
                // A shutdown past its wait (the store still away): given
                // up before the key is let go (the shutdown did too), the
                // message left to come back after the ack wait.
                self.give_up(&key, fingerprint);
                drop(guard);
                tracing::warn!(error = %e, "a handler that ran is still unrecorded at shutdown: its key given up here, its message left to come back after the ack wait");
            }
            Finished::Refused(e) => {
                // Its handler ran: given up before the key is let go, so
                // the other deliveries of it here are settled, never run;
                // its dead letter owed until it is published.
                self.give_up(&key, fingerprint);
                drop(guard);
                let reason = format!("the handler ran but its result could not be recorded: {e}");
                lock(&self.shared.owed).insert(key.clone(), reason.clone());
                self.dead(Some(&key), &raw, &message, &reason).await;
            }
        }
        self.shared.release(id);
    }

    /// Gives `key` up here: its handler ran, its completion is not
    /// written; never run again by this consumer.
    fn give_up(&self, key: &IdempotencyKey, fingerprint: Option<Fingerprint>) {
        self.shared.finishing.given_up().insert(
            key.clone(),
            fingerprint,
            self.idem.retention_period(),
        );
    }
}
