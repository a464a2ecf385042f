//! Delivery: copies published and redelivered, a consumer killed
//! mid-batch (SIGKILL of a child process), the default key; a panicking
//! handler, copies in one pull, an empty payload, the durable consumer
//! deleted under the consumer. Every effect once, nothing left unacked.

use crate::support;

use std::io::BufRead;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit::nats::{MessageError, NatsConsumer, NatsMessage};
use idemkit::{Idempotency, IdempotencyStore, MemoryStore};

use super::{
    all_acked, create_stream, effect, jetstream, jetstream_at, name, pending, publish, redis_store,
    wait_until, Effects, Running,
};

/// The variable that tells a child process of this binary to be consumer
/// A of [`thousand_messages_two_consumers_one_killed_mid_batch_every_effect_once`]
/// (its value: the stream and the durable consumer).
const CONSUMER_A: &str = "IDEM_TEST_NATS_CONSUMER_A";

/// How many effects A runs before its handlers stall.
const A_EFFECTS: u64 = 300;

/// 1,000 messages, each published 1 to 4 times (copies with the same
/// `message-id` header, as a producer resending after a lost ack; ~2,500
/// stream entries); two consumers of one durable consumer share a Redis
/// store, and one of them, a process of its own, is killed (SIGKILL) with
/// messages in flight. Every message's effect runs once, the messages
/// the killed consumer held come back after the ack wait and run (or
/// replay) at the survivor, and nothing is left unacked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_messages_two_consumers_one_killed_mid_batch_every_effect_once() {
    if let Ok(spec) = std::env::var(CONSUMER_A) {
        let (stream, durable) = spec
            .split_once(' ')
            .unwrap_or_else(|| panic!("{CONSUMER_A}={spec}"));
        return consumer_a(stream, durable).await;
    }
    let started = Instant::now();
    let js = jetstream().await;
    let stream = name("PAY");
    let durable = name("billing");
    let subject = format!("{stream}.charge");
    create_stream(&js, &stream, &[&subject]).await;
    let messages = 1000u32;
    let mut copies = Vec::new();
    for m in 0..messages {
        for _ in 0..fastrand::u32(1..=4) {
            copies.push(m);
        }
    }
    fastrand::shuffle(&mut copies);
    let total = copies.len() as u64;
    // Published with their acks awaited in groups (one by one takes long
    // on a loaded machine).
    for chunk in copies.chunks(200) {
        let mut acks = Vec::new();
        for m in chunk {
            let mut headers = idemkit::nats::async_nats::HeaderMap::new();
            headers.insert("message-id", format!("m-{m}"));
            let ack = js
                .publish_with_headers(
                    subject.clone(),
                    headers,
                    format!("{{\"amount\":{m}}}").into(),
                )
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            acks.push(ack);
        }
        for ack in acks {
            ack.await.unwrap_or_else(|e| panic!("{e}"));
        }
    }
    let published_in = started.elapsed();

    // Consumer A, a process of its own: its effects are the lines it
    // prints. After 300 effects its handlers stall before their effect,
    // and it is killed with those messages unacked.
    let effects: Effects = Arc::default();
    let a_effects = Arc::new(AtomicU64::new(0));
    let stalled = Arc::new(AtomicBool::new(false));
    let mut a_process = {
        let exe = std::env::current_exe().unwrap_or_else(|e| panic!("this test binary: {e}"));
        let child = std::process::Command::new(exe)
            .args([
                "nats::delivery::thousand_messages_two_consumers_one_killed_mid_batch_every_effect_once",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CONSUMER_A, format!("{stream} {durable}"))
            .env("IDEM_REDIS_URL", support::redis_server::shared_url())
            .env("IDEM_NATS_URL", support::nats::shared_url())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start consumer A: {e}"));
        support::alone::Killed(child)
    };
    {
        let out = a_process.0.stdout.take().unwrap();
        let (effects, a_effects, stalled) = (effects.clone(), a_effects.clone(), stalled.clone());
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                // The first line may follow libtest's "test NAME ... ".
                if let Some((_, id)) = line.split_once("idem-effect ") {
                    effect(&effects, id);
                    a_effects.fetch_add(1, Ordering::SeqCst);
                } else if line.ends_with("idem-stalled") {
                    stalled.store(true, Ordering::SeqCst);
                } else {
                    println!("consumer A: {line}");
                }
            }
        });
    }
    // B joins once A ran half its effects, so that A reaches 300 with B
    // pulling beside it (had B started first on a loaded machine, it
    // could take most messages before A had run 300).
    let a = a_effects.clone();
    wait_until(
        "consumer A's first 150 effects",
        Duration::from_secs(120),
        || {
            let ran = a.load(Ordering::SeqCst) >= A_EFFECTS / 2;
            async move { ran }
        },
    )
    .await;

    // Consumer B, in this process.
    let store = Arc::new(redis_store().await);
    let b = Running::start(
        consumer(&js, &stream, &durable, Idempotency::from_arc(store.clone())),
        {
            let effects = effects.clone();
            move |m: NatsMessage| {
                let effects = effects.clone();
                async move {
                    let id = m.header_text("message-id")?.to_owned();
                    effect(&effects, &id);
                    Ok::<_, MessageError>(id)
                }
            }
        },
    );
    let s = stalled.clone();
    wait_until(
        "consumer A stalled after 300 effects",
        Duration::from_secs(120),
        || {
            let stalled = s.load(Ordering::SeqCst);
            async move { stalled }
        },
    )
    .await;
    // Killed once the effects it ran are recorded: a kill between an
    // effect and its record is the at-least-once hazard of any receiver
    // (RELIABILITY.md), not what this test is about.
    let ran: Vec<String> = effects.lock().unwrap().keys().cloned().collect();
    let scope = idemkit::nats::default_scope(&stream, &durable);
    wait_until("A's effects recorded", Duration::from_secs(30), || {
        let (store, ran, scope) = (store.clone(), ran.clone(), scope.clone());
        async move {
            for id in &ran {
                let key = idemkit::IdempotencyKey::new(scope.as_str(), id.as_str()).unwrap();
                match store.get(&key).await {
                    Ok(Some(r)) if r.is_completed() => {}
                    _ => return false,
                }
            }
            true
        }
    })
    .await;
    let a_in_flight = pending(&js, &stream, &durable).await.map(|p| p.1);
    a_process.kill();
    let killed_at = started.elapsed();

    wait_until(
        "every effect, and every message acked",
        Duration::from_secs(300),
        || {
            let (js, stream, durable, effects) =
                (js.clone(), stream.clone(), durable.clone(), effects.clone());
            async move {
                let all = effects.lock().unwrap().len() == messages as usize;
                all && all_acked(&js, &stream, &durable).await
            }
        },
    )
    .await;
    let drained_at = started.elapsed();
    let stats = b.stop().await;
    let effects = effects.lock().unwrap().clone();
    let not_once: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        not_once.is_empty(),
        "effects not run exactly once: {not_once:?}"
    );
    assert_eq!(effects.len(), messages as usize);
    assert!(
        all_acked(&js, &stream, &durable).await,
        "nothing left unacked"
    );
    let a = a_effects.load(Ordering::SeqCst);
    assert_eq!(a, A_EFFECTS);
    assert_eq!(stats.executed + a, u64::from(messages), "{stats:?}");
    assert!(stats.replayed > 0, "B replayed copies: {stats:?}");
    assert_eq!(stats.poison + stats.dead_lettered, 0, "{stats:?}");
    eprintln!(
        "{total} entries published in {published_in:?}; A killed at {killed_at:?} \
         ({a_in_flight:?} unacked then); all acked at {drained_at:?}; B: {stats:?}"
    );
}

/// The consumer both A and B run.
fn consumer<S: idemkit::IdempotencyStore + ?Sized>(
    js: &idemkit::nats::async_nats::jetstream::Context,
    stream: &str,
    durable: &str,
    idem: Idempotency<S>,
) -> NatsConsumer<S> {
    NatsConsumer::new(
        js.clone(),
        stream,
        durable,
        idem.lease(Duration::from_secs(2)),
    )
    .key_header("message-id")
    .ack_wait(Duration::from_secs(2))
    .pull_wait(Duration::from_secs(1))
    .retry_delay(Duration::from_millis(200))
    .concurrency(32)
}

/// Consumer A of the test above, in its child process: its effects are
/// lines on stdout (`idem-effect ID`), and after 300 of them its handlers
/// stall (`idem-stalled`) until the process is killed.
async fn consumer_a(stream: &str, durable: &str) {
    use std::io::Write;
    let js = jetstream_at(support::nats::shared_url()).await;
    let effects = Arc::new(AtomicU64::new(0));
    let idem = Idempotency::new(redis_store().await);
    let outcome = consumer(&js, stream, durable, idem)
        .run(
            move |m: NatsMessage| {
                let effects = effects.clone();
                async move {
                    let id = m.header_text("message-id")?.to_owned();
                    // The count is taken before the effect: handlers run
                    // at once.
                    if effects.fetch_add(1, Ordering::SeqCst) >= A_EFFECTS {
                        let _ = writeln!(std::io::stdout().lock(), "idem-stalled");
                        std::future::pending::<()>().await;
                    }
                    let _ = writeln!(std::io::stdout().lock(), "idem-effect {id}");
                    Ok::<_, MessageError>(id)
                }
            },
            std::future::pending::<()>(),
        )
        .await;
    panic!("consumer A stopped before it was killed: {outcome:?}");
}

/// The default key is the `Nats-Msg-Id` header: a message published again
/// with the same ID after JetStream's duplicate window (here, a second
/// stream fed the same ID, as a republish would be) is replayed, not run.
/// The handler gets its attempt and fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_key_is_the_message_id_and_the_handler_gets_attempt_and_fence() {
    let js = jetstream().await;
    let stream = name("IDS");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    let store = Arc::new(idemkit::MemoryStore::new());
    let effects: Effects = Arc::default();
    let contexts = Arc::new(std::sync::Mutex::new(Vec::new()));
    let durable = name("ids");
    let handler = {
        let (effects, contexts) = (effects.clone(), contexts.clone());
        move |m: NatsMessage| {
            let (effects, contexts) = (effects.clone(), contexts.clone());
            async move {
                effect(&effects, m.header("Nats-Msg-Id").unwrap_or("none"));
                contexts
                    .lock()
                    .unwrap()
                    .push((m.attempt, m.fence, m.delivered));
                Ok::<_, MessageError>(m.text()?.len())
            }
        }
    };
    let a = Running::start(
        NatsConsumer::new(
            js.clone(),
            &stream,
            &durable,
            Idempotency::from_arc(store.clone()),
        )
        .scope("ids")
        .pull_wait(Duration::from_millis(500)),
        handler.clone(),
    );
    publish(&js, &subject, &[("Nats-Msg-Id", "id-1")], "one").await;
    publish(&js, &subject, &[("Nats-Msg-Id", "id-2")], "two").await;
    // A copy within the duplicate window: JetStream drops it itself.
    publish(&js, &subject, &[("Nats-Msg-Id", "id-1")], "one").await;
    wait_until("both acked", Duration::from_secs(30), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    let sa = a.stop().await;
    // The same ID through another stream, sharing the scope: a duplicate.
    let other = name("IDS2");
    let other_subject = format!("{other}.in");
    create_stream(&js, &other, &[&other_subject]).await;
    publish(&js, &other_subject, &[("Nats-Msg-Id", "id-1")], "one").await;
    let durable_b = name("ids");
    let b = Running::start(
        NatsConsumer::new(
            js.clone(),
            &other,
            &durable_b,
            Idempotency::from_arc(store.clone()),
        )
        .scope("ids")
        .pull_wait(Duration::from_millis(500)),
        handler,
    );
    wait_until("the copy acked", Duration::from_secs(30), || {
        all_acked(&js, &other, &durable_b)
    })
    .await;
    let sb = b.stop().await;
    assert_eq!((sa.executed, sa.replayed), (2, 0), "{sa:?}");
    assert_eq!((sb.executed, sb.replayed), (0, 1), "{sb:?}");
    let effects = effects.lock().unwrap().clone();
    assert_eq!(effects.get("id-1"), Some(&1));
    assert_eq!(effects.get("id-2"), Some(&1));
    let contexts = contexts.lock().unwrap().clone();
    assert_eq!(contexts.len(), 2);
    for (attempt, fence, delivered) in contexts {
        assert_eq!((attempt, delivered), (1, Some(1)));
        assert!(fence > 0);
    }
}

/// A panicking handler is handed back, then dead-lettered at
/// `max_deliveries` (2 runs); two copies of a key in one pull run once;
/// an empty payload keyed by its content runs once; a durable consumer
/// deleted under the running consumer is made again (from the stream's
/// first message: the copies replay) and the consumer goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panics_copies_in_one_pull_an_empty_payload_and_a_deleted_durable_consumer() {
    let js = jetstream().await;
    let stream = name("PROBE");
    let subject = format!("{stream}.in");
    let dead = name("PROBEDEAD");
    let dead_subject = format!("{dead}.letters");
    create_stream(&js, &stream, &[&subject]).await;
    create_stream(&js, &dead, &[&dead_subject]).await;
    let durable = name("probe");
    let runs: Effects = Arc::default();
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
        .retry_delay(Duration::from_millis(100))
        .pull_wait(Duration::from_millis(500))
        .dead_letter(&dead_subject),
        move |m: NatsMessage| {
            let r = r.clone();
            async move {
                let text = String::from_utf8_lossy(&m.payload).into_owned();
                effect(&r, &text);
                if text == "panic" {
                    panic!("the handler panics");
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok::<_, std::io::Error>(text.len())
            }
        },
    );
    // Published before the first pull lands, in one batch: two copies.
    for p in ["copy", "copy", "", "panic"] {
        publish(&js, &subject, &[], p).await;
    }
    wait_until("all settled", Duration::from_secs(30), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    {
        let runs = runs.lock().unwrap().clone();
        assert_eq!(runs.get("copy"), Some(&1), "{runs:?}");
        assert_eq!(runs.get(""), Some(&1), "{runs:?}");
        assert_eq!(runs.get("panic"), Some(&2), "{runs:?}");
    }
    // The durable deleted under the running consumer: `run` makes it
    // again (from the stream's first message: the copies are replayed,
    // the panicking one, its key released, runs again).
    js.get_stream(&stream)
        .await
        .unwrap()
        .delete_consumer(&durable)
        .await
        .unwrap();
    publish(&js, &subject, &[], "after").await;
    wait_until("the new message run", Duration::from_secs(30), || {
        let n = runs.lock().unwrap().get("after").copied();
        async move { n == Some(1) }
    })
    .await;
    let stats = running.stop().await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.get("copy"), Some(&1), "{runs:?} {stats:?}");
    assert_eq!(runs.get(""), Some(&1), "{runs:?} {stats:?}");
    assert!(stats.dead_lettered >= 1, "{stats:?}");
}
