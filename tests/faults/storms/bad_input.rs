//! Bad input: keys at and past every limit, 4 MB payloads and responses,
//! responses that fail to serialize or exceed the store's limit, records
//! damaged in the server: typed errors for that key only, never a panic.

use super::*;

/// Keys at and past every limit: typed errors, never a panic.
#[test]
fn keys_at_and_past_every_limit() {
    let ok = |scope: &str, id: &str| IdempotencyKey::new(scope, id).is_ok();
    assert!(ok(&"s".repeat(64), "x"), "a 64-byte scope");
    assert!(!ok(&"s".repeat(65), "x"), "a 65-byte scope");
    assert!(!ok("", "x"), "an empty scope");
    for bad in ["a b", "a/b", "é", "a\n", "a*", "a{b}"] {
        assert!(!ok(bad, "x"), "scope {bad:?}");
    }
    assert!(ok("s", &"x".repeat(512)), "a 512-byte id");
    assert!(
        ok("s", &"é".repeat(256)),
        "a 512-byte id of 2-byte characters"
    );
    assert!(!ok("s", &"x".repeat(513)), "a 513-byte id");
    assert!(
        !ok("s", &format!("{}é", "x".repeat(511))),
        "513 bytes, 512 characters"
    );
    assert!(!ok("s", ""), "an empty id");
    for bad in ["a\nb", "a\u{0}b", "\u{7f}", "tab\there", "\u{85}"] {
        assert!(!ok("s", bad), "id {bad:?} has a control character");
    }
    assert!(ok("s", "spaces, slashes/ and ünïcödé 🦀 are fine"));
    // ids as bytes: non-UTF-8 is a typed error
    assert!(IdempotencyKey::from_utf8("s", &[0xff, 0xfe]).is_err());
    assert!(
        IdempotencyKey::from_utf8("s", &[0xe2, 0x82]).is_err(),
        "a truncated character"
    );
    assert!(IdempotencyKey::from_utf8("s", "ok".as_bytes()).is_ok());
    // every error says what is wrong
    let e = IdempotencyKey::new("s", "x".repeat(513))
        .err()
        .map(|e| e.to_string());
    assert!(
        e.is_some_and(|m| m.contains("512")),
        "the message names the limit"
    );
}

/// A response type whose serialization fails.
#[derive(Debug, serde::Deserialize)]
struct Unserializable;

impl serde::Serialize for Unserializable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "this response refuses to serialize",
        ))
    }
}

/// On one backend: the longest key works; a 4 MB payload and a 4 MB
/// response are recorded and replayed; a response that fails to serialize
/// completes the key as not replayable (the handler ran: it never runs
/// again, duplicates get `ResultUnavailable`); and a neighbouring key is
/// never affected by any of it.
async fn bad_input_scenario(backend: Backend) {
    let started = Instant::now();
    let idem =
        Idempotency::from_arc(backend.store().await).on_in_progress(InProgressPolicy::Reject);
    let run = run_id();
    let neighbour = key("faults.bad", &run, 0);
    let first = idem
        .process(&neighbour, 0u64, |_| async {
            Ok::<_, std::convert::Infallible>(11u64)
        })
        .await;
    assert!(matches!(first, Ok(Processed::Executed(11))), "{first:?}");

    let longest = IdempotencyKey::new("s".repeat(64), format!("{run}{}", "é".repeat(248)))
        .unwrap_or_else(|e| panic!("{e}"));
    for expected in ["executed", "replayed"] {
        let out = idem
            .process(&longest, 1u64, |_| async {
                Ok::<_, std::convert::Infallible>(12u64)
            })
            .await;
        match (expected, out) {
            ("executed", Ok(Processed::Executed(12)))
            | ("replayed", Ok(Processed::Replayed(12))) => {}
            (_, other) => panic!("longest key, {expected}: {other:?}"),
        }
    }

    let big = key("faults.bad", &run, 1);
    let payload = "p".repeat(4 << 20);
    let response = "r".repeat(4 << 20);
    let out = idem
        .process(&big, &payload, |_| {
            let response = response.clone();
            async move { Ok::<_, std::convert::Infallible>(response) }
        })
        .await;
    assert!(
        matches!(&out, Ok(Processed::Executed(r)) if r.len() == 4 << 20),
        "4 MB executed"
    );
    let out = idem
        .process(&big, &payload, |_| async {
            never::<String>("a completed key never runs again")
        })
        .await;
    assert!(
        matches!(&out, Ok(Processed::Replayed(r)) if *r == response),
        "4 MB replayed"
    );

    let unserializable = key("faults.bad", &run, 2);
    let out = idem
        .process(&unserializable, 2u64, |_| async {
            Ok::<_, std::convert::Infallible>(Unserializable)
        })
        .await;
    match out {
        Ok(Processed::ExecutedNotReplayable { reason, .. }) => {
            assert!(reason.contains("refuses to serialize"), "{reason}")
        }
        other => panic!("an unserializable response: {:?}", other.err()),
    }
    let retry = idem
        .process(&unserializable, 2u64, |_| async {
            never::<u64>("a key whose result was not recordable never runs again")
        })
        .await;
    assert!(
        matches!(&retry, Err(e @ IdemError::ResultUnavailable { .. }) if !e.is_retryable()),
        "{retry:?}"
    );

    let again = idem
        .process(&neighbour, 0u64, |_| async {
            never::<u64>("the neighbour is completed")
        })
        .await;
    assert!(matches!(again, Ok(Processed::Replayed(11))), "{again:?}");
    report(
        "bad-input",
        backend,
        &[
            (
                "cases",
                "longest-key,4MB-payload,4MB-response,unserializable-response".into(),
            ),
            ("panics", "0".into()),
            ("other_keys_affected", "0".into()),
        ],
        started,
    );
}

on_backends!(bad_input_scenario; memory => Backend::Memory, postgres => Backend::Postgres,
    redis => Backend::Redis, redis_cluster => Backend::RedisCluster, tiered => Backend::Tiered);

/// A response over PgStore's limit is refused before anything is sent;
/// the handler ran, so the key completes as not replayable (never
/// released): the caller gets its value, duplicates `ResultUnavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_response_over_the_limit() {
    let store = PgStore::builder(support::pg::pool(support::pg::shared_url(), 4).await)
        .max_response_bytes(1 << 20)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let idem = Idempotency::new(store);
    let k = key("faults.bad", &run_id(), 0);
    let out = idem
        .process(&k, 0u64, |_| async {
            Ok::<_, std::convert::Infallible>("r".repeat(2 << 20))
        })
        .await;
    match out {
        Ok(Processed::ExecutedNotReplayable { value, reason }) => {
            assert_eq!(value.len(), 2 << 20, "the caller gets its value");
            assert!(reason.contains("limit"), "{reason}");
        }
        other => panic!("a 2 MB response over a 1 MB limit: {:?}", other.err()),
    }
    let retry = idem
        .process(&k, 0u64, |_| async {
            never::<String>("a completed key never runs again")
        })
        .await;
    assert!(
        matches!(retry, Err(IdemError::ResultUnavailable { .. })),
        "{retry:?}"
    );
}

/// Records damaged directly in the server give `Corrupt` for their key
/// only; the next key is answered as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_records_affect_only_their_key() {
    let pg = pg_store().await;
    let redis = RedisStore::connect(support::redis_server::shared_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let run = run_id();
    let (damaged, intact) = (
        key("faults.corrupt", &run, 0),
        key("faults.corrupt", &run, 1),
    );
    let stores: [(&str, Arc<dyn IdempotencyStore>); 2] = [
        ("postgres", Arc::new(pg.clone())),
        ("redis", Arc::new(redis.clone())),
    ];
    for (name, store) in stores {
        let idem = Idempotency::from_arc(store);
        for k in [&damaged, &intact] {
            let out = idem
                .process(k, 0u64, |_| async {
                    Ok::<_, std::convert::Infallible>(14u64)
                })
                .await;
            assert!(
                matches!(out, Ok(Processed::Executed(14))),
                "{name}: {out:?}"
            );
        }
        if name == "postgres" {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE {} SET status = 9 WHERE scope = $1 AND key = $2",
                pg.qualified_table()
            )))
            .bind(damaged.scope())
            .bind(damaged.id())
            .execute(pg.pool())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        } else {
            let mut conn = idemkit::redis::redis::Client::open(support::redis_server::shared_url())
                .and_then(|c| c.get_connection())
                .unwrap_or_else(|e| panic!("{e}"));
            let _: () = idemkit::redis::redis::cmd("SET")
                .arg(redis.redis_key(&damaged))
                .arg("garbage")
                .query(&mut conn)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        let out = idem
            .process(&damaged, 0u64, |_| async {
                never::<u64>("a corrupt record is not absent")
            })
            .await;
        match out {
            Err(e @ IdemError::Store(StoreError::Corrupt { .. })) => {
                assert!(!e.is_retryable(), "{name}: {e}");
                assert!(
                    e.to_string().contains(damaged.id()),
                    "{name}: names the key: {e}"
                );
            }
            other => panic!("{name}: a damaged record: {other:?}"),
        }
        let out = idem
            .process(&intact, 0u64, |_| async { never::<u64>("completed") })
            .await;
        assert!(
            matches!(out, Ok(Processed::Replayed(14))),
            "{name}: {out:?}"
        );
    }
}
