//! A connection that is replaced when it stops answering.
//!
//! The `redis` crate's async cluster client (1.8) was seen to stop
//! answering every call, on every shard, after a master was killed and its
//! replica promoted, and never to recover by itself, while a new client
//! worked at once (`tests/failover_redis.rs`, RELIABILITY.md). A store made
//! by [`RedisStore::connect_cluster`](crate::RedisStore::connect_cluster)
//! therefore watches its calls: when a call times out and no call at all
//! has had an answer (a reply or an error) for [`STALL_AFTER`], it makes a
//! new connection in the background and uses it for the calls that follow.
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

pub(crate) type Connect<C> =
    Box<dyn Fn() -> Pin<Box<dyn Future<Output = Result<C, RedisError>> + Send>> + Send + Sync>;

/// The connection in use, and how to make another.
pub(crate) struct Healer<C> {
    current: RwLock<C>,
    connect: Connect<C>,
    connect_timeout: Duration,
    epoch: Instant,
    /// Milliseconds after `epoch` of the last answer.
    last_answer_ms: AtomicU64,
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
            last_answer_ms: AtomicU64::new(0),
            replacing: AtomicBool::new(false),
            replaced: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The connection to send the next call on.
    pub(crate) fn current(&self) -> C {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// A call had an answer (a reply or an error from the client).
    pub(crate) fn answered(&self) {
        self.last_answer_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// How many times the connection was replaced.
    pub(crate) fn replaced(&self) -> u64 {
        self.replaced.load(Ordering::Relaxed)
    }

    /// A call timed out: if nothing has answered for [`STALL_AFTER`],
    /// replace the connection (once at a time, in the background).
    pub(crate) fn timed_out(self: &Arc<Self>) {
        let silent = self
            .now_ms()
            .saturating_sub(self.last_answer_ms.load(Ordering::Relaxed));
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
                    healer.answered();
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
