//! The Redis Streams consumer against a real Redis (a standalone server and
//! a cluster, started by `support::redis_server`). Every entry's effect
//! once, every entry acknowledged, nothing left pending:
//!
//! - `delivery`: consumers killed or dropped mid-batch, duplicates in a
//!   batch, batches acquired at once, streams whose keys must not meet;
//! - `reads`: blocking reads on an idle stream, `claim_idle` at its
//!   extreme, a connection of the caller's own, a shutdown with an entry
//!   in flight;
//! - `in_transaction`: the in-transaction form (keys in PostgreSQL): a
//!   consumer killed between its INSERT and the commit, panics, 64 copies
//!   on a pool of 8;
//! - `poison`: dead letters (`max_deliveries`, entries without a usable
//!   key, mismatches, field names that are not UTF-8);
//! - `unrecorded`: a store outage after the handler ran (`Unrecorded`),
//!   the result finished later, duplicates of its key meanwhile.
//!
//! `cargo test --all-features --test receivers streams::` runs them.

use crate::support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::redis::redis;
use idemkit::redis::streams::{StreamConsumer, StreamEntry};
use idemkit::redis::RedisStore;
use idemkit::{Idempotency, IdempotencyStore};

mod delivery;
#[cfg(feature = "postgres")]
mod in_transaction;
mod poison;
mod reads;
mod unrecorded;

/// A condition [`run_until`] checks.
type Check = futures::future::BoxFuture<'static, bool>;

/// A connection to the shared Redis.
async fn conn() -> redis::aio::MultiplexedConnection {
    redis::Client::open(support::redis_server::shared_url())
        .unwrap_or_else(|e| panic!("{e}"))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Pending entries of the group (`XPENDING` summary count).
async fn pending(stream: &str, group: &str) -> i64 {
    let reply: redis::Value = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .query_async(&mut conn().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    match reply {
        redis::Value::Array(items) => match items.first() {
            Some(redis::Value::Int(n)) => *n,
            other => panic!("XPENDING: {other:?}"),
        },
        other => panic!("XPENDING: {other:?}"),
    }
}

/// Pending entries of consumer `name` in group `g`.
async fn pending_of(stream: &str, name: &str) -> i64 {
    let reply: redis::Value = redis::cmd("XPENDING")
        .arg(stream)
        .arg("g")
        .query_async(&mut conn().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let redis::Value::Array(items) = reply else {
        panic!("XPENDING: {reply:?}")
    };
    let Some(redis::Value::Array(consumers)) = items.get(3) else {
        return 0;
    };
    for c in consumers {
        if let redis::Value::Array(pair) = c {
            let n = match (&pair[0], &pair[1]) {
                (redis::Value::BulkString(who), redis::Value::BulkString(n))
                    if who.as_slice() == name.as_bytes() =>
                {
                    String::from_utf8_lossy(n).parse::<i64>().unwrap_or(0)
                }
                _ => continue,
            };
            return n;
        }
    }
    0
}

/// Adds an entry of `fields` to `stream`; its ID.
async fn xadd(stream: &str, fields: &[(&str, &str)]) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (k, v) in fields {
        cmd.arg(*k).arg(*v);
    }
    cmd.query_async(&mut conn().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The entries of a stream (`XRANGE - +`), each as its ID and fields.
async fn entries_of(stream: &str) -> Vec<(String, HashMap<String, String>)> {
    let reply: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    reply
        .into_iter()
        .map(|(id, fields)| (id, fields.into_iter().collect()))
        .collect()
}

/// A store on the shared Redis.
async fn redis_store() -> RedisStore {
    RedisStore::connect(support::redis_server::shared_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Consumer `name` of group `g` on `stream`, keyed by its `message_id`
/// field.
async fn consumer_on<S: IdempotencyStore>(
    stream: &str,
    name: &str,
    idem: Idempotency<S>,
) -> StreamConsumer<S> {
    StreamConsumer::connect(support::redis_server::shared_url(), stream, "g", name, idem)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .key_field("message_id")
}

/// Runs `consumer` until `done` holds (checked every 20 ms, for at most
/// `limit`), then shuts it down and returns what `run` returned. A `run`
/// that ends before `done` holds is an error.
async fn run_until<S, R, F, Fut, T, E>(
    consumer: &StreamConsumer<S, idemkit::JsonCodec, R>,
    handler: F,
    limit: Duration,
    done: impl Fn() -> Check,
) -> Result<idemkit::redis::streams::ConsumerStats, String>
where
    S: IdempotencyStore + ?Sized,
    R: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
    F: Fn(StreamEntry) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<T, E>> + Send + 'static,
    T: serde::Serialize + serde::de::DeserializeOwned + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = consumer.run(handler, async move {
        let _ = stop_rx.await;
    });
    tokio::pin!(run);
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        tokio::select! {
            ended = &mut run => {
                return Err(format!("run ended before the condition held: {:?}", ended.map_err(|e| e.to_string())));
            }
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
        if done().await {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            let _ = stop_tx.send(());
            let stats = tokio::time::timeout(Duration::from_secs(30), run).await;
            return Err(format!(
                "the condition did not hold within {limit:?}; run: {:?}",
                stats.map(|r| r.map_err(|e| e.to_string()))
            ));
        }
    }
    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .map_err(|_| "run did not stop within 30 s of the shutdown".to_owned())?
        .map_err(|e| e.to_string())
}

/// A handler that counts its runs and answers "ok".
fn counting(
    runs: &Arc<AtomicU64>,
) -> impl Fn(StreamEntry) -> futures::future::BoxFuture<'static, Result<String, std::io::Error>>
       + Send
       + Sync
       + 'static {
    let runs = runs.clone();
    move |_entry: StreamEntry| {
        let runs = runs.clone();
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok("ok".to_owned())
        })
    }
}

/// Done once `runs` reached `n` and nothing is pending in group `g`.
fn ran_and_nothing_pending(stream: &str, runs: &Arc<AtomicU64>, n: u64) -> impl Fn() -> Check {
    let (stream, runs) = (stream.to_owned(), runs.clone());
    move || {
        let (stream, runs) = (stream.clone(), runs.clone());
        Box::pin(
            async move { runs.load(Ordering::SeqCst) >= n && pending(&stream, "g").await == 0 },
        )
    }
}

/// Done once nothing is pending in group `g` of `stream`.
fn nothing_pending(stream: &str) -> impl Fn() -> Check {
    let stream = stream.to_owned();
    move || {
        let stream = stream.clone();
        Box::pin(async move { pending(&stream, "g").await == 0 })
    }
}
