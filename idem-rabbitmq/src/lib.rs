//! An idempotent RabbitMQ (AMQP 0-9-1) consumer for
//! [idem](https://docs.rs/idemkit), on [`lapin`]: it consumes a queue, runs
//! each message through [`Idempotency`] (the handler detached, the key
//! from the `message_id` property, a header, or a hash of the body), and
//! acks a message only once its result is recorded or replayed, or once
//! it was dead-lettered.
//!
//! ```no_run
//! use idem_core::{Idempotency, MemoryStore};
//! use idem_rabbitmq::{RabbitConsumer, RabbitMessage};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let idem = Idempotency::new(MemoryStore::new());
//! let consumer = RabbitConsumer::new("amqp://guest:guest@127.0.0.1:5672/%2f", "payments", idem)
//!     .max_deliveries(5)
//!     .dead_letter_queue("payments-dead");
//! let shutdown = async { let _ = tokio::signal::ctrl_c().await; };
//! let stats = consumer
//!     .run(
//!         |message: RabbitMessage| async move {
//!             let amount: u64 = message.json()?;
//!             Ok::<_, idem_rabbitmq::MessageError>(format!("charged {amount}"))
//!         },
//!         shutdown,
//!     )
//!     .await?;
//! println!("{stats:?}");
//! # Ok(()) }
//! ```
//!
//! # What happens to a message
//!
//! | outcome | the message |
//! |---|---|
//! | executed, replayed, or completed earlier without a replayable result ([`IdemError::ResultUnavailable`]) | acked |
//! | the key is in progress elsewhere ([`IdemError::InProgress`]), or the store is unavailable | held unacked and tried again in place every [`requeue_delay`](RabbitConsumer::requeue_delay) (never requeued nor dead-lettered for it: the lease ends, the store comes back); requeued at shutdown |
//! | the handler failed or panicked, or the store refused a call for a reason not known to pass (Redis at `maxmemory`, a missing table, a refused commit) | held for `requeue_delay`, then requeued, until its failures (counted in the store) reach [`max_deliveries`](RabbitConsumer::max_deliveries): then dead-lettered |
//! | can never succeed (no usable key, payload mismatch, a corrupt record; a [`MessageError`] from the handler) | dead-lettered at once |
//! | its key was taken over more than `max_deliveries` times (the runs before were cut off: their consumer died) | dead-lettered without running the handler |
//! | the handler ran but the store was away until its lease ended ([`IdemError::Unrecorded`]) | kept unacked (the broker gives it to no other consumer while this connection lives) and never run again here: its completion is written with the run's own lease ([`Idempotency::finish`]) as soon as the store answers, then acked |
//! | the handler ran but the store refuses its completion for good, or the shutdown wait ended first | dead-lettered (its handler ran); a later delivery of its key here, until the retention ends, is acked as a duplicate whose result was not recorded, never run |
//! | the executor's configuration is refused (a zero lease or retention) | requeued, and `run` fails: nothing could succeed |
//!
//! # Delivery counts
//!
//! A message's failed runs are counted in the store, on every kind of
//! queue (one more store call per failure, none for a message that
//! succeeds first time, [`delivery::count_failure`](idem_core::delivery::count_failure)),
//! and the count is forgotten once the message settles: the
//! `x-delivery-count` header of a quorum queue is not trusted for it (a
//! publisher may set it, a dead letter of a quorum queue carries it, and
//! a quorum queue counts redeliveries that were no failure). It is given
//! to the handler ([`RabbitMessage::delivery_count`]). Runs cut off by a
//! crash are counted apart, by the key's attempt: a message that kills
//! every consumer is dead-lettered after `max_deliveries` such runs.
//!
//! A message that cannot settle now (its key in progress elsewhere or
//! being finished here, the store away) is held unacked and tried again
//! in place every [`requeue_delay`](RabbitConsumer::requeue_delay), not
//! requeued: a quorum queue would count each requeue as a delivery and,
//! at its `x-delivery-limit` (RabbitMQ 4 sets 20 by default), drop or
//! dead-letter it unrun. A failed run is requeued (the broker counts that
//! delivery too: a quorum queue's `x-delivery-limit` under
//! `max_deliveries` dead-letters or drops the message first).
//!
//! # Dead letters
//!
//! With [`dead_letter_queue`](RabbitConsumer::dead_letter_queue) (or
//! [`DeadLetter::Exchange`]), the consumer publishes a poison message there
//! itself, on a channel with publisher confirms, `mandatory` (an
//! unroutable dead letter is not dropped: the message is requeued and the
//! failure logged), with the same body and properties and the headers
//! `idem-reason`, `idem-source-queue` and, on a quorum queue,
//! `idem-delivery-count`; it acks the message once the broker confirmed
//! the copy. A crash between the confirm and the ack dead-letters the
//! message again on its next delivery (the copies share its `message_id`).
//!
//! By default ([`DeadLetter::QueuePolicy`]) the consumer rejects poison
//! without requeue: the broker moves it to the queue's own dead-letter
//! exchange (`x-dead-letter-exchange`, with its `x-death` header) and
//! **drops it when the queue has none**. The reason is then only in the
//! log (`tracing`, at `warn`).
//!
//! # Connections
//!
//! [`run`](RabbitConsumer::run) connects itself, with a prefetch
//! ([`prefetch`](RabbitConsumer::prefetch), `basic.qos`) that bounds the
//! messages in flight, and connects again whenever the connection is lost
//! (pauses of up to 2 s). The broker requeues the unacked messages of a
//! lost connection: a message whose handler still runs here is found "in
//! progress" by whoever gets it, and replayed once the handler recorded
//! its result; an ack that could not be sent is counted in
//! [`ConsumerStats::ack_failures`] and its redelivery is replayed.
//!
//! The one window left: a result waiting for the store
//! ([`IdemError::Unrecorded`]: the store was away past the lease) when the
//! connection to the broker is lost too. The broker then hands the message
//! to another consumer, which, once the store is back, may take the
//! expired lease over and run it again before this consumer's completion
//! goes in (it is tried every 250 ms at most). Its size is the lease; the
//! defences are a lease longer than the store outages to survive, the
//! fence downstream, and the in-transaction form
//! ([`run_in_transaction`](RabbitConsumer::run_in_transaction)), which has
//! no lease at all.
//!
//! # Handlers run detached
//!
//! Each delivery runs in a task of its own, its handler in another
//! ([`Idempotency::process_with_detached`]): a consumer whose `run` future
//! is dropped does not cut its handlers off; they finish and their results
//! are recorded, and their messages, not acked, come back and are replayed.
//! A handler must be `Send + Sync + 'static`.
//!
//! # Shutdown
//!
//! When `shutdown` completes, `run` cancels its consumer (`basic.cancel`:
//! no more deliveries), requeues at once the messages it holds before a
//! requeue, waits up to [`shutdown_wait`](RabbitConsumer::shutdown_wait)
//! for the messages in flight, gives the results still being finished one
//! more try (those that fail are dead-lettered: their handler ran), and
//! closes the connection: the broker requeues what was not acked. A
//! handler still running then goes on (detached) and records its result;
//! the next delivery of its message gets the replay, or "in progress"
//! while it still runs.
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod consumer;
mod dead_letter;
mod error;
mod message;
mod run;
mod shared;
mod stats;
mod work;

pub use lapin;

pub use consumer::{DeadLetter, RabbitConsumer, DEFAULT_MAX_DELIVERIES, DEFAULT_PREFETCH};
pub use dead_letter::{
    DELIVERY_COUNT_HEADER as DEAD_DELIVERY_COUNT_HEADER, EXPIRATION_HEADER, HEADERS_DROPPED_HEADER,
    REASON_HEADER, SOURCE_QUEUE_HEADER, USER_ID_HEADER,
};
pub use error::RabbitConsumerError;
pub use message::{default_scope, KeySource, MessageError, RabbitMessage, DELIVERY_COUNT_HEADER};
pub use stats::ConsumerStats;

// The crate docs link to them.
#[cfg(doc)]
use idem_core::{IdemError, Idempotency};
