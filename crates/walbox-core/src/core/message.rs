//! Logical decoding messages as the core sees them: a transactional message of a
//! configured prefix is an event of its transaction exactly like an outbox
//! insert (same index sequence, same resume skip, same dead letters); a
//! non-transactional one has no commit order, so it is dead-lettered as a
//! one-event unit of its own at its LSN; a prefix no section names is ignored.
//! With `[[messages]]`, outbox inserts are held until a change at another WAL
//! position, so that a message tying with them comes first (`in_wal_order`).

use std::sync::Arc;

use bytes::Bytes;
use walbox_outbox::{Event, MessageConfig, MessageError, MessageMapper, Position};
use walbox_pgoutput::{DecodingMessage, LogicalMessage, Lsn};

use super::poison::Refused;
use super::{Core, CoreConfig, Provenance};
use crate::error::CoreError;

type Compiled = Arc<(MessageMapper, Arc<str>)>;

/// How many ignored prefixes are named in the log (and remembered, so that each
/// is named once); an application writing a prefix per message costs no more.
pub(super) const IGNORED_PREFIXES_NAMED: usize = 64;

impl Core {
    /// Takes `msg`, sent at `at`, in the order its transaction wrote it. The
    /// server orders a transaction's changes by LSN, taking a message at the end
    /// of its record and an insert at the start of its own: a message written in
    /// a subtransaction (a savepoint, a PL/pgSQL exception block) right before an
    /// insert of another (sub)transaction ties with it, and may come after it.
    /// So outbox inserts are held until a change at another position: a
    /// transactional message at the very LSN they start at goes first. Only
    /// with `[[messages]]`.
    pub(super) fn in_wal_order(&mut self, at: Lsn, msg: LogicalMessage) -> Result<(), CoreError> {
        match msg {
            LogicalMessage::Message(m) if m.transactional() => {
                if let Some((held_at, held)) = self.held.take() {
                    self.held_bytes = 0;
                    if held_at == at {
                        self.change(LogicalMessage::Message(m))?;
                        return held.into_iter().try_for_each(|c| self.change(c));
                    }
                    held.into_iter().try_for_each(|c| self.change(c))?;
                }
                self.change(LogicalMessage::Message(m))
            }
            LogicalMessage::Insert(ref i)
                if !self.cfg.messages.is_empty()
                    && self.txn.is_some()
                    && self.mappers.contains_key(&i.relation_oid) =>
            {
                let bytes = tuple_bytes(&i.new);
                match &mut self.held {
                    Some((held_at, held)) if *held_at == at => held.push(msg),
                    _ => {
                        self.release_held()?;
                        self.held = Some((at, vec![msg]));
                    }
                }
                self.held_bytes += bytes;
                Ok(())
            }
            other => {
                self.release_held()?;
                self.change(other)
            }
        }
    }

    /// Takes the held inserts, if any.
    pub(super) fn release_held(&mut self) -> Result<(), CoreError> {
        self.held_bytes = 0;
        match self.held.take() {
            Some((_, held)) => held.into_iter().try_for_each(|c| self.change(c)),
            None => Ok(()),
        }
    }

    /// The mapper of `prefix` when a section names it (compiled at its first
    /// message).
    fn message_mapper(&mut self, prefix: &str) -> Result<Option<Compiled>, CoreError> {
        if let Some(m) = self.message_mappers.get(prefix) {
            return Ok(Some(Arc::clone(m)));
        }
        let Some(cfg) = self
            .cfg
            .messages
            .iter()
            .find(|m| m.prefixes.iter().any(|p| p == prefix))
        else {
            return Ok(None);
        };
        let mapper = MessageMapper::compile(cfg, prefix, &self.cfg.producer)?;
        tracing::info!(prefix, source = mapper.source(), "message prefix");
        let source: Arc<str> = Arc::from(mapper.source());
        let compiled = Arc::new((mapper, source));
        self.message_mappers
            .insert(prefix.to_owned(), Arc::clone(&compiled));
        Ok(Some(compiled))
    }

    /// One logical decoding message.
    pub(super) fn message(&mut self, m: DecodingMessage) -> Result<(), CoreError> {
        let Some(compiled) = self.message_mapper(&m.prefix)? else {
            self.stats.ignored_messages += 1;
            let named = self.unknown_prefixes.len();
            if named < IGNORED_PREFIXES_NAMED && !self.unknown_prefixes.contains(&m.prefix) {
                self.unknown_prefixes.insert(m.prefix.clone());
                tracing::info!(prefix = %m.prefix, lsn = %m.lsn,
                    "logical decoding messages of a prefix no [[messages]] section names are \
                     ignored (counted as ignored_messages)");
                if named + 1 == IGNORED_PREFIXES_NAMED {
                    tracing::info!(
                        "{IGNORED_PREFIXES_NAMED} ignored prefixes named; messages of further \
                         prefixes are ignored and counted without being named"
                    );
                }
            }
            return Ok(());
        };
        let (mapper, source) = &*compiled;
        if m.transactional() {
            let Some((position, id, committed)) =
                self.next_in_txn("transactional message outside a transaction")?
            else {
                return Ok(());
            };
            let (event, dead_letter) = map_message(
                mapper,
                &m.content,
                position,
                Some(committed),
                &self.cfg,
                &mut self.stats.dead_lettered,
            )?;
            let origin = Provenance {
                table: Arc::clone(source),
                dead_letter,
                replaces: false,
            };
            self.queue(event, id, committed, origin, self.streamed.clone());
            return Ok(());
        }
        if self.txn.is_some() {
            return Err(CoreError::Protocol(
                "non-transactional message inside a transaction",
            ));
        }
        // Its LSN is what the confirmed position becomes once its dead letter is
        // acknowledged: a replay to that position includes it, as it includes a
        // transaction whose commit ends there.
        if self.stop_at.is_some_and(|end| m.lsn > end) {
            self.reached_end = true;
            return Ok(());
        }
        // No commit order: its own unit at its LSN, which the confirmed position
        // passes once its dead letter is acknowledged (the server sends it again
        // after a restart from before it).
        let position = Position {
            commit_lsn: m.lsn,
            index: 0,
            xid: 0,
        };
        let dead = dead_letter(
            mapper,
            &m.content,
            position,
            &MessageError::NonTransactional,
            &self.cfg,
            &mut self.stats.dead_lettered,
        )?;
        let unit = self.tracker.begin(m.lsn);
        let origin = Provenance {
            table: Arc::clone(source),
            dead_letter: true,
            replaces: false,
        };
        let read = walbox_outbox::Origin::Message {
            replay: match self.streamed {
                walbox_outbox::Origin::Replay { from } => Some(from),
                _ => None,
            },
        };
        self.queue(dead, unit, 0, origin, read);
        self.tracker.commit(unit, m.lsn);
        Ok(())
    }
}

/// Maps a message's content, or builds its dead letter (counting it; then
/// `true`), or stops under the stop policy.
fn map_message(
    mapper: &MessageMapper,
    content: &Bytes,
    position: Position,
    commit_time: Option<i64>,
    cfg: &CoreConfig,
    dead_lettered: &mut u64,
) -> Result<(Event, bool), CoreError> {
    match mapper.map(content, position, commit_time) {
        Ok(event) => Ok((event, false)),
        Err(e) => dead_letter(mapper, content, position, &e, cfg, dead_lettered).map(|d| (d, true)),
    }
}

/// The dead letter of a message that cannot be published (counted), or the
/// stop under the stop policy.
fn dead_letter(
    mapper: &MessageMapper,
    content: &Bytes,
    position: Position,
    error: &MessageError,
    cfg: &CoreConfig,
    dead_lettered: &mut u64,
) -> Result<Event, CoreError> {
    let dead = mapper.dead_letter(content, position, error, &cfg.dead_letter_topic);
    let refused = Refused {
        source: mapper.source(),
        position,
        class: error.class(),
        reason: error,
    };
    refused.take(dead, cfg, dead_lettered)
}

impl CoreConfig {
    /// Every configured message prefix, in configuration order.
    #[must_use]
    pub fn message_prefixes(&self) -> Vec<&str> {
        self.messages
            .iter()
            .flat_map(|m: &MessageConfig| m.prefixes.iter().map(String::as_str))
            .collect()
    }
}

#[cfg(test)]
mod tests;

/// The bytes of a row's values as the server sent them.
fn tuple_bytes(tuple: &[walbox_pgoutput::TupleValue]) -> usize {
    tuple
        .iter()
        .map(|v| match v {
            walbox_pgoutput::TupleValue::Text(b) | walbox_pgoutput::TupleValue::Binary(b) => {
                b.len()
            }
            _ => 0,
        })
        .sum()
}
