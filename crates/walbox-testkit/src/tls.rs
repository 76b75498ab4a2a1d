//! Generated certificates for TLS tests.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::{Result, TestkitError};

/// PEM files of a throwaway certificate authority, a server certificate it signed
/// (for `localhost` and `127.0.0.1` unless told otherwise), and a client
/// certificate for the given user.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The CA certificate clients trust (`sslrootcert`).
    pub ca_cert: PathBuf,
    /// The server certificate.
    pub server_cert: PathBuf,
    /// The server's private key.
    pub server_key: PathBuf,
    /// A client certificate whose common name is the user name (`sslcert`).
    pub client_cert: PathBuf,
    /// The client certificate's private key (`sslkey`).
    pub client_key: PathBuf,
}

impl TlsFiles {
    /// Generates the CA and both certificates into `dir`, the server's for
    /// `localhost` and `127.0.0.1`.
    pub fn generate(dir: &Path, client_user: &str) -> Result<Self> {
        Self::generate_for(dir, client_user, &["localhost", "127.0.0.1"])
    }

    /// Generates the CA and both certificates into `dir`, the server's for
    /// `server_names` (DNS names, or IP addresses as IP address entries).
    pub fn generate_for(dir: &Path, client_user: &str, server_names: &[&str]) -> Result<Self> {
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "walbox test CA");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_key = KeyPair::generate()?;
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca_params, ca_key);

        let names: Vec<String> = server_names.iter().map(|n| (*n).to_owned()).collect();
        let mut server = CertificateParams::new(names)?;
        server.distinguished_name.push(
            DnType::CommonName,
            server_names.first().copied().unwrap_or("localhost"),
        );
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_key = KeyPair::generate()?;
        let server_cert = server.signed_by(&server_key, &issuer)?;

        let mut client = CertificateParams::new(Vec::<String>::new())?;
        client
            .distinguished_name
            .push(DnType::CommonName, client_user);
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_key = KeyPair::generate()?;
        let client_cert = client.signed_by(&client_key, &issuer)?;

        let files = TlsFiles {
            ca_cert: dir.join("ca.crt"),
            server_cert: dir.join("server.crt"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.crt"),
            client_key: dir.join("client.key"),
        };
        write(&files.ca_cert, &ca_cert.pem(), 0o644)?;
        write(&files.server_cert, &server_cert.pem(), 0o644)?;
        write(&files.server_key, &server_key.serialize_pem(), 0o600)?;
        write(&files.client_cert, &client_cert.pem(), 0o644)?;
        write(&files.client_key, &client_key.serialize_pem(), 0o600)?;
        Ok(files)
    }
}

fn write(path: &Path, contents: &str, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, contents).map_err(TestkitError::io("writing", path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(TestkitError::io("setting permissions of", path))
}
