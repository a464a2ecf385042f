//! The core of [idem](https://docs.rs/idemkit): idempotent receivers.
//!
//! A message delivered many times (broker redelivery, client retry, a
//! consumer that crashed before its ack, two consumers racing) must have its
//! side effects applied once, and every later delivery must get the same
//! result back. This crate holds the pieces:
//!
//! - [`IdempotencyKey`] and [`Fingerprint`]: what identifies an operation
//!   and its payload, with helpers for natural, content-derived and
//!   time-windowed keys.
//! - [`IdempotencyStore`]: the store contract, one round trip per
//!   operation, with fencing [`LeaseToken`]s.
//! - [`Idempotency`]: the executor that acquires the key, runs the handler
//!   once (renewing the lease while it runs), records the result and
//!   replays it, typed, to every duplicate.
//! - [`MemoryStore`]: the in-process store.
//! - `testkit` (feature `testkit`): the conformance suite every store runs.
//!
//! ```
//! use idem_core::{Idempotency, IdempotencyKey, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let idem = Idempotency::new(MemoryStore::new());
//! let key = IdempotencyKey::new("emails.welcome", "user-42")?;
//! let sent = idem
//!     .process(&key, "user-42", |user| async move { Ok::<_, std::io::Error>(format!("sent to {user}")) })
//!     .await?;
//! assert_eq!(sent.into_inner(), "sent to user-42");
//! # Ok(()) }
//! ```
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod batching;
mod canonical;
mod codec;
pub mod delivery;
mod error;
mod executor;
mod fingerprint;
mod finishing;
mod finite;
pub mod json;
mod key;
mod memory;
mod payload;
mod record;
mod store;
mod telemetry;

#[cfg(feature = "testkit")]
pub mod testkit;

pub use batching::{Batcher, Batching, STORE_BATCH_SIZE};
pub use canonical::canonical_json;
pub use codec::{Codec, JsonCodec};
pub use error::{BoxError, CodecError, IdemError, KeyError, StoreError, Unrecorded};
pub use executor::{
    BatchOutcome, Context, Gated, Idempotency, InProgressPolicy, KeyGate, LeaseRunner, Processed,
    Runner, SharedTx, TransactionalStore, TxEnded, TxGuard, TxRunner, DEFAULT_TRANSACTION_WAIT,
};
pub use fingerprint::Fingerprint;
pub use finishing::{Finished, FinishingGuard, FinishingKeys, GivenUpKeys, Pauses, MIN_PAUSE};
pub use key::{IdempotencyKey, MAX_ID_LEN, MAX_SCOPE_LEN};
pub use memory::{MemoryStore, MemoryStoreBuilder};
pub use payload::{PayloadFingerprint, PickFn};
pub use record::{
    not_replayable_marker, not_replayable_reason, saturate, within_response_limit, Acquisition,
    CompletedRecord, Lease, LeaseToken, Record, RecordState, IN_PROGRESS_GRACE, MAX_DURATION,
    NOT_REPLAYABLE,
};
pub use store::{purge_periodically, AcquireItem, IdempotencyStore};
pub use telemetry::{describe_metrics, StoreOperation, STORE_DURATION_SECONDS};

pub use async_trait::async_trait;
