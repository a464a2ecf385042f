//! Errors: how an SDK error becomes a [`StoreError`] (retryable
//! `Unavailable` or not), and the call timeout's own error.

use std::time::Duration;

use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use idem_core::StoreError;

/// A call that did not finish within the store's call timeout; the source
/// of [`StoreError::Unavailable`].
#[derive(Debug, thiserror::Error)]
#[error("DynamoDB did not answer within {0:?}")]
pub struct CallTimeout(pub Duration);

/// Maps an SDK error: timeouts, connection failures, throttling and
/// DynamoDB's own server errors are [`StoreError::Unavailable`]
/// (retryable); the rest (a missing table, a refused request) are
/// [`StoreError::Backend`].
pub(crate) fn map_sdk<E, R>(e: SdkError<E, R>) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    match &e {
        SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => {
            StoreError::unavailable(e)
        }
        SdkError::ServiceError(se) => {
            let retryable = matches!(
                se.err().code(),
                Some(
                    "InternalServerError"
                        | "ServiceUnavailable"
                        | "ProvisionedThroughputExceededException"
                        | "RequestLimitExceeded"
                        | "ThrottlingException"
                        | "TransactionConflictException"
                        | "TransactionInProgressException"
                        | "ReplicatedWriteConflictException"
                )
            );
            if retryable {
                StoreError::unavailable(e)
            } else {
                StoreError::backend(e)
            }
        }
        _ => StoreError::backend(e),
    }
}
