//! The simulated broker and the sink in front of it.
//!
//! Topics have two partitions; a record goes to the partition of its key's hash.
//! The sink takes events in the order the core hands them out and keeps them per
//! partition until the broker settles them, in order within a partition (the
//! idempotent producer): the head is written and acknowledged, written with its
//! acknowledgement lost (a crash), refused for its size (never written), or
//! timed out (written or not). Records larger than [`LIMIT`] are refused.

use std::collections::{BTreeMap, HashSet, VecDeque};

use walbox_core::{Failure, Outcome, Rejected};
use walbox_outbox::{Event, Position};

use crate::world::Tables;

/// Largest record the broker takes (`Event::size`).
pub const LIMIT: usize = 1_200;

/// A partition: topic and number.
pub type Part = (String, u32);

/// One record in a partition's log.
#[derive(Debug, Clone)]
pub struct Record {
    pub event_id: String,
    pub position: Position,
    pub key: Option<Vec<u8>>,
    /// The configuration of the session that sent it.
    pub tables: Tables,
    pub dead_letter: bool,
}

/// The broker's durable state.
#[derive(Debug, Default)]
pub struct Broker {
    pub logs: BTreeMap<Part, Vec<Record>>,
    /// Event ids of which some copy was written and acknowledged to walbox.
    pub acked: HashSet<String>,
}

fn partition(event: &Event) -> Part {
    // FNV-1a of the key.
    let mut h: u32 = 0x811c_9dc5;
    for b in event.key.as_deref().unwrap_or_default() {
        h = (h ^ u32::from(*b)).wrapping_mul(0x0100_0193);
    }
    (event.topic.clone(), h % 2)
}

/// An event the sink took and the broker has not settled.
#[derive(Debug)]
pub struct InFlight {
    pub token: usize,
    pub event: Event,
    pub written: bool,
}

impl InFlight {
    fn too_large(&self) -> bool {
        self.event.size() > LIMIT
    }
}

/// The sink of one session.
#[derive(Debug)]
pub struct Sink {
    pub tables: Tables,
    queues: BTreeMap<Part, VecDeque<InFlight>>,
}

/// How the broker settles the head of a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// Written (if not yet) and acknowledged; refused when too large.
    Ack,
    /// Timed out; `written` says whether it reached the log anyway.
    Timeout { written: bool },
}

impl Sink {
    pub fn new(tables: Tables) -> Self {
        Sink {
            tables,
            queues: BTreeMap::new(),
        }
    }

    pub fn send(&mut self, event: Event, token: usize) {
        self.queues
            .entry(partition(&event))
            .or_default()
            .push_back(InFlight {
                token,
                event,
                written: false,
            });
    }

    fn pick(&self, sel: u8) -> Option<Part> {
        let busy: Vec<&Part> = self
            .queues
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .map(|(p, _)| p)
            .collect();
        (!busy.is_empty()).then(|| busy[usize::from(sel) % busy.len()].clone())
    }

    pub fn is_empty(&self) -> bool {
        self.queues.values().all(VecDeque::is_empty)
    }

    /// The broker writes the next unwritten record of a partition (its
    /// acknowledgement is still to come).
    pub fn write_next(&mut self, sel: u8, broker: &mut Broker) {
        let Some(part) = self.pick(sel) else { return };
        let tables = self.tables;
        let q = self.queues.get_mut(&part).expect("picked");
        if let Some(f) = q.iter_mut().find(|f| !f.written)
            && !f.too_large()
        {
            append(broker, &part, &f.event, tables);
            f.written = true;
        }
    }

    /// The broker settles the head of a partition: the token and the outcome
    /// to report to the core.
    pub fn settle(
        &mut self,
        sel: u8,
        how: Settle,
        broker: &mut Broker,
    ) -> Option<(usize, Outcome)> {
        let part = self.pick(sel)?;
        let tables = self.tables;
        let f = self.queues.get_mut(&part)?.pop_front()?;
        let outcome = match how {
            Settle::Ack if f.too_large() => Outcome::Failed(refused(&f.event)),
            Settle::Ack => {
                if !f.written {
                    append(broker, &part, &f.event, tables);
                }
                broker.acked.insert(f.event.event_id.clone());
                Outcome::Acked
            }
            Settle::Timeout { written } => {
                if written && !f.written && !f.too_large() {
                    append(broker, &part, &f.event, tables);
                }
                Outcome::Failed(Failure {
                    event_id: f.event.event_id.clone(),
                    topic: f.event.topic.clone(),
                    class: "timeout",
                    reason: "Local: Message timed out".into(),
                    about_message: false,
                    lasting: false,
                    rejected: None,
                })
            }
        };
        Some((f.token, outcome))
    }

    /// A producer that is not aborted after a failure goes on delivering what
    /// it holds, past the failed record.
    pub fn linger(&mut self, broker: &mut Broker) {
        let tables = self.tables;
        for (part, q) in &mut self.queues {
            for f in q.drain(..) {
                if !f.written && !f.too_large() {
                    append(broker, part, &f.event, tables);
                }
            }
        }
    }
}

fn append(broker: &mut Broker, part: &Part, event: &Event, tables: Tables) {
    broker.logs.entry(part.clone()).or_default().push(Record {
        event_id: event.event_id.clone(),
        position: event.position,
        key: event.key.as_ref().map(|k| k.to_vec()),
        tables,
        dead_letter: event.topic.ends_with(".dlq"),
    });
}

/// The broker's refusal of a record too large, as the Kafka sink reports it.
fn refused(event: &Event) -> Failure {
    Failure {
        event_id: event.event_id.clone(),
        topic: event.topic.clone(),
        class: "message_too_large",
        reason: "Broker: Message size too large".into(),
        about_message: true,
        lasting: false,
        rejected: Some(Rejected {
            key: event.key.clone(),
            headers: event.headers.clone(),
            value_len: event.value.len(),
            attempts: 1,
        }),
    }
}
