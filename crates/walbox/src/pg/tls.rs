//! TLS for the SQL connection with libpq's `sslmode` semantics, on rustls.
//!
//! - `prefer` / `require`: encrypted, the certificate is not checked (as libpq).
//! - `verify-ca`: the certificate must chain to the trusted CA; any host name.
//! - `verify-full`: it must also name the host.
//!
//! The CA comes from `sslrootcert` (libpq's default `~/.postgresql/root.crt` when
//! unset); `sslcert` / `sslkey` add a client certificate.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, Error, RootCertStore, SignatureScheme};

/// libpq `sslmode` values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SslMode {
    /// No TLS.
    Disable,
    /// TLS when the server offers it (libpq's default).
    #[default]
    Prefer,
    /// TLS, without checking the certificate.
    Require,
    /// TLS with a certificate signed by a trusted CA.
    VerifyCa,
    /// TLS with a trusted certificate for the host name.
    VerifyFull,
}

impl FromStr for SslMode {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "disable" => Self::Disable,
            "allow" | "prefer" => Self::Prefer,
            "require" => Self::Require,
            "verify-ca" => Self::VerifyCa,
            "verify-full" => Self::VerifyFull,
            other => bail!(
                "sslmode {other:?} is not one of disable, allow, prefer, require, verify-ca, verify-full"
            ),
        })
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A rustls client configuration for `mode`.
pub fn client_config(
    mode: SslMode,
    rootcert: Option<&str>,
    cert: Option<&str>,
    key: Option<&str>,
) -> Result<ClientConfig> {
    let provider = provider();
    let algorithms = provider.signature_verification_algorithms;
    let verifier: Arc<dyn ServerCertVerifier> = match mode {
        SslMode::Disable => bail!("no TLS configuration for sslmode=disable"),
        SslMode::Prefer | SslMode::Require => Arc::new(Unchecked { algorithms }),
        SslMode::VerifyCa | SslMode::VerifyFull => {
            let roots = roots(rootcert)?;
            let webpki =
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
                    .build()
                    .context("building the certificate verifier")?;
            if mode == SslMode::VerifyCa {
                Arc::new(AnyName { inner: webpki })
            } else {
                webpki
            }
        }
    };
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let config = match (cert, key) {
        (Some(c), Some(k)) => {
            let chain = CertificateDer::pem_file_iter(c)
                .and_then(|i| i.collect::<Result<Vec<_>, _>>())
                .with_context(|| format!("reading sslcert {c}"))?;
            let key =
                PrivateKeyDer::from_pem_file(k).with_context(|| format!("reading sslkey {k}"))?;
            builder
                .with_client_auth_cert(chain, key)
                .context("client certificate")?
        }
        (None, None) => builder.with_no_client_auth(),
        _ => bail!("sslcert and sslkey must be given together"),
    };
    Ok(config)
}

fn roots(rootcert: Option<&str>) -> Result<RootCertStore> {
    let path: PathBuf = match rootcert {
        Some(p) => PathBuf::from(p),
        None => std::env::var_os("HOME")
            .map(|h| Path::new(&h).join(".postgresql/root.crt"))
            .context("sslrootcert is not set and there is no home directory")?,
    };
    let mut store = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&path)
        .with_context(|| format!("reading sslrootcert {}", path.display()))?
    {
        let cert = cert.with_context(|| format!("parsing sslrootcert {}", path.display()))?;
        store
            .add(cert)
            .with_context(|| format!("trusting sslrootcert {}", path.display()))?;
    }
    if store.is_empty() {
        bail!("sslrootcert {} holds no certificate", path.display());
    }
    Ok(store)
}

/// `require`: encryption without authentication of the server, as libpq does.
#[derive(Debug)]
struct Unchecked {
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must be trusted; the name is not checked.
#[derive(Debug)]
struct AnyName {
    inner: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        match self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Err(Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}
