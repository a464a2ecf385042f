//! Script replies and stored records decoded into idem-core's types; a
//! record that does not decode is `Corrupt`, a reply of another shape an
//! [`UnexpectedReply`](crate::error::UnexpectedReply).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use idem_core::{
    Acquisition, CompletedRecord, Fingerprint, IdempotencyKey, Lease, LeaseToken, Record,
    RecordState, StoreError,
};
use redis::Value;

use crate::error::{corrupt, unexpected};
use crate::format;

pub(crate) fn int(v: &Value, key: &IdempotencyKey) -> Result<i64, StoreError> {
    match v {
        Value::Int(n) => Ok(*n),
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt(key, "a number field is not a number")),
        other => Err(unexpected(format!("expected a number, got {other:?}"))),
    }
}

fn bytes_of(v: Value) -> Result<Vec<u8>, StoreError> {
    match v {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.into_bytes()),
        other => Err(unexpected(format!("expected a string, got {other:?}"))),
    }
}

pub(crate) fn time_of(ms: i64, key: &IdempotencyKey) -> Result<SystemTime, StoreError> {
    u64::try_from(ms)
        .map(|ms| UNIX_EPOCH + Duration::from_millis(ms))
        .map_err(|_| corrupt(key, format!("time {ms} ms is before 1970")))
}

/// A stored time in ms (decoded as u64, at most 2^53 - 1: no overflow).
fn time_ms(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

pub(crate) fn fence_of(n: i64, key: &IdempotencyKey) -> Result<u64, StoreError> {
    u64::try_from(n).map_err(|_| corrupt(key, format!("fence {n} is negative")))
}

pub(crate) fn attempt_of(a: i64, key: &IdempotencyKey) -> Result<u32, StoreError> {
    u32::try_from(a)
        .ok()
        .filter(|a| *a > 0)
        .ok_or_else(|| corrupt(key, format!("attempt {a} is not positive")))
}

fn fingerprint_of(b: &[u8], key: &IdempotencyKey) -> Result<Option<Fingerprint>, StoreError> {
    if b.is_empty() {
        return Ok(None);
    }
    Fingerprint::from_slice(b)
        .map(Some)
        .ok_or_else(|| corrupt(key, format!("fingerprint is {} bytes, not 32", b.len())))
}

pub(crate) fn decode_acquire(
    reply: Value,
    key: &IdempotencyKey,
    token: LeaseToken,
) -> Result<Acquisition, StoreError> {
    let Value::Array(items) = reply else {
        return Err(unexpected(format!("acquire returned {reply:?}")));
    };
    let mut items = items.into_iter();
    let tag = items.next().map(bytes_of).transpose()?.unwrap_or_default();
    let rest: Vec<Value> = items.collect();
    match (tag.as_slice(), rest.len()) {
        (b"acquired", 4) => {
            let attempt = attempt_of(int(&rest[0], key)?, key)?;
            let until = time_of(int(&rest[1], key)?, key)?;
            let fence = fence_of(int(&rest[3], key)?, key)?;
            let stored = rest
                .into_iter()
                .nth(2)
                .map(bytes_of)
                .transpose()?
                .unwrap_or_default();
            Ok(Acquisition::Acquired(
                Lease::new(key.clone(), token, attempt, until)
                    .with_fence(fence)
                    .with_fingerprint(fingerprint_of(&stored, key)?),
            ))
        }
        (b"completed", 2) => {
            let mut rest = rest.into_iter();
            let raw = match rest.next() {
                Some(Value::BulkString(b)) => Bytes::from(b),
                other => return Err(unexpected(format!("acquire returned a record {other:?}"))),
            };
            // Time left by the server's clock (its PTTL, or expiry minus TIME).
            let ttl = match rest.next() {
                Some(v) => Duration::from_millis(u64::try_from(int(&v, key)?).unwrap_or(0)),
                None => Duration::ZERO,
            };
            replay(raw, key, |_| ttl)
        }
        (b"in_progress", 3) => {
            let until_ms = int(&rest[0], key)?;
            let attempt = attempt_of(int(&rest[1], key)?, key)?;
            let now_ms = int(&rest[2], key)?;
            Ok(Acquisition::InProgress {
                lease_expires_at: time_of(until_ms, key)?,
                retry_after: Duration::from_millis(until_ms.saturating_sub(now_ms).max(0) as u64),
                attempt,
            })
        }
        (b"mismatch", 0) => Ok(Acquisition::Mismatch),
        (b"corrupt", 1) => {
            let detail = rest
                .into_iter()
                .next()
                .map(bytes_of)
                .transpose()?
                .unwrap_or_default();
            Err(corrupt(key, String::from_utf8_lossy(&detail).into_owned()))
        }
        (tag, n) => Err(unexpected(format!(
            "acquire returned {:?} with {n} values",
            String::from_utf8_lossy(tag)
        ))),
    }
}

/// The server's clock as an `acquire_many.lua` reply starts with it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BatchClock {
    /// TIME in ms: the batch's leases start there.
    pub(crate) now_ms: u64,
    /// TIME in µs: the fence of a key acquired while absent.
    pub(crate) now_us: u64,
}

impl BatchClock {
    /// The first two values of an `acquire_many.lua` reply.
    pub(crate) fn of(now_ms: &Value, now_us: &Value) -> Result<Self, StoreError> {
        let n = |v: &Value| match v {
            Value::Int(n) => u64::try_from(*n).ok(),
            _ => None,
        };
        match (n(now_ms), n(now_us)) {
            (Some(now_ms), Some(now_us)) => Ok(Self { now_ms, now_us }),
            _ => Err(unexpected(format!(
                "acquire_many returned the time {now_ms:?}, {now_us:?}"
            ))),
        }
    }
}

/// One key's answer in an `acquire_many.lua` reply (see the script): the
/// bare record of a replay with its time left (`ttl`, the value after it),
/// 1 for a key acquired while absent (attempt 1, the lease from the
/// batch's clock, the request's fingerprint), or a table as
/// `acquire.lua`'s.
pub(crate) fn decode_batch_acquire(
    reply: Value,
    ttl: Option<Value>,
    key: &IdempotencyKey,
    token: LeaseToken,
    fingerprint: Option<&Fingerprint>,
    lease_ms: u64,
    clock: BatchClock,
) -> Result<Acquisition, StoreError> {
    match reply {
        Value::BulkString(raw) => {
            let ttl = match ttl {
                Some(v) => Duration::from_millis(u64::try_from(int(&v, key)?).unwrap_or(0)),
                None => {
                    return Err(unexpected(
                        "acquire_many replayed a record without its time left".into(),
                    ))
                }
            };
            replay(Bytes::from(raw), key, |_| ttl)
        }
        Value::Int(1) => Ok(Acquisition::Acquired(
            Lease::new(
                key.clone(),
                token,
                1,
                time_ms(clock.now_ms.saturating_add(lease_ms)),
            )
            .with_fence(clock.now_us)
            .with_fingerprint(fingerprint.copied()),
        )),
        other => decode_acquire(other, key, token),
    }
}

/// A completed record as stored, replayed with the time `ttl_of` gives it
/// (from its expiry in ms) by the server's clock.
pub(crate) fn replay(
    raw: Bytes,
    key: &IdempotencyKey,
    ttl_of: impl FnOnce(u64) -> Duration,
) -> Result<Acquisition, StoreError> {
    let stored = format::decode(raw).map_err(|detail| corrupt(key, detail))?;
    if !stored.completed {
        return Err(unexpected("acquire replayed a record in progress".into()));
    }
    Ok(Acquisition::Completed(
        CompletedRecord::new(
            key.clone(),
            stored.response,
            stored.fingerprint.map(Fingerprint::from_array),
            stored.attempt,
            time_ms(stored.completed_ms),
            time_ms(stored.expires_ms),
        )
        .with_fence(stored.fence)
        .with_ttl(ttl_of(stored.expires_ms)),
    ))
}

pub(crate) fn decode_record(raw: Bytes, key: &IdempotencyKey) -> Result<Record, StoreError> {
    let stored = format::decode(raw).map_err(|detail| corrupt(key, detail))?;
    let state = if stored.completed {
        RecordState::Completed {
            response: stored.response,
            completed_at: time_ms(stored.completed_ms),
        }
    } else {
        RecordState::InProgress {
            lease_expires_at: time_ms(stored.lease_until_ms),
        }
    };
    Ok(Record::new(
        key.clone(),
        state,
        stored.fingerprint.map(Fingerprint::from_array),
        LeaseToken::from_u128(u128::from_be_bytes(stored.token)),
        stored.attempt,
        time_ms(stored.created_ms),
        time_ms(stored.expires_ms),
    )
    .with_fence(stored.fence))
}
