//! A connection that is replaced when it stops answering.
//!
//! The `redis` crate's async cluster client (1.8) was seen to stop
//! answering every call, on every shard, after a master was killed and its
//! replica promoted, and never to recover by itself, while a new client
//! worked at once (`tests/faults/failover/redis/`, RELIABILITY.md). A store made
//! by [`RedisStore::connect_cluster`](crate::RedisStore::connect_cluster)
//! therefore watches its calls: when calls have timed out for
//! [`STALL_AFTER`] with no answer (a reply or an error) in between, either
//! any call at all, any call on the same hash slot, or any call on a slot
//! of the same master (a master frozen while its replica took over leaves
//! only its own slots silent, and the client, which never sees an error
//! there, never rereads the topology; calls with fresh keys land on a new
//! slot of that master each time), it makes a new connection in the
//! background and uses it for the calls that follow. Which master serves
//! which slots is read (`CLUSTER SLOTS`) when the store connects and after
//! each replacement; a store that cannot read it (an ACL without
//! `cluster|slots`) watches every call and each slot only.
//! Calls already sent keep the connection they were sent on, so a
//! replacement never cuts a call short; a needless one (every node really
//! silent) costs one connection attempt.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
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

/// Reads which master serves which slots, on a connection: `(first slot,
/// last slot, the master's name)` for each range.
pub(crate) type ReadSlots<C> = Box<
    dyn Fn(C) -> Pin<Box<dyn Future<Output = Result<Vec<(u16, u16, String)>, RedisError>> + Send>>
        + Send
        + Sync,
>;

/// The most masters watched one by one (more share the last watch).
const MAX_MASTERS: usize = 1_024;

/// A slot whose master is not known.
const UNKNOWN: u16 = u16::MAX;

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
    /// How to read the slots' masters, if the connection has them.
    read_slots: Option<ReadSlots<C>>,
    /// The master (an index into `master_silent_since_ms`) of each slot.
    master_of: Box<[AtomicU16]>,
    /// The same silence for each master.
    master_silent_since_ms: Box<[AtomicU64]>,
    replacing: AtomicBool,
    replaced: AtomicU64,
}

impl<C: Clone + Send + Sync + 'static> Healer<C> {
    /// Watches `conn`; `read_slots` (a cluster) reads its slots' masters
    /// now, in the background, and after each replacement.
    pub(crate) fn new(
        conn: C,
        connect: Connect<C>,
        connect_timeout: Duration,
        read_slots: Option<ReadSlots<C>>,
    ) -> Arc<Self> {
        let healer = Arc::new(Healer {
            current: RwLock::new(conn),
            connect,
            connect_timeout,
            epoch: Instant::now(),
            silent_since_ms: AtomicU64::new(0),
            slot_silent_since_ms: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            read_slots,
            master_of: (0..SLOTS).map(|_| AtomicU16::new(UNKNOWN)).collect(),
            master_silent_since_ms: (0..MAX_MASTERS).map(|_| AtomicU64::new(0)).collect(),
            replacing: AtomicBool::new(false),
            replaced: AtomicU64::new(0),
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let healer = healer.clone();
            runtime.spawn(async move { healer.read_masters().await });
        }
        healer
    }

    /// Reads which master serves each slot (bounded by the connect
    /// timeout); on a failure the map stays as it was.
    async fn read_masters(&self) {
        let Some(read) = &self.read_slots else {
            return;
        };
        let read = tokio::time::timeout(self.connect_timeout, read(self.current())).await;
        let ranges = match read {
            Ok(Ok(ranges)) => ranges,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "cannot read the cluster's slots: each slot is watched alone");
                return;
            }
            Err(_) => return,
        };
        let mut names: Vec<&str> = ranges.iter().map(|(_, _, name)| name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        for slot in self.master_of.iter() {
            slot.store(UNKNOWN, Ordering::Relaxed);
        }
        for (first, last, name) in &ranges {
            let index = names.binary_search(&name.as_str()).map_or(UNKNOWN, |i| {
                u16::try_from(i.min(MAX_MASTERS - 1)).unwrap_or(UNKNOWN)
            });
            for slot in *first..=(*last).min(u16::try_from(SLOTS - 1).unwrap_or(u16::MAX)) {
                if let Some(of) = self.master_of.get(usize::from(slot)) {
                    of.store(index, Ordering::Relaxed);
                }
            }
        }
        for since in self.master_silent_since_ms.iter() {
            since.store(0, Ordering::Relaxed);
        }
    }

    /// The silence of the master of `slot`, if it is known.
    fn master(&self, slot: Option<u16>) -> Option<&AtomicU64> {
        let of = self
            .master_of
            .get(usize::from(slot?))?
            .load(Ordering::Relaxed);
        if of == UNKNOWN {
            return None;
        }
        self.master_silent_since_ms.get(usize::from(of))
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
        if let Some(since) = self.master(slot) {
            since.store(0, Ordering::Relaxed);
        }
    }

    /// Forgets every silence (a new connection gets a full period).
    fn reset(&self) {
        self.silent_since_ms.store(0, Ordering::Relaxed);
        for since in self.slot_silent_since_ms.iter() {
            since.store(0, Ordering::Relaxed);
        }
        for since in self.master_silent_since_ms.iter() {
            since.store(0, Ordering::Relaxed);
        }
    }

    /// How many times the connection was replaced.
    pub(crate) fn replaced(&self) -> u64 {
        self.replaced.load(Ordering::Relaxed)
    }

    /// A call (on `slot`) timed out: if calls have timed out for
    /// [`STALL_AFTER`] with no answer in between, on any slot, on this one
    /// or on its master's, replace the connection (once at a time, in the
    /// background).
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
        let silent = silence(&self.silent_since_ms)
            .max(self.slot(slot).map_or(0, silence))
            .max(self.master(slot).map_or(0, silence));
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
                    // The topology it found.
                    healer.read_masters().await;
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

/// The ranges of a `CLUSTER SLOTS` reply: `(first, last, master)`, the
/// master named by its node ID (or its address, if the reply has no ID).
/// Entries that do not read so are left out.
pub(crate) fn slot_ranges(reply: &redis::Value) -> Vec<(u16, u16, String)> {
    use redis::Value;
    let Value::Array(entries) = reply else {
        return Vec::new();
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    entries
        .iter()
        .filter_map(|entry| {
            let Value::Array(fields) = entry else {
                return None;
            };
            let (Some(Value::Int(first)), Some(Value::Int(last)), Some(Value::Array(master))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return None;
            };
            let name = match (
                master.first().and_then(text),
                master.get(1),
                master.get(2).and_then(text),
            ) {
                (_, _, Some(id)) if !id.is_empty() => id,
                (Some(host), Some(Value::Int(port)), _) => format!("{host}:{port}"),
                _ => return None,
            };
            Some((
                u16::try_from(*first).ok()?,
                u16::try_from(*last).ok()?,
                name,
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::Value;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn slot_ranges_name_each_range_by_its_master() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                Value::Array(vec![bulk("127.0.0.1"), Value::Int(7000), bulk("aaa")]),
                Value::Array(vec![bulk("127.0.0.1"), Value::Int(7003), bulk("ddd")]),
            ]),
            // No ID: the address names it.
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(10922),
                Value::Array(vec![bulk("127.0.0.1"), Value::Int(7001)]),
            ]),
            // Out of range, or not a range at all: left out.
            Value::Array(vec![Value::Int(-1), Value::Int(3), Value::Array(vec![])]),
            Value::Int(7),
        ]);
        assert_eq!(
            slot_ranges(&reply),
            vec![
                (0, 5460, "aaa".to_owned()),
                (5461, 10922, "127.0.0.1:7001".to_owned()),
            ]
        );
        assert!(slot_ranges(&Value::Nil).is_empty());
    }
}
