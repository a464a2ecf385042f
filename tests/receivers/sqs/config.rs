//! Configurations `run` refuses before any call, a queue that does not
//! exist (SQS's error, not transient), and settings at their extremes.

use std::time::Duration;

use idemkit::sqs::{SqsConsumer, SqsConsumerError, SqsMessage};
use idemkit::{Idempotency, MemoryStore};

use super::{client, create_queue};

/// A configuration that cannot work fails `run` before any call; a queue
/// that does not exist fails it with SQS's error, not transient.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misconfiguration_and_a_missing_queue_fail_run_with_typed_errors() {
    let client = client();
    let url = create_queue(&client, "idem-config").await;
    let idem = Idempotency::new(MemoryStore::new());
    let handler = |m: SqsMessage| async move { Ok::<_, std::io::Error>(m.body.len()) };
    let run = |consumer: SqsConsumer<MemoryStore>| async move {
        tokio::time::timeout(
            Duration::from_secs(30),
            consumer.run(handler, std::future::pending()),
        )
        .await
        .expect("run returned")
    };
    let same = SqsConsumer::new(client.clone(), &url, idem.clone()).dead_letter(&url);
    assert!(
        matches!(run(same).await, Err(SqsConsumerError::Config(e)) if e.contains("the queue itself"))
    );
    let scope = SqsConsumer::new(client.clone(), &url, idem.clone()).scope("a scope with spaces");
    assert!(matches!(run(scope).await, Err(SqsConsumerError::Config(e)) if e.contains("scope")));
    let empty = SqsConsumer::new(client.clone(), "", idem.clone());
    assert!(matches!(run(empty).await, Err(SqsConsumerError::Config(_))));
    let missing = format!("{}-gone", url);
    let gone =
        SqsConsumer::new(client.clone(), missing, idem.clone()).wait_time(Duration::from_secs(1));
    match run(gone).await {
        Err(SqsConsumerError::Sqs(e)) => {
            assert!(!e.is_transient(), "{e}");
            assert_eq!(e.operation(), "ReceiveMessage");
            let code = e.code().unwrap_or_default();
            assert!(
                code.contains("NonExistentQueue") || code.contains("QueueDoesNotExist"),
                "{e}"
            );
        }
        other => panic!("a missing queue: {other:?}"),
    }
}

/// `concurrency(n)` documents "at least 1", no upper bound: a large value
/// must not panic `run` (tokio's `Semaphore::new` panics past
/// `usize::MAX >> 3` permits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_usize_max_does_not_panic_run() {
    let client = client();
    let url = create_queue(&client, "idem-conc").await;
    let consumer = SqsConsumer::new(client.clone(), &url, Idempotency::new(MemoryStore::new()))
        .concurrency(usize::MAX)
        .wait_time(Duration::ZERO);
    let task = tokio::spawn(async move {
        consumer
            .run(
                |m: SqsMessage| async move { Ok::<_, std::io::Error>(m.body.len()) },
                tokio::time::sleep(Duration::from_millis(500)),
            )
            .await
    });
    let out = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("run returned");
    match out {
        Ok(Ok(_)) | Ok(Err(SqsConsumerError::Config(_))) => {}
        Ok(Err(e)) => panic!("run failed: {e}"),
        Err(e) => panic!("run panicked on concurrency(usize::MAX): {e}"),
    }
}
