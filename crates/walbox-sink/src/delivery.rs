//! The outcome of one event: acknowledged, or a [`DeliveryError`] whose
//! [`DeliveryClass`] says what kind of failure it is and what follows from it
//! (a dead letter, a retry, or a stop).

use std::fmt;

/// The outcome of one event.
#[derive(Debug)]
pub struct Delivery {
    /// The token given with the event.
    pub token: usize,
    /// Whether the destination acknowledged it.
    pub result: Result<(), DeliveryError>,
}

/// A record the destination refused for what it is, not for where it went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RejectedRecord {
    /// Its key.
    pub key: Option<bytes::Bytes>,
    /// Its headers, in order (the names mostly static, not copied).
    pub headers: Vec<(walbox_outbox::HeaderName, bytes::Bytes)>,
    /// Size of its value in bytes.
    pub value_len: usize,
    /// How many times walbox sent it (a webhook's retries count; a broker's
    /// client retries inside one send).
    pub attempts: u32,
}

/// The kind of a failed delivery. Its text form ([`DeliveryClass::as_str`]) is
/// what logs and dead-letter headers carry, so it never changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeliveryClass {
    /// The broker did not acknowledge the record within `message.timeout.ms`.
    Timeout,
    /// The record is larger than the broker or the producer accepts.
    MessageTooLarge,
    /// The broker refuses the record as such (e.g. no key on a compacted topic).
    InvalidRecord,
    /// The topic or partition does not exist.
    UnknownTopic,
    /// The topic's name is not valid (the record's topic: it goes to a dead
    /// letter).
    InvalidTopic,
    /// The client may not write to the topic.
    Authorization,
    /// The broker refused the client's credentials (SASL).
    Authentication,
    /// Any other broker or client error.
    BrokerError,
    /// The reader of standard output closed it (EPIPE).
    OutputClosed,
    /// Writing to standard output failed otherwise.
    IoError,
    /// The destination already holds another record under the event's id
    /// (a JetStream stream drops it as a duplicate): another subject or key,
    /// or the same ones from another source position (an id used again). A
    /// drop of the same event is not a failure, and not a record stored: a
    /// sink counts it apart ([`crate::Sink::duplicates`]); see the crate's
    /// rules for destinations that deduplicate.
    DuplicateId,
    /// An HTTP receiver refused the event (a 4xx other than 408, 410, 425
    /// and 429).
    HttpRefused,
    /// An HTTP receiver gave no 2xx within the retry ceiling
    /// (`max_retry_duration_s`).
    RetriesExhausted,
    /// The HTTP endpoint is gone (410).
    EndpointGone,
    /// The HTTP endpoint redirects, and redirects are not followed (3xx).
    EndpointMoved,
}

impl DeliveryClass {
    /// Every class, for checks over all of them.
    pub const ALL: [DeliveryClass; 15] = [
        DeliveryClass::Timeout,
        DeliveryClass::MessageTooLarge,
        DeliveryClass::InvalidRecord,
        DeliveryClass::UnknownTopic,
        DeliveryClass::InvalidTopic,
        DeliveryClass::Authorization,
        DeliveryClass::Authentication,
        DeliveryClass::BrokerError,
        DeliveryClass::OutputClosed,
        DeliveryClass::IoError,
        DeliveryClass::DuplicateId,
        DeliveryClass::HttpRefused,
        DeliveryClass::RetriesExhausted,
        DeliveryClass::EndpointGone,
        DeliveryClass::EndpointMoved,
    ];

    /// The short, stable text form (for logs and dead-letter headers).
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            DeliveryClass::Timeout => "timeout",
            DeliveryClass::MessageTooLarge => "message_too_large",
            DeliveryClass::InvalidRecord => "invalid_record",
            DeliveryClass::UnknownTopic => "unknown_topic",
            DeliveryClass::InvalidTopic => "invalid_topic",
            DeliveryClass::Authorization => "authorization",
            DeliveryClass::Authentication => "authentication",
            DeliveryClass::BrokerError => "broker_error",
            DeliveryClass::OutputClosed => "output_closed",
            DeliveryClass::IoError => "io_error",
            DeliveryClass::DuplicateId => "duplicate_id",
            DeliveryClass::HttpRefused => "http_refused",
            DeliveryClass::RetriesExhausted => "retries_exhausted",
            DeliveryClass::EndpointGone => "endpoint_gone",
            DeliveryClass::EndpointMoved => "endpoint_moved",
        }
    }

    /// Whether a failure of this class is about the message itself, so that
    /// sending it again would fail again (it belongs in a dead-letter topic).
    /// An HTTP receiver's refusal and retries run out count so: the event
    /// goes to a dead letter instead of holding its key for good.
    #[must_use]
    pub const fn is_about_the_message(self) -> bool {
        matches!(
            self,
            DeliveryClass::MessageTooLarge
                | DeliveryClass::InvalidRecord
                | DeliveryClass::InvalidTopic
                | DeliveryClass::HttpRefused
                | DeliveryClass::RetriesExhausted
        )
    }

    /// Whether the destination is gone for good (the reader of standard output
    /// closed it), refuses walbox's credentials, or holds another record under
    /// the event's id, so that no later attempt can deliver it: the relay stops
    /// instead of retrying.
    #[must_use]
    pub const fn is_final(self) -> bool {
        matches!(
            self,
            DeliveryClass::OutputClosed
                | DeliveryClass::Authentication
                | DeliveryClass::DuplicateId
                | DeliveryClass::EndpointGone
                | DeliveryClass::EndpointMoved
        )
    }
}

impl fmt::Display for DeliveryClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An event the destination did not accept.
#[derive(Debug, Clone, thiserror::Error)]
#[error("delivery of event {event_id} to {topic} failed ({class}): {reason}")]
pub struct DeliveryError {
    /// The event.
    pub event_id: String,
    /// Its topic.
    pub topic: String,
    /// The kind of failure.
    pub class: DeliveryClass,
    /// What the destination said.
    pub reason: String,
    /// For a failure about the message itself (too large), the record as it was
    /// sent, without its value: what a dead letter needs.
    pub rejected: Option<RejectedRecord>,
}

impl DeliveryError {
    /// Whether the failure is about the message itself
    /// ([`DeliveryClass::is_about_the_message`]).
    #[must_use]
    pub fn is_about_the_message(&self) -> bool {
        self.class.is_about_the_message()
    }

    /// Whether the destination is gone for good ([`DeliveryClass::is_final`]).
    #[must_use]
    pub fn is_final(&self) -> bool {
        self.class.is_final()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_forms_are_the_stable_names_logs_and_dead_letters_carry() {
        let names: Vec<&str> = DeliveryClass::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(
            names,
            [
                "timeout",
                "message_too_large",
                "invalid_record",
                "unknown_topic",
                "invalid_topic",
                "authorization",
                "authentication",
                "broker_error",
                "output_closed",
                "io_error",
                "duplicate_id",
                "http_refused",
                "retries_exhausted",
                "endpoint_gone",
                "endpoint_moved",
            ]
        );
        for class in DeliveryClass::ALL {
            assert_eq!(class.to_string(), class.as_str());
        }
    }

    #[test]
    fn only_refused_records_and_topics_are_about_the_message_and_only_a_closed_output_refused_credentials_or_a_taken_id_are_final()
     {
        let about: Vec<DeliveryClass> = DeliveryClass::ALL
            .into_iter()
            .filter(|c| c.is_about_the_message())
            .collect();
        assert_eq!(
            about,
            [
                DeliveryClass::MessageTooLarge,
                DeliveryClass::InvalidRecord,
                DeliveryClass::InvalidTopic,
                DeliveryClass::HttpRefused,
                DeliveryClass::RetriesExhausted
            ]
        );
        let last: Vec<DeliveryClass> = DeliveryClass::ALL
            .into_iter()
            .filter(|c| c.is_final())
            .collect();
        assert_eq!(
            last,
            [
                DeliveryClass::Authentication,
                DeliveryClass::OutputClosed,
                DeliveryClass::DuplicateId,
                DeliveryClass::EndpointGone,
                DeliveryClass::EndpointMoved
            ]
        );
        let e = DeliveryError {
            event_id: "e1".into(),
            topic: "t".into(),
            class: DeliveryClass::MessageTooLarge,
            reason: "too big".into(),
            rejected: None,
        };
        assert_eq!(
            e.to_string(),
            "delivery of event e1 to t failed (message_too_large): too big"
        );
    }
}
