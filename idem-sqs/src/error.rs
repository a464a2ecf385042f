//! The errors: a failed SQS call ([`SqsError`]), and why the consumer
//! could not run or could not go on ([`SqsConsumerError`]).

use std::fmt;
use std::time::Duration;

use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use idem_core::StoreError;

/// A failed SQS call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqsError {
    operation: &'static str,
    code: Option<String>,
    transient: bool,
    message: String,
}

impl SqsError {
    /// The SQS operation that failed (`ReceiveMessage`, ...).
    pub fn operation(&self) -> &str {
        self.operation
    }

    /// The error code SQS answered with (`AWS.SimpleQueueService.NonExistentQueue`,
    /// `QueueDoesNotExist`, ...), if it answered.
    pub fn code(&self) -> Option<&str> {
        self.code.as_deref()
    }

    /// Whether the same call may succeed later: a timeout, a connection
    /// that failed, throttling, a server error (5xx).
    pub fn is_transient(&self) -> bool {
        self.transient
    }

    pub(crate) fn timeout(operation: &'static str, limit: Duration) -> Self {
        SqsError {
            operation,
            code: None,
            transient: true,
            message: format!("no answer within {limit:?}"),
        }
    }

    pub(crate) fn of<E>(operation: &'static str, e: SdkError<E>) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
    {
        let code = e
            .as_service_error()
            .and_then(|s| s.code())
            .map(str::to_owned);
        let transient = match &e {
            SdkError::ServiceError(s) => {
                let status = s.raw().status();
                status.is_server_error()
                    || status.as_u16() == 429
                    || code.as_deref().is_some_and(|c| {
                        c.contains("Throttl")
                            || c.contains("ServiceUnavailable")
                            || c == "InternalError"
                            || c == "InternalFailure"
                            || c == "RequestTimeout"
                    })
            }
            SdkError::ConstructionFailure(_) => false,
            // Timeouts, connections that failed, replies that did not parse.
            _ => true,
        };
        // A service error's own message; the whole chain of anything else
        // (a connection refused, a timeout).
        let message = match e.as_service_error() {
            Some(s) => s.message().unwrap_or("(no message)").to_owned(),
            None => DisplayErrorContext(&e).to_string(),
        };
        SqsError {
            operation,
            code,
            transient,
            message,
        }
    }
}

impl fmt::Display for SqsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SQS {} failed", self.operation)?;
        if let Some(code) = &self.code {
            write!(f, " ({code})")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for SqsError {}

/// Why the consumer could not run or could not go on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SqsConsumerError {
    /// SQS refused to receive from the queue for a reason that waiting
    /// does not fix (the queue does not exist, access denied). Transient
    /// failures are logged and retried with a backoff instead.
    #[error(transparent)]
    Sqs(#[from] SqsError),
    /// The idempotency store or the executor's configuration refused
    /// every call: nothing could succeed.
    #[error("idempotency store: {0}")]
    Store(#[from] StoreError),
    /// A setting is wrong (an empty queue URL, a dead-letter queue that is
    /// the queue itself, a scope that is not valid).
    #[error("configuration: {0}")]
    Config(String),
}
