//! TieredStore against real Redis and PostgreSQL: the conformance suite on
//! moka -> Redis -> PostgreSQL and on moka -> PostgreSQL, which tier answers
//! a duplicate (and the fills), and Redis stopped in the middle of a storm.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::postgres::PgStore;
use idemkit::testkit::{self, Harness, Settings, Tap};
use idemkit::tiered::{
    CacheError, MokaCache, RecordCache, RedisCache, RedisInvalidation, TieredStore,
};
use idemkit::{
    async_trait, Acquisition, CompletedRecord, Fingerprint, Idempotency, IdempotencyKey,
    IdempotencyStore, InProgressPolicy, MemoryStore, Processed,
};
use support::{pg, redis_server};

async fn postgres() -> PgStore {
    let store = PgStore::new(pg::pool(pg::shared_url(), 16).await);
    store
        .migrate()
        .await
        .unwrap_or_else(|e| panic!("migrate: {e}"));
    store
}

async fn redis_cache(url: &str) -> RedisCache {
    RedisCache::connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect the Redis tier: {e}"))
}

fn moka() -> MokaCache {
    MokaCache::new(100_000, 256 << 20)
}

async fn corrupt_source(store: &TieredStore<PgStore>, key: &IdempotencyKey) {
    // A cache only ever holds what the source completed; corrupting the
    // record means the source's row, with the cached copies dropped.
    store
        .invalidate_caches(key)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let sql = format!(
        "UPDATE {} SET status = 9 WHERE scope = $1 AND key = $2",
        store.source().qualified_table()
    );
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(key.scope())
        .bind(key.id())
        .execute(store.source().pool())
        .await
        .unwrap_or_else(|e| panic!("corrupt: {e}"));
}

fn settings() -> Settings {
    Settings::default().lease(Duration::from_millis(400))
}

struct MokaRedisPg;

#[async_trait]
impl Harness for MokaRedisPg {
    type Store = TieredStore<PgStore>;
    async fn store(&self) -> TieredStore<PgStore> {
        TieredStore::new(postgres().await)
            .with_cache(moka())
            .with_cache(redis_cache(redis_server::shared_url()).await)
    }
    async fn corrupt(&self, store: &TieredStore<PgStore>, key: &IdempotencyKey) {
        corrupt_source(store, key).await;
    }
    fn settings(&self) -> Settings {
        settings()
    }
}

struct MokaPg;

#[async_trait]
impl Harness for MokaPg {
    type Store = TieredStore<PgStore>;
    async fn store(&self) -> TieredStore<PgStore> {
        TieredStore::new(postgres().await).with_cache(moka())
    }
    async fn corrupt(&self, store: &TieredStore<PgStore>, key: &IdempotencyKey) {
        corrupt_source(store, key).await;
    }
    fn settings(&self) -> Settings {
        settings()
    }
}

mod moka_redis_postgres {
    use super::*;
    idemkit::conformance_tests!(MokaRedisPg);
}

mod moka_postgres {
    use super::*;
    idemkit::conformance_tests!(MokaPg);
}

/// A real cache tier that counts the lookups it answered.
#[derive(Clone)]
struct Counted<C> {
    inner: C,
    hits: Arc<AtomicUsize>,
}

impl<C> Counted<C> {
    fn new(inner: C) -> Self {
        Counted {
            inner,
            hits: Arc::new(AtomicUsize::new(0)),
        }
    }
    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl<C: RecordCache + Clone> RecordCache for Counted<C> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    async fn get(&self, key: &IdempotencyKey) -> Result<Option<CompletedRecord>, CacheError> {
        let got = self.inner.get(key).await?;
        if got.is_some() {
            self.hits.fetch_add(1, Ordering::SeqCst);
        }
        Ok(got)
    }
    async fn put(&self, record: &CompletedRecord, ttl: Duration) -> Result<(), CacheError> {
        self.inner.put(record, ttl).await
    }
    async fn tombstone(
        &self,
        key: &IdempotencyKey,
        fence: u64,
        ttl: Duration,
    ) -> Result<(), CacheError> {
        self.inner.tombstone(key, fence, ttl).await
    }
    async fn invalidate(&self, key: &IdempotencyKey) -> Result<(), CacheError> {
        self.inner.invalidate(key).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_are_answered_by_the_fastest_tier_that_holds_them() {
    let moka = Counted::new(moka());
    let redis = Counted::new(redis_cache(redis_server::shared_url()).await);
    let store = Arc::new(
        TieredStore::new(Tap::new(postgres().await))
            .with_cache(moka.clone())
            .with_cache(redis.clone()),
    );
    assert_eq!(store.backend_name(), "tiered");
    assert_eq!(store.source().backend_name(), "postgres");
    let idem = Idempotency::from_arc(store.clone());
    let key = testkit::unique_key("tiers");
    let first = idem
        .process(&key, "payload", |p| async move {
            Ok::<_, std::io::Error>(format!("done {p}"))
        })
        .await;
    assert!(matches!(first, Ok(Processed::Executed(_))), "{first:?}");
    let source = || store.source().acquires();
    let replay = || async {
        let out = idem
            .process(&key, "payload", |_| async {
                Ok::<_, std::io::Error>("ran again".to_string())
            })
            .await;
        assert_eq!(
            out.ok(),
            Some(Processed::Replayed("done payload".to_string()))
        );
    };
    let counts = || (moka.hits(), redis.hits(), source());
    let (m0, r0, s0) = counts();

    // Written through on completion: moka answers.
    replay().await;
    assert_eq!(counts(), (m0 + 1, r0, s0), "moka should answer");

    // Without the moka entry: Redis answers, and moka is filled again.
    moka.invalidate(&key)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    replay().await;
    assert_eq!(counts(), (m0 + 1, r0 + 1, s0), "redis should answer");
    replay().await;
    assert_eq!(
        counts(),
        (m0 + 2, r0 + 1, s0),
        "moka should be filled from redis"
    );

    // Without both: PostgreSQL answers, and both faster tiers are filled.
    moka.invalidate(&key)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    redis
        .invalidate(&key)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    replay().await;
    assert_eq!(counts(), (m0 + 2, r0 + 1, s0 + 1), "postgres should answer");
    replay().await;
    assert_eq!(
        counts(),
        (m0 + 3, r0 + 1, s0 + 1),
        "moka should be filled from postgres"
    );
    moka.invalidate(&key)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    replay().await;
    assert_eq!(
        counts(),
        (m0 + 3, r0 + 2, s0 + 1),
        "redis should be filled from postgres"
    );

    // A different payload is refused; the mismatch seen in a cache is
    // confirmed at the source (the entry could be stale).
    let other = idem
        .process(&key, "another payload", |_| async {
            Ok::<_, std::io::Error>(String::new())
        })
        .await;
    assert!(
        matches!(other, Err(idemkit::IdemError::PayloadMismatch)),
        "{other:?}"
    );
    assert_eq!(
        source(),
        s0 + 2,
        "a cached mismatch is confirmed at the source"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_cache_entries_are_misses_and_dropped() {
    let redis = redis_cache(redis_server::shared_url()).await;
    let store = TieredStore::new(postgres().await).with_cache(redis.clone());
    let key = testkit::unique_key("bad-entry");
    let Ok(Acquisition::Acquired(l)) = store.acquire(&key, None, Duration::from_secs(30)).await
    else {
        panic!("not acquired")
    };
    store
        .complete(&l, b"truth", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let client = idemkit::redis::redis::Client::open(redis_server::shared_url())
        .unwrap_or_else(|e| panic!("{e}"));
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let _: () = idemkit::redis::redis::cmd("SET")
        .arg(redis.redis_key(&key))
        .arg("garbage")
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    match store.acquire(&key, None, Duration::from_secs(30)).await {
        Ok(Acquisition::Completed(r)) => assert_eq!(&r.response[..], b"truth"),
        other => panic!("expected the source's record, got {other:?}"),
    }
    // Dropped, then filled again from the source with a good entry.
    match redis.get(&key).await {
        Ok(Some(r)) => assert_eq!(&r.response[..], b"truth"),
        other => panic!("expected a refilled entry, got {other:?}"),
    }
}

/// Redis (the middle tier) is killed in the middle of a storm and stays
/// down: nothing runs twice, and every call is answered by moka or
/// PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_mid_storm_changes_nothing_but_speed() {
    let redis = Arc::new(redis_server::RedisServer::start(&[]));
    let store = TieredStore::new(postgres().await)
        .with_cache(moka())
        .with_cache(redis_cache(&redis.url).await)
        .cache_timeout(Duration::from_millis(100));
    let idem = Idempotency::new(store)
        .lease(Duration::from_secs(20))
        .on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::from_secs(30),
            poll: Duration::from_millis(5),
        });
    let down = redis.clone();
    let report =
        support::chaos::storm_through_fault(idem, 300, 16, Box::new(move || down.kill()), None)
            .await;
    assert_eq!(
        report.unavailable, 0,
        "a cache outage must not fail any call"
    );
}

/// Concurrent misses for one key are merged into one lookup of the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_misses_are_merged_into_one_source_lookup() {
    let moka = moka();
    let store = Arc::new(TieredStore::new(Tap::new(postgres().await)).with_cache(moka.clone()));
    let key = testkit::unique_key("merged");
    let Ok(Acquisition::Acquired(l)) = store.acquire(&key, None, Duration::from_secs(30)).await
    else {
        panic!("not acquired")
    };
    store
        .complete(&l, b"once", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    moka.invalidate(&key)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let before = store.source().acquires();
    let barrier = Arc::new(tokio::sync::Barrier::new(32));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (store, key, barrier) = (store.clone(), key.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            store.acquire(&key, None, Duration::from_secs(30)).await
        }));
    }
    for task in tasks {
        match task.await.unwrap_or_else(|e| panic!("{e}")) {
            Ok(Acquisition::Completed(r)) => assert_eq!(&r.response[..], b"once"),
            other => panic!("expected the completed record, got {other:?}"),
        }
    }
    assert_eq!(
        store.source().acquires() - before,
        1,
        "32 concurrent misses reached the source more than once"
    );
}

/// The Redis tier frozen (SIGSTOP): calls wait at most the cache timeout for
/// it, are answered by PostgreSQL, and the timeouts are counted per tier.
#[test]
fn a_frozen_cache_tier_times_out_is_skipped_and_counted() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let redis = redis_server::RedisServer::start(&[]);
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        runtime.block_on(async {
            let store = TieredStore::new(postgres().await)
                .with_cache(redis_cache(&redis.url).await)
                .cache_timeout(Duration::from_millis(100));
            let key = testkit::unique_key("frozen");
            let Ok(Acquisition::Acquired(l)) =
                store.acquire(&key, None, Duration::from_secs(30)).await
            else {
                panic!("not acquired")
            };
            store
                .complete(&l, b"from postgres", Duration::from_secs(600))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            store
                .invalidate_caches(&key)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            redis.signal("STOP");
            let answer = tokio::time::timeout(
                Duration::from_secs(5),
                store.acquire(&key, None, Duration::from_secs(30)),
            )
            .await;
            redis.signal("CONT");
            match answer {
                Ok(Ok(Acquisition::Completed(r))) => assert_eq!(&r.response[..], b"from postgres"),
                other => {
                    panic!("expected the source's record despite the frozen tier, got {other:?}")
                }
            }
        });
    });
    let counted = |name: &str, tier: &str| -> u64 {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(k, _, _, _)| {
                k.key().name() == name
                    && k.key()
                        .labels()
                        .any(|l| l.key() == "tier" && l.value() == tier)
            })
            .map(|(_, _, _, v)| match v {
                DebugValue::Counter(n) => n,
                _ => 0,
            })
            .sum()
    };
    assert!(
        counted("idem_tier_errors_total", "redis") >= 1,
        "the timeout was not counted"
    );
}

/// `purge_periodically` deletes expired rows of the source on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_periodically_deletes_expired_rows() {
    let store = Arc::new(postgres().await);
    let key = testkit::unique_key("purged");
    let Ok(Acquisition::Acquired(l)) = store.acquire(&key, None, Duration::from_secs(30)).await
    else {
        panic!("not acquired")
    };
    store
        .complete(&l, b"r", Duration::from_millis(50))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let purger = idemkit::purge_periodically(store.clone(), Duration::from_millis(50), 100);
    let sql = format!(
        "SELECT count(*) FROM {} WHERE scope = $1 AND key = $2",
        store.qualified_table()
    );
    let mut rows = 1i64;
    for _ in 0..200 {
        rows = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
            .bind(key.scope())
            .bind(key.id())
            .fetch_one(store.pool())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        if rows == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    purger.abort();
    assert_eq!(rows, 0, "the expired row was never purged");
}

// ---------------------------------------------------------------------------
// DESIGN 5 cache rules: a cache may speed up an answer, never change it.

fn fp(text: &str) -> Fingerprint {
    Fingerprint::of_bytes(text.as_bytes())
}

async fn acquire_lease(
    store: &impl IdempotencyStore,
    key: &IdempotencyKey,
    f: &str,
) -> idemkit::Lease {
    match store
        .acquire(key, Some(&fp(f)), Duration::from_secs(30))
        .await
    {
        Ok(Acquisition::Acquired(lease)) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// 9(a): with the store's clock an hour ahead of the application's, a fill
/// still lives no longer than the record's retention: its TTL is what the
/// store computed on its own clock, not `expires_at` minus the app's clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fill_ttl_comes_from_the_store_clock_not_the_app_clock() {
    let source = Arc::new(Tap::new(MemoryStore::new()));
    source.clock_ahead(Duration::from_secs(3_600));
    let writer = TieredStore::new(source.clone());
    let key = testkit::unique_key("skew");
    let lease = acquire_lease(&writer, &key, "p").await;
    writer
        .complete(&lease, b"done", Duration::from_millis(800))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // Another instance misses its moka, reads the source and fills.
    let moka = moka();
    let reader = TieredStore::new(source.clone()).with_cache(moka.clone());
    let first = reader
        .acquire(&key, Some(&fp("p")), Duration::from_secs(30))
        .await;
    assert!(matches!(first, Ok(Acquisition::Completed(_))), "{first:?}");
    let cached = moka.get(&key).await.ok().flatten().map(|r| r.ttl);
    assert!(
        cached.is_some_and(|t| t <= Duration::from_millis(800)),
        "filled for {cached:?}, past the retention of 800 ms"
    );
    // Past the retention the source has forgotten the key: so must the cache.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let after = reader
        .acquire(&key, Some(&fp("p")), Duration::from_secs(30))
        .await;
    assert!(
        matches!(after, Ok(Acquisition::Acquired(_))),
        "replayed past the retention: {after:?}"
    );
}

/// 9(b): a newer completion corrects an older cache entry (put replaces a
/// lower fence), in moka and in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_completion_corrects_an_older_cache_entry() {
    let source = Arc::new(MemoryStore::new());
    let moka = moka();
    let redis = redis_cache(redis_server::shared_url()).await;
    let store = TieredStore::new(source.clone())
        .with_cache(moka.clone())
        .with_cache(redis.clone());
    let key = testkit::unique_key("newer");
    let old = acquire_lease(&store, &key, "p").await;
    store
        .complete(&old, b"old", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // Deleted behind the tiered store's back (another tool, another
    // instance without a channel), then run and completed again.
    assert!(source.delete(&key).await.unwrap_or(false));
    let new = match source
        .acquire(&key, Some(&fp("p")), Duration::from_secs(30))
        .await
    {
        Ok(Acquisition::Acquired(lease)) => lease,
        other => panic!("{other:?}"),
    };
    assert!(new.fence > old.fence);
    store
        .complete(&new, b"new", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for (tier, got) in [
        ("moka", moka.get(&key).await.ok().flatten()),
        ("redis", redis.get(&key).await.ok().flatten()),
    ] {
        let got = got.unwrap_or_else(|| panic!("{tier}: no entry"));
        assert_eq!(&got.response[..], b"new", "{tier} kept the older entry");
        assert_eq!(got.fence, new.fence, "{tier}");
    }
    // And an older record never overwrites a newer entry.
    let stale = CompletedRecord::new(
        key.clone(),
        b"old".to_vec().into(),
        None,
        1,
        std::time::SystemTime::now(),
        std::time::SystemTime::now(),
    )
    .with_fence(old.fence);
    for cache in [&moka as &dyn RecordCache, &redis] {
        cache
            .put(&stale, Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let got = cache.get(&key).await.ok().flatten().map(|r| r.response);
        assert_eq!(got.as_deref(), Some(&b"new"[..]), "{}", cache.name());
    }
}

/// 9(c): a fill racing a delete (the record read from the source before the
/// delete, written to the caches after it) does not resurrect the entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_racing_a_delete_does_not_resurrect_the_entry() {
    let source = Arc::new(Tap::new(MemoryStore::new()));
    let key = testkit::unique_key("race");
    let lease = acquire_lease(&*source, &key, "p").await;
    source
        .complete(&lease, b"deleted", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let redis = RedisCache::connect(redis_server::shared_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .prefix(format!("idem-race-{}:", fastrand::u64(..)));
    let store = TieredStore::new(source.clone())
        .with_cache(moka())
        .with_cache(redis);
    let (reached, resume) = source.hold_next_acquire();
    let reader = {
        let (store, key) = (store.clone(), key.clone());
        tokio::spawn(async move {
            store
                .acquire(&key, Some(&fp("p")), Duration::from_secs(30))
                .await
        })
    };
    reached.await.unwrap_or_else(|e| panic!("{e}"));
    // The source answered "completed"; the operator deletes before the fill.
    assert!(store.delete(&key).await.unwrap_or_else(|e| panic!("{e}")));
    let _ = resume.send(());
    let stale = reader.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(stale, Ok(Acquisition::Completed(_))), "{stale:?}");
    let next = store
        .acquire(&key, Some(&fp("p")), Duration::from_secs(30))
        .await;
    assert!(
        matches!(next, Ok(Acquisition::Acquired(_))),
        "the deleted record was resurrected by the racing fill: {next:?}"
    );
}

/// 9(d): `delete` returns an error when a tier could not be invalidated (the
/// caller must know the key may still replay), and still deletes the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_fails_when_a_tier_could_not_be_invalidated() {
    let redis = redis_server::RedisServer::start(&[]);
    let source = Arc::new(MemoryStore::new());
    let store = TieredStore::new(source.clone())
        .with_cache(moka())
        .with_cache(redis_cache(&redis.url).await)
        .cache_timeout(Duration::from_millis(200));
    let key = testkit::unique_key("delete-down");
    let lease = acquire_lease(&store, &key, "p").await;
    store
        .complete(&lease, b"r", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    redis.kill();
    let deleted = store.delete(&key).await;
    assert!(
        matches!(&deleted, Err(e) if e.is_retryable()),
        "a tier kept the entry, yet: {deleted:?}"
    );
    assert!(
        matches!(source.get(&key).await, Ok(None)),
        "the source still holds it"
    );
}

async fn numsub(channel: &str) -> i64 {
    use idemkit::redis::redis;
    let client = redis::Client::open(redis_server::shared_url()).unwrap_or_else(|e| panic!("{e}"));
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let reply: (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    reply.1
}

/// 9(e): two application instances share Redis and PostgreSQL, each with
/// its own moka. A delete in one reaches the other's moka over Redis
/// pub/sub within milliseconds; and a stale cached fingerprint never
/// refuses a valid new request (a mismatch seen in a cache is confirmed at
/// the source).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_reach_every_instance_and_cached_mismatches_are_confirmed() {
    let channel = format!("idem-test-invalidate-{}", fastrand::u64(..));
    let url = redis_server::shared_url();
    let instance = |moka: MokaCache| {
        let channel = channel.clone();
        async move {
            TieredStore::new(postgres().await)
                .with_cache(moka)
                .with_cache(redis_cache(url).await)
                .with_invalidation(
                    RedisInvalidation::connect(url)
                        .await
                        .unwrap_or_else(|e| panic!("{e}"))
                        .channel(channel),
                )
        }
    };
    let (moka_a, moka_b) = (moka(), moka());
    let a = instance(moka_a.clone()).await;
    let b = instance(moka_b.clone()).await;
    let subscribed = tokio::time::Instant::now();
    while numsub(&channel).await < 2 {
        assert!(
            subscribed.elapsed() < Duration::from_secs(10),
            "subscribers never came up"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let key = testkit::unique_key("instances");
    let lease = acquire_lease(&a, &key, "p1").await;
    a.complete(&lease, b"r1", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let on_b = b
        .acquire(&key, Some(&fp("p1")), Duration::from_secs(30))
        .await;
    assert!(matches!(on_b, Ok(Acquisition::Completed(_))), "{on_b:?}");
    assert!(
        moka_b.get(&key).await.ok().flatten().is_some(),
        "b's moka was filled"
    );

    let deleted_at = tokio::time::Instant::now();
    assert!(a.delete(&key).await.unwrap_or_else(|e| panic!("{e}")));
    while moka_b.get(&key).await.ok().flatten().is_some() {
        assert!(
            deleted_at.elapsed() < Duration::from_secs(2),
            "b's moka still replays a key deleted in a"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    eprintln!(
        "delete reached the other instance in {:?}",
        deleted_at.elapsed()
    );
    let fresh = b
        .acquire(&key, Some(&fp("p2")), Duration::from_secs(30))
        .await;
    assert!(matches!(fresh, Ok(Acquisition::Acquired(_))), "{fresh:?}");

    // Without a channel: b's moka holds p1's record, the key is deleted at
    // the source and reused with p2. b confirms the mismatch at the source.
    let key = testkit::unique_key("stale-fp");
    let c_moka = moka();
    let c = TieredStore::new(postgres().await).with_cache(c_moka.clone());
    let lease = acquire_lease(&c, &key, "p1").await;
    c.complete(&lease, b"r1", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(c.source().delete(&key).await.unwrap_or(false));
    let reused = c
        .acquire(&key, Some(&fp("p2")), Duration::from_secs(30))
        .await;
    assert!(
        matches!(reused, Ok(Acquisition::Acquired(_))),
        "a stale cached fingerprint refused a valid request: {reused:?}"
    );
    // A real mismatch is still one.
    let other = c
        .acquire(&key, Some(&fp("p3")), Duration::from_secs(30))
        .await;
    assert!(
        matches!(
            other,
            Ok(Acquisition::Mismatch) | Ok(Acquisition::InProgress { .. })
        ),
        "{other:?}"
    );
}

/// A delivery that acquires and completes the key while
/// `delete` runs (its write-through lands in moka and Redis with a higher
/// fence than anything the delete saw before) is deleted from the source:
/// its cache entries must not keep replaying it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_racing_a_fresh_completion_leaves_no_cache_replaying_it() {
    let source = Tap::new(postgres().await);
    let redis = RedisCache::connect(redis_server::shared_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = Arc::new(
        TieredStore::new(source)
            .with_cache(moka())
            .with_cache(redis),
    );
    let idem = Idempotency::from_arc(store.clone());
    let key = testkit::unique_key("delete-race");
    let runs = Arc::new(AtomicUsize::new(0));
    let run = || {
        let (idem, key, runs) = (idem.clone(), key.clone(), runs.clone());
        async move {
            idem.process(&key, "order-7", move |_| async move {
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                Ok::<_, std::io::Error>(format!("run {n}"))
            })
            .await
        }
    };
    let (reached, resume) = store.source().hold_next_delete();
    let deleting = {
        let (store, key) = (store.clone(), key.clone());
        tokio::spawn(async move { store.delete(&key).await })
    };
    reached.await.unwrap_or_else(|e| panic!("{e}"));
    let during = run().await;
    assert!(matches!(during, Ok(Processed::Executed(_))), "{during:?}");
    let _ = resume.send(());
    let deleted = deleting.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(deleted, Ok(true)), "{deleted:?}");
    assert!(matches!(store.get(&key).await, Ok(None)));
    let after = run().await;
    assert!(
        matches!(after, Ok(Processed::Executed(_))),
        "a cache replayed a deleted record: {after:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Dropping every clone of a tiered store stops its
/// invalidation subscriber (task and Redis pub/sub connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_tiered_stores_release_their_subscriber_connections() {
    let server = redis_server::RedisServer::start(&[]);
    let subscribers = || {
        server
            .command("CLIENT LIST")
            .lines()
            .filter(|l| l.contains(" sub=1 ") || l.contains("cmd=subscribe"))
            .count()
    };
    let until = |want: usize| {
        let subscribers = &subscribers;
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while subscribers() != want {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{} subscriber connections, expected {want}",
                    subscribers()
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    for _ in 0..10 {
        let channel = RedisInvalidation::connect(&server.url)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let store = TieredStore::new(MemoryStore::new())
            .with_cache(moka())
            .with_invalidation(channel);
        let clone = store.clone();
        until(1).await;
        drop(store);
        tokio::task::yield_now().await;
        assert_eq!(
            subscribers(),
            1,
            "a clone still lives: the subscriber stays"
        );
        drop(clone);
        until(0).await;
    }
}

/// A batch: one lookup pass per tier, duplicates answered by the fastest
/// tier that holds them (moka, then Redis, filling moka), and one
/// `acquire_many` on the source for the misses and for a mismatch seen in a
/// cache (confirmed there); `complete_many` writes through to every tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_asks_each_tier_once_and_the_source_once() {
    use idemkit::AcquireItem;
    let moka = Counted::new(moka());
    let redis = Counted::new(redis_cache(redis_server::shared_url()).await);
    let store = TieredStore::new(Tap::new(postgres().await))
        .with_cache(moka.clone())
        .with_cache(redis.clone());
    let long = Duration::from_secs(60);
    let keys: Vec<IdempotencyKey> = (0..6)
        .map(|i| testkit::unique_key(&format!("tier-batch-{i}")))
        .collect();
    let (a, b) = (Fingerprint::of_bytes(b"a"), Fingerprint::of_bytes(b"b"));
    let items: Vec<AcquireItem<'_>> = keys.iter().map(|k| AcquireItem::new(k, Some(&a))).collect();
    let first = store
        .acquire_many(&items, long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(store.source().acquire_batches(), 1);
    let leases: Vec<idemkit::Lease> = first
        .into_iter()
        .map(|o| match o {
            Ok(Acquisition::Acquired(l)) => l,
            other => panic!("{other:?}"),
        })
        .collect();
    let responses: Vec<Vec<u8>> = keys.iter().map(|k| k.id().as_bytes().to_vec()).collect();
    let done: Vec<(&idemkit::Lease, &[u8])> = leases
        .iter()
        .zip(&responses)
        .map(|(l, r)| (l, r.as_slice()))
        .collect();
    let completed = store
        .complete_many(&done, Duration::from_secs(3_600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(completed.iter().all(Result::is_ok), "{completed:?}");
    assert_eq!(store.source().complete_batches(), 1);

    // Written through: key 0 only in Redis (dropped from moka), key 1 asked
    // with another payload (moka's mismatch goes to the source), a new key.
    moka.invalidate(&keys[0])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let fresh = testkit::unique_key("tier-batch-new");
    let mut again: Vec<AcquireItem<'_>> =
        keys.iter().map(|k| AcquireItem::new(k, Some(&a))).collect();
    again[1] = AcquireItem::new(&keys[1], Some(&b));
    again.push(AcquireItem::new(&fresh, Some(&a)));
    let (m0, r0) = (moka.hits(), redis.hits());
    let got = store
        .acquire_many(&again, long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        moka.hits() - m0,
        5,
        "moka answers five keys (one a mismatch)"
    );
    assert_eq!(redis.hits() - r0, 1, "redis answers the key moka lost");
    assert_eq!(
        store.source().acquire_batches(),
        2,
        "one source call for the rest"
    );
    assert_eq!(
        store.source().acquires(),
        6 + 2,
        "the source saw the mismatch and the new key only"
    );
    for (i, outcome) in got.iter().enumerate() {
        match (i, outcome) {
            (1, Ok(Acquisition::Mismatch)) | (6, Ok(Acquisition::Acquired(_))) => {}
            (i, Ok(Acquisition::Completed(r))) if i < 6 => assert_eq!(r.response, responses[i]),
            other => panic!("item {i}: {other:?}"),
        }
    }
    // Redis filled moka back.
    let m1 = moka.hits();
    let got = store
        .acquire_many(&[AcquireItem::new(&keys[0], Some(&a))], long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(got.as_slice(), [Ok(Acquisition::Completed(_))]));
    assert_eq!(moka.hits() - m1, 1, "moka was filled from redis");
    assert_eq!(store.source().acquire_batches(), 2);
}

/// The source's delete went through but its reply was lost (the caller
/// gets a retryable error): the tiers are tombstoned all the same, so no
/// cache replays a record the source no longer holds. (No tier was
/// tombstoned: moka and Redis replayed the deleted record.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_delete_whose_reply_was_lost_still_tombstones_every_tier() {
    let (proxy, url) = super::postgres::proxied_shared_server().await;
    let source = super::postgres::one_connection_store(&url).await;
    let redis = redis_server::RedisServer::start(&[]);
    let store = TieredStore::new(source)
        .with_cache(moka())
        .with_cache(redis_cache(&redis.url).await);
    let key = testkit::unique_key("delete-reply-lost");
    let lease = acquire_lease(&store, &key, "p").await;
    store
        .complete(&lease, b"r", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // Filled into both tiers.
    assert!(matches!(
        store
            .acquire(&key, Some(&fp("p")), Duration::from_secs(30))
            .await,
        Ok(Acquisition::Completed(_))
    ));
    // The request that runs the delete carries the key (its parameters).
    proxy.lose_replies_to(key.id().as_bytes(), 1, 1);
    let deleted = store.delete(&key).await;
    assert_eq!(proxy.lost(), 1, "no reply was lost: proves nothing");
    assert!(
        matches!(&deleted, Err(e) if e.is_retryable()),
        "the lost reply is a retryable error: {deleted:?}"
    );
    let direct = postgres().await;
    let source_now = direct.get(&key).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        source_now.is_none(),
        "the delete did not go through: {source_now:?}"
    );
    let next = store
        .acquire(&key, Some(&fp("p")), Duration::from_secs(30))
        .await;
    assert!(
        matches!(next, Ok(Acquisition::Acquired(_))),
        "a cache replayed the record the source deleted: {next:?}"
    );
}
