//! Sans-I/O decoder for PostgreSQL's `pgoutput` logical replication protocol.
//!
//! This crate turns the payload of one XLogData message into a [`LogicalMessage`]
//! and back. It covers every message PostgreSQL 15 to 17 sends with protocol
//! versions 1 to 4: Begin, Commit, Origin, Relation, Type, Insert, Update, Delete,
//! Truncate, logical decoding Message, the streaming messages (Stream Start, Stop,
//! Commit, Abort) and the two-phase messages (Begin Prepare, Prepare, Commit
//! Prepared, Rollback Prepared, Stream Prepare).
//!
//! It does no I/O and has no async runtime. Decoding is total: every byte sequence
//! yields a message or a [`DecodeError`] that names the message, the field, the byte
//! offset and the problem. It never panics, never reads past the input, and never
//! reserves memory for more items than the remaining input could hold. Column
//! values are zero-copy views ([`bytes::Bytes`]) into the input buffer.
//!
//! ```
//! use bytes::Bytes;
//! use walbox_pgoutput::{Decoder, LogicalMessage, Lsn};
//!
//! // A Begin message: final LSN, commit timestamp, xid.
//! let mut raw = vec![b'B'];
//! raw.extend_from_slice(&0x16_B374_D848u64.to_be_bytes());
//! raw.extend_from_slice(&0i64.to_be_bytes());
//! raw.extend_from_slice(&742u32.to_be_bytes());
//!
//! let mut decoder = Decoder::new();
//! match decoder.decode(&Bytes::from(raw)).unwrap() {
//!     LogicalMessage::Begin(b) => {
//!         assert_eq!(b.final_lsn, "16/B374D848".parse::<Lsn>().unwrap());
//!         assert_eq!(b.xid, 742);
//!     }
//!     other => panic!("unexpected {other:?}"),
//! }
//! ```

#![deny(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]
#![cfg_attr(
    test,
    allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)
)]

mod decode;
mod encode;
mod error;
mod lsn;
mod message;
mod reader;

pub use decode::{Decoder, decode};
pub use encode::encode;
pub use error::{DecodeError, DecodeErrorKind};
pub use lsn::{Lsn, ParseLsnError};
pub use message::*;

#[cfg(test)]
mod tests;
