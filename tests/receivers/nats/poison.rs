//! Poison messages: dead-lettered after `max_deliveries` failed runs, or
//! at once when they can never succeed, with the reason in headers, then
//! acked; terminated when no dead-letter subject is set. Dead letters of
//! two consumers on one subject, of messages with JetStream's publish
//! headers or near `max_payload`, refused by the dead-letter stream; a
//! store refusing calls for a while (not poison).

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::nats::async_nats::jetstream::stream;
use idemkit::nats::{
    NatsConsumer, NatsMessage, CONSUMER_HEADER, DROPPED_HEADER, MESSAGE_ID_HEADER,
    ORIGINAL_ID_HEADER, PAYLOAD_SIZE_HEADER, REASON_HEADER,
};
use idemkit::{Idempotency, MemoryStore};

use super::{
    all_acked, create_stream, holds_within, jetstream, name, publish, read_all, wait_until, Running,
};

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

/// Two durable consumers of one stream (billing and shipping, say)
/// sharing a dead-letter subject both dead-letter one poison message: the
/// dead-letter stream keeps both letters, as each consumer counts its
/// own. A dead letter's `Nats-Msg-Id` names the consumer
/// (`idem-dead.{durable}.{stream}.{sequence}`), so the duplicate window
/// drops a dead letter published twice by one consumer, never the other
/// consumer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_sharing_a_dead_letter_subject_each_keep_their_dead_letter() {
    let js = jetstream().await;
    let stream = name("SHARE");
    let subject = format!("{stream}.in");
    let dead = name("SHAREDEAD");
    let dead_subject = format!("{dead}.letters");
    create_stream(&js, &stream, &[&subject]).await;
    create_stream(&js, &dead, &[&dead_subject]).await;
    let (billing, shipping) = (name("billing"), name("shipping"));
    let consumer = |durable: &str| {
        NatsConsumer::new(
            js.clone(),
            &stream,
            durable,
            Idempotency::new(MemoryStore::new()),
        )
        .key_header("order-id")
        .pull_wait(Duration::from_millis(500))
        .dead_letter(&dead_subject)
    };
    let handler = |_m: NatsMessage| async { Ok::<_, std::io::Error>(1) };
    let a = Running::start(consumer(&billing), handler);
    let b = Running::start(consumer(&shipping), handler);
    // No `order-id` header: poison for both consumers.
    publish(&js, &subject, &[("trace", "t-1")], "{}").await;
    wait_until("both consumers acked it", Duration::from_secs(30), || {
        let (js, stream, billing, shipping) = (
            js.clone(),
            stream.clone(),
            billing.clone(),
            shipping.clone(),
        );
        async move {
            all_acked(&js, &stream, &billing).await && all_acked(&js, &stream, &shipping).await
        }
    })
    .await;
    let (sa, sb) = (a.stop().await, b.stop().await);
    assert_eq!(
        (sa.dead_lettered, sb.dead_lettered),
        (1, 1),
        "{sa:?} {sb:?}"
    );
    let letters = read_all(&js, &dead, 2).await;
    let from: Vec<_> = letters
        .iter()
        .map(|l| l.header(CONSUMER_HEADER).unwrap_or("?").to_owned())
        .collect();
    assert_eq!(
        letters.len(),
        2,
        "both consumers report the message dead-lettered and acked it, but the dead-letter stream holds only the letters of {from:?}"
    );
    let mut from = from;
    from.sort();
    let mut expected = vec![billing.clone(), shipping.clone()];
    expected.sort();
    assert_eq!(from, expected);
    for l in &letters {
        let consumer = l.header(CONSUMER_HEADER).unwrap();
        let id = format!("idem-dead.{consumer}.{stream}.1");
        assert_eq!(l.header(MESSAGE_ID_HEADER), Some(id.as_str()));
    }
}

/// A poison message carrying JetStream's publish headers
/// (`Nats-Expected-Stream`, here the source stream's own name, which that
/// stream accepts) is dead-lettered with them renamed
/// (`Idem-Orig-Nats-Expected-Stream`), so the dead-letter stream does not
/// refuse it; its own `Nats-Msg-Id` is kept as `Idem-Msg-Id` and its
/// other headers and payload as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_with_jetstream_headers_is_dead_lettered_with_them_renamed() {
    let js = jetstream().await;
    let stream = name("EXPECT");
    let subject = format!("{stream}.in");
    let dead = name("EXPECTDEAD");
    let dead_subject = format!("{dead}.letters");
    create_stream(&js, &stream, &[&subject]).await;
    create_stream(&js, &dead, &[&dead_subject]).await;
    let durable = name("expect");
    let running = Running::start(
        NatsConsumer::new(
            js.clone(),
            &stream,
            &durable,
            Idempotency::new(MemoryStore::new()),
        )
        .key_header("order-id")
        .retry_delay(Duration::from_millis(200))
        .pull_wait(Duration::from_millis(500))
        .dead_letter(&dead_subject),
        |_m: NatsMessage| async { Ok::<_, std::io::Error>(1) },
    );
    // No `order-id`: poison. The header is the publisher's guard.
    publish(
        &js,
        &subject,
        &[
            ("Nats-Expected-Stream", stream.as_str()),
            ("Nats-Msg-Id", "m-1"),
            ("trace", "t-1"),
        ],
        "{}",
    )
    .await;
    let c = running.consumer.clone();
    let settled = holds_within(Duration::from_secs(20), || {
        let (js, stream, durable, s) = (js.clone(), stream.clone(), durable.clone(), c.stats());
        async move { s.dead_lettered == 1 && all_acked(&js, &stream, &durable).await }
    })
    .await;
    let stats = running.stop().await;
    assert!(
        settled,
        "the poison message was not dead-lettered within 20 s: {stats:?}"
    );
    let letters = read_all(&js, &dead, 1).await;
    assert_eq!(letters.len(), 1);
    let l = &letters[0];
    assert_eq!(l.header("Nats-Expected-Stream"), None);
    assert_eq!(
        l.header("Idem-Orig-Nats-Expected-Stream"),
        Some(stream.as_str())
    );
    assert_eq!(l.header(ORIGINAL_ID_HEADER), Some("m-1"));
    assert_eq!(l.header("trace"), Some("t-1"));
    assert_eq!(l.header(DROPPED_HEADER), None);
    assert_eq!(l.payload, b"{}");
}

/// A poison message whose payload fits the server's `max_payload` (1 MiB
/// by default) with only 100 bytes to spare, too few for the `Idem-*`
/// headers: its dead letter goes out with the payload cut to fit
/// (`Idem-Dropped: payload tail`, `Idem-Payload-Size` the full size),
/// never a publish that fails for its size on every delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_near_max_payload_is_dead_lettered_with_its_payload_cut() {
    let js = jetstream().await;
    let max = js.client().server_info().max_payload;
    let stream = name("BIG");
    let subject = format!("{stream}.in");
    let dead = name("BIGDEAD");
    let dead_subject = format!("{dead}.letters");
    create_stream(&js, &stream, &[&subject]).await;
    create_stream(&js, &dead, &[&dead_subject]).await;
    let durable = name("big");
    let running = Running::start(
        NatsConsumer::new(
            js.clone(),
            &stream,
            &durable,
            Idempotency::new(MemoryStore::new()),
        )
        .key_header("order-id")
        .retry_delay(Duration::from_millis(200))
        .pull_wait(Duration::from_millis(500))
        .dead_letter(&dead_subject),
        |_m: NatsMessage| async { Ok::<_, std::io::Error>(1) },
    );
    let payload = "x".repeat(max - 100);
    publish(&js, &subject, &[], &payload).await;
    let c = running.consumer.clone();
    let settled = holds_within(Duration::from_secs(20), || {
        let (js, stream, durable, s) = (js.clone(), stream.clone(), durable.clone(), c.stats());
        async move { s.dead_lettered == 1 && all_acked(&js, &stream, &durable).await }
    })
    .await;
    let stats = running.stop().await;
    assert!(
        settled,
        "a poison message of {} bytes (max_payload {max}) was not dead-lettered within 20 s: {stats:?}",
        payload.len()
    );
    let letters = read_all(&js, &dead, 1).await;
    assert_eq!(letters.len(), 1);
    let l = &letters[0];
    assert_eq!(l.header(DROPPED_HEADER), Some("payload tail"));
    let size = payload.len().to_string();
    assert_eq!(l.header(PAYLOAD_SIZE_HEADER), Some(size.as_str()));
    assert!(
        !l.payload.is_empty() && l.payload.len() < payload.len(),
        "{}",
        l.payload.len()
    );
    assert!(l.payload.iter().all(|b| *b == b'x'));
}

/// The dead-letter stream refuses the whole dead letter (its
/// `max_msg_size` is under the payload, JetStream answers 400): it goes
/// out without the message's headers and payload (`Idem-Dropped:
/// headers, payload`, `Idem-Payload-Size`), in the same delivery; and
/// when the stream refuses even that (a `max_msg_size` under the
/// `Idem-*` headers), the message is terminated (`+TERM`, an error
/// logged), never handed back for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_refused_for_good_goes_out_with_less_then_the_message_is_terminated() {
    let js = jetstream().await;
    for (max_msg_size, published) in [(2048, true), (64, false)] {
        let stream = name("SMALL");
        let subject = format!("{stream}.in");
        let dead = name("SMALLDEAD");
        let dead_subject = format!("{dead}.letters");
        create_stream(&js, &stream, &[&subject]).await;
        js.create_stream(stream::Config {
            name: dead.clone(),
            subjects: vec![dead_subject.clone()],
            max_message_size: max_msg_size,
            ..Default::default()
        })
        .await
        .unwrap();
        let durable = name("small");
        let running = Running::start(
            NatsConsumer::new(
                js.clone(),
                &stream,
                &durable,
                Idempotency::new(MemoryStore::new()),
            )
            .key_header("order-id")
            .retry_delay(Duration::from_millis(200))
            .pull_wait(Duration::from_millis(500))
            .dead_letter(&dead_subject),
            |_m: NatsMessage| async { Ok::<_, std::io::Error>(1) },
        );
        // No `order-id`: poison; 4,000 bytes, over the dead stream's limit.
        let payload = "y".repeat(4000);
        publish(&js, &subject, &[("trace", "t-1")], &payload).await;
        wait_until("settled", Duration::from_secs(20), || {
            all_acked(&js, &stream, &durable)
        })
        .await;
        let stats = running.stop().await;
        assert_eq!(
            (stats.poison, stats.acked, stats.handed_back),
            (1, 1, 0),
            "max_msg_size {max_msg_size}: {stats:?}"
        );
        if published {
            assert_eq!(
                (stats.dead_lettered, stats.dead_letter_failures),
                (1, 0),
                "{stats:?}"
            );
            let letters = read_all(&js, &dead, 1).await;
            assert_eq!(letters.len(), 1);
            let l = &letters[0];
            assert_eq!(l.header(DROPPED_HEADER), Some("headers, payload"));
            assert_eq!(l.header(PAYLOAD_SIZE_HEADER), Some("4000"));
            assert_eq!(l.header("trace"), None);
            assert!(l.payload.is_empty());
            assert!(l.header(REASON_HEADER).unwrap().contains("no usable key"));
        } else {
            assert_eq!(
                (stats.dead_lettered, stats.dead_letter_failures),
                (0, 1),
                "terminated: {stats:?}"
            );
            let info = js
                .get_stream(&dead)
                .await
                .unwrap()
                .info()
                .await
                .unwrap()
                .state
                .messages;
            assert_eq!(info, 0);
        }
    }
}

/// The Redis store on a server at its `maxmemory` (with `noeviction`,
/// the policy idem-redis requires) refuses a new key's acquire with OOM
/// until memory is freed: a passing state of the store, like an outage.
/// A message that arrives meanwhile is handed back (a failed run: its
/// deliveries count toward `max_deliveries`, 10 here, one a second), not
/// dead-lettered at once, and runs once Redis has room again. (A store
/// refusing calls for longer than `max_deliveries` redeliveries
/// dead-letters messages unrun, with the store's error as the reason.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_hands_messages_back_instead_of_dead_lettering_them() {
    let redis = support::redis_server::RedisServer::start(&["--maxmemory-policy", "noeviction"]);
    let store = idemkit::redis::RedisStore::connect(&redis.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let js = jetstream().await;
    let stream = name("OOM");
    let subject = format!("{stream}.in");
    let dead = name("OOMDEAD");
    let dead_subject = format!("{dead}.letters");
    create_stream(&js, &stream, &[&subject]).await;
    create_stream(&js, &dead, &[&dead_subject]).await;
    let durable = name("oom");
    let effects = Arc::new(AtomicUsize::new(0));
    let e = effects.clone();
    let running = Running::start(
        NatsConsumer::new(js.clone(), &stream, &durable, Idempotency::new(store))
            .key_header("order-id")
            .retry_delay(Duration::from_secs(1))
            .pull_wait(Duration::from_millis(500))
            .dead_letter(&dead_subject),
        move |_m: NatsMessage| {
            let e = e.clone();
            async move {
                e.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(1)
            }
        },
    );
    let full = redis.command("CONFIG SET maxmemory 1");
    assert!(full.starts_with("+OK"), "{full}");
    publish(&js, &subject, &[("order-id", "o-1")], "{}").await;
    // Redis stays full for 3 s, then memory is freed.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let freed = redis.command("CONFIG SET maxmemory 0");
    assert!(freed.starts_with("+OK"), "{freed}");
    let settled = holds_within(Duration::from_secs(20), || {
        let (js, stream, durable) = (js.clone(), stream.clone(), durable.clone());
        async move { all_acked(&js, &stream, &durable).await }
    })
    .await;
    let stats = running.stop().await;
    assert!(settled, "{stats:?}");
    let reasons: Vec<String> = if stats.dead_lettered > 0 {
        read_all(&js, &dead, 1)
            .await
            .iter()
            .map(|l| l.header(REASON_HEADER).unwrap_or("?").to_owned())
            .collect()
    } else {
        Vec::new()
    };
    assert_eq!(
        (stats.poison, effects.load(Ordering::SeqCst)),
        (0, 1),
        "a message that came while Redis was full was dead-lettered, its handler never run: {reasons:?} {stats:?}"
    );
}
