//! The errors: a failed NATS call ([`NatsError`]), and why the consumer
//! could not run or could not go on ([`NatsConsumerError`]).

use std::fmt;

use idem_core::StoreError;

/// A failed NATS or JetStream call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsError {
    operation: &'static str,
    transient: bool,
    message: String,
}

impl NatsError {
    /// The call that failed (`get stream`, `create consumer`, `pull`, ...).
    pub fn operation(&self) -> &str {
        self.operation
    }

    /// Whether the same call may succeed later: a timeout, a connection
    /// that is down, a JetStream that is restarting. A stream that does
    /// not exist, or a consumer configuration JetStream refuses, is not.
    pub fn is_transient(&self) -> bool {
        self.transient
    }

    pub(crate) fn new(operation: &'static str, transient: bool, e: impl fmt::Display) -> Self {
        NatsError {
            operation,
            transient,
            message: e.to_string(),
        }
    }
}

impl fmt::Display for NatsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NATS {} failed: {}", self.operation, self.message)
    }
}

impl std::error::Error for NatsError {}

/// Why the consumer could not run or could not go on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NatsConsumerError {
    /// JetStream refused the stream or the consumer for a reason that
    /// waiting does not fix (the stream does not exist, the consumer's
    /// configuration is refused). Transient failures are logged and
    /// retried with a backoff instead.
    #[error(transparent)]
    Nats(#[from] NatsError),
    /// The idempotency store or the executor's configuration refused
    /// every call: nothing could succeed.
    #[error("idempotency store: {0}")]
    Store(#[from] StoreError),
    /// A setting is wrong (an empty stream or consumer name, a
    /// dead-letter subject the consumer reads itself, a scope that is not
    /// valid).
    #[error("configuration: {0}")]
    Config(String),
}
