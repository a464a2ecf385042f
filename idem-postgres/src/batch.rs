//! Batches: `acquire_many` and `complete_many` split into statements (a
//! key's later items into later statements), each statement run on one
//! connection with every guarantee of the single-key call.

use std::collections::HashMap;
use std::time::Duration;

use idem_core::{
    saturate, AcquireItem, Acquisition, IdempotencyKey, Lease, StoreError, IN_PROGRESS_GRACE,
};
use sqlx::{PgConnection, Row};
use tokio::time::Instant;

use crate::decode::{column, decode_acquire, Decoded};
use crate::error::Failure;
use crate::statements::{micros, sql, ACQUIRE_TRIES};
use crate::store::PgStore;

/// The responses one `complete_many` statement carries, in bytes, at most
/// (a larger response goes alone): a statement stays far below the
/// protocol's 1 GB message limit.
pub(crate) const BATCH_RESPONSE_BYTES: usize = 16 << 20;

impl PgStore {
    /// One statement of `acquire_many` on one connection: the items
    /// `batch` of `items` (keys unique), re-run for the items whose answer
    /// was a stale view or a lease a wait shortened, as `acquire_on` does
    /// for one key (the same tokens, the same time rule). Answers per
    /// item of `batch`, in its order. With `try_locks` (the first send of
    /// a batch of single calls, see `busy_back`), the keys' locks are only
    /// tried:
    /// an item whose key is locked elsewhere is answered
    /// [`send_alone`](idem_core::batching::send_alone) (nothing was done
    /// for it), and its caller sends it alone, to wait for its lock as
    /// `acquire` does.
    pub(crate) async fn acquire_many_on(
        &self,
        conn: &mut PgConnection,
        items: &[AcquireItem<'_>],
        batch: &[usize],
        tokens: &[[u8; 16]],
        lease: Duration,
        sending: Sending,
    ) -> Result<Vec<Result<Acquisition, StoreError>>, Failure> {
        let Sending { send_by, try_locks } = sending;
        let lease = saturate(lease);
        let lease_us = micros(lease);
        let grace_us = micros(IN_PROGRESS_GRACE);
        let mut out: Vec<Option<Result<Acquisition, StoreError>>> =
            batch.iter().map(|_| None).collect();
        let mut renewed = vec![false; batch.len()];
        // Per item still to run: what to answer if a re-run is too late
        // to send (a lease a wait shortened, with some of it left).
        let mut late: Vec<Option<Acquisition>> = batch.iter().map(|_| None).collect();
        let mut pending: Vec<usize> = (0..batch.len()).collect();
        for run in 0..ACQUIRE_TRIES {
            if pending.is_empty() {
                break;
            }
            if run > 0 && Instant::now() >= send_by {
                for &p in &pending {
                    out[p] = Some(match late[p].take() {
                        Some(shortened) => Ok(shortened),
                        None => Err(StoreError::Unavailable(
                            format!(
                                "acquire of {} must run again (a concurrent commit) but too \
                                 little of the call is left to send it; nothing was written",
                                items[batch[p]].key
                            )
                            .into(),
                        )),
                    });
                }
                pending.clear();
                break;
            }
            let sent: Vec<&AcquireItem<'_>> = pending.iter().map(|&p| &items[batch[p]]).collect();
            let scopes: Vec<&str> = sent.iter().map(|i| i.key.scope()).collect();
            let keys: Vec<&str> = sent.iter().map(|i| i.key.id()).collect();
            let prints: Vec<Option<&[u8]>> = sent
                .iter()
                .map(|i| i.fingerprint.map(|f| f.as_bytes().as_slice()))
                .collect();
            let sent_tokens: Vec<&[u8]> = pending
                .iter()
                .map(|&p| tokens[batch[p]].as_slice())
                .collect();
            let rows = sqlx::query(sql(&self.inner.sql.acquire_many))
                .bind(scopes)
                .bind(keys)
                .bind(prints)
                .bind(sent_tokens)
                .bind(lease_us)
                .bind(grace_us)
                // Only the first run: a re-run is for items this
                // statement may have written (a lease a wait shortened),
                // which must come back to this call, not go alone.
                .bind(try_locks && run == 0)
                .fetch_all(&mut *conn)
                .await?;
            let mut again = vec![true; pending.len()];
            for row in &rows {
                let ord: i64 = row.try_get(13).map_err(|e| {
                    Failure::Store(StoreError::backend(format!(
                        "acquire_many: the item position does not decode: {e}"
                    )))
                })?;
                let Some(j) = usize::try_from(ord - 1).ok().filter(|j| *j < pending.len()) else {
                    return Err(Failure::Store(StoreError::backend(format!(
                        "acquire_many: a row for item {ord} of {}",
                        pending.len()
                    ))));
                };
                if !again[j] {
                    continue;
                }
                again[j] = false;
                let p = pending[j];
                let item = &items[batch[p]];
                if row.try_get::<bool, _>(14).unwrap_or(false) {
                    out[p] = Some(Err(idem_core::batching::send_alone(
                        "its key is locked by another transaction",
                    )));
                    continue;
                }
                // NULL: no visible row and nothing written (a stale view).
                let acquired: Option<bool> = match column(row, 0, item.key) {
                    Ok(a) => a,
                    Err(e) => {
                        out[p] = Some(Err(e));
                        continue;
                    }
                };
                if acquired.is_none() {
                    late[p] = None;
                    again[j] = true;
                    continue;
                }
                match decode_acquire(row, item.key, item.fingerprint, lease, renewed[p]) {
                    Ok(Decoded::Done(outcome)) => out[p] = Some(Ok(outcome)),
                    Ok(Decoded::Stale) => {
                        late[p] = None;
                        again[j] = true;
                    }
                    Ok(Decoded::Renew(shortened)) => {
                        renewed[p] = true;
                        late[p] = shortened.map(Acquisition::Acquired);
                        again[j] = true;
                    }
                    Err(e) => out[p] = Some(Err(e)),
                }
            }
            pending = pending
                .iter()
                .zip(&again)
                .filter(|(_, again)| **again)
                .map(|(&p, _)| p)
                .collect();
        }
        let out = out
            .into_iter()
            .enumerate()
            .map(|(p, outcome)| {
                outcome.unwrap_or_else(|| {
                    Err(StoreError::Unavailable(
                        format!(
                            "acquire of {} saw the record change {ACQUIRE_TRIES} times in a row; \
                             try again",
                            items[batch[p]].key
                        )
                        .into(),
                    ))
                })
            })
            .collect();
        Ok(out)
    }

    /// One statement of `complete_many` on one connection: the items
    /// `batch` of `items` (keys unique). Whether each completed, in the
    /// order of `batch`.
    pub(crate) async fn complete_many_on(
        &self,
        conn: &mut PgConnection,
        items: &[(&Lease, &[u8])],
        batch: &[usize],
        retention: Duration,
    ) -> Result<Vec<bool>, Failure> {
        let scopes: Vec<&str> = batch.iter().map(|&i| items[i].0.key.scope()).collect();
        let keys: Vec<&str> = batch.iter().map(|&i| items[i].0.key.id()).collect();
        let tokens: Vec<[u8; 16]> = batch.iter().map(|&i| items[i].0.token.to_bytes()).collect();
        let tokens: Vec<&[u8]> = tokens.iter().map(|t| t.as_slice()).collect();
        let responses: Vec<&[u8]> = batch.iter().map(|&i| items[i].1).collect();
        let done: Vec<i64> = sqlx::query_scalar(sql(&self.inner.sql.complete_many))
            .bind(scopes)
            .bind(keys)
            .bind(tokens)
            .bind(responses)
            .bind(micros(retention))
            .fetch_all(&mut *conn)
            .await?;
        let mut completed = vec![false; batch.len()];
        for ord in done {
            match usize::try_from(ord - 1)
                .ok()
                .and_then(|j| completed.get_mut(j))
            {
                Some(slot) => *slot = true,
                None => {
                    return Err(Failure::Store(StoreError::backend(format!(
                        "complete_many: a row for item {ord} of {}",
                        batch.len()
                    ))))
                }
            }
        }
        Ok(completed)
    }
}

/// How one `acquire_many` statement is sent: re-runs only before
/// `send_by`; with `try_locks`, its keys' locks only tried (see
/// [`PgStore::acquire_many_on`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sending {
    pub(crate) send_by: Instant,
    pub(crate) try_locks: bool,
}

/// The error of a batch item whose statement was not sent because an
/// earlier statement of the batch failed (`e`): nothing was written for
/// it, so it is retryable whatever `e` was (as the trait's default loop
/// answers), never `e` itself, which is another statement's verdict (a
/// non-retryable one would have the executor give up on the item).
pub(crate) fn not_sent(e: &StoreError) -> StoreError {
    StoreError::unavailable(format!(
        "not sent: an earlier statement of the batch failed ({e}); nothing was written"
    ))
}

/// Splits the items `0..n` of a batch into statements, in order: a key
/// goes into a later statement than its earlier items (so each sees their
/// effect, as calls in order would, and no statement meets a row twice),
/// else into the first statement with room: at most `cap` items and
/// `max_weight` of `weight` (a heavier item goes alone).
pub(crate) fn plan_statements<'k>(
    keys: impl Iterator<Item = (usize, &'k IdempotencyKey)>,
    weight: impl Fn(usize) -> usize,
    cap: usize,
    max_weight: usize,
) -> Vec<Vec<usize>> {
    let cap = cap.max(1);
    let mut statements: Vec<(Vec<usize>, usize)> = Vec::new();
    let mut next_for: HashMap<&'k IdempotencyKey, usize> = HashMap::new();
    // Statements before this one are full.
    let mut open_from = 0;
    for (i, key) in keys {
        let w = weight(i);
        let mut s = next_for.get(key).copied().unwrap_or(0).max(open_from);
        loop {
            if s == statements.len() {
                statements.push((Vec::new(), 0));
            }
            let (items, total) = &statements[s];
            if items.is_empty() || (items.len() < cap && total.saturating_add(w) <= max_weight) {
                break;
            }
            s += 1;
        }
        let (items, total) = &mut statements[s];
        items.push(i);
        *total = total.saturating_add(w);
        next_for.insert(key, s + 1);
        while statements
            .get(open_from)
            .is_some_and(|(items, _)| items.len() >= cap)
        {
            open_from += 1;
        }
    }
    statements.into_iter().map(|(items, _)| items).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test_key(id: &str) -> IdempotencyKey {
        IdempotencyKey::new("plan", id).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn batches_are_planned_in_order_with_unique_keys_per_statement() {
        let (a, b, c) = (test_key("a"), test_key("b"), test_key("c"));
        // a b a c a b: a's items in statements 0, 1, 2; b's in 0, 1.
        let keys = [&a, &b, &a, &c, &a, &b];
        let plan = plan_statements(keys.iter().copied().enumerate(), |_| 0, 256, usize::MAX);
        assert_eq!(plan, vec![vec![0, 1, 3], vec![2, 5], vec![4]]);
        // A cap of 2 items.
        let plan = plan_statements(keys.iter().copied().enumerate(), |_| 0, 2, usize::MAX);
        assert_eq!(plan, vec![vec![0, 1], vec![2, 3], vec![4, 5]]);
        for statement in &plan {
            let unique: std::collections::HashSet<_> = statement.iter().map(|&i| keys[i]).collect();
            assert_eq!(unique.len(), statement.len());
        }
        // Weights: an item heavier than the limit goes alone.
        let distinct: Vec<IdempotencyKey> = (0..4).map(|i| test_key(&i.to_string())).collect();
        let weights = [5, 20, 5, 5];
        let plan = plan_statements(distinct.iter().enumerate(), |i| weights[i], 256, 10);
        assert_eq!(plan, vec![vec![0, 2], vec![1], vec![3]]);
        // One key 10,000 times: 10,000 statements, in order; nothing at all:
        // no statement.
        let many = plan_statements((0..10_000).map(|i| (i, &a)), |_| 0, 256, usize::MAX);
        assert_eq!(many.len(), 10_000);
        assert!(many.iter().enumerate().all(|(i, s)| s == &vec![i]));
        assert!(plan_statements(std::iter::empty(), |_| 0, 256, usize::MAX).is_empty());
        // A cap of zero is taken as one.
        assert_eq!(
            plan_statements(keys.iter().copied().enumerate(), |_| 0, 0, 0).len(),
            6
        );
    }
}
