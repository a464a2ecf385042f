//! [`PgStore`]: what it holds, and how one call runs on one of its own
//! connections (the time rule, the resend after a lost connection).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

#[cfg(doc)]
use idem_core::IdempotencyStore;
use idem_core::StoreError;
use sqlx::postgres::PgPool;
use sqlx::PgConnection;
use tokio::time::Instant;

use crate::connection::{ConnectionSet, ConnectionStats};
use crate::error::{
    map_error, read_only, session_gone, statement_failed, CallTimeout, Failure, NoConnection,
};
use crate::in_tx::InTransaction;
use crate::statements::Statements;
use crate::timeouts::Timeouts;

/// The PostgreSQL [`IdempotencyStore`]. Cloning is cheap and shares the
/// pool.
#[derive(Clone)]
pub struct PgStore {
    pub(crate) inner: Arc<Inner>,
    /// Set on the copy a batch of single calls goes through: a batch item
    /// whose key is busy is handed back to its caller
    /// ([`idem_core::batching::send_alone`]) rather than waited for, which
    /// would hold up the other callers.
    pub(crate) busy_back: bool,
}

pub(crate) struct Inner {
    pub(crate) pool: PgPool,
    pub(crate) conns: Arc<ConnectionSet>,
    pub(crate) schema: String,
    pub(crate) table: String,
    pub(crate) qualified: String,
    pub(crate) sql: Statements,
    pub(crate) timeouts: Timeouts,
    pub(crate) max_response_bytes: usize,
    pub(crate) batch_statement: usize,
    /// The batching of concurrent `acquire`s and `complete`s.
    pub(crate) batcher: idem_core::Batcher,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("table", &self.inner.qualified)
            .field("call_timeout", &self.inner.timeouts.call)
            .field("server_timeout_ms", &self.inner.timeouts.server_ms)
            .field("connections", &self.inner.conns.max)
            .finish()
    }
}

impl PgStore {
    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The schema-qualified, quoted table name.
    pub fn qualified_table(&self) -> &str {
        &self.inner.qualified
    }

    /// The batching of this store's calls: its settings, and the calls
    /// waiting now for the one in flight (see
    /// [`PgStoreBuilder::batching`](crate::PgStoreBuilder::batching)).
    pub fn batcher(&self) -> &idem_core::Batcher {
        &self.inner.batcher
    }

    /// The in-transaction mode: reserve, write and complete inside your own
    /// transaction. See [`InTransaction`].
    pub fn in_transaction(&self) -> InTransaction {
        InTransaction::new(self.clone())
    }

    /// The server-side `statement_timeout` and `lock_timeout` of the
    /// store's connections: half the call timeout (lower if a connection's
    /// own settings are lower).
    pub fn server_timeout(&self) -> Duration {
        Duration::from_millis(self.inner.timeouts.server_ms)
    }

    /// The store's own connections now: open, idle, the most it opens at
    /// once, and how many it opened so far. The same figure is the gauge
    /// `idem_postgres_connections` (label `table`) of the `metrics` crate.
    pub fn connection_stats(&self) -> ConnectionStats {
        self.inner.conns.stats()
    }

    /// Maps a sqlx error to the store's error, keeping the source.
    pub(crate) fn error(&self, e: sqlx::Error) -> StoreError {
        map_error(e, &self.inner.qualified)
    }

    pub(crate) fn fail(&self, f: Failure) -> StoreError {
        match f {
            Failure::Sql(e) => {
                // The in-transaction mode's statements run on your
                // transaction: a read-only server there sends a
                // `Failover` searching too.
                if read_only(&e) || session_gone(&e) {
                    self.inner.conns.suspect_server();
                }
                self.error(e)
            }
            Failure::Store(e) => e,
        }
    }

    /// Runs `op` on one of the store's connections within the call
    /// timeout, resending it once on a connection-level failure (see
    /// [`PgStore::run`]).
    pub(crate) async fn call<'a, T, F>(&'a self, op: F) -> Result<T, StoreError>
    where
        T: Send,
        F: for<'c> Fn(&'c mut PgConnection, Within<'c, 'a>) -> Op<'c, T> + Send + Sync,
    {
        self.run(Resend::Once, op).await
    }

    /// Runs `op` on one of the store's connections within the call
    /// timeout. A statement is sent only while enough of the call is left
    /// for the server's own timeout to fire first. If the connection fails
    /// (the server closed it while it sat idle, a restart, a terminated
    /// backend, a reply lost on the network), fresh or reused, and `resend`
    /// allows it, the call runs once more on a fresh connection, under the
    /// same rule for the time left: those statements give the same answer
    /// when sent again (see the note before the `IdempotencyStore` impl).
    /// Without a failure, one round trip.
    pub(crate) async fn run<'a, T, F>(&'a self, resend: Resend, op: F) -> Result<T, StoreError>
    where
        T: Send,
        F: for<'c> Fn(&'c mut PgConnection, Within<'c, 'a>) -> Op<'c, T> + Send + Sync,
    {
        let t = self.inner.timeouts;
        let started = Instant::now();
        let attempt = async {
            let mut fresh = false;
            loop {
                let lent =
                    tokio::time::timeout_at(started + t.send_by, self.inner.conns.lend(fresh))
                        .await;
                let mut lent = match lent {
                    Ok(Ok(lent)) => lent,
                    Ok(Err(e)) => return Err(self.error(e)),
                    Err(_) => {
                        return Err(StoreError::Unavailable(Box::new(NoConnection(t.send_by))))
                    }
                };
                let result = op(lent.connection(), std::marker::PhantomData).await;
                match result {
                    Ok(v) => {
                        lent.keep();
                        return Ok(v);
                    }
                    Err(Failure::Store(e)) => {
                        lent.keep();
                        return Err(e);
                    }
                    Err(Failure::Sql(e)) => {
                        let read_only = read_only(&e);
                        if read_only || session_gone(&e) {
                            self.inner.conns.suspect_server();
                            if lent.reused() || read_only {
                                // Every connection idle as long is suspect:
                                // after a restart they are all dead.
                                self.inner.conns.close_idle();
                            }
                            if matches!(resend, Resend::Once) && !fresh {
                                tracing::debug!(table = %self.inner.qualified, error = %e,
                                    reused = lent.reused(),
                                    "a store connection failed during a call; sending it again on a fresh one");
                                drop(lent);
                                fresh = true;
                                continue;
                            }
                        } else if statement_failed(&e) {
                            // The server rolled the statement back; the
                            // session is fine.
                            lent.keep();
                        }
                        return Err(self.error(e));
                    }
                }
            }
        };
        match tokio::time::timeout_at(started + t.call, attempt).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Unavailable(Box::new(CallTimeout(t.call)))),
        }
    }
}

/// Whether [`PgStore::run`] may send a call again after its connection
/// failed.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Resend {
    /// Once, on a fresh connection: the statement answers the same when
    /// sent twice.
    Once,
    /// Never (`delete`, which has no token): the failure is `Unavailable`.
    Never,
}

/// What a call's statement returns to [`PgStore::call`].
pub(crate) type Op<'c, T> = Pin<Box<dyn Future<Output = Result<T, Failure>> + Send + 'c>>;

/// Says that a connection borrowed for `'c` is borrowed within the call's
/// own lifetime `'a` (so a statement's future may hold the call's
/// arguments).
pub(crate) type Within<'c, 'a> = std::marker::PhantomData<&'c &'a ()>;
