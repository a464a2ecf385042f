//! Building a [`PgStore`]: the defaults, the settings of
//! [`PgStoreBuilder`] and their limits, the table's names checked.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{Batcher, Batching};
#[cfg(doc)]
use idem_core::{IdempotencyStore, StoreError};
use sqlx::postgres::PgPool;

use crate::connection::ConnectionSet;
use crate::error::ConfigError;
use crate::failover::Failover;
use crate::migrate::sequence_name;
use crate::statements::Statements;
use crate::store::Inner;
use crate::store::PgStore;
use crate::timeouts::Timeouts;

/// The most items one batch statement carries by default; see
/// [`PgStoreBuilder::batch_statement`].
pub const DEFAULT_BATCH_STATEMENT: usize = 256;

/// The batching a [`PgStore`] starts with: on, at most 2 calls of each
/// kind in flight before new ones wait to be batched (two statements at
/// once kept PostgreSQL's two cores busier than one on the machine the
/// figures of the repository's docs/guide/performance.md come from).
///
/// ```
/// assert_eq!(idem_postgres::default_batching().calls_in_flight(), 2);
/// ```
pub fn default_batching() -> Batching {
    Batching::default().in_flight(2)
}

/// The largest [`PgStoreBuilder::batch_statement`].
pub const MAX_BATCH_STATEMENT: usize = 10_000;

/// The store's own connections by default (fewer if the pool allows
/// fewer).
pub const DEFAULT_CONNECTIONS: usize = 4;

/// The most connections a store keeps of its own: a larger
/// [`PgStoreBuilder::connections`] (say `usize::MAX`, "as many as allowed")
/// is taken as this. Nothing is allocated per possible connection.
pub const MAX_CONNECTIONS: usize = 10_000;

/// A [`PgStore`] under construction.
#[derive(Debug, Clone)]
pub struct PgStoreBuilder {
    pub(crate) pool: PgPool,
    schema: String,
    table: String,
    call_timeout: Duration,
    max_response_bytes: usize,
    connections: Option<usize>,
    batch_statement: usize,
    batching: Batching,
    pub(crate) failover: Option<Failover>,
}

impl PgStoreBuilder {
    /// The most items one statement of [`acquire_many`] or
    /// [`complete_many`] carries (default [`DEFAULT_BATCH_STATEMENT`],
    /// 256; at least 1, at most [`MAX_BATCH_STATEMENT`]): a larger batch
    /// is sent as several statements, one after the other. Each item of an
    /// `acquire_many` statement holds an advisory lock until the statement
    /// commits, and PostgreSQL keeps those in its shared lock table
    /// (`max_locks_per_transaction` x `max_connections` slots, 6,400 with
    /// the defaults, shared by every session): keep this times
    /// [`connections`](Self::connections) well inside it.
    ///
    /// [`acquire_many`]: IdempotencyStore::acquire_many
    /// [`complete_many`]: IdempotencyStore::complete_many
    pub fn batch_statement(mut self, items: usize) -> Self {
        self.batch_statement = items.clamp(1, MAX_BATCH_STATEMENT);
        self
    }

    /// How concurrent single calls are batched (default
    /// [`default_batching`]: on, at most 2 calls of each kind in flight
    /// before new ones wait). While those are in flight, the `acquire`s
    /// (`complete`s) other tasks make meanwhile wait and then go together
    /// as one `acquire_many` (`complete_many`) statement; each caller gets
    /// the answer its own call would have got. A call that finds room goes
    /// at once. Each batched call takes one of
    /// the store's [`connections`](Self::connections) while it runs.
    /// [`Batching::off`] sends every call alone.
    pub fn batching(mut self, batching: Batching) -> Self {
        self.batching = batching;
        self
    }

    /// How many connections the store keeps for its own calls: at most
    /// this many are open at once (default [`DEFAULT_CONNECTIONS`], 4, or
    /// the pool's `max_connections` if that is smaller). They come **in
    /// addition to the pool's** own connections (which `migrate` and the
    /// in-transaction mode use), so budget `max_connections + n` server
    /// connections per store. They are opened on demand the way the pool
    /// opens its own (its connect options and its `after_connect`
    /// callback), closed after the pool's `idle_timeout` idle and after its
    /// `max_lifetime`, and reused directly rather than going back through
    /// the pool, which pings every connection it takes back (a second round
    /// trip per call). See [`PgStore::connection_stats`].
    ///
    /// `n` is taken between 1 and [`MAX_CONNECTIONS`] (10,000): a larger
    /// one is clamped, never a panic, and nothing is allocated up front per
    /// possible connection.
    pub fn connections(mut self, n: usize) -> Self {
        self.connections = Some(n.clamp(1, MAX_CONNECTIONS));
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

    /// The longest a store call may take, waiting for a connection
    /// included, before it fails with [`StoreError::Unavailable`]. Default
    /// 10 s; saturated to a day; a zero timeout is taken as 1 ms.
    ///
    /// The server enforces it too, so a call the client gave up on does not
    /// go on on the server (a reservation committing after its caller was
    /// told "unavailable", backends piling up behind a lock): each of the
    /// store's connections runs with `statement_timeout` and `lock_timeout`
    /// at half the call timeout (or lower, if the connection's own settings
    /// are lower), and `client_connection_check_interval` (PostgreSQL 14+)
    /// so a backend notices a client that went away. A statement is only
    /// sent while at least 60% of the call timeout is left, so the server
    /// stops it before the client stops waiting: a call that fails this
    /// way gets the server's error (55P03, 57014: `Unavailable`) and its
    /// statement is known to be rolled back. The client's own timer only
    /// fires when the server does not answer at all.
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
            acquire_many: render(include_str!("../sql/acquire_many.sql")),
            complete: render(include_str!("../sql/complete.sql")),
            complete_many: render(include_str!("../sql/complete_many.sql")),
            release: render(include_str!("../sql/release.sql")),
            extend: render(include_str!("../sql/extend.sql")),
            get: render(include_str!("../sql/get.sql")),
            delete: render(include_str!("../sql/delete.sql")),
            purge: render(include_str!("../sql/purge.sql")),
        };
        let pool_max = self.pool.options().get_max_connections() as usize;
        let connections = self
            .connections
            .unwrap_or(DEFAULT_CONNECTIONS.min(pool_max))
            .clamp(1, MAX_CONNECTIONS);
        let timeouts = Timeouts::new(self.call_timeout);
        Ok(PgStore {
            busy_back: false,
            inner: Arc::new(Inner {
                conns: Arc::new(ConnectionSet::new(
                    self.pool.clone(),
                    connections,
                    timeouts,
                    format!("{}.{}", self.schema, self.table),
                    self.failover.as_ref().map(Failover::shared),
                )),
                pool: self.pool,
                schema: self.schema,
                table: self.table,
                qualified,
                sql,
                timeouts,
                max_response_bytes: self.max_response_bytes,
                batch_statement: self.batch_statement,
                batcher: Batcher::new(self.batching, "postgres"),
            }),
        })
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
            batch_statement: DEFAULT_BATCH_STATEMENT,
            batching: default_batching(),
            failover: None,
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

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
