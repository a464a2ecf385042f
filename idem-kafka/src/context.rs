//! The rdkafka context: librdkafka's logs, and the rebalance (assign,
//! revoke) and commit callbacks.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::ClientContext;

use crate::shared::{lock, Shared};
use crate::track::Track;

/// The rdkafka context: the rebalance and commit callbacks.
#[doc(hidden)]
pub struct IdemContext {
    pub(crate) shared: Arc<Shared>,
    /// `partition.assignment.strategy` is cooperative-sticky.
    pub(crate) cooperative: bool,
}

impl ClientContext for IdemContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        use rdkafka::config::RDKafkaLogLevel as L;
        match level {
            L::Emerg | L::Alert | L::Critical | L::Error => {
                tracing::error!(target: "librdkafka", %fac, "{message}")
            }
            L::Warning => tracing::warn!(target: "librdkafka", %fac, "{message}"),
            L::Notice | L::Info => tracing::info!(target: "librdkafka", %fac, "{message}"),
            L::Debug => tracing::debug!(target: "librdkafka", %fac, "{message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(target: "librdkafka", %error, "{reason}");
    }
}

impl ConsumerContext for IdemContext {
    /// rdkafka's own `rebalance` asks librdkafka for the rebalance
    /// protocol, a call that can block forever when the consumer is
    /// closing (librdkafka #4041, rust-rdkafka #509: a drop that never
    /// ends); the protocol is known from the configuration instead.
    fn rebalance(
        &self,
        base: &BaseConsumer<Self>,
        err: rdkafka::types::RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        use rdkafka::types::RDKafkaRespErr as E;
        match err {
            E::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                self.pre_rebalance(base, &Rebalance::Assign(tpl));
                let done = if self.cooperative {
                    base.incremental_assign(tpl)
                } else {
                    base.assign(tpl)
                };
                if let Err(e) = done {
                    tracing::warn!(error = %e, "could not take the assigned partitions");
                }
                self.post_rebalance(base, &Rebalance::Assign(tpl));
            }
            E::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                self.pre_rebalance(base, &Rebalance::Revoke(tpl));
                let done = if self.cooperative {
                    base.incremental_unassign(tpl)
                } else {
                    base.unassign()
                };
                if let Err(e) = done {
                    tracing::warn!(error = %e, "could not let the revoked partitions go");
                }
                self.post_rebalance(base, &Rebalance::Revoke(tpl));
            }
            other => {
                let e = KafkaError::Rebalance(other.into());
                self.pre_rebalance(base, &Rebalance::Error(e));
            }
        }
    }

    fn pre_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let tpl = match rebalance {
            Rebalance::Revoke(tpl) => tpl,
            Rebalance::Assign(tpl) => {
                tracing::info!(partitions = ?partitions_of(tpl), "partitions assigned");
                // A new track per assigned partition: records read from
                // here on belong to this assignment.
                let per_partition =
                    self.shared.partition_concurrency.load(Ordering::Relaxed) as usize;
                let mut map = lock(&self.shared.tracks);
                for (topic, partition) in partitions_of(tpl) {
                    let track = Arc::new(Track::new(&topic, partition, per_partition.max(1)));
                    if let Some(old) = map.insert((topic, partition), track) {
                        old.revoke();
                    }
                }
                return;
            }
            Rebalance::Error(e) => {
                tracing::warn!(error = %e, "rebalance error");
                return;
            }
        };
        tracing::info!(partitions = ?partitions_of(tpl), "partitions revoked");
        let lost = base.assignment_lost();
        let tracks: Vec<Arc<Track>> = {
            let mut map = lock(&self.shared.tracks);
            tpl.elements()
                .iter()
                .filter_map(|e| map.remove(&(e.topic().to_owned(), e.partition())))
                .collect()
        };
        self.shared
            .counters
            .revoked
            .fetch_add(tpl.count() as u64, Ordering::Relaxed);
        for t in &tracks {
            t.revoke();
        }
        if lost {
            tracing::warn!(
                partitions = tpl.count(),
                "assignment lost (session timeout): nothing committed"
            );
            return;
        }
        let limit = Duration::from_millis(self.shared.revoke_wait_ms.load(Ordering::Relaxed));
        let running: usize = tracks.iter().map(|t| t.running()).sum();
        if running > 0 && !limit.is_zero() {
            let wait = || {
                let deadline = std::time::Instant::now() + limit;
                tracks
                    .iter()
                    .map(|t| {
                        t.wait_idle(deadline.saturating_duration_since(std::time::Instant::now()))
                    })
                    .sum::<usize>()
            };
            let multi = tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
            let left = if multi {
                tokio::task::block_in_place(wait)
            } else {
                tracing::debug!(
                    "revoke on a current-thread runtime: running records are not waited for"
                );
                running
            };
            if left > 0 {
                tracing::info!(
                    records = left,
                    "revoke: records still running after revoke_wait are left to the next owner"
                );
            }
        }
        let mut commit = TopicPartitionList::new();
        let mut records = 0;
        for t in &tracks {
            if let Some((offset, n)) = t.take_commit(true) {
                if commit
                    .add_partition_offset(&t.topic, t.partition, Offset::Offset(offset))
                    .is_ok()
                {
                    records += n;
                }
            }
        }
        if commit.count() > 0 {
            let _one_at_a_time = lock(&self.shared.commit_lock);
            match base.commit(&commit, CommitMode::Sync) {
                Ok(()) => {
                    self.shared
                        .counters
                        .committed
                        .fetch_add(records, Ordering::Relaxed);
                    self.confirm(&commit);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "commit at revoke failed: the next owner replays those records")
                }
            }
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        match result {
            Ok(()) => self.confirm(offsets),
            Err(KafkaError::ConsumerCommit(rdkafka::types::RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => {
                tracing::debug!(error = %e, "offset commit failed: it is sent again");
                self.shared.recommit.store(true, Ordering::SeqCst);
                self.shared.wake.notify_one();
            }
        }
    }
}

impl IdemContext {
    fn confirm(&self, offsets: &TopicPartitionList) {
        self.shared.confirm(offsets);
    }
}

fn partitions_of(tpl: &TopicPartitionList) -> Vec<(String, i32)> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}
