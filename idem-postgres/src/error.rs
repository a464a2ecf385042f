//! Errors: the crate's own error types, how a sqlx error becomes a
//! [`StoreError`] (retryable `Unavailable` or not), and how a statement's
//! failure is judged (is the session gone, may the call be sent again?).

use std::time::Duration;

use idem_core::StoreError;
use sqlx::postgres::{PgDatabaseError, PgSeverity};

#[cfg(doc)]
use crate::store::PgStore;

/// A configuration error: an identifier PostgreSQL would not take as is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Schema and table names must be 1 to 40 characters of `[a-z0-9_]`,
    /// not starting with a digit (40, so the index name fits in 63).
    #[error("invalid {what} name {name:?}: use 1 to 40 characters of [a-z0-9_], not starting with a digit")]
    InvalidIdentifier {
        /// `"schema"` or `"table"`.
        what: &'static str,
        /// The name given.
        name: String,
    },
}

/// The records table does not exist: run [`PgStore::migrate`] first. Comes
/// as the source of [`StoreError::Backend`].
#[derive(Debug, thiserror::Error)]
#[error(
    "table {table} does not exist: run PgStore::migrate() (or apply PgStore::migrations()) first"
)]
pub struct MissingTable {
    /// The schema-qualified table name.
    pub table: String,
    #[source]
    source: sqlx::Error,
}

/// A call that did not finish within the store's `call_timeout`. Comes as
/// the source of [`StoreError::Unavailable`].
#[derive(Debug, thiserror::Error)]
#[error("PostgreSQL did not answer within {0:?}")]
pub struct CallTimeout(pub Duration);

/// A call that got no connection in time to send its statement (all of
/// the store's connections busy, or PostgreSQL not accepting connections):
/// nothing was sent. Comes as the source of [`StoreError::Unavailable`].
#[derive(Debug, thiserror::Error)]
#[error("no connection to PostgreSQL within {0:?}; nothing was sent")]
pub struct NoConnection(pub Duration);

/// A connection or a call refused by a TLS setting: the source of
/// [`StoreError::Backend`], its message the cause in words.
#[derive(Debug, thiserror::Error)]
#[error("{cause}")]
pub struct TlsRefused {
    cause: String,
    #[source]
    source: sqlx::Error,
}

pub(crate) fn map_error(e: sqlx::Error, table: &str) -> StoreError {
    if let Some(cause) = tls_refusal(&e) {
        return StoreError::Backend(Box::new(TlsRefused { cause, source: e }));
    }
    match &e {
        e2 if map_error_kind(e2) => StoreError::Unavailable(Box::new(e)),
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            if retryable_code(&code) {
                StoreError::Unavailable(Box::new(e))
            } else if code == "42P01" {
                StoreError::Backend(Box::new(MissingTable {
                    table: table.to_owned(),
                    source: e,
                }))
            } else {
                StoreError::Backend(Box::new(e))
            }
        }
        _ => StoreError::Backend(Box::new(e)),
    }
}

/// Whether the error is a connection-level failure, retryable
/// (`Unavailable`) whatever the statement was.
pub(crate) fn map_error_kind(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
    )
}

/// Whether a server error of this SQLSTATE is resolved by trying again:
/// 08 connection exceptions; 57P01-03 server shutting down or starting;
/// 57P05 idle session timeout; 57014 statement timeout or cancelled; 55P03
/// lock timeout; 53300 too many connections; 40001/40P01 a serialization
/// failure or deadlock; 25006 a write refused by a read-only server (a
/// standby: after a failover, the next connection goes to the primary).
pub(crate) fn retryable_code(code: &str) -> bool {
    code.starts_with("08")
        || matches!(
            code,
            "57P01"
                | "57P02"
                | "57P03"
                | "57P05"
                | "57014"
                | "55P03"
                | "53300"
                | "40001"
                | "40P01"
                | "25006"
        )
}

/// A TLS failure that only a change of settings cures (a certificate not
/// trusted or not naming the host, a server that refuses TLS or our
/// certificate, TLS asked of a build without it), in words: every retry
/// would fail alike, so it is [`StoreError::Backend`], never
/// `Unavailable`.
pub(crate) fn tls_refusal(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Tls(tls) => {
            #[cfg(feature = "tls")]
            if let Some(tls) = tls.downcast_ref::<rustls::Error>() {
                return Some(describe_tls(tls));
            }
            Some(format!("TLS: {tls}"))
        }
        #[cfg(feature = "tls")]
        sqlx::Error::Io(io) => io
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            .filter(|tls| {
                matches!(
                    tls,
                    rustls::Error::InvalidCertificate(_)
                        | rustls::Error::NoCertificatesPresented
                        | rustls::Error::UnsupportedNameType
                        | rustls::Error::PeerIncompatible(_)
                        | rustls::Error::AlertReceived(_)
                        | rustls::Error::InvalidMessage(_)
                        | rustls::Error::InappropriateMessage { .. }
                        | rustls::Error::InappropriateHandshakeMessage { .. }
                        | rustls::Error::InvalidCertRevocationList(_)
                )
            })
            .map(describe_tls),
        _ => None,
    }
}

#[cfg(feature = "tls")]
fn describe_tls(e: &rustls::Error) -> String {
    match e {
        rustls::Error::InvalidCertificate(cause) => format!(
            "TLS: the server's certificate is not trusted ({cause:?}): give the CA that signed it (sslrootcert= in the URL) and a certificate naming the host (sslmode=verify-full)"
        ),
        rustls::Error::AlertReceived(alert) => format!(
            "TLS: the server refused the handshake ({alert:?}; a client certificate it wants, or one it does not trust?)"
        ),
        other => format!("TLS: {other}"),
    }
}

/// Why a statement failed: the server or the connection (decides whether
/// the connection is kept, or the call runs again), or the store's own
/// verdict on an answer (`LeaseLost`, `Corrupt`, ...).
#[derive(Debug)]
pub(crate) enum Failure {
    Sql(sqlx::Error),
    Store(StoreError),
}

impl From<sqlx::Error> for Failure {
    fn from(e: sqlx::Error) -> Self {
        Failure::Sql(e)
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        Failure::Store(e)
    }
}

/// Whether `e` says the session itself is gone: the server ended it
/// (57P01 admin shutdown, 57P02 crash, 57P05 idle session timeout, 08xxx,
/// any FATAL) or the socket failed. On a connection that sat idle in the
/// store this means the server closed it before the statement arrived
/// (or, if it ended the session while the statement ran, rolled the
/// statement back); either way sending the statement again is safe.
pub(crate) fn session_gone(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            code.starts_with("08")
                || matches!(&*code, "57P01" | "57P02" | "57P05")
                || db.try_downcast_ref::<PgDatabaseError>().is_some_and(|pg| {
                    matches!(pg.severity(), PgSeverity::Fatal | PgSeverity::Panic)
                })
        }
        _ => false,
    }
}

/// Whether the server refused the statement as read-only (25006): a
/// standby, or a primary demoted since the connection was opened. Nothing
/// was written; the connection is dropped (it stays on that server) and
/// the call may be sent again on a fresh one.
pub(crate) fn read_only(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("25006"))
}

/// Whether `e` is an ERROR the server raised for the statement (it rolled
/// the statement back and the session goes on): the connection is kept.
pub(crate) fn statement_failed(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db)
        if db.try_downcast_ref::<PgDatabaseError>()
            .is_some_and(|pg| matches!(pg.severity(), PgSeverity::Error)))
}
