#![doc = include_str!("guide.md")]
//!
//! ## Cargo features
//!
//! The default build is `idem-core` alone, with [`MemoryStore`]; a backend
//! is one feature away:
//!
#![doc = document_features::document_features!()]
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use idem_core::*;

/// The Redis and Redis Cluster store, and the Redis Streams consumer
/// (feature `redis`, crate `idem-redis`).
#[cfg(feature = "redis")]
#[doc(inline)]
pub use idem_redis as redis;

/// The PostgreSQL store and its in-transaction mode (feature `postgres`,
/// crate `idem-postgres`).
#[cfg(feature = "postgres")]
#[doc(inline)]
pub use idem_postgres as postgres;

/// The tiered store: moka, then Redis, then a source of truth (feature
/// `tiered`, crate `idem-tiered`).
#[cfg(feature = "tiered")]
#[doc(inline)]
pub use idem_tiered as tiered;

/// The `Idempotency-Key` layer for tower and axum (feature `http`, crate
/// `idem-http`).
#[cfg(feature = "http")]
#[doc(inline)]
pub use idem_http as http;

/// The idempotent Kafka consumer (feature `kafka`, crate `idem-kafka`); its
/// `rdkafka` re-export is `idemkit::kafka::rdkafka`.
#[cfg(feature = "kafka")]
#[doc(inline)]
pub use idem_kafka as kafka;

/// The DynamoDB store (feature `dynamodb`, crate `idem-dynamodb`); its
/// `aws-sdk-dynamodb` re-export is `idemkit::dynamodb::aws_sdk_dynamodb`.
#[cfg(feature = "dynamodb")]
#[doc(inline)]
pub use idem_dynamodb as dynamodb;

/// The idempotent Amazon SQS consumer (feature `sqs`, crate `idem-sqs`);
/// its `aws-sdk-sqs` re-export is `idemkit::sqs::aws_sdk_sqs`.
#[cfg(feature = "sqs")]
#[doc(inline)]
pub use idem_sqs as sqs;

/// The idempotent RabbitMQ consumer (feature `rabbitmq`, crate
/// `idem-rabbitmq`); its `lapin` re-export is `idemkit::rabbitmq::lapin`.
#[cfg(feature = "rabbitmq")]
#[doc(inline)]
pub use idem_rabbitmq as rabbitmq;

/// The idempotent NATS JetStream consumer (feature `nats`, crate
/// `idem-nats`); its `async-nats` re-export is `idemkit::nats::async_nats`.
#[cfg(feature = "nats")]
#[doc(inline)]
pub use idem_nats as nats;
