//! [`IdempotencyService`]: what the layer wraps a service in, and the path
//! of one request through it: the key and body read, the store asked, the
//! handler run, its response recorded, or a replay or a problem answered.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use idem_core::{
    Codec, Fingerprint, FinishingKeys, IdemError, Idempotency, IdempotencyKey, IdempotencyStore,
    JsonCodec, Processed, Unrecorded,
};

use crate::fingerprint::fingerprint;
use crate::finishing::finish_later;
use crate::key::{key_id, key_path};
use crate::layer::{Config, KeySource};
use crate::recorded::{self, Buffered, Outcome, Prefixed, Recorded};
use crate::request::{
    display_header, header_key, malformed_key, parse_key_str, read_body, run_extractor, RawKey,
};
use crate::response::{
    box_response, full, is_event_stream, put, render, replay, BoxError, LayerBody,
};
use crate::tee;
use crate::DetachedTasks;
#[cfg(doc)]
use crate::IdempotencyLayer;
use crate::{Problem, ProblemKind};

/// The service of [`IdempotencyLayer`]: what `layer.layer(inner)` (or
/// axum's `Router::layer`) wraps `inner` in. It answers with
/// `Response<`[`LayerBody`]`>` and fails only where `inner` fails.
///
/// ```
/// use std::convert::Infallible;
///
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_http::{IdempotencyLayer, IdempotencyService};
/// use tower::{service_fn, Layer, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new())).allow_anonymous(true);
/// let service: IdempotencyService<MemoryStore, _> = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("done"))))
/// }));
/// // No key on a POST: the layer answers 400; the inner service never runs.
/// let response = service.oneshot(Request::post("/jobs").body(Full::new(Bytes::new()))?).await?;
/// assert_eq!(response.status(), 400);
/// # Ok(()) }
/// ```
pub struct IdempotencyService<S: ?Sized, Inner, C = JsonCodec> {
    pub(crate) config: Arc<Config<S, C>>,
    pub(crate) inner: Inner,
}

impl<S: ?Sized, Inner: Clone, C> Clone for IdempotencyService<S, Inner, C> {
    fn clone(&self) -> Self {
        IdempotencyService {
            config: self.config.clone(),
            inner: self.inner.clone(),
        }
    }
}

impl<S: ?Sized, Inner, C> fmt::Debug for IdempotencyService<S, Inner, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("scope", &self.config.scope)
            .finish_non_exhaustive()
    }
}

/// Why the handler's outcome is not recorded, and the key released.
enum NotRecorded<E> {
    /// A status the policy does not record; the response was passed on.
    Status(StatusCode),
    /// The inner service failed.
    Service(E),
}

impl<E> fmt::Display for NotRecorded<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotRecorded::Status(status) => write!(f, "a {status} response, not recorded"),
            NotRecorded::Service(_) => f.write_str("the inner service failed"),
        }
    }
}

impl<S, Inner, C, ReqBody, ResBody> tower::Service<Request<ReqBody>>
    for IdempotencyService<S, Inner, C>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
    Inner: tower::Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    Inner::Future: Send + 'static,
    Inner::Error: Send + 'static,
    ReqBody: http_body::Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<LayerBody>;
    type Error = Inner::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The clone that was made ready is the one that serves this call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        Box::pin(async move { handle(config, inner, request).await })
    }
}

async fn handle<S, C, Inner, ReqBody, ResBody>(
    config: Arc<Config<S, C>>,
    mut inner: Inner,
    request: Request<ReqBody>,
) -> Result<Response<LayerBody>, Inner::Error>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
    Inner: tower::Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    Inner::Future: Send + 'static,
    Inner::Error: Send + 'static,
    ReqBody: http_body::Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    if config.methods.as_ref().is_some_and(|listed| {
        !listed
            .iter()
            .any(|m| m.as_str().eq_ignore_ascii_case(request.method().as_str()))
    }) {
        return inner.call(request).await.map(box_response);
    }
    let (parts, body) = request.into_parts();
    // The client's key, read from the head before the body when it can be.
    let (raw, body) = match &config.key_source {
        KeySource::Header(name) => (header_key(&parts.headers, name), Pending::Unread(body)),
        KeySource::Head(key) => (run_extractor(|| key(&parts)), Pending::Unread(body)),
        KeySource::Body(key) => {
            let bytes = match read_body(&config, &parts, body).await {
                Ok(bytes) => bytes,
                Err(problem) => return Ok(render(&config, problem)),
            };
            (run_extractor(|| key(&parts, &bytes)), Pending::Read(bytes))
        }
    };
    if matches!(raw, RawKey::Missing) && !config.required {
        let body = match body {
            Pending::Unread(body) => body,
            Pending::Read(bytes) => ReqBody::from(bytes),
        };
        return inner
            .call(Request::from_parts(parts, body))
            .await
            .map(box_response);
    }
    // The user's tenant function, caught like the key extractors: a panic
    // is a clean 500, never a connection cut.
    let tenant = match config
        .tenant
        .as_ref()
        .map(|f| std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&parts))))
    {
        Some(Err(_)) => {
            tracing::error!("idempotency layer: the tenant function panicked");
            return Ok(render(
                &config,
                Problem::new(ProblemKind::Internal)
                    .with_detail("The request could not be processed. It did not run."),
            ));
        }
        Some(Ok(Some(tenant))) if !tenant.is_empty() => tenant,
        _ if config.allow_anonymous => String::new(),
        _ => return Ok(render(&config, Problem::new(ProblemKind::CallerUnknown))),
    };
    let client_key = match raw {
        RawKey::Value(value) => match parse_key_str(&value) {
            Some(key) => key.to_owned(),
            None => return Ok(render(&config, malformed_key(&config.key_source))),
        },
        RawKey::Malformed => return Ok(render(&config, malformed_key(&config.key_source))),
        RawKey::Missing => {
            let mut problem = Problem::new(ProblemKind::KeyMissing);
            if let KeySource::Header(name) = &config.key_source {
                problem = problem.with_detail(format!(
                    "This operation requires an idempotency key in the {} header.",
                    display_header(name)
                ));
            }
            return Ok(render(&config, problem));
        }
        RawKey::Panicked => {
            tracing::error!("idempotency layer: the key function panicked");
            return Ok(render(
                &config,
                Problem::new(ProblemKind::Internal)
                    .with_detail("The request could not be processed. It did not run."),
            ));
        }
    };
    let body = match body {
        Pending::Read(bytes) => bytes,
        Pending::Unread(unread) => match read_body(&config, &parts, unread).await {
            Ok(bytes) => bytes,
            Err(problem) => return Ok(render(&config, problem)),
        },
    };

    let id = key_id(
        &tenant,
        parts.method.as_str(),
        key_path(&parts, config.route_template),
        &client_key,
    );
    let key = match IdempotencyKey::new(config.scope.clone(), id) {
        Ok(key) => key,
        // Cannot happen: the scope was validated when the layer was built,
        // and key_id's result is at most 471 bytes without control
        // characters. Not the client's fault if it does.
        Err(e) => {
            tracing::error!(error = %e, "idempotency layer: the key id was refused");
            return Ok(render(
                &config,
                Problem::new(ProblemKind::Internal)
                    .with_detail("The request could not be processed. It did not run."),
            ));
        }
    };
    // An idem layer further out runs this very key: its run is this one
    // (nested layers computing the same key); pass the request through.
    if parts
        .extensions
        .get::<HeldByLayers>()
        .is_some_and(|held| held.0.contains(&key))
    {
        return inner
            .call(Request::from_parts(parts, ReqBody::from(body)))
            .await
            .map(box_response);
    }
    let fingerprint = fingerprint(&parts, &body, &config.fingerprint);
    // The request's headers, one copy shared by the handler (a response
    // that varies, `Vary`, is recorded against them) and the replay (which
    // must match them).
    let request_headers = Arc::new(parts.headers.clone());

    // The in-transaction form: claim, handler, record and commit in one
    // transaction (crate::in_tx).
    #[cfg(feature = "postgres")]
    if let Some(mode) = config.tx.as_ref() {
        return crate::in_tx::handle(
            &config,
            mode,
            inner,
            parts,
            body,
            key,
            fingerprint,
            request_headers,
        )
        .await;
    }

    let head = parts.method == http::Method::HEAD;
    let request = Request::from_parts(parts, ReqBody::from(body));
    // The response for this caller, put here by the handler (detached, it
    // runs in another task) and taken once processing ends.
    let live: Arc<Mutex<Option<Response<LayerBody>>>> = Arc::default();
    // Detached, a response whose body is still coming goes to its caller
    // at once (the head and each frame as it comes): the handler says so
    // here, and the run goes on to record it when the body ends.
    let (streaming, streams) = tokio::sync::oneshot::channel::<()>();
    let streaming = config.detached.then_some(streaming);
    let handler = {
        let live = live.clone();
        let record = config.record.clone();
        let skip = config.skip_headers.clone();
        let limit = config.max_response_bytes;
        let key = key.clone();
        let request_headers = request_headers.clone();
        move |context: idem_core::Context| async move {
            let mut request = request;
            request.extensions_mut().insert(context);
            let mut held = request
                .extensions_mut()
                .remove::<HeldByLayers>()
                .unwrap_or_default();
            held.0.push(key);
            request.extensions_mut().insert(held);
            let response = inner.call(request).await.map_err(NotRecorded::Service)?;
            // An answer an idem layer further in made itself (a 400, 409,
            // 422...): its handler did not run; never recorded here.
            if response.extensions().get::<LayerAnswer>().is_some() {
                let status = response.status();
                put(
                    &live,
                    response.map(|b| b.map_err(Into::into).boxed_unsync()),
                );
                return Err(NotRecorded::Status(status));
            }
            let (mut parts, body) = response.into_parts();
            let body = body.map_err(Into::into).boxed_unsync();
            // The handler says nothing happened (a proxy that could not
            // reach its upstream): released, whatever the status.
            if parts.extensions.get::<NothingHappened>().is_some() {
                let status = parts.status;
                put(&live, Response::from_parts(parts, body));
                return Err(NotRecorded::Status(status));
            }
            // The handler says its effects may have happened but its
            // answer is not theirs: completed "not replayable".
            if let Some(marker) = parts.extensions.get::<NotReplayable>() {
                let why = marker.reason().to_owned();
                put(&live, Response::from_parts(parts, body));
                return Ok(Outcome::NotRecordable(why));
            }
            // The handler ran: if the policy itself panics, record (the
            // safe side: a release could run the handler twice).
            let recorded =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| record(parts.status)))
                    .unwrap_or(true);
            if !recorded {
                let status = parts.status;
                put(&live, Response::from_parts(parts, body));
                return Err(NotRecorded::Status(status));
            }
            let vary = recorded::varies_on(&parts.headers);
            let (body, outcome) = if is_event_stream(&parts.headers) {
                let why = "a text/event-stream response is streamed, not recorded";
                (body, Outcome::NotRecordable(why.to_owned()))
            } else if vary.is_none() {
                let why = "a response with `Vary: *` varies on more than the request's headers";
                (body, Outcome::NotRecordable(why.to_owned()))
            } else {
                match recorded::buffer(body, limit, streaming.is_some()).await {
                    Buffered::Pending { read, size, rest } => {
                        let (status, headers) = (parts.status, parts.headers.clone());
                        let (forwarded, copying) = tee::tee(read, size, rest, limit);
                        put(&live, Response::from_parts(parts, forwarded.boxed_unsync()));
                        if let Some(streaming) = streaming {
                            let _ = streaming.send(());
                        }
                        let outcome = match copying.await {
                            Ok(bytes) => Outcome::Recorded(
                                Recorded::of(
                                    status,
                                    &headers,
                                    bytes,
                                    &skip,
                                    vary.as_deref().unwrap_or_default(),
                                    &request_headers,
                                )
                                .with_head_length_if(head, &headers),
                            ),
                            Err(why) => Outcome::NotRecordable(why),
                        };
                        return Ok(outcome);
                    }
                    Buffered::Complete(bytes) => {
                        let copy = Recorded::of(
                            parts.status,
                            &parts.headers,
                            bytes.clone(),
                            &skip,
                            vary.as_deref().unwrap_or_default(),
                            &request_headers,
                        )
                        .with_head_length_if(head, &parts.headers);
                        recorded::frame_by_body(&mut parts, head, bytes.len());
                        (full(bytes), Outcome::Recorded(copy))
                    }
                    Buffered::Streamed { read, rest, why } => (
                        Prefixed::new(read, None, Some(rest)).boxed_unsync(),
                        Outcome::NotRecordable(why),
                    ),
                    Buffered::Failed { read, error } => {
                        let why = format!("the response body failed: {error}");
                        (
                            Prefixed::new(read, Some(error), None).boxed_unsync(),
                            Outcome::NotRecordable(why),
                        )
                    }
                }
            };
            put(&live, Response::from_parts(parts, body));
            Ok::<_, NotRecorded<Inner::Error>>(outcome)
        }
    };
    // A key given up (the finisher puts it in the keys given up before it
    // lets the key go) is the executor's: it answers `ResultUnavailable`
    // (409 "not recorded") while the store holds the record.
    if config.finishing.holds(&key, &fingerprint) {
        let problem =
            Problem::new(ProblemKind::InProgress).with_retry_after(Duration::from_secs(1));
        return Ok(render(&config, problem));
    }
    let run = if config.detached {
        // The whole run, the start of the finisher included, is one task
        // that the request only awaits: a client that goes away does not
        // stop the recording of what its handler did.
        let (idem, finishing, run_key) =
            (config.idem.clone(), config.finishing.clone(), key.clone());
        let tasks = config.tasks.clone();
        let counted = tasks.start();
        let task = async move {
            let _counted = counted;
            let run = match idem
                .process_with(&run_key, Some(fingerprint), handler)
                .await
            {
                Err(IdemError::Unrecorded(unrecorded)) => {
                    let cause = unrecorded.cause().to_string();
                    finish_in_background(
                        &finishing,
                        &tasks,
                        &idem,
                        run_key,
                        fingerprint,
                        unrecorded,
                    );
                    Run::Finishing { cause }
                }
                outcome => Run::Done(outcome),
            };
            // The store answered this run: the completions waiting for it
            // go in now (here, since a streamed response's caller has its
            // answer before the run ends).
            if !run.store_away() {
                finishing.store_answered();
            }
            run
        };
        let mut task = tokio::spawn(task);
        let joined = tokio::select! {
            joined = &mut task => joined,
            Ok(()) = streams => {
                // The handler's response streams: its caller gets it now;
                // the run, detached, records it when its body ends.
                let live = live.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(live) = live {
                    let key = key.clone();
                    tokio::spawn(async move {
                        if let Ok(Run::Done(Err(e))) = task.await {
                            tracing::error!(key = %key, error = %e, "idempotency layer: the handler ran but its streamed response was not recorded");
                        }
                    });
                    return Ok(live);
                }
                task.await
            }
        };
        match joined {
            Ok(run) => run,
            // `process_with` catches the handler's panics; this is the
            // runtime shutting down under the task, or a panic in the store.
            Err(e) => Run::Done(Err(IdemError::Panicked {
                message: if e.is_panic() {
                    "the request's task panicked".to_owned()
                } else {
                    "the request's task was cancelled (the runtime is shutting down)".to_owned()
                },
            })),
        }
    } else {
        match config
            .idem
            .process_with(&key, Some(fingerprint), handler)
            .await
        {
            Err(IdemError::Unrecorded(unrecorded)) => {
                let cause = unrecorded.cause().to_string();
                finish_in_background(
                    &config.finishing,
                    &config.tasks,
                    &config.idem,
                    key.clone(),
                    fingerprint,
                    unrecorded,
                );
                Run::Finishing { cause }
            }
            outcome => Run::Done(outcome),
        }
    };

    // The store answered this request: the completions waiting for it go
    // in now (detached, the run's task did it).
    if !config.detached && !run.store_away() {
        config.finishing.store_answered();
    }

    // The handler ran in this call: its caller gets its response as it
    // is, whether it was recorded or not.
    let live = live.lock().unwrap_or_else(|p| p.into_inner()).take();
    let outcome = match run {
        Run::Done(outcome) => outcome,
        // The store was away until the lease ended: the response is
        // written later with the same lease (a retry meanwhile gets 409),
        // never by running the handler again.
        Run::Finishing { cause } => {
            tracing::warn!(key = %key, %cause, "idempotency layer: the handler ran while the store was away; its response is recorded once the store is back");
            return Ok(live.unwrap_or_else(|| {
                // Cannot happen: the handler puts its response before it
                // ends well.
                tracing::error!(key = %key, "idempotency layer: the handler ran but left no response");
                render(&config, Problem::new(ProblemKind::Internal))
            }));
        }
    };
    if let Some(live) = live {
        match &outcome {
            Ok(Processed::Executed(_)) | Err(IdemError::Handler(NotRecorded::Status(_))) => {}
            Ok(Processed::ExecutedNotReplayable { reason, .. }) => {
                tracing::debug!(key = %key, %reason, "idempotency layer: the response is not replayable");
            }
            Ok(Processed::Replayed(_)) | Err(_) => {
                // Its recording failed (the lease was taken over, the
                // store failed): the effects ran, so the caller gets the
                // response; a duplicate gets 409 until the lease ends.
                if let Err(e) = &outcome {
                    tracing::error!(key = %key, error = %e, "idempotency layer: the handler ran but its response was not recorded");
                }
            }
        }
        return Ok(live);
    }
    let problem = match outcome {
        // A response that varies on a header this request sends otherwise
        // (another `Accept-Encoding`...) is not this request's answer.
        Ok(Processed::Replayed(Outcome::Recorded(recorded)))
            if !recorded.matches(&request_headers) =>
        {
            Problem::new(ProblemKind::Mismatch).with_detail(
                "This request differs from the first one with this key in a header its response varies on (Vary).",
            )
        }
        Ok(Processed::Replayed(Outcome::Recorded(recorded))) => {
            return Ok(replay(&config, &key, recorded))
        }
        Err(IdemError::Handler(NotRecorded::Service(e))) => return Err(e),
        Ok(
            Processed::Executed(_)
            | Processed::ExecutedNotReplayable { .. }
            | Processed::Replayed(Outcome::NotRecordable(_)),
        ) => {
            // Cannot happen: the handler puts its response before it ends
            // well, and a not recordable outcome never decodes.
            tracing::error!(key = %key, "idempotency layer: the handler ran but left no response");
            Problem::new(ProblemKind::Internal)
        }
        Err(IdemError::ResultUnavailable { reason }) => {
            tracing::debug!(key = %key, %reason, "idempotency layer: a duplicate of a key whose response was not recorded");
            Problem::new(ProblemKind::NotRecorded)
        }
        Err(IdemError::WaitTimeout { .. }) => {
            Problem::new(ProblemKind::InProgress).with_retry_after(Duration::from_secs(1))
        }
        Err(IdemError::InProgress { retry_after, .. }) => Problem::new(ProblemKind::InProgress)
            .with_retry_after(retry_after.min(config.max_retry_after)),
        Err(IdemError::PayloadMismatch) => Problem::new(ProblemKind::Mismatch),
        Err(IdemError::Store(e)) if e.is_retryable() => {
            tracing::warn!(error = %e, key = %key, "idempotency layer: the store is unavailable");
            Problem::new(ProblemKind::StoreUnavailable).with_retry_after(Duration::from_secs(1))
        }
        Err(e) => {
            tracing::error!(error = %e, key = %key, "idempotency layer failed");
            Problem::new(ProblemKind::Internal)
        }
    };
    Ok(render(&config, problem))
}

/// The keys the idem layers a request went through are running it under
/// (a request extension): a nested layer that computes one of them passes
/// the request through.
#[derive(Clone, Debug, Default)]
pub(crate) struct HeldByLayers(pub(crate) Vec<IdempotencyKey>);

/// Put in a response's extensions by a handler whose effects may have
/// happened although its answer does not say what they were (a proxy whose
/// upstream timed out, or whose connection broke after the request was
/// sent). Whatever its status, the layer never records this answer and
/// never releases the key: the key is completed "not replayable", so no
/// retry runs the handler again, and duplicates get `409 Conflict` ("the
/// original response was not recorded"). The response still reaches the
/// caller whose request ran.
///
/// ```
/// use http::{Response, StatusCode};
/// use idem_http::NotReplayable;
///
/// let mut response = Response::new(String::from("the upstream did not answer in time"));
/// *response.status_mut() = StatusCode::GATEWAY_TIMEOUT;
/// response
///     .extensions_mut()
///     .insert(NotReplayable::new("the upstream timed out after the request was sent"));
/// # let _ = response;
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotReplayable(String);

impl NotReplayable {
    /// A marker saying why the answer is not the effects' own.
    pub fn new(reason: impl Into<String>) -> Self {
        NotReplayable(reason.into())
    }

    /// Why the answer is not recorded.
    pub fn reason(&self) -> &str {
        &self.0
    }
}

/// Put in a response's extensions by a handler that did nothing: no
/// effect happened (a proxy that could not connect to its upstream, so
/// the request was never sent). Whatever its status, the layer releases
/// the key and records nothing, so a retry runs the handler. Never put it
/// on an answer after effects may have started: that retry would run them
/// again.
///
/// ```
/// use http::{Response, StatusCode};
/// use idem_http::NothingHappened;
///
/// let mut response = Response::new(String::from("the upstream cannot be reached"));
/// *response.status_mut() = StatusCode::BAD_GATEWAY;
/// response.extensions_mut().insert(NothingHappened);
/// # let _ = response;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NothingHappened;

/// Marks a response an idem layer made itself (a problem: 400, 409,
/// 422...), so that a layer further out never records it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LayerAnswer;

/// How a run ended, seen from the request that made it.
enum Run<T, E> {
    /// Its outcome.
    Done(Result<Processed<T>, IdemError<E>>),
    /// The handler ran while the store was away past the lease
    /// (`IdemError::Unrecorded`): its response is being written later, its
    /// key held finishing.
    Finishing {
        /// The last store error of the completion.
        cause: String,
    },
}

impl<T, E> Run<T, E> {
    /// Whether the store was away for this run (it did not answer).
    fn store_away(&self) -> bool {
        match self {
            Run::Finishing { .. } => true,
            Run::Done(Err(IdemError::Store(e))) => e.is_retryable(),
            Run::Done(_) => false,
        }
    }
}

/// Holds `key` finishing (a retry with the same payload gets 409 without
/// asking the store) and writes the completion of `unrecorded` in a task
/// of its own, which lets the key go when it ends however it ends; one it
/// gave up recording is put in the keys given up first (its retries get
/// 409 "not recorded" for the retention).
fn finish_in_background<S: IdempotencyStore + ?Sized, C: Codec>(
    finishing: &Arc<FinishingKeys>,
    tasks: &DetachedTasks,
    idem: &Idempotency<S, C>,
    key: IdempotencyKey,
    fingerprint: Fingerprint,
    unrecorded: Box<Unrecorded>,
) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            let counted = tasks.start();
            let guard = finishing.hold(key.clone(), Some(fingerprint));
            let (idem, finishing) = (idem.clone(), finishing.clone());
            runtime.spawn(async move {
                let retention = idem.retention_period();
                if finish_later(idem, unrecorded, &finishing).await {
                    finishing
                        .given_up()
                        .insert(key, Some(fingerprint), retention);
                }
                drop(guard);
                drop(counted);
            });
        }
        Err(_) => {
            tracing::error!(key = %key, "idempotency layer: no tokio runtime to record the response later; after its lease a retry runs the handler again");
        }
    }
}

/// How far the request body is: not read yet, or buffered.
enum Pending<B> {
    Unread(B),
    Read(Bytes),
}
