//! The read loop: reads that block longer than a connection's response
//! timeout or without a limit on an idle stream, `claim_idle` at its
//! extreme, a connection of the caller's own (standalone and cluster), and
//! a shutdown that waits for the entry in flight.

use crate::support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::redis::redis;
use idemkit::redis::streams::{StreamConsumer, StreamEntry};
use idemkit::redis::RedisStore;
use idemkit::Idempotency;

use super::{
    consumer_on, counting, pending, ran_and_nothing_pending, redis_store, run_until, xadd, Check,
};

/// A shutdown while an entry is in flight: `run` returns only after that
/// entry completed and was acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_the_entries_in_flight() {
    let stream = format!("shutdown-{:08x}", fastrand::u32(..));
    xadd(&stream, &[("message_id", "only")]).await;
    let consumer = consumer_on(&stream, "c", Idempotency::new(redis_store().await))
        .await
        .block(Duration::from_millis(50));
    let started = Arc::new(tokio::sync::Notify::new());
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = {
        let (started, gate) = (started.clone(), gate.clone());
        tokio::spawn(async move {
            consumer
                .run(
                    move |_entry: StreamEntry| {
                        let (started, gate) = (started.clone(), gate.clone());
                        async move {
                            started.notify_one();
                            let _permit = gate.acquire().await;
                            Ok::<_, std::io::Error>(1u8)
                        }
                    },
                    async {
                        let _ = stop_rx.await;
                    },
                )
                .await
        })
    };
    started.notified().await;
    let _ = stop_tx.send(());
    assert!(!run.is_finished(), "the entry in flight holds the shutdown");
    gate.add_permits(1);
    let stats = run
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((stats.executed, stats.acked), (1, 1), "{stats:?}");
    assert_eq!(pending(&stream, "g").await, 0);
}

/// A read that blocks longer than a connection's usual response timeout
/// (5.5 s) waits on an idle stream instead of failing, and the entry that
/// arrives after 6 s idle is processed and acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_blocking_longer_than_five_seconds_waits_on_an_idle_stream() {
    let stats =
        late_entry_on_an_idle_stream("idle-long", Duration::from_secs(8), Duration::from_secs(60))
            .await;
    assert_eq!((stats.executed, stats.acked), (1, 1), "{stats:?}");
}

/// `block(0)` means "wait for entries without a time limit": on a stream
/// idle for 6 s `run` keeps waiting (it does not fail with `Unavailable`
/// after the connection's response timeout, leaving the entry delivered to
/// the abandoned read pending), and the entry is processed and acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_zero_waits_for_entries_without_a_time_limit() {
    let stats =
        late_entry_on_an_idle_stream("idle-zero", Duration::ZERO, Duration::from_secs(4)).await;
    assert_eq!((stats.executed, stats.acked), (1, 1), "{stats:?}");
}

/// A consumer with `block` and `claim_idle` reads a stream that stays idle
/// for 6 s before one entry arrives; returns its stats once the entry ran
/// and nothing is pending (checked by `ran_and_nothing_pending`).
async fn late_entry_on_an_idle_stream(
    tag: &str,
    block: Duration,
    claim_idle: Duration,
) -> idemkit::redis::streams::ConsumerStats {
    let stream = format!("{tag}-{:08x}", fastrand::u32(..));
    let consumer = consumer_on(&stream, "c", Idempotency::new(redis_store().await))
        .await
        .block(block)
        .claim_idle(claim_idle);
    let producer = {
        let stream = stream.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(6)).await; // the stream stays idle
            xadd(&stream, &[("message_id", "late")]).await
        })
    };
    let runs = Arc::new(AtomicU64::new(0));
    let stats = run_until(
        &consumer,
        counting(&runs),
        Duration::from_secs(30),
        ran_and_nothing_pending(&stream, &runs, 1),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    producer.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(pending(&stream, "g").await, 0);
    stats
}

/// `claim_idle(Duration::MAX)` ("never take over another consumer's
/// entries") is saturated, not sent as a number XAUTOCLAIM refuses ("Invalid
/// min-idle-time argument"): `run` processes and acks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_idle_of_duration_max_is_saturated_not_an_error() {
    let stream = format!("claim-max-{:08x}", fastrand::u32(..));
    xadd(&stream, &[("message_id", "m-1")]).await;
    let consumer = consumer_on(&stream, "c", Idempotency::new(redis_store().await))
        .await
        .block(Duration::from_millis(50))
        .claim_idle(Duration::MAX);
    let runs = Arc::new(AtomicU64::new(0));
    let stats = run_until(
        &consumer,
        counting(&runs),
        Duration::from_secs(10),
        ran_and_nothing_pending(&stream, &runs, 1),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((stats.executed, stats.acked), (1, 1), "{stats:?}");
}

/// `batch` and `concurrency` of `usize::MAX` are clamped to `MAX_BATCH`:
/// reads ask Redis for a `COUNT` it takes (before, `COUNT
/// 18446744073709551615` failed the first read and `run` with it), and
/// `run` processes and acks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_and_concurrency_of_usize_max_are_clamped_not_an_error() {
    let stream = format!("batch-max-{:08x}", fastrand::u32(..));
    xadd(&stream, &[("message_id", "m-1")]).await;
    let consumer = consumer_on(&stream, "c", Idempotency::new(redis_store().await))
        .await
        .block(Duration::from_millis(50))
        .batch(usize::MAX)
        .concurrency(usize::MAX);
    let debug = format!("{consumer:?}");
    assert!(
        debug.contains(&format!("batch: {}", idemkit::redis::streams::MAX_BATCH)),
        "{debug}"
    );
    let runs = Arc::new(AtomicU64::new(0));
    let stats = run_until(
        &consumer,
        counting(&runs),
        Duration::from_secs(10),
        ran_and_nothing_pending(&stream, &runs, 1),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((stats.executed, stats.acked), (1, 1), "{stats:?}");
}

/// A scope that is not a valid key scope is refused when the consumer is
/// built (before, every entry was dead-lettered with "no usable key").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_scope_is_refused_when_the_consumer_is_built() {
    let stream = format!("scope-bad-{:08x}", fastrand::u32(..));
    for bad in ["orders v2", "", &"s".repeat(65)] {
        let consumer = consumer_on(&stream, "c", Idempotency::new(redis_store().await)).await;
        match consumer.scope(bad) {
            Err(
                idemkit::KeyError::EmptyScope
                | idemkit::KeyError::ScopeTooLong { .. }
                | idemkit::KeyError::InvalidScopeChar { .. },
            ) => {}
            other => panic!("scope {bad:?}: {:?}", other.map(|_| "accepted")),
        }
    }
    let consumer = consumer_on(&stream, "c", Idempotency::new(redis_store().await)).await;
    assert!(consumer.scope("orders.v2").is_ok());
}

/// A consumer over a connection of yours: a
/// `MultiplexedConnection` (made without a response timeout) and a Redis
/// Cluster connection. Both process, dead-letter and acknowledge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_takes_an_existing_standalone_or_cluster_connection() {
    use idemkit::redis::redis::AsyncConnectionConfig;
    // Standalone.
    let stream = format!("own-conn-{:08x}", fastrand::u32(..));
    xadd(&stream, &[("message_id", "m-1")]).await;
    xadd(&stream, &[("amount", "no key")]).await;
    let mine = redis::Client::open(support::redis_server::shared_url())
        .unwrap_or_else(|e| panic!("{e}"))
        .get_multiplexed_async_connection_with_config(
            &AsyncConnectionConfig::new().set_response_timeout(None),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let consumer = StreamConsumer::new(
        mine,
        &stream,
        "g",
        "c",
        Idempotency::new(redis_store().await),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .key_field("message_id")
    .block(Duration::from_millis(50));
    let runs = Arc::new(AtomicU64::new(0));
    let stats = run_until(
        &consumer,
        counting(&runs),
        Duration::from_secs(10),
        ran_and_nothing_pending(&stream, &runs, 1),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (stats.executed, stats.dead_lettered, stats.acked),
        (1, 1, 2),
        "{stats:?}"
    );

    // Redis Cluster: the stream and its dead-letter stream on their own
    // slots.
    let nodes = support::redis_server::shared_cluster().to_vec();
    let mut cluster = redis::cluster::ClusterClient::builder(nodes)
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
        .get_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let stream = format!("cluster-conn-{:08x}", fastrand::u32(..));
    for fields in [
        &[("message_id", "m-1")][..],
        &[("message_id", "m-1")],
        &[("amount", "no key")],
    ] {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&stream).arg("*");
        for (k, v) in fields {
            cmd.arg(*k).arg(*v);
        }
        let _: String = cmd
            .query_async(&mut cluster)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let store = RedisStore::connect_cluster(
        support::redis_server::shared_cluster()
            .iter()
            .map(String::as_str),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let consumer = StreamConsumer::new(cluster.clone(), &stream, "g", "c", Idempotency::new(store))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .key_field("message_id")
        .block(Duration::from_millis(50));
    let runs = Arc::new(AtomicU64::new(0));
    let done = {
        let (stream, runs, cluster) = (stream.clone(), runs.clone(), cluster.clone());
        move || {
            let (stream, runs, mut cluster) = (stream.clone(), runs.clone(), cluster.clone());
            Box::pin(async move {
                let summary: (i64, redis::Value, redis::Value, redis::Value) =
                    redis::cmd("XPENDING")
                        .arg(&stream)
                        .arg("g")
                        .query_async(&mut cluster)
                        .await
                        .unwrap_or_else(|e| panic!("{e}"));
                runs.load(Ordering::SeqCst) == 1 && summary.0 == 0
            }) as Check
        }
    };
    let stats = run_until(&consumer, counting(&runs), Duration::from_secs(10), done)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let dead: i64 = redis::cmd("XLEN")
        .arg(format!("{stream}:dead"))
        .query_async(&mut cluster)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(dead, 1);
    assert_eq!(
        (
            stats.executed,
            stats.replayed,
            stats.dead_lettered,
            stats.acked
        ),
        (1, 1, 1, 3),
        "{stats:?}"
    );
}
