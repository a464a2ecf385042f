//! The layer's detached work still running: a request's run (handler and
//! recording) and the finishing of a response the store could not take at
//! once. A server shutting down waits for it, so that what already ran is
//! recorded before the process exits.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// A handle on the detached tasks of an [`IdempotencyLayer`] and its
/// clones ([`IdempotencyLayer::detached_tasks`]): how many run, and a
/// future that ends when none does. A graceful shutdown stops taking
/// requests, lets its connections end, then awaits [`idle`](Self::idle)
/// (bounded by a timeout of its own: a completion waiting for a store that
/// is away runs until the store answers or its lease ends).
///
/// A client that went away leaves its request's run going on here, out of
/// sight of the server's connections: without this wait, a process that
/// exits as soon as its connections close cuts off a run that the next
/// delivery then finds in progress until its lease ends.
///
/// [`IdempotencyLayer`]: crate::IdempotencyLayer
/// [`IdempotencyLayer::detached_tasks`]: crate::IdempotencyLayer::detached_tasks
///
/// ```
/// use std::time::Duration;
///
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_http::IdempotencyLayer;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new())).allow_anonymous(true);
/// let tasks = layer.detached_tasks();
/// // ... serve with `layer` until a shutdown signal, stop accepting, then:
/// let drained = tokio::time::timeout(Duration::from_secs(30), tasks.idle()).await;
/// assert!(drained.is_ok() && tasks.running() == 0);
/// # }
/// ```
#[derive(Clone, Default)]
pub struct DetachedTasks {
    inner: Arc<Counter>,
}

#[derive(Default)]
struct Counter {
    running: AtomicUsize,
    idle: Notify,
}

impl DetachedTasks {
    /// How many detached tasks run now.
    pub fn running(&self) -> usize {
        self.inner.running.load(Ordering::Acquire)
    }

    /// Ends when no detached task runs (at once if none does). A task
    /// started meanwhile is waited for too.
    pub async fn idle(&self) {
        loop {
            let notified = self.inner.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.running() == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Counts a task from now until the guard drops.
    pub(crate) fn start(&self) -> TaskGuard {
        self.inner.running.fetch_add(1, Ordering::AcqRel);
        TaskGuard(self.inner.clone())
    }
}

impl fmt::Debug for DetachedTasks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DetachedTasks")
            .field("running", &self.running())
            .finish()
    }
}

/// One detached task, counted until it drops.
pub(crate) struct TaskGuard(Arc<Counter>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn idle_waits_for_every_guard_and_ends_at_once_without_one() {
        let tasks = DetachedTasks::default();
        tasks.idle().await;
        let (a, b) = (tasks.start(), tasks.start());
        assert_eq!(tasks.running(), 2);
        let waiter = tokio::spawn({
            let tasks = tasks.clone();
            async move { tasks.idle().await }
        });
        drop(a);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "one task still runs");
        drop(b);
        waiter.await.expect("the waiter ends");
        assert_eq!(tasks.running(), 0);
    }
}
