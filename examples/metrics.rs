//! idem's metrics at `GET /metrics`, in the Prometheus text format
//! (`metrics-exporter-prometheus`), beside an idempotent `POST /payments`
//! on PostgreSQL. The Grafana dashboard `docs/grafana/idem.json` reads them.
//!
//! ```text
//! cargo run --example metrics --features http,postgres -- --postgres-url postgres://app@127.0.0.1/app
//! curl -si localhost:3000/payments -H 'idempotency-key: k-1' -H 'x-api-key: acme' -H 'content-type: application/json' -d '{"amount_cents": 1200}'
//! curl -s localhost:3000/metrics
//! ```
//!
//! `--listen` sets the address (default `127.0.0.1:3000`);
//! `IDEM_POSTGRES_URL` may stand for `--postgres-url`.
//!
//! Besides the metrics idem emits (the executor's counters, the
//! store-latency histogram with buckets, the pool's connections), a task
//! sets the gauge `idem_records{scope, state}` every `--records-every`
//! seconds (default 10) from `PgStore::counts`: the rows by scope and state,
//! `in_progress`, `stuck` (in progress, lease over: a worker died holding
//! the key, or its completion waits to be finished), `completed`, `expired`
//! (not purged yet), `corrupt`. It reads the whole table within the
//! store's call timeout (a table too large for that wants a store of its
//! own with a longer `call_timeout` for the count); a count that fails
//! sets the gauges to NaN. Each instance of an app reports the same
//! counts: the dashboard takes the largest.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use idemkit::postgres::PgStore;
use tokio::time::MissedTickBehavior;

#[path = "metrics/app.rs"]
mod app;

#[derive(Debug, Parser)]
#[command(about = "idem's metrics at GET /metrics, beside an idempotent POST /payments")]
struct Args {
    /// The PostgreSQL of the store (its table is created if missing).
    #[arg(long, env = "IDEM_POSTGRES_URL")]
    postgres_url: String,
    /// The address to serve on.
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// Seconds between two counts of the records (`idem_records`).
    #[arg(long, default_value_t = 10)]
    records_every: u64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    // First the recorder, then anything that records.
    let metrics = app::install_recorder()?;
    let store = PgStore::new(idemkit::postgres::connect(&args.postgres_url).await?);
    store.migrate().await?;

    // 1 s to a day: tokio's interval adds the period to an instant.
    let every = Duration::from_secs(args.records_every.clamp(1, 86_400));
    let counted = store.clone();
    let upkeep = metrics.clone();
    tokio::spawn(async move {
        let mut gauges = app::RecordGauges::default();
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            // Drains the histograms' samples: memory stays bounded
            // between two scrapes.
            upkeep.run_upkeep();
            if let Err(e) = gauges.update(&counted).await {
                eprintln!("idem_records not updated: {e}");
            }
        }
    });

    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let at = listener.local_addr()?;
    println!("serving POST http://{at}/payments and GET http://{at}/metrics");
    axum::serve(listener, app::app(store, metrics)?).await?;
    Ok(())
}
