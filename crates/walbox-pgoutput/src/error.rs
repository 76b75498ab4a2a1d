//! What can be wrong with a pgoutput message.

use std::fmt;

/// A pgoutput message that could not be decoded.
///
/// Says which message (by its tag byte), which field, at which byte offset of the
/// message, and what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pgoutput {}: {field} at byte {offset}: {kind}", tag_name(*.tag))]
pub struct DecodeError {
    /// Tag byte of the message being decoded (`None` for an empty message).
    pub tag: Option<u8>,
    /// Name of the field being read when the problem was found.
    pub field: &'static str,
    /// Byte offset inside the message where the field starts.
    pub offset: usize,
    /// What was wrong.
    pub kind: DecodeErrorKind,
}

/// The class of a [`DecodeError`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeErrorKind {
    /// The message is empty: not even a tag byte.
    Empty,
    /// The first byte is not a known pgoutput message tag.
    UnknownTag(u8),
    /// The message ended before the field was complete.
    UnexpectedEnd {
        /// Bytes the field needs.
        needed: usize,
        /// Bytes left in the message.
        available: usize,
    },
    /// A string field has no terminating NUL byte.
    UnterminatedString,
    /// A string field is not valid UTF-8.
    InvalidUtf8,
    /// A count or length field is negative.
    NegativeLength(i32),
    /// A byte that selects between alternatives has a value the protocol does not define.
    UnexpectedByte {
        /// The byte found.
        found: u8,
        /// The values the protocol allows here.
        expected: &'static str,
    },
    /// The message continues after its last field.
    TrailingBytes(usize),
}

impl fmt::Display for DecodeErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("empty message"),
            Self::UnknownTag(t) => write!(f, "unknown message tag {}", show_byte(*t)),
            Self::UnexpectedEnd { needed, available } => write!(
                f,
                "message ends early: needs {needed} more bytes, {available} left"
            ),
            Self::UnterminatedString => f.write_str("string has no terminating NUL"),
            Self::InvalidUtf8 => f.write_str("string is not valid UTF-8"),
            Self::NegativeLength(n) => write!(f, "negative length {n}"),
            Self::UnexpectedByte { found, expected } => {
                write!(
                    f,
                    "unexpected byte {}, expected {expected}",
                    show_byte(*found)
                )
            }
            Self::TrailingBytes(n) => write!(f, "{n} unexpected bytes after the last field"),
        }
    }
}

fn show_byte(b: u8) -> String {
    if b.is_ascii_graphic() {
        format!("'{}' (0x{b:02x})", b as char)
    } else {
        format!("0x{b:02x}")
    }
}

/// Human name of a message tag, for error messages.
pub(crate) fn tag_name(tag: Option<u8>) -> &'static str {
    match tag {
        None => "message",
        Some(b'B') => "Begin",
        Some(b'C') => "Commit",
        Some(b'O') => "Origin",
        Some(b'R') => "Relation",
        Some(b'Y') => "Type",
        Some(b'I') => "Insert",
        Some(b'U') => "Update",
        Some(b'D') => "Delete",
        Some(b'T') => "Truncate",
        Some(b'M') => "Message",
        Some(b'S') => "Stream Start",
        Some(b'E') => "Stream Stop",
        Some(b'c') => "Stream Commit",
        Some(b'A') => "Stream Abort",
        Some(b'b') => "Begin Prepare",
        Some(b'P') => "Prepare",
        Some(b'K') => "Commit Prepared",
        Some(b'r') => "Rollback Prepared",
        Some(b'p') => "Stream Prepare",
        Some(_) => "message",
    }
}
