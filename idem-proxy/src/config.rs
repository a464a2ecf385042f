//! The proxy's options, as flags and as a TOML file, and their checked
//! form ([`Settings`]).
//!
//! Every option is both a flag (`--max-body-bytes`) and a key of the file
//! (`max_body_bytes`); a flag given wins over the file. Nothing is used
//! before it is checked: [`ProxyArgs::settings`] refuses a bad value with a
//! [`ConfigError`] that names it, before anything listens or connects.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use http::header::HeaderName;
use http::StatusCode;
use idem_core::{IdempotencyKey, PayloadFingerprint};
use serde::Deserialize;

use crate::routes::Routes;
use crate::tenant::TenantSource;
use crate::upstream::Upstream;

/// Why the options cannot be used; nothing was started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// An option's value is not valid.
    #[error("{option}: {reason}")]
    Invalid {
        /// The option, as its flag.
        option: &'static str,
        /// Why.
        reason: String,
    },
    /// A required option is missing.
    #[error("{0} is required (a flag, or a key of the --config file)")]
    Missing(&'static str),
    /// The config file cannot be read or parsed.
    #[error("config file {path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// A duration in the TOML file: text (`"30s"`) or a number of seconds
/// (`30`, `1.5`).
fn duration_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Given {
        Text(String),
        Whole(u64),
        Number(f64),
    }
    Ok(Some(match Given::deserialize(d)? {
        Given::Text(text) => text,
        Given::Whole(n) => n.to_string(),
        Given::Number(n) => n.to_string(),
    }))
}

fn invalid(option: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        option,
        reason: reason.into(),
    }
}

/// Declares [`ProxyArgs`] and its overlay from one list of options, so an
/// option is spelled once here and once in [`Settings`].
macro_rules! options {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[$field_meta:meta])* pub $field:ident : $ty:ty, )*
        }
    ) => {
        $(#[$meta])*
        pub struct $name {
            $( $(#[$field_meta])* pub $field: $ty, )*
        }

        impl $name {
            /// Each option of `self` where it is given, else `under`'s.
            fn over(self, under: $name) -> $name {
                $name { $( $field: self.$field.or(under.$field), )* }
            }
        }
    };
}

options! {
    /// The options of `idem proxy`: flags, or keys of a TOML file with `_` for
    /// `-`. Each is optional here; [`ProxyArgs::settings`] applies the
    /// defaults and checks them.
    #[derive(Debug, Clone, Default, Deserialize, clap::Args)]
    #[serde(deny_unknown_fields)]
    #[non_exhaustive]
    pub struct ProxyArgs {
        /// A TOML file with any of these options (`max_body_bytes = 65536`);
        /// flags given win over it.
        #[arg(long)]
        #[serde(skip)]
        pub config: Option<PathBuf>,
        /// Address to listen on [default: 127.0.0.1:8080]; port 0 picks one
        /// (the line `idem proxy: listening on ...` says which).
        #[arg(long)]
        pub listen: Option<String>,
        /// The upstream every request goes to: `http://host:port`, optionally
        /// with a base path that prefixes every request's path.
        #[arg(long)]
        pub upstream: Option<String>,
        /// Speak HTTP/2 to the upstream with prior knowledge (h2c) instead of
        /// HTTP/1.1.
        #[arg(long, num_args = 0..=1, default_missing_value = "true")]
        pub upstream_http2: Option<bool>,
        /// The bound on one upstream call, head and body [default: 60s]. A
        /// protected request past it gets 504 and its key is completed "not
        /// replayable" (the upstream may have acted): it never runs again.
        #[arg(long)]
        #[serde(default, deserialize_with = "duration_text")]
        pub upstream_timeout: Option<String>,
        /// Connections kept idle per upstream host [default: 256].
        #[arg(long)]
        pub upstream_idle_connections: Option<usize>,
        /// How long an idle upstream connection is kept [default: 4s]. Keep it
        /// below the upstream's own keep-alive timeout (Node's is 5 s): a
        /// request sent on a connection the upstream is closing breaks, and a
        /// protected one is then completed "not replayable".
        #[arg(long)]
        #[serde(default, deserialize_with = "duration_text")]
        pub upstream_idle_timeout: Option<String>,
        /// The store: `memory`, `redis://...`, `rediss://...`,
        /// `redis+cluster://host:port,host:port`, `postgres://...` or
        /// `dynamodb://TABLE?region=...&endpoint=...`.
        #[arg(long)]
        pub store: Option<String>,
        /// A cache tier in front of the store, fastest first: `moka` (in this
        /// process) or `redis://...`; the store stays the source of truth.
        #[arg(long)]
        pub cache: Option<Vec<String>>,
        /// Run the PostgreSQL migrations at start [default: true].
        #[arg(long, num_args = 0..=1, default_missing_value = "true")]
        pub migrate: Option<bool>,
        /// PostgreSQL: the connections the store keeps for its calls
        /// [default: 4], 1 to 10000; concurrent calls share them in batches.
        #[arg(long)]
        pub store_connections: Option<usize>,
        /// The scope of the keys [default: http].
        #[arg(long)]
        pub scope: Option<String>,
        /// How long a request holds its key before another may take it over
        /// (renewed while the upstream works) [default: 60s].
        #[arg(long)]
        #[serde(default, deserialize_with = "duration_text")]
        pub lease: Option<String>,
        /// How long a recorded answer is replayed [default: 24h].
        #[arg(long)]
        #[serde(default, deserialize_with = "duration_text")]
        pub retention: Option<String>,
        /// A duplicate of a request still running waits up to this for its
        /// answer instead of getting 409 at once [default: 0s, no wait].
        #[arg(long)]
        #[serde(default, deserialize_with = "duration_text")]
        pub wait: Option<String>,
        /// The most the `Retry-After` of a 409 says [default: 1s]; the
        /// running request's remaining lease when that is shorter.
        #[arg(long)]
        #[serde(default, deserialize_with = "duration_text")]
        pub retry_after: Option<String>,
        /// The header carrying the client's key [default: Idempotency-Key].
        #[arg(long)]
        pub key_header: Option<String>,
        /// A protected request without a key passes through unprotected
        /// instead of getting 400.
        #[arg(long, num_args = 0..=1, default_missing_value = "true")]
        pub optional_key: Option<bool>,
        /// The largest request body of a protected request [default: 1048576];
        /// larger ones get 413 before anything runs.
        #[arg(long)]
        pub max_body_bytes: Option<usize>,
        /// The largest response body recorded [default: 1048576]; a longer one
        /// streams whole to its caller and its key is completed "not
        /// replayable".
        #[arg(long)]
        pub max_response_bytes: Option<usize>,
        /// Statuses of the upstream that release the key instead of being
        /// recorded [default: 401,408,425,429,502,503,504].
        #[arg(long, value_delimiter = ',')]
        pub release_status: Option<Vec<u16>>,
        /// Only these JSON pointers of a JSON body count in its fingerprint
        /// (repeat the flag); the whole body counts when none is given.
        #[arg(long)]
        pub fingerprint_pointer: Option<Vec<String>>,
        /// A protected route: `METHODS PREFIX` (`POST,PATCH /payments`, `*
        /// /orders`) or a prefix alone (POST and PATCH) [default: `POST,PATCH
        /// /`]. The first rule that matches wins; a request no rule matches is
        /// passed through.
        #[arg(long)]
        pub protect: Option<Vec<String>>,
        /// A path prefix passed through untouched, whatever the method; checked
        /// before the protected routes.
        #[arg(long)]
        pub pass: Option<Vec<String>>,
        /// The tenant is this request header's value (an API key; hashed before
        /// it is stored).
        #[arg(long)]
        pub tenant_header: Option<String>,
        /// The tenant is the issuer and subject of the bearer JWT in
        /// `Authorization`, read without verifying the token.
        #[arg(long, num_args = 0..=1, default_missing_value = "true")]
        pub tenant_jwt: Option<bool>,
        /// The tenant is the client certificate (its SHA-256), with TLS
        /// terminated here and `--tls-client-ca`.
        #[arg(long, num_args = 0..=1, default_missing_value = "true")]
        pub tenant_client_cert: Option<bool>,
        /// Requests without a tenant share one key space instead of getting
        /// 401.
        #[arg(long, num_args = 0..=1, default_missing_value = "true")]
        pub allow_anonymous: Option<bool>,
        /// The header that carries the acquisition's fence to the upstream
        /// [default: idem-fence]; a client's own is removed.
        #[arg(long)]
        pub fence_header: Option<String>,
        /// The header that carries the acquisition's attempt to the upstream
        /// [default: idem-attempt]; a client's own is removed.
        #[arg(long)]
        pub attempt_header: Option<String>,
        /// The most protected requests running on the upstream at once,
        /// those whose clients went away included [default: 4096]; past it a
        /// protected request gets 503 with Retry-After, nothing sent.
        #[arg(long)]
        pub max_running: Option<usize>,
        /// How long a protected request's body has to arrive whole
        /// [default: 60s]; a slower one gets 400, nothing sent.
        #[arg(long)]
        #[serde(default, deserialize_with = "duration_text")]
        pub body_timeout: Option<String>,
        /// How long a client has to send a request head whole, and a new
        /// connection its first request [default: 30s]; slower ones are cut.
        #[arg(long)]
        #[serde(default, deserialize_with = "duration_text")]
        pub header_timeout: Option<String>,
        /// How long a shutdown waits for requests in flight to end and be
        /// recorded [default: 30s].
        #[arg(long)]
        #[serde(default, deserialize_with = "duration_text")]
        pub shutdown_wait: Option<String>,
        /// Log lines as `text` or `json` [default: text].
        #[arg(long)]
        pub log_format: Option<String>,
        /// The proxy's own health path [default: /healthz]; empty to forward it.
        #[arg(long)]
        pub health_path: Option<String>,
        /// The proxy's Prometheus metrics path [default: /metrics]; empty to
        /// forward it.
        #[arg(long)]
        pub metrics_path: Option<String>,
        /// Terminate TLS here: the server certificate chain (PEM).
        #[arg(long)]
        pub tls_cert: Option<PathBuf>,
        /// The server certificate's private key (PEM).
        #[arg(long)]
        pub tls_key: Option<PathBuf>,
        /// Require client certificates signed by this CA (PEM).
        #[arg(long)]
        pub tls_client_ca: Option<PathBuf>,
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// TLS termination.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Certificate chain, PEM.
    pub cert: PathBuf,
    /// Private key, PEM.
    pub key: PathBuf,
    /// The CA client certificates must chain to, if they are required.
    pub client_ca: Option<PathBuf>,
}

/// The checked options: what the proxy runs with.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Settings {
    /// Where it listens.
    pub listen: SocketAddr,
    /// Where it forwards.
    pub upstream: Upstream,
    /// HTTP/2 with prior knowledge to the upstream.
    pub upstream_http2: bool,
    /// The bound on one upstream call.
    pub upstream_timeout: Duration,
    /// Idle connections kept per upstream host.
    pub upstream_idle_connections: usize,
    /// How long an idle upstream connection is kept.
    pub upstream_idle_timeout: Duration,
    /// The store's URL.
    pub store: String,
    /// Cache tiers in front of it.
    pub caches: Vec<String>,
    /// Run the PostgreSQL migrations at start.
    pub migrate: bool,
    /// PostgreSQL: the store's own connections.
    pub store_connections: usize,
    /// The keys' scope.
    pub scope: String,
    /// The lease.
    pub lease: Duration,
    /// The retention.
    pub retention: Duration,
    /// How long a duplicate waits for a running request's answer.
    pub wait: Duration,
    /// The most a 409's `Retry-After` says.
    pub retry_after: Duration,
    /// The key's header.
    pub key_header: HeaderName,
    /// Whether a protected request may come without a key.
    pub optional_key: bool,
    /// The largest protected request body.
    pub max_body_bytes: usize,
    /// The largest recorded response body.
    pub max_response_bytes: usize,
    /// Upstream statuses that release the key.
    pub release_status: Vec<StatusCode>,
    /// What of a body its fingerprint covers.
    pub fingerprint: PayloadFingerprint,
    /// Which requests are protected.
    pub routes: Routes,
    /// Who is calling.
    pub tenant: TenantSource,
    /// Whether callers without a tenant are served.
    pub allow_anonymous: bool,
    /// The fence's header to the upstream.
    pub fence_header: HeaderName,
    /// The attempt's header to the upstream.
    pub attempt_header: HeaderName,
    /// The bound on a graceful shutdown.
    pub shutdown_wait: Duration,
    /// How long a request head, and a connection's first request, may take.
    pub header_timeout: Duration,
    /// The most protected requests running at once.
    pub max_running: usize,
    /// How long a protected request's body may take to arrive.
    pub body_timeout: Duration,
    /// How logs are written.
    pub log_format: LogFormat,
    /// The proxy's health path (`None`: forwarded).
    pub health_path: Option<String>,
    /// The proxy's metrics path (`None`: forwarded).
    pub metrics_path: Option<String>,
    /// TLS termination, if on.
    pub tls: Option<TlsFiles>,
}

impl ProxyArgs {
    /// These flags over the file named by `--config` (if any).
    ///
    /// # Errors
    ///
    /// [`ConfigError::File`] when the file cannot be read, is not TOML, or
    /// names an option that does not exist.
    pub fn with_file(self) -> Result<ProxyArgs, ConfigError> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let text = std::fs::read_to_string(&path).map_err(|e| ConfigError::File {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let file: ProxyArgs = toml::from_str(&text).map_err(|e| ConfigError::File {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        Ok(self.over(file))
    }

    /// The settings, with the defaults, every value checked.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] naming the first option that is missing or not
    /// valid. A retry will not help: the options must change.
    pub fn settings(self) -> Result<Settings, ConfigError> {
        let a = self.with_file()?;
        let listen = a.listen.as_deref().unwrap_or("127.0.0.1:8080");
        let listen: SocketAddr = listen.parse().map_err(|_| {
            invalid(
                "--listen",
                format!("`{listen}` is not an IP address and port"),
            )
        })?;
        let upstream = Upstream::parse(
            a.upstream
                .as_deref()
                .ok_or(ConfigError::Missing("--upstream"))?,
        )
        .map_err(|reason| invalid("--upstream", reason))?;
        let store = a.store.ok_or(ConfigError::Missing("--store"))?;
        let scope = a.scope.unwrap_or_else(|| "http".to_owned());
        IdempotencyKey::new(scope.clone(), "-").map_err(|e| invalid("--scope", e.to_string()))?;
        let lease = duration("--lease", a.lease.as_deref(), Duration::from_secs(60))?;
        if lease < Duration::from_secs(1) {
            return Err(invalid(
                "--lease",
                "at least 1s: a shorter lease cannot be renewed in time, and a duplicate would take a running request over (was `m` meant?)",
            ));
        }
        let retention = duration(
            "--retention",
            a.retention.as_deref(),
            Duration::from_secs(86_400),
        )?;
        if retention.is_zero() {
            return Err(invalid("--retention", "a zero retention records nothing"));
        }
        let upstream_timeout = duration(
            "--upstream-timeout",
            a.upstream_timeout.as_deref(),
            Duration::from_secs(60),
        )?;
        if upstream_timeout.is_zero() {
            return Err(invalid("--upstream-timeout", "must be more than zero"));
        }
        let key_header = header("--key-header", a.key_header.as_deref(), "idempotency-key")?;
        let fence_header = header("--fence-header", a.fence_header.as_deref(), "idem-fence")?;
        let attempt_header = header(
            "--attempt-header",
            a.attempt_header.as_deref(),
            "idem-attempt",
        )?;
        if fence_header == attempt_header
            || fence_header == key_header
            || attempt_header == key_header
        {
            return Err(invalid(
                "--fence-header",
                "the key, fence and attempt headers must be three different headers",
            ));
        }
        if let Some(tenant) = a.tenant_header.as_deref() {
            if [&fence_header, &attempt_header]
                .iter()
                .any(|h| h.as_str().eq_ignore_ascii_case(tenant.trim()))
            {
                return Err(invalid(
                    "--fence-header",
                    "the fence and attempt headers replace the client's: they cannot be the tenant header",
                ));
            }
        }
        let release_status = match a.release_status {
            None => vec![401, 408, 425, 429, 502, 503, 504],
            Some(list) => list,
        }
        .into_iter()
        .map(|code| {
            StatusCode::from_u16(code)
                .ok()
                .filter(|s| s.as_u16() >= 100)
                .ok_or_else(|| invalid("--release-status", format!("{code} is not an HTTP status")))
        })
        .collect::<Result<Vec<_>, _>>()?;
        if release_status.iter().any(|s| s.is_success()) {
            return Err(invalid(
                "--release-status",
                "a 2xx answer says the upstream acted: releasing it would run it again",
            ));
        }
        let fingerprint = match a.fingerprint_pointer {
            None => PayloadFingerprint::Whole,
            Some(list) if list.is_empty() => PayloadFingerprint::Whole,
            Some(list) => PayloadFingerprint::json_pointers(list)
                .map_err(|e| invalid("--fingerprint-pointer", e.to_string()))?,
        };
        if a.protect.as_ref().is_some_and(Vec::is_empty) {
            return Err(invalid(
                "--protect",
                "an empty list protects nothing (every request would run as often as it is sent): leave it out for `POST,PATCH /`, or pass everything with `pass = [\"/\"]`",
            ));
        }
        let routes = Routes::parse(
            a.protect.as_deref().unwrap_or(&["POST,PATCH /".to_owned()]),
            a.pass.as_deref().unwrap_or(&[]),
        )?;
        let tls = match (a.tls_cert, a.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert,
                key,
                client_ca: a.tls_client_ca,
            }),
            (None, None) if a.tls_client_ca.is_none() => None,
            _ => return Err(invalid(
                "--tls-cert",
                "TLS needs --tls-cert and --tls-key together (and --tls-client-ca only with them)",
            )),
        };
        let tenant = TenantSource::choose(
            a.tenant_header.as_deref(),
            a.tenant_jwt.unwrap_or(false),
            a.tenant_client_cert.unwrap_or(false),
        )?;
        if matches!(tenant, TenantSource::ClientCert)
            && tls.as_ref().and_then(|t| t.client_ca.as_ref()).is_none()
        {
            return Err(invalid(
                "--tenant-client-cert",
                "needs TLS terminated here with client certificates: --tls-cert, --tls-key and --tls-client-ca",
            ));
        }
        let allow_anonymous = a.allow_anonymous.unwrap_or(false);
        let log_format = match a.log_format.as_deref().unwrap_or("text") {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => return Err(invalid("--log-format", format!("`{other}`: text or json"))),
        };
        let health_path = own_path("--health-path", a.health_path, "/healthz")?;
        let metrics_path = own_path("--metrics-path", a.metrics_path, "/metrics")?;
        let max_body_bytes = a.max_body_bytes.unwrap_or(1 << 20);
        let max_response_bytes = a.max_response_bytes.unwrap_or(1 << 20);
        Ok(Settings {
            listen,
            upstream,
            upstream_http2: a.upstream_http2.unwrap_or(false),
            upstream_timeout,
            upstream_idle_connections: a.upstream_idle_connections.unwrap_or(256),
            upstream_idle_timeout: duration(
                "--upstream-idle-timeout",
                a.upstream_idle_timeout.as_deref(),
                Duration::from_secs(4),
            )?,
            store,
            caches: a.cache.unwrap_or_default(),
            migrate: a.migrate.unwrap_or(true),
            store_connections: match a.store_connections {
                None => 4,
                Some(n @ 1..=10_000) => n,
                Some(n) => {
                    return Err(invalid(
                        "--store-connections",
                        format!("{n}: from 1 to 10000"),
                    ))
                }
            },
            scope,
            lease,
            retention,
            wait: duration("--wait", a.wait.as_deref(), Duration::ZERO)?,
            retry_after: duration(
                "--retry-after",
                a.retry_after.as_deref(),
                Duration::from_secs(1),
            )?,
            key_header,
            optional_key: a.optional_key.unwrap_or(false),
            max_body_bytes,
            max_response_bytes,
            release_status,
            fingerprint,
            routes,
            tenant,
            allow_anonymous,
            fence_header,
            attempt_header,
            shutdown_wait: duration(
                "--shutdown-wait",
                a.shutdown_wait.as_deref(),
                Duration::from_secs(30),
            )?,
            header_timeout: match duration(
                "--header-timeout",
                a.header_timeout.as_deref(),
                Duration::from_secs(30),
            )? {
                d if d.is_zero() => {
                    return Err(invalid("--header-timeout", "must be more than zero"))
                }
                d => d,
            },
            body_timeout: match duration(
                "--body-timeout",
                a.body_timeout.as_deref(),
                Duration::from_secs(60),
            )? {
                d if d.is_zero() => {
                    return Err(invalid("--body-timeout", "must be more than zero"))
                }
                d => d,
            },
            max_running: match a.max_running {
                None => 4096,
                Some(0) => return Err(invalid("--max-running", "must be at least 1")),
                Some(n) => n,
            },
            log_format,
            health_path,
            metrics_path,
            tls,
        })
    }
}

/// `/healthz` by default, `None` when set empty (the path is forwarded).
fn own_path(
    option: &'static str,
    value: Option<String>,
    default: &str,
) -> Result<Option<String>, ConfigError> {
    match value {
        None => Ok(Some(default.to_owned())),
        Some(p) if p.is_empty() => Ok(None),
        Some(p) if p.starts_with('/') && !p.contains(['?', '#']) => Ok(Some(p)),
        Some(p) => Err(invalid(
            option,
            format!("`{p}` is not a path (`/...`, no query)"),
        )),
    }
}

fn header(
    option: &'static str,
    value: Option<&str>,
    default: &str,
) -> Result<HeaderName, ConfigError> {
    let value = value.unwrap_or(default);
    let name = HeaderName::from_bytes(value.as_bytes())
        .map_err(|_| invalid(option, format!("`{value}` is not a header name")))?;
    if crate::upstream::is_hop_by_hop_name(&name) || name == http::header::HOST {
        return Err(invalid(
            option,
            format!(
                "`{value}` is a hop-by-hop or framing header: it would not reach its destination"
            ),
        ));
    }
    // The fence and attempt headers replace the client's: never one that
    // frames the body, says who is calling, or says where a request came
    // from.
    if option != "--key-header" && is_request_meaning(&name) {
        return Err(invalid(
            option,
            format!("`{value}` means something to the upstream already: the proxy would replace the client's"),
        ));
    }
    Ok(name)
}

/// Headers whose value the upstream reads for the request itself (its
/// body's framing and type, credentials, where it came from).
fn is_request_meaning(name: &HeaderName) -> bool {
    use http::header;
    [
        header::CONTENT_LENGTH,
        header::CONTENT_TYPE,
        header::CONTENT_ENCODING,
        header::EXPECT,
        header::AUTHORIZATION,
        header::PROXY_AUTHORIZATION,
        header::COOKIE,
        header::FORWARDED,
    ]
    .contains(name)
        || name.as_str().starts_with("x-forwarded-")
}

/// A duration as `500ms`, `30s`, `5m`, `1h`, `2d` or a number of seconds
/// (`1.5`). Refuses negative, NaN and infinite values; one too long for a
/// `Duration` is `Duration::MAX` (the store holds it as long as it can).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .trim_end_matches(|c: char| c.is_ascii_alphabetic())
        .len();
    let (number, unit) = text.split_at(split);
    let seconds_per: f64 = match unit {
        "ms" => 0.001,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3_600.0,
        "d" => 86_400.0,
        _ => return Err(format!("`{text}`: the unit is ms, s, m, h or d")),
    };
    let number: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a duration (e.g. `500ms`, `30s`, `5m`)"))?;
    if !number.is_finite() || number < 0.0 {
        return Err(format!(
            "`{text}`: a duration is a finite number, not negative"
        ));
    }
    Ok(Duration::try_from_secs_f64(number * seconds_per).unwrap_or(Duration::MAX))
}

fn duration(
    option: &'static str,
    value: Option<&str>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    match value {
        None => Ok(default),
        Some(text) => parse_duration(text)
            .map(|d| d.min(LONGEST))
            .map_err(|reason| invalid(option, reason)),
    }
}

/// The longest duration an option takes (ten years); a longer one is
/// taken as this. Deadlines are `now + duration`: this keeps them inside
/// what a clock holds.
pub(crate) const LONGEST: Duration = Duration::from_secs(3650 * 86_400);

/// `now + d`, for a `d` of any size: past what the clock holds, `now`
/// plus [`LONGEST`].
pub(crate) fn deadline(now: tokio::time::Instant, d: Duration) -> tokio::time::Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(LONGEST))
        .unwrap_or(now)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use http::Method;

    #[test]
    fn durations_parse_with_units_and_refuse_what_is_not_one() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1e300d"), Ok(Duration::MAX));
        for bad in ["", "NaN", "inf", "-1s", "10 parsecs", "s", "1y"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} was taken");
        }
    }

    fn args(upstream: &str) -> ProxyArgs {
        ProxyArgs {
            upstream: Some(upstream.to_owned()),
            store: Some("memory".to_owned()),
            ..ProxyArgs::default()
        }
    }

    #[test]
    fn the_defaults_protect_post_and_patch_everywhere() {
        let s = args("http://127.0.0.1:8000").settings().unwrap();
        assert!(s.routes.protects(&Method::POST, "/anything"));
        assert!(s.routes.protects(&Method::PATCH, "/"));
        assert!(!s.routes.protects(&Method::GET, "/anything"));
        assert_eq!(s.lease, Duration::from_secs(60));
        assert_eq!(s.health_path.as_deref(), Some("/healthz"));
    }

    #[test]
    fn values_that_cannot_work_are_refused_by_name() {
        let refused = |a: ProxyArgs, option: &str| match a.settings() {
            Err(ConfigError::Invalid { option: o, .. }) => assert_eq!(o, option),
            other => panic!("{option}: {other:?}"),
        };
        refused(
            ProxyArgs {
                lease: Some("0s".into()),
                ..args("http://x:1")
            },
            "--lease",
        );
        refused(args("ftp://x:1"), "--upstream");
        refused(
            ProxyArgs {
                scope: Some("a b".into()),
                ..args("http://x:1")
            },
            "--scope",
        );
        refused(
            ProxyArgs {
                release_status: Some(vec![200]),
                ..args("http://x:1")
            },
            "--release-status",
        );
        refused(
            ProxyArgs {
                release_status: Some(vec![1000]),
                ..args("http://x:1")
            },
            "--release-status",
        );
        refused(
            ProxyArgs {
                key_header: Some("connection".into()),
                ..args("http://x:1")
            },
            "--key-header",
        );
        refused(
            ProxyArgs {
                protect: Some(vec!["POST payments".into()]),
                ..args("http://x:1")
            },
            "--protect",
        );
        refused(
            ProxyArgs {
                tenant_client_cert: Some(true),
                ..args("http://x:1")
            },
            "--tenant-client-cert",
        );
        refused(
            ProxyArgs {
                tenant_jwt: Some(true),
                tenant_header: Some("x-api-key".into()),
                ..args("http://x:1")
            },
            "--tenant-header",
        );
        for n in [0, 10_001, usize::MAX] {
            refused(
                ProxyArgs {
                    store_connections: Some(n),
                    ..args("http://x:1")
                },
                "--store-connections",
            );
        }
        for d in ["1e300d", "0s"] {
            let s = ProxyArgs {
                retry_after: Some(d.into()),
                ..args("http://x:1")
            }
            .settings()
            .unwrap();
            assert_eq!(s.retry_after, parse_duration(d).unwrap().min(LONGEST));
        }
        // Every duration is held to ten years: deadlines are `now + d`.
        let far = ProxyArgs {
            upstream_timeout: Some("1e300s".into()),
            shutdown_wait: Some("99999999999999h".into()),
            upstream_idle_timeout: Some("1e300d".into()),
            lease: Some("1e300d".into()),
            ..args("http://x:1")
        }
        .settings()
        .unwrap();
        for d in [
            far.upstream_timeout,
            far.shutdown_wait,
            far.upstream_idle_timeout,
            far.lease,
        ] {
            assert_eq!(d, LONGEST);
        }
        refused(
            ProxyArgs {
                lease: Some("999ms".into()),
                ..args("http://x:1")
            },
            "--lease",
        );
        refused(args("http://:80"), "--upstream");
        for name in [
            "content-length",
            "authorization",
            "x-forwarded-for",
            "expect",
        ] {
            refused(
                ProxyArgs {
                    fence_header: Some(name.into()),
                    ..args("http://x:1")
                },
                "--fence-header",
            );
            refused(
                ProxyArgs {
                    attempt_header: Some(name.into()),
                    ..args("http://x:1")
                },
                "--attempt-header",
            );
        }
        refused(
            ProxyArgs {
                tenant_header: Some("X-Api-Key".into()),
                fence_header: Some("x-api-key".into()),
                ..args("http://x:1")
            },
            "--fence-header",
        );
        assert!(matches!(
            ProxyArgs {
                upstream: None,
                ..args("http://x:1")
            }
            .settings(),
            Err(ConfigError::Missing("--upstream"))
        ));
    }
}
