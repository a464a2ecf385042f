//! The [`IdempotencyStore`] operations of [`PgStore`], and the statements
//! that run them on one connection (shared with the in-transaction mode).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    saturate, AcquireItem, Acquisition, Fingerprint, IdempotencyKey, IdempotencyStore, Lease,
    LeaseToken, Record, StoreError, IN_PROGRESS_GRACE,
};
use sqlx::PgConnection;
use tokio::time::Instant;

use crate::batch::{not_sent, plan_statements, Sending, BATCH_RESPONSE_BYTES};
#[cfg(doc)]
use crate::builder::PgStoreBuilder;
use crate::decode::{
    attempt_of, column, decode_acquire, decode_record, fence_of, time_of, Decoded,
};
use crate::error::Failure;
use crate::statements::{micros, sql, ACQUIRE_TRIES};
use crate::store::PgStore;
use crate::store::Resend;

/// Rows deleted per statement by `purge_expired`.
const PURGE_BATCH: usize = 1_000;

impl PgStore {
    /// The acquire statement on one connection, re-run while a concurrent
    /// commit was invisible to it, or while the lease it got was shortened
    /// by a wait (then renewed: same token).
    ///
    /// A re-run is sent only before `send_by` (the same rule as the call's
    /// first send: the server's timeout must fire before the client gives
    /// up; `None` in the in-transaction mode, whose caller owns the
    /// transaction). Past it: a run that wrote nothing (a stale view) ends
    /// in `Unavailable`; a reservation whose lease a wait shortened is
    /// handed out as it is if any of its lease is left, else `Unavailable`
    /// (its lease is over: anyone may take the key over).
    pub(crate) async fn acquire_on(
        &self,
        conn: &mut PgConnection,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
        token: LeaseToken,
        send_by: Option<Instant>,
    ) -> Result<Acquisition, Failure> {
        let lease = saturate(lease);
        let lease_us = micros(lease);
        let grace_us = micros(IN_PROGRESS_GRACE);
        let fp = fingerprint.map(|f| f.as_bytes().as_slice());
        let token_bytes = token.to_bytes();
        let mut renewed = false;
        // What to answer if a re-run is due but too late to send.
        let mut late = None;
        for _ in 0..ACQUIRE_TRIES {
            if let Some(late) = late.take() {
                if send_by.is_some_and(|by| Instant::now() >= by) {
                    return match late {
                        Some(shortened) => Ok(shortened),
                        None => Err(Failure::Store(StoreError::Unavailable(
                            format!(
                                "acquire of {key} must run again (a concurrent commit) but too \
                                 little of the call is left to send it; nothing was written"
                            )
                            .into(),
                        ))),
                    };
                }
            }
            let row = sqlx::query(sql(&self.inner.sql.acquire))
                .bind(key.scope())
                .bind(key.id())
                .bind(fp)
                .bind(token_bytes.as_slice())
                .bind(lease_us)
                .bind(grace_us)
                .fetch_optional(&mut *conn)
                .await?;
            // A stale view wrote nothing (no row from `fresh` or `taken`).
            let Some(row) = row else {
                late = Some(None);
                continue;
            };
            match decode_acquire(&row, key, fingerprint, lease, renewed)? {
                Decoded::Done(outcome) => return Ok(outcome),
                Decoded::Stale => late = Some(None),
                Decoded::Renew(shortened) => {
                    renewed = true;
                    late = Some(shortened.map(Acquisition::Acquired));
                }
            }
        }
        Err(Failure::Store(StoreError::Unavailable(
            format!(
                "acquire of {key} saw the record change {ACQUIRE_TRIES} times in a row; try again"
            )
            .into(),
        )))
    }

    pub(crate) async fn complete_on(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), Failure> {
        let token = lease.token.to_bytes();
        let done = sqlx::query(sql(&self.inner.sql.complete))
            .bind(lease.key.scope())
            .bind(lease.key.id())
            .bind(token.as_slice())
            .bind(response)
            .bind(micros(retention))
            .execute(&mut *conn)
            .await?;
        if done.rows_affected() == 1 {
            Ok(())
        } else {
            Err(Failure::Store(StoreError::LeaseLost))
        }
    }

    pub(crate) async fn release_on(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
    ) -> Result<(), Failure> {
        let token = lease.token.to_bytes();
        let done = sqlx::query(sql(&self.inner.sql.release))
            .bind(lease.key.scope())
            .bind(lease.key.id())
            .bind(token.as_slice())
            .execute(&mut *conn)
            .await?;
        if done.rows_affected() == 1 {
            Ok(())
        } else {
            Err(Failure::Store(StoreError::LeaseLost))
        }
    }

    pub(crate) fn check_response_size(&self, response: &[u8]) -> Result<(), StoreError> {
        if !idem_core::within_response_limit(response, self.inner.max_response_bytes) {
            return Err(StoreError::ResponseTooLarge {
                size: response.len(),
                limit: self.inner.max_response_bytes,
            });
        }
        Ok(())
    }
}

// A call whose connection failed (fresh or reused; the statement may or may
// not have run) is sent once more on a fresh connection (`PgStore::run`),
// within the same time rule, because these statements answer the same
// when sent twice:
// - acquire: the same token; a reservation that the first send made is
//   this call's own and comes back as acquired (renewed), not "in
//   progress";
// - complete: completing again with the token that completed the row
//   matches and changes nothing;
// - extend: renews from the server's clock again;
// - release: the token no longer holds the key (`LeaseLost`): true, since
//   the first send released it;
// - get, purge: read, or delete expired rows in bounded batches.
// Except `delete`, which has no token: sent again, it would delete whatever
// holds the key then (a reservation made after the first send deleted the
// record: a second run of a live handler). A connection failure of delete
// is `Unavailable`; the delete may or may not have happened.

#[async_trait]
impl IdempotencyStore for PgStore {
    fn backend_name(&self) -> &'static str {
        "postgres"
    }

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
        let alone = async {
            // One token for the whole call, re-runs and a resend included.
            let token = LeaseToken::random();
            // The call's own rule for sending (see `PgStore::run`), for re-runs.
            let send_by = Instant::now() + self.inner.timeouts.send_by;
            self.call(|conn, _| {
                Box::pin(self.acquire_on(conn, key, fingerprint, lease, token, Some(send_by)))
            })
            .await
        };
        // Batched, a busy key comes back to be sent alone (`alone`).
        let batched = PgStore {
            inner: self.inner.clone(),
            busy_back: true,
        };
        self.inner
            .batcher
            .acquire(&batched, key, fingerprint, lease, alone)
            .await
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.check_response_size(response)?;
        let alone =
            self.call(|conn, _| Box::pin(self.complete_on(conn, lease, response, retention)));
        self.inner
            .batcher
            .complete(self, lease, response, retention, alone)
            .await
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        self.call(|conn, _| Box::pin(self.release_on(conn, lease)))
            .await
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        // Refused here, before the round trip: the lease stays as it was.
        if lease_for.is_zero() {
            return Err(StoreError::zero_lease());
        }
        let lease_us = micros(lease_for);
        let grace_us = micros(IN_PROGRESS_GRACE);
        self.call(|conn, _| {
            Box::pin(async move {
                let token = lease.token.to_bytes();
                let row = sqlx::query(sql(&self.inner.sql.extend))
                    .bind(lease.key.scope())
                    .bind(lease.key.id())
                    .bind(token.as_slice())
                    .bind(lease_us)
                    .bind(grace_us)
                    .fetch_optional(&mut *conn)
                    .await?;
                let Some(row) = row else {
                    return Err(Failure::Store(StoreError::LeaseLost));
                };
                let key = &lease.key;
                let attempt = attempt_of(column(&row, 0, key)?, key)?;
                let until = time_of(column(&row, 1, key)?, key, "lease_until")?;
                let fence = fence_of(column(&row, 2, key)?, key)?;
                Ok(Lease::new(key.clone(), lease.token, attempt, until)
                    .with_fence(fence)
                    .with_fingerprint(lease.fingerprint))
            })
        })
        .await
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.call(|conn, _| {
            Box::pin(async move {
                let row = sqlx::query(sql(&self.inner.sql.get))
                    .bind(key.scope())
                    .bind(key.id())
                    .fetch_optional(&mut *conn)
                    .await?;
                match row {
                    Some(row) => Ok(decode_record(&row, key)?),
                    None => Ok(None),
                }
            })
        })
        .await
    }

    async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        // Never resent: a second send would delete a reservation made after
        // the first one did its work (see the note above).
        self.run(Resend::Never, |conn, _| {
            Box::pin(async move {
                let live: Option<bool> = sqlx::query_scalar(sql(&self.inner.sql.delete))
                    .bind(key.scope())
                    .bind(key.id())
                    .fetch_optional(&mut *conn)
                    .await?;
                Ok(live.unwrap_or(false))
            })
        })
        .await
    }

    async fn purge_expired(&self, max: usize) -> Result<u64, StoreError> {
        let mut purged = 0u64;
        while (purged as usize) < max {
            let batch = (max - purged as usize).min(PURGE_BATCH);
            let done = self
                .call(|conn, _| {
                    Box::pin(async move {
                        let done = sqlx::query(sql(&self.inner.sql.purge))
                            .bind(batch as i64)
                            .execute(&mut *conn)
                            .await?;
                        Ok(done.rows_affected())
                    })
                })
                .await?;
            purged += done;
            if (done as usize) < batch {
                break;
            }
        }
        Ok(purged)
    }

    /// One statement (`sql/acquire_many.sql`) for up to
    /// [`PgStoreBuilder::batch_statement`] items, each answered as
    /// `acquire` would; a key's later items in the batch go into later
    /// statements. Every statement is a call of its own (the time rule,
    /// the resend on a connection failure: each item keeps its token). If
    /// the first statement fails, the call fails; if a later one does, its
    /// items get the error, the items of the statements after it (not
    /// sent: nothing written) a retryable `Unavailable`, and the items
    /// before keep their answers. The advisory locks of a statement's keys are taken
    /// in one order, so two batches that share keys queue instead of
    /// deadlocking; a key held in a long transaction (an in-transaction
    /// claim) holds up its whole statement, up to the server's
    /// `lock_timeout`. (The store's own batches of single calls, see
    /// [`PgStoreBuilder::batching`], only try the locks: a held key goes
    /// back to its caller, which waits for it alone.)
    async fn acquire_many(
        &self,
        items: &[AcquireItem<'_>],
        lease: Duration,
    ) -> Result<Vec<Result<Acquisition, StoreError>>, StoreError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        if lease.is_zero() {
            return Err(StoreError::zero_lease());
        }
        // One token per item for the whole call, re-runs and resends included.
        let tokens: Vec<[u8; 16]> = items
            .iter()
            .map(|_| LeaseToken::random().to_bytes())
            .collect();
        let statements = plan_statements(
            items.iter().map(|i| i.key).enumerate(),
            |_| 0,
            self.inner.batch_statement,
            usize::MAX,
        );
        let mut results: Vec<Option<Result<Acquisition, StoreError>>> =
            items.iter().map(|_| None).collect();
        let mut failed: Option<StoreError> = None;
        for (n, batch) in statements.iter().enumerate() {
            if let Some(e) = &failed {
                for &i in batch {
                    results[i] = Some(Err(not_sent(e)));
                }
                continue;
            }
            let send_by = Instant::now() + self.inner.timeouts.send_by;
            // A batch of single calls tries its keys' locks on its first
            // send only: a resend after a lost reply (the same tokens) may
            // find the reservations the first send made, and must wait for
            // them to come back to their callers, as a single call's
            // resend does.
            let sends = AtomicBool::new(self.busy_back);
            let answered = self
                .call(|conn, _| {
                    let try_locks = sends.swap(false, Ordering::Relaxed);
                    let sending = Sending { send_by, try_locks };
                    Box::pin(self.acquire_many_on(conn, items, batch, &tokens, lease, sending))
                })
                .await;
            match answered {
                Ok(outcomes) => {
                    for (&i, outcome) in batch.iter().zip(outcomes) {
                        results[i] = Some(outcome);
                    }
                }
                Err(e) if n == 0 => return Err(e),
                Err(e) => {
                    for &i in batch {
                        results[i] = Some(Err(e.replicate()));
                    }
                    failed = Some(e);
                }
            }
        }
        Ok(results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(StoreError::backend("acquire_many: an item was not planned"))
                })
            })
            .collect())
    }

    /// One statement (`sql/complete_many.sql`) for up to
    /// [`PgStoreBuilder::batch_statement`] items and 16 MiB of responses
    /// (a larger response goes alone); a key's later items go into later
    /// statements. A response over `max_response_bytes` is that item's
    /// [`StoreError::ResponseTooLarge`], not sent. Failures are reported
    /// as in [`acquire_many`](Self::acquire_many).
    async fn complete_many(
        &self,
        items: &[(&Lease, &[u8])],
        retention: Duration,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let mut results: Vec<Option<Result<(), StoreError>>> = items
            .iter()
            .map(|(_, response)| self.check_response_size(response).err().map(Err))
            .collect();
        let statements = plan_statements(
            items
                .iter()
                .enumerate()
                .filter(|(i, _)| results[*i].is_none())
                .map(|(i, (lease, _))| (i, &lease.key)),
            |i| items[i].1.len(),
            self.inner.batch_statement,
            BATCH_RESPONSE_BYTES,
        );
        let mut failed: Option<StoreError> = None;
        for (n, batch) in statements.iter().enumerate() {
            if let Some(e) = &failed {
                for &i in batch {
                    results[i] = Some(Err(not_sent(e)));
                }
                continue;
            }
            let answered = self
                .call(|conn, _| Box::pin(self.complete_many_on(conn, items, batch, retention)))
                .await;
            match answered {
                Ok(completed) => {
                    for (&i, done) in batch.iter().zip(completed) {
                        results[i] = Some(if done {
                            Ok(())
                        } else {
                            Err(StoreError::LeaseLost)
                        });
                    }
                }
                Err(e) if n == 0 => return Err(e),
                Err(e) => {
                    for &i in batch {
                        results[i] = Some(Err(e.replicate()));
                    }
                    failed = Some(e);
                }
            }
        }
        Ok(results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(StoreError::backend(
                        "complete_many: an item was not planned",
                    ))
                })
            })
            .collect())
    }
}
