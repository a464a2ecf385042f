//! Configuration: what `run` refuses before any call (a typed error,
//! never a panic), what JetStream refuses (a stream missing, or deleted
//! under the consumer), and extreme settings clamped.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::nats::{NatsConsumer, NatsConsumerError, NatsMessage, MAX_ACK_WAIT, MAX_CONCURRENCY};
use idemkit::{Idempotency, MemoryStore};

use super::{all_acked, create_stream, jetstream, name, publish, wait_until, Running};

async fn refused(consumer: NatsConsumer<MemoryStore>) -> NatsConsumerError {
    let outcome = tokio::time::timeout(
        Duration::from_secs(30),
        consumer.run(
            |_m: NatsMessage| async { Ok::<_, std::io::Error>(()) },
            std::future::pending::<()>(),
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("run did not refuse the configuration"));
    match outcome {
        Ok(stats) => panic!("run accepted the configuration: {stats:?}"),
        Err(e) => e,
    }
}

/// Invalid names, subjects and scopes are refused by `run` before any
/// call, with a configuration error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_settings_are_refused_before_any_call() {
    let js = jetstream().await;
    let idem = || Idempotency::new(MemoryStore::new());
    let make = |stream: &str, durable: &str| NatsConsumer::new(js.clone(), stream, durable, idem());
    let cases = [
        ("an empty stream", make("", "d")),
        ("a stream name with a dot", make("a.b", "d")),
        ("an empty consumer", make("S", "")),
        ("a consumer name with a space", make("S", "a b")),
        ("an empty filter subject", make("S", "d").filter_subject("")),
        (
            "a filter subject with an empty token",
            make("S", "d").filter_subject("a..b"),
        ),
        (
            "an empty dead-letter subject",
            make("S", "d").dead_letter(""),
        ),
        (
            "a wildcard dead-letter subject",
            make("S", "d").dead_letter("dead.*"),
        ),
        (
            "a dead-letter subject the consumer reads",
            make("S", "d")
                .filter_subject("orders.>")
                .dead_letter("orders.dead"),
        ),
        ("an invalid scope", make("S", "d").scope("no spaces here")),
        ("an empty scope", make("S", "d").scope("")),
    ];
    for (what, consumer) in cases {
        let e = refused(consumer).await;
        assert!(matches!(e, NatsConsumerError::Config(_)), "{what}: {e:?}");
    }
}

/// A stream that does not exist, and a dead-letter subject the stream
/// itself captures while the consumer reads every subject of it, are
/// refused by JetStream or at binding: `run` fails (not retried forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_stream_or_a_dead_letter_subject_read_back_is_refused() {
    let js = jetstream().await;
    let missing = NatsConsumer::new(
        js.clone(),
        name("MISSING"),
        "d",
        Idempotency::new(MemoryStore::new()),
    );
    match refused(missing).await {
        NatsConsumerError::Nats(e) => assert!(!e.is_transient(), "{e}"),
        other => panic!("{other:?}"),
    }
    let stream = name("LOOP");
    create_stream(&js, &stream, &[&format!("{stream}.>")]).await;
    let looping = NatsConsumer::new(
        js.clone(),
        &stream,
        "d",
        Idempotency::new(MemoryStore::new()),
    )
    .dead_letter(format!("{stream}.dead"));
    match refused(looping).await {
        NatsConsumerError::Nats(e) => assert!(
            !e.is_transient() && e.to_string().contains("come back"),
            "{e}"
        ),
        other => panic!("{other:?}"),
    }
}

/// Zero and huge settings are clamped (`Duration::MAX` saturates), never
/// a panic or a refusal: the durable consumer gets the clamped values and
/// the consumer works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_settings_are_clamped_and_the_consumer_works() {
    let js = jetstream().await;
    let stream = name("EXTREME");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    let durable = name("extreme");
    let huge = NatsConsumer::new(
        js.clone(),
        &stream,
        &durable,
        Idempotency::new(MemoryStore::new()),
    )
    .key_from_content()
    .concurrency(usize::MAX)
    .max_ack_pending(usize::MAX)
    .batch(usize::MAX)
    .ack_wait(Duration::MAX)
    .pull_wait(Duration::MAX)
    .retry_delay(Duration::MAX)
    .shutdown_wait(Duration::MAX)
    .max_deliveries(u32::MAX);
    let running = Running::start(huge, |m: NatsMessage| async move {
        Ok::<_, std::io::Error>(m.payload.len())
    });
    publish(&js, &subject, &[], "x").await;
    wait_until("the message acked", Duration::from_secs(30), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    let info = js
        .get_stream(&stream)
        .await
        .unwrap()
        .consumer_info(&durable)
        .await
        .unwrap();
    assert_eq!(info.config.ack_wait, MAX_ACK_WAIT);
    assert_eq!(info.config.max_ack_pending, MAX_CONCURRENCY as i64);
    assert_eq!(info.config.max_deliver, -1);
    let stats = running.stop().await;
    assert_eq!(stats.executed, 1, "{stats:?}");

    let durable = name("tiny");
    let tiny = NatsConsumer::new(
        js.clone(),
        &stream,
        &durable,
        Idempotency::new(MemoryStore::new()),
    )
    .key_from_content()
    .concurrency(0)
    .max_ack_pending(0)
    .batch(0)
    .ack_wait(Duration::ZERO)
    .pull_wait(Duration::ZERO)
    .retry_delay(Duration::ZERO)
    .shutdown_wait(Duration::ZERO)
    .max_deliveries(0);
    let running = Running::start(tiny, |m: NatsMessage| async move {
        Ok::<_, std::io::Error>(m.payload.len())
    });
    wait_until(
        "the message acked by the second consumer",
        Duration::from_secs(30),
        || all_acked(&js, &stream, &durable),
    )
    .await;
    let info = js
        .get_stream(&stream)
        .await
        .unwrap()
        .consumer_info(&durable)
        .await
        .unwrap();
    assert_eq!(info.config.ack_wait, idemkit::nats::MIN_ACK_WAIT);
    assert_eq!(info.config.max_ack_pending, 1);
    let stats = running.stop().await;
    // The same payload as the first: a duplicate in its own store? No:
    // each consumer has a store of its own, so it ran.
    assert_eq!(stats.executed, 1, "{stats:?}");
}

/// A dead-letter subject that no stream captures is refused when `run`
/// binds: its dead letters could never be published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_subject_no_stream_captures_is_refused() {
    let js = jetstream().await;
    let stream = name("NODEAD");
    create_stream(&js, &stream, &[&format!("{stream}.in")]).await;
    let consumer = NatsConsumer::new(
        js.clone(),
        &stream,
        "d",
        Idempotency::new(MemoryStore::new()),
    )
    .dead_letter(format!("{}.nowhere", name("dead")));
    match refused(consumer).await {
        NatsConsumerError::Nats(e) => {
            assert!(
                !e.is_transient() && e.to_string().contains("no stream captures"),
                "{e}"
            )
        }
        other => panic!("{other:?}"),
    }
}

/// The stream deleted under a running consumer, a handler in flight:
/// `run` returns an error within 30 s, without a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_deleted_under_the_consumer_ends_run() {
    let js = jetstream().await;
    let stream = name("GONE");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    let durable = name("gone");
    let consumer = Arc::new(
        NatsConsumer::new(
            js.clone(),
            &stream,
            &durable,
            Idempotency::new(MemoryStore::new()),
        )
        .key_from_content()
        .shutdown_wait(Duration::from_secs(5))
        .pull_wait(Duration::from_millis(500)),
    );
    let started = Arc::new(AtomicUsize::new(0));
    let task = {
        let (c, s) = (consumer.clone(), started.clone());
        tokio::spawn(async move {
            c.run(
                move |_m: NatsMessage| {
                    let s = s.clone();
                    async move {
                        s.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        Ok::<_, std::io::Error>(1)
                    }
                },
                std::future::pending::<()>(),
            )
            .await
        })
    };
    publish(&js, &subject, &[], "x").await;
    let s = started.clone();
    wait_until("the handler running", Duration::from_secs(30), || {
        let n = s.load(Ordering::SeqCst);
        async move { n > 0 }
    })
    .await;
    js.delete_stream(&stream).await.unwrap();
    let out = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("run returned within 30 s of the stream's deletion")
        .expect("no panic");
    assert!(out.is_err(), "{out:?}");
}

/// A key header name no NATS header can have (a space, a ':', a
/// non-ASCII letter, empty) is refused by `run` with a configuration
/// error before any call: never a message task panicking in
/// `HeaderMap::get` on every message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_header_name_that_is_not_valid_is_refused() {
    let js = jetstream().await;
    for bad in ["order id", "order:id", "ordér-id", ""] {
        let consumer =
            NatsConsumer::new(js.clone(), "S", "d", Idempotency::new(MemoryStore::new()))
                .key_header(bad);
        let e = refused(consumer).await;
        assert!(matches!(e, NatsConsumerError::Config(_)), "{bad:?}: {e:?}");
    }
}
