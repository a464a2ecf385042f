//! The state shared by the run loop and the message tasks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_nats::jetstream;
use idem_core::{Fingerprint, FinishingKeys, IdempotencyKey, StoreError};

use crate::stats::Counters;

/// A message a task holds (delivered, not yet acked or handed back).
pub(crate) struct Held {
    pub(crate) message: jetstream::Message,
    /// Set while its completion is written after a store outage: its key
    /// and fingerprint (at shutdown such a message is not handed back,
    /// and its key is given up here).
    pub(crate) finishing: Option<(IdempotencyKey, Option<Fingerprint>)>,
}

/// State shared by the run loop and the message tasks.
pub(crate) struct Shared {
    pub(crate) counters: Counters,
    /// The messages the tasks hold, by task number.
    pub(crate) held: Mutex<HashMap<u64, Held>>,
    next: AtomicU64,
    /// A task found that nothing can succeed: `run` stops with this.
    pub(crate) fatal: Mutex<Option<StoreError>>,
    /// The keys whose completion a task is writing after a store outage
    /// (held while it does), and those given up.
    pub(crate) finishing: Arc<FinishingKeys>,
    /// The dead letters owed: runs whose handler ran, whose result the
    /// store refused for good, whose dead letter could not be published
    /// yet; by key, with the reason. A delivery of such a key (answered
    /// "result unavailable": given up here) publishes it before its ack.
    pub(crate) owed: Mutex<HashMap<IdempotencyKey, String>>,
    /// Bumped when a shutdown gives up the completions still being
    /// written: their finishers (detached tasks) stop.
    pub(crate) giving_up: tokio::sync::watch::Sender<u64>,
}

impl Shared {
    pub(crate) fn new(durable: &str) -> Self {
        Shared {
            counters: Counters::new(durable),
            held: Mutex::default(),
            next: AtomicU64::new(0),
            fatal: Mutex::default(),
            finishing: Arc::default(),
            owed: Mutex::default(),
            giving_up: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Holds `message`; its number, to let it go with [`release`](Self::release).
    pub(crate) fn hold(&self, message: jetstream::Message) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.held).insert(
            id,
            Held {
                message,
                finishing: None,
            },
        );
        id
    }

    /// Marks held message `id` as being finished.
    pub(crate) fn finishing(&self, id: u64, key: IdempotencyKey, fingerprint: Option<Fingerprint>) {
        if let Some(held) = lock(&self.held).get_mut(&id) {
            held.finishing = Some((key, fingerprint));
        }
    }

    /// Completes once a shutdown gives up the completions being written
    /// ([`give_up`](Self::give_up) called after this).
    pub(crate) fn given_up_at_shutdown(&self) -> impl std::future::Future<Output = ()> + Send {
        let mut seen = self.giving_up.subscribe();
        async move {
            let _ = seen.changed().await;
        }
    }

    /// Tells the finishers alive to give up (a shutdown past its wait).
    pub(crate) fn give_up(&self) {
        self.giving_up.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Lets held message `id` go (acked, handed back, or left).
    pub(crate) fn release(&self, id: u64) {
        lock(&self.held).remove(&id);
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
