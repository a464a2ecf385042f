//! Batches: `acquire_many` and `complete_many` answer each item as its
//! own call would, in order; `Idempotency::process_batch` on the store.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::{
    AcquireItem, Acquisition, Fingerprint, IdemError, Idempotency, IdempotencyKey,
    IdempotencyStore, Lease, Processed, RecordState, StoreError,
};

use super::{
    acquired, close, completed_response, fp, lease_lost, ok, outlive, unique_key, Harness, DAY,
    LONG,
};

/// `acquire_many`, unwrapping the outer result: one result per item.
async fn acquire_batch<S: IdempotencyStore + ?Sized>(
    store: &S,
    items: &[(&IdempotencyKey, Option<&Fingerprint>)],
    lease: Duration,
    what: &str,
) -> Vec<Result<Acquisition, StoreError>> {
    let items: Vec<AcquireItem<'_>> = items
        .iter()
        .map(|(key, fingerprint)| AcquireItem::new(key, *fingerprint))
        .collect();
    let got = ok(store.acquire_many(&items, lease).await, what);
    assert_eq!(
        got.len(),
        items.len(),
        "{what}: {} results for {} items",
        got.len(),
        items.len()
    );
    got
}

/// One `acquire_many` meets every state at once, each item answered as
/// its own `acquire` would be: a fresh key is acquired, a completed one
/// replayed (with or without a fingerprint), a held one in progress, a
/// completed one with another payload a mismatch, one whose lease is over
/// taken over (attempt 2), and a corrupt record is that item's own
/// `Corrupt` error, the others unharmed.
pub async fn batch_mixed_outcomes<H: Harness>(h: &H) {
    let store = h.store().await;
    let short = h.settings().lease;
    let fresh = unique_key("batch-fresh");
    let done = unique_key("batch-done");
    let busy = unique_key("batch-busy");
    let stale = unique_key("batch-stale");
    let broken = unique_key("batch-corrupt");

    let lease = acquired(store.acquire(&done, Some(&fp("a")), LONG).await, "acquire");
    ok(store.complete(&lease, b"done", DAY).await, "complete");
    let held = acquired(store.acquire(&busy, Some(&fp("a")), LONG).await, "acquire");
    let old = acquired(
        store.acquire(&stale, Some(&fp("a")), short).await,
        "acquire",
    );
    let lease = acquired(store.acquire(&broken, None, LONG).await, "acquire");
    ok(store.complete(&lease, b"r", DAY).await, "complete");
    h.corrupt(&store, &broken).await;
    outlive(short).await;

    let got = acquire_batch(
        &store,
        &[
            (&fresh, Some(&fp("x"))),
            (&done, Some(&fp("a"))),
            (&busy, Some(&fp("a"))),
            (&done, Some(&fp("b"))),
            (&broken, None),
            (&stale, Some(&fp("a"))),
            (&done, None),
        ],
        LONG,
        "mixed batch",
    )
    .await;
    let mut got = got.into_iter();
    let mut next = || got.next().unwrap_or_else(|| panic!("missing result"));
    let new = acquired(next(), "fresh item");
    assert_eq!(new.key, fresh);
    assert_eq!(new.attempt, 1);
    assert_eq!(new.fingerprint, Some(fp("x")));
    // The lease is the one stored: its deadline and fence.
    let stored = ok(store.get(&fresh).await, "get").unwrap_or_else(|| panic!("record gone"));
    assert_eq!(stored.fence, new.fence, "fence of a fresh batch item");
    match stored.state {
        RecordState::InProgress { lease_expires_at } => assert!(
            close(lease_expires_at, new.expires_at, Duration::from_millis(2)),
            "fresh item: stored deadline {lease_expires_at:?}, lease's {:?}",
            new.expires_at
        ),
        other => panic!("fresh item: stored as {other:?}"),
    }
    match next() {
        Ok(Acquisition::Completed(record)) => {
            assert_eq!(record.key, done);
            assert_eq!(&record.response[..], b"done");
            assert_eq!(record.fingerprint, Some(fp("a")));
            // Time left of the retention, by the store's clock.
            assert!(
                record.ttl <= DAY && record.ttl + Duration::from_secs(60) >= DAY,
                "replayed item: {:?} left of a {DAY:?} retention",
                record.ttl
            );
        }
        other => panic!("completed item: expected Completed, got {other:?}"),
    }
    match next() {
        Ok(Acquisition::InProgress {
            lease_expires_at,
            attempt,
            ..
        }) => {
            assert_eq!(attempt, 1);
            assert!(
                close(lease_expires_at, held.expires_at, Duration::from_millis(2)),
                "in-progress item: deadline {lease_expires_at:?}, holder's {:?}",
                held.expires_at
            );
        }
        other => panic!("held item: expected InProgress, got {other:?}"),
    }
    let got_mismatch = next();
    assert!(
        matches!(got_mismatch, Ok(Acquisition::Mismatch)),
        "other payload: {got_mismatch:?}"
    );
    match next() {
        Err(StoreError::Corrupt { key, .. }) => assert_eq!(key, broken),
        other => panic!("corrupt item: expected Corrupt, got {other:?}"),
    }
    let taken = acquired(next(), "lease over");
    assert_eq!(taken.attempt, 2, "a takeover in a batch is attempt 2");
    assert_ne!(taken.token, old.token);
    assert!(taken.fence > old.fence);
    assert_eq!(
        completed_response(next(), "completed item without fingerprint"),
        b"done"
    );

    // The leases of a batch work like any other.
    lease_lost(store.complete(&old, b"zombie", DAY).await, "stale complete");
    ok(store.complete(&new, b"new", DAY).await, "complete");
    ok(store.complete(&taken, b"taken", DAY).await, "complete");
    assert_eq!(
        completed_response(store.acquire(&fresh, None, LONG).await, "replay"),
        b"new"
    );
    assert_eq!(
        completed_response(store.acquire(&stale, None, LONG).await, "replay"),
        b"taken"
    );
    let record = ok(store.get(&busy).await, "get").unwrap_or_else(|| panic!("record gone"));
    assert_eq!(record.token, held.token, "asking did not change the holder");
}

/// A key that appears several times in one batch is answered as calling
/// `acquire` on each item in order: the first acquires, the later ones see
/// it held (in progress, attempt 1) or, with another fingerprint, a
/// mismatch; a key repeated 100 times is acquired once. Completing twice
/// with one lease in one `complete_many` keeps the first response.
pub async fn batch_duplicate_keys_in_one_batch<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("batch-dup");
    let other = unique_key("batch-dup-other");
    let got = acquire_batch(
        &store,
        &[
            (&key, Some(&fp("a"))),
            (&key, Some(&fp("a"))),
            (&key, Some(&fp("b"))),
            (&other, None),
            (&key, None),
        ],
        LONG,
        "batch with a repeated key",
    )
    .await;
    let mut got = got.into_iter();
    let mut next = || got.next().unwrap_or_else(|| panic!("missing result"));
    let first = acquired(next(), "first of the key");
    for (i, expect_mismatch) in [(1, false), (2, true)] {
        let outcome = next();
        if expect_mismatch {
            assert!(
                matches!(outcome, Ok(Acquisition::Mismatch)),
                "item {i}: {outcome:?}"
            );
        } else {
            match outcome {
                Ok(Acquisition::InProgress {
                    lease_expires_at,
                    attempt: 1,
                    ..
                }) => assert!(
                    close(lease_expires_at, first.expires_at, Duration::from_millis(2)),
                    "item {i}: held until {lease_expires_at:?}, the first lease until {:?}",
                    first.expires_at
                ),
                other => panic!("item {i}: expected InProgress held by item 0, got {other:?}"),
            }
        }
    }
    let other_lease = acquired(next(), "the other key");
    assert!(
        matches!(next(), Ok(Acquisition::InProgress { attempt: 1, .. })),
        "the key again, without a fingerprint"
    );
    let record = ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("record gone"));
    assert_eq!(record.token, first.token, "later items did not take over");
    assert_eq!(record.fingerprint, Some(fp("a")));

    // One lease twice in one complete_many: the first response stays.
    let done = ok(
        store
            .complete_many(
                &[
                    (&first, b"one".as_slice()),
                    (&other_lease, b"other".as_slice()),
                    (&first, b"two".as_slice()),
                ],
                DAY,
            )
            .await,
        "complete_many",
    );
    assert_eq!(done.len(), 3);
    for (i, one) in done.into_iter().enumerate() {
        ok(one, &format!("completion {i}"));
    }
    assert_eq!(
        completed_response(store.acquire(&key, None, LONG).await, "replay"),
        b"one"
    );

    // A completed key twice, and a key repeated 100 times.
    let got = acquire_batch(
        &store,
        &[(&key, Some(&fp("a"))), (&key, Some(&fp("a")))],
        LONG,
        "completed key twice",
    )
    .await;
    for outcome in got {
        assert_eq!(completed_response(outcome, "completed key twice"), b"one");
    }
    let hot = unique_key("batch-hot");
    let hot_print = fp("h");
    let items: Vec<_> = (0..100).map(|_| (&hot, Some(&hot_print))).collect();
    let got = acquire_batch(&store, &items, LONG, "a key 100 times").await;
    let mut got = got.into_iter();
    let lease = acquired(
        got.next().unwrap_or_else(|| panic!("no result")),
        "first of 100",
    );
    for (i, outcome) in got.enumerate() {
        assert!(
            matches!(outcome, Ok(Acquisition::InProgress { attempt: 1, .. })),
            "copy {}: {outcome:?}",
            i + 1
        );
    }
    ok(store.complete(&lease, b"hot", DAY).await, "complete");
}

/// `complete_many` completes every item whose lease holds and answers
/// `LeaseLost` for a stale one (its key released and acquired again), in
/// the items' order, without touching the new holder's record.
pub async fn batch_complete_many<H: Harness>(h: &H) {
    let store = h.store().await;
    let keys: Vec<IdempotencyKey> = (0..3)
        .map(|i| unique_key(&format!("batch-complete-{i}")))
        .collect();
    let mut leases: Vec<Lease> = Vec::new();
    for key in &keys {
        leases.push(acquired(store.acquire(key, None, LONG).await, "acquire"));
    }
    // The middle lease goes stale: released, and the key acquired again.
    ok(store.release(&leases[1]).await, "release");
    let owner = acquired(
        store.acquire(&keys[1], None, LONG).await,
        "acquire after release",
    );
    let done = ok(
        store
            .complete_many(
                &[
                    (&leases[0], b"r0".as_slice()),
                    (&leases[1], b"stale".as_slice()),
                    (&leases[2], b"r2".as_slice()),
                ],
                DAY,
            )
            .await,
        "complete_many",
    );
    assert_eq!(done.len(), 3);
    let mut done = done.into_iter();
    ok(done.next().unwrap_or(Ok(())), "item 0");
    lease_lost(done.next().unwrap_or(Ok(())), "the stale item");
    ok(done.next().unwrap_or(Ok(())), "item 2");
    assert_eq!(
        completed_response(store.acquire(&keys[0], None, LONG).await, "replay 0"),
        b"r0"
    );
    assert_eq!(
        completed_response(store.acquire(&keys[2], None, LONG).await, "replay 2"),
        b"r2"
    );
    let record = ok(store.get(&keys[1]).await, "get").unwrap_or_else(|| panic!("record gone"));
    assert_eq!(record.token, owner.token);
    assert!(
        matches!(record.state, RecordState::InProgress { .. }),
        "the new holder's record was completed by a stale lease"
    );
    ok(
        store.complete(&owner, b"owner", DAY).await,
        "owner completes",
    );
}

/// Empty batches answer empty lists; a zero lease is refused with
/// `InvalidArgument` before anything is written.
pub async fn batch_empty<H: Harness>(h: &H) {
    let store = h.store().await;
    let got = ok(store.acquire_many(&[], LONG).await, "empty acquire_many");
    assert!(got.is_empty(), "{got:?}");
    let got = ok(store.complete_many(&[], DAY).await, "empty complete_many");
    assert!(got.is_empty(), "{got:?}");
    let key = unique_key("batch-zero");
    let refused = store
        .acquire_many(&[AcquireItem::new(&key, None)], Duration::ZERO)
        .await;
    assert!(
        matches!(refused, Err(StoreError::InvalidArgument { .. })),
        "zero lease: {refused:?}"
    );
    assert!(
        ok(store.get(&key).await, "get").is_none(),
        "a refused batch wrote a record"
    );
}

/// 1,000 keys in one batch: every result is its own item's, in order
/// (each key completed with a response naming it, then replayed in a
/// shuffled batch).
pub async fn batch_order_kept<H: Harness>(h: &H) {
    let store = h.store().await;
    let run = format!("{:016x}", fastrand::u64(..));
    let keys: Vec<IdempotencyKey> = (0..1_000)
        .map(
            |i| match IdempotencyKey::new("idem.conformance.batch", format!("{run}-{i}")) {
                Ok(k) => k,
                Err(e) => panic!("{e}"),
            },
        )
        .collect();
    let prints: Vec<Fingerprint> = (0..keys.len()).map(|i| fp(&i.to_string())).collect();
    let items: Vec<_> = keys
        .iter()
        .zip(&prints)
        .map(|(k, f)| (k, Some(f)))
        .collect();
    let got = acquire_batch(&store, &items, LONG, "1,000 fresh keys").await;
    let leases: Vec<Lease> = got
        .into_iter()
        .enumerate()
        .map(|(i, outcome)| {
            let lease = acquired(outcome, &format!("key {i}"));
            assert_eq!(lease.key, keys[i], "result {i} is another item's");
            assert_eq!(lease.fingerprint, Some(prints[i]));
            lease
        })
        .collect();
    let responses: Vec<Vec<u8>> = keys.iter().map(|k| k.id().as_bytes().to_vec()).collect();
    let completions: Vec<(&Lease, &[u8])> = leases
        .iter()
        .zip(&responses)
        .map(|(l, r)| (l, r.as_slice()))
        .collect();
    let done = ok(
        store.complete_many(&completions, DAY).await,
        "complete_many",
    );
    assert_eq!(done.len(), keys.len());
    for (i, one) in done.into_iter().enumerate() {
        ok(one, &format!("completion {i}"));
    }
    let mut order: Vec<usize> = (0..keys.len()).collect();
    fastrand::shuffle(&mut order);
    let items: Vec<_> = order
        .iter()
        .map(|&i| (&keys[i], Some(&prints[i])))
        .collect();
    let got = acquire_batch(&store, &items, LONG, "1,000 replays").await;
    for (&i, outcome) in order.iter().zip(got) {
        assert_eq!(
            completed_response(outcome, &format!("replay of key {i}")),
            responses[i],
            "replay of key {i} carries another item's response"
        );
    }
}

/// `Idempotency::process_batch` on this store: one item's handler fails
/// and its key is released; every other item is recorded (one of them a
/// second delivery of a key in the same batch, which replays); a retry of
/// the batch runs the failed item only.
pub async fn batch_process_one_handler_fails<H: Harness>(h: &H) {
    #[derive(Debug)]
    struct Declined;
    let store = Arc::new(h.store().await);
    let idem = Idempotency::from_arc(store.clone())
        .lease(LONG)
        .retention(DAY);
    let keys: Vec<IdempotencyKey> = (0..4)
        .map(|i| unique_key(&format!("batch-process-{i}")))
        .collect();
    let items = |keys: &[IdempotencyKey]| -> Vec<(IdempotencyKey, u64)> {
        let mut items: Vec<_> = keys.iter().cloned().zip(0u64..).collect();
        items.push((keys[0].clone(), 0));
        items
    };
    let runs = Arc::new(AtomicU32::new(0));
    let out = idem
        .process_batch(items(&keys), |n| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                if n == 2 {
                    Err(Declined)
                } else {
                    Ok(format!("done {n}"))
                }
            }
        })
        .await;
    assert_eq!(out.len(), 5);
    for (i, outcome) in out.iter().enumerate() {
        match (i, outcome) {
            (2, Err(IdemError::Handler(Declined))) => {}
            (4, Ok(Processed::Replayed(v))) => assert_eq!(v, "done 0"),
            (i, Ok(Processed::Executed(v))) if i < 4 => assert_eq!(v, &format!("done {i}")),
            other => panic!("batch item {}: {:?}", other.0, other.1),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 4, "the repeated key ran once");
    for (i, key) in keys.iter().enumerate() {
        let record = ok(store.get(key).await, "get");
        match (i, record) {
            (2, None) => {}
            (i, Some(r)) if i != 2 => assert!(r.is_completed(), "key {i}: {r:?}"),
            (i, other) => panic!("key {i}: {other:?}"),
        }
    }
    let retry = idem
        .process_batch(items(&keys), |n| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Declined>(format!("retried {n}"))
            }
        })
        .await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        5,
        "only the failed item ran again"
    );
    for (i, outcome) in retry.iter().enumerate() {
        let expected = match i {
            2 => Processed::Executed("retried 2".to_owned()),
            4 => Processed::Replayed("done 0".to_owned()),
            i => Processed::Replayed(format!("done {i}")),
        };
        assert_eq!(outcome.as_ref().ok(), Some(&expected), "retry item {i}");
    }
}
