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
//! | same key, different body or media type (or, with route templates, another path of the route) | `422 Unprocessable Content` |
//! | the same key value on another method or path | another key (both are part of it): runs on its own |
//! | completed, but the response varies (`Vary`) on a header this request sends otherwise | `422 Unprocessable Content` (`Vary: *`: not replayable, 409) |
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
//! 1 MiB): a body that is all there when the handler returns is read up to
//! the limit and recorded if it ends within it, and its caller gets it once
//! it is recorded. A body still coming (an NDJSON stream, a proxied
//! upstream) goes to its caller at once, head first, each frame as it
//! comes, while the layer keeps a copy: recorded when the body ends within
//! the limit (a duplicate meanwhile gets `409`, then the replay). A longer
//! body, and every `text/event-stream` (which is never read ahead), reaches
//! its caller in full, streamed, and its key is completed as "not
//! replayable" once the limit is passed (at once for an event stream): the
//! handler never runs again for it, and duplicates get the `409` above.
//! (With `.detached(false)`, a body is read up to the limit before its
//! caller gets the head.)
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

mod detached;
mod fingerprint;
mod finishing;
#[cfg(feature = "postgres")]
mod in_tx;
mod key;
mod layer;
mod problem;
mod recorded;
mod request;
mod response;
mod service;
mod tee;

/// The axum this crate reads `OriginalUri` from (feature `axum`).
#[cfg(feature = "axum")]
pub use axum;
/// The `http` crate whose types this layer takes and returns
/// (`idemkit::http::http`).
pub use http;
/// The `tower` crate whose `Layer` and `Service` this crate implements
/// (`idemkit::http::tower`).
pub use tower;

// The crate docs link to it.
pub use detached::DetachedTasks;
pub use fingerprint::FingerprintExtra;
#[cfg(doc)]
use idem_core::Idempotency;
#[cfg(feature = "postgres")]
pub use idem_core::{TxEnded, TxGuard};
#[cfg(feature = "postgres")]
pub use in_tx::{RequestTx, DEFAULT_TRANSACTION_WAIT};
pub use key::{request_key, KeyPath, RequestKeyError};
pub use layer::IdempotencyLayer;
pub use problem::{Problem, ProblemKind};
pub use request::{ForbiddenHeaderName, IDEMPOTENCY_KEY, MAX_KEY_LEN};
pub use response::{default_record_status, BoxError, LayerBody, IDEMPOTENT_REPLAYED};
pub use service::{IdempotencyService, NotReplayable, NothingHappened};
