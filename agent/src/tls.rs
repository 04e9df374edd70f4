//! TLS trust for PVE and the hub: a pinned SHA-256 certificate fingerprint, or a CA file.
//! There is no insecure mode.
//!
//! With a pin, the server's end-entity certificate must hash to the pin; names and chains are
//! not consulted (PVE's self-signed node certificates are what pins are for), but the handshake
//! signature is still verified. A mismatch fails the handshake, so no request is ever sent, and
//! the fingerprint that was seen is kept for the error message.

use std::path::Path;
use std::sync::{Arc, Mutex};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use sha2::{Digest, Sha256};

use crate::config::{format_fingerprint, TlsTrust};

/// Records the fingerprint of a certificate that did not match the pin.
#[derive(Debug, Clone, Default)]
pub struct PinObserver(Arc<Mutex<Option<[u8; 32]>>>);

impl PinObserver {
    /// The fingerprint of the last mismatching certificate, formatted `AB:CD:…`, taken: the
    /// next call answers `None` until another mismatch, so a later failure of another kind is
    /// never reported as a pin mismatch.
    pub fn mismatch(&self) -> Option<String> {
        self.0
            .lock()
            .ok()
            .and_then(|mut g| g.take().map(|fp| format_fingerprint(&fp)))
    }
    /// Forget what was seen (called before each new connection).
    pub fn reset(&self) {
        if let Ok(mut g) = self.0.lock() {
            *g = None;
        }
    }
    fn record(&self, fp: [u8; 32]) {
        if let Ok(mut g) = self.0.lock() {
            *g = Some(fp);
        }
    }
}

#[derive(Debug)]
struct PinVerifier {
    pin: [u8; 32],
    observer: PinObserver,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for PinVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let fp: [u8; 32] = Sha256::digest(end_entity.as_ref()).into();
        if fp == self.pin {
            self.observer.reset();
            Ok(ServerCertVerified::assertion())
        } else {
            self.observer.record(fp);
            Err(rustls::Error::General(format!(
                "certificate fingerprint {} does not match the pinned {}",
                format_fingerprint(&fp),
                format_fingerprint(&self.pin)
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// The crypto provider used everywhere (ring).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Why a TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    /// The CA file could not be read or holds no certificate.
    #[error(
        "CA file {path}: {detail}; point ca_file at a PEM file such as /etc/pve/pve-root-ca.pem"
    )]
    CaFile {
        /// The file.
        path: String,
        /// What is wrong.
        detail: String,
    },
    /// rustls refused the configuration.
    #[error("TLS setup failed: {0}")]
    Rustls(String),
}

/// A rustls client configuration for a trust setting, and the observer of pin mismatches.
pub fn client_config(trust: &TlsTrust) -> Result<(ClientConfig, PinObserver), TlsSetupError> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsSetupError::Rustls(e.to_string()))?;
    let observer = PinObserver::default();
    let config = match trust {
        TlsTrust::Pin(pin) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PinVerifier {
                pin: *pin,
                observer: observer.clone(),
                algorithms: provider.signature_verification_algorithms,
            }))
            .with_no_client_auth(),
        TlsTrust::CaFile(path) => builder
            .with_root_certificates(load_roots(path)?)
            .with_no_client_auth(),
    };
    Ok((config, observer))
}

fn load_roots(path: &Path) -> Result<RootCertStore, TlsSetupError> {
    let err = |detail: String| TlsSetupError::CaFile {
        path: path.display().to_string(),
        detail,
    };
    // Checked on the open file: whoever may change it decides whom the agent trusts.
    let mut file = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
    let meta = file.metadata().map_err(|e| err(e.to_string()))?;
    if let Some(why) = crate::config::untrusted_reason(path, &meta, "CA file") {
        return Err(err(why));
    }
    let mut pem = Vec::new();
    std::io::Read::read_to_end(
        &mut std::io::Read::take(&mut file, 4 * 1024 * 1024),
        &mut pem,
    )
    .map_err(|e| err(e.to_string()))?;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| err(e.to_string()))?;
        roots.add(cert).map_err(|e| err(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(err("no certificate in it".to_string()));
    }
    Ok(roots)
}
