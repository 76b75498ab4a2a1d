//! Credentials in the Kafka client's settings and errors: which properties hold
//! a secret, settings that print without them, and the record of an
//! authentication failure the client reported, so that it stops walbox instead
//! of being retried. Also where a URL holds its user information, for the
//! sinks whose URLs may carry a password.

use std::fmt;
use std::sync::{Arc, Mutex};

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::SinkError;

/// Whether a librdkafka property holds a secret (a password, a private key, a
/// client secret or an OAUTHBEARER configuration), so that its value is never
/// printed.
#[must_use]
pub fn is_secret_property(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k.contains("password")
        || k.contains("secret")
        || k.contains("ssl.key.pem")
        || k.contains("oauthbearer.config")
        || k.contains("credential")
        || k.contains("token")
}

/// librdkafka properties that print with the values of secret ones hidden.
pub struct Redacted<'a>(pub &'a [(String, String)]);

impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(k, v)| {
                let shown: &dyn fmt::Debug = if is_secret_property(k) { &Hidden } else { v };
                (k, shown)
            }))
            .finish()
    }
}

/// Stands in for a secret in printed settings.
pub struct Hidden;

impl fmt::Debug for Hidden {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<hidden>")
    }
}

/// Where `url` holds its user information (`scheme://user:password@host`):
/// from after `://` to the URL's last `@`. A password may be written with `/`,
/// `?`, `#` or `@` unencoded, which ends the authority early for a URL parser
/// (and leaves the rest of the password in the path or the query): taken to
/// the last `@`, the user information holds the whole password, whatever it
/// holds. An `@` in a path or query makes more of the URL hidden, never less.
#[must_use]
pub(crate) fn url_userinfo(url: &str) -> Option<std::ops::Range<usize>> {
    let start = url.find("://")? + 3;
    let at = url[start..].rfind('@')?;
    Some(start..start + at)
}

/// Where `url` holds its password: in its user information
/// ([`url_userinfo`]), after the first `:` (a user name holds none).
#[must_use]
pub(crate) fn url_password(url: &str) -> Option<std::ops::Range<usize>> {
    let info = url_userinfo(url)?;
    let colon = url[info.clone()].find(':')?;
    Some(info.start + colon + 1..info.end)
}

/// A client configuration error without the value it was about: librdkafka
/// repeats the value (`Invalid value "..." for configuration property ...`), and
/// the value of a mistyped secret key is still a secret.
pub(crate) fn config_error(desc: &str, key: &str, value: &str) -> String {
    let desc = if value.is_empty() {
        desc.to_owned()
    } else {
        desc.replace(value, "<value>")
    };
    format!("kafka property {key}: {desc}")
}

/// Whether a client error is the broker refusing the client's credentials.
pub(crate) fn is_authentication_error(code: Option<RDKafkaErrorCode>) -> bool {
    matches!(
        code,
        Some(RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed)
    )
}

/// The first authentication failure a client reported, shared between
/// librdkafka's callback threads and the sink.
#[derive(Clone, Default)]
pub(crate) struct AuthFailure(Arc<Mutex<Option<String>>>);

impl AuthFailure {
    /// Records `error` if it is an authentication failure; returns whether it was.
    pub(crate) fn observe(&self, error: &KafkaError, reason: &str) -> bool {
        if !is_authentication_error(error.rdkafka_error_code()) {
            return false;
        }
        let mut slot = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(reason.to_owned());
        }
        true
    }

    /// What the broker said, once it refused the credentials.
    pub(crate) fn get(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// The error for a broker that refused the credentials of a client with
/// `properties` (the last value of a key wins, as in librdkafka): the user and
/// mechanism, never the password.
pub(crate) fn authentication_error(properties: &[(String, String)], reason: String) -> SinkError {
    let property = |key: &str| {
        properties
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    };
    SinkError::Authentication {
        user: property("sasl.username").unwrap_or("(none)").to_owned(),
        mechanism: property("sasl.mechanism")
            .or(property("sasl.mechanisms"))
            .unwrap_or("(none)")
            .to_owned(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_properties_are_hidden_and_others_shown() {
        for k in [
            "sasl.password",
            "ssl.key.password",
            "ssl.keystore.password",
            "ssl.key.pem",
            "sasl.oauthbearer.client.secret",
            "sasl.oauthbearer.config",
            "SASL.PASSWORD",
        ] {
            assert!(is_secret_property(k), "{k}");
        }
        for k in [
            "bootstrap.servers",
            "sasl.username",
            "sasl.mechanism",
            "ssl.ca.location",
        ] {
            assert!(!is_secret_property(k), "{k}");
        }
        let props = vec![
            ("sasl.username".to_owned(), "walbox".to_owned()),
            ("sasl.password".to_owned(), "hunter2-xyz".to_owned()),
        ];
        let shown = format!("{:?}", Redacted(&props));
        assert!(
            shown.contains("walbox") && shown.contains("<hidden>"),
            "{shown}"
        );
        assert!(!shown.contains("hunter2-xyz"), "{shown}");
    }

    #[test]
    fn a_url_s_user_information_runs_to_its_last_at() {
        let pw = |url: &'static str| url_password(url).map(|r| &url[r]);
        assert_eq!(pw("https://u:Ab1/Cd2?x#y@h.example/p"), Some("Ab1/Cd2?x#y"));
        assert_eq!(pw("redis://:p@w@h:6379"), Some("p@w"));
        assert_eq!(pw("nats://token@h"), None);
        assert_eq!(pw("https://h.example/p"), None);
        let url = "nats://token@h";
        assert_eq!(url_userinfo(url).map(|r| &url[r]), Some("token"));
    }

    #[test]
    fn configuration_errors_do_not_repeat_the_value() {
        let e = config_error(
            "Invalid value \"hunter2 x\" for configuration property \"sasl.pasword\"",
            "sasl.pasword",
            "hunter2 x",
        );
        assert!(!e.contains("hunter2"), "{e}");
        assert!(e.contains("sasl.pasword"), "{e}");
    }
}
