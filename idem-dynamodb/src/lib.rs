//! DynamoDB store for [idem](https://docs.rs/idemkit): one item per key, a
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
//! | `acquire` after a lease ended, a release, a delete or an expiry | 2 (3 over a deleted chunked response) | the `PutItem` above, then a `PutItem` conditioned on the item's revision (another writer in between: the answer comes from what it wrote); over a tombstone that still names a deleted response's chunks (its delete's reply lost), a `BatchWriteItem` removing them |
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
mod store;

#[cfg(doc)]
use idem_core::StoreError;

pub use aws_sdk_dynamodb;
pub use batch::BATCH_CONCURRENCY;
pub use error::CallTimeout;
pub use idem_core;
pub use setup::{create_table, local_client};
pub use store::{DynamoDbStore, DEFAULT_MAX_RESPONSE_BYTES, INLINE_RESPONSE_BYTES, TOMBSTONE_FOR};
