//! An `Idempotency-Key` layer for [tower] and axum, on any idem store.
//!
//! It follows the IETF draft "The Idempotency-Key HTTP Header Field": a
//! client sends a unique key with a request that is not idempotent (a
//! `POST`); the first request with a key runs, its response is recorded,
//! and a retry with the same key gets the recorded response back, marked
//! `Idempotent-Replayed: true`, instead of running again.
//!
//! ```no_run
//! use axum::{routing::post, Json, Router};
//! use idem_core::{Idempotency, MemoryStore};
//! use idem_http::IdempotencyLayer;
//!
//! async fn create_payment(Json(body): Json<serde_json::Value>) -> Json<serde_json::Value> {
//!     Json(serde_json::json!({ "charged": body["amount"] }))
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
//!     // two clients never share keys: scope them by who is calling
//!     .tenant(|req| {
//!         req.headers
//!             .get("x-api-key")
//!             .and_then(|v| v.to_str().ok())
//!             .map(str::to_owned)
//!     });
//! let app: Router = Router::new()
//!     .route("/payments", post(create_payment))
//!     .layer(layer);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! ```
//!
//! | request | response |
//! |---|---|
//! | first with a key | the handler runs (detached, see below); its caller gets the handler's response unchanged, and a copy is recorded if its status is recorded |
//! | same key, same request, completed | the recorded status, headers and body, with `Idempotent-Replayed: true` |
//! | same key while the first still runs | `409 Conflict` with `Retry-After` (or, with `InProgressPolicy::Wait` on the executor, the replay once it completes) |
//! | same key, completed, but its response was not recorded (streamed, over `max_response_bytes`, refused by the store) | `409 Conflict`, no `Retry-After`, title "The original response was not recorded": it ran and will not run again for this key |
//! | same key, different body (or method, path, media type) | `422 Unprocessable Content` |
//! | a caller the tenant function does not know (it returns `None` or `""`, or there is no tenant function) | `401 Unauthorized`, before anything runs; unless `.allow_anonymous(true)`: then all anonymous callers share one key space |
//! | no key where one is required | `400 Bad Request` |
//! | a malformed key, or the key header sent twice | `400 Bad Request` |
//! | a body over `max_body_bytes` (default 1 MiB) | `413 Content Too Large`, before anything is stored |
//! | the store unreachable | `503 Service Unavailable` with `Retry-After`; nothing ran |
//! | the layer fails otherwise | `500 Internal Server Error`, a generic detail (the error is logged with `tracing`, never sent) |
//! | the handler answers 401, 408, 425, 429, 502, 503 or 504 | passed through; the key is released, a retry runs again |
//! | the handler answers anything else, 500 included | recorded and replayed: the handler may have done part of its work (`.record_status(...)` changes the policy) |
//!
//! The layer's own errors are `application/problem+json` (RFC 9457), or
//! what [`IdempotencyLayer::problem_response`] renders from a [`Problem`]
//! (its [`ProblemKind`], status, title and detail).
//!
//! **Hooks**:
//!
//! | method | what it does |
//! |---|---|
//! | [`header_name`](IdempotencyLayer::header_name) | the header that carries the key (default `Idempotency-Key`); hop-by-hop, browser-forbidden and credential headers are refused |
//! | [`key_from`](IdempotencyLayer::key_from), [`key_from_body`](IdempotencyLayer::key_from_body) | the key from a function of the request head, or of the head and the buffered body; checked and scoped like the header's |
//! | [`route_template`](IdempotencyLayer::route_template) | key by axum's `MatchedPath` instead of the concrete path; another path with the same key gets `422` |
//! | [`on_replay`](IdempotencyLayer::on_replay) | edit or log every replayed response (never the executed one) |
//! | [`problem_response`](IdempotencyLayer::problem_response) | render the layer's own errors |
//!
//! **The caller whose request ran** gets the handler's response as it is,
//! every header included (`Set-Cookie`, repeated headers, non-ASCII
//! values). **The recorded copy**, replayed to duplicates, leaves out the
//! hop-by-hop headers (`Connection` and the headers it names,
//! `Keep-Alive`, `Transfer-Encoding`, `TE`, `Trailer`, `Upgrade`,
//! `Proxy-Authenticate`, `Proxy-Connection`) and the per-caller ones
//! (`Set-Cookie`, `Date`), and `Content-Length`, which is set again; header
//! values are kept as bytes. The body is recorded through the executor's
//! codec: with JSON, a UTF-8 body as a JSON string (escaped, not inflated
//! by base64), any other body as base64; with a binary codec, as bytes.
//!
//! **Detached** (`.detached(true)`, the default): the acquisition, the
//! handler and the recording run in a spawned task that the request only
//! awaits ([`Idempotency::process_with_detached`]). A client that
//! disconnects or times out does not cut the handler off: it runs to its
//! end and its response is recorded, and the client's retry gets `409`
//! while it runs, then the replay. The handler finds the acquisition's
//! [`idem_core::Context`] (attempt, fence) in the request's extensions
//! (axum: `Extension<idem_core::Context>`), to pass the fence to systems
//! that can refuse a stale writer.
//!
//! **Large and streaming responses** (`.max_response_bytes(n)`, default
//! 1 MiB): the body is read up to the limit and recorded if it ends within
//! it. A longer body, and every `text/event-stream` (which is never read
//! ahead), reaches its caller in full, streamed, and its key is completed
//! at once as "not replayable": the handler never runs again for it, and
//! duplicates get the `409` above.
//!
//! **Tenants**: set [`IdempotencyLayer::tenant`] to who is calling (an API
//! key, the subject of a verified token). A request whose tenant is not
//! known is refused with `401`; [`IdempotencyLayer::allow_anonymous`] lets
//! such requests in, all in one shared key space.
//!
//! **Keys and fingerprints**: the key of a request is (tenant, method,
//! path or route template, client key) under the layer's scope
//! ([`request_key`] computes it), so two tenants, or two
//! routes, never collide and never read each other's responses; a tenant
//! or path longer than 64 bytes is hashed (SHA-256) into the key, so a
//! valid header value is never refused for the length of the path. The
//! scope is checked when the layer is built ([`IdempotencyLayer::scope`]
//! returns a `Result`). The fingerprint covers the method, the path with
//! its query, the media type and the body: the canonical JSON of a JSON
//! body (`application/json`, `+json`), so that field order and whitespace
//! never make a mismatch, with numbers kept as written (two bodies that
//! differ in a digit never match, however large the number); the bytes of
//! any other body, or of a body that is not valid JSON.
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod json;
mod problem;
mod recorded;

/// The axum this crate reads `OriginalUri` from (feature `axum`).
#[cfg(feature = "axum")]
pub use axum;
/// The `http` crate whose types this layer takes and returns
/// (`idem::http::http`).
pub use http;
/// The `tower` crate whose `Layer` and `Service` this crate implements
/// (`idem::http::tower`).
pub use tower;

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use idem_core::{
    Codec, Fingerprint, IdemError, Idempotency, IdempotencyKey, IdempotencyStore, JsonCodec,
    KeyError, Processed,
};
pub use problem::{Problem, ProblemKind};
use recorded::{Buffered, Outcome, Prefixed, Recorded};

/// The request header that carries the key (unless
/// [`IdempotencyLayer::header_name`] names another).
///
/// ```
/// use axum::{body::Body, routing::post, Router};
/// use http::Request;
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_http::{IdempotencyLayer, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
/// use tower::ServiceExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new())).allow_anonymous(true);
/// let app = Router::new().route("/pay", post(|| async { "paid" })).layer(layer);
/// let pay = || Request::post("/pay").header(IDEMPOTENCY_KEY, "k-1").body(Body::empty());
/// let first = app.clone().oneshot(pay()?).await?;
/// assert!(first.headers().get(IDEMPOTENT_REPLAYED).is_none());
/// let again = app.oneshot(pay()?).await?;
/// assert_eq!(again.headers()[IDEMPOTENT_REPLAYED], "true");
/// # Ok(()) }
/// ```
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The response header set on a replayed response (`true`); see
/// [`IDEMPOTENCY_KEY`] for an example.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The body of the layer's responses: the handler's own body, passed
/// through, or a recorded or problem body. Read it as any
/// [`http_body::Body`]:
///
/// ```
/// use http_body_util::BodyExt;
/// use idem_http::{Problem, ProblemKind};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_http::BoxError> {
/// let body = Problem::new(ProblemKind::Mismatch).to_response().into_body();
/// let bytes = body.collect().await?.to_bytes();
/// assert!(bytes.starts_with(b"{"));
/// # Ok(()) }
/// ```
pub type LayerBody = UnsyncBoxBody<Bytes, BoxError>;
/// A boxed error: the error of a [`LayerBody`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

type TenantFn = dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync;
type StatusFn = dyn Fn(StatusCode) -> bool + Send + Sync;
type HeadKeyFn = dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync;
type BodyKeyFn = dyn Fn(&http::request::Parts, &[u8]) -> Option<String> + Send + Sync;
type ReplayFn = dyn Fn(&mut Response<Bytes>, &IdempotencyKey) + Send + Sync;
type RenderFn = dyn Fn(&Problem) -> Response<LayerBody> + Send + Sync;

/// Where the client's key is read from.
#[derive(Clone)]
enum KeySource {
    /// A header (default `Idempotency-Key`).
    Header(HeaderName),
    /// A function of the request head.
    Head(Arc<HeadKeyFn>),
    /// A function of the request head and its buffered body.
    Body(Arc<BodyKeyFn>),
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Header(name) => write!(f, "Header({name})"),
            KeySource::Head(_) => f.write_str("Head(..)"),
            KeySource::Body(_) => f.write_str("Body(..)"),
        }
    }
}

/// The response headers that are passed to the caller whose request ran
/// but left out of the recorded copy: hop-by-hop headers (and any that
/// `Connection` names) and per-caller ones (`Set-Cookie`, `Date`), plus
/// the framing (`Content-Length`, set again for the replayed body).
fn not_recorded_headers() -> Arc<[HeaderName]> {
    Arc::from([
        http::header::CONNECTION,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
        http::header::PROXY_AUTHENTICATE,
        http::header::TE,
        http::header::TRAILER,
        http::header::TRANSFER_ENCODING,
        http::header::UPGRADE,
        CONTENT_LENGTH,
        http::header::DATE,
        http::header::SET_COOKIE,
    ])
}

/// The longest key accepted, in bytes (quotes not counted); a longer one
/// gets `400`.
///
/// ```
/// use axum::{body::Body, routing::post, Router};
/// use http::Request;
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_http::IdempotencyLayer;
/// use tower::ServiceExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new())).allow_anonymous(true);
/// let app = Router::new().route("/pay", post(|| async { "paid" })).layer(layer);
/// let pay = |key: String| Request::post("/pay").header("idempotency-key", key).body(Body::empty());
/// let longest = "k".repeat(idem_http::MAX_KEY_LEN);
/// assert_eq!(app.clone().oneshot(pay(longest.clone())?).await?.status(), 200);
/// assert_eq!(app.oneshot(pay(longest + "k")?).await?.status(), 400);
/// # Ok(()) }
/// ```
pub const MAX_KEY_LEN: usize = 255;

/// A [`tower::Layer`] that makes the requests it wraps idempotent by their
/// `Idempotency-Key` header. See the [crate docs](crate) for axum; on a
/// plain tower service:
///
/// ```
/// use std::convert::Infallible;
///
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_http::IdempotencyLayer;
/// use tower::{service_fn, Layer, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
///     .tenant(|req| Some(req.headers.get("x-api-key")?.to_str().ok()?.to_owned()));
/// let service = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("done"))))
/// }));
/// let request = Request::post("/jobs")
///     .header("x-api-key", "tenant-1")
///     .header("idempotency-key", "job-1")
///     .body(Full::new(Bytes::new()))?;
/// let response = service.oneshot(request).await?;
/// assert_eq!(response.status(), 200);
/// # Ok(()) }
/// ```
pub struct IdempotencyLayer<S: ?Sized, C = JsonCodec> {
    config: Arc<Config<S, C>>,
}

struct Config<S: ?Sized, C> {
    idem: Idempotency<S, C>,
    scope: String,
    required: bool,
    methods: Vec<Method>,
    max_body_bytes: usize,
    max_response_bytes: usize,
    detached: bool,
    tenant: Option<Arc<TenantFn>>,
    allow_anonymous: bool,
    record: Arc<StatusFn>,
    skip_headers: Arc<[HeaderName]>,
    key_source: KeySource,
    route_template: bool,
    on_replay: Option<Arc<ReplayFn>>,
    render: Option<Arc<RenderFn>>,
    /// Keys whose response is being written after an outage
    /// ([`finish_later`]); shared by the layer's clones.
    finishing: Arc<Finishing>,
}

/// The keys of responses written later, after the store was away: a
/// request with one of them gets 409 here, without asking the store (after
/// the lease, the store would let it take the key over and run again).
#[derive(Default)]
struct Finishing {
    /// How many keys: the request path reads this, and looks into the set
    /// only when it is not zero.
    count: std::sync::atomic::AtomicUsize,
    /// Each key with the fingerprint of the request that ran.
    keys: std::sync::Mutex<std::collections::HashMap<IdempotencyKey, Fingerprint>>,
}

impl Finishing {
    /// Whether `key` is being finished for a request with this
    /// fingerprint. Another payload goes on to the store, which answers
    /// the mismatch (422), whatever the record's state.
    fn holds(&self, key: &IdempotencyKey, fingerprint: &Fingerprint) -> bool {
        self.count.load(std::sync::atomic::Ordering::Acquire) > 0
            && self
                .keys
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(key)
                .is_some_and(|f| f == fingerprint)
    }

    fn insert(&self, key: IdempotencyKey, fingerprint: Fingerprint) {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if keys.insert(key, fingerprint).is_none() {
            self.count
                .fetch_add(1, std::sync::atomic::Ordering::Release);
        }
    }

    fn remove(&self, key: &IdempotencyKey) {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if keys.remove(key).is_some() {
            self.count
                .fetch_sub(1, std::sync::atomic::Ordering::Release);
        }
    }
}

impl<S: ?Sized, C> Clone for Config<S, C> {
    fn clone(&self) -> Self {
        Config {
            idem: self.idem.clone(),
            scope: self.scope.clone(),
            required: self.required,
            methods: self.methods.clone(),
            max_body_bytes: self.max_body_bytes,
            max_response_bytes: self.max_response_bytes,
            detached: self.detached,
            tenant: self.tenant.clone(),
            allow_anonymous: self.allow_anonymous,
            record: self.record.clone(),
            skip_headers: self.skip_headers.clone(),
            key_source: self.key_source.clone(),
            route_template: self.route_template,
            on_replay: self.on_replay.clone(),
            finishing: self.finishing.clone(),
            render: self.render.clone(),
        }
    }
}

impl<S: ?Sized, C> Clone for IdempotencyLayer<S, C> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            config: self.config.clone(),
        }
    }
}

impl<S: ?Sized, C> fmt::Debug for IdempotencyLayer<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("scope", &self.config.scope)
            .field("required", &self.config.required)
            .field("methods", &self.config.methods)
            .field("max_body_bytes", &self.config.max_body_bytes)
            .field("max_response_bytes", &self.config.max_response_bytes)
            .field("detached", &self.config.detached)
            .field("tenant", &self.config.tenant.is_some())
            .field("allow_anonymous", &self.config.allow_anonymous)
            .field("key_source", &self.config.key_source)
            .field("route_template", &self.config.route_template)
            .field("on_replay", &self.config.on_replay.is_some())
            .field("problem_response", &self.config.render.is_some())
            .finish()
    }
}

impl<S: IdempotencyStore + ?Sized, C: Codec> IdempotencyLayer<S, C> {
    /// A layer over `idem`: its store, lease, retention and heartbeat apply.
    /// A duplicate that arrives while the first request runs gets 409 unless
    /// the executor's policy is `InProgressPolicy::Wait`, in which case it
    /// waits for the recorded response.
    ///
    /// Defaults: scope `http`; the key is required on `POST` and `PATCH`
    /// (other methods pass through untouched); request bodies up to 1 MiB;
    /// no tenant function and anonymous requests refused, so set
    /// [`tenant`](Self::tenant) or [`allow_anonymous`](Self::allow_anonymous);
    /// every status is recorded but 401, 408, 425, 429, 502, 503 and 504
    /// ([`default_record_status`]); response bodies recorded up to 1 MiB
    /// ([`max_response_bytes`](Self::max_response_bytes)); the handler runs
    /// [`detached`](Self::detached).
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use idem_core::{Idempotency, InProgressPolicy, MemoryStore};
    /// use idem_http::IdempotencyLayer;
    ///
    /// let idem = Idempotency::new(MemoryStore::new())
    ///     .lease(Duration::from_secs(30))
    ///     // a duplicate waits for the first request's response instead of a 409
    ///     .on_in_progress(InProgressPolicy::Wait {
    ///         max_wait: Duration::from_secs(10),
    ///         poll: Duration::from_millis(50),
    ///     });
    /// let layer = IdempotencyLayer::new(idem);
    /// # let _ = layer;
    /// ```
    pub fn new(idem: Idempotency<S, C>) -> Self {
        IdempotencyLayer {
            config: Arc::new(Config {
                idem,
                scope: "http".to_owned(),
                required: true,
                methods: vec![Method::POST, Method::PATCH],
                max_body_bytes: 1 << 20,
                max_response_bytes: 1 << 20,
                detached: true,
                tenant: None,
                allow_anonymous: false,
                record: Arc::new(default_record_status),
                skip_headers: not_recorded_headers(),
                key_source: KeySource::Header(IDEMPOTENCY_KEY),
                route_template: false,
                on_replay: None,
                render: None,
                finishing: Arc::default(),
            }),
        }
    }

    /// Applies `f` to this layer's configuration; a layer that shares it
    /// with clones gets its own copy first, so the clones are unchanged.
    fn edit(mut self, f: impl FnOnce(&mut Config<S, C>)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The scope of the idempotency keys (default `http`): give each API
    /// its own when several share a store.
    ///
    /// # Errors
    ///
    /// A scope that is not 1 to 64 bytes of `[A-Za-z0-9._:-]` is refused
    /// here, when the layer is built, with the [`KeyError`] that says why;
    /// the layer is not changed. (A layer cannot fail once it serves, and a
    /// per-request error would blame the client for the server's
    /// configuration.)
    ///
    /// ```
    /// use idem_core::{Idempotency, KeyError, MemoryStore};
    /// use idem_http::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()));
    /// assert!(matches!(
    ///     layer.clone().scope("payments api"),
    ///     Err(KeyError::InvalidScopeChar { .. })
    /// ));
    /// let layer = layer.scope("payments.api")?;
    /// # let _ = layer;
    /// # Ok::<(), KeyError>(())
    /// ```
    pub fn scope(self, scope: impl Into<String>) -> Result<Self, KeyError> {
        let scope = scope.into();
        // The scope is validated with the key type's own rules.
        IdempotencyKey::new(scope.clone(), "-")?;
        Ok(self.edit(|c| c.scope = scope))
    }

    /// Whether a request without a key is refused with 400 (default
    /// `true`) or passed through without idempotency.
    ///
    /// ```
    /// use axum::{body::Body, routing::post, Router};
    /// use http::Request;
    /// use idem_core::{Idempotency, MemoryStore};
    /// use idem_http::IdempotencyLayer;
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
    ///     .allow_anonymous(true)
    ///     .required(false);
    /// let app = Router::new().route("/pay", post(|| async { "paid" })).layer(layer);
    /// let response = app.oneshot(Request::post("/pay").body(Body::empty())?).await?;
    /// assert_eq!(response.status(), 200, "no key: passed through");
    /// # Ok(()) }
    /// ```
    pub fn required(self, required: bool) -> Self {
        self.edit(|c| c.required = required)
    }

    /// The methods the layer applies to (default `POST` and `PATCH`);
    /// requests with other methods pass through untouched.
    ///
    /// ```
    /// use http::Method;
    /// use idem_core::{Idempotency, MemoryStore};
    /// use idem_http::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
    ///     .methods([Method::POST, Method::PATCH, Method::DELETE]);
    /// # let _ = layer;
    /// ```
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.edit(|c| c.methods = methods)
    }

    /// The largest request body accepted (default 1 MiB); larger ones get
    /// 413 before anything is stored.
    ///
    /// ```
    /// use axum::{body::Body, routing::post, Router};
    /// use http::Request;
    /// use idem_core::{Idempotency, MemoryStore};
    /// use idem_http::IdempotencyLayer;
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
    ///     .allow_anonymous(true)
    ///     .max_body_bytes(16);
    /// let app = Router::new().route("/pay", post(|| async { "paid" })).layer(layer);
    /// let big = Request::post("/pay").header("idempotency-key", "k").body(Body::from("x".repeat(17)))?;
    /// assert_eq!(app.oneshot(big).await?.status(), 413);
    /// # Ok(()) }
    /// ```
    pub fn max_body_bytes(self, max: usize) -> Self {
        self.edit(|c| c.max_body_bytes = max)
    }

    /// The largest response body recorded (default 1 MiB). The body is
    /// read up to this; if it ends within it, it is recorded and replayed.
    /// If it goes past, the key is completed as "not replayable" at once
    /// (the lease is not held while the body streams) and the caller gets
    /// the whole response, streamed: what was read, then the rest. A
    /// duplicate of such a key gets `409 Conflict` ("the original response
    /// was not recorded"), never a second execution. A `text/event-stream`
    /// response is never read ahead: it is streamed at once and not
    /// replayable. The store may have its own, lower limit (and the
    /// recorded copy adds its headers and some escaping): a response the
    /// store refuses is not replayable the same way.
    pub fn max_response_bytes(self, max: usize) -> Self {
        self.edit(|c| c.max_response_bytes = max)
    }

    /// Whether the handler runs detached (default `true`): acquisition,
    /// handler and recording run in a spawned task that the request only
    /// awaits, so a client that disconnects (or times out) does not cut the
    /// handler off: it runs to its end, its response is recorded, and the
    /// client's retry gets the replay (`409` while it still runs). The
    /// inner service, its future and its error must be `Send + 'static`
    /// (as axum's are).
    ///
    /// Off, the handler runs in the request's own future: a client that
    /// disconnects drops it wherever it is, and its key then stays in
    /// progress until its lease ends (it is never released, since part of
    /// the handler's effects may have happened); the retry after that runs
    /// the handler again.
    pub fn detached(self, detached: bool) -> Self {
        self.edit(|c| c.detached = detached)
    }

    /// Who is calling, from the request head (an API key, the subject of a
    /// verified token put in the extensions by an auth layer...). Keys are
    /// scoped by it, so two callers sending the same key never collide and
    /// never read each other's responses.
    ///
    /// A request whose tenant is not known (no tenant function, or it
    /// returns `None` or an empty string) is refused with `401
    /// Unauthorized` before anything runs or is stored, unless
    /// [`allow_anonymous`](Self::allow_anonymous) is on.
    ///
    /// ```
    /// use axum::{body::Body, routing::post, Router};
    /// use http::Request;
    /// use idem_core::{Idempotency, MemoryStore};
    /// use idem_http::IdempotencyLayer;
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
    ///     .tenant(|req| Some(req.headers.get("x-api-key")?.to_str().ok()?.to_owned()));
    /// let app = Router::new().route("/pay", post(|| async { "paid" })).layer(layer);
    /// let pay = |tenant: &str| {
    ///     Request::post("/pay")
    ///         .header("x-api-key", tenant)
    ///         .header("idempotency-key", "k-1")
    ///         .body(Body::empty())
    /// };
    /// app.clone().oneshot(pay("alice")?).await?;
    /// let bob = app.clone().oneshot(pay("bob")?).await?;
    /// assert!(bob.headers().get("idempotent-replayed").is_none(), "bob's own request ran");
    /// let nobody = Request::post("/pay").header("idempotency-key", "k-1").body(Body::empty())?;
    /// assert_eq!(app.oneshot(nobody).await?.status(), 401);
    /// # Ok(()) }
    /// ```
    pub fn tenant(
        self,
        tenant: impl Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.edit(|c| c.tenant = Some(Arc::new(tenant)))
    }

    /// Whether requests whose tenant is not known are served (default
    /// `false`: they get `401 Unauthorized`). On, **all anonymous callers
    /// share one key space**: two of them sending the same key get one
    /// execution, and the second one gets the first one's response. Turn it
    /// on only for an API without callers to tell apart, or whose keys are
    /// unguessable and never shared (random UUIDs from trusted clients).
    ///
    /// ```
    /// use idem_core::{Idempotency, MemoryStore};
    /// use idem_http::IdempotencyLayer;
    ///
    /// // An internal API whose only client is one trusted service.
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new())).allow_anonymous(true);
    /// # let _ = layer;
    /// ```
    pub fn allow_anonymous(self, allow: bool) -> Self {
        self.edit(|c| c.allow_anonymous = allow)
    }

    /// Which response statuses are recorded and replayed. A response that
    /// is not recorded is passed through and releases the key, so a retry
    /// runs the handler again.
    ///
    /// Default ([`default_record_status`]): every status is recorded but
    /// those that say "nothing happened, try again": 401, 408, 425, 429,
    /// 502, 503 and 504. A 500 is recorded: the handler may have done part
    /// of its work before it failed, and running it again could do it twice
    /// (Stripe's API does the same). Release a status only if your handler
    /// guarantees it had no effect when it answers it.
    ///
    /// ```
    /// use idem_core::{Idempotency, MemoryStore};
    /// use idem_http::{default_record_status, IdempotencyLayer};
    ///
    /// // This handler answers 409 only before it did anything: a retry may run.
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
    ///     .record_status(|status| status != 409 && default_record_status(status));
    /// # let _ = layer;
    /// ```
    pub fn record_status(
        self,
        record: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.edit(|c| c.record = Arc::new(record))
    }

    /// The header that carries the client's key (default
    /// `Idempotency-Key`), for clients that send it under another name.
    /// The value is read as the draft's: a token or a quoted string of 1 to
    /// 255 visible ASCII characters. Replaces a [`key_from`](Self::key_from)
    /// or [`key_from_body`](Self::key_from_body) function (the last call
    /// wins).
    ///
    /// # Errors
    ///
    /// A header that cannot carry a key from the client to the layer, or
    /// must not be stored, is refused here with the layer unchanged:
    /// hop-by-hop and framing headers (`Connection`, `Keep-Alive`, `TE`,
    /// `Trailer`, `Transfer-Encoding`, `Upgrade`, `Content-Length`, `Host`,
    /// `Expect`...), which proxies drop or rewrite; the ones a browser may
    /// not set (`Origin`, `Referer`, `Date`, `Via`, `Proxy-*`, `Sec-*`...);
    /// and credentials (`Authorization`, `Cookie`): the key is part of the
    /// record's id, stored and logged.
    ///
    /// ```
    /// use axum::{body::Body, routing::post, Router};
    /// use http::{header::HeaderName, Request};
    /// use idem_core::{Idempotency, MemoryStore};
    /// use idem_http::IdempotencyLayer;
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
    ///     .allow_anonymous(true) // one caller in this example
    ///     .header_name(HeaderName::from_static("x-request-id"))?;
    /// let app = Router::new().route("/pay", post(|| async { "paid" })).layer(layer.clone());
    /// let pay = || Request::post("/pay").header("x-request-id", "r-1").body(Body::empty());
    /// app.clone().oneshot(pay()?).await?;
    /// let again = app.oneshot(pay()?).await?;
    /// assert_eq!(again.headers()["idempotent-replayed"], "true");
    ///
    /// // A proxy drops `Connection`: the key would never arrive.
    /// assert!(layer.header_name(http::header::CONNECTION).is_err());
    /// # Ok(()) }
    /// ```
    pub fn header_name(self, name: HeaderName) -> Result<Self, ForbiddenHeaderName> {
        if is_forbidden_key_header(&name) {
            return Err(ForbiddenHeaderName(name));
        }
        Ok(self.edit(|c| c.key_source = KeySource::Header(name)))
    }

    /// Reads the client's key with `key`, from the request head, instead
    /// of from the `Idempotency-Key` header: another header, a query
    /// parameter, an extension an earlier layer put there. Replaces
    /// [`header_name`](Self::header_name) and
    /// [`key_from_body`](Self::key_from_body) (the last call wins).
    ///
    /// `None` means "no key": `400` where a key is
    /// [`required`](Self::required), passed through otherwise. A value is
    /// checked like the header's (1 to 255 visible ASCII characters,
    /// optionally quoted; else `400`) and keyed the same way, under the
    /// tenant, method and path, so two tenants or two paths never share a
    /// record. A panic in `key` answers `500`; nothing runs.
    ///
    /// ```
    /// use axum::{body::Body, routing::post, Router};
    /// use http::Request;
    /// use idem_core::{Idempotency, MemoryStore};
    /// use idem_http::IdempotencyLayer;
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // The key in a query parameter: `POST /pay?request_id=r-1`.
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
    ///     .allow_anonymous(true)
    ///     .key_from(|req| {
    ///         let query = req.uri.query()?;
    ///         let value = query.split('&').find_map(|kv| kv.strip_prefix("request_id="))?;
    ///         Some(value.to_owned())
    ///     });
    /// let app = Router::new().route("/pay", post(|| async { "paid" })).layer(layer);
    /// let pay = || Request::post("/pay?request_id=r-1").body(Body::empty());
    /// app.clone().oneshot(pay()?).await?;
    /// let again = app.clone().oneshot(pay()?).await?;
    /// assert_eq!(again.headers()["idempotent-replayed"], "true");
    /// let missing = app.oneshot(Request::post("/pay").body(Body::empty())?).await?;
    /// assert_eq!(missing.status(), 400);
    /// # Ok(()) }
    /// ```
    pub fn key_from(
        self,
        key: impl Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.edit(|c| c.key_source = KeySource::Head(Arc::new(key)))
    }

    /// Reads the client's key with `key` from the request head and its
    /// body (a field of a JSON body, say) instead of from the
    /// `Idempotency-Key` header. Replaces [`header_name`](Self::header_name)
    /// and [`key_from`](Self::key_from) (the last call wins). Its result is
    /// checked and keyed as with [`key_from`](Self::key_from).
    ///
    /// The body is read (up to [`max_body_bytes`](Self::max_body_bytes),
    /// `413` over it) before the key is known, so with `.required(false)`
    /// every request of the layer's [`methods`](Self::methods) is buffered,
    /// whether it carries a key or not.
    ///
    /// ```
    /// use axum::{body::Body, routing::post, Router};
    /// use http::Request;
    /// use idem_core::{Idempotency, MemoryStore};
    /// use idem_http::IdempotencyLayer;
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // The key in the body: `{"request_id": "r-1", "amount": 5}`.
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
    ///     .allow_anonymous(true)
    ///     .key_from_body(|_head, body| {
    ///         let body: serde_json::Value = serde_json::from_slice(body).ok()?;
    ///         Some(body.get("request_id")?.as_str()?.to_owned())
    ///     });
    /// let app = Router::new().route("/pay", post(|| async { "paid" })).layer(layer);
    /// let pay = || {
    ///     Request::post("/pay")
    ///         .header("content-type", "application/json")
    ///         .body(Body::from(r#"{"request_id": "r-1", "amount": 5}"#))
    /// };
    /// app.clone().oneshot(pay()?).await?;
    /// let again = app.oneshot(pay()?).await?;
    /// assert_eq!(again.headers()["idempotent-replayed"], "true");
    /// # Ok(()) }
    /// ```
    pub fn key_from_body(
        self,
        key: impl Fn(&http::request::Parts, &[u8]) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.edit(|c| c.key_source = KeySource::Body(Arc::new(key)))
    }

    /// Keys requests by the route they matched, axum's
    /// [`MatchedPath`](axum::extract::MatchedPath)
    /// (`/accounts/{id}/transfer`), instead of their concrete path
    /// (`/accounts/1/transfer`). Default `false`. Feature `axum`.
    ///
    /// What it means: a client's key names one record per tenant, method
    /// and **route**, not per resource. A request to `/accounts/2/transfer`
    /// with the key already used on `/accounts/1/transfer` finds that
    /// record; the fingerprint still covers the concrete path (and query),
    /// so it gets `422` (key reused with a different request): it never
    /// gets the other path's response, and never runs. Turn it on when
    /// clients make their keys unique per operation (as most do, with
    /// UUIDs) and a reused key should be refused; leave it off to let one
    /// key be used on two resources.
    ///
    /// Where a request has no `MatchedPath` (the layer wraps the `Router`
    /// from outside instead of being added with `Router::layer`, or no
    /// route matched), the concrete path is used, as when this is off.
    /// [`request_key`] then takes the template as its `path`.
    ///
    /// ```
    /// use axum::{body::Body, routing::post, Router};
    /// use http::Request;
    /// use idem_core::{Idempotency, MemoryStore};
    /// use idem_http::IdempotencyLayer;
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
    ///     .allow_anonymous(true)
    ///     .route_template(true);
    /// let app = Router::new()
    ///     .route("/accounts/{id}/transfer", post(|| async { "moved" }))
    ///     .layer(layer);
    /// let transfer = |id: u32| {
    ///     Request::post(format!("/accounts/{id}/transfer"))
    ///         .header("idempotency-key", "k-1")
    ///         .body(Body::empty())
    /// };
    /// assert_eq!(app.clone().oneshot(transfer(1)?).await?.status(), 200);
    /// // The same key on another account: refused, not replayed.
    /// assert_eq!(app.oneshot(transfer(2)?).await?.status(), 422);
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "axum")]
    pub fn route_template(self, on: bool) -> Self {
        self.edit(|c| c.route_template = on)
    }

    /// Called on every replayed response (a recorded one, marked
    /// `Idempotent-Replayed: true`) before it goes to the client, with the
    /// key it was recorded under: to add a header, log, count. It is never
    /// called on the response of the request that ran, nor on the layer's
    /// problems (a `409`, a `422`...).
    ///
    /// If `hook` panics, the replay it was editing is dropped and the
    /// client gets a `500` problem (no panic text); the handler does not
    /// run again, and a retry is replayed again.
    ///
    /// ```
    /// use axum::{body::Body, routing::post, Router};
    /// use http::{HeaderValue, Request};
    /// use idem_core::{Idempotency, MemoryStore};
    /// use idem_http::IdempotencyLayer;
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
    ///     .allow_anonymous(true)
    ///     .on_replay(|response, key| {
    ///         tracing::info!(%key, "replayed");
    ///         response.headers_mut().insert("x-cache", HeaderValue::from_static("replay"));
    ///     });
    /// let app = Router::new().route("/pay", post(|| async { "paid" })).layer(layer);
    /// let pay = || Request::post("/pay").header("idempotency-key", "k-1").body(Body::empty());
    /// let first = app.clone().oneshot(pay()?).await?;
    /// assert!(first.headers().get("x-cache").is_none());
    /// let again = app.oneshot(pay()?).await?;
    /// assert_eq!(again.headers()["x-cache"], "replay");
    /// # Ok(()) }
    /// ```
    pub fn on_replay(
        self,
        hook: impl Fn(&mut Response<Bytes>, &IdempotencyKey) + Send + Sync + 'static,
    ) -> Self {
        self.edit(|c| c.on_replay = Some(Arc::new(hook)))
    }

    /// Renders the layer's own answers (a missing key, a mismatch, the
    /// store down...: every [`ProblemKind`]) with `render` instead of as
    /// RFC 9457 `application/problem+json` ([`Problem::to_response`], the
    /// default, which `render` can fall back to). The layer sets
    /// `Retry-After` from [`Problem::retry_after`] when `render` did not.
    /// The problem's texts are the layer's own, never an internal error's.
    /// If `render` panics, the default rendering is sent.
    ///
    /// ```
    /// use axum::{body::Body, response::IntoResponse, routing::post, Json, Router};
    /// use http::Request;
    /// use idem_core::{Idempotency, MemoryStore};
    /// use idem_http::IdempotencyLayer;
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
    ///     .allow_anonymous(true)
    ///     .problem_response(|problem| {
    ///         let body = serde_json::json!({
    ///             "error": { "code": problem.kind.as_str(), "message": problem.detail }
    ///         });
    ///         (problem.status, Json(body)).into_response()
    ///     });
    /// let app = Router::new().route("/pay", post(|| async { "paid" })).layer(layer);
    /// let response = app.oneshot(Request::post("/pay").body(Body::empty())?).await?;
    /// assert_eq!(response.status(), 400);
    /// let body = axum::body::to_bytes(response.into_body(), 1 << 20).await?;
    /// let body: serde_json::Value = serde_json::from_slice(&body)?;
    /// assert_eq!(body["error"]["code"], "key_missing");
    /// # Ok(()) }
    /// ```
    pub fn problem_response<B>(
        self,
        render: impl Fn(&Problem) -> Response<B> + Send + Sync + 'static,
    ) -> Self
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let render = move |problem: &Problem| box_response(render(problem));
        self.edit(|c| c.render = Some(Arc::new(render)))
    }
}

impl<S: ?Sized, C, Inner> tower::Layer<Inner> for IdempotencyLayer<S, C> {
    type Service = IdempotencyService<S, Inner, C>;

    fn layer(&self, inner: Inner) -> Self::Service {
        IdempotencyService {
            config: self.config.clone(),
            inner,
        }
    }
}

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
    config: Arc<Config<S, C>>,
    inner: Inner,
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
    if !config.methods.contains(request.method()) {
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
    let tenant = match config.tenant.as_ref().and_then(|f| f(&parts)) {
        Some(tenant) if !tenant.is_empty() => tenant,
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
    let fingerprint = fingerprint(&parts, &body);

    let request = Request::from_parts(parts, ReqBody::from(body));
    // The response for this caller, put here by the handler (detached, it
    // runs in another task) and taken once processing ends.
    let live: Arc<Mutex<Option<Response<LayerBody>>>> = Arc::default();
    let handler = {
        let live = live.clone();
        let record = config.record.clone();
        let skip = config.skip_headers.clone();
        let limit = config.max_response_bytes;
        move |context: idem_core::Context| async move {
            let mut request = request;
            request.extensions_mut().insert(context);
            let response = inner.call(request).await.map_err(NotRecorded::Service)?;
            let (parts, body) = response.into_parts();
            let body = body.map_err(Into::into).boxed_unsync();
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
            let (body, outcome) = if is_event_stream(&parts.headers) {
                let why = "a text/event-stream response is streamed, not recorded";
                (body, Outcome::NotRecordable(why.to_owned()))
            } else {
                match recorded::buffer(body, limit).await {
                    Buffered::Complete(bytes) => {
                        let copy = Recorded::of(parts.status, &parts.headers, bytes.clone(), &skip);
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
    if config.finishing.holds(&key, &fingerprint) {
        let problem =
            Problem::new(ProblemKind::InProgress).with_retry_after(Duration::from_secs(1));
        return Ok(render(&config, problem));
    }
    let outcome = if config.detached {
        config
            .idem
            .process_with_detached(&key, Some(fingerprint), handler)
            .await
    } else {
        config
            .idem
            .process_with(&key, Some(fingerprint), handler)
            .await
    };

    // The handler ran in this call: its caller gets its response as it
    // is, whether it was recorded or not.
    let live = live.lock().unwrap_or_else(|p| p.into_inner()).take();
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
        // The store was away until the lease ended: the response is
        // written later with the same lease (a retry meanwhile gets 409),
        // never by running the handler again.
        if let Err(IdemError::Unrecorded(unrecorded)) = outcome {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    config.finishing.insert(key.clone(), fingerprint);
                    // Out of the set however the task ends (a panic, or
                    // its runtime shutting down, included).
                    let guard = FinishingGuard(config.finishing.clone(), key.clone());
                    let idem = config.idem.clone();
                    runtime.spawn(async move {
                        finish_later(idem, unrecorded).await;
                        drop(guard);
                    });
                }
                Err(_) => {
                    tracing::error!(key = %key, "idempotency layer: no tokio runtime to record the response later; after its lease a retry runs the handler again");
                }
            }
        }
        return Ok(live);
    }
    let problem = match outcome {
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
        Err(IdemError::InProgress { retry_after, .. }) => {
            Problem::new(ProblemKind::InProgress).with_retry_after(retry_after)
        }
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

/// Takes a key out of [`Finishing`] when dropped.
struct FinishingGuard(Arc<Finishing>, IdempotencyKey);

impl Drop for FinishingGuard {
    fn drop(&mut self) {
        self.0.remove(&self.1);
    }
}

/// How long [`finish_later`] keeps trying.
const FINISH_FOR: Duration = Duration::from_secs(3600);

/// Writes the completion of a handler that ran while the store was away
/// (`IdemError::Unrecorded`), with its own lease, retrying with a backoff
/// (10 ms to 500 ms: a client retry after the lease may take the key
/// over, so the completion goes in soon after the store is back) until it
/// is written, another worker took the key over,
/// the store refuses it for good, or an hour passed.
async fn finish_later<S: IdempotencyStore + ?Sized, C: Codec>(
    idem: Idempotency<S, C>,
    unrecorded: Box<idem_core::Unrecorded>,
) {
    let key = &unrecorded.lease().key;
    let give_up = tokio::time::Instant::now() + FINISH_FOR;
    let mut pause = Duration::from_millis(10);
    loop {
        match idem.finish(&unrecorded).await {
            Ok(()) => {
                tracing::info!(key = %key, "idempotency layer: the response was recorded after the store came back");
                return;
            }
            Err(e) if e.is_retryable() && tokio::time::Instant::now() + pause < give_up => {
                tracing::debug!(key = %key, error = %e, "idempotency layer: recording the response later");
            }
            Err(e) => {
                tracing::error!(key = %key, error = %e, "idempotency layer: gave up recording a response whose handler ran; after its lease a retry runs the handler again");
                return;
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

/// How far the request body is: not read yet, or buffered.
enum Pending<B> {
    Unread(B),
    Read(Bytes),
}

/// The client's key as found, before it is checked.
enum RawKey {
    /// No key: no header, or the key function returned `None`.
    Missing,
    /// A value, to check with [`parse_key_str`].
    Value(String),
    /// A header value that is not visible ASCII.
    Malformed,
    /// The key function panicked.
    Panicked,
}

/// The key from the header `name`. A header sent twice is malformed: the
/// draft's field holds one item, and picking one of two keys could key a
/// request by another one than a proxy or the handler saw.
fn header_key(headers: &http::HeaderMap, name: &HeaderName) -> RawKey {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (None, _) => RawKey::Missing,
        (Some(_), Some(_)) => RawKey::Malformed,
        (Some(value), None) => match value.to_str() {
            Ok(value) => RawKey::Value(value.to_owned()),
            Err(_) => RawKey::Malformed,
        },
    }
}

/// Runs a key function; a panic is caught (and is the server's fault).
fn run_extractor(key: impl FnOnce() -> Option<String>) -> RawKey {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(key)) {
        Ok(Some(value)) => RawKey::Value(value),
        Ok(None) => RawKey::Missing,
        Err(_) => RawKey::Panicked,
    }
}

fn malformed_key(source: &KeySource) -> Problem {
    let problem = Problem::new(ProblemKind::KeyMalformed);
    match source {
        KeySource::Header(name) => problem.with_detail(format!(
            "The {} header must be 1 to {MAX_KEY_LEN} visible ASCII characters (a string, \
             optionally quoted).",
            display_header(name)
        )),
        _ => problem.with_detail(format!(
            "The idempotency key must be 1 to {MAX_KEY_LEN} visible ASCII characters (a string, \
             optionally quoted)."
        )),
    }
}

/// `Idempotency-Key` for the default header (as the draft spells it),
/// the name as configured otherwise.
fn display_header(name: &HeaderName) -> &str {
    if name == IDEMPOTENCY_KEY {
        "Idempotency-Key"
    } else {
        name.as_str()
    }
}

/// Reads the request body up to the layer's limit.
async fn read_body<S: ?Sized, C, B>(
    config: &Config<S, C>,
    parts: &http::request::Parts,
    body: B,
) -> Result<Bytes, Problem>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        Problem::new(ProblemKind::BodyTooLarge).with_detail(format!(
            "The body must be at most {} bytes.",
            config.max_body_bytes
        ))
    };
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > config.max_body_bytes as u64) {
        return Err(too_large());
    }
    match Limited::new(body, config.max_body_bytes).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Err(e) => {
            tracing::debug!(error = %e, "idempotency layer: the request body could not be read");
            Err(Problem::new(ProblemKind::BodyUnreadable))
        }
    }
}

/// A problem as the layer's renderer makes it: the custom one if set
/// (the default if that panics), with `Retry-After` when it has one.
fn render<S: ?Sized, C>(config: &Config<S, C>, problem: Problem) -> Response<LayerBody> {
    let Some(custom) = &config.render else {
        return problem.to_response();
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| custom(&problem))) {
        Ok(mut response) => {
            if let Some(after) = problem.retry_after {
                if !response.headers().contains_key(RETRY_AFTER) {
                    problem::set_retry_after(&mut response, after);
                }
            }
            response
        }
        Err(_) => {
            tracing::error!(
                kind = problem.kind.as_str(),
                "idempotency layer: the problem renderer panicked; the default rendering was sent"
            );
            problem.to_response()
        }
    }
}

/// The path a request is keyed by: its route template if asked for and
/// known, else the path as the client sent it.
fn key_path(parts: &http::request::Parts, route_template: bool) -> &str {
    #[cfg(feature = "axum")]
    if route_template {
        if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
            return matched.as_str();
        }
    }
    #[cfg(not(feature = "axum"))]
    let _ = route_template;
    original_uri(parts).path()
}

/// Headers refused by [`IdempotencyLayer::header_name`].
fn is_forbidden_key_header(name: &HeaderName) -> bool {
    const FORBIDDEN: &[&str] = &[
        // Hop-by-hop and framing: proxies drop or rewrite them.
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
        "expect",
        // Not settable by a browser (Fetch's forbidden request headers).
        "accept-charset",
        "accept-encoding",
        "access-control-request-headers",
        "access-control-request-method",
        "cookie2",
        "date",
        "dnt",
        "origin",
        "referer",
        "set-cookie",
        "via",
        // Credentials: the key is stored in the record's id and logged.
        "authorization",
        "cookie",
    ];
    let name = name.as_str();
    FORBIDDEN.contains(&name) || name.starts_with("proxy-") || name.starts_with("sec-")
}

/// Why [`IdempotencyLayer::header_name`] refused a header.
///
/// ```
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_http::IdempotencyLayer;
///
/// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()));
/// let refused = layer.header_name(http::header::TRANSFER_ENCODING).unwrap_err();
/// assert_eq!(refused.name(), "transfer-encoding");
/// ```
#[derive(Debug, thiserror::Error)]
#[error(
    "the header `{0}` cannot carry an idempotency key (hop-by-hop, not settable by clients, or a \
     credential)"
)]
pub struct ForbiddenHeaderName(HeaderName);

impl ForbiddenHeaderName {
    /// The header that was refused.
    pub fn name(&self) -> &HeaderName {
        &self.0
    }
}

/// The fingerprint of a request: SHA-256 over its method, its path and
/// query, the essence of its media type (`application/json`, without
/// parameters such as `charset`), and its body: the canonical JSON of a
/// JSON body (`application/json` or `+json`), so that field order and
/// whitespace never make a mismatch, or else the body's bytes. A JSON body
/// keeps its numbers' exact text (see the `json` module): two requests that
/// differ only in a digit never share a fingerprint.
fn fingerprint(parts: &http::request::Parts, body: &[u8]) -> Fingerprint {
    let target = original_uri(parts)
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let media = media_type(&parts.headers);
    let canonical = is_json(&media).then(|| json::canonical(body)).flatten();
    let (form, body) = match &canonical {
        Some(canonical) => (&b"json"[..], canonical.as_slice()),
        None => (&b"bytes"[..], body),
    };
    // Method, target and media type hold no newline (HTTP forbids it).
    let mut bytes = Vec::with_capacity(body.len() + target.len() + media.len() + 32);
    for part in [
        parts.method.as_str().as_bytes(),
        target.as_bytes(),
        &media,
        form,
    ] {
        bytes.extend_from_slice(part);
        bytes.push(b'\n');
    }
    bytes.extend_from_slice(body);
    Fingerprint::of_bytes(&bytes)
}

/// The request's URI as the client sent it. Inside a nested axum router
/// the URI handed to the layer has lost the nest's prefix
/// (`/accounts/1/transfer` arrives as `/transfer`); axum keeps the whole
/// one as `OriginalUri`, which keys and fingerprints must use, or two
/// accounts' requests would share a key.
fn original_uri(parts: &http::request::Parts) -> &http::Uri {
    #[cfg(feature = "axum")]
    if let Some(original) = parts.extensions.get::<axum::extract::OriginalUri>() {
        return &original.0;
    }
    &parts.uri
}

/// The media type of `Content-Type` without its parameters, lowercased;
/// empty without one.
fn media_type(headers: &http::HeaderMap) -> Vec<u8> {
    let Some(value) = headers.get(CONTENT_TYPE) else {
        return Vec::new();
    };
    let essence = value.as_bytes().split(|&b| b == b';').next().unwrap_or(b"");
    essence.trim_ascii().to_ascii_lowercase()
}

/// `application/json` or a `+json` structured syntax suffix.
fn is_json(media: &[u8]) -> bool {
    media == b"application/json" || (media.ends_with(b"+json") && media.contains(&b'/'))
}

/// The longest tenant, method or path (once `%` and `/` are escaped) kept
/// as it is in a key id.
const MAX_RAW_PART: usize = 64;

/// The id of a request's key: tenant, method and path, each escaped (`%`
/// and `/` percent-encoded) or, when longer than [`MAX_RAW_PART`] or
/// holding a control character, replaced by `sha256:` and its hex SHA-256
/// (71 bytes, so never equal to a part kept as it is); then the header
/// value as it is. The parts hold no `/`, so the id splits back into them
/// at its first three `/`: two different requests never share an id (short
/// of a SHA-256 collision). At most 3 × 71 + 3 + 255 = 471 bytes, under the
/// key's 512, whatever the lengths of the path and tenant.
fn key_id(tenant: &str, method: &str, path: &str, client_key: &str) -> String {
    let mut id = String::with_capacity(3 * 72 + client_key.len());
    for part in [tenant, method, path] {
        let mut escaped = String::with_capacity(part.len());
        for ch in part.chars() {
            match ch {
                '%' => escaped.push_str("%25"),
                '/' => escaped.push_str("%2F"),
                c => escaped.push(c),
            }
        }
        if escaped.len() <= MAX_RAW_PART && !part.chars().any(char::is_control) {
            id.push_str(&escaped);
        } else {
            id.push_str("sha256:");
            id.push_str(&Fingerprint::of_bytes(part.as_bytes()).to_hex());
        }
        id.push('/');
    }
    id.push_str(client_key);
    id
}

/// The key under which the layer records a request: what an operator
/// tool needs to find one request's record.
///
/// `scope` is the layer's scope (default `"http"`), `tenant` what the
/// layer's tenant function returned (`""` for anonymous use), `method` the
/// request's, `path` the request's path as the client sent it (before any
/// nesting stripped it, no query) or, with
/// [`route_template(true)`](IdempotencyLayer::route_template), the route
/// template it matched (`/accounts/{id}/transfer`; the concrete path for a
/// request that matched none), and `header_value` the client's key as it
/// was sent: the key header's value (a token or a quoted string; the
/// header's name does not matter), or what the
/// [`key_from`](IdempotencyLayer::key_from) or
/// [`key_from_body`](IdempotencyLayer::key_from_body) function returned.
/// Two different requests never share a key.
///
/// ```
/// use idem_http::request_key;
///
/// let key = request_key("http", "tenant-1", "POST", "/payments", "\"k-1\"")?;
/// assert_eq!(key.scope(), "http");
/// assert_eq!(key, request_key("http", "tenant-1", "POST", "/payments", "k-1")?);
/// assert_ne!(key, request_key("http", "tenant-2", "POST", "/payments", "k-1")?);
/// // A layer with `.route_template(true)`:
/// let key = request_key("http", "tenant-1", "POST", "/accounts/{id}/transfer", "k-1")?;
/// # let _ = key;
/// assert!(request_key("http", "tenant-1", "POST", "/p", "has space").is_err());
/// # Ok::<(), idem_http::RequestKeyError>(())
/// ```
pub fn request_key(
    scope: &str,
    tenant: &str,
    method: &str,
    path: &str,
    header_value: &str,
) -> Result<IdempotencyKey, RequestKeyError> {
    let client_key = parse_key_str(header_value).ok_or(RequestKeyError::MalformedHeader)?;
    IdempotencyKey::new(scope, key_id(tenant, method, path, client_key))
        .map_err(RequestKeyError::Key)
}

/// Why [`request_key`] could not build a key.
///
/// ```
/// use idem_http::{request_key, RequestKeyError};
///
/// assert!(matches!(
///     request_key("http", "t", "POST", "/p", &"k".repeat(256)),
///     Err(RequestKeyError::MalformedHeader)
/// ));
/// assert!(matches!(request_key("bad scope", "t", "POST", "/p", "k"), Err(RequestKeyError::Key(_))));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RequestKeyError {
    /// The header value is not 1 to 255 visible ASCII characters, as a
    /// token or a quoted string: the layer answers such a request 400.
    #[error(
        "the Idempotency-Key value must be 1 to 255 visible ASCII characters, optionally quoted"
    )]
    MalformedHeader,
    /// The scope is not a valid key scope.
    #[error(transparent)]
    Key(#[from] KeyError),
}

/// The default of [`IdempotencyLayer::record_status`]: `true` (record)
/// for every status but those that say "nothing happened, try again":
/// 401, 408, 425, 429, 502, 503, 504.
///
/// ```
/// use http::StatusCode;
/// use idem_http::default_record_status;
///
/// assert!(default_record_status(StatusCode::CREATED));
/// assert!(default_record_status(StatusCode::INTERNAL_SERVER_ERROR), "it may have done part of its work");
/// assert!(!default_record_status(StatusCode::TOO_MANY_REQUESTS), "nothing happened: a retry runs");
/// ```
pub fn default_record_status(status: StatusCode) -> bool {
    !matches!(status.as_u16(), 401 | 408 | 425 | 429 | 502 | 503 | 504)
}

/// The key from the header: a token, or a quoted string (the draft's
/// structured-field form), of visible ASCII.
fn parse_key_str(raw: &str) -> Option<&str> {
    let raw = raw.trim();
    let key = match raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
        Some(inner) => inner,
        None => raw,
    };
    let visible = key.bytes().all(|b| (0x21..=0x7e).contains(&b) && b != b'"');
    (visible && (1..=MAX_KEY_LEN).contains(&key.len())).then_some(key)
}

fn box_response<B>(response: Response<B>) -> Response<LayerBody>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    response.map(|b| b.map_err(Into::into).boxed_unsync())
}

fn full(bytes: impl Into<Bytes>) -> LayerBody {
    Full::new(bytes.into())
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
}

/// The replay of a recorded response, marked `Idempotent-Replayed: true`,
/// through the replay hook if there is one.
fn replay<S: ?Sized, C>(
    config: &Config<S, C>,
    key: &IdempotencyKey,
    recorded: Recorded,
) -> Response<LayerBody> {
    let Ok(status) = StatusCode::from_u16(recorded.status) else {
        tracing::error!(
            status = recorded.status,
            key = %key,
            "idempotency layer: the recorded status is not valid"
        );
        return render(config, Problem::new(ProblemKind::Internal));
    };
    let mut response = Response::new(recorded.body.0.clone());
    *response.status_mut() = status;
    *response.headers_mut() = recorded.header_map();
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if let Some(hook) = &config.on_replay {
        let hooked =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(&mut response, key)));
        if hooked.is_err() {
            // The response may be half edited: none of it is sent.
            tracing::error!(key = %key, "idempotency layer: the replay hook panicked");
            return render(config, Problem::new(ProblemKind::Internal));
        }
    }
    response.map(full)
}

/// Whether a response is a `text/event-stream`.
fn is_event_stream(headers: &http::HeaderMap) -> bool {
    let media = headers
        .get(CONTENT_TYPE)
        .map(|v| v.as_bytes().split(|&b| b == b';').next().unwrap_or(b""))
        .unwrap_or(b"");
    media
        .trim_ascii()
        .eq_ignore_ascii_case(b"text/event-stream")
}

fn put<T>(slot: &Mutex<Option<T>>, value: T) {
    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(value);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(content_type: &str, body: &str) -> Fingerprint {
        fp_at("POST", "/p?q=1", content_type, body)
    }

    fn fp_at(method: &str, target: &str, content_type: &str, body: &str) -> Fingerprint {
        let mut builder = Request::builder().method(method).uri(target);
        if !content_type.is_empty() {
            builder = builder.header(CONTENT_TYPE, content_type);
        }
        let (parts, ()) = builder
            .body(())
            .unwrap_or_else(|e| panic!("{e}"))
            .into_parts();
        fingerprint(&parts, body.as_bytes())
    }

    #[test]
    fn json_fingerprints_ignore_order_and_whitespace_only() {
        let json = "application/json";
        assert_eq!(
            fp(json, r#"{"a":1,"b":"x"}"#),
            fp(json, "{ \"b\":\"x\",\n \"a\": 1 }")
        );
        assert_eq!(
            fp(json, r#"{"a":1}"#),
            fp("Application/JSON; charset=utf-8", r#"{ "a":1 }"#)
        );
        assert_eq!(
            fp("application/merge-patch+json", r#"{"a":1,"b":2}"#),
            fp("application/merge-patch+json", r#"{"b":2,"a":1}"#)
        );
        assert_ne!(
            fp(json, r#"{"a":12345678901234567890123}"#),
            fp(json, r#"{"a":12345678901234567890124}"#)
        );
        assert_ne!(fp(json, r#"{"a":1}"#), fp(json, r#"{"a":1.0}"#));
        // Not JSON: the bytes, so whitespace counts.
        assert_ne!(
            fp("text/plain", r#"{"a":1}"#),
            fp("text/plain", r#"{ "a":1}"#)
        );
        assert_ne!(fp(json, "{oops"), fp(json, "{oops "));
        assert_eq!(fp(json, "{oops"), fp(json, "{oops"));
        // The media type, method and target count.
        assert_ne!(fp(json, r#"{"a":1}"#), fp("text/plain", r#"{"a":1}"#));
        assert_ne!(fp("", "x"), fp("text/plain", "x"));
        assert_ne!(
            fp_at("POST", "/p", json, "{}"),
            fp_at("PATCH", "/p", json, "{}")
        );
        assert_ne!(
            fp_at("POST", "/p?a=1", json, "{}"),
            fp_at("POST", "/p?a=2", json, "{}")
        );
        // An invalid JSON body never equals a canonical one.
        assert_ne!(fp(json, "[1,]"), fp(json, "[1]"));
    }

    #[test]
    fn key_ids_fit_and_never_collide() {
        let long = "/".repeat(300);
        let key = "%/".repeat(127) + "%";
        let id = key_id(&long, &"M".repeat(100), &long, &key);
        assert!(id.len() <= idem_core::MAX_ID_LEN, "{}", id.len());
        assert!(IdempotencyKey::new("s", id).is_ok());
        // Raw and hashed parts never meet: a raw part is at most 64 bytes.
        let hashed = key_id(&"t".repeat(65), "POST", "/p", "k");
        let raw_like = format!("{}/POST/%2Fp/k", &hashed[..71]);
        assert_eq!(hashed, raw_like, "the hashed form is 71 bytes");
        assert_ne!(key_id(&hashed[..71], "POST", "/p", "k"), hashed);
        // Separators inside parts are escaped.
        assert_ne!(
            key_id("a/b", "POST", "/p", "k"),
            key_id("a", "b/POST", "/p", "k")
        );
        assert_ne!(
            key_id("a", "POST", "/p", "k/x"),
            key_id("a", "POST", "/p/k", "x")
        );
        assert_ne!(
            key_id("t", "POST", &("/".to_owned() + &"p".repeat(99) + "a"), "k"),
            key_id("t", "POST", &("/".to_owned() + &"p".repeat(99) + "b"), "k")
        );
        // A control character in a tenant is hashed, never refused.
        assert!(IdempotencyKey::new("s", key_id("a\nb", "POST", "/", "k")).is_ok());
    }

    #[test]
    fn header_names_that_cannot_carry_a_key_are_refused() {
        for name in [
            "connection",
            "transfer-encoding",
            "upgrade",
            "te",
            "host",
            "content-length",
            "authorization",
            "cookie",
            "set-cookie",
            "proxy-authorization",
            "proxy-anything",
            "sec-fetch-site",
        ] {
            assert!(
                is_forbidden_key_header(&HeaderName::from_static(name)),
                "{name}"
            );
        }
        for name in [
            "idempotency-key",
            "x-request-id",
            "x-idempotency-key",
            "request-id",
        ] {
            assert!(
                !is_forbidden_key_header(&HeaderName::from_static(name)),
                "{name}"
            );
        }
    }

    #[test]
    fn every_problem_kind_has_its_status_and_a_distinct_name() {
        use ProblemKind::*;
        let kinds = [
            (CallerUnknown, 401),
            (KeyMissing, 400),
            (KeyMalformed, 400),
            (BodyTooLarge, 413),
            (BodyUnreadable, 400),
            (InProgress, 409),
            (NotRecorded, 409),
            (Mismatch, 422),
            (StoreUnavailable, 503),
            (Internal, 500),
        ];
        let mut names = std::collections::HashSet::new();
        for (kind, status) in kinds {
            let problem = Problem::new(kind);
            assert_eq!(
                (problem.status.as_u16(), kind.status().as_u16()),
                (status, status)
            );
            assert!(names.insert(kind.as_str()), "{}", kind.as_str());
            let response = problem
                .with_retry_after(Duration::from_millis(1500))
                .to_response();
            assert_eq!(response.status().as_u16(), status);
            assert_eq!(response.headers()[RETRY_AFTER], "2", "rounded up");
        }
    }

    /// A layer inside a nested router, keyed by route template: the
    /// template is the whole one (`/accounts/{id}/transfer`), as
    /// `request_key` is told to take it.
    #[tokio::test]
    async fn a_nested_route_template_is_the_whole_template() {
        use axum::{body::Body, routing::post, Router};
        use idem_core::MemoryStore;
        use tower::ServiceExt;

        let store = Arc::new(MemoryStore::new());
        let layer = IdempotencyLayer::new(Idempotency::new(store.clone()))
            .allow_anonymous(true)
            .route_template(true);
        let app: Router = Router::new().nest(
            "/accounts/{id}",
            Router::new()
                .route("/transfer", post(|| async { "moved" }))
                .layer(layer),
        );
        let request = Request::post("/accounts/7/transfer")
            .header("idempotency-key", "k")
            .body(Body::empty())
            .unwrap_or_else(|e| panic!("{e}"));
        let response = app.oneshot(request).await.unwrap_or_else(|e| match e {});
        assert_eq!(response.status(), 200);
        let key = request_key("http", "", "POST", "/accounts/{id}/transfer", "k")
            .unwrap_or_else(|e| panic!("{e}"));
        let record = store.get(&key).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(record.is_some(), "recorded under the whole template");
    }

    #[test]
    fn keys_are_tokens_or_quoted_strings_of_visible_ascii() {
        let parse = |s: &str| {
            HeaderValue::from_str(s)
                .ok()
                .and_then(|v| v.to_str().ok().and_then(parse_key_str).map(str::to_owned))
        };
        assert_eq!(parse("abc-123").as_deref(), Some("abc-123"));
        assert_eq!(
            parse("\"8e03978e-40d5-43e8-bc93-6894a57f9324\"").as_deref(),
            Some("8e03978e-40d5-43e8-bc93-6894a57f9324")
        );
        assert_eq!(parse(""), None);
        assert_eq!(parse("\"\""), None);
        assert_eq!(parse("a b"), None);
        assert_eq!(
            parse(&"k".repeat(MAX_KEY_LEN)).map(|k| k.len()),
            Some(MAX_KEY_LEN)
        );
        assert_eq!(parse(&"k".repeat(MAX_KEY_LEN + 1)), None);
        // What a key function returns is read the same way.
        assert_eq!(parse_key_str(" \"k\" "), Some("k"));
        for bad in [
            "a\u{1}b",
            "a\u{7f}",
            "caf\u{e9}",
            "\"\"",
            "a\"b",
            &"k".repeat(10 * 1024),
        ] {
            assert_eq!(parse_key_str(bad), None, "{bad:?}");
        }
    }
}
