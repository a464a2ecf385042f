//! DynamoDbStore against moto's server mode (IDEM_MOTO_URL, or a server
//! started here): the conformance suite, clock skew between clients, lost
//! replies, storms through a frozen server and a cut connection, and the
//! store as the source of truth of a tiered store; `requests`: what each
//! operation costs, counted at a proxy; `items`: chunked responses,
//! corrupt items, fences and purges
//! (`cargo test --all-features --test stores dynamodb::items`).

use crate::support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use idemkit::dynamodb::aws_sdk_dynamodb::types::AttributeValue;
use idemkit::dynamodb::{create_table, local_client, DynamoDbStore};
use idemkit::testkit::{self, Harness, Settings};
use idemkit::tiered::{MokaCache, TieredStore};
use idemkit::{
    async_trait, Acquisition, Idempotency, IdempotencyKey, IdempotencyStore, InProgressPolicy,
    Processed,
};
use support::moto::{self, MotoServer};
use support::proxy::CountingProxy;

mod items;
mod requests;

const TABLE: &str = "idem_records";
const LONG: Duration = Duration::from_secs(30);
const DAY: Duration = Duration::from_secs(86_400);

/// A store on a table of its own (moto scans a table in full: `purge`
/// stays quick when each test has its own).
async fn store_at(url: &str) -> DynamoDbStore {
    let table = format!("{TABLE}_{:016x}", fastrand::u64(..));
    store_on(url, &table).await
}

async fn store_on(url: &str, table: &str) -> DynamoDbStore {
    let client = local_client(url);
    create_table(&client, table)
        .await
        .unwrap_or_else(|e| panic!("cannot create the table {table} at {url}: {e}"));
    // The suite's leases are 300 ms: a margin well inside them. moto is a
    // Python emulator sharing two cores with the tests: calls get 10 s.
    DynamoDbStore::new(client, table)
        .clock_skew_margin(Duration::from_millis(20))
        .call_timeout(Duration::from_secs(10))
}

async fn store() -> DynamoDbStore {
    store_at(moto::shared_url()).await
}

fn key(tag: &str) -> IdempotencyKey {
    testkit::unique_key(tag)
}

fn fp(text: &str) -> idemkit::Fingerprint {
    idemkit::Fingerprint::of_bytes(text.as_bytes())
}

/// `k` acquired for `lease` (anything else fails the test).
async fn acquired(store: &DynamoDbStore, k: &IdempotencyKey, lease: Duration) -> idemkit::Lease {
    match store.acquire(k, None, lease).await {
        Ok(Acquisition::Acquired(l)) => l,
        other => panic!("acquire {k}: {other:?}"),
    }
}

/// Overwrites the item of `key` with `attrs` (plus its `pk`).
async fn overwrite(store: &DynamoDbStore, key: &IdempotencyKey, attrs: &[(&str, AttributeValue)]) {
    let mut item: HashMap<String, AttributeValue> = attrs
        .iter()
        .map(|(n, v)| ((*n).to_owned(), v.clone()))
        .collect();
    item.insert("pk".into(), AttributeValue::S(DynamoDbStore::item_key(key)));
    store
        .client()
        .put_item()
        .table_name(store.table())
        .set_item(Some(item))
        .send()
        .await
        .unwrap_or_else(|e| panic!("overwrite: {e:?}"));
}

struct DynamoHarness;

#[async_trait]
impl Harness for DynamoHarness {
    type Store = DynamoDbStore;
    async fn store(&self) -> DynamoDbStore {
        store().await
    }
    async fn corrupt(&self, store: &DynamoDbStore, key: &IdempotencyKey) {
        overwrite(
            store,
            key,
            &[
                ("st", AttributeValue::S("zz".into())),
                ("fe", AttributeValue::N("1".into())),
                ("ex", AttributeValue::N("99999999999999".into())),
                ("rv", AttributeValue::N("1".into())),
            ],
        )
        .await;
    }
    fn settings(&self) -> Settings {
        // moto answers a few thousand requests a second: a smaller storm.
        Settings::default()
            .lease(Duration::from_millis(300))
            .storm(16, 200)
    }
}

idemkit::conformance_tests!(DynamoHarness);

/// A store whose requests go through a counting proxy in front of `url`.
async fn proxied(url: &str) -> (DynamoDbStore, CountingProxy) {
    let upstream: SocketAddr = url
        .trim_start_matches("http://")
        .parse()
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let proxy = CountingProxy::start(upstream).await;
    // The table made through the direct URL first.
    let table = store_at(url).await.table().to_owned();
    (
        store_on(&format!("http://{}", proxy.addr), &table).await,
        proxy,
    )
}

/// Two clients whose clocks differ by less than the margin: the one ahead
/// never takes over a lease its holder still has, and never sees a
/// completed record as expired before its retention; without the margin
/// it would (the hazard the margin is there for). A client behind still
/// gets a higher fence after a release (the tombstone keeps it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clock_skew_within_the_margin_never_takes_a_live_lease_over() {
    let base = store().await;
    // Seconds, not milliseconds: a busy moto may take a second or more
    // per request, and the windows below must outlast a few of them.
    let margin = Duration::from_secs(10);
    let holder = base.clone().clock_skew_margin(margin);
    let ahead = base
        .clone()
        .clock_skew_margin(margin)
        .clock_offset_ms(8_000);
    let ahead_no_margin = base
        .clone()
        .clock_skew_margin(Duration::ZERO)
        .clock_offset_ms(8_000);
    let behind = base
        .clone()
        .clock_skew_margin(margin)
        .clock_offset_ms(-8_000);

    // A 3 s lease; the client 8 s ahead asks at once: the holder's lease
    // ends 5 s from now on its clock (3 + 10 - 8).
    let k = key("skew-lease");
    let lease = acquired(&holder, &k, Duration::from_secs(3)).await;
    let got = ahead.acquire(&k, None, LONG).await;
    match got {
        Ok(Acquisition::InProgress { retry_after, .. }) => {
            assert!(retry_after <= Duration::from_secs(6), "{retry_after:?}")
        }
        other => panic!("within the margin: expected InProgress, got {other:?}"),
    }
    // Without a margin the same client takes the live lease over.
    let k2 = key("skew-hazard");
    match holder.acquire(&k2, None, Duration::from_secs(3)).await {
        Ok(Acquisition::Acquired(_)) => {}
        other => panic!("{other:?}"),
    }
    let got = ahead_no_margin.acquire(&k2, None, LONG).await;
    assert!(
        matches!(got, Ok(Acquisition::Acquired(_))),
        "without a margin a clock 8 s ahead takes a 3 s lease over at once: {got:?}"
    );
    // The holder completes with a 3 s retention: the client ahead (past
    // it on its own clock, within the margin) replays it, and the one
    // behind too.
    holder
        .complete(&lease, b"r", Duration::from_secs(3))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for (who, s) in [("ahead", &ahead), ("behind", &behind)] {
        let got = s.acquire(&k, None, LONG).await;
        assert!(
            matches!(got, Ok(Acquisition::Completed(_))),
            "{who}: {got:?}"
        );
    }

    // Fences: released by the holder, acquired by the client behind.
    let k3 = key("skew-fence");
    let first = acquired(&holder, &k3, LONG).await;
    holder
        .release(&first)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let second = acquired(&behind, &k3, LONG).await;
    assert!(
        second.fence > first.fence,
        "fence {} after a release, by a clock 8 s behind, is not above {}",
        second.fence,
        first.fence
    );
    behind.delete(&k3).await.unwrap_or_else(|e| panic!("{e}"));
    let third = acquired(&behind, &k3, LONG).await;
    assert!(third.fence > second.fence, "after a delete");
}

/// Replies lost after DynamoDB applied the request: the SDK sends it
/// again, and the resend finds the first one's work: an acquire is still
/// acquired (its own token holds the key), a completion and a release
/// still succeed. Nothing runs twice, nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_and_its_resend_are_one_operation() {
    let (store, proxy) = proxied(moto::shared_url()).await;
    let store = store.call_timeout(Duration::from_secs(10));
    let k = key("resend");
    proxy.lose_replies_to(b"DynamoDB_20120810.PutItem", 1, 1);
    let lease = match store.acquire(&k, Some(&fp("a")), LONG).await {
        Ok(Acquisition::Acquired(l)) => l,
        other => panic!("acquire with a lost reply: {other:?}"),
    };
    assert_eq!(proxy.lost(), 1, "the reply was not lost");
    assert_eq!(lease.attempt, 1);
    proxy.lose_replies_to(b"DynamoDB_20120810.UpdateItem", 1, 1);
    store
        .complete(&lease, b"once", DAY)
        .await
        .unwrap_or_else(|e| panic!("complete with a lost reply: {e}"));
    assert_eq!(proxy.lost(), 2);
    match store.acquire(&k, Some(&fp("a")), LONG).await {
        Ok(Acquisition::Completed(r)) => assert_eq!(&r.response[..], b"once"),
        other => panic!("{other:?}"),
    }
    let k2 = key("resend-release");
    let lease = acquired(&store, &k2, LONG).await;
    proxy.lose_replies_to(b"DynamoDB_20120810.UpdateItem", 1, 1);
    store
        .release(&lease)
        .await
        .unwrap_or_else(|e| panic!("release with a lost reply: {e}"));
    assert_eq!(proxy.lost(), 3);
    assert!(store
        .get(&k2)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .is_none());
    // A delete is sent once: its lost reply is an error that says so.
    let lease = acquired(&store, &k2, LONG).await;
    drop(lease);
    proxy.lose_replies_to(b"DynamoDB_20120810.UpdateItem", 1, 1);
    let deleted = store.delete(&k2).await;
    assert!(
        matches!(&deleted, Err(e) if e.is_retryable()),
        "a delete whose reply was lost: {deleted:?}"
    );
}

/// The executor settings of the fault storms: leases long enough to ride
/// out the outage; store calls of 1 s, so a frozen server is seen soon
/// while a debug-built SDK client on a loaded machine (tens of ms of CPU
/// per request) still answers inside it; waiters poll every 100 ms, so
/// they do not crowd out the holder's completion.
fn fault_executor(store: DynamoDbStore) -> Idempotency<DynamoDbStore> {
    // The lease is far longer than the faults (a cut of 500 ms, a freeze):
    // on a loaded machine moto's answers may take seconds, and a lease
    // passed is a takeover (`LeaseLost`), the window these tests are not
    // about.
    Idempotency::new(store.call_timeout(Duration::from_secs(1)))
        .lease(Duration::from_secs(30))
        .retention(DAY)
        .on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::from_secs(60),
            poll: Duration::from_millis(100),
        })
}

/// moto frozen (SIGSTOP) in the middle of a storm, then thawed: calls
/// fail `Unavailable` while it is frozen, every key runs exactly once and
/// every replay is that run's value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_through_a_frozen_server() {
    let server = Arc::new(MotoServer::start());
    let store = store_at(&server.url).await;
    let (freeze, thaw) = (server.clone(), server.clone());
    let report = support::chaos::storm_through_fault(
        fault_executor(store),
        200,
        8,
        Box::new(move || freeze.freeze()),
        Some(Box::new(move || {
            std::thread::sleep(Duration::from_millis(500));
            thaw.thaw()
        })),
    )
    .await;
    assert!(report.unavailable > 0, "the freeze was never seen");
}

/// The connection to DynamoDB cut in the middle of a storm (a proxy
/// closes every connection and refuses new ones, as an endpoint that went
/// away; the data stays, as DynamoDB's does), then restored: the same
/// guarantee. moto itself keeps everything in memory, so killing it
/// would lose every record, which DynamoDB never does: the cut stands in
/// for "killed and restarted".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_through_a_cut_connection() {
    let server = MotoServer::start();
    let (store, proxy) = proxied(&server.url).await;
    let proxy = Arc::new(proxy);
    let (cut, restore) = (proxy.clone(), proxy.clone());
    let report = support::chaos::storm_through_fault(
        fault_executor(store),
        200,
        8,
        Box::new(move || cut.cut(true)),
        Some(Box::new(move || {
            std::thread::sleep(Duration::from_millis(500));
            restore.cut(false)
        })),
    )
    .await;
    assert!(report.unavailable > 0, "the cut was never seen");
}

/// moka in front of DynamoDB as the source of truth: the storm holds, a
/// replay of a completed key is answered by moka with no request, and a
/// delete goes through both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_over_dynamodb() {
    let tiered = TieredStore::new(store().await).with_cache(MokaCache::new(10_000, 64 << 20));
    let idem = testkit::storm_executor(tiered);
    testkit::storm(&[idem], 8, 100).await;

    let (source, proxy) = proxied(moto::shared_url()).await;
    let tiered = TieredStore::new(source).with_cache(MokaCache::new(10_000, 64 << 20));
    let idem = Idempotency::new(tiered.clone());
    let k = key("tiered");
    let run = |v: u32| {
        let idem = idem.clone();
        let k = k.clone();
        async move {
            idem.process(&k, 1u8, move |_| async move { Ok::<_, std::io::Error>(v) })
                .await
        }
    };
    assert!(matches!(run(1).await, Ok(Processed::Executed(1))));
    let before = proxy.turns();
    assert!(matches!(run(2).await, Ok(Processed::Replayed(1))));
    assert_eq!(proxy.turns(), before, "the replay reached DynamoDB");
    assert!(tiered.delete(&k).await.unwrap_or_else(|e| panic!("{e}")));
    assert!(matches!(run(3).await, Ok(Processed::Executed(3))));
}
