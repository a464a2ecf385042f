//! The fault and load suite: exactly-once under redelivery storms, crashed
//! and zombie workers, long handlers, and server faults, on every backend.
//!
//! Every scenario records side effects in a ledger (an atomic counter per
//! message, or a PostgreSQL table written in the same transaction for the
//! in-transaction mode; `support::storm`) and checks it at the end. Each
//! prints one `reliability scenario=... backend=...` line with its figures;
//! RELIABILITY.md tabulates them
//! (`cargo test --all-features --test faults storms -- --nocapture`).
//!
//! This file holds what the scenarios share: the backends, the storm and
//! its figures, the receivers of a storm through a fault. Each module is
//! one scenario, run on every backend it applies to.

use crate::support;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemkit::postgres::{Claim, PgStore, TxLease};
use idemkit::redis::RedisStore;
use idemkit::testkit::Tap;
use idemkit::tiered::{MokaCache, RedisCache, TieredStore};
use idemkit::{
    Acquisition, IdemError, Idempotency, IdempotencyKey, IdempotencyStore, InProgressPolicy,
    MemoryStore, Processed, Record, StoreError,
};
use support::storm::{
    deliver_all, key, plan, run_id, Delivery, Ledger, Progress, Receiver, STORM_LIMIT,
};

// ------------------------------------------------------------ backends

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

/// Prints the figures of one scenario in the format RELIABILITY.md uses.
fn report(scenario: &str, backend: Backend, fields: &[(&str, String)], started: Instant) {
    support::report::report(scenario, backend.name(), fields, started)
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

mod bad_input;
mod blocking_handler;
mod cancelled_caller;
mod crash_mid_handler;
mod heartbeat;
mod lost_reply;
mod pg_waits;
mod poison_entry;
mod redelivery_storm;
mod server_faults;
mod zombie_worker;

// ------------------------------------------------------------ the storm

/// A fault injected into a storm: gets the storm's progress, returns when
/// the fault is over.
type Fault = Box<dyn FnOnce(Arc<Progress>) -> futures::future::BoxFuture<'static, ()> + Send>;

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
    let plan = plan(messages);
    let planned = plan.len() as u64;
    let ledger = Ledger::new(messages);
    let results: Arc<Vec<AtomicU64>> = Arc::new((0..messages).map(|_| AtomicU64::new(0)).collect());
    let replays = Arc::new(Mutex::new(Vec::new()));
    // Redeliveries, failures.
    let counters = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let seen = {
        let (progress, results, replays, counters) = (
            progress.clone(),
            results.clone(),
            replays.clone(),
            counters.clone(),
        );
        move |msg: u64, delivery: &Delivery, _begun: Instant| match delivery {
            Delivery::Executed(v) => {
                let before = results[msg as usize].swap(*v, Ordering::SeqCst);
                assert_eq!(before, 0, "message {msg} executed twice");
                progress.bump(&progress.executed);
            }
            Delivery::Replayed(v) => replays
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((msg, *v)),
            other => {
                match other {
                    Delivery::Unavailable(e) => {
                        if progress.unavailable.load(Ordering::SeqCst) == 0 {
                            eprintln!("first Unavailable (redelivered): {e}");
                        }
                        progress.bump(&progress.unavailable)
                    }
                    Delivery::Failed(_) | Delivery::LeaseLost
                        if counters[1].fetch_add(1, Ordering::Relaxed) == 0 =>
                    {
                        eprintln!("first failed delivery (redelivered): {other:?}");
                    }
                    _ => {}
                }
                counters[0].fetch_add(1, Ordering::Relaxed);
            }
        }
    };
    let deliveries = deliver_all(
        &receiver,
        "faults.storm",
        &run,
        plan,
        workers,
        &ledger,
        seen,
    );
    // The fault beside the deliveries: a fault that fails (a server that
    // would not stop or start again) fails the test at once, instead of
    // leaving the deliveries to wait on a server nobody brings back.
    let deliveries = match fault {
        None => deliveries.await,
        Some(mut fault) => {
            tokio::pin!(deliveries);
            tokio::select! {
                n = &mut deliveries => {
                    fault.await.unwrap_or_else(|e| panic!("the fault task failed: {e}"));
                    n
                }
                done = &mut fault => {
                    done.unwrap_or_else(|e| panic!("the fault task failed: {e}"));
                    deliveries.await
                }
            }
        }
    };
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
        // A read the store could not answer yet (a connection the restart
        // cut, handed out once more) is asked again, 5 s at most: only an
        // answer counts.
        let k = key("faults.storm", &run, msg);
        let deadline = Instant::now() + Duration::from_secs(5);
        let got = loop {
            match store.get(&k).await {
                Err(e) if e.is_retryable() && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => break other,
            }
        };
        match got {
            Ok(Some(Record {
                state: idemkit::RecordState::Completed { .. },
                ..
            })) => {}
            _ => lost_completions += 1,
        }
    }
    debug_assert!(deliveries >= planned);
    Storm {
        deliveries,
        redeliveries: counters[0].load(Ordering::SeqCst),
        unavailable: progress.unavailable.load(Ordering::SeqCst),
        failures: counters[1].load(Ordering::SeqCst),
        double_effects,
        lost_completions,
    }
}

/// A worker's lease short enough for a takeover within a test.
const SHORT_LEASE: Duration = Duration::from_millis(400);

/// The in-transaction mode's worker, up to its effect: begins a
/// transaction, claims `key` in it and writes the effect (a row of the
/// table `ledger`), without completing or committing. Returns the
/// transaction and its lease.
async fn claim_with_effect(
    store: &PgStore,
    ledger: &str,
    key: &IdempotencyKey,
) -> (sqlx::Transaction<'static, sqlx::Postgres>, TxLease) {
    let mut tx = store.pool().begin().await.unwrap_or_else(|e| panic!("{e}"));
    let Ok(Claim::Acquired(lease)) = store
        .in_transaction()
        .claim::<_, u64>(&mut tx, key, &0u64)
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
    (tx, lease)
}

/// A handler that must not run.
fn never<T>(why: &str) -> Result<T, std::convert::Infallible> {
    panic!("{why}")
}

// ------------------------------------------------------------ server faults

/// Messages of a storm through a fault.
const FAULT_MESSAGES: u64 = 2_000;

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
