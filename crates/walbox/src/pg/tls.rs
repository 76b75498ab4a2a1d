//! TLS for both PostgreSQL connections with libpq's `sslmode` semantics, on
//! rustls. One client configuration serves the SQL connection and the
//! replication connection, so both encrypt and verify alike.
//!
//! - `disable`: never TLS.
//! - `allow`: plaintext first; TLS when the server refuses the plaintext session.
//! - `prefer` (the default): TLS when the server offers it; plaintext when it
//!   refuses (the replication connection: only an `N` to the SSLRequest; the SQL
//!   connection, tokio-postgres: any answer but `S`); a failed handshake is an
//!   error.
//! - `require`: TLS; the certificate is checked only when a CA is at hand (see
//!   below).
//! - `verify-ca`: the certificate must chain to the trusted CA; any host name.
//! - `verify-full`: it must also name the host: a DNS name against the
//!   certificate's DNS names, an IP address against its IP addresses.
//!
//! The CA comes from `sslrootcert`, else libpq's default `~/.postgresql/root.crt`
//! (`system`: the system's trust store, which makes `verify-full` the default and
//! refuses weaker modes). As in libpq, when a CA is at hand (`sslrootcert` given,
//! or the default file exists) `allow`, `prefer` and `require` check the chain as
//! `verify-ca` does; without one they encrypt without checking. `sslcert` /
//! `sslkey` add a client certificate.

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
    /// TLS; the certificate is checked as under `VerifyCa` when a CA is at
    /// hand, else not at all.
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

/// The files a TLS configuration is built from: `sslrootcert`, `sslcert` and
/// `sslkey` as given, and the home directory libpq's default files are under.
#[derive(Debug, Clone, Default)]
pub struct CertFiles {
    /// `sslrootcert`.
    pub rootcert: Option<String>,
    /// `sslcert`.
    pub cert: Option<String>,
    /// `sslkey`.
    pub key: Option<String>,
    /// The home directory (`HOME`), for `~/.postgresql/`.
    pub home: Option<PathBuf>,
}

impl CertFiles {
    /// libpq's default file `name` under `~/.postgresql/`.
    fn default_file(&self, name: &str) -> Option<PathBuf> {
        self.home.as_ref().map(|h| h.join(".postgresql").join(name))
    }
}

/// Where the trusted CA comes from.
enum Trust {
    /// The system's trust store (`sslrootcert=system`).
    System,
    /// A PEM file: `sslrootcert`, or the default one that exists.
    File(PathBuf),
    /// None at hand: `sslrootcert` not given and no default file.
    Nothing,
}

impl Trust {
    /// `sslrootcert` when given, else `~/.postgresql/root.crt` when it exists
    /// (libpq tests for the file, not for its readability: an unreadable one is
    /// an error when it is read).
    fn of(files: &CertFiles) -> Self {
        match files.rootcert.as_deref() {
            Some(SYSTEM_ROOTS) => Self::System,
            Some(path) => Self::File(PathBuf::from(path)),
            None => match files.default_file("root.crt") {
                Some(path) if path.exists() => Self::File(path),
                _ => Self::Nothing,
            },
        }
    }

    fn roots(&self) -> Result<Option<RootCertStore>> {
        match self {
            Self::System => system_roots().map(Some),
            Self::File(path) => file_roots(path).map(Some),
            Self::Nothing => Ok(None),
        }
    }
}

/// A rustls client configuration for `mode`.
pub fn client_config(mode: SslMode, files: &CertFiles) -> Result<ClientConfig> {
    let provider = provider();
    let algorithms = provider.signature_verification_algorithms;
    let roots = Trust::of(files).roots()?;
    let webpki = |roots: RootCertStore| {
        WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
            .build()
            .context("building the certificate verifier")
    };
    let verifier: Arc<dyn ServerCertVerifier> = match (mode, roots) {
        (SslMode::Disable, _) => bail!("no TLS configuration for sslmode=disable"),
        // As libpq: with a CA at hand, the weaker modes check the chain too.
        (SslMode::Allow | SslMode::Prefer | SslMode::Require, Some(roots))
        | (SslMode::VerifyCa, Some(roots)) => Arc::new(AnyName {
            inner: webpki(roots)?,
        }),
        (SslMode::Allow | SslMode::Prefer | SslMode::Require, None) => {
            Arc::new(Unchecked { algorithms })
        }
        (SslMode::VerifyFull, Some(roots)) => webpki(roots)?,
        (SslMode::VerifyCa | SslMode::VerifyFull, None) => bail!(
            "sslmode={} needs the CA that signed the server's certificate, and there is none: \
             sslrootcert is not set and {} does not exist; give sslrootcert the CA's file, or \
             put it there",
            mode.as_str(),
            files
                .default_file("root.crt")
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "~/.postgresql/root.crt (no home directory)".to_owned())
        ),
    };
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let config = match client_files(files)? {
        Some((c, k)) => {
            let chain = CertificateDer::pem_file_iter(&c)
                .and_then(|i| i.collect::<Result<Vec<_>, _>>())
                .with_context(|| format!("reading sslcert {}", c.display()))?;
            let key = PrivateKeyDer::from_pem_file(&k)
                .with_context(|| format!("reading sslkey {}", k.display()))?;
            builder
                .with_client_auth_cert(chain, key)
                .context("client certificate")?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(config)
}

/// The client certificate and key, as libpq finds them: `sslcert`, else
/// `~/.postgresql/postgresql.crt` when it exists; `sslkey`, else
/// `~/.postgresql/postgresql.key` when there is a certificate.
fn client_files(files: &CertFiles) -> Result<Option<(PathBuf, PathBuf)>> {
    let cert = match &files.cert {
        Some(c) => Some(PathBuf::from(c)),
        None => files.default_file("postgresql.crt").filter(|p| p.exists()),
    };
    let key = match &files.key {
        Some(k) => Some(PathBuf::from(k)),
        None => cert
            .as_ref()
            .and_then(|_| files.default_file("postgresql.key")),
    };
    match (cert, key) {
        (Some(c), Some(k)) => Ok(Some((c, k))),
        (None, None) => Ok(None),
        (Some(c), None) => bail!(
            "sslcert {} has no key: set sslkey (there is no home directory for libpq's default \
             ~/.postgresql/postgresql.key)",
            c.display()
        ),
        (None, Some(_)) => bail!(
            "sslkey is set but there is no client certificate: set sslcert too (sslcert and \
             sslkey must be given together), or put it at ~/.postgresql/postgresql.crt"
        ),
    }
}

/// The certificates of the PEM file `path`.
fn file_roots(path: &Path) -> Result<RootCertStore> {
    let mut store = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path)
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
        let none = CertFiles::default();
        assert!(client_config(SslMode::Disable, &none).is_err());
        for mode in [SslMode::Allow, SslMode::Prefer, SslMode::Require] {
            client_config(mode, &none).unwrap();
        }
        let err = client_config(
            SslMode::Require,
            &CertFiles {
                key: Some("/c.key".into()),
                ..CertFiles::default()
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("together"), "{err}");
        let err = client_config(
            SslMode::Require,
            &CertFiles {
                cert: Some("/c.crt".into()),
                ..CertFiles::default()
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("set sslkey"), "{err}");
    }

    #[test]
    fn the_client_certificate_defaults_to_the_files_under_the_home_directory() {
        let home = tempfile::tempdir().unwrap();
        let generated = tempfile::tempdir().unwrap();
        let tls = walbox_testkit::TlsFiles::generate(generated.path(), "walbox").unwrap();
        let files = CertFiles {
            home: Some(home.path().to_owned()),
            ..CertFiles::default()
        };
        let has_cert = |files: &CertFiles| {
            client_config(SslMode::Require, files)
                .unwrap()
                .client_auth_cert_resolver
                .has_certs()
        };
        // No file: no client certificate.
        assert!(!has_cert(&files));
        let dir = home.path().join(".postgresql");
        std::fs::create_dir(&dir).unwrap();
        std::fs::copy(&tls.client_cert, dir.join("postgresql.crt")).unwrap();
        // A certificate without its key is an error naming the key's file.
        let err = client_config(SslMode::Require, &files).unwrap_err();
        assert!(
            format!("{err:#}").contains(".postgresql/postgresql.key"),
            "{err:#}"
        );
        std::fs::copy(&tls.client_key, dir.join("postgresql.key")).unwrap();
        assert!(has_cert(&files));
        // sslcert given alone: the key defaults to the home directory's.
        std::fs::remove_file(dir.join("postgresql.crt")).unwrap();
        let only_cert = CertFiles {
            cert: Some(tls.client_cert.display().to_string()),
            ..files.clone()
        };
        assert!(has_cert(&only_cert));
    }

    #[test]
    fn a_ca_at_hand_makes_the_weaker_modes_check_the_chain() {
        // A given sslrootcert is read (and checked against) under every mode.
        let missing = CertFiles {
            rootcert: Some("/nonexistent/ca.crt".into()),
            ..CertFiles::default()
        };
        for mode in [
            SslMode::Allow,
            SslMode::Prefer,
            SslMode::Require,
            SslMode::VerifyCa,
        ] {
            let err = client_config(mode, &missing).unwrap_err();
            assert!(err.to_string().contains("/nonexistent/ca.crt"), "{err}");
        }
        // So is ~/.postgresql/root.crt, when it exists.
        let home = tempfile::tempdir().unwrap();
        let files = CertFiles {
            home: Some(home.path().to_owned()),
            ..CertFiles::default()
        };
        client_config(SslMode::Require, &files).unwrap();
        let err = client_config(SslMode::VerifyCa, &files).unwrap_err();
        assert!(
            err.to_string().contains(".postgresql/root.crt")
                && err.to_string().contains("sslrootcert"),
            "{err}"
        );
        std::fs::create_dir(home.path().join(".postgresql")).unwrap();
        std::fs::write(home.path().join(".postgresql/root.crt"), "not a PEM\n").unwrap();
        let err = client_config(SslMode::Require, &files).unwrap_err();
        assert!(err.to_string().contains("root.crt"), "{err}");
    }
}
