//! TLS termination, and the client certificate a tenant can be.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use sha2::{Digest, Sha256};
use tokio_rustls::TlsAcceptor;

use crate::config::TlsFiles;
use crate::tenant::ClientCertificate;

/// Why TLS cannot be set up.
#[derive(Debug, thiserror::Error)]
#[error("TLS: {0}")]
pub struct TlsError(pub String);

/// An acceptor for `files`: the server's chain and key, and client
/// certificates required when a client CA is given. ALPN offers h2 and
/// http/1.1.
pub(crate) fn acceptor(files: &TlsFiles) -> Result<TlsAcceptor, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|certs| certs.collect::<Result<_, _>>())
        .map_err(|e| TlsError(format!("{}: {e}", files.cert.display())))?;
    if certs.is_empty() {
        return Err(TlsError(format!(
            "{}: no certificate",
            files.cert.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| TlsError(format!("{}: {e}", files.key.display())))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError(e.to_string()))?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(ca)
                .map_err(|e| TlsError(format!("{}: {e}", ca.display())))?
            {
                let cert = cert.map_err(|e| TlsError(format!("{}: {e}", ca.display())))?;
                roots
                    .add(cert)
                    .map_err(|e| TlsError(format!("{}: {e}", ca.display())))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| TlsError(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| TlsError(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The identity of the client's certificate: the SHA-256 of its DER.
pub(crate) fn client_identity(certs: Option<&[CertificateDer<'_>]>) -> Option<ClientCertificate> {
    let leaf = certs?.first()?;
    let digest = Sha256::digest(leaf.as_ref());
    Some(ClientCertificate(format!(
        "cert:{}",
        hex::encode(&digest[..16])
    )))
}
