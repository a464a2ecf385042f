//! The consumer loop ([`NatsConsumer::run`]): create or update the durable
//! consumer, pull while there is room, hand each message to a task of its
//! own, and shut down.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::context::{GetStreamByNameErrorKind, GetStreamErrorKind};
use async_nats::jetstream::stream::ConsumerErrorKind;
use futures_util::{FutureExt, StreamExt};
use idem_core::{
    Codec, IdempotencyStore, LeaseRunner, Runner, SharedTx, TransactionalStore, TxRunner,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::consumer::subject_matches;
use crate::shared::lock;
use crate::stats::Event;
use crate::work::Work;
use crate::{ConsumerStats, NatsConsumer, NatsConsumerError, NatsError, NatsMessage};

/// The backoff after a failed pull or bind: from the first, doubled up to
/// the longest.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(2));

/// How long past its `expires` a pull is read before it is given up (the
/// server's end of it may be lost, in a restart).
const PULL_GRACE: Duration = Duration::from_secs(1);

impl<S: IdempotencyStore + ?Sized, C: Codec> NatsConsumer<S, C> {
    /// Pulls and processes messages until `shutdown` completes, then waits
    /// up to [`shutdown_wait`](Self::shutdown_wait) for the messages in
    /// flight and returns what it did. Fails when the configuration is
    /// refused ([`NatsConsumerError::Config`], before any call), when
    /// JetStream refuses the stream or the consumer for a reason that
    /// waiting does not fix ([`NatsConsumerError::Nats`]), or when the
    /// executor's configuration is refused ([`NatsConsumerError::Store`]);
    /// a server that is away is waited for (pulls retried with a backoff),
    /// and handler errors hand the message back, then dead-letter it (see
    /// the [crate docs](crate)).
    pub async fn run<F, Fut, T, E>(
        &self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, NatsConsumerError>
    where
        F: Fn(NatsMessage) -> Fut + Send + Sync + 'static,
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
    /// leaves nothing: the redelivery runs the message cleanly, with no
    /// lease and no window, so effects in that database happen exactly
    /// once. A commit that fails for a passing reason (a lost connection)
    /// hands the message back; one the database refuses (a deferred
    /// constraint) dead-letters it with the reason. A crash leaves no
    /// trace in the transaction, so the runs cut off are counted apart
    /// (the message's `attempt`): a message that kills every consumer is
    /// dead-lettered after [`max_deliveries`](Self::max_deliveries) such
    /// runs. A handler's `Err` or panic rolls everything back. Keep
    /// [`concurrency`](Self::concurrency) at or under the pool's size: each
    /// message in flight holds a connection. See [`TxRunner`] for the rest.
    ///
    /// ```no_run
    /// use idem_core::Idempotency;
    /// use idem_postgres::{sqlx, PgStore, PgTx};
    /// use idem_nats::{NatsConsumer, NatsMessage};
    ///
    /// # async fn run(js: idem_nats::async_nats::jetstream::Context, store: PgStore) -> Result<(), Box<dyn std::error::Error>> {
    /// let consumer = NatsConsumer::new(js, "EMAILS", "sender", Idempotency::new(store)).concurrency(8);
    /// consumer
    ///     .run_in_transaction(
    ///         |message: NatsMessage, tx: PgTx| async move {
    ///             let mut tx = tx.lock().await?;
    ///             sqlx::query("INSERT INTO emails (body, fence) VALUES ($1, $2)")
    ///                 .bind(message.payload.to_vec())
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
    ) -> Result<ConsumerStats, NatsConsumerError>
    where
        S: TransactionalStore,
        F: Fn(NatsMessage, SharedTx<S::Tx>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let runner = TxRunner::new().wait(self.transaction_wait);
        self.run_with(runner, handler, shutdown).await
    }

    /// The durable consumer's configuration.
    fn consumer_config(&self) -> pull::Config {
        pull::Config {
            durable_name: Some(self.durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            // No limit of JetStream's: it would stop delivering a message
            // silently; `max_deliveries` dead-letters it instead.
            max_deliver: -1,
            max_ack_pending: i64::try_from(self.max_ack_pending).unwrap_or(i64::MAX),
            filter_subject: self.filter_subject.clone().unwrap_or_default(),
            ..Default::default()
        }
    }

    /// Finds the stream and creates (or updates) the durable consumer.
    async fn bind(&self) -> Result<PullConsumer, NatsError> {
        let stream = self.jetstream.get_stream(&self.stream).await.map_err(|e| {
            let transient = matches!(e.kind(), GetStreamErrorKind::Request);
            NatsError::new("get stream", transient, e)
        })?;
        if let Some(dead) = &self.dead_letter {
            let captured = stream
                .cached_info()
                .config
                .subjects
                .iter()
                .any(|s| subject_matches(s, dead));
            let read = self
                .filter_subject
                .as_ref()
                .is_none_or(|f| subject_matches(f, dead));
            if captured && read {
                return Err(NatsError::new(
                    "bind",
                    false,
                    format!("the dead-letter subject {dead:?} is in the stream {:?} and read by this consumer: poison would come back", self.stream),
                ));
            }
            // A dead letter no stream takes could never be published: the
            // poison would be handed back for ever.
            if let Err(e) = self.jetstream.stream_by_subject(dead.clone()).await {
                let transient = matches!(e.kind(), GetStreamByNameErrorKind::Request);
                let detail = match e.kind() {
                    GetStreamByNameErrorKind::NotFound => {
                        format!("no stream captures the dead-letter subject {dead:?}")
                    }
                    _ => e.to_string(),
                };
                return Err(NatsError::new(
                    "find the dead-letter stream",
                    transient,
                    detail,
                ));
            }
        }
        stream
            .create_consumer(self.consumer_config())
            .await
            .map_err(|e| {
                let transient = matches!(
                    e.kind(),
                    ConsumerErrorKind::TimedOut
                        | ConsumerErrorKind::Request
                        | ConsumerErrorKind::Other
                );
                NatsError::new("create consumer", transient, e)
            })
    }

    /// [`run`](Self::run) with handlers run by `runner`.
    async fn run_with<M, F, Fut, T, E>(
        &self,
        runner: M,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, NatsConsumerError>
    where
        M: Runner<S, C>,
        F: Fn(NatsMessage, M::With) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        self.check()?;
        let shared = &self.shared;
        // Messages of an earlier run whose future was dropped: settled or
        // redelivered since; but those whose completion is being written
        // (their finishers, detached, still hold them) are given up if
        // this run's shutdown outwaits them.
        lock(&shared.held).retain(|_, h| h.finishing.is_some());
        let counters = &shared.counters;
        let shutdown = shutdown.fuse();
        futures_util::pin_mut!(shutdown);
        let work = Arc::new(Work {
            idem: self.idem.clone(),
            runner,
            handler: Arc::new(handler),
            jetstream: self.jetstream.clone(),
            durable: self.durable.clone(),
            key: self.key.clone(),
            scope: self.scope.clone(),
            fingerprint: self.fingerprint.clone(),
            max_deliveries: self.max_deliveries,
            retry_delay: self.retry_delay,
            dead_letter: self.dead_letter.clone(),
            progress_every: self
                .progress_acks
                .then(|| (self.ack_wait / 3).max(Duration::from_millis(30))),
            shared: shared.clone(),
        });
        let mut backoff = Duration::ZERO;
        let mut consumer: Option<PullConsumer> = None;
        let room = Arc::new(Semaphore::new(self.concurrency));
        let mut tasks = JoinSet::new();
        let mut failed: Option<NatsConsumerError> = None;
        'pulling: loop {
            if let Some(e) = lock(&shared.fatal).take() {
                failed = Some(e.into());
                break;
            }
            while let Some(Some(done)) = tasks.join_next().now_or_never() {
                if let Err(e) = done {
                    tracing::error!(consumer = %self.durable, error = %e, "a message task failed: its message comes back after the ack wait");
                }
            }
            if !backoff.is_zero() {
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    () = tokio::time::sleep(backoff) => {}
                }
            }
            let bound = match &consumer {
                Some(c) => c,
                None => {
                    let bound = tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        b = self.bind() => b,
                    };
                    match bound {
                        Ok(c) => consumer.insert(c),
                        Err(e) if e.is_transient() => {
                            backoff = next_backoff(backoff);
                            tracing::warn!(consumer = %self.durable, error = %e, ?backoff, "cannot bind the consumer yet; trying again");
                            continue;
                        }
                        Err(e) => {
                            tracing::error!(consumer = %self.durable, error = %e, "JetStream refused the consumer: it stops");
                            failed = Some(e.into());
                            break;
                        }
                    }
                }
            };
            // Room for one message at least, then for as many more as are
            // free, up to a batch.
            let permit = tokio::select! {
                biased;
                () = &mut shutdown => break,
                p = room.clone().acquire_owned() => p,
            };
            let Ok(mut permits) = permit else { break };
            let more = room.available_permits().min(self.batch - 1);
            if more > 0 {
                if let Ok(extra) = room.clone().try_acquire_many_owned(more as u32) {
                    permits.merge(extra);
                }
            }
            let want = permits.num_permits();
            let pull = bound
                .batch()
                .max_messages(want)
                .expires(self.pull_wait)
                .messages();
            let pulled = tokio::select! {
                biased;
                () = &mut shutdown => break,
                p = pull => p,
            };
            let mut batch = match pulled {
                Ok(batch) => batch,
                Err(e) => {
                    counters.add(Event::PullFailures, 1);
                    backoff = next_backoff(backoff);
                    tracing::warn!(consumer = %self.durable, error = %e, ?backoff, "pull failed; trying again");
                    consumer = None;
                    continue;
                }
            };
            let deadline = tokio::time::Instant::now() + self.pull_wait + PULL_GRACE;
            loop {
                let next = tokio::select! {
                    biased;
                    () = &mut shutdown => {
                        // What this pull brought already is handed back,
                        // not left to the ack wait.
                        while let Some(Some(Ok(raw))) = batch.next().now_or_never() {
                            work.hand_back(&raw).await;
                        }
                        break 'pulling;
                    }
                    () = tokio::time::sleep_until(deadline) => break,
                    next = batch.next() => next,
                };
                match next {
                    Some(Ok(raw)) => {
                        backoff = Duration::ZERO;
                        counters.add(Event::Received, 1);
                        match permits.split(1) {
                            Some(permit) => {
                                // Held from here: a task aborted at
                                // shutdown before it ran hands it back.
                                let id = shared.hold(raw.clone());
                                tasks.spawn(work.clone().handle(raw, id, permit));
                            }
                            // More than the pull asked for (a server
                            // should not): no room for it, handed back.
                            None => work.hand_back(&raw).await,
                        }
                    }
                    Some(Err(e)) => {
                        counters.add(Event::PullFailures, 1);
                        backoff = next_backoff(backoff);
                        tracing::warn!(consumer = %self.durable, error = %e, ?backoff, "pull ended with an error; trying again");
                        consumer = None;
                        break;
                    }
                    None => {
                        backoff = Duration::ZERO;
                        break;
                    }
                }
            }
        }

        // Shutdown: the messages in flight get `shutdown_wait`; past it,
        // their tasks are dropped (the detached handlers go on and record
        // their results) and their messages handed back.
        let bound = tokio::time::sleep(self.shutdown_wait);
        futures_util::pin_mut!(bound);
        loop {
            tokio::select! {
                next = tasks.join_next() => if next.is_none() { break },
                () = &mut bound => {
                    tasks.abort_all();
                    while tasks.join_next().await.is_some() {}
                    self.hand_back_held(&work).await;
                    break;
                }
            }
        }
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

    /// At shutdown, the messages whose tasks were dropped: handed back
    /// (their handlers, detached, record their results; the redelivery
    /// gets "in progress", then the replay), except those whose
    /// completion was being written: their keys are given up here (never
    /// run again by this consumer), their finishers told to stop (after
    /// one more try) and their messages left to come back after the ack
    /// wait.
    async fn hand_back_held<M, F>(&self, work: &Work<S, C, F, M>)
    where
        M: Runner<S, C>,
    {
        let held: Vec<_> = lock(&self.shared.held).drain().map(|(_, h)| h).collect();
        if held.is_empty() {
            return;
        }
        tracing::warn!(consumer = %self.durable, messages = held.len(), wait = ?self.shutdown_wait, "messages still held at shutdown: handed back");
        self.shared.counters.add(Event::Abandoned, held.len());
        for h in held {
            match h.finishing {
                Some((key, fingerprint)) => {
                    tracing::warn!(consumer = %self.durable, %key, "a handler that ran is still unrecorded at shutdown: its message comes back after the ack wait and, its lease over, may run again elsewhere");
                    self.shared.finishing.given_up().insert(
                        key,
                        fingerprint,
                        self.idem.retention_period(),
                    );
                }
                None => work.hand_back(&h.message).await,
            }
        }
        self.shared.give_up();
    }
}

fn next_backoff(backoff: Duration) -> Duration {
    let (first, longest) = BACKOFF;
    (backoff * 2).clamp(first, longest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_within_its_bounds() {
        let (first, longest) = BACKOFF;
        assert_eq!(next_backoff(Duration::ZERO), first);
        assert_eq!(next_backoff(first), first * 2);
        assert_eq!(next_backoff(longest), longest);
        assert_eq!(next_backoff(Duration::MAX / 4), longest);
    }
}
