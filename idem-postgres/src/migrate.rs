//! The table's migrations: [`PgStore::migrate`], or the SQL or a sqlx
//! `Migrator` for teams that run migrations with their own tool.

use idem_core::StoreError;
use sqlx::AssertSqlSafe;

use crate::store::PgStore;

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

/// The schema-qualified, quoted name of the fence sequence (the table name
/// is at most 40 characters, so this fits PostgreSQL's 63).
pub(crate) fn sequence_name(schema: &str, table: &str) -> String {
    format!("\"{schema}\".\"{table}_fence_seq\"")
}

impl PgStore {
    /// The migrations of this store's table as a sqlx [`Migrator`], to run
    /// beside your own `sqlx::migrate!()` (instead of [`PgStore::migrate`]).
    ///
    /// It keeps its own history table, `<table>_sqlx_migrations` in the
    /// store's schema (created with the schema if missing), so its version
    /// numbers never clash with yours in `_sqlx_migrations`, and neither
    /// migrator reports the other's versions as missing. Its migrations
    /// are idempotent (`IF NOT EXISTS`), so a table that
    /// [`PgStore::migrate`] created already is left as it is.
    ///
    /// ```no_run
    /// # async fn run(pool: idem_postgres::sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let store = idem_postgres::PgStore::new(pool.clone());
    /// // sqlx::migrate!().run(&pool).await?;   // yours, from ./migrations
    /// store.migrator().run(&pool).await?;       // idem's
    /// # Ok(()) }
    /// ```
    ///
    /// [`Migrator`]: sqlx::migrate::Migrator
    pub fn migrator(&self) -> sqlx::migrate::Migrator {
        use sqlx::migrate::{Migration, MigrationType, Migrator};
        use sqlx::SqlSafeStr;
        let migrations = self
            .migrations()
            .into_iter()
            .zip(MIGRATIONS)
            .map(|((version, sql), (_, description, _))| {
                Migration::new(
                    i64::from(version),
                    std::borrow::Cow::Borrowed(*description),
                    MigrationType::Simple,
                    AssertSqlSafe(sql).into_sql_str(),
                    false,
                )
            })
            .collect();
        let mut migrator = Migrator::with_migrations(migrations);
        // Names validated by the builder: quoted, they are safe in SQL.
        migrator.dangerous_set_table_name(format!(
            "\"{}\".\"{}_sqlx_migrations\"",
            self.inner.schema, self.inner.table
        ));
        migrator.create_schema(format!("\"{}\"", self.inner.schema));
        migrator
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
        // `CREATE ... IF NOT EXISTS` on a migrated table makes the server
        // send a NOTICE ("already exists, skipping"), which sqlx logs at
        // INFO on every start: not worth a line. Warnings still come.
        sqlx::query("SET LOCAL client_min_messages = warning")
            .execute(&mut *tx)
            .await
            .map_err(|e| self.error(e))?;
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
            include_str!("../sql/acquire_many.sql"),
            include_str!("../sql/complete_many.sql"),
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
        assert!(include_str!("../sql/acquire_many.sql").contains("nextval('{{sequence}}')"));
    }
}
