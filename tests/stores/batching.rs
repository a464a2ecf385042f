//! Natural batching on real servers: single calls made while another is in
//! flight go together as one batched call, counted on the server (Redis's
//! `INFO commandstats`, PostgreSQL's `pg_stat_statements`), and each
//! caller gets the answer its own call would have got: fresh, duplicate,
//! mismatched and in-progress keys in one batch, one key twice, and a
//! batched call whose reply is lost.
//!
//! The call in flight is held on the server (Redis `CLIENT PAUSE`, a
//! PostgreSQL lock), and the others are let go once the store's batcher
//! shows them all waiting.

use crate::support;

use std::time::Duration;

use idemkit::postgres::{Claim, PgStore};
use idemkit::redis::RedisStore;
use idemkit::{
    Acquisition, Batcher, Batching, Fingerprint, IdempotencyKey, IdempotencyStore, Lease,
    StoreError,
};
use sqlx::PgPool;
use support::proxy::CountingProxy;
use support::redis_server::RedisServer;
use support::{pg, redis_server};

const LEASE: Duration = Duration::from_secs(30);

/// A `max_wait` for the tests that count server calls: queued calls wait
/// for the call in flight, not going beside it while the test looks.
const HOLD: Duration = Duration::from_secs(60);

fn key(id: &str) -> IdempotencyKey {
    IdempotencyKey::new("batching.test", id).unwrap_or_else(|e| panic!("{e}"))
}

/// Waits (30 s at most) until the batcher holds `acquires` and `completes`
/// calls waiting for the one in flight.
async fn until_waiting(batcher: &Batcher, acquires: usize, completes: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (a, c) = batcher.waiting();
        if a >= acquires && c >= completes {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "waiting: {a} acquires, {c} completes; wanted {acquires}, {completes}"
        );
        tokio::task::yield_now().await;
    }
}

fn acquired(got: &Result<Acquisition, StoreError>) -> Lease {
    match got {
        Ok(Acquisition::Acquired(lease)) => lease.clone(),
        other => panic!("not acquired: {other:?}"),
    }
}

fn spawn_acquire<S: IdempotencyStore + Clone>(
    store: &S,
    key: IdempotencyKey,
    fingerprint: Option<Fingerprint>,
    lease: Duration,
) -> tokio::task::JoinHandle<Result<Acquisition, StoreError>> {
    let store = store.clone();
    tokio::spawn(async move { store.acquire(&key, fingerprint.as_ref(), lease).await })
}

fn spawn_complete<S: IdempotencyStore + Clone>(
    store: &S,
    lease: Lease,
    response: Vec<u8>,
) -> tokio::task::JoinHandle<Result<(), StoreError>> {
    let store = store.clone();
    tokio::spawn(async move { store.complete(&lease, &response, LEASE).await })
}

async fn joined<T>(task: tokio::task::JoinHandle<T>) -> T {
    task.await.unwrap_or_else(|e| panic!("task: {e}"))
}

/// The calls of `command` Redis ran since the last `CONFIG RESETSTAT`
/// (its `calls` less its `failed_calls`: an `EVALSHA` of a script the
/// server did not know yet fails, and is sent again after `SCRIPT LOAD`).
fn redis_calls(server: &RedisServer, command: &str) -> u64 {
    let stats = server.command("INFO commandstats");
    let Some(line) = stats
        .lines()
        .find_map(|line| line.strip_prefix(&format!("cmdstat_{command}:")))
    else {
        return 0;
    };
    let field = |name: &str| -> u64 {
        line.split(',')
            .find_map(|f| f.trim().strip_prefix(&format!("{name}=")))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    field("calls") - field("failed_calls")
}

/// Runs `calls` (started one after the other) while Redis holds every
/// write: the first is sent and held, the others wait in the batcher;
/// then Redis lets them go.
async fn under_pause<T>(
    server: &RedisServer,
    batcher: &Batcher,
    waiting: (usize, usize),
    calls: impl FnOnce() -> Vec<tokio::task::JoinHandle<T>>,
) -> Vec<T> {
    assert!(server.command("CLIENT PAUSE 30000 WRITE").contains("OK"));
    let tasks = calls();
    until_waiting(batcher, waiting.0, waiting.1).await;
    assert!(server.command("CLIENT UNPAUSE").contains("OK"));
    let mut out = Vec::new();
    for task in tasks {
        out.push(joined(task).await);
    }
    out
}

/// 64 concurrent duplicates of each of `rounds` keys through the
/// executor, waiting while a key is in progress: each key's handler runs
/// exactly once, and every caller gets that run's result.
async fn concurrent_duplicates_run_their_handler_once<S>(store: S, run: &str, rounds: usize)
where
    S: IdempotencyStore + Clone + 'static,
{
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use idemkit::{IdemError, Idempotency, InProgressPolicy, Processed};

    #[derive(Debug)]
    struct Never;
    impl std::fmt::Display for Never {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("never")
        }
    }
    impl std::error::Error for Never {}

    let idem = Arc::new(
        Idempotency::new(store).on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::from_secs(20),
            poll: Duration::from_millis(5),
        }),
    );
    for round in 0..rounds {
        let k = key(&format!("dup-{run}-{round}"));
        let runs = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let (idem, k, runs) = (idem.clone(), k.clone(), runs.clone());
                tokio::spawn(async move {
                    let got: Result<Processed<u64>, IdemError<Never>> = idem
                        .process(&k, 7u8, move |_| async move {
                            let n = runs.fetch_add(1, Ordering::SeqCst);
                            tokio::task::yield_now().await;
                            Ok::<u64, Never>(1000 + n as u64)
                        })
                        .await;
                    got
                })
            })
            .collect();
        let mut values = std::collections::BTreeSet::new();
        for task in tasks {
            match joined(task).await {
                Ok(Processed::Executed(v)) | Ok(Processed::Replayed(v)) => {
                    values.insert(v);
                }
                Ok(other) => panic!("round {round}: {other:?}"),
                Err(e) => panic!("round {round}: {e:?}"),
            }
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "round {round}: handler runs"
        );
        assert_eq!(values.len(), 1, "round {round}: {values:?}");
    }
}

/// 256 concurrent callers over 32 keys (8 duplicates of each, interleaved)
/// through the executor: each key's handler runs exactly once.
async fn many_callers_over_many_keys_run_each_handler_once<S>(store: S, run: &str)
where
    S: IdempotencyStore + Clone + 'static,
{
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use idemkit::{IdemError, Idempotency, InProgressPolicy, Processed};

    let idem = Arc::new(
        Idempotency::new(store).on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::from_secs(20),
            poll: Duration::from_millis(5),
        }),
    );
    let runs: Arc<Vec<AtomicUsize>> = Arc::new((0..32).map(|_| AtomicUsize::new(0)).collect());
    let tasks: Vec<_> = (0..256usize)
        .map(|i| {
            let (idem, runs) = (idem.clone(), runs.clone());
            let k = key(&format!("many-{run}-{}", i % 32));
            tokio::spawn(async move {
                let got: Result<Processed<u64>, IdemError<std::io::Error>> = idem
                    .process(&k, 7u8, move |_| async move {
                        let n = runs[i % 32].fetch_add(1, Ordering::SeqCst);
                        tokio::task::yield_now().await;
                        Ok::<u64, std::io::Error>((i % 32) as u64 * 1000 + n as u64)
                    })
                    .await;
                (i % 32, got)
            })
        })
        .collect();
    let mut values: Vec<std::collections::BTreeSet<u64>> = vec![Default::default(); 32];
    for task in tasks {
        match joined(task).await {
            (k, Ok(Processed::Executed(v))) | (k, Ok(Processed::Replayed(v))) => {
                values[k].insert(v);
            }
            (k, other) => panic!("key {k}: {other:?}"),
        }
    }
    for k in 0..32 {
        assert_eq!(runs[k].load(Ordering::SeqCst), 1, "key {k}: handler runs");
        assert_eq!(values[k].len(), 1, "key {k}: {:?}", values[k]);
    }
}

/// A batch mixing every outcome, in this order: fresh, a fresh key asked
/// twice then with another fingerprint, a completed key (`done`, recorded
/// with fingerprint `a`) with `a` then `b`, a held key (`held`, with `a`)
/// with `a` then `b`, fresh again; led by `first` when `with_first`.
fn mixed_batch(
    done: &IdempotencyKey,
    held: &IdempotencyKey,
    a: Fingerprint,
    b: Fingerprint,
    with_first: bool,
) -> Vec<(IdempotencyKey, Option<Fingerprint>)> {
    let mut asked = Vec::new();
    if with_first {
        asked.push((key("first"), None));
    }
    asked.extend([
        (key("fresh-1"), None),
        (key("twice"), Some(a)),
        (done.clone(), Some(a)),
        (key("twice"), Some(a)),
        (held.clone(), Some(a)),
        (held.clone(), Some(b)),
        (done.clone(), Some(b)),
        (key("twice"), Some(b)),
        (key("fresh-2"), None),
    ]);
    asked
}

/// The answers of `first` and a [`mixed_batch`], each as its call alone
/// would have got it.
fn answered_as_alone(got: &[Result<Acquisition, StoreError>]) {
    assert_eq!(got.len(), 10, "{got:?}");
    acquired(&got[0]);
    acquired(&got[1]);
    acquired(&got[2]);
    assert!(
        matches!(&got[3], Ok(Acquisition::Completed(r)) if &r.response[..] == b"recorded"),
        "{:?}",
        got[3]
    );
    for i in [4, 5] {
        assert!(
            matches!(got[i], Ok(Acquisition::InProgress { .. })),
            "{:?}",
            got[i]
        );
    }
    for i in [6, 7, 8] {
        assert!(matches!(got[i], Ok(Acquisition::Mismatch)), "{:?}", got[i]);
    }
    acquired(&got[9]);
}

mod on_redis {
    use super::*;

    async fn own_server() -> (RedisServer, RedisStore) {
        let server = RedisServer::start(&[]);
        let store = RedisStore::connect(&server.url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to Redis: {e}"));
        // On by default on one server, 4 calls in flight.
        let defaults = store.batcher().settings();
        assert!(defaults.is_on());
        assert_eq!(defaults.calls_in_flight(), 4);
        // One call in flight before the others wait, however long (no
        // call goes beside it after `max_wait`): the counts below assume
        // it, on a machine however loaded.
        let store = store.batching(Batching::default().max_wait(HOLD));
        (server, store)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sixty_four_concurrent_callers_cost_two_script_calls_per_operation() {
        let (server, store) = own_server().await;
        let keys: Vec<IdempotencyKey> = (0..64).map(|i| key(&format!("k{i}"))).collect();
        assert!(server.command("CONFIG RESETSTAT").contains("OK"));

        // 64 acquires: the first alone, 63 in one batch.
        let got = under_pause(&server, store.batcher(), (63, 0), || {
            keys.iter()
                .map(|k| spawn_acquire(&store, k.clone(), None, LEASE))
                .collect()
        })
        .await;
        let leases: Vec<Lease> = got.iter().map(acquired).collect();
        for (lease, k) in leases.iter().zip(&keys) {
            assert_eq!(&lease.key, k);
        }
        assert_eq!(redis_calls(&server, "evalsha"), 2);

        // 64 completes, each with a response of its own.
        let done = under_pause(&server, store.batcher(), (0, 63), || {
            leases
                .iter()
                .map(|l| spawn_complete(&store, l.clone(), l.key.id().as_bytes().to_vec()))
                .collect()
        })
        .await;
        assert!(done.iter().all(Result::is_ok), "{done:?}");
        assert_eq!(redis_calls(&server, "evalsha"), 4);

        // 64 duplicates: each gets its own key's response back.
        let replays = under_pause(&server, store.batcher(), (63, 0), || {
            keys.iter()
                .map(|k| spawn_acquire(&store, k.clone(), None, LEASE))
                .collect()
        })
        .await;
        for (replay, k) in replays.iter().zip(&keys) {
            match replay {
                Ok(Acquisition::Completed(r)) => assert_eq!(&r.response[..], k.id().as_bytes()),
                other => panic!("{k}: {other:?}"),
            }
        }
        assert_eq!(redis_calls(&server, "evalsha"), 6);
        println!(
            "Redis: 192 single calls by 64 concurrent callers: {} script calls",
            redis_calls(&server, "evalsha")
        );
    }

    #[tokio::test]
    async fn a_batch_mixing_fresh_duplicate_mismatched_and_held_keys_answers_each_as_alone() {
        let (server, store) = own_server().await;
        let (a, b) = (Fingerprint::of_bytes(b"a"), Fingerprint::of_bytes(b"b"));
        let done = key("done");
        let lease = acquired(&store.acquire(&done, Some(&a), LEASE).await);
        store
            .complete(&lease, b"recorded", LEASE)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let held = key("held");
        acquired(&store.acquire(&held, Some(&a), LEASE).await);
        assert!(server.command("CONFIG RESETSTAT").contains("OK"));

        let asked = mixed_batch(&done, &held, a, b, true);
        let n = asked.len();
        let got = under_pause(&server, store.batcher(), (n - 1, 0), || {
            asked
                .iter()
                .map(|(k, fp)| spawn_acquire(&store, k.clone(), *fp, LEASE))
                .collect()
        })
        .await;
        answered_as_alone(&got);
        // The first alone, the nine others in one script call.
        assert_eq!(redis_calls(&server, "evalsha"), 2);
    }

    #[tokio::test]
    async fn a_batched_call_whose_reply_is_lost_is_each_callers_lost_reply() {
        let server = RedisServer::start(&[]);
        let upstream: std::net::SocketAddr = format!("127.0.0.1:{}", server.port)
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        let proxy = CountingProxy::start(upstream).await;
        let store = RedisStore::connect(&format!("redis://{}/", proxy.addr))
            .await
            .unwrap_or_else(|e| panic!("cannot connect to Redis: {e}"))
            .call_timeout(Duration::from_secs(2))
            .batching(Batching::default());
        let lease = Duration::from_millis(600);
        // A batch first, so that Redis knows the scripts (a NOSCRIPT
        // answer runs nothing).
        let warm = under_pause(&server, store.batcher(), (1, 0), || {
            ["warm-1", "warm-2"]
                .iter()
                .map(|id| spawn_acquire(&store, key(id), None, lease))
                .collect()
        })
        .await;
        warm.iter().for_each(|w| drop(acquired(w)));
        // The batch holds `lost-marker`: its reply is lost after Redis ran it.
        proxy.lose_replies_to(b"lost-marker", 1, 1);
        let ids = ["first", "lost-marker", "a", "b"];
        let got = under_pause(&server, store.batcher(), (3, 0), || {
            ids.iter()
                .map(|id| spawn_acquire(&store, key(id), None, lease))
                .collect()
        })
        .await;
        acquired(&got[0]);
        for (id, g) in ids.iter().zip(&got).skip(1) {
            assert!(matches!(g, Err(StoreError::Unavailable(_))), "{id}: {g:?}");
        }
        assert_eq!(proxy.lost(), 1);
        // Redis ran the batch: each key is reserved for nobody, as after a
        // single acquire whose reply was lost; a retry finds it in
        // progress, and takes it over once its lease is over.
        for id in &ids[1..] {
            let again = store.acquire(&key(id), None, lease).await;
            assert!(
                matches!(again, Ok(Acquisition::InProgress { .. })),
                "{id}: {again:?}"
            );
        }
        for id in &ids[1..] {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let taken = loop {
                match store.acquire(&key(id), None, lease).await {
                    Ok(Acquisition::Acquired(l)) => break l,
                    Ok(Acquisition::InProgress { .. }) => {
                        assert!(std::time::Instant::now() < deadline, "{id} never freed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    other => panic!("{id}: {other:?}"),
                }
            };
            assert_eq!(taken.attempt, 2, "{id}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sixty_four_concurrent_duplicates_through_the_executor_run_the_handler_once() {
        let (_server, store) = own_server().await;
        concurrent_duplicates_run_their_handler_once(store, "redis", 8).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_hundred_fifty_six_callers_over_thirty_two_keys_run_each_handler_once() {
        let (_server, store) = own_server().await;
        many_callers_over_many_keys_run_each_handler_once(store, "redis").await;
    }

    /// Two clones of one store with prefixes of their own (one per tenant),
    /// called at once: each call goes to its own store's key space, so each
    /// tenant's key is acquired exactly once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn clones_with_other_prefixes_called_at_once_keep_to_their_own_keys() {
        let (server, base) = own_server().await;
        let a = base.clone().prefix("tenant-a:");
        let b = base.clone().prefix("tenant-b:");
        for round in 0..8 {
            let k = key(&format!("order-{round}"));
            let tasks: Vec<_> = (0..64)
                .map(|i| spawn_acquire(if i % 2 == 0 { &a } else { &b }, k.clone(), None, LEASE))
                .collect();
            let (mut won_a, mut won_b) = (0, 0);
            for (i, task) in tasks.into_iter().enumerate() {
                match joined(task).await {
                    Ok(Acquisition::Acquired(_)) if i % 2 == 0 => won_a += 1,
                    Ok(Acquisition::Acquired(_)) => won_b += 1,
                    Ok(Acquisition::InProgress { .. }) => {}
                    other => panic!("{k}: {other:?}"),
                }
            }
            assert_eq!((won_a, won_b), (1, 1), "{k}");
            for store in [&a, &b] {
                let exists = server.command(&format!("EXISTS {}", store.redis_key(&k)));
                assert!(exists.contains(":1"), "{}: {exists}", store.redis_key(&k));
            }
        }
    }

    /// A clone that waits for replicas, called at once with one that does
    /// not: with no replica, every call of the first fails as it would
    /// alone, and every call of the other succeeds.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_clone_that_waits_for_replicas_called_beside_one_that_does_not_still_waits() {
        let (_server, base) = own_server().await;
        let durable = base.clone().wait_for_replicas(1, Duration::from_millis(50));
        let tasks: Vec<_> = (0..64)
            .map(|i| {
                let store = if i % 2 == 0 { &durable } else { &base };
                spawn_acquire(store, key(&format!("replicated-{i}")), None, LEASE)
            })
            .collect();
        for (i, task) in tasks.into_iter().enumerate() {
            let got = joined(task).await;
            if i % 2 == 0 {
                assert!(
                    matches!(got, Err(StoreError::Unavailable(_))),
                    "with no replica, a WAIT store's acquire answered {got:?}"
                );
            } else {
                acquired(&got);
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_a_cluster_a_batch_goes_as_one_script_call_per_hash_slot() {
        let servers = redis_server::start_cluster_servers();
        let urls: Vec<String> = servers.iter().map(|s| s.url.clone()).collect();
        let store = RedisStore::connect_cluster(urls.iter().map(String::as_str))
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the Redis Cluster: {e}"));
        // Off by default on a cluster, where keys spread over the slots.
        assert!(!store.batcher().settings().is_on());
        let store = store.batching(Batching::default().max_wait(HOLD));
        // 32 keys in one slot ({one}), 32 in another ({two}).
        let keys: Vec<IdempotencyKey> = (0..64)
            .map(|i| {
                key(&format!(
                    "{{{}}}-{i}",
                    if i % 2 == 0 { "one" } else { "two" }
                ))
            })
            .collect();
        for s in &servers {
            assert!(s.command("CONFIG RESETSTAT").contains("OK"));
            assert!(s.command("CLIENT PAUSE 30000 WRITE").contains("OK"));
        }
        let tasks: Vec<_> = keys
            .iter()
            .map(|k| spawn_acquire(&store, k.clone(), None, LEASE))
            .collect();
        until_waiting(store.batcher(), 63, 0).await;
        for s in &servers {
            assert!(s.command("CLIENT UNPAUSE").contains("OK"));
        }
        let mut leases = Vec::new();
        for task in tasks {
            leases.push(acquired(&joined(task).await));
        }
        for (lease, k) in leases.iter().zip(&keys) {
            assert_eq!(&lease.key, k);
        }
        let calls: u64 = servers.iter().map(|s| redis_calls(s, "evalsha")).sum();
        // The first alone; the batch: one call per slot.
        assert_eq!(calls, 3);
    }
}

mod on_postgres {
    use super::*;

    /// Receipt type of the claim that holds a key.
    #[derive(serde::Serialize, serde::Deserialize)]
    struct Unit;

    /// The calls PostgreSQL counted of the statement whose text holds
    /// `marker` since the last reset.
    async fn pg_calls(monitor: &PgPool, marker: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements WHERE query LIKE $1",
        )
        .bind(format!("%{marker}%"))
        .fetch_one(monitor)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }

    async fn reset(monitor: &PgPool) {
        sqlx::query("SELECT pg_stat_statements_reset()")
            .execute(monitor)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// A server of its own that counts statements, a store on it, and a
    /// pool to watch it with.
    async fn own_server() -> (pg::PgServer, PgStore, PgPool) {
        let server = pg::PgServer::init("-c shared_preload_libraries=pg_stat_statements");
        server.start_again();
        let pool = pg::pool(&server.url, 4).await;
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let store = PgStore::builder(pool.clone())
            .batching(Batching::default().max_wait(HOLD))
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        (server, store, pool)
    }

    // What tells the statements apart in their text.
    const ACQUIRE: &str = "-- acquire: one statement";
    const ACQUIRE_MANY: &str = "-- acquire_many: ";
    const COMPLETE: &str = "-- complete: compare-and-set";
    const COMPLETE_MANY: &str = "-- complete_many: ";

    /// Runs `calls` while `hold` keeps the first of them waiting on a lock:
    /// the others wait in the batcher; then the hold ends.
    async fn held_by<T>(
        store: &PgStore,
        monitor: &PgPool,
        hold: sqlx::Transaction<'static, sqlx::Postgres>,
        waiting: (usize, usize),
        first: tokio::task::JoinHandle<T>,
        rest: impl FnOnce() -> Vec<tokio::task::JoinHandle<T>>,
    ) -> Vec<T> {
        pg::until_waiting_on_locks(monitor, 1).await;
        let tasks = rest();
        until_waiting(store.batcher(), waiting.0, waiting.1).await;
        hold.rollback().await.unwrap_or_else(|e| panic!("{e}"));
        let mut out = vec![joined(first).await];
        for task in tasks {
            out.push(joined(task).await);
        }
        out
    }

    /// A claim of `k` in a transaction: an acquire of `k` waits on it.
    async fn claimed(
        store: &PgStore,
        pool: &PgPool,
        k: &IdempotencyKey,
    ) -> sqlx::Transaction<'static, sqlx::Postgres> {
        let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
        let Ok(Claim::Acquired(_)) = store
            .in_transaction()
            .claim_with::<Unit>(&mut tx, k, None)
            .await
        else {
            panic!("claim")
        };
        tx
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sixty_four_concurrent_callers_cost_two_statements_per_operation() {
        let (_server, store, pool) = own_server().await;
        let keys: Vec<IdempotencyKey> = (0..64).map(|i| key(&format!("k{i}"))).collect();

        // The first acquire waits on a claim of its key; 63 batch behind it.
        let hold = claimed(&store, &pool, &keys[0]).await;
        reset(&pool).await;
        let first = spawn_acquire(&store, keys[0].clone(), None, LEASE);
        let got = held_by(&store, &pool, hold, (63, 0), first, || {
            keys[1..]
                .iter()
                .map(|k| spawn_acquire(&store, k.clone(), None, LEASE))
                .collect()
        })
        .await;
        let leases: Vec<Lease> = got.iter().map(acquired).collect();
        for (lease, k) in leases.iter().zip(&keys) {
            assert_eq!(&lease.key, k);
        }
        assert_eq!(pg_calls(&pool, ACQUIRE).await, 1);
        assert_eq!(pg_calls(&pool, ACQUIRE_MANY).await, 1);

        // The first complete waits on a lock of its row; 63 batch behind it.
        let mut hold = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
        sqlx::query("SELECT 1 FROM idem_records WHERE key = $1 FOR UPDATE")
            .bind(keys[0].id())
            .execute(&mut *hold)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        reset(&pool).await;
        let first = spawn_complete(&store, leases[0].clone(), b"k0".to_vec());
        let done = held_by(&store, &pool, hold, (0, 63), first, || {
            leases[1..]
                .iter()
                .map(|l| spawn_complete(&store, l.clone(), l.key.id().as_bytes().to_vec()))
                .collect()
        })
        .await;
        assert!(done.iter().all(Result::is_ok), "{done:?}");
        assert_eq!(pg_calls(&pool, COMPLETE).await, 1);
        assert_eq!(pg_calls(&pool, COMPLETE_MANY).await, 1);
        for k in &keys {
            let record = store.get(k).await.unwrap_or_else(|e| panic!("{e}"));
            match record.map(|r| r.state) {
                Some(idemkit::RecordState::Completed { response, .. }) => {
                    assert_eq!(&response[..], k.id().as_bytes())
                }
                other => panic!("{k}: {other:?}"),
            }
        }
        pool.close().await;
    }

    #[tokio::test]
    async fn a_batch_mixing_fresh_duplicate_mismatched_and_held_keys_answers_each_as_alone() {
        let (_server, store, pool) = own_server().await;
        let (a, b) = (Fingerprint::of_bytes(b"a"), Fingerprint::of_bytes(b"b"));
        let done = key("done");
        let lease = acquired(&store.acquire(&done, Some(&a), LEASE).await);
        store
            .complete(&lease, b"recorded", LEASE)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let held = key("held");
        acquired(&store.acquire(&held, Some(&a), LEASE).await);

        let hold = claimed(&store, &pool, &key("first")).await;
        reset(&pool).await;
        let first = spawn_acquire(&store, key("first"), None, LEASE);
        let asked = mixed_batch(&done, &held, a, b, false);
        let n = asked.len();
        let got = held_by(&store, &pool, hold, (n, 0), first, || {
            asked
                .iter()
                .map(|(k, fp)| spawn_acquire(&store, k.clone(), *fp, LEASE))
                .collect()
        })
        .await;
        answered_as_alone(&got);
        // `twice` three times: three statements, in order.
        assert_eq!(pg_calls(&pool, ACQUIRE_MANY).await, 3);
        pool.close().await;
    }

    #[tokio::test]
    async fn a_batched_statement_whose_reply_is_lost_is_resent_and_each_caller_holds_its_key() {
        let (proxy, url) = pg::proxied().await;
        let direct = pg::pool(pg::shared_url(), 2).await;
        let pool = pg::pool(&url, 2).await;
        let table = format!("batch_lost_{:08x}", fastrand::u32(..));
        let store = PgStore::builder(pool.clone())
            .table(table.clone())
            .batching(Batching::default())
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        // The same table without the proxy, to hold the first key.
        let direct_store = PgStore::builder(direct.clone())
            .table(table)
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        let run = format!("{:08x}", fastrand::u32(..));
        let ids: Vec<String> = ["first", "lost-marker", "a", "b"]
            .iter()
            .map(|id| format!("{id}-{run}"))
            .collect();
        let hold = claimed(&direct_store, &direct, &key(&ids[0])).await;
        let first = spawn_acquire(&store, key(&ids[0]), None, LEASE);
        proxy.lose_replies_to(ids[1].as_bytes(), 1, 1);
        let got = held_by(&store, &direct, hold, (3, 0), first, || {
            ids[1..]
                .iter()
                .map(|id| spawn_acquire(&store, key(id), None, LEASE))
                .collect()
        })
        .await;
        assert_eq!(proxy.lost(), 1);
        // Resent with the same tokens: each caller holds its own key.
        for (id, g) in ids.iter().zip(&got) {
            let lease = acquired(g);
            assert_eq!(lease.attempt, 1, "{id}");
            let again = store.acquire(&key(id), None, LEASE).await;
            assert!(
                matches!(again, Ok(Acquisition::InProgress { .. })),
                "{id}: {again:?}"
            );
            store
                .complete(&lease, id.as_bytes(), LEASE)
                .await
                .unwrap_or_else(|e| panic!("{id}: {e}"));
        }
        pool.close().await;
        direct.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sixty_four_concurrent_duplicates_through_the_executor_run_the_handler_once() {
        let pool = pg::pool(pg::shared_url(), 4).await;
        let table = format!("batch_dups_{:08x}", fastrand::u32(..));
        let store = PgStore::builder(pool.clone())
            .table(table)
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        concurrent_duplicates_run_their_handler_once(store.clone(), "pg", 8).await;
        let tiered = idemkit::tiered::TieredStore::new(store)
            .with_cache(idemkit::tiered::MokaCache::new(1_000, 1 << 20));
        concurrent_duplicates_run_their_handler_once(tiered, "tiered", 8).await;
        pool.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_hundred_fifty_six_callers_over_thirty_two_keys_run_each_handler_once() {
        let pool = pg::pool(pg::shared_url(), 4).await;
        let table = format!("batch_many_{:08x}", fastrand::u32(..));
        let store = PgStore::builder(pool.clone())
            .table(table)
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        many_callers_over_many_keys_run_each_handler_once(store, "pg").await;
        pool.close().await;
    }

    /// Waits (10 s at most) until a session waits for the advisory lock
    /// of `k` (pg_locks; other tests' lock waits do not count).
    async fn until_waiting_on_key_lock(monitor: &PgPool, k: &IdempotencyKey) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                 AND objid::int8 = (hashtext($1)::int8 & 4294967295)",
            )
            .bind(k.id())
            .fetch_one(monitor)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            if waiting >= 1 {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "nobody waited on {k}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A batched statement whose reply is lost is resent with the same
    /// tokens; if its key is locked elsewhere when the resend runs, the
    /// caller must still end up holding the key its first send reserved,
    /// as a single call resent (waiting for the lock) would.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_reply_whose_resend_finds_the_key_locked_still_gives_the_caller_its_key() {
        let (proxy, url) = pg::proxied().await;
        let direct = pg::pool(pg::shared_url(), 3).await;
        let pool = pg::pool(&url, 2).await;
        let table = format!("batch_lost_busy_{:08x}", fastrand::u32(..));
        let store = PgStore::builder(pool.clone())
            .table(table.clone())
            .call_timeout(Duration::from_secs(20))
            .batching(Batching::default())
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        let direct_store = PgStore::builder(direct.clone())
            .table(table)
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        let run = format!("{:08x}", fastrand::u32(..));
        let first_id = format!("first-{run}");
        let x_id = format!("lost-busy-{run}");
        let x = key(&x_id);
        // The first call waits on a claim; `x` waits in the batcher.
        let hold = claimed(&direct_store, &direct, &key(&first_id)).await;
        let first = spawn_acquire(&store, key(&first_id), None, LEASE);
        until_waiting_on_key_lock(&direct, &key(&first_id)).await;
        // `x`'s statement reaches the server late, runs, and its reply is
        // lost; its resend reaches the server late too.
        proxy.lose_replies_to(x_id.as_bytes(), 1, 1);
        proxy.delay_requests_to(x_id.as_bytes(), Duration::from_millis(1500));
        let batched = spawn_acquire(&store, x.clone(), None, LEASE);
        until_waiting(store.batcher(), 1, 0).await;
        hold.rollback().await.unwrap_or_else(|e| panic!("{e}"));
        acquired(&joined(first).await);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while proxy.lost() < 1 {
            assert!(std::time::Instant::now() < deadline, "no reply lost");
            tokio::task::yield_now().await;
        }
        // Before the resend arrives: another session locks `x` for a while
        // (as an in-transaction claim of it does).
        let mut lock = direct.begin().await.unwrap_or_else(|e| panic!("{e}"));
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1 || $2), hashtext($3))")
            .bind(direct_store.qualified_table())
            .bind(x.scope())
            .bind(x.id())
            .execute(&mut *lock)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        until_waiting_on_key_lock(&direct, &x).await;
        lock.rollback().await.unwrap_or_else(|e| panic!("{e}"));
        let got = joined(batched).await;
        let record = direct_store.get(&x).await;
        assert!(
            matches!(&got, Ok(Acquisition::Acquired(l)) if l.attempt == 1),
            "the caller whose batched statement reserved {x} got {got:?}; record: {record:?}"
        );
        pool.close().await;
        direct.close().await;
    }

    /// The same lost reply and locked resend for a single call sent alone
    /// (batching off): the caller holds its key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_reply_whose_resend_finds_the_key_locked_gives_a_lone_caller_its_key() {
        let (proxy, url) = pg::proxied().await;
        let direct = pg::pool(pg::shared_url(), 3).await;
        let pool = pg::pool(&url, 2).await;
        let table = format!("batch_lost_alone_{:08x}", fastrand::u32(..));
        let store = PgStore::builder(pool.clone())
            .table(table.clone())
            .call_timeout(Duration::from_secs(20))
            .batching(idemkit::Batching::off())
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        let direct_store = PgStore::builder(direct.clone())
            .table(table)
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        let x_id = format!("lost-busy-{:08x}", fastrand::u32(..));
        let x = key(&x_id);
        proxy.lose_replies_to(x_id.as_bytes(), 1, 1);
        proxy.delay_requests_to(x_id.as_bytes(), Duration::from_millis(1500));
        let alone = spawn_acquire(&store, x.clone(), None, LEASE);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while proxy.lost() < 1 {
            assert!(std::time::Instant::now() < deadline, "no reply lost");
            tokio::task::yield_now().await;
        }
        let mut lock = direct.begin().await.unwrap_or_else(|e| panic!("{e}"));
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1 || $2), hashtext($3))")
            .bind(direct_store.qualified_table())
            .bind(x.scope())
            .bind(x.id())
            .execute(&mut *lock)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        until_waiting_on_key_lock(&direct, &x).await;
        lock.rollback().await.unwrap_or_else(|e| panic!("{e}"));
        let got = joined(alone).await;
        assert!(
            matches!(&got, Ok(Acquisition::Acquired(l)) if l.attempt == 1),
            "{got:?}"
        );
        pool.close().await;
        direct.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_held_in_a_transaction_does_not_hold_up_the_other_callers_of_its_batch() {
        let pool = pg::pool(pg::shared_url(), 4).await;
        let table = format!("batch_held_{:08x}", fastrand::u32(..));
        let store = PgStore::builder(pool.clone())
            .table(table)
            .call_timeout(Duration::from_secs(20))
            .batching(Batching::default().max_wait(HOLD))
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        let held = key("held-in-a-transaction");
        let kept = claimed(&store, &pool, &held).await;
        // The first waits on a claim of its own key; three batch behind it,
        // one of them the key `kept` holds.
        let hold = claimed(&store, &pool, &key("first")).await;
        let first = spawn_acquire(&store, key("first"), None, LEASE);
        pg::until_waiting_on_locks(&pool, 1).await;
        let waiting_on_held = spawn_acquire(&store, held.clone(), None, LEASE);
        let free: Vec<_> = ["free-1", "free-2"]
            .iter()
            .map(|id| spawn_acquire(&store, key(id), None, LEASE))
            .collect();
        until_waiting(store.batcher(), 3, 0).await;
        hold.rollback().await.unwrap_or_else(|e| panic!("{e}"));
        acquired(&joined(first).await);
        // The free keys are answered while the held key's transaction is
        // still open (their batch tried its lock and sent it alone).
        let answered = tokio::time::timeout(Duration::from_secs(5), async {
            let mut got = Vec::new();
            for task in free {
                got.push(joined(task).await);
            }
            got
        })
        .await
        .unwrap_or_else(|_| panic!("the free keys waited for the held one"));
        answered.iter().for_each(|g| drop(acquired(g)));
        assert!(!waiting_on_held.is_finished());
        // The held key's caller waited for its lock, as alone, and then
        // takes the key the claim gave up.
        kept.rollback().await.unwrap_or_else(|e| panic!("{e}"));
        acquired(&joined(waiting_on_held).await);
        pool.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_waiting_for_a_lock_holds_up_the_other_callers_no_longer_than_max_wait() {
        let pool = pg::pool(pg::shared_url(), 4).await;
        let table = format!("batch_wait_{:08x}", fastrand::u32(..));
        let store = PgStore::builder(pool.clone())
            .table(table)
            .call_timeout(Duration::from_secs(20))
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        // The first call waits for a claim that stays open.
        let hold = claimed(&store, &pool, &key("first")).await;
        let first = spawn_acquire(&store, key("first"), None, LEASE);
        pg::until_waiting_on_locks(&pool, 1).await;
        let others: Vec<_> = (0..8)
            .map(|i| spawn_acquire(&store, key(&format!("other-{i}")), None, LEASE))
            .collect();
        let answered = tokio::time::timeout(Duration::from_secs(5), async {
            let mut got = Vec::new();
            for task in others {
                got.push(joined(task).await);
            }
            got
        })
        .await
        .unwrap_or_else(|_| panic!("the other callers waited for the lock"));
        answered.iter().for_each(|g| drop(acquired(g)));
        assert!(!first.is_finished());
        hold.rollback().await.unwrap_or_else(|e| panic!("{e}"));
        acquired(&joined(first).await);
        pool.close().await;
    }
}
