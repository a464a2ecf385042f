//! The queue and the SQS calls made on it: receive, delete, change
//! visibility, each bounded by the call timeout.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry,
    MessageSystemAttributeName,
};
use aws_sdk_sqs::Client;

use crate::error::SqsError;
use crate::shared::Shared;
use crate::stats::add;

/// The most messages one `ReceiveMessage` (and one batch call) takes: SQS's
/// limit.
pub const MAX_BATCH: usize = 10;

/// The queue and the calls made on it.
pub(crate) struct Queue {
    pub(crate) client: Client,
    pub(crate) url: String,
    pub(crate) call_timeout: Duration,
    /// The visibility timeout asked for, in seconds.
    pub(crate) visibility: i32,
    pub(crate) dead_letter: Option<String>,
    /// The attribute the keys come from: kept first in a dead letter.
    pub(crate) key_attribute: Option<String>,
    pub(crate) shared: Arc<Shared>,
}

/// One SQS call, bounded by `limit`.
pub(crate) async fn call<T, E>(
    operation: &'static str,
    limit: Duration,
    request: impl Future<Output = Result<T, SdkError<E>>>,
) -> Result<T, SqsError>
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    match tokio::time::timeout(limit, request).await {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(e)) => Err(SqsError::of(operation, e)),
        Err(_) => Err(SqsError::timeout(operation, limit)),
    }
}

impl Queue {
    /// Up to `max` messages, waiting up to `wait` seconds for them.
    pub(crate) async fn receive(
        &self,
        max: usize,
        wait: i32,
    ) -> Result<Vec<aws_sdk_sqs::types::Message>, SqsError> {
        let request = self
            .client
            .receive_message()
            .queue_url(&self.url)
            .max_number_of_messages(max.clamp(1, MAX_BATCH) as i32)
            .wait_time_seconds(wait)
            .visibility_timeout(self.visibility)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
            .message_attribute_names("All")
            .send();
        let limit = Duration::from_secs(wait.max(0) as u64).saturating_add(self.call_timeout);
        let out = call("ReceiveMessage", limit, request).await?;
        Ok(out.messages.unwrap_or_default())
    }

    /// Deletes these messages, 10 a call, the calls at once.
    pub(crate) async fn delete(&self, receipts: &[String]) {
        if receipts.is_empty() {
            return;
        }
        let calls = receipts.chunks(MAX_BATCH).map(|chunk| async move {
            let entries: Vec<_> = chunk
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    DeleteMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(r)
                        .build()
                        .ok()
                })
                .collect();
            let request = self
                .client
                .delete_message_batch()
                .queue_url(&self.url)
                .set_entries(Some(entries))
                .send();
            match call("DeleteMessageBatch", self.call_timeout, request).await {
                Ok(out) => {
                    for failed in &out.failed {
                        tracing::warn!(queue = %self.url, code = %failed.code, message = ?failed.message, "delete refused: the message comes back and is replayed");
                    }
                    (out.successful.len(), out.failed.len())
                }
                Err(e) => {
                    tracing::warn!(queue = %self.url, messages = chunk.len(), error = %e, "delete failed: the messages come back and are replayed");
                    (0, chunk.len())
                }
            }
        });
        for (ok, failed) in futures_util::future::join_all(calls).await {
            add(&self.shared.counters.deleted, ok);
            add(&self.shared.counters.delete_failures, failed);
        }
    }

    /// Sets the visibility of these messages to `seconds`, 10 a call, the
    /// calls at once; how many SQS accepted, and the receipts it refused.
    pub(crate) async fn change_visibility(
        &self,
        receipts: &[String],
        seconds: i32,
    ) -> (usize, Vec<String>) {
        let calls = receipts.chunks(MAX_BATCH).map(|chunk| async move {
            let entries: Vec<_> = chunk
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    ChangeMessageVisibilityBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(r)
                        .visibility_timeout(seconds)
                        .build()
                        .ok()
                })
                .collect();
            let request = self
                .client
                .change_message_visibility_batch()
                .queue_url(&self.url)
                .set_entries(Some(entries))
                .send();
            match call("ChangeMessageVisibilityBatch", self.call_timeout, request).await {
                Ok(out) => {
                    let mut refused = Vec::new();
                    for failed in &out.failed {
                        let receipt = failed.id.parse::<usize>().ok().and_then(|i| chunk.get(i));
                        tracing::debug!(queue = %self.url, code = %failed.code, message = ?failed.message, "visibility change refused");
                        refused.extend(receipt.cloned());
                    }
                    (out.successful.len(), refused)
                }
                Err(e) => {
                    tracing::warn!(queue = %self.url, messages = chunk.len(), error = %e, "visibility change failed");
                    (0, chunk.to_vec())
                }
            }
        });
        let mut accepted = 0;
        let mut refused = Vec::new();
        for (ok, failed) in futures_util::future::join_all(calls).await {
            accepted += ok;
            refused.extend(failed);
        }
        (accepted, refused)
    }
}
