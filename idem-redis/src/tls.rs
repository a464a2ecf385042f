//! TLS settings for `rediss://` connections (feature `tls`).

use std::path::Path;

use idem_core::StoreError;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// How [`RedisStore::connect_tls`](crate::RedisStore::connect_tls) and
/// [`RedisStore::connect_cluster_tls`](crate::RedisStore::connect_cluster_tls)
/// check the server, and who the client is.
///
/// By default the server's certificate must chain to one of the system's
/// root certificates and name the host of the URL (`localhost`, or an IP
/// address SAN for `127.0.0.1`). Give the CA of your own (a private CA, a
/// test CA) with [`root_ca_pem`](Self::root_ca_pem) or
/// [`root_ca_file`](Self::root_ca_file): then it is the only one trusted.
/// A client certificate ([`client_identity_pem`](Self::client_identity_pem))
/// is for servers run with `tls-auth-clients yes`.
///
/// The password (and ACL user name) go in the URL:
/// `rediss://idem:secret@redis.internal:6380/`.
///
/// ```no_run
/// use idem_redis::{RedisStore, TlsOptions};
///
/// # async fn run() -> Result<(), idem_core::StoreError> {
/// let tls = TlsOptions::new().root_ca_file("/etc/idem/redis-ca.pem")?;
/// let store = RedisStore::connect_tls("rediss://idem:secret@redis.internal:6380/", &tls).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct TlsOptions {
    root_ca: Option<Vec<u8>>,
    client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for TlsOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsOptions")
            .field(
                "root_ca",
                &self.root_ca.as_ref().map(|_| "custom").unwrap_or("system"),
            )
            .field("client_identity", &self.client.is_some())
            .finish()
    }
}

impl TlsOptions {
    /// System roots, no client certificate.
    pub fn new() -> Self {
        TlsOptions::default()
    }

    /// Trust only these CA certificates (PEM, one or more). Checked when
    /// connecting: a PEM that does not parse, or holds no certificate, is
    /// [`StoreError::InvalidArgument`].
    pub fn root_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.root_ca = Some(pem.into());
        self
    }

    /// Trust only the CA certificates of this PEM file. A file that cannot
    /// be read, does not parse, or holds no certificate is
    /// [`StoreError::InvalidArgument`].
    pub fn root_ca_file(self, path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let path = path.as_ref();
        let pem = std::fs::read(path).map_err(|e| StoreError::InvalidArgument {
            detail: format!("cannot read the CA file {}: {e}", path.display()),
        })?;
        check_roots(&pem, &format!("the CA file {}", path.display()))?;
        Ok(self.root_ca_pem(pem))
    }

    /// A client certificate chain and its private key (PEM), for servers
    /// that ask for one (`tls-auth-clients yes`). Checked when connecting:
    /// a chain or key that does not parse is
    /// [`StoreError::InvalidArgument`].
    pub fn client_identity_pem(
        mut self,
        cert_chain: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        self.client = Some((cert_chain.into(), key.into()));
        self
    }

    /// The certificates for the `redis` crate, each PEM checked first: one
    /// that does not parse (which the `redis` crate reports as an I/O
    /// error, read as retryable) is a setting no retry cures:
    /// [`StoreError::InvalidArgument`], naming the PEM.
    pub(crate) fn certificates(&self) -> Result<redis::TlsCertificates, StoreError> {
        if let Some(pem) = &self.root_ca {
            check_roots(pem, "the CA PEM (TlsOptions::root_ca_pem)")?;
        }
        if let Some((cert, key)) = &self.client {
            check_identity(cert, key)?;
        }
        Ok(redis::TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.root_ca.clone(),
        })
    }
}

fn invalid(detail: String) -> StoreError {
    StoreError::InvalidArgument { detail }
}

/// Every certificate of `pem` parses and is a usable trust anchor, and
/// there is at least one (an empty root store trusts no server: every
/// handshake would fail).
fn check_roots(pem: &[u8], what: &str) -> Result<(), StoreError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| invalid(format!("{what} does not parse as PEM: {e}")))?;
        roots.add(cert).map_err(|e| {
            invalid(format!(
                "{what} holds a certificate that is not a usable CA certificate: {e}"
            ))
        })?;
    }
    if roots.is_empty() {
        return Err(invalid(format!(
            "no certificate in {what} (a PEM with -----BEGIN CERTIFICATE----- blocks is expected)"
        )));
    }
    Ok(())
}

/// The client certificate chain parses and holds a certificate, and the
/// key parses and is of a type rustls can sign with.
fn check_identity(cert: &[u8], key: &[u8]) -> Result<(), StoreError> {
    const WHAT: &str = "the client certificate PEM (TlsOptions::client_identity_pem)";
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(format!("{WHAT} does not parse as PEM: {e}")))?;
    if chain.is_empty() {
        return Err(invalid(format!(
            "no certificate in {WHAT} (a PEM with -----BEGIN CERTIFICATE----- blocks is expected)"
        )));
    }
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| {
        invalid(format!(
            "the client key PEM (TlsOptions::client_identity_pem) does not hold a private key: {e}"
        ))
    })?;
    rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| {
        invalid(format!(
            "the client key PEM (TlsOptions::client_identity_pem) is not a usable private key: {e}"
        ))
    })?;
    Ok(())
}

/// Makes sure rustls has a process-wide crypto provider, installing ring's
/// (the one this crate's `tls` feature brings) if the application has not
/// installed one; an application that installed its own keeps it.
///
/// The `redis` crate builds its TLS configuration with that process-wide
/// provider, and rustls cannot pick one by itself when two crates of the
/// build enabled different ones (an application's AWS SDK HTTPS client,
/// from `aws-config`, brings aws-lc-rs, this crate ring): it panics. [`RedisStore::connect_tls`](crate::RedisStore::connect_tls),
/// `connect_cluster_tls`, `connect` and
/// [`StreamConsumer::connect`](crate::streams::StreamConsumer::connect) with a
/// `rediss://` URL call this (and idem-tiered's Redis tiers, with its `tls`
/// feature, do the same);
/// call it yourself before making `rediss://` connections of your own with
/// the `redis` crate (for [`RedisStore::new`](crate::RedisStore::new)).
pub fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Err: another thread installed one meanwhile; that one is used.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// The rustls error inside `e`, if the failure is TLS's own (a certificate
/// refused, an alert from the server, a peer that does not speak TLS).
pub(crate) fn tls_error(e: &redis::RedisError) -> Option<&rustls::Error> {
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    // tokio-rustls reports a refused handshake as an `io::Error` holding
    // the rustls error; the `redis` crate keeps that in an `Arc`, which is
    // what its `source()` gives (and an `io::Error`'s own `source()` skips
    // the error it holds): look inside both.
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(tls) = io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
                return Some(tls);
            }
        }
        if let Some(shared) = err.downcast_ref::<Shared>() {
            let inner: &(dyn std::error::Error + Send + Sync + 'static) = &**shared;
            if let Some(tls) = inner.downcast_ref::<rustls::Error>() {
                return Some(tls);
            }
            if let Some(io) = inner.downcast_ref::<std::io::Error>() {
                if let Some(tls) = io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
                    return Some(tls);
                }
            }
        }
        source = err.source();
    }
    None
}

/// What a TLS failure means, in words an operator acts on.
pub(crate) fn describe(e: &rustls::Error) -> String {
    match e {
        rustls::Error::InvalidCertificate(cause) => format!(
            "TLS: the server's certificate is not trusted ({cause:?}): give the CA that signed it (TlsOptions::root_ca_pem / root_ca_file), and a certificate naming the host of the URL"
        ),
        rustls::Error::NoCertificatesPresented => {
            "TLS: the server presented no certificate".to_owned()
        }
        rustls::Error::AlertReceived(alert) => format!(
            "TLS: the server refused the handshake ({alert:?}; a client certificate it wants, or one it does not trust?)"
        ),
        rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. } => format!(
            "TLS: the server does not speak TLS on this port ({e}): use redis:// for a plaintext port"
        ),
        other => format!("TLS: {other}"),
    }
}

/// Whether this TLS failure is a setting that does not match (every retry
/// fails alike), not a network fault.
pub(crate) fn is_setting(e: &rustls::Error) -> bool {
    matches!(
        e,
        rustls::Error::InvalidCertificate(_)
            | rustls::Error::NoCertificatesPresented
            | rustls::Error::UnsupportedNameType
            | rustls::Error::PeerIncompatible(_)
            | rustls::Error::AlertReceived(_)
            | rustls::Error::InvalidMessage(_)
            | rustls::Error::InappropriateMessage { .. }
            | rustls::Error::InappropriateHandshakeMessage { .. }
            | rustls::Error::InvalidCertRevocationList(_)
            | rustls::Error::General(_)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(r: Result<impl std::fmt::Debug, StoreError>, names: &str) {
        match r {
            Err(StoreError::InvalidArgument { detail }) => {
                assert!(detail.contains(names), "{detail:?} does not name {names:?}")
            }
            other => panic!("expected InvalidArgument naming {names:?}, got {other:?}"),
        }
    }

    #[test]
    fn malformed_or_empty_pems_are_invalid_arguments() {
        let bad = b"-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n".to_vec();
        refused(
            TlsOptions::new().root_ca_pem(bad.clone()).certificates(),
            "root_ca_pem",
        );
        refused(
            TlsOptions::new().root_ca_pem(Vec::new()).certificates(),
            "no certificate in the CA PEM",
        );
        refused(
            TlsOptions::new()
                .root_ca_pem(b"just some text\n".to_vec())
                .certificates(),
            "no certificate in the CA PEM",
        );
        // Base64 that decodes, but not to a certificate.
        refused(
            TlsOptions::new()
                .root_ca_pem(
                    b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".to_vec(),
                )
                .certificates(),
            "not a usable CA certificate",
        );
        refused(
            TlsOptions::new()
                .client_identity_pem(bad, Vec::new())
                .certificates(),
            "client certificate PEM",
        );
        refused(
            TlsOptions::new()
                .client_identity_pem(Vec::new(), Vec::new())
                .certificates(),
            "no certificate in the client certificate PEM",
        );
        assert!(TlsOptions::new().certificates().is_ok());

        let dir = std::env::temp_dir().join(format!("idem-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let empty = dir.join("empty-ca.pem");
        std::fs::write(&empty, b"").unwrap_or_else(|e| panic!("{e}"));
        refused(
            TlsOptions::new().root_ca_file(&empty),
            "no certificate in the CA file",
        );
        refused(
            TlsOptions::new().root_ca_file(dir.join("missing.pem")),
            "cannot read the CA file",
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
