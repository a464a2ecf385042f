//! A ledger for the in-transaction forms: a table with one row per run
//! whose transaction committed (the business write of a payment), inserted
//! on the run's own transaction, and a count of the runs that reached
//! their INSERT, committed or not.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use idemkit::postgres::{PgStore, PgTx};
use sqlx::PgPool;

/// A ledger table of a test's own, and the runs its handlers counted.
#[derive(Clone)]
pub struct Ledger {
    pub table: String,
    pool: PgPool,
    /// Handler runs that reached their INSERT (committed or not).
    pub runs: Arc<AtomicU64>,
}

impl Ledger {
    /// Creates `{prefix}_{random}` (and its `_deferred` table, whose
    /// constraint is checked at commit) on `pool`'s database.
    pub async fn create(pool: &PgPool, prefix: &str) -> Ledger {
        let table = format!("{prefix}_{:08x}", fastrand::u32(..));
        for statement in [
            format!("CREATE TABLE {table} (n bigserial PRIMARY KEY, id text NOT NULL, fence bigint NOT NULL)"),
            format!("CREATE TABLE {table}_deferred (v int UNIQUE DEFERRABLE INITIALLY DEFERRED)"),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(pool)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        }
        Ledger {
            table,
            pool: pool.clone(),
            runs: Arc::default(),
        }
    }

    /// The ledger `table` created by another process.
    pub fn existing(pool: &PgPool, table: &str) -> Ledger {
        Ledger {
            table: table.to_owned(),
            pool: pool.clone(),
            runs: Arc::default(),
        }
    }

    /// Inserts the row of `id` on the run's transaction; counts the run.
    pub async fn insert(&self, tx: &PgTx, id: &str, fence: u64) -> Result<(), BoxError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let mut tx = tx.lock().await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (id, fence) VALUES ($1, $2)",
            self.table
        )))
        .bind(id)
        .bind(i64::try_from(fence).unwrap_or(i64::MAX))
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    /// Breaks the deferred constraint on `tx`: its commit fails.
    pub async fn break_commit(&self, tx: &PgTx) -> Result<(), BoxError> {
        let mut tx = tx.lock().await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {}_deferred (v) VALUES (1), (1)",
            self.table
        )))
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    /// The committed rows of `id`.
    pub async fn rows(&self, id: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE id = $1",
            self.table
        )))
        .bind(id)
        .fetch_one(&self.pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Every committed row's id, with its count, where an id has more
    /// than one (empty when each payment is there once).
    pub async fn doubles(&self) -> Vec<(String, i64)> {
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT id, count(*) FROM {} GROUP BY id HAVING count(*) > 1 ORDER BY id",
            self.table
        )))
        .fetch_all(&self.pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The committed rows.
    pub async fn total(&self) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {}",
            self.table
        )))
        .fetch_one(&self.pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The runs counted so far.
    pub fn runs(&self) -> u64 {
        self.runs.load(Ordering::SeqCst)
    }
}

/// A handler's error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A migrated store on the shared PostgreSQL with a pool of
/// `connections`.
pub async fn pg_store(connections: u32) -> PgStore {
    let store = PgStore::new(super::pg::pool(super::pg::shared_url(), connections).await);
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    store
}
