//! The in-transaction mode.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use idem_core::{
    not_replayable_marker, not_replayable_reason, Acquisition, Codec, CodecError, Context,
    Fingerprint, IdemError, IdempotencyKey, JsonCodec, Lease, LeaseToken, SharedTx, StoreError,
    TransactionalStore,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use sqlx::{PgConnection, Postgres, Transaction};

use crate::error::Failure;
use crate::store::PgStore;

/// The transaction a receiver's in-transaction form hands its handler
/// (`run_in_transaction` of the Kafka, SQS and Redis Streams consumers):
/// `tx.lock().await?` gives a guard, and `&mut *guard` is an sqlx executor
/// on the transaction. The receiver records the result in it and commits.
pub type PgTx = SharedTx<Transaction<'static, Postgres>>;

/// Idempotency inside your own transaction: the reservation, your business
/// writes and the completion commit or roll back together.
///
/// [`claim`](Self::claim) reserves the key in your transaction. A fresh key
/// gives [`Claim::Acquired`]: do your writes on the same transaction, then
/// [`TxLease::complete`] records the response, then commit. A completed key
/// gives [`Claim::Replayed`] with the recorded response. A duplicate that
/// claims while the first transaction is open **waits** for it (on the
/// unique index), then replays its response if it committed, or acquires
/// and runs if it rolled back. A crash rolls everything back, so no lease is
/// needed and none is held: the record is invisible to others until commit.
///
/// ```no_run
/// use idem_core::IdempotencyKey;
/// use idem_postgres::{Claim, PgStore};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct Payment { order_id: i64, amount_cents: i64 }
/// #[derive(Serialize, Deserialize)]
/// struct Receipt { payment_id: i64 }
///
/// # async fn pay(pool: sqlx::PgPool, store: PgStore, payment: Payment) -> Result<Receipt, Box<dyn std::error::Error>> {
/// let key = IdempotencyKey::new("payments.charge", format!("order-{}", payment.order_id))?;
/// let mut tx = pool.begin().await?;
/// match store.in_transaction().claim::<_, Receipt>(&mut tx, &key, &payment).await? {
///     Claim::Replayed(receipt) => Ok(receipt), // tx dropped: rolled back, nothing written
///     Claim::Acquired(lease) => {
///         let payment_id: i64 = sqlx::query_scalar(
///             "INSERT INTO payments (order_id, amount_cents) VALUES ($1, $2) RETURNING id",
///         )
///         .bind(payment.order_id)
///         .bind(payment.amount_cents)
///         .fetch_one(&mut *tx)
///         .await?;
///         let receipt = Receipt { payment_id };
///         lease.complete(&mut tx, &receipt).await?;
///         tx.commit().await?; // the payment row and the idem record, together
///         Ok(receipt)
///     }
/// }
/// # }
/// ```
///
/// Run it at the default READ COMMITTED isolation: under REPEATABLE READ or
/// SERIALIZABLE a waiting duplicate gets a serialization failure instead of
/// the replay (reported as the retryable [`StoreError::Unavailable`]).
///
/// Claiming a key your transaction already claimed gives the same claim
/// again (same token, attempt and fence; completing either completes the
/// key), never a takeover of your own row; a claim rolled back with its
/// savepoint is gone. Each claim holds a transaction-scoped advisory lock on
/// its key until your transaction ends (that is what plain acquisitions of
/// the key wait on, so their leases and fences are taken after your
/// transaction): a single transaction claiming thousands of keys needs
/// room in the server's lock table (`max_locks_per_transaction`). The
/// store's server-side timeouts are not applied to your transaction; set
/// `lock_timeout` on it if a claim should not wait for long.
///
/// Dropping the transaction after an error rolls back the reservation with
/// everything else; if you commit without completing, the key is left in
/// progress with its lease already over, so the next delivery takes it over
/// as attempt 2.
pub struct InTransaction<C = JsonCodec> {
    store: PgStore,
    retention: Duration,
    codec: Arc<C>,
    lock_wait: Option<Duration>,
}

impl<C> Clone for InTransaction<C> {
    fn clone(&self) -> Self {
        InTransaction {
            store: self.store.clone(),
            retention: self.retention,
            codec: self.codec.clone(),
            lock_wait: self.lock_wait,
        }
    }
}

/// The outcome of [`InTransaction::claim`].
#[derive(Debug)]
pub enum Claim<T, C = JsonCodec> {
    /// Your transaction holds the key: write, complete, commit.
    Acquired(TxLease<C>),
    /// The key was completed: this is the recorded response.
    Replayed(T),
}

/// What [`TxLease::complete`] wrote in the transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completion {
    /// The response, replayed to every later claim once committed.
    Recorded,
    /// The "not replayable" marker, with its reason: the response could
    /// not be recorded; later claims get `ResultUnavailable`.
    NotReplayable {
        /// Why the response was not recorded.
        reason: String,
    },
}

/// The key held inside a transaction; [`complete`](Self::complete) it on the
/// same transaction before committing.
#[must_use = "complete the lease on the same transaction before committing"]
#[derive(Debug)]
pub struct TxLease<C = JsonCodec> {
    store: PgStore,
    lease: Lease,
    retention: Duration,
    codec: Arc<C>,
}

impl InTransaction<JsonCodec> {
    pub(crate) fn new(store: PgStore) -> Self {
        InTransaction {
            store,
            retention: Duration::from_secs(24 * 60 * 60),
            codec: Arc::new(JsonCodec),
            lock_wait: None,
        }
    }
}

impl<C: Codec> InTransaction<C> {
    /// How long completed responses are kept for replay (default 24 h;
    /// saturated to [`MAX_DURATION`](idem_core::MAX_DURATION), so
    /// `Duration::MAX` keeps them as long as the store can). A zero
    /// retention is refused when a key is claimed
    /// ([`IdemError::InvalidConfig`]): every duplicate would run again.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Replaces the response codec (default JSON).
    pub fn codec<C2: Codec>(self, codec: C2) -> InTransaction<C2> {
        self.codec_shared(Arc::new(codec))
    }

    /// How long a claim waits for another open transaction that holds its
    /// key; then the claim is [`IdemError::InProgress`] and your
    /// transaction is aborted (roll it back). Default: your transaction's
    /// own `lock_timeout` (the server's, often none). The transaction's
    /// setting is given back after the claim.
    pub fn lock_wait(mut self, wait: Duration) -> Self {
        self.lock_wait = Some(wait);
        self
    }

    /// Replaces the response codec with a shared one (an executor's,
    /// [`Idempotency::codec_shared`](idem_core::Idempotency::codec_shared)).
    pub fn codec_shared<C2: Codec>(self, codec: Arc<C2>) -> InTransaction<C2> {
        InTransaction {
            store: self.store,
            retention: self.retention,
            codec,
            lock_wait: self.lock_wait,
        }
    }

    /// Reserves `key` in `tx`, checking `payload`'s fingerprint against a
    /// stored one. Waits while another open transaction holds the key.
    pub async fn claim<P, T>(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        key: &IdempotencyKey,
        payload: &P,
    ) -> Result<Claim<T, C>, IdemError<Infallible>>
    where
        P: Serialize + ?Sized,
        T: DeserializeOwned,
    {
        let fingerprint = Fingerprint::of(payload)
            .map_err(|e| IdemError::Codec(CodecError::Encode(Box::new(e))))?;
        self.claim_with(tx, key, Some(fingerprint)).await
    }

    /// Like [`claim`](Self::claim) with a fingerprint computed by the
    /// caller, or none.
    pub async fn claim_with<T>(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        key: &IdempotencyKey,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Claim<T, C>, IdemError<Infallible>>
    where
        T: DeserializeOwned,
    {
        // A completion that expires at once would let every duplicate
        // run the handler again.
        if self.retention.is_zero() {
            return Err(IdemError::InvalidConfig {
                detail: "the retention is zero: every duplicate would run the handler again".into(),
            });
        }
        let outcome = self
            .store
            .claim_on(tx, key, fingerprint.as_ref(), self.lock_wait)
            .await?;
        match outcome {
            Acquisition::Acquired(lease) => Ok(Claim::Acquired(TxLease {
                store: self.store.clone(),
                lease,
                retention: self.retention,
                codec: self.codec.clone(),
            })),
            // A key whose result could not be recorded ran: never again.
            Acquisition::Completed(record) => match not_replayable_reason(&record.response) {
                Some(reason) => Err(IdemError::ResultUnavailable { reason }),
                None => self
                    .codec
                    .decode(&record.response)
                    .map(Claim::Replayed)
                    .map_err(IdemError::Codec),
            },
            Acquisition::InProgress {
                retry_after,
                attempt,
                ..
            } => Err(IdemError::InProgress {
                retry_after,
                attempt,
            }),
            Acquisition::Mismatch => Err(IdemError::PayloadMismatch),
        }
    }
}

impl<C: Codec> TxLease<C> {
    /// 1, or more when an earlier transaction committed the key without
    /// completing it.
    pub fn attempt(&self) -> u32 {
        self.lease.attempt
    }

    /// The fence of this claim, from the store's sequence: strictly above
    /// the fence of every earlier acquisition of the key (in a transaction
    /// or not), including those before a release, a delete or the record's
    /// expiry. A rolled-back claim's fence is never handed out again. Pass
    /// it to downstream systems that keep the highest fence per key.
    pub fn fence(&self) -> u64 {
        self.lease.fence
    }

    /// The underlying lease.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Records `response` in `tx`. Commit afterwards to make the business
    /// writes and the record durable together.
    ///
    /// A response that cannot be recorded (it does not encode, such as a
    /// NaN in JSON, or it is over the store's `max_response_bytes`) does
    /// not fail the claim: the key is completed as "not replayable"
    /// ([`Completion::NotReplayable`]), so that once you commit, your
    /// writes stand and every later claim gets
    /// [`IdemError::ResultUnavailable`], never a second run.
    pub async fn complete<T: Serialize>(
        self,
        tx: &mut Transaction<'_, Postgres>,
        response: &T,
    ) -> Result<Completion, IdemError<Infallible>> {
        let bytes = match self.codec.encode(response) {
            Ok(bytes) => bytes,
            Err(e) => {
                let reason = format!("the result does not encode: {e}");
                return self.complete_not_replayable(tx, &reason).await;
            }
        };
        if let Err(e) = self.store.check_response_size(&bytes) {
            return self.complete_not_replayable(tx, &e.to_string()).await;
        }
        self.store
            .complete_on(tx, &self.lease, &bytes, self.retention)
            .await
            .map_err(|f| match self.store.fail(f) {
                StoreError::LeaseLost => IdemError::LeaseLost,
                other => IdemError::Store(other),
            })?;
        Ok(Completion::Recorded)
    }

    /// Records in `tx` that the key ran but its result cannot be replayed,
    /// for `reason` (a response too large or streamed): every later claim
    /// of the key gets [`IdemError::ResultUnavailable`], never a second
    /// run. Commit afterwards, as after [`complete`](Self::complete).
    pub async fn complete_not_replayable(
        self,
        tx: &mut Transaction<'_, Postgres>,
        reason: &str,
    ) -> Result<Completion, IdemError<Infallible>> {
        let marker = not_replayable_marker(reason);
        self.store
            .complete_on(tx, &self.lease, &marker, self.retention)
            .await
            .map_err(|f| match self.store.fail(f) {
                StoreError::LeaseLost => IdemError::LeaseLost,
                other => IdemError::Store(other),
            })?;
        Ok(Completion::NotReplayable {
            reason: not_replayable_reason(&marker).unwrap_or_default(),
        })
    }

    /// What a handler of this claim is told: its attempt, fence and token.
    pub fn context(&self) -> Context {
        Context::of(&self.lease)
    }

    /// Gives the key up inside `tx` (for when you want to commit other work
    /// but let the next delivery run the handler again).
    pub async fn release(self, tx: &mut Transaction<'_, Postgres>) -> Result<(), StoreError> {
        self.store
            .release_on(tx, &self.lease)
            .await
            .map_err(|f| self.store.fail(f))
    }
}

impl PgStore {
    /// Claims `key` on the transaction's connection, waiting at most
    /// `wait` (if given) for another transaction holding it: then
    /// `InProgress`. The connection's `lock_timeout` is given back after.
    async fn claim_on(
        &self,
        conn: &mut PgConnection,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        wait: Option<Duration>,
    ) -> Result<Acquisition, StoreError> {
        let before = match wait {
            None => None,
            Some(wait) => {
                let wait_ms = wait.as_millis().clamp(1, i32::MAX as u128).to_string();
                // The setting's own value first (the set_config refers to
                // it, so it runs after), to give it back after the claim.
                let before: String = sqlx::query_scalar(
                    "SELECT old FROM (SELECT current_setting('lock_timeout') AS old OFFSET 0) s, \
                     LATERAL (SELECT set_config('lock_timeout', $1, true) WHERE s.old IS NOT NULL) l",
                )
                .bind(&wait_ms)
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| self.error(e))?;
                Some(before)
            }
        };
        // No lease: until commit the record is visible to nobody else, and
        // if it is committed unfinished the next delivery may take it over.
        // A second claim of the key in this transaction gets this claim
        // again (the token names the transaction).
        let outcome = self
            .acquire_on(
                conn,
                key,
                fingerprint,
                Duration::ZERO,
                LeaseToken::random(),
                None,
            )
            .await;
        let outcome = match outcome {
            Ok(outcome) => outcome,
            // The wait for another transaction on the key ran out.
            Err(Failure::Sql(e))
                if before.is_some()
                    && e.as_database_error()
                        .and_then(|d| d.code())
                        .is_some_and(|c| c == "55P03") =>
            {
                return Ok(Acquisition::InProgress {
                    lease_expires_at: SystemTime::now(),
                    retry_after: Duration::from_secs(1),
                    attempt: 0,
                });
            }
            Err(f) => return Err(self.fail(f)),
        };
        if let Some(before) = before {
            sqlx::query("SELECT set_config('lock_timeout', $1, true)")
                .bind(&before)
                .execute(&mut *conn)
                .await
                .map_err(|e| self.error(e))?;
        }
        Ok(outcome)
    }
}

/// The receivers' in-transaction form on PostgreSQL: a transaction of the
/// store's pool per message, the claim as [`InTransaction`] makes it
/// (waiting at most the receiver's wait for another transaction on the
/// key), the result recorded in it.
#[async_trait]
impl TransactionalStore for PgStore {
    type Tx = Transaction<'static, Postgres>;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.pool().begin().await.map_err(|e| self.error(e))
    }

    async fn claim_in(
        &self,
        tx: &mut Self::Tx,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        wait: Duration,
    ) -> Result<Acquisition, StoreError> {
        self.claim_on(tx, key, fingerprint, Some(wait)).await
    }

    async fn complete_in(
        &self,
        tx: &mut Self::Tx,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.check_response_size(response)?;
        self.complete_on(tx, lease, response, retention)
            .await
            .map_err(|f| self.fail(f))
    }

    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError> {
        tx.commit().await.map_err(|e| self.error(e))
    }

    async fn rollback(&self, tx: Self::Tx) {
        if let Err(e) = tx.rollback().await {
            tracing::debug!(error = %e, "a rollback failed (the server rolls the transaction back)");
        }
    }
}
