//! The in-transaction form of the layer (feature `postgres`): the key is
//! claimed in a PostgreSQL transaction that the handler writes in
//! ([`RequestTx`]), the response is recorded in it, and it commits before
//! the response leaves. A crash anywhere before the commit rolls back the
//! handler's writes with the claim: the retry runs cleanly.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use idem_core::{Codec, Fingerprint, IdemError, IdempotencyKey, StoreError};
use idem_postgres::sqlx::{PgConnection, Postgres, Transaction};
use idem_postgres::{Claim, Completion, InTransaction, PgStore, TxLease};
use tokio::sync::{OwnedMappedMutexGuard, OwnedMutexGuard};

use crate::layer::Config;
use crate::recorded::{self, Buffered, Outcome, Prefixed, Recorded};
use crate::response::{box_response, full, is_event_stream, render, replay, BoxError, LayerBody};
use crate::service::{HeldByLayers, LayerAnswer};
use crate::{Problem, ProblemKind};

/// The default of [`IdempotencyLayer::transaction_wait`](crate::IdempotencyLayer::transaction_wait).
pub const DEFAULT_TRANSACTION_WAIT: Duration = Duration::from_secs(10);

/// The in-transaction settings of a layer.
pub(crate) struct TxMode<C> {
    pub(crate) in_tx: InTransaction<C>,
    pub(crate) store: PgStore,
    pub(crate) wait: Duration,
    pub(crate) gate: Arc<KeyGate>,
}

/// The request's PostgreSQL transaction, for a handler behind a layer in
/// its in-transaction form
/// ([`IdempotencyLayer::in_transaction`](crate::IdempotencyLayer::in_transaction)):
/// in the request's extensions (axum: `Extension<RequestTx>`). Do the
/// business writes on it; the layer records the response in the same
/// transaction and commits, or rolls everything back.
///
/// ```no_run
/// use axum::{Extension, Json};
/// use idem_core::Context;
/// use idem_http::RequestTx;
///
/// async fn pay(
///     Extension(tx): Extension<RequestTx>,
///     Extension(context): Extension<Context>,
///     Json(body): Json<serde_json::Value>,
/// ) -> Result<Json<serde_json::Value>, axum::http::StatusCode> {
///     let mut tx = tx.lock().await.map_err(|_| axum::http::StatusCode::INTERNAL_SERVER_ERROR)?;
///     let id: i64 = idem_postgres::sqlx::query_scalar("INSERT INTO payments (amount, fence) VALUES ($1, $2) RETURNING id")
///         .bind(body["amount"].as_i64().unwrap_or(0))
///         .bind(context.fence as i64)
///         .fetch_one(&mut *tx)
///         .await
///         .map_err(|_| axum::http::StatusCode::SERVICE_UNAVAILABLE)?;
///     Ok(Json(serde_json::json!({ "payment": id })))
/// }
/// ```
#[derive(Clone)]
pub struct RequestTx(Arc<tokio::sync::Mutex<Option<Transaction<'static, Postgres>>>>);

impl fmt::Debug for RequestTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestTx").finish_non_exhaustive()
    }
}

/// [`RequestTx::lock`] after the request's transaction ended: the handler
/// kept the `RequestTx` past its response (in a task of its own, say).
/// Not retryable: the transaction is committed or rolled back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the request's transaction has ended: write in it before the handler returns")]
pub struct TxEnded;

/// The request's transaction, locked for the handler's statements: it
/// derefs to the connection (`&mut *guard` is an sqlx executor), and
/// `guard.begin()` opens a savepoint. Do not run `COMMIT` or `ROLLBACK`
/// on it: the layer ends the transaction once the response is recorded.
pub struct TxGuard(
    OwnedMappedMutexGuard<Option<Transaction<'static, Postgres>>, Transaction<'static, Postgres>>,
);

impl fmt::Debug for TxGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TxGuard").finish_non_exhaustive()
    }
}

impl Deref for TxGuard {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.0
    }
}

impl DerefMut for TxGuard {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.0
    }
}

impl RequestTx {
    fn new(tx: Transaction<'static, Postgres>) -> Self {
        RequestTx(Arc::new(tokio::sync::Mutex::new(Some(tx))))
    }

    /// Locks the transaction until the guard is dropped (statements of one
    /// request run one at a time on its one connection).
    pub async fn lock(&self) -> Result<TxGuard, TxEnded> {
        let guard = self.0.clone().lock_owned().await;
        OwnedMutexGuard::try_map(guard, Option::as_mut)
            .map(TxGuard)
            .map_err(|_| TxEnded)
    }

    /// The transaction, taken back by the layer once the handler returned;
    /// `None` if a guard is still held after `wait`.
    async fn take(&self, wait: Duration) -> Option<Transaction<'static, Postgres>> {
        let mut guard = tokio::time::timeout(wait, self.0.lock()).await.ok()?;
        guard.take()
    }
}

/// The keys this process is claiming in a transaction: a duplicate in the
/// same process waits here, holding no connection, instead of in the
/// database on a connection of the pool (64 duplicates of one key on a
/// pool of 8 would hold every connection waiting).
#[derive(Default)]
pub(crate) struct KeyGate {
    /// Each key's lock and how many requests hold or wait for it.
    keys: Mutex<HashMap<IdempotencyKey, (KeyLock, usize)>>,
}

/// The lock of one key at the gate.
type KeyLock = Arc<tokio::sync::Mutex<()>>;

/// A request at [`KeyGate`] for a key (holding it once `guard` is set);
/// counted out when dropped, however the wait ended.
struct Gated {
    gate: Arc<KeyGate>,
    key: IdempotencyKey,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl KeyGate {
    /// Waits until no other request of this process holds `key`, for at
    /// most `wait`.
    async fn enter(self: &Arc<Self>, key: &IdempotencyKey, wait: Duration) -> Option<Gated> {
        let lock = {
            let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
            let (lock, users) = keys.entry(key.clone()).or_default();
            *users += 1;
            lock.clone()
        };
        // Counted in from here: dropped on a timeout or a cancellation, it
        // counts itself out.
        let mut gated = Gated {
            gate: self.clone(),
            key: key.clone(),
            guard: None,
        };
        gated.guard = Some(tokio::time::timeout(wait, lock.lock_owned()).await.ok()?);
        Some(gated)
    }

    /// The keys held or waited for (for tests: none once requests end).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.keys.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Drop for Gated {
    fn drop(&mut self) {
        self.guard.take();
        let mut keys = self.gate.keys.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, users)) = keys.get_mut(&self.key) {
            *users -= 1;
            if *users == 0 {
                keys.remove(&self.key);
            }
        }
    }
}

/// What became of the handler's response.
enum Ran {
    /// Not recorded (a status the policy releases, an answer of a layer
    /// further in): roll back, pass it on.
    Released(Response<LayerBody>),
    /// Recorded (or marked not replayable): commit, then send it.
    Record(Response<LayerBody>, Outcome),
}

/// The request of an in-transaction layer, from the claim to the commit.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn handle<S, C, Inner, ReqBody, ResBody>(
    config: &Config<S, C>,
    mode: &TxMode<C>,
    mut inner: Inner,
    mut parts: http::request::Parts,
    body: Bytes,
    key: IdempotencyKey,
    fingerprint: Fingerprint,
    request_headers: Arc<http::HeaderMap>,
) -> Result<Response<LayerBody>, Inner::Error>
where
    S: ?Sized,
    C: Codec,
    Inner: tower::Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    Inner::Future: Send + 'static,
    Inner::Error: Send + 'static,
    ReqBody: http_body::Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let in_progress = || {
        render(
            config,
            Problem::new(ProblemKind::InProgress).with_retry_after(Duration::from_secs(1)),
        )
    };
    // A duplicate of this process waits for the first here, without a
    // connection; then its claim replays.
    let Some(_gated) = mode.gate.enter(&key, mode.wait).await else {
        return Ok(in_progress());
    };
    let mut tx = match mode.store.pool().begin().await {
        Ok(tx) => tx,
        Err(e) => return Ok(unavailable(config, &key, &e)),
    };
    // A claim waits for another process's open transaction on the key for
    // at most `wait` (then 409); the handler's own statements get the
    // server's setting back.
    let wait_ms = mode.wait.as_millis().clamp(1, i32::MAX as u128).to_string();
    // The session's own value first (the set_config refers to it, so it
    // runs after), to give it back after the claim.
    let before: Result<String, _> = idem_postgres::sqlx::query_scalar(
        "SELECT old FROM (SELECT current_setting('lock_timeout') AS old OFFSET 0) s, \
         LATERAL (SELECT set_config('lock_timeout', $1, true) WHERE s.old IS NOT NULL) l",
    )
    .bind(&wait_ms)
    .fetch_one(&mut *tx)
    .await;
    let before = match before {
        Ok(before) => before,
        Err(e) => return Ok(unavailable(config, &key, &e)),
    };
    let claim = mode
        .in_tx
        .claim_with::<Outcome>(&mut tx, &key, Some(fingerprint))
        .await;
    let lease: TxLease<C> = match claim {
        Ok(Claim::Acquired(lease)) => lease,
        Ok(Claim::Replayed(Outcome::Recorded(recorded))) => {
            if !recorded.matches(&request_headers) {
                return Ok(render(config, Problem::new(ProblemKind::Mismatch).with_detail(
                    "This request differs from the first one with this key in a header its response varies on (Vary).",
                )));
            }
            return Ok(replay(config, &key, recorded));
        }
        Ok(Claim::Replayed(Outcome::NotRecordable(_)))
        | Err(IdemError::ResultUnavailable { .. }) => {
            return Ok(render(config, Problem::new(ProblemKind::NotRecorded)))
        }
        Err(IdemError::InProgress { retry_after, .. }) => {
            return Ok(render(
                config,
                Problem::new(ProblemKind::InProgress).with_retry_after(retry_after),
            ))
        }
        Err(IdemError::PayloadMismatch) => {
            return Ok(render(config, Problem::new(ProblemKind::Mismatch)))
        }
        // The wait for another transaction on the key ran out.
        Err(IdemError::Store(e)) if lock_wait_ran_out(&e) => return Ok(in_progress()),
        Err(e) => return Ok(failed(config, &key, e)),
    };
    if let Err(e) = idem_postgres::sqlx::query("SELECT set_config('lock_timeout', $1, true)")
        .bind(&before)
        .execute(&mut *tx)
        .await
    {
        return Ok(unavailable(config, &key, &e));
    }

    // The handler: the transaction and the context in its extensions.
    let shared = RequestTx::new(tx);
    parts.extensions.insert(lease.context());
    parts.extensions.insert(shared.clone());
    let mut held = parts
        .extensions
        .remove::<HeldByLayers>()
        .unwrap_or_default();
    held.0.push(key.clone());
    parts.extensions.insert(held);
    let request = Request::from_parts(parts, ReqBody::from(body));
    // A panic of the handler is caught here (its transaction rolls back
    // with it), a clean 500 rather than a connection cut.
    let called = caught(inner.call(request)).await;
    let response = match called {
        Ok(Ok(response)) => response,
        // The transaction is dropped with `shared`: rolled back.
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            tracing::error!(key = %key, "idempotency layer: the handler panicked; its transaction is rolled back");
            return Ok(render(
                config,
                Problem::new(ProblemKind::Internal).with_detail(
                    "The request failed. Nothing it did was kept: it can be sent again.",
                ),
            ));
        }
    };
    // The body is read here: a body that panics is the handler's panic.
    let Ok(ran) = caught(settle(config, response, &request_headers)).await else {
        tracing::error!(key = %key, "idempotency layer: the response body panicked; its transaction is rolled back");
        return Ok(render(
            config,
            Problem::new(ProblemKind::Internal)
                .with_detail("The request failed. Nothing it did was kept: it can be sent again."),
        ));
    };
    let Some(mut tx) = shared.take(mode.wait).await else {
        tracing::error!(key = %key, "idempotency layer: the handler still holds its transaction after it returned; rolled back");
        return Ok(render(config, Problem::new(ProblemKind::Internal)));
    };
    let (response, outcome) = match ran {
        Ran::Released(response) => {
            // Rolled back: the claim and the handler's writes.
            if let Err(e) = tx.rollback().await {
                tracing::warn!(key = %key, error = %e, "idempotency layer: the rollback of a released request failed (the server rolls it back)");
            }
            return Ok(response);
        }
        Ran::Record(response, outcome) => (response, outcome),
    };
    let recorded = match outcome {
        Outcome::Recorded(recorded) => lease.complete(&mut tx, &recorded).await,
        Outcome::NotRecordable(why) => lease.complete_not_replayable(&mut tx, &why).await,
    };
    match recorded {
        Ok(Completion::Recorded) => {}
        Ok(Completion::NotReplayable { reason }) => {
            tracing::debug!(key = %key, %reason, "idempotency layer: the response is not replayable");
        }
        // A statement of the handler failed and it answered anyway (a
        // unique violation it maps to 409, say): the transaction was
        // aborted, so nothing of it can be kept. Its answer is passed on,
        // unrecorded, as for a released status: a retry runs again.
        Err(IdemError::Store(e)) if sqlstate(&e).as_deref() == Some("25P02") => {
            tracing::debug!(key = %key, "idempotency layer: the handler answered from an aborted transaction; nothing kept, its response passed on");
            drop(tx);
            return Ok(response);
        }
        // The claim is gone: the handler ended the transaction itself
        // (ROLLBACK), and what it wrote after that was committed on its
        // own. It ran: the key is completed "not replayable" in a new
        // transaction, so that a retry never runs it again.
        Err(IdemError::LeaseLost) => {
            drop(tx);
            tracing::error!(key = %key, "idempotency layer: the handler ended the request's transaction itself; what it wrote after that is not covered; the key is marked not replayable");
            return Ok(mark_ran(config, mode, &key, fingerprint, response).await);
        }
        // Nothing is kept: the handler's writes go with the claim.
        Err(e) => return Ok(failed(config, &key, e)),
    }
    match tx.commit().await {
        Ok(()) => Ok(response),
        Err(e) => {
            // The response is not sent: its writes may not be kept. A commit
            // whose reply was lost may have been kept: then the retry gets
            // the replay, else it runs cleanly.
            tracing::warn!(key = %key, error = %e, "idempotency layer: the commit failed");
            // A refusal of the data (a deferred constraint) fails again on
            // a retry: 500; a lost connection or a serialization failure
            // may not: 503.
            let refused = matches!(&e, idem_postgres::sqlx::Error::Database(db)
                if db.code().is_some_and(|c| !c.starts_with("40") && !c.starts_with("08") && !c.starts_with("57")));
            let problem = if refused {
                Problem::new(ProblemKind::Internal).with_detail(
                    "The request's transaction did not commit. Nothing it did was kept.",
                )
            } else {
                Problem::new(ProblemKind::StoreUnavailable)
                    .with_retry_after(Duration::from_secs(1))
                    .with_detail("The request's transaction did not commit: send it again.")
            };
            Ok(render(config, problem))
        }
    }
}

/// Polls `future`, catching a panic of its poll (as the plain form's
/// `process_with` catches the handler's).
async fn caught<F: Future>(future: F) -> Result<F::Output, Box<dyn std::any::Any + Send>> {
    let mut future = Box::pin(future);
    std::future::poll_fn(|cx| {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(std::task::Poll::Ready(done)) => std::task::Poll::Ready(Ok(done)),
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Err(panic) => std::task::Poll::Ready(Err(panic)),
        }
    })
    .await
}

/// After a handler ended the request's transaction itself: claims the key
/// again in a new transaction and completes it "not replayable", then
/// passes the handler's response on (503 if that fails: the retry may
/// then run again, as the log says).
async fn mark_ran<S: ?Sized, C: Codec>(
    config: &Config<S, C>,
    mode: &TxMode<C>,
    key: &IdempotencyKey,
    fingerprint: Fingerprint,
    response: Response<LayerBody>,
) -> Response<LayerBody> {
    let why = "the handler ended the request's transaction itself";
    let marked: Result<(), String> = async {
        let mut tx = mode.store.pool().begin().await.map_err(|e| e.to_string())?;
        match mode
            .in_tx
            .claim_with::<Outcome>(&mut tx, key, Some(fingerprint))
            .await
        {
            Ok(Claim::Acquired(lease)) => {
                lease
                    .complete_not_replayable(&mut tx, why)
                    .await
                    .map_err(|e| e.to_string())?;
                tx.commit().await.map_err(|e| e.to_string())
            }
            // It committed its claim before it ended (COMMIT) and the
            // completion went in with it, or another request has it now.
            Ok(Claim::Replayed(_)) | Err(IdemError::ResultUnavailable { .. }) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    }
    .await;
    match marked {
        Ok(()) => response,
        Err(e) => {
            tracing::error!(key = %key, error = %e, "idempotency layer: the key could not be marked not replayable; a retry may run the handler again");
            render(
                config,
                Problem::new(ProblemKind::StoreUnavailable)
                    .with_retry_after(Duration::from_secs(1)),
            )
        }
    }
}

/// The SQLSTATE of the database error under a store error, if any.
fn sqlstate(e: &StoreError) -> Option<String> {
    let (StoreError::Unavailable(source) | StoreError::Backend(source)) = e else {
        return None;
    };
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
    while let Some(error) = cause {
        if let Some(idem_postgres::sqlx::Error::Database(db)) =
            error.downcast_ref::<idem_postgres::sqlx::Error>()
        {
            return db.code().map(|c| c.into_owned());
        }
        cause = error.source();
    }
    None
}

/// Whether `e` is a lock wait that ran out (SQLSTATE 55P03, the claim's
/// `lock_timeout`): another transaction holds the key.
fn lock_wait_ran_out(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable(_)) && sqlstate(e).as_deref() == Some("55P03")
}

/// Whether the response is recorded, and what is recorded: its body read
/// (all of it, up to the limit) before anything commits.
async fn settle<S: ?Sized, C, ResBody>(
    config: &Config<S, C>,
    response: Response<ResBody>,
    request_headers: &http::HeaderMap,
) -> Ran
where
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    if response.extensions().get::<LayerAnswer>().is_some() {
        return Ran::Released(box_response(response));
    }
    let (parts, body) = response.into_parts();
    let body: LayerBody = body.map_err(Into::into).boxed_unsync();
    let record = config.record.clone();
    // A panicking policy records: the safe side.
    let recorded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| record(parts.status)))
        .unwrap_or(true);
    if !recorded {
        return Ran::Released(Response::from_parts(parts, body));
    }
    let vary = recorded::varies_on(&parts.headers);
    if is_event_stream(&parts.headers) {
        let why = "a text/event-stream response is streamed, not recorded".to_owned();
        return Ran::Record(
            Response::from_parts(parts, body),
            Outcome::NotRecordable(why),
        );
    }
    let Some(vary) = vary else {
        let why = "a response with `Vary: *` varies on more than the request's headers".to_owned();
        return Ran::Record(
            Response::from_parts(parts, body),
            Outcome::NotRecordable(why),
        );
    };
    match recorded::buffer(body, config.max_response_bytes, false).await {
        Buffered::Complete(bytes) => {
            let copy = Recorded::of(
                parts.status,
                &parts.headers,
                bytes.clone(),
                &config.skip_headers,
                &vary,
                request_headers,
            );
            Ran::Record(
                Response::from_parts(parts, full(bytes)),
                Outcome::Recorded(copy),
            )
        }
        Buffered::Streamed { read, rest, why } => Ran::Record(
            Response::from_parts(parts, Prefixed::new(read, None, Some(rest)).boxed_unsync()),
            Outcome::NotRecordable(why),
        ),
        // The body failed: its caller gets what came and the error; the
        // writes are kept, the response marked not replayable.
        Buffered::Failed { read, error } => {
            let why = format!("the response body failed: {error}");
            Ran::Record(
                Response::from_parts(parts, Prefixed::new(read, Some(error), None).boxed_unsync()),
                Outcome::NotRecordable(why),
            )
        }
        Buffered::Pending { .. } => {
            // Not asked for (`stream` false): a body read to its end.
            let why = "the response body could not be read to its end".to_owned();
            Ran::Record(
                Response::from_parts(parts, full(Bytes::new())),
                Outcome::NotRecordable(why),
            )
        }
    }
}

/// 503: the database could not be reached; nothing ran.
fn unavailable<S: ?Sized, C>(
    config: &Config<S, C>,
    key: &IdempotencyKey,
    error: &dyn std::error::Error,
) -> Response<LayerBody> {
    tracing::warn!(key = %key, %error, "idempotency layer: the database is unavailable");
    render(
        config,
        Problem::new(ProblemKind::StoreUnavailable).with_retry_after(Duration::from_secs(1)),
    )
}

/// The answer to a claim or completion that failed: 503 when a retry can
/// help, else 500; nothing was kept.
fn failed<S: ?Sized, C>(
    config: &Config<S, C>,
    key: &IdempotencyKey,
    error: IdemError<Infallible>,
) -> Response<LayerBody> {
    match error {
        IdemError::Store(e) if e.is_retryable() => unavailable(config, key, &e),
        e => {
            tracing::error!(key = %key, error = %e, "idempotency layer (in a transaction) failed");
            render(config, Problem::new(ProblemKind::Internal))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> IdempotencyKey {
        IdempotencyKey::new("http", id).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Waiters that time out or are cancelled while another request holds
    /// the key count themselves out: the gate keeps no key once every
    /// request ended.
    #[tokio::test]
    async fn the_gate_forgets_a_key_once_its_waiters_timed_out_or_went_away() {
        let gate = Arc::new(KeyGate::default());
        let held = gate.enter(&key("k"), Duration::from_secs(1)).await;
        assert!(held.is_some());
        let timed_out = gate.enter(&key("k"), Duration::from_millis(10)).await;
        assert!(timed_out.is_none(), "the key is held");
        let cancelled = tokio::time::timeout(
            Duration::from_millis(10),
            gate.enter(&key("k"), Duration::from_secs(60)),
        )
        .await;
        assert!(cancelled.is_err(), "still waiting when cancelled");
        assert_eq!(gate.len(), 1);
        let waiting = {
            let gate = gate.clone();
            tokio::spawn(async move {
                gate.enter(&key("k"), Duration::from_secs(60))
                    .await
                    .is_some()
            })
        };
        while gate.keys.lock().unwrap_or_else(|p| p.into_inner())[&key("k")].1 < 2 {
            tokio::task::yield_now().await;
        }
        drop(held);
        assert!(
            waiting.await.unwrap_or_else(|e| panic!("{e}")),
            "the waiter got the key"
        );
        assert_eq!(gate.len(), 0, "no key left");
    }
}
