//! Helpers shared by this crate's tests against a real server.

#![allow(dead_code)] // each test binary uses a different part

use std::collections::HashMap;

use walbox_pgoutput::{LogicalMessage, Oid, Relation};

/// Tracks Relation messages so Inserts, Updates and Deletes can be read by name.
#[derive(Debug, Default)]
pub struct Relations {
    by_oid: HashMap<Oid, Relation>,
}

impl Relations {
    /// Records `msg` when it is a Relation message.
    pub fn observe(&mut self, msg: &LogicalMessage) {
        if let LogicalMessage::Relation(r) = msg {
            self.by_oid.insert(r.oid, r.clone());
        }
    }

    /// The relation announced for `oid`.
    ///
    /// # Panics
    /// When no Relation message for `oid` came first, which pgoutput never allows.
    #[must_use]
    pub fn get(&self, oid: Oid) -> &Relation {
        self.by_oid
            .get(&oid)
            .unwrap_or_else(|| panic!("change for relation {oid} before its Relation message"))
    }

    /// The qualified name of relation `oid`.
    #[must_use]
    pub fn name(&self, oid: Oid) -> String {
        let r = self.get(oid);
        format!("{}.{}", r.namespace, r.name)
    }
}
