//! Errors: the crate's error sources, and how a Redis error becomes a
//! [`StoreError`] (retryable or not, a setting refused, an argument
//! refused by a script).

use std::time::Duration;

use idem_core::{IdempotencyKey, StoreError};
use redis::{ErrorKind, RedisError, ServerErrorKind};

#[cfg(feature = "tls")]
use crate::tls;

/// A call that did not finish within the store's call timeout; the source
/// of [`StoreError::Unavailable`].
///
/// ```
/// use idem_core::StoreError;
/// use idem_redis::CallTimeout;
///
/// fn waited_too_long(e: &StoreError) -> bool {
///     matches!(e, StoreError::Unavailable(source) if source.downcast_ref::<CallTimeout>().is_some())
/// }
/// # let e = StoreError::Unavailable(Box::new(CallTimeout(std::time::Duration::from_millis(500))));
/// # assert!(waited_too_long(&e) && e.is_retryable());
/// ```
#[derive(Debug, thiserror::Error)]
#[error("Redis did not answer within {0:?}")]
pub struct CallTimeout(pub Duration);

/// A reply of a shape the scripts never produce (a different script loaded
/// under the same SHA, a proxy in the way); the source of
/// [`StoreError::Backend`].
///
/// ```
/// use idem_core::StoreError;
/// use idem_redis::UnexpectedReply;
///
/// fn is_unexpected_reply(e: &StoreError) -> bool {
///     matches!(e, StoreError::Backend(source) if source.downcast_ref::<UnexpectedReply>().is_some())
/// }
/// # assert!(!is_unexpected_reply(&StoreError::LeaseLost));
/// ```
#[derive(Debug, thiserror::Error)]
#[error("unexpected reply from Redis: {0}")]
pub struct UnexpectedReply(pub(crate) String);

/// The code of the scripts' error reply for an argument they refuse.
const INVALID_CODE: &str = "IDEM_INVALID";

/// The code of Redis's refusal of a write for want of good replicas
/// (`min-replicas-to-write`).
const NO_REPLICAS_CODE: &str = "NOREPLICAS";

/// The code of a write refused because the server is at `maxmemory`
/// (with `noeviction`).
const OUT_OF_MEMORY_CODE: &str = "OOM";

pub(crate) fn map_error(e: RedisError) -> StoreError {
    if e.code() == Some(INVALID_CODE) {
        // A script refused an argument before writing anything.
        return StoreError::InvalidArgument {
            detail: e.detail().unwrap_or("refused by the script").to_owned(),
        };
    }
    if let Some(cause) = refused_setting(&e) {
        // Wrong credentials, an ACL that refuses a command or a key, a
        // certificate not trusted: every retry fails alike.
        return StoreError::Backend(Box::new(Refused { cause, source: e }));
    }
    if is_transient(&e) {
        StoreError::Unavailable(Box::new(e))
    } else {
        StoreError::Backend(Box::new(e))
    }
}

/// Whether trying again later can succeed: a connection refused, dropped
/// or timed out, a cluster redirection or reconfiguration, or a master
/// under `min-replicas-to-write` without enough good replicas (one just
/// promoted, a replica away), which refuses writes until one is back: a
/// passing condition, like `WAIT` falling short.
pub(crate) fn is_transient(e: &RedisError) -> bool {
    use redis::RetryMethod;
    // A pipeline's errors come together, without a code of their own:
    // passing if every one of them is. The one pipeline of the store
    // writes a marker before a `WAIT` (a replay under `wait_for_replicas`):
    // refused with NOREPLICAS, or with OOM on a full server, the record
    // is there and a retry gets its replay once the replicas are back or
    // memory is freed (records expire).
    if e.code().is_none() {
        if let Some(errors) = e.clone().into_server_errors() {
            if !errors.is_empty() {
                return errors.iter().all(|(_, server)| {
                    server.code() == NO_REPLICAS_CODE
                        || server.code() == OUT_OF_MEMORY_CODE
                        || is_transient(&RedisError::from(server.clone()))
                });
            }
        }
    }
    e.code() == Some(NO_REPLICAS_CODE)
        || e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || matches!(
            e.retry_method(),
            RetryMethod::Reconnect
                | RetryMethod::RetryImmediately
                | RetryMethod::WaitAndRetry
                | RetryMethod::ReconnectFromInitialConnections
                | RetryMethod::RefreshSlotsAndRetry
        )
}

/// A call or a connection refused because of a setting (credentials, ACL,
/// TLS): the source of [`StoreError::Backend`], its message the cause in
/// words.
///
/// ```
/// use idem_core::StoreError;
/// use idem_redis::Refused;
///
/// fn misconfigured(e: &StoreError) -> bool {
///     matches!(e, StoreError::Backend(source) if source.downcast_ref::<Refused>().is_some())
/// }
/// # assert!(!misconfigured(&StoreError::LeaseLost));
/// ```
#[derive(Debug, thiserror::Error)]
#[error("{cause}")]
pub struct Refused {
    pub(crate) cause: String,
    #[source]
    pub(crate) source: RedisError,
}

impl Refused {
    /// The cause, in words: `authentication failed: ...`, `permission
    /// denied by the ACL: ...`, `TLS: ...`.
    pub fn cause(&self) -> &str {
        &self.cause
    }
}

/// The cause, if `e` is a refusal that only a change of settings cures.
pub(crate) fn refused_setting(e: &RedisError) -> Option<String> {
    #[cfg(feature = "tls")]
    if let Some(tls) = tls::tls_error(e) {
        if tls::is_setting(tls) {
            return Some(tls::describe(tls));
        }
    }
    if e.kind() == ErrorKind::AuthenticationFailed {
        return Some(format!(
            "authentication failed: wrong password or user name, or the user is disabled (give them in the URL: redis[s]://user:password@host:port/) [{e}]"
        ));
    }
    // A command refused to a script (Redis 7.0 answers ERR, not NOPERM).
    let acl_in_script = e.code() != Some("NOPERM")
        && e.detail()
            .is_some_and(|d| d.contains("user executing the script can't run"));
    if acl_in_script {
        return Some(format!(
            "permission denied by the ACL: a command the store's scripts run is not allowed to this user (the idem-redis docs list the ACL the store needs) [{e}]"
        ));
    }
    match e.code() {
        Some("NOAUTH") => Some(format!(
            "authentication required: the server has a password (requirepass or an ACL user) and the URL gives none [{e}]"
        )),
        Some("WRONGPASS") => Some(format!(
            "authentication failed: wrong password or user name [{e}]"
        )),
        Some("NOPERM") => Some(format!(
            "permission denied by the ACL: the user may not run this command or touch this key (the idem-redis docs list the ACL the store needs) [{e}]"
        )),
        _ => None,
    }
}

/// Whether Redis (or the cluster client) refused a call whose keys span
/// hash slots: refused before anything ran.
pub(crate) fn is_cross_slot(e: &StoreError) -> bool {
    match e {
        StoreError::Backend(e) | StoreError::Unavailable(e) => e
            .downcast_ref::<RedisError>()
            .is_some_and(|r| r.kind() == ErrorKind::Server(ServerErrorKind::CrossSlot)),
        _ => false,
    }
}

pub(crate) fn is_wrong_type(e: &(dyn std::error::Error + Send + Sync + 'static)) -> bool {
    e.downcast_ref::<RedisError>()
        .is_some_and(|r| r.code() == Some("WRONGTYPE"))
}

pub(crate) fn corrupt(key: &IdempotencyKey, detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        key: key.clone(),
        detail: detail.into(),
    }
}

pub(crate) fn unexpected(detail: String) -> StoreError {
    StoreError::Backend(Box::new(UnexpectedReply(detail)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_script_arguments_are_invalid_argument() {
        let e = redis::make_extension_error(
            INVALID_CODE.to_owned(),
            Some("lease must be ...".to_owned()),
        );
        match map_error(e) {
            StoreError::InvalidArgument { detail } => assert_eq!(detail, "lease must be ..."),
            other => panic!("{other:?}"),
        }
        let other = redis::make_extension_error("OTHER".to_owned(), None);
        assert!(matches!(map_error(other), StoreError::Backend(_)));
    }
}
