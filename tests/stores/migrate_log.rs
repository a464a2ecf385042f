//! What `PgStore::migrate` logs, in a process of its own
//! ([`support::alone`](crate::support::alone)): a `tracing`
//! subscriber set for one thread caches each log line's interest globally,
//! so in a process where other tests hit the same line on other threads
//! first (the postgres binary, 79 tests at once) it could miss it (seen
//! once in CI: "the first run says what it applied:" with nothing logged).

use crate::support;

use idemkit::postgres::PgStore;
use support::pg;

/// A `MakeWriter` into a shared buffer, to read what was logged.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

#[tokio::test(flavor = "current_thread")]
async fn migrating_a_migrated_table_logs_nothing_at_info() {
    if !support::alone::in_own_process(
        "migrate_log::migrating_a_migrated_table_logs_nothing_at_info",
    ) {
        return;
    }
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .with_writer(captured.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing_subscriber::util::SubscriberInitExt::set_default(subscriber);
    let table = format!("quiet_{:08x}", fastrand::u32(..));
    let store = PgStore::builder(pg::pool(pg::shared_url(), 2).await)
        .table(&table)
        .build()
        .unwrap_or_else(|e| panic!("build: {e}"));
    store
        .migrate()
        .await
        .unwrap_or_else(|e| panic!("migrate: {e}"));
    let first =
        String::from_utf8_lossy(&captured.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned();
    assert!(
        first.contains("applied idem migration"),
        "the first run says what it applied: {first}"
    );
    captured.0.lock().unwrap_or_else(|p| p.into_inner()).clear();
    store
        .migrate()
        .await
        .unwrap_or_else(|e| panic!("migrate again: {e}"));
    let second =
        String::from_utf8_lossy(&captured.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned();
    assert!(second.is_empty(), "a second start logged: {second}");
}
