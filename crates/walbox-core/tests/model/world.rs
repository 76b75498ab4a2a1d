//! The simulated server: a log of committed transactions (inserts into the
//! outbox tables and transactional logical decoding messages among them) and
//! non-transactional messages between them, and the stream `START_REPLICATION`
//! sends from a position, as pgoutput (protocol 1) writes it.

use std::collections::HashMap;

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use walbox_core::WalMessage;
use walbox_outbox::TableConfig;
use walbox_pgoutput::{
    DecodingMessage, Delete, Insert, LogicalMessage, Lsn, Oid, OldTuple, OldTupleKind, Relation,
    RelationColumn, ReplicaIdentity, TupleValue, Update, Xid, encode,
};

/// The two outbox tables (index 0 and 1): name and oid.
pub const OUTBOX: [(&str, Oid); 2] = [("outbox_a", 16_401), ("outbox_b", 16_402)];
/// The oid of the table swapped in under `outbox_b`'s name (see [`Swap`]).
pub const OUTBOX_B_SWAPPED: Oid = 16_404;
/// A published table that is no outbox.
pub const AUDIT: (&str, Oid) = ("audit", 16_403);
/// The configured message prefix (every session has it).
pub const PREFIX: &str = "walbox";
/// The "table" index of message events.
pub const MSG: usize = 3;

/// Which outbox tables a session is configured with. The model moves a table
/// out of the publication together with the configuration, so a session's
/// stream holds changes of exactly these outbox tables (and of the audit table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tables {
    Both,
    OnlyA,
}

impl Tables {
    /// Whether events of `table` (an outbox table, or [`MSG`]) are configured.
    pub fn has(self, table: usize) -> bool {
        table != 1 || self == Tables::Both
    }

    /// The sources as `Partial::tables` names them (`CoreConfig::table_set`).
    fn names(self) -> Vec<String> {
        let mut names: Vec<String> = (0..OUTBOX.len())
            .filter(|t| self.has(*t))
            .map(|t| format!("public.{}", OUTBOX[t].0))
            .collect();
        names.push(format!("message:{PREFIX}"));
        names.sort();
        names
    }

    pub fn configs(self) -> Vec<TableConfig> {
        (0..OUTBOX.len())
            .filter(|t| self.has(*t))
            .map(|t| TableConfig::new(OUTBOX[t].0))
            .collect()
    }

    /// The tables as `Partial::tables` names them.
    pub fn from_names(names: &[String]) -> Option<Tables> {
        [Tables::Both, Tables::OnlyA]
            .into_iter()
            .find(|t| t.names() == names)
    }
}

/// What a row's payload is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload {
    /// JSON, small.
    Small(u8),
    /// JSON, larger than the broker takes: refused, then dead-lettered.
    Large,
    /// NULL (a required column): dead-lettered by the mapper.
    Poison,
}

/// How an event is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// An insert into an outbox table.
    Table,
    /// A transactional logical decoding message.
    Message,
    /// A non-transactional message: always dead-lettered.
    Unordered,
}

/// One outbox row (or message content).
#[derive(Debug, Clone)]
pub struct Row {
    pub id: String,
    pub aggregate_type: &'static str,
    pub key: String,
    pub payload: Payload,
    pub via: Via,
    /// Inserted into the table swapped in under `outbox_b`'s name.
    pub swapped: bool,
    /// Inserted while its table was in no publication: no stream has it.
    pub hidden: bool,
}

impl Row {
    /// The topic its event is meant for.
    pub fn topic(&self) -> String {
        format!("outbox.{}", self.aggregate_type)
    }

    /// Whether its event ends up in the dead-letter topic.
    pub fn dead(&self) -> bool {
        self.via == Via::Unordered || matches!(self.payload, Payload::Large | Payload::Poison)
    }

    /// The message's content: the payload field left out stands for a poison
    /// row.
    fn content(&self) -> Bytes {
        let payload = match self.payload {
            Payload::Small(pad) => format!(r#","payload":{{"pad":"{}"}}"#, pad_of(pad)),
            Payload::Large => format!(r#","payload":{{"pad":"{}"}}"#, "L".repeat(1_500)),
            Payload::Poison => String::new(),
        };
        Bytes::from(format!(
            r#"{{"id":"{}","aggregate_type":"{}","aggregate_id":"{}","event_type":"Created"{payload}}}"#,
            self.id, self.aggregate_type, self.key
        ))
    }

    pub fn tuple(&self) -> Vec<TupleValue> {
        let payload = match self.payload {
            Payload::Small(pad) => text(&format!(
                r#"{{"id":"{}","pad":"{}"}}"#,
                self.id,
                pad_of(pad)
            )),
            Payload::Large => text(&format!(r#"{{"pad":"{}"}}"#, "L".repeat(1_500))),
            Payload::Poison => TupleValue::Null,
        };
        vec![
            text(&self.id),
            text(self.aggregate_type),
            text(&self.key),
            text("Created"),
            payload,
        ]
    }
}

fn pad_of(n: u8) -> String {
    "p".repeat(usize::from(n % 64))
}

fn text(s: &str) -> TupleValue {
    TupleValue::Text(Bytes::copy_from_slice(s.as_bytes()))
}

/// One change of a transaction.
#[derive(Debug, Clone)]
pub enum Change {
    /// An outbox insert: an event.
    Insert { table: usize, row: Row },
    /// A logical decoding message of the configured prefix: an event (a
    /// transactional one inside its transaction, or the only change of a
    /// non-transactional entry).
    Message { row: Row },
    /// A message of a prefix no section names: ignored.
    OtherMessage,
    /// An update of an outbox row (ignored by walbox).
    UpdateOutbox { table: usize },
    /// A delete of an outbox row (ignored by walbox).
    DeleteOutbox { table: usize },
    /// An update in the published audit table.
    AuditUpdate,
    /// A delete in the published audit table.
    AuditDelete,
    /// An insert into the published audit table: walbox must stop.
    AuditInsert,
}

impl Change {
    /// The table index (2 = audit).
    fn table(&self) -> usize {
        match self {
            Change::Insert { table, .. }
            | Change::UpdateOutbox { table }
            | Change::DeleteOutbox { table } => *table,
            Change::Message { .. } | Change::OtherMessage => MSG,
            _ => 2,
        }
    }
}

/// A committed transaction (rolled-back ones are never sent: they are gaps).
#[derive(Debug, Clone)]
pub struct Txn {
    /// A non-transactional message, not a transaction: sent when decoded,
    /// without Begin and Commit; `commit_lsn` and `end_lsn` are its LSN (the
    /// end of its record), `xid` 0.
    pub unordered: bool,
    pub xid: Xid,
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub changes: Vec<Change>,
    /// A keepalive in the middle of it (its WAL end is the commit LSN at most).
    pub keepalive_inside: bool,
    /// A keepalive after it, with this WAL end (before the next commit).
    pub keepalive_after: Option<Lsn>,
    /// Adjacent inserts into one table share one WAL start (a multi-insert
    /// record, as `COPY` writes).
    pub copy: bool,
}

impl Txn {
    /// The outbox inserts, in order.
    pub fn rows(&self) -> impl Iterator<Item = (usize, &Row)> {
        self.changes.iter().filter_map(|c| match c {
            Change::Insert { table, row } => Some((*table, row)),
            Change::Message { row } => Some((MSG, row)),
            _ => None,
        })
    }

    /// The outbox inserts a stream has, in order.
    pub fn streamed_rows(&self) -> impl Iterator<Item = (usize, &Row)> {
        self.rows().filter(|(_, r)| !r.hidden)
    }

    /// Event ids of the first `n` events as a session with `tables` counts them.
    pub fn first_events(&self, tables: Tables, n: u64) -> Vec<&str> {
        self.streamed_rows()
            .filter(|(t, _)| tables.has(*t))
            .take(usize::try_from(n).unwrap_or(usize::MAX))
            .map(|(_, r)| r.id.as_str())
            .collect()
    }
}

/// The server's committed history.
#[derive(Debug, Clone)]
pub struct Log {
    /// Where the slot was created.
    pub created: Lsn,
    pub txns: Vec<Txn>,
    /// The server's WAL end after the last transaction.
    pub wal_end: Lsn,
    /// `outbox_b` swapped for a new table of the same name.
    pub swap: Option<Swap>,
    /// The entry (index into `txns`) deleting each deleted row, by event id.
    pub deleted: HashMap<String, usize>,
}

/// `outbox_b` is swapped for a new table (another oid, the same name) before
/// entry `at`; the new table joins the publication (`ALTER PUBLICATION ...
/// ADD TABLE`) before entry `fix`. Its inserts before then are in no stream.
#[derive(Debug, Clone, Copy)]
pub struct Swap {
    pub at: usize,
    pub fix: usize,
}

/// Everything known about one event.
#[derive(Debug, Clone)]
pub struct EventInfo<'a> {
    pub txn: usize,
    /// Its place in commit order.
    pub rank: usize,
    pub row: &'a Row,
}

impl Log {
    /// Every event of the log, in commit order.
    pub fn events(&self) -> Vec<EventInfo<'_>> {
        let mut out = Vec::new();
        for (i, t) in self.txns.iter().enumerate() {
            for (_, row) in t.rows() {
                out.push(EventInfo {
                    txn: i,
                    rank: out.len(),
                    row,
                });
            }
        }
        out
    }

    /// The event's index in its transaction as a session with `tables` numbers it.
    pub fn index_of(&self, txn: usize, id: &str, tables: Tables) -> u32 {
        let n = self.txns[txn]
            .streamed_rows()
            .filter(|(t, _)| tables.has(*t))
            .take_while(|(_, r)| r.id != id)
            .count();
        u32::try_from(n).expect("small")
    }

    /// The transaction with this commit LSN.
    pub fn txn_at(&self, commit_lsn: Lsn) -> Option<&Txn> {
        self.txns.iter().find(|t| t.commit_lsn == commit_lsn)
    }

    /// The WAL position once the first `written` entries of the log are
    /// written: before the next entry's record.
    pub fn wal_now(&self, written: usize) -> Lsn {
        self.txns
            .get(written)
            .map_or(self.wal_end, |t| Lsn(t.commit_lsn.0 - 1))
    }

    /// The oid of `table`'s changes in entry `i`, and whether they are in the
    /// stream (pgoutput decodes a change against the publication as it was
    /// when the change was written).
    pub fn oid_in(&self, table: usize, i: usize) -> (Oid, bool) {
        match self.swap {
            Some(sw) if table == 1 && i >= sw.at => (OUTBOX_B_SWAPPED, i >= sw.fix),
            _ => (OUTBOX[table].1, true),
        }
    }

    /// The most outbox inserts one WAL record carries.
    pub fn largest_record(&self) -> u64 {
        self.txns
            .iter()
            .map(|t| {
                if !t.copy {
                    return 1;
                }
                let mut best = 1;
                let mut run = 0;
                let mut prev: Option<usize> = None;
                for c in &t.changes {
                    match c {
                        Change::Insert { table, .. } if prev == Some(*table) => run += 1,
                        Change::Insert { table, .. } => {
                            run = 1;
                            prev = Some(*table);
                        }
                        _ => {
                            run = 0;
                            prev = None;
                        }
                    }
                    best = best.max(run);
                }
                best
            })
            .max()
            .unwrap_or(1)
    }

    /// What `START_REPLICATION` from `from` sends to a session with `tables`:
    /// every transaction that ends after `from`, each table's Relation before
    /// its first change, keepalives where the log has them; each message with
    /// the index of the log entry it belongs to (sent once that is written).
    pub fn stream(&self, from: Lsn, tables: Tables) -> Vec<(usize, WalMessage)> {
        let mut out = Vec::new();
        let mut announced: Vec<Oid> = Vec::new();
        for (n, t) in self
            .txns
            .iter()
            .enumerate()
            .filter(|(_, t)| t.end_lsn > from)
        {
            let mut push = |m: WalMessage| out.push((n, m));
            if t.unordered {
                for c in &t.changes {
                    push(data(&message(c, false, t.end_lsn)));
                }
                continue;
            }
            // Adjacent inserts into one table of a multi-insert record share
            // the start of the first.
            let mut record: Option<(usize, Lsn)> = None;
            push(WalMessage::Begin {
                final_lsn: t.commit_lsn,
                xid: t.xid,
                commit_time: 1_000,
            });
            for (i, c) in t.changes.iter().enumerate() {
                let table = c.table();
                if table < 2 && !tables.has(table) {
                    record = None;
                    continue;
                }
                if table == MSG {
                    record = None;
                    let lsn =
                        Lsn(t.commit_lsn.0 - 1 - u64::try_from(t.changes.len() - i).unwrap_or(0));
                    push(as_shell(message(c, true, lsn)));
                    continue;
                }
                let oid = if table < 2 {
                    let (oid, streamed) = self.oid_in(table, n);
                    if !streamed {
                        record = None;
                        continue;
                    }
                    oid
                } else {
                    AUDIT.1
                };
                if !announced.contains(&oid) {
                    announced.push(oid);
                    push(data(&LogicalMessage::Relation(relation(table, oid))));
                }
                if t.keepalive_inside && i == t.changes.len() / 2 {
                    push(WalMessage::KeepAlive {
                        wal_end: t.commit_lsn,
                    });
                }
                // Change i at the LSN a message in its place would have: an
                // insert never ties with a message written after it.
                let mut start =
                    Lsn(t.commit_lsn.0 - 1 - u64::try_from(t.changes.len() - i).unwrap_or(0));
                if let Change::Insert { .. } = c {
                    match record {
                        Some((r, at)) if t.copy && r == table => start = at,
                        _ => record = Some((table, start)),
                    }
                } else {
                    record = None;
                }
                push(data_at(start, &change_message(c, oid)));
            }
            push(WalMessage::Commit { end_lsn: t.end_lsn });
            if let Some(wal_end) = t.keepalive_after {
                push(WalMessage::KeepAlive { wal_end });
            }
        }
        out
    }
}

fn data(msg: &LogicalMessage) -> WalMessage {
    data_at(Lsn(0), msg)
}

/// `msg` as the server sends it from `wal_start`.
fn data_at(wal_start: Lsn, msg: &LogicalMessage) -> WalMessage {
    let mut buf = BytesMut::new();
    encode(msg, &mut buf);
    WalMessage::Data {
        wal_start,
        data: buf.freeze(),
    }
}

/// The Relation message of `table` (0, 1: outbox; 2: audit) as the relation `oid`.
pub fn relation(table: usize, oid: Oid) -> Relation {
    let (name, columns): (&str, &[(&str, Oid)]) = if table < 2 {
        (
            OUTBOX[table].0,
            &[
                ("id", 25),
                ("aggregate_type", 25),
                ("aggregate_id", 25),
                ("event_type", 25),
                ("payload", 3802),
            ],
        )
    } else {
        (AUDIT.0, &[("id", 23), ("note", 25)])
    };
    Relation {
        xid: None,
        oid,
        namespace: "public".into(),
        name: name.into(),
        replica_identity: ReplicaIdentity::Default,
        columns: columns
            .iter()
            .enumerate()
            .map(|(i, (n, t))| RelationColumn {
                flags: u8::from(i == 0),
                name: (*n).into(),
                type_oid: *t,
                type_modifier: -1,
            })
            .collect(),
    }
}

/// A logical decoding message as the shell hands it over (the replication
/// client decodes these itself).
fn as_shell(msg: LogicalMessage) -> WalMessage {
    match msg {
        LogicalMessage::Message(m) => WalMessage::Message(m),
        other => data(&other),
    }
}

/// A logical decoding message change as pgoutput sends it.
fn message(c: &Change, transactional: bool, lsn: Lsn) -> LogicalMessage {
    let (prefix, content) = match c {
        Change::Message { row } => (PREFIX, row.content()),
        _ => ("other", Bytes::from_static(b"not walbox's")),
    };
    LogicalMessage::Message(DecodingMessage {
        xid: None,
        flags: u8::from(transactional),
        lsn,
        prefix: prefix.into(),
        content,
    })
}

fn change_message(c: &Change, oid: Oid) -> LogicalMessage {
    let outbox_row = || {
        vec![
            text("x"),
            text("order"),
            text("k"),
            text("Changed"),
            text("{}"),
        ]
    };
    let audit_row = || vec![text("1"), text("note")];
    let key = |tuple: Vec<TupleValue>| OldTuple {
        kind: OldTupleKind::Key,
        tuple,
    };
    match c {
        Change::Insert { row, .. } => LogicalMessage::Insert(Insert {
            xid: None,
            relation_oid: oid,
            new: row.tuple(),
        }),
        Change::UpdateOutbox { .. } => LogicalMessage::Update(Update {
            xid: None,
            relation_oid: oid,
            old: None,
            new: outbox_row(),
        }),
        Change::DeleteOutbox { .. } => LogicalMessage::Delete(Delete {
            xid: None,
            relation_oid: oid,
            old: key(outbox_row()),
        }),
        Change::AuditUpdate => LogicalMessage::Update(Update {
            xid: None,
            relation_oid: AUDIT.1,
            old: Some(key(audit_row())),
            new: audit_row(),
        }),
        Change::AuditDelete => LogicalMessage::Delete(Delete {
            xid: None,
            relation_oid: AUDIT.1,
            old: key(audit_row()),
        }),
        Change::AuditInsert => LogicalMessage::Insert(Insert {
            xid: None,
            relation_oid: AUDIT.1,
            new: audit_row(),
        }),
        Change::Message { .. } | Change::OtherMessage => message(c, true, Lsn(0)),
    }
}

// ---- generation -------------------------------------------------------------

/// A change before ids are given out.
#[derive(Debug, Clone)]
pub enum ChangeSpec {
    Insert {
        table: usize,
        key: u8,
        aggregate_type: bool,
        payload: Payload,
    },
    UpdateOutbox(usize),
    DeleteOutbox(usize),
    AuditUpdate,
    AuditDelete,
    /// A transactional message of the configured prefix.
    Message {
        key: u8,
        aggregate_type: bool,
        payload: Payload,
    },
    /// A message of another prefix.
    OtherMessage,
}

/// A non-transactional message before a transaction.
#[derive(Debug, Clone)]
pub struct UnorderedSpec {
    /// WAL before its record.
    pub gap: u16,
    /// Length of its record.
    pub len: u8,
    pub key: u8,
    /// Poison (no payload) rather than a small payload.
    pub poison: bool,
}

/// A transaction before LSNs are given out.
#[derive(Debug, Clone)]
pub struct TxnSpec {
    /// WAL before its commit record (other work, rolled-back transactions).
    pub gap: u16,
    /// Length of its commit record.
    pub len: u8,
    pub changes: Vec<ChangeSpec>,
    pub keepalive_inside: bool,
    /// A keepalive after it, somewhere in the gap to the next one.
    pub keepalive_after: Option<u16>,
    /// A non-transactional message in the WAL before it.
    pub unordered_before: Option<UnorderedSpec>,
    /// Adjacent inserts into one table are one multi-insert record.
    pub copy: bool,
}

fn payload() -> impl Strategy<Value = Payload> {
    prop_oneof![
        18 => any::<u8>().prop_map(Payload::Small),
        1 => Just(Payload::Large),
        1 => Just(Payload::Poison),
    ]
}

fn change() -> impl Strategy<Value = ChangeSpec> {
    prop_oneof![
        12 => (0..2usize, 0..2u8, any::<bool>(), payload()).prop_map(
            |(table, key, aggregate_type, payload)| ChangeSpec::Insert {
                table,
                key,
                aggregate_type,
                payload,
            }
        ),
        1 => (0..2usize).prop_map(ChangeSpec::UpdateOutbox),
        1 => (0..2usize).prop_map(ChangeSpec::DeleteOutbox),
        1 => Just(ChangeSpec::AuditUpdate),
        1 => Just(ChangeSpec::AuditDelete),
        6 => (0..2u8, any::<bool>(), payload()).prop_map(|(key, aggregate_type, payload)| {
            ChangeSpec::Message {
                key,
                aggregate_type,
                payload,
            }
        }),
        1 => Just(ChangeSpec::OtherMessage),
    ]
}

/// Transactions of 0 to 12 changes: many fit the in-flight bounds, some do not.
pub fn txns() -> impl Strategy<Value = Vec<TxnSpec>> {
    let txn = (
        1..300u16,
        8..64u8,
        prop_oneof![3 => prop::collection::vec(change(), 0..4), 1 => prop::collection::vec(change(), 4..13)],
        prop::bool::weighted(0.1),
        prop::option::weighted(0.4, any::<u16>()),
        prop::option::weighted(
            0.15,
            (1..300u16, 8..64u8, 0..2u8, prop::bool::weighted(0.2)).prop_map(
                |(gap, len, key, poison)| UnorderedSpec {
                    gap,
                    len,
                    key,
                    poison,
                },
            ),
        ),
        prop::bool::weighted(0.2),
    )
        .prop_map(
            |(gap, len, changes, keepalive_inside, keepalive_after, unordered_before, copy)| {
                TxnSpec {
                    gap,
                    len,
                    changes,
                    keepalive_inside,
                    keepalive_after,
                    unordered_before,
                    copy,
                }
            },
        );
    prop::collection::vec(txn, 1..14)
}

impl Log {
    /// Gives out ids and LSNs. With `audit_insert`, that transaction (if it
    /// exists) also inserts into the audit table, after its other changes.
    pub fn build(specs: &[TxnSpec], audit_insert: Option<usize>) -> Log {
        let created = Lsn(0x1_0000);
        let mut at = created.0;
        let mut next_id = 0u32;
        let mut txns: Vec<Txn> = Vec::new();
        // The keepalive after the last entry: its WAL end lies in the gap before
        // the next entry's record (a non-transactional message is sent when its
        // record is decoded, so no keepalive before it passes it).
        let mut keepalive: Option<u16> = None;
        let place = |txns: &mut Vec<Txn>, keepalive: &mut Option<u16>, gap: u16| {
            if let (Some(prev), Some(off)) = (txns.last_mut(), keepalive.take()) {
                prev.keepalive_after = Some(Lsn(prev.end_lsn.0 + u64::from(off) % u64::from(gap)));
            }
        };
        let mut id = || {
            next_id += 1;
            format!("ev-{next_id}")
        };
        for (i, s) in specs.iter().enumerate() {
            if let Some(u) = &s.unordered_before {
                place(&mut txns, &mut keepalive, u.gap);
                let lsn = Lsn(at + u64::from(u.gap) + u64::from(u.len));
                txns.push(Txn {
                    unordered: true,
                    xid: 0,
                    commit_lsn: lsn,
                    end_lsn: lsn,
                    changes: vec![Change::Message {
                        row: Row {
                            id: id(),
                            aggregate_type: "order",
                            key: format!("u{}", u.key),
                            payload: if u.poison {
                                Payload::Poison
                            } else {
                                Payload::Small(u.key)
                            },
                            via: Via::Unordered,
                            swapped: false,
                            hidden: false,
                        },
                    }],
                    keepalive_inside: false,
                    keepalive_after: None,
                    copy: false,
                });
                at = lsn.0;
            }
            place(&mut txns, &mut keepalive, s.gap);
            let commit_lsn = Lsn(at + u64::from(s.gap));
            let end_lsn = Lsn(commit_lsn.0 + u64::from(s.len));
            let mut changes: Vec<Change> = s
                .changes
                .iter()
                .map(|c| match c {
                    ChangeSpec::Insert {
                        table,
                        key,
                        aggregate_type,
                        payload,
                    } => Change::Insert {
                        table: *table,
                        row: Row {
                            id: id(),
                            aggregate_type: if *aggregate_type { "order" } else { "payment" },
                            // Keys of the two tables are disjoint: a table
                            // moved out of the publication must not reorder
                            // the other table's keys.
                            key: format!("{}{key}", ["a", "b"][*table]),
                            payload: *payload,
                            via: Via::Table,
                            swapped: false,
                            hidden: false,
                        },
                    },
                    ChangeSpec::Message {
                        key,
                        aggregate_type,
                        payload,
                    } => Change::Message {
                        row: Row {
                            id: id(),
                            aggregate_type: if *aggregate_type { "order" } else { "payment" },
                            key: format!("m{key}"),
                            payload: *payload,
                            via: Via::Message,
                            swapped: false,
                            hidden: false,
                        },
                    },
                    ChangeSpec::OtherMessage => Change::OtherMessage,
                    ChangeSpec::UpdateOutbox(t) => Change::UpdateOutbox { table: *t },
                    ChangeSpec::DeleteOutbox(t) => Change::DeleteOutbox { table: *t },
                    ChangeSpec::AuditUpdate => Change::AuditUpdate,
                    ChangeSpec::AuditDelete => Change::AuditDelete,
                })
                .collect();
            if audit_insert == Some(i) {
                changes.push(Change::AuditInsert);
            }
            txns.push(Txn {
                unordered: false,
                xid: 700 + u32::try_from(i).expect("small"),
                commit_lsn,
                end_lsn,
                changes,
                keepalive_inside: s.keepalive_inside,
                keepalive_after: None,
                copy: s.copy,
            });
            keepalive = s.keepalive_after;
            at = end_lsn.0;
        }
        let wal_end = Lsn(at + 40);
        place(&mut txns, &mut keepalive, 40);
        Log {
            created,
            txns,
            wal_end,
            swap: None,
            deleted: HashMap::new(),
        }
    }

    /// The log of `specs` with `outbox_b` swapped for a new table before
    /// entry `swap.at` (inserts from there on go into the new one), which
    /// joins the publication before entry `swap.fix`; the new table's rows are
    /// deleted as `deletes` says in turn (an offset of entries after their
    /// insert; `None`: kept).
    pub fn build_swapped(specs: &[TxnSpec], swap: &SwapSpec) -> Log {
        let mut log = Log::build(specs, None);
        let len = log.txns.len();
        let at = swap.at.index(len + 1);
        let fix = at + swap.fix.index(len + 1 - at);
        log.swap = Some(Swap { at, fix });
        let mut deletes = swap.deletes.iter().cycle();
        let mut pending: Vec<(usize, String)> = Vec::new();
        for (i, t) in log.txns.iter_mut().enumerate().skip(at) {
            for c in &mut t.changes {
                if let Change::Insert { table: 1, row } = c {
                    row.swapped = true;
                    row.hidden = i < fix;
                    if let Some(Some(off)) = deletes.next() {
                        pending.push((i + usize::from(*off), row.id.clone()));
                    }
                }
            }
        }
        for (j, id) in pending {
            if let Some(t) = log.txns.get_mut(j).filter(|t| !t.unordered) {
                // A delete of that row (a snapshot taken after it lacks it).
                t.changes.push(Change::DeleteOutbox { table: 1 });
                log.deleted.insert(id, j);
            }
        }
        log
    }
}

/// Where the swap and the fix fall, and which rows of the new table are
/// deleted when.
#[derive(Debug, Clone)]
pub struct SwapSpec {
    pub at: prop::sample::Index,
    pub fix: prop::sample::Index,
    pub deletes: Vec<Option<u8>>,
}

pub fn swap() -> impl Strategy<Value = SwapSpec> {
    (
        any::<prop::sample::Index>(),
        any::<prop::sample::Index>(),
        prop::collection::vec(prop::option::weighted(0.4, 0..4u8), 1..8),
    )
        .prop_map(|(at, fix, deletes)| SwapSpec { at, fix, deletes })
}
