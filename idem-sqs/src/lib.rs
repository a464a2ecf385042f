//! An idempotent Amazon SQS consumer for [idem](https://docs.rs/idemkit): it
//! long-polls a queue, runs each message through [`Idempotency`] (the
//! handler detached, the key from a message attribute, the message ID or a
//! hash of the body), keeps the messages it works on invisible while their
//! handlers run (a visibility heartbeat), and deletes a message only once
//! its result is recorded or replayed, or once it was dead-lettered.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_core::{Idempotency, MemoryStore};
//! use idem_sqs::{SqsConsumer, SqsMessage};
//!
//! # async fn run(client: idem_sqs::aws_sdk_sqs::Client) -> Result<(), Box<dyn std::error::Error>> {
//! // `client` is an `aws_sdk_sqs::Client` you built (from `aws-config`;
//! // for moto or ElasticMQ, `idem_sqs::local_client(url)`).
//! let idem = Idempotency::new(MemoryStore::new());
//! let queue = "https://sqs.us-east-1.amazonaws.com/123456789012/payments";
//! let consumer = SqsConsumer::new(client, queue, idem)
//!     .key_attribute("message-id")
//!     .visibility_timeout(Duration::from_secs(30))
//!     .max_deliveries(5)
//!     .dead_letter("https://sqs.us-east-1.amazonaws.com/123456789012/payments-dead");
//! let shutdown = async { let _ = tokio::signal::ctrl_c().await; };
//! let stats = consumer
//!     .run(
//!         |message: SqsMessage| async move {
//!             let amount: u64 = message.json()?;
//!             Ok::<_, idem_sqs::MessageError>(format!("charged {amount}"))
//!         },
//!         shutdown,
//!     )
//!     .await?;
//! println!("{stats:?}");
//! # Ok(()) }
//! ```
//!
//! The consumer takes an [`aws_sdk_sqs::Client`] that you build (this
//! crate does not depend on `aws-config`), and uses standard SQS calls
//! only: `ReceiveMessage` (long polling, up to 10 messages),
//! `DeleteMessageBatch`, `ChangeMessageVisibilityBatch` and, for dead
//! letters, `SendMessage`. Its tests run on moto's server mode.
//!
//! # What happens to a message
//!
//! | outcome | the message |
//! |---|---|
//! | executed, replayed, or completed earlier without a replayable result ([`IdemError::ResultUnavailable`]) | deleted |
//! | the key is in progress with another consumer ([`IdemError::InProgress`], [`IdemError::WaitTimeout`]) or with another receive of this one, the store is unavailable, or the lease was taken over (its new holder records) | left for redelivery (never dead-lettered: the lease ends, the store comes back) |
//! | the handler ran but the store was away until its lease ended ([`IdemError::Unrecorded`]) | kept invisible (the heartbeat goes on), never run again by this consumer: its completion is written with the run's own lease ([`Idempotency::finish`]) once the store is back (tried every 50 ms), then deleted; other messages of its key at this consumer are left for redelivery meanwhile. Another message of the key received by another consumer once the store is back, before that write, takes the expired lease over and runs again: the window of an outage longer than the lease (DESIGN 4; defences: a lease longer than the outages to survive, the fence downstream) |
//! | the handler ran but the store refuses its completion for good (a non-retryable error while finishing), or the consumer gave up | dead-lettered (its handler ran); a later message of its key at this consumer, until the retention ends, is deleted as a duplicate whose result was not recorded, never run |
//! | the handler failed or panicked, or the store refused a call for a reason not known to pass (a `Backend` error: Redis at `maxmemory`, a missing table, a refused commit) | left for redelivery, until its `ApproximateReceiveCount` reaches [`max_deliveries`](SqsConsumer::max_deliveries): then dead-lettered |
//! | can never succeed ([`IdemError::is_retryable`] is false: no usable key, a key attribute over 512 bytes, payload mismatch, a corrupt record, a response that does not decode; a [`MessageError`] from the handler) | dead-lettered at once |
//! | its key was taken over more than `max_deliveries` times (the runs before were cut off: their process died) | dead-lettered without running the handler |
//! | the executor's configuration is refused (a zero lease or retention) | left for redelivery, and `run` fails: nothing could succeed |
//!
//! "Left for redelivery" means the message is not deleted: it becomes
//! visible again when its visibility timeout runs out, or at once after
//! [`retry_visibility`](SqsConsumer::retry_visibility) if that is set (the
//! consumer then changes the message's visibility to that).
//!
//! # Dead letters
//!
//! With a [`dead_letter`](SqsConsumer::dead_letter) queue, the consumer
//! sends a poison message there itself (`SendMessage`: the same body,
//! with the message attributes `idem.reason`, `idem.receive_count`,
//! `idem.source_queue` and `idem.message_id`, then the message's own
//! attributes, the key attribute first and the others by name, as many as
//! SQS's limit of 10 leaves room for: when some must go, the last ones go
//! first and `idem.dropped` names them), then deletes it. A copy that SQS refuses (too large with the
//! added attributes) is sent again without the original attributes, then
//! with no attribute at all (the reason is then only in the log). A
//! crash between the send and the delete dead-letters the message again
//! on its next delivery (a FIFO dead-letter queue drops that copy: its
//! deduplication ID is a hash of the message ID).
//!
//! Without one, the consumer leaves poison messages to the queue's own
//! redrive policy: they are left for redelivery like any failure, and SQS
//! moves them to the queue's dead-letter queue once their receive count
//! passes `maxReceiveCount` (a queue without a redrive policy delivers
//! them until their retention period ends). SQS's move carries no reason:
//! the consumer logs it (`tracing`, at `warn`) and counts it in
//! [`ConsumerStats::poison`].
//!
//! # Visibility
//!
//! Every `ReceiveMessage` asks for the consumer's
//! [`visibility_timeout`](SqsConsumer::visibility_timeout) (default 30 s;
//! the queue's own setting is not used). While a message is being handled,
//! a heartbeat task sets its visibility to that again every third of it
//! (`ChangeMessageVisibilityBatch`, 10 messages a call), so a handler that
//! runs longer than the timeout is not handed to another consumer
//! meanwhile; the heartbeat stops for a message once it is settled, and
//! for every message when `run` returns or its future is dropped. SQS
//! caps a message's invisibility at 12 hours from its first receive.
//!
//! # Handlers run detached
//!
//! The messages of each receive run through
//! [`Idempotency::process_batch_with_detached`] (one `acquire_many` and
//! one `complete_many` for the batch), each handler in a task of its own;
//! up to [`concurrency`](SqsConsumer::concurrency) messages are in flight
//! over several receives. A consumer whose `run` future is dropped does
//! not cut its handlers off: they finish and their results are recorded,
//! and their messages, not deleted, come back after their visibility
//! timeout and are replayed and deleted then. Messages of one key in one
//! receive run one after the other (the later ones get the first's
//! replay); a message whose key another receive of this consumer is still
//! processing is left for redelivery (counted in
//! [`ConsumerStats::in_progress`], as the store would answer "in
//! progress"). A handler must be `Send + Sync + 'static`.
//!
//! # FIFO queues
//!
//! SQS hands out the messages of one message group in order and no more of
//! a group while one of it is in flight, but one receive may hold several
//! of a group. The consumer runs those one after another, in the order
//! received (each round of a receive runs the next message of every group
//! through the batch path), and a message of a group that does not end
//! deleted or dead-lettered (its handler failed, its key is in progress,
//! the store is away, its result waits to be finished) stops its group:
//! the group's later messages in that receive are left for redelivery
//! without running, so they come back after it, in order. A group's
//! message that is dead-lettered does not stop it (it is off the queue; if
//! the dead letter cannot be sent, the message is left for redelivery,
//! after its group's later messages of that receive ran).
//! Messages without a group run as above, all at once.
//!
//! # Shutdown
//!
//! When `shutdown` completes, `run` stops receiving (a receive in flight is
//! abandoned: the messages SQS may have handed to it come back after their
//! visibility timeout), waits up to
//! [`shutdown_wait`](SqsConsumer::shutdown_wait) for the messages in
//! flight, writes the completions it can of unfinished runs, and returns.
//! A handler still running then goes on (detached) and records its result,
//! but its message is not deleted by this consumer: it reappears after its
//! visibility timeout, and the next delivery gets the replay, or "in
//! progress" while the handler still runs.
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod batch;
mod consumer;
mod dead_letter;
mod error;
mod finishing;
mod heartbeat;
mod local;
mod message;
mod queue;
mod run;
mod shared;
mod stats;

pub use aws_sdk_sqs;
pub use message::{default_scope, queue_name, KeySource, MessageError, SqsMessage};

pub use consumer::{SqsConsumer, DEFAULT_MAX_DELIVERIES, MAX_CONCURRENCY};
pub use dead_letter::MAX_ATTRIBUTES;
pub use error::{SqsConsumerError, SqsError};
pub use local::local_client;
pub use queue::MAX_BATCH;
pub use stats::ConsumerStats;

// The crate docs link to them.
#[cfg(doc)]
use idem_core::{IdemError, Idempotency};
