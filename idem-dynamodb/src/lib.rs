//! DynamoDB store for [idem](https://docs.rs/idem): one item per key, a
//! conditional write for every transition.
//!
//! [`DynamoDbStore`] keeps each idempotency key in one item of a table whose
//! partition key is the string attribute `pk` ([`create_table`] makes one).
//! Every write is conditional, so a reservation, a completion, a release and
//! a lease renewal are each **one request** and atomic in DynamoDB:
//!
//! | operation | requests | how |
//! |---|---|---|
//! | `acquire`, fresh key | 1 | `PutItem` if the item does not exist |
//! | `acquire`, duplicate (completed, in progress, mismatch) | 1 | the same `PutItem`: its condition fails and DynamoDB returns the stored item (`ReturnValuesOnConditionCheckFailure = ALL_OLD`); the fingerprint is checked on that item |
//! | `acquire` after a lease ended, a release, a delete or an expiry | 2 | the `PutItem` above, then a `PutItem` conditioned on the item's revision (another writer in between: the answer comes from what it wrote) |
//! | `complete`, `release`, `extend` | 1 | `UpdateItem` conditioned on the lease token |
//! | `complete` of a response over [`INLINE_RESPONSE_BYTES`] | 1 | `TransactWriteItems`: the record and the response's chunk items together (a refused one learns why from the record's item in the cancellation reasons; a conflict with another transaction costs one `GetItem` more) |
//! | replay of a response over [`INLINE_RESPONSE_BYTES`] | 2 | the `PutItem`, then a consistent `BatchGetItem` of its chunks |
//! | `get` | 1 (2 with chunks) | `GetItem` with `ConsistentRead` |
//! | `delete` | 1 (2 with chunks or a corrupt item) | `UpdateItem` into a tombstone; a chunked response's chunks in one `BatchWriteItem`; a corrupt item replaced by a clean tombstone |
//! | `purge_expired` | scan pages + 1 per removed item | a consistent `Scan` filtered on the expiry, then a `DeleteItem` conditioned on each item's revision |
//!
//! ```no_run
//! use idem_core::{Idempotency, IdempotencyKey};
//! use idem_dynamodb::DynamoDbStore;
//!
//! # async fn demo(client: aws_sdk_dynamodb::Client) -> Result<(), Box<dyn std::error::Error>> {
//! // `client` from aws-config: `aws_sdk_dynamodb::Client::new(&aws_config::load_from_env().await)`.
//! idem_dynamodb::create_table(&client, "idem_records").await?; // once; harmless if it exists
//! let store = DynamoDbStore::new(client, "idem_records");
//! let idem = Idempotency::new(store);
//! let key = IdempotencyKey::new("emails.send", "msg-1")?;
//! idem.process(&key, "hello", |m| async move { Ok::<_, std::io::Error>(m.len()) }).await?;
//! # Ok(()) }
//! ```
//!
//! # Time: the clients' clocks, with a skew margin
//!
//! DynamoDB has no server clock that a condition can read, so leases and
//! expiries are timed by the clock of the client that writes them, and
//! compared with the clock of the client that reads them. A client whose
//! clock runs ahead of the holder's would see a lease end early and take
//! the key over while its holder still runs. So every comparison gives the
//! other side a margin, [`DynamoDbStore::clock_skew_margin`] (default
//! 1 s): a lease can be taken over only once it ended `margin` ago by the
//! reader's clock, and a record is absent only `margin` after its expiry.
//! **Clocks that differ by less than the margin never let a key run twice
//! while its lease holds**; keep the clients' clocks synchronised (NTP,
//! chrony, the Amazon Time Sync Service) well inside it. The cost: a
//! crashed holder's key waits `margin` longer before a takeover, and a
//! record replays `margin` longer than its retention.
//!
//! # Fences
//!
//! A fence is the acquiring client's clock in microseconds, or the stored
//! fence + 1 if that is higher. Releases and deletes leave a **tombstone**
//! (status `r` or `x`, [`TOMBSTONE_FOR`], then purged or removed by the
//! TTL) that keeps the fence, so a re-acquisition right after a release by
//! a client whose clock is behind still gets a higher fence. Once an item
//! is gone (its tombstone or its expired record purged), the next fence
//! rests on the acquiring client's clock alone, which is higher as long as
//! clocks differ by less than the time since the last acquisition.
//!
//! # Guarantees and their limits
//!
//! - **Consistency**: every write is conditional and every read
//!   (`GetItem`, `BatchGetItem`, `Scan`) is strongly consistent. Global
//!   tables replicate asynchronously between regions and resolve
//!   conflicts by last writer: use one region's table as the store.
//! - **Expiry**: the store checks `ex` itself; DynamoDB's TTL (attribute
//!   `tt`, enabled by [`create_table`]) only removes items days later, and
//!   `purge_expired` removes them sooner.
//! - **Item size**: DynamoDB refuses items over 400 KB. A response up to
//!   [`INLINE_RESPONSE_BYTES`] lives in the record; a larger one, up to
//!   [`DynamoDbStore::max_response_bytes`] (default
//!   [`DEFAULT_MAX_RESPONSE_BYTES`], under the 4 MB of a transaction), in
//!   chunk items written in the same transaction as the completion. A
//!   larger one is refused with [`StoreError::ResponseTooLarge`] before
//!   anything is sent (the executor then completes the key as "not
//!   replayable").
//! - **Resent requests**: the SDK resends a request whose reply was lost.
//!   An `acquire` resent finds its own token holding the key and answers
//!   "acquired"; a `complete` or `release` resent finds its own token in
//!   the completed record or the release tombstone and succeeds. `delete`
//!   is sent once (the SDK's retries are turned off for it): a resend could
//!   delete a reservation made since; a lost reply is
//!   [`StoreError::Unavailable`].
//! - **Timeouts**: every call is bounded by
//!   [`DynamoDbStore::call_timeout`] (default 2 s), the SDK's retries
//!   included; a request that timed out may still be applied (an
//!   acquisition held by nobody frees itself when its lease ends).
//! - **Durations**: a zero lease is refused before anything is sent;
//!   leases and retentions are saturated to
//!   [`MAX_DURATION`](idem_core::MAX_DURATION) and rounded up to whole ms.
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod acquire;
mod batch;
mod error;
mod item;
mod lease;
mod purge;
mod record;
mod request;
mod response;
mod setup;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_dynamodb::Client;
use batch::per_key;
use idem_core::{
    saturate, AcquireItem, Acquisition, Fingerprint, IdempotencyKey, IdempotencyStore, Lease,
    Record, StoreError,
};
use item::{n, Attrs};

pub use aws_sdk_dynamodb;
pub use batch::BATCH_CONCURRENCY;
pub use error::CallTimeout;
pub use idem_core;
pub use setup::{create_table, local_client};

/// The largest response kept in the record's own item. DynamoDB items hold
/// at most 400 KB, names and values of every attribute counted; the rest
/// of a record takes under 1 KB.
///
/// ```
/// assert_eq!(idem_dynamodb::INLINE_RESPONSE_BYTES, 380_000);
/// ```
pub const INLINE_RESPONSE_BYTES: usize = 380_000;

/// The default largest response: 3 MiB, in up to 9 chunk items written
/// with the completion in one transaction (4 MB at most).
///
/// ```
/// assert_eq!(idem_dynamodb::DEFAULT_MAX_RESPONSE_BYTES, 3 << 20);
/// ```
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 3 << 20;

/// The most a response can be: 10 chunks, with the record, under the
/// 4 MB of a `TransactWriteItems`.
const HARD_MAX_RESPONSE_BYTES: usize = 10 * INLINE_RESPONSE_BYTES;

/// How long a release or delete tombstone keeps a key's fence.
pub const TOMBSTONE_FOR: Duration = Duration::from_secs(3_600);

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
const DEFAULT_SKEW: Duration = Duration::from_secs(1);
/// The DynamoDB [`IdempotencyStore`]. Cloning is cheap (the SDK client is
/// shared).
///
/// ```no_run
/// use std::time::Duration;
/// use idem_dynamodb::DynamoDbStore;
///
/// # fn demo(client: aws_sdk_dynamodb::Client) {
/// let store = DynamoDbStore::new(client, "idem_records")
///     .call_timeout(Duration::from_millis(800))
///     .clock_skew_margin(Duration::from_millis(500));
/// # }
/// ```
#[derive(Clone)]
pub struct DynamoDbStore {
    client: Client,
    table: Arc<str>,
    call_timeout: Duration,
    skew_ms: i64,
    max_response_bytes: usize,
    clock_offset_ms: i64,
    purge_cursor: Arc<std::sync::Mutex<Option<Attrs>>>,
}

impl std::fmt::Debug for DynamoDbStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoDbStore")
            .field("table", &self.table)
            .field("call_timeout", &self.call_timeout)
            .field("clock_skew_margin_ms", &self.skew_ms)
            .field("max_response_bytes", &self.max_response_bytes)
            .finish()
    }
}

/// `d` in whole milliseconds, saturated and rounded up.
fn millis(d: Duration) -> i64 {
    let d = saturate(d);
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    i64::try_from(ms).unwrap_or(i64::MAX)
}

fn wall(ms: i64) -> SystemTime {
    if ms >= 0 {
        UNIX_EPOCH + Duration::from_millis(ms.unsigned_abs())
    } else {
        UNIX_EPOCH - Duration::from_millis(ms.unsigned_abs())
    }
}

fn since(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

impl DynamoDbStore {
    /// A store on `table` (made by [`create_table`] or to its shape).
    /// Defaults: 2 s call timeout, 1 s clock skew margin, responses up to
    /// [`DEFAULT_MAX_RESPONSE_BYTES`].
    pub fn new(client: Client, table: impl Into<String>) -> Self {
        DynamoDbStore {
            client,
            table: Arc::from(table.into()),
            call_timeout: DEFAULT_TIMEOUT,
            skew_ms: millis(DEFAULT_SKEW),
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            clock_offset_ms: 0,
            purge_cursor: Arc::new(std::sync::Mutex::new(None)),
        }
    }

    /// The longest one call may take, the SDK's retries included, before
    /// it fails with [`StoreError::Unavailable`] (default 2 s).
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = saturate(timeout).max(Duration::from_millis(1));
        self
    }

    /// How far apart the clients' clocks may be (default 1 s): a lease is
    /// taken over only once it ended this long ago by the reader's clock,
    /// and a record is absent this long after its expiry. See the crate
    /// docs.
    pub fn clock_skew_margin(mut self, margin: Duration) -> Self {
        self.skew_ms = millis(margin);
        self
    }

    /// The largest response `complete` accepts (default
    /// [`DEFAULT_MAX_RESPONSE_BYTES`]; at most 3.8 MB, ten chunks of
    /// [`INLINE_RESPONSE_BYTES`]: a larger value is lowered to that). A
    /// larger response is refused with [`StoreError::ResponseTooLarge`]
    /// before anything is sent.
    pub fn max_response_bytes(mut self, max: usize) -> Self {
        self.max_response_bytes = max.min(HARD_MAX_RESPONSE_BYTES);
        self
    }

    /// Moves this store's clock by `offset_ms` milliseconds (negative:
    /// behind). For tests of clock skew between clients; never needed in
    /// production.
    pub fn clock_offset_ms(mut self, offset_ms: i64) -> Self {
        self.clock_offset_ms = offset_ms;
        self
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The SDK client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The partition key (`pk`) of a key's item: `{scope}/{id}`.
    pub fn item_key(key: &IdempotencyKey) -> String {
        item::record_pk(key.scope(), key.id())
    }

    fn now_ms(&self) -> i64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        now.saturating_add(self.clock_offset_ms)
    }

    fn now_us(&self) -> u64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        u64::try_from(now.saturating_add(self.clock_offset_ms.saturating_mul(1_000))).unwrap_or(0)
    }

    /// The TTL attribute for an item live until `ex`: seconds, after the
    /// skew margin, rounded up.
    fn ttl_of(&self, ex: i64) -> AttributeValue {
        n(ex.saturating_add(self.skew_ms) / 1_000 + 1)
    }

    /// Whether an item that stops being live at `ex` is gone by `now`.
    fn gone(&self, ex: i64, now: i64) -> bool {
        ex.saturating_add(self.skew_ms) < now
    }

    async fn timed<T, F>(&self, call: F) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, StoreError>>,
    {
        match tokio::time::timeout(self.call_timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::unavailable(CallTimeout(self.call_timeout))),
        }
    }

    fn corrupt(key: &IdempotencyKey, detail: impl Into<String>) -> StoreError {
        StoreError::Corrupt {
            key: key.clone(),
            detail: detail.into(),
        }
    }
}

#[async_trait]
impl IdempotencyStore for DynamoDbStore {
    fn backend_name(&self) -> &'static str {
        "dynamodb"
    }

    async fn acquire(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        self.timed(self.acquire_inner(key, fingerprint, lease))
            .await
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.timed(self.complete_inner(lease, response, retention))
            .await
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        self.timed(self.release_inner(lease)).await
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        self.timed(self.extend_inner(lease, lease_for)).await
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.timed(self.get_inner(key)).await
    }

    async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        self.timed(self.delete_inner(key)).await
    }

    async fn purge_expired(&self, max: usize) -> Result<u64, StoreError> {
        self.purge_inner(max).await
    }

    /// One `acquire` per item (DynamoDB has no conditional batch write
    /// that answers per item), up to [`BATCH_CONCURRENCY`] at once: the
    /// items of one key one after the other, in order, so a key twice in
    /// a batch sees its earlier item's effect.
    async fn acquire_many(
        &self,
        items: &[AcquireItem<'_>],
        lease: Duration,
    ) -> Result<Vec<Result<Acquisition, StoreError>>, StoreError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        if lease.is_zero() {
            return Err(StoreError::zero_lease());
        }
        Ok(per_key(
            items.len(),
            |i| items[i].key,
            |i| async move {
                self.acquire(items[i].key, items[i].fingerprint, lease)
                    .await
            },
        )
        .await)
    }

    /// One `complete` per item, as [`acquire_many`](Self::acquire_many).
    async fn complete_many(
        &self,
        items: &[(&Lease, &[u8])],
        retention: Duration,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        Ok(per_key(
            items.len(),
            |i| &items[i].0.key,
            |i| async move { self.complete(items[i].0, items[i].1, retention).await },
        )
        .await)
    }
}
