//! Why the consumer could not be made or could not go on.

use idem_core::StoreError;
use rdkafka::error::KafkaError;

/// Why the consumer could not be made or could not go on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaConsumerError {
    /// The Kafka client refused its configuration or failed.
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    /// The idempotency store or the executor's configuration refused
    /// every call: nothing could succeed.
    #[error("idempotency store: {0}")]
    Store(#[from] StoreError),
    /// A setting is missing or wrong (`group.id`, no topic, no tokio
    /// runtime).
    #[error("configuration: {0}")]
    Config(String),
}
