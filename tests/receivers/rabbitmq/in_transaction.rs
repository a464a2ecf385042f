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
