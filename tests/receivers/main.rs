//! The receivers on real servers and brokers: the HTTP `Idempotency-Key`
//! layer through a real axum server and client (tenants sharing keys
//! included), and the Kafka (Tansu), SQS (moto) and Redis Streams
//! consumers: redelivery, crashes, rebalances, poison messages, shutdown
//! and results finished after a store outage. Each area is a folder whose
//! modules are behaviours (`cargo test --all-features --test receivers
//! kafka::rebalance`).
//!
//! One test binary; each module is an area, gated by the facade features
//! it needs (`cargo test --all-features --test receivers`).

#[path = "../support/mod.rs"]
mod support;

#[cfg(all(feature = "http", feature = "postgres", feature = "redis"))]
mod http;
#[cfg(all(feature = "kafka", feature = "redis"))]
mod kafka;
#[cfg(all(feature = "nats", feature = "redis"))]
mod nats;
#[cfg(all(feature = "rabbitmq", feature = "redis"))]
mod rabbitmq;
#[cfg(feature = "sqs")]
mod sqs;
#[cfg(feature = "redis")]
mod streams;
