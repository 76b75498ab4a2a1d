//! Write-ahead log positions.

use std::fmt;
use std::str::FromStr;

/// A position in the PostgreSQL write-ahead log.
///
/// Printed and parsed in the server's `X/Y` form, where `X` is the high and `Y` the
/// low 32 bits in upper-case hexadecimal without leading zeros (`16/B374D848`).
#[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl Lsn {
    /// The invalid position, `0/0`.
    pub const ZERO: Lsn = Lsn(0);

    /// The position as a plain integer.
    #[must_use]
    pub const fn as_u64(self) -> u64 {
        self.0
    }

    /// Whether this is `0/0`, which the server uses for "no position".
    #[must_use]
    pub const fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// Number of WAL bytes from `earlier` up to `self`, or zero when `earlier` is later.
    #[must_use]
    pub const fn bytes_since(self, earlier: Lsn) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

impl fmt::Debug for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Lsn({self})")
    }
}

impl From<u64> for Lsn {
    fn from(value: u64) -> Self {
        Lsn(value)
    }
}

impl From<Lsn> for u64 {
    fn from(value: Lsn) -> Self {
        value.0
    }
}

/// Why a string is not an LSN.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid LSN {input:?}: {reason} (expected the X/Y form, e.g. 16/B374D848)")]
pub struct ParseLsnError {
    input: String,
    reason: &'static str,
}

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let fail = |reason| ParseLsnError {
            input: s.chars().take(40).collect(),
            reason,
        };
        let (hi, lo) = s.split_once('/').ok_or_else(|| fail("missing '/'"))?;
        let half = |part: &str| -> Result<u64, ParseLsnError> {
            if part.is_empty() || part.len() > 8 {
                return Err(fail("each half must have 1 to 8 hex digits"));
            }
            if !part.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(fail("not a hexadecimal number"));
            }
            u64::from_str_radix(part, 16).map_err(|_| fail("not a hexadecimal number"))
        };
        Ok(Lsn((half(hi)? << 32) | half(lo)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_like_postgres() {
        assert_eq!(Lsn(0).to_string(), "0/0");
        assert_eq!(Lsn(0x16_B374_D848).to_string(), "16/B374D848");
        assert_eq!(Lsn(u64::MAX).to_string(), "FFFFFFFF/FFFFFFFF");
        assert_eq!(Lsn(0x0100_0000_0000_0001).to_string(), "1000000/1");
    }

    #[test]
    fn parses_both_cases_and_round_trips() {
        assert_eq!("16/B374D848".parse::<Lsn>().unwrap(), Lsn(0x16_B374_D848));
        assert_eq!("16/b374d848".parse::<Lsn>().unwrap(), Lsn(0x16_B374_D848));
        assert_eq!("0/0".parse::<Lsn>().unwrap(), Lsn::ZERO);
        for v in [
            0,
            1,
            0xFFFF_FFFF,
            0x1_0000_0000,
            u64::MAX,
            0xDEAD_BEEF_0000_0001,
        ] {
            assert_eq!(Lsn(v).to_string().parse::<Lsn>().unwrap(), Lsn(v));
        }
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "",
            "/",
            "1/",
            "/1",
            "1",
            "1/2/3",
            "G/0",
            "0/-1",
            "+1/0",
            "123456789/0",
            " 1/0",
        ] {
            let err = bad.parse::<Lsn>().unwrap_err();
            assert!(err.to_string().contains("invalid LSN"), "{bad}: {err}");
        }
    }

    #[test]
    fn orders_and_measures() {
        assert!(Lsn(1) < Lsn(2));
        assert_eq!(Lsn(10).bytes_since(Lsn(4)), 6);
        assert_eq!(Lsn(4).bytes_since(Lsn(10)), 0);
    }
}
