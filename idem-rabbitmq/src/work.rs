//! One delivery, from its key to its ack: run it through the executor,
//! then ack, requeue, finish or dead-letter it as its outcome says.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::delivery::{self, count_failure, forget_failures, Attempted, Done, Settle};
use idem_core::{
    Codec, Finished, Idempotency, IdempotencyKey, IdempotencyStore, Pauses, PayloadFingerprint,
    Runner, Unrecorded,
};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, ConfirmSelectOptions};
use lapin::Acker;
use lapin::Channel;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::watch;

use crate::dead_letter;
use crate::shared::{lock, Shared};
use crate::stats::add;
use crate::{DeadLetter, KeySource, MessageError, RabbitMessage};

/// Where the consumer is in its life: the message tasks watch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Phase {
    Running,
    /// `shutdown` completed: messages held before a requeue are requeued
    /// at once.
    Stopping,
    /// The shutdown wait is over: results still being finished are given
    /// up after one more try.
    GivingUp,
}

/// Everything a message task needs, shared by all of them.
pub(crate) struct Work<S: ?Sized, C, F, M> {
    pub(crate) idem: Idempotency<S, C>,
    pub(crate) runner: M,
    pub(crate) handler: Arc<F>,
    pub(crate) key: KeySource,
    pub(crate) fingerprint: PayloadFingerprint,
    pub(crate) scope: String,
    pub(crate) queue: String,
    pub(crate) max_deliveries: u32,
    pub(crate) requeue_delay: Duration,
    pub(crate) dead_letter: DeadLetter,
    /// The confirm channel dead letters are published on, of the current
    /// connection.
    pub(crate) publisher: Mutex<Option<Publisher>>,
    pub(crate) phase: watch::Sender<Phase>,
    pub(crate) shared: Arc<Shared>,
}

/// Where dead letters are published: the current connection and its
/// confirm channel (opened again when the broker closed it: a dead letter
/// refused for a missing exchange closes its channel).
pub(crate) struct Publisher {
    pub(crate) connection: Arc<lapin::Connection>,
    pub(crate) channel: Option<Channel>,
}

/// The shortest hold before a message that cannot settle now is tried
/// again in place (a zero `requeue_delay` would ask the store back to
/// back).
const MIN_HOLD: Duration = Duration::from_millis(10);

/// The pauses between two tries of a result's completion: short, since
/// once its lease is over another consumer may take its key over.
const FINISH_PAUSES: (Duration, Duration) = (Duration::from_millis(10), Duration::from_millis(250));

impl<S, C, F, M> Work<S, C, F, M>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
    M: Runner<S, C>,
{
    /// Processes one delivery to its end (acked, requeued or
    /// dead-lettered).
    pub(crate) async fn handle<Fut, T, E>(self: Arc<Self>, delivery: Delivery)
    where
        F: Fn(RabbitMessage, M::With) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let (message, acker) = RabbitMessage::read(delivery);
        let key = match self.key.key_with(&self.scope, &message, &self.fingerprint) {
            Ok(key) => key,
            Err(e) => {
                let reason = format!("no usable key: {e}");
                return self.poison(&message, &acker, None, reason).await;
            }
        };
        let print = self.fingerprint.fingerprint(&message.body);
        let counters = &self.shared.counters;
        let max = self.max_deliveries;
        // Tried again in place while it cannot settle now (in progress
        // elsewhere, the store away): held unacked, never requeued for it
        // (a quorum queue would count each requeue as a delivery, and drop
        // the message at its `x-delivery-limit`).
        let settled = loop {
            // A key whose result is being finished here: never asked of
            // the store, which would hand its expired lease over and run it
            // again.
            let outcome = if self.shared.finishing.holds(&key, &print) {
                Settle::Retry("its result is being finished here".into())
            } else {
                let handler = self.handler.clone();
                let copy = message.clone();
                let result = self
                    .runner
                    .process_one(&self.idem, &key, Some(print), move |context, with| {
                        let mut copy = copy;
                        copy.attempt = context.attempt;
                        copy.fence = context.fence;
                        Attempted::guard(context, max, move |_| handler(copy, with))
                    })
                    .await;
                delivery::settle(result, is_permanent::<E>, max)
            };
            match outcome {
                Settle::Retry(reason) => {
                    add(&counters.in_progress, 1);
                    tracing::debug!(queue = %self.queue, key = %key, %reason, "not settled now: held, tried again");
                    if !self.hold(&acker).await {
                        return self.requeue(&acker).await;
                    }
                }
                other => break other,
            }
        };
        match settled {
            Settle::Done(Done::ResultUnavailable) if lock(&self.shared.owed).contains_key(&key) => {
                let reason = lock(&self.shared.owed)
                    .get(&key)
                    .cloned()
                    .unwrap_or_default();
                self.poison(&message, &acker, Some(&key), reason).await;
            }
            Settle::Done(done) => {
                match done {
                    Done::Executed | Done::ExecutedNotReplayable => add(&counters.executed, 1),
                    Done::Replayed | Done::ResultUnavailable => add(&counters.replayed, 1),
                }
                self.ack(&acker).await;
                // A redelivery may have failures counted in the store: a
                // fresh copy counts from zero.
                if message.redelivered {
                    forget_failures(self.idem.store().as_ref(), &key).await;
                }
            }
            Settle::Dead(reason) => self.poison(&message, &acker, Some(&key), reason).await,
            Settle::Failed(reason) => {
                add(&counters.failed, 1);
                // Counted in the store, on every kind of queue: a header
                // (`x-delivery-count`) may come from the publisher or from
                // an earlier queue's dead letter, and a quorum queue counts
                // requeues that were no failure.
                let deliveries = count_failure(self.idem.store().as_ref(), &key).await;
                match deliveries {
                    Some(n) if n >= max => {
                        let reason = format!(
                            "the handler failed on delivery {n} (max_deliveries {max}): {reason}"
                        );
                        self.poison(&message, &acker, Some(&key), reason).await;
                    }
                    _ => {
                        tracing::debug!(queue = %self.queue, key = %key, deliveries, %reason, "handler failed: requeued");
                        self.requeue_later(&acker).await;
                    }
                }
            }
            // Not reached (tried again above): handed back.
            Settle::Retry(_) => self.requeue(&acker).await,
            // In a task of its own: a `run` future dropped meanwhile does
            // not cut the finish off (the key would be let go unrecorded,
            // and its redelivery would take the expired lease over).
            Settle::Finish(unrecorded) => {
                let finish = tokio::spawn(self.clone().finish(message, acker, *unrecorded));
                let _ = finish.await;
            }
            Settle::Fatal(e) => {
                tracing::error!(queue = %self.queue, error = %e, "the executor's configuration is refused: the consumer stops");
                *lock(&self.shared.fatal) = Some(e);
                self.requeue(&acker).await;
            }
        }
    }

    /// Writes the completion of a run whose handler returned while the
    /// store was away, with the run's own lease, while the message stays
    /// unacked (the broker gives it to no one else while this connection
    /// lives) and its key is held here; then acks it.
    async fn finish(self: Arc<Self>, message: RabbitMessage, acker: Acker, unrecorded: Unrecorded) {
        let (message, acker) = (&message, &acker);
        let key = unrecorded.lease().key.clone();
        let fingerprint = unrecorded.lease().fingerprint;
        let held = self.shared.finishing.hold(key.clone(), fingerprint);
        tracing::warn!(queue = %self.queue, key = %key, error = %unrecorded.cause(), "the handler ran but the store is away: its result is finished before the ack");
        let giving_up = self.reached(Phase::GivingUp);
        let finished = self
            .idem
            .finish_until_woken(
                &unrecorded,
                Pauses::new(FINISH_PAUSES.0, FINISH_PAUSES.1),
                giving_up,
                &self.shared.finishing,
            )
            .await;
        let counters = &self.shared.counters;
        match finished {
            Finished::Recorded => {
                drop(held);
                add(&counters.finished, 1);
                add(&counters.executed, 1);
                self.ack(acker).await;
            }
            Finished::TakenOver => {
                drop(held);
                tracing::warn!(queue = %self.queue, key = %key, "an unfinished run was taken over by another worker: requeued (its redelivery gets the new holder's answer)");
                self.requeue(acker).await;
            }
            Finished::Refused(e) | Finished::GaveUp(e) => {
                // Given up before the key is let go: the other deliveries
                // of the key here settle as duplicates, never run.
                self.shared.finishing.given_up().insert(
                    key.clone(),
                    fingerprint,
                    self.idem.retention_period(),
                );
                drop(held);
                let reason = format!("the handler ran but its result could not be recorded: {e}");
                // Owed until it is published: a redelivery (the first
                // publish failed) is dead-lettered, not acked as a
                // duplicate whose result was not recorded.
                lock(&self.shared.owed).insert(key.clone(), reason.clone());
                self.poison(message, acker, Some(&key), reason).await;
            }
        }
    }

    /// A message that can never succeed: dead-lettered with `reason`, then
    /// acked; requeued when the dead letter could not be published.
    async fn poison(
        &self,
        message: &RabbitMessage,
        acker: &Acker,
        key: Option<&IdempotencyKey>,
        reason: String,
    ) {
        let counters = &self.shared.counters;
        add(&counters.poison, 1);
        tracing::warn!(queue = %self.queue, message_id = ?message.message_id(), %reason, "poison message: dead-lettered");
        match &self.dead_letter {
            DeadLetter::QueuePolicy => {
                let nack = acker.nack(BasicNackOptions {
                    multiple: false,
                    requeue: false,
                });
                if self.settled(nack.await) {
                    add(&counters.rejected, 1);
                    add(&counters.dead_lettered, 1);
                    if let Some(key) = key {
                        lock(&self.shared.owed).remove(key);
                    }
                }
            }
            DeadLetter::Exchange {
                exchange,
                routing_key,
            } => {
                let sent = match self.publish_channel().await {
                    Ok((channel, frame_max)) => {
                        dead_letter::publish(
                            &channel,
                            frame_max,
                            exchange,
                            routing_key,
                            &self.queue,
                            message,
                            &reason,
                        )
                        .await
                    }
                    Err(e) => Err(e),
                };
                match sent {
                    Ok(()) => {
                        add(&counters.dead_lettered, 1);
                        if let Some(key) = key {
                            lock(&self.shared.owed).remove(key);
                        }
                        self.ack(acker).await;
                    }
                    Err(e) => {
                        add(&counters.dead_letter_failures, 1);
                        tracing::error!(queue = %self.queue, message_id = ?message.message_id(), error = %e, "the dead letter was not published: requeued");
                        self.requeue_later(acker).await;
                        return;
                    }
                }
            }
        }
        if let Some(key) = key {
            self.runner.forget(&self.idem, key).await;
            forget_failures(self.idem.store().as_ref(), key).await;
        }
    }

    /// The confirm channel to publish a dead letter on, opened again if
    /// the broker closed it, and the connection's largest frame.
    async fn publish_channel(&self) -> Result<(Channel, u32), String> {
        let (connection, channel) = match &*lock(&self.publisher) {
            Some(p) => (p.connection.clone(), p.channel.clone()),
            None => return Err("no connection to publish it on".into()),
        };
        let frame_max = connection.configuration().frame_max();
        if let Some(channel) = channel.filter(|c| c.status().connected()) {
            return Ok((channel, frame_max));
        }
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| e.to_string())?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| e.to_string())?;
        if let Some(p) = &mut *lock(&self.publisher) {
            if Arc::ptr_eq(&p.connection, &connection) {
                p.channel = Some(channel.clone());
            }
        }
        Ok((channel, frame_max))
    }

    async fn ack(&self, acker: &Acker) {
        if self.settled(acker.ack(BasicAckOptions::default()).await) {
            add(&self.shared.counters.acked, 1);
        }
    }

    /// Requeues the message at once.
    async fn requeue(&self, acker: &Acker) {
        let nack = acker.nack(BasicNackOptions {
            multiple: false,
            requeue: true,
        });
        if self.settled(nack.await) {
            add(&self.shared.counters.requeued, 1);
        }
    }

    /// Holds the message for the requeue delay; whether to try it again
    /// (not when the consumer is stopping, or the message's channel is
    /// gone: the broker delivers it again).
    async fn hold(&self, acker: &Acker) -> bool {
        tokio::select! {
            () = tokio::time::sleep(self.requeue_delay.max(MIN_HOLD)) => {}
            () = self.reached(Phase::Stopping) => return false,
        }
        !acker.poisoned()
    }

    /// Holds the message for the requeue delay (cut short by a shutdown),
    /// then requeues it.
    async fn requeue_later(&self, acker: &Acker) {
        if !self.requeue_delay.is_zero() {
            tokio::select! {
                () = tokio::time::sleep(self.requeue_delay) => {}
                () = self.reached(Phase::Stopping) => {}
            }
        }
        self.requeue(acker).await;
    }

    /// Whether an ack, nack or reject reached the broker; counts it
    /// otherwise (its channel is gone: the broker delivers the message
    /// again, and the redelivery is replayed or run).
    fn settled(&self, sent: lapin::Result<bool>) -> bool {
        match sent {
            Ok(true) => true,
            Ok(false) | Err(_) => {
                add(&self.shared.counters.ack_failures, 1);
                tracing::warn!(queue = %self.queue, error = ?sent.err(), "the channel of a delivery is gone: the broker delivers it again");
                false
            }
        }
    }

    /// Completes once the consumer reached `phase`.
    pub(crate) async fn reached(&self, phase: Phase) {
        let mut watch = self.phase.subscribe();
        let _ = watch.wait_for(|p| *p >= phase).await;
    }
}

fn is_permanent<E: 'static>(e: &E) -> bool {
    delivery::is_permanent::<MessageError, E>(e)
}
