//! What comes before a store: the table ([`create_table`]) and, for a
//! local endpoint (moto, DynamoDB Local, LocalStack), a client
//! ([`local_client`]).

use std::time::Duration;

use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
    TimeToLiveSpecification,
};
use aws_sdk_dynamodb::Client;
use idem_core::StoreError;

use crate::error::map_sdk;
use crate::item;

/// A client for a local DynamoDB endpoint (moto, DynamoDB Local,
/// LocalStack): region `us-east-1`, static dummy credentials, the SDK's
/// latest behaviour version, and an HTTP(S) client on rustls with ring.
/// For AWS itself, build the client from `aws-config` (its default
/// features bring the SDK's HTTPS client): this crate turns off the SDK's
/// default features, so a client built by hand from an
/// `aws_sdk_dynamodb::Config` needs an HTTP client from the application
/// (`aws-sdk-dynamodb` with its default features among its dependencies,
/// or `.http_client(...)`).
///
/// ```
/// let client = idem_dynamodb::local_client("http://127.0.0.1:5000");
/// # drop(client);
/// ```
pub fn local_client(endpoint_url: &str) -> Client {
    use aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint_url)
        .credentials_provider(Credentials::new("idem", "idem", None, None, "idem-static"))
        .http_client(local_http_client())
        .build();
    Client::from_conf(config)
}

/// rustls on ring: plain HTTP for a local endpoint, HTTPS for one behind TLS.
fn local_http_client() -> aws_sdk_dynamodb::config::SharedHttpClient {
    use aws_smithy_http_client::tls::{rustls_provider::CryptoMode, Provider};
    aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .build_https()
}

/// Creates the table the store expects, if it does not exist: partition
/// key `pk` (string), no sort key, on-demand billing, and DynamoDB's TTL
/// on the attribute `tt`. Waits until the table is active. Harmless to
/// call on every start.
///
/// To make it yourself (CloudFormation, Terraform): one `HASH` key named
/// `pk` of type `S`, TTL attribute `tt`; any billing mode.
pub async fn create_table(client: &Client, table: &str) -> Result<(), StoreError> {
    let created = client
        .create_table()
        .table_name(table)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name(item::PK)
                .attribute_type(ScalarAttributeType::S)
                .build()
                .map_err(StoreError::backend)?,
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name(item::PK)
                .key_type(KeyType::Hash)
                .build()
                .map_err(StoreError::backend)?,
        )
        .billing_mode(BillingMode::PayPerRequest)
        .send()
        .await;
    match created {
        Ok(_) => {}
        Err(e) if e.code() == Some("ResourceInUseException") => {}
        Err(e) => return Err(map_sdk(e)),
    }
    // Active: on AWS a new table takes seconds; moto is active at once.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let described = client
            .describe_table()
            .table_name(table)
            .send()
            .await
            .map_err(map_sdk)?;
        let active = described
            .table()
            .and_then(|t| t.table_status())
            .is_some_and(|s| s.as_str() == "ACTIVE");
        if active {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(StoreError::unavailable(format!(
                "table {table} is not active after 120 s"
            )));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let ttl = client
        .update_time_to_live()
        .table_name(table)
        .time_to_live_specification(
            TimeToLiveSpecification::builder()
                .enabled(true)
                .attribute_name(item::TT)
                .build()
                .map_err(StoreError::backend)?,
        )
        .send()
        .await;
    match ttl {
        Ok(_) => Ok(()),
        // Already enabled (AWS answers ValidationException to a second
        // enable of the same attribute).
        Err(e) if e.code() == Some("ValidationException") => Ok(()),
        Err(e) => Err(map_sdk(e)),
    }
}
