//! Forwarding a request to the upstream over a pooled HTTP/1.1 or HTTP/2
//! client: hop-by-hop headers dropped both ways (RFC 9110 section 7.6.1),
//! `Forwarded` and `X-Forwarded-*` added, the fence and attempt of the
//! request's acquisition passed on, and the upstream's failures turned
//! into answers the idempotency layer reads right.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body::Frame;
use hyper_util::client::legacy::connect::{capture_connection, HttpConnector};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use idem_http::{NotReplayable, NothingHappened};
use tokio::time::Instant;

use crate::telemetry;

/// The upstream's base URL: `http://host:port[/base]`.
#[derive(Debug, Clone)]
pub struct Upstream {
    authority: Authority,
    base: String,
}

impl Upstream {
    /// Parses `http://host:port[/base]`.
    pub(crate) fn parse(url: &str) -> Result<Upstream, String> {
        let uri: Uri = url.parse().map_err(|_| format!("`{url}` is not a URL"))?;
        if uri.scheme() != Some(&Scheme::HTTP) {
            return Err(format!(
                "`{url}`: the upstream is reached over plain http:// (TLS to the upstream is not supported; terminate it here)"
            ));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("`{url}` has no host"))?;
        if authority.host().is_empty() {
            return Err(format!("`{url}` has no host"));
        }
        if authority.as_str().contains('@') {
            return Err(format!("`{url}`: credentials in the URL are not supported"));
        }
        if uri.query().is_some() {
            return Err(format!(
                "`{url}`: a query in the upstream URL is not supported"
            ));
        }
        let base = uri.path().trim_end_matches('/').to_owned();
        Ok(Upstream { authority, base })
    }

    /// The base path (`""` when none), without a trailing slash.
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// The URL as given, for logs.
    pub fn url(&self) -> String {
        format!("http://{}{}", self.authority, self.base)
    }

    fn uri_for(&self, path_and_query: Option<&PathAndQuery>) -> Result<Uri, http::Error> {
        let pq = path_and_query.map_or("/", |pq| pq.as_str());
        Uri::builder()
            .scheme(Scheme::HTTP)
            .authority(self.authority.clone())
            .path_and_query(format!("{}{pq}", self.base))
            .build()
    }
}

/// RFC 9110 section 7.6.1's hop-by-hop headers (and the old
/// `Proxy-Connection`), which a proxy never forwards.
pub(crate) fn is_hop_by_hop_name(name: &HeaderName) -> bool {
    name == header::CONNECTION
        || name == header::TE
        || name == header::TRANSFER_ENCODING
        || name == header::UPGRADE
        || name == header::TRAILER
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// Removes the hop-by-hop headers and the ones `Connection` names, and
/// a `Content-Length` that does not frame the body: one sent beside
/// `Transfer-Encoding` (the body came chunked; RFC 9112 section 6.3 has
/// an intermediary remove it), and repeats of one length kept once. The
/// next hop then frames the body by what it is, never by a length that
/// would cut it and leave its rest on the connection as the next answer.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        headers.remove(header::CONTENT_LENGTH);
    }
    // One length given more than once (`5, 5`, or on two lines; hyper
    // takes it when every value is the same): kept once, or dropped when
    // the values differ.
    let lengths: Vec<String> = headers
        .get_all(header::CONTENT_LENGTH)
        .iter()
        .flat_map(|v| {
            v.to_str()
                .unwrap_or("?")
                .split(',')
                .map(|s| s.trim().to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    if lengths.len() > 1 {
        headers.remove(header::CONTENT_LENGTH);
        if lengths.iter().all(|l| *l == lengths[0]) {
            if let Ok(one) = HeaderValue::from_str(&lengths[0]) {
                headers.insert(header::CONTENT_LENGTH, one);
            }
        }
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::TE,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::TRAILER,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
    ] {
        headers.remove(name);
    }
}

/// The permit of a protected request's upstream call (`--max-running`):
/// held until the call ends, its answer's body included.
pub(crate) struct RunPermit {
    _held: tokio::sync::OwnedSemaphorePermit,
}

/// A request body that must arrive whole by a deadline (`--body-timeout`):
/// one that stalls ends as a failed body, so nothing is sent and the
/// connection is not held.
pub(crate) struct BodyDeadline<B> {
    body: B,
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl<B> BodyDeadline<B> {
    pub(crate) fn new(body: B, within: Duration) -> Self {
        BodyDeadline {
            body,
            sleep: Box::pin(tokio::time::sleep_until(crate::config::deadline(
                Instant::now(),
                within,
            ))),
        }
    }
}

impl<B> http_body::Body for BodyDeadline<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame.map(|f| f.map_err(Into::into))),
            Poll::Pending => match this.sleep.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(
                    "the request's body did not arrive within the body timeout".into(),
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Where a request came from, put in its extensions by the listener.
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr {
    /// The peer's address.
    pub addr: SocketAddr,
    /// Whether it came over TLS.
    pub tls: bool,
}

/// The `for=` of a `Forwarded` element: an IPv6 address is quoted.
fn forwarded_node(addr: SocketAddr) -> String {
    match addr {
        SocketAddr::V4(v4) => v4.ip().to_string(),
        SocketAddr::V6(v6) => format!("\"[{}]\"", v6.ip()),
    }
}

/// The client: pooled, HTTP/1.1 or HTTP/2 with prior knowledge.
#[derive(Clone)]
pub struct Forwarder {
    client: Client<HttpConnector, Body>,
    upstream: Upstream,
    http2: bool,
    timeout: Duration,
    fence_header: HeaderName,
    attempt_header: HeaderName,
    vary_on: Option<HeaderName>,
    max_buffer: usize,
    /// With HTTP/2: whether the upstream was seen to speak it. Until then
    /// each protected request checks first, so none is sent to an
    /// upstream that would fail it after it was sent.
    http2_checked: Arc<AtomicBool>,
    /// One permit per protected call on the upstream (`--max-running`).
    running: Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("upstream", &self.upstream)
            .field("http2", &self.http2)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// How an upstream call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// No connection: the request was never sent. Safe to run again.
    Connect,
    /// No answer in time: the upstream may have acted.
    Timeout,
    /// The connection broke after the request may have been sent.
    Broken,
}

impl Failure {
    fn as_str(self) -> &'static str {
        match self {
            Failure::Connect => "connect",
            Failure::Timeout => "timeout",
            Failure::Broken => "broken",
        }
    }
}

impl Forwarder {
    /// A client for `upstream` (see [`Settings`](crate::Settings) for
    /// each value). With `vary_on`, a protected request's answer varies on
    /// that request header: a replay needs the same value (the JWT a
    /// tenant was read from), else the caller gets 422.
    pub fn new(settings: &crate::Settings, vary_on: Option<HeaderName>) -> Forwarder {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(settings.upstream_timeout.min(Duration::from_secs(10))));
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(settings.upstream_idle_timeout.min(crate::config::LONGEST))
            .pool_max_idle_per_host(settings.upstream_idle_connections)
            .http2_only(settings.upstream_http2)
            .build(connector);
        Forwarder {
            client,
            upstream: settings.upstream.clone(),
            http2: settings.upstream_http2,
            timeout: settings.upstream_timeout,
            fence_header: settings.fence_header.clone(),
            attempt_header: settings.attempt_header.clone(),
            vary_on,
            max_buffer: settings.max_response_bytes,
            http2_checked: Arc::new(AtomicBool::new(!settings.upstream_http2)),
            running: Arc::new(tokio::sync::Semaphore::new(
                settings
                    .max_running
                    .min(tokio::sync::Semaphore::MAX_PERMITS),
            )),
        }
    }

    /// With HTTP/2 to the upstream, checks that it speaks it: an
    /// `OPTIONS` of its base path, whatever the answer's status. An
    /// upstream that cannot be reached now passes (it is logged); one
    /// that answers but not in HTTP/2 is an error. A request sent to an
    /// upstream that does not speak HTTP/2 fails after it was sent, and
    /// the proxy cannot tell that nothing ran.
    pub(crate) async fn check_http2(&self) -> Result<(), String> {
        let pq = PathAndQuery::from_static("/");
        let uri = self
            .upstream
            .uri_for(Some(&pq))
            .map_err(|e| e.to_string())?;
        let request = Request::builder()
            .method(http::Method::OPTIONS)
            .uri(uri)
            .version(Version::HTTP_2)
            .body(Body::empty())
            .map_err(|e| e.to_string())?;
        let limit = self.timeout.min(Duration::from_secs(10));
        match tokio::time::timeout(limit, self.client.request(request)).await {
            // An answer, or a stream refused in HTTP/2: it speaks it.
            Ok(Ok(_)) => {
                self.http2_checked.store(true, Ordering::Release);
                Ok(())
            }
            Ok(Err(e)) if refused_stream(&e) => {
                self.http2_checked.store(true, Ordering::Release);
                Ok(())
            }
            // Only a connection that could not be made says nothing: one
            // made that fails the HTTP/2 handshake or the request is an
            // upstream that does not speak it.
            Ok(Err(e)) if e.is_connect() => {
                tracing::warn!(error = %e, upstream = %self.upstream.url(), "idem proxy: the upstream cannot be reached to check that it speaks HTTP/2 (--upstream-http2); checked again before the first request");
                Ok(())
            }
            Ok(Err(e)) => Err(format!(
                "the upstream at {} does not speak HTTP/2 with prior knowledge (h2c): {e}; leave --upstream-http2 out for HTTP/1.1",
                self.upstream.url()
            )),
            Err(_) => {
                tracing::warn!(upstream = %self.upstream.url(), "idem proxy: the upstream did not answer the HTTP/2 check in time; checked again before the first request");
                Ok(())
            }
        }
    }

    /// The request as the upstream gets it.
    fn upstream_request(&self, request: Request<Body>) -> Result<Request<Body>, http::Error> {
        let (mut parts, body) = request.into_parts();
        // The authority of an absolute-form target wins over `Host` (RFC
        // 9112 section 3.2.2), as in the fingerprint.
        let client_host = parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
            .or_else(|| parts.headers.get(header::HOST).cloned());
        let headers = &mut parts.headers;
        strip_hop_by_hop(headers);
        // The fence and attempt come from the proxy alone.
        headers.remove(&self.fence_header);
        headers.remove(&self.attempt_header);
        if let Some(context) = parts.extensions.get::<idem_core::Context>() {
            headers.insert(self.fence_header.clone(), HeaderValue::from(context.fence));
            headers.insert(
                self.attempt_header.clone(),
                HeaderValue::from(context.attempt),
            );
        }
        if let Some(client) = parts.extensions.get::<ClientAddr>() {
            let proto = if client.tls { "https" } else { "http" };
            let mut element = format!("for={};proto={proto}", forwarded_node(client.addr));
            if let Some(host) = client_host.as_ref().and_then(|h| h.to_str().ok()) {
                if !host.is_empty()
                    && host
                        .bytes()
                        .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
                {
                    element.push_str(&format!(";host=\"{host}\""));
                }
            }
            append_list(headers, header::FORWARDED, &element);
            append_list(
                headers,
                HeaderName::from_static("x-forwarded-for"),
                &client.addr.ip().to_string(),
            );
            headers.insert(
                HeaderName::from_static("x-forwarded-proto"),
                HeaderValue::from_static(proto),
            );
            if let Some(host) = client_host {
                headers.insert(HeaderName::from_static("x-forwarded-host"), host);
            }
        }
        headers.remove(header::HOST);
        if !self.http2 {
            if let Ok(host) = HeaderValue::from_str(self.upstream.authority.as_str()) {
                headers.insert(header::HOST, host);
            }
        }
        let uri = self.upstream.uri_for(parts.uri.path_and_query())?;
        let mut builder = Request::builder()
            .method(parts.method)
            .uri(uri)
            .version(if self.http2 {
                Version::HTTP_2
            } else {
                Version::HTTP_11
            });
        *builder.headers_mut().expect("a fresh builder has headers") = parts.headers;
        builder.body(body)
    }

    /// Forwards `request`; never fails: a failure is an answer (502, 504)
    /// that says to the layer whether the upstream may have acted.
    pub fn forward(
        &self,
        request: Request<Body>,
    ) -> Pin<Box<dyn Future<Output = Response<Body>> + Send>> {
        let this = self.clone();
        Box::pin(async move { this.forward_now(request).await })
    }

    async fn forward_now(self, request: Request<Body>) -> Response<Body> {
        let started = Instant::now();
        let deadline = crate::config::deadline(started, self.timeout);
        // Read before the request is rebuilt for the upstream (the
        // extensions stay behind).
        let protected = request.extensions().get::<idem_core::Context>().is_some();
        // Runs whose clients went away keep running: a permit per protected
        // call, held until it ends (its answer's body included), bounds
        // them. A replay, a 409 or a duplicate waiting never gets here.
        let permit = if protected {
            match self.running.clone().try_acquire_owned() {
                Ok(permit) => Some(RunPermit { _held: permit }),
                Err(_) => {
                    telemetry::upstream_failed("busy");
                    let mut response = answer(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "Too many requests are running on the upstream; nothing was sent. Retry later.",
                    );
                    response
                        .headers_mut()
                        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                    response.extensions_mut().insert(NothingHappened);
                    return response;
                }
            }
        } else {
            None
        };
        if protected && !self.http2_checked.load(Ordering::Acquire) {
            if let Err(e) = self.check_http2().await {
                tracing::error!(error = %e, "idem proxy: the request was not sent");
                let mut response = answer(
                    StatusCode::BAD_GATEWAY,
                    "The upstream does not speak HTTP/2. The request was not sent; a retry may help once it does.",
                );
                response.extensions_mut().insert(NothingHappened);
                return response;
            }
        }
        let request = match self.upstream_request(request) {
            Ok(request) => request,
            Err(e) => {
                tracing::warn!(error = %e, "idem proxy: the request cannot be forwarded");
                // Nothing was sent.
                return answer(StatusCode::BAD_REQUEST, "The request cannot be forwarded.");
            }
        };
        let mut request = request;
        // Whether a connection was ever handed to the request: without
        // one, nothing was sent, whatever ended the call.
        let connection = capture_connection(&mut request);
        let result = tokio::time::timeout_at(deadline, self.client.request(request)).await;
        let connected = connection.connection_metadata().is_some();
        let failure = match result {
            Ok(Ok(response)) => {
                telemetry::upstream_answered(started.elapsed());
                let (mut parts, body) = response.into_parts();
                // The caller's connection is the proxy's own: an HTTP/1.0
                // upstream's answer does not end its keep-alive.
                parts.version = Version::HTTP_11;
                strip_hop_by_hop(&mut parts.headers);
                if let (true, Some(name)) = (protected, &self.vary_on) {
                    if let Ok(value) = HeaderValue::from_str(name.as_str()) {
                        parts.headers.append(header::VARY, value);
                    }
                }
                // An answer whose length is known and fits the record is
                // read whole first: the layer records it before its caller
                // gets the last byte, so a retry sent at once is the replay.
                let small = parts
                    .headers
                    .get(header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<usize>().ok())
                    .is_some_and(|n| n <= self.max_buffer);
                if small {
                    use http_body_util::BodyExt as _;
                    match tokio::time::timeout_at(deadline, body.collect()).await {
                        Ok(Ok(collected)) => {
                            return Response::from_parts(parts, Body::from(collected.to_bytes()))
                        }
                        _ => {
                            telemetry::upstream_failed(Failure::Broken.as_str());
                            return not_replayable(
                                StatusCode::BAD_GATEWAY,
                                "The upstream's answer broke off: it may have acted. This key will not run again.",
                                "the upstream's body broke off or did not end in time",
                            );
                        }
                    }
                }
                let body = Body::new(Deadline::new(body, permit, deadline));
                return Response::from_parts(parts, body);
            }
            Ok(Err(e)) if e.is_connect() || !connected || refused_stream(&e) || handed_back(&e) => {
                tracing::warn!(error = %e, upstream = %self.upstream.url(), "idem proxy: the upstream cannot be reached or refused the stream; nothing was processed");
                Failure::Connect
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, upstream = %self.upstream.url(), "idem proxy: the upstream connection broke after the request was sent; the upstream may have acted");
                Failure::Broken
            }
            Err(_) if !connected => {
                tracing::warn!(timeout = ?self.timeout, upstream = %self.upstream.url(), "idem proxy: no connection to the upstream in time; nothing was sent");
                Failure::Connect
            }
            Err(_) => {
                tracing::error!(timeout = ?self.timeout, upstream = %self.upstream.url(), "idem proxy: the upstream did not answer in time; it may have acted");
                Failure::Timeout
            }
        };
        telemetry::upstream_failed(failure.as_str());
        match failure {
            Failure::Connect => {
                let mut response = answer(
                    StatusCode::BAD_GATEWAY,
                    "The upstream cannot be reached. The request was not sent; a retry may help.",
                );
                // Released whatever --release-status says.
                response.extensions_mut().insert(NothingHappened);
                response
            }
            Failure::Broken => not_replayable(
                StatusCode::BAD_GATEWAY,
                "The upstream's connection broke after the request was sent: it may have acted. This key will not run again.",
                "the upstream connection broke after the request was sent",
            ),
            Failure::Timeout => not_replayable(
                StatusCode::GATEWAY_TIMEOUT,
                "The upstream did not answer in time: it may have acted. This key will not run again.",
                "the upstream did not answer within the upstream timeout",
            ),
        }
    }
}

/// Whether the client handed the request back unsent. hyper-util's
/// client says `Canceled` exactly when the connection gave the request
/// back before writing it (hyper's dispatcher returned the message); it
/// has no method for it, so its message is read, and hyper's own
/// `is_canceled` below it.
fn handed_back(e: &hyper_util::client::legacy::Error) -> bool {
    if e.to_string() == "client error (Canceled)" {
        return true;
    }
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        if inner
            .downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_canceled)
        {
            return true;
        }
        source = inner.source();
    }
    false
}

/// Whether an HTTP/2 upstream refused the request's stream
/// (`REFUSED_STREAM`): RFC 9113 section 8.7 says it was not processed.
fn refused_stream(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(e);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            if h2.reason() == Some(h2::Reason::REFUSED_STREAM) && h2.is_remote() {
                return true;
            }
        }
        source = e.source();
    }
    false
}

/// Appends `element` to the list header `name`, every line the client
/// sent kept (RFC 9110 section 5.3: they are one list), as one line.
fn append_list(headers: &mut HeaderMap, name: HeaderName, element: &str) {
    let mut elements: Vec<&str> = headers
        .get_all(&name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .collect();
    elements.push(element);
    let joined = elements.join(", ");
    if let Ok(value) = HeaderValue::from_str(&joined) {
        headers.insert(name, value);
    }
}

/// An answer the proxy makes itself, as problem JSON.
pub(crate) fn answer(status: StatusCode, detail: &str) -> Response<Body> {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

fn not_replayable(status: StatusCode, detail: &str, reason: &str) -> Response<Body> {
    let mut response = answer(status, detail);
    response.extensions_mut().insert(NotReplayable::new(reason));
    response
}

/// The upstream's body, cut at the call's deadline: a body that stalls
/// ends as a failed body (the layer then completes the key "not
/// replayable"), and one whose reader stalls is dropped at the deadline
/// with its connection and the run's permit, never held for ever. A timer
/// task takes the body away at the deadline, whether or not anyone polls.
struct Deadline<B> {
    shared: Arc<std::sync::Mutex<Cut<B>>>,
    timer: tokio::task::JoinHandle<()>,
}

/// What the body and its timer share.
struct Cut<B> {
    /// The body and the run's permit; `None` once the deadline took them.
    held: Option<(B, Option<RunPermit>)>,
    /// Who waits for the body's next frame, woken when it is taken.
    waiting: Option<std::task::Waker>,
}

impl<B: Send + 'static> Deadline<B> {
    fn new(body: B, permit: Option<RunPermit>, deadline: Instant) -> Self {
        let shared = Arc::new(std::sync::Mutex::new(Cut {
            held: Some((body, permit)),
            waiting: None,
        }));
        let timer = tokio::spawn({
            let shared = shared.clone();
            async move {
                tokio::time::sleep_until(deadline).await;
                let (held, waiting) = {
                    let mut cut = shared.lock().unwrap_or_else(|p| p.into_inner());
                    (cut.held.take(), cut.waiting.take())
                };
                if held.is_some() {
                    telemetry::upstream_failed(Failure::Timeout.as_str());
                }
                drop(held);
                if let Some(waker) = waiting {
                    waker.wake();
                }
            }
        });
        Deadline { shared, timer }
    }
}

impl<B> Drop for Deadline<B> {
    fn drop(&mut self) {
        self.timer.abort();
    }
}

impl<B> http_body::Body for Deadline<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let mut cut = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        let Some((body, _)) = cut.held.as_mut() else {
            return Poll::Ready(Some(Err(
                "the upstream's body did not end within the upstream timeout".into(),
            )));
        };
        match Pin::new(body).poll_frame(cx) {
            Poll::Ready(None) => {
                // Ended: the connection and the permit go back now.
                cut.held = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(frame)) => Poll::Ready(Some(frame.map_err(Into::into))),
            Poll::Pending => {
                cut.waiting = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        let cut = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        cut.held
            .as_ref()
            .is_some_and(|(body, _)| body.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let cut = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        cut.held
            .as_ref()
            .map_or_else(http_body::SizeHint::default, |(body, _)| body.size_hint())
    }
}

impl tower::Service<Request<Body>> for Forwarder {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.forward(request).await) })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_the_ones_connection_names_are_dropped() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "close, x-secret"),
            ("x-secret", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("proxy-connection", "keep-alive"),
            ("x-kept", "yes"),
        ] {
            h.append(k, HeaderValue::from_static(v));
        }
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert_eq!(h["x-kept"], "yes");
    }

    #[test]
    fn the_upstream_url_is_plain_http_with_an_optional_base() {
        let u = Upstream::parse("http://127.0.0.1:8000/api/").unwrap();
        let pq: PathAndQuery = "/pay?x=1".parse().unwrap();
        assert_eq!(
            u.uri_for(Some(&pq)).unwrap(),
            "http://127.0.0.1:8000/api/pay?x=1"
        );
        assert!(Upstream::parse("https://x").is_err());
        assert!(Upstream::parse("http://u:p@x").is_err());
        assert!(Upstream::parse("not a url").is_err());
    }
}
