//! Operator reads: the server's clock, a record with the clock, the keys
//! stuck in progress, counts by scope and state. For tools such as the
//! `idem` command, never on a request's path: `stuck` and `counts` read
//! the whole table (no index serves them), each statement bounded by the
//! store's server-side `statement_timeout` (half the call timeout).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::{IdempotencyKey, LeaseToken, Record, StoreError};
use sqlx::{AssertSqlSafe, Row};

use crate::decode::{column, decode_record};
use crate::store::PgStore;

/// The columns of `sql/get.sql`, in its order, for `decode_record`.
const RECORD_COLUMNS: &str = "status, fingerprint, token, attempt,
       (extract(epoch FROM lease_until) * 1000000)::int8,
       response,
       (extract(epoch FROM created_at) * 1000000)::int8,
       (extract(epoch FROM completed_at) * 1000000)::int8,
       (extract(epoch FROM expires_at) * 1000000)::int8,
       (extract(epoch FROM clock_timestamp()) * 1000000)::int8,
       fence";

/// What makes a row undecodable, in SQL (`decode_record` says which).
const CORRUPT: &str = "(status NOT IN (1, 2)
        OR octet_length(token) <> 16
        OR attempt < 1
        OR fence < 0
        OR (fingerprint IS NOT NULL AND octet_length(fingerprint) <> 32)
        OR (status = 1 AND lease_until IS NULL)
        OR (status = 2 AND (response IS NULL OR completed_at IS NULL)))";

/// A row listed by [`PgStore::stuck`].
#[derive(Debug)]
#[non_exhaustive]
pub struct ListedRecord {
    /// The row's scope, as stored.
    pub scope: String,
    /// The row's key id, as stored.
    pub id: String,
    /// The record, or why it does not decode: a corrupt row is reported
    /// with its key, never skipped.
    pub record: Result<Record, String>,
}

/// The keys stuck in progress, as [`PgStore::stuck`] found them.
#[derive(Debug)]
#[non_exhaustive]
pub struct StuckRows {
    /// The server's clock (`clock_timestamp()`) when the statement ran.
    pub now: SystemTime,
    /// Stuck rows (oldest lease deadline first), then corrupt rows.
    pub records: Vec<ListedRecord>,
}

/// The rows of one scope by state, as [`PgStore::counts`] counts them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScopeCounts {
    /// The scope.
    pub scope: String,
    /// Live, in progress, lease not over.
    pub in_progress: u64,
    /// Live, in progress, lease over: a duplicate would take the key over.
    pub stuck: u64,
    /// Live, completed.
    pub completed: u64,
    /// Expired, not yet purged (`purge_expired` deletes them).
    pub expired: u64,
    /// Rows that do not decode.
    pub corrupt: u64,
}

fn us_to_time(us: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_micros(u64::try_from(us).unwrap_or(0))
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

impl PgStore {
    /// The server's clock, `clock_timestamp()`. One round trip.
    pub async fn server_time(&self) -> Result<SystemTime, StoreError> {
        self.call(|conn, _| {
            Box::pin(async move {
                let us: i64 = sqlx::query_scalar(
                    "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8",
                )
                .fetch_one(&mut *conn)
                .await?;
                Ok(us_to_time(us))
            })
        })
        .await
    }

    /// Deletes the row of `key` only if it is still held by the
    /// acquisition with lease token `token` and is not in progress with a
    /// live lease (by the server's clock), in one statement: for tools that
    /// check a record, then delete it. A takeover in between (the lease was
    /// over, a duplicate took the key) gives the row another token, and a
    /// late heartbeat's extend makes its lease live again: either way it is
    /// left alone, `Ok(false)`, as for a row that is gone.
    ///
    /// A call whose connection failed is sent again and answers what the
    /// first send did: the statement runs in a transaction whose id it
    /// returns, so if only the `COMMIT`'s reply was lost, the resend asks
    /// the server whether that transaction committed (and answers the
    /// first send's count) instead of deleting again and finding nothing.
    /// Three round trips (`BEGIN`, the statement, `COMMIT`).
    pub async fn delete_if_token(
        &self,
        key: &IdempotencyKey,
        token: &LeaseToken,
    ) -> Result<bool, StoreError> {
        let statement = format!(
            "WITH gone AS (DELETE FROM {table} WHERE scope = $1 AND key = $2 AND token = $3 \
             AND NOT (status = 1 AND lease_until > clock_timestamp()) RETURNING 1) \
             SELECT pg_current_xact_id()::text, (SELECT count(*) FROM gone)",
            table = self.qualified_table()
        );
        let statement = statement.as_str();
        let token = token.to_bytes();
        // The transaction id and the answer of a send whose `COMMIT` was
        // sent but not answered.
        let unconfirmed: std::sync::Mutex<Option<(String, bool)>> = std::sync::Mutex::new(None);
        let unconfirmed = &unconfirmed;
        self.call(|conn, _| {
            Box::pin(async move {
                let earlier = unconfirmed.lock().map(|u| u.clone()).unwrap_or(None);
                if let Some((xid, deleted)) = earlier {
                    // A resend: did the first send commit? (Its session
                    // may still be ending: "in progress" until then.)
                    loop {
                        let status: Option<String> =
                            sqlx::query_scalar("SELECT pg_xact_status($1::xid8)")
                                .bind(&xid)
                                .fetch_one(&mut *conn)
                                .await?;
                        match status.as_deref() {
                            Some("committed") => return Ok(deleted),
                            Some("in progress") => {
                                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                            }
                            // Rolled back: nothing was deleted; send again.
                            _ => break,
                        }
                    }
                }
                let mut tx = sqlx::Connection::begin(&mut *conn).await?;
                let (xid, count): (String, i64) = sqlx::query_as(AssertSqlSafe(statement))
                    .bind(key.scope())
                    .bind(key.id())
                    .bind(&token[..])
                    .fetch_one(&mut *tx)
                    .await?;
                if let Ok(mut u) = unconfirmed.lock() {
                    *u = Some((xid, count > 0));
                }
                tx.commit().await?;
                Ok(count > 0)
            })
        })
        .await
    }

    /// The record of `key` (as [`get`](idem_core::IdempotencyStore::get)
    /// reads it: an expired row is absent) and the server's clock, in one
    /// statement. For operator tools that show how long a lease or a
    /// retention has left.
    pub async fn get_with_time(
        &self,
        key: &IdempotencyKey,
    ) -> Result<(Option<Record>, SystemTime), StoreError> {
        let statement = format!(
            "SELECT {RECORD_COLUMNS} FROM (SELECT 1) AS one LEFT JOIN {table} \
             ON scope = $1 AND key = $2",
            table = self.qualified_table()
        );
        let statement = statement.as_str();
        self.call(|conn, _| {
            Box::pin(async move {
                let row = sqlx::query(AssertSqlSafe(statement))
                    .bind(key.scope())
                    .bind(key.id())
                    .fetch_one(&mut *conn)
                    .await?;
                let now: Option<i64> = column(&row, 9, key)?;
                let now = us_to_time(now.unwrap_or(0));
                let status: Option<i16> = column(&row, 0, key)?;
                if status.is_none() {
                    return Ok((None, now));
                }
                Ok((decode_record(&row, key)?, now))
            })
        })
        .await
    }

    /// The keys in progress whose lease deadline has passed by the
    /// server's clock (a duplicate would take them over), oldest deadline
    /// first, then the rows that do not decode, at most `limit` rows in
    /// all. Expired rows are left out (they are as good as absent).
    pub async fn stuck(&self, limit: usize) -> Result<StuckRows, StoreError> {
        let statement = format!(
            "WITH t AS (SELECT clock_timestamp() AS now) \
             SELECT {RECORD_COLUMNS}, scope, key, \
                    (extract(epoch FROM t.now) * 1000000)::int8 \
             FROM {table}, t \
             WHERE {CORRUPT} \
                OR (status = 1 AND lease_until <= t.now AND expires_at > t.now) \
             ORDER BY {CORRUPT}, lease_until, scope, key \
             LIMIT $1",
            table = self.qualified_table()
        );
        let statement = statement.as_str();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self
            .call(|conn, _| {
                Box::pin(async move {
                    Ok(sqlx::query(AssertSqlSafe(statement))
                        .bind(limit)
                        .fetch_all(&mut *conn)
                        .await?)
                })
            })
            .await?;
        let mut now = None;
        let mut records = Vec::with_capacity(rows.len());
        for row in &rows {
            let scope: String = row.try_get(11).unwrap_or_default();
            let id: String = row.try_get(12).unwrap_or_default();
            if now.is_none() {
                now = row.try_get::<i64, _>(13).ok().map(us_to_time);
            }
            let record = match IdempotencyKey::new(&scope, &id) {
                Ok(key) => match decode_record(row, &key) {
                    Ok(Some(record)) => Ok(record),
                    // Expired between the filter and the decode.
                    Ok(None) => continue,
                    Err(StoreError::Corrupt { detail, .. }) => Err(detail),
                    Err(e) => Err(e.to_string()),
                },
                Err(e) => Err(format!("the row's key is not a valid key: {e}")),
            };
            records.push(ListedRecord { scope, id, record });
        }
        let now = match now {
            Some(now) => now,
            None => self.server_time().await?,
        };
        Ok(StuckRows { now, records })
    }

    /// The scopes holding a live record (not expired by the server's
    /// clock) for `id`, in order, at most `limit`: what an operator looking
    /// for a key in the wrong scope needs. One statement that walks the
    /// distinct scopes on the primary key's index (one probe per scope,
    /// never a scan of the rows).
    pub async fn scopes_holding(&self, id: &str, limit: usize) -> Result<Vec<String>, StoreError> {
        let statement = format!(
            "WITH RECURSIVE s(scope) AS ( \
               (SELECT scope FROM {table} ORDER BY scope LIMIT 1) \
               UNION ALL \
               SELECT (SELECT t.scope FROM {table} t WHERE t.scope > s.scope \
                       ORDER BY t.scope LIMIT 1) \
               FROM s WHERE s.scope IS NOT NULL) \
             SELECT s.scope FROM s \
             WHERE s.scope IS NOT NULL AND EXISTS ( \
               SELECT 1 FROM {table} r WHERE r.scope = s.scope AND r.key = $1 \
                 AND r.expires_at > clock_timestamp()) \
             ORDER BY s.scope LIMIT $2",
            table = self.qualified_table()
        );
        let statement = statement.as_str();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let id = id.to_owned();
        let rows = self
            .call(|conn, _| {
                let id = id.clone();
                Box::pin(async move {
                    Ok(sqlx::query(AssertSqlSafe(statement))
                        .bind(id)
                        .bind(limit)
                        .fetch_all(&mut *conn)
                        .await?)
                })
            })
            .await?;
        rows.iter()
            .map(|row| {
                row.try_get(0).map_err(|e| {
                    StoreError::backend(format!("scopes_holding: the scope does not decode: {e}"))
                })
            })
            .collect()
    }

    /// Counts the rows by scope and state, by the server's clock; scopes
    /// in order.
    pub async fn counts(&self) -> Result<Vec<ScopeCounts>, StoreError> {
        let statement = format!(
            "WITH t AS (SELECT clock_timestamp() AS now) \
             SELECT scope, \
               count(*) FILTER (WHERE NOT {CORRUPT} AND expires_at > t.now \
                                  AND status = 1 AND lease_until > t.now), \
               count(*) FILTER (WHERE NOT {CORRUPT} AND expires_at > t.now \
                                  AND status = 1 AND lease_until <= t.now), \
               count(*) FILTER (WHERE NOT {CORRUPT} AND expires_at > t.now AND status = 2), \
               count(*) FILTER (WHERE NOT {CORRUPT} AND expires_at <= t.now), \
               count(*) FILTER (WHERE {CORRUPT}) \
             FROM {table}, t GROUP BY scope ORDER BY scope",
            table = self.qualified_table()
        );
        let statement = statement.as_str();
        let rows = self
            .call(|conn, _| {
                Box::pin(async move {
                    Ok(sqlx::query(AssertSqlSafe(statement))
                        .fetch_all(&mut *conn)
                        .await?)
                })
            })
            .await?;
        rows.iter()
            .map(|row| {
                let get = |i: usize| -> Result<i64, StoreError> {
                    row.try_get(i).map_err(|e| {
                        StoreError::backend(format!("counts: column {i} does not decode: {e}"))
                    })
                };
                Ok(ScopeCounts {
                    scope: row.try_get(0).map_err(|e| {
                        StoreError::backend(format!("counts: the scope does not decode: {e}"))
                    })?,
                    in_progress: count(get(1)?),
                    stuck: count(get(2)?),
                    completed: count(get(3)?),
                    expired: count(get(4)?),
                    corrupt: count(get(5)?),
                })
            })
            .collect()
    }
}
