//! Identifiers on the wire: message ids and transaction ids, both ULIDs.
//!
//! Both are carried as the canonical 26-character Crockford base32 text of a ULID. Parsing is
//! case-insensitive (as ULID text is); encoding is always upper case. The two ids are distinct
//! types so a message id can never be passed where a transaction id is meant.

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use ulid::Ulid;

use crate::clip;

/// A text that is not a ULID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidUlid {
    /// The offending text (clipped to a short prefix).
    pub text: String,
    /// Why it is not a ULID.
    pub reason: String,
}

impl fmt::Display for InvalidUlid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid ULID `{}`: {}", self.text, self.reason)
    }
}

impl std::error::Error for InvalidUlid {}

/// Crockford base32 as ULIDs write it (no I, L, O or U).
const ALPHABET: &[u8] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";

/// Parses ULID text strictly: 26 characters of the canonical alphabet (either case), the first
/// at most `7` so the value fits 128 bits. Every accepted text re-encodes to itself (upper
/// case), so peers comparing ids as text agree.
fn parse_ulid(text: &str) -> Result<Ulid, InvalidUlid> {
    let fail = |reason: &str| InvalidUlid {
        text: clip(text, 40).to_owned(),
        reason: reason.to_owned(),
    };
    if text.len() != ulid::ULID_LEN {
        return Err(fail("expected 26 characters"));
    }
    if !text
        .bytes()
        .all(|c| ALPHABET.contains(&c.to_ascii_uppercase()))
    {
        return Err(fail("not Crockford base32"));
    }
    if text.as_bytes().first().is_some_and(|&c| c > b'7') {
        return Err(fail("larger than 128 bits"));
    }
    Ulid::from_string(text).map_err(|e| fail(&e.to_string()))
}

macro_rules! ulid_newtype {
    ($(#[$doc:meta])* $name:ident, $expecting:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(Ulid);

        impl $name {
            /// Wraps a ULID.
            pub const fn from_ulid(ulid: Ulid) -> Self {
                Self(ulid)
            }

            /// The ULID inside.
            pub const fn ulid(self) -> Ulid {
                self.0
            }

            /// Parses ULID text (case-insensitive).
            pub fn parse(text: &str) -> Result<Self, InvalidUlid> {
                parse_ulid(text).map(Self)
            }
        }

        impl From<Ulid> for $name {
            fn from(ulid: Ulid) -> Self {
                Self(ulid)
            }
        }

        impl From<$name> for Ulid {
            fn from(id: $name) -> Self {
                id.0
            }
        }

        impl FromStr for $name {
            type Err = InvalidUlid;

            fn from_str(text: &str) -> Result<Self, Self::Err> {
                Self::parse(text)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let mut buf = [0u8; ulid::ULID_LEN];
                serializer.serialize_str(self.0.array_to_str(&mut buf))
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct IdVisitor;

                impl Visitor<'_> for IdVisitor {
                    type Value = $name;

                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str($expecting)
                    }

                    fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
                        $name::parse(text).map_err(E::custom)
                    }
                }

                deserializer.deserialize_str(IdVisitor)
            }
        }
    };
}

ulid_newtype!(
    /// The id of one message (the envelope's `id`). Receivers de-duplicate by it and
    /// acknowledge it in an `ack`.
    MessageId,
    "a message id (ULID text)"
);

ulid_newtype!(
    /// The id of one transaction (a provision, destroy or restore-test run, or an inventory
    /// request). It is the idempotency key of a dispatch: the agent runs a transaction id at most
    /// once and answers a repeated dispatch with the state it already has.
    TxnId,
    "a transaction id (ULID text)"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_case_insensitively_and_encodes_upper_case() {
        let id = MessageId::parse("01j9zqk3v5w8x2y4z6a7b8c9d0").unwrap();
        assert_eq!(id.to_string(), "01J9ZQK3V5W8X2Y4Z6A7B8C9D0");
        assert_eq!(
            serde_json::to_string(&id).unwrap(),
            "\"01J9ZQK3V5W8X2Y4Z6A7B8C9D0\""
        );
    }

    #[test]
    fn rejects_bad_text_with_a_message_naming_it() {
        for bad in [
            "",
            "01J9",
            "01J9ZQK3V5W8X2Y4Z6A7B8C9DU",
            "81J9ZQK3V5W8X2Y4Z6A7B8C9D0",
        ] {
            let err = TxnId::parse(bad).unwrap_err();
            assert!(err.to_string().starts_with("invalid ULID `"), "{err}");
            assert!(serde_json::from_value::<TxnId>(serde_json::json!(bad)).is_err());
        }
        assert!(serde_json::from_value::<TxnId>(serde_json::json!(17)).is_err());
    }

    #[test]
    fn every_accepted_text_re_encodes_to_itself() {
        for text in ["00000000000000000000000000", "7ZZZZZZZZZZZZZZZZZZZZZZZZZ"] {
            assert_eq!(MessageId::parse(text).unwrap().to_string(), text);
        }
    }

    #[test]
    fn long_bad_text_is_clipped_in_the_message() {
        let long = "x".repeat(10_000);
        let err = MessageId::parse(&long).unwrap_err();
        assert!(err.to_string().len() < 200, "{err}");
    }
}
