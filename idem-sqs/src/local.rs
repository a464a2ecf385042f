//! A client for a local SQS endpoint ([`local_client`]).

use aws_sdk_sqs::Client;

/// A client for a local SQS endpoint (moto, ElasticMQ, LocalStack): region
/// `us-east-1`, static dummy credentials, the SDK's latest behaviour
/// version, and an HTTP(S) client on rustls with ring. For AWS itself,
/// build the client from `aws-config` (its default features bring the
/// SDK's HTTPS client): this crate turns off the SDK's default features,
/// so a client built by hand from an `aws_sdk_sqs::Config` needs an HTTP
/// client from the application (`aws-sdk-sqs` with its default features
/// among its dependencies, or `.http_client(...)`).
///
/// ```
/// let client = idem_sqs::local_client("http://127.0.0.1:5000");
/// # drop(client);
/// ```
pub fn local_client(endpoint_url: &str) -> Client {
    use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
    use aws_smithy_http_client::tls::{rustls_provider::CryptoMode, Provider};
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .build_https();
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint_url)
        .credentials_provider(Credentials::new("idem", "idem", None, None, "idem-static"))
        .http_client(http)
        .build();
    Client::from_conf(config)
}
