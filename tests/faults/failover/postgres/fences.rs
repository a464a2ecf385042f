//! Fences across a failover: the standby that is promoted may lack the
//! last acquisitions (asynchronous replication, a standby that was away, an
//! in-transaction claim whose transaction never committed), and with them
//! the sequence's advance; the fences it hands out must still be above
//! every fence handed out before.

use crate::support;

use std::time::{Duration, Instant};

use idemkit::postgres::Claim;
use idemkit::{Acquisition, IdempotencyStore};
use support::pg_replica::{PgReplicaPair, Replication};
use support::report::report;
use support::storm::run_id;

use super::{acquire_until_answered, key, small_pool, store_on, until_migrated_on_standby};

/// Asynchronous replication; the standby is stopped, the primary hands
/// out 40 fences (plain acquisitions, and an in-transaction claim whose
/// transaction is still open when the primary crashes), then the standby
/// is started and promoted: the next fences, for a new key and for a key
/// acquired before the crash, are above every fence handed out before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_rise_across_a_failover_to_a_standby_that_lacks_the_last_acquisitions() {
    let started = Instant::now();
    let _one = super::ONE_AT_A_TIME.lock().await;
    let pair = tokio::task::block_in_place(|| PgReplicaPair::start(Replication::Async));
    let (_failover, store) = store_on(&pair, small_pool(), 4).await;
    until_migrated_on_standby(&pair).await;
    let run = run_id();
    tokio::task::block_in_place(|| pair.stop_standby());
    let mut highest = 0u64;
    for i in 0..40 {
        match store
            .acquire(&key(&run, i), None, Duration::from_secs(60))
            .await
        {
            Ok(Acquisition::Acquired(lease)) => highest = highest.max(lease.fence),
            other => panic!("{other:?}"),
        }
    }
    // An in-transaction claim, its transaction open when the primary dies.
    let pool = store.pool().clone();
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let claimed = key(&run, 40);
    match store
        .in_transaction()
        .claim_with::<String>(&mut tx, &claimed, None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    {
        Claim::Acquired(lease) => highest = highest.max(lease.fence()),
        Claim::Replayed(r) => panic!("replayed {r:?}"),
    }
    tokio::task::block_in_place(|| {
        pair.kill_primary();
        pair.start_standby_again();
        pair.promote_standby();
    });
    drop(tx);
    let mut after = Vec::new();
    for k in [key(&run, 100), key(&run, 39), claimed] {
        match acquire_until_answered(&store, &k).await {
            Acquisition::Acquired(lease) => after.push(lease.fence),
            other => panic!("after the failover, {k}: {other:?}"),
        }
    }
    report(
        "postgres-fences-across-failover",
        "postgres",
        &[
            ("highest_before", highest.to_string()),
            ("first_after", after[0].to_string()),
        ],
        started,
    );
    for fence in after {
        assert!(
            fence > highest,
            "fence {fence} after the failover, {highest} handed out before it"
        );
    }
}
