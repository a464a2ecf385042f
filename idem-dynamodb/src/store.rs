//! [`DynamoDbStore`]: its settings, defaults and limits, its clock (with
//! the skew margin), and the [`IdempotencyStore`] operations, each bounded
//! by the call timeout (their bodies are in `acquire.rs`, `response.rs`,
//! `lease.rs`, `record.rs` and `purge.rs`).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_dynamodb::Client;
use idem_core::{
    saturate, AcquireItem, Acquisition, Fingerprint, IdempotencyKey, IdempotencyStore, Lease,
    Record, StoreError,
};

use crate::batch::per_key;
#[cfg(doc)]
use crate::batch::BATCH_CONCURRENCY;
use crate::error::CallTimeout;
use crate::item::{self, n, Attrs};
#[cfg(doc)]
use crate::setup::create_table;

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
pub(crate) const HARD_MAX_RESPONSE_BYTES: usize = 10 * INLINE_RESPONSE_BYTES;

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
    pub(crate) client: Client,
    pub(crate) table: Arc<str>,
    call_timeout: Duration,
    pub(crate) skew_ms: i64,
    pub(crate) max_response_bytes: usize,
    clock_offset_ms: i64,
    pub(crate) purge_cursor: Arc<std::sync::Mutex<Option<Attrs>>>,
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
pub(crate) fn millis(d: Duration) -> i64 {
    let d = saturate(d);
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    i64::try_from(ms).unwrap_or(i64::MAX)
}

pub(crate) fn wall(ms: i64) -> SystemTime {
    if ms >= 0 {
        UNIX_EPOCH + Duration::from_millis(ms.unsigned_abs())
    } else {
        UNIX_EPOCH - Duration::from_millis(ms.unsigned_abs())
    }
}

pub(crate) fn since(ms: i64) -> Duration {
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

    pub(crate) fn now_ms(&self) -> i64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        now.saturating_add(self.clock_offset_ms)
    }

    pub(crate) fn now_us(&self) -> u64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        u64::try_from(now.saturating_add(self.clock_offset_ms.saturating_mul(1_000))).unwrap_or(0)
    }

    /// The TTL attribute for an item live until `ex`: seconds, after the
    /// skew margin, rounded up.
    pub(crate) fn ttl_of(&self, ex: i64) -> AttributeValue {
        n(ex.saturating_add(self.skew_ms) / 1_000 + 1)
    }

    /// Whether an item that stops being live at `ex` is gone by `now`.
    pub(crate) fn gone(&self, ex: i64, now: i64) -> bool {
        ex.saturating_add(self.skew_ms) < now
    }

    pub(crate) async fn timed<T, F>(&self, call: F) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, StoreError>>,
    {
        match tokio::time::timeout(self.call_timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::unavailable(CallTimeout(self.call_timeout))),
        }
    }

    pub(crate) fn corrupt(key: &IdempotencyKey, detail: impl Into<String>) -> StoreError {
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
