//! Messages that cannot succeed: a handler that always fails (after
//! `max_deliveries` receives), a key reused with another body, messages
//! without a usable key, extreme bodies and attributes. Each gets its typed
//! outcome: dead-lettered with its reason and attributes, or left to the
//! queue's redrive policy when there is no dead-letter queue.

use std::sync::Arc;
use std::time::Duration;

use idemkit::sqs::aws_sdk_sqs::primitives::Blob;
use idemkit::sqs::aws_sdk_sqs::types::{Message, MessageAttributeValue, QueueAttributeName};
use idemkit::sqs::{SqsConsumer, SqsMessage};
use idemkit::{Idempotency, MemoryStore};

use super::{
    addr_of, attr, client, client_at, create_queue, create_queue_with, dead_of, queue_empty, send,
    take_dead, take_dead_within, text, wait_until, Effects, Running,
};
use crate::support;

/// A message whose handler always fails is dead-lettered after
/// `max_deliveries` receives, with the reason attributes and its own
/// attributes (within SQS's 10); a payload mismatch (the key of an earlier
/// message with another body) is dead-lettered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn poison_dead_lettered_after_max_deliveries_and_a_mismatch_at_once() {
    let client = client();
    let url = create_queue(&client, "idem-poison").await;
    let dlq = create_queue(&client, "idem-poison-dead").await;
    let runs: Effects = Arc::default();
    let r = runs.clone();
    let consumer = SqsConsumer::new(client.clone(), &url, Idempotency::new(MemoryStore::new()))
        .key_attribute("key")
        .max_deliveries(3)
        .visibility_timeout(Duration::from_secs(5))
        .retry_visibility(Duration::ZERO)
        .wait_time(Duration::from_secs(1))
        .dead_letter(&dlq);
    let running = Running::start(consumer, move |m: SqsMessage| {
        let runs = r.clone();
        async move {
            *runs.lock().unwrap().entry(m.body.clone()).or_default() += 1;
            if m.body == "poison" {
                return Err("always fails".into());
            }
            Ok(m.body.len())
        }
    });
    // The poison carries 9 attributes: with our 4, only 5 fit.
    let mut attributes = vec![("key", text("p-1"))];
    let extra: Vec<String> = (1..=8).map(|i| format!("a{i}")).collect();
    attributes.extend(extra.iter().map(|n| (n.as_str(), text("v"))));
    let poison = send(&client, &url, "poison", &attributes).await;
    send(&client, &url, "first", &[("key", text("g-1"))]).await;
    let r = runs.clone();
    wait_until(
        "the first message of g-1 ran",
        Duration::from_secs(30),
        || {
            let done = r.lock().unwrap().get("first") == Some(&1);
            async move { done }
        },
    )
    .await;
    let mismatch = send(&client, &url, "second", &[("key", text("g-1"))]).await;

    let dead = take_dead(&client, &dlq, 2).await;
    wait_until("the queue empty", Duration::from_secs(30), || {
        queue_empty(&client, &url)
    })
    .await;
    let stats = running.stop().await;

    let p = dead_of(&dead, &poison);
    assert_eq!(p.body(), Some("poison"));
    let reason = attr(p, "idem.reason").unwrap();
    assert!(
        reason.contains("always fails") && reason.contains("received 3 times"),
        "{reason}"
    );
    assert_eq!(attr(p, "idem.receive_count"), Some("3"));
    assert_eq!(attr(p, "idem.source_queue"), Some(url.as_str()));
    let kept = p.message_attributes().unwrap();
    assert!(kept.len() <= 10, "{kept:?}");
    assert_eq!(
        attr(p, "key"),
        Some("p-1"),
        "the key attribute is kept first"
    );
    assert!(kept.contains_key("a1") && kept.contains_key("a4") && !kept.contains_key("a5"));
    let dropped = attr(p, "idem.dropped").unwrap();
    assert!(
        dropped.starts_with("4 of") && dropped.contains("a5, a6, a7, a8"),
        "{dropped}"
    );
    assert_eq!(
        runs.lock().unwrap().get("poison"),
        Some(&3),
        "the handler ran max_deliveries times: {stats:?}"
    );

    let m = dead_of(&dead, &mismatch);
    assert_eq!(m.body(), Some("second"));
    let reason = attr(m, "idem.reason").unwrap();
    assert!(reason.contains("different payload"), "{reason}");
    assert_eq!(
        attr(m, "idem.receive_count"),
        Some("1"),
        "dead-lettered at once"
    );
    assert_eq!(attr(m, "key"), Some("g-1"));
    assert_eq!(
        runs.lock().unwrap().get("second"),
        None,
        "a mismatch never runs"
    );

    assert_eq!(
        (stats.dead_lettered, stats.poison, stats.executed),
        (2, 2, 1),
        "{stats:?}"
    );
    assert_eq!(
        stats.left_for_redelivery, 2,
        "the poison's first two failures: {stats:?}"
    );
}

/// A dead letter that reaches the dead-letter queue later than the
/// visibility timeout (a slow link): the message is kept invisible until it is
/// deleted, so it is dead-lettered once and never received again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_slower_than_the_visibility_timeout_is_sent_once() {
    // A moto of its own: the shared one, busy with the other tests, may
    // answer a renewal later than the visibility timeout.
    let moto = support::moto::MotoServer::start();
    let client = client_at(&moto.url);
    let url = create_queue(&client, "idem-slowdead").await;
    let dlq = create_queue(&client, "idem-slowdead-dead").await;
    let proxy = support::proxy::CountingProxy::start(addr_of(&moto.url)).await;
    proxy.delay_requests_to(b"AmazonSQS.SendMessage\r", Duration::from_secs(9));
    let through = client_at(&format!("http://{}", proxy.addr));
    let runs: Effects = Arc::default();
    let r = runs.clone();
    let consumer = SqsConsumer::new(through, &url, Idempotency::new(MemoryStore::new()))
        .key_attribute("key")
        .max_deliveries(1)
        .visibility_timeout(Duration::from_secs(4))
        .wait_time(Duration::from_secs(1))
        .call_timeout(Duration::from_secs(30))
        .dead_letter(&dlq);
    let running = Running::start(consumer, move |m: SqsMessage| {
        let runs = r.clone();
        async move {
            *runs.lock().unwrap().entry(m.body.clone()).or_default() += 1;
            Err("always fails".into())
        }
    });
    let poison = send(&client, &url, "poison", &[("key", text("slow-1"))]).await;
    let dead = take_dead(&client, &dlq, 1).await;
    wait_until("the queue empty", Duration::from_secs(30), || {
        queue_empty(&client, &url)
    })
    .await;
    let stats = running.stop().await;
    assert_eq!(dead_of(&dead, &poison).body(), Some("poison"));
    assert!(
        proxy.delayed() >= 1,
        "no dead letter went through the proxy"
    );
    assert_eq!(runs.lock().unwrap().get("poison"), Some(&1), "{stats:?}");
    assert_eq!(
        (stats.received, stats.poison, stats.dead_lettered),
        (1, 1, 1),
        "received again while its dead letter was on its way: {stats:?}"
    );
    let more = take_dead_within(&client, &dlq, Duration::from_secs(2)).await;
    assert!(more.is_empty(), "a second dead letter: {more:?}");
}

/// Without a dead-letter queue, poison is left to the queue's redrive
/// policy: SQS (here moto) moves it after `maxReceiveCount` receives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_a_dead_letter_queue_poison_goes_by_the_redrive_policy() {
    let client = client();
    let dlq = create_queue(&client, "idem-redrive-dead").await;
    let arn = client
        .get_queue_attributes()
        .queue_url(&dlq)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap()
        .attributes()
        .unwrap()
        .get(&QueueAttributeName::QueueArn)
        .unwrap()
        .clone();
    let policy = format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"2"}}"#);
    let url = create_queue_with(
        &client,
        "idem-redrive",
        &[(QueueAttributeName::RedrivePolicy, policy)],
    )
    .await;
    let consumer = SqsConsumer::new(client.clone(), &url, Idempotency::new(MemoryStore::new()))
        .key_attribute("key")
        .max_deliveries(5)
        .visibility_timeout(Duration::from_secs(2))
        .retry_visibility(Duration::ZERO)
        .wait_time(Duration::from_secs(1));
    let running = Running::start(consumer, |m: SqsMessage| async move {
        if m.body == "poison" {
            return Err("always fails".into());
        }
        Ok(m.body.len())
    });
    let poison = send(&client, &url, "poison", &[("key", text("p-1"))]).await;
    let no_key = send(&client, &url, "no key", &[]).await;
    let dead = take_dead(&client, &dlq, 2).await;
    wait_until("the queue empty", Duration::from_secs(30), || {
        queue_empty(&client, &url)
    })
    .await;
    let stats = running.stop().await;
    let mut ids: Vec<&str> = dead.iter().filter_map(Message::message_id).collect();
    ids.sort_unstable();
    let mut want = vec![poison.as_str(), no_key.as_str()];
    want.sort_unstable();
    assert_eq!(ids, want, "SQS moved both (a redrive keeps the message ID)");
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert_eq!(
        stats.poison, 2,
        "the message without a key, on each of its 2 receives: {stats:?}"
    );
}

/// Extremes: an empty body (moto accepts it; SQS does not), a key
/// attribute of 513 bytes, a binary key attribute, a message without the
/// key attribute, a 256 KiB body (sent twice: replayed), a body the
/// handler refuses (a `MessageError`): each gets its typed outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn extreme_messages_get_typed_outcomes() {
    let client = client();
    let url = create_queue(&client, "idem-extremes").await;
    let dlq = create_queue(&client, "idem-extremes-dead").await;
    let runs: Effects = Arc::default();
    let r = runs.clone();
    let consumer = SqsConsumer::new(client.clone(), &url, Idempotency::new(MemoryStore::new()))
        .key_attribute("key")
        .visibility_timeout(Duration::from_secs(5))
        .retry_visibility(Duration::ZERO)
        .wait_time(Duration::from_secs(1))
        .dead_letter(&dlq);
    let running = Running::start(consumer, move |m: SqsMessage| {
        let runs = r.clone();
        async move {
            *runs
                .lock()
                .unwrap()
                .entry(m.attribute_text("key").unwrap_or("?").to_owned())
                .or_default() += 1;
            if m.attribute("parse").is_some() {
                let _: serde_json::Value = m.json()?;
            }
            Ok(m.body.len())
        }
    });
    let big = "b".repeat(256 * 1024);
    let binary = MessageAttributeValue::builder()
        .data_type("Binary")
        .binary_value(Blob::new(b"k-1".to_vec()))
        .build()
        .unwrap();
    send(&client, &url, "", &[("key", text("empty-1"))]).await;
    let long_key = send(
        &client,
        &url,
        "long key",
        &[("key", text(&"k".repeat(513)))],
    )
    .await;
    let binary_key = send(&client, &url, "binary key", &[("key", binary)]).await;
    let no_key = send(&client, &url, "no key", &[]).await;
    send(&client, &url, &big, &[("key", text("big-1"))]).await;
    send(&client, &url, &big, &[("key", text("big-1"))]).await;
    let bad_json = send(
        &client,
        &url,
        "{not json",
        &[("key", text("json-1")), ("parse", text("1"))],
    )
    .await;

    let dead = take_dead(&client, &dlq, 4).await;
    wait_until("the queue empty", Duration::from_secs(30), || {
        queue_empty(&client, &url)
    })
    .await;
    let stats = running.stop().await;

    let reason = |id: &str| attr(dead_of(&dead, id), "idem.reason").unwrap().to_owned();
    let r = reason(&long_key);
    assert!(
        r.contains("no usable key") && r.contains("513 bytes, the limit is 512"),
        "{r}"
    );
    assert_eq!(dead_of(&dead, &long_key).body(), Some("long key"));
    let r = reason(&binary_key);
    assert!(r.contains("binary, not text"), "{r}");
    let r = reason(&no_key);
    assert!(r.contains(r#"no attribute "key""#), "{r}");
    let r = reason(&bad_json);
    assert!(r.contains("does not parse"), "{r}");
    assert_eq!(
        attr(dead_of(&dead, &bad_json), "idem.receive_count"),
        Some("1"),
        "dead-lettered at once"
    );

    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.get("empty-1"), Some(&1), "{runs:?}");
    assert_eq!(
        runs.get("big-1"),
        Some(&1),
        "the second copy replayed: {runs:?}"
    );
    assert_eq!(runs.get("json-1"), Some(&1), "{runs:?}");
    assert_eq!(
        runs.len(),
        3,
        "no handler ran for the messages without a usable key: {runs:?}"
    );
    assert_eq!(
        (stats.executed, stats.replayed, stats.dead_lettered),
        (2, 1, 4),
        "{stats:?}"
    );
}

/// With the fingerprint on the body's `/amount` and `/account`, a resend
/// whose other fields differ (a timestamp set on each send) is a duplicate:
/// replayed and deleted, its handler not run again; the same key with
/// another amount is a payload mismatch, dead-lettered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resend_that_differs_outside_the_fingerprinted_parts_is_a_duplicate() {
    let client = client();
    let url = create_queue(&client, "idem-parts").await;
    let dlq = create_queue(&client, "idem-parts-dead").await;
    let runs: Effects = Arc::default();
    let r = runs.clone();
    let parts = idemkit::PayloadFingerprint::json_pointers(["/amount", "/account"])
        .unwrap_or_else(|e| panic!("{e}"));
    let consumer = SqsConsumer::new(client.clone(), &url, Idempotency::new(MemoryStore::new()))
        .key_attribute("key")
        .fingerprint(parts)
        .visibility_timeout(Duration::from_secs(5))
        .wait_time(Duration::from_secs(1))
        .dead_letter(&dlq);
    let running = Running::start(consumer, move |m: SqsMessage| {
        let runs = r.clone();
        async move {
            *runs.lock().unwrap().entry(m.body.clone()).or_default() += 1;
            Ok(m.body.len())
        }
    });
    let first = r#"{"amount":100,"account":"a-1","sent_at":"10:00:00"}"#;
    send(&client, &url, first, &[("key", text("pay-1"))]).await;
    let r = runs.clone();
    wait_until("the first send ran", Duration::from_secs(30), || {
        let done = r.lock().unwrap().get(first) == Some(&1);
        async move { done }
    })
    .await;
    let resend = r#"{"sent_at":"10:00:07","account":"a-1","amount":100}"#;
    send(&client, &url, resend, &[("key", text("pay-1"))]).await;
    let other = r#"{"amount":200,"account":"a-1","sent_at":"10:00:09"}"#;
    let mismatch = send(&client, &url, other, &[("key", text("pay-1"))]).await;

    let dead = take_dead(&client, &dlq, 1).await;
    wait_until("the queue empty", Duration::from_secs(30), || {
        queue_empty(&client, &url)
    })
    .await;
    let stats = running.stop().await;
    let m = dead_of(&dead, &mismatch);
    assert_eq!(m.body(), Some(other));
    let reason = attr(m, "idem.reason").unwrap();
    assert!(reason.contains("different payload"), "{reason}");
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.get(first), Some(&1), "{runs:?}");
    assert_eq!(runs.get(resend), None, "the resend was replayed: {runs:?}");
    assert_eq!(runs.get(other), None, "a mismatch never runs: {runs:?}");
    assert_eq!(
        (stats.executed, stats.replayed, stats.dead_lettered),
        (1, 1, 1),
        "{stats:?}"
    );
}

/// With `key_from_content` and a fingerprint of parts of the body, the
/// key is the hash of those parts: a resend that differs elsewhere (a
/// timestamp set on each send) shares the first send's key and is
/// replayed, its handler not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resend_keyed_by_content_is_a_duplicate_when_only_parts_count() {
    let client = client();
    let url = create_queue(&client, "idem-parts-content").await;
    let runs: Effects = Arc::default();
    let r = runs.clone();
    let parts = idemkit::PayloadFingerprint::json_pointers(["/amount", "/account"])
        .unwrap_or_else(|e| panic!("{e}"));
    let consumer = SqsConsumer::new(client.clone(), &url, Idempotency::new(MemoryStore::new()))
        .key_from_content()
        .fingerprint(parts)
        .visibility_timeout(Duration::from_secs(5))
        .wait_time(Duration::from_secs(1));
    let running = Running::start(consumer, move |m: SqsMessage| {
        let runs = r.clone();
        async move {
            *runs.lock().unwrap().entry(m.body.clone()).or_default() += 1;
            Ok(m.body.len())
        }
    });
    let first = r#"{"amount":100,"account":"a-1","sent_at":"10:00:00"}"#;
    send(&client, &url, first, &[]).await;
    let r = runs.clone();
    wait_until("the first send ran", Duration::from_secs(30), || {
        let done = r.lock().unwrap().get(first) == Some(&1);
        async move { done }
    })
    .await;
    let resend = r#"{"amount":100,"account":"a-1","sent_at":"10:00:07"}"#;
    send(&client, &url, resend, &[]).await;
    wait_until("the queue empty", Duration::from_secs(30), || {
        queue_empty(&client, &url)
    })
    .await;
    let stats = running.stop().await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(
        (stats.executed, stats.replayed),
        (1, 1),
        "the resend of the same payment ran again: {runs:?} {stats:?}"
    );
}
