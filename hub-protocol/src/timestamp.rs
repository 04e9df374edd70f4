//! UTC timestamps on the wire: RFC 3339 text ending in `Z`.
//!
//! The text is validated once, when it is built or decoded, and then kept as it was written, so
//! a decoded message re-encodes byte for byte. The accepted form is
//! `YYYY-MM-DDTHH:MM:SS[.F]Z` with 1 to 9 fraction digits, upper-case `T` and `Z`, a real
//! calendar date and seconds 00..=59. Nothing here reads the clock.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::clip;

/// A UTC instant as RFC 3339 text (`2026-03-01T12:00:00Z`, `2026-03-01T12:00:00.250Z`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Timestamp(String);

/// A text that is not an RFC 3339 UTC timestamp.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidTimestamp {
    /// The offending text (clipped to a short prefix).
    pub text: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl fmt::Display for InvalidTimestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid UTC timestamp `{}`: {} (expected RFC 3339 like 2026-03-01T12:00:00Z)",
            self.text, self.reason
        )
    }
}

impl std::error::Error for InvalidTimestamp {}

impl Timestamp {
    /// Validates RFC 3339 UTC text and keeps it as written.
    pub fn parse(text: &str) -> Result<Self, InvalidTimestamp> {
        validate(text.as_bytes()).map_err(|reason| InvalidTimestamp {
            text: clip(text, 40).to_owned(),
            reason,
        })?;
        Ok(Self(text.to_owned()))
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The text, by value.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl TryFrom<String> for Timestamp {
    type Error = InvalidTimestamp;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        match validate(text.as_bytes()) {
            Ok(()) => Ok(Self(text)),
            Err(reason) => Err(InvalidTimestamp {
                text: clip(&text, 40).to_owned(),
                reason,
            }),
        }
    }
}

impl std::str::FromStr for Timestamp {
    type Err = InvalidTimestamp;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::parse(text)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TimestampVisitor;

        impl Visitor<'_> for TimestampVisitor {
            type Value = Timestamp;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an RFC 3339 UTC timestamp")
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
                Timestamp::parse(text).map_err(E::custom)
            }
        }

        deserializer.deserialize_str(TimestampVisitor)
    }
}

/// Reads `N` ASCII digits at `at` as a number.
fn digits(b: &[u8], at: usize, n: usize) -> Option<u32> {
    let slice = b.get(at..at + n)?;
    slice.iter().try_fold(0u32, |acc, &c| {
        c.is_ascii_digit().then(|| acc * 10 + u32::from(c - b'0'))
    })
}

fn days_in_month(year: u32, month: u32) -> u32 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        _ => {
            let leap =
                (year.is_multiple_of(4) && !year.is_multiple_of(100)) || year.is_multiple_of(400);
            if leap {
                29
            } else {
                28
            }
        }
    }
}

fn validate(b: &[u8]) -> Result<(), &'static str> {
    const SHAPE: &str = "not in the form YYYY-MM-DDTHH:MM:SS[.fraction]Z";
    if b.len() < 20 || b.len() > 30 {
        return Err(SHAPE);
    }
    let separators = [(4, b'-'), (7, b'-'), (10, b'T'), (13, b':'), (16, b':')];
    if separators.iter().any(|&(at, c)| b[at] != c) {
        return Err(SHAPE);
    }
    let year = digits(b, 0, 4).ok_or(SHAPE)?;
    let month = digits(b, 5, 2).ok_or(SHAPE)?;
    let day = digits(b, 8, 2).ok_or(SHAPE)?;
    let hour = digits(b, 11, 2).ok_or(SHAPE)?;
    let minute = digits(b, 14, 2).ok_or(SHAPE)?;
    let second = digits(b, 17, 2).ok_or(SHAPE)?;
    let rest = &b[19..];
    match rest {
        [b'Z'] => {}
        [b'.', fraction @ .., b'Z'] => {
            if fraction.is_empty() || fraction.len() > 9 {
                return Err("the fraction of a second must have 1 to 9 digits");
            }
            if !fraction.iter().all(u8::is_ascii_digit) {
                return Err(SHAPE);
            }
        }
        _ if rest.last() != Some(&b'Z') => return Err("not UTC (must end in Z)"),
        _ => return Err(SHAPE),
    }
    if !(1..=12).contains(&month) {
        return Err("month out of range");
    }
    if day == 0 || day > days_in_month(year, month) {
        return Err("day out of range for the month");
    }
    if hour > 23 || minute > 59 || second > 59 {
        return Err("time of day out of range");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_utc_rfc3339() {
        for ok in [
            "2026-03-01T12:00:00Z",
            "2026-03-01T23:59:59.1Z",
            "2026-03-01T00:00:00.123456789Z",
            "2024-02-29T00:00:00Z",
            "2000-02-29T00:00:00Z",
            "0000-01-01T00:00:00Z",
        ] {
            let ts = Timestamp::parse(ok).unwrap();
            assert_eq!(ts.as_str(), ok);
        }
    }

    #[test]
    fn rejects_everything_else() {
        for bad in [
            "",
            "2026-03-01",
            "2026-03-01 12:00:00Z",
            "2026-03-01t12:00:00Z",
            "2026-03-01T12:00:00z",
            "2026-03-01T12:00:00+01:00",
            "2026-03-01T12:00:00",
            "2026-03-01T12:00:00.Z",
            "2026-03-01T12:00:00.1234567890Z",
            "2026-13-01T12:00:00Z",
            "2026-00-01T12:00:00Z",
            "2026-02-29T12:00:00Z",
            "1900-02-29T12:00:00Z",
            "2026-04-31T12:00:00Z",
            "2026-03-00T12:00:00Z",
            "2026-03-01T24:00:00Z",
            "2026-03-01T12:60:00Z",
            "2026-03-01T12:00:60Z",
            "2026-03-01T12:00:0aZ",
            "+026-03-01T12:00:00Z",
            "2026-03-01T12:00:00.1a3Z",
            "2026-03-01T12:00:00ZZ",
            "２026-03-01T12:00:00Z",
        ] {
            assert!(Timestamp::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn offset_is_named_in_the_message() {
        let err = Timestamp::parse("2026-03-01T12:00:00+01:00").unwrap_err();
        assert!(err.to_string().contains("must end in Z"), "{err}");
    }

    #[test]
    fn serde_keeps_the_text() {
        let ts: Timestamp = serde_json::from_str("\"2026-03-01T12:00:00.500Z\"").unwrap();
        assert_eq!(
            serde_json::to_string(&ts).unwrap(),
            "\"2026-03-01T12:00:00.500Z\""
        );
        assert!(serde_json::from_str::<Timestamp>("\"yesterday\"").is_err());
    }
}
