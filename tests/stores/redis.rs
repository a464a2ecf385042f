//! RedisStore against real Redis servers started by tests/support (or
//! IDEM_REDIS_URL / IDEM_REDIS_CLUSTER_URLS): the conformance suite on a
//! standalone server and on a 3-master cluster, bad records, round trips,
//! and a server killed and restarted in the middle of a storm.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use idemkit::redis::redis::aio::ConnectionLike;
use idemkit::redis::redis::cluster_async::ClusterConnection;
use idemkit::redis::RedisStore;
use idemkit::testkit::{self, Harness, Settings};
use idemkit::{
    async_trait, Acquisition, IdemError, Idempotency, IdempotencyKey, IdempotencyStore,
    InProgressPolicy, Processed, StoreError,
};
use support::redis_server::{self, RedisServer};

async fn standalone() -> RedisStore {
    RedisStore::connect(redis_server::shared_url())
        .await
        .unwrap_or_else(|e| panic!("cannot connect to Redis: {e}"))
}

async fn cluster() -> RedisStore<ClusterConnection> {
    RedisStore::connect_cluster(redis_server::shared_cluster().iter().map(String::as_str))
        .await
        .unwrap_or_else(|e| panic!("cannot connect to the Redis Cluster: {e}"))
}

/// Overwrites a record with a plain string far shorter than a record header.
async fn clobber<C>(store: &RedisStore<C>, conn: &mut impl ConnectionLike, key: &IdempotencyKey)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let _: () = idemkit::redis::redis::cmd("SET")
        .arg(store.redis_key(key))
        .arg("garbage")
        .query_async(conn)
        .await
        .unwrap_or_else(|e| panic!("corrupt: {e}"));
}

fn settings() -> Settings {
    Settings::default()
        .lease(Duration::from_millis(300))
        .purge_reports_removed(false)
}

struct RedisHarness;

#[async_trait]
impl Harness for RedisHarness {
    type Store = RedisStore;
    async fn store(&self) -> RedisStore {
        standalone().await
    }
    async fn corrupt(&self, store: &RedisStore, key: &IdempotencyKey) {
        let client = idemkit::redis::redis::Client::open(redis_server::shared_url())
            .unwrap_or_else(|e| panic!("{e}"));
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        clobber(store, &mut conn, key).await;
    }
    fn settings(&self) -> Settings {
        settings()
    }
}

idemkit::conformance_tests!(RedisHarness);

/// The same store with its batching of concurrent calls off (on by
/// default on one Redis server): the whole suite again, every call alone.
mod without_batching {
    use super::*;

    pub(super) struct UnbatchedRedisHarness;

    #[async_trait]
    impl Harness for UnbatchedRedisHarness {
        type Store = RedisStore;
        async fn store(&self) -> RedisStore {
            standalone().await.batching(idemkit::Batching::off())
        }
        async fn corrupt(&self, store: &RedisStore, key: &IdempotencyKey) {
            RedisHarness.corrupt(store, key).await
        }
        fn settings(&self) -> Settings {
            settings()
        }
    }

    idemkit::conformance_tests!(UnbatchedRedisHarness);
}

mod on_cluster {
    use super::*;

    pub(super) struct ClusterHarness;

    #[async_trait]
    impl Harness for ClusterHarness {
        type Store = RedisStore<ClusterConnection>;
        async fn store(&self) -> RedisStore<ClusterConnection> {
            cluster().await
        }
        async fn corrupt(&self, store: &RedisStore<ClusterConnection>, key: &IdempotencyKey) {
            let client = idemkit::redis::redis::cluster::ClusterClient::new(
                redis_server::shared_cluster().to_vec(),
            )
            .unwrap_or_else(|e| panic!("{e}"));
            let mut conn = client
                .get_async_connection()
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            clobber(store, &mut conn, key).await;
        }
        fn settings(&self) -> Settings {
            settings()
        }
    }

    idemkit::conformance_tests!(ClusterHarness);

    /// The storm's keys land on every master: every slot range works.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_spread_over_every_master() {
        let store = cluster().await;
        let idem = testkit::storm_executor(store);
        testkit::storm(&[idem], 8, 300).await;
        for url in redis_server::shared_cluster() {
            let port: u16 = url
                .trim_end_matches('/')
                .rsplit(':')
                .next()
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("cannot parse {url}"));
            let reply = redis_server::command(port, "DBSIZE");
            let keys: u64 = reply
                .trim()
                .trim_start_matches(':')
                .parse()
                .unwrap_or_else(|_| panic!("DBSIZE reply {reply:?}"));
            assert!(keys > 0, "master {url} holds no record");
        }
    }
}

/// The `backend` label of the store-call histogram.
#[tokio::test]
async fn the_backend_label_is_redis_standalone_and_cluster() {
    assert_eq!(standalone().await.backend_name(), "redis");
    assert_eq!(cluster().await.backend_name(), "redis");
}

#[tokio::test]
async fn undecodable_records_are_corrupt_never_absent() {
    let store = standalone().await;
    let client = idemkit::redis::redis::Client::open(redis_server::shared_url())
        .unwrap_or_else(|e| panic!("{e}"));
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // (what, offset, bytes written over the stored record; see
    // idem-redis/scripts/acquire.lua for the layout)
    let damage: [(&str, isize, &[u8]); 5] = [
        ("status", 0, b"x"),
        ("fingerprint flag", 1, b"7"),
        ("attempt 0", 50, &[0, 0, 0, 0]),
        ("fence over 2^53", 54, &[0xff; 8]),
        ("truncated", -1, b"c1"),
    ];
    for (i, (what, offset, bytes)) in damage.iter().enumerate() {
        let change = what;
        let k = testkit::unique_key(&format!("damaged-{i}"));
        let fp = idemkit::Fingerprint::of_bytes(b"p");
        let Ok(Acquisition::Acquired(l)) =
            store.acquire(&k, Some(&fp), Duration::from_secs(30)).await
        else {
            panic!("not acquired")
        };
        assert!(store
            .complete(&l, b"r", Duration::from_secs(600))
            .await
            .is_ok());
        let cmd = if *offset < 0 {
            // A string shorter than the header, with the expiry kept.
            let mut cmd = idemkit::redis::redis::cmd("SET");
            cmd.arg(store.redis_key(&k)).arg(*bytes).arg("KEEPTTL");
            cmd
        } else {
            let mut cmd = idemkit::redis::redis::cmd("SETRANGE");
            cmd.arg(store.redis_key(&k)).arg(*offset).arg(*bytes);
            cmd
        };
        let _: idemkit::redis::redis::Value = cmd
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let got = store.get(&k).await;
        assert!(
            matches!(&got, Err(StoreError::Corrupt { key, .. }) if *key == k),
            "get after {change:?}: {got:?}"
        );
        let got = store.acquire(&k, None, Duration::from_secs(30)).await;
        assert!(
            matches!(&got, Err(StoreError::Corrupt { key, .. }) if *key == k),
            "acquire after {change:?}: {got:?}"
        );
    }
}

/// Every store operation is one round trip, counted on the wire.
#[tokio::test]
async fn every_operation_is_one_round_trip() {
    let url = redis_server::shared_url();
    let host_port = url
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .to_owned();
    let upstream = tokio::net::lookup_host(host_port.as_str())
        .await
        .ok()
        .and_then(|mut a| a.next())
        .unwrap_or_else(|| panic!("cannot resolve {host_port}"));
    let proxy = support::proxy::CountingProxy::start(upstream).await;
    let client = idemkit::redis::redis::Client::open(format!("redis://{}/", proxy.addr))
        .unwrap_or_else(|e| panic!("{e}"));
    let conn = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = RedisStore::new(conn);
    let long = Duration::from_secs(60);

    // Warm up: the first call of each script loads it (NOSCRIPT, SCRIPT LOAD).
    let warm = testkit::unique_key("rt-warm");
    let Ok(Acquisition::Acquired(l)) = store.acquire(&warm, None, long).await else {
        panic!("warm-up")
    };
    let l = store
        .extend(&l, long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    store
        .complete(&l, b"r", long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let warm2 = testkit::unique_key("rt-warm2");
    let Ok(Acquisition::Acquired(l)) = store.acquire(&warm2, None, long).await else {
        panic!("warm-up")
    };
    store.release(&l).await.unwrap_or_else(|e| panic!("{e}"));
    store.delete(&warm).await.unwrap_or_else(|e| panic!("{e}"));
    let warm3 = testkit::unique_key("rt-warm3");
    let warmed = store
        .acquire_many(&[idemkit::AcquireItem::new(&warm3, None)], long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let Some(Ok(Acquisition::Acquired(l))) = warmed.into_iter().next() else {
        panic!("warm-up")
    };
    store
        .complete_many(&[(&l, &b"r"[..])], long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let k = testkit::unique_key("rt");
    let mut measured = Vec::new();
    macro_rules! measure {
        ($name:expr, $call:expr) => {{
            let before = proxy.turns();
            let out = $call;
            measured.push(($name, proxy.turns() - before));
            out
        }};
    }
    let Ok(Acquisition::Acquired(l)) =
        measure!("acquire (fresh)", store.acquire(&k, None, long).await)
    else {
        panic!("fresh")
    };
    let l = measure!("extend", store.extend(&l, long).await).unwrap_or_else(|e| panic!("{e}"));
    let busy = measure!("acquire (in progress)", store.acquire(&k, None, long).await);
    assert!(
        matches!(busy, Ok(Acquisition::InProgress { .. })),
        "{busy:?}"
    );
    measure!("complete", store.complete(&l, b"r", long).await).unwrap_or_else(|e| panic!("{e}"));
    let dup = measure!("acquire (duplicate)", store.acquire(&k, None, long).await);
    assert!(matches!(dup, Ok(Acquisition::Completed(_))), "{dup:?}");
    let got = measure!("get", store.get(&k).await);
    assert!(matches!(got, Ok(Some(_))), "{got:?}");
    let deleted = measure!("delete", store.delete(&k).await);
    assert!(matches!(deleted, Ok(true)), "{deleted:?}");
    let Ok(Acquisition::Acquired(l)) = store.acquire(&k, None, long).await else {
        panic!("acquire")
    };
    measure!("release", store.release(&l).await).unwrap_or_else(|e| panic!("{e}"));
    // A batch of 100 keys (fresh, completed, in progress, a mismatch) is
    // one acquire_many script call, and completing it one more.
    let batch: Vec<IdempotencyKey> = (0..100)
        .map(|i| testkit::unique_key(&format!("rt-batch-{i}")))
        .collect();
    let fp = idemkit::Fingerprint::of_bytes(b"a");
    let other = idemkit::Fingerprint::of_bytes(b"b");
    let items: Vec<idemkit::AcquireItem<'_>> = batch
        .iter()
        .map(|k| idemkit::AcquireItem::new(k, Some(&fp)))
        .collect();
    let first = measure!(
        "acquire_many (100 fresh)",
        store.acquire_many(&items, long).await
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let leases: Vec<idemkit::Lease> = first
        .into_iter()
        .map(|r| match r {
            Ok(Acquisition::Acquired(l)) => l,
            other => panic!("{other:?}"),
        })
        .collect();
    let half: Vec<(&idemkit::Lease, &[u8])> = leases[..50].iter().map(|l| (l, &b"r"[..])).collect();
    let done = measure!("complete_many (50)", store.complete_many(&half, long).await)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(done.iter().all(|d| d.is_ok()), "{done:?}");
    let mut mixed = items.clone();
    mixed[99] = idemkit::AcquireItem::new(&batch[99], Some(&other));
    let again = measure!(
        "acquire_many (50 completed, 49 in progress, 1 mismatch)",
        store.acquire_many(&mixed, long).await
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(again[..50]
        .iter()
        .all(|a| matches!(a, Ok(Acquisition::Completed(_)))));
    assert!(again[50..99]
        .iter()
        .all(|a| matches!(a, Ok(Acquisition::InProgress { .. }))));
    assert!(
        matches!(again[99], Ok(Acquisition::Mismatch)),
        "{:?}",
        again[99]
    );
    for (op, turns) in measured {
        assert_eq!(turns, 1, "{op} took {turns} round trips");
    }
}

#[tokio::test]
async fn eviction_policy_is_checked_and_wait_is_enforced() {
    let server = RedisServer::start(&[]);
    let store = RedisStore::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        store.check_eviction_policy().await.as_deref(),
        Some("noeviction")
    );
    server.command("CONFIG SET maxmemory-policy allkeys-lru");
    assert_eq!(
        store.check_eviction_policy().await.as_deref(),
        Some("allkeys-lru")
    );

    // WAIT for a replica this server does not have: the acquisition is
    // reported as not durable enough, as a retryable error.
    let waiting = store
        .clone()
        .wait_for_replicas(1, Duration::from_millis(100));
    match waiting
        .acquire(&testkit::unique_key("wait"), None, Duration::from_secs(5))
        .await
    {
        Err(e @ StoreError::Unavailable(_)) => assert!(e.is_retryable()),
        other => panic!("expected Unavailable from WAIT, got {other:?}"),
    }
    let no_replicas = store.wait_for_replicas(0, Duration::from_millis(100));
    let got = no_replicas
        .acquire(&testkit::unique_key("wait0"), None, Duration::from_secs(5))
        .await;
    assert!(matches!(got, Ok(Acquisition::Acquired(_))), "{got:?}");
}

/// Redis is killed (SIGKILL) in the middle of a storm and started again on
/// the same port with its append-only file. Calls during the outage fail
/// with Unavailable; the same store carries on after the restart; every key
/// ran exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_killed_and_restarted_mid_storm_runs_nothing_twice() {
    let server = Arc::new(RedisServer::start(&[
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
    ]));
    let store = RedisStore::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .call_timeout(Duration::from_millis(500));
    // A reservation whose reply was lost in the crash stays until its lease
    // ends (the redelivery then takes it over): keep the lease short.
    let idem = Idempotency::new(store)
        .lease(Duration::from_secs(5))
        .on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::from_secs(30),
            poll: Duration::from_millis(5),
        });
    let (down, up) = (server.clone(), server.clone());
    let report = support::chaos::storm_through_fault(
        idem,
        300,
        16,
        Box::new(move || down.kill()),
        Some(Box::new(move || up.start_again())),
    )
    .await;
    assert!(report.unavailable > 0, "no call saw the outage");
}

/// Reads what a store left under `key` with a raw connection: whether the
/// Redis key exists, and its PTTL (-1: no expiry, -2: absent).
async fn raw_state(store: &RedisStore, key: &IdempotencyKey) -> (bool, i64) {
    let client = idemkit::redis::redis::Client::open(redis_server::shared_url())
        .unwrap_or_else(|e| panic!("{e}"));
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let (exists, pttl): (i64, i64) = idemkit::redis::redis::pipe()
        .cmd("EXISTS")
        .arg(store.redis_key(key))
        .cmd("PTTL")
        .arg(store.redis_key(key))
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    (exists == 1, pttl)
}

/// `Duration::MAX` (and other huge durations) as a lease, an extension or
/// a retention never leaves a half-written record: either the call
/// succeeds and the record has an expiry, or it fails and nothing changed.
/// (Before the durations were saturated, acquire HSET the record and then
/// failed at PEXPIREAT, leaving a hash with no expiry behind an error.)
#[tokio::test]
async fn huge_durations_never_half_write_a_record() {
    let store = standalone().await;
    let huge = [
        Duration::MAX,
        Duration::from_secs(u64::MAX / 1_000),
        Duration::from_millis(u64::MAX / 4 + 1),
    ];
    for (i, d) in huge.into_iter().enumerate() {
        // acquire
        let k = testkit::unique_key(&format!("huge-acquire-{i}"));
        let got = store.acquire(&k, None, d).await;
        let (exists, pttl) = raw_state(&store, &k).await;
        match &got {
            Ok(Acquisition::Acquired(_)) => {
                assert!(exists && pttl > 0, "acquire({d:?}): pttl {pttl}")
            }
            Err(_) => assert!(
                !exists,
                "acquire({d:?}) failed ({got:?}) but wrote a record"
            ),
            other => panic!("acquire({d:?}): {other:?}"),
        }
        assert!(got.is_ok(), "acquire({d:?}): {got:?}");

        // extend
        let k = testkit::unique_key(&format!("huge-extend-{i}"));
        let Ok(Acquisition::Acquired(lease)) =
            store.acquire(&k, None, Duration::from_secs(30)).await
        else {
            panic!("acquire")
        };
        let (_, pttl_before) = raw_state(&store, &k).await;
        let got = store.extend(&lease, d).await;
        let (exists, pttl) = raw_state(&store, &k).await;
        assert!(exists, "extend({d:?}) removed the record");
        match &got {
            Ok(_) => assert!(pttl > pttl_before, "extend({d:?}): pttl {pttl}"),
            Err(_) => panic!("extend({d:?}): {got:?}"),
        }
        let record = store.get(&k).await;
        assert!(
            matches!(record, Ok(Some(_))),
            "get after extend({d:?}): {record:?}"
        );

        // complete
        let got = store.complete(&lease, b"done", d).await;
        let (exists, pttl) = raw_state(&store, &k).await;
        assert!(got.is_ok(), "complete({d:?}): {got:?}");
        assert!(exists && pttl > 0, "complete({d:?}): pttl {pttl}");
        let record = store.get(&k).await;
        assert!(
            matches!(&record, Ok(Some(r)) if r.is_completed()),
            "get after complete({d:?}): {record:?}"
        );
        let replay = store.acquire(&k, None, Duration::from_secs(30)).await;
        assert!(
            matches!(&replay, Ok(Acquisition::Completed(r)) if &r.response[..] == b"done"),
            "replay after complete({d:?}): {replay:?}"
        );
    }
}

/// A raw connection to the shared standalone server.
async fn raw_conn() -> idemkit::redis::redis::aio::MultiplexedConnection {
    idemkit::redis::redis::Client::open(redis_server::shared_url())
        .unwrap_or_else(|e| panic!("{e}"))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Every script checks every argument before its first write: called
/// directly with a bad one (not a number, a fraction, negative, NaN, inf,
/// over MAX_DURATION, a wrong-sized token or fingerprint, a missing
/// argument), it answers an `IDEM_INVALID` error and the record is exactly
/// as before (absent, or the live record untouched).
#[tokio::test]
async fn scripts_refuse_bad_arguments_before_writing() {
    use idemkit::redis::redis::{Script, Value};
    let store = standalone().await;
    let mut conn = raw_conn().await;
    let token = [7u8; 16];
    let over = (idemkit::MAX_DURATION.as_millis() + 1).to_string();
    let bad_ms: [&[u8]; 9] = [
        b"",
        b"abc",
        b"1.5",
        b"-1",
        b"nan",
        b"inf",
        b"1e300",
        over.as_bytes(),
        b"18446744073709551615",
    ];
    let script = |name: &str| {
        Script::new(match name {
            "acquire" => include_str!("../../idem-redis/scripts/acquire.lua"),
            "complete" => include_str!("../../idem-redis/scripts/complete.lua"),
            "extend" => include_str!("../../idem-redis/scripts/extend.lua"),
            _ => include_str!("../../idem-redis/scripts/release.lua"),
        })
    };
    async fn run(
        conn: &mut idemkit::redis::redis::aio::MultiplexedConnection,
        script: &Script,
        key: &str,
        args: &[&[u8]],
    ) -> Result<Value, idemkit::redis::redis::RedisError> {
        let mut inv = script.prepare_invoke();
        inv.key(key);
        for a in args {
            inv.arg(*a);
        }
        inv.invoke_async(conn).await
    }
    let refused = |what: String, got: Result<Value, idemkit::redis::redis::RedisError>| match got {
        Err(e) if e.code() == Some("IDEM_INVALID") => {}
        other => panic!("{what}: expected an IDEM_INVALID error, got {other:?}"),
    };

    // acquire on an absent key: a bad lease, grace, token or fingerprint
    // writes nothing.
    let acquire = script("acquire");
    let k = testkit::unique_key("bad-args");
    let rk = store.redis_key(&k);
    let mut cases: Vec<(String, Vec<&[u8]>)> = Vec::new();
    for bad in bad_ms {
        let label = String::from_utf8_lossy(bad).into_owned();
        cases.push((format!("lease {label:?}"), vec![b"", &token, bad, b"1000"]));
        cases.push((format!("grace {label:?}"), vec![b"", &token, b"1000", bad]));
    }
    cases.push(("lease 0".into(), vec![b"", &token, b"0", b"1000"]));
    cases.push(("short token".into(), vec![b"", b"short", b"1000", b"1000"]));
    cases.push((
        "fingerprint of 3 bytes".into(),
        vec![b"abc", &token, b"1000", b"1000"],
    ));
    cases.push(("3 arguments".into(), vec![b"", &token, b"1000"]));
    for (what, args) in &cases {
        refused(
            format!("acquire, {what}"),
            run(&mut conn, &acquire, &rk, args).await,
        );
        let (exists, _) = raw_state(&store, &k).await;
        assert!(!exists, "acquire with {what} wrote a record");
    }

    // extend and complete on a live record: nothing changes.
    let Ok(Acquisition::Acquired(lease)) = store.acquire(&k, None, Duration::from_secs(30)).await
    else {
        panic!("acquire")
    };
    let lease_token = lease.token.to_bytes();
    let snapshot = |conn: &mut idemkit::redis::redis::aio::MultiplexedConnection| {
        let rk = rk.clone();
        let mut conn = conn.clone();
        async move {
            let record: Vec<u8> = idemkit::redis::redis::cmd("GET")
                .arg(&rk)
                .query_async(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            record
        }
    };
    let before = snapshot(&mut conn).await;
    let extend = script("extend");
    let complete = script("complete");
    for bad in bad_ms {
        let label = String::from_utf8_lossy(bad).into_owned();
        refused(
            format!("extend, lease {label:?}"),
            run(&mut conn, &extend, &rk, &[&lease_token, bad, b"1000"]).await,
        );
        refused(
            format!("extend, grace {label:?}"),
            run(&mut conn, &extend, &rk, &[&lease_token, b"1000", bad]).await,
        );
        refused(
            format!("complete, retention {label:?}"),
            run(&mut conn, &complete, &rk, &[&lease_token, b"r", bad]).await,
        );
        assert_eq!(snapshot(&mut conn).await, before, "changed by {label:?}");
    }
    refused(
        "extend, lease 0".into(),
        run(&mut conn, &extend, &rk, &[&lease_token, b"0", b"1000"]).await,
    );
    refused(
        "complete, short token".into(),
        run(&mut conn, &complete, &rk, &[b"short", b"r", b"1000"]).await,
    );
    // release, delete_if_token and delete take the record and their
    // call's marker, whose time to live is checked before any write (a PX
    // refused after the DEL would leave the call half done).
    let marker = format!("{rk}-marker");
    let marked = |source: &'static str, args: Vec<&[u8]>| {
        let script = Script::new(source);
        let keys = [rk.clone(), marker.clone()];
        let args: Vec<Vec<u8>> = args.into_iter().map(<[u8]>::to_vec).collect();
        let mut conn = conn.clone();
        async move {
            let mut inv = script.prepare_invoke();
            for k in &keys {
                inv.key(k);
            }
            for a in &args {
                inv.arg(&a[..]);
            }
            inv.invoke_async::<Value>(&mut conn).await
        }
    };
    let release = include_str!("../../idem-redis/scripts/release.lua");
    let delete_if_token = include_str!("../../idem-redis/scripts/delete_if_token.lua");
    let delete = include_str!("../../idem-redis/scripts/delete.lua");
    let token: &[u8] = &lease_token;
    refused(
        "release, short token".into(),
        marked(release, vec![b"short", b"1000"]).await,
    );
    refused("release, no token".into(), marked(release, vec![]).await);
    for bad in bad_ms.iter().copied().chain([&b"0"[..]]) {
        let label = String::from_utf8_lossy(bad).into_owned();
        refused(
            format!("release, marker ttl {label:?}"),
            marked(release, vec![token, bad]).await,
        );
        refused(
            format!("delete_if_token, marker ttl {label:?}"),
            marked(delete_if_token, vec![token, bad]).await,
        );
        refused(
            format!("delete, marker ttl {label:?}"),
            marked(delete, vec![bad]).await,
        );
    }
    refused(
        "release, the record only".into(),
        run(&mut conn, &script("release"), &rk, &[token, b"1000"]).await,
    );
    assert_eq!(
        snapshot(&mut conn).await,
        before,
        "changed by a refused call"
    );
    // The lease is intact.
    assert!(store
        .complete(&lease, b"ok", Duration::from_secs(60))
        .await
        .is_ok());
}

/// The same acquire script reaching Redis twice (a client retry after a
/// lost reply, same token) answers "acquired" both times, with the same
/// fence and attempt: the second delivery does not lock its own caller out.
#[tokio::test]
async fn resent_acquire_is_still_acquired_with_the_same_fence() {
    use idemkit::redis::redis::{Script, Value};
    let store = standalone().await;
    let mut conn = raw_conn().await;
    let k = testkit::unique_key("resent");
    let rk = store.redis_key(&k);
    let acquire = Script::new(include_str!("../../idem-redis/scripts/acquire.lua"));
    let token = [9u8; 16];
    let mut replies = Vec::new();
    for _ in 0..2 {
        let reply: Value = acquire
            .key(&rk)
            .arg(&[] as &[u8])
            .arg(&token[..])
            .arg(30_000u64)
            .arg(1_000u64)
            .invoke_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        replies.push(reply);
    }
    let fence_of = |v: &Value| match v {
        Value::Array(items) if items.len() == 5 => {
            assert!(
                matches!(&items[0], Value::BulkString(b) if b == b"acquired"),
                "{v:?}"
            );
            (items[1].clone(), items[4].clone())
        }
        other => panic!("expected acquired, got {other:?}"),
    };
    assert_eq!(fence_of(&replies[0]), fence_of(&replies[1]));
    // A third caller with another token sees it in progress.
    let other = store.acquire(&k, None, Duration::from_secs(30)).await;
    assert!(
        matches!(other, Ok(Acquisition::InProgress { .. })),
        "{other:?}"
    );
}

/// A stored fence ahead of the server's clock (a record written by a
/// primary whose clock ran ahead) is still exceeded by the next
/// acquisition: the stored fence + 1. And `get`/`extend` report it.
#[tokio::test]
async fn fence_exceeds_a_stored_fence_ahead_of_the_clock() {
    let store = standalone().await;
    let mut conn = raw_conn().await;
    let k = testkit::unique_key("fence-ahead");
    let short = Duration::from_millis(50);
    let Ok(Acquisition::Acquired(first)) = store.acquire(&k, None, short).await else {
        panic!("acquire")
    };
    // A fence an hour ahead of the clock.
    let ahead = first.fence + 3_600_000_000;
    // The fence: 8 big-endian bytes at offset 54 of the stored record.
    let _: i64 = idemkit::redis::redis::cmd("SETRANGE")
        .arg(store.redis_key(&k))
        .arg(54)
        .arg(&ahead.to_be_bytes()[..])
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let record = store.get(&k).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(record.map(|r| r.fence), Some(ahead));
    let extended = store
        .extend(&first, short)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(extended.fence, ahead);
    tokio::time::sleep(Duration::from_millis(120)).await;
    match store.acquire(&k, None, Duration::from_secs(30)).await {
        Ok(Acquisition::Acquired(taken)) => {
            assert_eq!(taken.attempt, 2);
            assert_eq!(taken.fence, ahead + 1);
        }
        other => panic!("expected a takeover, got {other:?}"),
    }
}

/// DESIGN 4: Redis under `maxmemory` with `noeviction`
/// (the policy the README asks for) cannot hold a 12 MiB result: the store
/// refuses it before sending (its limit follows `maxmemory`), so the key
/// completes as not replayable: the caller gets its value, a duplicate
/// after the lease gets `ResultUnavailable`, and the handler runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_redis_refuses_completes_the_key_as_not_replayable() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let server = RedisServer::start(&["--maxmemory", "8mb", "--maxmemory-policy", "noeviction"]);
    let store = RedisStore::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let lease = Duration::from_millis(600);
    let idem = Idempotency::new(store).lease(lease);
    let key = testkit::unique_key("oom");
    let effects = Arc::new(AtomicU64::new(0));
    let run = || {
        let (idem, key, effects) = (idem.clone(), key.clone(), effects.clone());
        async move {
            idem.process(&key, "export", move |_| async move {
                effects.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>("x".repeat(12 << 20))
            })
            .await
        }
    };
    match run().await {
        Ok(Processed::ExecutedNotReplayable { value, reason }) => {
            assert_eq!(value.len(), 12 << 20, "the caller gets its value");
            assert!(reason.contains("limit"), "{reason}");
        }
        other => panic!("first delivery: {:?}", other.map(|p| p.is_replayed())),
    }
    tokio::time::sleep(lease + Duration::from_millis(400)).await; // past the lease
    let second = run().await;
    assert!(
        matches!(second, Err(IdemError::ResultUnavailable { .. })),
        "{:?}",
        second.map(|p| p.is_replayed())
    );
    assert_eq!(effects.load(Ordering::SeqCst), 1, "the handler ran twice");
}

/// A `WAIT` that fails after an acquisition releases the
/// reservation, so the retry acquires the key (before: the key stayed in
/// progress for its lease, and the retry was refused).
#[tokio::test]
async fn a_failed_wait_releases_the_reservation() {
    let server = RedisServer::start(&[]);
    let store = RedisStore::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let k = testkit::unique_key("wait-release");
    // One replica asked for, none attached: WAIT answers 0.
    let waiting = store
        .clone()
        .wait_for_replicas(1, Duration::from_millis(100));
    match waiting.acquire(&k, None, Duration::from_secs(30)).await {
        Err(e @ StoreError::Unavailable(_)) => {
            assert!(e.to_string().contains("0 of 1"), "{e}")
        }
        other => panic!("expected Unavailable from WAIT, got {other:?}"),
    }
    let left = store.get(&k).await;
    assert!(
        matches!(left, Ok(None)),
        "the failed acquisition left a record: {left:?}"
    );
    let retry = store.acquire(&k, None, Duration::from_secs(30)).await;
    match retry {
        Ok(Acquisition::Acquired(lease)) => assert_eq!(lease.attempt, 1),
        other => panic!("the retry was not acquired: {other:?}"),
    }
}

/// The store's calls are bounded by its own settings, not
/// by a fixed 2 s response timeout on the connection: with
/// `call_timeout(10 s)` and `WAIT` for 3 s or more, a replica that lags 3 s
/// is waited for. A replica frozen for the whole `WAIT` gives `Unavailable`
/// after the `WAIT` timeout (not at 2 s), and the reservation is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_replicas_follows_the_wait_timeout_not_a_fixed_two_seconds() {
    let primary = RedisServer::start(&[]);
    let replica = Arc::new(RedisServer::start(&[
        "--replicaof",
        "127.0.0.1",
        &primary.port.to_string(),
    ]));
    redis_server::wait_for_replication(&primary, &replica);
    let store = RedisStore::connect(&primary.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .call_timeout(Duration::from_secs(10));

    // The replica frozen for the whole WAIT of 3 s.
    replica.signal("STOP");
    let k = testkit::unique_key("wait-frozen");
    let started = std::time::Instant::now();
    let got = store
        .clone()
        .wait_for_replicas(1, Duration::from_secs(3))
        .acquire(&k, None, Duration::from_secs(30))
        .await;
    let waited = started.elapsed();
    println!("WAIT 3 s, replica frozen: {got:?} after {waited:?}");
    match &got {
        Err(e @ StoreError::Unavailable(_)) => {
            assert!(e.to_string().contains("0 of 1"), "{e}")
        }
        other => panic!("expected Unavailable from WAIT, got {other:?}"),
    }
    assert!(
        waited >= Duration::from_secs(3),
        "gave up after {waited:?}, before the WAIT timeout"
    );
    assert!(
        matches!(store.get(&k).await, Ok(None)),
        "the reservation was not released"
    );

    // The replica lags 3 s, then acknowledges: WAIT 6 s sees it.
    let thaw = {
        let replica = replica.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3)).await; // the lag
            replica.signal("CONT");
        })
    };
    let k = testkit::unique_key("wait-lag");
    let started = std::time::Instant::now();
    let got = store
        .clone()
        .wait_for_replicas(1, Duration::from_secs(6))
        .acquire(&k, None, Duration::from_secs(30))
        .await;
    let waited = started.elapsed();
    thaw.await.unwrap_or_else(|e| panic!("{e}"));
    println!(
        "WAIT 6 s, replica lagging 3 s: acquired={} after {waited:?}",
        matches!(got, Ok(Acquisition::Acquired(_)))
    );
    assert!(
        matches!(got, Ok(Acquisition::Acquired(_))),
        "expected the lagging replica to be waited for: {got:?} after {waited:?}"
    );
}

/// Under `wait_for_replicas`, a replay writes a marker in the record's
/// slot before its `WAIT`: 1,000 replays of one key leave no key behind
/// after a second (each marker lives 1 s), not one key each for 60 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_under_wait_leave_no_key_behind() {
    let server = RedisServer::start(&[]);
    let store = RedisStore::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .wait_for_replicas(0, Duration::from_millis(100));
    let mut conn = raw_connection(&server.url).await;
    let k = testkit::unique_key("wait-replay-keys");
    let Ok(Acquisition::Acquired(l)) = store.acquire(&k, None, Duration::from_secs(30)).await
    else {
        panic!("not acquired")
    };
    store
        .complete(&l, b"once", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let dbsize = |conn: &mut idemkit::redis::redis::aio::MultiplexedConnection| {
        let mut conn = conn.clone();
        async move {
            idemkit::redis::redis::cmd("DBSIZE")
                .query_async::<i64>(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
        }
    };
    let before = dbsize(&mut conn).await;
    for _ in 0..1000 {
        let got = store.acquire(&k, None, Duration::from_secs(30)).await;
        assert!(matches!(got, Ok(Acquisition::Completed(_))), "{got:?}");
    }
    let markers: Vec<String> = idemkit::redis::redis::cmd("KEYS")
        .arg("*delete/*")
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for marker in markers.iter().take(20) {
        let pttl: i64 = idemkit::redis::redis::cmd("PTTL")
            .arg(marker)
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(pttl <= 1000, "{marker} lives {pttl} ms");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let left = dbsize(&mut conn).await - before;
        if left == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "1,000 replays left {left} keys behind for over 5 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The marker a replay writes under `wait_for_replicas` has a random id:
/// a record whose key is named like a marker (scope `delete`, an id of the
/// marker's form in the same slot) is never overwritten by the replays of
/// its neighbours, so it never runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_under_wait_never_overwrites_a_record_named_like_its_marker() {
    let server = RedisServer::start(&[]);
    let store = RedisStore::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .wait_for_replicas(0, Duration::from_millis(100));
    let idem = Idempotency::new(store.clone());
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let run = |k: IdempotencyKey| {
        let (idem, runs) = (idem.clone(), runs.clone());
        async move {
            idem.process(&k, "charge", move |_p: &str| async move {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, std::io::Error>("charged".to_owned())
            })
            .await
        }
    };
    // Records named like the markers of the slot of `{0}` (each hex
    // digit repeated), and a neighbour in that slot replayed 50 times.
    let named: Vec<IdempotencyKey> = "0123456789abcdef"
        .chars()
        .map(|c| {
            IdempotencyKey::new("delete", format!("{{0}}/{}", c.to_string().repeat(32)))
                .unwrap_or_else(|e| panic!("{e}"))
        })
        .collect();
    for k in &named {
        let first = run(k.clone()).await;
        assert!(matches!(first, Ok(Processed::Executed(_))), "{first:?}");
    }
    let neighbour = IdempotencyKey::new("orders", "{0}-42").unwrap_or_else(|e| panic!("{e}"));
    let _ = run(neighbour.clone()).await;
    for _ in 0..50 {
        let replay = run(neighbour.clone()).await;
        assert!(matches!(replay, Ok(Processed::Replayed(_))), "{replay:?}");
    }
    for k in &named {
        let again = run(k.clone()).await;
        assert!(
            matches!(again, Ok(Processed::Replayed(_))),
            "{k} after its neighbour's replays: {again:?}"
        );
    }
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        named.len() + 1
    );
}

/// A replay under `wait_for_replicas` on a server at `maxmemory`
/// (`noeviction`): its marker's write is refused (OOM). The duplicate gets
/// `Unavailable` (a retry gets the replay once memory is freed), never a
/// `Backend` error a consumer would dead-letter for a completed key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_under_wait_on_a_full_server_is_retryable() {
    let server = RedisServer::start(&[]);
    let plain = RedisStore::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let waiting = RedisStore::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .wait_for_replicas(0, Duration::from_millis(100));
    let mut conn = raw_connection(&server.url).await;
    let k = testkit::unique_key("wait-replay-oom");
    let Ok(Acquisition::Acquired(l)) = plain.acquire(&k, None, Duration::from_secs(30)).await
    else {
        panic!("not acquired")
    };
    plain
        .complete(&l, b"once", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let set_maxmemory = |conn: &mut idemkit::redis::redis::aio::MultiplexedConnection, v: &str| {
        let (mut conn, v) = (conn.clone(), v.to_owned());
        async move {
            idemkit::redis::redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory")
                .arg(v)
                .query_async::<()>(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
        }
    };
    set_maxmemory(&mut conn, "1").await;
    let without_wait = plain.acquire(&k, None, Duration::from_secs(30)).await;
    let with_wait = waiting.acquire(&k, None, Duration::from_secs(30)).await;
    set_maxmemory(&mut conn, "0").await;
    assert!(
        matches!(without_wait, Ok(Acquisition::Completed(_))),
        "without WAIT: {without_wait:?}"
    );
    assert!(
        matches!(&with_wait, Err(e) if e.is_retryable()),
        "a duplicate under WAIT on a full server: {with_wait:?}"
    );
    let later = waiting.acquire(&k, None, Duration::from_secs(30)).await;
    assert!(
        matches!(later, Ok(Acquisition::Completed(_))),
        "once memory is freed: {later:?}"
    );
}

/// Under `wait_for_replicas`, an extension is reported only once the
/// replicas acknowledged it, and a duplicate is replayed only a completion
/// the replicas have: with the replica frozen, `extend` is `Unavailable`
/// (the holder keeps counting on its old deadline, the one a failover
/// would leave), and after a completion whose own `WAIT` failed, a
/// duplicate gets `Unavailable`, not the replay of a result a failover
/// could lose. Once the replica is back, the duplicate is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_wait_extensions_and_replays_are_only_of_what_the_replicas_have() {
    let primary = RedisServer::start(&[]);
    let replica = RedisServer::start(&["--replicaof", "127.0.0.1", &primary.port.to_string()]);
    redis_server::wait_for_replication(&primary, &replica);
    let store = RedisStore::connect(&primary.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .call_timeout(Duration::from_secs(10))
        .wait_for_replicas(1, Duration::from_millis(500));
    let k = testkit::unique_key("wait-extend");
    let Ok(Acquisition::Acquired(lease)) = store.acquire(&k, None, Duration::from_secs(30)).await
    else {
        panic!("not acquired with the replica up")
    };

    replica.signal("STOP");
    let extended = store.extend(&lease, Duration::from_secs(60)).await;
    assert!(
        matches!(&extended, Err(e @ StoreError::Unavailable(_)) if e.to_string().contains("0 of 1")),
        "an extension the replica never got was reported: {extended:?}"
    );
    let completed = store
        .complete(&lease, b"once", Duration::from_secs(600))
        .await;
    assert!(
        matches!(&completed, Err(StoreError::Unavailable(_))),
        "{completed:?}"
    );
    let duplicate = store.acquire(&k, None, Duration::from_secs(30)).await;
    assert!(
        matches!(&duplicate, Err(StoreError::Unavailable(_))),
        "a duplicate was replayed a completion the replica does not have: {duplicate:?}"
    );
    let many = store
        .acquire_many(
            &[idemkit::AcquireItem::new(&k, None)],
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(many.first(), Some(Err(StoreError::Unavailable(_)))),
        "acquire_many replayed it: {many:?}"
    );

    replica.signal("CONT");
    redis_server::wait_for_replication(&primary, &replica);
    let duplicate = store.acquire(&k, None, Duration::from_secs(30)).await;
    assert!(
        matches!(&duplicate, Ok(Acquisition::Completed(r)) if &r.response[..] == b"once"),
        "{duplicate:?}"
    );
}

/// On Redis Cluster, the reply to `acquire` is lost (the
/// proxy in front of the key's node drops it and cuts the connection after
/// the script ran). The cluster client reconnects and resends the EVALSHA,
/// which runs a second time with the same token: the answer is "acquired"
/// with the same fence, not "in progress" (which would block the key for
/// its lease), and the lease completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_acquire_on_redis_cluster_is_acquired_not_in_progress() {
    let (servers, proxies) = redis_server::start_cluster_behind_proxies().await;
    let store = RedisStore::connect_cluster(
        proxies
            .iter()
            .map(|p| format!("redis://{}/", p.addr))
            .collect::<Vec<_>>(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let k = testkit::unique_key("cluster-resend");
    let rk = store.redis_key(&k);
    let owner = redis_server::owner_of(&servers, &rk);
    // Warm up: the script is loaded on the key's node (a first EVALSHA
    // answers NOSCRIPT), then the key is free again.
    let Ok(Acquisition::Acquired(warm)) = store.acquire(&k, None, Duration::from_secs(30)).await
    else {
        panic!("warm-up acquire")
    };
    store.release(&warm).await.unwrap_or_else(|e| panic!("{e}"));

    let before = redis_server::command_calls(&servers[owner], "evalsha");
    proxies[owner].lose_replies_to(b"EVALSHA", 1, 1);
    let got = store.acquire(&k, None, Duration::from_secs(30)).await;
    let ran = redis_server::command_calls(&servers[owner], "evalsha") - before;
    println!(
        "lost replies: {}, EVALSHA runs on the node: {ran}, outcome: {got:?}",
        proxies[owner].lost()
    );
    assert_eq!(proxies[owner].lost(), 1, "the reply was not lost");
    assert_eq!(ran, 2, "the cluster client did not resend the script");
    let lease = match got {
        Ok(Acquisition::Acquired(lease)) => lease,
        other => panic!("the resent acquire answered {other:?}, not acquired"),
    };
    assert_eq!(lease.attempt, 1);
    let record = store
        .get(&k)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("no record"));
    assert_eq!(record.token, lease.token, "the record is held by our token");
    assert_eq!(record.fence, lease.fence);
    store
        .complete(&lease, b"done", Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let dup = store.acquire(&k, None, Duration::from_secs(30)).await;
    assert!(
        matches!(&dup, Ok(Acquisition::Completed(r)) if &r.response[..] == b"done"),
        "{dup:?}"
    );
}

/// The Redis Cluster side of PostgreSQL's test of a resent `delete`
/// (`tests/stores/postgres.rs`). The cluster client now
/// resends a call up to 6 times after a lost reply, on the argument that
/// every script is safe to run twice. `delete` is a plain `DEL` with no
/// token: its resend (at least `min_wait_time`, 1.28 s, later) deletes
/// whatever holds the key *then*. The first `DEL` removed the completed
/// record (its reply was lost); a delivery acquires the key and starts its
/// handler; the resent `DEL` removes that live reservation, and the next
/// delivery acquires the key and runs the handler a second time while the
/// first still runs. DESIGN 4/5: a resend must be harmless.
///
/// Now `delete` is a script (`delete.lua`) that leaves a marker under a
/// random request id in the record's slot: the resend finds it and answers
/// the first answer without deleting. The lost reply is the script's
/// (its SHA, loaded on the node beforehand so the first send is an
/// EVALSHA).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_delete_on_redis_cluster_does_not_remove_a_later_reservation() {
    use idemkit::redis::redis::AsyncCommands;
    let (servers, proxies) = redis_server::start_cluster_behind_proxies().await;
    let admin = RedisStore::connect_cluster(
        proxies
            .iter()
            .map(|p| format!("redis://{}/", p.addr))
            .collect::<Vec<_>>(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .call_timeout(Duration::from_secs(10));
    let k = testkit::unique_key("cluster-resent-delete");
    let rk = admin.redis_key(&k);
    let owner = redis_server::owner_of(&servers, &rk);
    // The workers reach the key's node directly (single-key scripts).
    let direct =
        idemkit::redis::redis::Client::open(format!("redis://127.0.0.1:{}/", servers[owner].port))
            .unwrap_or_else(|e| panic!("{e}"))
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    let workers = RedisStore::new(direct.clone());
    let lease = Duration::from_secs(30);
    let Ok(Acquisition::Acquired(old)) = admin.acquire(&k, None, lease).await else {
        panic!("not acquired")
    };
    admin
        .complete(&old, b"old", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let sha: String = idemkit::redis::redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(include_str!("../../idem-redis/scripts/delete.lua"))
        .query_async(&mut direct.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    proxies[owner].lose_replies_to(sha.as_bytes(), 1, 1);
    let delete = {
        let (admin, k) = (admin.clone(), k.clone());
        tokio::spawn(async move { admin.delete(&k).await })
    };
    let mut probe = direct.clone();
    for i in 0.. {
        let exists: bool = probe.exists(&rk).await.unwrap_or_else(|e| panic!("{e}"));
        if !exists {
            break;
        }
        assert!(i < 2000, "the delete never landed");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let first = workers.acquire(&k, None, lease).await;
    println!("delivery 1 after the delete: {first:?}");
    let Ok(Acquisition::Acquired(first)) = first else {
        panic!("not acquired")
    };
    let deleted = delete.await.unwrap_or_else(|e| panic!("{e}"));
    println!(
        "the admin's delete (reply lost {}): {deleted:?}; EVALSHA (every script) ran {} times on the node",
        proxies[owner].lost(),
        redis_server::command_calls(&servers[owner], "evalsha")
    );
    assert_eq!(
        proxies[owner].lost(),
        1,
        "no reply was lost: the test proves nothing"
    );
    assert!(
        matches!(deleted, Ok(true)),
        "the resend answers the first answer: {deleted:?}"
    );
    let second = workers.acquire(&k, None, lease).await;
    println!("delivery 2 while delivery 1 runs: {second:?}");
    let done = workers
        .complete(&first, b"first", Duration::from_secs(600))
        .await;
    println!("delivery 1 completes: {done:?}");
    assert!(
        matches!(second, Ok(Acquisition::InProgress { .. })),
        "a live reservation was deleted by a resent DEL: the key ran twice ({second:?})"
    );
}

/// On Redis Cluster, a `release` or a `delete_if_token` whose reply is
/// lost (the proxy in front of the key's node drops it after the script
/// ran) is resent by the cluster client: the resend answers what the
/// first send did (released, deleted), not `LeaseLost` or "nothing
/// deleted" for the record that very call freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resent_conditional_writes_on_redis_cluster_answer_what_the_first_send_did() {
    let (servers, proxies) = redis_server::start_cluster_behind_proxies().await;
    let store = RedisStore::connect_cluster(
        proxies
            .iter()
            .map(|p| format!("redis://{}/", p.addr))
            .collect::<Vec<_>>(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .call_timeout(Duration::from_secs(10));
    for what in ["release", "delete_if_token"] {
        let k = testkit::unique_key("cluster-resent-write");
        let rk = store.redis_key(&k);
        let owner = redis_server::owner_of(&servers, &rk);
        let Ok(Acquisition::Acquired(lease)) =
            store.acquire(&k, None, Duration::from_secs(30)).await
        else {
            panic!("not acquired")
        };
        let source = if what == "release" {
            include_str!("../../idem-redis/scripts/release.lua")
        } else {
            store
                .complete(&lease, b"done", Duration::from_secs(600))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            include_str!("../../idem-redis/scripts/delete_if_token.lua")
        };
        // Loaded on the key's node, so the first send is an EVALSHA of
        // this SHA (no NOSCRIPT round).
        let mut direct = idemkit::redis::redis::Client::open(format!(
            "redis://127.0.0.1:{}/",
            servers[owner].port
        ))
        .unwrap_or_else(|e| panic!("{e}"))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let sha: String = idemkit::redis::redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(source)
            .query_async(&mut direct)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let lost = proxies[owner].lost();
        proxies[owner].lose_replies_to(sha.as_bytes(), 1, 1);
        let got = if what == "release" {
            store.release(&lease).await.map(|()| true)
        } else {
            store.delete_if_token(&k, &lease.token).await
        };
        assert_eq!(proxies[owner].lost(), lost + 1, "{what}: no reply was lost");
        assert!(
            matches!(got, Ok(true)),
            "{what}: the resend answered {got:?}, though the first send freed the key"
        );
        assert!(store
            .get(&k)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .is_none());
    }
}

/// With `wait_for_replicas`, `acquire` runs the script (the
/// lease starts on the server's clock), then blocks in `WAIT` for up to its
/// timeout, which the store now honours in full. A WAIT
/// that outlasts the lease (a replica lagging, here 2.5 s, under a WAIT
/// timeout of 4 s and a lease of 1 s) hands out a lease that is already
/// over: meanwhile a redelivery took the key over (attempt 2), and its own
/// WAIT returns at the same moment, so both callers get "acquired" and
/// both handlers run. PgStore refuses this ("a lease that is already over
/// is never reported"); RedisStore neither re-checks nor
/// bounds WAIT by the lease.
///
/// Now an acquisition's WAIT lasts at most half the lease and a TIME in
/// the same pipeline checks the lease is not over: both deliveries here
/// are told `Unavailable` (their reservations released), and once the
/// replica is back a third delivery runs the handler: once in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_longer_than_the_lease_never_hands_out_a_lease_taken_over() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let primary = RedisServer::start(&[]);
    let replica = Arc::new(RedisServer::start(&[
        "--replicaof",
        "127.0.0.1",
        &primary.port.to_string(),
    ]));
    redis_server::wait_for_replication(&primary, &replica);
    let store = RedisStore::connect(&primary.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .call_timeout(Duration::from_secs(10))
        .wait_for_replicas(1, Duration::from_secs(4));
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let k = testkit::unique_key("wait-over-lease");
    let runs = Arc::new(AtomicU64::new(0));
    let deliver = |tag: &'static str| {
        let (idem, k, runs) = (idem.clone(), k.clone(), runs.clone());
        tokio::spawn(async move {
            idem.process(&k, "payload", move |_| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(500)).await;
                Ok::<_, std::io::Error>(tag.to_owned())
            })
            .await
        })
    };
    // The replica lags 2.5 s.
    replica.signal("STOP");
    let thaw = {
        let replica = replica.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(2500)).await;
            replica.signal("CONT");
        })
    };
    let first = deliver("first");
    tokio::time::sleep(Duration::from_millis(1300)).await; // past the lease
    let second = deliver("second");
    let first = first.await.unwrap_or_else(|e| panic!("{e}"));
    let second = second.await.unwrap_or_else(|e| panic!("{e}"));
    thaw.await.unwrap_or_else(|e| panic!("{e}"));
    let n = runs.load(Ordering::SeqCst);
    println!("delivery 1: {first:?}\ndelivery 2: {second:?}\nhandler executions: {n}");
    assert!(n <= 1, "the handler ran {n} times for one key");
    for d in [&first, &second] {
        assert!(
            matches!(d, Ok(Processed::Executed(_)))
                || matches!(d, Err(IdemError::Store(StoreError::Unavailable(_)))),
            "{d:?}"
        );
    }
    redis_server::wait_for_replication(&primary, &replica);
    // On a loaded machine the third delivery's WAIT (half its 1 s lease)
    // may run out too: that is Unavailable, nothing ran, retry.
    let mut third = deliver("third").await.unwrap_or_else(|e| panic!("{e}"));
    for _ in 0..10 {
        if !matches!(third, Err(IdemError::Store(StoreError::Unavailable(_)))) {
            break;
        }
        third = deliver("third").await.unwrap_or_else(|e| panic!("{e}"));
    }
    assert!(matches!(third, Ok(Processed::Executed(_))), "{third:?}");
    let n = runs.load(Ordering::SeqCst);
    println!("delivery 3: {third:?}\nhandler executions: {n}");
    assert_eq!(n, 1, "the handler ran {n} times for one key");
}

/// A batch far larger than Lua's unpack limit (10,000 keys), with a key
/// that holds another Redis type and a key repeated at both ends: one
/// script call answers every item, the wrong-typed key is `Corrupt` (never
/// absent: nothing overwrites it), the repeat sees the first item's lease.
#[tokio::test]
async fn a_batch_of_ten_thousand_keys_with_a_wrong_type_and_a_repeat() {
    let store = standalone().await;
    let mut conn = raw_conn().await;
    let keys: Vec<IdempotencyKey> = (0..9_998)
        .map(|i| testkit::unique_key(&format!("big-batch-{i}")))
        .collect();
    let _: i64 = idemkit::redis::redis::cmd("HSET")
        .arg(store.redis_key(&keys[5_000]))
        .arg("x")
        .arg("y")
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut items: Vec<idemkit::AcquireItem<'_>> = keys
        .iter()
        .map(|k| idemkit::AcquireItem::new(k, None))
        .collect();
    items.push(idemkit::AcquireItem::new(&keys[0], None));
    items.push(idemkit::AcquireItem::new(&keys[9_997], None));
    let got = store
        .acquire_many(&items, Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(got.len(), 10_000);
    for (i, outcome) in got.iter().enumerate() {
        match i {
            5_000 => assert!(
                matches!(outcome, Err(StoreError::Corrupt { .. })),
                "{outcome:?}"
            ),
            9_998 | 9_999 => assert!(
                matches!(outcome, Ok(Acquisition::InProgress { attempt: 1, .. })),
                "item {i}: {outcome:?}"
            ),
            _ => assert!(
                matches!(outcome, Ok(Acquisition::Acquired(l)) if l.key == keys[i]),
                "item {i}: {outcome:?}"
            ),
        }
    }
    let kind: String = idemkit::redis::redis::cmd("TYPE")
        .arg(store.redis_key(&keys[5_000]))
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(kind, "hash", "the wrong-typed key was overwritten");
}

/// Makes the completed record of `key` one whose expiry (header bytes
/// 78..86) passed a minute ago by the server's clock, and that has no TTL:
/// as a record someone `PERSIST`ed, read after its retention (or a record
/// read in the very millisecond it expires, when its PTTL is 0).
async fn expire_without_ttl(
    store: &RedisStore,
    conn: &mut impl ConnectionLike,
    key: &IdempotencyKey,
) {
    use idemkit::redis::redis::cmd;
    let rk = store.redis_key(key);
    let mut raw: Vec<u8> = cmd("GET")
        .arg(&rk)
        .query_async(conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(raw.len() >= 94 && raw[0] == b'c', "not a completed record");
    let (secs, micros): (u64, u64) = cmd("TIME")
        .query_async(conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let past_ms = secs * 1_000 + micros / 1_000 - 60_000;
    raw[78..86].copy_from_slice(&past_ms.to_be_bytes());
    let _: () = cmd("SET")
        .arg(&rk)
        .arg(raw)
        .query_async(conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

/// A completed record past its expiry is absent
/// (DESIGN 2: "Completed, past expires_at == absent"), whatever the
/// payload: the general path of acquire.lua answers "acquired" for it.
/// The fast path compared fingerprints before it looked at the record's
/// time left, so the same expired record answered `Mismatch` to another
/// payload (format 1 checked the expiry first): an expired key refused a
/// new payload with a 422 forever (PERSIST), or in its last millisecond.
#[tokio::test]
async fn an_expired_record_is_absent_for_any_payload_never_a_mismatch() {
    let store = standalone().await;
    let mut conn = raw_conn().await;
    let (a, b) = (
        idemkit::Fingerprint::of_bytes(b"a"),
        idemkit::Fingerprint::of_bytes(b"b"),
    );
    let lease = Duration::from_secs(30);
    let ks: Vec<IdempotencyKey> = (0..3)
        .map(|i| testkit::unique_key(&format!("expired-persisted-{i}")))
        .collect();
    for k in &ks {
        let Ok(Acquisition::Acquired(l)) = store.acquire(k, Some(&a), lease).await else {
            panic!("acquire")
        };
        store
            .complete(&l, b"r", Duration::from_secs(3_600))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        expire_without_ttl(&store, &mut conn, k).await;
    }
    // The same payload: absent, acquired afresh (attempt 1).
    let same = store.acquire(&ks[0], Some(&a), lease).await;
    assert!(
        matches!(&same, Ok(Acquisition::Acquired(l)) if l.attempt == 1),
        "same payload: {same:?}"
    );
    // Another payload: absent too.
    let other = store.acquire(&ks[1], Some(&b), lease).await;
    assert!(
        matches!(&other, Ok(Acquisition::Acquired(l)) if l.attempt == 1),
        "another payload on an expired record: {other:?}"
    );
    let batch = store
        .acquire_many(&[idemkit::AcquireItem::new(&ks[2], Some(&b))], lease)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(batch.as_slice(), [Ok(Acquisition::Acquired(l))] if l.attempt == 1),
        "another payload on an expired record, in a batch: {batch:?}"
    );
}

/// A cluster connection behind a type of the application's own (a wrapper
/// that adds metrics, say): every single-key call works on it.
#[derive(Clone)]
struct WrappedCluster(ClusterConnection);

impl ConnectionLike for WrappedCluster {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a idemkit::redis::redis::Cmd,
    ) -> idemkit::redis::redis::RedisFuture<'a, idemkit::redis::redis::Value> {
        self.0.req_packed_command(cmd)
    }
    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a idemkit::redis::redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> idemkit::redis::redis::RedisFuture<'a, Vec<idemkit::redis::redis::Value>> {
        self.0.req_packed_commands(pipeline, offset, count)
    }
    fn get_db(&self) -> i64 {
        self.0.get_db()
    }
}

/// `RedisStore::new` takes any cluster-capable
/// connection, but a batch went per hash slot only when the connection's
/// type was exactly `ClusterConnection` (a `TypeId` check): over any other
/// type, a batch whose keys span slots was one script call, refused with
/// CROSSSLOT, so every item of every such batch failed (and a Streams
/// consumer dead-lettered them: a Backend error is not retryable).
#[tokio::test]
async fn a_batch_over_a_wrapped_cluster_connection_goes_per_slot() {
    let client =
        idemkit::redis::redis::cluster::ClusterClient::new(redis_server::shared_cluster().to_vec())
            .unwrap_or_else(|e| panic!("{e}"));
    let conn = client
        .get_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = RedisStore::new(WrappedCluster(conn));
    let ks: Vec<IdempotencyKey> = (0..20)
        .map(|i| testkit::unique_key(&format!("wrapped-cluster-{i}")))
        .collect();
    // Single-key calls work on the wrapper.
    let single = store.acquire(&ks[0], None, Duration::from_secs(30)).await;
    assert!(matches!(single, Ok(Acquisition::Acquired(_))), "{single:?}");
    let idem = Idempotency::new(store);
    let out = idem
        .process_batch(ks[1..].iter().cloned().zip(1u32..), |n| async move {
            Ok::<_, std::convert::Infallible>(n)
        })
        .await;
    for (i, o) in out.iter().enumerate() {
        assert!(
            matches!(o, Ok(Processed::Executed(n)) if *n as usize == i + 1),
            "item {i}: {o:?}"
        );
    }
    let again = idem
        .process_batch(ks[1..].iter().cloned().zip(1u32..), |_| async move {
            Ok::<_, std::convert::Infallible>(0)
        })
        .await;
    for (i, o) in again.iter().enumerate() {
        assert!(
            matches!(o, Ok(Processed::Replayed(n)) if *n as usize == i + 1),
            "item {i} again: {o:?}"
        );
    }
}

/// A record that `get` reports as corrupt (an
/// in-progress header followed by bytes: `format::decode` refuses it) is
/// corrupt to `acquire` and `acquire_many` too: reported, never taken over
/// and overwritten (DESIGN 3, `Corrupt`).
#[tokio::test]
async fn an_in_progress_record_with_trailing_bytes_is_corrupt_to_every_reader() {
    use idemkit::redis::redis::cmd;
    let store = standalone().await;
    let mut conn = raw_conn().await;
    let ks: Vec<IdempotencyKey> = (0..2)
        .map(|i| testkit::unique_key(&format!("trailing-{i}")))
        .collect();
    for k in &ks {
        let Ok(Acquisition::Acquired(_)) = store.acquire(k, None, Duration::from_secs(30)).await
        else {
            panic!("acquire")
        };
        let rk = store.redis_key(k);
        // The lease over (its deadline, bytes 62..70, in 1970), then junk.
        let _: i64 = cmd("SETRANGE")
            .arg(&rk)
            .arg(62)
            .arg(&1u64.to_be_bytes()[..])
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let _: i64 = cmd("APPEND")
            .arg(&rk)
            .arg("junk")
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let got = store.get(k).await;
        assert!(
            matches!(got, Err(StoreError::Corrupt { .. })),
            "get: {got:?}"
        );
    }
    let single = store.acquire(&ks[0], None, Duration::from_secs(30)).await;
    assert!(
        matches!(single, Err(StoreError::Corrupt { .. })),
        "acquire: {single:?}"
    );
    let batch = store
        .acquire_many(
            &[idemkit::AcquireItem::new(&ks[1], None)],
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(batch.as_slice(), [Err(StoreError::Corrupt { .. })]),
        "acquire_many: {batch:?}"
    );
}

/// A plain connection to the server at `url`, for commands the store does
/// not send.
async fn raw_connection(url: &str) -> idemkit::redis::redis::aio::MultiplexedConnection {
    idemkit::redis::redis::Client::open(url)
        .unwrap_or_else(|e| panic!("{e}"))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A response limit smaller than the "not replayable" marker: a result
/// over it still completes the key as not replayable (the marker is
/// never refused for its size), so the duplicate gets `ResultUnavailable`
/// and the handler runs once.
#[tokio::test]
async fn a_result_over_a_limit_smaller_than_the_marker_completes_not_replayable() {
    let idem = Idempotency::new(standalone().await.max_response_bytes(16));
    let k = testkit::unique_key("tiny-limit");
    let runs = std::sync::atomic::AtomicU64::new(0);
    for _ in 0..2 {
        let out = idem
            .process(&k, &"payload", |_| async {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, std::convert::Infallible>("x".repeat(1024))
            })
            .await;
        assert!(
            matches!(
                out,
                Ok(Processed::ExecutedNotReplayable { .. })
                    | Err(IdemError::ResultUnavailable { .. })
            ),
            "{out:?}"
        );
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
}
