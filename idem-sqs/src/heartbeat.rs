//! The visibility heartbeat: the messages in flight are kept invisible
//! while their handlers run.

use std::sync::Arc;
use std::time::Duration;

use crate::queue::Queue;
use crate::shared::lock;
use crate::stats::add;

impl Queue {
    /// Keeps the messages in flight invisible: every `every`, their
    /// visibility is set to the visibility timeout again.
    pub(crate) async fn heartbeat(self: Arc<Self>, every: Duration) {
        loop {
            tokio::time::sleep(every).await;
            let receipts: Vec<String> = lock(&self.shared.in_flight).iter().cloned().collect();
            if receipts.is_empty() {
                continue;
            }
            let (ok, refused) = self.change_visibility(&receipts, self.visibility).await;
            add(&self.shared.counters.heartbeats, ok);
            // A message settled (deleted) while the call was on its way, or
            // whose delete is on its way, is refused: not a failure.
            let failed = {
                let in_flight = lock(&self.shared.in_flight);
                let settling = lock(&self.shared.settling);
                refused
                    .iter()
                    .filter(|r| in_flight.contains(*r) && !settling.contains(*r))
                    .count()
            };
            if failed > 0 {
                add(&self.shared.counters.heartbeat_failures, failed);
                tracing::warn!(queue = %self.url, failed, "visibility heartbeat: some messages were not extended (handed out again, or past SQS's 12 hours)");
            }
        }
    }

    /// Marks these messages (still in the heartbeat) as on their way to be
    /// deleted, or dead-lettered and deleted.
    pub(crate) fn settling<'a>(&self, receipts: impl IntoIterator<Item = &'a String>) {
        lock(&self.shared.settling).extend(receipts.into_iter().cloned());
    }

    /// Takes these messages out of the heartbeat: settled (deleted, or
    /// left to come back).
    pub(crate) fn settled(&self, receipts: &[String]) {
        if receipts.is_empty() {
            return;
        }
        let mut in_flight = lock(&self.shared.in_flight);
        let mut settling = lock(&self.shared.settling);
        for r in receipts {
            in_flight.remove(r);
            settling.remove(r);
        }
    }
}
