//! The consumer's in-transaction form (`run_in_transaction`,
//! PostgreSQL): the claim, the handler's INSERT and the result commit
//! together, before the ack. Duplicates and handler failures through two
//! consumers on a pool of 8 connections: one row per message.

use crate::support;
use crate::support::ledger::{pg_store, BoxError, Ledger};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::postgres::PgTx;
use idemkit::rabbitmq::{RabbitConsumer, RabbitMessage};
use idemkit::Idempotency;

use super::{channel, declare, drained, name, publish_ids, until_settled, wait_until};

/// 200 messages, each published 1 to 3 times, through two consumers in
/// their in-transaction form; every fifth message's handler fails on its
/// first run after its INSERT (rolled back with the claim). Each message
/// commits one row, with the fence of its run, and the queue ends empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_and_failures_commit_one_row_per_message() {
    let queue = name("tx");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    let store = pg_store(8).await;
    let ledger = Ledger::create(store.pool(), "rabbit_tx").await;
    let ids: Vec<String> = (0..200).map(|m| format!("t-{m}")).collect();
    let mut copies = Vec::new();
    for id in &ids {
        for _ in 0..fastrand::u32(1..=3) {
            copies.push(id.clone());
        }
    }
    fastrand::shuffle(&mut copies);
    publish_ids(&channel, &queue, &copies).await;
    let failures = Arc::new(AtomicU64::new(0));
    let consumer = || {
        Arc::new(
            RabbitConsumer::new(
                support::rabbitmq::shared_url(),
                &queue,
                Idempotency::new(store.clone()),
            )
            .prefetch(4)
            .requeue_delay(Duration::from_millis(50)),
        )
    };
    let handler = || {
        let (ledger, failures) = (ledger.clone(), failures.clone());
        move |message: RabbitMessage, tx: PgTx| {
            let (ledger, failures) = (ledger.clone(), failures.clone());
            async move {
                let id = message.message_id().unwrap_or_default().to_owned();
                ledger.insert(&tx, &id, message.fence).await?;
                let n: u32 = id.trim_start_matches("t-").parse()?;
                if n.is_multiple_of(5) && message.attempt == 1 && !message.redelivered {
                    failures.fetch_add(1, Ordering::SeqCst);
                    return Err::<(), BoxError>(
                        "the first run of every fifth message fails".into(),
                    );
                }
                Ok(())
            }
        }
    };
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let run = |c: Arc<RabbitConsumer<_>>, h, mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        c.run_in_transaction(h, async move {
            let _ = stopped.wait_for(|s| *s).await;
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let (ca, cb) = (consumer(), consumer());
    let a = tokio::spawn(run(ca.clone(), handler(), stopped.clone()));
    let b = tokio::spawn(run(cb.clone(), handler(), stopped));
    let l = ledger.clone();
    wait_until("a row per message", Duration::from_secs(120), || {
        let l = l.clone();
        async move { l.total().await == 200 }
    })
    .await;
    until_settled(
        &queue,
        Duration::from_secs(60),
        &[&|| ca.stats(), &|| cb.stats()],
    )
    .await;
    let _ = stop.send(true);
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    assert!(drained(&queue).await, "{a:?} {b:?}");
    assert_eq!(ledger.doubles().await, Vec::<(String, i64)>::new());
    assert_eq!(ledger.total().await, 200);
    assert!(failures.load(Ordering::SeqCst) >= 1);
    assert_eq!(a.executed + b.executed, 200, "{a:?} {b:?}");
}

/// Tells a child process of this binary to be the consumer that is killed
/// (its value: the queue and the ledger table).
const KILLED_CONSUMER: &str = "IDEM_TEST_RABBITMQ_TX_CONSUMER";

/// The message whose run the killed consumer holds open after its INSERT.
const HELD: &str = "t-7";

/// A consumer, a process of its own, is killed (SIGKILL) after its
/// handler's INSERT for one message and before that transaction commits:
/// nothing of that run is kept; the broker requeues what the killed
/// consumer held and the other consumer runs it once, and replays what it
/// committed but did not ack. Every message's row is in the ledger once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_between_its_insert_and_the_commit_leaves_nothing_and_the_redelivery_commits_once(
) {
    if let Ok(spec) = std::env::var(KILLED_CONSUMER) {
        let (queue, table) = spec.split_once(' ').unwrap();
        let store = pg_store(4).await;
        let ledger = Ledger::existing(store.pool(), table);
        let consumer = RabbitConsumer::new(
            support::rabbitmq::shared_url(),
            queue,
            Idempotency::new(store),
        )
        .prefetch(4);
        let _ = consumer
            .run_in_transaction(
                move |message: RabbitMessage, tx: PgTx| {
                    let ledger = ledger.clone();
                    async move {
                        let id = message.message_id().unwrap_or_default().to_owned();
                        ledger.insert(&tx, &id, message.fence).await?;
                        if id == HELD {
                            println!("idem-inserted {id}");
                            std::future::pending::<()>().await;
                        }
                        Ok::<_, BoxError>(())
                    }
                },
                std::future::pending::<()>(),
            )
            .await;
        return;
    }
    let queue = name("tx-killed");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    let ids: Vec<String> = (0..20).map(|m| format!("t-{m}")).collect();
    publish_ids(&channel, &queue, &ids).await;
    let store = pg_store(8).await;
    let ledger = Ledger::create(store.pool(), "rabbit_tx").await;
    let mut child = support::alone::Part::start(
        "rabbitmq::in_transaction::a_consumer_killed_between_its_insert_and_the_commit_leaves_nothing_and_the_redelivery_commits_once",
        KILLED_CONSUMER,
        &format!("{queue} {}", ledger.table),
        &[("IDEM_AMQP_URL", support::rabbitmq::shared_url())],
    );
    child.line_with("idem-inserted ", Duration::from_secs(120));
    assert_eq!(ledger.rows(HELD).await, 0, "not committed yet");
    child.kill();
    let consumer = Arc::new(
        RabbitConsumer::new(
            support::rabbitmq::shared_url(),
            &queue,
            Idempotency::new(store.clone()),
        )
        .requeue_delay(Duration::from_millis(50)),
    );
    let l = ledger.clone();
    let running = {
        let consumer = consumer.clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            consumer
                .run_in_transaction(
                    move |message: RabbitMessage, tx: PgTx| {
                        let l = l.clone();
                        async move {
                            l.insert(&tx, message.message_id().unwrap_or_default(), message.fence)
                                .await?;
                            Ok::<_, BoxError>(())
                        }
                    },
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
        });
        (stop, task)
    };
    let l = ledger.clone();
    wait_until("a row per message", Duration::from_secs(120), || {
        let l = l.clone();
        async move { l.total().await == 20 }
    })
    .await;
    until_settled(&queue, Duration::from_secs(60), &[&|| consumer.stats()]).await;
    let _ = running.0.send(());
    let stats = running.1.await.unwrap().unwrap();
    assert!(
        ledger.doubles().await.is_empty(),
        "{:?}",
        ledger.doubles().await
    );
    assert_eq!(ledger.rows(HELD).await, 1, "{stats:?}");
    assert!(drained(&queue).await);
}
