//! The proxy: the listener, one connection's requests, the idempotency
//! layer in front of the forwarder, and the graceful shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use idem_core::{Idempotency, IdempotencyStore, InProgressPolicy};
use idem_http::{
    DetachedTasks, FingerprintExtra, IdempotencyLayer, IdempotencyService, KeyPath,
    IDEMPOTENT_REPLAYED,
};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tower::{Layer as _, ServiceExt as _};

use crate::config::Settings;
use crate::store::{self, OpenError};
use crate::telemetry;
use crate::tls::{self, TlsError};
use crate::upstream::{answer, BodyDeadline, ClientAddr, Forwarder};

/// Why the proxy cannot start or serve.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProxyError {
    /// The store or a cache tier cannot be opened.
    #[error(transparent)]
    Store(#[from] OpenError),
    /// The address cannot be listened on.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// TLS cannot be set up from the files given.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A setting the layer refused.
    #[error("{0}")]
    Layer(String),
    /// `--upstream-http2`, and the upstream answered but not in HTTP/2:
    /// every request sent to it would fail after it was sent (and its key
    /// could not run again). A retry will not help: the setting must
    /// change.
    #[error("--upstream-http2: {0}")]
    NotHttp2(String),
}

impl ProxyError {
    /// Whether trying again later may help (a store that did not answer, an
    /// address still in use).
    pub fn is_retryable(&self) -> bool {
        match self {
            ProxyError::Store(e) => e.is_retryable(),
            ProxyError::Listen { .. } => true,
            ProxyError::Tls(_) | ProxyError::Layer(_) | ProxyError::NotHttp2(_) => false,
        }
    }
}

type Protected = IdempotencyService<dyn IdempotencyStore, Forwarder>;

struct State {
    protected: Protected,
    forwarder: Forwarder,
    settings: Settings,
    metrics: Option<PrometheusHandle>,
    tasks: DetachedTasks,
    draining: AtomicBool,
}

/// The proxy, its store open, ready to serve.
pub struct Proxy {
    state: Arc<State>,
    tls: Option<TlsAcceptor>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("upstream", &self.state.settings.upstream)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

/// How a shutdown ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// Connections still open when the wait ran out (cut).
    pub connections_cut: bool,
    /// Detached runs still going when the wait ran out: their keys stay in
    /// progress until their leases end.
    pub runs_left: usize,
}

impl Proxy {
    /// Opens the store and builds the layer; `metrics` renders `/metrics`
    /// (from [`telemetry::install_recorder`]).
    ///
    /// # Errors
    ///
    /// [`ProxyError::Store`] when the store cannot be opened (retryable if
    /// it did not answer), [`ProxyError::Tls`] for TLS files that do not
    /// work.
    pub async fn new(
        settings: Settings,
        metrics: Option<PrometheusHandle>,
    ) -> Result<Proxy, ProxyError> {
        let tls = settings.tls.as_ref().map(tls::acceptor).transpose()?;
        let store = store::open(
            &settings.store,
            &settings.caches,
            settings.migrate,
            settings.store_connections,
        )
        .await?;
        let mut idem: Idempotency<dyn IdempotencyStore> = Idempotency::from_arc(store)
            .lease(settings.lease)
            .retention(settings.retention)
            .heartbeat(true);
        if !settings.wait.is_zero() {
            idem = idem.on_in_progress(InProgressPolicy::Wait {
                max_wait: settings.wait,
                poll: Duration::from_millis(20),
            });
        }
        let release = settings.release_status.clone();
        let tenant = settings.tenant.clone();
        let layer = IdempotencyLayer::new(idem)
            .scope(settings.scope.clone())
            .map_err(|e| ProxyError::Layer(format!("--scope: {e}")))?
            .header_name(settings.key_header.clone())
            .map_err(|e| ProxyError::Layer(format!("--key-header: {e}")))?
            // The routes choose what is protected, in any method.
            .every_method()
            .required(!settings.optional_key)
            .max_body_bytes(settings.max_body_bytes)
            .max_response_bytes(settings.max_response_bytes)
            .max_retry_after(settings.retry_after)
            .fingerprint(settings.fingerprint.clone())
            .allow_anonymous(settings.allow_anonymous)
            .record_status(move |status| !release.contains(&status))
            .tenant(move |parts| tenant.of(parts))
            .detached(true);
        let tasks = layer.detached_tasks();
        // A JWT is read, not verified: a replay needs the very token the
        // request ran with, so a token forged for another subject gets
        // 422, never that subject's recorded answer.
        let vary_on = matches!(settings.tenant, crate::tenant::TenantSource::JwtSubject)
            .then_some(http::header::AUTHORIZATION);
        let forwarder = Forwarder::new(&settings, vary_on);
        if settings.upstream_http2 {
            forwarder
                .check_http2()
                .await
                .map_err(ProxyError::NotHttp2)?;
        }
        let protected = layer.layer(forwarder.clone());
        Ok(Proxy {
            state: Arc::new(State {
                protected,
                forwarder,
                settings,
                metrics,
                tasks,
                draining: AtomicBool::new(false),
            }),
            tls,
        })
    }

    /// Binds the settings' address.
    ///
    /// # Errors
    ///
    /// [`ProxyError::Listen`] when the address cannot be bound.
    pub async fn bind(&self) -> Result<TcpListener, ProxyError> {
        let addr = self.state.settings.listen;
        TcpListener::bind(addr)
            .await
            .map_err(|source| ProxyError::Listen { addr, source })
    }

    /// Serves `listener` until `shutdown` ends; then stops accepting,
    /// lets the connections finish their requests and waits for the
    /// detached runs (a client that went away leaves its run going) to end
    /// and be recorded, all within the shutdown wait.
    pub async fn serve(self, listener: TcpListener, shutdown: impl Future<Output = ()>) -> Drained {
        let graceful = GracefulShutdown::new();
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(self.state.settings.header_timeout)
            // A client that shuts its side after the request still gets
            // the answer.
            .half_close(true);
        builder
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(Some(Duration::from_secs(30)))
            .keep_alive_timeout(Duration::from_secs(10));
        let builder = Arc::new(builder);
        let first_request = self.state.settings.header_timeout;
        tokio::pin!(shutdown);
        loop {
            let (stream, peer) = tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors and the like: wait a little.
                        tracing::warn!(error = %e, "idem proxy: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = stream.set_nodelay(true);
            let state = self.state.clone();
            let builder = builder.clone();
            match &self.tls {
                None => {
                    let client = ClientAddr {
                        addr: peer,
                        tls: false,
                    };
                    let seen = Arc::new(AtomicBool::new(false));
                    let service = {
                        let seen = seen.clone();
                        hyper::service::service_fn(move |request| {
                            seen.store(true, Ordering::Relaxed);
                            Box::pin(dispatch(state.clone(), client, None, request))
                                as Pin<Box<dyn Future<Output = _> + Send>>
                        })
                    };
                    let conn = builder
                        .serve_connection(TokioIo::new(stream), service)
                        .into_owned();
                    let conn = graceful.watch(conn);
                    tokio::spawn(until_silent_cut(conn, seen, first_request));
                }
                Some(acceptor) => {
                    let acceptor = acceptor.clone();
                    let watcher = graceful.watcher();
                    tokio::spawn(async move {
                        let tls = match tokio::time::timeout(
                            Duration::from_secs(10),
                            acceptor.accept(stream),
                        )
                        .await
                        {
                            Ok(Ok(tls)) => tls,
                            Ok(Err(e)) => {
                                tracing::debug!(error = %e, peer = %peer, "idem proxy: TLS handshake failed");
                                return;
                            }
                            Err(_) => return,
                        };
                        let identity = tls::client_identity(tls.get_ref().1.peer_certificates());
                        let client = ClientAddr {
                            addr: peer,
                            tls: true,
                        };
                        let seen = Arc::new(AtomicBool::new(false));
                        let service = {
                            let seen = seen.clone();
                            hyper::service::service_fn(move |request| {
                                seen.store(true, Ordering::Relaxed);
                                Box::pin(dispatch(state.clone(), client, identity.clone(), request))
                                    as Pin<Box<dyn Future<Output = _> + Send>>
                            })
                        };
                        let conn = builder
                            .serve_connection(TokioIo::new(tls), service)
                            .into_owned();
                        until_silent_cut(watcher.watch(conn), seen, first_request).await;
                    });
                }
            }
        }
        drop(listener);
        self.state.draining.store(true, Ordering::Release);
        let wait = self.state.settings.shutdown_wait;
        let deadline = crate::config::deadline(Instant::now(), wait);
        tracing::info!(wait = ?wait, "idem proxy: shutting down; requests in flight finish first");
        let connections_cut = tokio::time::timeout_at(deadline, graceful.shutdown())
            .await
            .is_err();
        let runs = tokio::time::timeout_at(deadline, self.state.tasks.idle()).await;
        let runs_left = if runs.is_err() {
            self.state.tasks.running()
        } else {
            0
        };
        if connections_cut || runs_left > 0 {
            tracing::warn!(connections_cut, runs_left, "idem proxy: the shutdown wait ran out; keys still running stay in progress until their leases end");
        }
        Drained {
            connections_cut,
            runs_left,
        }
    }
}

/// Serves a connection; one that has sent no request within `first`
/// (`--header-timeout`: nothing, a byte, an HTTP/2 preface alone) is cut,
/// so silent connections never pile up.
async fn until_silent_cut<C, E>(conn: C, seen: Arc<AtomicBool>, first: Duration)
where
    C: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    tokio::pin!(conn);
    let ended = match tokio::time::timeout(first, &mut conn).await {
        Ok(ended) => ended,
        Err(_) if !seen.load(Ordering::Relaxed) => {
            tracing::debug!("idem proxy: a connection sent no request in time; closed");
            return;
        }
        Err(_) => conn.await,
    };
    if let Err(e) = ended {
        tracing::debug!(error = %e, "idem proxy: connection ended with an error");
    }
}

/// A `Host` (or an authority) without its port, in lower case: the name
/// an upstream that serves several hosts tells them apart by (the port
/// of a proxy restarted elsewhere does not make another request).
fn host_name(host: &[u8]) -> Vec<u8> {
    let name = match host.iter().rposition(|b| *b == b':') {
        Some(colon)
            if host[colon + 1..].iter().all(u8::is_ascii_digit)
                && (host.first() != Some(&b'[') || host[..colon].ends_with(b"]")) =>
        {
            &host[..colon]
        }
        _ => host,
    };
    name.to_ascii_lowercase()
}

fn plain(status: StatusCode, body: String, content_type: &'static str) -> Response<Body> {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

async fn dispatch(
    state: Arc<State>,
    client: ClientAddr,
    identity: Option<crate::tenant::ClientCertificate>,
    request: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let started = Instant::now();
    let path = request.uri().path();
    let settings = &state.settings;
    let own = matches!(*request.method(), Method::GET | Method::HEAD);
    if own && settings.health_path.as_deref() == Some(path) {
        return Ok(if state.draining.load(Ordering::Acquire) {
            plain(
                StatusCode::SERVICE_UNAVAILABLE,
                "draining\n".into(),
                "text/plain",
            )
        } else {
            plain(StatusCode::OK, "ok\n".into(), "text/plain")
        });
    }
    if own && settings.metrics_path.as_deref() == Some(path) {
        metrics::gauge!(telemetry::DETACHED).set(state.tasks.running() as f64);
        return Ok(match &state.metrics {
            Some(handle) => plain(StatusCode::OK, handle.render(), "text/plain; version=0.0.4"),
            None => answer(
                StatusCode::SERVICE_UNAVAILABLE,
                "No metrics recorder in this process.",
            ),
        });
    }
    let method = request.method().clone();
    // A standard method spelt otherwise (`post`, `Head`): refused, nothing
    // sent. A server that reads methods without regard to case would take
    // it for the method, while HTTP clients (the proxy's own included)
    // frame its answer as an unknown method's.
    if is_misspelt_standard_method(&method) {
        return Ok(answer(
            StatusCode::BAD_REQUEST,
            "Methods are case-sensitive: send the standard method in upper case.",
        ));
    }
    let path = path.to_owned();
    // Routes are chosen, and keys made, on one form of the path however a
    // client spells it (`//pay`, `/./pay`, `/%70ay`, `/pay/`).
    let (normal, protected_as) = settings.routes.route(&method, &path);
    let base = settings.upstream.base();
    // Under a base path, no spelling climbs out of it.
    if !base.is_empty() {
        let base_form = crate::routes::matching_form(base);
        let inside =
            |joined: &String| *joined == base_form || joined.starts_with(&format!("{base_form}/"));
        if !crate::routes::matching_forms(&format!("{base}{normal}"))
            .iter()
            .all(inside)
        {
            return Ok(answer(
                StatusCode::BAD_REQUEST,
                "The request's path leaves the upstream's base path.",
            ));
        }
    }
    let mut request = request.map(Body::new);
    request.extensions_mut().insert(client);
    if let Some(identity) = identity {
        request.extensions_mut().insert(identity);
    }
    // The upstream gets the path in its normal form (no dot segments, one
    // spelling of each character): the path the routes were chosen on.
    if normal != path {
        let pq = match request.uri().query() {
            Some(query) => format!("{normal}?{query}"),
            None => normal,
        };
        let mut parts = request.uri().clone().into_parts();
        parts.path_and_query = pq.parse().ok();
        match Uri::from_parts(parts) {
            Ok(uri) if uri.path_and_query().is_some() => *request.uri_mut() = uri,
            _ => {
                return Ok(answer(
                    StatusCode::BAD_REQUEST,
                    "The request's path cannot be put in its normal form.",
                ))
            }
        }
    }
    let (route, response) = if let Some(key_path) = protected_as {
        let (parts, body) = request.into_parts();
        // A credential that names no tenant (the header twice or empty, a
        // token that is not a JWT) is never anonymous: its answer could
        // hold what the credential opened.
        if settings.allow_anonymous
            && settings.tenant.offered(&parts)
            && settings.tenant.of(&parts).is_none()
        {
            return Ok(answer(
                StatusCode::UNAUTHORIZED,
                "The request's credential names no caller; send it once, or none.",
            ));
        }
        let host = parts
            .uri
            .authority()
            .map(|a| a.as_str().as_bytes())
            .or_else(|| parts.headers.get(header::HOST).map(HeaderValue::as_bytes))
            .map(host_name)
            .unwrap_or_default();
        // The body the layer reads whole before anything runs must come
        // in time; a request without a key (`--optional-key`) streams on
        // to the upstream unprotected and is not held to it.
        let body = if parts.headers.contains_key(&settings.key_header) {
            Body::new(BodyDeadline::new(body, settings.body_timeout))
        } else {
            Body::new(body)
        };
        let mut request = Request::from_parts(parts, body);
        let extensions = request.extensions_mut();
        extensions.insert(KeyPath::new(key_path));
        // An upstream may serve several hosts: another host under one key
        // is another request (422), never the first one's replay.
        extensions.insert(FingerprintExtra::new([b"host ".as_slice(), &host].concat()));
        let call: Pin<Box<dyn Future<Output = Result<_, Infallible>> + Send>> =
            Box::pin(state.protected.clone().oneshot(request));
        let response = match call.await {
            Ok(response) => response.map(Body::new),
            Err(never) => match never {},
        };
        ("protected", response)
    } else {
        ("passed", state.forwarder.forward(request).await)
    };
    let replayed = response.headers().contains_key(IDEMPOTENT_REPLAYED);
    let status = response.status().as_u16();
    let took = started.elapsed();
    telemetry::answered(route, status, replayed, took);
    tracing::info!(
        target: "idem_proxy::access",
        method = %method,
        path = %path,
        route,
        status,
        replayed,
        peer = %client.addr,
        ms = took.as_secs_f64() * 1e3,
        "request"
    );
    Ok(response)
}

/// Whether `method` is a standard method in another case (`post`).
fn is_misspelt_standard_method(method: &Method) -> bool {
    [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::PATCH,
        Method::DELETE,
        Method::OPTIONS,
        Method::TRACE,
        Method::CONNECT,
    ]
    .iter()
    .any(|m| m != method && m.as_str().eq_ignore_ascii_case(method.as_str()))
}
