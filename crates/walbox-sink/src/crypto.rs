//! The process's rustls crypto provider.
//!
//! walbox's dependencies compile rustls with both of its providers (ring, and
//! aws-lc-rs through the replication client's defaults). rustls then cannot
//! pick one by itself, and a client library that builds its TLS settings with
//! the process default (redis-rs for `rediss://`, the RabbitMQ clients) would
//! panic. walbox names ring, the provider its PostgreSQL connections use, once
//! for the whole process, before any sink connects.

use std::sync::Once;

/// Installs ring as the process's default rustls crypto provider, once; a
/// provider installed before (by the program) is kept.
pub fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Err only when a default is installed already: that one stays.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn after_it_the_process_has_a_default_provider() {
        install_crypto_provider();
        install_crypto_provider();
        assert!(rustls::crypto::CryptoProvider::get_default().is_some());
    }
}
