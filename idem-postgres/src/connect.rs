//! Opening a pool: [`connect`] and [`connect_with`] make one connection
//! first and say at once why it failed, in words, retryable or not.

use idem_core::StoreError;
use sqlx::postgres::PgPool;

use crate::error::{map_error_kind, retryable_code, tls_refusal};

/// Opens a pool on `url` and fails fast with the cause when it cannot.
///
/// `PgPoolOptions::connect` retries a refused connection until its acquire
/// timeout (30 s by default) and then reports only `PoolTimedOut`; this
/// makes one connection first and returns what went wrong at once:
///
/// | cause | error | retryable |
/// |---|---|---|
/// | connection refused, host unreachable, no answer within the pool's acquire timeout | [`StoreError::Unavailable`] | yes |
/// | authentication failed, unknown role, unknown database, TLS refused or not built in | [`StoreError::Backend`] | no |
/// | a server certificate not signed by `sslrootcert` or not naming the host, `sslmode=disable` to a server whose pg_hba.conf has `hostssl` lines only | [`StoreError::Backend`] | no |
///
/// TLS (feature `tls`, on rustls) is asked in the URL:
/// `postgres://idem:secret@db.internal/app?sslmode=verify-full&sslrootcert=/etc/idem/pg-ca.pem`.
/// | a URL that does not parse | [`StoreError::InvalidArgument`] | no |
///
/// The message names the host, port, user and database, never the
/// password. Then the pool is opened as `PgPoolOptions::connect` would.
///
/// ```no_run
/// # async fn run() -> Result<(), idem_core::StoreError> {
/// let pool = idem_postgres::connect("postgres://app@127.0.0.1/app").await?;
/// let store = idem_postgres::PgStore::new(pool);
/// # Ok(()) }
/// ```
pub async fn connect(url: &str) -> Result<PgPool, StoreError> {
    connect_with(sqlx::postgres::PgPoolOptions::new(), url).await
}

/// [`connect`] with your pool options (its acquire timeout bounds the
/// first connection too).
pub async fn connect_with(
    options: sqlx::postgres::PgPoolOptions,
    url: &str,
) -> Result<PgPool, StoreError> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(StoreError::InvalidArgument {
            detail: "a PostgreSQL URL starts with postgres:// or postgresql://".to_owned(),
        });
    }
    let connect: sqlx::postgres::PgConnectOptions =
        url.parse().map_err(|e| StoreError::InvalidArgument {
            detail: format!("not a PostgreSQL URL: {e}"),
        })?;
    let target = format!(
        "PostgreSQL at {}:{} (user {:?}, database {:?})",
        connect.get_host(),
        connect.get_port(),
        connect.get_username(),
        connect.get_database().unwrap_or(connect.get_username()),
    );
    let wait = options.get_acquire_timeout();
    let probe = sqlx::ConnectOptions::connect(&connect);
    match tokio::time::timeout(wait, probe).await {
        Ok(Ok(conn)) => {
            // Best effort: the pool opens its own connections.
            let _ = sqlx::Connection::close(conn).await;
        }
        Ok(Err(e)) => return Err(connect_error(e, target)),
        Err(_) => {
            return Err(StoreError::Unavailable(Box::new(ConnectError {
                target,
                cause: format!("no answer within {wait:?}"),
                source: None,
            })))
        }
    }
    options
        .connect_with(connect)
        .await
        .map_err(|e| connect_error(e, target))
}

/// Why [`connect`] could not open a connection, with where it tried.
#[derive(Debug)]
struct ConnectError {
    target: String,
    cause: String,
    source: Option<sqlx::Error>,
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cannot connect to {}: {}", self.target, self.cause)
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_ref().map(|e| e as _)
    }
}

pub(crate) fn connect_error(e: sqlx::Error, target: String) -> StoreError {
    let (cause, retryable) = connect_failure(&e);
    let error = Box::new(ConnectError {
        target,
        cause,
        source: Some(e),
    });
    if retryable {
        StoreError::Unavailable(error)
    } else {
        StoreError::Backend(error)
    }
}

/// Why a connection could not be opened, in words, and whether a retry may
/// resolve it (a TLS setting, a refused password or database: no).
pub(crate) fn connect_failure(e: &sqlx::Error) -> (String, bool) {
    if let Some(refusal) = tls_refusal(e) {
        return (refusal, false);
    }
    match e {
        // A file named in the URL (sslrootcert, sslcert, sslkey) missing
        // or unreadable: no network error reads as that, and no retry
        // finds the file.
        sqlx::Error::Io(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
            ) =>
        {
            (
                format!(
                    "a file named in the URL (sslrootcert, sslcert, sslkey?) cannot be read: {io}"
                ),
                false,
            )
        }
        sqlx::Error::Io(io) => (
            match io.kind() {
                std::io::ErrorKind::ConnectionRefused => {
                    "connection refused (is the server running, on this port?)".to_owned()
                }
                _ => format!("{io}"),
            },
            true,
        ),
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            let what = match code.as_str() {
                // pg_hba.conf has `hostssl` lines only: a plaintext attempt.
                "28000" if db.message().contains("no encryption") => {
                    "the server takes only TLS connections here (use sslmode=verify-full, with sslrootcert=)"
                }
                "28P01" | "28000" => "authentication failed",
                "3D000" => "the database does not exist",
                _ => "the server refused the connection",
            };
            (format!("{what}: {}", db.message()), retryable_code(&code))
        }
        // A TLS failure at connect time is a setting that does not match
        // (sslmode=require on a build or a server without TLS, a
        // certificate refused): every retry fails alike.
        sqlx::Error::Tls(e) => (format!("TLS: {e}"), false),
        other => (other.to_string(), map_error_kind(other)),
    }
}
