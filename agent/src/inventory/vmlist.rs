//! The `/etc/pve/.vmlist` parser: [`parse_vmlist`] reads the bytes pmxcfs writes through a
//! direct scanner and leaves anything else to the JSON decoder, [`parse_vmlist_reference`],
//! which defines the answer (the two agree on every input).
//!
//! It may use only the shared types of [`crate::inventory`], std and serde.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;

use super::{parse_pmxcfs_vmid, GuestEntry, GuestType, InventoryError};

/// A number that PVE may print as a JSON number or as a string of digits.
struct LenientU64(u64);

impl<'de> Deserialize<'de> for LenientU64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = LenientU64;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a non-negative integer (number or string)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<LenientU64, E> {
                Ok(LenientU64(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<LenientU64, E> {
                u64::try_from(v)
                    .map(LenientU64)
                    .map_err(|_| E::custom(format!("negative version {v}")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<LenientU64, E> {
                if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
                    v.parse()
                        .map(LenientU64)
                        .map_err(|_| E::custom(format!("version {v:?} is too large")))
                } else {
                    Err(E::custom(format!("version {v:?} is not a number")))
                }
            }
        }
        d.deserialize_any(V)
    }
}

struct VmidKey(u32);

impl<'de> Deserialize<'de> for VmidKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = VmidKey;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a vmid as an object key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<VmidKey, E> {
                parse_pmxcfs_vmid(v)
                    .map(VmidKey)
                    .ok_or_else(|| E::custom(format!("guest key {:?} is not a vmid", v)))
            }
        }
        d.deserialize_str(V)
    }
}

#[derive(Deserialize)]
struct RawEntry<'a> {
    #[serde(borrow)]
    node: Cow<'a, str>,
    #[serde(rename = "type")]
    kind: GuestType,
    version: Option<LenientU64>,
}

/// Shares one `Arc<str>` per node name among the entries of a list.
#[derive(Default)]
struct NodeNames(Vec<Arc<str>>);

impl NodeNames {
    fn get(&mut self, name: &str) -> Arc<str> {
        if let Some(known) = self.0.iter().rev().find(|n| &***n == name) {
            return Arc::clone(known);
        }
        let new: Arc<str> = Arc::from(name);
        self.0.push(Arc::clone(&new));
        new
    }
}

/// The `ids` object, kept in file order.
struct Ids(Vec<GuestEntry>);

impl<'de> Deserialize<'de> for Ids {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Ids;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of guests keyed by vmid")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Ids, A::Error> {
                let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0));
                let mut nodes = NodeNames::default();
                while let Some(VmidKey(vmid)) = map.next_key()? {
                    let raw: RawEntry<'de> = map.next_value()?;
                    if raw.node.is_empty() {
                        return Err(de::Error::custom(format!("guest {vmid} has an empty node")));
                    }
                    out.push(GuestEntry {
                        vmid,
                        kind: raw.kind,
                        node: nodes.get(&raw.node),
                        version: raw.version.map(|v| v.0),
                    });
                }
                Ok(Ids(out))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum DocKey {
    Version,
    Ids,
    #[serde(other)]
    Other,
}

/// The whole `.vmlist` document.
struct VmlistDoc(Vec<GuestEntry>);

impl<'de> Deserialize<'de> for VmlistDoc {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = VmlistDoc;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a .vmlist object with a version")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<VmlistDoc, A::Error> {
                let mut version: Option<u64> = None;
                let mut ids: Option<Vec<GuestEntry>> = None;
                while let Some(key) = map.next_key()? {
                    match key {
                        DocKey::Version => {
                            if version.is_some() {
                                return Err(de::Error::duplicate_field("version"));
                            }
                            version = Some(map.next_value::<LenientU64>()?.0);
                        }
                        DocKey::Ids => {
                            if ids.is_some() {
                                return Err(de::Error::duplicate_field("ids"));
                            }
                            ids = Some(map.next_value::<Ids>()?.0);
                        }
                        DocKey::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                if version.is_none() {
                    return Err(de::Error::missing_field("version"));
                }
                // No `ids` key is how pmxcfs writes an empty guest list.
                Ok(VmlistDoc(ids.unwrap_or_default()))
            }
        }
        d.deserialize_map(V)
    }
}

/// Parse the bytes of `/etc/pve/.vmlist`, keeping the entries in file order (pmxcfs writes
/// them in hash order).
///
/// The format: a JSON object with a `version` counter and, when the cluster has any guest, an
/// `ids` object keyed by vmid whose values carry `node`, `type` (`qemu`, `lxc` or the legacy
/// `openvz`) and the config's `version`. Numbers may also arrive as strings of digits. Unknown
/// keys are ignored; anything else (no `version`, a key that is not a vmid, an unknown type, a
/// vmid listed twice, trailing data) is an error, because a guest list that cannot be trusted
/// must not clear a vmid.
///
/// Text laid out exactly as pmxcfs writes it is read by a direct scanner (a 100,000-guest list
/// is parsed on every `vmid-check`); anything else goes through the JSON decoder
/// [`parse_vmlist_reference`]. Both give the same result for every input.
pub fn parse_vmlist(bytes: &[u8]) -> Result<Vec<GuestEntry>, InventoryError> {
    reject_duplicates(decode_vmlist(bytes)?)
}

/// [`parse_vmlist`] through the JSON decoder only. It defines what `parse_vmlist` must return;
/// the fuzz target checks the two against each other.
pub fn parse_vmlist_reference(bytes: &[u8]) -> Result<Vec<GuestEntry>, InventoryError> {
    reject_duplicates(decode_vmlist_json(bytes)?)
}

fn reject_duplicates(entries: Vec<GuestEntry>) -> Result<Vec<GuestEntry>, InventoryError> {
    let mut vmids: Vec<u32> = entries.iter().map(|e| e.vmid).collect();
    vmids.sort_unstable();
    if let Some(w) = vmids.windows(2).find(|w| w[0] == w[1]) {
        return Err(InventoryError::VmlistSyntax {
            detail: format!("vmid {} is listed twice", w[0]),
        });
    }
    Ok(entries)
}

/// [`parse_vmlist`] without the duplicate check, for callers that sort anyway.
pub(super) fn decode_vmlist(bytes: &[u8]) -> Result<Vec<GuestEntry>, InventoryError> {
    match scan_pmxcfs_vmlist(bytes) {
        Some(entries) => Ok(entries),
        None => decode_vmlist_json(bytes),
    }
}

fn decode_vmlist_json(bytes: &[u8]) -> Result<Vec<GuestEntry>, InventoryError> {
    let VmlistDoc(entries) =
        serde_json::from_slice(bytes).map_err(|e| InventoryError::VmlistSyntax {
            detail: e.to_string(),
        })?;
    Ok(entries)
}

/// A cursor over bytes for [`scan_pmxcfs_vmlist`]. Every step returns `None` on anything
/// unexpected; it never indexes out of bounds.
struct Scan<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Scan<'a> {
    fn literal(&mut self, lit: &[u8]) -> Option<()> {
        let end = self.at.checked_add(lit.len())?;
        (self.bytes.get(self.at..end)? == lit).then(|| self.at = end)
    }

    /// One or more ASCII digits.
    fn digits(&mut self) -> Option<&'a [u8]> {
        let start = self.at;
        while self.bytes.get(self.at).is_some_and(u8::is_ascii_digit) {
            self.at += 1;
        }
        self.bytes.get(start..self.at).filter(|d| !d.is_empty())
    }

    /// A JSON integer as serde_json reads it into a u64: no leading zero, no overflow.
    fn json_u64(&mut self) -> Option<u64> {
        let d = self.digits()?;
        if d.len() > 1 && d.first() == Some(&b'0') {
            return None;
        }
        d.iter().try_fold(0u64, |acc, &b| {
            acc.checked_mul(10)?.checked_add(u64::from(b - b'0'))
        })
    }

    /// A vmid key as pmxcfs writes it (see [`parse_pmxcfs_vmid`](super::parse_pmxcfs_vmid)), then its closing `"`.
    fn vmid_key(&mut self) -> Option<u32> {
        let d = self.digits()?;
        if d.first() == Some(&b'0') {
            return None;
        }
        self.literal(b"\"")?;
        let n = d.iter().try_fold(0u64, |acc, &b| {
            acc.checked_mul(10)?.checked_add(u64::from(b - b'0'))
        })?;
        u32::try_from(n).ok()
    }

    /// The bytes up to the next `"`, which is consumed.
    fn until_quote(&mut self) -> Option<&'a [u8]> {
        let rest = self.bytes.get(self.at..)?;
        let len = rest.iter().position(|&b| b == b'"')?;
        self.at += len + 1;
        rest.get(..len)
    }

    fn at_end(&self) -> bool {
        self.at == self.bytes.len()
    }
}

/// Read `.vmlist` bytes laid out exactly as pmxcfs writes them (`status.c`
/// `cfs_create_vmlist_msg`), or `None` for anything else, which the JSON decoder then reads.
/// Only node names of letters, digits, `.`, `-` and `_` are taken (nothing a JSON string would
/// escape), so the result is what the JSON decoder would give.
fn scan_pmxcfs_vmlist(bytes: &[u8]) -> Option<Vec<GuestEntry>> {
    let mut s = Scan { bytes, at: 0 };
    s.literal(b"{\n\"version\": ")?;
    s.json_u64()?;
    if s.literal(b"\n\n}\n").is_some() {
        return s.at_end().then(Vec::new);
    }
    s.literal(b",\n\"ids\": {\n")?;
    let mut out = Vec::with_capacity(bytes.len() / 56);
    let mut nodes = NodeNames::default();
    loop {
        s.literal(b"\"")?;
        let vmid = s.vmid_key()?;
        s.literal(b": { \"node\": \"")?;
        let node = s.until_quote()?;
        if node.is_empty()
            || !node
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
        {
            return None;
        }
        s.literal(b", \"type\": \"")?;
        let kind = GuestType::from_pve(std::str::from_utf8(s.until_quote()?).ok()?)?;
        s.literal(b", \"version\": ")?;
        let version = s.json_u64()?;
        s.literal(b" }")?;
        out.push(GuestEntry {
            vmid,
            kind,
            node: nodes.get(std::str::from_utf8(node).ok()?),
            version: Some(version),
        });
        if s.literal(b",\n").is_some() {
            continue;
        }
        s.literal(b"}\n\n}\n")?;
        return s.at_end().then_some(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::fixtures::{entry, VMLIST_EMPTY, VMLIST_MULTI};

    #[test]
    fn vmlist_multi_entry_sample() {
        let got = parse_vmlist(VMLIST_MULTI.as_bytes()).unwrap();
        assert_eq!(
            got,
            vec![
                entry(100, GuestType::Qemu, "pve1", Some(5)),
                entry(101, GuestType::Lxc, "pve2", Some(9)),
            ]
        );
    }

    #[test]
    fn vmlist_without_ids_is_empty() {
        assert_eq!(parse_vmlist(VMLIST_EMPTY.as_bytes()).unwrap(), vec![]);
    }

    #[test]
    fn vmlist_keeps_file_order_openvz_and_string_numbers() {
        let text = "{\n\"version\": \"42\",\n\"ids\": {\n\"990003\": { \"node\": \"pve3\", \"type\": \"openvz\", \"version\": \"7\" },\n\"200\": { \"node\": \"pve1\", \"type\": \"lxc\", \"version\": 1, \"future\": [1] }}\n\n}\n";
        assert_eq!(
            parse_vmlist(text.as_bytes()).unwrap(),
            vec![
                entry(990_003, GuestType::OpenVz, "pve3", Some(7)),
                entry(200, GuestType::Lxc, "pve1", Some(1)),
            ]
        );
    }

    #[test]
    fn vmlist_corrupt_inputs_are_errors() {
        let cases: &[(&str, &str)] = &[
            ("", "EOF"),
            ("{", "EOF"),
            ("[]", "invalid type"),
            ("{}", "missing field `version`"),
            ("{\"ids\": {}}", "missing field `version`"),
            ("{\"version\": -1}", "negative"),
            ("{\"version\": 1.5}", "non-negative integer"),
            ("{\"version\": \"x\"}", "not a number"),
            ("{\"version\": 1, \"version\": 2}", "duplicate field"),
            ("{\"version\": 1, \"ids\": []}", "invalid type"),
            ("{\"version\": 1, \"ids\": null}", "invalid type"),
            (
                "{\"version\": 1, \"ids\": {\"0100\": {\"node\": \"a\", \"type\": \"lxc\"}}}",
                "is not a vmid",
            ),
            (
                "{\"version\": 1, \"ids\": {\"abc\": {\"node\": \"a\", \"type\": \"lxc\"}}}",
                "is not a vmid",
            ),
            (
                "{\"version\": 1, \"ids\": {\"4294967296\": {\"node\": \"a\", \"type\": \"lxc\"}}}",
                "is not a vmid",
            ),
            (
                "{\"version\": 1, \"ids\": {\"100\": {\"type\": \"lxc\"}}}",
                "missing field `node`",
            ),
            (
                "{\"version\": 1, \"ids\": {\"100\": {\"node\": \"a\"}}}",
                "missing field `type`",
            ),
            (
                "{\"version\": 1, \"ids\": {\"100\": {\"node\": \"a\", \"type\": \"unknown\"}}}",
                "unknown variant",
            ),
            (
                "{\"version\": 1, \"ids\": {\"100\": {\"node\": \"\", \"type\": \"lxc\"}}}",
                "empty node",
            ),
            (
                "{\"version\": 1, \"ids\": {\"100\": {\"node\": \"a\", \"type\": \"lxc\"}, \"100\": {\"node\": \"b\", \"type\": \"qemu\"}}}",
                "vmid 100 is listed twice",
            ),
            ("{\"version\": 1} trailing", "trailing characters"),
        ];
        for (text, want) in cases {
            match parse_vmlist(text.as_bytes()) {
                Err(InventoryError::VmlistSyntax { detail }) => {
                    assert!(detail.contains(want), "{text:?}: {detail}")
                }
                other => panic!("{text:?} gave {other:?}"),
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn scanner_and_json_decoder_agree_on_damaged_lists(
            rows in proptest::collection::vec((100u32..100_000, "[a-z0-9]{1,6}"), 0..6),
            edits in proptest::collection::vec((proptest::num::usize::ANY, proptest::num::u8::ANY, 0u8..3), 0..4),
        ) {
            let mut bytes = vmlist_text(7, rows.iter().map(|(v, n)| (*v, "lxc", n.as_str(), 1))).into_bytes();
            for (at, byte, op) in edits {
                if bytes.is_empty() { break; }
                let at = at % bytes.len();
                match op {
                    0 => bytes[at] = byte,
                    1 => bytes.insert(at, byte),
                    _ => { bytes.remove(at); }
                }
            }
            proptest::prop_assert_eq!(parse_vmlist(&bytes), parse_vmlist_reference(&bytes));
        }

        #[test]
        fn vmlist_round_trip(
            rows in proptest::collection::btree_map(
                1u32..=u32::MAX,
                (proptest::prop_oneof![proptest::strategy::Just("lxc"), proptest::strategy::Just("qemu"), proptest::strategy::Just("openvz")], "[a-z][a-z0-9-]{0,10}", 0u32..=u32::MAX),
                0..30,
            ),
            version in 0u32..=u32::MAX,
        ) {
            let text = vmlist_text(version, rows.iter().map(|(v, (t, n, ver))| (*v, *t, n.as_str(), *ver)));
            proptest::prop_assert!(scan_pmxcfs_vmlist(text.as_bytes()).is_some());
            let mut got = parse_vmlist(text.as_bytes()).unwrap();
            got.sort_by_key(|e| e.vmid);
            let want: Vec<GuestEntry> = rows.iter().map(|(v, (t, n, ver))| GuestEntry {
                vmid: *v,
                kind: GuestType::from_pve(t).unwrap(),
                node: n.as_str().into(),
                version: Some(u64::from(*ver)),
            }).collect();
            proptest::prop_assert_eq!(got, want);
        }
    }

    /// `.vmlist` text laid out exactly as pmxcfs writes it.
    fn vmlist_text<'a>(
        version: u32,
        rows: impl Iterator<Item = (u32, &'a str, &'a str, u32)>,
    ) -> String {
        let rows: Vec<String> = rows
            .map(|(vmid, kind, node, ver)| {
                format!("\"{vmid}\": {{ \"node\": \"{node}\", \"type\": \"{kind}\", \"version\": {ver} }}")
            })
            .collect();
        if rows.is_empty() {
            format!("{{\n\"version\": {version}\n\n}}\n")
        } else {
            format!(
                "{{\n\"version\": {version},\n\"ids\": {{\n{}}}\n\n}}\n",
                rows.join(",\n")
            )
        }
    }

    #[test]
    fn the_scanner_reads_pmxcfs_layout_and_leaves_the_rest_to_json() {
        // The reference bytes take the direct path...
        assert_eq!(
            scan_pmxcfs_vmlist(VMLIST_MULTI.as_bytes()),
            Some(parse_vmlist_reference(VMLIST_MULTI.as_bytes()).unwrap())
        );
        assert_eq!(scan_pmxcfs_vmlist(VMLIST_EMPTY.as_bytes()), Some(vec![]));
        // ...anything else the JSON decoder, with the same answer.
        let cases = [
            // Escaped node name.
            "{\n\"version\": 1,\n\"ids\": {\n\"100\": { \"node\": \"pve\\u0031\", \"type\": \"lxc\", \"version\": 1 }}\n\n}\n",
            // Other whitespace.
            "{\"version\": 1, \"ids\": {\"100\": {\"node\": \"pve1\", \"type\": \"lxc\", \"version\": 1}}}",
            // Leading zero in a number: JSON refuses it.
            "{\n\"version\": 01\n\n}\n",
            // Version too large for u64.
            "{\n\"version\": 1,\n\"ids\": {\n\"100\": { \"node\": \"a\", \"type\": \"lxc\", \"version\": 99999999999999999999 }}\n\n}\n",
            // Trailing bytes.
            "{\n\"version\": 3\n\n}\nx",
        ];
        for text in cases {
            assert_eq!(scan_pmxcfs_vmlist(text.as_bytes()), None, "{text:?}");
            assert_eq!(
                parse_vmlist(text.as_bytes()),
                parse_vmlist_reference(text.as_bytes()),
                "{text:?}"
            );
        }
        assert_eq!(
            parse_vmlist(cases[0].as_bytes()).unwrap(),
            vec![entry(100, GuestType::Lxc, "pve1", Some(1))]
        );
    }

    #[test]
    fn vmlist_text_matches_the_reference_bytes() {
        assert_eq!(vmlist_text(3, std::iter::empty()), VMLIST_EMPTY);
        assert_eq!(
            vmlist_text(
                17,
                [(100, "qemu", "pve1", 5), (101, "lxc", "pve2", 9)].into_iter()
            ),
            VMLIST_MULTI
        );
    }
}
