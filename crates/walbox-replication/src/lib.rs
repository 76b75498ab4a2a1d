//! The replication side of walbox: what may be confirmed to PostgreSQL.
//!
//! [`AckTracker`] follows every transaction read from the slot and every event it
//! produced, and answers one question: which flush position can be sent to the
//! server without losing an event if walbox dies right now. The answer is the commit
//! end LSN of the newest transaction whose events, and all events of earlier
//! transactions, the sink has acknowledged; with nothing open or in flight, it is
//! the server's WAL end from keepalives, so a quiet outbox beside busy tables does
//! not hold WAL back. A failed delivery freezes it below the failed event for good.

//!
//! [`CheckpointFile`] keeps walbox's own durable record of that position, with the
//! identity of the cluster and slot it belongs to and the state of an initial
//! snapshot.

mod ack;
mod checkpoint;

pub use ack::{AckTracker, Ticket, TxnId};
pub use checkpoint::{
    CHECKPOINT_VERSION, Checkpoint, CheckpointError, CheckpointFile, Partial, SnapshotState,
};
