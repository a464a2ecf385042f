//! An idempotent NATS JetStream consumer for [idem](https://docs.rs/idemkit):
//! it pulls from a durable pull consumer, runs each message through
//! [`Idempotency`] (the handler detached, the key from the `Nats-Msg-Id`
//! header, a header of your choice or a hash of the payload), keeps the
//! messages it works on from redelivery with in-progress acks while their
//! handlers run, and acks a message only once its result is recorded or
//! replayed, or once it was dead-lettered.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_core::{Idempotency, MemoryStore};
//! use idem_nats::{NatsConsumer, NatsMessage};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let client = idem_nats::async_nats::connect("nats://127.0.0.1:4222").await?;
//! let js = idem_nats::async_nats::jetstream::new(client);
//! let idem = Idempotency::new(MemoryStore::new());
//! let consumer = NatsConsumer::new(js, "ORDERS", "billing", idem)
//!     .filter_subject("orders.created")
//!     .ack_wait(Duration::from_secs(30))
//!     .max_deliveries(5)
//!     .dead_letter("dead.orders");
//! let shutdown = async { let _ = tokio::signal::ctrl_c().await; };
//! let stats = consumer
//!     .run(
//!         |message: NatsMessage| async move {
//!             let amount: u64 = message.json()?;
//!             Ok::<_, idem_nats::MessageError>(format!("charged {amount}"))
//!         },
//!         shutdown,
//!     )
//!     .await?;
//! println!("{stats:?}");
//! # Ok(()) }
//! ```
//!
//! The consumer takes an [`async_nats::jetstream::Context`] that you
//! build, the name of a stream that exists, and the name of a durable
//! pull consumer, which `run` creates or updates to its settings
//! (explicit acks, [`ack_wait`](NatsConsumer::ack_wait),
//! [`max_ack_pending`](NatsConsumer::max_ack_pending),
//! [`filter_subject`](NatsConsumer::filter_subject), and no
//! `max_deliver` of JetStream's own). Several processes may run the same
//! durable consumer: JetStream hands each message to one of them.
//!
//! # What happens to a message
//!
//! | outcome | the message |
//! |---|---|
//! | executed, replayed, or completed earlier without a replayable result ([`IdemError::ResultUnavailable`]) | acked |
//! | the key is in progress with another consumer ([`IdemError::InProgress`], [`IdemError::WaitTimeout`]), or being finished here, or the store is unavailable | handed back (`-NAK` with [`retry_delay`](NatsConsumer::retry_delay)); never dead-lettered: the lease ends, the store comes back |
//! | the handler ran but the store was away until its lease ended ([`IdemError::Unrecorded`]) | kept (in-progress acks go on), never run again by this consumer: its completion is written with the run's own lease ([`Idempotency::finish`]) as soon as the store is back, then acked; other deliveries of its key here are handed back meanwhile. A delivery of the key to another consumer once the store is back, before that write, takes the expired lease over and runs again: the window of an outage longer than the lease (DESIGN 4; defences: a lease longer than the outages to survive, the fence downstream, the in-transaction form) |
//! | the handler ran but the store refuses its completion for good | dead-lettered (its handler ran); a later delivery of its key here, until the retention ends, is acked as a duplicate whose result was not recorded, never run. If that dead letter could not be published, it is owed: the next delivery of the key here publishes it before its ack |
//! | the handler failed or panicked; or the store refused a call for a reason not known to pass (a `Backend` error: Redis at `maxmemory`, a missing table) | handed back, until its delivery count reaches [`max_deliveries`](NatsConsumer::max_deliveries): then dead-lettered |
//! | can never succeed (no usable key, a payload mismatch, a corrupt record; a [`MessageError`] from the handler) | dead-lettered at once |
//! | its key was taken over more than `max_deliveries` times (the runs before were cut off: their process died) | dead-lettered without running the handler |
//! | the executor's configuration is refused (a zero lease or retention) | handed back, and `run` fails: nothing could succeed |
//!
//! Acks are plain (`+ACK`, no confirmation awaited): an ack that is lost
//! (the server restarting) leaves the message to come back after the ack
//! wait, when it is replayed and acked again, which is harmless.
//!
//! # In-progress acks and the ack wait
//!
//! While a message is held (its handler runs, its dead letter is
//! published, or its completion is written after a store outage), an
//! in-progress ack (`+WPI`) goes out every third of the ack wait, so
//! JetStream does not deliver it to another consumer meanwhile. Without
//! them ([`progress_acks(false)`](NatsConsumer::progress_acks)), or when
//! they cannot reach the server, a handler that runs longer than the ack
//! wait has its message delivered again: the other consumer finds its key
//! in progress in the store (the lease is renewed by the executor's
//! heartbeat), hands it back, and gets the replay once the first run
//! recorded. The effect runs once either way; the ack wait only decides
//! how many redeliveries that costs.
//!
//! # Dead letters
//!
//! With a [`dead_letter`](NatsConsumer::dead_letter) subject, the
//! consumer publishes a poison message there itself (through JetStream,
//! waiting for its ack: a stream must capture the subject): the same
//! payload and headers, with `Idem-Reason`, `Idem-Delivered`,
//! `Idem-Stream`, `Idem-Stream-Sequence`, `Idem-Subject` and
//! `Idem-Consumer` added. Then it acks the message.
//!
//! - Its `Nats-Msg-Id` is `idem-dead.{durable}.{stream}.{sequence}`, so a
//!   dead letter published twice (a crash between the publish and the
//!   ack) is dropped by the dead-letter stream's duplicate window, and
//!   two consumers of one stream sharing a dead-letter subject each keep
//!   their own. The message's own `Nats-Msg-Id` is kept as
//!   [`Idem-Msg-Id`](ORIGINAL_ID_HEADER).
//! - The message's other `Nats-*` headers, which JetStream acts on
//!   (`Nats-Expected-Stream` and the other `Nats-Expected-*`,
//!   `Nats-Rollup`, `Nats-TTL`), are kept under
//!   [`Idem-Orig-`](ORIGINAL_PREFIX) (`Idem-Orig-Nats-Expected-Stream`):
//!   copied as they are, they would have the dead letter refused, the
//!   dead-letter stream purged, or the letter expire.
//! - A dead letter over the server's `max_payload` (the client knows it
//!   from the server's `INFO`) has its payload cut to fit
//!   ([`Idem-Dropped`](DROPPED_HEADER)`: payload tail`, the full size in
//!   [`Idem-Payload-Size`](PAYLOAD_SIZE_HEADER)); it is never published
//!   to fail on its size.
//! - A dead letter JetStream refuses for good (a 4xx answer: a message
//!   over the dead-letter stream's `max_msg_size`, a header it refuses)
//!   is published again at once without the message's headers
//!   (`Idem-Dropped: headers`); refused again, without its payload
//!   (`Idem-Dropped: headers, payload`); refused even so, the message is
//!   terminated (`+TERM`) and the dead letter's reason logged at `error`
//!   ([`ConsumerStats::dead_letter_failures`]). A poison message is
//!   never handed back for ever for a dead letter that can never go out.
//! - A dead letter that cannot be published for now (the server away, the
//!   dead-letter stream full, a timeout) hands the message back: it is
//!   dead-lettered again on its next delivery. For a message whose
//!   handler ran and whose result the store refused, the dead letter is
//!   owed: the next delivery of its key here (which the executor answers
//!   "result unavailable") publishes it before the ack.
//!
//! Without one, a poison message is terminated (`+TERM`: JetStream
//! delivers it no more and publishes a `MSG_TERMINATED` advisory) and its
//! reason is logged (`tracing`, at `warn`).
//!
//! `max_deliveries` counts JetStream's deliveries of the message (its
//! metadata's delivery count). The durable consumer is made with no
//! `max_deliver` of its own: JetStream's limit would stop delivering a
//! message without a word, which no dead letter would tell.
//!
//! # Handlers run detached
//!
//! Each message runs in a task of its own, up to
//! [`concurrency`](NatsConsumer::concurrency) at once; a pull asks for no
//! more than the room left (at most [`batch`](NatsConsumer::batch)). A
//! consumer whose `run` future is dropped does not cut its handlers off:
//! they finish and their results are recorded; their messages, not acked,
//! come back after the ack wait and are replayed then. Nor does it cut
//! off the writing of a result after a store outage (`Unrecorded`): that
//! runs in a task of its own, which keeps the message with in-progress
//! acks, records the result once the store is back, and acks it. A
//! handler must be `Send + Sync + 'static`.
//!
//! # The server away
//!
//! The client reconnects by itself. Meanwhile a pull ends at its expiry
//! (plus a second: the server's end of it is lost in a restart), a pull
//! that fails is tried again with a backoff (from 100 ms to 2 s) and the
//! durable consumer bound again; acks and in-progress acks are queued by
//! the client and sent once it is back, and those that fail are logged and
//! counted ([`ConsumerStats::ack_failures`],
//! [`ConsumerStats::progress_failures`]). A message whose ack or
//! in-progress acks did not reach the server comes back after the ack
//! wait and gets the replay, or "in progress" while its handler still
//! runs.
//!
//! # Shutdown
//!
//! When `shutdown` completes, `run` stops pulling (a pull in flight is
//! abandoned: the messages it brought already are handed back, those
//! still on their way come back after the ack wait), waits up to [`shutdown_wait`](NatsConsumer::shutdown_wait) for
//! the messages in flight, and returns. A message still held then is
//! handed back (its handler goes on, detached, and records its result;
//! the redelivery gets "in progress", then the replay), except one whose
//! completion is still being written after a store outage: its writer
//! tries once more and stops, the message is left to come back after the
//! ack wait, and its key is given up here.
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

pub use async_nats;
pub use consumer::{
    NatsConsumer, DEFAULT_MAX_DELIVERIES, MAX_ACK_WAIT, MAX_BATCH, MAX_CONCURRENCY, MIN_ACK_WAIT,
};
pub use dead_letter::{
    CONSUMER_HEADER, DELIVERED_HEADER, DROPPED_HEADER, ORIGINAL_ID_HEADER, ORIGINAL_PREFIX,
    PAYLOAD_SIZE_HEADER, REASON_HEADER, SEQUENCE_HEADER, STREAM_HEADER, SUBJECT_HEADER,
};
pub use error::{NatsConsumerError, NatsError};
pub use message::{default_scope, KeySource, MessageError, NatsMessage, MESSAGE_ID_HEADER};
pub use stats::ConsumerStats;

// The crate docs link to them.
#[cfg(doc)]
use idem_core::{IdemError, Idempotency};
