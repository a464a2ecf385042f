//! Errors of every layer: keys, codecs, stores and the executor.
//!
//! Each error says whether retrying the same call can help
//! (`is_retryable`), so a consumer knows whether to nack for redelivery or
//! to park the message.

use std::fmt;
use std::time::Duration;

use crate::key::IdempotencyKey;
use crate::record::Lease;

/// A boxed error source, kept so that the cause chain is not lost.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An invalid idempotency key. Never retryable: the same input fails again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The scope is empty.
    #[error("invalid idempotency key: the scope is empty")]
    EmptyScope,
    /// The scope is longer than 64 bytes.
    #[error("invalid idempotency key: the scope is {len} bytes, the limit is 64")]
    ScopeTooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The scope holds a character outside `[A-Za-z0-9._:-]`.
    #[error("invalid idempotency key: scope character {ch:?} at byte {index} is not one of [A-Za-z0-9._:-]")]
    InvalidScopeChar {
        /// Byte offset of the character.
        index: usize,
        /// The character.
        ch: char,
    },
    /// The id is empty.
    #[error("invalid idempotency key: the id is empty")]
    EmptyId,
    /// The id is longer than 512 bytes.
    #[error("invalid idempotency key: the id is {len} bytes, the limit is 512")]
    IdTooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The id holds a control character.
    #[error("invalid idempotency key: control character in the id at byte {index}")]
    ControlCharInId {
        /// Byte offset of the character.
        index: usize,
    },
    /// The id was given as bytes that are not UTF-8.
    #[error("invalid idempotency key: the id is not UTF-8 (valid up to byte {valid_up_to})")]
    IdNotUtf8 {
        /// Length of the valid UTF-8 prefix.
        valid_up_to: usize,
    },
    /// `windowed` was given a zero-length window.
    #[error("invalid idempotency key: the time window is zero")]
    ZeroWindow,
    /// `from_content` could not serialize the content.
    #[error("invalid idempotency key: the content does not serialize to JSON: {0}")]
    Content(String),
}

impl KeyError {
    /// Always `false`: the same input gives the same error.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

/// A value that could not be encoded or a stored response that could not be
/// decoded. Not retryable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The handler's response (or the payload, for its fingerprint) did not
    /// serialize.
    #[error("could not encode: {0}")]
    Encode(#[source] BoxError),
    /// The recorded response did not decode as the requested type.
    #[error("could not decode the recorded response: {0}")]
    Decode(#[source] BoxError),
}

impl CodecError {
    /// Always `false`.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

/// An error of an [`IdempotencyStore`](crate::IdempotencyStore) operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The lease token no longer owns the key: another worker took it over
    /// after the lease ran out, or the record was completed, released,
    /// deleted or expired. Nothing was changed. Not retryable.
    #[error("lease lost: the key is no longer held by this lease token")]
    LeaseLost,
    /// The store could not be reached or did not answer in time. Retryable.
    #[error("idempotency store unavailable: {0}")]
    Unavailable(#[source] BoxError),
    /// A stored record does not decode. It is reported, never treated as
    /// absent (that could run a side effect twice). Not retryable until an
    /// operator deletes or repairs the record.
    #[error("corrupt idempotency record for {key}: {detail}")]
    Corrupt {
        /// The key whose record is corrupt.
        key: IdempotencyKey,
        /// What is wrong with it.
        detail: String,
    },
    /// A bounded store is full of live records; nothing was evicted.
    /// Retryable once records complete and expire.
    #[error("idempotency store is full ({max_records} records); no live record is evicted")]
    CapacityExceeded {
        /// The configured limit.
        max_records: usize,
    },
    /// The response is larger than the store accepts. Not retryable. The
    /// store refuses it before writing anything; the executor then releases
    /// the key (the handler ran: its effects are not undone).
    #[error("response of {size} bytes is larger than the store's limit of {limit} bytes")]
    ResponseTooLarge {
        /// The response's size in bytes.
        size: usize,
        /// The store's limit in bytes.
        limit: usize,
    },
    /// An argument the store refuses before writing anything (a zero
    /// lease, which would let a duplicate take over at once). Not
    /// retryable.
    #[error("invalid argument: {detail}")]
    InvalidArgument {
        /// What is wrong.
        detail: String,
    },
    /// Any other backend failure (a query error, a script error). Not
    /// retryable as such.
    #[error("idempotency store error: {0}")]
    Backend(#[source] BoxError),
}

impl StoreError {
    /// Wraps a connection or timeout failure.
    pub fn unavailable(err: impl Into<BoxError>) -> Self {
        StoreError::Unavailable(err.into())
    }

    /// The error every store gives for a zero lease.
    pub fn zero_lease() -> Self {
        StoreError::InvalidArgument {
            detail:
                "a zero lease is over when granted: a duplicate would take the key over at once"
                    .to_owned(),
        }
    }

    /// Wraps any other backend failure.
    pub fn backend(err: impl Into<BoxError>) -> Self {
        StoreError::Backend(err.into())
    }

    /// Whether retrying the same call later can succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            StoreError::Unavailable(_) | StoreError::CapacityExceeded { .. }
        )
    }

    /// The same error for another item of a batch that it failed as a
    /// whole: the same variant, so the same retryability, with the source
    /// (which cannot be cloned) carried as its text.
    pub fn replicate(&self) -> StoreError {
        match self {
            StoreError::LeaseLost => StoreError::LeaseLost,
            StoreError::Unavailable(e) => StoreError::Unavailable(Box::new(Replicated::of(e))),
            StoreError::Corrupt { key, detail } => StoreError::Corrupt {
                key: key.clone(),
                detail: detail.clone(),
            },
            StoreError::CapacityExceeded { max_records } => StoreError::CapacityExceeded {
                max_records: *max_records,
            },
            StoreError::ResponseTooLarge { size, limit } => StoreError::ResponseTooLarge {
                size: *size,
                limit: *limit,
            },
            StoreError::InvalidArgument { detail } => StoreError::InvalidArgument {
                detail: detail.clone(),
            },
            StoreError::Backend(e) => StoreError::Backend(Box::new(Replicated::of(e))),
        }
    }
}

/// The source of a [`StoreError::replicate`]d error: the original's text,
/// with its causes.
#[derive(Debug)]
struct Replicated(String);

impl Replicated {
    fn of(e: &BoxError) -> Self {
        let mut text = e.to_string();
        let mut cause = e.source();
        while let Some(c) = cause {
            text.push_str(": ");
            text.push_str(&c.to_string());
            cause = c.source();
        }
        Replicated(text)
    }
}

impl fmt::Display for Replicated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Replicated {}

/// The error of [`Idempotency::process`](crate::Idempotency::process), generic
/// over the handler's own error `E`.
#[non_exhaustive]
pub enum IdemError<E> {
    /// Another worker holds the key and its lease is live (policy
    /// `Reject`). Retryable after `retry_after`.
    InProgress {
        /// Time until the holder's lease runs out (by the store's clock).
        retry_after: Duration,
        /// The holder's attempt number.
        attempt: u32,
    },
    /// The key was used before with a different payload. Not retryable.
    PayloadMismatch,
    /// The handler returned an error; the key was released, so a retry runs
    /// the handler again.
    Handler(E),
    /// The handler panicked; the key was released, so a retry runs the
    /// handler again. (A panic in the response's `Serialize` is not this:
    /// the handler's effects ran, so the key completes as not replayable.)
    /// One exception: a detached handler whose task was cancelled (the
    /// runtime shutting down) was cut off after an unknown part of its
    /// effects, so its key is **not** released: a retry waits for the lease
    /// to end, then takes the key over (the message says "cancelled").
    Panicked {
        /// The panic message, when it was a string.
        message: String,
    },
    /// The handler ran, but its lease had been taken over by another worker
    /// before the completion was written, so its result was not recorded.
    /// Its side effects may have happened; the caller must know. Not
    /// retryable (the key now belongs to the other worker).
    LeaseLost,
    /// Policy `Wait`: the key was still in progress after `max_wait`.
    /// Retryable.
    WaitTimeout {
        /// How long the executor waited.
        waited: Duration,
    },
    /// The payload did not serialize for its fingerprint (nothing was
    /// stored), or a recorded response did not decode as the requested type
    /// (the record is kept). Not retryable.
    Codec(CodecError),
    /// The key completed, but its handler's result could not be recorded
    /// (it did not encode, the codec refused it, the store refused its
    /// size, the HTTP response was streamed): the handler ran and will not
    /// run again for this key, and there is nothing to replay. Not
    /// retryable.
    ResultUnavailable {
        /// Why the result was not recorded.
        reason: String,
    },
    /// The executor's configuration is refused (a zero lease or retention).
    /// Nothing was stored. Not retryable.
    InvalidConfig {
        /// What is wrong.
        detail: String,
    },
    /// The store failed; see [`StoreError::is_retryable`].
    Store(StoreError),
    /// The key was invalid. Not retryable.
    InvalidKey(KeyError),
    /// The handler ran and returned `Ok`, but its result could not be
    /// recorded before the lease ended (the store was unavailable): the
    /// key is still held by this call's lease, in progress. **Do not run
    /// the message again** (after the lease another delivery would take
    /// the key over and run the handler a second time): finish it with
    /// [`Idempotency::finish`](crate::Idempotency::finish), which writes
    /// the same completion with this lease's token, until it returns
    /// `Ok` (recorded) or [`StoreError::LeaseLost`] (another worker took
    /// the key over after the lease ended). Not retryable in the sense of
    /// [`is_retryable`](Self::is_retryable): retrying the message is what
    /// must not happen.
    Unrecorded(Box<Unrecorded>),
}

/// What [`IdemError::Unrecorded`] hands back: the lease of a handler that
/// ran and the bytes of its completion (its encoded result, or the "not
/// replayable" marker), to write with
/// [`Idempotency::finish`](crate::Idempotency::finish) once the store is
/// back.
pub struct Unrecorded {
    pub(crate) lease: Lease,
    pub(crate) response: Vec<u8>,
    pub(crate) cause: StoreError,
}

impl Unrecorded {
    /// The lease that still holds the key.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The completion to write: the handler's result as the codec encoded
    /// it (decode it with the executor's codec), or the "not replayable"
    /// marker when the result could not be recorded.
    pub fn response(&self) -> &[u8] {
        &self.response
    }

    /// The last store error of the completion.
    pub fn cause(&self) -> &StoreError {
        &self.cause
    }
}

impl fmt::Debug for Unrecorded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Unrecorded")
            .field("key", &self.lease.key)
            .field("attempt", &self.lease.attempt)
            .field("fence", &self.lease.fence)
            .field("response_len", &self.response.len())
            .field("cause", &self.cause)
            .finish()
    }
}

impl<E> IdemError<E> {
    /// Whether retrying the same message later can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            IdemError::InProgress { .. }
            | IdemError::Handler(_)
            | IdemError::Panicked { .. }
            | IdemError::WaitTimeout { .. } => true,
            IdemError::PayloadMismatch
            | IdemError::LeaseLost
            | IdemError::Codec(_)
            | IdemError::ResultUnavailable { .. }
            | IdemError::InvalidConfig { .. }
            | IdemError::InvalidKey(_)
            | IdemError::Unrecorded(_) => false,
            IdemError::Store(e) => e.is_retryable(),
        }
    }

    /// The handler's error, if that is what this is.
    pub fn handler_error(&self) -> Option<&E> {
        match self {
            IdemError::Handler(e) => Some(e),
            _ => None,
        }
    }
}

impl<E> From<StoreError> for IdemError<E> {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::LeaseLost => IdemError::LeaseLost,
            other => IdemError::Store(other),
        }
    }
}

impl<E> From<KeyError> for IdemError<E> {
    fn from(e: KeyError) -> Self {
        IdemError::InvalidKey(e)
    }
}

impl<E> From<CodecError> for IdemError<E> {
    fn from(e: CodecError) -> Self {
        IdemError::Codec(e)
    }
}

impl<E: fmt::Debug> fmt::Debug for IdemError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdemError::InProgress {
                retry_after,
                attempt,
            } => f
                .debug_struct("InProgress")
                .field("retry_after", retry_after)
                .field("attempt", attempt)
                .finish(),
            IdemError::PayloadMismatch => f.write_str("PayloadMismatch"),
            IdemError::Handler(e) => f.debug_tuple("Handler").field(e).finish(),
            IdemError::Panicked { message } => f
                .debug_struct("Panicked")
                .field("message", message)
                .finish(),
            IdemError::LeaseLost => f.write_str("LeaseLost"),
            IdemError::WaitTimeout { waited } => f
                .debug_struct("WaitTimeout")
                .field("waited", waited)
                .finish(),
            IdemError::Codec(e) => f.debug_tuple("Codec").field(e).finish(),
            IdemError::ResultUnavailable { reason } => f
                .debug_struct("ResultUnavailable")
                .field("reason", reason)
                .finish(),
            IdemError::InvalidConfig { detail } => f
                .debug_struct("InvalidConfig")
                .field("detail", detail)
                .finish(),
            IdemError::Store(e) => f.debug_tuple("Store").field(e).finish(),
            IdemError::InvalidKey(e) => f.debug_tuple("InvalidKey").field(e).finish(),
            IdemError::Unrecorded(u) => f.debug_tuple("Unrecorded").field(u).finish(),
        }
    }
}

impl<E: fmt::Display> fmt::Display for IdemError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdemError::InProgress {
                retry_after,
                attempt,
            } => write!(
                f,
                "already in progress (attempt {attempt}); retry after {retry_after:?}"
            ),
            IdemError::PayloadMismatch => {
                f.write_str("idempotency key reused with a different payload")
            }
            IdemError::Handler(e) => write!(f, "handler failed: {e}"),
            IdemError::Panicked { message } => write!(f, "handler panicked: {message}"),
            IdemError::LeaseLost => f.write_str(
                "lease lost: the handler ran but another worker took the key over, its result was not recorded",
            ),
            IdemError::WaitTimeout { waited } => {
                write!(f, "still in progress after waiting {waited:?}")
            }
            IdemError::Codec(e) => e.fmt(f),
            IdemError::ResultUnavailable { reason } => write!(
                f,
                "the key completed but its result was not recorded ({reason}); the handler will not run again"
            ),
            IdemError::InvalidConfig { detail } => write!(f, "invalid idempotency configuration: {detail}"),
            IdemError::Store(e) => e.fmt(f),
            IdemError::InvalidKey(e) => e.fmt(f),
            IdemError::Unrecorded(u) => write!(
                f,
                "the handler ran but its result is not recorded yet (the store failed: {}); finish it with its lease, do not run it again",
                u.cause
            ),
        }
    }
}

impl<E> std::error::Error for IdemError<E>
where
    E: std::error::Error + 'static,
{
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            IdemError::Handler(e) => Some(e),
            IdemError::Codec(e) => Some(e),
            IdemError::Store(e) => Some(e),
            IdemError::InvalidKey(e) => Some(e),
            IdemError::Unrecorded(u) => Some(&u.cause),
            _ => None,
        }
    }
}
