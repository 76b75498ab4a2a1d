//! Events that cannot be published: a row or a message the mapping refuses
//! becomes a dead letter in its place (counted and logged without values), or
//! stops the core under the stop policy.

use walbox_outbox::{Event, Mapper, Position};
use walbox_pgoutput::TupleValue;

use super::CoreConfig;
use crate::error::CoreError;

/// Maps `row` (of a transaction committed at `commit_time`, when known), or
/// builds its dead letter (counting it; then `true`), or stops under the stop
/// policy.
pub(super) fn map_row(
    mapper: &Mapper,
    row: &[TupleValue],
    position: Position,
    commit_time: Option<i64>,
    cfg: &CoreConfig,
    dead_lettered: &mut u64,
) -> Result<(Event, bool), CoreError> {
    match mapper.map_at(row, position, commit_time) {
        Ok(event) => Ok((event, false)),
        Err(e) => {
            let dead = mapper.dead_letter(row, position, &e, &cfg.dead_letter_topic);
            let refused = Refused {
                source: mapper.table(),
                position,
                class: e.class(),
                reason: &e,
            };
            refused.take(dead, cfg, dead_lettered).map(|d| (d, true))
        }
    }
}

/// What the mapping refused: where it came from, its position, and why.
pub(super) struct Refused<'a> {
    /// The table's `schema.name`, or a message prefix's source name.
    pub source: &'a str,
    pub position: Position,
    pub class: &'static str,
    pub reason: &'a dyn std::fmt::Display,
}

impl Refused<'_> {
    /// `dead` in the refused event's place (logged and counted), or the stop
    /// under the stop policy.
    pub(super) fn take(
        self,
        dead: Event,
        cfg: &CoreConfig,
        dead_lettered: &mut u64,
    ) -> Result<Event, CoreError> {
        let position = self.position;
        if cfg.stop_on_poison {
            return Err(CoreError::Poison {
                event_id: dead.event_id,
                position,
                table: self.source.to_owned(),
                class: self.class,
                reason: self.reason.to_string(),
            });
        }
        tracing::warn!(
            table = self.source,
            event_id = %dead.event_id,
            position = %format_args!("{}#{}", position.commit_lsn, position.index),
            class = self.class,
            reason = %self.reason,
            topic = %dead.topic,
            "dead-lettered"
        );
        *dead_lettered += 1;
        Ok(dead)
    }
}
