//! CloudEvents protocol bindings: the one place that says, for the protocol a
//! sink speaks, which binding a CloudEvent follows, its default content mode,
//! and how attributes are named and their values encoded in binary mode.
//!
//! | protocol | binding | default mode | attribute names | values | `datacontenttype` (binary) | structured content type header |
//! |---|---|---|---|---|---|---|
//! | Kafka (and stdout) | Kafka 1.0.2 | binary | `ce_` + name | as they are | `content-type` | `content-type` |
//! | NATS | NATS (1.0.2: structured only; binary as of the 1.0.3 text, cloudevents/spec #1016) | structured | `ce-` + name | percent-encoded | `ce-datacontenttype` | `Content-Type` |
//! | HTTP | HTTP 1.0.2 | binary | `ce-` + name | percent-encoded | `Content-Type` | `Content-Type` |
//! | AMQP 1.0 | AMQP 1.0.3 | binary | `cloudEvents_` + name (application properties) | as they are | `content-type` (the message's content-type property) | `content-type` |
//!
//! A sink added later picks its binding by naming its [`Protocol`] here; the
//! formatter reads everything else from the [`Binding`].

use std::borrow::Cow;

use percent_encoding::{AsciiSet, CONTROLS, percent_decode_str, utf8_percent_encode};

use crate::config::CloudEventsMode;

/// The protocol a sink speaks, as far as CloudEvents bindings are concerned.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Protocol {
    /// Kafka records (also what the stdout sink prints).
    #[default]
    Kafka,
    /// NATS messages (JetStream).
    Nats,
    /// HTTP requests.
    Http,
    /// AMQP 1.0 messages (application properties).
    Amqp,
    /// Google Cloud Pub/Sub messages (attributes).
    PubSub,
}

/// How CloudEvents travel over one protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    /// The protocol.
    pub protocol: Protocol,
    /// The content mode used when `cloudevents_mode` is not set.
    pub default_mode: CloudEventsMode,
    /// What precedes an attribute's name in binary mode.
    pub prefix: &'static str,
    /// Whether attribute values are percent-encoded (HTTP, NATS).
    pub percent_encoded: bool,
    /// The header that carries `datacontenttype` in binary mode.
    pub data_content_type: &'static str,
    /// The header that carries `application/cloudevents+json` in structured
    /// mode.
    pub structured_content_type: &'static str,
}

impl Protocol {
    /// The binding CloudEvents follow over this protocol.
    #[must_use]
    pub const fn cloudevents(self) -> Binding {
        match self {
            Protocol::Kafka => Binding {
                protocol: self,
                default_mode: CloudEventsMode::Binary,
                prefix: "ce_",
                percent_encoded: false,
                data_content_type: "content-type",
                structured_content_type: "content-type",
            },
            Protocol::Nats => Binding {
                protocol: self,
                default_mode: CloudEventsMode::Structured,
                prefix: "ce-",
                percent_encoded: true,
                data_content_type: "ce-datacontenttype",
                structured_content_type: "Content-Type",
            },
            Protocol::Http => Binding {
                protocol: self,
                default_mode: CloudEventsMode::Binary,
                prefix: "ce-",
                percent_encoded: true,
                data_content_type: "Content-Type",
                structured_content_type: "Content-Type",
            },
            Protocol::Amqp => Binding {
                protocol: self,
                default_mode: CloudEventsMode::Binary,
                prefix: "cloudEvents_",
                percent_encoded: false,
                data_content_type: "content-type",
                structured_content_type: "content-type",
            },
            // Google's Pub/Sub binding: `ce-` attributes, UTF-8 values as
            // they are, the content type in `content-type`.
            Protocol::PubSub => Binding {
                protocol: self,
                default_mode: CloudEventsMode::Binary,
                prefix: "ce-",
                percent_encoded: false,
                data_content_type: "content-type",
                structured_content_type: "content-type",
            },
        }
    }
}

impl Default for Binding {
    fn default() -> Self {
        Protocol::default().cloudevents()
    }
}

impl Binding {
    /// The header name of attribute `name` in binary mode.
    #[must_use]
    pub fn attribute(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// An attribute's value as its header carries it.
    #[must_use]
    pub fn value<'a>(&self, value: &'a str) -> Cow<'a, str> {
        if self.percent_encoded {
            percent_encode(value)
        } else {
            Cow::Borrowed(value)
        }
    }
}

/// The HTTP and NATS bindings' percent-encoding set: space, `"`, `%` and the
/// control characters; every byte outside ASCII is encoded as well. Encoded as
/// `%XY` per UTF-8 byte, upper case.
const ENCODED: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

/// A value percent-encoded as the HTTP and NATS bindings say.
#[must_use]
pub fn percent_encode(value: &str) -> Cow<'_, str> {
    utf8_percent_encode(value, ENCODED).into()
}

/// One round of percent-decoding; `None` for bytes that are not UTF-8.
#[must_use]
pub fn percent_decode(value: &str) -> Option<Cow<'_, str>> {
    percent_decode_str(value).decode_utf8().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_protocol_names_its_binding_s_mode_names_and_encoding() {
        let kafka = Protocol::Kafka.cloudevents();
        assert_eq!(kafka.default_mode, CloudEventsMode::Binary);
        assert_eq!(kafka.attribute("id"), "ce_id");
        assert_eq!(kafka.value("a b"), "a b");
        assert_eq!(kafka.data_content_type, "content-type");
        assert_eq!(kafka.structured_content_type, "content-type");

        // NATS: 1.0.2 has structured mode only, so structured is the default;
        // binary as the 1.0.3 text says.
        let nats = Protocol::Nats.cloudevents();
        assert_eq!(nats.default_mode, CloudEventsMode::Structured);
        assert_eq!(nats.attribute("specversion"), "ce-specversion");
        assert_eq!(nats.value("a b"), "a%20b");
        assert_eq!(nats.data_content_type, "ce-datacontenttype");
        assert_eq!(nats.structured_content_type, "Content-Type");

        let http = Protocol::Http.cloudevents();
        assert_eq!(http.default_mode, CloudEventsMode::Binary);
        assert_eq!(http.attribute("time"), "ce-time");
        assert_eq!(http.value("a b"), "a%20b");
        assert_eq!(http.data_content_type, "Content-Type");

        let amqp = Protocol::Amqp.cloudevents();
        assert_eq!(amqp.attribute("id"), "cloudEvents_id");
        assert_eq!(amqp.value("a b"), "a b");
        assert_eq!(amqp.data_content_type, "content-type");
        assert_eq!(Binding::default(), kafka);
    }

    #[test]
    fn values_are_percent_encoded_as_the_http_and_nats_bindings_say() {
        // The binding's own example.
        assert_eq!(
            percent_encode("Euro \u{20AC} \u{1F600}"),
            "Euro%20%E2%82%AC%20%F0%9F%98%80"
        );
        // Space, double quote, percent, controls, DEL; printable ASCII stays.
        assert_eq!(percent_encode("a\"b%c\td\u{7f}"), "a%22b%25c%09d%7F");
        let printable: String = (0x21u8..=0x7e)
            .filter(|b| !matches!(b, b'"' | b'%'))
            .map(char::from)
            .collect();
        assert_eq!(percent_encode(&printable), printable.as_str());
        assert!(matches!(percent_encode("plain/urn:x"), Cow::Borrowed(_)));
        // One round of decoding gives the value back; lower case is accepted;
        // bytes that are not UTF-8 (an overlong space) are refused.
        for v in ["Grüße 42", "100% \"sure\"", "plain"] {
            assert_eq!(percent_decode(&percent_encode(v)).as_deref(), Some(v));
        }
        assert_eq!(percent_decode("%e2%82%ac").as_deref(), Some("\u{20AC}"));
        assert_eq!(percent_decode("%C0%A0"), None);
    }
}
