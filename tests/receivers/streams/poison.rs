//! Entries that cannot succeed: a handler that always fails (dead-lettered
//! after `max_deliveries`), entries without a usable key or reusing a key
//! with another payload (at once, never run), field names that are not
//! UTF-8 (never merged). Each goes to the dead-letter stream with its
//! reason and fields and is acknowledged; nothing is left pending.

use crate::support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemkit::redis::redis;
use idemkit::redis::streams::{StreamConsumer, StreamEntry};
use idemkit::Idempotency;

use super::{
    conn, consumer_on, entries_of, nothing_pending, pending, redis_store, run_until, xadd, Check,
};

/// An entry whose handler always fails is delivered `max_deliveries` times
/// (its first read, then reclaims), then goes to the dead-letter stream with
/// its ID, its delivery count and the reason, and is acknowledged: nothing
/// is left pending, no reclaim without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_always_fails_is_dead_lettered_after_max_deliveries() {
    let stream = format!("poison-{:08x}", fastrand::u32(..));
    let poison = xadd(&stream, &[("message_id", "poison"), ("amount", "1")]).await;
    xadd(&stream, &[("message_id", "fine"), ("amount", "2")]).await;
    let consumer = consumer_on(&stream, "c", Idempotency::new(redis_store().await))
        .await
        .block(Duration::from_millis(50))
        .claim_idle(Duration::from_millis(200))
        .max_deliveries(3);
    let runs = Arc::new(Mutex::new(HashMap::<String, u32>::new()));
    let handler = {
        let runs = runs.clone();
        move |entry: StreamEntry| {
            let runs = runs.clone();
            async move {
                let id = entry.text("message_id").unwrap_or_default().to_owned();
                *runs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(id.clone())
                    .or_default() += 1;
                if id == "poison" {
                    Err(std::io::Error::other("the gateway refuses it"))
                } else {
                    Ok("charged".to_owned())
                }
            }
        }
    };
    let dead = format!("{stream}:dead");
    let done = {
        let (stream, dead) = (stream.clone(), dead.clone());
        move || {
            let (stream, dead) = (stream.clone(), dead.clone());
            Box::pin(async move {
                pending(&stream, "g").await == 0 && !entries_of(&dead).await.is_empty()
            }) as Check
        }
    };
    let stats = run_until(&consumer, handler, Duration::from_secs(20), done)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let runs = runs.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let dead_entries = entries_of(&dead).await;
    println!("runs {runs:?}; {stats:?}; dead letter {dead_entries:?}");
    assert_eq!(
        runs.get("poison"),
        Some(&3),
        "the poison ran once per delivery"
    );
    assert_eq!(runs.get("fine"), Some(&1));
    assert_eq!(dead_entries.len(), 1, "{dead_entries:?}");
    let fields = &dead_entries[0].1;
    assert_eq!(fields.get("idem.entry"), Some(&poison));
    assert_eq!(fields.get("idem.stream"), Some(&stream));
    assert_eq!(fields.get("idem.deliveries").map(String::as_str), Some("3"));
    let reason = fields.get("idem.reason").cloned().unwrap_or_default();
    assert!(reason.contains("the gateway refuses it"), "{reason}");
    assert_eq!(fields.get("message_id").map(String::as_str), Some("poison"));
    assert_eq!(fields.get("amount").map(String::as_str), Some("1"));
    assert_eq!(
        (stats.executed, stats.dead_lettered, stats.acked),
        (1, 1, 2),
        "{stats:?}"
    );
    assert_eq!(pending(&stream, "g").await, 0);
}

/// Entries that can never succeed go to the dead-letter
/// stream at once (delivery 1), without running the handler: one without
/// the key field, and one that reuses a key with another payload
/// (mismatch). A duplicate of a key whose result was not recordable is
/// acknowledged (`ResultUnavailable`), never dead-lettered nor run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_that_can_never_succeed_are_dead_lettered_at_once() {
    let stream = format!("never-{:08x}", fastrand::u32(..));
    xadd(&stream, &[("message_id", "m-1"), ("amount", "10")]).await;
    let no_key = xadd(&stream, &[("amount", "20")]).await;
    let nan_first = xadd(&stream, &[("message_id", "nan"), ("amount", "30")]).await;
    let consumer = consumer_on(&stream, "c", Idempotency::new(redis_store().await))
        .await
        .block(Duration::from_millis(50))
        .claim_idle(Duration::from_secs(60))
        .max_deliveries(5);
    let runs = Arc::new(AtomicU64::new(0));
    // m-1 answers a number; "nan" answers NaN, which JSON cannot record.
    let handler = {
        let runs = runs.clone();
        move |entry: StreamEntry| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(if entry.text("message_id") == Some("nan") {
                    f64::NAN
                } else {
                    1.0
                })
            }
        }
    };
    let dead = format!("{stream}:dead");
    let first_batch = {
        let (stream, runs) = (stream.clone(), runs.clone());
        move || {
            let (stream, runs) = (stream.clone(), runs.clone());
            Box::pin(
                async move { runs.load(Ordering::SeqCst) == 2 && pending(&stream, "g").await == 0 },
            ) as Check
        }
    };
    let stats = run_until(
        &consumer,
        handler.clone(),
        Duration::from_secs(10),
        first_batch,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (stats.executed, stats.dead_lettered, stats.acked),
        (2, 1, 3),
        "{stats:?}"
    );
    // Later: m-1 again with another amount (a mismatch), and a duplicate
    // of "nan" (not replayable).
    let mismatch = xadd(&stream, &[("message_id", "m-1"), ("amount", "11")]).await;
    let nan_again = xadd(&stream, &[("message_id", "nan"), ("amount", "30")]).await;
    let second_batch = nothing_pending(&stream);
    let stats = run_until(&consumer, handler, Duration::from_secs(10), second_batch)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let dead_entries = entries_of(&dead).await;
    println!("{stats:?}; dead letter {dead_entries:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2, "no handler ran again");
    let dead_ids: Vec<&str> = dead_entries
        .iter()
        .filter_map(|(_, f)| f.get("idem.entry").map(String::as_str))
        .collect();
    assert_eq!(dead_ids, vec![no_key.as_str(), mismatch.as_str()]);
    for (_, fields) in &dead_entries {
        assert_eq!(fields.get("idem.deliveries").map(String::as_str), Some("1"));
    }
    let reasons: Vec<&str> = dead_entries
        .iter()
        .filter_map(|(_, f)| f.get("idem.reason").map(String::as_str))
        .collect();
    assert!(reasons[0].contains("no usable key"), "{reasons:?}");
    assert!(reasons[1].contains("different payload"), "{reasons:?}");
    assert!(!dead_ids.contains(&nan_first.as_str()) && !dead_ids.contains(&nan_again.as_str()));
    assert_eq!(
        (
            stats.executed,
            stats.replayed,
            stats.dead_lettered,
            stats.acked
        ),
        (2, 1, 2, 5),
        "{stats:?}"
    );
    assert_eq!(pending(&stream, "g").await, 0);
}

/// Stream field names are binary-safe in Redis: two distinct names that are
/// not UTF-8 must never become one (as `from_utf8_lossy` would make them,
/// "\u{FFFD}"), which would drop a field from what the handler sees and,
/// with `key_from_content`, give two messages one key and one fingerprint.
/// Such an entry is dead-lettered at once, with the reason and its fields
/// byte for byte, and its handler never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_with_non_utf8_field_names_are_dead_lettered_never_merged() {
    let stream = format!("binary-{:08x}", fastrand::u32(..));
    let tag = format!("{:08x}", fastrand::u32(..));
    for name in [&b"\xffname"[..], &b"\xfename"[..]] {
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg(name)
            .arg(tag.as_bytes())
            .query_async(&mut conn().await)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let _: String = redis::cmd("XADD")
        .arg(&stream)
        .arg("*")
        .arg(&b"\xffa"[..])
        .arg("1")
        .arg(&b"\xfea"[..])
        .arg("2")
        .query_async(&mut conn().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let consumer = StreamConsumer::connect(
        support::redis_server::shared_url(),
        &stream,
        "g",
        "c",
        Idempotency::new(redis_store().await),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .key_from_content()
    .block(Duration::from_millis(50));
    let seen = Arc::new(Mutex::new(Vec::<usize>::new()));
    let handler = {
        let seen = seen.clone();
        move |entry: StreamEntry| {
            let seen = seen.clone();
            async move {
                seen.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(entry.fields.len());
                Ok::<_, std::io::Error>(format!("{:?}", entry.fields))
            }
        }
    };
    let done = nothing_pending(&stream);
    let stats = run_until(&consumer, handler, Duration::from_secs(10), done)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let seen = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    println!("field counts seen by the handler: {seen:?}; {stats:?}");
    assert!(
        seen.is_empty(),
        "an entry with merged field names reached the handler: {seen:?}"
    );
    assert_eq!(stats.dead_lettered, 3, "{stats:?}");
    // The dead letters carry the reason and every field, byte for byte.
    let dead: redis::Value = redis::cmd("XRANGE")
        .arg(format!("{stream}:dead"))
        .arg("-")
        .arg("+")
        .query_async(&mut conn().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    fn flat(v: &redis::Value, out: &mut Vec<Vec<u8>>) {
        match v {
            redis::Value::BulkString(b) => out.push(b.clone()),
            redis::Value::Array(items) => items.iter().for_each(|i| flat(i, out)),
            redis::Value::Map(pairs) => pairs.iter().for_each(|(k, v)| {
                flat(k, out);
                flat(v, out)
            }),
            _ => {}
        }
    }
    let mut words = Vec::new();
    flat(&dead, &mut words);
    let reasons = words
        .iter()
        .filter(|w| String::from_utf8_lossy(w).contains("is not UTF-8"))
        .count();
    assert_eq!(reasons, 3, "{words:?}");
    for name in [
        &b"\xffname"[..],
        &b"\xfename"[..],
        &b"\xffa"[..],
        &b"\xfea"[..],
    ] {
        assert!(
            words.iter().any(|w| w == name),
            "{name:?} is not in the dead letters: {words:?}"
        );
    }
}

/// With the fingerprint on the field `amount`, a resend whose other fields
/// differ (a timestamp set on each send) is a duplicate: replayed and
/// acknowledged, its handler not run again; the same key with another
/// amount is a payload mismatch, dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_that_differs_outside_the_fingerprinted_parts_is_a_duplicate() {
    let stream = format!("parts-{:08x}", fastrand::u32(..));
    xadd(
        &stream,
        &[
            ("message_id", "pay-1"),
            ("amount", "100"),
            ("sent_at", "10:00:00"),
        ],
    )
    .await;
    xadd(
        &stream,
        &[
            ("sent_at", "10:00:07"),
            ("message_id", "pay-1"),
            ("amount", "100"),
        ],
    )
    .await;
    let other = xadd(
        &stream,
        &[
            ("message_id", "pay-1"),
            ("amount", "200"),
            ("sent_at", "10:00:09"),
        ],
    )
    .await;
    // The three come in one read: one batch.
    let (runs, stats) = run_fingerprinting(&stream, "/amount").await;
    assert_eq!(runs, 1, "{stats:?}");
    assert_eq!(
        (stats.executed, stats.replayed, stats.dead_lettered),
        (1, 1, 1),
        "{stats:?}"
    );
    let dead = entries_of(&format!("{stream}:dead")).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(
        dead[0].1.get("idem.entry").map(String::as_str),
        Some(other.as_str())
    );
    let reason = dead[0].1.get("idem.reason").cloned().unwrap_or_default();
    assert!(reason.contains("different payload"), "{reason}");
}

/// The common shape of a stream entry is one field holding a JSON
/// document (`XADD s * message_id k payload '{"amount":...}'`): the
/// pointer `/payload/amount` reads into it, so an entry that reuses a key
/// with another amount is a mismatch, dead-lettered, never a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pointer_reads_into_a_json_document_held_in_a_field() {
    let stream = format!("parts-nested-{:08x}", fastrand::u32(..));
    xadd(
        &stream,
        &[
            ("message_id", "pay-1"),
            ("payload", r#"{"amount":100,"sent_at":"10:00:00"}"#),
        ],
    )
    .await;
    let other = xadd(
        &stream,
        &[
            ("message_id", "pay-1"),
            ("payload", r#"{"amount":999999,"sent_at":"10:00:09"}"#),
        ],
    )
    .await;
    let (_, stats) = run_fingerprinting(&stream, "/payload/amount").await;
    let dead = entries_of(&format!("{stream}:dead")).await;
    assert_eq!(
        (stats.executed, stats.replayed, stats.dead_lettered),
        (1, 0, 1),
        "the entry {other} with amount 999999 under the key of amount 100: {stats:?}, dead: {dead:?}"
    );
}

/// A field holding a JSON document led by a UTF-8 byte order mark (RFC
/// 8259 lets a parser ignore it): the pointers read past the mark, so two
/// different payments in that form, with `key_from_content` and the
/// fingerprint on their parts, get two keys and both run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_payments_in_a_field_led_by_a_byte_order_mark_both_run() {
    let stream = format!("parts-bom-{:08x}", fastrand::u32(..));
    xadd(
        &stream,
        &[("payload", "\u{feff}{\"amount\":100,\"account\":\"a-1\"}")],
    )
    .await;
    xadd(
        &stream,
        &[("payload", "\u{feff}{\"amount\":999999,\"account\":\"b-2\"}")],
    )
    .await;
    let parts = idemkit::PayloadFingerprint::json_pointers(["/payload/amount", "/payload/account"])
        .unwrap_or_else(|e| panic!("{e}"));
    let consumer = consumer_on(&stream, "c", Idempotency::new(redis_store().await))
        .await
        .key_from_content()
        .fingerprint(parts)
        .block(Duration::from_millis(50));
    let charged = Arc::new(Mutex::new(Vec::<String>::new()));
    let handler = {
        let charged = charged.clone();
        move |entry: StreamEntry| {
            let charged = charged.clone();
            async move {
                let text = entry.text("payload").unwrap_or_default();
                let v: serde_json::Value =
                    serde_json::from_str(text.trim_start_matches('\u{feff}'))
                        .map_err(std::io::Error::other)?;
                let what = format!("{} to {}", v["amount"], v["account"]);
                charged
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(what.clone());
                Ok::<_, std::io::Error>(what)
            }
        }
    };
    let stats = run_until(
        &consumer,
        handler,
        Duration::from_secs(10),
        nothing_pending(&stream),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let charged = charged.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(
        charged.len(),
        2,
        "two different payments, {} ran: {charged:?}; {stats:?}",
        charged.len()
    );
}

/// Runs a consumer of `stream` (keyed by `message_id`) with the
/// fingerprint on `pointer` and a counting handler until nothing is
/// pending: the handler's runs and the stats.
async fn run_fingerprinting(
    stream: &str,
    pointer: &str,
) -> (u64, idemkit::redis::streams::ConsumerStats) {
    let parts =
        idemkit::PayloadFingerprint::json_pointers([pointer]).unwrap_or_else(|e| panic!("{e}"));
    let consumer = consumer_on(stream, "c", Idempotency::new(redis_store().await))
        .await
        .fingerprint(parts)
        .block(Duration::from_millis(50));
    let runs = Arc::new(AtomicU64::new(0));
    let stats = run_until(
        &consumer,
        super::counting(&runs),
        Duration::from_secs(10),
        nothing_pending(stream),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    (runs.load(Ordering::SeqCst), stats)
}
