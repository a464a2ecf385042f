//! `acquire`: a conditional `PutItem` for a fresh key; on a refusal, the
//! stored item says the answer (completed, in progress, mismatch) or a
//! takeover conditioned on its revision.

use std::collections::HashMap;
use std::time::Duration;

use idem_core::{
    Acquisition, CompletedRecord, Fingerprint, IdempotencyKey, Lease, LeaseToken, StoreError,
    IN_PROGRESS_GRACE,
};

use crate::item::{self, b, n, s, Attrs, Item, State};
use crate::request::{random_rev, Write};
use crate::response::Chunks;
use crate::store::{millis, since, wall, DynamoDbStore};

/// Rounds of `acquire` when writers keep changing the item between its
/// read and the conditional write (each round is a new state).
const ACQUIRE_ROUNDS: usize = 16;

/// The next conditional write of an `acquire` round, and the lease it
/// gives if it goes through.
struct NextWrite {
    attrs: Attrs,
    /// The revision the item must still have (`None`: no item at all).
    expect_rev: Option<u64>,
    lease_until: i64,
    fence: u64,
    attempt: u32,
    fingerprint: Option<Fingerprint>,
    /// The chunks an `x` tombstone being written over still names (its
    /// delete's chunk removal may not have run: a lost reply): removed
    /// once the write went through, or nothing would ever reach them.
    leftover: Option<(LeaseToken, u32)>,
}

impl DynamoDbStore {
    /// The write of a fresh acquisition: attempt 1, the call's
    /// fingerprint, a fence from the clock, the lease from now. Where no
    /// item is (`over` none: the first round, or the item gone since it
    /// was read), or over an item that is as good as absent (a tombstone,
    /// an expired record), conditioned on its revision, with a fence at
    /// least `above` and the chunks a tombstone still names to remove.
    fn fresh_write(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        fingerprint: Option<&Fingerprint>,
        lease_ms: i64,
        over: Option<(&Item, u64)>,
    ) -> NextWrite {
        let now = self.now_ms();
        let lease_until = now.saturating_add(lease_ms);
        let fence = self.now_us().max(over.map_or(0, |(_, above)| above));
        NextWrite {
            attrs: self.in_progress_item(
                key,
                token,
                fence,
                1,
                fingerprint,
                now,
                lease_until,
                random_rev(),
            ),
            expect_rev: over.map(|(old, _)| old.rev),
            lease_until,
            fence,
            attempt: 1,
            fingerprint: fingerprint.copied(),
            leftover: over.and_then(|(old, _)| match (&old.state, old.token) {
                (State::Deleted { chunks: Some(c) }, Some(t)) => Some((t, *c)),
                _ => None,
            }),
        }
    }

    /// The attributes of a new in-progress record.
    #[allow(clippy::too_many_arguments)]
    fn in_progress_item(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        fence: u64,
        attempt: u32,
        fingerprint: Option<&Fingerprint>,
        created: i64,
        lease_until: i64,
        rev: u64,
    ) -> Attrs {
        let ex = lease_until.saturating_add(millis(IN_PROGRESS_GRACE));
        let mut attrs = HashMap::with_capacity(11);
        attrs.insert(item::PK.to_owned(), s(Self::item_key(key)));
        attrs.insert(item::ST.to_owned(), s("p"));
        attrs.insert(item::TK.to_owned(), b(token.to_bytes().to_vec()));
        attrs.insert(item::FE.to_owned(), n(fence));
        attrs.insert(item::AT.to_owned(), n(attempt));
        if let Some(fp) = fingerprint {
            attrs.insert(item::FP.to_owned(), b(fp.as_bytes().to_vec()));
        }
        attrs.insert(item::LE.to_owned(), n(lease_until));
        attrs.insert(item::CR.to_owned(), n(created));
        attrs.insert(item::EX.to_owned(), n(ex));
        attrs.insert(item::RV.to_owned(), n(rev));
        attrs.insert(item::TT.to_owned(), self.ttl_of(ex));
        attrs
    }

    pub(crate) async fn acquire_inner(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        if lease.is_zero() {
            return Err(StoreError::zero_lease());
        }
        let lease_ms = millis(lease);
        let token = LeaseToken::random();
        // Round 1: a fresh key.
        let mut next = self.fresh_write(key, token, fingerprint, lease_ms, None);
        // The revision of an item whose response had a chunk missing.
        let mut missing_in: Option<u64> = None;
        for _ in 0..ACQUIRE_ROUNDS {
            let old = match self.put_if(next.attrs, next.expect_rev).await? {
                Write::Done(()) => {
                    if let Some((old_token, chunks)) = next.leftover {
                        if let Err(e) = self.delete_chunks(old_token, chunks).await {
                            tracing::warn!(key = %key, error = %e, "the chunks of a deleted record were not all removed");
                        }
                    }
                    return Ok(Acquisition::Acquired(
                        Lease::new(key.clone(), token, next.attempt, wall(next.lease_until))
                            .with_fence(next.fence)
                            .with_fingerprint(next.fingerprint),
                    ));
                }
                Write::Refused(old) => self.decodable(key, old).await?,
            };
            let Some(old) = old else {
                // The item went away between the two writes: a fresh key.
                next = self.fresh_write(key, token, fingerprint, lease_ms, None);
                continue;
            };
            let now = self.now_ms();
            let lease_until = now.saturating_add(lease_ms);
            let old = item::decode(&old).map_err(|d| Self::corrupt(key, d))?;
            // A resend of this call (a reply lost, the SDK sent it again):
            // this token already holds the key.
            if let (State::InProgress { lease_until: held }, Some(t)) = (&old.state, old.token) {
                if t == token {
                    return Ok(Acquisition::Acquired(
                        Lease::new(key.clone(), token, old.attempt, wall(*held))
                            .with_fence(old.fence)
                            .with_fingerprint(old.fingerprint),
                    ));
                }
            }
            let Some(above) = old.fence.checked_add(1) else {
                return Err(Self::corrupt(
                    key,
                    "the fence is at its maximum: no higher one can be given",
                ));
            };
            if old.is_tombstone() || self.gone(old.expires, now) {
                // Absent: a fresh acquisition, above the stored fence.
                next = self.fresh_write(key, token, fingerprint, lease_ms, Some((&old, above)));
                continue;
            }
            if let (Some(stored), Some(given)) = (&old.fingerprint, fingerprint) {
                if stored != given {
                    return Ok(Acquisition::Mismatch);
                }
            }
            match &old.state {
                State::Completed {
                    completed_at,
                    response,
                } => {
                    let response = match self.response_of(key, &old, response).await? {
                        Chunks::Read(response) => response,
                        Chunks::Missing(detail) => {
                            // The same item twice with a chunk missing:
                            // corrupt. Else it was deleted or purged (or
                            // taken over after its expiry) since the
                            // refusal read it: start again from what the
                            // table holds now.
                            if missing_in == Some(old.rev) {
                                return Err(Self::corrupt(key, detail));
                            }
                            missing_in = Some(old.rev);
                            next = self.fresh_write(key, token, fingerprint, lease_ms, None);
                            continue;
                        }
                    };
                    // The time left by the clock after the chunks were
                    // read (a slow read must not lengthen a cache's fill).
                    let ttl = since(old.expires.saturating_sub(self.now_ms()));
                    return Ok(Acquisition::Completed(
                        CompletedRecord::new(
                            key.clone(),
                            response,
                            old.fingerprint,
                            old.attempt,
                            wall(*completed_at),
                            wall(old.expires),
                        )
                        .with_fence(old.fence)
                        .with_ttl(ttl),
                    ));
                }
                State::InProgress { lease_until: held } if !self.gone(*held, now) => {
                    let retry_after = since(held.saturating_add(self.skew_ms).saturating_sub(now))
                        .max(Duration::from_millis(1));
                    return Ok(Acquisition::InProgress {
                        lease_expires_at: wall(*held),
                        retry_after,
                        attempt: old.attempt,
                    });
                }
                _ => {
                    // Takeover: the holder's lease ended (by the margin).
                    // Fingerprint and attempt carry over.
                    let fence = self.now_us().max(above);
                    let attempt = old.attempt.saturating_add(1);
                    let stored_fp = old.fingerprint.or(fingerprint.copied());
                    next = NextWrite {
                        attrs: self.in_progress_item(
                            key,
                            token,
                            fence,
                            attempt,
                            stored_fp.as_ref(),
                            old.created,
                            lease_until,
                            random_rev(),
                        ),
                        expect_rev: Some(old.rev),
                        lease_until,
                        fence,
                        attempt,
                        fingerprint: stored_fp,
                        leftover: None,
                    };
                }
            }
        }
        Err(StoreError::unavailable(format!(
            "acquire of {key}: the item changed under {ACQUIRE_ROUNDS} conditional writes in a row"
        )))
    }
}
