//! `idem proxy`: the idem `Idempotency-Key` layer in front of any HTTP
//! upstream, whatever its language.
//!
//! Every protected request (by default `POST` and `PATCH` on every path)
//! goes through [`idem_http::IdempotencyLayer`] before it is forwarded: the
//! first with a key runs on the upstream, detached from its client, and
//! its answer is recorded; a retry gets the recorded answer
//! (`Idempotent-Replayed: true`) and the upstream never sees it; a
//! duplicate while it runs gets `409`, another body under the key `422`,
//! a store away `503`. Other requests pass through untouched, their bodies
//! streamed.
//!
//! The upstream gets the acquisition's fence and attempt in headers
//! (`idem-fence`, `idem-attempt`), to refuse a stale writer after a
//! takeover. A failure of the upstream is answered as the layer answers a
//! failing handler: no connection (nothing sent) is `502` and releases the
//! key; the upstream's own `502`/`503`/`504` release it; a timeout or a
//! connection that broke after the request was sent is `504`/`502` and
//! completes the key "not replayable": the upstream may have acted, so it
//! never runs again for that key.
//!
//! The command is `idem proxy` (crate `idem-cli`); this crate is its
//! library: [`ProxyArgs`] (flags and the TOML file), [`Settings`],
//! [`Proxy`].
#![deny(missing_docs)]

mod config;
mod routes;
mod server;
mod store;
pub mod telemetry;
mod tenant;
mod tls;
mod upstream;

pub use config::{parse_duration, ConfigError, LogFormat, ProxyArgs, Settings, TlsFiles};
pub use routes::{matching_form, matching_forms, normal_form, Routes};
pub use server::{Drained, Proxy, ProxyError};
pub use store::{open as open_store, redacted, OpenError};
pub use tenant::{ClientCertificate, TenantSource};
pub use tls::TlsError;
pub use upstream::{ClientAddr, Forwarder, Upstream};
