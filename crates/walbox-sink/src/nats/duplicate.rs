//! A PubAck marked duplicate is not taken on trust. The stream drops any
//! message whose `Nats-Msg-Id` it holds within its duplicate window, whatever
//! the message: two events with one id (two tables with `bigserial` ids
//! publishing into one stream) would otherwise lose the second one silently.
//! A duplicate's PubAck names the sequence of the message the stream holds;
//! that message is read back and compared with what walbox published: subject
//! and key header, and the source position (`walbox_commit_lsn`,
//! `walbox_index`) when both are streamed events (`walbox_xid` not 0). Not the
//! payload, nor a snapshot row's position: a legitimate repeat can differ in
//! them (a snapshot taken again carries the snapshot's position, and a
//! CloudEvent without `occurred_at` takes its time from the commit, which a
//! snapshot row has not). A streamed event's position is the same on every
//! copy (a replay, a promoted standby's WAL); another position under the same
//! id, subject and key is another event: a primary promoted without
//! `synchronized_standby_slots` can hand out again a `bigserial` id walbox
//! published from the history it lost. Equal: a replay, delivered. Different:
//! a collision, which no retry can deliver. A message the stream no longer holds (retention,
//! a work queue, a deletion) cannot be compared: the duplicate is taken as
//! delivered, with a warning. Only duplicates (replays after a crash) pay for
//! the read.

use async_nats::HeaderMap;
use async_nats::jetstream::{self, publish::PublishAck, stream::RawMessageErrorKind};
use walbox_outbox::header;

use super::headers::{KEY_HEADER, ORIGIN_HEADER, stable_origin};
use crate::DeliveryClass;

/// What walbox published, to compare with what the stream holds.
#[derive(Debug)]
pub(super) struct Sent {
    /// The subject it went to.
    pub(super) subject: String,
    /// Its `Nats-Msg-Id`.
    pub(super) msg_id: String,
    /// Its key header, as sent.
    pub(super) key: Option<String>,
    /// Its source position, as sent.
    pub(super) position: Option<SourcePosition>,
}

impl Sent {
    /// What is published to `subject` under `msg_id` for `event`, with the
    /// key header `key`: its position only when every read of the WAL gives
    /// it the same one ([`walbox_outbox::Origin::position_is_stable`]).
    pub(super) fn of_event(
        subject: &str,
        msg_id: &str,
        key: Option<String>,
        event: &walbox_outbox::Event,
    ) -> Sent {
        let position = event.origin.position_is_stable().then(|| SourcePosition {
            commit_lsn: event.position.commit_lsn.to_string(),
            index: event.position.index.to_string(),
        });
        Sent {
            subject: subject.to_owned(),
            msg_id: msg_id.to_owned(),
            key,
            position,
        }
    }

    /// What is published to `subject` under `msg_id` with `headers`.
    #[cfg(test)]
    pub(super) fn of(subject: &str, msg_id: &str, headers: &HeaderMap) -> Sent {
        Sent {
            subject: subject.to_owned(),
            msg_id: msg_id.to_owned(),
            key: headers.get(KEY_HEADER).map(|v| v.as_str().to_owned()),
            position: SourcePosition::of(headers),
        }
    }
}

/// The position headers of a streamed event, as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SourcePosition {
    /// `walbox_commit_lsn`.
    pub(super) commit_lsn: String,
    /// `walbox_index`.
    pub(super) index: String,
}

impl SourcePosition {
    /// The position in `headers`, when the message is a copy whose position
    /// stays the same on every read: its [`ORIGIN_HEADER`] (walbox's own,
    /// written for every event not streamed) says so. A message stored
    /// before walbox wrote that header counts as streamed unless its
    /// `walbox_xid` is 0 (a snapshot row, a non-transactional message).
    fn of(headers: &HeaderMap) -> Option<SourcePosition> {
        let text = |name: &str| headers.get(name).map(|v| v.as_str().to_owned());
        match text(ORIGIN_HEADER) {
            Some(origin) if !stable_origin(&origin) => return None,
            Some(_) => {}
            None if text(header::XID).is_some_and(|x| x.trim() == "0") => return None,
            None => {}
        }
        Some(SourcePosition {
            commit_lsn: text(header::COMMIT_LSN)?,
            index: text(header::INDEX)?,
        })
    }
}

impl std::fmt::Display for SourcePosition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "commit LSN {}, index {}", self.commit_lsn, self.index)
    }
}

/// How the message the stream holds compares with what walbox published.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// The same event: a replay.
    Same,
    /// Another subject or key under the id.
    OtherRecord,
    /// The same subject and key, another source position: another event
    /// that was given the same id.
    OtherPosition(SourcePosition, SourcePosition),
}

/// Compares the stored message (its subject and headers) with `sent`.
pub(super) fn compare(stored_subject: &str, stored: Option<&HeaderMap>, sent: &Sent) -> Verdict {
    let key = stored.and_then(|h| h.get(KEY_HEADER)).map(|v| v.as_str());
    if stored_subject != sent.subject || key != sent.key.as_deref() {
        return Verdict::OtherRecord;
    }
    match (stored.and_then(SourcePosition::of), &sent.position) {
        (Some(theirs), Some(ours)) if theirs != *ours => {
            Verdict::OtherPosition(theirs, ours.clone())
        }
        _ => Verdict::Same,
    }
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
    let verdict = compare(stored.subject.as_str(), Some(&stored.headers), sent);
    if verdict == Verdict::Same {
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
    let reason = match verdict {
        Verdict::OtherPosition(theirs, ours) => {
            reused(ack, event_id, sent, &theirs, &ours, &window)
        }
        _ => collision(ack, event_id, sent, stored.subject.as_str(), &window),
    };
    Err((DeliveryClass::DuplicateId, reason))
}

/// The reason when the stored message is another event on the same subject
/// and key: both positions, the id, the window and what it means.
fn reused(
    ack: &PublishAck,
    event_id: &str,
    sent: &Sent,
    theirs: &SourcePosition,
    ours: &SourcePosition,
    window: &str,
) -> String {
    format!(
        "stream {stream} dropped event {event_id} ({ours}) on subject {subject} as a \
         duplicate: it already holds another event under Nats-Msg-Id {msg_id} (sequence \
         {sequence}, {theirs}), stored within its duplicate window of {window}, with the same \
         subject and key but another source position; the id was used again, as a primary \
         promoted without synchronized_standby_slots does with a bigserial id that walbox \
         published from the history it lost (the stored event is a phantom the table no longer \
         holds); consumers that deduplicate by event id would drop this event too: use uuid \
         ids (e.g. id uuid DEFAULT gen_random_uuid()) and synchronized_standby_slots; walbox \
         stops before this event",
        stream = ack.stream,
        subject = sent.subject,
        msg_id = sent.msg_id,
        sequence = ack.sequence,
    )
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
            position: None,
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

    fn headers(subject_key: &str, lsn: &str, index: &str, xid: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(KEY_HEADER, subject_key);
        h.insert(header::COMMIT_LSN, lsn);
        h.insert(header::INDEX, index);
        h.insert(header::XID, xid);
        h
    }

    #[test]
    fn a_stored_event_of_another_position_is_another_event_unless_either_is_a_snapshot_row() {
        let ours = headers("k", "0/16B3748", "2", "750");
        let sent = Sent::of("outbox.order", "17", &ours);
        // The same event again (a replay after a crash, a promoted standby's WAL).
        assert_eq!(
            compare(
                "outbox.order",
                Some(&headers("k", "0/16B3748", "2", "750")),
                &sent
            ),
            Verdict::Same
        );
        // Another commit or another place in it: the id was used again.
        for (lsn, index) in [("0/16C0000", "2"), ("0/16B3748", "3")] {
            match compare(
                "outbox.order",
                Some(&headers("k", lsn, index, "751")),
                &sent,
            ) {
                Verdict::OtherPosition(theirs, mine) => {
                    assert_eq!(
                        (theirs.commit_lsn.as_str(), theirs.index.as_str()),
                        (lsn, index)
                    );
                    assert_eq!(mine.commit_lsn, "0/16B3748");
                }
                other => panic!("{lsn} {index}: {other:?}"),
            }
        }
        // A snapshot row (xid 0) on either side carries the snapshot's
        // position, which a snapshot taken again changes.
        assert_eq!(
            compare(
                "outbox.order",
                Some(&headers("k", "0/1000000", "40", "0")),
                &sent
            ),
            Verdict::Same
        );
        let row = Sent::of("outbox.order", "17", &headers("k", "0/1000000", "40", "0"));
        assert_eq!(compare("outbox.order", Some(&ours), &row), Verdict::Same);
        // A message without position headers (another publisher's) cannot be
        // compared by position; another subject or key is a collision first.
        assert_eq!(
            compare("outbox.order", Some(&HeaderMap::new()), &sent),
            Verdict::OtherRecord
        );
        assert_eq!(
            compare(
                "outbox.other",
                Some(&headers("k", "0/16B3748", "2", "750")),
                &sent
            ),
            Verdict::OtherRecord
        );
        let mut no_position = HeaderMap::new();
        no_position.insert(KEY_HEADER, "k");
        assert_eq!(
            compare("outbox.order", Some(&no_position), &sent),
            Verdict::Same
        );
    }

    /// A row dead-lettered twice (by an interrupted snapshot and the one
    /// taken again, at two snapshot points): `walbox dlq replay` publishes
    /// both letters' events under the row's id. The second is the same
    /// event, not a reused id: snapshot positions differ between copies.
    #[test]
    fn a_snapshot_rows_letters_replayed_from_two_snapshots_are_the_same_event() {
        let mut stored = headers("k", "0/1000", "3", "0");
        stored.insert(super::super::headers::ORIGIN_HEADER, "dlq_replay_snapshot");
        let event = walbox_outbox::Event {
            event_id: "r".into(),
            topic: "outbox.order".into(),
            key: Some(bytes::Bytes::from_static(b"k")),
            value: bytes::Bytes::from_static(b"{}"),
            json_value: true,
            headers: Vec::new(),
            position: walbox_outbox::Position {
                commit_lsn: walbox_pgoutput::Lsn(0x2000),
                index: 5,
                xid: 0,
            },
            origin: walbox_outbox::Origin::DeadLetterReplay {
                letter: "dlq.outbox.order.dlq.9".into(),
                snapshot: Some(walbox_pgoutput::Lsn(0x2000)),
            },
        };
        let sent = Sent::of_event("outbox.order", "r", Some("k".into()), &event);
        assert_eq!(compare("outbox.order", Some(&stored), &sent), Verdict::Same);
        // A streamed event's letter keeps its position: another one under the
        // id is another event.
        let mut streamed = event.clone();
        streamed.position.xid = 9;
        streamed.origin = walbox_outbox::Origin::DeadLetterReplay {
            letter: "dlq.outbox.order.dlq.10".into(),
            snapshot: None,
        };
        let sent = Sent::of_event("outbox.order", "r", Some("k".into()), &streamed);
        let mut other = headers("k", "0/1000", "3", "7");
        other.insert(super::super::headers::ORIGIN_HEADER, "dlq_replay");
        assert!(matches!(
            compare("outbox.order", Some(&other), &sent),
            Verdict::OtherPosition(..)
        ));
    }

    #[test]
    fn a_reused_id_names_both_positions_the_id_the_window_and_the_cause() {
        let ack = PublishAck {
            stream: "OUTBOX".into(),
            sequence: 7,
            domain: String::new(),
            duplicate: true,
            value: None,
        };
        let sent = Sent::of("outbox.order", "17", &headers("k", "0/2000000", "0", "900"));
        let theirs = SourcePosition {
            commit_lsn: "0/1000000".into(),
            index: "4".into(),
        };
        let text = reused(
            &ack,
            "17",
            &sent,
            &theirs,
            sent.position.as_ref().unwrap(),
            "600 s",
        );
        for part in [
            "event 17 (commit LSN 0/2000000, index 0)",
            "sequence 7, commit LSN 0/1000000, index 4",
            "Nats-Msg-Id 17",
            "600 s",
            "synchronized_standby_slots",
            "uuid",
            "walbox stops before this event",
        ] {
            assert!(text.contains(part), "{part}: {text}");
        }
    }
}
