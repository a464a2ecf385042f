//! The Grafana dashboard (`docs/grafana/idem.json`) against what idem
//! exports. The metrics example's app (`examples/metrics/app.rs`, included
//! here) serves a real PostgreSQL store; traffic through its HTTP layer and
//! through executors over the same store makes every outcome happen at
//! least once (fresh, duplicate, key reuse, in progress, release, lease
//! lost, not replayable and its duplicate, unrecorded then finished (and
//! one whose finish is fenced off), a
//! tier hit), its `idem_records` gauge counts a stuck key (and zero for a
//! scope whose rows are gone), and its
//! `GET /metrics` answers the exposition text. Every metric a dashboard
//! query names must be in that text, and every idem metric in it on the
//! dashboard.
//!
//! The Prometheus recorder is process-wide, so the test that installs it
//! runs in a process of its own (`support::alone`).
//!
//! `cargo test --features http,postgres,tiered --test stores metrics_export`

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit::postgres::PgStore;
use idemkit::testkit::Tap;
use idemkit::tiered::{MokaCache, TieredStore};
use idemkit::{IdemError, Idempotency, IdempotencyKey, InProgressPolicy, Processed};
use serde_json::Value;

use crate::support::{self, pg};

#[path = "../../examples/metrics/app.rs"]
mod app;

/// The dashboard, from the repository's root.
const DASHBOARD: &str = "docs/grafana/idem.json";

#[derive(Debug)]
struct Declined;

fn dashboard() -> Value {
    let path = format!("{}/{DASHBOARD}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} is not JSON: {e}"))
}

/// The panels of `dashboard`, those inside rows included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        out.push(panel);
        out.extend(panel["panels"].as_array().into_iter().flatten());
    }
    out
}

/// Every PromQL query of `dashboard` with where it is: each panel's
/// targets and each templating variable's query.
fn queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for panel in panels(dashboard) {
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                out.push((format!("panel {}", panel["title"]), expr.to_owned()));
            }
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if variable["type"] != "query" {
            continue;
        }
        let query = &variable["query"];
        if let Some(q) = query.as_str().or_else(|| query["query"].as_str()) {
            out.push((format!("variable {}", variable["name"]), q.to_owned()));
        }
    }
    out
}

/// The metric names a PromQL expression names: the identifiers that start
/// with `idem_` (idem's prefix; no label or function name starts so), not
/// inside another identifier, a string (a label's value) nor a Grafana
/// variable (`$idem_x`).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let is_name_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    // The expression with its strings blanked out.
    let mut quote = None;
    let mut escaped = false;
    let unquoted: String = expr
        .chars()
        .map(|c| match quote {
            Some(q) => {
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == q {
                    quote = None;
                }
                ' '
            }
            None if matches!(c, '"' | '\'' | '`') => {
                quote = Some(c);
                ' '
            }
            None => c,
        })
        .collect();
    let mut names = BTreeSet::new();
    let mut rest = unquoted.as_str();
    while let Some(at) = rest.find("idem_") {
        let starts_a_name = !rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| is_name_char(c) || c == '$');
        let tail = &rest[at..];
        let len = tail.find(|c| !is_name_char(c)).unwrap_or(tail.len());
        if starts_a_name {
            names.insert(tail[..len].to_owned());
        }
        rest = &tail[len..];
    }
    names
}

/// An exposition text, read: the value of each series (`name{labels}`
/// as written) and the kind of each metric family (its `# TYPE` line).
struct Exposition {
    samples: BTreeMap<String, f64>,
    kinds: BTreeMap<String, String>,
}

impl Exposition {
    fn parse(text: &str) -> Exposition {
        let mut samples = BTreeMap::new();
        let mut kinds = BTreeMap::new();
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            if let Some(typed) = line.strip_prefix("# TYPE ") {
                let (name, kind) = typed
                    .split_once(' ')
                    .unwrap_or_else(|| panic!("a TYPE line without a kind: {line}"));
                kinds.insert(name.to_owned(), kind.to_owned());
            } else if !line.starts_with('#') {
                let (series, value) = line
                    .rsplit_once(' ')
                    .unwrap_or_else(|| panic!("a sample line without a value: {line}"));
                let value = value
                    .parse()
                    .unwrap_or_else(|e| panic!("{line}: the value does not parse: {e}"));
                samples.insert(series.to_owned(), value);
            }
        }
        Exposition { samples, kinds }
    }

    /// The names of the series: a histogram's are its family's name with
    /// `_bucket`, `_sum` or `_count`.
    fn names(&self) -> BTreeSet<&str> {
        self.samples
            .keys()
            .map(|s| s.split_once('{').map_or(s.as_str(), |(name, _)| name))
            .collect()
    }

    /// The value of one series, e.g. `idem_records{scope="a",state="stuck"}`.
    fn value(&self, series: &str) -> Option<f64> {
        self.samples.get(series).copied()
    }
}

/// The metric names `expr` names that `exported` does not hold.
fn unexported(expr: &str, exported: &BTreeSet<&str>) -> Vec<String> {
    metric_names(expr)
        .into_iter()
        .filter(|name| !exported.contains(name.as_str()))
        .collect()
}

/// Whether a query names metric family `family`: the family itself, or
/// one of a histogram's series.
fn names_family(expr: &str, family: &str) -> bool {
    metric_names(expr).iter().any(|name| {
        name == family
            || ["_bucket", "_sum", "_count"]
                .into_iter()
                .any(|suffix| name.strip_prefix(family) == Some(suffix))
    })
}

#[test]
fn the_dashboard_is_grafana_json_whose_every_panel_queries_the_datasource_variable() {
    let dashboard = dashboard();
    assert!(
        dashboard["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
        "schemaVersion: {}",
        dashboard["schemaVersion"]
    );
    let variables: BTreeMap<&str, &Value> = dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| Some((v["name"].as_str()?, v)))
        .collect();
    let datasource = variables
        .get("datasource")
        .unwrap_or_else(|| panic!("no datasource variable: {variables:?}"));
    assert_eq!(datasource["type"], "datasource");
    assert_eq!(datasource["query"], "prometheus");
    let scope = variables
        .get("scope")
        .unwrap_or_else(|| panic!("no scope variable: {variables:?}"));
    assert_eq!(scope["type"], "query");
    assert_eq!(scope["datasource"]["uid"], "${datasource}");

    let mut ids = BTreeSet::new();
    let mut queried = 0;
    for panel in panels(&dashboard) {
        let title = &panel["title"];
        let id = panel["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("{title}: no id"));
        assert!(ids.insert(id), "{title}: id {id} is used twice");
        assert!(
            panel["gridPos"]["w"].as_u64().is_some(),
            "{title}: no gridPos"
        );
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        let targets = panel["targets"].as_array().map_or(&[][..], Vec::as_slice);
        assert!(!targets.is_empty(), "{title}: no query");
        for target in targets {
            assert_eq!(target["datasource"]["uid"], "${datasource}", "{title}");
            let expr = target["expr"].as_str().unwrap_or_default();
            assert!(
                !metric_names(expr).is_empty(),
                "{title}: a query that names no idem metric: {expr:?}"
            );
        }
        queried += 1;
    }
    assert!(queried >= 8, "{queried} panels with queries");
}

#[test]
fn a_query_naming_a_metric_nobody_exports_is_reported() {
    let text = "# TYPE idem_replayed_total counter\n\
                idem_replayed_total{scope=\"s\"} 2\n\
                \n\
                # TYPE idem_store_duration_seconds histogram\n\
                idem_store_duration_seconds_bucket{backend=\"postgres\",le=\"0.001\"} 1\n\
                idem_store_duration_seconds_bucket{backend=\"postgres\",le=\"+Inf\"} 1\n\
                idem_store_duration_seconds_sum{backend=\"postgres\"} 0.0004\n\
                idem_store_duration_seconds_count{backend=\"postgres\"} 1\n";
    let exposition = Exposition::parse(text);
    let exported = exposition.names();
    assert_eq!(
        exposition.value("idem_replayed_total{scope=\"s\"}"),
        Some(2.0)
    );
    assert_eq!(
        exposition
            .kinds
            .get("idem_store_duration_seconds")
            .map(String::as_str),
        Some("histogram")
    );
    // A typo, a histogram's series and a variable's query.
    assert_eq!(
        unexported(
            "sum(rate(idem_replayed_totl{scope=~\"$scope\"}[$__rate_interval]))",
            &exported
        ),
        ["idem_replayed_totl"]
    );
    assert!(unexported(
        "histogram_quantile(0.99, sum by (le) (rate(idem_store_duration_seconds_bucket[5m])))",
        &exported
    )
    .is_empty());
    assert_eq!(
        unexported("label_values(idem_acquired_total, scope)", &exported),
        ["idem_acquired_total"]
    );
    // A histogram's family is named by its series, not by a prefix.
    assert!(names_family(
        "rate(idem_store_duration_seconds_count[5m])",
        "idem_store_duration_seconds"
    ));
    assert!(!names_family(
        "rate(idem_store_duration_seconds_total[5m])",
        "idem_store_duration_seconds"
    ));
    // Not metrics: a name inside another identifier, a variable.
    assert!(metric_names("my_idem_total + $idem_x").is_empty());
    assert_eq!(
        metric_names("idem_a_total{state=\"idem_b\"} / idem_c"),
        BTreeSet::from(["idem_a_total".to_owned(), "idem_c".to_owned()])
    );
}

/// Polls `condition` every 20 ms until it holds, for 10 s at most.
async fn until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    while !condition().await {
        assert!(Instant::now() < deadline, "{what}: not within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_queries_is_exported_by_the_example() {
    if !support::alone::in_own_process(
        "metrics_export::every_metric_the_dashboard_queries_is_exported_by_the_example",
    ) {
        return;
    }
    let metrics = app::install_recorder().unwrap_or_else(|e| panic!("install: {e}"));
    let store = PgStore::new(pg::pool(pg::shared_url(), 8).await);
    store
        .migrate()
        .await
        .unwrap_or_else(|e| panic!("migrate: {e}"));
    let router = app::app(store.clone(), metrics.clone()).unwrap_or_else(|e| panic!("app: {e}"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("bind: {e}"));
    let base = format!(
        "http://{}",
        listener.local_addr().unwrap_or_else(|e| panic!("{e}"))
    );
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    let client = reqwest::Client::new();

    // Through the example's layer: fresh, duplicate, key reused.
    let pay_key = format!("pay-{:08x}", fastrand::u32(..));
    let pay = |amount: i64| {
        client
            .post(format!("{base}/payments"))
            .header("idempotency-key", &pay_key)
            .header("x-api-key", "acme")
            .json(&serde_json::json!({ "amount_cents": amount }))
            .send()
    };
    let first = pay(1200).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.status(), 201);
    let retry = pay(1200).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(retry.status(), 201);
    assert!(retry.headers().contains_key("idempotent-replayed"));
    let reused = pay(9999).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reused.status(), 422);

    // Through executors over the same store, in a scope of this run.
    let scope = format!("metrics.export.{:08x}", fastrand::u32(..));
    let key = |id: &str| IdempotencyKey::new(scope.as_str(), id).unwrap_or_else(|e| panic!("{e}"));
    let idem = Idempotency::new(store.clone());
    // A handler error releases the key.
    let declined = idem
        .process(&key("declined"), 1u8, |_| async { Err::<u8, _>(Declined) })
        .await;
    assert!(
        matches!(declined, Err(IdemError::Handler(Declined))),
        "{declined:?}"
    );
    // A result JSON cannot hold: completed as not replayable; its
    // duplicate gets ResultUnavailable.
    let nan = idem
        .process(&key("nan"), 1u8, |_| async {
            Ok::<f64, Declined>(f64::NAN)
        })
        .await;
    assert!(
        matches!(nan, Ok(Processed::ExecutedNotReplayable { .. })),
        "{nan:?}"
    );
    let nan_again = idem
        .process(&key("nan"), 1u8, |_| async { Ok::<f64, Declined>(1.0) })
        .await;
    assert!(
        matches!(nan_again, Err(IdemError::ResultUnavailable { .. })),
        "{nan_again:?}"
    );

    // A holder whose lease (300 ms, no heartbeat) ends while its handler
    // runs: a waiting duplicate finds the key in progress, takes it over
    // once the lease is over, and the holder's completion is fenced off.
    let holder = Idempotency::new(store.clone())
        .lease(Duration::from_millis(300))
        .heartbeat(false);
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let (go, go_rx) = tokio::sync::oneshot::channel::<()>();
    let held = key("held");
    let slow = tokio::spawn(async move {
        holder
            .process(&held, 1u8, move |_| async move {
                let _ = started_tx.send(());
                let _ = go_rx.await;
                Ok::<u8, Declined>(1)
            })
            .await
    });
    started
        .await
        .unwrap_or_else(|e| panic!("the holder's handler: {e}"));
    let taker = Idempotency::new(store.clone()).on_in_progress(InProgressPolicy::Wait {
        max_wait: Duration::from_secs(10),
        poll: Duration::from_millis(20),
    });
    let took = taker
        .process(&key("held"), 1u8, |_| async { Ok::<u8, Declined>(2) })
        .await;
    assert!(matches!(took, Ok(Processed::Executed(2))), "{took:?}");
    let _ = go.send(());
    let lost = slow.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(lost, Err(IdemError::LeaseLost)), "{lost:?}");

    // Completions the store refuses until the lease ends: Unrecorded. The
    // key is stuck (in progress, lease over) until it is finished, and the
    // example's gauge says so.
    let tap = Arc::new(Tap::new(store.clone()));
    let flaky = Idempotency::from_arc(tap.clone())
        .lease(Duration::from_millis(300))
        .heartbeat(false);
    tap.fail_completes(usize::MAX);
    let out = flaky
        .process(&key("unrecorded"), 1u8, |_| async { Ok::<u8, Declined>(3) })
        .await;
    let Err(IdemError::Unrecorded(unrecorded)) = out else {
        panic!("not unrecorded: {out:?}");
    };
    tap.fail_completes(0);
    let stuck = format!("{}{{scope=\"{scope}\",state=\"stuck\"}}", app::RECORDS);
    let completed = format!("{}{{scope=\"{scope}\",state=\"completed\"}}", app::RECORDS);
    let gauges = tokio::sync::Mutex::new(app::RecordGauges::default());
    let gauged = |series: &str, n: f64| {
        let (gauges, store, metrics, series) = (&gauges, &store, &metrics, series.to_owned());
        async move {
            gauges
                .lock()
                .await
                .update(store)
                .await
                .unwrap_or_else(|e| panic!("counts: {e}"));
            Exposition::parse(&metrics.render()).value(&series) == Some(n)
        }
    };
    until("the unrecorded key counted stuck", || gauged(&stuck, 1.0)).await;
    flaky
        .finish(&unrecorded)
        .await
        .unwrap_or_else(|e| panic!("finish: {e}"));
    assert!(gauged(&stuck, 0.0).await, "still stuck once finished");
    // nan, held (by the taker) and unrecorded.
    assert!(gauged(&completed, 3.0).await);

    // A finish fenced off: its key taken over after the lease (in a scope
    // of its own, so the counts above stay as they are).
    let fenced_key = IdempotencyKey::new(format!("{scope}-f").as_str(), "fenced")
        .unwrap_or_else(|e| panic!("{e}"));
    fence_off_a_finish(&store, &fenced_key).await;

    // A tiered store over the same PostgreSQL: the duplicate is answered
    // by the moka tier.
    let tiered = Idempotency::new(
        TieredStore::new(store.clone()).with_cache(MokaCache::new(1_000, 1 << 20)),
    );
    let first = tiered
        .process(&key("tiered"), 1u8, |_| async { Ok::<u8, Declined>(4) })
        .await;
    assert!(matches!(first, Ok(Processed::Executed(4))), "{first:?}");
    let again = tiered
        .process(&key("tiered"), 1u8, |_| async { Ok::<u8, Declined>(5) })
        .await;
    assert!(matches!(again, Ok(Processed::Replayed(4))), "{again:?}");

    // A scope whose rows are all gone reads zero, not its last count.
    assert!(gauged(&completed, 4.0).await, "with the tiered key");
    let statement = format!("DELETE FROM {} WHERE scope = $1", store.qualified_table());
    sqlx::query(sqlx::AssertSqlSafe(statement))
        .bind(&scope)
        .execute(store.pool())
        .await
        .unwrap_or_else(|e| panic!("delete the scope's rows: {e}"));
    assert!(gauged(&completed, 0.0).await, "the scope's rows are gone");

    // What the example's GET /metrics answers.
    let response = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET /metrics: {e}"));
    assert_eq!(response.status(), 200);
    assert!(response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/plain; version=0.0.4")));
    let text = response.text().await.unwrap_or_else(|e| panic!("{e}"));
    server.abort();
    let exposition = Exposition::parse(&text);

    // Every outcome happened in this run, so every counter is there.
    for counter in [
        "idem_acquired_total",
        "idem_in_progress_total",
        "idem_released_total",
        "idem_lease_lost_total",
        "idem_not_replayable_total",
        "idem_result_unavailable_total",
        "idem_unrecorded_total",
        "idem_finished_total",
        "idem_replayed_total",
    ] {
        let series = format!("{counter}{{scope=\"{scope}\"}}");
        assert!(
            exposition.value(&series).is_some_and(|n| n >= 1.0),
            "{series} not counted:\n{text}"
        );
    }
    for series in [
        "idem_replayed_total{scope=\"payments.api\"}",
        "idem_mismatch_total{scope=\"payments.api\"}",
        "idem_tier_hits_total{tier=\"moka\"}",
    ] {
        assert!(
            exposition.value(series).is_some_and(|n| n >= 1.0),
            "{series} not counted:\n{text}"
        );
    }
    // A histogram with buckets, which histogram_quantile needs (without
    // them the exporter writes a summary).
    assert_eq!(
        exposition
            .kinds
            .get(idemkit::STORE_DURATION_SECONDS)
            .map(String::as_str),
        Some("histogram"),
        "{text}"
    );

    // The dashboard's queries name only exported metrics...
    let exported = exposition.names();
    let queries = queries(&dashboard());
    let mut problems: Vec<String> = queries
        .iter()
        .flat_map(|(place, expr)| {
            unexported(expr, &exported)
                .into_iter()
                .map(move |name| format!("{place} names {name}, which is not exported"))
        })
        .collect();
    // ...and every idem metric exported is on the dashboard.
    for family in exposition.kinds.keys().filter(|f| f.starts_with("idem_")) {
        if !queries.iter().any(|(_, expr)| names_family(expr, family)) {
            problems.push(format!("no query of the dashboard reads {family}"));
        }
    }
    assert!(
        problems.is_empty(),
        "{DASHBOARD} against GET /metrics:\n  {}\nexported: {exported:?}",
        problems.join("\n  ")
    );
}

/// A handler ran, its completion was not recorded (Unrecorded), another
/// worker took the key over after the lease ended, and `finish` then got
/// `LeaseLost`: the dashboard's "Waiting to be finished" reads 0 (nothing
/// waits any more) and "Effects at risk" counts it (the effects may have
/// run twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finish_fenced_off_is_neither_waiting_nor_invisible() {
    if !support::alone::in_own_process(
        "metrics_export::a_finish_fenced_off_is_neither_waiting_nor_invisible",
    ) {
        return;
    }
    let metrics = app::install_recorder().unwrap_or_else(|e| panic!("install: {e}"));
    let store = PgStore::new(pg::pool(pg::shared_url(), 4).await);
    store
        .migrate()
        .await
        .unwrap_or_else(|e| panic!("migrate: {e}"));
    let scope = format!("metrics.fenced.{:08x}", fastrand::u32(..));
    let key = IdempotencyKey::new(scope.as_str(), "k").unwrap_or_else(|e| panic!("{e}"));
    fence_off_a_finish(&store, &key).await;
    let exposition = Exposition::parse(&metrics.render());
    let of = |counter: &str| {
        exposition
            .value(&format!("{counter}{{scope=\"{scope}\"}}"))
            .unwrap_or(0.0)
    };
    // Panel "Waiting to be finished": unrecorded - finished - finish lost.
    let waiting =
        of("idem_unrecorded_total") - of("idem_finished_total") - of("idem_finish_lost_total");
    // Panel "Effects at risk in the time range".
    let at_risk = of("idem_lease_lost_total")
        + of("idem_not_replayable_total")
        + of("idem_result_unavailable_total");
    println!("waiting to be finished: {waiting}, effects at risk: {at_risk}");
    assert!(
        waiting == 0.0 && at_risk >= 1.0,
        "after a finish fenced off (the key taken over, the handler run twice): \
         'Waiting to be finished' reads {waiting} (nothing waits), \
         'Effects at risk' reads {at_risk}"
    );
}

/// The example's `idem_records` after a count that failed (the store
/// unavailable, or the whole-table count past the store's
/// statement_timeout): the gauges read NaN (no value), not the last
/// count (here a stuck key that has since completed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_count_does_not_leave_the_records_gauge_stale() {
    if !support::alone::in_own_process(
        "metrics_export::a_failed_count_does_not_leave_the_records_gauge_stale",
    ) {
        return;
    }
    use idemkit::{Acquisition, IdempotencyStore};
    let metrics = app::install_recorder().unwrap_or_else(|e| panic!("install: {e}"));
    let pool = pg::pool(pg::shared_url(), 4).await;
    let table = format!("records_lock_{:08x}", fastrand::u32(..));
    let store = PgStore::builder(pool.clone())
        .table(&table)
        .call_timeout(Duration::from_secs(1))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store
        .migrate()
        .await
        .unwrap_or_else(|e| panic!("migrate: {e}"));
    let scope = format!("metrics.stale.{:08x}", fastrand::u32(..));
    let key = IdempotencyKey::new(scope.as_str(), "k").unwrap_or_else(|e| panic!("{e}"));
    let lease = match store
        .acquire(&key, None, Duration::from_millis(100))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    {
        Acquisition::Acquired(lease) => lease,
        other => panic!("{other:?}"),
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stuck = format!("{}{{scope=\"{scope}\",state=\"stuck\"}}", app::RECORDS);
    let mut gauges = app::RecordGauges::default();
    gauges
        .update(&store)
        .await
        .unwrap_or_else(|e| panic!("counts: {e}"));
    assert_eq!(
        Exposition::parse(&metrics.render()).value(&stuck),
        Some(1.0)
    );
    // The holder finishes: nothing is stuck any more.
    store
        .complete(&lease, b"1", Duration::from_secs(3600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // Counting fails (here: the table locked by a migration, say).
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
        store.qualified_table()
    )))
    .execute(&mut *tx)
    .await
    .unwrap_or_else(|e| panic!("lock: {e}"));
    let failed = gauges.update(&store).await;
    let text = metrics.render();
    let _ = tx.rollback().await;
    println!("the count: {failed:?}");
    assert!(failed.is_err(), "the count did not fail: {failed:?}");
    let read = Exposition::parse(&text).value(&stuck);
    let records_lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("idem_records"))
        .collect();
    assert!(
        read.is_some_and(f64::is_nan),
        "after a failed count the gauge reads {read:?}, not NaN (no value):\n{}",
        records_lines.join("\n")
    );
    let records_lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("idem_records"))
        .collect();
    assert_ne!(
        read,
        Some(1.0),
        "after a failed count, a key completed since still reads stuck, and nothing says the \
         count failed:\n{}",
        records_lines.join("\n")
    );
}

/// A handler runs on `key` but its completion is refused until the lease
/// ends (Unrecorded); another worker then takes the key over and runs it,
/// and the first worker's `finish` gets `LeaseLost`.
async fn fence_off_a_finish(store: &PgStore, key: &IdempotencyKey) {
    let tap = Arc::new(Tap::new(store.clone()));
    let flaky = Idempotency::from_arc(tap.clone())
        .lease(Duration::from_millis(300))
        .heartbeat(false);
    tap.fail_completes(usize::MAX);
    let out = flaky
        .process(key, 1u8, |_| async { Ok::<u8, Declined>(3) })
        .await;
    let Err(IdemError::Unrecorded(unrecorded)) = out else {
        panic!("not unrecorded: {out:?}");
    };
    tap.fail_completes(0);
    // The lease is over: another worker takes the key over and runs it.
    let taker = Idempotency::new(store.clone()).on_in_progress(InProgressPolicy::Wait {
        max_wait: Duration::from_secs(10),
        poll: Duration::from_millis(20),
    });
    let took = taker
        .process(key, 1u8, |_| async { Ok::<u8, Declined>(4) })
        .await;
    assert!(matches!(took, Ok(Processed::Executed(4))), "{took:?}");
    let finished = flaky.finish(&unrecorded).await;
    assert!(
        matches!(finished, Err(idemkit::StoreError::LeaseLost)),
        "{finished:?}"
    );
}
