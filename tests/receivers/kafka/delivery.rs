//! Delivery: duplicates produced and redelivered, a member killed
//! mid-batch, records of one partition finishing out of order. Every
//! effect once, every record committed, the committed offset never past a
//! record that has not finished.

use crate::support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemkit::kafka::{KafkaRecord, RecordError};
use idemkit::redis::RedisStore;
use idemkit::Idempotency;

use super::{
    all_committed, committed, consumer, effect, exactly_once, name, once_set, produce, redis_store,
    until, until_every_effect_and_commit, Effects,
};

/// The variable that tells a child process of this binary to be member A
/// of [`two_members_one_killed_mid_batch_every_effect_once_and_every_record_committed`]
/// (its value: the topic and the group).
const MEMBER_A: &str = "IDEM_TEST_KAFKA_MEMBER_A";

/// 2,000 messages, each produced 1 to 4 times to any of 3 partitions; two
/// members share a Redis store and one of them, a process of its own, is
/// killed (SIGKILL) with records of its batch in flight and nothing
/// committed. Every message's effect runs once, every record is
/// committed, and the records the killed member ran are replayed to the
/// survivor, not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_members_one_killed_mid_batch_every_effect_once_and_every_record_committed() {
    if let Ok(spec) = std::env::var(MEMBER_A) {
        let (topic, group) = spec
            .split_once(' ')
            .unwrap_or_else(|| panic!("{MEMBER_A}={spec}"));
        return member_a(topic, group).await;
    }
    let topic = name("payments");
    let group = name("billing");
    support::kafka::create_topic(&topic, 3);
    // 2,000 messages; the producer sends each 1 to 4 times (a resend
    // after a lost acknowledgement), to any partition: ~5,000 records.
    let messages = 2000u32;
    let mut records = Vec::new();
    for m in 0..messages {
        let id = format!("m-{m}");
        for copy in 0..fastrand::u32(1..=4) {
            let partition = ((m + copy) % 3) as i32;
            records.push((
                partition,
                Some(format!("account-{}", m % 17)),
                vec![("message-id".to_owned(), id.clone())],
                format!("{{\"amount\":{m}}}"),
            ));
        }
    }
    let total = records.len() as u64;
    let ends = produce(&topic, records).await;

    let effects: Effects = Arc::default();
    let store = redis_store().await;

    // Member A, a process of its own (this test in a child process): its
    // effects are the lines it prints, read here. After 300 effects its
    // handlers stall before their effect, and it is killed with records of
    // its batch in flight. It never commits (a long commit interval), so
    // every record it executed is uncommitted when it dies.
    let a_effects = Arc::new(AtomicU64::new(0));
    let stalled = Arc::new(tokio::sync::Notify::new());
    let mut a_process = {
        let exe = std::env::current_exe().unwrap_or_else(|e| panic!("this test binary: {e}"));
        let child = std::process::Command::new(exe)
            .args([
                "kafka::delivery::two_members_one_killed_mid_batch_every_effect_once_and_every_record_committed",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(MEMBER_A, format!("{topic} {group}"))
            // The servers of this process (started here if none was given).
            .env("IDEM_REDIS_URL", support::redis_server::shared_url())
            .env("IDEM_KAFKA_BROKERS", support::kafka::brokers())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start member A: {e}"));
        support::alone::Killed(child)
    };
    {
        let out = a_process
            .0
            .stdout
            .take()
            .unwrap_or_else(|| panic!("A's stdout"));
        let (effects, a_effects, stalled) = (effects.clone(), a_effects.clone(), stalled.clone());
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                // The first line may follow libtest's "test NAME ... ".
                if let Some((_, id)) = line.split_once("idem-effect ") {
                    effect(&effects, id);
                    a_effects.fetch_add(1, Ordering::SeqCst);
                } else if line.ends_with("idem-stalled") {
                    stalled.notify_one();
                } else {
                    println!("member A: {line}");
                }
            }
        });
    }

    // Member B joins once A has run an effect, so A holds partitions
    // when the group rebalances (had B joined first, it could take every
    // partition and finish the topic before A was assigned any: A would
    // never reach 300 effects, as happened once in CI).
    let waited = tokio::time::Instant::now();
    while a_effects.load(Ordering::SeqCst) == 0 {
        assert!(
            waited.elapsed() < Duration::from_secs(60),
            "member A never ran an effect"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Member B, in this process, until every message had its effect and
    // the group's lag is 0.
    let b = consumer(
        &group,
        &topic,
        Idempotency::from_arc(store.clone()).lease(Duration::from_secs(2)),
    )
    .key_header("message-id")
    .retry_backoff(Duration::from_millis(20), Duration::from_millis(500));
    let done = Arc::new(AtomicBool::new(false));
    let b_run = {
        let effects = effects.clone();
        let done = done.clone();
        async {
            b.run(
                move |record: KafkaRecord| {
                    let effects = effects.clone();
                    async move {
                        let id = record.header_text("message-id")?.to_owned();
                        effect(&effects, &id);
                        Ok::<_, RecordError>(id)
                    }
                },
                once_set(done),
            )
            .await
        }
    };
    let control = async {
        tokio::time::timeout(Duration::from_secs(60), stalled.notified())
            .await
            .unwrap_or_else(|_| panic!("member A never reached 300 effects"));
        // Killed once the effects that ran are recorded: a kill between an
        // effect and its record is the at-least-once hazard of any
        // receiver (RELIABILITY.md), not what this test is about.
        let ran: Vec<String> = effects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        let scope = idemkit::kafka::default_scope(&topic);
        until("A's effects recorded", Duration::from_secs(30), || {
            let (store, ran, scope) = (store.clone(), ran.clone(), scope.clone());
            async move {
                for id in &ran {
                    let key = idemkit::IdempotencyKey::new(scope.as_str(), id.as_str())
                        .unwrap_or_else(|e| panic!("{e}"));
                    match store.get(&key).await {
                        Ok(Some(r)) if r.is_completed() => {}
                        _ => return false,
                    }
                }
                true
            }
        })
        .await;
        // Kill A (SIGKILL): its connections close with nothing committed
        // and no LeaveGroup; the group drops it after its session timeout.
        a_process.kill();
        until_every_effect_and_commit(&effects, messages, (&group, &topic), &ends).await;
        done.store(true, Ordering::SeqCst);
    };
    let (stats, ()) = tokio::join!(b_run, control);
    let stats = stats.unwrap_or_else(|e| panic!("member B: {e}"));
    exactly_once(&effects, (0..messages).map(|m| format!("m-{m}")));
    assert!(
        all_committed(&group, &topic, &ends).await,
        "lag 0 at the end"
    );
    let a = a_effects.load(Ordering::SeqCst);
    assert_eq!(a, 300);
    // A committed nothing, so B read every record, A's included; the 300
    // that A executed were replayed to B (their effect did not run again).
    assert!(stats.received >= total, "{stats:?}, {total} records");
    assert_eq!(stats.executed + a, u64::from(messages), "{stats:?}");
    assert!(stats.replayed >= total - stats.executed, "{stats:?}");
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert!(stats.committed >= total - stats.executed - a, "{stats:?}");
}

/// Member A of the test above, in its child process: its effects are
/// lines on stdout (`idem-effect ID`), and after 300 of them its handlers
/// stall (`idem-stalled`) until the process is killed.
async fn member_a(topic: &str, group: &str) {
    use std::io::Write;
    let effects = Arc::new(AtomicU64::new(0));
    let store = RedisStore::connect(support::redis_server::shared_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let idem = Idempotency::new(store).lease(Duration::from_secs(2));
    let consumer = super::consumer(group, topic, idem)
        .key_header("message-id")
        .batch(16)
        .commit_interval(Duration::from_secs(3600));
    let outcome = consumer
        .run(
            move |record: KafkaRecord| {
                let effects = effects.clone();
                async move {
                    let id = record.header_text("message-id")?.to_owned();
                    // One of the first 300 effects, or a stall (handlers
                    // of several partitions run at once: the count is
                    // taken before the effect).
                    if effects.fetch_add(1, Ordering::SeqCst) >= 300 {
                        let _ = writeln!(std::io::stdout().lock(), "idem-stalled");
                        std::future::pending::<()>().await;
                    }
                    // The effect: one whole line, written at once.
                    let _ = writeln!(std::io::stdout().lock(), "idem-effect {id}");
                    Ok::<_, RecordError>(id)
                }
            },
            std::future::pending::<()>(),
        )
        .await;
    panic!("member A stopped before it was killed: {outcome:?}");
}

/// Records of one partition run concurrently and finish out of order: the
/// committed offset of the partition waits for the slowest (its first
/// record), while another partition's commits go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_completion_the_committed_offset_waits_for_the_slowest() {
    let topic = name("refunds");
    let group = name("refunder");
    support::kafka::create_topic(&topic, 2);
    produce(
        &topic,
        (0..5)
            .map(|i| (0, Some(format!("r-{i}")), vec![], format!("{i}")))
            .collect(),
    )
    .await;
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let executed: Arc<Mutex<HashSet<String>>> = Arc::default();
    let consumer = consumer(&group, &topic, Idempotency::from_arc(redis_store().await))
        .partition_concurrency(8)
        .commit_interval(Duration::ZERO);
    let handler = {
        let (release, executed) = (release.clone(), executed.clone());
        move |record: KafkaRecord| {
            let (release, executed) = (release.clone(), executed.clone());
            async move {
                let key = record.key_text()?.to_owned();
                if record.partition == 0 && record.offset == 0 {
                    // The first record of partition 0 is the slowest.
                    let _ = release.acquire().await;
                }
                executed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(key.clone());
                Ok::<_, RecordError>(key)
            }
        }
    };
    let control = async {
        until(
            "records 1..4 of partition 0 done",
            Duration::from_secs(60),
            || async { consumer.stats().executed == 4 },
        )
        .await;
        // A record of partition 1, produced after the others settled, and
        // its commit: any commit point of partition 0 would have gone
        // with it or before it.
        produce(
            &topic,
            vec![(1, Some("late".to_owned()), vec![], "x".to_owned())],
        )
        .await;
        until("partition 1 committed", Duration::from_secs(60), || async {
            committed(&group, &topic, 2).await.get(&1) == Some(&1)
        })
        .await;
        let offsets = committed(&group, &topic, 2).await;
        assert_eq!(
            offsets.get(&0),
            None,
            "partition 0 committed past its running record"
        );
        assert_eq!(
            consumer.stats().committed_offsets.get(&(topic.clone(), 0)),
            None
        );
        release.add_permits(1);
        until("partition 0 committed", Duration::from_secs(60), || async {
            committed(&group, &topic, 2).await.get(&0) == Some(&5)
        })
        .await;
    };
    let (stats, ()) = tokio::join!(consumer.run(handler, control), async {});
    let stats = stats.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stats.executed, 6, "{stats:?}");
    assert_eq!(
        stats.committed_offsets.get(&(topic.clone(), 0)),
        Some(&5),
        "{stats:?}"
    );
}
