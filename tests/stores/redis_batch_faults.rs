//! A Redis store's batches of concurrent single calls under faults: a
//! frozen server (lost replies, then retries), callers dropped after their
//! batch went, overlapping keys through `process`, every batching setting
//! a user can give, and a key that Redis refuses (an ACL, `maxmemory`)
//! failing only its own caller, as it would alone.

use crate::support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit::redis::RedisStore;
use idemkit::{
    Acquisition, Batching, IdemError, IdempotencyKey, IdempotencyStore, Lease, Processed,
    StoreError,
};
use support::redis_server::RedisServer;

const LEASE: Duration = Duration::from_secs(30);
const BOUND: Duration = Duration::from_secs(20);

fn key(scope: &str, id: &str) -> IdempotencyKey {
    IdempotencyKey::new(scope, id).unwrap_or_else(|e| panic!("{e}"))
}

fn kind(got: &Result<Acquisition, StoreError>) -> String {
    match got {
        Ok(Acquisition::Acquired(l)) => format!("Acquired(attempt {})", l.attempt),
        Ok(Acquisition::Completed(r)) => {
            format!("Completed({:?})", String::from_utf8_lossy(&r.response))
        }
        Ok(Acquisition::InProgress { attempt, .. }) => format!("InProgress(attempt {attempt})"),
        Ok(Acquisition::Mismatch) => "Mismatch".into(),
        Err(e) => format!("Err({e}; retryable {})", e.is_retryable()),
    }
}

async fn connect(url: &str) -> RedisStore {
    RedisStore::connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to Redis: {e}"))
}

/// a frozen server (SIGSTOP) while 24 concurrent acquires (most
/// of them batched) are in flight: every caller gets a retryable error
/// within about the call timeout; after the thaw, a key whose lost call
/// reserved it (the record exists) answers InProgress to a retry, never
/// Acquired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_batched_acquire_then_retry_is_in_progress() {
    let server = RedisServer::start(&[]);
    let store = connect(&server.url)
        .await
        .call_timeout(Duration::from_millis(400));
    // Warm up the scripts (loaded) and the connection.
    for i in 0..8 {
        let _ = store
            .acquire(&key("rev.warm", &format!("w{i}")), None, LEASE)
            .await;
    }
    let warm: Vec<_> = (0..16)
        .map(|i| {
            let s = store.clone();
            tokio::spawn(async move {
                s.acquire(&key("rev.warm", &format!("c{i}")), None, LEASE)
                    .await
            })
        })
        .collect();
    for w in warm {
        let _ = w.await;
    }
    server.signal("STOP");
    let started = Instant::now();
    let calls: Vec<_> = (0..24)
        .map(|i| {
            let s = store.clone();
            tokio::spawn(async move {
                let k = key("rev.lost", &format!("k{}", i % 16));
                let t = Instant::now();
                let got = s.acquire(&k, None, LEASE).await;
                (k, got, t.elapsed())
            })
        })
        .collect();
    let mut results = Vec::new();
    for c in calls {
        let r = tokio::time::timeout(BOUND, c)
            .await
            .expect("a caller stuck while the server is frozen")
            .expect("task");
        results.push(r);
    }
    let all = started.elapsed();
    server.signal("CONT");
    for (k, got, took) in &results {
        assert!(
            matches!(got, Err(e) if e.is_retryable()),
            "{k}: frozen server answered {}",
            kind(got)
        );
        assert!(
            *took < Duration::from_millis(400) + Duration::from_millis(600),
            "{k}: a caller waited {took:?}, call timeout 400ms"
        );
    }
    eprintln!("all 24 callers answered within {all:?}");
    // Let the server run what it had buffered.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut held = 0;
    for i in 0..16 {
        let k = key("rev.lost", &format!("k{i}"));
        let record = store.get(&k).await.expect("get");
        let retry = store.acquire(&k, None, LEASE).await;
        if record.is_some() {
            held += 1;
            assert!(
                matches!(retry, Ok(Acquisition::InProgress { .. })),
                "{k}: reserved by a lost call ({record:?}), a retry answered {}",
                kind(&retry)
            );
        }
    }
    eprintln!("{held} of 16 keys were reserved by lost calls");
    let mgets = support::redis_server::command_calls(&server, "mget");
    eprintln!("acquire_many calls (MGET inside the script): {mgets}");
    assert!(mgets > 1, "no batch was sent: {mgets}");
}

/// Completions whose replies are lost (frozen server)
/// leave the keys completed; a retry of complete with the same lease
/// answers Ok, and a duplicate replays the response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_batched_complete_then_retry_is_ok() {
    let server = RedisServer::start(&[]);
    let store = connect(&server.url)
        .await
        .call_timeout(Duration::from_millis(400));
    let mut leases: Vec<Lease> = Vec::new();
    for i in 0..24 {
        let k = key("rev.complete", &format!("k{i}"));
        match store.acquire(&k, None, LEASE).await {
            Ok(Acquisition::Acquired(l)) => leases.push(l),
            other => panic!("{}", kind(&other)),
        }
    }
    // Warm complete scripts.
    {
        let k = key("rev.complete", "warm");
        if let Ok(Acquisition::Acquired(l)) = store.acquire(&k, None, LEASE).await {
            store.complete(&l, b"w", LEASE).await.expect("warm");
        }
    }
    server.signal("STOP");
    let calls: Vec<_> = leases
        .iter()
        .cloned()
        .map(|l| {
            let s = store.clone();
            tokio::spawn(async move {
                let body = format!("resp-{}", l.key.id());
                let t = Instant::now();
                let got = s.complete(&l, body.as_bytes(), LEASE).await;
                (l, got, t.elapsed())
            })
        })
        .collect();
    let mut results = Vec::new();
    for c in calls {
        results.push(
            tokio::time::timeout(BOUND, c)
                .await
                .expect("a complete stuck")
                .expect("task"),
        );
    }
    server.signal("CONT");
    for (l, got, took) in &results {
        assert!(
            matches!(got, Err(e) if e.is_retryable()),
            "{}: frozen complete answered {got:?}",
            l.key
        );
        assert!(
            *took < Duration::from_millis(1000),
            "{}: took {took:?}",
            l.key
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Retries, concurrently (batched again).
    let retries: Vec<_> = leases
        .iter()
        .cloned()
        .map(|l| {
            let s = store.clone();
            tokio::spawn(async move {
                let body = format!("resp-{}", l.key.id());
                let got = s.complete(&l, body.as_bytes(), LEASE).await;
                (l, got)
            })
        })
        .collect();
    for r in retries {
        let (l, got) = tokio::time::timeout(BOUND, r)
            .await
            .expect("stuck")
            .expect("task");
        assert!(
            got.is_ok(),
            "{}: retry of a lost complete answered {got:?}",
            l.key
        );
    }
    let mgets = support::redis_server::command_calls(&server, "mget");
    assert!(mgets > 0, "no complete_many was sent");
    eprintln!("batched script calls (MGET): {mgets}");
    for l in &leases {
        let got = store.acquire(&l.key, None, LEASE).await;
        let want = format!("Completed({:?})", format!("resp-{}", l.key.id()));
        assert_eq!(kind(&got), want, "{}", l.key);
    }
}

/// callers dropped after their batch was sent (the server is
/// frozen so the batch is in flight): the other callers of the batch are
/// not stuck and get their answers once the server thaws.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_callers_after_send_do_not_strand_the_rest() {
    let server = RedisServer::start(&[]);
    let store = connect(&server.url)
        .await
        .call_timeout(Duration::from_secs(3));
    for i in 0..8 {
        let _ = store
            .acquire(&key("rev.warm", &format!("w{i}")), None, LEASE)
            .await;
    }
    server.signal("STOP");
    let mut kept = Vec::new();
    for i in 0..32 {
        let s = store.clone();
        let k = key("rev.drop", &format!("k{i}"));
        if i % 2 == 0 {
            // Dropped 100 ms in: well after the queue's 10 ms.
            tokio::spawn(async move {
                let _ =
                    tokio::time::timeout(Duration::from_millis(100), s.acquire(&k, None, LEASE))
                        .await;
            });
        } else {
            kept.push(tokio::spawn(async move {
                let got = s.acquire(&k, None, LEASE).await;
                (k, got)
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.signal("CONT");
    for c in kept {
        let (k, got) = tokio::time::timeout(BOUND, c)
            .await
            .expect("stuck")
            .expect("task");
        assert!(
            matches!(got, Ok(Acquisition::Acquired(_))),
            "{k}: {}",
            kind(&got)
        );
    }
    // Nothing left stuck in the queues.
    let waiting = store.batcher().waiting();
    assert_eq!(waiting, (0, 0));
    let got = tokio::time::timeout(
        Duration::from_secs(5),
        store.acquire(&key("rev.drop", "after"), None, LEASE),
    )
    .await
    .expect("a later call stuck");
    assert!(
        matches!(got, Ok(Acquisition::Acquired(_))),
        "{}",
        kind(&got)
    );
}

#[derive(Debug)]
struct Never;

/// 96 tasks on 8 keys through `process` and `process_detached`,
/// payloads differing per task on half of the keys: one execution per
/// key, every replay the executed call's own answer for that key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_many_tasks_overlapping_keys_run_once() {
    let url = support::redis_server::shared_url();
    for round in 0..4 {
        let store = connect(url).await;
        let idem = Arc::new(idemkit::Idempotency::new(store));
        let runs: Arc<Vec<AtomicUsize>> = Arc::new((0..8).map(|_| AtomicUsize::new(0)).collect());
        let tag = format!("{}-{round}", std::process::id());
        let tasks: Vec<_> = (0..96usize)
            .map(|t| {
                let idem = idem.clone();
                let runs = runs.clone();
                let tag = tag.clone();
                tokio::spawn(async move {
                    let ki = t % 8;
                    let k = key("rev.process", &format!("{tag}-k{ki}"));
                    // Keys 0..4: same payload; 4..8: a payload per task.
                    let payload = if ki < 4 {
                        format!("p{ki}")
                    } else {
                        format!("p{ki}-t{t}")
                    };
                    let runs2 = runs.clone();
                    let handler = move |p: String| async move {
                        runs2[ki].fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        Ok::<_, Never>(format!("k{ki}:{p}"))
                    };
                    let got = if t % 2 == 0 {
                        idem.process(&k, payload.clone(), handler).await
                    } else {
                        idem.process_detached(&k, payload.clone(), handler).await
                    };
                    (ki, payload, got)
                })
            })
            .collect();
        let mut answers: HashMap<usize, Vec<(String, String)>> = HashMap::new();
        for task in tasks {
            let (ki, payload, got) = tokio::time::timeout(BOUND, task)
                .await
                .expect("a process call stuck")
                .expect("task");
            let what = match got {
                Ok(Processed::Executed(v)) => format!("Executed({v})"),
                Ok(Processed::Replayed(v)) => {
                    assert!(v.starts_with(&format!("k{ki}:")), "key {ki} replayed {v}");
                    format!("Replayed({v})")
                }
                Ok(other) => format!("{other:?}"),
                Err(IdemError::InProgress { .. }) => "InProgress".into(),
                Err(IdemError::PayloadMismatch) => "Mismatch".into(),
                Err(e) => panic!("key {ki}: {e:?}"),
            };
            answers.entry(ki).or_default().push((payload, what));
        }
        for ki in 0..8 {
            let n = runs[ki].load(Ordering::SeqCst);
            assert_eq!(
                n, 1,
                "round {round} key {ki} ran {n} times: {:?}",
                answers[&ki]
            );
            let executed: Vec<_> = answers[&ki]
                .iter()
                .filter(|(_, w)| w.starts_with("Executed"))
                .collect();
            assert_eq!(executed.len(), 1, "{:?}", answers[&ki]);
            let (winner_payload, winner) = executed[0];
            assert_eq!(winner, &format!("Executed(k{ki}:{winner_payload})"));
            for (payload, what) in &answers[&ki] {
                if what.starts_with("Replayed") {
                    assert_eq!(
                        payload, winner_payload,
                        "a replay to another payload: {what}"
                    );
                    assert_eq!(what, &format!("Replayed(k{ki}:{winner_payload})"));
                }
                if what == "Mismatch" {
                    assert_ne!(payload, winner_payload);
                }
            }
        }
    }
}

/// batching settings a user can give: no panic, no hang, the
/// same answers (one Acquired per key, the rest InProgress; completions
/// replayed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_batching_settings_keep_answers() {
    let url = support::redis_server::shared_url();
    let settings: Vec<(&str, Batching)> = vec![
        (
            "max_items(0)",
            idemkit::redis::default_batching().max_items(0),
        ),
        (
            "max_items(MAX)",
            idemkit::redis::default_batching().max_items(usize::MAX),
        ),
        (
            "max_bytes(0)",
            idemkit::redis::default_batching().max_bytes(0),
        ),
        (
            "max_bytes(MAX)",
            idemkit::redis::default_batching().max_bytes(usize::MAX),
        ),
        ("in_flight(0)", Batching::default().in_flight(0)),
        ("in_flight(MAX)", Batching::default().in_flight(usize::MAX)),
        (
            "max_wait(ZERO)",
            Batching::default().in_flight(1).max_wait(Duration::ZERO),
        ),
        (
            "max_wait(MAX)",
            Batching::default().in_flight(1).max_wait(Duration::MAX),
        ),
    ];
    for (name, batching) in settings {
        let store = connect(url).await.batching(batching);
        let tag = format!("{}-{}", std::process::id(), name.replace(['(', ')'], "_"));
        let tasks: Vec<_> = (0..64usize)
            .map(|t| {
                let s = store.clone();
                let k = key("rev.settings", &format!("{tag}-k{}", t % 16));
                tokio::spawn(async move {
                    let got = s.acquire(&k, None, LEASE).await;
                    if let Ok(Acquisition::Acquired(l)) = &got {
                        let body = format!("r-{}", l.key.id());
                        s.complete(l, body.as_bytes(), LEASE).await.map(|_| ())?;
                    }
                    Ok::<_, StoreError>((k, got))
                })
            })
            .collect();
        let mut acquired: HashMap<String, usize> = HashMap::new();
        for task in tasks {
            let (k, got) = tokio::time::timeout(BOUND, task)
                .await
                .unwrap_or_else(|_| panic!("{name}: stuck"))
                .unwrap_or_else(|e| panic!("{name}: task {e}"))
                .unwrap_or_else(|e| panic!("{name}: complete {e}"));
            match &got {
                Ok(Acquisition::Acquired(_)) => {
                    *acquired.entry(k.id().to_owned()).or_default() += 1
                }
                Ok(Acquisition::InProgress { .. }) => {}
                Ok(Acquisition::Completed(r)) => {
                    assert_eq!(
                        r.response.as_ref(),
                        format!("r-{}", k.id()).as_bytes(),
                        "{name}"
                    )
                }
                other => panic!("{name}: {k}: {}", kind(other)),
            }
        }
        assert_eq!(acquired.len(), 16, "{name}: {acquired:?}");
        assert!(acquired.values().all(|&n| n == 1), "{name}: {acquired:?}");
    }
}

/// Beyond the list: a batch's per-key refusal by Redis (an ACL that gives
/// the store's user only some scopes under its prefix) fails every caller
/// batched with it, where each call alone gets its own answer: a caller
/// whose key the ACL allows must get Acquired, as alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_refused_key_fails_only_its_own_caller() {
    let server = RedisServer::start(&[]);
    let reply = server.command(
        "ACL SETUSER scoped on >pw resetkeys ~idem:rev.ok/* resetchannels -@all +evalsha +script|load +get +set +del +mget +pttl +time +ping +config|get +hello +client",
    );
    assert!(reply.contains("OK"), "{reply}");
    let url = format!("redis://scoped:pw@127.0.0.1:{}/", server.port);
    for (name, batching) in [
        ("alone", Batching::off()),
        ("batched", idemkit::redis::default_batching()),
    ] {
        let store = connect(&url).await.batching(batching);
        // Load the scripts.
        let _ = store
            .acquire(&key("rev.ok", &format!("warm-{name}")), None, LEASE)
            .await;
        let tasks: Vec<_> = (0..32usize)
            .map(|t| {
                let s = store.clone();
                let scope = if t % 2 == 0 { "rev.ok" } else { "rev.denied" };
                let k = key(scope, &format!("{name}-k{t}"));
                tokio::spawn(async move {
                    let got = s.acquire(&k, None, LEASE).await;
                    (k, got)
                })
            })
            .collect();
        let mut wrong = Vec::new();
        for task in tasks {
            let (k, got) = tokio::time::timeout(BOUND, task)
                .await
                .expect("stuck")
                .expect("task");
            if k.scope() == "rev.ok" && !matches!(got, Ok(Acquisition::Acquired(_))) {
                wrong.push(format!("{k}: {}", kind(&got)));
            }
        }
        assert!(
            wrong.is_empty(),
            "{name}: allowed keys got {} wrong answers, e.g. {:?}",
            wrong.len(),
            wrong.first()
        );
    }
}

/// Same root cause, a condition a user meets: a server at `maxmemory`
/// (noeviction) refuses writes, but a duplicate's replay writes nothing, so
/// alone it replays. Batched with a fresh key (whose SET is refused with
/// OOM inside acquire_many.lua), the whole script fails and the duplicate
/// gets the fresh key's OOM error instead of its replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_batched_with_a_refused_write_still_replays() {
    let server = RedisServer::start(&[]);
    for (name, batching) in [
        ("alone", Batching::off()),
        ("batched", idemkit::redis::default_batching()),
    ] {
        server.command("CONFIG SET maxmemory 0");
        let store = connect(&server.url).await.batching(batching);
        let done = key("rev.oom", &format!("{name}-done"));
        match store.acquire(&done, None, LEASE).await {
            Ok(Acquisition::Acquired(l)) => store
                .complete(&l, b"the answer", LEASE)
                .await
                .expect("complete"),
            other => panic!("{}", kind(&other)),
        }
        // Warm acquire_many too.
        let _ = store
            .acquire(&key("rev.oom", &format!("{name}-warm")), None, LEASE)
            .await;
        let reply = server.command("CONFIG SET maxmemory 1");
        assert!(reply.contains("OK"), "{reply}");
        let tasks: Vec<_> = (0..32usize)
            .map(|t| {
                let s = store.clone();
                let k = if t % 2 == 0 {
                    done.clone()
                } else {
                    key("rev.oom", &format!("{name}-fresh{t}"))
                };
                tokio::spawn(async move {
                    let got = s.acquire(&k, None, LEASE).await;
                    (k, got)
                })
            })
            .collect();
        let mut wrong = Vec::new();
        for task in tasks {
            let (k, got) = tokio::time::timeout(BOUND, task)
                .await
                .expect("stuck")
                .expect("task");
            if k == done && kind(&got) != "Completed(\"the answer\")" {
                wrong.push(kind(&got));
            }
        }
        server.command("CONFIG SET maxmemory 0");
        assert!(
            wrong.is_empty(),
            "{name}: {} of 16 duplicates did not replay, e.g. {:?}",
            wrong.len(),
            wrong.first()
        );
    }
}

/// The OOM case through `Idempotency::process` on the default store: a
/// duplicate must be `Replayed` (alone it is), not a non-retryable store
/// error (which a consumer dead-letters).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_duplicate_replays_beside_refused_fresh_keys() {
    let server = RedisServer::start(&[]);
    let store = connect(&server.url).await;
    let idem = Arc::new(idemkit::Idempotency::new(store));
    let done = key("rev.oomp", "done");
    let first = idem
        .process(&done, 7u32, |p| async move { Ok::<_, Never>(p * 6) })
        .await
        .expect("first");
    assert!(matches!(first, Processed::Executed(42)));
    let _ = idem
        .process(&key("rev.oomp", "warm"), 1u32, |p| async move {
            Ok::<_, Never>(p)
        })
        .await;
    let reply = server.command("CONFIG SET maxmemory 1");
    assert!(reply.contains("OK"), "{reply}");
    let tasks: Vec<_> = (0..32usize)
        .map(|t| {
            let idem = idem.clone();
            let k = if t % 2 == 0 {
                done.clone()
            } else {
                key("rev.oomp", &format!("fresh{t}"))
            };
            tokio::spawn(async move {
                let got = idem
                    .process(&k, 7u32, |p| async move { Ok::<_, Never>(p * 6) })
                    .await;
                (k, got)
            })
        })
        .collect();
    let mut wrong = Vec::new();
    for task in tasks {
        let (k, got) = tokio::time::timeout(BOUND, task)
            .await
            .expect("stuck")
            .expect("task");
        if k == done && !matches!(got, Ok(Processed::Replayed(42))) {
            wrong.push(format!("{got:?}"));
        }
    }
    server.command("CONFIG SET maxmemory 0");
    assert!(
        wrong.is_empty(),
        "{} of 16 duplicates not replayed, e.g. {:?}",
        wrong.len(),
        wrong.first()
    );
}
