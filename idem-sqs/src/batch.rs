//! The processing of one receive's messages: their keys claimed, run
//! through the executor's batch path, then each deleted, left for
//! redelivery, dead-lettered or kept to finish, as its outcome says.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

// The handler's error, or the run refused because its key was acquired
// more than `max_deliveries` times: the shared `Attempted`.
use idem_core::delivery::{self, Attempted as Run, Done, Settle};
use idem_core::{
    Codec, Context, Fingerprint, IdemError, Idempotency, IdempotencyKey, IdempotencyStore,
    PayloadFingerprint, Processed, Runner, StoreError, Unrecorded,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::OwnedSemaphorePermit;

use crate::finishing::Unfinished;
use crate::message;
use crate::queue::Queue;
use crate::shared::{lock, Shared};
use crate::stats::add;
use crate::{KeySource, MessageError, SqsMessage};

/// The keys a batch task claimed in [`Shared::busy`]; given back when
/// dropped (settled, or the task aborted).
struct Claimed {
    shared: Arc<Shared>,
    keys: HashSet<IdempotencyKey>,
}

impl Drop for Claimed {
    fn drop(&mut self) {
        let mut busy = lock(&self.shared.busy);
        for key in &self.keys {
            busy.remove(key);
        }
    }
}

/// What to do with a message after processing it.
enum Outcome {
    /// Delete it.
    Delete,
    /// Leave it for redelivery; not the message's fault.
    Left,
    /// The handler failed: left, or dead-lettered past `max_deliveries`.
    Failed(String),
    /// Dead-letter it at once, with this reason.
    Dead(String),
    /// Leave it, and stop `run` with this error.
    Fatal(StoreError),
    /// Its handler ran but the completion is not written: kept invisible,
    /// finished later with this lease.
    Finish(Box<Unrecorded>),
}

impl Outcome {
    /// Whether the next messages of its FIFO message group must wait for
    /// it: anything but deleted (done, or a duplicate) or dead-lettered
    /// (off the queue for good) leaves it to come back first.
    fn stops_its_group(&self) -> bool {
        !matches!(self, Outcome::Delete | Outcome::Dead(_))
    }
}

/// Whether a handler error says the message can never succeed.
fn is_permanent<E: 'static>(e: &E) -> bool {
    delivery::is_permanent::<MessageError, E>(e)
}

/// What a batch task needs: the queue, the executor, the handler.
pub(crate) struct Work<S: ?Sized, C, F, M> {
    pub(crate) queue: Arc<Queue>,
    pub(crate) idem: Idempotency<S, C>,
    /// How the handler runs: with a lease, or in a transaction.
    pub(crate) runner: M,
    pub(crate) handler: Arc<F>,
    pub(crate) key: KeySource,
    pub(crate) scope: String,
    pub(crate) fingerprint: PayloadFingerprint,
    pub(crate) max_deliveries: u32,
    /// In whole seconds.
    pub(crate) retry_visibility: Option<i32>,
}

impl<S, C, F, M> Work<S, C, F, M>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
    M: Runner<S, C>,
{
    /// The message's key; a key from the content, with a fingerprint of
    /// parts of the body, is the hash of those parts (copies that differ
    /// elsewhere share a key, as they share a fingerprint).
    fn key_of(&self, message: &SqsMessage) -> Result<IdempotencyKey, MessageError> {
        if matches!(self.key, KeySource::Content) && !self.fingerprint.is_whole() {
            let hash = self
                .fingerprint
                .fingerprint(message.body.as_bytes())
                .to_hex();
            return Ok(IdempotencyKey::new(self.scope.as_str(), hash)?);
        }
        self.key.key_of(&self.scope, message)
    }

    /// Processes one receive's messages through the executor's batch path,
    /// then dead-letters, deletes and leaves them as their outcomes say.
    pub(crate) async fn process<Fut, T, E>(
        &self,
        batch: Vec<(SqsMessage, Option<String>)>,
        _room: OwnedSemaphorePermit,
    ) where
        F: Fn(SqsMessage, M::With) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let shared = &self.queue.shared;
        // A message without a receipt handle cannot be deleted nor kept
        // invisible: it is not run (its redelivery will have one).
        let mut batch: Vec<(SqsMessage, String)> = batch
            .into_iter()
            .filter_map(|(message, receipt)| match receipt {
                Some(r) => Some((message, r)),
                None => {
                    tracing::warn!(queue = %self.queue.url, message_id = %message.message_id, "a message without a receipt handle: not run");
                    add(&shared.counters.left_for_redelivery, 1);
                    None
                }
            })
            .collect();
        // Runs still to finish: their messages (a redelivery) and every
        // message of their keys are left, never run. Keys that another
        // batch of this consumer is processing are left too ("in
        // progress"): the two never race, so a run of the other batch that
        // ends unrecorded is in `unfinished` before its key is free here
        // (else this batch could take its expired lease over and run it
        // again).
        let mut claimed = Claimed {
            shared: shared.clone(),
            keys: HashSet::new(),
        };
        let mut settled: Vec<Option<Outcome>> = Vec::with_capacity(batch.len());
        // The messages to run: their key and fingerprint, by index.
        let mut to_run: Vec<Option<(IdempotencyKey, Fingerprint)>> =
            Vec::with_capacity(batch.len());
        {
            let mut busy = lock(&shared.busy);
            let (unfinished_ids, unfinished_keys): (HashSet<String>, HashSet<IdempotencyKey>) = {
                let map = lock(&shared.unfinished);
                (
                    map.values()
                        .map(|u| u.message.message_id.clone())
                        .filter(|id| !id.is_empty())
                        .collect(),
                    map.values()
                        .map(|u| u.unrecorded.lease().key.clone())
                        .collect(),
                )
            };
            for (message, _) in &batch {
                let mut run = None;
                let outcome = if unfinished_ids.contains(&message.message_id) {
                    Some(Outcome::Left)
                } else {
                    match self.key_of(message) {
                        Err(e) => Some(Outcome::Dead(format!("no usable key: {e}"))),
                        Ok(key) if unfinished_keys.contains(&key) => Some(Outcome::Left),
                        Ok(key) if busy.contains(&key) && !claimed.keys.contains(&key) => {
                            add(&shared.counters.in_progress, 1);
                            Some(Outcome::Left)
                        }
                        Ok(key) => {
                            claimed.keys.insert(key.clone());
                            run = Some((key, message::fingerprint_of(message, &self.fingerprint)));
                            None
                        }
                    }
                };
                settled.push(outcome);
                to_run.push(run);
            }
            busy.extend(claimed.keys.iter().cloned());
        }
        // A FIFO queue's messages of one group run one after another, in
        // the order received, and a message that does not succeed stops
        // its group: the rest are left, so SQS hands them out again after
        // it, in order. Each round runs the next message of every group
        // still going through the executor's batch path; messages without
        // a group are all in the first round.
        let mut groups: Vec<std::collections::VecDeque<usize>> = Vec::new();
        {
            let mut group_of: std::collections::HashMap<&str, usize> =
                std::collections::HashMap::new();
            for (i, (message, _)) in batch.iter().enumerate() {
                match message.message_group_id.as_deref() {
                    Some(g) => {
                        let at = *group_of.entry(g).or_insert_with(|| {
                            groups.push(std::collections::VecDeque::new());
                            groups.len() - 1
                        });
                        groups[at].push_back(i);
                    }
                    None => groups.push(std::collections::VecDeque::from([i])),
                }
            }
        }
        let item = |message: &SqsMessage| {
            let (handler, mut message) = (self.handler.clone(), message.clone());
            let max = self.max_deliveries;
            move |context: Context, with: M::With| async move {
                if context.attempt > max {
                    return Err(Run::TooManyAttempts(context.attempt));
                }
                message.attempt = context.attempt;
                message.fence = context.fence;
                handler(message, with).await.map_err(Run::Handler)
            }
        };
        loop {
            let mut items = Vec::new();
            let mut item_of = Vec::new();
            for (g, group) in groups.iter_mut().enumerate() {
                while let Some(i) = group.pop_front() {
                    if let Some((key, fingerprint)) = to_run[i].take() {
                        items.push((key, Some(fingerprint), item(&batch[i].0)));
                        item_of.push((i, g));
                        break;
                    }
                    if settled[i].as_ref().is_some_and(Outcome::stops_its_group) {
                        for rest in group.drain(..) {
                            settled[rest] = Some(Outcome::Left);
                        }
                    }
                }
            }
            if items.is_empty() {
                break;
            }
            let processed = self.runner.process_batch(&self.idem, items).await;
            for ((i, g), result) in item_of.into_iter().zip(processed) {
                let outcome = self.outcome_of(&batch[i].0, result);
                if outcome.stops_its_group() {
                    for rest in groups[g].drain(..) {
                        settled[rest] = Some(Outcome::Left);
                    }
                }
                settled[i] = Some(outcome);
            }
        }

        let mut delete = Vec::new();
        let mut left = Vec::new();
        let mut dead = Vec::new();
        let mut fatal = None;
        for ((message, receipt), outcome) in batch.drain(..).zip(settled) {
            let outcome = outcome.unwrap_or_else(|| {
                Outcome::Fatal(StoreError::backend("a message of the batch got no outcome"))
            });
            match outcome {
                Outcome::Delete => delete.push(receipt),
                Outcome::Left => left.push(receipt),
                Outcome::Fatal(e) => {
                    fatal.get_or_insert(e);
                    left.push(receipt);
                }
                Outcome::Dead(reason) => dead.push((message, receipt, reason)),
                Outcome::Failed(reason) => {
                    let max = self.max_deliveries;
                    let count = match message.receive_count {
                        None if max == 1 => Some(1),
                        n => n,
                    };
                    match count {
                        Some(n) if n >= max => {
                            let reason =
                                format!("{reason} (received {n} times, max_deliveries {max})");
                            dead.push((message, receipt, reason));
                        }
                        Some(_) => left.push(receipt),
                        None => {
                            tracing::warn!(queue = %self.queue.url, message_id = %message.message_id, "handler failed and the receive count is unknown: left for redelivery");
                            left.push(receipt);
                        }
                    }
                }
                Outcome::Finish(unrecorded) => {
                    lock(&shared.unfinished).insert(
                        receipt,
                        Unfinished {
                            message,
                            unrecorded: Arc::from(unrecorded),
                        },
                    );
                }
            }
        }
        // Unrecorded runs are in `unfinished` now: their keys may go.
        drop(claimed);
        // The messages left go out of the heartbeat first: a visibility set
        // below must not be undone by a renewal (one already under way may
        // still extend a message once; it then comes back a little later).
        // Those to delete or dead-letter stay in it until they are deleted:
        // a dead letter or a delete slower than the visibility timeout must
        // not let the message be received (and run, or dead-lettered)
        // again meanwhile.
        self.queue.settled(&left);
        self.queue
            .settling(delete.iter().chain(dead.iter().map(|(_, r, _)| r)));
        for (message, _, _) in &dead {
            if let Ok(key) = self.key_of(message) {
                self.runner.forget(&self.idem, &key).await;
            }
        }
        let (sent, not_sent) = self.queue.dead_letter(dead).await;
        self.queue.settled(&not_sent);
        delete.extend(sent);
        left.extend(not_sent);
        self.queue.delete(&delete).await;
        self.queue.settled(&delete);
        add(&shared.counters.left_for_redelivery, left.len());
        if let (Some(seconds), false) = (self.retry_visibility, left.is_empty()) {
            self.queue.change_visibility(&left, seconds).await;
        }
        if let Some(e) = fatal {
            lock(&shared.fatal).get_or_insert(e);
        }
    }

    /// What to do with a message after processing it
    /// ([`idem_core::delivery::settle`], the table every consumer shares),
    /// counted and logged.
    fn outcome_of<T, E: fmt::Display + 'static>(
        &self,
        message: &SqsMessage,
        outcome: Result<Processed<T>, IdemError<Run<E>>>,
    ) -> Outcome {
        let counters = &self.queue.shared.counters;
        let (queue, id) = (&self.queue.url, &message.message_id);
        let reason = match &outcome {
            Ok(Processed::ExecutedNotReplayable { reason, .. }) => Some(reason.clone()),
            Err(IdemError::ResultUnavailable { reason }) => Some(reason.clone()),
            _ => None,
        };
        let in_progress = matches!(
            outcome,
            Err(IdemError::InProgress { .. } | IdemError::WaitTimeout { .. })
        );
        match delivery::settle(outcome, is_permanent::<E>, self.max_deliveries) {
            Settle::Done(Done::Executed) => {
                add(&counters.executed, 1);
                Outcome::Delete
            }
            Settle::Done(Done::ExecutedNotReplayable) => {
                tracing::warn!(%queue, message_id = %id, ?reason, "the handler ran but its result was not recorded");
                add(&counters.executed, 1);
                Outcome::Delete
            }
            Settle::Done(Done::Replayed) => {
                add(&counters.replayed, 1);
                Outcome::Delete
            }
            // The key completed (its result was not recordable): deleted,
            // never run again, never dead-lettered.
            Settle::Done(Done::ResultUnavailable) => {
                tracing::warn!(%queue, message_id = %id, ?reason, "duplicate of a message whose result was not recorded: deleted");
                add(&counters.replayed, 1);
                Outcome::Delete
            }
            // Held by another worker right now (its lease ends if it
            // died), the executor waited too long for it, the store away
            // or refusing calls, the lease taken over.
            Settle::Retry(why) => {
                if in_progress {
                    add(&counters.in_progress, 1);
                } else {
                    tracing::warn!(%queue, message_id = %id, reason = %why, "not settled now: left for redelivery");
                }
                Outcome::Left
            }
            Settle::Fatal(e) => Outcome::Fatal(e),
            // The handler ran; the store was away past its lease: the
            // completion is written later with the same lease.
            Settle::Finish(u) => {
                tracing::warn!(%queue, message_id = %id, error = %u.cause(), "the handler ran but its result is not recorded yet: kept invisible, to finish");
                Outcome::Finish(u)
            }
            Settle::Failed(why) => {
                tracing::warn!(%queue, message_id = %id, error = %why, "handler failed: left for redelivery");
                Outcome::Failed(why)
            }
            Settle::Dead(why) => Outcome::Dead(why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handler_errors_of_bad_input_are_permanent() {
        assert!(is_permanent(&MessageError::NoMessageId));
        let boxed: Box<dyn std::error::Error + Send + Sync> =
            Box::new(MessageError::Json("x".into()));
        assert!(is_permanent(&boxed));
        assert!(!is_permanent(&std::io::Error::other("down")));
    }
}
