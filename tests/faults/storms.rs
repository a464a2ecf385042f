//! The fault and load suite: exactly-once under redelivery storms, crashed
//! and zombie workers, long handlers, and server faults, on every backend.
//!
//! Every scenario records side effects in a ledger (an atomic counter per
//! message, or a PostgreSQL table written in the same transaction for the
//! in-transaction mode) and checks it at the end. Each prints one
//! `reliability scenario=... backend=...` line with its figures; RELIABILITY.md
//! tabulates them (`cargo test --all-features --test faults -- --nocapture`).

use crate::support;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::postgres::{Claim, PgStore};
use idem::redis::RedisStore;
use idem::testkit::Tap;
use idem::tiered::{MokaCache, RedisCache, TieredStore};
use idem::{
    Acquisition, IdemError, Idempotency, IdempotencyKey, IdempotencyStore, InProgressPolicy,
    MemoryStore, Processed, Record, StoreError,
};

// ------------------------------------------------------------ backends

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Memory,
    Postgres,
    PostgresTx,
    Redis,
    RedisCluster,
    Tiered,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Postgres => "postgres",
            Backend::PostgresTx => "postgres-tx",
            Backend::Redis => "redis",
            Backend::RedisCluster => "redis-cluster",
            Backend::Tiered => "tiered",
        }
    }

    /// The store (for the in-transaction mode: the PgStore it runs on).
    async fn store(self) -> Arc<dyn IdempotencyStore> {
        match self {
            Backend::Memory => Arc::new(MemoryStore::new()),
            Backend::Postgres | Backend::PostgresTx => Arc::new(pg_store().await),
            Backend::Redis => Arc::new(
                RedisStore::connect(support::redis_server::shared_url())
                    .await
                    .unwrap_or_else(|e| panic!("{e}")),
            ),
            Backend::RedisCluster => Arc::new(
                RedisStore::connect_cluster(
                    support::redis_server::shared_cluster()
                        .iter()
                        .map(String::as_str),
                )
                .await
                .unwrap_or_else(|e| panic!("{e}")),
            ),
            Backend::Tiered => Arc::new(
                TieredStore::new(pg_store().await)
                    .with_cache(MokaCache::new(100_000, 64 << 20))
                    .with_cache(
                        RedisCache::connect(support::redis_server::shared_url())
                            .await
                            .unwrap_or_else(|e| panic!("{e}")),
                    ),
            ),
        }
    }

    async fn receiver(self, lease: Duration) -> Receiver {
        if self == Backend::PostgresTx {
            return Receiver::tx(pg_store().await).await;
        }
        Receiver::Store(
            Idempotency::from_arc(self.store().await)
                .lease(lease)
                .on_in_progress(InProgressPolicy::Reject),
        )
    }
}

async fn pg_store() -> PgStore {
    pg_store_at(support::pg::shared_url()).await
}

async fn pg_store_at(url: &str) -> PgStore {
    let store = PgStore::builder(support::pg::pool(url, 32).await)
        .connections(32)
        .call_timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    store
}

fn run_id() -> String {
    format!("{:016x}", fastrand::u64(..))
}

fn key(scope: &str, run: &str, msg: u64) -> IdempotencyKey {
    IdempotencyKey::new(scope, format!("{run}-{msg}")).unwrap_or_else(|e| panic!("{e}"))
}

/// Prints the figures of one scenario in the format RELIABILITY.md uses.
fn report(scenario: &str, backend: Backend, fields: &[(&str, String)], started: Instant) {
    let mut line = format!("reliability scenario={scenario} backend={}", backend.name());
    for (k, v) in fields {
        line.push_str(&format!(" {k}={v}"));
    }
    line.push_str(&format!(" duration_ms={}", started.elapsed().as_millis()));
    println!("{line}");
}

/// One test per backend, `$name` running `$scenario($backend)` on a
/// 2-thread runtime.
macro_rules! on_backends {
    ($scenario:path; $($name:ident => $backend:expr),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            $scenario($backend).await
        }
    )*};
}

// ------------------------------------------------------------ receivers

/// What one delivery got.
#[derive(Debug)]
enum Delivery {
    Executed(u64),
    Replayed(u64),
    InProgress,
    /// The store could not be reached (`StoreError::Unavailable`).
    Unavailable(String),
    Failed(String),
}

/// Writes an unrecorded completion with its own lease, retrying while the
/// store is away (30 s at most): the run's value once written, `Failed`
/// if another worker took the key over or the store refused it.
async fn finish(idem: &Idempotency<dyn IdempotencyStore>, u: &idem::Unrecorded) -> Delivery {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match idem.finish(u).await {
            Ok(()) => {
                return match serde_json::from_slice::<u64>(u.response()) {
                    Ok(v) => Delivery::Executed(v),
                    Err(e) => Delivery::Failed(format!("finished, but its value: {e}")),
                }
            }
            Err(e) if e.is_retryable() && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Delivery::Failed(format!("unrecorded, then: {e}")),
        }
    }
}

/// A message receiver on one backend; its effect is counted in a ledger.
#[derive(Clone)]
enum Receiver {
    Store(Idempotency<dyn IdempotencyStore>),
    /// The in-transaction mode: the effect is a row in `ledger`, written in
    /// the same transaction as the reservation and the completion.
    Tx {
        store: PgStore,
        ledger: String,
    },
}

static EXECUTION: AtomicU64 = AtomicU64::new(1);

impl Receiver {
    async fn tx(store: PgStore) -> Receiver {
        let ledger = format!("ledger_{}", run_id());
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {ledger} (msg int8 NOT NULL, execution int8 NOT NULL)"
        )))
        .execute(store.pool())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        Receiver::Tx { store, ledger }
    }

    /// Delivers `msg` under `key`; the effect adds one to `ledger[msg]`
    /// (or a row to the ledger table) and the recorded result is a number
    /// unique to this execution.
    async fn deliver(&self, key: &IdempotencyKey, msg: u64, ledger: &Ledger) -> Delivery {
        match self {
            Receiver::Store(idem) => {
                let out = idem
                    .process(key, msg, |msg| async move {
                        ledger.effect(msg);
                        Ok::<_, std::convert::Infallible>(EXECUTION.fetch_add(1, Ordering::SeqCst))
                    })
                    .await;
                match out {
                    Ok(Processed::Executed(v)) => Delivery::Executed(v),
                    Ok(Processed::Replayed(v)) => Delivery::Replayed(v),
                    Ok(Processed::ExecutedNotReplayable { reason, .. }) => Delivery::Failed(reason),
                    Err(IdemError::InProgress { .. }) => Delivery::InProgress,
                    Err(IdemError::Store(e @ StoreError::Unavailable(_))) => {
                        Delivery::Unavailable(e.to_string())
                    }
                    // The handler ran; the store was away past the lease:
                    // finished with the same lease, as a consumer does.
                    Err(IdemError::Unrecorded(u)) => finish(idem, &u).await,
                    Err(e) => Delivery::Failed(e.to_string()),
                }
            }
            Receiver::Tx { store, ledger } => match tx_deliver(store, ledger, key, msg).await {
                Ok(d) => d,
                Err(e) => e,
            },
        }
    }

    /// How many effects the ledger holds per message.
    async fn effects(&self, ledger: &Ledger, messages: u64) -> Vec<u32> {
        match self {
            Receiver::Store(_) => (0..messages).map(|m| ledger.count(m)).collect(),
            Receiver::Tx { store, ledger } => {
                let rows: Vec<(i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                    "SELECT msg, count(*) FROM {ledger} GROUP BY msg"
                )))
                .fetch_all(store.pool())
                .await
                .unwrap_or_else(|e| panic!("{e}"));
                let mut out = vec![0; messages as usize];
                for (msg, n) in rows {
                    out[msg as usize] = n as u32;
                }
                out
            }
        }
    }

    /// The store holding the records.
    fn store(&self) -> Arc<dyn IdempotencyStore> {
        match self {
            Receiver::Store(idem) => idem.store().clone(),
            Receiver::Tx { store, .. } => Arc::new(store.clone()),
        }
    }
}

/// A failed delivery of the in-transaction mode: connection-level sqlx
/// errors and `StoreError::Unavailable` mean the server could not be
/// reached.
fn tx_failure(e: impl Into<TxError>) -> Delivery {
    match e.into() {
        TxError::Sqlx(
            e @ (sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::Protocol(_)),
        ) => Delivery::Unavailable(e.to_string()),
        TxError::Sqlx(sqlx::Error::Database(e))
            if e.code()
                .is_some_and(|c| c.starts_with("57") || c.starts_with("08")) =>
        {
            Delivery::Unavailable(e.to_string())
        }
        TxError::Idem(IdemError::Store(e @ StoreError::Unavailable(_))) => {
            Delivery::Unavailable(e.to_string())
        }
        TxError::Store(e @ StoreError::Unavailable(_)) => Delivery::Unavailable(e.to_string()),
        other => Delivery::Failed(other.to_string()),
    }
}

#[derive(Debug, thiserror::Error)]
enum TxError {
    #[error(transparent)]
    Sqlx(#[from] sqlx::Error),
    #[error(transparent)]
    Idem(#[from] IdemError<std::convert::Infallible>),
    #[error(transparent)]
    Store(#[from] StoreError),
}

async fn tx_deliver(
    store: &PgStore,
    ledger: &str,
    key: &IdempotencyKey,
    msg: u64,
) -> Result<Delivery, Delivery> {
    let mut tx = store.pool().begin().await.map_err(tx_failure)?;
    match store
        .in_transaction()
        .claim::<_, u64>(&mut tx, key, &msg)
        .await
    {
        Ok(Claim::Acquired(lease)) => {
            let execution = EXECUTION.fetch_add(1, Ordering::SeqCst);
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {ledger} (msg, execution) VALUES ($1, $2)"
            )))
            .bind(msg as i64)
            .bind(execution as i64)
            .execute(&mut *tx)
            .await
            .map_err(tx_failure)?;
            lease
                .complete(&mut tx, &execution)
                .await
                .map_err(tx_failure)?;
            tx.commit().await.map_err(tx_failure)?;
            Ok(Delivery::Executed(execution))
        }
        Ok(Claim::Replayed(v)) => Ok(Delivery::Replayed(v)),
        Err(IdemError::InProgress { .. }) => Ok(Delivery::InProgress),
        Err(e) => Err(tx_failure(e)),
    }
}

/// Side effects per message, counted in process.
struct Ledger(Vec<AtomicU32>);

impl Ledger {
    fn new(messages: u64) -> Arc<Ledger> {
        Arc::new(Ledger((0..messages).map(|_| AtomicU32::new(0)).collect()))
    }
    fn effect(&self, msg: u64) {
        self.0[msg as usize].fetch_add(1, Ordering::SeqCst);
    }
    fn count(&self, msg: u64) -> u32 {
        self.0[msg as usize].load(Ordering::SeqCst)
    }
}

// ------------------------------------------------------------ 1. storm

/// A fault injected into a storm: gets the storm's progress, returns when
/// the fault is over.
type Fault = Box<dyn FnOnce(Arc<Progress>) -> futures::future::BoxFuture<'static, ()> + Send>;

/// How far a storm got, for a fault to wait on.
#[derive(Default)]
struct Progress {
    executed: AtomicU64,
    unavailable: AtomicU64,
    changed: tokio::sync::Notify,
}

impl Progress {
    /// Waits until `ready` holds.
    async fn until(&self, ready: impl Fn(&Progress) -> bool) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if ready(self) {
                return;
            }
            changed.await;
        }
    }
    fn bump(&self, counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }
}

/// What a storm saw.
struct Storm {
    deliveries: u64,
    redeliveries: u64,
    unavailable: u64,
    failures: u64,
    double_effects: usize,
    lost_completions: usize,
}

/// Delivers each of `messages` messages 1 to 8 times, in random order, from
/// `workers` workers; a delivery told "in progress" or failed goes back to
/// the end of the queue, as a broker redelivers. Checks that every message
/// had its effect exactly once, that every replay returned the recorded
/// result, and that every record is still completed at the end.
async fn storm(
    backend: Backend,
    receiver: Receiver,
    messages: u64,
    workers: usize,
    fault: Option<Fault>,
) -> Storm {
    let progress = Arc::new(Progress::default());
    let fault = fault.map(|f| tokio::spawn(f(progress.clone())));
    let run = run_id();
    let mut deliveries: Vec<u64> = (0..messages)
        .flat_map(|m| std::iter::repeat_n(m, fastrand::usize(1..=8)))
        .collect();
    fastrand::shuffle(&mut deliveries);
    let planned = deliveries.len() as u64;
    let queue = Arc::new(Mutex::new(VecDeque::from(deliveries)));
    let ledger = Ledger::new(messages);
    let results: Arc<Vec<AtomicU64>> = Arc::new((0..messages).map(|_| AtomicU64::new(0)).collect());
    let replays = Arc::new(Mutex::new(Vec::new()));
    let counters = Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let progress = progress.clone();
            let (receiver, queue, ledger, results, replays, counters, run) = (
                receiver.clone(),
                queue.clone(),
                ledger.clone(),
                results.clone(),
                replays.clone(),
                counters.clone(),
                run.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let next = queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                    let Some(msg) = next else { break };
                    counters[0].fetch_add(1, Ordering::Relaxed);
                    match receiver
                        .deliver(&key("faults.storm", &run, msg), msg, &ledger)
                        .await
                    {
                        Delivery::Executed(v) => {
                            let before = results[msg as usize].swap(v, Ordering::SeqCst);
                            assert_eq!(before, 0, "message {msg} executed twice");
                            progress.bump(&progress.executed);
                        }
                        Delivery::Replayed(v) => replays
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push((msg, v)),
                        other => {
                            match &other {
                                Delivery::Unavailable(e) => {
                                    if progress.unavailable.load(Ordering::SeqCst) == 0 {
                                        eprintln!("first Unavailable (redelivered): {e}");
                                    }
                                    progress.bump(&progress.unavailable)
                                }
                                Delivery::Failed(e)
                                    if counters[2].fetch_add(1, Ordering::Relaxed) == 0 =>
                                {
                                    eprintln!("first failed delivery (redelivered): {e}");
                                }
                                _ => {}
                            }
                            counters[1].fetch_add(1, Ordering::Relaxed);
                            // Redelivered later; a short pause as a broker's
                            // redelivery delay, so a fault is not spun on.
                            tokio::time::sleep(Duration::from_millis(2)).await;
                            queue
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .push_back(msg);
                        }
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await
            .unwrap_or_else(|e| panic!("a storm worker panicked: {e}"));
    }
    if let Some(fault) = fault {
        fault
            .await
            .unwrap_or_else(|e| panic!("the fault task failed: {e}"));
    }
    let effects = receiver.effects(&ledger, messages).await;
    let double_effects = effects.iter().filter(|&&n| n > 1).count();
    let missing = effects.iter().filter(|&&n| n == 0).count();
    assert_eq!(
        double_effects,
        0,
        "{}: messages with a double effect",
        backend.name()
    );
    assert_eq!(missing, 0, "{}: messages never executed", backend.name());
    for (msg, v) in replays.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        assert_eq!(
            *v,
            results[*msg as usize].load(Ordering::SeqCst),
            "a replay of message {msg} differs from its recorded result"
        );
    }
    let store = receiver.store();
    let mut lost_completions = 0;
    for msg in 0..messages {
        match store.get(&key("faults.storm", &run, msg)).await {
            Ok(Some(Record {
                state: idem::RecordState::Completed { .. },
                ..
            })) => {}
            _ => lost_completions += 1,
        }
    }
    let c = |i: usize| counters[i].load(Ordering::SeqCst);
    debug_assert!(c(0) >= planned);
    Storm {
        deliveries: c(0),
        redeliveries: c(1),
        unavailable: progress.unavailable.load(Ordering::SeqCst),
        failures: c(2),
        double_effects,
        lost_completions,
    }
}

async fn storm_scenario(backend: Backend) {
    let started = Instant::now();
    let messages = 10_000;
    let receiver = backend.receiver(Duration::from_secs(30)).await;
    let s = storm(backend, receiver, messages, 64, None).await;
    assert_eq!(
        s.failures + s.unavailable,
        0,
        "no delivery fails without a fault"
    );
    assert_eq!(s.lost_completions, 0);
    report(
        "redelivery-storm",
        backend,
        &[
            ("messages", messages.to_string()),
            ("deliveries", s.deliveries.to_string()),
            ("in_progress_redeliveries", s.redeliveries.to_string()),
            ("double_effects", s.double_effects.to_string()),
            ("lost_completions", s.lost_completions.to_string()),
        ],
        started,
    );
}

mod redelivery_storm {
    use super::*;
    on_backends!(storm_scenario; memory => Backend::Memory, postgres => Backend::Postgres,
        postgres_tx => Backend::PostgresTx, redis => Backend::Redis,
        redis_cluster => Backend::RedisCluster, tiered => Backend::Tiered);
}

// ------------------------------------------------------------ 2. crash

const SHORT_LEASE: Duration = Duration::from_millis(400);

/// A worker's handler is killed mid-way (before its side effect, or after
/// the effect started), and its process dies before it can release the key.
/// After the lease, the redelivery takes the key over as attempt 2: with an
/// effect outside the store, the effect that had started is done again
/// (at-least-once, and `attempt` tells the handler); before the effect,
/// it runs once.
async fn crash_scenario(backend: Backend, effect_started: bool) {
    let started = Instant::now();
    let store = backend.store().await;
    let run = run_id();
    let key = key("faults.crash", &run, 0);
    let ledger = Ledger::new(1);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    // The worker's process dies before it can release the key.
    let dying = Tap::new(store.clone());
    dying.drop_releases(true);
    let dying = Idempotency::new(dying).lease(SHORT_LEASE);
    let worker = {
        let (key, ledger) = (key.clone(), ledger.clone());
        tokio::spawn(async move {
            let _ = dying
                .process_with(&key, None, |_| async move {
                    if effect_started {
                        ledger.effect(0);
                    }
                    let _ = started_tx.send(());
                    std::future::pending::<Result<u64, std::convert::Infallible>>().await
                })
                .await;
        })
    };
    started_rx.await.unwrap_or_else(|e| panic!("{e}"));
    worker.abort();
    let _ = worker.await;

    // The redelivery waits out the dead worker's lease, then takes over.
    let idem = Idempotency::from_arc(store)
        .lease(SHORT_LEASE)
        .on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::from_secs(10),
            poll: Duration::from_millis(50),
        });
    let attempt = Arc::new(AtomicU32::new(0));
    let out = {
        let (ledger, attempt) = (ledger.clone(), attempt.clone());
        idem.process_with(&key, None, |ctx| async move {
            attempt.store(ctx.attempt, Ordering::SeqCst);
            ledger.effect(0);
            Ok::<_, std::convert::Infallible>(7u64)
        })
        .await
    };
    assert!(matches!(out, Ok(Processed::Executed(7))), "{out:?}");
    assert_eq!(
        attempt.load(Ordering::SeqCst),
        2,
        "the takeover runs as attempt 2"
    );
    let expected = if effect_started { 2 } else { 1 };
    assert_eq!(ledger.count(0), expected);
    report(
        if effect_started {
            "crash-after-effect"
        } else {
            "crash-before-effect"
        },
        backend,
        &[
            ("messages", "1".into()),
            ("deliveries", "2".into()),
            (
                "takeover_attempt",
                attempt.load(Ordering::SeqCst).to_string(),
            ),
            ("effects", ledger.count(0).to_string()),
        ],
        started,
    );
}

/// In the in-transaction mode the effect is a row of the same transaction:
/// a worker killed after writing it rolls back with its reservation, and
/// the redelivery's effect is the only one.
async fn crash_tx_scenario() {
    let started = Instant::now();
    let store = pg_store().await;
    let Receiver::Tx { ledger, .. } = Receiver::tx(store.clone()).await else {
        unreachable!()
    };
    let key = key("faults.crash", &run_id(), 0);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let worker = {
        let (store, ledger, key) = (store.clone(), ledger.clone(), key.clone());
        tokio::spawn(async move {
            let mut tx = store.pool().begin().await.unwrap_or_else(|e| panic!("{e}"));
            let Ok(Claim::Acquired(_lease)) = store
                .in_transaction()
                .claim::<_, u64>(&mut tx, &key, &0u64)
                .await
            else {
                panic!("not acquired")
            };
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {ledger} VALUES (0, 1)"
            )))
            .execute(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            let _ = started_tx.send(());
            std::future::pending::<()>().await;
        })
    };
    started_rx.await.unwrap_or_else(|e| panic!("{e}"));
    worker.abort();
    let _ = worker.await;
    let receiver = Receiver::Tx {
        store: store.clone(),
        ledger,
    };
    let ledger_unused = Ledger::new(1);
    let out = receiver.deliver(&key, 0, &ledger_unused).await;
    assert!(matches!(out, Delivery::Executed(_)), "{out:?}");
    let effects = receiver.effects(&ledger_unused, 1).await;
    assert_eq!(
        effects,
        vec![1],
        "the killed transaction's effect rolled back"
    );
    report(
        "crash-after-effect",
        Backend::PostgresTx,
        &[
            ("messages", "1".into()),
            ("deliveries", "2".into()),
            ("takeover_attempt", "1".into()),
            ("effects", effects[0].to_string()),
        ],
        started,
    );
}

mod crash_mid_handler {
    use super::*;
    async fn before_the_effect(backend: Backend) {
        crash_scenario(backend, false).await
    }
    async fn after_the_effect_started(backend: Backend) {
        crash_scenario(backend, true).await
    }
    macro_rules! crash_tests {
        ($($name:ident: $backend:expr),*) => {$(
            mod $name {
                use super::*;
                on_backends!(super::before_the_effect; before_the_effect => $backend);
                on_backends!(super::after_the_effect_started; after_the_effect_started => $backend);
            }
        )*};
    }
    crash_tests!(memory: Backend::Memory, postgres: Backend::Postgres, redis: Backend::Redis,
                 redis_cluster: Backend::RedisCluster, tiered: Backend::Tiered);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_tx_never_doubles_the_effect() {
        crash_tx_scenario().await
    }
}

/// A handler that must not run.
fn never<T>(why: &str) -> Result<T, std::convert::Infallible> {
    panic!("{why}")
}

// ------------------------------------------------------------ 3. zombie

/// A worker stalls past its lease (heartbeat off, so nothing renews it);
/// another worker takes the key over and completes it. When the zombie
/// wakes up and finishes, its completion is fenced off with `LeaseLost`,
/// the new owner's result stands, and replays return it.
async fn zombie_scenario(backend: Backend) {
    let started = Instant::now();
    let store = backend.store().await;
    let key = key("faults.zombie", &run_id(), 0);
    let ledger = Ledger::new(1);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (wake_tx, wake_rx) = tokio::sync::oneshot::channel::<()>();
    let zombie = {
        let idem = Idempotency::from_arc(store.clone())
            .lease(SHORT_LEASE)
            .heartbeat(false);
        let (key, ledger) = (key.clone(), ledger.clone());
        tokio::spawn(async move {
            idem.process_with(&key, None, |_| async move {
                let _ = started_tx.send(());
                let _ = wake_rx.await;
                ledger.effect(0);
                Ok::<_, std::convert::Infallible>(1u64)
            })
            .await
        })
    };
    started_rx.await.unwrap_or_else(|e| panic!("{e}"));

    let idem = Idempotency::from_arc(store)
        .lease(Duration::from_secs(30))
        .on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::from_secs(10),
            poll: Duration::from_millis(50),
        });
    let new_owner = {
        let ledger = ledger.clone();
        idem.process_with(&key, None, |ctx| async move {
            assert_eq!(ctx.attempt, 2, "the new owner takes over as attempt 2");
            ledger.effect(0);
            Ok::<_, std::convert::Infallible>(2u64)
        })
        .await
    };
    assert!(
        matches!(new_owner, Ok(Processed::Executed(2))),
        "{new_owner:?}"
    );

    let _ = wake_tx.send(());
    let zombie = zombie.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(zombie, Err(IdemError::LeaseLost)),
        "the zombie is fenced off: {zombie:?}"
    );
    let replay = idem
        .process_with(&key, None, |_| async {
            never::<u64>("a completed key never runs again")
        })
        .await;
    assert!(
        matches!(replay, Ok(Processed::Replayed(2))),
        "replays return the new owner's result: {replay:?}"
    );
    report(
        "zombie-worker",
        backend,
        &[
            ("messages", "1".into()),
            ("deliveries", "3".into()),
            ("zombie_completion", "LeaseLost".into()),
            ("replayed", "new-owner".into()),
            ("effects", ledger.count(0).to_string()),
        ],
        started,
    );
}

mod zombie_worker {
    use super::*;
    /// MemoryStore on paused time: the lease runs out without waiting.
    #[tokio::test(start_paused = true)]
    async fn memory() {
        zombie_scenario(Backend::Memory).await
    }
    on_backends!(zombie_scenario; postgres => Backend::Postgres, redis => Backend::Redis,
        redis_cluster => Backend::RedisCluster, tiered => Backend::Tiered);
}

// ------------------------------------------------------------ 4. heartbeat

/// A handler that runs for 5 leases keeps its key: the heartbeat renews the
/// lease, every duplicate delivered meanwhile is told "in progress", no
/// takeover happens, and the effect runs once.
async fn heartbeat_scenario(backend: Backend) {
    let started = Instant::now();
    let store = backend.store().await;
    let key = key("faults.heartbeat", &run_id(), 0);
    let ledger = Ledger::new(1);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let long = {
        let idem = Idempotency::from_arc(store.clone()).lease(SHORT_LEASE);
        let (key, ledger) = (key.clone(), ledger.clone());
        tokio::spawn(async move {
            idem.process_with(&key, None, |ctx| async move {
                ledger.effect(0);
                let _ = started_tx.send(());
                tokio::time::sleep(SHORT_LEASE * 5).await; // the handler's long work
                Ok::<_, std::convert::Infallible>(ctx.attempt)
            })
            .await
        })
    };
    started_rx.await.unwrap_or_else(|e| panic!("{e}"));
    let duplicate = Idempotency::from_arc(store).lease(SHORT_LEASE);
    let mut rejected = 0;
    while !long.is_finished() {
        let out = duplicate
            .process_with(&key, None, |_| async {
                never::<u32>("no takeover while the heartbeat runs")
            })
            .await;
        match out {
            Err(IdemError::InProgress { .. }) => rejected += 1,
            Ok(Processed::Replayed(1)) => break, // it just finished
            other => panic!("a duplicate during the long handler got {other:?}"),
        }
        tokio::time::sleep(SHORT_LEASE / 4).await;
    }
    let out = long.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(out, Ok(Processed::Executed(1))),
        "the first attempt completes: {out:?}"
    );
    assert!(
        rejected >= 10,
        "duplicates kept arriving during the 5 leases: {rejected}"
    );
    assert_eq!(ledger.count(0), 1);
    report(
        "heartbeat-5-leases",
        backend,
        &[
            ("messages", "1".into()),
            ("deliveries", (rejected + 1).to_string()),
            ("in_progress_answers", rejected.to_string()),
            ("takeovers", "0".into()),
            ("effects", ledger.count(0).to_string()),
        ],
        started,
    );
}

mod heartbeat {
    use super::*;
    #[tokio::test(start_paused = true)]
    async fn memory() {
        heartbeat_scenario(Backend::Memory).await
    }
    on_backends!(heartbeat_scenario; postgres => Backend::Postgres, redis => Backend::Redis,
        redis_cluster => Backend::RedisCluster, tiered => Backend::Tiered);
}

// ------------------------------------------------------------ 5. server faults

/// Receivers for a storm through a fault: a lease long enough that a
/// completion retried through a short outage lands before anyone may take
/// the key over, and a completion retry budget longer than the outage.
fn fault_receiver(store: Arc<dyn IdempotencyStore>) -> Receiver {
    Receiver::Store(
        Idempotency::from_arc(store)
            .lease(Duration::from_secs(5))
            .complete_retry(Duration::from_secs(20))
            .on_in_progress(InProgressPolicy::Reject),
    )
}

async fn redis_at(url: &str) -> Arc<dyn IdempotencyStore> {
    Arc::new(
        RedisStore::connect(url)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .call_timeout(Duration::from_millis(500)),
    )
}

async fn pg_at(url: &str) -> PgStore {
    let store = PgStore::builder(support::pg::pool(url, 16).await)
        .connections(16)
        .call_timeout(Duration::from_millis(500))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    store
}

/// A fault that starts once a third of the messages ran, and ends once a
/// delivery has seen it (`Unavailable`), so every run really crosses it.
fn fault(
    messages: u64,
    start: impl FnOnce() + Send + 'static,
    end: impl FnOnce() + Send + 'static,
) -> Fault {
    fault_until(messages, start, end, |seen, p| {
        p.unavailable.load(Ordering::SeqCst) > seen
    })
}

/// A fault that starts once a third of the messages ran and ends when
/// `over(unavailable count at the start, progress)` holds.
fn fault_until(
    messages: u64,
    start: impl FnOnce() + Send + 'static,
    end: impl FnOnce() + Send + 'static,
    over: impl Fn(u64, &Progress) -> bool + Send + Sync + 'static,
) -> Fault {
    Box::new(move |progress: Arc<Progress>| {
        Box::pin(async move {
            progress
                .until(|p| p.executed.load(Ordering::SeqCst) >= messages / 3)
                .await;
            let seen = progress.unavailable.load(Ordering::SeqCst);
            tokio::task::spawn_blocking(start)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            progress.until(|p| over(seen, p)).await;
            tokio::task::spawn_blocking(end)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        })
    })
}

const FAULT_MESSAGES: u64 = 2_000;

async fn fault_storm(scenario: &str, backend: Backend, receiver: Receiver, fault: Fault) {
    fault_storm_expecting(scenario, backend, receiver, fault, true).await
}

async fn fault_storm_expecting(
    scenario: &str,
    backend: Backend,
    receiver: Receiver,
    fault: Fault,
    calls_fail: bool,
) {
    let started = Instant::now();
    let s = storm(backend, receiver, FAULT_MESSAGES, 32, Some(fault)).await;
    if calls_fail {
        assert!(
            s.unavailable > 0,
            "calls failed with Unavailable during the fault"
        );
    } else {
        assert_eq!(s.unavailable, 0, "the fault is invisible to callers");
    }
    assert_eq!(
        s.failures, 0,
        "every failure during the fault is Unavailable"
    );
    assert_eq!(s.lost_completions, 0, "no completed record was lost");
    report(
        scenario,
        backend,
        &[
            ("messages", FAULT_MESSAGES.to_string()),
            ("deliveries", s.deliveries.to_string()),
            ("unavailable", s.unavailable.to_string()),
            ("double_effects", s.double_effects.to_string()),
            ("lost_completions", s.lost_completions.to_string()),
        ],
        started,
    );
}

mod server_faults {
    use super::support::pg::PgServer;
    use super::support::redis_server::RedisServer;
    use super::*;

    /// Redis with an append-only file synced on every write: killed with
    /// SIGKILL mid-storm and started again, it comes back with every
    /// record. (Without persistence a restart loses every record: see
    /// RELIABILITY.md.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_killed_and_restarted() {
        let server = Arc::new(RedisServer::start(&[
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
        ]));
        let receiver = fault_receiver(redis_at(&server.url).await);
        let (a, b) = (server.clone(), server.clone());
        let fault = fault(FAULT_MESSAGES, move || a.kill(), move || b.start_again());
        fault_storm(
            "redis-killed-restarted-aof",
            Backend::Redis,
            receiver,
            fault,
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_frozen_then_thawed() {
        let server = Arc::new(RedisServer::start(&[]));
        let receiver = fault_receiver(redis_at(&server.url).await);
        let (a, b) = (server.clone(), server.clone());
        let fault = fault(
            FAULT_MESSAGES,
            move || a.signal("STOP"),
            move || b.signal("CONT"),
        );
        fault_storm("redis-sigstop-sigcont", Backend::Redis, receiver, fault).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_restarted() {
        let server = Arc::new(PgServer::start());
        let receiver = fault_receiver(Arc::new(pg_at(&server.url).await));
        let (a, b) = (server.clone(), server.clone());
        let fault = fault(FAULT_MESSAGES, move || a.stop(), move || b.start_again());
        fault_storm("postgres-restarted", Backend::Postgres, receiver, fault).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_frozen_then_thawed() {
        let server = Arc::new(PgServer::start());
        let receiver = fault_receiver(Arc::new(pg_at(&server.url).await));
        let (a, b) = (server.clone(), server.clone());
        let fault = fault(
            FAULT_MESSAGES,
            move || a.signal("STOP"),
            move || b.signal("CONT"),
        );
        fault_storm(
            "postgres-sigstop-sigcont",
            Backend::Postgres,
            receiver,
            fault,
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_tx_restarted() {
        let server = Arc::new(PgServer::start());
        let receiver = Receiver::tx(pg_at(&server.url).await).await;
        let (a, b) = (server.clone(), server.clone());
        let fault = fault(FAULT_MESSAGES, move || a.stop(), move || b.start_again());
        fault_storm("postgres-restarted", Backend::PostgresTx, receiver, fault).await;
    }

    /// One master of a 3-master cluster frozen and thawed (within the
    /// cluster's node timeout, so no failover): calls for its slots time
    /// out, the others go on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_cluster_node_frozen_then_thawed() {
        let servers = Arc::new(support::redis_server::start_cluster_servers());
        let store = RedisStore::connect_cluster(servers.iter().map(|s| s.url.as_str()))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .call_timeout(Duration::from_millis(500));
        let receiver = fault_receiver(Arc::new(store));
        let (a, b) = (servers.clone(), servers.clone());
        let fault = fault(
            FAULT_MESSAGES,
            move || a[1].signal("STOP"),
            move || b[1].signal("CONT"),
        );
        fault_storm(
            "redis-node-sigstop-sigcont",
            Backend::RedisCluster,
            receiver,
            fault,
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_tx_frozen_then_thawed() {
        let server = Arc::new(PgServer::start());
        let receiver = Receiver::tx(pg_at(&server.url).await).await;
        let (a, b) = (server.clone(), server.clone());
        let fault = fault(
            FAULT_MESSAGES,
            move || a.signal("STOP"),
            move || b.signal("CONT"),
        );
        fault_storm(
            "postgres-sigstop-sigcont",
            Backend::PostgresTx,
            receiver,
            fault,
        )
        .await;
    }

    /// The tiered store's Redis cache tier killed mid-storm and started
    /// again: callers never see it (the tier is skipped), and nothing runs
    /// twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tiered_cache_tier_killed_and_restarted() {
        let redis = Arc::new(RedisServer::start(&[]));
        let store = TieredStore::new(pg_store().await)
            .with_cache(MokaCache::new(100_000, 64 << 20))
            .with_cache(
                RedisCache::connect(&redis.url)
                    .await
                    .unwrap_or_else(|e| panic!("{e}")),
            );
        let receiver = fault_receiver(Arc::new(store));
        let (a, b) = (redis.clone(), redis.clone());
        let fault = fault_until(
            FAULT_MESSAGES,
            move || a.kill(),
            move || b.start_again(),
            |_, p| p.executed.load(Ordering::SeqCst) >= 2 * FAULT_MESSAGES / 3,
        );
        fault_storm_expecting(
            "redis-tier-killed-restarted",
            Backend::Tiered,
            receiver,
            fault,
            false,
        )
        .await;
    }

    /// The tiered store with its source of truth restarted: duplicates of
    /// completed keys keep being answered by moka and Redis meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tiered_source_restarted() {
        let server = Arc::new(PgServer::start());
        let store = TieredStore::new(pg_at(&server.url).await)
            .with_cache(MokaCache::new(100_000, 64 << 20))
            .with_cache(
                RedisCache::connect(support::redis_server::shared_url())
                    .await
                    .unwrap_or_else(|e| panic!("{e}")),
            );
        let receiver = fault_receiver(Arc::new(store));
        let (a, b) = (server.clone(), server.clone());
        let fault = fault(FAULT_MESSAGES, move || a.stop(), move || b.start_again());
        fault_storm("postgres-restarted", Backend::Tiered, receiver, fault).await;
    }
}

// ------------------------------------------- 5b. PostgreSQL waits and timeouts

mod pg_waits {
    use super::support::pg::PgServer;
    use super::*;

    /// Waits until `n` sessions of `pool`'s server wait on a lock.
    async fn until_waiting_on_locks(pool: &sqlx::PgPool, n: i64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
            )
            .fetch_one(pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            if waiting >= n {
                return;
            }
            assert!(Instant::now() < deadline, "{n} sessions never waited");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Plain deliveries wait on in-transaction claims of their keys for two
    /// leases; the transactions roll back; each waiting delivery acquires
    /// with a lease counted from its write, so a redelivery while its
    /// handler runs (three leases, heartbeat on) is "in progress": 0
    /// takeovers, 1 effect per message.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_lock_wait_longer_than_the_lease_behind_an_in_transaction_claim() {
        let started = Instant::now();
        let store = pg_store().await; // 2 s calls: the server waits up to 1 s
        let lease = Duration::from_millis(300);
        let wait = lease * 2;
        let messages = 8u64;
        let idem = Idempotency::new(store.clone())
            .lease(lease)
            .on_in_progress(InProgressPolicy::Reject);
        let run = run_id();
        let ledger = Ledger::new(messages);
        let mut claims = Vec::new();
        for msg in 0..messages {
            let mut tx = store.pool().begin().await.unwrap_or_else(|e| panic!("{e}"));
            let claim = store
                .in_transaction()
                .claim::<_, u64>(&mut tx, &key("faults.lockwait", &run, msg), &msg)
                .await;
            assert!(matches!(claim, Ok(Claim::Acquired(_))), "{claim:?}");
            claims.push(tx);
        }
        let mut deliveries = Vec::new();
        let mut started_rx = Vec::new();
        for msg in 0..messages {
            let (idem, ledger, k) = (
                idem.clone(),
                ledger.clone(),
                key("faults.lockwait", &run, msg),
            );
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            started_rx.push(rx);
            deliveries.push(tokio::spawn(async move {
                idem.process(&k, msg, move |msg| async move {
                    ledger.effect(msg);
                    let _ = tx.send(());
                    tokio::time::sleep(lease * 3).await;
                    Ok::<_, std::convert::Infallible>(msg)
                })
                .await
            }));
        }
        until_waiting_on_locks(store.pool(), messages as i64).await;
        tokio::time::sleep(wait).await; // the length of the fault
        for tx in claims {
            tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
        }
        let (mut in_progress, mut takeovers) = (0, 0);
        for (msg, rx) in started_rx.into_iter().enumerate() {
            rx.await.unwrap_or_else(|e| panic!("{e}"));
            let again = idem
                .process(
                    &key("faults.lockwait", &run, msg as u64),
                    msg as u64,
                    |_| async { never::<u64>("a live handler's key") },
                )
                .await;
            match again {
                Err(IdemError::InProgress { .. }) => in_progress += 1,
                _ => takeovers += 1,
            }
        }
        for d in deliveries {
            let out = d.await.unwrap_or_else(|e| panic!("{e}"));
            assert!(matches!(out, Ok(Processed::Executed(_))), "{out:?}");
        }
        let effects: Vec<u32> = (0..messages).map(|m| ledger.count(m)).collect();
        assert_eq!(
            takeovers, 0,
            "a handler's key was taken over after a lock wait"
        );
        assert!(effects.iter().all(|&n| n == 1), "{effects:?}");
        report(
            "lock-wait-past-lease",
            Backend::Postgres,
            &[
                ("messages", messages.to_string()),
                ("lease_ms", lease.as_millis().to_string()),
                ("lock_wait_ms", wait.as_millis().to_string()),
                ("redeliveries_in_progress", in_progress.to_string()),
                ("takeovers", takeovers.to_string()),
                (
                    "double_effects",
                    effects.iter().filter(|&&n| n > 1).count().to_string(),
                ),
            ],
            started,
        );
    }

    /// Completions that run into the server's `lock_timeout` (55P03) or
    /// `statement_timeout` (57014), set on the connections as a DBA would:
    /// each message's row is locked by another session for 300 ms as its
    /// handler returns (100 ms timeouts). The completion fails with
    /// `Unavailable`, the executor retries it, it lands once the lock is
    /// gone: every message executed once, recorded, replayed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_statement_and_lock_timeouts_during_completion() {
        for setting in ["lock_timeout", "statement_timeout"] {
            let started = Instant::now();
            let options: sqlx::postgres::PgConnectOptions = support::pg::shared_url()
                .parse()
                .unwrap_or_else(|e| panic!("{e}"));
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(8)
                .test_before_acquire(false)
                .connect_with(options.options([(setting, "100ms")]))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let store = PgStore::builder(pool)
                .connections(8)
                .call_timeout(Duration::from_secs(5))
                .build()
                .unwrap_or_else(|e| panic!("{e}"));
            store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
            let lockers = support::pg::pool(support::pg::shared_url(), 20).await;
            let tap = Arc::new(Tap::new(store.clone()));
            let idem = Idempotency::from_arc(tap.clone())
                .lease(Duration::from_secs(5))
                .complete_retry(Duration::from_secs(3))
                .on_in_progress(InProgressPolicy::Reject);
            let messages = 20u64;
            let run = run_id();
            let ledger = Ledger::new(messages);
            let table = store.qualified_table().to_owned();
            let tasks: Vec<_> = (0..messages)
                .map(|msg| {
                    let (idem, ledger, lockers, table) =
                        (idem.clone(), ledger.clone(), lockers.clone(), table.clone());
                    let k = key("faults.timeouts", &run, msg);
                    tokio::spawn(async move {
                        let kk = k.clone();
                        idem.process(&k, msg, move |msg| async move {
                            ledger.effect(msg);
                            // Another session locks the row before the
                            // completion comes, and holds it for 300 ms.
                            let (locked_tx, locked_rx) = tokio::sync::oneshot::channel();
                            tokio::spawn(async move {
                                let mut tx =
                                    lockers.begin().await.unwrap_or_else(|e| panic!("{e}"));
                                sqlx::query(sqlx::AssertSqlSafe(format!(
                                    "SELECT 1 FROM {table} WHERE scope = $1 AND key = $2 FOR UPDATE"
                                )))
                                .bind(kk.scope())
                                .bind(kk.id())
                                .execute(&mut *tx)
                                .await
                                .unwrap_or_else(|e| panic!("{e}"));
                                let _ = locked_tx.send(());
                                tokio::time::sleep(Duration::from_millis(300)).await;
                                tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
                            });
                            let _ = locked_rx.await;
                            Ok::<_, std::convert::Infallible>(msg)
                        })
                        .await
                    })
                })
                .collect();
            let mut failed = Vec::new();
            for t in tasks {
                match t.await.unwrap_or_else(|e| panic!("{e}")) {
                    Ok(Processed::Executed(_)) => {}
                    other => failed.push(format!("{other:?}")),
                }
            }
            let mut replayed = 0;
            for msg in 0..messages {
                let again = idem
                    .process(&key("faults.timeouts", &run, msg), msg, |_| async {
                        never::<u64>("it was recorded")
                    })
                    .await;
                if matches!(again, Ok(Processed::Replayed(v)) if v == msg) {
                    replayed += 1;
                }
            }
            let retried = tap.completes() as u64 - messages;
            let double = (0..messages).filter(|&m| ledger.count(m) > 1).count();
            assert!(failed.is_empty(), "{setting}: {failed:?}");
            assert!(retried > 0, "{setting}: no completion ran into the timeout");
            assert_eq!(replayed, messages, "{setting}: every result recorded");
            assert_eq!(double, 0);
            report(
                &format!("{}-during-completion", setting.replace('_', "-")),
                Backend::Postgres,
                &[
                    ("messages", messages.to_string()),
                    ("server_timeout_ms", "100".into()),
                    ("row_locked_ms", "300".into()),
                    ("completions_retried", retried.to_string()),
                    ("failed_calls", failed.len().to_string()),
                    ("replayed", replayed.to_string()),
                    ("double_effects", double.to_string()),
                ],
                started,
            );
        }
    }

    /// A lock holder that freezes (an in-transaction claim that neither
    /// commits nor rolls back) while 16 workers retry its key 10 times each
    /// with a 200 ms call timeout: every call is `Unavailable`, and the
    /// server never holds more backends than the pool and the store's
    /// connections (each statement dies on the server with its call). Once
    /// the holder rolls back, the key is free (no reservation was left by a
    /// call that gave up).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_frozen_lock_holder_with_many_retries_keeps_connections_bounded() {
        let started = Instant::now();
        let server = PgServer::start();
        let pool = support::pg::pool(&server.url, 4).await;
        let store = PgStore::builder(pool.clone())
            .connections(8)
            .call_timeout(Duration::from_millis(200))
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        let mut monitor = <sqlx::PgConnection as sqlx::Connection>::connect(&server.url)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let mut holder = <sqlx::PgConnection as sqlx::Connection>::connect(&server.url)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let hot = key("faults.frozen", &run_id(), 0);
        let mut tx = sqlx::Connection::begin(&mut holder)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let claim = store
            .in_transaction()
            .claim::<_, u64>(&mut tx, &hot, &0u64)
            .await;
        assert!(matches!(claim, Ok(Claim::Acquired(_))), "{claim:?}");

        let (workers, retries) = (16usize, 10usize);
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let tasks: Vec<_> = (0..workers)
            .map(|_| {
                let (store, hot, outcomes) = (store.clone(), hot.clone(), outcomes.clone());
                tokio::spawn(async move {
                    for _ in 0..retries {
                        let r = store.acquire(&hot, None, Duration::from_secs(30)).await;
                        let retryable = matches!(&r, Err(e) if e.is_retryable());
                        outcomes
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push((retryable, format!("{r:?}")));
                        tokio::time::sleep(Duration::from_millis(2)).await; // redelivery delay
                    }
                })
            })
            .collect();
        // Sample the server's client backends while the retries go on.
        let sampler = {
            let done = done.clone();
            tokio::spawn(async move {
                let mut max = 0i64;
                while !done.load(Ordering::SeqCst) {
                    let n: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'",
                    )
                    .fetch_one(&mut monitor)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                    max = max.max(n);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                max
            })
        };
        for t in tasks {
            t.await.unwrap_or_else(|e| panic!("{e}"));
        }
        done.store(true, Ordering::SeqCst);
        let max_backends = sampler.await.unwrap_or_else(|e| panic!("{e}"));
        tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
        let outcomes = outcomes.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let unavailable = outcomes.iter().filter(|(r, _)| *r).count();
        let other: Vec<_> = outcomes.iter().filter(|(r, _)| !*r).collect();
        let after = store.acquire(&hot, None, Duration::from_secs(30)).await;
        // pool (4) + store (8) + the monitor and the holder
        let limit = 4 + 8 + 2;
        assert!(
            other.is_empty(),
            "calls behind the frozen holder: {other:?}"
        );
        assert!(
            max_backends <= limit,
            "{max_backends} server backends for a limit of {limit}"
        );
        assert!(
            matches!(&after, Ok(Acquisition::Acquired(l)) if l.attempt == 1),
            "after the holder let go: {after:?}"
        );
        report(
            "frozen-lock-holder-retries",
            Backend::Postgres,
            &[
                ("calls", outcomes.len().to_string()),
                ("unavailable", unavailable.to_string()),
                ("max_server_backends", max_backends.to_string()),
                ("backend_limit", limit.to_string()),
                ("left_reserved", "no".into()),
            ],
            started,
        );
    }

    /// PostgreSQL restarts while the store's 16 connections sit idle (all
    /// dead after it); then a storm of 2,000 messages: no call fails (a
    /// call whose connection the server had closed runs again on a fresh
    /// one), 0 double effects, 0 lost.
    ///
    /// The call timeout is 2 s here, not the 500 ms of the other fault
    /// tests: what is tested is that a dead idle connection costs no call,
    /// and on 2 busy cores 16 new backends of a server that just started
    /// (cold caches) took longer than the 200 ms a 500 ms call leaves for
    /// getting a connection ("no connection to PostgreSQL within 200ms",
    /// 4 to 8 calls of a run in CI).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_restart_with_warm_idle_connections() {
        let started = Instant::now();
        let server = PgServer::start();
        let store = PgStore::builder(support::pg::pool(&server.url, 16).await)
            .connections(16)
            .call_timeout(Duration::from_secs(2))
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        let pool = store.pool().clone();
        // Open all 16: 16 acquires wait on an in-transaction claim.
        let k = key("faults.warm", &run_id(), 0);
        let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
        let claim = store
            .in_transaction()
            .claim::<_, u64>(&mut tx, &k, &0u64)
            .await;
        assert!(matches!(claim, Ok(Claim::Acquired(_))), "{claim:?}");
        let warm: Vec<_> = (0..16)
            .map(|_| {
                let (store, k) = (store.clone(), k.clone());
                tokio::spawn(async move { store.acquire(&k, None, Duration::from_secs(30)).await })
            })
            .collect();
        until_waiting_on_locks(&pool, 16).await;
        tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
        for w in warm {
            let got = w.await.unwrap_or_else(|e| panic!("{e}"));
            assert!(got.is_ok(), "{got:?}");
        }
        server.stop();
        server.start_again();
        let s = storm(
            Backend::Postgres,
            fault_receiver(Arc::new(store)),
            FAULT_MESSAGES,
            32,
            None,
        )
        .await;
        assert_eq!(
            s.unavailable + s.failures,
            0,
            "calls failed after the restart"
        );
        assert_eq!(s.lost_completions, 0);
        report(
            "postgres-restart-warm-idle",
            Backend::Postgres,
            &[
                ("idle_connections", "16".into()),
                ("messages", FAULT_MESSAGES.to_string()),
                ("deliveries", s.deliveries.to_string()),
                ("failed_calls", (s.unavailable + s.failures).to_string()),
                ("double_effects", s.double_effects.to_string()),
                ("lost_completions", s.lost_completions.to_string()),
            ],
            started,
        );
    }
}

// ------------------------------------------------------------ 6. bad input

/// Keys at and past every limit: typed errors, never a panic.
#[test]
fn keys_at_and_past_every_limit() {
    let ok = |scope: &str, id: &str| IdempotencyKey::new(scope, id).is_ok();
    assert!(ok(&"s".repeat(64), "x"), "a 64-byte scope");
    assert!(!ok(&"s".repeat(65), "x"), "a 65-byte scope");
    assert!(!ok("", "x"), "an empty scope");
    for bad in ["a b", "a/b", "é", "a\n", "a*", "a{b}"] {
        assert!(!ok(bad, "x"), "scope {bad:?}");
    }
    assert!(ok("s", &"x".repeat(512)), "a 512-byte id");
    assert!(
        ok("s", &"é".repeat(256)),
        "a 512-byte id of 2-byte characters"
    );
    assert!(!ok("s", &"x".repeat(513)), "a 513-byte id");
    assert!(
        !ok("s", &format!("{}é", "x".repeat(511))),
        "513 bytes, 512 characters"
    );
    assert!(!ok("s", ""), "an empty id");
    for bad in ["a\nb", "a\u{0}b", "\u{7f}", "tab\there", "\u{85}"] {
        assert!(!ok("s", bad), "id {bad:?} has a control character");
    }
    assert!(ok("s", "spaces, slashes/ and ünïcödé 🦀 are fine"));
    // ids as bytes: non-UTF-8 is a typed error
    assert!(IdempotencyKey::from_utf8("s", &[0xff, 0xfe]).is_err());
    assert!(
        IdempotencyKey::from_utf8("s", &[0xe2, 0x82]).is_err(),
        "a truncated character"
    );
    assert!(IdempotencyKey::from_utf8("s", "ok".as_bytes()).is_ok());
    // every error says what is wrong
    let e = IdempotencyKey::new("s", "x".repeat(513))
        .err()
        .map(|e| e.to_string());
    assert!(
        e.is_some_and(|m| m.contains("512")),
        "the message names the limit"
    );
}

/// A response type whose serialization fails.
#[derive(Debug, serde::Deserialize)]
struct Unserializable;

impl serde::Serialize for Unserializable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "this response refuses to serialize",
        ))
    }
}

/// On one backend: the longest key works; a 4 MB payload and a 4 MB
/// response are recorded and replayed; a response that fails to serialize
/// completes the key as not replayable (the handler ran: it never runs
/// again, duplicates get `ResultUnavailable`); and a neighbouring key is
/// never affected by any of it.
async fn bad_input_scenario(backend: Backend) {
    let started = Instant::now();
    let idem =
        Idempotency::from_arc(backend.store().await).on_in_progress(InProgressPolicy::Reject);
    let run = run_id();
    let neighbour = key("faults.bad", &run, 0);
    let first = idem
        .process(&neighbour, 0u64, |_| async {
            Ok::<_, std::convert::Infallible>(11u64)
        })
        .await;
    assert!(matches!(first, Ok(Processed::Executed(11))), "{first:?}");

    let longest = IdempotencyKey::new("s".repeat(64), format!("{run}{}", "é".repeat(248)))
        .unwrap_or_else(|e| panic!("{e}"));
    for expected in ["executed", "replayed"] {
        let out = idem
            .process(&longest, 1u64, |_| async {
                Ok::<_, std::convert::Infallible>(12u64)
            })
            .await;
        match (expected, out) {
            ("executed", Ok(Processed::Executed(12)))
            | ("replayed", Ok(Processed::Replayed(12))) => {}
            (_, other) => panic!("longest key, {expected}: {other:?}"),
        }
    }

    let big = key("faults.bad", &run, 1);
    let payload = "p".repeat(4 << 20);
    let response = "r".repeat(4 << 20);
    let out = idem
        .process(&big, &payload, |_| {
            let response = response.clone();
            async move { Ok::<_, std::convert::Infallible>(response) }
        })
        .await;
    assert!(
        matches!(&out, Ok(Processed::Executed(r)) if r.len() == 4 << 20),
        "4 MB executed"
    );
    let out = idem
        .process(&big, &payload, |_| async {
            never::<String>("a completed key never runs again")
        })
        .await;
    assert!(
        matches!(&out, Ok(Processed::Replayed(r)) if *r == response),
        "4 MB replayed"
    );

    let unserializable = key("faults.bad", &run, 2);
    let out = idem
        .process(&unserializable, 2u64, |_| async {
            Ok::<_, std::convert::Infallible>(Unserializable)
        })
        .await;
    match out {
        Ok(Processed::ExecutedNotReplayable { reason, .. }) => {
            assert!(reason.contains("refuses to serialize"), "{reason}")
        }
        other => panic!("an unserializable response: {:?}", other.err()),
    }
    let retry = idem
        .process(&unserializable, 2u64, |_| async {
            never::<u64>("a key whose result was not recordable never runs again")
        })
        .await;
    assert!(
        matches!(&retry, Err(e @ IdemError::ResultUnavailable { .. }) if !e.is_retryable()),
        "{retry:?}"
    );

    let again = idem
        .process(&neighbour, 0u64, |_| async {
            never::<u64>("the neighbour is completed")
        })
        .await;
    assert!(matches!(again, Ok(Processed::Replayed(11))), "{again:?}");
    report(
        "bad-input",
        backend,
        &[
            (
                "cases",
                "longest-key,4MB-payload,4MB-response,unserializable-response".into(),
            ),
            ("panics", "0".into()),
            ("other_keys_affected", "0".into()),
        ],
        started,
    );
}

mod bad_input {
    use super::*;
    on_backends!(bad_input_scenario; memory => Backend::Memory, postgres => Backend::Postgres,
        redis => Backend::Redis, redis_cluster => Backend::RedisCluster, tiered => Backend::Tiered);

    /// A response over PgStore's limit is refused before anything is sent;
    /// the handler ran, so the key completes as not replayable (never
    /// released): the caller gets its value, duplicates `ResultUnavailable`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_response_over_the_limit() {
        let store = PgStore::builder(support::pg::pool(support::pg::shared_url(), 4).await)
            .max_response_bytes(1 << 20)
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        let idem = Idempotency::new(store);
        let k = key("faults.bad", &run_id(), 0);
        let out = idem
            .process(&k, 0u64, |_| async {
                Ok::<_, std::convert::Infallible>("r".repeat(2 << 20))
            })
            .await;
        match out {
            Ok(Processed::ExecutedNotReplayable { value, reason }) => {
                assert_eq!(value.len(), 2 << 20, "the caller gets its value");
                assert!(reason.contains("limit"), "{reason}");
            }
            other => panic!("a 2 MB response over a 1 MB limit: {:?}", other.err()),
        }
        let retry = idem
            .process(&k, 0u64, |_| async {
                never::<String>("a completed key never runs again")
            })
            .await;
        assert!(
            matches!(retry, Err(IdemError::ResultUnavailable { .. })),
            "{retry:?}"
        );
    }

    /// Records damaged directly in the server give `Corrupt` for their key
    /// only; the next key is answered as before.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn corrupt_records_affect_only_their_key() {
        let pg = pg_store().await;
        let redis = RedisStore::connect(support::redis_server::shared_url())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let run = run_id();
        let (damaged, intact) = (
            key("faults.corrupt", &run, 0),
            key("faults.corrupt", &run, 1),
        );
        let stores: [(&str, Arc<dyn IdempotencyStore>); 2] = [
            ("postgres", Arc::new(pg.clone())),
            ("redis", Arc::new(redis.clone())),
        ];
        for (name, store) in stores {
            let idem = Idempotency::from_arc(store);
            for k in [&damaged, &intact] {
                let out = idem
                    .process(k, 0u64, |_| async {
                        Ok::<_, std::convert::Infallible>(14u64)
                    })
                    .await;
                assert!(
                    matches!(out, Ok(Processed::Executed(14))),
                    "{name}: {out:?}"
                );
            }
            if name == "postgres" {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "UPDATE {} SET status = 9 WHERE scope = $1 AND key = $2",
                    pg.qualified_table()
                )))
                .bind(damaged.scope())
                .bind(damaged.id())
                .execute(pg.pool())
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            } else {
                let mut conn =
                    idem::redis::redis::Client::open(support::redis_server::shared_url())
                        .and_then(|c| c.get_connection())
                        .unwrap_or_else(|e| panic!("{e}"));
                let _: () = idem::redis::redis::cmd("SET")
                    .arg(redis.redis_key(&damaged))
                    .arg("garbage")
                    .query(&mut conn)
                    .unwrap_or_else(|e| panic!("{e}"));
            }
            let out = idem
                .process(&damaged, 0u64, |_| async {
                    never::<u64>("a corrupt record is not absent")
                })
                .await;
            match out {
                Err(e @ IdemError::Store(StoreError::Corrupt { .. })) => {
                    assert!(!e.is_retryable(), "{name}: {e}");
                    assert!(
                        e.to_string().contains(damaged.id()),
                        "{name}: names the key: {e}"
                    );
                }
                other => panic!("{name}: a damaged record: {other:?}"),
            }
            let out = idem
                .process(&intact, 0u64, |_| async { never::<u64>("completed") })
                .await;
            assert!(
                matches!(out, Ok(Processed::Replayed(14))),
                "{name}: {out:?}"
            );
        }
    }
}

/// The in-transaction mode has no lease to run out: a stalled transaction
/// keeps the key, a duplicate waits on it (it does not take over), and
/// replays the stalled one's result once it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zombie_worker_postgres_tx_stalled_transaction_is_waited_for() {
    let started = Instant::now();
    let store = pg_store().await;
    let Receiver::Tx { ledger, .. } = Receiver::tx(store.clone()).await else {
        unreachable!()
    };
    let key = key("faults.zombie", &run_id(), 0);
    let mut tx = store.pool().begin().await.unwrap_or_else(|e| panic!("{e}"));
    let Ok(Claim::Acquired(lease)) = store
        .in_transaction()
        .claim::<_, u64>(&mut tx, &key, &0u64)
        .await
    else {
        panic!("not acquired")
    };
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {ledger} VALUES (0, 1)"
    )))
    .execute(&mut *tx)
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    let receiver = Receiver::Tx {
        store: store.clone(),
        ledger: ledger.clone(),
    };
    let duplicate = {
        let (receiver, key) = (receiver.clone(), key.clone());
        tokio::spawn(async move { receiver.deliver(&key, 0, &Ledger::new(1)).await })
    };
    // The duplicate is blocked on the stalled transaction's row: PostgreSQL
    // shows a session waiting on this transaction's backend.
    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let waiting = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        )
        .bind(holder)
        .fetch_one(store.pool())
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while waiting().await == 0 {
        assert!(
            Instant::now() < deadline,
            "the duplicate never waited on the lock"
        );
        tokio::task::yield_now().await;
    }
    assert!(
        !duplicate.is_finished(),
        "the duplicate waits; it does not take over"
    );
    lease
        .complete(&mut tx, &21u64)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    let out = duplicate.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(out, Delivery::Replayed(21)), "{out:?}");
    let effects = receiver.effects(&Ledger::new(1), 1).await;
    assert_eq!(effects, vec![1]);
    report(
        "zombie-worker",
        Backend::PostgresTx,
        &[
            ("messages", "1".into()),
            ("deliveries", "2".into()),
            ("zombie_completion", "committed-duplicate-waited".into()),
            ("replayed", "stalled-transaction".into()),
            ("effects", effects[0].to_string()),
        ],
        started,
    );
}

// ------------------------------------------------- callers that go away

/// Waits (bounded) until the record of `key` is completed.
async fn until_completed(store: &Arc<dyn IdempotencyStore>, key: &IdempotencyKey) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(record)) = store.get(key).await {
            if record.is_completed() {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{key} never completed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A caller that goes away mid-handler (a task aborted, an HTTP client that
/// disconnects). Attached: the key is not released (the handler was cut off
/// after an unknown part of its effects); after the lease the next delivery
/// takes it over as attempt 2 with a higher fence. Detached: the handler
/// runs on, its result is recorded, the retry gets "in progress" and then
/// the replay; one effect.
async fn cancelled_caller_scenario(backend: Backend) {
    use std::convert::Infallible;
    let started = Instant::now();
    let lease = Duration::from_millis(400);
    let store = backend.store().await;
    let idem = Idempotency::from_arc(store.clone()).lease(lease);
    let run = run_id();

    let k = key("faults.cancel", &run, 0);
    let (fence_tx, fence_rx) = tokio::sync::oneshot::channel();
    let caller = {
        let (idem, k) = (idem.clone(), k.clone());
        tokio::spawn(async move {
            idem.process_with(&k, None, |cx| async move {
                let _ = fence_tx.send(cx.fence);
                std::future::pending::<Result<u64, Infallible>>().await
            })
            .await
        })
    };
    let first_fence = fence_rx.await.unwrap_or_else(|e| panic!("{e}"));
    caller.abort();
    let _ = caller.await;
    let held = store.acquire(&k, None, lease).await;
    assert!(
        matches!(held, Ok(Acquisition::InProgress { attempt: 1, .. })),
        "a dropped caller released the key: {held:?}"
    );
    tokio::time::sleep(lease + Duration::from_millis(100)).await; // the lease runs out
    let again = idem
        .process_with(&k, None, |cx| async move {
            Ok::<_, Infallible>((cx.attempt, cx.fence))
        })
        .await;
    let (attempt, fence) = match again {
        Ok(Processed::Executed(seen)) => seen,
        other => panic!("after the lease: {other:?}"),
    };
    assert_eq!(attempt, 2);
    assert!(fence > first_fence, "fence {fence} after {first_fence}");

    let k = key("faults.cancel", &run, 1);
    let effects = Arc::new(AtomicU32::new(0));
    let gate = Arc::new(tokio::sync::Notify::new());
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let caller = {
        let (idem, k, effects, gate) = (idem.clone(), k.clone(), effects.clone(), gate.clone());
        tokio::spawn(async move {
            idem.process_with_detached(&k, None, move |_| async move {
                let _ = started_tx.send(());
                gate.notified().await;
                effects.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Infallible>(7u64)
            })
            .await
        })
    };
    started_rx.await.unwrap_or_else(|e| panic!("{e}"));
    caller.abort(); // the client goes away
    let _ = caller.await;
    let retry = idem
        .process_with(&k, None, |_| async { never::<u64>("it still runs") })
        .await;
    assert!(
        matches!(retry, Err(IdemError::InProgress { .. })),
        "{retry:?}"
    );
    gate.notify_one();
    until_completed(&store, &k).await;
    let replay = idem
        .process_with(&k, None, |_| async { never::<u64>("it was recorded") })
        .await;
    assert!(matches!(replay, Ok(Processed::Replayed(7))), "{replay:?}");
    assert_eq!(effects.load(Ordering::SeqCst), 1);
    report(
        "cancelled-caller",
        backend,
        &[
            ("attached_released", "no".into()),
            ("takeover_attempt", attempt.to_string()),
            ("fence_increased", "yes".into()),
            (
                "detached_effects",
                effects.load(Ordering::SeqCst).to_string(),
            ),
            ("detached_retry", "in-progress-then-replayed".into()),
        ],
        started,
    );
}

mod cancelled_caller {
    use super::*;
    on_backends!(cancelled_caller_scenario; memory => Backend::Memory, postgres => Backend::Postgres,
        redis => Backend::Redis, redis_cluster => Backend::RedisCluster, tiered => Backend::Tiered);
}

/// A handler that blocks its thread for four leases (a synchronous client,
/// a long computation) on a 2-worker runtime: the heartbeat, on its own
/// task, keeps the lease; duplicates every 50 ms are all "in progress", none
/// takes the key over.
async fn blocking_handler_scenario(backend: Backend) {
    let started = Instant::now();
    let lease = Duration::from_millis(300);
    let store = backend.store().await;
    let idem = Idempotency::from_arc(store.clone()).lease(lease);
    let k = key("faults.blocking", &run_id(), 0);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let worker = {
        let (idem, k) = (idem.clone(), k.clone());
        tokio::spawn(async move {
            idem.process_with(&k, None, |_| async move {
                let _ = started_tx.send(());
                std::thread::sleep(lease * 4);
                Ok::<_, std::convert::Infallible>(1u64)
            })
            .await
        })
    };
    started_rx.await.unwrap_or_else(|e| panic!("{e}"));
    let (mut duplicates, mut takeovers) = (0, 0);
    while !worker.is_finished() {
        tokio::time::sleep(Duration::from_millis(50)).await;
        match store.acquire(&k, None, lease).await {
            Ok(Acquisition::InProgress { .. }) => duplicates += 1,
            Ok(Acquisition::Acquired(stolen)) => {
                takeovers += 1;
                let _ = store.release(&stolen).await;
            }
            Ok(Acquisition::Completed(_)) => break,
            other => panic!("{other:?}"),
        }
    }
    let out = worker.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(takeovers, 0, "a blocked handler's lease ran out");
    assert!(matches!(out, Ok(Processed::Executed(1))), "{out:?}");
    report(
        "blocking-handler",
        backend,
        &[
            ("blocked_ms", (lease * 4).as_millis().to_string()),
            ("duplicates", duplicates.to_string()),
            ("takeovers", takeovers.to_string()),
        ],
        started,
    );
}

mod blocking_handler {
    use super::*;
    on_backends!(blocking_handler_scenario; memory => Backend::Memory, postgres => Backend::Postgres,
        redis => Backend::Redis, redis_cluster => Backend::RedisCluster, tiered => Backend::Tiered);
}

// ------------------------------------------------------------ lost replies

/// Issue 13 item 4 on Redis Cluster: every 5th script call loses its reply
/// (the proxy in front of the node drops it and cuts the connection, after
/// the node ran the script), so the cluster client reconnects and resends
/// it. Every message is delivered twice: the first delivery executes (a
/// resent `acquire` answers "acquired", a resent `complete` answers done),
/// the second replays. 0 answered "in progress", 0 failed, 0 doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_reply_on_redis_cluster() {
    let started = Instant::now();
    let (servers, proxies) = support::redis_server::start_cluster_behind_proxies().await;
    let store = RedisStore::connect_cluster(
        proxies
            .iter()
            .map(|p| format!("redis://{}/", p.addr))
            .collect::<Vec<_>>(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let idem = Idempotency::new(store)
        .lease(Duration::from_secs(30))
        .on_in_progress(InProgressPolicy::Reject);
    let run = run_id();
    let messages = 200u64;
    // Load the scripts on every node first (a first EVALSHA answers
    // NOSCRIPT): only replies of scripts that ran are lost.
    for m in 0..32 {
        let k = key("faults.lost-reply-warm", &run, m);
        let _ = idem
            .process_with(&k, None, |_| async { Ok::<_, std::io::Error>(0u64) })
            .await;
    }
    let evalsha_before: u64 = servers
        .iter()
        .map(|s| support::redis_server::command_calls(s, "evalsha"))
        .sum();
    for proxy in &proxies {
        proxy.lose_replies_to(b"EVALSHA", 5, u64::MAX);
    }
    let ledger = Ledger::new(messages);
    let (mut executed, mut replayed, mut in_progress, mut failed) = (0u64, 0u64, 0u64, 0u64);
    for round in 0..2 {
        for m in 0..messages {
            let ledger = ledger.clone();
            let out = idem
                .process_with(&key("faults.lost-reply", &run, m), None, |_| async move {
                    ledger.effect(m);
                    Ok::<_, std::io::Error>(m)
                })
                .await;
            match out {
                Ok(Processed::Executed(v)) if round == 0 && v == m => executed += 1,
                Ok(Processed::Replayed(v)) if round == 1 && v == m => replayed += 1,
                Err(IdemError::InProgress { .. }) => in_progress += 1,
                other => {
                    println!("round {round}, message {m}: {other:?}");
                    failed += 1
                }
            }
        }
    }
    let lost: u64 = proxies.iter().map(|p| p.lost()).sum();
    let evalsha_runs: u64 = servers
        .iter()
        .map(|s| support::redis_server::command_calls(s, "evalsha"))
        .sum::<u64>()
        - evalsha_before;
    let doubled = (0..messages).filter(|m| ledger.count(*m) > 1).count();
    report(
        "lost-reply",
        Backend::RedisCluster,
        &[
            ("messages", messages.to_string()),
            ("deliveries", (2 * messages).to_string()),
            ("lost_replies", lost.to_string()),
            ("script_runs", evalsha_runs.to_string()),
            ("executed", executed.to_string()),
            ("replayed", replayed.to_string()),
            ("in_progress", in_progress.to_string()),
            ("failed", failed.to_string()),
            ("double_effects", doubled.to_string()),
        ],
        started,
    );
    assert!(lost >= 2 * messages / 5, "only {lost} replies were lost");
    assert_eq!(in_progress, 0, "a resent acquire answered in progress");
    assert_eq!(failed, 0, "deliveries failed");
    assert_eq!((executed, replayed), (messages, messages));
    assert_eq!(doubled, 0);
}

// ------------------------------------------------------------ poison entry

/// Issue 13 item 10 (b): a stream of 300 payment entries (100 of them sent
/// twice) holds one poison entry whose handler always fails. The consumer
/// (`max_deliveries(3)`, `claim_idle` 200 ms) runs it 3 times, moves it to
/// the dead-letter stream with its delivery count and the reason, and
/// acknowledges everything: 0 pending, every payment charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_entry_on_the_streams_consumer() {
    use idem::redis::redis;
    use idem::redis::streams::{StreamConsumer, StreamEntry};
    let started = Instant::now();
    let url = support::redis_server::shared_url();
    let stream = format!("faults-poison-{}", run_id());
    let mut conn = redis::Client::open(url)
        .unwrap_or_else(|e| panic!("{e}"))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let messages = 200u64;
    let poison = 77u64;
    let mut entries = 0u64;
    for m in (0..messages).chain((0..messages).step_by(2)) {
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg("message_id")
            .arg(m)
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        entries += 1;
    }
    let store = RedisStore::connect(url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let consumer = StreamConsumer::connect(url, &stream, "g", "c", Idempotency::new(store))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .key_field("message_id")
        .block(Duration::from_millis(50))
        .claim_idle(Duration::from_millis(200))
        .max_deliveries(3);
    let ledger = Ledger::new(messages);
    let handler = {
        let ledger = ledger.clone();
        move |entry: StreamEntry| {
            let ledger = ledger.clone();
            async move {
                let m: u64 = entry
                    .text("message_id")
                    .and_then(|m| m.parse().ok())
                    .unwrap_or(u64::MAX);
                ledger.effect(m);
                if m == poison {
                    Err(std::io::Error::other("poison"))
                } else {
                    Ok(m)
                }
            }
        }
    };
    let pending = |conn: redis::aio::MultiplexedConnection, stream: String| async move {
        let mut conn = conn;
        let summary: (i64, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
            .arg(&stream)
            .arg("g")
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        summary.0
    };
    let dead_letter = format!("{stream}:dead");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let watcher = {
        let (conn, stream, dead_letter) = (conn.clone(), stream.clone(), dead_letter.clone());
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let mut c = conn.clone();
                let dead: i64 = redis::cmd("XLEN")
                    .arg(&dead_letter)
                    .query_async(&mut c)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                if dead >= 1 && pending(conn.clone(), stream.clone()).await == 0 {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the poison entry was not dead-lettered within 60 s"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = stop_tx.send(());
        })
    };
    let stats = consumer
        .run(handler, async {
            let _ = stop_rx.await;
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    watcher.await.unwrap_or_else(|e| panic!("{e}"));
    let left = pending(conn.clone(), stream.clone()).await;
    let dead: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&dead_letter)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let field = |name: &str| {
        dead.first()
            .and_then(|(_, f)| f.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
            .unwrap_or_default()
    };
    let doubled = (0..messages)
        .filter(|m| *m != poison && ledger.count(*m) != 1)
        .count();
    report(
        "poison-entry",
        Backend::Redis,
        &[
            ("entries", entries.to_string()),
            ("messages", messages.to_string()),
            ("max_deliveries", "3".into()),
            ("poison_runs", ledger.count(poison).to_string()),
            ("dead_lettered", stats.dead_lettered.to_string()),
            ("dead_letter_deliveries", field("idem.deliveries")),
            ("pending", left.to_string()),
            ("acked", stats.acked.to_string()),
            ("double_effects", doubled.to_string()),
        ],
        started,
    );
    assert_eq!(ledger.count(poison), 3, "the poison ran once per delivery");
    assert_eq!((dead.len(), stats.dead_lettered), (1, 1));
    assert_eq!(field("idem.deliveries"), "3");
    assert_eq!(field("message_id"), poison.to_string());
    assert!(field("idem.reason").contains("poison"));
    assert_eq!(left, 0, "entries left pending");
    assert_eq!(stats.acked, entries, "every entry acknowledged");
    assert_eq!(doubled, 0, "payments charged other than once");
}
