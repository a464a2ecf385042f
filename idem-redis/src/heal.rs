//! A connection that is replaced when it stops answering.
//!
//! The `redis` crate's async cluster client (1.8) was seen to stop
//! answering every call, on every shard, after a master was killed and its
//! replica promoted, and never to recover by itself, while a new client
//! worked at once (`tests/faults/failover/redis/`, RELIABILITY.md). A store made
//! by [`RedisStore::connect_cluster`](crate::RedisStore::connect_cluster)
//! therefore watches its calls: when calls have timed out for
//! [`STALL_AFTER`] with no answer (a reply or an error) in between, either
//! any call at all or any call on the same hash slot (a master frozen
//! while its replica took over leaves only its own slots silent, and the
//! client, which never sees an error there, never rereads the topology),
//! it makes a new connection in the background and uses it for the calls
//! that follow.
//! Calls already sent keep the connection they were sent on, so a
//! replacement never cuts a call short; a needless one (every node really
//! silent) costs one connection attempt.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use redis::RedisError;

/// How long no call may have had an answer, while calls time out, before
/// the connection is replaced.
pub const STALL_AFTER: Duration = Duration::from_secs(4);

/// Hash slots of a Redis Cluster.
const SLOTS: usize = 16_384;

pub(crate) type Connect<C> =
    Box<dyn Fn() -> Pin<Box<dyn Future<Output = Result<C, RedisError>> + Send>> + Send + Sync>;

/// The connection in use, and how to make another.
pub(crate) struct Healer<C> {
    current: RwLock<C>,
    connect: Connect<C>,
    connect_timeout: Duration,
    epoch: Instant,
    /// Milliseconds after `epoch` (at least 1) of the first timeout since
    /// the last answer, for any call; 0: answering.
    silent_since_ms: AtomicU64,
    /// The same for each hash slot.
    slot_silent_since_ms: Box<[AtomicU64]>,
    replacing: AtomicBool,
    replaced: AtomicU64,
}

impl<C: Clone + Send + Sync + 'static> Healer<C> {
    pub(crate) fn new(conn: C, connect: Connect<C>, connect_timeout: Duration) -> Self {
        Healer {
            current: RwLock::new(conn),
            connect,
            connect_timeout,
            epoch: Instant::now(),
            silent_since_ms: AtomicU64::new(0),
            slot_silent_since_ms: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            replacing: AtomicBool::new(false),
            replaced: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    fn slot(&self, slot: Option<u16>) -> Option<&AtomicU64> {
        slot.and_then(|s| self.slot_silent_since_ms.get(usize::from(s)))
    }

    /// The connection to send the next call on.
    pub(crate) fn current(&self) -> C {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// A call (on `slot`, if it has a key) had an answer: a reply or an
    /// error from the client.
    pub(crate) fn answered(&self, slot: Option<u16>) {
        self.silent_since_ms.store(0, Ordering::Relaxed);
        if let Some(since) = self.slot(slot) {
            since.store(0, Ordering::Relaxed);
        }
    }

    /// Forgets every silence (a new connection gets a full period).
    fn reset(&self) {
        self.silent_since_ms.store(0, Ordering::Relaxed);
        for since in self.slot_silent_since_ms.iter() {
            since.store(0, Ordering::Relaxed);
        }
    }

    /// How many times the connection was replaced.
    pub(crate) fn replaced(&self) -> u64 {
        self.replaced.load(Ordering::Relaxed)
    }

    /// A call (on `slot`) timed out: if calls have timed out for
    /// [`STALL_AFTER`] with no answer in between, on any slot or on this
    /// one, replace the connection (once at a time, in the background).
    pub(crate) fn timed_out(self: &Arc<Self>, slot: Option<u16>) {
        let now = self.now_ms();
        // The silence so far (0 if this timeout starts one).
        let silence = |since: &AtomicU64| match since.compare_exchange(
            0,
            now,
            Ordering::Relaxed,
            Ordering::Relaxed,
        ) {
            Ok(_) => 0,
            Err(first) => now.saturating_sub(first),
        };
        let silent = silence(&self.silent_since_ms).max(self.slot(slot).map_or(0, silence));
        if u128::from(silent) < STALL_AFTER.as_millis() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.replacing.swap(true, Ordering::AcqRel) {
            return;
        }
        let healer = self.clone();
        runtime.spawn(async move {
            let made = tokio::time::timeout(healer.connect_timeout, (healer.connect)()).await;
            match made {
                Ok(Ok(conn)) => {
                    *healer.current.write().unwrap_or_else(|p| p.into_inner()) = conn;
                    healer.replaced.fetch_add(1, Ordering::Relaxed);
                    // The new connection gets a full period before it
                    // can be judged.
                    healer.reset();
                    tracing::warn!(
                        silent_ms = silent,
                        "replaced a Redis connection on which no call had an answer"
                    );
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot replace a silent Redis connection yet")
                }
                Err(_) => tracing::warn!("cannot replace a silent Redis connection yet: timed out"),
            }
            healer.replacing.store(false, Ordering::Release);
        });
    }
}
