//! The relay's core: every decision walbox makes about events and positions, as
//! a state machine without I/O (no async runtime, no sockets, no files, no
//! threads).
//!
//! [`Core`] takes in what happened (WAL messages from the slot, rows of a
//! snapshot, the sink's delivery results, flushed checkpoints, the clock) and
//! gives out what to do: events to send, checkpoints to write, positions to report
//! to the server. It holds the relation cache and the outbox mappers, the open
//! transaction, the skip after a partly acknowledged transaction, a replay's end,
//! dead-letter substitution, one in-flight ledger (count and bytes), the
//! acknowledged prefix ([`AckTracker`]), the snapshot's state, the replay window
//! ([`Holdback`]) and when a checkpoint is due. The `walbox` binary is the shell
//! around it: it owns every connection, thread and timer, and carries out the
//! core's outputs.
//!
//! [`AckTracker`] answers one question: which flush position can be sent to the
//! server without losing an event if walbox dies right now. The answer is the commit
//! end LSN of the newest transaction whose events, and all events of earlier
//! transactions, the sink has acknowledged; with nothing open or in flight, it is
//! the server's WAL end from keepalives, so a quiet outbox beside busy tables does
//! not hold WAL back. A failed delivery freezes it below the failed event for good.
//!
//! [`CheckpointFile`] keeps walbox's own durable record of that position, with the
//! identity of the cluster and slot it belongs to and the state of an initial
//! snapshot (the file itself is the one piece of I/O here; the core only says what
//! to write).

mod ack;
mod checkpoint;
mod core;
mod error;
mod holdback;
mod ledger;
mod takeover;
mod timeline;

pub use ack::{AckTracker, Ticket, TxnId};
pub use checkpoint::{
    CHECKPOINT_VERSION, Checkpoint, CheckpointError, CheckpointFile, Partial, SnapshotState,
    TableIdentity,
};
pub use core::{Core, CoreConfig, Outcome, Provenance, Stats, WalMessage};
pub use error::{CoreError, Failure, Rejected, TOO_LARGE};
pub use holdback::{Holdback, MAX_SAMPLES, ReplayWindow};
pub use takeover::{SlotOnServer, Takeover, TakeoverProblem, check_takeover};
pub use timeline::{TimelineProblem, check_timeline};
