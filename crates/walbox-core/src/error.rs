//! What can stop the core, and what a failed delivery carries.

use walbox_outbox::{Event, MappingError, Position, TopicTemplate};
use walbox_pgoutput::{DecodeError, Lsn, Oid};

/// The class of a refusal for size (the sinks' `message_too_large`): the one
/// refusal of a dead letter that sending it without its value can help.
pub const TOO_LARGE: &str = "message_too_large";

/// A failed delivery, as the sink reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The event.
    pub event_id: String,
    /// Its topic.
    pub topic: String,
    /// Short class of the failure (for logs and dead-letter headers).
    pub class: &'static str,
    /// What the destination said.
    pub reason: String,
    /// The failure is about the message itself (sending it again would fail
    /// again), not about where it went.
    pub about_message: bool,
    /// The destination is gone for good (a closed stdout pipe): a new session
    /// would fail the same way.
    pub lasting: bool,
    /// For a failure about the message, the record as sent, without its value.
    pub rejected: Option<Rejected>,
}

/// A record the destination refused for what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// Its key.
    pub key: Option<bytes::Bytes>,
    /// Its headers, in order.
    pub headers: Vec<(walbox_outbox::HeaderName, bytes::Bytes)>,
    /// Size of its value in bytes.
    pub value_len: usize,
    /// How many times it was sent: the dead letter's `walbox_attempts`.
    pub attempts: u32,
}

impl Rejected {
    /// The value of header `name`, when it is text.
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    /// The source position its headers carry (zero where one is missing).
    fn position(&self) -> Position {
        Position {
            commit_lsn: self
                .header(walbox_outbox::header::COMMIT_LSN)
                .and_then(|v| v.parse().ok())
                .unwrap_or(Lsn(0)),
            index: self
                .header(walbox_outbox::header::INDEX)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            xid: self
                .header(walbox_outbox::header::XID)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
        }
    }

    /// Its headers as an event's.
    fn event_headers(&self) -> Vec<(walbox_outbox::HeaderName, bytes::Bytes)> {
        self.headers.clone()
    }
}

impl Failure {
    /// The dead letter that takes the refused event's place: its key and
    /// headers, the failure's class and reason, where it came from (`source`: a
    /// table's `schema.name` or a message prefix's source name, so that `dlq
    /// replay` knows what to rebuild it from), and a value that describes it
    /// (the value itself is what was refused). A dead letter refused for its size
    /// (a poison row's columns or a message's content too large for the broker)
    /// is sent again with the same headers and only that description as its
    /// value, marked `walbox_value_omitted`. `None` when there is no record, the
    /// record is a dead letter refused for something else, or such a reduced dead
    /// letter already (its headers alone are refused).
    #[must_use]
    pub fn dead_letter(&self, template: &TopicTemplate, source: &str) -> Option<Event> {
        use walbox_outbox::dead_letter_header as dl;
        let record = self.rejected.as_ref()?;
        if record.headers.iter().any(|(k, _)| k == dl::VALUE_OMITTED) {
            return None;
        }
        if self.is_dead_letter() {
            // Only a size can be helped by leaving the value out.
            return (self.class == TOO_LARGE).then(|| self.reduced_dead_letter(record));
        }
        let header = |name: &str| record.header(name);
        let position = record.position();
        let mut headers = record.event_headers();
        if header(walbox_outbox::header::EVENT_ID).is_none() && !self.event_id.is_empty() {
            // A format that names the id otherwise: dead letters carry it as
            // in every format.
            headers.push((
                walbox_outbox::header::EVENT_ID.into(),
                bytes::Bytes::from(self.event_id.clone()),
            ));
        }
        headers.push((
            dl::ERROR_CLASS.into(),
            bytes::Bytes::from_static(self.class.as_bytes()),
        ));
        headers.push((dl::ERROR.into(), bytes::Bytes::from(self.reason.clone())));
        headers.push((
            dl::SOURCE_TOPIC.into(),
            bytes::Bytes::from(self.topic.clone()),
        ));
        headers.push((
            dl::ATTEMPTS.into(),
            bytes::Bytes::from(record.attempts.to_string()),
        ));
        let (name, origin) = match walbox_outbox::MessageConfig::prefix_of(source) {
            Some(prefix) => (walbox_outbox::SOURCE_MESSAGE_PREFIX, prefix),
            None => (dl::SOURCE_TABLE, source),
        };
        if header(name).is_none() {
            headers.push((name.into(), bytes::Bytes::from(origin.to_owned())));
        }
        let value = serde_json::json!({
            "topic": self.topic,
            "value_bytes": record.value_len,
            "value": null,
        })
        .to_string();
        Some(Event {
            event_id: self.event_id.clone(),
            topic: template.dead_letter_topic(&self.topic),
            key: record.key.clone(),
            value: bytes::Bytes::from(value),
            json_value: true,
            headers,
            position,
            origin: walbox_outbox::Origin::Stream,
        })
    }
}

impl Failure {
    /// Whether the refused record is a dead letter already (counted as one).
    #[must_use]
    pub fn is_dead_letter(&self) -> bool {
        use walbox_outbox::dead_letter_header as dl;
        self.rejected
            .as_ref()
            .is_some_and(|r| r.headers.iter().any(|(k, _)| k == dl::ERROR_CLASS))
    }

    /// A refused dead letter again, its value left out: it keeps its topic, key,
    /// headers (the first refusal's class and reason among them) and position.
    fn reduced_dead_letter(&self, record: &Rejected) -> Event {
        use walbox_outbox::dead_letter_header as dl;
        let header = |name: &str| record.header(name);
        let position = record.position();
        let mut headers = record.event_headers();
        headers.push((
            dl::VALUE_OMITTED.into(),
            bytes::Bytes::from_static(self.class.as_bytes()),
        ));
        let value = serde_json::json!({
            "topic": header(dl::SOURCE_TOPIC),
            "value_bytes": record.value_len,
            "value": null,
        })
        .to_string();
        Event {
            event_id: self.event_id.clone(),
            topic: self.topic.clone(),
            key: record.key.clone(),
            value: bytes::Bytes::from(value),
            json_value: true,
            headers,
            position,
            origin: walbox_outbox::Origin::Stream,
        }
    }
}

/// Why the core stopped.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// A message from the server could not be decoded.
    #[error("decoding the replication stream: {0}")]
    Decode(#[from] DecodeError),
    /// Messages out of protocol order.
    #[error("replication stream out of order: {0}")]
    Protocol(&'static str),
    /// An outbox table's shape does not fit its configuration.
    #[error(transparent)]
    Mapping(#[from] MappingError),
    /// An insert into a published table that is no outbox: walbox cannot map it
    /// and does not pass it in silence.
    #[error(
        "an insert into {table} (oid {oid}) came through publication {publication}, but no \
         [[outbox]] table maps {table}; walbox stops before its position passes it{}. Add \
         {table} to [[outbox]], or to source.ignore_tables if its events are not walbox's to \
         relay, or remove it from the publication (ALTER PUBLICATION {publication} DROP TABLE \
         {table}; transactions written before that still carry it), or, when it is a \
         partition of an outbox table, publish partitions as their root (ALTER PUBLICATION \
         {publication} SET (publish_via_partition_root = true))",
        commit_lsn.map(|l| format!(" (transaction committing at {l})")).unwrap_or_default()
    )]
    Unmapped {
        /// The relation's name as the stream gave it.
        table: String,
        /// The publication.
        publication: String,
        /// Its oid.
        oid: Oid,
        /// The transaction's commit LSN.
        commit_lsn: Option<Lsn>,
    },
    /// A row that cannot become an event, under the stop policy.
    #[error(
        "{} with event id {event_id} at {}#{} (xid {}) in {table} cannot be published \
         ({class}): {reason}",
        if walbox_outbox::MessageConfig::is_message_source(table) {
            "logical decoding message"
        } else {
            "outbox row"
        },
        position.commit_lsn, position.index, position.xid
    )]
    Poison {
        /// The row's event id (or its stand-in).
        event_id: String,
        /// Its position.
        position: Position,
        /// Its table.
        table: String,
        /// The error's class.
        class: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A delivery failed; the position stays at `confirmed`.
    #[error(
        "delivery of event {} to {} failed ({}): {}; the position stays at {confirmed} and the \
         next session resumes there",
        failure.event_id, failure.topic, failure.class, failure.reason
    )]
    Delivery {
        /// Whether a new session may succeed (not about the message itself).
        transient: bool,
        /// The acknowledged position.
        confirmed: Lsn,
        /// The failure.
        failure: Box<Failure>,
    },
    /// A delivery report for a token the core never gave out.
    #[error("delivery report for an unknown event (token {0})")]
    UnknownToken(usize),
}

impl CoreError {
    /// Whether a new session, resuming from the checkpoint, can succeed.
    #[must_use]
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            CoreError::Delivery {
                transient: true,
                ..
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(headers: &[(&str, &str)]) -> Failure {
        Failure {
            event_id: "e-1".into(),
            topic: "outbox.event.Order".into(),
            class: "message_too_large",
            reason: "too large".into(),
            about_message: true,
            lasting: false,
            rejected: Some(Rejected {
                key: Some(bytes::Bytes::from_static(b"1")),
                headers: headers
                    .iter()
                    .map(|(k, v)| {
                        (
                            (*k).to_owned().into(),
                            bytes::Bytes::copy_from_slice(v.as_bytes()),
                        )
                    })
                    .collect(),
                value_len: 2_000_000,
                attempts: 1,
            }),
        }
    }

    fn event_id_headers(e: &Event) -> Vec<&[u8]> {
        e.headers
            .iter()
            .filter(|(k, _)| k == walbox_outbox::header::EVENT_ID)
            .map(|(_, v)| v.as_ref())
            .collect()
    }

    #[test]
    fn a_refused_record_of_any_format_dead_letters_with_its_event_id_header() {
        let template = TopicTemplate::parse("{topic}.dlq").unwrap();
        // Debezium's format names the id `id`: the dead letter adds `event_id`.
        let dead = refused(&[("id", "e-1"), ("walbox_index", "4")])
            .dead_letter(&template, "public.outbox")
            .unwrap();
        assert_eq!(event_id_headers(&dead), [b"e-1"]);
        assert_eq!(dead.position.index, 4);
        let source = |e: &Event, name: &str| {
            e.headers
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(
            source(&dead, "walbox_source_table").as_deref(),
            Some(&b"public.outbox"[..])
        );
        // A message's record names its prefix, for `dlq replay`.
        let message = refused(&[("id", "e-1")])
            .dead_letter(&template, "message:walbox")
            .unwrap();
        assert_eq!(
            source(&message, "walbox_source_message_prefix").as_deref(),
            Some(&b"walbox"[..])
        );
        assert_eq!(source(&message, "walbox_source_table"), None);
        assert_eq!(dead.topic, "outbox.event.Order.dlq");
        // walbox's format has it already: not twice.
        let dead = refused(&[("event_id", "e-1")])
            .dead_letter(&template, "public.outbox")
            .unwrap();
        assert_eq!(event_id_headers(&dead), [b"e-1"]);
    }

    #[test]
    fn a_refused_dead_letter_is_sent_again_without_its_value_and_then_no_more() {
        let template = TopicTemplate::parse("{topic}.dlq").unwrap();
        let mut letter = refused(&[
            ("event_id", "e-1"),
            ("walbox_commit_lsn", "0/FA"),
            ("walbox_error_class", "non_transactional_message"),
            ("walbox_error", "non-transactional message"),
            ("walbox_source_topic", "outbox.event.Order"),
        ]);
        letter.topic = "outbox.event.Order.dlq".into();
        let reduced = letter
            .dead_letter(&template, "message:walbox")
            .expect("a smaller letter");
        // Same topic (not `.dlq.dlq`), key, position and first reason; the value
        // only says what was left out.
        assert_eq!(reduced.topic, "outbox.event.Order.dlq");
        assert_eq!(reduced.key.as_deref(), Some(&b"1"[..]));
        assert_eq!(reduced.position.commit_lsn, Lsn(250));
        let header = |name: &str| {
            reduced
                .headers
                .iter()
                .filter(|(k, _)| k == name)
                .map(|(_, v)| v.as_ref())
                .collect::<Vec<&[u8]>>()
        };
        assert_eq!(header("walbox_error_class"), [b"non_transactional_message"]);
        assert_eq!(header("walbox_value_omitted"), [b"message_too_large"]);
        let value: serde_json::Value = serde_json::from_slice(&reduced.value).unwrap();
        assert_eq!(value["value_bytes"], 2_000_000);
        assert_eq!(value["topic"], "outbox.event.Order");
        assert!(value["value"].is_null());
        // A dead letter refused for something a smaller value cannot help.
        let mut invalid = letter.clone();
        invalid.class = "invalid_topic";
        assert!(invalid.dead_letter(&template, "message:walbox").is_none());
        // Refused again (its headers alone too large): nothing smaller is left.
        let mut again = refused(&[
            ("walbox_error_class", "non_transactional_message"),
            ("walbox_value_omitted", "message_too_large"),
        ]);
        again.topic = reduced.topic;
        assert!(again.dead_letter(&template, "message:walbox").is_none());
    }
}
