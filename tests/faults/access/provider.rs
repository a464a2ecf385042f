//! `rediss://` URLs in an application that may have two rustls crypto
//! providers (the `redis-tls` feature brings ring; an AWS SDK client from
//! `aws-config` brings aws-lc-rs): rustls cannot pick one by itself there,
//! and whoever builds a TLS configuration before one is installed panics.
//! This repository's build has ring alone (the AWS crates turn the SDK's
//! HTTPS client off), so rustls would pick it anyway: these tests show
//! that each connect path gives a connection or an error, with the
//! provider installed by idem before the TLS configuration is built. The tiered store's Redis tiers
//! (`RedisCache::connect`, `Invalidation::connect`) and the Redis Streams
//! consumer's `connect` install ring's provider themselves: a user's URL
//! gets a connection or an error, never a panic. Each test runs in a
//! process of its own (`support::alone`), where no other test installed
//! a provider first.
//!
//! `cargo test --all-features --test faults access::provider -- --nocapture`

use std::time::{Duration, Instant};

use crate::support;

use idemkit::tiered::RedisCache;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cache_with_a_rediss_url_does_not_panic() {
    if !support::alone::in_own_process(
        "access::provider::redis_cache_with_a_rediss_url_does_not_panic",
    ) {
        return;
    }
    let started = Instant::now();
    // Nothing listens there: the TLS configuration is built before the
    // TCP connection, so the outcome is the same with a real TLS server.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!("rediss://127.0.0.1:{port}/");
    let outcome = tokio::spawn(async move {
        tokio::time::timeout(Duration::from_secs(20), RedisCache::connect(&url))
            .await
            .map(|r| r.map(|_| ()).map_err(|e| e.to_string()))
    })
    .await;
    let panicked = matches!(&outcome, Err(e) if e.is_panic());
    println!(
        "reliability scenario=tiered-redis-cache-rediss-provider backend=tiered panicked={panicked} duration_ms={}",
        started.elapsed().as_millis()
    );
    match outcome {
        Err(e) if e.is_panic() => {
            let text = e
                .into_panic()
                .downcast::<String>()
                .map(|s| *s)
                .or_else(|p| p.downcast::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("RedisCache::connect with a rediss:// URL panicked: {text}");
        }
        other => eprintln!("outcome: {other:?}"),
    }
}

/// Runs `connect` on a task of its own; the panic message if it panicked.
async fn panics<F>(connect: F) -> Option<String>
where
    F: std::future::Future<Output = String> + Send + 'static,
{
    match tokio::spawn(async move { tokio::time::timeout(Duration::from_secs(20), connect).await })
        .await
    {
        Err(e) if e.is_panic() => Some(
            e.into_panic()
                .downcast::<String>()
                .map(|s| *s)
                .or_else(|p| p.downcast::<&str>().map(|s| s.to_string()))
                .unwrap_or_default(),
        ),
        other => {
            eprintln!("outcome: {other:?}");
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_consumer_with_a_rediss_url_does_not_panic() {
    if !support::alone::in_own_process(
        "access::provider::stream_consumer_with_a_rediss_url_does_not_panic",
    ) {
        return;
    }
    let started = Instant::now();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!("rediss://127.0.0.1:{port}/");
    let panicked = panics(async move {
        let idem = idemkit::Idempotency::new(idemkit::MemoryStore::new());
        match idemkit::redis::streams::StreamConsumer::connect(&url, "s", "g", "c", idem).await {
            Ok(_) => "connected".to_owned(),
            Err(e) => e.to_string(),
        }
    })
    .await;
    println!(
        "reliability scenario=redis-stream-consumer-rediss-provider backend=redis panicked={} duration_ms={}",
        panicked.is_some(),
        started.elapsed().as_millis()
    );
    if let Some(text) = panicked {
        panic!("StreamConsumer::connect with a rediss:// URL panicked: {text}");
    }
}
