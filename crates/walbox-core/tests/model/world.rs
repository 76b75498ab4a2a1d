//! The simulated server: a log of committed transactions, and the stream
//! `START_REPLICATION` sends from a position, as pgoutput (protocol 1) writes it.

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use walbox_core::WalMessage;
use walbox_outbox::TableConfig;
use walbox_pgoutput::{
    Delete, Insert, LogicalMessage, Lsn, Oid, OldTuple, OldTupleKind, Relation, RelationColumn,
    ReplicaIdentity, TupleValue, Update, Xid, encode,
};

/// The two outbox tables (index 0 and 1): name and oid.
pub const OUTBOX: [(&str, Oid); 2] = [("outbox_a", 16_401), ("outbox_b", 16_402)];
/// A published table that is no outbox.
pub const AUDIT: (&str, Oid) = ("audit", 16_403);

/// Which outbox tables a session is configured with. The model moves a table
/// out of the publication together with the configuration, so a session's
/// stream holds changes of exactly these outbox tables (and of the audit table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tables {
    Both,
    OnlyA,
}

impl Tables {
    pub fn has(self, table: usize) -> bool {
        table == 0 || self == Tables::Both
    }

    pub fn configs(self) -> Vec<TableConfig> {
        (0..OUTBOX.len())
            .filter(|t| self.has(*t))
            .map(|t| TableConfig::new(OUTBOX[t].0))
            .collect()
    }

    /// The tables as `Partial::tables` names them.
    pub fn from_names(names: &[String]) -> Option<Tables> {
        let both: Vec<String> = OUTBOX.iter().map(|(n, _)| format!("public.{n}")).collect();
        if names == both.as_slice() {
            Some(Tables::Both)
        } else if names == &both[..1] {
            Some(Tables::OnlyA)
        } else {
            None
        }
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

/// One outbox row.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: String,
    pub aggregate_type: &'static str,
    pub key: String,
    pub payload: Payload,
}

impl Row {
    /// The topic its event is meant for.
    pub fn topic(&self) -> String {
        format!("outbox.{}", self.aggregate_type)
    }

    fn tuple(&self) -> Vec<TupleValue> {
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
            _ => 2,
        }
    }
}

/// A committed transaction (rolled-back ones are never sent: they are gaps).
#[derive(Debug, Clone)]
pub struct Txn {
    pub xid: Xid,
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub changes: Vec<Change>,
    /// A keepalive in the middle of it (its WAL end is the commit LSN at most).
    pub keepalive_inside: bool,
    /// A keepalive after it, with this WAL end (before the next commit).
    pub keepalive_after: Option<Lsn>,
}

impl Txn {
    /// The outbox inserts, in order.
    pub fn rows(&self) -> impl Iterator<Item = (usize, &Row)> {
        self.changes.iter().filter_map(|c| match c {
            Change::Insert { table, row } => Some((*table, row)),
            _ => None,
        })
    }

    /// Event ids of the first `n` events as a session with `tables` counts them.
    pub fn first_events(&self, tables: Tables, n: u64) -> Vec<&str> {
        self.rows()
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
            .rows()
            .filter(|(t, _)| tables.has(*t))
            .take_while(|(_, r)| r.id != id)
            .count();
        u32::try_from(n).expect("small")
    }

    /// The transaction with this commit LSN.
    pub fn txn_at(&self, commit_lsn: Lsn) -> Option<&Txn> {
        self.txns.iter().find(|t| t.commit_lsn == commit_lsn)
    }

    /// What `START_REPLICATION` from `from` sends to a session with `tables`:
    /// every transaction that ends after `from`, each table's Relation before
    /// its first change, keepalives where the log has them.
    pub fn stream(&self, from: Lsn, tables: Tables) -> Vec<WalMessage> {
        let mut out = Vec::new();
        let mut announced = [false; 3];
        for t in self.txns.iter().filter(|t| t.end_lsn > from) {
            out.push(WalMessage::Begin {
                final_lsn: t.commit_lsn,
                xid: t.xid,
                commit_time: 1_000,
            });
            for (i, c) in t.changes.iter().enumerate() {
                let table = c.table();
                if table < 2 && !tables.has(table) {
                    continue;
                }
                if !announced[table] {
                    announced[table] = true;
                    out.push(data(&LogicalMessage::Relation(relation(table))));
                }
                if t.keepalive_inside && i == t.changes.len() / 2 {
                    out.push(WalMessage::KeepAlive {
                        wal_end: t.commit_lsn,
                    });
                }
                out.push(data(&change_message(c)));
            }
            out.push(WalMessage::Commit { end_lsn: t.end_lsn });
            if let Some(wal_end) = t.keepalive_after {
                out.push(WalMessage::KeepAlive { wal_end });
            }
        }
        out
    }
}

fn data(msg: &LogicalMessage) -> WalMessage {
    let mut buf = BytesMut::new();
    encode(msg, &mut buf);
    WalMessage::Data(buf.freeze())
}

fn relation(table: usize) -> Relation {
    let (name, oid, columns): (&str, Oid, &[(&str, Oid)]) = if table < 2 {
        (
            OUTBOX[table].0,
            OUTBOX[table].1,
            &[
                ("id", 25),
                ("aggregate_type", 25),
                ("aggregate_id", 25),
                ("event_type", 25),
                ("payload", 3802),
            ],
        )
    } else {
        (AUDIT.0, AUDIT.1, &[("id", 23), ("note", 25)])
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

fn change_message(c: &Change) -> LogicalMessage {
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
        Change::Insert { table, row } => LogicalMessage::Insert(Insert {
            xid: None,
            relation_oid: OUTBOX[*table].1,
            new: row.tuple(),
        }),
        Change::UpdateOutbox { table } => LogicalMessage::Update(Update {
            xid: None,
            relation_oid: OUTBOX[*table].1,
            old: None,
            new: outbox_row(),
        }),
        Change::DeleteOutbox { table } => LogicalMessage::Delete(Delete {
            xid: None,
            relation_oid: OUTBOX[*table].1,
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
    )
        .prop_map(
            |(gap, len, changes, keepalive_inside, keepalive_after)| TxnSpec {
                gap,
                len,
                changes,
                keepalive_inside,
                keepalive_after,
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
        for (i, s) in specs.iter().enumerate() {
            let commit_lsn = Lsn(at + u64::from(s.gap));
            let end_lsn = Lsn(commit_lsn.0 + u64::from(s.len));
            // The keepalive before this one's commit: its WAL end lies in the gap.
            if let Some(prev) = txns.last_mut()
                && let Some(off) = specs[i - 1].keepalive_after
            {
                prev.keepalive_after =
                    Some(Lsn(prev.end_lsn.0 + u64::from(off) % u64::from(s.gap)));
            }
            let mut changes: Vec<Change> = s
                .changes
                .iter()
                .map(|c| match c {
                    ChangeSpec::Insert {
                        table,
                        key,
                        aggregate_type,
                        payload,
                    } => {
                        next_id += 1;
                        Change::Insert {
                            table: *table,
                            row: Row {
                                id: format!("ev-{next_id}"),
                                aggregate_type: if *aggregate_type { "order" } else { "payment" },
                                // Keys of the two tables are disjoint: a table
                                // moved out of the publication must not reorder
                                // the other table's keys.
                                key: format!("{}{key}", ["a", "b"][*table]),
                                payload: *payload,
                            },
                        }
                    }
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
                xid: 700 + u32::try_from(i).expect("small"),
                commit_lsn,
                end_lsn,
                changes,
                keepalive_inside: s.keepalive_inside,
                keepalive_after: None,
            });
            at = end_lsn.0;
        }
        let wal_end = Lsn(at + 40);
        if let (Some(last), Some(off)) = (
            txns.last_mut(),
            specs.last().and_then(|s| s.keepalive_after),
        ) {
            last.keepalive_after = Some(Lsn(last.end_lsn.0 + u64::from(off) % 40));
        }
        Log {
            created,
            txns,
            wal_end,
        }
    }
}
