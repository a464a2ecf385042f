//! The in-transaction form of the layer (feature `postgres`): the key is
//! claimed in a PostgreSQL transaction that the handler writes in
//! ([`RequestTx`]), the response is recorded in it, and it commits before
//! the response leaves. A crash anywhere before the commit rolls back the
//! handler's writes with the claim: the retry runs cleanly.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use idem_core::{Codec, Fingerprint, IdemError, IdempotencyKey, KeyGate, SharedTx, StoreError};
use idem_postgres::{Claim, Completion, InTransaction, PgStore, TxLease};

use crate::layer::Config;
use crate::recorded::{self, Buffered, Outcome, Prefixed, Recorded};
use crate::response::{box_response, full, is_event_stream, render, replay, BoxError, LayerBody};
use crate::service::{HeldByLayers, LayerAnswer};
use crate::{Problem, ProblemKind};

pub use idem_core::DEFAULT_TRANSACTION_WAIT;

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
/// `tx.lock().await` gives a [`TxGuard`](idem_core::TxGuard) (`&mut *guard` is an sqlx
/// executor; do not run `COMMIT` or `ROLLBACK` on it), or
/// [`TxEnded`](idem_core::TxEnded) once the request's transaction ended.
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
pub type RequestTx = idem_postgres::PgTx;

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
    let head = parts.method == http::Method::HEAD;
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
                Problem::new(ProblemKind::InProgress)
                    .with_retry_after(retry_after.min(config.max_retry_after)),
            ))
        }
        Err(IdemError::PayloadMismatch) => {
            return Ok(render(config, Problem::new(ProblemKind::Mismatch)))
        }
        Err(e) => return Ok(failed(config, &key, e)),
    };
    // The handler: the transaction and the context in its extensions.
    let shared: RequestTx = SharedTx::new(tx);
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
    let Ok(ran) = caught(settle(config, response, &request_headers, head)).await else {
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

/// Whether the response is recorded, and what is recorded: its body read
/// (all of it, up to the limit) before anything commits.
async fn settle<S: ?Sized, C, ResBody>(
    config: &Config<S, C>,
    response: Response<ResBody>,
    request_headers: &http::HeaderMap,
    head: bool,
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
    if parts.extensions.get::<crate::NothingHappened>().is_some() {
        return Ran::Released(Response::from_parts(parts, body));
    }
    if let Some(marker) = parts.extensions.get::<crate::NotReplayable>() {
        let why = marker.reason().to_owned();
        return Ran::Record(
            Response::from_parts(parts, body),
            Outcome::NotRecordable(why),
        );
    }
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
            )
            .with_head_length_if(head, &parts.headers);
            let mut parts = parts;
            recorded::frame_by_body(&mut parts, head, bytes.len());
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
