//! PostgreSQL failover (issue 18, items 2 and 3): a primary and a standby
//! made by `pg_basebackup`, the redelivery storm of tests/faults.rs, and
//! mid-storm the primary is killed with SIGKILL and the standby promoted
//! (`pg_ctl promote`). The store reaches the new primary through
//! `idem_postgres::Failover` (several URLs, the writable one used).
//!
//! Runs: PgStore on synchronous and on asynchronous replication, the
//! in-transaction mode and the tiered store (moka + Redis over the failing
//! over PgStore) on synchronous replication. Each prints one
//! `reliability scenario=postgres-failover ...` line:
//! - `double_effects`: messages whose effect ran more than once;
//! - `lost_completions`: messages told "executed" or "replayed" whose
//!   record, read on the new primary at the end (the PgStore itself, never
//!   through a cache), is missing, not completed or carries another result
//!   than the one first told;
//! - `lease_lost`: handlers that ran and then found their key taken over
//!   (their reservation was lost with the primary), `unavailable`: calls
//!   that failed `Unavailable` (redelivered);
//! - times after the kill: `last_unavailable_ms` (the last `Unavailable`),
//!   `unavailable_window_ms` (first to last `Unavailable`), `promoted_ms`
//!   (`pg_ctl promote -w` and a check returned: the test promotes as soon
//!   as a delivery saw the primary gone), `first_execution_ms` (the first
//!   delivery begun after the kill that ran its handler and recorded it).
//!
//! Synchronous replication asserts 0 double effects, 0 lost completions, 0
//! leases lost, every message completed at the end; asynchronous asserts
//! only what it guarantees (every effect ran at least once; a message not
//! completed at the end is one whose completion was lost) and prints what
//! it lost.
//!
//! `cargo test --all-features --test failover_pg -- --nocapture`

use crate::support;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::postgres::{Claim, Failover, PgStore};
use idem::tiered::{MokaCache, RedisCache, TieredStore};
use idem::{
    IdemError, Idempotency, IdempotencyKey, IdempotencyStore, InProgressPolicy, Processed, Record,
    RecordState, StoreError,
};
use support::pg_replica::{PgReplicaPair, Replication};

/// Messages per run (each delivered 1 to 8 times).
const MESSAGES: u64 = 10_000;
/// Concurrent workers per run.
const WORKERS: usize = 64;
const SCOPE: &str = "failover.pg";

/// One run at a time: each starts two servers, and the figures (the
/// unavailable window above all) mean more without three other storms on
/// the same two cores.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Postgres,
    PostgresTx,
    Tiered,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Postgres => "postgres",
            Kind::PostgresTx => "postgres-tx",
            Kind::Tiered => "tiered",
        }
    }
}

fn run_id() -> String {
    format!("{:016x}", fastrand::u64(..))
}

fn key(run: &str, msg: u64) -> IdempotencyKey {
    IdempotencyKey::new(SCOPE, format!("{run}-{msg}")).unwrap_or_else(|e| panic!("{e}"))
}

// ------------------------------------------------------------ receivers

#[derive(Debug)]
enum Delivery {
    Executed(u64),
    Replayed(u64),
    InProgress,
    Unavailable(String),
    /// The handler ran, but another worker had taken the key over: its
    /// result was not recorded (the other worker's was).
    LeaseLost,
    Failed(String),
}

static EXECUTION: AtomicU64 = AtomicU64::new(1);

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

#[derive(Clone)]
enum Receiver {
    Store(Idempotency<dyn IdempotencyStore>),
    /// The in-transaction mode: the effect is a row of `ledger`, written in
    /// the same transaction as the reservation and the completion.
    Tx {
        store: PgStore,
        ledger: String,
    },
}

/// Writes an unrecorded completion with its own lease, retrying while the
/// store is away (30 s at most), as a consumer does.
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
            Err(StoreError::LeaseLost) => return Delivery::LeaseLost,
            Err(e) => return Delivery::Failed(format!("unrecorded, then: {e}")),
        }
    }
}

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
                    Err(IdemError::Unrecorded(u)) => finish(idem, &u).await,
                    Err(IdemError::LeaseLost) => Delivery::LeaseLost,
                    Err(e) => Delivery::Failed(e.to_string()),
                }
            }
            Receiver::Tx { store, ledger } => match tx_deliver(store, ledger, key, msg).await {
                Ok(d) => d,
                Err(e) => e,
            },
        }
    }

    /// Effects per message: the in-process ledger, or the ledger table as
    /// the new primary has it.
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
}

#[derive(Debug, thiserror::Error)]
enum TxError {
    #[error(transparent)]
    Sqlx(#[from] sqlx::Error),
    #[error(transparent)]
    Idem(#[from] IdemError<std::convert::Infallible>),
}

/// Connection-level sqlx errors, a read-only server (25006, the standby
/// before its promotion) and `StoreError::Unavailable` mean the primary
/// could not be reached.
fn tx_failure(e: impl Into<TxError>) -> Delivery {
    match e.into() {
        TxError::Sqlx(
            e @ (sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::Protocol(_)),
        ) => Delivery::Unavailable(e.to_string()),
        TxError::Sqlx(sqlx::Error::Database(e))
            if e.code()
                .is_some_and(|c| c.starts_with("57") || c.starts_with("08") || c == "25006") =>
        {
            Delivery::Unavailable(e.to_string())
        }
        TxError::Idem(IdemError::Store(e @ StoreError::Unavailable(_))) => {
            Delivery::Unavailable(e.to_string())
        }
        other => Delivery::Failed(other.to_string()),
    }
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

// ------------------------------------------------------------ the storm

/// How far a storm got, and when calls failed.
#[derive(Default)]
struct Progress {
    executed: AtomicU64,
    unavailable: AtomicU64,
    changed: tokio::sync::Notify,
    /// First and last `Unavailable` seen.
    window: Mutex<Option<(Instant, Instant)>>,
    /// When the primary was killed, and when the standby was promoted.
    killed: std::sync::OnceLock<Instant>,
    promoted: std::sync::OnceLock<Instant>,
    /// When the first delivery begun after the kill was told "executed".
    first_execution_after_kill: Mutex<Option<Instant>>,
}

impl Progress {
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
    fn executed(&self, begun: Instant) {
        if self.killed.get().is_some_and(|&k| begun > k) {
            let now = Instant::now();
            let mut first = self
                .first_execution_after_kill
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            *first = Some(first.map_or(now, |f| f.min(now)));
        }
        self.bump(&self.executed);
    }

    fn unavailable_at(&self, at: Instant) {
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        *w = Some(match *w {
            None => (at, at),
            Some((first, last)) => (first.min(at), last.max(at)),
        });
        drop(w);
        self.bump(&self.unavailable);
    }
}

/// What a storm saw.
#[derive(Debug, Default)]
struct Storm {
    deliveries: u64,
    unavailable: u64,
    failures: u64,
    lease_lost: u64,
    double_effects: usize,
    never_executed: usize,
    /// Told "completed"/"replayed", and at the end the record on the new
    /// primary is missing, not completed, or carries another result.
    lost_completions: usize,
    /// Replays whose value is not the one the message's execution returned.
    replay_mismatches: usize,
    /// Messages not completed at the end (whatever they were told).
    not_completed: usize,
    window_ms: u128,
    last_unavailable_ms: u128,
    promoted_ms: u128,
    first_execution_ms: u128,
    first_failure: Option<String>,
}

/// The storm of tests/faults.rs: each message delivered 1 to 8 times in
/// random order by `WORKERS` workers, a delivery told "in progress" or
/// failed going back to the end of the queue (a broker's redelivery). Once
/// a third of the messages ran, the primary is killed and the standby
/// promoted.
async fn storm(
    pair: Arc<PgReplicaPair>,
    receiver: Receiver,
    source: PgStore,
    messages: u64,
) -> Storm {
    let progress = Arc::new(Progress::default());
    let fault = {
        let progress = progress.clone();
        tokio::spawn(async move {
            progress
                .until(|p| p.executed.load(Ordering::SeqCst) >= messages / 3)
                .await;
            let seen = progress.unavailable.load(Ordering::SeqCst);
            let p = pair.clone();
            let _ = progress.killed.set(Instant::now());
            tokio::task::spawn_blocking(move || p.kill_primary())
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            // A failover manager promotes once it saw the primary gone:
            // here, once a delivery saw it (`Unavailable`), 10 s at most.
            let _ = tokio::time::timeout(
                Duration::from_secs(10),
                progress.until(|p| p.unavailable.load(Ordering::SeqCst) > seen),
            )
            .await;
            let p = pair.clone();
            tokio::task::spawn_blocking(move || p.promote_standby())
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let _ = progress.promoted.set(Instant::now());
        })
    };
    let run = run_id();
    let mut deliveries: Vec<u64> = (0..messages)
        .flat_map(|m| std::iter::repeat_n(m, fastrand::usize(1..=8)))
        .collect();
    fastrand::shuffle(&mut deliveries);
    let queue = Arc::new(Mutex::new(VecDeque::from(deliveries)));
    let ledger = Ledger::new(messages);
    // The value each message was first told (executed or replayed), and
    // the value its executions returned.
    let told: Arc<Vec<AtomicU64>> = Arc::new((0..messages).map(|_| AtomicU64::new(0)).collect());
    let executed: Arc<Vec<AtomicU64>> =
        Arc::new((0..messages).map(|_| AtomicU64::new(0)).collect());
    let replays = Arc::new(Mutex::new(Vec::new()));
    let counters = Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
    let first_failure = Arc::new(Mutex::new(None::<String>));
    let tasks: Vec<_> = (0..WORKERS)
        .map(|_| {
            let progress = progress.clone();
            let (receiver, queue, ledger, told, executed, replays, counters, run, first_failure) = (
                receiver.clone(),
                queue.clone(),
                ledger.clone(),
                told.clone(),
                executed.clone(),
                replays.clone(),
                counters.clone(),
                run.clone(),
                first_failure.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let next = queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                    let Some(msg) = next else { break };
                    counters[0].fetch_add(1, Ordering::Relaxed);
                    let begun = Instant::now();
                    match receiver.deliver(&key(&run, msg), msg, &ledger).await {
                        Delivery::Executed(v) => {
                            let _ = told[msg as usize].compare_exchange(
                                0,
                                v,
                                Ordering::SeqCst,
                                Ordering::SeqCst,
                            );
                            executed[msg as usize].store(v, Ordering::SeqCst);
                            progress.executed(begun);
                        }
                        Delivery::Replayed(v) => {
                            let _ = told[msg as usize].compare_exchange(
                                0,
                                v,
                                Ordering::SeqCst,
                                Ordering::SeqCst,
                            );
                            replays
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .push((msg, v));
                        }
                        other => {
                            match &other {
                                Delivery::Unavailable(e) => {
                                    if progress.unavailable.load(Ordering::SeqCst) == 0 {
                                        eprintln!("first Unavailable (redelivered): {e}");
                                    }
                                    progress.unavailable_at(Instant::now());
                                }
                                Delivery::Failed(e) => {
                                    counters[1].fetch_add(1, Ordering::Relaxed);
                                    let mut first =
                                        first_failure.lock().unwrap_or_else(|p| p.into_inner());
                                    if first.is_none() {
                                        eprintln!("first failed delivery (redelivered): {e}");
                                        *first = Some(e.clone());
                                    }
                                }
                                Delivery::LeaseLost => {
                                    counters[2].fetch_add(1, Ordering::Relaxed);
                                }
                                _ => {}
                            }
                            // Redelivered later, after a broker's short
                            // redelivery delay.
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
    fault
        .await
        .unwrap_or_else(|e| panic!("the failover task failed: {e}"));

    let effects = receiver.effects(&ledger, messages).await;
    let mut s = Storm {
        deliveries: counters[0].load(Ordering::SeqCst),
        unavailable: progress.unavailable.load(Ordering::SeqCst),
        failures: counters[1].load(Ordering::SeqCst),
        lease_lost: counters[2].load(Ordering::SeqCst),
        double_effects: effects.iter().filter(|&&n| n > 1).count(),
        never_executed: effects.iter().filter(|&&n| n == 0).count(),
        first_failure: first_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone(),
        ..Storm::default()
    };
    for (msg, v) in replays.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        // (A message whose only execution's reply was lost, its commit made
        // anyway, is only ever replayed: nothing to compare with.)
        let ran = executed[*msg as usize].load(Ordering::SeqCst);
        if ran != 0 && *v != ran {
            s.replay_mismatches += 1;
        }
    }
    // Every key read on the new primary (the source of truth itself, not
    // through a cache).
    for msg in 0..messages {
        let record = source.get(&key(&run, msg)).await;
        let recorded = match &record {
            Ok(Some(Record {
                state: RecordState::Completed { response, .. },
                ..
            })) => serde_json::from_slice::<u64>(response).ok(),
            Ok(_) => None,
            Err(e) => panic!("get on the new primary failed: {e}"),
        };
        if recorded.is_none() {
            s.not_completed += 1;
        }
        let first_told = told[msg as usize].load(Ordering::SeqCst);
        if first_told != 0 && recorded != Some(first_told) {
            s.lost_completions += 1;
        }
    }
    let killed = *progress
        .killed
        .get()
        .unwrap_or_else(|| panic!("never killed"));
    let since_kill = |t: Instant| t.saturating_duration_since(killed).as_millis();
    let window = *progress.window.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((first, last)) = window {
        s.window_ms = (last - first).as_millis();
        s.last_unavailable_ms = since_kill(last);
    }
    s.promoted_ms = progress.promoted.get().map_or(0, |&t| since_kill(t));
    s.first_execution_ms = progress
        .first_execution_after_kill
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .map_or(0, since_kill);
    s
}

// ------------------------------------------------------------ the runs

async fn failover_run(kind: Kind, replication: Replication) {
    let _one = ONE_AT_A_TIME.lock().await;
    let started = Instant::now();
    let pair = Arc::new(tokio::task::block_in_place(|| {
        PgReplicaPair::start(replication)
    }));
    let failover = Failover::new([&pair.primary_url, &pair.standby_url])
        .unwrap_or_else(|e| panic!("{e}"))
        .probe_timeout(Duration::from_secs(1))
        .check_interval(Duration::from_millis(200));
    let pool = failover
        .connect_with(
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(32)
                .test_before_acquire(false)
                .acquire_timeout(Duration::from_secs(2)),
        )
        .await
        .unwrap_or_else(|e| panic!("cannot connect to the primary: {e}"));
    let source = PgStore::builder(pool)
        .failover(failover.clone())
        .connections(32)
        .call_timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    source.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        failover.current(),
        format!("127.0.0.1:{}", pair.primary_port)
    );

    // Executor receivers as in the fault storms of tests/faults.rs: a
    // lease long enough for a completion retried across the failover, and
    // a completion retry budget longer than it.
    let executor = |store: Arc<dyn IdempotencyStore>| {
        Receiver::Store(
            Idempotency::from_arc(store)
                .lease(Duration::from_secs(5))
                .complete_retry(Duration::from_secs(20))
                .on_in_progress(InProgressPolicy::Reject),
        )
    };
    let receiver = match kind {
        Kind::Postgres => executor(Arc::new(source.clone())),
        Kind::PostgresTx => Receiver::tx(source.clone()).await,
        Kind::Tiered => executor(Arc::new(
            TieredStore::new(source.clone())
                .with_cache(MokaCache::new(100_000, 64 << 20))
                .with_cache(
                    RedisCache::connect(support::redis_server::shared_url())
                        .await
                        .unwrap_or_else(|e| panic!("{e}")),
                ),
        )),
    };

    let s = tokio::time::timeout(
        Duration::from_secs(150),
        storm(pair.clone(), receiver, source.clone(), MESSAGES),
    )
    .await
    .unwrap_or_else(|_| panic!("the storm did not end within 150 s"));

    let mode = match replication {
        Replication::Sync => "sync",
        Replication::Async => "async",
    };
    println!(
        "reliability scenario=postgres-failover backend={} replication={mode} messages={MESSAGES} \
         deliveries={} unavailable={} lease_lost={} failed={} double_effects={} lost_completions={} \
         replay_mismatches={} not_completed={} unavailable_window_ms={} last_unavailable_ms={} \
         promoted_ms={} first_execution_ms={} switches={} duration_ms={}",
        kind.name(),
        s.deliveries,
        s.unavailable,
        s.lease_lost,
        s.failures,
        s.double_effects,
        s.lost_completions,
        s.replay_mismatches,
        s.not_completed,
        s.window_ms,
        s.last_unavailable_ms,
        s.promoted_ms,
        s.first_execution_ms,
        failover.switches(),
        started.elapsed().as_millis()
    );

    // What holds whatever the replication: the store found the promoted
    // standby and every message's effect ran.
    assert_eq!(
        failover.current(),
        format!("127.0.0.1:{}", pair.standby_port),
        "the store uses the promoted standby"
    );
    assert_eq!(failover.switches(), 1, "one switch, to the standby");
    assert!(s.unavailable > 0, "the storm crossed the failover");
    assert_eq!(s.never_executed, 0, "every message's effect ran");
    // Under asynchronous replication a completion may be lost with the
    // old primary; if that was the message's last delivery, its record is
    // gone for good: a lost completion, counted as such.
    assert!(
        s.not_completed <= s.lost_completions,
        "a message not completed at the end ({}) whose completion was not lost ({})",
        s.not_completed,
        s.lost_completions
    );
    assert_eq!(
        s.failures, 0,
        "every failed call was Unavailable, or LeaseLost (first other failure: {:?})",
        s.first_failure
    );
    if replication == Replication::Sync {
        assert_eq!(s.not_completed, 0, "every message is completed at the end");
        assert_eq!(
            s.lease_lost, 0,
            "no lease lost with synchronous replication"
        );
        assert_eq!(
            s.double_effects, 0,
            "no double effect with synchronous replication"
        );
        assert_eq!(
            s.lost_completions, 0,
            "no completion lost with synchronous replication"
        );
        assert_eq!(
            s.replay_mismatches, 0,
            "every replay is the recorded result"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sync_failover() {
    failover_run(Kind::Postgres, Replication::Sync).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_async_failover() {
    failover_run(Kind::Postgres, Replication::Async).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tx_sync_failover() {
    failover_run(Kind::PostgresTx, Replication::Sync).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_sync_failover() {
    failover_run(Kind::Tiered, Replication::Sync).await
}

/// Before any failover: a `Failover` whose first URL is the standby goes
/// to the primary (the writable one), and one whose servers are all
/// standbys or down fails fast with a retryable `Unavailable` naming each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_picks_the_writable_server() {
    let _one = ONE_AT_A_TIME.lock().await;
    let pair = tokio::task::block_in_place(|| PgReplicaPair::start(Replication::Async));
    let failover =
        Failover::new([&pair.standby_url, &pair.primary_url]).unwrap_or_else(|e| panic!("{e}"));
    let pool = failover.connect().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        failover.current(),
        format!("127.0.0.1:{}", pair.primary_port)
    );
    let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!in_recovery, "the pool is on the primary");
    let store = PgStore::builder(pool)
        .failover(failover)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let k = key(&run_id(), 1);
    assert!(matches!(
        store.acquire(&k, None, Duration::from_secs(5)).await,
        Ok(idem::Acquisition::Acquired(_))
    ));

    let dead = format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        support::free_port()
    );
    let nowhere = Failover::new([&pair.standby_url, &dead]).unwrap_or_else(|e| panic!("{e}"));
    match nowhere.connect().await {
        Err(StoreError::Unavailable(e)) => {
            let text = e.to_string();
            assert!(
                text.contains("read-only")
                    && text.contains("no writable")
                    && text.contains("refused"),
                "the error names each server's state: {text}"
            );
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(matches!(
        Failover::new(Vec::<String>::new()),
        Err(StoreError::InvalidArgument { .. })
    ));
    assert!(matches!(
        Failover::new(["mysql://x"]),
        Err(StoreError::InvalidArgument { .. })
    ));
}

/// A primary that turns read-only under open connections
/// (`default_transaction_read_only = on`, reloaded): the store's statements
/// get 25006, which is `Unavailable` (never `Backend`), the connection is
/// dropped and the store searches again (finding no writable server while
/// it lasts); once the primary takes writes again, the next call succeeds
/// on a fresh connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_server_is_left_and_found_again() {
    let _one = ONE_AT_A_TIME.lock().await;
    let pair = tokio::task::block_in_place(|| PgReplicaPair::start(Replication::Async));
    let failover = Failover::new([&pair.primary_url, &pair.standby_url])
        .unwrap_or_else(|e| panic!("{e}"))
        .check_interval(Duration::from_millis(100));
    let pool = failover.connect().await.unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::builder(pool)
        .failover(failover.clone())
        .connections(4)
        .call_timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let run = run_id();
    // Warm connections, idle in the store.
    for i in 0..4 {
        assert!(matches!(
            store
                .acquire(&key(&run, i), None, Duration::from_secs(5))
                .await,
            Ok(idem::Acquisition::Acquired(_))
        ));
    }

    let set = |on: bool| {
        tokio::task::block_in_place(|| {
            let value = if on { "on" } else { "off" };
            pair.psql_primary(&format!(
                "ALTER SYSTEM SET default_transaction_read_only = {value}"
            ));
            pair.psql_primary("SELECT pg_reload_conf()");
        })
    };
    set(true);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut refused = 0;
    let mut msg = 100;
    loop {
        msg += 1;
        match store
            .acquire(&key(&run, msg), None, Duration::from_secs(5))
            .await
        {
            Err(StoreError::Unavailable(e)) => {
                refused += 1;
                let text = e.to_string();
                assert!(
                    text.contains("read-only") || text.contains("read_only"),
                    "the error says why: {text}"
                );
                break;
            }
            // The reload has not reached this session yet.
            Ok(_) => {}
            Err(e) => panic!("a read-only server is Unavailable, not {e:?}"),
        }
        assert!(
            Instant::now() < deadline,
            "the primary never refused a write"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The writes stay refused while it lasts, and no connection to the
    // read-only server is handed out.
    for i in 0..5 {
        assert!(matches!(
            store
                .acquire(&key(&run, 200 + i), None, Duration::from_secs(5))
                .await,
            Err(StoreError::Unavailable(_))
        ));
    }
    set(false);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store
            .acquire(&key(&run, 300), None, Duration::from_secs(5))
            .await
        {
            Ok(idem::Acquisition::Acquired(_)) => break,
            Err(StoreError::Unavailable(_)) => {}
            other => panic!("expected Acquired, got {other:?}"),
        }
        assert!(
            Instant::now() < deadline,
            "the store did not come back to the primary within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(failover.switches(), 0);
    assert_eq!(
        failover.current(),
        format!("127.0.0.1:{}", pair.primary_port)
    );
    println!(
        "reliability scenario=postgres-read-only-primary backend=postgres refused_calls={} \
         then=acquired",
        refused + 5
    );
}
