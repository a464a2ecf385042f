//! Metrics: every counter of `ConsumerStats` is a `metrics` counter
//! `idem_nats_{name}_total`, labelled with the durable consumer; what
//! `in_progress` counts.

use crate::support;

use std::time::Duration;

use idemkit::nats::{NatsConsumer, NatsMessage};
use idemkit::{Idempotency, MemoryStore};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

use super::{all_acked, create_stream, jetstream, name, publish, wait_until, Running};

/// Three messages, one a copy of another: the counters the recorder saw
/// are the consumer's stats.
#[test]
fn the_counters_are_metrics_labelled_with_the_consumer() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let durable = name("metrics");
    // A runtime of one thread under a recorder of this thread's: every
    // task of the consumer (the executor's detached handlers included)
    // counts into it.
    let stats = metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let js = jetstream().await;
            let stream = name("METRICS");
            let subject = format!("{stream}.in");
            create_stream(&js, &stream, &[&subject]).await;
            let consumer = NatsConsumer::new(
                js.clone(),
                &stream,
                &durable,
                Idempotency::new(MemoryStore::new()),
            )
            .key_header("id")
            .pull_wait(Duration::from_millis(300));
            let stop = std::sync::Arc::new(tokio::sync::Notify::new());
            let run = consumer.run(
                |m: NatsMessage| async move { Ok::<_, std::io::Error>(m.payload.len()) },
                {
                    let stop = stop.clone();
                    async move { stop.notified().await }
                },
            );
            let drive = async {
                publish(&js, &subject, &[("id", "a")], "1").await;
                publish(&js, &subject, &[("id", "b")], "2").await;
                publish(&js, &subject, &[("id", "a")], "1").await;
                wait_until("all acked", Duration::from_secs(30), || {
                    all_acked(&js, &stream, &durable)
                })
                .await;
                stop.notify_one();
            };
            let (stats, ()) = tokio::join!(run, drive);
            stats.unwrap()
        })
    });
    // One snapshot: taking one resets the recorder's counters.
    let snapshot = snapshotter.snapshot().into_vec();
    let counter = |metric: &str| {
        snapshot
            .iter()
            .find(|(k, _, _, _)| {
                k.key().name() == metric
                    && k.key()
                        .labels()
                        .any(|l| l.key() == "consumer" && l.value() == durable)
            })
            .map(|(_, _, _, v)| match v {
                DebugValue::Counter(n) => *n,
                other => panic!("{metric}: {other:?}"),
            })
            .unwrap_or(0)
    };
    // The copy may have come while the first ran (handed back, then
    // replayed): counted as it happened.
    assert_eq!(
        (stats.executed, stats.replayed, stats.acked),
        (2, 1, 3),
        "{stats:?}"
    );
    assert_eq!(counter("idem_nats_received_total"), stats.received);
    assert_eq!(counter("idem_nats_executed_total"), 2);
    assert_eq!(counter("idem_nats_replayed_total"), 1);
    assert_eq!(counter("idem_nats_acked_total"), 3);
    assert_eq!(counter("idem_nats_handed_back_total"), stats.handed_back);
    assert_eq!(counter("idem_nats_poison_total"), 0);
}

/// `ConsumerStats::in_progress` counts the deliveries whose key another
/// run held (in progress with another worker, or being finished here),
/// not those handed back because the store was away: one consumer alone,
/// its store away for 2 s when the message comes, hands it back without
/// counting it "in progress".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_progress_counts_only_keys_held_by_another_run() {
    let js = jetstream().await;
    let stream = name("STAT");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    let durable = name("stat");
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let running = Running::start(
        NatsConsumer::new(js.clone(), &stream, &durable, Idempotency::new(store))
            .key_header("key")
            .retry_delay(Duration::from_millis(200))
            .pull_wait(Duration::from_millis(500)),
        |_m: NatsMessage| async { Ok::<_, std::io::Error>(1) },
    );
    support::flaky::outage(&down, Duration::from_secs(2));
    publish(&js, &subject, &[("key", "k-1")], "{}").await;
    wait_until("acked", Duration::from_secs(30), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    let stats = running.stop().await;
    assert!(
        stats.handed_back >= 1,
        "handed back during the outage: {stats:?}"
    );
    assert_eq!(
        stats.in_progress, 0,
        "no other worker ever held the key: {stats:?}"
    );
}
