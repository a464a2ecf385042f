//! PostgreSQL store for [idem](https://docs.rs/idem), on sqlx.
//!
//! [`PgStore`] keeps one row per idempotency key in a table
//! (`public.idem_records` by default; schema and name configurable) with the
//! primary key `(scope, key)`, so the table can be hash-partitioned or
//! distributed by key. Every [`IdempotencyStore`] operation is one SQL
//! statement, one round trip: `acquire` inserts a fresh key, takes over a
//! key whose lease is over, or returns the stored state (completed response,
//! in-progress deadline or mismatch) in the same statement. Time is the
//! server's (`clock_timestamp()`), never the client's.
//!
//! ```no_run
//! use idem_core::{Idempotency, IdempotencyKey};
//! use idem_postgres::PgStore;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::postgres::PgPoolOptions::new()
//!     .max_connections(16)
//!     .connect("postgres://app@127.0.0.1/app")
//!     .await?;
//! let store = PgStore::new(pool);
//! store.migrate().await?; // safe from several processes at once
//! let idem = Idempotency::new(store);
//! let key = IdempotencyKey::new("orders.create", "client-key-1")?;
//! let out = idem.process(&key, 42u32, |n| async move { Ok::<_, std::io::Error>(n) }).await?;
//! # Ok(()) }
//! ```
//!
//! The **in-transaction mode** ([`PgStore::in_transaction`]) goes further:
//! the reservation, your business writes and the completion share your
//! `sqlx::Transaction`, so they commit or roll back together.
//!
//! Expired rows are invisible but stay until deleted: run
//! [`purge_periodically`](idem_core::purge_periodically) (or call
//! `purge_expired`) to delete them in bounded batches.
//!
//! **Fences** come from a sequence (`<table>_fence_seq`, created by
//! migration 2 next to the table): every acquisition, in a transaction or
//! not, takes the next value, so a key's fences strictly increase across
//! takeovers, releases, deletes and expiries, and do not depend on any
//! clock. Rows written before migration 2 have fence 0. A completed record
//! handed out by `acquire` carries its fence and the time it has left,
//! computed by the server (`expires_at - clock_timestamp()`).
//!
//! **Durations**: a zero lease (or extension) is refused with
//! [`StoreError::InvalidArgument`] before anything is sent; leases,
//! extensions and retentions are saturated to
//! [`MAX_DURATION`](idem_core::MAX_DURATION) and rounded up to whole
//! microseconds, so `Duration::MAX` means "as long as the store can hold"
//! and no deadline overflows.
#![deny(missing_docs)]

mod in_tx;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{
    saturate, Acquisition, CompletedRecord, Fingerprint, IdempotencyKey, IdempotencyStore, Lease,
    LeaseToken, Record, RecordState, StoreError, IN_PROGRESS_GRACE,
};
use sqlx::postgres::{PgConnectOptions, PgPool, PgRow};
use sqlx::Connection;
use sqlx::{AssertSqlSafe, PgConnection, Row};

pub use idem_core;
pub use in_tx::{Claim, InTransaction, TxLease};

/// The migrations, in order: `(version, description, SQL template)`. The
/// templates name the table `{{table}}`, its index `{{index}}` and its
/// fence sequence `{{sequence}}`; [`PgStore::migrations`] fills them in for
/// your configuration.
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "create records table",
        include_str!("../migrations/0001_create_records.sql"),
    ),
    (
        2,
        "add fence column and sequence",
        include_str!("../migrations/0002_add_fence.sql"),
    ),
];

/// How many times `acquire` re-runs its statement when a concurrent commit
/// was not visible to it (READ COMMITTED takes a new snapshot each time).
const ACQUIRE_TRIES: usize = 16;
/// Rows deleted per statement by `purge_expired`.
const PURGE_BATCH: usize = 1_000;

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

/// A [`PgStore`] under construction.
#[derive(Debug, Clone)]
pub struct PgStoreBuilder {
    pool: PgPool,
    schema: String,
    table: String,
    call_timeout: Duration,
    max_response_bytes: usize,
    connections: Option<usize>,
}

impl PgStoreBuilder {
    /// How many connections the store keeps for its own calls (default:
    /// the pool's `max_connections`). They are opened lazily with the pool's
    /// connect options and reused directly, without going back through the
    /// pool, which pings every connection it takes back (a second round trip
    /// per call). They are in addition to the pool's own connections.
    /// `migrate` and the in-transaction mode use the pool.
    pub fn connections(mut self, n: usize) -> Self {
        self.connections = Some(n.max(1));
        self
    }

    /// The schema of the table (default `public`); `migrate` creates it if
    /// missing.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The table name (default `idem_records`).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The longest a store call may take, waiting for a pooled connection
    /// included, before it fails with [`StoreError::Unavailable`]. Default
    /// 10 s.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// The largest response `complete` accepts (default 64 MiB); larger
    /// ones get [`StoreError::ResponseTooLarge`] before anything is sent.
    pub fn max_response_bytes(mut self, max: usize) -> Self {
        self.max_response_bytes = max;
        self
    }

    /// Validates the names and builds the store.
    pub fn build(self) -> Result<PgStore, ConfigError> {
        validate_identifier("schema", &self.schema)?;
        validate_identifier("table", &self.table)?;
        let qualified = format!("\"{}\".\"{}\"", self.schema, self.table);
        let sequence = sequence_name(&self.schema, &self.table);
        let render = |template: &str| {
            Arc::<str>::from(
                template
                    .replace("{{table}}", &qualified)
                    .replace("{{sequence}}", &sequence),
            )
        };
        let sql = Statements {
            acquire: render(include_str!("../sql/acquire.sql")),
            complete: render(include_str!("../sql/complete.sql")),
            release: render(include_str!("../sql/release.sql")),
            extend: render(include_str!("../sql/extend.sql")),
            get: render(include_str!("../sql/get.sql")),
            delete: render(include_str!("../sql/delete.sql")),
            purge: render(include_str!("../sql/purge.sql")),
        };
        let connections = self
            .connections
            .unwrap_or(self.pool.options().get_max_connections() as usize)
            .max(1);
        Ok(PgStore {
            inner: Arc::new(Inner {
                conns: ConnectionSet::new(
                    self.pool.connect_options().as_ref().clone(),
                    connections,
                ),
                pool: self.pool,
                schema: self.schema,
                table: self.table,
                qualified,
                sql,
                call_timeout: self.call_timeout,
                max_response_bytes: self.max_response_bytes,
            }),
        })
    }
}

/// The schema-qualified, quoted name of the fence sequence (the table name
/// is at most 40 characters, so this fits PostgreSQL's 63).
fn sequence_name(schema: &str, table: &str) -> String {
    format!("\"{schema}\".\"{table}_fence_seq\"")
}

fn validate_identifier(what: &'static str, name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 40
        && !name.as_bytes()[0].is_ascii_digit()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(ConfigError::InvalidIdentifier {
            what,
            name: name.to_owned(),
        })
    }
}

/// The PostgreSQL [`IdempotencyStore`]. Cloning is cheap and shares the
/// pool.
#[derive(Clone)]
pub struct PgStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    conns: ConnectionSet,
    schema: String,
    table: String,
    qualified: String,
    sql: Statements,
    call_timeout: Duration,
    max_response_bytes: usize,
}

/// The statements, rendered once for the configured table. Only validated
/// identifiers are interpolated; every value is a bind parameter.
struct Statements {
    acquire: Arc<str>,
    complete: Arc<str>,
    release: Arc<str>,
    extend: Arc<str>,
    get: Arc<str>,
    delete: Arc<str>,
    purge: Arc<str>,
}

/// Marks SQL built from validated identifiers as safe for sqlx.
fn sql(text: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(text.clone())
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("table", &self.inner.qualified)
            .field("call_timeout", &self.inner.call_timeout)
            .finish()
    }
}

impl PgStore {
    /// A store on `public.idem_records` with the default settings.
    pub fn new(pool: PgPool) -> Self {
        match Self::builder(pool).build() {
            Ok(store) => store,
            // The defaults are valid identifiers.
            Err(e) => unreachable!("default configuration rejected: {e}"),
        }
    }

    /// A builder for the schema, table name and limits.
    pub fn builder(pool: PgPool) -> PgStoreBuilder {
        PgStoreBuilder {
            pool,
            schema: "public".to_owned(),
            table: "idem_records".to_owned(),
            call_timeout: Duration::from_secs(10),
            max_response_bytes: 64 << 20,
            connections: None,
        }
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The schema-qualified, quoted table name.
    pub fn qualified_table(&self) -> &str {
        &self.inner.qualified
    }

    /// The migrations for this store's table, in order, as SQL ready to
    /// run, for teams that apply migrations with their own tool.
    pub fn migrations(&self) -> Vec<(i32, String)> {
        let index = format!("\"{}_expires_at_idx\"", self.inner.table);
        let sequence = sequence_name(&self.inner.schema, &self.inner.table);
        MIGRATIONS
            .iter()
            .map(|(version, _, sql)| {
                (
                    *version,
                    sql.replace("{{table}}", &self.inner.qualified)
                        .replace("{{index}}", &index)
                        .replace("{{sequence}}", &sequence),
                )
            })
            .collect()
    }

    /// Creates the schema (if missing), the table and its index, applying
    /// each migration once; the versions applied are kept in
    /// `<table>_migrations`. Safe to run from several processes at once: a
    /// transaction-scoped advisory lock serializes them.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let inner = &*self.inner;
        let mut tx = inner.pool.begin().await.map_err(|e| self.error(e))?;
        let lock_name = format!("idem.migrate:{}", inner.qualified);
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1)::int8)")
            .bind(&lock_name)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.error(e))?;
        let schema_exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
                .bind(&inner.schema)
                .fetch_one(&mut *tx)
                .await
                .map_err(|e| self.error(e))?;
        if !schema_exists {
            sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA \"{}\"", inner.schema)))
                .execute(&mut *tx)
                .await
                .map_err(|e| self.error(e))?;
        }
        let versions = format!("\"{}\".\"{}_migrations\"", inner.schema, inner.table);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {versions} (
                 version integer PRIMARY KEY,
                 description text NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now())"
        )))
        .execute(&mut *tx)
        .await
        .map_err(|e| self.error(e))?;
        let applied: i32 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT coalesce(max(version), 0) FROM {versions}"
        )))
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| self.error(e))?;
        for ((version, sql), (_, description, _)) in self.migrations().into_iter().zip(MIGRATIONS) {
            if version <= applied {
                continue;
            }
            sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(&mut *tx)
                .await
                .map_err(|e| self.error(e))?;
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {versions} (version, description) VALUES ($1, $2)"
            )))
            .bind(version)
            .bind(*description)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.error(e))?;
            tracing::info!(table = %inner.qualified, version, "applied idem migration");
        }
        tx.commit().await.map_err(|e| self.error(e))
    }

    /// The in-transaction mode: reserve, write and complete inside your own
    /// transaction. See [`InTransaction`].
    pub fn in_transaction(&self) -> InTransaction {
        InTransaction::new(self.clone())
    }

    /// Maps a sqlx error to the store's error, keeping the source.
    fn error(&self, e: sqlx::Error) -> StoreError {
        map_error(e, &self.inner.qualified)
    }

    async fn timed<T, F>(&self, call: F) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, StoreError>>,
    {
        match tokio::time::timeout(self.inner.call_timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Unavailable(Box::new(CallTimeout(
                self.inner.call_timeout,
            )))),
        }
    }

    /// The acquire statement on one connection, re-run while a concurrent
    /// commit was invisible to it, or while the lease it got was shortened
    /// by a wait (then renewed: same token).
    pub(crate) async fn acquire_on(
        &self,
        conn: &mut PgConnection,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
        token: LeaseToken,
    ) -> Result<Acquisition, StoreError> {
        let lease = saturate(lease);
        let lease_us = micros(lease);
        let grace_us = micros(IN_PROGRESS_GRACE);
        let fp = fingerprint.map(|f| f.as_bytes().as_slice());
        let token_bytes = token.to_bytes();
        let mut renewed = false;
        for _ in 0..ACQUIRE_TRIES {
            let row = sqlx::query(sql(&self.inner.sql.acquire))
                .bind(key.scope())
                .bind(key.id())
                .bind(fp)
                .bind(token_bytes.as_slice())
                .bind(lease_us)
                .bind(grace_us)
                .fetch_optional(&mut *conn)
                .await
                .map_err(|e| self.error(e))?;
            let Some(row) = row else {
                continue;
            };
            match decode_acquire(&row, key, fingerprint, lease, renewed)? {
                Decoded::Done(outcome) => return Ok(outcome),
                Decoded::Stale => continue,
                Decoded::Renew => renewed = true,
            }
        }
        Err(StoreError::Unavailable(
            format!(
                "acquire of {key} saw the record change {ACQUIRE_TRIES} times in a row; try again"
            )
            .into(),
        ))
    }

    pub(crate) async fn complete_on(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        if response.len() > self.inner.max_response_bytes {
            return Err(StoreError::ResponseTooLarge {
                size: response.len(),
                limit: self.inner.max_response_bytes,
            });
        }
        let token = lease.token.to_bytes();
        let done = sqlx::query(sql(&self.inner.sql.complete))
            .bind(lease.key.scope())
            .bind(lease.key.id())
            .bind(token.as_slice())
            .bind(response)
            .bind(micros(retention))
            .execute(&mut *conn)
            .await
            .map_err(|e| self.error(e))?;
        if done.rows_affected() == 1 {
            Ok(())
        } else {
            Err(StoreError::LeaseLost)
        }
    }

    pub(crate) async fn release_on(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        let token = lease.token.to_bytes();
        let done = sqlx::query(sql(&self.inner.sql.release))
            .bind(lease.key.scope())
            .bind(lease.key.id())
            .bind(token.as_slice())
            .execute(&mut *conn)
            .await
            .map_err(|e| self.error(e))?;
        if done.rows_affected() == 1 {
            Ok(())
        } else {
            Err(StoreError::LeaseLost)
        }
    }

    /// Lends one of the store's connections for one call. Settle it with
    /// the call's result: it is reused only if the call ended without a
    /// connection-level failure; otherwise, or if the call was cancelled
    /// mid-query, it is closed and a new one is opened next time.
    async fn lend(&self) -> Result<Lent<'_>, StoreError> {
        self.inner.conns.lend().await.map_err(|e| self.error(e))
    }
}

#[async_trait]
impl IdempotencyStore for PgStore {
    async fn acquire(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        // Refused here, before the round trip: nothing is written. (The
        // in-transaction mode calls `acquire_on` with no lease on purpose.)
        if lease.is_zero() {
            return Err(StoreError::zero_lease());
        }
        // One token for the whole call, re-runs included.
        let token = LeaseToken::random();
        self.timed(async {
            let mut lent = self.lend().await?;
            let result = self
                .acquire_on(lent.connection(), key, fingerprint, lease, token)
                .await;
            lent.settle(&result);
            result
        })
        .await
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.timed(async {
            let mut lent = self.lend().await?;
            let result = self
                .complete_on(lent.connection(), lease, response, retention)
                .await;
            lent.settle(&result);
            result
        })
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        self.timed(async {
            let mut lent = self.lend().await?;
            let result = self.release_on(lent.connection(), lease).await;
            lent.settle(&result);
            result
        })
        .await
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        // Refused here, before the round trip: the lease stays as it was.
        if lease_for.is_zero() {
            return Err(StoreError::zero_lease());
        }
        self.timed(async {
            let mut lent = self.lend().await?;
            let conn = lent.connection();
            let result = async {
                let token = lease.token.to_bytes();
                let row = sqlx::query(sql(&self.inner.sql.extend))
                    .bind(lease.key.scope())
                    .bind(lease.key.id())
                    .bind(token.as_slice())
                    .bind(micros(lease_for))
                    .bind(micros(IN_PROGRESS_GRACE))
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(|e| self.error(e))?;
                let Some(row) = row else {
                    return Err(StoreError::LeaseLost);
                };
                let key = &lease.key;
                let attempt = attempt_of(column(&row, 0, key)?, key)?;
                let until = time_of(column(&row, 1, key)?, key, "lease_until")?;
                let fence = fence_of(column(&row, 2, key)?, key)?;
                Ok(Lease::new(key.clone(), lease.token, attempt, until)
                    .with_fence(fence)
                    .with_fingerprint(lease.fingerprint))
            }
            .await;
            lent.settle(&result);
            result
        })
        .await
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.timed(async {
            let mut lent = self.lend().await?;
            let conn = lent.connection();
            let result = async {
                let row = sqlx::query(sql(&self.inner.sql.get))
                    .bind(key.scope())
                    .bind(key.id())
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(|e| self.error(e))?;
                match row {
                    Some(row) => decode_record(&row, key),
                    None => Ok(None),
                }
            }
            .await;
            lent.settle(&result);
            result
        })
        .await
    }

    async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        self.timed(async {
            let mut lent = self.lend().await?;
            let conn = lent.connection();
            let result = async {
                let live: Option<bool> = sqlx::query_scalar(sql(&self.inner.sql.delete))
                    .bind(key.scope())
                    .bind(key.id())
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(|e| self.error(e))?;
                Ok(live.unwrap_or(false))
            }
            .await;
            lent.settle(&result);
            result
        })
        .await
    }

    async fn purge_expired(&self, max: usize) -> Result<u64, StoreError> {
        let mut purged = 0u64;
        while (purged as usize) < max {
            let batch = (max - purged as usize).min(PURGE_BATCH);
            let done = self
                .timed(async {
                    let mut lent = self.lend().await?;
                    let conn = lent.connection();
                    let result = async {
                        sqlx::query(sql(&self.inner.sql.purge))
                            .bind(batch as i64)
                            .execute(&mut *conn)
                            .await
                            .map_err(|e| self.error(e))
                    }
                    .await;
                    lent.settle(&result);
                    result
                })
                .await?;
            purged += done.rows_affected();
            if (done.rows_affected() as usize) < batch {
                break;
            }
        }
        Ok(purged)
    }
}

/// The store's own connections: at most `max` lent at once, idle ones kept
/// for reuse, new ones opened on demand with the pool's connect options.
struct ConnectionSet {
    options: PgConnectOptions,
    idle: std::sync::Mutex<Vec<PgConnection>>,
    slots: tokio::sync::Semaphore,
}

/// A connection lent for one call; back to the idle set only if `keep`.
struct Lent<'a> {
    set: &'a ConnectionSet,
    conn: Option<PgConnection>,
    keep: bool,
    _slot: tokio::sync::SemaphorePermit<'a>,
}

impl ConnectionSet {
    fn new(options: PgConnectOptions, max: usize) -> Self {
        ConnectionSet {
            options,
            idle: std::sync::Mutex::new(Vec::with_capacity(max)),
            slots: tokio::sync::Semaphore::new(max),
        }
    }

    async fn lend(&self) -> Result<Lent<'_>, sqlx::Error> {
        let slot = self
            .slots
            .acquire()
            .await
            .map_err(|_| sqlx::Error::PoolClosed)?;
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let conn = match idle {
            Some(conn) => conn,
            None => PgConnection::connect_with(&self.options).await?,
        };
        Ok(Lent {
            set: self,
            conn: Some(conn),
            keep: false,
            _slot: slot,
        })
    }
}

impl Lent<'_> {
    fn connection(&mut self) -> &mut PgConnection {
        match self.conn.as_mut() {
            Some(conn) => conn,
            None => unreachable!("a lent connection is present until dropped"),
        }
    }

    /// Marks the connection for reuse unless `result` says the connection
    /// itself may be broken.
    fn settle<T>(&mut self, result: &Result<T, StoreError>) {
        self.keep = !matches!(
            result,
            Err(StoreError::Unavailable(_) | StoreError::Backend(_))
        );
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        if let (true, Some(conn)) = (self.keep, self.conn.take()) {
            self.set
                .idle
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(conn);
        }
        // Otherwise the connection is dropped, which closes its socket.
    }
}

fn map_error(e: sqlx::Error, table: &str) -> StoreError {
    match &e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => StoreError::Unavailable(Box::new(e)),
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            // 08: connection exceptions; 57P01-03: server shutting down or
            // starting; 57P05: idle session timeout; 57014: statement
            // timeout or cancelled; 55P03: lock timeout; 53300: too many
            // connections; 40001/40P01: a serialization failure or
            // deadlock. Each is resolved by trying again.
            if code.starts_with("08")
                || matches!(
                    code.as_str(),
                    "57P01"
                        | "57P02"
                        | "57P03"
                        | "57P05"
                        | "57014"
                        | "55P03"
                        | "53300"
                        | "40001"
                        | "40P01"
                )
            {
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

/// `d` in whole microseconds for a statement: saturated to
/// [`MAX_DURATION`](idem_core::MAX_DURATION), so every deadline
/// (`now + lease + IN_PROGRESS_GRACE`) stays far inside timestamptz's
/// range, and rounded up, so a lease under a microsecond is not a zero
/// lease.
fn micros(d: Duration) -> i64 {
    let d = saturate(d);
    let us = d.as_micros() + u128::from(d.subsec_nanos() % 1_000 != 0);
    // MAX_DURATION is about 3.2e15 µs: always fits.
    i64::try_from(us).unwrap_or(i64::MAX)
}

fn fence_of(fence: i64, key: &IdempotencyKey) -> Result<u64, StoreError> {
    u64::try_from(fence).map_err(|_| corrupt(key, format!("fence {fence} is negative")))
}

fn corrupt(key: &IdempotencyKey, detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        key: key.clone(),
        detail: detail.into(),
    }
}

fn column<'r, T>(row: &'r PgRow, index: usize, key: &IdempotencyKey) -> Result<T, StoreError>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    row.try_get(index)
        .map_err(|e| corrupt(key, format!("column {index} does not decode: {e}")))
}

fn time_of(us: Option<i64>, key: &IdempotencyKey, what: &str) -> Result<SystemTime, StoreError> {
    match us {
        Some(us) if us >= 0 => Ok(UNIX_EPOCH + Duration::from_micros(us as u64)),
        Some(us) => Err(corrupt(key, format!("{what} is before 1970 ({us} µs)"))),
        None => Err(corrupt(key, format!("{what} is missing"))),
    }
}

fn attempt_of(attempt: i32, key: &IdempotencyKey) -> Result<u32, StoreError> {
    u32::try_from(attempt)
        .ok()
        .filter(|a| *a > 0)
        .ok_or_else(|| corrupt(key, format!("attempt {attempt} is not positive")))
}

fn fingerprint_of(
    bytes: Option<Vec<u8>>,
    key: &IdempotencyKey,
) -> Result<Option<Fingerprint>, StoreError> {
    match bytes {
        None => Ok(None),
        Some(b) => Fingerprint::from_slice(&b)
            .map(Some)
            .ok_or_else(|| corrupt(key, format!("fingerprint is {} bytes, not 32", b.len()))),
    }
}

fn status_of(status: i16, key: &IdempotencyKey) -> Result<i16, StoreError> {
    if matches!(status, 1 | 2) {
        Ok(status)
    } else {
        Err(corrupt(key, format!("unknown status {status}")))
    }
}

/// What one run of the acquire statement came to.
enum Decoded {
    Done(Acquisition),
    /// The row was a stale view (see acquire.sql): run again.
    Stale,
    /// Acquired, but a wait shortened the lease: run again with the same
    /// token, which renews it from the server's clock.
    Renew,
}

/// Decodes the acquire statement's row for a call that asked for `lease`
/// (zero: the in-transaction mode), `renewed` if it already renewed once.
fn decode_acquire(
    row: &PgRow,
    key: &IdempotencyKey,
    given: Option<&Fingerprint>,
    lease: Duration,
    renewed: bool,
) -> Result<Decoded, StoreError> {
    let acquired: bool = column(row, 0, key)?;
    let attempt = attempt_of(column(row, 3, key)?, key)?;
    let lease_until: Option<i64> = column(row, 4, key)?;
    let fence = fence_of(column(row, 9, key)?, key)?;
    let token_of = |row: &PgRow| -> Result<LeaseToken, StoreError> {
        let bytes: Vec<u8> = column(row, 11, key)?;
        LeaseToken::from_slice(&bytes)
            .ok_or_else(|| corrupt(key, format!("token is {} bytes, not 16", bytes.len())))
    };
    // For an acquisition: when the row was written; otherwise when the
    // statement read it. Both by the server's clock.
    let now = time_of(column(row, 8, key)?, key, "clock")?;
    if acquired {
        let until = time_of(lease_until, key, "lease_until")?;
        if !lease.is_zero() {
            // Never hand out a lease a wait has eaten: over half of it
            // gone (a lock wait), renew; after a renewal, anything left.
            let left = until.duration_since(now).unwrap_or(Duration::ZERO);
            if left.is_zero() || (!renewed && left < lease / 2) {
                return Ok(Decoded::Renew);
            }
        }
        let stored = fingerprint_of(column(row, 2, key)?, key)?;
        return Ok(Decoded::Done(Acquisition::Acquired(
            Lease::new(key.clone(), token_of(row)?, attempt, until)
                .with_fence(fence)
                .with_fingerprint(stored),
        )));
    }
    let status = status_of(column(row, 1, key)?, key)?;
    let stored = fingerprint_of(column(row, 2, key)?, key)?;
    let expires = time_of(column(row, 7, key)?, key, "expires_at")?;
    if expires <= now {
        return Ok(Decoded::Stale);
    }
    if let (Some(stored), Some(given)) = (stored, given) {
        if stored != *given {
            return Ok(Decoded::Done(Acquisition::Mismatch));
        }
    }
    let mine: bool = column(row, 12, key)?;
    if mine {
        // A claim of this same transaction (the in-transaction mode): the
        // same claim again, never a takeover of its own row.
        let until = time_of(lease_until, key, "lease_until")?;
        return Ok(Decoded::Done(Acquisition::Acquired(
            Lease::new(key.clone(), token_of(row)?, attempt, until)
                .with_fence(fence)
                .with_fingerprint(stored),
        )));
    }
    if status == 2 {
        let response: Option<Vec<u8>> = column(row, 5, key)?;
        let response = response.ok_or_else(|| corrupt(key, "completed without a response"))?;
        let completed = time_of(column(row, 6, key)?, key, "completed_at")?;
        // expires_at minus the server's clock, computed by the server.
        let ttl_us: Option<i64> = column(row, 10, key)?;
        let ttl = Duration::from_micros(ttl_us.and_then(|us| u64::try_from(us).ok()).unwrap_or(0));
        return Ok(Decoded::Done(Acquisition::Completed(
            CompletedRecord::new(
                key.clone(),
                Bytes::from(response),
                stored,
                attempt,
                completed,
                expires,
            )
            .with_fence(fence)
            .with_ttl(ttl),
        )));
    }
    let until = time_of(lease_until, key, "lease_until")?;
    match until.duration_since(now) {
        Ok(left) if !left.is_zero() => Ok(Decoded::Done(Acquisition::InProgress {
            lease_expires_at: until,
            retry_after: left,
            attempt,
        })),
        // The lease is over, yet the takeover did not happen: a newer
        // version of the row exists that this snapshot did not see.
        _ => Ok(Decoded::Stale),
    }
}

fn decode_record(row: &PgRow, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
    let status = status_of(column(row, 0, key)?, key)?;
    let fingerprint = fingerprint_of(column(row, 1, key)?, key)?;
    let token_bytes: Vec<u8> = column(row, 2, key)?;
    let token = LeaseToken::from_slice(&token_bytes)
        .ok_or_else(|| corrupt(key, format!("token is {} bytes, not 16", token_bytes.len())))?;
    let attempt = attempt_of(column(row, 3, key)?, key)?;
    let created = time_of(column(row, 6, key)?, key, "created_at")?;
    let expires = time_of(column(row, 8, key)?, key, "expires_at")?;
    let now = time_of(column(row, 9, key)?, key, "clock")?;
    if expires <= now {
        return Ok(None);
    }
    let state = if status == 2 {
        let response: Option<Vec<u8>> = column(row, 5, key)?;
        RecordState::Completed {
            response: Bytes::from(
                response.ok_or_else(|| corrupt(key, "completed without a response"))?,
            ),
            completed_at: time_of(column(row, 7, key)?, key, "completed_at")?,
        }
    } else {
        RecordState::InProgress {
            lease_expires_at: time_of(column(row, 4, key)?, key, "lease_until")?,
        }
    };
    let fence = fence_of(column(row, 10, key)?, key)?;
    Ok(Some(
        Record::new(
            key.clone(),
            state,
            fingerprint,
            token,
            attempt,
            created,
            expires,
        )
        .with_fence(fence),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_saturated_and_rounded_up() {
        assert_eq!(micros(Duration::ZERO), 0);
        assert_eq!(micros(Duration::from_nanos(1)), 1);
        assert_eq!(micros(Duration::from_nanos(1_500)), 2);
        assert_eq!(micros(Duration::from_millis(7)), 7_000);
        let max = idem_core::MAX_DURATION.as_micros() as i64;
        for huge in [
            Duration::MAX,
            Duration::from_secs(u64::MAX),
            idem_core::MAX_DURATION + Duration::from_nanos(1),
        ] {
            assert_eq!(micros(huge), max, "{huge:?}");
        }
        // The longest deadline offset a statement computes, lease + grace,
        // is exact in the float8 that `int8 * interval` goes through.
        let longest = max + micros(IN_PROGRESS_GRACE);
        assert_eq!(longest as f64 as i64, longest);
    }

    #[test]
    fn migrations_and_statements_name_the_sequence() {
        let longest = "a".repeat(40);
        let seq = sequence_name(&longest, &longest);
        let table_part = seq.rsplit('.').next().unwrap_or_default().trim_matches('"');
        assert!(table_part.len() <= 63, "{table_part}");
        // Every placeholder a template uses is one that gets filled in.
        let known = ["{{table}}", "{{index}}", "{{sequence}}"];
        let statements = [
            include_str!("../sql/acquire.sql"),
            include_str!("../sql/extend.sql"),
            include_str!("../sql/get.sql"),
        ];
        for sql in MIGRATIONS.iter().map(|m| m.2).chain(statements) {
            let mut rest = sql;
            while let Some(at) = rest.find("{{") {
                let name = &rest[at..at + rest[at..].find("}}").map_or(2, |e| e + 2)];
                assert!(known.contains(&name), "unknown placeholder {name}");
                rest = &rest[at + 2..];
            }
        }
        assert!(MIGRATIONS[1].2.contains("{{sequence}}"));
        assert!(include_str!("../sql/acquire.sql").contains("nextval('{{sequence}}')"));
    }

    #[test]
    fn identifiers_are_validated() {
        assert!(validate_identifier("table", "idem_records").is_ok());
        assert!(validate_identifier("table", "t1").is_ok());
        for bad in [
            "",
            "1abc",
            "Idem",
            "a-b",
            "a\"b",
            "x; drop table y",
            &"a".repeat(41),
        ] {
            assert!(
                matches!(
                    validate_identifier("table", bad),
                    Err(ConfigError::InvalidIdentifier { what: "table", .. })
                ),
                "{bad:?} accepted"
            );
        }
    }
}
