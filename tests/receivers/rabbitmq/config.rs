//! Configurations `run` refuses before any call, a queue that does not
//! exist (the broker's refusal, not retried), and settings at their
//! extremes.

use crate::support;

use std::time::Duration;

use idemkit::rabbitmq::{DeadLetter, RabbitConsumer, RabbitConsumerError, RabbitMessage};
use idemkit::{Idempotency, MemoryStore};

use super::{channel, declare, drained, name, publish, Running};

/// A configuration that cannot work fails `run` before any call; a queue
/// that does not exist fails it with the broker's refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misconfiguration_and_a_missing_queue_fail_run_with_typed_errors() {
    let url = support::rabbitmq::shared_url();
    let idem = Idempotency::new(MemoryStore::new());
    let handler = |m: RabbitMessage| async move { Ok::<_, std::io::Error>(m.body.len()) };
    let run = |consumer: RabbitConsumer<MemoryStore>| async move {
        tokio::time::timeout(
            Duration::from_secs(30),
            consumer.run(handler, std::future::pending()),
        )
        .await
        .expect("run returned")
    };
    let config = |r: Result<_, RabbitConsumerError>, what: &str| match r {
        Err(RabbitConsumerError::Config(e)) => assert!(e.contains(what), "{e}"),
        other => panic!("{what}: {other:?}"),
    };
    let queue = name("config");
    config(
        run(RabbitConsumer::new(url, &queue, idem.clone()).scope("a scope with spaces")).await,
        "scope",
    );
    config(
        run(RabbitConsumer::new(url, "", idem.clone())).await,
        "queue name is empty",
    );
    config(
        run(RabbitConsumer::new(url, "q".repeat(256), idem.clone())).await,
        "over 255 bytes",
    );
    config(
        run(RabbitConsumer::new("", &queue, idem.clone())).await,
        "URI is empty",
    );
    config(
        run(RabbitConsumer::new("http://nope", &queue, idem.clone())).await,
        "does not parse",
    );
    config(
        run(RabbitConsumer::new(url, &queue, idem.clone()).dead_letter_queue(&queue)).await,
        "the queue itself",
    );
    config(
        run(RabbitConsumer::new(url, &queue, idem.clone()).dead_letter_queue("")).await,
        "empty",
    );
    let long = DeadLetter::Exchange {
        exchange: "x".repeat(300),
        routing_key: "k".into(),
    };
    config(
        run(RabbitConsumer::new(url, &queue, idem.clone()).dead_letter(long)).await,
        "over 255 bytes",
    );
    match run(RabbitConsumer::new(url, name("missing"), idem.clone())).await {
        Err(RabbitConsumerError::Refused(e)) => assert!(
            e.to_string().contains("NOT_FOUND") || e.to_string().contains("no queue"),
            "{e}"
        ),
        other => panic!("a missing queue: {other:?}"),
    }
}

/// A prefetch of zero (no limit, in AMQP) is raised to 1; zero
/// `max_deliveries` to 1; `Duration::MAX` waits and delays saturate: the
/// consumer still runs messages and stops at once when nothing is in
/// flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_at_their_extremes_neither_panic_nor_hang() {
    let queue = name("extremes");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    let consumer = RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        &queue,
        Idempotency::new(MemoryStore::new()),
    )
    .prefetch(0)
    .max_deliveries(0)
    .requeue_delay(Duration::MAX)
    .shutdown_wait(Duration::MAX)
    .transaction_wait(Duration::MAX);
    let running = Running::start(consumer, |m: RabbitMessage| async move {
        Ok::<_, std::io::Error>(m.body.len())
    });
    let big = vec![b'x'; 1 << 20];
    publish(
        &channel,
        &queue,
        &[(Some("a"), &[], b""), (Some("b"), &[], &big)],
    )
    .await;
    running
        .until("both", Duration::from_secs(30), |s| s.executed == 2)
        .await;
    let stats = tokio::time::timeout(Duration::from_secs(30), running.stop())
        .await
        .expect("stopped");
    assert_eq!(stats.acked, 2, "{stats:?}");
    assert!(drained(&queue).await);
}
