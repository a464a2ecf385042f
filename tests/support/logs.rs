//! The code under test's log lines in a test's output, chosen by
//! `RUST_LOG` (`RUST_LOG=idem_kafka=debug` shows what a consumer did).

/// Installs a `tracing` subscriber writing to the test's output, filtered
/// by `RUST_LOG`; once per process (later calls do nothing).
pub fn init() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}
