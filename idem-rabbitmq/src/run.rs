//! The consumer loop ([`RabbitConsumer::run`]): connect, consume, hand each
//! delivery to a task of its own, connect again when the connection is
//! lost, and shut down.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use idem_core::{
    Codec, IdempotencyStore, LeaseRunner, Runner, SharedTx, TransactionalStore, TxRunner,
};
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::error::is_refusal;
use crate::shared::lock;
use crate::stats::add;
use crate::work::{Phase, Publisher, Work};
use crate::{ConsumerStats, DeadLetter, RabbitConsumer, RabbitConsumerError, RabbitMessage};

/// How long a connect (TCP, AMQP handshake, channel, qos, consume) may
/// take before it is tried again.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest pause between two connects while the broker is away.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// After the shutdown wait, how long the results still being finished get
/// for their last try and their dead letter.
const GIVE_UP_WAIT: Duration = Duration::from_secs(5);

/// A live connection: its consuming channel and its consumer.
struct Session {
    connection: Arc<Connection>,
    channel: Channel,
    consumer: Consumer,
}

impl<S: IdempotencyStore + ?Sized, C: Codec> RabbitConsumer<S, C> {
    /// Consumes and processes messages until `shutdown` completes, then
    /// waits up to [`shutdown_wait`](Self::shutdown_wait) for the messages
    /// in flight and returns what it did. A lost connection (the broker
    /// restarted, the network failed) is made again, with pauses of up to
    /// 2 s; the messages the lost connection held come back from the
    /// broker and are replayed. Fails when the configuration is refused
    /// ([`RabbitConsumerError::Config`], before any call), when the
    /// broker refuses to consume for a reason that connecting again does
    /// not fix ([`RabbitConsumerError::Refused`]: the queue does not
    /// exist), or when the executor's configuration is refused
    /// ([`RabbitConsumerError::Store`]).
    pub async fn run<F, Fut, T, E>(
        &self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, RabbitConsumerError>
    where
        F: Fn(RabbitMessage) -> Fut + Send + Sync + 'static,
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
    /// message is acked. A consumer killed anywhere before that commit
    /// leaves nothing: the broker delivers the message again and it runs
    /// cleanly, with no lease and no window, so effects in that database
    /// happen exactly once. A commit that fails for a passing reason
    /// requeues the message; a handler's `Err` or panic rolls everything
    /// back. Keep [`prefetch`](Self::prefetch) at or under the pool's size:
    /// each message in flight holds a connection. See [`TxRunner`].
    ///
    /// ```no_run
    /// use idem_core::Idempotency;
    /// use idem_postgres::{sqlx, PgStore, PgTx};
    /// use idem_rabbitmq::{RabbitConsumer, RabbitMessage};
    ///
    /// # async fn run(store: PgStore) -> Result<(), Box<dyn std::error::Error>> {
    /// let consumer = RabbitConsumer::new("amqp://127.0.0.1:5672/%2f", "emails", Idempotency::new(store))
    ///     .prefetch(8);
    /// consumer
    ///     .run_in_transaction(
    ///         |message: RabbitMessage, tx: PgTx| async move {
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
    ) -> Result<ConsumerStats, RabbitConsumerError>
    where
        S: TransactionalStore,
        F: Fn(RabbitMessage, SharedTx<S::Tx>) -> Fut + Send + Sync + 'static,
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
    ) -> Result<ConsumerStats, RabbitConsumerError>
    where
        M: Runner<S, C>,
        F: Fn(RabbitMessage, M::With) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        self.check()?;
        let (phase, _) = watch::channel(Phase::Running);
        let work = Arc::new(Work {
            idem: self.idem.clone(),
            runner,
            handler: Arc::new(handler),
            key: self.key.clone(),
            fingerprint: self.fingerprint.clone(),
            scope: self.scope.clone(),
            queue: self.queue.clone(),
            max_deliveries: self.max_deliveries,
            requeue_delay: self.requeue_delay,
            dead_letter: self.dead_letter.clone(),
            publisher: Mutex::new(None),
            phase,
            shared: self.shared.clone(),
        });
        let counters = &self.shared.counters;
        let mut tasks = JoinSet::new();
        let shutdown = shutdown.fuse();
        futures_util::pin_mut!(shutdown);
        let mut failed: Option<RabbitConsumerError> = None;
        let mut live: Option<Session> = None;
        let mut connects = 0u64;
        let mut backoff = Duration::ZERO;
        'connect: loop {
            let connected = tokio::select! {
                biased;
                () = &mut shutdown => break 'connect,
                c = tokio::time::timeout(CONNECT_TIMEOUT, self.connect()) => c,
            };
            let session = match connected {
                Ok(Ok((session, publisher))) => {
                    *lock(&work.publisher) = publisher;
                    session
                }
                Ok(Err(e)) if is_refusal(&e) => {
                    tracing::error!(queue = %self.queue, error = %e, "the broker refuses to consume: the consumer stops");
                    failed = Some(RabbitConsumerError::Refused(e));
                    break 'connect;
                }
                failure => {
                    let error = match failure {
                        Ok(Err(e)) => e.to_string(),
                        _ => format!("no connection within {CONNECT_TIMEOUT:?}"),
                    };
                    backoff = (backoff * 2).clamp(Duration::from_millis(50), MAX_BACKOFF);
                    tracing::warn!(queue = %self.queue, %error, ?backoff, "cannot connect to the broker; trying again");
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break 'connect,
                        () = tokio::time::sleep(backoff) => continue 'connect,
                    }
                }
            };
            connects += 1;
            if connects > 1 {
                add(&counters.reconnects, 1);
                tracing::info!(queue = %self.queue, "connected again");
            }
            backoff = Duration::ZERO;
            let mut consumer = session.consumer.clone();
            live = Some(session);
            loop {
                while let Some(Some(done)) = tasks.join_next().now_or_never() {
                    if let Err(e) = done {
                        tracing::error!(queue = %self.queue, error = %e, "a message task failed: the broker delivers its message again");
                    }
                }
                if let Some(e) = lock(&self.shared.fatal).take() {
                    failed = Some(e.into());
                    break 'connect;
                }
                tokio::select! {
                    biased;
                    () = &mut shutdown => break 'connect,
                    // A task that set `fatal` ends: look again.
                    Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
                    next = consumer.next() => match next {
                        Some(Ok(delivery)) => {
                            add(&counters.received, 1);
                            tasks.spawn(work.clone().handle(delivery));
                        }
                        Some(Err(e)) => {
                            tracing::warn!(queue = %self.queue, error = %e, "the connection to the broker is lost: connecting again (the broker delivers the unacked messages again)");
                            break;
                        }
                        None => {
                            tracing::warn!(queue = %self.queue, "the broker ended the consumer: connecting again");
                            break;
                        }
                    },
                }
            }
            // The lost connection's deliveries can no longer be acked: the
            // broker requeued them.
            if let Some(lost) = live.take() {
                let _ = lost
                    .connection
                    .close(0, "idem: connection lost".into())
                    .now_or_never();
            }
        }

        // Shutdown: no more deliveries; those in flight get
        // `shutdown_wait` (messages held before a requeue are requeued at
        // once), then the results being finished get one more try.
        if let Some(session) = &live {
            let tag = session.consumer.tag();
            let cancel = session
                .channel
                .basic_cancel(tag, BasicCancelOptions::default());
            if let Err(e) = tokio::time::timeout(CONNECT_TIMEOUT, cancel)
                .await
                .unwrap_or(Ok(()))
            {
                tracing::debug!(queue = %self.queue, error = %e, "basic.cancel failed at shutdown");
            }
        }
        work.phase.send_replace(Phase::Stopping);
        if !wait_for(&mut tasks, self.shutdown_wait).await {
            work.phase.send_replace(Phase::GivingUp);
            if !wait_for(&mut tasks, GIVE_UP_WAIT).await {
                let running = tasks.len();
                tracing::warn!(queue = %self.queue, running, wait = ?self.shutdown_wait, "messages still in flight at shutdown: not acked, the broker delivers them again (their handlers go on and record)");
                add(&counters.abandoned, running as u64);
                tasks.abort_all();
                while tasks.join_next().await.is_some() {}
            }
        }
        *lock(&work.publisher) = None;
        if let Some(session) = live.take() {
            // Unacked messages go back to the queue with the connection.
            let close = session.connection.close(200, "idem: shutdown".into());
            let _ = tokio::time::timeout(CONNECT_TIMEOUT, close).await;
        }
        if failed.is_none() {
            if let Some(e) = lock(&self.shared.fatal).take() {
                failed = Some(e.into());
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(self.stats()),
        }
    }

    /// Connects, opens the consuming channel (with its prefetch) and, for
    /// dead letters of our own, a confirm channel, and starts consuming.
    async fn connect(&self) -> lapin::Result<(Session, Option<Publisher>)> {
        let connection = Arc::new(Connection::connect(&self.uri, (self.properties)()).await?);
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await?;
        let publisher = match &self.dead_letter {
            DeadLetter::QueuePolicy => None,
            DeadLetter::Exchange { .. } => {
                let publisher = connection.create_channel().await?;
                publisher
                    .confirm_select(ConfirmSelectOptions::default())
                    .await?;
                Some(Publisher {
                    connection: connection.clone(),
                    channel: Some(publisher),
                })
            }
        };
        // Both checked at most 255 bytes by `check`.
        let consumer = channel
            .basic_consume(
                self.queue.as_str().into(),
                self.consumer_tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok((
            Session {
                connection,
                channel,
                consumer,
            },
            publisher,
        ))
    }
}

/// Waits up to `wait` for every task; whether they all ended.
async fn wait_for(tasks: &mut JoinSet<()>, wait: Duration) -> bool {
    let all = async { while tasks.join_next().await.is_some() {} };
    tokio::time::timeout(wait, all).await.is_ok()
}
