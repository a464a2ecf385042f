//! Decoding the statements' rows into the store's answers: a column of
//! the wrong type or an impossible value is [`StoreError::Corrupt`].

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use idem_core::{
    Acquisition, CompletedRecord, Fingerprint, IdempotencyKey, Lease, LeaseToken, Record,
    RecordState, StoreError,
};
use sqlx::postgres::PgRow;
use sqlx::Row;

pub(crate) fn fence_of(fence: i64, key: &IdempotencyKey) -> Result<u64, StoreError> {
    u64::try_from(fence).map_err(|_| corrupt(key, format!("fence {fence} is negative")))
}

fn corrupt(key: &IdempotencyKey, detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        key: key.clone(),
        detail: detail.into(),
    }
}

pub(crate) fn column<'r, T>(
    row: &'r PgRow,
    index: usize,
    key: &IdempotencyKey,
) -> Result<T, StoreError>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    row.try_get(index)
        .map_err(|e| corrupt(key, format!("column {index} does not decode: {e}")))
}

pub(crate) fn time_of(
    us: Option<i64>,
    key: &IdempotencyKey,
    what: &str,
) -> Result<SystemTime, StoreError> {
    match us {
        Some(us) if us >= 0 => Ok(UNIX_EPOCH + Duration::from_micros(us as u64)),
        Some(us) => Err(corrupt(key, format!("{what} is before 1970 ({us} µs)"))),
        None => Err(corrupt(key, format!("{what} is missing"))),
    }
}

pub(crate) fn attempt_of(attempt: i32, key: &IdempotencyKey) -> Result<u32, StoreError> {
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
pub(crate) enum Decoded {
    Done(Acquisition),
    /// The row was a stale view (see acquire.sql): run again.
    Stale,
    /// Acquired, but a wait shortened the lease: run again with the same
    /// token, which renews it from the server's clock. With the lease as
    /// written if any of it is left.
    Renew(Option<Lease>),
}

/// Decodes the acquire statement's row for a call that asked for `lease`
/// (zero: the in-transaction mode), `renewed` if it already renewed once.
pub(crate) fn decode_acquire(
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
                let shortened = if left.is_zero() {
                    None
                } else {
                    let stored = fingerprint_of(column(row, 2, key)?, key)?;
                    Some(
                        Lease::new(key.clone(), token_of(row)?, attempt, until)
                            .with_fence(fence)
                            .with_fingerprint(stored),
                    )
                };
                return Ok(Decoded::Renew(shortened));
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

pub(crate) fn decode_record(
    row: &PgRow,
    key: &IdempotencyKey,
) -> Result<Option<Record>, StoreError> {
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
