//! Leases and fencing: takeover after a lease ends, `extend`, `release`,
//! completion as the end of a lease, tokens never reused, fences that
//! strictly increase.

use std::collections::HashSet;

use crate::{Acquisition, IdempotencyStore, Lease, RecordState};

use super::{
    acquired, completed_response, fp, lease_lost, ok, outlive, unique_key, Harness, DAY, LONG,
};

/// After the lease ends another worker takes over (new token, attempt 2),
/// and the old holder's complete, release and extend get `LeaseLost` and
/// change nothing.
pub async fn lease_takeover_fencing<H: Harness>(h: &H) {
    let store = h.store().await;
    let short = h.settings().lease;
    let key = unique_key("takeover");
    let old = acquired(
        store.acquire(&key, Some(&fp("a")), short).await,
        "first acquire",
    );
    outlive(short).await;
    // Taken over without a fingerprint: the stored one is kept and reported.
    let new = acquired(store.acquire(&key, None, LONG).await, "takeover");
    assert_eq!(new.attempt, 2);
    assert_eq!(
        new.fingerprint,
        Some(fp("a")),
        "the takeover lease carries the stored fingerprint"
    );
    assert_ne!(new.token, old.token, "takeover must issue a new token");

    lease_lost(store.complete(&old, b"zombie", DAY).await, "stale complete");
    lease_lost(store.release(&old).await, "stale release");
    lease_lost(store.extend(&old, LONG).await, "stale extend");

    let record = ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("record gone"));
    assert_eq!(record.token, new.token);
    assert_eq!(record.attempt, 2);
    assert_eq!(
        record.fingerprint,
        Some(fp("a")),
        "fingerprint survives a takeover"
    );
    assert!(matches!(record.state, RecordState::InProgress { .. }));

    ok(
        store.complete(&new, b"owner", DAY).await,
        "new owner completes",
    );
    lease_lost(
        store.complete(&old, b"zombie", DAY).await,
        "stale complete after completion",
    );
    match store.acquire(&key, Some(&fp("a")), LONG).await {
        Ok(Acquisition::Completed(r)) => {
            assert_eq!(&r.response[..], b"owner");
            assert_eq!(r.attempt, 2);
        }
        other => panic!("expected the new owner's result, got {other:?}"),
    }
}

/// A passed deadline only allows a takeover: until someone takes over, the
/// holder's extend, complete and release still succeed.
pub async fn expired_lease_still_owned_until_takeover<H: Harness>(h: &H) {
    let store = h.store().await;
    let short = h.settings().lease;

    let key = unique_key("late");
    let lease = acquired(store.acquire(&key, None, short).await, "acquire");
    outlive(short).await;
    let renewed = ok(store.extend(&lease, short).await, "late extend");
    assert_eq!(renewed.token, lease.token);
    assert!(renewed.expires_at > lease.expires_at);
    outlive(short).await;
    ok(store.complete(&lease, b"late", DAY).await, "late complete");
    assert_eq!(
        completed_response(store.acquire(&key, None, LONG).await, "replay"),
        b"late"
    );

    let key = unique_key("late-release");
    let lease = acquired(store.acquire(&key, None, short).await, "acquire");
    outlive(short).await;
    ok(store.release(&lease).await, "late release");
    assert_eq!(
        acquired(store.acquire(&key, None, LONG).await, "after release").attempt,
        1
    );
}

/// `extend` pushes the deadline out, so no takeover happens at the old one.
pub async fn extend_renews_lease<H: Harness>(h: &H) {
    let store = h.store().await;
    let short = h.settings().lease;
    let key = unique_key("extend");
    let lease = acquired(store.acquire(&key, None, short).await, "acquire");
    let renewed = ok(store.extend(&lease, LONG).await, "extend");
    assert_eq!(renewed.token, lease.token);
    assert_eq!(renewed.fingerprint, lease.fingerprint);
    assert_eq!(renewed.attempt, lease.attempt);
    assert!(renewed.expires_at > lease.expires_at + short);
    outlive(short).await;
    let got = store.acquire(&key, None, LONG).await;
    assert!(
        matches!(got, Ok(Acquisition::InProgress { .. })),
        "after extend: {got:?}"
    );
    // Both the original lease and the renewed one name the same holder.
    ok(store.complete(&lease, b"done", DAY).await, "complete");
}

/// `release` makes the key absent: the next acquire runs again (attempt 1,
/// new token) and the released token is dead.
pub async fn release_frees_key<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("release");
    let first = acquired(store.acquire(&key, Some(&fp("a")), LONG).await, "acquire");
    ok(store.release(&first).await, "release");
    assert!(
        ok(store.get(&key).await, "get").is_none(),
        "released key must be absent"
    );
    // Absent means no fingerprint either.
    let second = acquired(
        store.acquire(&key, Some(&fp("b")), LONG).await,
        "acquire after release",
    );
    assert_eq!(second.attempt, 1);
    assert_ne!(second.token, first.token);
    lease_lost(
        store.release(&first).await,
        "release with the released token",
    );
    lease_lost(
        store.complete(&first, b"x", DAY).await,
        "complete with the released token",
    );
    ok(store.complete(&second, b"y", DAY).await, "complete");
}

/// Completion ends the lease: a release or an extend with it gets
/// `LeaseLost`. Completing again with the same lease (a retry after a lost
/// reply) succeeds and changes nothing: the first response stays.
pub async fn complete_is_final<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("final");
    let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
    ok(store.complete(&lease, b"first", DAY).await, "complete");
    ok(
        store.complete(&lease, b"second", DAY).await,
        "completing again with the same lease",
    );
    lease_lost(store.release(&lease).await, "release after complete");
    lease_lost(store.extend(&lease, LONG).await, "extend after complete");
    assert_eq!(
        completed_response(store.acquire(&key, None, LONG).await, "replay"),
        b"first"
    );
}

/// Tokens are never reused for a key: across releases, takeovers and
/// expiries, every acquisition gets a new one, and every older one is dead.
pub async fn token_never_reused<H: Harness>(h: &H) {
    let store = h.store().await;
    let short = h.settings().lease;
    let key = unique_key("tokens");
    let mut seen: Vec<Lease> = Vec::new();
    let check_new = |lease: &Lease, seen: &mut Vec<Lease>| {
        assert!(
            seen.iter().all(|old| old.token != lease.token),
            "token {:?} reused",
            lease.token
        );
        seen.push(lease.clone());
    };
    for _ in 0..8 {
        let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
        check_new(&lease, &mut seen);
        ok(store.release(&lease).await, "release");
    }
    // Takeover.
    let lease = acquired(store.acquire(&key, None, short).await, "acquire");
    check_new(&lease, &mut seen);
    outlive(short).await;
    let lease = acquired(store.acquire(&key, None, LONG).await, "takeover");
    check_new(&lease, &mut seen);
    // Retention expiry.
    ok(store.complete(&lease, b"r", short).await, "complete");
    outlive(short).await;
    let lease = acquired(store.acquire(&key, None, LONG).await, "after expiry");
    check_new(&lease, &mut seen);
    let (current, stale) = seen.split_last().unwrap_or_else(|| panic!("no leases"));
    for old in stale {
        lease_lost(store.extend(old, LONG).await, "extend with an old token");
        lease_lost(
            store.complete(old, b"old", DAY).await,
            "complete with an old token",
        );
    }
    let unique: HashSet<_> = seen.iter().map(|l| l.token).collect();
    assert_eq!(unique.len(), seen.len());
    ok(
        store.complete(current, b"current", DAY).await,
        "current complete",
    );
}

/// The fence of a key's acquisitions strictly increases across everything
/// that can happen to its record: a release, a takeover, a delete, the
/// record's expiry; `extend` and `get` keep it.
pub async fn fence_strictly_increases<H: Harness>(h: &H) {
    let store = h.store().await;
    let short = h.settings().lease;
    let key = unique_key("fence");
    let mut seen: Vec<(&str, u64)> = Vec::new();
    let mut check = |what: &'static str, fence: u64| {
        if let Some((before, last)) = seen.last() {
            assert!(
                fence > *last,
                "fence after {what} ({fence}) is not above the one after {before} ({last})"
            );
        }
        seen.push((what, fence));
    };

    let first = acquired(store.acquire(&key, None, LONG).await, "first acquire");
    check("first acquire", first.fence);
    let record = ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("no record"));
    assert_eq!(record.fence, first.fence, "get returns the holder's fence");
    let extended = ok(store.extend(&first, LONG).await, "extend");
    assert_eq!(extended.fence, first.fence, "extend keeps the fence");
    ok(store.release(&first).await, "release");

    let after_release = acquired(store.acquire(&key, None, short).await, "after release");
    check("release", after_release.fence);
    outlive(short).await;
    let takeover = acquired(store.acquire(&key, None, LONG).await, "takeover");
    assert_eq!(takeover.attempt, 2, "a takeover is attempt 2");
    check("takeover", takeover.fence);
    lease_lost(
        store.complete(&after_release, b"stale", DAY).await,
        "stale complete",
    );
    ok(store.complete(&takeover, b"done", DAY).await, "complete");
    match store.acquire(&key, None, LONG).await {
        Ok(Acquisition::Completed(record)) => assert_eq!(
            record.fence, takeover.fence,
            "a completed record carries the fence of the acquisition that completed it"
        ),
        other => panic!("expected Completed, got {other:?}"),
    }
    assert!(
        ok(store.delete(&key).await, "delete"),
        "delete found the record"
    );

    let after_delete = acquired(store.acquire(&key, None, short).await, "after delete");
    assert_eq!(after_delete.attempt, 1, "attempt resets after a delete");
    check("delete", after_delete.fence);
    ok(
        store.complete(&after_delete, b"done", short).await,
        "complete",
    );
    outlive(short).await;
    let after_expiry = acquired(store.acquire(&key, None, LONG).await, "after expiry");
    assert_eq!(after_expiry.attempt, 1, "attempt resets after expiry");
    check("retention expiry", after_expiry.fence);
}
