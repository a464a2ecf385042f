//! A poison entry on the Redis Streams consumer: dead-lettered after its
//! last delivery, everything else processed once and acknowledged.

use super::*;

/// A stream of 300 payment entries (100 of them sent
/// twice) holds one poison entry whose handler always fails. The consumer
/// (`max_deliveries(3)`, `claim_idle` 200 ms) runs it 3 times, moves it to
/// the dead-letter stream with its delivery count and the reason, and
/// acknowledges everything: 0 pending, every payment charged once. The
/// consumer is stopped once the poison is dead-lettered, every entry was
/// delivered and none is pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_consumer() {
    use idemkit::redis::redis;
    use idemkit::redis::streams::{StreamConsumer, StreamEntry};
    let started = Instant::now();
    let url = support::redis_server::shared_url();
    let stream = format!("faults-poison-{}", run_id());
    let mut conn = redis::Client::open(url)
        .unwrap_or_else(|e| panic!("{e}"))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let messages = 200u64;
    let poison = 77u64;
    let mut entries = 0u64;
    for m in (0..messages).chain((0..messages).step_by(2)) {
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg("message_id")
            .arg(m)
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        entries += 1;
    }
    let store = RedisStore::connect(url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let consumer = StreamConsumer::connect(url, &stream, "g", "c", Idempotency::new(store))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .key_field("message_id")
        .block(Duration::from_millis(50))
        .claim_idle(Duration::from_millis(200))
        .max_deliveries(3);
    let ledger = Ledger::new(messages);
    let handler = {
        let ledger = ledger.clone();
        move |entry: StreamEntry| {
            let ledger = ledger.clone();
            async move {
                let m: u64 = entry
                    .text("message_id")
                    .and_then(|m| m.parse().ok())
                    .unwrap_or(u64::MAX);
                ledger.effect(m);
                if m == poison {
                    Err(std::io::Error::other("poison"))
                } else {
                    Ok(m)
                }
            }
        }
    };
    let pending = |conn: redis::aio::MultiplexedConnection, stream: String| async move {
        let mut conn = conn;
        let summary: (i64, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
            .arg(&stream)
            .arg("g")
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        summary.0
    };
    // Whether the group was handed every entry of the stream: its
    // last-delivered-id is the stream's last id (XINFO).
    let all_delivered = |conn: redis::aio::MultiplexedConnection, stream: String| async move {
        let mut conn = conn;
        let info: redis::Value = redis::cmd("XINFO")
            .arg("STREAM")
            .arg(&stream)
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let groups: Vec<redis::Value> = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&stream)
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let last = info_field(&info, "last-generated-id");
        last.is_some()
            && groups
                .iter()
                .any(|g| info_field(g, "last-delivered-id") == last)
    };
    let dead_letter = format!("{stream}:dead");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let watcher = {
        let (conn, stream, dead_letter) = (conn.clone(), stream.clone(), dead_letter.clone());
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let mut c = conn.clone();
                let dead: i64 = redis::cmd("XLEN")
                    .arg(&dead_letter)
                    .query_async(&mut c)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                if dead >= 1
                    && pending(conn.clone(), stream.clone()).await == 0
                    && all_delivered(conn.clone(), stream.clone()).await
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the poison entry was not dead-lettered within 60 s"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = stop_tx.send(());
        })
    };
    let stats = consumer
        .run(handler, async {
            let _ = stop_rx.await;
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    watcher.await.unwrap_or_else(|e| panic!("{e}"));
    let left = pending(conn.clone(), stream.clone()).await;
    let dead: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&dead_letter)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let field = |name: &str| {
        dead.first()
            .and_then(|(_, f)| f.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
            .unwrap_or_default()
    };
    let doubled = (0..messages)
        .filter(|m| *m != poison && ledger.count(*m) != 1)
        .count();
    report(
        "poison-entry",
        Backend::Redis,
        &[
            ("entries", entries.to_string()),
            ("messages", messages.to_string()),
            ("max_deliveries", "3".into()),
            ("poison_runs", ledger.count(poison).to_string()),
            ("dead_lettered", stats.dead_lettered.to_string()),
            ("dead_letter_deliveries", field("idem.deliveries")),
            ("pending", left.to_string()),
            ("acked", stats.acked.to_string()),
            ("double_effects", doubled.to_string()),
        ],
        started,
    );
    assert_eq!(ledger.count(poison), 3, "the poison ran once per delivery");
    assert_eq!((dead.len(), stats.dead_lettered), (1, 1));
    assert_eq!(field("idem.deliveries"), "3");
    assert_eq!(field("message_id"), poison.to_string());
    assert!(field("idem.reason").contains("poison"));
    assert_eq!(left, 0, "entries left pending");
    assert_eq!(stats.acked, entries, "every entry acknowledged");
    assert_eq!(doubled, 0, "payments charged other than once");
}

/// A field of an `XINFO` reply (name, value pairs, or a map), as text.
fn info_field(reply: &idemkit::redis::redis::Value, name: &str) -> Option<String> {
    use idemkit::redis::redis::Value;
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    };
    match reply {
        Value::Array(items) => items
            .chunks(2)
            .find(|pair| text(&pair[0]).as_deref() == Some(name))
            .and_then(|pair| pair.get(1).and_then(text)),
        Value::Map(pairs) => pairs
            .iter()
            .find(|(k, _)| text(k).as_deref() == Some(name))
            .and_then(|(_, v)| text(v)),
        _ => None,
    }
}
