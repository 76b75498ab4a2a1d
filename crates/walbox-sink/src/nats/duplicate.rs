//! A PubAck marked duplicate is not taken on trust. The stream drops any
//! message whose `Nats-Msg-Id` it holds within its duplicate window, whatever
//! the message: two events with one id (two tables with `bigserial` ids
//! publishing into one stream) would otherwise lose the second one silently.
//! A duplicate's PubAck names the sequence of the message the stream holds;
//! that message is read back and compared with what walbox published: subject
//! and key header. Not the payload or the position headers: a legitimate repeat
//! can differ in them (a snapshot taken again carries the snapshot's position,
//! and a CloudEvent without `occurred_at` takes its time from the commit, which
//! a snapshot row has not). Equal: a replay, delivered. Different: a collision,
//! which no retry can deliver. A message the stream no longer holds (retention,
//! a work queue, a deletion) cannot be compared: the duplicate is taken as
//! delivered, with a warning. Only duplicates (replays after a crash) pay for
//! the read.

use async_nats::jetstream::{self, publish::PublishAck, stream::RawMessageErrorKind};

use super::headers::KEY_HEADER;
use crate::DeliveryClass;

/// What walbox published, to compare with what the stream holds.
pub(super) struct Sent {
    /// The subject it went to.
    pub(super) subject: String,
    /// Its `Nats-Msg-Id`.
    pub(super) msg_id: String,
    /// Its key header, as sent.
    pub(super) key: Option<String>,
}

/// Checks a PubAck marked duplicate: `Ok` when the stream holds what walbox
/// published, else the failure to report.
pub(super) async fn check(
    js: &jetstream::Context,
    ack: &PublishAck,
    event_id: &str,
    sent: &Sent,
) -> Result<(), (DeliveryClass, String)> {
    let stream = js
        .get_stream_no_info(&ack.stream)
        .await
        .map_err(|e| unreadable(ack, &e.to_string()))?;
    let stored = match stream.get_raw_message(ack.sequence).await {
        Ok(stored) => stored,
        Err(e) if matches!(e.kind(), RawMessageErrorKind::NoMessageFound) => {
            tracing::warn!(
                event_id,
                subject = sent.subject,
                stream = ack.stream,
                sequence = ack.sequence,
                "the stream answered duplicate, naming a message it no longer holds \
                 (retention, a work queue, a deletion): taken as delivered without comparing"
            );
            return Ok(());
        }
        Err(e) => return Err(unreadable(ack, &e.to_string())),
    };
    let key = stored.headers.get(KEY_HEADER).map(|v| v.as_str());
    if stored.subject.as_str() == sent.subject && key == sent.key.as_deref() {
        tracing::debug!(
            event_id,
            subject = sent.subject,
            sequence = ack.sequence,
            "already stored"
        );
        return Ok(());
    }
    let window = match js.get_stream(&ack.stream).await {
        Ok(mut s) => match s.info().await {
            Ok(info) => format!("{} s", info.config.duplicate_window.as_secs()),
            Err(_) => "(unknown)".into(),
        },
        Err(_) => "(unknown)".into(),
    };
    Err((
        DeliveryClass::DuplicateId,
        collision(ack, event_id, sent, stored.subject.as_str(), &window),
    ))
}

/// The reason of a collision: both subjects, the id, the window and the fix.
fn collision(
    ack: &PublishAck,
    event_id: &str,
    sent: &Sent,
    stored_subject: &str,
    window: &str,
) -> String {
    format!(
        "stream {stream} dropped event {event_id} on subject {subject} as a duplicate: it \
         already holds another message with Nats-Msg-Id {msg_id} (sequence {sequence}, on \
         subject {stored_subject}), stored within its duplicate window of {window}; event \
         ids must be unique within the stream for its duplicate window: use uuid ids (e.g. \
         id uuid DEFAULT gen_random_uuid()), or give each table its own stream; walbox stops \
         before this event",
        stream = ack.stream,
        subject = sent.subject,
        msg_id = sent.msg_id,
        sequence = ack.sequence,
    )
}

/// The failure when the message a duplicate's PubAck names cannot be read:
/// transient, the next session publishes the event again.
fn unreadable(ack: &PublishAck, error: &str) -> (DeliveryClass, String) {
    (
        DeliveryClass::BrokerError,
        format!(
            "the stream {} answered duplicate, naming sequence {}, which could not be read \
             ({error}); walbox delivers a duplicate only once it has compared it with the \
             stored message, and publishes it again (walbox's NATS user needs \
             $JS.API.STREAM.MSG.GET.{} for that)",
            ack.stream, ack.sequence, ack.stream
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_collision_names_both_subjects_the_id_the_window_and_the_fix() {
        let ack = PublishAck {
            stream: "OUTBOX".into(),
            sequence: 7,
            domain: String::new(),
            duplicate: true,
            value: None,
        };
        let sent = Sent {
            subject: "outbox.b.order".into(),
            msg_id: "1".into(),
            key: Some("k".into()),
        };
        let text = collision(&ack, "1", &sent, "outbox.a.order", "120 s");
        for part in [
            "outbox.b.order",
            "outbox.a.order",
            "event 1",
            "Nats-Msg-Id 1",
            "120 s",
            "uuid",
            "its own stream",
        ] {
            assert!(text.contains(part), "{part}: {text}");
        }
    }
}
