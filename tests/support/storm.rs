//! The redelivery storm of the fault tests (`tests/faults/storms`, and the
//! PostgreSQL failover of `tests/faults/failover/postgres`): many workers
//! deliver each message 1 to 8 times, in random order, through a
//! [`Receiver`] whose side effect is counted in a [`Ledger`]; a delivery
//! that was neither executed nor replayed goes back to the end of the queue,
//! as a broker redelivers. The tests check the ledger and the records at the
//! end.
//!
//! (`support::chaos` is a smaller storm for the stores' own tests: keys
//! processed until they succeed through one injected fault.)

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemkit::postgres::{Claim, PgStore};
use idemkit::{IdemError, Idempotency, IdempotencyKey, IdempotencyStore, Processed, StoreError};

/// Messages per redelivery storm (the storms of `tests/faults/storms`
/// without a fault and the failover storms): 2,500, each delivered 1 to 8
/// times by 64 workers, so a fault lands with the storm in full flow and
/// thousands of deliveries come after it. `IDEM_STORM_MESSAGES` sets
/// another size: the figures in docs/reliability.txt were measured with
/// 10,000.
pub fn messages() -> u64 {
    match std::env::var("IDEM_STORM_MESSAGES") {
        Ok(v) => v
            .parse()
            .ok()
            .filter(|&n: &u64| n >= 100)
            .unwrap_or_else(|| panic!("IDEM_STORM_MESSAGES={v:?}: give a count of at least 100")),
        Err(_) => 2_500,
    }
}

/// A fresh id for the keys of one run.
pub fn run_id() -> String {
    format!("{:016x}", fastrand::u64(..))
}

/// The key of message `msg` of `run` in `scope`.
pub fn key(scope: &str, run: &str, msg: u64) -> IdempotencyKey {
    IdempotencyKey::new(scope, format!("{run}-{msg}")).unwrap_or_else(|e| panic!("{e}"))
}

// ------------------------------------------------------------ receivers

/// What one delivery got.
#[derive(Debug)]
pub enum Delivery {
    Executed(u64),
    Replayed(u64),
    InProgress,
    /// The store could not be reached (`StoreError::Unavailable`).
    Unavailable(String),
    /// The handler ran, but another worker had taken the key over: its
    /// result was not recorded (the other worker's was).
    LeaseLost,
    Failed(String),
}

/// The value an execution returns: unique to it, so a replay shows which
/// execution was recorded.
pub static EXECUTION: AtomicU64 = AtomicU64::new(1);

/// Side effects per message, counted in process.
pub struct Ledger(Vec<AtomicU32>);

impl Ledger {
    pub fn new(messages: u64) -> Arc<Ledger> {
        Arc::new(Ledger((0..messages).map(|_| AtomicU32::new(0)).collect()))
    }
    pub fn effect(&self, msg: u64) {
        self.0[msg as usize].fetch_add(1, Ordering::SeqCst);
    }
    pub fn count(&self, msg: u64) -> u32 {
        self.0[msg as usize].load(Ordering::SeqCst)
    }
}

/// A message receiver; its effect is counted in a ledger.
#[derive(Clone)]
pub enum Receiver {
    /// The executor on a store; the effect is counted in the [`Ledger`].
    Store(Idempotency<dyn IdempotencyStore>),
    /// The in-transaction mode: the effect is a row of the table `ledger`,
    /// written in the same transaction as the reservation and the
    /// completion.
    Tx { store: PgStore, ledger: String },
}

impl Receiver {
    /// The in-transaction mode on `store`, with a ledger table of its own.
    pub async fn tx(store: PgStore) -> Receiver {
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
    /// unique to this execution ([`EXECUTION`]).
    pub async fn deliver(&self, key: &IdempotencyKey, msg: u64, ledger: &Ledger) -> Delivery {
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

    /// How many effects the ledger holds per message: the in-process
    /// ledger, or the ledger table as the server has it.
    pub async fn effects(&self, ledger: &Ledger, messages: u64) -> Vec<u32> {
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
    pub fn store(&self) -> Arc<dyn IdempotencyStore> {
        match self {
            Receiver::Store(idem) => idem.store().clone(),
            Receiver::Tx { store, .. } => Arc::new(store.clone()),
        }
    }
}

/// Writes an unrecorded completion with its own lease, retrying while the
/// store is away (30 s at most), as a consumer does: the run's value once
/// written, `LeaseLost` if another worker took the key over, `Failed` if
/// the store refused it.
async fn finish(idem: &Idempotency<dyn IdempotencyStore>, u: &idemkit::Unrecorded) -> Delivery {
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

#[derive(Debug, thiserror::Error)]
enum TxError {
    #[error(transparent)]
    Sqlx(#[from] sqlx::Error),
    #[error(transparent)]
    Idem(#[from] IdemError<std::convert::Infallible>),
}

/// A failed delivery of the in-transaction mode: connection-level sqlx
/// errors, a server shutting down or refusing connections (57, 08), a
/// read-only server (25006: a standby before its promotion) and
/// `StoreError::Unavailable` mean the primary could not be reached.
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

/// How far a storm got, for a fault to wait on.
#[derive(Default)]
pub struct Progress {
    pub executed: AtomicU64,
    pub unavailable: AtomicU64,
    changed: tokio::sync::Notify,
}

impl Progress {
    /// Waits until `ready` holds; panics, naming `what`, if it does not
    /// within `limit` (a storm that stalls must fail, never hang).
    pub async fn until(&self, what: &str, limit: Duration, ready: impl Fn(&Progress) -> bool) {
        let waiting = async {
            loop {
                let changed = self.changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if ready(self) {
                    return;
                }
                changed.await;
            }
        };
        if tokio::time::timeout(limit, waiting).await.is_err() {
            panic!(
                "{what}: not within {limit:?} (executed {}, unavailable {})",
                self.executed.load(Ordering::SeqCst),
                self.unavailable.load(Ordering::SeqCst)
            );
        }
    }

    /// Adds one to `counter` (one of this progress's) and wakes the waiters.
    pub fn bump(&self, counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }
}

/// The longest a storm's deliveries may take, faults and redeliveries
/// included (the longest storms end in about a minute on 2 cores).
pub const STORM_LIMIT: Duration = Duration::from_secs(240);

/// The deliveries of a storm: each of `messages` messages 1 to 8 times, in
/// random order.
pub fn plan(messages: u64) -> Vec<u64> {
    let mut deliveries: Vec<u64> = (0..messages)
        .flat_map(|m| std::iter::repeat_n(m, fastrand::usize(1..=8)))
        .collect();
    fastrand::shuffle(&mut deliveries);
    deliveries
}

/// Delivers `plan` (message numbers, keyed `scope`/`run`) from `workers`
/// workers through `receiver`; `seen(msg, delivery, begun)` is told what
/// each delivery got and when it began. A delivery neither executed nor
/// replayed goes back to the end of the queue after a short pause (a
/// broker's redelivery delay, so a fault is not spun on). Returns the
/// number of deliveries made, redeliveries included; panics if the plan is
/// not delivered within [`STORM_LIMIT`] (a store that never comes back must
/// fail the test, not spin it forever).
pub async fn deliver_all(
    receiver: &Receiver,
    scope: &str,
    run: &str,
    plan: Vec<u64>,
    workers: usize,
    ledger: &Arc<Ledger>,
    seen: impl Fn(u64, &Delivery, Instant) + Send + Sync + 'static,
) -> u64 {
    let queue = Arc::new(Mutex::new(VecDeque::from(plan)));
    let deliveries = Arc::new(AtomicU64::new(0));
    let seen = Arc::new(seen);
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let (receiver, queue, ledger, deliveries, seen) = (
                receiver.clone(),
                queue.clone(),
                ledger.clone(),
                deliveries.clone(),
                seen.clone(),
            );
            let (scope, run) = (scope.to_owned(), run.to_owned());
            tokio::spawn(async move {
                loop {
                    let next = queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                    let Some(msg) = next else { break };
                    deliveries.fetch_add(1, Ordering::Relaxed);
                    let begun = Instant::now();
                    let delivery = receiver
                        .deliver(&key(&scope, &run, msg), msg, &ledger)
                        .await;
                    seen(msg, &delivery, begun);
                    if !matches!(delivery, Delivery::Executed(_) | Delivery::Replayed(_)) {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        queue
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push_back(msg);
                    }
                }
            })
        })
        .collect();
    let all = async {
        for t in tasks {
            t.await
                .unwrap_or_else(|e| panic!("a storm worker panicked: {e}"));
        }
    };
    if tokio::time::timeout(STORM_LIMIT, all).await.is_err() {
        let left = queue.lock().unwrap_or_else(|p| p.into_inner()).len();
        panic!(
            "the storm did not end within {STORM_LIMIT:?}: {} deliveries made, {left} waiting",
            deliveries.load(Ordering::SeqCst)
        );
    }
    deliveries.load(Ordering::SeqCst)
}
