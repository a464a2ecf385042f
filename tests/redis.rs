//! RedisStore against real Redis servers started by tests/support (or
//! IDEM_REDIS_URL / IDEM_REDIS_CLUSTER_URLS): the conformance suite on a
//! standalone server and on a 3-master cluster, bad records, round trips,
//! and a server killed and restarted in the middle of a storm.

mod support;

use std::sync::Arc;
use std::time::Duration;

use idem::redis::redis::aio::ConnectionLike;
use idem::redis::redis::cluster_async::ClusterConnection;
use idem::redis::RedisStore;
use idem::testkit::{self, Harness, Settings};
use idem::{
    async_trait, Acquisition, Idempotency, IdempotencyKey, IdempotencyStore, InProgressPolicy,
    StoreError,
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

/// Overwrites a record with a plain string: not a hash, so undecodable.
async fn clobber<C>(store: &RedisStore<C>, conn: &mut impl ConnectionLike, key: &IdempotencyKey)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let _: () = idem::redis::redis::cmd("SET")
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
        let client = idem::redis::redis::Client::open(redis_server::shared_url())
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

idem::conformance_tests!(RedisHarness);

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
            let client = idem::redis::redis::cluster::ClusterClient::new(
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

    idem::conformance_tests!(ClusterHarness);

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

#[tokio::test]
async fn undecodable_records_are_corrupt_never_absent() {
    let store = standalone().await;
    let client = idem::redis::redis::Client::open(redis_server::shared_url())
        .unwrap_or_else(|e| panic!("{e}"));
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let damage: [&[&str]; 4] = [
        &["HSET", "s", "9"],
        &["HDEL", "a"],
        &["HSET", "t", "short"],
        &["HSET", "f", "not-32-bytes"],
    ];
    for (i, change) in damage.iter().enumerate() {
        let k = testkit::unique_key(&format!("damaged-{i}"));
        let fp = idem::Fingerprint::of_bytes(b"p");
        let Ok(Acquisition::Acquired(l)) =
            store.acquire(&k, Some(&fp), Duration::from_secs(30)).await
        else {
            panic!("not acquired")
        };
        assert!(store
            .complete(&l, b"r", Duration::from_secs(600))
            .await
            .is_ok());
        let mut cmd = idem::redis::redis::cmd(change[0]);
        cmd.arg(store.redis_key(&k)).arg(&change[1..]);
        let _: i64 = cmd
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let got = store.get(&k).await;
        assert!(
            matches!(&got, Err(StoreError::Corrupt { key, .. }) if *key == k),
            "get after {change:?}: {got:?}"
        );
        // The fingerprint of a completed record is checked on replay; the
        // token is not read by acquire.
        if change[1] != "t" {
            let got = store.acquire(&k, None, Duration::from_secs(30)).await;
            assert!(
                matches!(&got, Err(StoreError::Corrupt { key, .. }) if *key == k),
                "acquire after {change:?}: {got:?}"
            );
        }
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
    let client = idem::redis::redis::Client::open(format!("redis://{}/", proxy.addr))
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
