//! The consumer loop ([`SqsConsumer::run`]): receive while there is room,
//! hand each receive to a batch task, and shut down.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use idem_core::{
    Codec, IdempotencyStore, LeaseRunner, Runner, SharedTx, TransactionalStore, TxRunner,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::batch::Work;
use crate::consumer::{seconds, MAX_VISIBILITY_SECONDS, MAX_WAIT_SECONDS};
use crate::queue::Queue;
use crate::shared::lock;
use crate::stats::add;
use crate::{ConsumerStats, KeySource, SqsConsumer, SqsConsumerError, SqsMessage};

/// The pause after an empty short poll (`wait_time` zero).
const IDLE_PAUSE: Duration = Duration::from_millis(100);

impl<S: IdempotencyStore + ?Sized, C: Codec> SqsConsumer<S, C> {
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
        self.run_with(LeaseRunner, move |message, ()| handler(message), shutdown)
            .await
    }

    /// The in-transaction form of [`run`](Self::run): each message runs in
    /// a transaction of the store's database (a [`TransactionalStore`],
    /// such as `PgStore`), handed to the handler; the claim of its key,
    /// the handler's writes and its result commit together before the
    /// message is deleted. A consumer killed anywhere before that commit
    /// leaves nothing: the redelivery runs the message cleanly, with no
    /// lease and no window, so effects in that database happen exactly
    /// once. A commit that fails for a passing reason (a lost connection)
    /// leaves the message for redelivery; one the database refuses (a
    /// deferred constraint) counts as a failed run: dead-lettered with the reason after `max_deliveries`. A crash leaves
    /// no trace in the transaction, so the runs cut off are counted apart
    /// (the message's `attempt`): a message that kills every consumer is
    /// dead-lettered after [`max_deliveries`](Self::max_deliveries) such
    /// runs. A handler's `Err` or panic rolls everything back. Keep
    /// [`concurrency`](Self::concurrency) at or under the pool's size: each
    /// message in flight holds a connection. See [`TxRunner`] for the rest.
    ///
    /// ```no_run
    /// use idem_core::Idempotency;
    /// use idem_postgres::{sqlx, PgStore, PgTx};
    /// use idem_sqs::{SqsConsumer, SqsMessage};
    ///
    /// # async fn run(client: idem_sqs::aws_sdk_sqs::Client, url: &str, store: PgStore) -> Result<(), Box<dyn std::error::Error>> {
    /// let consumer = SqsConsumer::new(client, url, Idempotency::new(store)).key_from_content();
    /// consumer
    ///     .run_in_transaction(
    ///         |message: SqsMessage, tx: PgTx| async move {
    ///             let mut tx = tx.lock().await?;
    ///             sqlx::query("INSERT INTO emails (body, fence) VALUES ($1, $2)")
    ///                 .bind(&message.body)
    ///                 .bind(message.fence as i64)
    ///                 .execute(&mut *tx)
    ///                 .await?;
    ///             Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    ///         },
    ///         async { let _ = tokio::signal::ctrl_c().await; },
    ///     )
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn run_in_transaction<F, Fut, T, E>(
        &self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, SqsConsumerError>
    where
        S: TransactionalStore,
        F: Fn(SqsMessage, SharedTx<S::Tx>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let runner = TxRunner::new().wait(self.transaction_wait);
        self.run_with(runner, handler, shutdown).await
    }

    /// [`run`](Self::run) with handlers run by `runner`.
    async fn run_with<M, F, Fut, T, E>(
        &self,
        runner: M,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, SqsConsumerError>
    where
        M: Runner<S, C>,
        F: Fn(SqsMessage, M::With) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        self.check()?;
        let shared = &self.shared;
        // Receipts of an earlier run whose future was dropped: stale.
        lock(&shared.in_flight).clear();
        lock(&shared.settling).clear();
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
            runner,
            handler: Arc::new(handler),
            key: self.key.clone(),
            fingerprint: self.fingerprint.clone(),
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
        lock(&shared.settling).clear();
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
