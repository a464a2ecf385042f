//! `idem proxy`: the Idempotency-Key reverse proxy (crate `idem-proxy`),
//! run on a multi-thread runtime of its own until SIGTERM or SIGINT.

use std::io::Write as _;

use idem_proxy::{telemetry, Proxy, ProxyArgs};

use crate::Failure;

/// Runs the proxy; returns when it has shut down.
pub(crate) fn run(args: ProxyArgs) -> Result<(), Failure> {
    let settings = args.settings().map_err(|e| Failure::Usage(e.to_string()))?;
    telemetry::init_logs(settings.log_format);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("idem-proxy")
        .build()
        .map_err(|e| Failure::Other(format!("cannot start the async runtime: {e}")))?;
    let outcome = runtime.block_on(async {
        let metrics = telemetry::install_recorder();
        let proxy = Proxy::new(settings.clone(), metrics).await.map_err(|e| match e {
            idem_proxy::ProxyError::Store(idem_proxy::OpenError::Url { .. })
            | idem_proxy::ProxyError::NotHttp2(_) => Failure::Usage(e.to_string()),
            e => fail(&e.to_string(), e.is_retryable()),
        })?;
        let listener = proxy
            .bind()
            .await
            .map_err(|e| fail(&e.to_string(), e.is_retryable()))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Failure::Other(format!("the listener has no address: {e}")))?;
        let scheme = if settings.tls.is_some() { "https" } else { "http" };
        tracing::info!(listen = %addr, upstream = %settings.upstream.url(), store = %idem_proxy::redacted(&settings.store), "idem proxy: ready");
        // The line a supervisor (or a test) waits for.
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "idem proxy: listening on {scheme}://{addr}");
        let _ = out.flush();
        drop(out);
        let drained = proxy.serve(listener, shutdown_signal()).await;
        tracing::info!(?drained, "idem proxy: stopped");
        Ok(())
    });
    // Connection tasks of the stores still run: not waited for.
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    outcome
}

fn fail(message: &str, retryable: bool) -> Failure {
    if retryable {
        Failure::Unavailable(message.to_owned())
    } else {
        Failure::Other(message.to_owned())
    }
}

/// SIGTERM or SIGINT (Ctrl-C).
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
