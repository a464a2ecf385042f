//! Records, leases and the outcomes of `acquire`.

use std::fmt;
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;

/// How long an in-progress record outlives its lease deadline when nobody
/// completes or releases it (its holder crashed). During this grace the key
/// can be taken over (its lease is over) while the record keeps its
/// fingerprint and attempt count, so a redelivery is still checked for a
/// mismatch and its handler is told that an earlier attempt may have run.
/// Every store uses the same value.
pub const IN_PROGRESS_GRACE: Duration = Duration::from_secs(24 * 60 * 60);

/// The longest lease or retention any store keeps: about 100 years.
/// Every store saturates longer durations (`Duration::MAX` included) to
/// this, so "forever" is accepted everywhere and no deadline overflows.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// `d`, capped at [`MAX_DURATION`]: what a store does with every lease and
/// retention it is given before computing a deadline.
pub fn saturate(d: Duration) -> Duration {
    d.min(MAX_DURATION)
}

/// The response that the executor records when the handler succeeded but
/// its result could not be recorded (it did not encode, the codec refused
/// it, the store refused its size): the key is completed, so the handler
/// never runs again for it, and every duplicate gets
/// [`IdemError::ResultUnavailable`](crate::IdemError::ResultUnavailable).
/// The bytes start with NUL, which no JSON text does; a reason in UTF-8
/// follows the marker.
pub const NOT_REPLAYABLE: &[u8] = b"\0idem:not-replayable\0";

/// The "not replayable" marker for `reason` (cut to 1 KiB, on a character
/// boundary): what a store records for a key whose handler ran but whose
/// result cannot be replayed.
pub fn not_replayable_marker(reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(1024);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut marker = NOT_REPLAYABLE.to_vec();
    marker.extend_from_slice(&reason.as_bytes()[..end]);
    marker
}

/// Whether a store with a response limit of `limit` bytes takes
/// `response`: one within the limit, or a "not replayable" marker
/// ([`not_replayable_marker`]: at most 1 KiB of reason), whatever the limit,
/// since it stands for a response that was too large.
pub fn within_response_limit(response: &[u8], limit: usize) -> bool {
    response.len() <= limit
        || (response.starts_with(NOT_REPLAYABLE) && response.len() <= NOT_REPLAYABLE.len() + 1024)
}

/// The reason recorded after [`NOT_REPLAYABLE`], if `response` is such a
/// marker.
pub fn not_replayable_reason(response: &[u8]) -> Option<String> {
    response
        .strip_prefix(NOT_REPLAYABLE)
        .map(|reason| String::from_utf8_lossy(reason).into_owned())
}

/// A fencing token: unique per acquisition, never reused for a key, even
/// after its record was released or expired. Every write after `acquire`
/// compares it with the stored one.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseToken(u128);

impl LeaseToken {
    /// Wraps a token value produced by a store.
    pub const fn from_u128(value: u128) -> Self {
        LeaseToken(value)
    }

    /// A random 128-bit token from the operating system's generator, for
    /// stores that make tokens on the client (no shared counter, so no hot
    /// key and nothing cross-slot in a cluster).
    ///
    /// The OS is asked for 4 KiB at a time per thread (one `getrandom` call
    /// per 256 tokens, not one per token: on the duplicate path that call
    /// was a measurable share of the client's time). The bytes are the
    /// OS generator's; none is handed out twice. A process that `fork`s
    /// without `exec` and goes on making tokens in both copies would
    /// repeat the rest of a buffer, as with any user-space random
    /// generator: don't run idem across such a fork.
    pub fn random() -> Self {
        use std::cell::RefCell;
        const POOL: usize = 4096;
        thread_local! {
            // (bytes, how many are used); starts empty.
            static BUFFER: RefCell<(Box<[u8; POOL]>, usize)> =
                RefCell::new((Box::new([0u8; POOL]), POOL));
        }
        let drawn = BUFFER.try_with(|cell| {
            let mut guard = cell.try_borrow_mut().ok()?;
            let (bytes, used) = &mut *guard;
            if *used + 16 > POOL {
                getrandom::fill(&mut bytes[..]).ok()?;
                *used = 0;
            }
            let mut token = [0u8; 16];
            token.copy_from_slice(&bytes[*used..*used + 16]);
            // Never handed out again, even if the next fill fails.
            bytes[*used..*used + 16].fill(0);
            *used += 16;
            Some(u128::from_be_bytes(token))
        });
        if let Ok(Some(token)) = drawn {
            return LeaseToken(token);
        }
        let mut bytes = [0u8; 16];
        if getrandom::fill(&mut bytes).is_err() {
            // The OS generator is unavailable (practically never on Linux):
            // fall back to a time- and counter-derived value, still unique
            // within this process.
            use std::sync::atomic::{AtomicU64, Ordering};
            static FALLBACK: AtomicU64 = AtomicU64::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default();
            let n = u128::from(FALLBACK.fetch_add(1, Ordering::Relaxed));
            return LeaseToken((nanos << 64) ^ n ^ u128::from(std::process::id()) << 32);
        }
        LeaseToken(u128::from_be_bytes(bytes))
    }

    /// The 16 big-endian bytes that stores persist.
    pub const fn to_bytes(&self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// Reads the 16-byte form; `None` for any other length.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        <[u8; 16]>::try_from(bytes)
            .ok()
            .map(|b| LeaseToken(u128::from_be_bytes(b)))
    }

    /// The token value.
    pub const fn as_u128(&self) -> u128 {
        self.0
    }

    /// The 32-character lowercase hex form that stores persist.
    pub fn to_hex(&self) -> String {
        format!("{:032x}", self.0)
    }

    /// Parses the hex form.
    pub fn from_hex(hex_str: &str) -> Option<Self> {
        if hex_str.is_empty() || hex_str.len() > 32 {
            return None;
        }
        u128::from_str_radix(hex_str, 16).ok().map(LeaseToken)
    }
}

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseToken({:032x})", self.0)
    }
}

impl fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Ownership of a key, returned by a successful `acquire` or `extend`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Lease {
    /// The key held.
    pub key: IdempotencyKey,
    /// The fencing token of this acquisition.
    pub token: LeaseToken,
    /// The fence of this acquisition: strictly greater than that of every
    /// earlier acquisition of the key, including those before a release, a
    /// delete or the record's expiry. Pass it to downstream systems that
    /// keep the highest fence seen per key, so a stale writer is refused.
    pub fence: u64,
    /// 1 for the first acquisition of the record, 2 after a takeover, ...
    /// Resets when the record goes away: not a fencing number.
    pub attempt: u32,
    /// When the lease runs out (store clock). Past it another worker may take
    /// the key over; until someone does, this lease still works.
    pub expires_at: SystemTime,
    /// The fingerprint stored with the record (the one given now, or the
    /// one kept from an earlier acquisition), so that layers above the store
    /// (a cache) can record it with the completion.
    pub fingerprint: Option<Fingerprint>,
}

impl Lease {
    /// Builds a lease (for store implementations); see
    /// [`with_fingerprint`](Self::with_fingerprint).
    pub fn new(
        key: IdempotencyKey,
        token: LeaseToken,
        attempt: u32,
        expires_at: SystemTime,
    ) -> Self {
        Lease {
            key,
            token,
            fence: 0,
            attempt,
            expires_at,
            fingerprint: None,
        }
    }

    /// Sets the acquisition's fence (every store must).
    pub fn with_fence(mut self, fence: u64) -> Self {
        self.fence = fence;
        self
    }

    /// Sets the record's stored fingerprint.
    pub fn with_fingerprint(mut self, fingerprint: Option<Fingerprint>) -> Self {
        self.fingerprint = fingerprint;
        self
    }
}

/// The state of a stored record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// A worker holds (or held, if the deadline passed) the key.
    InProgress {
        /// The lease deadline (store clock).
        lease_expires_at: SystemTime,
    },
    /// The handler's result was recorded.
    Completed {
        /// The encoded response.
        response: Bytes,
        /// When it was recorded (store clock).
        completed_at: SystemTime,
    },
}

/// A stored record, as [`get`](crate::IdempotencyStore::get) returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Record {
    /// The key.
    pub key: IdempotencyKey,
    /// In progress or completed.
    pub state: RecordState,
    /// The fingerprint stored at first acquisition, if the caller gave one.
    pub fingerprint: Option<Fingerprint>,
    /// The token of the latest acquisition.
    pub token: LeaseToken,
    /// The fence of the latest acquisition.
    pub fence: u64,
    /// The latest attempt number.
    pub attempt: u32,
    /// When the record was first acquired (store clock).
    pub created_at: SystemTime,
    /// When the record stops existing (store clock): completion time plus
    /// retention, or lease deadline plus [`IN_PROGRESS_GRACE`].
    pub expires_at: SystemTime,
}

impl Record {
    /// Builds a record (for store implementations).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        key: IdempotencyKey,
        state: RecordState,
        fingerprint: Option<Fingerprint>,
        token: LeaseToken,
        attempt: u32,
        created_at: SystemTime,
        expires_at: SystemTime,
    ) -> Self {
        Record {
            key,
            state,
            fingerprint,
            token,
            fence: 0,
            attempt,
            created_at,
            expires_at,
        }
    }

    /// Sets the fence of the latest acquisition.
    pub fn with_fence(mut self, fence: u64) -> Self {
        self.fence = fence;
        self
    }

    /// Whether the record is completed.
    pub fn is_completed(&self) -> bool {
        matches!(self.state, RecordState::Completed { .. })
    }
}

/// A completed record, as a duplicate `acquire` returns it for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CompletedRecord {
    /// The key.
    pub key: IdempotencyKey,
    /// The encoded response to replay.
    pub response: Bytes,
    /// The fingerprint stored with the record.
    pub fingerprint: Option<Fingerprint>,
    /// The attempt that completed it.
    pub attempt: u32,
    /// The fence of the acquisition that completed it. A cache keeps the
    /// entry with the highest fence, so a newer completion replaces an
    /// older one.
    pub fence: u64,
    /// When it was completed (store clock).
    pub completed_at: SystemTime,
    /// When it expires (store clock).
    pub expires_at: SystemTime,
    /// The time the record had left when the store answered, computed on
    /// the store's own clock: a cache keeps the entry no longer than this,
    /// whatever the application's clock says. Zero when the store does not
    /// say, and then nothing caches it.
    pub ttl: Duration,
}

impl CompletedRecord {
    /// Builds a completed record (for store implementations).
    pub fn new(
        key: IdempotencyKey,
        response: Bytes,
        fingerprint: Option<Fingerprint>,
        attempt: u32,
        completed_at: SystemTime,
        expires_at: SystemTime,
    ) -> Self {
        CompletedRecord {
            key,
            response,
            fingerprint,
            attempt,
            fence: 0,
            completed_at,
            expires_at,
            ttl: Duration::ZERO,
        }
    }

    /// Sets the fence of the acquisition that completed it.
    pub fn with_fence(mut self, fence: u64) -> Self {
        self.fence = fence;
        self
    }

    /// Sets the time left before the record expires, by the store's clock.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The reason the result was not recorded, if this record is the
    /// executor's "completed, result not replayable" marker.
    pub fn not_replayable(&self) -> Option<String> {
        not_replayable_reason(&self.response)
    }
}

/// The outcome of [`acquire`](crate::IdempotencyStore::acquire): every
/// case comes back in one round trip.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquisition {
    /// The caller owns the key: run the handler, then `complete` or
    /// `release` with this lease.
    Acquired(Lease),
    /// The key was completed: replay this response.
    Completed(CompletedRecord),
    /// Another worker holds a live lease on the key.
    InProgress {
        /// The holder's lease deadline (store clock).
        lease_expires_at: SystemTime,
        /// Time left on that lease, computed with the store's clock so that
        /// client clock skew does not matter.
        retry_after: Duration,
        /// The holder's attempt number.
        attempt: u32,
    },
    /// The key is live with a different fingerprint.
    Mismatch,
}

#[cfg(test)]
mod tests {
    use super::LeaseToken;
    use std::collections::HashSet;

    /// Tokens from the per-thread buffer, across several refills and
    /// threads, never repeat.
    #[test]
    fn random_tokens_never_repeat_across_refills_and_threads() {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| (0..5_000).map(|_| LeaseToken::random()).collect::<Vec<_>>())
            })
            .collect();
        let mut seen = HashSet::new();
        for t in threads {
            for token in t.join().unwrap_or_else(|_| panic!("thread panicked")) {
                assert!(seen.insert(token.as_u128()), "token {token:?} repeated");
            }
        }
        assert_eq!(seen.len(), 20_000);
    }
}
