//! On Redis, a batched `acquire` (`acquire_many.lua`, what concurrent single
//! calls go as) answers exactly as `acquire` alone (`acquire.lua`) for the
//! same stored state: records an operator kept or shortened (`PEXPIRE`),
//! corrupt and odd records, fresh leases of every length (byte for byte
//! the stored one), completions (`complete_many.lua` writes what
//! `complete.lua` writes), and a replay under `WAIT` beside a fresh key.

use crate::support;

use std::time::{Duration, UNIX_EPOCH};

use idemkit::redis::redis;
use idemkit::redis::RedisStore;
use idemkit::{
    AcquireItem, Acquisition, Batching, Fingerprint, IdempotencyKey, IdempotencyStore, Lease,
    StoreError,
};
use support::redis_server::{wait_for_replication, RedisServer};

const LEASE: Duration = Duration::from_secs(30);

fn key(id: &str) -> IdempotencyKey {
    IdempotencyKey::new("batch.answers", id).unwrap_or_else(|e| panic!("{e}"))
}

fn acquired(got: &Result<Acquisition, StoreError>) -> Lease {
    match got {
        Ok(Acquisition::Acquired(lease)) => lease.clone(),
        other => panic!("not acquired: {other:?}"),
    }
}

/// A short description of an answer, to compare kinds.
fn kind(got: &Result<Acquisition, StoreError>) -> String {
    match got {
        Ok(Acquisition::Acquired(l)) => format!("Acquired(attempt {})", l.attempt),
        Ok(Acquisition::Completed(r)) => {
            format!("Completed({:?})", String::from_utf8_lossy(&r.response))
        }
        Ok(Acquisition::InProgress { attempt, .. }) => format!("InProgress(attempt {attempt})"),
        Ok(Acquisition::Mismatch) => "Mismatch".into(),
        Err(e) => format!("Err({e})"),
    }
}

/// Two stores on one server: one that sends every call alone, and the
/// batched call (`acquire_many`) that the default store sends concurrent
/// calls as.
async fn stores(
    server: &RedisServer,
) -> (RedisStore, RedisStore, redis::aio::MultiplexedConnection) {
    let batched = RedisStore::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to Redis: {e}"));
    assert!(
        batched.batcher().settings().is_on(),
        "batching on by default"
    );
    let alone = RedisStore::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to Redis: {e}"))
        .batching(Batching::off());
    let conn = redis::Client::open(server.url.as_str())
        .unwrap_or_else(|e| panic!("{e}"))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    (alone, batched, conn)
}

async fn batch_one(
    store: &RedisStore,
    k: &IdempotencyKey,
    fp: Option<&Fingerprint>,
    lease: Duration,
) -> Result<Acquisition, StoreError> {
    let mut got = store
        .acquire_many(&[AcquireItem::new(k, fp)], lease)
        .await
        .unwrap_or_else(|e| panic!("acquire_many: {e}"));
    assert_eq!(got.len(), 1);
    got.remove(0)
}

async fn complete_with(
    store: &RedisStore,
    k: &IdempotencyKey,
    fp: Option<&Fingerprint>,
    response: &[u8],
    retention: Duration,
) {
    let lease = acquired(&store.acquire(k, fp, LEASE).await);
    store
        .complete(&lease, response, retention)
        .await
        .unwrap_or_else(|e| panic!("complete: {e}"));
}

async fn pexpire(
    conn: &mut redis::aio::MultiplexedConnection,
    store: &RedisStore,
    k: &IdempotencyKey,
    ms: u64,
) {
    let set: i64 = redis::cmd("PEXPIRE")
        .arg(store.redis_key(k))
        .arg(ms)
        .query_async(conn)
        .await
        .unwrap_or_else(|e| panic!("PEXPIRE: {e}"));
    assert_eq!(set, 1);
}

async fn raw(
    conn: &mut redis::aio::MultiplexedConnection,
    store: &RedisStore,
    k: &IdempotencyKey,
) -> Vec<u8> {
    redis::cmd("GET")
        .arg(store.redis_key(k))
        .query_async(conn)
        .await
        .unwrap_or_else(|e| panic!("GET: {e}"))
}

/// Waits (10 s at most) until Redis's clock is past the `expires` field of
/// `k`'s record.
async fn past_expiry(
    conn: &mut redis::aio::MultiplexedConnection,
    store: &RedisStore,
    k: &IdempotencyKey,
) {
    let expires = u64_at(&raw(conn, store, k).await, 78);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (secs, micros): (u64, u64) = redis::cmd("TIME")
            .query_async(conn)
            .await
            .unwrap_or_else(|e| panic!("TIME: {e}"));
        if secs * 1000 + micros / 1000 > expires {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the server's clock did not pass {expires} ms"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap_or_else(|e| panic!("{e}")))
}

fn ms_of(t: std::time::SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_else(|e| panic!("{e}"))
        .as_millis() as u64
}

/// A completed record whose key an operator kept longer (PEXPIRE) than its
/// `expires` field: acquire.lua decides by the key's PTTL (replays it),
/// acquire_many.lua now by the field (takes it over as expired). Same
/// state, two answers: the batched caller runs the handler again.
#[tokio::test]
async fn a_kept_completed_record_is_replayed_batched_as_alone() {
    let server = RedisServer::start(&[]);
    let (alone, batched, mut conn) = stores(&server).await;
    let fp = Fingerprint::of_bytes(b"payload");
    let (k_alone, k_batched) = (key("kept-alone"), key("kept-batched"));
    for k in [&k_alone, &k_batched] {
        complete_with(
            &alone,
            k,
            Some(&fp),
            b"recorded",
            Duration::from_millis(300),
        )
        .await;
        pexpire(&mut conn, &alone, k, 60_000).await;
    }
    // Past the record's `expires` field; the keys still live.
    past_expiry(&mut conn, &alone, &k_batched).await;

    let by_alone = alone.acquire(&k_alone, Some(&fp), LEASE).await;
    let by_batch = batch_one(&batched, &k_batched, Some(&fp), LEASE).await;
    assert_eq!(
        kind(&by_batch),
        kind(&by_alone),
        "same stored state, batched vs alone"
    );
}

/// The same kept record, with a different payload: alone answers Mismatch,
/// batched acquires it (the new payload's handler runs).
#[tokio::test]
async fn a_kept_completed_record_mismatches_batched_as_alone() {
    let server = RedisServer::start(&[]);
    let (alone, batched, mut conn) = stores(&server).await;
    let (a, b) = (Fingerprint::of_bytes(b"a"), Fingerprint::of_bytes(b"b"));
    let (k_alone, k_batched) = (key("mm-alone"), key("mm-batched"));
    for k in [&k_alone, &k_batched] {
        complete_with(&alone, k, Some(&a), b"recorded", Duration::from_millis(300)).await;
        pexpire(&mut conn, &alone, k, 60_000).await;
    }
    past_expiry(&mut conn, &alone, &k_batched).await;

    let by_alone = alone.acquire(&k_alone, Some(&b), LEASE).await;
    let by_batch = batch_one(&batched, &k_batched, Some(&b), LEASE).await;
    assert_eq!(
        kind(&by_batch),
        kind(&by_alone),
        "same stored state, batched vs alone"
    );
}

/// Through the default store itself: concurrent single calls (more than 4
/// in flight) on a kept record; each must be a replay, as alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_of_a_kept_record_on_the_default_store_all_replay() {
    let server = RedisServer::start(&[]);
    let (alone, batched, mut conn) = stores(&server).await;
    let k = key("kept-concurrent");
    complete_with(&alone, &k, None, b"recorded", Duration::from_millis(300)).await;
    pexpire(&mut conn, &alone, &k, 60_000).await;
    past_expiry(&mut conn, &alone, &k).await;
    // Alone, twice: a replay both times.
    for _ in 0..2 {
        let got = alone.acquire(&k, None, LEASE).await;
        assert_eq!(kind(&got), "Completed(\"recorded\")");
    }
    // Hold Redis's writes so that the calls pile up and go batched.
    assert!(server.command("CLIENT PAUSE 30000 WRITE").contains("OK"));
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (s, k) = (batched.clone(), k.clone());
            tokio::spawn(async move { s.acquire(&k, None, LEASE).await })
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    while batched.batcher().waiting().0 < 28 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(server.command("CLIENT UNPAUSE").contains("OK"));
    let mut kinds = Vec::new();
    for t in tasks {
        let got = tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .unwrap_or_else(|_| panic!("stuck"))
            .unwrap_or_else(|e| panic!("{e}"));
        kinds.push(kind(&got));
    }
    let executed = kinds.iter().filter(|k| k.starts_with("Acquired")).count();
    assert!(kinds.iter().all(|k| !k.starts_with("Err")), "{kinds:?}");
    assert_eq!(
        executed, 0,
        "duplicates that would run the handler: {kinds:?}"
    );
}

/// A completed record whose key an operator shortened (PEXPIRE): alone
/// replays it with its PTTL, batched with expires - now (longer than the
/// key lives).
#[tokio::test]
async fn a_replay_ttl_batched_is_the_keys_time_left_as_alone() {
    let server = RedisServer::start(&[]);
    let (alone, batched, mut conn) = stores(&server).await;
    let (k_alone, k_batched) = (key("short-alone"), key("short-batched"));
    for k in [&k_alone, &k_batched] {
        complete_with(&alone, k, None, b"recorded", Duration::from_secs(3600)).await;
        pexpire(&mut conn, &alone, k, 10_000).await;
    }
    let ttl = |got: &Result<Acquisition, StoreError>| match got {
        Ok(Acquisition::Completed(r)) => r.ttl,
        other => panic!("not a replay: {other:?}"),
    };
    let by_alone = ttl(&alone.acquire(&k_alone, None, LEASE).await);
    let by_batch = ttl(&batch_one(&batched, &k_batched, None, LEASE).await);
    assert!(by_alone <= Duration::from_secs(10), "alone: {by_alone:?}");
    assert!(
        by_batch <= Duration::from_secs(10),
        "batched replay's ttl {by_batch:?}, alone's {by_alone:?} (the key has 10 s left)"
    );
}

/// A fresh key's reconstructed lease is the stored one, byte for byte,
/// for leases from 1 ns to Duration::MAX, with and without a fingerprint;
/// and it can be extended, completed and released.
#[tokio::test]
async fn a_fresh_batched_lease_is_the_stored_one() {
    let server = RedisServer::start(&[]);
    let (alone, batched, mut conn) = stores(&server).await;
    let fp = Fingerprint::of_bytes(b"x");
    let leases = [
        Duration::from_nanos(1),
        Duration::from_micros(1500),
        Duration::from_millis(999),
        Duration::from_secs(30),
        Duration::from_secs(200 * 365 * 86400),
        Duration::MAX,
    ];
    for (i, &lease_for) in leases.iter().enumerate() {
        for with_fp in [false, true] {
            let k = key(&format!("fresh-{i}-{with_fp}"));
            let f = with_fp.then_some(&fp);
            let lease = acquired(&batch_one(&batched, &k, f, lease_for).await);
            let b = raw(&mut conn, &batched, &k).await;
            assert_eq!(b.len(), 94, "{lease_for:?}");
            assert_eq!(b[0], b'p');
            assert_eq!(b[1], if with_fp { b'1' } else { b'0' });
            if with_fp {
                assert_eq!(&b[2..34], fp.as_bytes().as_slice());
            }
            assert_eq!(
                &b[34..50],
                &lease.token.to_bytes()[..],
                "{lease_for:?} token"
            );
            assert_eq!(
                u32::from_be_bytes(b[50..54].try_into().unwrap_or_else(|e| panic!("{e}"))),
                lease.attempt
            );
            assert_eq!(u64_at(&b, 54), lease.fence, "{lease_for:?} fence");
            assert_eq!(
                u64_at(&b, 62),
                ms_of(lease.expires_at),
                "{lease_for:?} deadline"
            );
            assert_eq!(lease.fingerprint, f.copied(), "{lease_for:?} fingerprint");
            // The answer alone would give for the held key is in progress
            // with the stored deadline (a lease long enough to be held).
            if lease_for >= LEASE {
                match alone.acquire(&k, f, LEASE).await {
                    Ok(Acquisition::InProgress {
                        lease_expires_at,
                        attempt,
                        ..
                    }) => {
                        assert_eq!(lease_expires_at, lease.expires_at, "{lease_for:?}");
                        assert_eq!(attempt, 1);
                    }
                    other => panic!("{lease_for:?}: {other:?}"),
                }
            }
            let extended = batched
                .extend(&lease, Duration::from_secs(60))
                .await
                .unwrap_or_else(|e| panic!("{lease_for:?} extend: {e}"));
            assert_eq!(extended.fence, lease.fence);
            if i % 2 == 0 {
                batched
                    .complete(&extended, b"ok", Duration::from_secs(60))
                    .await
                    .unwrap_or_else(|e| panic!("{lease_for:?} complete: {e}"));
            } else {
                batched
                    .release(&extended)
                    .await
                    .unwrap_or_else(|e| panic!("{lease_for:?} release: {e}"));
            }
        }
    }
}

/// complete_many's surgery writes the bytes complete.lua writes (except
/// the times), for retention 0, 1 ms, a day and Duration::MAX.
#[tokio::test]
async fn complete_many_writes_the_record_complete_writes() {
    let server = RedisServer::start(&[]);
    let (alone, batched, mut conn) = stores(&server).await;
    let fp = Fingerprint::of_bytes(b"x");
    for (i, retention) in [
        Duration::from_secs(86400),
        Duration::MAX,
        Duration::from_secs(1),
    ]
    .into_iter()
    .enumerate()
    {
        for with_fp in [false, true] {
            let f = with_fp.then_some(&fp);
            let (ka, kb) = (
                key(&format!("ca-{i}-{with_fp}")),
                key(&format!("cb-{i}-{with_fp}")),
            );
            let la = acquired(&alone.acquire(&ka, f, LEASE).await);
            let lb = acquired(&alone.acquire(&kb, f, LEASE).await);
            let before_b = raw(&mut conn, &alone, &kb).await;
            alone
                .complete(&la, b"resp", retention)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let done = batched
                .complete_many(&[(&lb, b"resp".as_slice())], retention)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(done[0].is_ok(), "{done:?}");
            let (a, b) = (
                raw(&mut conn, &alone, &ka).await,
                raw(&mut conn, &alone, &kb).await,
            );
            assert_eq!(a.len(), b.len());
            assert_eq!(a[0], b[0]);
            assert_eq!(a[1], b[1]);
            assert_eq!(&a[2..34], &b[2..34]);
            assert_eq!(&b[34..62], &before_b[34..62], "token, attempt, fence kept");
            assert_eq!(u64_at(&b, 62), 0, "no lease");
            assert_eq!(&b[70..78], &before_b[70..78], "created kept");
            let ttl_b: i64 = redis::cmd("PTTL")
                .arg(alone.redis_key(&kb))
                .query_async(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let expires_b = u64_at(&b, 78);
            let now = ms_of(std::time::SystemTime::now());
            assert!(
                (expires_b as i64 - now as i64 - ttl_b).abs() < 1000,
                "expires field {expires_b}, now {now}, pttl {ttl_b}"
            );
            // Both replay the same.
            let ra = batch_one(&batched, &ka, f, LEASE).await;
            let rb = alone.acquire(&kb, f, LEASE).await;
            assert_eq!(kind(&ra), kind(&rb));
        }
    }
}

/// Corrupt and odd records: batched answers as alone.
#[tokio::test]
async fn odd_records_answer_batched_as_alone() {
    let server = RedisServer::start(&[]);
    let (alone, batched, mut conn) = stores(&server).await;
    let now = ms_of(std::time::SystemTime::now());
    let header = |status: u8, flag: u8, attempt: u32, fence: u64, lease: u64, expires: u64| {
        let mut v = vec![status, flag];
        v.extend_from_slice(&[7; 32]);
        v.extend_from_slice(&[9; 16]);
        v.extend_from_slice(&attempt.to_be_bytes());
        for n in [fence, lease, now - 1000, expires, now - 500] {
            v.extend_from_slice(&n.to_be_bytes());
        }
        v
    };
    let cases: Vec<(&str, Vec<u8>, Option<u64>)> = vec![
        (
            "live-c",
            [header(b'c', b'0', 1, 5, 0, now + 60_000), b"r".to_vec()].concat(),
            Some(60_000),
        ),
        (
            "c-attempt0",
            [header(b'c', b'0', 0, 5, 0, now + 60_000), b"r".to_vec()].concat(),
            Some(60_000),
        ),
        (
            "c-badflag",
            [header(b'c', b'7', 1, 5, 0, now + 60_000), b"r".to_vec()].concat(),
            Some(60_000),
        ),
        (
            "c-huge-exp",
            [header(b'c', b'0', 1, 5, 0, u64::MAX), b"r".to_vec()].concat(),
            Some(60_000),
        ),
        (
            "c-huge-fence",
            [
                header(b'c', b'0', 1, u64::MAX, 0, now + 60_000),
                b"r".to_vec(),
            ]
            .concat(),
            Some(60_000),
        ),
        (
            "c-persist",
            [header(b'c', b'0', 1, 5, 0, now + 60_000), b"r".to_vec()].concat(),
            None,
        ),
        (
            "c-persist-past",
            [header(b'c', b'0', 1, 5, 0, now - 10), b"r".to_vec()].concat(),
            None,
        ),
        (
            "c-fp-mismatch",
            [header(b'c', b'1', 1, 5, 0, now + 60_000), b"r".to_vec()].concat(),
            Some(60_000),
        ),
        (
            "p-live",
            header(b'p', b'0', 1, 5, now + 60_000, now + 70_000),
            Some(60_000),
        ),
        (
            "p-over",
            header(b'p', b'0', 3, 5, now - 10, now + 70_000),
            Some(60_000),
        ),
        ("short", b"c1short".to_vec(), Some(60_000)),
        (
            "x-status",
            header(b'x', b'0', 1, 5, 0, now + 60_000),
            Some(60_000),
        ),
        ("empty", Vec::new(), Some(60_000)),
    ];
    let fp = Fingerprint::of_bytes(b"q");
    let mut diffs = Vec::new();
    for (name, bytes, ttl) in &cases {
        for f in [None, Some(&fp)] {
            let (ka, kb) = (
                key(&format!("{name}-a-{}", f.is_some())),
                key(&format!("{name}-b-{}", f.is_some())),
            );
            for k in [&ka, &kb] {
                let mut cmd = redis::cmd("SET");
                cmd.arg(alone.redis_key(k)).arg(bytes.as_slice());
                if let Some(ms) = ttl {
                    cmd.arg("PX").arg(*ms);
                }
                let _: () = cmd
                    .query_async(&mut conn)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
            }
            let by_alone = alone.acquire(&ka, f, LEASE).await;
            let by_batch = batch_one(&batched, &kb, f, LEASE).await;
            let (x, y) = (kind(&by_alone), kind(&by_batch));
            // Error texts differ by key name; compare their kind only.
            let norm = |s: &str| s.replace("-b-", "-a-");
            if norm(&x) != norm(&y) {
                diffs.push(format!("{name} fp={}: alone {x}, batched {y}", f.is_some()));
            }
            if let (Ok(Acquisition::Acquired(a)), Ok(Acquisition::Acquired(b))) =
                (&by_alone, &by_batch)
            {
                if a.attempt != b.attempt || (a.fence > 5) != (b.fence > 5) {
                    diffs.push(format!("{name}: leases {a:?} vs {b:?}"));
                }
            }
        }
    }
    // A key of another type.
    for k in [key("list-a"), key("list-b")] {
        let _: () = redis::cmd("RPUSH")
            .arg(alone.redis_key(&k))
            .arg("x")
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let x = kind(&alone.acquire(&key("list-a"), None, LEASE).await);
    let y = kind(&batch_one(&batched, &key("list-b"), None, LEASE).await);
    if x != y.replace("list-b", "list-a") {
        diffs.push(format!("list: alone {x}, batched {y}"));
    }
    assert!(diffs.is_empty(), "{diffs:#?}");
}

/// Under wait_for_replicas(1, 3 s) with a 2 s lease, a replica that lags
/// 1.5 s: a duplicate alone waits up to 3 s and replays; the same
/// duplicate batched with a fresh key is bounded by that key's lease
/// (1 s) and gets the fresh key's failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_replay_under_wait_is_not_failed_by_another_keys_lease() {
    let primary = RedisServer::start(&[]);
    let replica = std::sync::Arc::new(RedisServer::start(&[
        "--replicaof",
        "127.0.0.1",
        &primary.port.to_string(),
    ]));
    wait_for_replication(&primary, &replica);
    let base = RedisStore::connect(&primary.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .call_timeout(Duration::from_secs(10));
    let durable = base.clone().wait_for_replicas(1, Duration::from_secs(3));
    let alone = durable.clone().batching(Batching::off());
    let lease = Duration::from_secs(2);
    let done = key("wait-done");
    let l = acquired(&alone.acquire(&done, None, lease).await);
    alone
        .complete(&l, b"recorded", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let lag = |replica: std::sync::Arc<RedisServer>| {
        replica.signal("STOP");
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            replica.signal("CONT");
        })
    };
    // Alone: the duplicate waits for the lagging replica and replays.
    let thaw = lag(replica.clone());
    let by_alone = alone.acquire(&done, None, lease).await;
    thaw.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(kind(&by_alone), "Completed(\"recorded\")");

    // Batched with a fresh key: the same duplicate.
    let fresh = key("wait-fresh");
    let thaw = lag(replica.clone());
    let got = durable
        .acquire_many(
            &[
                AcquireItem::new(&fresh, None),
                AcquireItem::new(&done, None),
            ],
            lease,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    thaw.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        kind(&got[1]),
        kind(&by_alone),
        "the duplicate, batched with a fresh key"
    );
}
