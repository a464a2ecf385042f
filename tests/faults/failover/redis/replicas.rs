//! What a Redis that is not (or no longer) a writable master answers: a
//! replica (READONLY), a replica whose master is gone (MASTERDOWN), a
//! master without enough replicas (NOREPLICAS). Each is a passing
//! condition of a failover: `Unavailable` (retryable), never `Backend` or
//! `Corrupt`.

use crate::support;

use std::time::{Duration, Instant};

use idemkit::redis::RedisStore;
use idemkit::{Acquisition, IdempotencyKey, IdempotencyStore, StoreError};
use support::report::report;

use super::key;

/// A Redis that turned into a replica (a failover moved
/// the master away) refuses the scripts' writes with READONLY, and one
/// whose master link is down with `replica-serve-stale-data no` refuses
/// the scripts' GET with MASTERDOWN (which the scripts now pass on): both
/// must be the retryable `Unavailable`, never `Backend`/`Corrupt`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_refusals_are_retryable() {
    let started = Instant::now();
    let master = tokio::task::block_in_place(|| support::redis_server::RedisServer::start(&[]));
    let replica = tokio::task::block_in_place(|| support::redis_server::RedisServer::start(&[]));
    let on_master = RedisStore::connect(&master.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = RedisStore::connect(&replica.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .call_timeout(Duration::from_secs(2));
    let lease = match on_master
        .acquire(&key("failover.replica"), None, Duration::from_secs(60))
        .await
    {
        Ok(Acquisition::Acquired(lease)) => lease,
        other => panic!("{other:?}"),
    };
    // The server the store uses is (now) a replica of `master`, with the
    // worker's reservation on it.
    let said = replica.command(&format!("REPLICAOF 127.0.0.1 {}", master.port));
    assert!(said.starts_with("+OK"), "{said}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(replica
        .command("INFO replication")
        .contains("master_link_status:up")
        && replica.command("DBSIZE").trim() == ":1")
    {
        assert!(Instant::now() < deadline, "the replica never synced");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let readonly_acquire = store
        .acquire(&key("failover.replica"), None, Duration::from_secs(30))
        .await
        .map(|_| ());
    let readonly_complete = store.complete(&lease, b"x", Duration::from_secs(60)).await;
    // The master goes away; stale reads are refused.
    assert!(replica
        .command("CONFIG SET replica-serve-stale-data no")
        .starts_with("+OK"));
    master.kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !replica
        .command("INFO replication")
        .contains("master_link_status:down")
    {
        assert!(
            Instant::now() < deadline,
            "the replica never saw its master go"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stale_acquire = store
        .acquire(&key("failover.replica"), None, Duration::from_secs(30))
        .await
        .map(|_| ());
    let stale_complete = store.complete(&lease, b"x", Duration::from_secs(60)).await;
    let stale_release = store.release(&lease).await;
    let stale_extend = store
        .extend(&lease, Duration::from_secs(30))
        .await
        .map(|_| ());
    let cases = [
        ("readonly_acquire", readonly_acquire),
        ("readonly_complete", readonly_complete),
        ("stale_acquire", stale_acquire),
        ("stale_complete", stale_complete),
        ("stale_release", stale_release),
        ("stale_extend", stale_extend),
    ];
    let show = |r: &Result<(), StoreError>| match r {
        Ok(()) => "ok".to_owned(),
        Err(e) if e.is_retryable() => "Unavailable".to_owned(),
        Err(_) => "NOT-retryable".to_owned(),
    };
    report(
        "redis-replica-refusals",
        "redis",
        &cases.iter().map(|(w, r)| (*w, show(r))).collect::<Vec<_>>(),
        started,
    );
    for (what, r) in cases {
        match r {
            Err(e) => assert!(e.is_retryable(), "{what}: {e:?}"),
            Ok(()) => panic!("{what}: a replica took the write"),
        }
    }
}

/// A master without a good replica under `min-replicas-to-write` refuses
/// writes with `NOREPLICAS`: a passing condition (the replica comes back),
/// so the store answers `Unavailable` (retryable), not `Backend`; reads
/// and replays still work, and under `wait_for_replicas` a replay (whose
/// marker write is refused) is `Unavailable` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noreplicas_is_unavailable() {
    let server = support::redis_server::RedisServer::start(&["--min-replicas-to-write", "1"]);
    let store = RedisStore::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let key = IdempotencyKey::new("failover.noreplicas", "k").unwrap_or_else(|e| panic!("{e}"));
    match store.acquire(&key, None, Duration::from_secs(15)).await {
        Err(e @ StoreError::Unavailable(_)) => {
            assert!(e.to_string().contains("NOREPLICAS"), "{e}");
            assert!(e.is_retryable());
        }
        other => panic!("acquire on a master without replicas: {other:?}"),
    }
    assert!(matches!(store.get(&key).await, Ok(None)));

    // A completed record, written before the setting; then replayed under
    // `wait_for_replicas`, which writes a marker first.
    let done = IdempotencyKey::new("failover.noreplicas", "done").unwrap_or_else(|e| panic!("{e}"));
    server.command("CONFIG SET min-replicas-to-write 0");
    let Ok(Acquisition::Acquired(lease)) =
        store.acquire(&done, None, Duration::from_secs(15)).await
    else {
        panic!("acquire without the setting")
    };
    store
        .complete(&lease, b"r", Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    server.command("CONFIG SET min-replicas-to-write 1");
    assert!(matches!(
        store.acquire(&done, None, Duration::from_secs(15)).await,
        Ok(Acquisition::Completed(_))
    ));
    match store
        .clone()
        .wait_for_replicas(1, Duration::from_millis(200))
        .acquire(&done, None, Duration::from_secs(15))
        .await
    {
        Err(e @ StoreError::Unavailable(_)) => assert!(e.is_retryable()),
        other => panic!("a replay under WAIT on a master without replicas: {other:?}"),
    }
}
