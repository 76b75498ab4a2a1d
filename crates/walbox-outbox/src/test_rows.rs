//! Builders shared by the unit tests: a Relation message for a table of given
//! columns, text values, a source position.

use bytes::Bytes;
use walbox_pgoutput::{Lsn, Oid, Relation, RelationColumn, ReplicaIdentity, TupleValue};

use crate::event::Position;

/// The Relation message of `public.<name>` (oid 16400) with `columns` (name, type oid).
pub(crate) fn relation_named(name: &str, columns: &[(&str, Oid)]) -> Relation {
    Relation {
        xid: None,
        oid: 16_400,
        namespace: "public".into(),
        name: name.into(),
        replica_identity: ReplicaIdentity::Default,
        columns: columns
            .iter()
            .map(|(n, t)| RelationColumn {
                flags: 0,
                name: (*n).into(),
                type_oid: *t,
                type_modifier: -1,
            })
            .collect(),
    }
}

/// A column value in text form.
pub(crate) fn t(s: &str) -> TupleValue {
    TupleValue::Text(Bytes::copy_from_slice(s.as_bytes()))
}

/// A source position: commit LSN 16/B374D848, index 3, xid 991.
pub(crate) fn pos() -> Position {
    Position {
        commit_lsn: Lsn(0x16_B374_D848),
        index: 3,
        xid: 991,
    }
}
