//! An idempotent Amazon SQS consumer for [idem](https://docs.rs/idem): it
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
//! // `client` is an `aws_sdk_sqs::Client` you built (from `aws-config`, or
//! // from an `aws_sdk_sqs::Config`).
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
//! | the key is in progress with another consumer ([`IdemError::InProgress`], [`IdemError::WaitTimeout`]) or with another receive of this one, or the store is unavailable | left for redelivery (never dead-lettered: the lease ends, the store comes back) |
//! | the handler ran but the store was away until its lease ended ([`IdemError::Unrecorded`]) | never run again: kept invisible (the heartbeat goes on), its completion written with the run's own lease ([`Idempotency::finish`]) once the store is back, then deleted; other messages of its key are left for redelivery meanwhile |
//! | the handler failed or panicked | left for redelivery, until its `ApproximateReceiveCount` reaches [`max_deliveries`](SqsConsumer::max_deliveries): then dead-lettered |
//! | can never succeed ([`IdemError::is_retryable`] is false: no usable key, a key attribute over 512 bytes, payload mismatch, lease lost, a corrupt record, a response that does not decode; a [`MessageError`] from the handler) | dead-lettered at once |
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

mod message;

pub use aws_sdk_sqs;
pub use message::{default_scope, queue_name, KeySource, MessageError, SqsMessage};

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry,
    MessageAttributeValue, MessageSystemAttributeName,
};
use aws_sdk_sqs::Client;
use futures_util::FutureExt;
use idem_core::{
    saturate, Codec, Context, Fingerprint, IdemError, Idempotency, IdempotencyKey,
    IdempotencyStore, JsonCodec, Processed, StoreError, Unrecorded,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

/// The default of [`SqsConsumer::max_deliveries`].
///
/// ```
/// assert_eq!(idem_sqs::DEFAULT_MAX_DELIVERIES, 10);
/// ```
pub const DEFAULT_MAX_DELIVERIES: u32 = 10;

/// The most messages one `ReceiveMessage` (and one batch call) takes: SQS's
/// limit.
pub const MAX_BATCH: usize = 10;

/// The most message attributes a message may carry: SQS's limit.
pub const MAX_ATTRIBUTES: usize = 10;

const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// SQS's longest long poll.
const MAX_WAIT_SECONDS: u64 = 20;
/// SQS's longest visibility timeout (12 hours).
const MAX_VISIBILITY_SECONDS: u64 = 43_200;
/// The longest `idem.reason` (and `idem.dropped`) value, in bytes.
const MAX_REASON: usize = 1024;
/// The most messages in flight at once ([`SqsConsumer::concurrency`] is
/// lowered to it): far above what a consumer can hold, far below what a
/// semaphore refuses.
pub const MAX_CONCURRENCY: usize = 1 << 20;

/// How often unfinished runs are tried again while the consumer waits
/// (for room, or for a receive): soon after the store is back, their
/// completions are written.
const FINISH_EVERY: Duration = Duration::from_millis(50);

/// The pause after an empty short poll (`wait_time` zero).
const IDLE_PAUSE: Duration = Duration::from_millis(100);

/// The names of the attributes a dead letter gets.
const REASON: &str = "idem.reason";
const RECEIVE_COUNT: &str = "idem.receive_count";
const SOURCE_QUEUE: &str = "idem.source_queue";
const MESSAGE_ID: &str = "idem.message_id";
const DROPPED: &str = "idem.dropped";

/// A failed SQS call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqsError {
    operation: &'static str,
    code: Option<String>,
    transient: bool,
    message: String,
}

impl SqsError {
    /// The SQS operation that failed (`ReceiveMessage`, ...).
    pub fn operation(&self) -> &str {
        self.operation
    }

    /// The error code SQS answered with (`AWS.SimpleQueueService.NonExistentQueue`,
    /// `QueueDoesNotExist`, ...), if it answered.
    pub fn code(&self) -> Option<&str> {
        self.code.as_deref()
    }

    /// Whether the same call may succeed later: a timeout, a connection
    /// that failed, throttling, a server error (5xx).
    pub fn is_transient(&self) -> bool {
        self.transient
    }

    fn timeout(operation: &'static str, limit: Duration) -> Self {
        SqsError {
            operation,
            code: None,
            transient: true,
            message: format!("no answer within {limit:?}"),
        }
    }

    fn of<E>(operation: &'static str, e: SdkError<E>) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
    {
        let code = e
            .as_service_error()
            .and_then(|s| s.code())
            .map(str::to_owned);
        let transient = match &e {
            SdkError::ServiceError(s) => {
                let status = s.raw().status();
                status.is_server_error()
                    || status.as_u16() == 429
                    || code.as_deref().is_some_and(|c| {
                        c.contains("Throttl")
                            || c.contains("ServiceUnavailable")
                            || c == "InternalError"
                            || c == "InternalFailure"
                            || c == "RequestTimeout"
                    })
            }
            SdkError::ConstructionFailure(_) => false,
            // Timeouts, connections that failed, replies that did not parse.
            _ => true,
        };
        // A service error's own message; the whole chain of anything else
        // (a connection refused, a timeout).
        let message = match e.as_service_error() {
            Some(s) => s.message().unwrap_or("(no message)").to_owned(),
            None => DisplayErrorContext(&e).to_string(),
        };
        SqsError {
            operation,
            code,
            transient,
            message,
        }
    }
}

impl fmt::Display for SqsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SQS {} failed", self.operation)?;
        if let Some(code) = &self.code {
            write!(f, " ({code})")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for SqsError {}

/// Why the consumer could not run or could not go on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SqsConsumerError {
    /// SQS refused to receive from the queue for a reason that waiting
    /// does not fix (the queue does not exist, access denied). Transient
    /// failures are logged and retried with a backoff instead.
    #[error(transparent)]
    Sqs(#[from] SqsError),
    /// The idempotency store or the executor's configuration refused
    /// every call: nothing could succeed.
    #[error("idempotency store: {0}")]
    Store(#[from] StoreError),
    /// A setting is wrong (an empty queue URL, a dead-letter queue that is
    /// the queue itself, a scope that is not valid).
    #[error("configuration: {0}")]
    Config(String),
}

/// What a consumer did, counted since it was made: returned by
/// [`SqsConsumer::run`], and by [`SqsConsumer::stats`] while it runs.
///
/// ```
/// use idem_sqs::ConsumerStats;
///
/// fn duplicate_share(stats: &ConsumerStats) -> f64 {
///     let seen = stats.executed + stats.replayed;
///     if seen == 0 { 0.0 } else { stats.replayed as f64 / seen as f64 }
/// }
/// assert_eq!(duplicate_share(&ConsumerStats { executed: 3, replayed: 1, ..Default::default() }), 0.25);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Messages received from SQS.
    pub received: u64,
    /// Messages whose handler ran here and whose result was recorded.
    pub executed: u64,
    /// Messages answered with a recorded result (duplicates,
    /// redeliveries), or whose key completed without a replayable result.
    pub replayed: u64,
    /// Deliveries whose key was in progress with another worker (left for
    /// redelivery).
    pub in_progress: u64,
    /// Messages deleted from the queue (dead-lettered ones included).
    pub deleted: u64,
    /// Deletes that SQS refused or that failed: those messages come back
    /// and are replayed, which is harmless.
    pub delete_failures: u64,
    /// Messages found poison: they can never succeed, or their handler
    /// failed `max_deliveries` times (dead-lettered, or left to the
    /// queue's redrive policy when no dead-letter queue is set).
    pub poison: u64,
    /// Messages sent to the dead-letter queue (then deleted).
    pub dead_lettered: u64,
    /// Dead letters that could not be sent (then left for redelivery, and
    /// dead-lettered again on it).
    pub dead_letter_failures: u64,
    /// Deliveries left for redelivery: handler failed (fewer than
    /// `max_deliveries` times), key in progress elsewhere, store
    /// unavailable, poison without a dead-letter queue.
    pub left_for_redelivery: u64,
    /// Visibility extensions of messages in flight that SQS accepted.
    pub heartbeats: u64,
    /// Visibility extensions that failed (such a message may be handed to
    /// another consumer, which then gets "in progress" or the replay).
    pub heartbeat_failures: u64,
    /// Messages still in flight when `run` stopped waiting for them at
    /// shutdown (not deleted: they come back after their visibility
    /// timeout).
    pub abandoned: u64,
}

#[derive(Default)]
struct Counters {
    received: AtomicU64,
    executed: AtomicU64,
    replayed: AtomicU64,
    in_progress: AtomicU64,
    deleted: AtomicU64,
    delete_failures: AtomicU64,
    poison: AtomicU64,
    dead_lettered: AtomicU64,
    dead_letter_failures: AtomicU64,
    left_for_redelivery: AtomicU64,
    heartbeats: AtomicU64,
    heartbeat_failures: AtomicU64,
    abandoned: AtomicU64,
}

fn add(counter: &AtomicU64, n: usize) {
    counter.fetch_add(n as u64, Ordering::Relaxed);
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A message whose handler ran but whose completion is not written yet.
struct Unfinished {
    message: SqsMessage,
    /// Shared, so a finish in flight leaves the entry in the map: its key
    /// stays held against the other messages of the key meanwhile.
    unrecorded: Arc<Unrecorded>,
}

/// State shared by the run loop, the batch tasks and the heartbeat.
#[derive(Default)]
struct Shared {
    counters: Counters,
    /// Receipt handles of the messages in flight: the heartbeat keeps them
    /// invisible.
    in_flight: Mutex<HashSet<String>>,
    /// Messages to finish, by receipt handle (kept in `in_flight`).
    unfinished: Mutex<HashMap<String, Unfinished>>,
    /// A batch found that nothing can succeed: `run` stops with this.
    fatal: Mutex<Option<StoreError>>,
    /// Keys that a batch task is processing.
    busy: Mutex<HashSet<IdempotencyKey>>,
}

/// The keys a batch task claimed in [`Shared::busy`]; given back when
/// dropped (settled, or the task aborted).
struct Claimed {
    shared: Arc<Shared>,
    keys: HashSet<IdempotencyKey>,
}

impl Drop for Claimed {
    fn drop(&mut self) {
        let mut busy = lock(&self.shared.busy);
        for key in &self.keys {
            busy.remove(key);
        }
    }
}

/// The queue and the calls made on it.
struct Queue {
    client: Client,
    url: String,
    call_timeout: Duration,
    /// The visibility timeout asked for, in seconds.
    visibility: i32,
    dead_letter: Option<String>,
    /// The attribute the keys come from: kept first in a dead letter.
    key_attribute: Option<String>,
    shared: Arc<Shared>,
}

/// An idempotent SQS consumer; see the [crate docs](crate).
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_sqs::{SqsConsumer, SqsMessage};
///
/// # async fn run(client: idem_sqs::aws_sdk_sqs::Client, url: &str) -> Result<(), Box<dyn std::error::Error>> {
/// let consumer = SqsConsumer::new(client, url, Idempotency::new(MemoryStore::new()))
///     .key_from_content()
///     .concurrency(64)
///     .retry_visibility(Duration::from_secs(5)); // a failed message comes back after 5 s
/// let stats = consumer
///     .run(
///         |message: SqsMessage| async move { Ok::<_, std::io::Error>(message.body.len()) },
///         async { let _ = tokio::signal::ctrl_c().await; }, // stop on Ctrl-C
///     )
///     .await?;
/// println!("{stats:?}");
/// # Ok(()) }
/// ```
pub struct SqsConsumer<S: ?Sized, C = JsonCodec> {
    client: Client,
    queue_url: String,
    idem: Idempotency<S, C>,
    key: KeySource,
    scope: String,
    batch: usize,
    concurrency: usize,
    wait_time: Duration,
    visibility: Duration,
    heartbeat: bool,
    retry_visibility: Option<Duration>,
    max_deliveries: u32,
    dead_letter: Option<String>,
    call_timeout: Duration,
    shutdown_wait: Duration,
    shared: Arc<Shared>,
}

impl<S: ?Sized, C> fmt::Debug for SqsConsumer<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqsConsumer")
            .field("queue_url", &self.queue_url)
            .field("key", &self.key)
            .field("scope", &self.scope)
            .field("batch", &self.batch)
            .field("concurrency", &self.concurrency)
            .field("wait_time", &self.wait_time)
            .field("visibility_timeout", &self.visibility)
            .field("heartbeat", &self.heartbeat)
            .field("retry_visibility", &self.retry_visibility)
            .field("max_deliveries", &self.max_deliveries)
            .field("dead_letter", &self.dead_letter)
            .field("call_timeout", &self.call_timeout)
            .field("shutdown_wait", &self.shutdown_wait)
            .finish_non_exhaustive()
    }
}

/// Whole seconds, rounded up, at most `max`.
fn seconds(d: Duration, max: u64) -> i32 {
    let s = d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0));
    // `max` is at most 43 200: the cast cannot truncate.
    s.min(max) as i32
}

impl<S: IdempotencyStore + ?Sized, C: Codec> SqsConsumer<S, C> {
    /// A consumer of the queue at `queue_url`, over a client you built.
    /// Nothing is sent until [`run`](Self::run).
    ///
    /// Defaults: the key is the message ID ([`KeySource::MessageId`]),
    /// scope `sqs.{queue name}` (when valid, else `sqs:` and a hash of the
    /// name: [`default_scope`]), receives of 10 messages, up to 40
    /// messages in flight, long polls of 20 s, a visibility timeout of
    /// 30 s renewed by the heartbeat, no change of visibility for a
    /// message left for redelivery, dead-lettered after
    /// [`DEFAULT_MAX_DELIVERIES`] receives, no dead-letter queue (poison is
    /// left to the queue's redrive policy), 5 s per call, and up to 30 s
    /// for the messages in flight at shutdown.
    pub fn new(client: Client, queue_url: impl Into<String>, idem: Idempotency<S, C>) -> Self {
        let queue_url = queue_url.into();
        let scope = default_scope(queue_name(&queue_url));
        SqsConsumer {
            client,
            queue_url,
            idem,
            key: KeySource::MessageId,
            scope,
            batch: MAX_BATCH,
            concurrency: 40,
            wait_time: Duration::from_secs(MAX_WAIT_SECONDS),
            visibility: Duration::from_secs(30),
            heartbeat: true,
            retry_visibility: None,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            dead_letter: None,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            shutdown_wait: Duration::from_secs(30),
            shared: Arc::default(),
        }
    }

    /// Takes each message's key from this message attribute (of type
    /// `String`): a message without it is dead-lettered.
    pub fn key_attribute(mut self, name: impl Into<String>) -> Self {
        self.key = KeySource::Attribute(name.into());
        self
    }

    /// Takes each message's key from its SQS message ID (the default).
    pub fn key_from_message_id(mut self) -> Self {
        self.key = KeySource::MessageId;
        self
    }

    /// Takes each message's key from a SHA-256 of its body.
    pub fn key_from_content(mut self) -> Self {
        self.key = KeySource::Content;
        self
    }

    /// The scope of the keys (default `sqs.{queue name}`, see
    /// [`default_scope`]). `run` refuses a scope that is not valid.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = scope.into();
        self
    }

    /// Messages asked for per `ReceiveMessage` (default and at most 10, at
    /// least 1).
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.clamp(1, MAX_BATCH);
        self
    }

    /// Messages in flight at once, over several receives (default 40, at
    /// least 1). A receive asks for no more than the room left.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.clamp(1, MAX_CONCURRENCY);
        self
    }

    /// How long a receive waits for messages (`WaitTimeSeconds`: whole
    /// seconds, rounded up, at most 20; default 20). Zero is a short poll,
    /// with a pause of 100 ms after an empty answer.
    pub fn wait_time(mut self, wait: Duration) -> Self {
        self.wait_time = Duration::from_secs(seconds(wait, MAX_WAIT_SECONDS) as u64);
        self
    }

    /// The visibility timeout every receive asks for (whole seconds,
    /// rounded up, from 1 s to 12 h; default 30 s). The heartbeat renews
    /// it every third of it while a message is being handled; without the
    /// heartbeat, set it longer than your handler's longest run.
    pub fn visibility_timeout(mut self, timeout: Duration) -> Self {
        let s = seconds(timeout, MAX_VISIBILITY_SECONDS).max(1);
        self.visibility = Duration::from_secs(s as u64);
        self
    }

    /// Whether to renew the visibility of messages in flight (default on).
    pub fn heartbeat(mut self, on: bool) -> Self {
        self.heartbeat = on;
        self
    }

    /// When a message is left for redelivery (its handler failed, its key
    /// is in progress elsewhere, the store is away), set its visibility to
    /// this (whole seconds, rounded up, at most 12 h; zero: visible at
    /// once), so it comes back sooner than its visibility timeout. Default:
    /// unset (it comes back when its visibility timeout runs out).
    pub fn retry_visibility(mut self, after: Duration) -> Self {
        let s = seconds(after, MAX_VISIBILITY_SECONDS);
        self.retry_visibility = Some(Duration::from_secs(s as u64));
        self
    }

    /// How many receives a message whose handler fails gets before it is
    /// dead-lettered (default [`DEFAULT_MAX_DELIVERIES`]; at least 1). The
    /// count is SQS's `ApproximateReceiveCount`, which every receive
    /// increases: receives answered "in progress", or that found the
    /// store unavailable, count too, but only a failure of the handler at
    /// or past the limit dead-letters the message. A message whose count
    /// is missing or not a number is left for redelivery on a failure
    /// (with `max_deliveries(1)`: dead-lettered). Set it below the queue's
    /// `maxReceiveCount` if the queue has a redrive policy, or SQS moves
    /// the message first, without a reason.
    pub fn max_deliveries(mut self, n: u32) -> Self {
        self.max_deliveries = n.max(1);
        self
    }

    /// The URL of the queue that poison messages are sent to, with the
    /// reason (default: none, poison is left to the queue's redrive
    /// policy; see the [crate docs](crate#dead-letters)).
    pub fn dead_letter(mut self, queue_url: impl Into<String>) -> Self {
        self.dead_letter = Some(queue_url.into());
        self
    }

    /// How long one SQS call may take (on top of a receive's wait) before
    /// it counts as failed (default 5 s, at least 1 ms).
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = saturate(timeout).max(Duration::from_millis(1));
        self
    }

    /// How long `run` waits at shutdown for the messages in flight
    /// (default 30 s). Saturated to [`MAX_DURATION`](idem_core::MAX_DURATION).
    pub fn shutdown_wait(mut self, wait: Duration) -> Self {
        self.shutdown_wait = saturate(wait);
        self
    }

    /// The client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The queue URL.
    pub fn queue_url(&self) -> &str {
        &self.queue_url
    }

    /// What this consumer did so far.
    pub fn stats(&self) -> ConsumerStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerStats {
            received: get(&c.received),
            executed: get(&c.executed),
            replayed: get(&c.replayed),
            in_progress: get(&c.in_progress),
            deleted: get(&c.deleted),
            delete_failures: get(&c.delete_failures),
            poison: get(&c.poison),
            dead_lettered: get(&c.dead_lettered),
            dead_letter_failures: get(&c.dead_letter_failures),
            left_for_redelivery: get(&c.left_for_redelivery),
            heartbeats: get(&c.heartbeats),
            heartbeat_failures: get(&c.heartbeat_failures),
            abandoned: get(&c.abandoned),
        }
    }

    fn check(&self) -> Result<(), SqsConsumerError> {
        if self.queue_url.trim().is_empty() {
            return Err(SqsConsumerError::Config("the queue URL is empty".into()));
        }
        if let Some(dead) = &self.dead_letter {
            if dead.trim().is_empty() {
                return Err(SqsConsumerError::Config(
                    "the dead-letter queue URL is empty".into(),
                ));
            }
            if dead == &self.queue_url {
                return Err(SqsConsumerError::Config(
                    "the dead-letter queue is the queue itself: poison would come back".into(),
                ));
            }
        }
        // An invalid scope would make every message "no usable key", and
        // dead-letter the whole queue.
        if let Err(e) = IdempotencyKey::new(self.scope.clone(), "x") {
            return Err(SqsConsumerError::Config(format!(
                "the scope {:?} is not valid: {e}",
                self.scope
            )));
        }
        Ok(())
    }

    /// Receives and processes messages until `shutdown` completes, then
    /// waits up to [`shutdown_wait`](Self::shutdown_wait) for the messages
    /// in flight and returns what it did. Fails when the configuration is
    /// refused ([`SqsConsumerError::Config`], before any call), when SQS
    /// refuses to receive for a reason that waiting does not fix
    /// ([`SqsConsumerError::Sqs`]), or when the executor's configuration is
    /// refused ([`SqsConsumerError::Store`]); handler errors leave the
    /// message for redelivery, then dead-letter it (see the
    /// [crate docs](crate)).
    pub async fn run<F, Fut, T, E>(
        &self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, SqsConsumerError>
    where
        F: Fn(SqsMessage) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        self.check()?;
        let shared = &self.shared;
        // Receipts of an earlier run whose future was dropped: stale.
        lock(&shared.in_flight).clear();
        let queue = Arc::new(Queue {
            client: self.client.clone(),
            url: self.queue_url.clone(),
            call_timeout: self.call_timeout,
            visibility: seconds(self.visibility, MAX_VISIBILITY_SECONDS).max(1),
            dead_letter: self.dead_letter.clone(),
            key_attribute: match &self.key {
                KeySource::Attribute(name) => Some(name.clone()),
                _ => None,
            },
            shared: shared.clone(),
        });
        // The unfinished runs of an earlier `run` are still held: keep
        // their messages invisible again.
        {
            let unfinished = lock(&shared.unfinished);
            lock(&shared.in_flight).extend(unfinished.keys().cloned());
        }
        let work = Arc::new(Work {
            queue: queue.clone(),
            idem: self.idem.clone(),
            handler: Arc::new(handler),
            key: self.key.clone(),
            scope: self.scope.clone(),
            max_deliveries: self.max_deliveries,
            retry_visibility: self
                .retry_visibility
                .map(|d| seconds(d, MAX_VISIBILITY_SECONDS)),
        });
        let _heartbeat = self.heartbeat.then(|| {
            let every = (self.visibility / 3).max(Duration::from_millis(100));
            AbortOnDrop(tokio::spawn(queue.clone().heartbeat(every)))
        });
        let wait = seconds(self.wait_time, MAX_WAIT_SECONDS);
        let room = Arc::new(Semaphore::new(self.concurrency));
        let mut tasks = JoinSet::new();
        let shutdown = shutdown.fuse();
        futures_util::pin_mut!(shutdown);
        let mut backoff = Duration::ZERO;
        let mut failed: Option<SqsConsumerError> = None;
        loop {
            if let Some(e) = lock(&shared.fatal).take() {
                failed = Some(e.into());
                break;
            }
            while let Some(Some(done)) = tasks.join_next().now_or_never() {
                if let Err(e) = done {
                    tracing::error!(queue = %self.queue_url, error = %e, "a batch task failed: its messages come back after their visibility timeout");
                }
            }
            work.finish_unfinished().await;
            let want = self.batch.min(self.concurrency);
            let permits = tokio::select! {
                biased;
                () = &mut shutdown => break,
                p = work.finishing_while(room.clone().acquire_many_owned(want as u32)) => p,
            };
            let Ok(mut permits) = permits else { break };
            let received = tokio::select! {
                biased;
                () = &mut shutdown => break,
                r = work.finishing_while(queue.receive(want, wait)) => r,
            };
            let messages = match received {
                Ok(messages) => {
                    backoff = Duration::ZERO;
                    messages
                }
                Err(e) if e.is_transient() => {
                    backoff =
                        (backoff * 2).clamp(Duration::from_millis(100), Duration::from_secs(5));
                    tracing::warn!(queue = %self.queue_url, error = %e, ?backoff, "receive failed; trying again");
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(backoff) => continue,
                    }
                }
                Err(e) => {
                    tracing::error!(queue = %self.queue_url, error = %e, "receive refused: the consumer stops");
                    failed = Some(e.into());
                    break;
                }
            };
            if messages.is_empty() {
                if wait == 0 {
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(IDLE_PAUSE) => {}
                    }
                }
                continue;
            }
            add(&shared.counters.received, messages.len());
            // The room the receive did not fill goes back.
            if messages.len() < want {
                drop(permits.split(want - messages.len()));
            }
            let batch: Vec<(SqsMessage, Option<String>)> =
                messages.into_iter().map(SqsMessage::read).collect();
            {
                let mut in_flight = lock(&shared.in_flight);
                in_flight.extend(batch.iter().filter_map(|(_, r)| r.clone()));
            }
            let work = work.clone();
            tasks.spawn(async move {
                work.process(batch, permits).await;
            });
        }

        // Shutdown: the messages in flight get `shutdown_wait`; past it,
        // their tasks are dropped (the detached handlers go on and record
        // their results; the messages, not deleted, come back after their
        // visibility timeout and are replayed).
        let bound = tokio::time::sleep(self.shutdown_wait);
        futures_util::pin_mut!(bound);
        loop {
            tokio::select! {
                next = tasks.join_next() => if next.is_none() { break },
                () = &mut bound => {
                    let running = {
                        let unfinished = lock(&shared.unfinished);
                        lock(&shared.in_flight)
                            .iter()
                            .filter(|r| !unfinished.contains_key(*r))
                            .count()
                    };
                    tracing::warn!(queue = %self.queue_url, running, wait = ?self.shutdown_wait, "messages still in flight at shutdown: not deleted, they come back after their visibility timeout");
                    add(&shared.counters.abandoned, running);
                    tasks.abort_all();
                    while tasks.join_next().await.is_some() {}
                    break;
                }
            }
        }
        work.finish_unfinished().await;
        let left = lock(&shared.unfinished).len();
        if left > 0 {
            tracing::warn!(queue = %self.queue_url, messages = left, "handlers that ran are still unrecorded at shutdown: a later run finishes them; else their messages come back and, after the lease, run again");
        }
        lock(&shared.in_flight).clear();
        if failed.is_none() {
            if let Some(e) = lock(&shared.fatal).take() {
                failed = Some(e.into());
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(self.stats()),
        }
    }
}

/// Aborts the task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One SQS call, bounded by `limit`.
async fn call<T, E>(
    operation: &'static str,
    limit: Duration,
    request: impl Future<Output = Result<T, SdkError<E>>>,
) -> Result<T, SqsError>
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    match tokio::time::timeout(limit, request).await {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(e)) => Err(SqsError::of(operation, e)),
        Err(_) => Err(SqsError::timeout(operation, limit)),
    }
}

impl Queue {
    /// Up to `max` messages, waiting up to `wait` seconds for them.
    async fn receive(
        &self,
        max: usize,
        wait: i32,
    ) -> Result<Vec<aws_sdk_sqs::types::Message>, SqsError> {
        let request = self
            .client
            .receive_message()
            .queue_url(&self.url)
            .max_number_of_messages(max.clamp(1, MAX_BATCH) as i32)
            .wait_time_seconds(wait)
            .visibility_timeout(self.visibility)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
            .message_attribute_names("All")
            .send();
        let limit = Duration::from_secs(wait.max(0) as u64).saturating_add(self.call_timeout);
        let out = call("ReceiveMessage", limit, request).await?;
        Ok(out.messages.unwrap_or_default())
    }

    /// Deletes these messages, 10 a call, the calls at once.
    async fn delete(&self, receipts: &[String]) {
        if receipts.is_empty() {
            return;
        }
        let calls = receipts.chunks(MAX_BATCH).map(|chunk| async move {
            let entries: Vec<_> = chunk
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    DeleteMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(r)
                        .build()
                        .ok()
                })
                .collect();
            let request = self
                .client
                .delete_message_batch()
                .queue_url(&self.url)
                .set_entries(Some(entries))
                .send();
            match call("DeleteMessageBatch", self.call_timeout, request).await {
                Ok(out) => {
                    for failed in &out.failed {
                        tracing::warn!(queue = %self.url, code = %failed.code, message = ?failed.message, "delete refused: the message comes back and is replayed");
                    }
                    (out.successful.len(), out.failed.len())
                }
                Err(e) => {
                    tracing::warn!(queue = %self.url, messages = chunk.len(), error = %e, "delete failed: the messages come back and are replayed");
                    (0, chunk.len())
                }
            }
        });
        for (ok, failed) in futures_util::future::join_all(calls).await {
            add(&self.shared.counters.deleted, ok);
            add(&self.shared.counters.delete_failures, failed);
        }
    }

    /// Sets the visibility of these messages to `seconds`, 10 a call, the
    /// calls at once; how many SQS accepted, and the receipts it refused.
    async fn change_visibility(&self, receipts: &[String], seconds: i32) -> (usize, Vec<String>) {
        let calls = receipts.chunks(MAX_BATCH).map(|chunk| async move {
            let entries: Vec<_> = chunk
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    ChangeMessageVisibilityBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(r)
                        .visibility_timeout(seconds)
                        .build()
                        .ok()
                })
                .collect();
            let request = self
                .client
                .change_message_visibility_batch()
                .queue_url(&self.url)
                .set_entries(Some(entries))
                .send();
            match call("ChangeMessageVisibilityBatch", self.call_timeout, request).await {
                Ok(out) => {
                    let mut refused = Vec::new();
                    for failed in &out.failed {
                        let receipt = failed.id.parse::<usize>().ok().and_then(|i| chunk.get(i));
                        tracing::debug!(queue = %self.url, code = %failed.code, message = ?failed.message, "visibility change refused");
                        refused.extend(receipt.cloned());
                    }
                    (out.successful.len(), refused)
                }
                Err(e) => {
                    tracing::warn!(queue = %self.url, messages = chunk.len(), error = %e, "visibility change failed");
                    (0, chunk.to_vec())
                }
            }
        });
        let mut accepted = 0;
        let mut refused = Vec::new();
        for (ok, failed) in futures_util::future::join_all(calls).await {
            accepted += ok;
            refused.extend(failed);
        }
        (accepted, refused)
    }

    /// Keeps the messages in flight invisible: every `every`, their
    /// visibility is set to the visibility timeout again.
    async fn heartbeat(self: Arc<Self>, every: Duration) {
        loop {
            tokio::time::sleep(every).await;
            let receipts: Vec<String> = lock(&self.shared.in_flight).iter().cloned().collect();
            if receipts.is_empty() {
                continue;
            }
            let (ok, refused) = self.change_visibility(&receipts, self.visibility).await;
            add(&self.shared.counters.heartbeats, ok);
            // A message settled (deleted) while the call was on its way is
            // refused: not a failure.
            let failed = {
                let in_flight = lock(&self.shared.in_flight);
                refused.iter().filter(|r| in_flight.contains(*r)).count()
            };
            if failed > 0 {
                add(&self.shared.counters.heartbeat_failures, failed);
                tracing::warn!(queue = %self.url, failed, "visibility heartbeat: some messages were not extended (handed out again, or past SQS's 12 hours)");
            }
        }
    }

    /// Dead-letters these messages (the sends at once); returns the
    /// receipts of those sent, to delete, and of those not sent, to leave
    /// for redelivery. Without a dead-letter queue, none is sent: they are
    /// left to the queue's redrive policy.
    async fn dead_letter(
        &self,
        dead: Vec<(SqsMessage, String, String)>,
    ) -> (Vec<String>, Vec<String>) {
        if dead.is_empty() {
            return (Vec::new(), Vec::new());
        }
        add(&self.shared.counters.poison, dead.len());
        let Some(target) = &self.dead_letter else {
            let left = dead
                .into_iter()
                .map(|(message, receipt, reason)| {
                    tracing::warn!(queue = %self.url, message_id = %message.message_id, receive_count = ?message.receive_count, %reason, "poison message left to the queue's redrive policy (no dead-letter queue set)");
                    receipt
                })
                .collect();
            return (Vec::new(), left);
        };
        let sends = dead.into_iter().map(|(message, receipt, reason)| async move {
            match self.send_dead_letter(target, &message, &reason).await {
                Ok(()) => {
                    tracing::warn!(queue = %self.url, message_id = %message.message_id, dead_letter = %target, %reason, "message dead-lettered");
                    Ok(receipt)
                }
                Err(e) => {
                    tracing::warn!(queue = %self.url, message_id = %message.message_id, dead_letter = %target, error = %e, "could not dead-letter: left for redelivery");
                    Err(receipt)
                }
            }
        });
        let (mut sent, mut failed) = (Vec::new(), Vec::new());
        for result in futures_util::future::join_all(sends).await {
            match result {
                Ok(receipt) => sent.push(receipt),
                Err(receipt) => failed.push(receipt),
            }
        }
        add(&self.shared.counters.dead_letter_failures, failed.len());
        add(&self.shared.counters.dead_lettered, sent.len());
        (sent, failed)
    }

    /// Sends the dead letter of `message`: with its original attributes
    /// first; if SQS refuses that copy (too large with the attributes
    /// added), without them; if it refuses that too (a body at the size
    /// limit of the dead-letter queue), with no attribute at all, the
    /// reason then only in the log.
    async fn send_dead_letter(
        &self,
        target: &str,
        message: &SqsMessage,
        reason: &str,
    ) -> Result<(), SqsError> {
        let mut level = DeadCopy::WithOriginals;
        loop {
            let attributes = match level {
                DeadCopy::WithOriginals | DeadCopy::OursOnly => dead_letter_attributes(
                    &self.url,
                    message,
                    reason,
                    matches!(level, DeadCopy::WithOriginals),
                    self.key_attribute.as_deref(),
                ),
                DeadCopy::Bare => HashMap::new(),
            };
            let mut request = self
                .client
                .send_message()
                .queue_url(target)
                .message_body(message.body.as_str())
                .set_message_attributes(Some(attributes).filter(|a| !a.is_empty()));
            if target.ends_with(".fifo") {
                let group = message
                    .message_group_id
                    .clone()
                    .unwrap_or_else(|| "idem.dead-letter".to_owned());
                let seed = if message.message_id.is_empty() {
                    message.body.as_bytes()
                } else {
                    message.message_id.as_bytes()
                };
                request = request
                    .message_group_id(group)
                    .message_deduplication_id(Fingerprint::of_bytes(seed).to_hex());
            }
            let e = match call("SendMessage", self.call_timeout, request.send()).await {
                Ok(_) => return Ok(()),
                Err(e) if e.is_transient() => return Err(e),
                Err(e) => e,
            };
            level = match level {
                DeadCopy::WithOriginals if !message.attributes.is_empty() => {
                    tracing::warn!(queue = %self.url, message_id = %message.message_id, error = %e, "dead letter refused with the original attributes: sent again without them");
                    DeadCopy::OursOnly
                }
                DeadCopy::WithOriginals | DeadCopy::OursOnly => {
                    tracing::warn!(queue = %self.url, message_id = %message.message_id, error = %e, %reason, "dead letter refused with the reason attributes: sent again with none (the reason is only in this log)");
                    DeadCopy::Bare
                }
                DeadCopy::Bare => return Err(e),
            };
        }
    }
}

/// Which copy of a poison message is sent to the dead-letter queue.
#[derive(Clone, Copy)]
enum DeadCopy {
    WithOriginals,
    OursOnly,
    Bare,
}

/// A `String` attribute, its value made acceptable to SQS: at most
/// `MAX_REASON` bytes, characters SQS refuses replaced by `?`, never empty.
fn text_attribute(value: &str) -> Option<MessageAttributeValue> {
    let mut clean: String = value
        .chars()
        .map(|c| match c {
            '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' => c,
            c if c >= '\u{10000}' => c,
            _ => '?',
        })
        .collect();
    if clean.len() > MAX_REASON {
        let mut end = MAX_REASON - 3;
        while !clean.is_char_boundary(end) {
            end -= 1;
        }
        clean.truncate(end);
        clean.push_str("...");
    }
    if clean.is_empty() {
        clean.push('-');
    }
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(clean)
        .build()
        .ok()
}

/// The message attributes of a dead letter: ours, then the message's own
/// (the key attribute `first`, then by name) as far as SQS's limit of 10
/// leaves room (the last ones dropped first, named in `idem.dropped`), or
/// none of them.
fn dead_letter_attributes(
    source_queue: &str,
    message: &SqsMessage,
    reason: &str,
    with_originals: bool,
    first: Option<&str>,
) -> HashMap<String, MessageAttributeValue> {
    let receive_count = message
        .receive_count
        .map_or_else(|| "unknown".to_owned(), |n| n.to_string());
    let message_id = if message.message_id.is_empty() {
        "unknown"
    } else {
        message.message_id.as_str()
    };
    let ours = [
        (REASON, reason),
        (RECEIVE_COUNT, receive_count.as_str()),
        (SOURCE_QUEUE, source_queue),
        (MESSAGE_ID, message_id),
    ];
    let mut out: HashMap<String, MessageAttributeValue> = ours
        .iter()
        .filter_map(|(name, value)| Some(((*name).to_owned(), text_attribute(value)?)))
        .collect();
    let mut originals: Vec<(&String, &MessageAttributeValue)> = message
        .attributes
        .iter()
        .filter(|(name, _)| !ours.iter().any(|(n, _)| n == name) && name.as_str() != DROPPED)
        .collect();
    originals.sort_by_key(|(name, _)| (Some(name.as_str()) != first, name.as_str()));
    let room = MAX_ATTRIBUTES - out.len();
    let keep = if !with_originals {
        0
    } else if originals.len() <= room {
        originals.len()
    } else {
        room - 1
    };
    let dropped: Vec<&str> = originals[keep..].iter().map(|(n, _)| n.as_str()).collect();
    for (name, value) in &originals[..keep] {
        out.insert((*name).clone(), (*value).clone());
    }
    if !dropped.is_empty() {
        let list = format!(
            "{} of the original attributes: {}",
            dropped.len(),
            dropped.join(", ")
        );
        if let Some(value) = text_attribute(&list) {
            out.insert(DROPPED.to_owned(), value);
        }
    }
    out
}

/// What to do with a message after processing it.
enum Outcome {
    /// Delete it.
    Delete,
    /// Leave it for redelivery; not the message's fault.
    Left,
    /// The handler failed: left, or dead-lettered past `max_deliveries`.
    Failed(String),
    /// Dead-letter it at once, with this reason.
    Dead(String),
    /// Leave it, and stop `run` with this error.
    Fatal(StoreError),
    /// Its handler ran but the completion is not written: kept invisible,
    /// finished later with this lease.
    Finish(Box<Unrecorded>),
}

/// The handler's error, or the run refused because the key was acquired
/// more than `max_deliveries` times (its earlier runs were cut off).
enum Run<E> {
    Handler(E),
    TooManyAttempts(u32),
}

impl<E: fmt::Display> fmt::Display for Run<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Run::Handler(e) => e.fmt(f),
            Run::TooManyAttempts(n) => write!(
                f,
                "acquired {n} times: the earlier runs were cut off (their process died)"
            ),
        }
    }
}

/// Whether a handler error says the message can never succeed.
fn is_permanent<E: 'static>(e: &E) -> bool {
    let any = e as &dyn std::any::Any;
    if any.is::<MessageError>() {
        return true;
    }
    if let Some(b) = any.downcast_ref::<Box<dyn std::error::Error + Send + Sync>>() {
        return b.is::<MessageError>();
    }
    if let Some(b) = any.downcast_ref::<Box<dyn std::error::Error>>() {
        return b.is::<MessageError>();
    }
    false
}

/// What a batch task needs: the queue, the executor, the handler.
struct Work<S: ?Sized, C, F> {
    queue: Arc<Queue>,
    idem: Idempotency<S, C>,
    handler: Arc<F>,
    key: KeySource,
    scope: String,
    max_deliveries: u32,
    /// In whole seconds.
    retry_visibility: Option<i32>,
}

impl<S, C, F> Work<S, C, F>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
{
    /// Processes one receive's messages through the executor's batch path,
    /// then dead-letters, deletes and leaves them as their outcomes say.
    async fn process<Fut, T, E>(
        &self,
        batch: Vec<(SqsMessage, Option<String>)>,
        _room: OwnedSemaphorePermit,
    ) where
        F: Fn(SqsMessage) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let shared = &self.queue.shared;
        // A message without a receipt handle cannot be deleted nor kept
        // invisible: it is not run (its redelivery will have one).
        let mut batch: Vec<(SqsMessage, String)> = batch
            .into_iter()
            .filter_map(|(message, receipt)| match receipt {
                Some(r) => Some((message, r)),
                None => {
                    tracing::warn!(queue = %self.queue.url, message_id = %message.message_id, "a message without a receipt handle: not run");
                    add(&shared.counters.left_for_redelivery, 1);
                    None
                }
            })
            .collect();
        // Runs still to finish: their messages (a redelivery) and every
        // message of their keys are left, never run. Keys that another
        // batch of this consumer is processing are left too ("in
        // progress"): the two never race, so a run of the other batch that
        // ends unrecorded is in `unfinished` before its key is free here
        // (else this batch could take its expired lease over and run it
        // again).
        let mut claimed = Claimed {
            shared: shared.clone(),
            keys: HashSet::new(),
        };
        let mut settled: Vec<Option<Outcome>> = Vec::with_capacity(batch.len());
        let mut items = Vec::new();
        let mut item_of = Vec::new();
        {
            let mut busy = lock(&shared.busy);
            let (unfinished_ids, unfinished_keys): (HashSet<String>, HashSet<IdempotencyKey>) = {
                let map = lock(&shared.unfinished);
                (
                    map.values()
                        .map(|u| u.message.message_id.clone())
                        .filter(|id| !id.is_empty())
                        .collect(),
                    map.values()
                        .map(|u| u.unrecorded.lease().key.clone())
                        .collect(),
                )
            };
            for (i, (message, _)) in batch.iter().enumerate() {
                let outcome = if unfinished_ids.contains(&message.message_id) {
                    Some(Outcome::Left)
                } else {
                    match self.key.key_of(&self.scope, message) {
                        Err(e) => Some(Outcome::Dead(format!("no usable key: {e}"))),
                        Ok(key) if unfinished_keys.contains(&key) => Some(Outcome::Left),
                        Ok(key) if busy.contains(&key) && !claimed.keys.contains(&key) => {
                            add(&shared.counters.in_progress, 1);
                            Some(Outcome::Left)
                        }
                        Ok(key) => {
                            claimed.keys.insert(key.clone());
                            let fingerprint = Some(message::fingerprint_of(message));
                            let (handler, mut message) = (self.handler.clone(), message.clone());
                            let max = self.max_deliveries;
                            items.push((key, fingerprint, move |context: Context| async move {
                                if context.attempt > max {
                                    return Err(Run::TooManyAttempts(context.attempt));
                                }
                                message.attempt = context.attempt;
                                message.fence = context.fence;
                                handler(message).await.map_err(Run::Handler)
                            }));
                            item_of.push(i);
                            None
                        }
                    }
                };
                settled.push(outcome);
            }
            busy.extend(claimed.keys.iter().cloned());
        }
        let processed = self.idem.process_batch_with_detached(items).await;
        for (i, result) in item_of.into_iter().zip(processed) {
            settled[i] = Some(self.outcome_of(&batch[i].0, result));
        }

        let mut delete = Vec::new();
        let mut left = Vec::new();
        let mut dead = Vec::new();
        let mut done = Vec::new();
        let mut fatal = None;
        for ((message, receipt), outcome) in batch.drain(..).zip(settled) {
            let outcome = outcome.unwrap_or_else(|| {
                Outcome::Fatal(StoreError::backend("a message of the batch got no outcome"))
            });
            if !matches!(outcome, Outcome::Finish(_)) {
                done.push(receipt.clone());
            }
            match outcome {
                Outcome::Delete => delete.push(receipt),
                Outcome::Left => left.push(receipt),
                Outcome::Fatal(e) => {
                    fatal.get_or_insert(e);
                    left.push(receipt);
                }
                Outcome::Dead(reason) => dead.push((message, receipt, reason)),
                Outcome::Failed(reason) => {
                    let max = self.max_deliveries;
                    let count = match message.receive_count {
                        None if max == 1 => Some(1),
                        n => n,
                    };
                    match count {
                        Some(n) if n >= max => {
                            let reason =
                                format!("{reason} (received {n} times, max_deliveries {max})");
                            dead.push((message, receipt, reason));
                        }
                        Some(_) => left.push(receipt),
                        None => {
                            tracing::warn!(queue = %self.queue.url, message_id = %message.message_id, "handler failed and the receive count is unknown: left for redelivery");
                            left.push(receipt);
                        }
                    }
                }
                Outcome::Finish(unrecorded) => {
                    lock(&shared.unfinished).insert(
                        receipt,
                        Unfinished {
                            message,
                            unrecorded: Arc::from(unrecorded),
                        },
                    );
                }
            }
        }
        // Unrecorded runs are in `unfinished` now: their keys may go.
        drop(claimed);
        // Out of the heartbeat first: a visibility set below must not be
        // undone by a renewal (one already under way may still extend a
        // message once; it then comes back a little later).
        {
            let mut in_flight = lock(&shared.in_flight);
            for r in &done {
                in_flight.remove(r);
            }
        }
        let (sent, not_sent) = self.queue.dead_letter(dead).await;
        delete.extend(sent);
        left.extend(not_sent);
        self.queue.delete(&delete).await;
        add(&shared.counters.left_for_redelivery, left.len());
        if let (Some(seconds), false) = (self.retry_visibility, left.is_empty()) {
            self.queue.change_visibility(&left, seconds).await;
        }
        if let Some(e) = fatal {
            lock(&shared.fatal).get_or_insert(e);
        }
    }

    /// What to do with a message after processing it.
    fn outcome_of<T, E: fmt::Display + 'static>(
        &self,
        message: &SqsMessage,
        outcome: Result<Processed<T>, IdemError<Run<E>>>,
    ) -> Outcome {
        let counters = &self.queue.shared.counters;
        let (queue, id) = (&self.queue.url, &message.message_id);
        match outcome {
            Ok(Processed::Executed(_)) => {
                add(&counters.executed, 1);
                Outcome::Delete
            }
            Ok(Processed::ExecutedNotReplayable { reason, .. }) => {
                tracing::warn!(%queue, message_id = %id, %reason, "the handler ran but its result was not recorded");
                add(&counters.executed, 1);
                Outcome::Delete
            }
            Ok(Processed::Replayed(_)) => {
                add(&counters.replayed, 1);
                Outcome::Delete
            }
            // The key completed (its result was not recordable): deleted,
            // never run again, never dead-lettered.
            Err(IdemError::ResultUnavailable { reason }) => {
                tracing::warn!(%queue, message_id = %id, %reason, "duplicate of a message whose result was not recorded: deleted");
                add(&counters.replayed, 1);
                Outcome::Delete
            }
            // Held by another worker right now (its lease ends if it
            // died), or the executor waited too long for it.
            Err(IdemError::InProgress { .. } | IdemError::WaitTimeout { .. }) => {
                add(&counters.in_progress, 1);
                Outcome::Left
            }
            Err(IdemError::InvalidConfig { detail }) => {
                Outcome::Fatal(StoreError::InvalidArgument { detail })
            }
            Err(IdemError::Store(e @ StoreError::InvalidArgument { .. })) => Outcome::Fatal(e),
            Err(IdemError::Store(e)) if e.is_retryable() => {
                tracing::warn!(%queue, message_id = %id, error = %e, "store unavailable: left for redelivery");
                Outcome::Left
            }
            // The handler ran; the store was away past its lease: the
            // completion is written later with the same lease.
            Err(IdemError::Unrecorded(u)) => {
                tracing::warn!(%queue, message_id = %id, error = %u.cause(), "the handler ran but its result is not recorded yet: kept invisible, to finish");
                Outcome::Finish(u)
            }
            Err(IdemError::Handler(Run::TooManyAttempts(n))) => {
                Outcome::Dead(Run::<E>::TooManyAttempts(n).to_string())
            }
            Err(IdemError::Handler(Run::Handler(e))) if is_permanent(&e) => {
                Outcome::Dead(format!("the handler refused the message: {e}"))
            }
            Err(e) if e.is_retryable() => {
                tracing::warn!(%queue, message_id = %id, error = %e, "handler failed: left for redelivery");
                Outcome::Failed(e.to_string())
            }
            Err(e) => Outcome::Dead(e.to_string()),
        }
    }

    /// Writes the completions of messages whose handler ran while the
    /// store was away (one `complete` each, with the run's own lease), and
    /// deletes those recorded. One taken over by another worker is left
    /// (its redelivery gets the new holder's answer); one the store
    /// refuses for good is dead-lettered (its handler ran: never run
    /// again); one still failing waits for the next round, invisible.
    /// Awaits `wait`, trying the unfinished runs again every
    /// [`FINISH_EVERY`] meanwhile (a long poll can take 20 s: the lease of
    /// an unfinished run is over, and another worker may take its key over
    /// at any time, so its completion is written as soon as the store
    /// takes it).
    async fn finishing_while<T>(&self, wait: impl std::future::Future<Output = T>) -> T {
        futures_util::pin_mut!(wait);
        // A run may end unrecorded while this waits: the map is looked at
        // on every tick (a lock and an empty check while nothing is
        // unfinished).
        loop {
            tokio::select! {
                biased;
                out = &mut wait => return out,
                () = tokio::time::sleep(FINISH_EVERY) => self.finish_unfinished().await,
            }
        }
    }

    async fn finish_unfinished(&self) {
        let shared = &self.queue.shared;
        let todo: Vec<String> = {
            let map = lock(&shared.unfinished);
            if map.is_empty() {
                return;
            }
            map.keys().cloned().collect()
        };
        let mut delete = Vec::new();
        let mut dead = Vec::new();
        for receipt in todo {
            // The entry stays in the map while its finish is in flight
            // (its key held); it leaves once the finish settles.
            let Some(unrecorded) = lock(&shared.unfinished)
                .get(&receipt)
                .map(|u| u.unrecorded.clone())
            else {
                continue;
            };
            let finished = self.idem.finish(&unrecorded).await;
            if matches!(&finished, Err(e) if e.is_retryable()) {
                continue;
            }
            let Some(u) = lock(&shared.unfinished).remove(&receipt) else {
                continue;
            };
            match finished {
                Ok(()) => {
                    add(&shared.counters.executed, 1);
                    lock(&shared.in_flight).remove(&receipt);
                    delete.push(receipt);
                }
                Err(StoreError::LeaseLost) => {
                    tracing::warn!(queue = %self.queue.url, message_id = %u.message.message_id, "unfinished run taken over by another worker: left for redelivery");
                    lock(&shared.in_flight).remove(&receipt);
                    add(&shared.counters.left_for_redelivery, 1);
                }
                Err(e) if e.is_retryable() => {
                    lock(&shared.unfinished).insert(receipt, u);
                }
                Err(e) => {
                    lock(&shared.in_flight).remove(&receipt);
                    let reason =
                        format!("the handler ran but its result could not be recorded: {e}");
                    dead.push((u.message, receipt, reason));
                }
            }
        }
        let (sent, not_sent) = self.queue.dead_letter(dead).await;
        delete.extend(sent);
        add(&shared.counters.left_for_redelivery, not_sent.len());
        self.queue.delete(&delete).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(value: &str) -> MessageAttributeValue {
        text_attribute(value).unwrap_or_else(|| panic!("{value:?}"))
    }

    fn message_with(n: usize) -> SqsMessage {
        SqsMessage {
            message_id: "m-1".to_owned(),
            body: "b".to_owned(),
            attributes: (0..n).map(|i| (format!("a{i:02}"), text("v"))).collect(),
            receive_count: Some(3),
            ..SqsMessage::default()
        }
    }

    #[test]
    fn dead_letters_keep_within_ten_attributes_and_name_what_they_drop() {
        for n in [0, 6, 7, 10] {
            let out = dead_letter_attributes("q", &message_with(n), "why", true, None);
            assert!(out.len() <= MAX_ATTRIBUTES, "{n}: {}", out.len());
            for name in [REASON, RECEIVE_COUNT, SOURCE_QUEUE, MESSAGE_ID] {
                assert!(out.contains_key(name), "{n}: {name}");
            }
            let dropped = out.get(DROPPED).and_then(|v| v.string_value());
            if n <= 6 {
                assert_eq!(out.len(), 4 + n);
                assert_eq!(dropped, None);
            } else {
                assert_eq!(out.len(), MAX_ATTRIBUTES);
                // The first 5 by name kept, the rest named.
                assert!(out.contains_key("a04") && !out.contains_key("a05"));
                let dropped = dropped.unwrap_or_else(|| panic!("{n}: nothing named"));
                assert!(dropped.starts_with(&format!("{} of", n - 5)), "{dropped}");
                assert!(dropped.contains("a05"), "{dropped}");
            }
        }
        // The key attribute first, whatever its name.
        let keyed = dead_letter_attributes("q", &message_with(10), "why", true, Some("a09"));
        assert!(keyed.contains_key("a09") && keyed.contains_key("a03"));
        assert!(!keyed.contains_key("a04"));
        let none = dead_letter_attributes("q", &message_with(3), "why", false, None);
        assert_eq!(none.len(), 5);
        assert!(none
            .get(DROPPED)
            .and_then(|v| v.string_value())
            .is_some_and(|d| d.contains("a00, a01, a02")));
        let count = none.get(RECEIVE_COUNT).and_then(|v| v.string_value());
        assert_eq!(count, Some("3"));
    }

    #[test]
    fn attribute_values_are_cut_cleaned_and_never_empty() {
        let long = "é".repeat(2000);
        let v = text(&long);
        let s = v.string_value().unwrap_or_default();
        assert!(s.len() <= MAX_REASON && s.ends_with("..."), "{}", s.len());
        assert_eq!(text("a\u{1}b").string_value(), Some("a?b"));
        assert_eq!(text("").string_value(), Some("-"));
    }

    #[test]
    fn handler_errors_of_bad_input_are_permanent() {
        assert!(is_permanent(&MessageError::NoMessageId));
        let boxed: Box<dyn std::error::Error + Send + Sync> =
            Box::new(MessageError::Json("x".into()));
        assert!(is_permanent(&boxed));
        assert!(!is_permanent(&std::io::Error::other("down")));
    }

    #[test]
    fn durations_become_whole_seconds_within_limits() {
        assert_eq!(seconds(Duration::ZERO, 20), 0);
        assert_eq!(seconds(Duration::from_millis(1), 20), 1);
        assert_eq!(seconds(Duration::from_millis(1500), 20), 2);
        assert_eq!(seconds(Duration::MAX, MAX_VISIBILITY_SECONDS), 43_200);
    }
}
