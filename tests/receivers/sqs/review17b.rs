//! Review 17b: the SQS consumer on moto (IDEM_MOTO_URL).
#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::sqs::aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use idem::sqs::aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use idem::sqs::aws_sdk_sqs::{self, Client};
use idem::sqs::{ConsumerStats, SqsConsumer, SqsConsumerError, SqsMessage};
use idem::{Idempotency, IdempotencyStore, MemoryStore};
use tokio::sync::oneshot;

use crate::support;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn moto_url() -> String {
    std::env::var("IDEM_MOTO_URL").expect("IDEM_MOTO_URL")
}

fn client_at(url: &str) -> Client {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url)
        .credentials_provider(Credentials::new("test", "test", None, None, "static"))
        .build();
    Client::from_conf(config)
}

fn client() -> Client {
    client_at(&moto_url())
}

fn moto_addr() -> SocketAddr {
    let url = moto_url();
    let hostport = url.trim_start_matches("http://").trim_end_matches('/');
    hostport.parse().unwrap()
}

async fn create_queue(client: &Client, prefix: &str) -> String {
    let name = format!("{prefix}-{:016x}", fastrand::u64(..));
    let out = client
        .create_queue()
        .queue_name(&name)
        .send()
        .await
        .unwrap();
    out.queue_url().unwrap().to_owned()
}

fn text(value: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .unwrap()
}

async fn send(client: &Client, url: &str, body: &str, key: &str) -> String {
    client
        .send_message()
        .queue_url(url)
        .message_body(body)
        .message_attributes("key", text(key))
        .send()
        .await
        .unwrap()
        .message_id()
        .unwrap()
        .to_owned()
}

async fn depth(client: &Client, url: &str) -> (u64, u64) {
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .unwrap();
    let a = out.attributes().unwrap();
    let get = |n: QueueAttributeName| -> u64 { a.get(&n).map_or(0, |v| v.parse().unwrap()) };
    (
        get(QueueAttributeName::ApproximateNumberOfMessages),
        get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
    )
}

async fn wait_until<F, Fut>(what: &str, limit: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    while !condition().await {
        assert!(start.elapsed() < limit, "{what}: not after {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct Running<S: IdempotencyStore = MemoryStore> {
    consumer: Arc<SqsConsumer<S>>,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<ConsumerStats, SqsConsumerError>>,
}

impl<S: IdempotencyStore> Running<S> {
    fn start<F, Fut>(consumer: SqsConsumer<S>, handler: F) -> Self
    where
        F: Fn(SqsMessage) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<usize, BoxError>> + Send + 'static,
    {
        let consumer = Arc::new(consumer);
        let (stop, stopped) = oneshot::channel::<()>();
        let c = consumer.clone();
        let task = tokio::spawn(async move {
            c.run(handler, async {
                let _ = stopped.await;
            })
            .await
        });
        Running {
            consumer,
            stop,
            task,
        }
    }

    async fn stop(self) -> ConsumerStats {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(40), self.task)
            .await
            .expect("the consumer stopped within 40 s")
            .unwrap()
            .unwrap()
    }
}

/// `concurrency(n)` documents "at least 1", no upper bound: a large value
/// must not panic `run` (tokio's `Semaphore::new` panics past
/// `usize::MAX >> 3` permits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_usize_max_does_not_panic_run() {
    let client = client();
    let url = create_queue(&client, "r17b-conc").await;
    let consumer = SqsConsumer::new(client.clone(), &url, Idempotency::new(MemoryStore::new()))
        .concurrency(usize::MAX)
        .wait_time(Duration::ZERO);
    let task = tokio::spawn(async move {
        consumer
            .run(
                |m: SqsMessage| async move { Ok::<_, std::io::Error>(m.body.len()) },
                tokio::time::sleep(Duration::from_millis(500)),
            )
            .await
    });
    let out = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("run returned");
    match out {
        Ok(Ok(_)) | Ok(Err(SqsConsumerError::Config(_))) => {}
        Ok(Err(e)) => panic!("run failed: {e}"),
        Err(e) => panic!("run panicked on concurrency(usize::MAX): {e}"),
    }
}

/// The handler of message 1 ran; the store went away until its 1 s lease
/// ended (`Unrecorded`): the crate docs promise "never run again: kept
/// invisible, its completion written with the run's own lease once the
/// store is back". Consumer A only retries the completion at the top of
/// its loop, i.e. after its long poll (20 s by default) returns. Meanwhile
/// a second consumer B sharing the store and the scope (here on a second
/// queue, e.g. a retry queue fed with the same keys) gets a duplicate of
/// the key once the store is back: it takes the expired lease over and
/// runs the handler a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unrecorded_run_is_run_again_by_a_second_consumer_before_a_finishes_it() {
    let client = client();
    let qa = create_queue(&client, "r17b-unrec-a").await;
    let qb = create_queue(&client, "r17b-unrec-b").await;
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (effects, down) = (effects.clone(), down.clone());
        move |_m: SqsMessage| {
            let (effects, down) = (effects.clone(), down.clone());
            async move {
                if effects.fetch_add(1, Ordering::SeqCst) == 0 {
                    down.store(true, Ordering::SeqCst);
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_secs(3));
                        down.store(false, Ordering::SeqCst);
                    });
                }
                Ok::<_, BoxError>(7)
            }
        }
    };
    // A: documented defaults but a short visibility (the heartbeat keeps
    // the unfinished message invisible).
    let a = Running::start(
        SqsConsumer::new(client.clone(), &qa, idem.clone())
            .key_attribute("key")
            .scope("pay")
            .visibility_timeout(Duration::from_secs(2)),
        handler.clone(),
    );
    send(&client, &qa, "charge", "k-1").await;
    let e = effects.clone();
    wait_until("the first run", Duration::from_secs(30), || {
        let ran = e.load(Ordering::SeqCst) > 0;
        async move { ran }
    })
    .await;
    // The store is back.
    let d = down.clone();
    wait_until("the store back", Duration::from_secs(30), || {
        let up = !d.load(Ordering::SeqCst);
        async move { up }
    })
    .await;
    let b = Running::start(
        SqsConsumer::new(client.clone(), &qb, idem.clone())
            .key_attribute("key")
            .scope("pay")
            .visibility_timeout(Duration::from_secs(2))
            .retry_visibility(Duration::ZERO)
            .wait_time(Duration::from_secs(1)),
        handler,
    );
    send(&client, &qb, "charge", "k-1").await;
    wait_until("both queues empty", Duration::from_secs(60), || {
        let client = client.clone();
        let (qa, qb) = (qa.clone(), qb.clone());
        async move { depth(&client, &qa).await == (0, 0) && depth(&client, &qb).await == (0, 0) }
    })
    .await;
    let (sa, sb) = (a.stop().await, b.stop().await);
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "an Unrecorded run ran again: A {sa:?} B {sb:?}"
    );
}

/// The heartbeat fails while a handler runs (A's connection to SQS is
/// cut): the message is redelivered to consumer B; B must get "in
/// progress" or the replay, never a second run; once A is back, every
/// message is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_heartbeat_never_runs_the_handler_twice() {
    let client = client();
    let url = create_queue(&client, "r17b-hbcut").await;
    let proxy = support::proxy::CountingProxy::start(moto_addr()).await;
    let through = client_at(&format!("http://{}", proxy.addr));
    let idem = Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(2));
    let runs = Arc::new(AtomicUsize::new(0));
    let (started_tx, started_rx) = tokio::sync::watch::channel(false);
    let handler = {
        let runs = runs.clone();
        move |m: SqsMessage| {
            let (runs, started) = (runs.clone(), started_tx.clone());
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let _ = started.send(true);
                tokio::time::sleep(Duration::from_secs(6)).await;
                Ok::<_, BoxError>(m.body.len())
            }
        }
    };
    let mk = |c: Client| {
        SqsConsumer::new(c, &url, idem.clone())
            .key_attribute("key")
            .visibility_timeout(Duration::from_secs(2))
            .retry_visibility(Duration::from_secs(1))
            .wait_time(Duration::from_secs(1))
            .call_timeout(Duration::from_secs(1))
    };
    let a = Running::start(mk(through), handler.clone());
    send(&client, &url, "slow", "h-1").await;
    let mut rx = started_rx.clone();
    tokio::time::timeout(Duration::from_secs(30), rx.wait_for(|s| *s))
        .await
        .unwrap()
        .unwrap();
    proxy.cut(true);
    let b = Running::start(mk(client.clone()), handler);
    let bc = b.consumer.clone();
    wait_until("B received the redelivery", Duration::from_secs(30), || {
        let n = bc.stats().received;
        async move { n >= 1 }
    })
    .await;
    proxy.cut(false);
    wait_until("the queue empty", Duration::from_secs(60), || {
        let client = client.clone();
        let url = url.clone();
        async move { depth(&client, &url).await == (0, 0) }
    })
    .await;
    let (sa, sb) = (a.stop().await, b.stop().await);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "A {sa:?} B {sb:?}");
    assert!(sa.heartbeat_failures >= 1, "{sa:?}");
}

/// The reply to DeleteMessageBatch is lost (the delete ran): no second
/// run, no dead letter; the redelivery (if any) is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_delete_reply_never_runs_the_handler_twice() {
    let client = client();
    let url = create_queue(&client, "r17b-delloss").await;
    let proxy = support::proxy::CountingProxy::start(moto_addr()).await;
    proxy.lose_replies_to(b"DeleteMessageBatch", 1, 3);
    let through = client_at(&format!("http://{}", proxy.addr));
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let a = Running::start(
        SqsConsumer::new(through, &url, Idempotency::new(MemoryStore::new()))
            .key_attribute("key")
            .visibility_timeout(Duration::from_secs(1))
            .wait_time(Duration::from_secs(1))
            .call_timeout(Duration::from_secs(1)),
        move |m: SqsMessage| {
            let r = r.clone();
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                Ok(m.body.len())
            }
        },
    );
    send(&client, &url, "x", "d-1").await;
    wait_until("the queue empty", Duration::from_secs(60), || {
        let client = client.clone();
        let url = url.clone();
        async move { depth(&client, &url).await == (0, 0) }
    })
    .await;
    let s = a.stop().await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{s:?}");
    assert_eq!((s.poison, s.dead_lettered), (0, 0), "{s:?}");
    assert!(proxy.lost() >= 1, "no reply was lost: {s:?}");
}
