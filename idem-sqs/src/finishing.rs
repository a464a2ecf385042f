//! The finishing of messages whose handler ran while the store was away
//! (`IdemError::Unrecorded`): kept invisible, their completions written
//! with the run's own lease once the store is back, then deleted.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{Codec, Finished, IdempotencyStore, Unrecorded};

use crate::batch::Work;
use crate::shared::lock;
use crate::stats::add;
use crate::SqsMessage;

/// How often unfinished runs are tried again while the consumer waits
/// (for room, or for a receive): soon after the store is back, their
/// completions are written.
const FINISH_EVERY: Duration = Duration::from_millis(50);

/// A message whose handler ran but whose completion is not written yet.
pub(crate) struct Unfinished {
    pub(crate) message: SqsMessage,
    /// Shared, so a finish in flight leaves the entry in the map: its key
    /// stays held against the other messages of the key meanwhile.
    pub(crate) unrecorded: Arc<Unrecorded>,
}

impl<S, C, F, M> Work<S, C, F, M>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
{
    /// Writes the completions of messages whose handler ran while the
    /// store was away (one `complete` each, with the run's own lease), and
    /// deletes those recorded. One taken over by another worker is left
    /// (its redelivery gets the new holder's answer); one the store
    /// refuses for good is dead-lettered (its handler ran: never run
    /// again); one still failing waits for the next round, invisible.
    /// Awaits `wait`, trying the unfinished runs again every
    /// [`FINISH_EVERY`] meanwhile (a long poll can take 20 s: the lease of
    /// an unfinished run is over, and another worker may take its key over
    /// at any time, so its completion is written as soon as the store
    /// takes it).
    pub(crate) async fn finishing_while<T>(&self, wait: impl std::future::Future<Output = T>) -> T {
        futures_util::pin_mut!(wait);
        // A run may end unrecorded while this waits: the map is looked at
        // on every tick (a lock and an empty check while nothing is
        // unfinished).
        loop {
            tokio::select! {
                biased;
                out = &mut wait => return out,
                () = tokio::time::sleep(FINISH_EVERY) => self.finish_unfinished().await,
            }
        }
    }

    pub(crate) async fn finish_unfinished(&self) {
        let shared = &self.queue.shared;
        let todo: Vec<String> = {
            let map = lock(&shared.unfinished);
            if map.is_empty() {
                return;
            }
            map.keys().cloned().collect()
        };
        let mut delete = Vec::new();
        let mut dead = Vec::new();
        for receipt in todo {
            // The entry stays in the map while its finish is in flight
            // (its key held); it leaves once the finish settles.
            let Some(unrecorded) = lock(&shared.unfinished)
                .get(&receipt)
                .map(|u| u.unrecorded.clone())
            else {
                continue;
            };
            // Still away: tried again on the next round, the entry left
            // in the map.
            let Ok(finished) = self.idem.try_finish(&unrecorded).await else {
                continue;
            };
            // Its handler ran: given up before its key leaves
            // `unfinished`, so the other messages of the key are settled as
            // duplicates, never run.
            if let Finished::Refused(_) | Finished::GaveUp(_) = &finished {
                let retention = self.idem.retention_period();
                shared.finishing.given_up().insert(
                    unrecorded.lease().key.clone(),
                    unrecorded.lease().fingerprint,
                    retention,
                );
            }
            let Some(u) = lock(&shared.unfinished).remove(&receipt) else {
                continue;
            };
            // Those to delete or dead-letter stay in the heartbeat until
            // they are deleted (a slow delete must not let them come back).
            match finished {
                Finished::Recorded => {
                    add(&shared.counters.executed, 1);
                    delete.push(receipt);
                }
                Finished::TakenOver => {
                    tracing::warn!(queue = %self.queue.url, message_id = %u.message.message_id, "unfinished run taken over by another worker: left for redelivery");
                    self.queue.settled(std::slice::from_ref(&receipt));
                    add(&shared.counters.left_for_redelivery, 1);
                }
                Finished::Refused(e) | Finished::GaveUp(e) => {
                    let reason =
                        format!("the handler ran but its result could not be recorded: {e}");
                    dead.push((u.message, receipt, reason));
                }
            }
        }
        self.queue
            .settling(delete.iter().chain(dead.iter().map(|(_, r, _)| r)));
        let (sent, not_sent) = self.queue.dead_letter(dead).await;
        self.queue.settled(&not_sent);
        delete.extend(sent);
        add(&shared.counters.left_for_redelivery, not_sent.len());
        self.queue.delete(&delete).await;
        self.queue.settled(&delete);
    }
}
