//! Offset commits: the commit points of the partitions, sent one at a
//! time, synchronously, on a blocking thread, and the offsets the broker
//! confirmed.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use idem_core::{Codec, IdempotencyStore};
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use crate::consumer::KafkaConsumer;
use crate::context::IdemContext;
use crate::shared::{lock, Shared};
use crate::track::Track;

impl Shared {
    pub(crate) fn confirm(&self, offsets: &TopicPartitionList) {
        let mut confirmed = lock(&self.confirmed);
        for e in offsets.elements() {
            if let (Offset::Offset(o), Ok(())) = (e.offset(), e.error()) {
                let slot = confirmed
                    .entry((e.topic().to_owned(), e.partition()))
                    .or_insert(o);
                *slot = (*slot).max(o);
            }
        }
    }
}

impl<S: IdempotencyStore + ?Sized, C: Codec> KafkaConsumer<S, C> {
    fn commit_points(&self, force: bool) -> (TopicPartitionList, u64) {
        let tracks: Vec<Arc<Track>> = lock(&self.shared.tracks).values().cloned().collect();
        points(&tracks, force)
    }

    /// Sends the commit points that moved (all of them after a failed
    /// commit), unless a commit is under way: then the next wake does.
    /// The commit is synchronous, on a blocking thread, so its answer is
    /// known (rdkafka does not report asynchronous commits to a
    /// `StreamConsumer` reliably) and commits never overtake each other.
    pub(crate) fn commit_async(&self) {
        if self.shared.committing.swap(true, Ordering::SeqCst) {
            return;
        }
        let force = self.shared.recommit.swap(false, Ordering::SeqCst);
        let (tpl, records) = self.commit_points(force);
        if tpl.count() == 0 {
            self.shared.committing.store(false, Ordering::SeqCst);
            return;
        }
        let (consumer, shared) = (self.consumer.clone(), self.shared.clone());
        tokio::task::spawn_blocking(move || {
            commit_now(&*consumer, &shared, &tpl, records);
            shared.committing.store(false, Ordering::SeqCst);
            shared.wake.notify_one();
        });
    }

    /// Commits every commit point and waits for the answer (at shutdown).
    pub(crate) async fn commit_sync(&self) {
        let (consumer, shared) = (self.consumer.clone(), self.shared.clone());
        let done = tokio::task::spawn_blocking(move || {
            let (tpl, records) = {
                let tracks: Vec<Arc<Track>> = lock(&shared.tracks).values().cloned().collect();
                points(&tracks, true)
            };
            if tpl.count() > 0 && !commit_now(&*consumer, &shared, &tpl, records) {
                tracing::warn!(
                    "final offset commit failed: the records since the last commit are replayed"
                );
            }
        })
        .await;
        if let Err(e) = done {
            tracing::warn!(error = %e, "final offset commit task failed");
        }
    }
}

/// The commit points of `tracks` that moved (all, with `force`), and the
/// records they cover.
fn points(tracks: &[Arc<Track>], force: bool) -> (TopicPartitionList, u64) {
    let mut tpl = TopicPartitionList::new();
    let mut records = 0;
    for t in tracks {
        if let Some((offset, n)) = t.take_commit(force) {
            if tpl
                .add_partition_offset(&t.topic, t.partition, Offset::Offset(offset))
                .is_ok()
            {
                records += n;
            }
        }
    }
    (tpl, records)
}

/// A synchronous commit, one at a time (the revoke's too); on failure the
/// next commit sends every point again. Whether it succeeded.
fn commit_now<K: Consumer<IdemContext>>(
    consumer: &K,
    shared: &Shared,
    tpl: &TopicPartitionList,
    records: u64,
) -> bool {
    let _one_at_a_time = lock(&shared.commit_lock);
    match consumer.commit(tpl, CommitMode::Sync) {
        Ok(()) => {
            shared
                .counters
                .committed
                .fetch_add(records, Ordering::Relaxed);
            shared.confirm(tpl);
            true
        }
        Err(e) => {
            tracing::debug!(error = %e, "offset commit failed: sent again");
            shared.recommit.store(true, Ordering::SeqCst);
            false
        }
    }
}
