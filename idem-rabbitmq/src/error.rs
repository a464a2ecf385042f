//! Why the consumer could not run or could not go on.

use idem_core::StoreError;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::ErrorKind;

/// Why [`RabbitConsumer::run`](crate::RabbitConsumer::run) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RabbitConsumerError {
    /// The configuration is refused (before anything is sent): retrying
    /// does not help.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
    /// The broker refused to let the consumer consume, for a reason that
    /// connecting again does not fix (the queue does not exist, access
    /// refused, the queue is exclusive to another connection). A lost or
    /// refused connection is not this: `run` connects again.
    #[error("the broker refused to consume: {0}")]
    Refused(lapin::Error),
    /// The executor's configuration is refused (a zero lease or
    /// retention): nothing could succeed.
    #[error("the store or executor refused the configuration: {0}")]
    Store(#[from] StoreError),
}

/// Whether `e`, from setting the consumer up, is the broker refusing for
/// good (a channel-level NOT_FOUND, ACCESS_REFUSED, RESOURCE_LOCKED or
/// PRECONDITION_FAILED), not a connection that went away.
pub(crate) fn is_refusal(e: &lapin::Error) -> bool {
    match e.kind() {
        ErrorKind::ProtocolError(amqp) => matches!(
            amqp.kind(),
            AMQPErrorKind::Soft(
                AMQPSoftError::NOTFOUND
                    | AMQPSoftError::ACCESSREFUSED
                    | AMQPSoftError::RESOURCELOCKED
                    | AMQPSoftError::PRECONDITIONFAILED
            )
        ),
        _ => false,
    }
}
