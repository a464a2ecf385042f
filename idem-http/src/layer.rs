//! [`IdempotencyLayer`]: its settings ([`Config`], shared by its clones
//! and its services) and the builder methods that set them.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, CONTENT_LENGTH};
use http::{Method, Response, StatusCode};
use idem_core::{
    Codec, FinishingKeys, Idempotency, IdempotencyKey, IdempotencyStore, JsonCodec, KeyError,
    PayloadFingerprint,
};

use crate::request::{is_forbidden_key_header, ForbiddenHeaderName, IDEMPOTENCY_KEY};
use crate::response::{box_response, default_record_status, BoxError, LayerBody};
use crate::service::IdempotencyService;
use crate::DetachedTasks;
use crate::Problem;
#[cfg(doc)]
use crate::{request_key, ProblemKind};

type TenantFn = dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync;
type StatusFn = dyn Fn(StatusCode) -> bool + Send + Sync;
type HeadKeyFn = dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync;
type BodyKeyFn = dyn Fn(&http::request::Parts, &[u8]) -> Option<String> + Send + Sync;
type ReplayFn = dyn Fn(&mut Response<Bytes>, &IdempotencyKey) + Send + Sync;
type RenderFn = dyn Fn(&Problem) -> Response<LayerBody> + Send + Sync;

/// Where the client's key is read from.
#[derive(Clone)]
pub(crate) enum KeySource {
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

pub(crate) struct Config<S: ?Sized, C> {
    pub(crate) idem: Idempotency<S, C>,
    pub(crate) scope: String,
    pub(crate) required: bool,
    /// The methods it applies to; `None`: every method.
    pub(crate) methods: Option<Vec<Method>>,
    pub(crate) max_body_bytes: usize,
    pub(crate) max_response_bytes: usize,
    /// The most a `409`'s `Retry-After` says (the lease's remaining time
    /// below it).
    pub(crate) max_retry_after: Duration,
    /// What of a body its fingerprint covers (default the whole body).
    pub(crate) fingerprint: PayloadFingerprint,
    pub(crate) detached: bool,
    pub(crate) tenant: Option<Arc<TenantFn>>,
    pub(crate) allow_anonymous: bool,
    pub(crate) record: Arc<StatusFn>,
    pub(crate) skip_headers: Arc<[HeaderName]>,
    pub(crate) key_source: KeySource,
    pub(crate) route_template: bool,
    pub(crate) on_replay: Option<Arc<ReplayFn>>,
    pub(crate) render: Option<Arc<RenderFn>>,
    /// Keys whose response is being written after an outage
    /// ([`finish_later`](crate::finishing::finish_later)); shared by the
    /// layer's clones.
    pub(crate) finishing: Arc<FinishingKeys>,
    /// The detached runs and finishers still going; shared by the clones.
    pub(crate) tasks: DetachedTasks,
    /// The in-transaction form's settings, when it is on.
    #[cfg(feature = "postgres")]
    pub(crate) tx: Option<Arc<crate::in_tx::TxMode<C>>>,
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
            max_retry_after: self.max_retry_after,
            fingerprint: self.fingerprint.clone(),
            detached: self.detached,
            tenant: self.tenant.clone(),
            allow_anonymous: self.allow_anonymous,
            record: self.record.clone(),
            skip_headers: self.skip_headers.clone(),
            key_source: self.key_source.clone(),
            route_template: self.route_template,
            on_replay: self.on_replay.clone(),
            finishing: self.finishing.clone(),
            tasks: self.tasks.clone(),
            render: self.render.clone(),
            #[cfg(feature = "postgres")]
            tx: self.tx.clone(),
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
            .field("fingerprint", &self.config.fingerprint)
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
        // A request waiting on a key this layer is finishing waits here,
        // never taking the key over at the store after its lease.
        let finishing: Arc<FinishingKeys> = Arc::default();
        IdempotencyLayer {
            config: Arc::new(Config {
                idem: idem.waits_for_finishing(finishing.clone()),
                scope: "http".to_owned(),
                required: true,
                methods: Some(vec![Method::POST, Method::PATCH]),
                max_body_bytes: 1 << 20,
                max_response_bytes: 1 << 20,
                max_retry_after: Duration::MAX,
                fingerprint: PayloadFingerprint::Whole,
                detached: true,
                tenant: None,
                allow_anonymous: false,
                record: Arc::new(default_record_status),
                skip_headers: not_recorded_headers(),
                key_source: KeySource::Header(IDEMPOTENCY_KEY),
                route_template: false,
                on_replay: None,
                render: None,
                finishing,
                tasks: DetachedTasks::default(),
                #[cfg(feature = "postgres")]
                tx: None,
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
        self.edit(|c| c.methods = Some(methods))
    }

    /// The layer applies to requests of every method, extension methods
    /// (`MKCOL`, `CHARGE`) and any spelling of one included: for a front
    /// end that has chosen which requests to protect before they reach the
    /// layer, as `idem proxy` does with its routes.
    ///
    /// ```
    /// use idem_core::{Idempotency, MemoryStore};
    /// use idem_http::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new())).every_method();
    /// # let _ = layer;
    /// ```
    pub fn every_method(self) -> Self {
        self.edit(|c| c.methods = None)
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

    /// What of a request's body its fingerprint covers (default: the whole
    /// body, JSON in its canonical form). With
    /// [`PayloadFingerprint::json_pointers`], only the parts of a JSON body
    /// the pointers name count, so a retry that differs elsewhere (a
    /// timestamp the client adds on each try) gets the replay instead of
    /// 422; a body that is not JSON (or where a pointer names two values)
    /// counts whole. The method, the path with its query and the media
    /// type always count. A request recorded before a change of this gets
    /// 422 on its retry.
    ///
    /// ```
    /// use axum::{body::Body, routing::post, Router};
    /// use http::Request;
    /// use idem_core::{Idempotency, MemoryStore, PayloadFingerprint};
    /// use idem_http::IdempotencyLayer;
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = IdempotencyLayer::new(Idempotency::new(MemoryStore::new()))
    ///     .allow_anonymous(true)
    ///     .fingerprint(PayloadFingerprint::json_pointers(["/amount", "/account"])?);
    /// let app = Router::new().route("/pay", post(|| async { "paid" })).layer(layer);
    /// let pay = |body: &'static str| {
    ///     Request::post("/pay")
    ///         .header("idempotency-key", "k-1")
    ///         .header("content-type", "application/json")
    ///         .body(Body::from(body))
    /// };
    /// let first = app.clone().oneshot(pay(r#"{"amount":5,"account":"a","sent_at":"10:00:00"}"#)?).await?;
    /// assert_eq!(first.status(), 200);
    /// // The retry's timestamp differs: the replay.
    /// let retry = app.clone().oneshot(pay(r#"{"amount":5,"account":"a","sent_at":"10:00:09"}"#)?).await?;
    /// assert_eq!(retry.headers()["idempotent-replayed"], "true");
    /// // Another amount under the same key: 422.
    /// let other = app.oneshot(pay(r#"{"amount":6,"account":"a","sent_at":"10:00:09"}"#)?).await?;
    /// assert_eq!(other.status(), 422);
    /// # Ok(()) }
    /// ```
    pub fn fingerprint(self, what: PayloadFingerprint) -> Self {
        self.edit(|c| c.fingerprint = what)
    }

    /// The largest response body recorded (default 1 MiB). The body is
    /// read up to this; if it ends within it, it is recorded and replayed.
    /// A body still coming when the handler returns streams to its caller
    /// as it comes (detached mode), copied up to this. If it goes past,
    /// the key is completed as "not replayable" at once (the lease is not
    /// held while the rest streams) and the caller gets the whole
    /// response, streamed: what was read, then the rest. A
    /// duplicate of such a key gets `409 Conflict` ("the original response
    /// was not recorded"), never a second execution. A `text/event-stream`
    /// response is never read ahead: it is streamed at once and not
    /// replayable. The store may have its own, lower limit (and the
    /// recorded copy adds its headers and some escaping): a response the
    /// store refuses is not replayable the same way.
    pub fn max_response_bytes(self, max: usize) -> Self {
        self.edit(|c| c.max_response_bytes = max)
    }

    /// The most the `Retry-After` of a `409` ("a request with this key is
    /// running") says (default: no limit). Without it, `Retry-After` is the
    /// running request's remaining lease, when another request may take
    /// the key over: with the heartbeat on, most of the lease (60 s by
    /// default), while the answer usually comes much sooner. An API whose
    /// requests take a second or less is better served by
    /// `max_retry_after(Duration::from_secs(1))`: the client asks again
    /// then and gets the replay (or another `409`). `Retry-After` is in
    /// whole seconds, at least 1.
    pub fn max_retry_after(self, max: Duration) -> Self {
        self.edit(|c| c.max_retry_after = max)
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

    /// The detached tasks of this layer and its clones: a graceful
    /// shutdown awaits [`DetachedTasks::idle`] after its connections
    /// ended, so that runs whose clients went away, and responses still
    /// being recorded, finish before the process exits.
    pub fn detached_tasks(&self) -> DetachedTasks {
        self.config.tasks.clone()
    }

    /// Who is calling, from the request head (an API key, the subject of a
    /// verified token put in the extensions by an auth layer...). Keys are
    /// scoped by it, so two callers sending the same key never collide and
    /// never read each other's responses.
    ///
    /// A request whose tenant is not known (no tenant function, or it
    /// returns `None` or an empty string) is refused with `401
    /// Unauthorized` before anything runs or is stored, unless
    /// [`allow_anonymous`](Self::allow_anonymous) is on. A tenant
    /// function that panics is answered `500` (nothing runs, the panic
    /// text is not sent), like a key function that panics.
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

#[cfg(feature = "postgres")]
impl<C: Codec> IdempotencyLayer<idem_postgres::PgStore, C> {
    /// The in-transaction form (feature `postgres`): each request's key is
    /// claimed in a PostgreSQL transaction of the store's pool, which the
    /// handler gets in its extensions ([`RequestTx`](crate::RequestTx);
    /// axum: `Extension<RequestTx>`) beside the
    /// [`Context`](idem_core::Context); its response is recorded in the
    /// same transaction, which commits before the response leaves. A crash
    /// anywhere before the commit rolls back the handler's writes with the
    /// claim, so the retry runs cleanly: exactly once for the writes made
    /// in that transaction, with no lease.
    ///
    /// | what happens | what the caller and the retry get |
    /// |---|---|
    /// | the handler's response is recorded | commit, then the response; duplicates get the replay |
    /// | a status the layer releases (401, 408, 425, 429, 502-504) | rolled back, the response passed on; a retry runs again |
    /// | the handler panics, or the client goes away before the commit | rolled back (500, or nothing); a retry runs again |
    /// | the commit fails | 503, the response withheld; a retry runs cleanly, or replays if the commit took place after all |
    /// | a duplicate while the first is open | waits (in this process without a connection), then the replay; after [`transaction_wait`](Self::transaction_wait), 409 with `Retry-After` |
    ///
    /// Not detached: the handler runs in the request's task, so that a
    /// client that goes away rolls its request back. The response is read
    /// whole (up to `max_response_bytes`) before the commit; a longer or
    /// streamed one commits as "not replayable" and then reaches its
    /// caller. Do the writes that must happen once on the request's
    /// transaction, never on another connection of the pool (their commit
    /// would not wait for the record's), and never run `COMMIT` or
    /// `ROLLBACK` on it yourself.
    ///
    /// ```no_run
    /// use axum::{routing::post, Extension, Router};
    /// use idem_core::Idempotency;
    /// use idem_http::{IdempotencyLayer, RequestTx};
    /// use idem_postgres::PgStore;
    ///
    /// async fn pay(Extension(tx): Extension<RequestTx>) -> Result<&'static str, axum::http::StatusCode> {
    ///     let mut tx = tx.lock().await.map_err(|_| axum::http::StatusCode::INTERNAL_SERVER_ERROR)?;
    ///     idem_postgres::sqlx::query("INSERT INTO payments (amount) VALUES (1999)")
    ///         .execute(&mut *tx)
    ///         .await
    ///         .map_err(|_| axum::http::StatusCode::SERVICE_UNAVAILABLE)?;
    ///     Ok("charged")
    /// }
    ///
    /// # async fn run(store: PgStore) -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = IdempotencyLayer::new(Idempotency::new(store))
    ///     .allow_anonymous(true)
    ///     .in_transaction();
    /// let app: Router = Router::new().route("/payments", post(pay)).layer(layer);
    /// # let _ = app; Ok(()) }
    /// ```
    pub fn in_transaction(self) -> Self {
        let store = (**self.config.idem.store()).clone();
        let wait = self
            .config
            .tx
            .as_ref()
            .map_or(crate::in_tx::DEFAULT_TRANSACTION_WAIT, |m| m.wait);
        let in_tx = store
            .in_transaction()
            .retention(self.config.idem.retention_period())
            .codec_shared(self.config.idem.codec_shared())
            .lock_wait(wait);
        self.edit(|c| {
            c.tx = Some(Arc::new(crate::in_tx::TxMode {
                in_tx,
                store,
                wait,
                gate: Arc::default(),
            }))
        })
    }

    /// How long a duplicate waits for the open transaction that holds its
    /// key, in the in-transaction form (default 10 s; at least 1 ms,
    /// `Duration::MAX` saturated to `i32::MAX` ms): then it gets `409` with
    /// `Retry-After`. Call it after
    /// [`in_transaction`](Self::in_transaction); without it, it does
    /// nothing.
    pub fn transaction_wait(self, wait: Duration) -> Self {
        let wait = wait.clamp(
            Duration::from_millis(1),
            Duration::from_millis(i32::MAX as u64),
        );
        self.edit(|c| {
            if let Some(mode) = &c.tx {
                c.tx = Some(Arc::new(crate::in_tx::TxMode {
                    in_tx: mode.in_tx.clone().lock_wait(wait),
                    store: mode.store.clone(),
                    wait,
                    gate: mode.gate.clone(),
                }));
            }
        })
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
