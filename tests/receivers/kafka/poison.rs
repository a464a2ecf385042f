//! Records that cannot succeed: handlers that always fail or panic
//! (`max_deliveries`), keys acquired too often, records without a usable
//! key, payloads that do not parse or reuse a key, odd headers, a dead
//! letter near the size limit or re-driven. Each is dead-lettered with
//! its reason and committed, never retried without end, never a panic.

use crate::support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemkit::kafka::rdkafka::producer::FutureRecord;
use idemkit::kafka::rdkafka::util::Timeout;
use idemkit::kafka::{ConsumerStats, KafkaConsumer, KafkaRecord, RecordError};
use idemkit::{Idempotency, MemoryStore};

use super::{
    all_committed, committed, consumer, effect, headers_of, merge, name, payload_of, produce,
    producer, read_topic, read_topic_until, redis_store, run_until_committed, send, until, Effects,
    Ends, Letter,
};

/// Headers, value, and whether the record is usable.
type OddCase<'a> = (Vec<(&'a str, Option<&'a [u8]>)>, Option<&'a [u8]>, bool);

/// The first `n` records of a dead-letter topic (one partition), read for
/// up to 60 s: (payload, headers).
async fn dead_letters(topic: &str, n: usize) -> Vec<(String, HashMap<String, String>)> {
    read_topic(topic, n, Duration::from_secs(60))
        .await
        .iter()
        .map(|l| (payload_of(l), headers_of(l)))
        .collect()
}

/// The dead letters of `topic` by "key/payload" (key "(none)" when the
/// record has none), each with its headers, once `n` distinct ones are
/// read (for up to 60 s).
async fn dead_letters_by_record(topic: &str, n: usize) -> HashMap<String, HashMap<String, String>> {
    let letters = read_topic_until(topic, Duration::from_secs(60), move |got| {
        by_record(got).len() >= n
    })
    .await;
    by_record(&letters)
}

fn by_record(letters: &[Letter]) -> HashMap<String, HashMap<String, String>> {
    letters
        .iter()
        .map(|l| {
            let key =
                l.0.as_deref()
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .unwrap_or_else(|| "(none)".to_owned());
            (format!("{key}/{}", payload_of(l)), headers_of(l))
        })
        .collect()
}

/// Records no handler can use go to the dead-letter topic with their reason:
/// one whose handler always fails (after `max_deliveries`), one without a
/// key, one that does not parse (at once), and one reusing a key with
/// another payload; the others run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_records_go_to_the_dead_letter_topic_with_their_reason() {
    let topic = name("invoices");
    let dead = format!("{topic}.dead");
    let group = name("ledger");
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&dead, 1);
    let record =
        |key: Option<&str>, payload: &str| (0, key.map(str::to_owned), vec![], payload.to_owned());
    let ends = produce(
        &topic,
        vec![
            record(Some("ok-1"), "{\"amount\":1}"),
            record(Some("poison"), "{\"amount\":2}"), // the handler always fails
            record(None, "{\"amount\":3}"),           // no key
            record(Some("bad-json"), "{not json"),    // does not parse
            record(Some("ok-1"), "{\"amount\":99}"),  // same key, another payload
            record(Some("ok-2"), "{\"amount\":4}"),
        ],
    )
    .await;
    let calls: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let consumer = consumer(&group, &topic, Idempotency::from_arc(redis_store().await))
        .max_deliveries(3)
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(50));
    let handler = {
        let calls = calls.clone();
        move |record: KafkaRecord| {
            let calls = calls.clone();
            async move {
                let key = record.key_text()?.to_owned();
                *calls
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(key.clone())
                    .or_default() += 1;
                let body: serde_json::Value = record.json()?;
                if key == "poison" {
                    return Err(Box::<dyn std::error::Error + Send + Sync>::from(
                        "the ledger refuses it",
                    ));
                }
                Ok(body["amount"].as_u64().unwrap_or(0))
            }
        }
    };
    let stats = consumer
        .run(handler, async {
            until(
                "every record committed",
                Duration::from_secs(60),
                || async { all_committed(&group, &topic, &ends).await },
            )
            .await
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stats.executed, 2, "{stats:?}");
    assert_eq!(stats.dead_lettered, 4, "{stats:?}");
    let calls = calls.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(calls.get("poison"), Some(&3), "{calls:?}");
    assert_eq!(
        calls.get("bad-json"),
        Some(&1),
        "dead-lettered at once: {calls:?}"
    );

    // The dead-letter topic holds the four, with their reasons.
    let got = dead_letters_by_record(&dead, 4).await;
    assert_eq!(got.len(), 4, "{got:#?}");
    let reason = |k: &str| {
        got.get(k)
            .and_then(|h| h.get("idem.reason"))
            .cloned()
            .unwrap_or_else(|| panic!("no dead letter {k}: {got:#?}"))
    };
    let poison = reason("poison/{\"amount\":2}");
    assert!(
        poison.contains("the ledger refuses it") && poison.contains("failed 3 times"),
        "{poison}"
    );
    assert_eq!(
        got["poison/{\"amount\":2}"]
            .get("idem.deliveries")
            .map(String::as_str),
        Some("3")
    );
    assert_eq!(got["poison/{\"amount\":2}"].get("idem.topic"), Some(&topic));
    assert!(reason("(none)/{\"amount\":3}").contains("no key"));
    assert!(reason("bad-json/{not json").contains("does not parse"));
    assert!(reason("ok-1/{\"amount\":99}").contains("different payload"));
}

/// A record whose key was acquired `max_deliveries` times already (runs cut
/// off by consumers that died) is dead-lettered without running again; a
/// key header missing or not UTF-8 is a typed error and a dead letter,
/// never a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_whose_runs_keep_dying_is_dead_lettered_without_running_again() {
    let topic = name("transfers");
    let dead = name("transfers-dlq");
    let group = name("bank");
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&dead, 1);
    let store = redis_store().await;
    // Three earlier runs of "t-1" were cut off (their consumers died): the
    // key was acquired three times, each lease taken over after it ended.
    let key = idemkit::IdempotencyKey::new(idemkit::kafka::default_scope(&topic), "t-1")
        .unwrap_or_else(|e| panic!("{e}"));
    let attempt = Arc::new(AtomicU64::new(0));
    until("three acquisitions", Duration::from_secs(10), || {
        let (store, key, attempt) = (store.clone(), key.clone(), attempt.clone());
        async move {
            if let Ok(idemkit::Acquisition::Acquired(lease)) =
                store.acquire(&key, None, Duration::from_millis(1)).await
            {
                attempt.store(u64::from(lease.attempt), Ordering::SeqCst);
            }
            attempt.load(Ordering::SeqCst) >= 3
        }
    })
    .await;
    let ends = produce(
        &topic,
        vec![
            (
                0,
                None,
                vec![("transfer-id".to_owned(), "t-1".to_owned())],
                "1".to_owned(),
            ),
            // A key header whose value is not UTF-8 (a typed error, then the
            // dead-letter topic; never a panic).
            (0, None, vec![], "2".to_owned()),
            (
                0,
                None,
                vec![("transfer-id".to_owned(), "t-2".to_owned())],
                "3".to_owned(),
            ),
        ],
    )
    .await;
    // The second record's header, not UTF-8, sent with raw bytes.
    let offset = send(
        &topic,
        0,
        None,
        &[("transfer-id", Some(&b"\xff\xfe"[..]))],
        Some(&b"4"[..]),
    )
    .await;
    let ends = merge(ends, Ends::from([(0, offset + 1)]));
    let ran: Arc<Mutex<Vec<String>>> = Arc::default();
    let consumer = consumer(&group, &topic, Idempotency::from_arc(store.clone()))
        .key_header("transfer-id")
        .dead_letter(dead.clone())
        .max_deliveries(3);
    let handler = {
        let ran = ran.clone();
        move |record: KafkaRecord| {
            let ran = ran.clone();
            async move {
                let id = record.header_text("transfer-id")?.to_owned();
                ran.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(id.clone());
                Ok::<_, RecordError>(id)
            }
        }
    };
    let stats = consumer
        .run(handler, async {
            until(
                "every record committed",
                Duration::from_secs(60),
                || async { all_committed(&group, &topic, &ends).await },
            )
            .await
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        *ran.lock().unwrap_or_else(|p| p.into_inner()),
        vec!["t-2".to_owned()],
        "t-1 never ran again"
    );
    assert_eq!(stats.executed, 1, "{stats:?}");
    assert_eq!(stats.dead_lettered, 3, "{stats:?}");
    let letters = dead_letters(&dead, 3).await;
    let reasons: Vec<&str> = letters
        .iter()
        .filter_map(|(_, h)| h.get("idem.reason").map(String::as_str))
        .collect();
    assert_eq!(reasons.len(), 3, "{letters:#?}");
    for expected in ["acquired 4 times", "no header", "not UTF-8"] {
        assert!(
            reasons.iter().any(|r| r.contains(expected)),
            "{expected}: {reasons:?}"
        );
    }
}

/// A record no handler can use (no key) whose dead-letter copy is larger
/// than the dead-letter producer's `message.max.bytes` (librdkafka's default
/// 1,000,000: the consumer adds six `idem.*` headers to a record just under
/// it) is still dead-lettered and committed, and the partition's commit
/// point moves past it (the dead letter's produce, refused locally as
/// MsgSizeTooLarge, must not be retried forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_record_near_the_size_limit_is_dead_lettered_and_committed() {
    let topic = name("big");
    let group = name("big-g");
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&format!("{topic}.dead"), 1);
    // The largest value (no key, no header) that a producer with
    // librdkafka's default message.max.bytes sends (refused locally above).
    let p = producer();
    let mut size = 1_000_000usize;
    let big_size = loop {
        assert!(size > 990_000, "no size near the limit was accepted");
        let big = vec![b'x'; size];
        let r: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&topic).partition(0).payload(&big);
        match p.send(r, Timeout::After(Duration::from_secs(30))).await {
            Ok(_) => break size,
            Err(_) => size -= 10,
        }
    };
    let end = send(&topic, 0, Some(b"after"), &[], Some(b"2")).await + 1;
    let consumer = consumer(&group, &topic, Idempotency::new(MemoryStore::new()))
        .commit_interval(Duration::ZERO)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200));
    let handler =
        |record: KafkaRecord| async move { Ok::<_, RecordError>(record.key_text()?.to_owned()) };
    let stats = run_until_committed(
        &consumer,
        handler,
        (&group, &topic),
        end,
        Duration::from_secs(25),
    )
    .await;
    assert_eq!(
        committed(&group, &topic, 1).await.get(&0),
        Some(&end),
        "the partition never committed past the poison record of {big_size} bytes: {stats:?}"
    );
    assert_eq!(stats.dead_lettered, 1, "{stats:?}");
}

/// A dead letter produced back to its topic (the usual repair: fix, then
/// re-drive) that fails again gets a new dead letter whose first
/// `idem.reason` and `idem.topic` (what `KafkaRecord::header` and most
/// readers take) are the new ones, not those the record carried back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redriven_dead_letter_gets_its_new_reason_first() {
    let topic = name("redrive");
    let dead = format!("{topic}.dead");
    let group = name("redrive-g");
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&dead, 1);
    // As an earlier dead letter carried it back: old idem.* headers.
    let end = send(
        &topic,
        0,
        None,
        &[
            ("idem.topic", Some(b"old-topic".as_slice())),
            ("idem.offset", Some(b"41".as_slice())),
            ("idem.deliveries", Some(b"10".as_slice())),
            (
                "idem.reason",
                Some(b"handler failed: ledger timeout (failed 10 times)".as_slice()),
            ),
        ],
        Some(b"{\"amount\":5}"),
    )
    .await
        + 1;
    let consumer = consumer(&group, &topic, Idempotency::new(MemoryStore::new()))
        .commit_interval(Duration::ZERO);
    let handler =
        |record: KafkaRecord| async move { Ok::<_, RecordError>(record.key_text()?.to_owned()) };
    let stats = run_until_committed(
        &consumer,
        handler,
        (&group, &topic),
        end,
        Duration::from_secs(25),
    )
    .await;
    assert_eq!(stats.dead_lettered, 1, "{stats:?}");
    let letters = read_topic(&dead, 1, Duration::from_secs(20)).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    let headers = &letters[0].2;
    let as_record = KafkaRecord {
        headers: headers.clone(),
        ..KafkaRecord::default()
    };
    let reasons: Vec<String> = headers
        .iter()
        .filter(|(k, _)| k == "idem.reason")
        .map(|(_, v)| String::from_utf8_lossy(v.as_deref().unwrap_or_default()).into_owned())
        .collect();
    let first = as_record
        .header_text("idem.reason")
        .unwrap_or("(none)")
        .to_owned();
    assert!(
        first.contains("no key"),
        "the dead letter's idem.reason (first header) is {first:?}, not why it was dead-lettered now; all: {reasons:?}"
    );
    assert_eq!(
        as_record.header_text("idem.topic").ok(),
        Some(topic.as_str()),
        "idem.topic: {headers:?}"
    );
}

/// Input a producer can send, keyed by a header: no key header, a null
/// value, a repeated key header, a non-UTF-8 header value, a non-ASCII
/// header name, an empty key, an empty value, a tombstone, an over-long key
/// (513 bytes), a control character in the key. No panic, every usable
/// record runs once, every unusable one is dead-lettered with one reason,
/// everything is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_input_never_panics_and_every_record_settles() {
    let topic = name("odd");
    let dead = format!("{topic}.dead");
    let group = name("odd-g");
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&dead, 1);
    let long = "k".repeat(513);
    let cases: Vec<OddCase<'_>> = vec![
        (vec![], Some(b"1"), false),             // no key header
        (vec![("id", None)], Some(b"2"), false), // null value
        (
            vec![("id", Some(b"a")), ("id", Some(b"b"))],
            Some(b"3"),
            true,
        ), // repeated: "a"
        (vec![("id", Some(b"\xff\xfe"))], Some(b"4"), false), // not UTF-8
        (
            vec![("\u{ff}\u{2028}", Some(b"x")), ("id", Some(b"c"))],
            Some(b"5"),
            true,
        ), // odd name
        (vec![("id", Some(b""))], Some(b"6"), false), // empty key
        (vec![("id", Some(b"d"))], None, true),  // tombstone
        (vec![("id", Some(long.as_bytes()))], Some(b"8"), false), // too long
        (vec![("id", Some(b"e\n"))], Some(b"9"), false), // control char
        (vec![("id", Some(b"f"))], Some(b""), true), // empty value
    ];
    let mut end = 0;
    let mut expected_ok = 0;
    let mut expected_dead = 0;
    for (headers, payload, ok) in &cases {
        end = send(&topic, 0, Some(b"rk"), headers, *payload).await + 1;
        if *ok {
            expected_ok += 1;
        } else {
            expected_dead += 1;
        }
    }
    let effects: Effects = Arc::default();
    let consumer = consumer(&group, &topic, Idempotency::new(MemoryStore::new()))
        .key_header("id")
        .commit_interval(Duration::ZERO);
    let handler = {
        let effects = effects.clone();
        move |record: KafkaRecord| {
            let effects = effects.clone();
            async move {
                let id = record.header_text("id")?.to_owned();
                effect(&effects, &id);
                Ok::<_, RecordError>(id)
            }
        }
    };
    let stats = run_until_committed(
        &consumer,
        handler,
        (&group, &topic),
        end,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        committed(&group, &topic, 1).await.get(&0),
        Some(&end),
        "{stats:?}"
    );
    let effects = effects.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(effects.len(), expected_ok, "{effects:?} {stats:?}");
    assert!(effects.values().all(|n| *n == 1), "{effects:?}");
    assert_eq!(stats.dead_lettered, expected_dead as u64, "{stats:?}");
    let letters = read_topic(&dead, expected_dead, Duration::from_secs(20)).await;
    assert_eq!(letters.len(), expected_dead, "{letters:?}");
    for (_, payload, headers) in &letters {
        let reasons = headers.iter().filter(|(k, _)| k == "idem.reason").count();
        assert_eq!(reasons, 1, "{payload:?}: {headers:?}");
    }
}

/// `max_deliveries(1)` and a handler that panics: run once, dead-lettered
/// with the panic in the reason, committed; the record after it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_with_max_deliveries_one_is_dead_lettered_and_the_next_record_runs() {
    let topic = name("panic");
    let dead = format!("{topic}.dead");
    let group = name("panic-g");
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&dead, 1);
    send(&topic, 0, Some(b"boom"), &[], Some(b"1")).await;
    let end = send(&topic, 0, Some(b"fine"), &[], Some(b"2")).await + 1;
    let calls: Effects = Arc::default();
    let consumer = consumer(&group, &topic, Idempotency::new(MemoryStore::new()))
        .max_deliveries(1)
        .commit_interval(Duration::ZERO);
    let handler = {
        let calls = calls.clone();
        move |record: KafkaRecord| {
            let calls = calls.clone();
            async move {
                let id = record.key_text()?.to_owned();
                effect(&calls, &id);
                if id == "boom" {
                    panic!("handler exploded on {id}");
                }
                Ok::<_, RecordError>(id)
            }
        }
    };
    let stats = run_until_committed(
        &consumer,
        handler,
        (&group, &topic),
        end,
        Duration::from_secs(30),
    )
    .await;
    let calls = calls.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(calls.get("boom"), Some(&1), "{calls:?} {stats:?}");
    assert_eq!(calls.get("fine"), Some(&1), "{calls:?} {stats:?}");
    assert_eq!(stats.dead_lettered, 1, "{stats:?}");
    let letters = read_topic(&dead, 1, Duration::from_secs(20)).await;
    let reason = letters
        .first()
        .and_then(|l| l.2.iter().find(|(k, _)| k == "idem.reason"))
        .and_then(|(_, v)| v.clone())
        .map(|v| String::from_utf8_lossy(&v).into_owned())
        .unwrap_or_default();
    assert!(reason.contains("exploded"), "{reason:?}");
}

/// Two records with the same key, the first a tombstone (no value), the
/// second with a value. A tombstone has no fingerprint, so no payload check
/// can refuse the second; still, the record with a value must not be
/// answered with the tombstone's recorded result (a record lost): it runs,
/// or is dead-lettered as a mismatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_after_a_tombstone_of_its_key_is_not_replayed_the_tombstones_result() {
    let topic = name("tomb");
    let dead = format!("{topic}.dead");
    let group = name("tomb-g");
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&dead, 1);
    send(
        &topic,
        0,
        Some(b"acct-1"),
        &[("message-id", Some(b"m-1".as_slice()))],
        None,
    )
    .await;
    let end = send(
        &topic,
        0,
        Some(b"acct-1"),
        &[("message-id", Some(b"m-1".as_slice()))],
        Some(b"{\"credit\":500}"),
    )
    .await
        + 1;
    let ran: Arc<Mutex<Vec<Option<Vec<u8>>>>> = Arc::default();
    let consumer = consumer(&group, &topic, Idempotency::new(MemoryStore::new()))
        .key_header("message-id")
        .commit_interval(Duration::ZERO);
    let handler = {
        let ran = ran.clone();
        move |record: KafkaRecord| {
            let ran = ran.clone();
            async move {
                ran.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(record.payload.clone());
                Ok::<_, RecordError>(if record.payload.is_none() {
                    "deleted".to_owned()
                } else {
                    "credited".to_owned()
                })
            }
        }
    };
    let stats = run_until_committed(
        &consumer,
        handler,
        (&group, &topic),
        end,
        Duration::from_secs(25),
    )
    .await;
    let ran = ran.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(
        ran.len() == 2 || stats.dead_lettered == 1,
        "the record with a value neither ran nor was dead-lettered as a mismatch: runs {ran:?}, {stats:?}"
    );
}

/// With the fingerprint on the value's `/amount`, a resend whose other
/// fields differ (a timestamp set on each send) is a duplicate: replayed
/// and committed, its handler not run again; the same key with another
/// amount is a payload mismatch, dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_that_differs_outside_the_fingerprinted_parts_is_a_duplicate() {
    let topic = name("parts");
    let dead = format!("{topic}.dead");
    let group = name("parts-g");
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&dead, 1);
    let first = br#"{"amount":100,"sent_at":"10:00:00"}"#;
    let resend = br#"{"sent_at":"10:00:07","amount":100}"#;
    let other = br#"{"amount":200,"sent_at":"10:00:09"}"#;
    let mut end = 0;
    for value in [&first[..], &resend[..], &other[..]] {
        end = send(
            &topic,
            0,
            Some(b"acct-1"),
            &[("message-id", Some(b"pay-1".as_slice()))],
            Some(value),
        )
        .await
            + 1;
    }
    let (ran, stats) =
        run_fingerprinting_amount(&group, &topic, end, |c| c.key_header("message-id")).await;
    assert_eq!(ran, [String::from_utf8_lossy(first)], "{stats:?}");
    assert_eq!(
        (stats.executed, stats.replayed, stats.dead_lettered),
        (1, 1, 1),
        "{stats:?}"
    );
    let letters = dead_letters(&dead, 1).await;
    assert_eq!(letters[0].0.as_bytes(), other);
    let reason = letters[0].1.get("idem.reason").cloned().unwrap_or_default();
    assert!(reason.contains("different payload"), "{reason}");
}

/// With keys from the content and a fingerprint of parts of the value, the
/// key is the hash of the record key and those parts: a resend whose
/// other fields differ shares the first send's key and is replayed, its
/// handler not run again; another amount is another key and runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_keyed_by_content_is_a_duplicate_when_only_parts_count() {
    let topic = name("parts-content");
    let group = name("parts-content-g");
    support::kafka::create_topic(&topic, 1);
    let values: [&[u8]; 3] = [
        br#"{"amount":100,"sent_at":"10:00:00"}"#,
        br#"{"sent_at":"10:00:07","amount":100}"#,
        br#"{"amount":200,"sent_at":"10:00:09"}"#,
    ];
    let mut end = 0;
    for value in values {
        end = send(&topic, 0, Some(b"acct-1"), &[], Some(value)).await + 1;
    }
    // Two keys: their records run side by side; `ran` comes sorted.
    let (ran, stats) =
        run_fingerprinting_amount(&group, &topic, end, |c| c.key_from_content()).await;
    let expected: Vec<String> = [values[0], values[2]]
        .iter()
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    assert_eq!(ran, expected, "{stats:?}");
    assert_eq!(
        (stats.executed, stats.replayed, stats.dead_lettered),
        (2, 1, 0),
        "{stats:?}"
    );
}

/// Runs a consumer of partition 0 of `topic` (keys as `keyed` sets them,
/// the fingerprint on the value's `/amount`) until `end` is committed:
/// the values whose handler ran, sorted, and the stats.
async fn run_fingerprinting_amount(
    group: &str,
    topic: &str,
    end: i64,
    keyed: impl FnOnce(KafkaConsumer<MemoryStore>) -> KafkaConsumer<MemoryStore>,
) -> (Vec<String>, ConsumerStats) {
    let ran: Arc<Mutex<Vec<String>>> = Arc::default();
    let parts =
        idemkit::PayloadFingerprint::json_pointers(["/amount"]).unwrap_or_else(|e| panic!("{e}"));
    let consumer = keyed(consumer(group, topic, Idempotency::new(MemoryStore::new())))
        .fingerprint(parts)
        .commit_interval(Duration::ZERO);
    let handler = {
        let ran = ran.clone();
        move |record: KafkaRecord| {
            let ran = ran.clone();
            async move {
                let value = record.text()?.to_owned();
                ran.lock().unwrap_or_else(|p| p.into_inner()).push(value);
                Ok::<_, RecordError>("charged".to_owned())
            }
        }
    };
    let stats = run_until_committed(
        &consumer,
        handler,
        (group, topic),
        end,
        Duration::from_secs(25),
    )
    .await;
    let mut ran = ran.lock().unwrap_or_else(|p| p.into_inner()).clone();
    ran.sort();
    (ran, stats)
}
