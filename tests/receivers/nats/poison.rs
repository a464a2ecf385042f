//! Poison messages: dead-lettered after `max_deliveries` failed runs, or
//! at once when they can never succeed, with the reason in headers, then
//! acked; terminated when no dead-letter subject is set.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::nats::{NatsConsumer, NatsMessage, REASON_HEADER};
use idemkit::{Idempotency, MemoryStore};

use super::{all_acked, create_stream, jetstream, name, publish, read_all, wait_until, Running};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A message whose handler always fails is handed back until its delivery
/// count reaches `max_deliveries` (3), then published to the dead-letter
/// subject with its payload, its headers and the reason, and acked. A
/// message without a usable key and one whose payload the handler cannot
/// parse (a `MessageError`) are dead-lettered at once, without a second
/// run; a good message beside them runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_is_dead_lettered_with_its_reason_and_acked() {
    let js = jetstream().await;
    let stream = name("POISON");
    let subject = format!("{stream}.in");
    let dead_stream = name("DEAD");
    let dead_subject = format!("{dead_stream}.letters");
    create_stream(&js, &stream, &[&subject]).await;
    create_stream(&js, &dead_stream, &[&dead_subject]).await;
    let runs = Arc::new(std::sync::Mutex::new(std::collections::HashMap::<
        String,
        usize,
    >::new()));
    let handler = {
        let runs = runs.clone();
        move |m: NatsMessage| {
            let runs = runs.clone();
            async move {
                let id = m.header_text("message-id")?.to_owned();
                *runs.lock().unwrap().entry(id.clone()).or_default() += 1;
                match id.as_str() {
                    "fails" => Err::<u64, BoxError>("the card processor is down".into()),
                    _ => Ok(m.json::<u64>()?),
                }
            }
        }
    };
    let durable = name("poison");
    let running = Running::start(
        NatsConsumer::new(
            js.clone(),
            &stream,
            &durable,
            Idempotency::new(MemoryStore::new()),
        )
        .key_header("message-id")
        .max_deliveries(3)
        .retry_delay(Duration::from_millis(100))
        .pull_wait(Duration::from_millis(500))
        .dead_letter(&dead_subject),
        handler,
    );
    publish(
        &js,
        &subject,
        &[("message-id", "fails"), ("trace", "t-1")],
        "1",
    )
    .await;
    publish(&js, &subject, &[("trace", "t-2")], "2").await;
    publish(&js, &subject, &[("message-id", "not-json")], "{").await;
    publish(&js, &subject, &[("message-id", "good")], "7").await;
    wait_until("every message acked", Duration::from_secs(60), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    let stats = running.stop().await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.get("fails"), Some(&3), "{runs:?}");
    assert_eq!(runs.get("not-json"), Some(&1), "{runs:?}");
    assert_eq!(runs.get("good"), Some(&1), "{runs:?}");
    assert_eq!((stats.poison, stats.dead_lettered), (3, 3), "{stats:?}");
    assert_eq!(stats.executed, 1, "{stats:?}");
    assert!(stats.handed_back >= 2, "{stats:?}");

    let letters = read_all(&js, &dead_stream, 3).await;
    assert_eq!(letters.len(), 3);
    let by_trace = |t: &str| letters.iter().find(|l| l.header("trace") == Some(t));
    let failed = by_trace("t-1").unwrap();
    let reason = failed.header(REASON_HEADER).unwrap();
    assert!(
        reason.contains("max_deliveries 3") && reason.contains("the card processor is down"),
        "{reason}"
    );
    assert_eq!(failed.header("Idem-Delivered"), Some("3"));
    assert_eq!(failed.header("Idem-Stream"), Some(stream.as_str()));
    assert_eq!(failed.header("Idem-Subject"), Some(subject.as_str()));
    assert_eq!(failed.header("message-id"), Some("fails"));
    assert_eq!(failed.payload, b"1");
    assert!(failed.subject == dead_subject);
    let keyless = by_trace("t-2").unwrap();
    let reason = keyless.header(REASON_HEADER).unwrap();
    assert!(
        reason.contains("no usable key") && reason.contains("message-id"),
        "{reason}"
    );
    assert_eq!(keyless.header("Idem-Delivered"), Some("1"));
    let not_json = letters
        .iter()
        .find(|l| l.header("message-id") == Some("not-json"))
        .unwrap();
    assert!(not_json
        .header(REASON_HEADER)
        .unwrap()
        .contains("does not parse"));
}

/// Without a dead-letter subject, a poison message is terminated (`+TERM`)
/// after `max_deliveries` runs: JetStream delivers it no more, nothing is
/// left unacked, and it is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_without_a_dead_letter_subject_is_terminated() {
    let js = jetstream().await;
    let stream = name("TERM");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let durable = name("term");
    let r = runs.clone();
    let running = Running::start(
        NatsConsumer::new(
            js.clone(),
            &stream,
            &durable,
            Idempotency::new(MemoryStore::new()),
        )
        .key_from_content()
        .max_deliveries(2)
        .retry_delay(Duration::ZERO)
        .pull_wait(Duration::from_millis(500)),
        move |_m: NatsMessage| {
            let r = r.clone();
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(std::io::Error::other("always"))
            }
        },
    );
    publish(&js, &subject, &[], "x").await;
    wait_until("the message terminated", Duration::from_secs(30), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    // Nothing comes back: a second pull round finds nothing.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stats = running.stop().await;
    assert_eq!(runs.load(Ordering::SeqCst), 2, "{stats:?}");
    assert_eq!(
        (stats.poison, stats.dead_lettered, stats.received),
        (1, 0, 2),
        "{stats:?}"
    );
}
