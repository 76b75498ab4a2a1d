//! The outcome of each publication: the PubAck awaited in publishing order,
//! a duplicate checked, a failure classified, and a [`Delivery`] reported for
//! each.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_nats::jetstream::{
    self,
    context::{PublishAckFuture, PublishError, PublishErrorKind},
};
use tokio::sync::mpsc;

use super::duplicate::{self, Sent};
use crate::kit::Reports;
use crate::{DeliveryClass, RejectedRecord};

/// One publication waiting for its outcome, in publishing order.
pub(super) struct Pending {
    pub(super) token: usize,
    pub(super) event_id: String,
    pub(super) subject: String,
    pub(super) outcome: Outcome,
    /// The record without its value, for a dead letter.
    pub(super) rejected: RejectedRecord,
    /// What was published, for a PubAck marked duplicate.
    pub(super) sent: Option<Sent>,
}

pub(super) enum Outcome {
    Wait(PublishAckFuture),
    /// Acknowledged already (a probe: stored, or a duplicate checked).
    Delivered,
    Failed(DeliveryClass, String),
}

/// The class and reason of a publication the server refused or did not
/// acknowledge; `after_duplicate`: the one before it was dropped as a
/// duplicate.
pub(super) fn failure(e: &PublishError, after_duplicate: bool) -> (DeliveryClass, String) {
    let text = match std::error::Error::source(e) {
        Some(s) => format!("{e}: {s}"),
        None => e.to_string(),
    };
    let text = match e.kind() {
        PublishErrorKind::WrongLastMessageId if after_duplicate => {
            format!("{text}: {AFTER_DUPLICATE}")
        }
        PublishErrorKind::WrongLastMessageId => format!("{text}: {NOT_CHAINED}"),
        _ => text,
    };
    (classify(e.kind(), &text), text)
}

/// The class of a failed publication.
pub(super) fn classify(kind: PublishErrorKind, text: &str) -> DeliveryClass {
    match kind {
        PublishErrorKind::MaxPayloadExceeded => DeliveryClass::MessageTooLarge,
        PublishErrorKind::TimedOut => DeliveryClass::Timeout,
        PublishErrorKind::StreamNotFound => DeliveryClass::UnknownTopic,
        _ if text.contains("message size exceeds maximum") => DeliveryClass::MessageTooLarge,
        _ if text.contains("ermission") || text.contains("authorization") => {
            DeliveryClass::Authorization
        }
        _ => DeliveryClass::BrokerError,
    }
}

/// Why a chained publication was refused, and what walbox does about it.
const NOT_CHAINED: &str = "the stream's last message is not the one walbox published before \
     this one: another publisher wrote to the stream (walbox must be its only publisher), or \
     an earlier publication was lost; walbox publishes again from its acknowledged position";

/// Why a chained publication was refused right after one the stream dropped
/// as a duplicate: the stream's last message is not that one.
const AFTER_DUPLICATE: &str = "the publication before it was dropped by the stream as a \
     duplicate of a copy stored earlier, and the stream's last message is one stored since \
     (a replay or dead-letter replay between two sessions); walbox publishes again from its \
     acknowledged position";

/// Reports outcomes in publishing order; counts the duplicates delivered.
pub(super) async fn report(
    js: jetstream::Context,
    mut rx: mpsc::UnboundedReceiver<Pending>,
    reports: Reports,
    duplicates: Arc<AtomicU64>,
) {
    // Whether the previous publication was dropped as a duplicate.
    let mut after_duplicate = false;
    while let Some(p) = rx.recv().await {
        let was_duplicate = std::mem::take(&mut after_duplicate);
        let failed = match p.outcome {
            Outcome::Wait(fut) => match fut.await {
                Ok(ack) => match (&p.sent, ack.duplicate) {
                    (Some(sent), true) => {
                        let checked = duplicate::check(&js, &ack, &p.event_id, sent).await;
                        if checked.is_ok() {
                            duplicates.fetch_add(1, Ordering::SeqCst);
                            after_duplicate = true;
                        }
                        checked.err()
                    }
                    _ => None,
                },
                Err(e) => Some(failure(&e, was_duplicate)),
            },
            Outcome::Delivered => None,
            Outcome::Failed(class, reason) => Some((class, reason)),
        };
        let result = match failed {
            None => Ok(()),
            Some((class, reason)) => Err(crate::kit::refused(
                p.event_id, p.subject, class, reason, p.rejected,
            )),
        };
        reports.report(p.token, result);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_classified() {
        assert_eq!(
            classify(PublishErrorKind::MaxPayloadExceeded, ""),
            DeliveryClass::MessageTooLarge
        );
        assert_eq!(
            classify(
                PublishErrorKind::Other,
                "publish failed: message size exceeds maximum allowed"
            ),
            DeliveryClass::MessageTooLarge
        );
        assert_eq!(
            classify(PublishErrorKind::TimedOut, ""),
            DeliveryClass::Timeout
        );
        assert_eq!(
            classify(PublishErrorKind::WrongLastMessageId, ""),
            DeliveryClass::BrokerError
        );
    }
}
