//! An idempotent Kafka consumer for [idem](https://docs.rs/idemkit): it reads
//! topics in a consumer group, runs each record through
//! [`Idempotency`] (the handler detached, the key from the record key, a
//! header or a hash of the content), and commits a partition's offset only
//! over records whose result is recorded, replayed or dead-lettered, and
//! only contiguously: the committed offset never passes a record still
//! running.
//!
//! ```no_run
//! use idem_core::{Idempotency, MemoryStore};
//! use idem_kafka::{KafkaConsumer, KafkaRecord};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let idem = Idempotency::new(MemoryStore::new());
//! let consumer = KafkaConsumer::connect("127.0.0.1:9092", "billing", &["payments"], idem)?
//!     .key_header("message-id")
//!     .concurrency(64)
//!     .max_deliveries(5); // then to the topic "payments.dead"
//! let shutdown = async { let _ = tokio::signal::ctrl_c().await; };
//! let stats = consumer
//!     .run(
//!         |record: KafkaRecord| async move {
//!             let amount: u64 = record.json()?;
//!             Ok::<_, idem_kafka::RecordError>(format!("charged {amount}"))
//!         },
//!         shutdown,
//!     )
//!     .await?;
//! println!("{stats:?}");
//! # Ok(()) }
//! ```
//!
//! It uses only standard Kafka protocol features (consumer groups with the
//! eager protocol, offset commits, fetch, produce for the dead letters)
//! through [`rdkafka`] (librdkafka, built from source by default). Its
//! tests run on Tansu, an Apache-Kafka-protocol broker.
//!
//! # What happens to a record
//!
//! | outcome | the record |
//! |---|---|
//! | executed, replayed, or completed earlier without a replayable result | settled: its offset may be committed |
//! | the key is in progress (another consumer runs it: a rebalance moved the partition), the store is unavailable, or the lease was lost | retried in place with a backoff, until settled; the partition's commit point waits |
//! | the handler ran but the store was away until its lease ended ([`IdemError::Unrecorded`]) | not run again by this consumer: its completion is written with its own lease ([`Idempotency::finish`]) once the store is back, then it settles; its partition's commit point waits. If a rebalance takes the partition away first, the record is let go uncommitted after [`revoke_wait`](KafkaConsumer::revoke_wait), and the new owner, the lease being over, takes the key over and runs it again: the window of an outage longer than the lease (DESIGN 4; defences: a lease longer than the outages to survive, the fence downstream). That run is told so (`attempt` 2, a fence above the first run's) and the first run's late completion is refused, never overwriting its result (tested on the broker) |
//! | the handler ran but the store refuses its completion for good (a non-retryable error while finishing) | dead-lettered (its handler ran); a later record of its key at this consumer, until the retention ends, is settled as a duplicate whose result was not recorded, never run |
//! | the handler failed or panicked, or the store refused a call for a reason not known to pass (a `Backend` error: Redis at `maxmemory`, a missing table, a refused commit) | retried in place until it failed [`max_deliveries`](KafkaConsumer::max_deliveries) times, then dead-lettered |
//! | can never succeed: no usable key, payload mismatch, a corrupt record, a [`RecordError`] from the handler | dead-lettered at once |
//! | its partition is revoked, or the consumer shuts down, while it waits for a retry | abandoned: never committed by this consumer, redelivered to the next owner |
//!
//! Dead-lettering produces the record (key, value, headers) to the
//! dead-letter topic (default `{topic}.dead`; it must exist, or the broker
//! must create topics) with the headers `idem.topic`, `idem.partition`,
//! `idem.offset`, `idem.group`, `idem.deliveries` and `idem.reason`, waits
//! for the broker's acknowledgement, then settles the record. A crash
//! between the two dead-letters it again on its redelivery.
//!
//! # Delivery counts
//!
//! Kafka keeps no delivery count, so the consumer counts with idem: each
//! failed run of a key takes over a counter record of its own in the store
//! (scope `idem.failures`, a hash of the key as ID, a 1 ms lease, never
//! completed), whose attempt number is the count of failures, across
//! restarts and consumers; deleted when the record settles. And a run cut off by a crash is counted by the
//! key's own attempt number: an acquisition whose attempt is past
//! `max_deliveries` does not run the handler and dead-letters the record
//! (a poison record that kills its consumer does not kill every next one).
//! In the in-transaction form
//! ([`run_in_transaction`](KafkaConsumer::run_in_transaction)) a crash
//! rolls the claim back with everything else, so the attempt is 1 plus the
//! runs of the key *cut off* in a row ([`TxRunner`](idem_core::TxRunner)
//! counts them outside the transaction once the key is claimed, and
//! forgets the count when a run is seen to end): a record whose runs were
//! cut off `max_deliveries` times is dead-lettered without running;
//! failures seen to end are counted by the failure counter above, and a
//! retry while its key is held elsewhere, or while the store is away,
//! counts nothing.
//!
//! # Commits
//!
//! `enable.auto.commit` and `enable.auto.offset.store` are turned off. A
//! partition's commit point moves over the contiguous prefix of settled
//! records. Commits are synchronous calls on a blocking thread, one at a
//! time, at most every [`commit_interval`](KafkaConsumer::commit_interval)
//! (rdkafka did not report asynchronous commits of a `StreamConsumer`
//! back, and a commit must never overtake a later one), and again at a
//! revoke and at shutdown. A commit that fails (a rebalance under way) is
//! sent again with every commit point; in the worst case the records after
//! the last commit are redelivered, and replayed.
//!
//! # Rebalances
//!
//! On revoke (every rebalance revokes everything with the eager protocol),
//! the consumer stops taking records of the revoked partitions, waits up
//! to [`revoke_wait`](KafkaConsumer::revoke_wait) for their running
//! records (on a multi-thread runtime: the rebalance callback runs inside
//! the consumer's poll and blocks its thread with
//! `tokio::task::block_in_place`; on a current-thread runtime it cannot
//! wait, as the handlers would need that thread), commits what settled, and
//! lets the partitions go. Records that did not finish are not committed:
//! the new owner reads them again, and idem answers it with the replay,
//! or "in progress" (it retries until the detached handler here has
//! recorded its result), never a second run. A lost assignment (the
//! session timed out) is not committed at all.
//!
//! # Handlers run detached
//!
//! Each record runs through [`Idempotency::process_with_detached`], or,
//! with [`batch`](KafkaConsumer::batch) above 1, the records of a
//! partition read together run through
//! [`Idempotency::process_batch_with_detached`] (one `acquire_many` and
//! one `complete_many`). A consumer whose `run` future is dropped does not
//! cut the handlers off; their results are recorded and their records
//! replayed on redelivery. Records of one key taken by this consumer run in
//! the order read, one after the other.
//!
//! # Shutdown
//!
//! When `shutdown` completes, `run` stops reading, lets the running
//! handlers finish for up to [`revoke_wait`](KafkaConsumer::revoke_wait)
//! (records waiting for a retry give up; records still running then are
//! given up uncommitted, their detached handlers go on and record their
//! results, so the next owner gets the replay), commits, and
//! leaves the group (it unsubscribes and serves the revoke itself, so
//! that dropping the client has nothing to give back: librdkafka can hang
//! forever in a revoke served while its client closes, librdkafka #4041).
//! A later `run` subscribes again.
//!
//! # Concurrency
//!
//! At most [`concurrency`](KafkaConsumer::concurrency) records are in
//! flight, at most
//! [`partition_concurrency`](KafkaConsumer::partition_concurrency) of one
//! partition. When a partition has its maximum in flight, the consumer
//! waits for one of them before it reads further (records of other
//! partitions wait too).
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod commit;
mod consumer;
mod context;
mod dead_letter;
mod error;
mod failures;
mod lag;
mod outcome;
mod poll;
mod record;
mod shared;
mod stats;
mod track;
mod work;

pub use consumer::{KafkaConsumer, DEFAULT_MAX_DELIVERIES, MAX_IN_FLIGHT};
#[doc(hidden)]
pub use context::IdemContext;
pub use error::KafkaConsumerError;
pub use lag::{group_committed, group_lag};
pub use rdkafka;
pub use record::{default_scope, KafkaRecord, KeySource, RecordError};
pub use stats::ConsumerStats;

// For the links of the crate docs.
#[cfg(doc)]
use idem_core::{IdemError, Idempotency};
