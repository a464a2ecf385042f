//! `idem`, the operator command of [idem](https://docs.rs/idemkit): inspect a
//! key's record, delete it, list keys stuck in progress, purge expired
//! records, run the PostgreSQL migrations, count records by scope and
//! state, and compute the key the HTTP layer records a request under.
//!
//! Works on PostgreSQL, Redis, Redis Cluster and the tiered store
//! (PostgreSQL as the source of truth, a Redis cache tier, and the
//! invalidation channel that reaches the applications' in-process tiers).
//! Every time it shows ("lease left", "expires in") is computed on the
//! store's clock, never this machine's.
//!
//! Exit codes: 0 done, 1 key not found, 2 usage, 3 store unavailable (a
//! retry may help), 4 any other error.
#![deny(missing_docs)]

mod proxy;
mod render;
mod store;

use std::io::Write as _;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Operate on idem's idempotency records.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    store: StoreArgs,
    /// Output JSON (one document) instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

/// Which store, and where.
#[derive(Debug, Args)]
pub(crate) struct StoreArgs {
    /// The store to work on; optional when only one of the URLs is set.
    #[arg(long, env = "IDEM_BACKEND", global = true)]
    backend: Option<Backend>,
    /// PostgreSQL URL (the `postgres` and `tiered` backends).
    #[arg(long, env = "IDEM_POSTGRES_URL", global = true, hide_env_values = true)]
    postgres_url: Option<String>,
    /// Schema of the records table.
    #[arg(long, env = "IDEM_SCHEMA", default_value = "public", global = true)]
    schema: String,
    /// Name of the records table (`PgStoreBuilder::table`).
    #[arg(
        long,
        env = "IDEM_TABLE",
        default_value = "idem_records",
        global = true
    )]
    table: String,
    /// Redis URL (the `redis` backend, or the tiered store's cache tier).
    #[arg(long, env = "IDEM_REDIS_URL", global = true, hide_env_values = true)]
    redis_url: Option<String>,
    /// Redis Cluster node URLs, comma-separated (the `redis-cluster`
    /// backend, or the tiered store's cache tier).
    #[arg(
        long,
        env = "IDEM_REDIS_CLUSTER_URLS",
        value_delimiter = ',',
        global = true,
        hide_env_values = true
    )]
    redis_cluster_urls: Vec<String>,
    /// Key prefix of RedisStore's records (`RedisStore::prefix`).
    #[arg(
        long,
        env = "IDEM_REDIS_PREFIX",
        default_value = "idem:",
        global = true
    )]
    prefix: String,
    /// Key prefix of the tiered store's Redis cache tier (`RedisCache::prefix`).
    #[arg(
        long,
        env = "IDEM_CACHE_PREFIX",
        default_value = "idem-cache:",
        global = true
    )]
    cache_prefix: String,
    /// The tiered store's invalidation channel (`RedisInvalidation::channel`).
    #[arg(
        long,
        env = "IDEM_INVALIDATION_CHANNEL",
        default_value = "idem:invalidate",
        global = true
    )]
    channel: String,
    /// Seconds the command may take talking to the stores.
    #[arg(long, env = "IDEM_TIMEOUT", default_value_t = 10.0, global = true)]
    timeout: f64,
}

/// The stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Backend {
    /// PgStore.
    Postgres,
    /// RedisStore on a standalone server.
    Redis,
    /// RedisStore on a Redis Cluster.
    RedisCluster,
    /// TieredStore: PostgreSQL as the source, a Redis (or cluster) cache tier.
    Tiered,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show a key's record: state, attempt, fence, lease left, expiry,
    /// response size and a preview (and, on the tiered store, its cache
    /// tier entry).
    Inspect(KeyArgs),
    /// Delete a key's record (on the tiered store: in every tier, and in
    /// the applications' in-process tiers through the invalidation
    /// channel). A key in progress whose lease is not over is refused
    /// without --force: its handler may still be running.
    Delete {
        #[command(flatten)]
        key: KeyArgs,
        /// Delete a key in progress even though its lease is not over (a
        /// duplicate may then run the handler a second time).
        #[arg(long)]
        force: bool,
    },
    /// List keys in progress whose lease is over by the store's clock
    /// (a duplicate would take them over), and corrupt records.
    Stuck {
        /// At most this many keys.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Redis: read at most this many record keys.
        #[arg(long, default_value_t = 1_000_000)]
        scan_max: usize,
    },
    /// Delete expired records (PostgreSQL; Redis expires its own).
    Purge {
        /// At most this many records.
        #[arg(long, default_value_t = 100_000)]
        max: usize,
    },
    /// Create or upgrade the PostgreSQL table (safe to run again).
    Migrate,
    /// Count records by scope and state.
    Stats {
        /// Redis: read at most this many record keys.
        #[arg(long, default_value_t = 1_000_000)]
        scan_max: usize,
    },
    /// Print the key the HTTP layer records a request under.
    HttpKey(HttpKeyArgs),
    /// Run the Idempotency-Key reverse proxy in front of an HTTP upstream
    /// (any language): `idem proxy --upstream http://127.0.0.1:8000 --store
    /// redis://127.0.0.1:6379/`. Runs until SIGTERM or SIGINT, then
    /// finishes and records the requests in flight.
    Proxy(Box<idem_proxy::ProxyArgs>),
}

/// A key: `SCOPE ID`, or the HTTP layer's key of a request.
#[derive(Debug, Args)]
pub(crate) struct KeyArgs {
    /// The key's scope (`payments.charge`).
    #[arg(required_unless_present = "http_key")]
    scope_name: Option<String>,
    /// The key's id.
    #[arg(required_unless_present = "http_key")]
    id: Option<String>,
    /// Use the HTTP layer's key of a request (--tenant, --method, --path,
    /// --header) instead of SCOPE ID.
    #[arg(long, conflicts_with_all = ["scope_name", "id"], requires_all = ["tenant", "method", "path", "header"])]
    http_key: bool,
    #[command(flatten)]
    http: HttpParts,
}

/// The parts of a request the HTTP layer keys it by.
#[derive(Debug, Args)]
pub(crate) struct HttpParts {
    /// The tenant (what the layer's tenant function returned; "" when
    /// anonymous).
    #[arg(long)]
    tenant: Option<String>,
    /// The request's method.
    #[arg(long)]
    method: Option<String>,
    /// The request's path, as the client sent it.
    #[arg(long)]
    path: Option<String>,
    /// The Idempotency-Key header value, as the client sent it.
    #[arg(long)]
    header: Option<String>,
    /// The layer's scope (`IdempotencyLayer::scope`).
    #[arg(long, default_value = "http")]
    scope: String,
}

/// `http-key`: every part required.
#[derive(Debug, Args)]
struct HttpKeyArgs {
    /// The tenant ("" when anonymous).
    #[arg(long)]
    tenant: String,
    /// The request's method.
    #[arg(long)]
    method: String,
    /// The request's path, as the client sent it.
    #[arg(long)]
    path: String,
    /// The Idempotency-Key header value.
    #[arg(long)]
    header: String,
    /// The layer's scope.
    #[arg(long, default_value = "http")]
    scope: String,
}

/// Why the command failed, with its exit code.
#[derive(Debug)]
pub(crate) enum Failure {
    /// 1: the key has no record.
    NotFound(String),
    /// 2: the command line is wrong.
    Usage(String),
    /// 3: a store could not be reached or did not answer in time.
    Unavailable(String),
    /// 4: anything else.
    Other(String),
}

impl Failure {
    fn code(&self) -> i32 {
        match self {
            Failure::NotFound(_) => 1,
            Failure::Usage(_) => 2,
            Failure::Unavailable(_) => 3,
            Failure::Other(_) => 4,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Failure::NotFound(_) => "not_found",
            Failure::Usage(_) => "usage",
            Failure::Unavailable(_) => "unavailable",
            Failure::Other(_) => "error",
        }
    }

    fn message(&self) -> String {
        match self {
            Failure::NotFound(m) => format!("not found: {m}"),
            Failure::Usage(m) => format!("usage: {m} (fix the command line; see `idem --help`)"),
            Failure::Unavailable(m) => format!("store unavailable: {m} (a retry may help)"),
            Failure::Other(m) => m.clone(),
        }
    }
}

impl From<idem_core::StoreError> for Failure {
    fn from(e: idem_core::StoreError) -> Self {
        use idem_core::StoreError;
        match e {
            StoreError::Unavailable(_) => Failure::Unavailable(e.to_string()),
            StoreError::Corrupt { key, detail } => Failure::Other(format!(
                "corrupt record for {}: {detail} (a retry will not help: the record does not decode; \
                 delete it with `idem delete` once you have looked at it)",
                render::escape(&key.to_string())
            )),
            other => Failure::Other(format!("{other} (a retry will not help)")),
        }
    }
}

impl KeyArgs {
    /// The key named on the command line.
    pub(crate) fn key(&self) -> Result<idem_core::IdempotencyKey, Failure> {
        if self.http_key {
            let h = &self.http;
            return http_key(
                &h.scope,
                h.tenant.as_deref().unwrap_or_default(),
                h.method.as_deref().unwrap_or_default(),
                h.path.as_deref().unwrap_or_default(),
                h.header.as_deref().unwrap_or_default(),
            );
        }
        let (Some(scope), Some(id)) = (&self.scope_name, &self.id) else {
            return Err(Failure::Usage("give SCOPE ID, or --http-key".into()));
        };
        idem_core::IdempotencyKey::new(scope, id)
            .map_err(|e| Failure::Usage(format!("invalid key: {e}")))
    }
}

fn http_key(
    scope: &str,
    tenant: &str,
    method: &str,
    path: &str,
    header: &str,
) -> Result<idem_core::IdempotencyKey, Failure> {
    idem_http::request_key(scope, tenant, method, path, header)
        .map_err(|e| Failure::Usage(format!("cannot compute the HTTP layer's key: {e}")))
}

/// Writes `text` to stdout; a closed pipe (`idem stats | head`) is not an
/// error worth a panic.
fn emit(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes());
    if !text.ends_with('\n') {
        let _ = out.write_all(b"\n");
    }
    let _ = out.flush();
}

async fn run(cli: Cli) -> Result<String, Failure> {
    let json = cli.json;
    if let Command::HttpKey(a) = &cli.command {
        let key = http_key(&a.scope, &a.tenant, &a.method, &a.path, &a.header)?;
        return Ok(if json {
            serde_json::json!({ "scope": key.scope(), "id": key.id() }).to_string()
        } else {
            format!(
                "scope  {}\nid     {}",
                render::escape(key.scope()),
                render::escape(key.id())
            )
        });
    }
    if !(cli.store.timeout.is_finite() && cli.store.timeout > 0.0) {
        return Err(Failure::Usage(
            "--timeout must be a positive number of seconds".into(),
        ));
    }
    let timeout = Duration::try_from_secs_f64(cli.store.timeout)
        .map_err(|_| Failure::Usage("--timeout is out of range".into()))?;
    let work = async {
        let stores = store::Stores::connect(&cli.store, timeout).await?;
        match &cli.command {
            Command::Inspect(key) => stores.inspect(&key.key()?, json).await,
            Command::Delete { key, force } => stores.delete(&key.key()?, *force, json).await,
            Command::Stuck { limit, scan_max } => stores.stuck(*limit, *scan_max, json).await,
            Command::Purge { max } => stores.purge(*max, json).await,
            Command::Migrate => stores.migrate(json).await,
            Command::Stats { scan_max } => stores.stats(*scan_max, json).await,
            Command::HttpKey(_) | Command::Proxy(_) => Err(Failure::Other("unreachable".into())),
        }
    };
    // Bounds everything, connecting included: a store that accepts
    // connections but never answers is "unavailable" after the timeout.
    match tokio::time::timeout(timeout.saturating_mul(2), work).await {
        Ok(result) => result,
        Err(_) => Err(Failure::Unavailable(format!(
            "no answer within {}",
            render::duration(timeout.saturating_mul(2))
        ))),
    }
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are not errors; clap exits 2 on usage.
            let _ = e.print();
            std::process::exit(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let cli = match cli.command {
        Command::Proxy(args) => match proxy::run(*args) {
            Ok(()) => std::process::exit(0),
            Err(failure) => {
                eprintln!("idem proxy: {}", failure.message());
                std::process::exit(failure.code());
            }
        },
        command => Cli { command, ..cli },
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("idem: cannot start the async runtime: {e} (a retry will not help)");
            std::process::exit(4);
        }
    };
    let json = cli.json;
    let outcome = runtime.block_on(run(cli));
    // The invalidation subscriber (tiered) may still run: not waited for.
    runtime.shutdown_timeout(Duration::from_millis(100));
    match outcome {
        Ok(text) => {
            emit(&text);
            std::process::exit(0);
        }
        Err(failure) => {
            if json {
                emit(
                    &serde_json::json!({
                        "error": failure.kind(),
                        "message": failure.message(),
                        "retry_may_help": matches!(failure, Failure::Unavailable(_)),
                        "exit_code": failure.code(),
                    })
                    .to_string(),
                );
            }
            eprintln!("idem: {}", failure.message());
            std::process::exit(failure.code());
        }
    }
}
