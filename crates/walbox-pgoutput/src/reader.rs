//! A bounds-checked cursor over one message.

use bytes::Bytes;

use crate::error::{DecodeError, DecodeErrorKind};

/// Reads big-endian fields from a message, never past its end.
///
/// Every read returns a [`DecodeError`] naming the field and its offset instead of
/// panicking; byte slices are cheap views into the original buffer.
pub(crate) struct Reader<'a> {
    buf: &'a Bytes,
    pos: usize,
    tag: Option<u8>,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a Bytes) -> Self {
        Reader {
            buf,
            pos: 0,
            tag: None,
        }
    }

    pub(crate) fn set_tag(&mut self, tag: u8) {
        self.tag = Some(tag);
    }

    pub(crate) fn offset(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(crate) fn error(&self, field: &'static str, kind: DecodeErrorKind) -> DecodeError {
        self.error_at(field, self.pos, kind)
    }

    pub(crate) fn error_at(
        &self,
        field: &'static str,
        offset: usize,
        kind: DecodeErrorKind,
    ) -> DecodeError {
        DecodeError {
            tag: self.tag,
            field,
            offset,
            kind,
        }
    }

    fn take<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        let bytes = self
            .buf
            .get(self.pos..)
            .and_then(|rest| rest.get(..N))
            .ok_or_else(|| {
                self.error(
                    field,
                    DecodeErrorKind::UnexpectedEnd {
                        needed: N,
                        available: self.remaining(),
                    },
                )
            })?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        self.pos += N;
        Ok(out)
    }

    pub(crate) fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take::<1>(field)?[0])
    }

    pub(crate) fn i16(&mut self, field: &'static str) -> Result<i16, DecodeError> {
        Ok(i16::from_be_bytes(self.take(field)?))
    }

    pub(crate) fn i32(&mut self, field: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(self.take(field)?))
    }

    pub(crate) fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.take(field)?))
    }

    pub(crate) fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.take(field)?))
    }

    pub(crate) fn i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_be_bytes(self.take(field)?))
    }

    /// A non-negative count or length stored as Int16 or Int32.
    pub(crate) fn count16(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let at = self.pos;
        let n = self.i16(field)?;
        usize::try_from(n)
            .map_err(|_| self.error_at(field, at, DecodeErrorKind::NegativeLength(n.into())))
    }

    pub(crate) fn count32(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let at = self.pos;
        let n = self.i32(field)?;
        usize::try_from(n).map_err(|_| self.error_at(field, at, DecodeErrorKind::NegativeLength(n)))
    }

    /// `len` bytes as a view into the message (no copy).
    pub(crate) fn bytes(&mut self, field: &'static str, len: usize) -> Result<Bytes, DecodeError> {
        if len > self.remaining() {
            return Err(self.error(
                field,
                DecodeErrorKind::UnexpectedEnd {
                    needed: len,
                    available: self.remaining(),
                },
            ));
        }
        let out = self.buf.slice(self.pos..self.pos + len);
        self.pos += len;
        Ok(out)
    }

    /// A NUL-terminated UTF-8 string.
    pub(crate) fn string(&mut self, field: &'static str) -> Result<String, DecodeError> {
        let start = self.pos;
        let rest = self.buf.get(start..).unwrap_or_default();
        let len = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| self.error(field, DecodeErrorKind::UnterminatedString))?;
        let text = std::str::from_utf8(rest.get(..len).unwrap_or_default())
            .map_err(|_| self.error(field, DecodeErrorKind::InvalidUtf8))?;
        self.pos += len + 1;
        Ok(text.to_owned())
    }

    /// Capacity to reserve for `count` items of at least `min_item_bytes` each: never
    /// more than the rest of the message could hold, so a forged count cannot make the
    /// decoder allocate beyond what the input justifies.
    pub(crate) fn capacity_for(&self, count: usize, min_item_bytes: usize) -> usize {
        count.min(self.remaining() / min_item_bytes.max(1))
    }

    /// Fails unless the whole message was consumed.
    pub(crate) fn finish(&self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(self.error("end of message", DecodeErrorKind::TrailingBytes(n))),
        }
    }
}
