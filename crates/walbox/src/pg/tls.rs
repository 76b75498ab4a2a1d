//! TLS for both PostgreSQL connections with libpq's `sslmode` semantics, on
//! rustls. One client configuration serves the SQL connection and the
//! replication connection, so both encrypt and verify alike.
//!
//! - `disable`: never TLS.
//! - `allow`: plaintext first; TLS when the server refuses the plaintext session.
//! - `prefer` (the default): TLS when the server offers it, plaintext only when it
//!   answers the SSLRequest with `N`; a failed handshake is an error.
//! - `require`: TLS, the certificate is not checked (as libpq).
//! - `verify-ca`: the certificate must chain to the trusted CA; any host name.
//! - `verify-full`: it must also name the host: a DNS name against the
//!   certificate's DNS names, an IP address against its IP addresses.
//!
//! The CA comes from `sslrootcert` (libpq's default `~/.postgresql/root.crt` when
//! unset; `system`: the system's trust store, which makes `verify-full` the
//! default and refuses weaker modes); `sslcert` / `sslkey` add a client
//! certificate.

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

/// `sslrootcert=system`: the system's trust store.
pub const SYSTEM_ROOTS: &str = "system";

/// libpq `sslmode` values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SslMode {
    /// No TLS.
    Disable,
    /// Plaintext, TLS when the server refuses plaintext.
    Allow,
    /// TLS when the server offers it (libpq's default).
    #[default]
    Prefer,
    /// TLS, without checking the certificate.
    Require,
    /// TLS with a certificate signed by a trusted CA.
    VerifyCa,
    /// TLS with a trusted certificate for the host name or address.
    VerifyFull,
}

impl SslMode {
    /// The connection-string spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disable => "disable",
            Self::Allow => "allow",
            Self::Prefer => "prefer",
            Self::Require => "require",
            Self::VerifyCa => "verify-ca",
            Self::VerifyFull => "verify-full",
        }
    }

    /// The mode in effect for an `sslmode` given or not, with `sslrootcert`:
    /// as libpq 16, `sslrootcert=system` makes `verify-full` the default and
    /// refuses anything weaker (any certificate from a public CA would pass).
    pub fn resolve(given: Option<SslMode>, rootcert: Option<&str>) -> Result<SslMode> {
        match (given, rootcert) {
            (None, Some(SYSTEM_ROOTS)) => Ok(SslMode::VerifyFull),
            (Some(mode), Some(SYSTEM_ROOTS)) if mode != SslMode::VerifyFull => bail!(
                "sslmode={} may not be used with sslrootcert=system: a certificate from any \
                 public CA would pass; use sslmode=verify-full, or give sslrootcert the file \
                 of your own CA",
                mode.as_str()
            ),
            (given, _) => Ok(given.unwrap_or_default()),
        }
    }

    /// The vendored replication client's mode: it decides whether TLS is tried,
    /// required or retried; verification is in the configuration walbox gives it.
    pub fn replication(self) -> pgwire_replication::SslMode {
        use pgwire_replication::SslMode as R;
        match self {
            Self::Disable => R::Disable,
            Self::Allow => R::Allow,
            Self::Prefer => R::Prefer,
            Self::Require => R::Require,
            Self::VerifyCa => R::VerifyCa,
            Self::VerifyFull => R::VerifyFull,
        }
    }
}

impl FromStr for SslMode {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "disable" => Self::Disable,
            "allow" => Self::Allow,
            "prefer" => Self::Prefer,
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
        SslMode::Allow | SslMode::Prefer | SslMode::Require => Arc::new(Unchecked { algorithms }),
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
    if rootcert == Some(SYSTEM_ROOTS) {
        return system_roots();
    }
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

/// The system's trust store (`SSL_CERT_FILE` / `SSL_CERT_DIR` when set, as
/// OpenSSL reads them).
fn system_roots() -> Result<RootCertStore> {
    let found = rustls_native_certs::load_native_certs();
    let mut store = RootCertStore::empty();
    let (added, _unparsable) = store.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .first()
            .map(|e| format!(" ({e})"))
            .unwrap_or_default();
        bail!(
            "sslrootcert=system: the system's trust store holds no certificate{why}; install \
             the CA certificates (Debian: ca-certificates), set SSL_CERT_FILE, or give \
             sslrootcert the CA's file"
        );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_libpq_mode_parses_to_itself() {
        for mode in [
            SslMode::Disable,
            SslMode::Allow,
            SslMode::Prefer,
            SslMode::Require,
            SslMode::VerifyCa,
            SslMode::VerifyFull,
        ] {
            assert_eq!(mode.as_str().parse::<SslMode>().unwrap(), mode);
        }
        assert_eq!(SslMode::default(), SslMode::Prefer);
    }

    #[test]
    fn the_replication_client_negotiates_as_the_mode_says() {
        use pgwire_replication::SslMode as R;
        assert_eq!(SslMode::Allow.replication(), R::Allow);
        assert_eq!(SslMode::Prefer.replication(), R::Prefer);
        assert_eq!(SslMode::Require.replication(), R::Require);
        assert!(!SslMode::Allow.replication().requires_tls());
        assert!(!SslMode::Prefer.replication().requires_tls());
        for strict in [SslMode::Require, SslMode::VerifyCa, SslMode::VerifyFull] {
            assert!(strict.replication().requires_tls(), "{strict:?}");
        }
    }

    #[test]
    fn system_roots_make_verify_full_the_default_and_refuse_weaker_modes() {
        let system = Some(SYSTEM_ROOTS);
        assert_eq!(SslMode::resolve(None, system).unwrap(), SslMode::VerifyFull);
        assert_eq!(
            SslMode::resolve(Some(SslMode::VerifyFull), system).unwrap(),
            SslMode::VerifyFull
        );
        for weak in [
            SslMode::Disable,
            SslMode::Allow,
            SslMode::Prefer,
            SslMode::Require,
            SslMode::VerifyCa,
        ] {
            let err = SslMode::resolve(Some(weak), system)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(weak.as_str()) && err.contains("verify-full"),
                "{err}"
            );
        }
        assert_eq!(SslMode::resolve(None, None).unwrap(), SslMode::Prefer);
        assert_eq!(
            SslMode::resolve(Some(SslMode::Require), Some("/ca.crt")).unwrap(),
            SslMode::Require
        );
    }

    #[test]
    fn every_mode_but_disable_builds_one_configuration_for_both_connections() {
        assert!(client_config(SslMode::Disable, None, None, None).is_err());
        for mode in [SslMode::Allow, SslMode::Prefer, SslMode::Require] {
            client_config(mode, None, None, None).unwrap();
        }
        let err = client_config(SslMode::Require, None, Some("/c.crt"), None).unwrap_err();
        assert!(err.to_string().contains("together"), "{err}");
    }
}
