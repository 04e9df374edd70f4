//! The node's full guest list (`/etc/pve/.vmlist`, or `pct list` + `qm list`) joined with the
//! pool view of the API token. Foreign guests' names never leave this node.
//!
//! This module owns:
//! - reading the FULL guest list as root (DESIGN rule 2): [`read_full_list`] reads `.vmlist`
//!   (cluster-wide) and falls back to `pct list` + `qm list` (this node only) when `.vmlist`
//!   cannot be read, and says which source it used ([`ListSource`]);
//! - the parsers of those three formats ([`parse_vmlist`], [`parse_pct_list`],
//!   [`parse_qm_list`]), which reject anything that is not exactly what PVE prints;
//! - the join with the pool view ([`PoolView`], [`join`]) that marks each guest as a pool guest
//!   or a foreign one, and the two documents built from it: [`GuestsReport`] (for
//!   `felhom-agent guests`, shown on this node) and [`HubInventory`] (the only form meant for
//!   the hub, which has no room for a foreign guest's name);
//! - the `next-id` lint of `/etc/pve/datacenter.cfg` ([`next_id_lint`]).
//!
//! It never writes anything and never talks to the PVE API: the caller fetches the pool view
//! and hands its rows in.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Serialize};

use crate::error::ErrorCode;
use crate::vmid::{GuestLookup, Holder, RESTORE_TEST_BAND, SELFTEST_SCRATCH_VMID};

/// The default location of the cluster-wide guest list.
pub const DEFAULT_VMLIST_PATH: &str = "/etc/pve/.vmlist";

/// The largest `.vmlist` (or `pct list` / `qm list` output) this agent reads. A 100,000-guest
/// `.vmlist` is about 6 MiB.
pub const MAX_LIST_BYTES: u64 = 64 * 1024 * 1024;

/// How long `pct list` or `qm list` may run before the agent gives up on it.
pub const LIST_COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// The most of a command's stderr an error message repeats.
const STDERR_EXCERPT_CHARS: usize = 400;

/// The `next-id` range that leaves out 9999 and the restore-test band.
const SUGGESTED_NEXT_ID: &str = "next-id: lower=10000,upper=990000";

/// PVE's default `next-id` range when `datacenter.cfg` sets none: `[100, 1000000)`.
const DEFAULT_NEXT_ID_LOWER: u64 = 100;
const DEFAULT_NEXT_ID_UPPER: u64 = 1_000_000;

/// Errors of reading and parsing the full guest list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InventoryError {
    /// The text is not a `.vmlist` document (no path known yet).
    #[error("not a valid .vmlist: {detail}")]
    VmlistSyntax {
        /// What is wrong, with line and column where known.
        detail: String,
    },
    /// The `.vmlist` file was read but is not a valid guest list.
    #[error(
        "{path} is not a valid guest list: {detail}; check that pve-cluster (pmxcfs) is \
         running and that vmlist_path in the agent config points at /etc/pve/.vmlist"
    )]
    VmlistInvalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The `.vmlist` file is larger than [`MAX_LIST_BYTES`].
    #[error(
        "{path} is larger than {max} bytes, which no real guest list is; check that \
         vmlist_path in the agent config points at /etc/pve/.vmlist"
    )]
    VmlistTooLarge {
        /// The file.
        path: PathBuf,
        /// The limit.
        max: u64,
    },
    /// `pct list` printed something that is not its table.
    #[error(
        "`pct list` printed line {line} in a form this agent does not know: {detail}; \
         run `pct list` by hand to see it, and check that pve-container is installed intact"
    )]
    PctListInvalid {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        detail: String,
    },
    /// `qm list` printed something that is not its table.
    #[error(
        "`qm list` printed line {line} in a form this agent does not know: {detail}; \
         run `qm list` by hand to see it, and check that qemu-server is installed intact"
    )]
    QmListInvalid {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        detail: String,
    },
    /// One vmid appears twice in one guest list.
    #[error(
        "vmid {vmid} appears twice in {origin}; the guest list cannot be trusted, check the \
         cluster file system (pmxcfs) before provisioning"
    )]
    DuplicateVmid {
        /// The vmid.
        vmid: u32,
        /// Which list.
        origin: String,
    },
    /// `.vmlist` was unreadable and the local commands failed too.
    #[error(
        "cannot read the full guest list: {vmlist_path} could not be read ({vmlist_error}) \
         and `{command}` failed: {detail}; run the agent as root on a Proxmox VE node with \
         /etc/pve mounted"
    )]
    NoGuestList {
        /// The `.vmlist` path tried first.
        vmlist_path: PathBuf,
        /// Why it could not be read.
        vmlist_error: String,
        /// The command that failed (`pct list` or `qm list`).
        command: &'static str,
        /// How it failed.
        detail: String,
    },
    /// A list command could not be run or failed (as reported by a [`ListCommands`]).
    #[error("`{command}` failed: {detail}")]
    CommandFailed {
        /// `pct list` or `qm list`.
        command: &'static str,
        /// How it failed.
        detail: String,
    },
}

impl InventoryError {
    /// The stable error code: a list file that is not what it should be is `config_invalid`;
    /// a local PVE that cannot answer (commands missing or failing) is `pve_unreachable`.
    /// Both end a command with the environment exit status.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::VmlistSyntax { .. }
            | Self::VmlistInvalid { .. }
            | Self::VmlistTooLarge { .. }
            | Self::DuplicateVmid { .. } => ErrorCode::ConfigInvalid,
            Self::PctListInvalid { .. }
            | Self::QmListInvalid { .. }
            | Self::NoGuestList { .. }
            | Self::CommandFailed { .. } => ErrorCode::PveUnreachable,
        }
    }
}

/// The kind of a guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GuestType {
    /// An LXC container (`lxc`).
    Lxc,
    /// A QEMU virtual machine (`qemu`).
    Qemu,
    /// A legacy OpenVZ container (`openvz`); `.vmlist` can still list one.
    #[serde(rename = "openvz")]
    OpenVz,
}

impl GuestType {
    /// PVE's name: `lxc`, `qemu` or `openvz`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Lxc => "lxc",
            Self::Qemu => "qemu",
            Self::OpenVz => "openvz",
        }
    }

    /// The type from PVE's name (`.vmlist` `type`, `cluster/resources` `type`).
    pub fn from_pve(s: &str) -> Option<Self> {
        match s {
            "lxc" => Some(Self::Lxc),
            "qemu" => Some(Self::Qemu),
            "openvz" => Some(Self::OpenVz),
            _ => None,
        }
    }

    /// The word an operator message uses: "container", "virtual machine".
    pub fn noun(self) -> &'static str {
        match self {
            Self::Lxc => "container",
            Self::Qemu => "virtual machine",
            Self::OpenVz => "legacy OpenVZ container",
        }
    }

    /// [`GuestType::noun`] with its article: "a container".
    pub fn noun_with_article(self) -> &'static str {
        match self {
            Self::Lxc => "a container",
            Self::Qemu => "a virtual machine",
            Self::OpenVz => "a legacy OpenVZ container",
        }
    }
}

impl fmt::Display for GuestType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One guest of the full guest list. It has no name: `.vmlist` carries none, and the names
/// `pct list` / `qm list` print are dropped so that a foreign guest's name is never kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestEntry {
    /// The vmid.
    pub vmid: u32,
    /// Container or virtual machine.
    pub kind: GuestType,
    /// The cluster node whose config directory holds the guest. Shared between the entries of
    /// one list (a cluster has few nodes and may have 100,000 guests).
    pub node: Arc<str>,
    /// The config file's version counter (`.vmlist` only).
    pub version: Option<u64>,
}

/// Where the full guest list came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListSource {
    /// `/etc/pve/.vmlist`: every guest of the cluster.
    Vmlist {
        /// The file read.
        path: PathBuf,
    },
    /// `pct list` + `qm list`, because `.vmlist` could not be read. These see only the guests
    /// of this node: a guest on another cluster node is missing from such a list.
    LocalCommands {
        /// This node.
        node: String,
        /// The `.vmlist` path that could not be read.
        vmlist_path: PathBuf,
        /// Why it could not be read.
        vmlist_error: String,
    },
}

impl ListSource {
    /// `vmlist` or `local_commands`, as JSON output names it.
    pub fn kind_str(&self) -> &'static str {
        match self {
            Self::Vmlist { .. } => "vmlist",
            Self::LocalCommands { .. } => "local_commands",
        }
    }

    /// True when the list covers every node of the cluster.
    pub fn cluster_wide(&self) -> bool {
        matches!(self, Self::Vmlist { .. })
    }

    /// A sentence part for the operator: which list, and what it covers.
    pub fn describe(&self) -> String {
        match self {
            Self::Vmlist { path } => format!("{} (cluster-wide)", path.display()),
            Self::LocalCommands {
                node,
                vmlist_path,
                vmlist_error,
            } => format!(
                "`pct list` and `qm list` on node {node}, which see only this node's guests \
                 ({} could not be read: {vmlist_error})",
                vmlist_path.display()
            ),
        }
    }
}

/// The full guest list: every guest that holds a vmid, sorted by vmid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FullGuestList {
    source: ListSource,
    /// Sorted by vmid, no vmid twice.
    entries: Vec<GuestEntry>,
}

impl FullGuestList {
    /// A list from parsed entries; a vmid that appears twice is an error.
    pub fn from_entries(
        source: ListSource,
        entries: impl IntoIterator<Item = GuestEntry>,
    ) -> Result<Self, InventoryError> {
        let mut entries: Vec<GuestEntry> = entries.into_iter().collect();
        entries.sort_unstable_by_key(|e| e.vmid);
        if let Some(w) = entries.windows(2).find(|w| w[0].vmid == w[1].vmid) {
            return Err(InventoryError::DuplicateVmid {
                vmid: w[0].vmid,
                origin: source.describe(),
            });
        }
        Ok(Self { source, entries })
    }

    /// Where the list came from.
    pub fn source(&self) -> &ListSource {
        &self.source
    }

    /// The guest at `vmid`, if any.
    pub fn lookup(&self, vmid: u32) -> Option<&GuestEntry> {
        self.entries
            .binary_search_by_key(&vmid, |e| e.vmid)
            .ok()
            .and_then(|i| self.entries.get(i))
    }

    /// True when a guest holds `vmid`.
    pub fn contains(&self, vmid: u32) -> bool {
        self.lookup(vmid).is_some()
    }

    /// Every guest, by ascending vmid.
    pub fn entries(&self) -> impl Iterator<Item = &GuestEntry> {
        self.entries.iter()
    }

    /// How many guests.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when the list has no guest.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

// ---------------------------------------------------------------------------------------------
// .vmlist

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

/// A vmid as pmxcfs writes it (`%u` of a config file name matching `[1-9][0-9]*.conf`):
/// decimal digits, no leading zero, fitting 32 bits. Such a key may lie outside PVE's
/// 100..=999999999 (a hand-made `5.conf`); it still holds that number, so it is kept.
fn parse_pmxcfs_vmid(s: &str) -> Option<u32> {
    let bytes = s.as_bytes();
    match bytes.first() {
        Some(b'1'..=b'9') if bytes.iter().all(u8::is_ascii_digit) => s.parse().ok(),
        _ => None,
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
fn decode_vmlist(bytes: &[u8]) -> Result<Vec<GuestEntry>, InventoryError> {
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

    /// A vmid key as pmxcfs writes it (see [`parse_pmxcfs_vmid`]), then its closing `"`.
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

// ---------------------------------------------------------------------------------------------
// pct list / qm list

/// The words of a line split on spaces, each with its byte offset.
fn words(line: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, b) in line.bytes().enumerate() {
        match (b == b' ', start) {
            (true, Some(s)) => {
                out.push((s, &line[s..i]));
                start = None;
            }
            (false, None) => start = Some(i),
            _ => {}
        }
    }
    if let Some(s) = start {
        out.push((s, &line[s..]));
    }
    out
}

/// The non-blank lines of a command's output, numbered from 1.
fn table_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.split('\n')
        .enumerate()
        .map(|(i, l)| (i + 1, l))
        .filter(|(_, l)| !l.trim().is_empty())
}

/// `pct list`'s line layout (pve-container `pct.pm`): `"%-10s %-10s %-12s %-20s\n"`.
fn pct_layout(vmid: &str, status: &str, lock: &str, name: &str) -> String {
    format!("{vmid:<10} {status:<10} {lock:<12} {name:<20}")
}

/// Parse the output of `pct list` into entries on `node` (the command sees only this node).
///
/// `pct list` prints nothing at all when there are no containers; otherwise a header
/// `VMID Status Lock Name` and one row per container, laid out by `"%-10s %-10s %-12s %-20s"`.
/// The Lock column is blank unless the container is locked, so a row has three or four words;
/// the name (a hostname, no whitespace) is always the last. A value longer than its column
/// (the `snapshot-delete` lock) pushes the rest of the row right, exactly as printf does. Every
/// row must match that layout character for character; the names are read and dropped.
pub fn parse_pct_list(text: &str, node: &str) -> Result<Vec<GuestEntry>, InventoryError> {
    let node: Arc<str> = Arc::from(node);
    let bad = |line: usize, detail: String| InventoryError::PctListInvalid { line, detail };
    let header = pct_layout("VMID", "Status", "Lock", "Name");
    let mut lines = table_lines(text);
    let Some((n, first)) = lines.next() else {
        return Ok(Vec::new());
    };
    if first.trim_end() != header.trim_end() {
        return Err(bad(
            n,
            format!("expected the header {:?}", header.trim_end()),
        ));
    }
    let mut out = Vec::new();
    for (n, line) in lines {
        let w = words(line);
        let (vmid, status, lock, name) = match w.as_slice() {
            [(_, v), (_, s), (_, nm)] => (*v, *s, "", *nm),
            [(_, v), (_, s), (_, l), (_, nm)] => (*v, *s, *l, *nm),
            _ => {
                return Err(bad(
                    n,
                    format!("expected 3 or 4 columns, found {}", w.len()),
                ))
            }
        };
        let Some(id) = parse_pmxcfs_vmid(vmid) else {
            return Err(bad(n, format!("{vmid:?} is not a vmid")));
        };
        if pct_layout(vmid, status, lock, name).trim_end() != line.trim_end() {
            return Err(bad(n, "the columns are not where pct puts them".into()));
        }
        out.push(GuestEntry {
            vmid: id,
            kind: GuestType::Lxc,
            node: Arc::clone(&node),
            version: None,
        });
    }
    Ok(out)
}

/// `qm list`'s line layout (qemu-server `qm.pm`): `"%10s %-20s %-10s %-10s %12s %-10s\n"`.
fn qm_layout(vmid: &str, name: &str, status: &str, mem: &str, disk: &str, pid: &str) -> String {
    format!("{vmid:>10} {name:<20} {status:<10} {mem:<10} {disk:>12} {pid:<10}")
}

fn is_perl_number(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-'))
        && s.parse::<f64>().is_ok()
}

fn is_fixed_2(s: &str) -> bool {
    match s.split_once('.') {
        Some((int, frac)) => {
            !int.is_empty()
                && int.bytes().all(|b| b.is_ascii_digit())
                && frac.len() == 2
                && frac.bytes().all(|b| b.is_ascii_digit())
        }
        None => false,
    }
}

/// Parse the output of `qm list` into entries on `node` (the command sees only this node).
///
/// `qm list` prints nothing when there are no virtual machines; otherwise a header
/// `VMID NAME STATUS MEM(MB) BOOTDISK(GB) PID` and one row per VM, laid out by
/// `"%10s %-20s %-10s %-10s %12.2f %-10s"`. The NAME may contain spaces (the default name is
/// `VM <vmid>`), so a row is read from both ends: the vmid first, then status, memory, boot
/// disk and pid from the right, and the name is what lies between. Every row must match that
/// layout character for character; the names are read and dropped.
pub fn parse_qm_list(text: &str, node: &str) -> Result<Vec<GuestEntry>, InventoryError> {
    let node: Arc<str> = Arc::from(node);
    let bad = |line: usize, detail: String| InventoryError::QmListInvalid { line, detail };
    let header = qm_layout("VMID", "NAME", "STATUS", "MEM(MB)", "BOOTDISK(GB)", "PID");
    let mut lines = table_lines(text);
    let Some((n, first)) = lines.next() else {
        return Ok(Vec::new());
    };
    if first.trim_end() != header.trim_end() {
        return Err(bad(
            n,
            format!("expected the header {:?}", header.trim_end()),
        ));
    }
    let mut out = Vec::new();
    for (n, line) in lines {
        let w = words(line);
        if w.len() < 6 {
            return Err(bad(n, format!("expected 6 columns, found {}", w.len())));
        }
        let k = w.len();
        let vmid = w[0].1;
        let (status_at, status) = w[k - 4];
        let (mem, disk, pid) = (w[k - 3].1, w[k - 2].1, w[k - 1].1);
        let name_at = w[1].0;
        let name = line
            .get(name_at..status_at)
            .map(str::trim_end)
            .unwrap_or_default();
        let Some(id) = parse_pmxcfs_vmid(vmid) else {
            return Err(bad(n, format!("{vmid:?} is not a vmid")));
        };
        if !is_perl_number(mem) {
            return Err(bad(n, format!("MEM(MB) {mem:?} is not a number")));
        }
        if !is_fixed_2(disk) {
            return Err(bad(n, format!("BOOTDISK(GB) {disk:?} is not a number")));
        }
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad(n, format!("PID {pid:?} is not a number")));
        }
        if qm_layout(vmid, name, status, mem, disk, pid).trim_end() != line.trim_end() {
            return Err(bad(n, "the columns are not where qm puts them".into()));
        }
        out.push(GuestEntry {
            vmid: id,
            kind: GuestType::Qemu,
            node: Arc::clone(&node),
            version: None,
        });
    }
    Ok(out)
}

/// The two local list commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListCommand {
    /// `pct list`.
    Pct,
    /// `qm list`.
    Qm,
}

impl ListCommand {
    /// The program name, looked up on `PATH`.
    pub fn program(self) -> &'static str {
        match self {
            Self::Pct => "pct",
            Self::Qm => "qm",
        }
    }

    /// The command line as messages show it.
    pub fn display(self) -> &'static str {
        match self {
            Self::Pct => "pct list",
            Self::Qm => "qm list",
        }
    }
}

/// Runs `pct list` / `qm list` and hands back their stdout. Tests feed text through a closure
/// `Fn(ListCommand) -> Result<String, InventoryError>`; the agent uses [`SystemListCommands`].
pub trait ListCommands {
    /// The stdout of the command, or [`InventoryError::CommandFailed`].
    fn run(&self, command: ListCommand) -> Result<String, InventoryError>;
}

impl<F> ListCommands for F
where
    F: Fn(ListCommand) -> Result<String, InventoryError>,
{
    fn run(&self, command: ListCommand) -> Result<String, InventoryError> {
        self(command)
    }
}

/// Spawns the real `pct list` / `qm list`, with a timeout.
#[derive(Debug, Clone)]
pub struct SystemListCommands {
    /// How long one command may run.
    pub timeout: Duration,
    /// The directory holding `pct` and `qm`; `None` looks them up on `PATH`.
    pub bin_dir: Option<PathBuf>,
}

impl Default for SystemListCommands {
    fn default() -> Self {
        Self {
            timeout: LIST_COMMAND_TIMEOUT,
            bin_dir: None,
        }
    }
}

fn read_bounded(reader: Option<impl Read>, max: u64) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    if let Some(r) = reader {
        r.take(max + 1).read_to_end(&mut buf)?;
    }
    Ok(buf)
}

fn excerpt(text: &str) -> String {
    let t = text.trim();
    let n = t.chars().count();
    if n > STDERR_EXCERPT_CHARS {
        let tail: String = t.chars().skip(n - STDERR_EXCERPT_CHARS).collect();
        format!("…{tail}")
    } else {
        t.to_owned()
    }
}

impl ListCommands for SystemListCommands {
    fn run(&self, command: ListCommand) -> Result<String, InventoryError> {
        let failed = |detail: String| InventoryError::CommandFailed {
            command: command.display(),
            detail,
        };
        let program = match &self.bin_dir {
            Some(dir) => dir.join(command.program()),
            None => PathBuf::from(command.program()),
        };
        let mut child = Command::new(&program)
            .arg("list")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| failed(format!("cannot start {}: {e}", program.display())))?;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let out_reader = thread::spawn(move || read_bounded(stdout, MAX_LIST_BYTES));
        let err_reader = thread::spawn(move || read_bounded(stderr, 64 * 1024));
        let deadline = Instant::now() + self.timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() >= deadline => {
                    // Our own child: end it, reap it, and leave the readers to finish when the
                    // pipes close.
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(failed(format!(
                        "no answer within {} s (is pmxcfs hanging?)",
                        self.timeout.as_secs()
                    )));
                }
                Ok(None) => thread::sleep(Duration::from_millis(5)),
                Err(e) => return Err(failed(format!("cannot wait for it: {e}"))),
            }
        };
        let joined = |h: thread::JoinHandle<io::Result<Vec<u8>>>| match h.join() {
            Ok(r) => r,
            Err(_) => Err(io::Error::other("output reader panicked")),
        };
        let out = joined(out_reader).map_err(|e| failed(format!("cannot read its output: {e}")))?;
        let err = joined(err_reader).unwrap_or_default();
        if !status.success() {
            return Err(failed(format!(
                "{status}: {}",
                excerpt(&String::from_utf8_lossy(&err))
            )));
        }
        if out.len() as u64 > MAX_LIST_BYTES {
            return Err(failed(format!(
                "it printed more than {MAX_LIST_BYTES} bytes"
            )));
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }
}

/// Read `.vmlist` fully into memory, within [`MAX_LIST_BYTES`].
fn read_vmlist_file(path: &Path) -> io::Result<Vec<u8>> {
    let file = File::open(path)?;
    let mut buf = Vec::new();
    file.take(MAX_LIST_BYTES + 1).read_to_end(&mut buf)?;
    Ok(buf)
}

/// Read the full guest list: `.vmlist` at `vmlist_path`, or, when that cannot be read at all
/// (missing, permission denied, any IO error), `pct list` + `qm list` through `commands`, whose
/// entries are put on `node`. The result's [`FullGuestList::source`] says which was used.
///
/// A `.vmlist` that was read but is not valid is an error, not a reason to fall back: a list
/// that cannot be trusted must not clear a vmid.
pub fn read_full_list(
    vmlist_path: &Path,
    node: &str,
    commands: &impl ListCommands,
) -> Result<FullGuestList, InventoryError> {
    match read_vmlist_file(vmlist_path) {
        Ok(bytes) => {
            if bytes.len() as u64 > MAX_LIST_BYTES {
                return Err(InventoryError::VmlistTooLarge {
                    path: vmlist_path.to_owned(),
                    max: MAX_LIST_BYTES,
                });
            }
            let entries = decode_vmlist(&bytes).map_err(|e| match e {
                InventoryError::VmlistSyntax { detail } => InventoryError::VmlistInvalid {
                    path: vmlist_path.to_owned(),
                    detail,
                },
                other => other,
            })?;
            FullGuestList::from_entries(
                ListSource::Vmlist {
                    path: vmlist_path.to_owned(),
                },
                entries,
            )
            .map_err(|e| match e {
                InventoryError::DuplicateVmid { vmid, .. } => InventoryError::VmlistInvalid {
                    path: vmlist_path.to_owned(),
                    detail: format!("vmid {vmid} is listed twice"),
                },
                other => other,
            })
        }
        Err(io_err) => {
            let vmlist_error = io_err.to_string();
            let run = |command: ListCommand| {
                commands.run(command).map_err(|e| {
                    let detail = match e {
                        InventoryError::CommandFailed { detail, .. } => detail,
                        other => other.to_string(),
                    };
                    InventoryError::NoGuestList {
                        vmlist_path: vmlist_path.to_owned(),
                        vmlist_error: vmlist_error.clone(),
                        command: command.display(),
                        detail,
                    }
                })
            };
            let cts = parse_pct_list(&run(ListCommand::Pct)?, node)?;
            let vms = parse_qm_list(&run(ListCommand::Qm)?, node)?;
            FullGuestList::from_entries(
                ListSource::LocalCommands {
                    node: node.to_owned(),
                    vmlist_path: vmlist_path.to_owned(),
                    vmlist_error,
                },
                cts.into_iter().chain(vms),
            )
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The pool view and the join

/// Whether a guest is in the fleet's pool (visible to the agent's token, and so to the hub) or
/// foreign. Only a pool guest can carry a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Membership {
    /// In the pool: the API showed it to the token.
    Pool {
        /// The guest's name as the API gave it.
        name: Option<String>,
        /// The guest's status as the API gave it (`running`, `stopped`, `unknown`, ...).
        status: Option<String>,
    },
    /// Not visible to the token. Its name stays on this node.
    Foreign,
}

/// One guest row of the token's `GET /cluster/resources?type=vm`, as the caller maps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceRow {
    /// `vmid`.
    pub vmid: u32,
    /// `type` (`lxc` / `qemu`).
    pub kind: GuestType,
    /// `node`.
    pub node: String,
    /// `name`, when present.
    pub name: Option<String>,
    /// `status`, when present.
    pub status: Option<String>,
    /// `pool`, when present (PVE removes it without `Pool.Audit` on that pool).
    pub pool: Option<String>,
}

/// One pool guest as the token sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolGuest {
    /// The vmid.
    pub vmid: u32,
    /// Container or virtual machine.
    pub kind: GuestType,
    /// The node it is on.
    pub node: String,
    /// Its name, when the API gave one.
    pub name: Option<String>,
    /// Its status, when the API gave one.
    pub status: Option<String>,
}

/// The guests of the fleet's pool, as the pool-scoped token sees them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolView {
    guests: BTreeMap<u32, PoolGuest>,
    outside_pool: BTreeSet<u32>,
}

impl PoolView {
    /// The pool view from the token's cluster resources. A row counts as a pool guest only when
    /// its `pool` is `pool`. Rows the token can see that are not in the pool (a token with more
    /// rights than it should have, or without `Pool.Audit`, which hides the `pool` field) are
    /// treated as foreign: their names are dropped here, only their vmids are kept
    /// ([`PoolView::outside_pool`]) so `doctor` can warn.
    pub fn from_resources(pool: &str, rows: impl IntoIterator<Item = ResourceRow>) -> Self {
        let mut view = Self::default();
        for row in rows {
            if row.pool.as_deref() == Some(pool) {
                view.guests.insert(
                    row.vmid,
                    PoolGuest {
                        vmid: row.vmid,
                        kind: row.kind,
                        node: row.node,
                        name: row.name,
                        status: row.status,
                    },
                );
            } else {
                view.outside_pool.insert(row.vmid);
            }
        }
        for vmid in view.guests.keys() {
            view.outside_pool.remove(vmid);
        }
        view
    }

    /// The pool guest at `vmid`, if any.
    pub fn get(&self, vmid: u32) -> Option<&PoolGuest> {
        self.guests.get(&vmid)
    }

    /// Every pool guest, by ascending vmid.
    pub fn guests(&self) -> impl Iterator<Item = &PoolGuest> {
        self.guests.values()
    }

    /// The vmids the token could see that are not in the pool.
    pub fn outside_pool(&self) -> impl Iterator<Item = u32> + '_ {
        self.outside_pool.iter().copied()
    }
}

/// One guest of the joined inventory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InventoryRow {
    /// The vmid.
    pub vmid: u32,
    /// Container or virtual machine.
    pub kind: GuestType,
    /// The node it is on.
    pub node: String,
    /// Pool guest (with its name) or foreign (without).
    pub membership: Membership,
    /// False for a pool guest the full list did not have (see [`join`]).
    pub in_full_list: bool,
}

impl InventoryRow {
    /// True for a pool guest.
    pub fn in_pool(&self) -> bool {
        matches!(self.membership, Membership::Pool { .. })
    }

    /// The guest as the vmid policy sees it.
    pub fn holder(&self) -> Holder {
        Holder {
            kind: self.kind,
            node: self.node.clone(),
            membership: self.membership.clone(),
        }
    }
}

/// The full guest list joined with the pool view: every vmid that is taken, and by whom.
///
/// It borrows both sides and builds rows only when asked, so a vmid check against a
/// 100,000-guest list costs two lookups, not a copy of the list.
#[derive(Debug, Clone, Copy)]
pub struct Inventory<'a> {
    full: &'a FullGuestList,
    pool: &'a PoolView,
}

/// Join the full guest list with the pool view.
///
/// Every guest of the full list is a row, `in_pool` when the pool view has its vmid (kind and
/// node come from the full list, which is read locally; the name from the pool view). A pool
/// guest that the full list does not have (created after the list was read, or on another node
/// when the list came from the local commands) is a row too, from the pool view, with
/// `in_full_list: false`: a vmid that either source shows as taken is taken.
pub fn join<'a>(full: &'a FullGuestList, pool: &'a PoolView) -> Inventory<'a> {
    Inventory { full, pool }
}

fn pool_membership(g: &PoolGuest) -> Membership {
    Membership::Pool {
        name: g.name.clone(),
        status: g.status.clone(),
    }
}

impl Inventory<'_> {
    /// Where the full guest list came from.
    pub fn source(&self) -> &ListSource {
        self.full.source()
    }

    fn full_row(&self, e: &GuestEntry) -> InventoryRow {
        InventoryRow {
            vmid: e.vmid,
            kind: e.kind,
            node: e.node.to_string(),
            membership: self
                .pool
                .get(e.vmid)
                .map_or(Membership::Foreign, pool_membership),
            in_full_list: true,
        }
    }

    fn pool_only_row(g: &PoolGuest) -> InventoryRow {
        InventoryRow {
            vmid: g.vmid,
            kind: g.kind,
            node: g.node.clone(),
            membership: pool_membership(g),
            in_full_list: false,
        }
    }

    /// The row at `vmid`, if any guest holds it.
    pub fn get(&self, vmid: u32) -> Option<InventoryRow> {
        match self.full.lookup(vmid) {
            Some(e) => Some(self.full_row(e)),
            None => self.pool.get(vmid).map(Self::pool_only_row),
        }
    }

    /// Every row, by ascending vmid.
    pub fn rows(&self) -> Vec<InventoryRow> {
        let mut rows: Vec<InventoryRow> = self.full.entries().map(|e| self.full_row(e)).collect();
        let before = rows.len();
        rows.extend(
            self.pool
                .guests()
                .filter(|g| !self.full.contains(g.vmid))
                .map(Self::pool_only_row),
        );
        if rows.len() > before {
            rows.sort_by_key(|r| r.vmid);
        }
        rows
    }

    /// The document `felhom-agent guests --json` prints (shown on this node only).
    pub fn guests_report(&self) -> GuestsReport {
        let source = self.source();
        GuestsReport {
            guests: self
                .rows()
                .into_iter()
                .map(|r| GuestsReportRow {
                    vmid: r.vmid,
                    kind: r.kind,
                    in_pool: r.in_pool(),
                    in_full_list: r.in_full_list,
                    name: match r.membership {
                        Membership::Pool { name, .. } => name,
                        Membership::Foreign => None,
                    },
                    node: r.node,
                })
                .collect(),
            source: source.kind_str(),
            cluster_wide: source.cluster_wide(),
            source_description: source.describe(),
        }
    }

    /// The form meant for the hub: pool guests with their names, foreign guests as bare vmids.
    pub fn hub_inventory(&self) -> HubInventory {
        let mut pool_guests = Vec::new();
        let mut foreign_vmids = Vec::new();
        for r in self.rows() {
            match r.membership {
                Membership::Pool { name, status } => pool_guests.push(HubPoolGuest {
                    vmid: r.vmid,
                    kind: r.kind,
                    node: r.node,
                    name,
                    status,
                }),
                Membership::Foreign => foreign_vmids.push(r.vmid),
            }
        }
        HubInventory {
            pool_guests,
            foreign_vmids,
            cluster_wide: self.source().cluster_wide(),
        }
    }
}

impl GuestLookup for Inventory<'_> {
    fn holder(&self, vmid: u32) -> Option<Holder> {
        self.get(vmid).map(|r| r.holder())
    }

    fn is_held(&self, vmid: u32) -> bool {
        self.full.contains(vmid) || self.pool.get(vmid).is_some()
    }
}

/// One guest of `guests --json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GuestsReportRow {
    /// The vmid.
    pub vmid: u32,
    /// `lxc`, `qemu` or `openvz`.
    #[serde(rename = "type")]
    pub kind: GuestType,
    /// The node it is on.
    pub node: String,
    /// True for a pool guest (visible to the hub), false for a foreign one.
    pub in_pool: bool,
    /// False for a pool guest the full list did not have yet.
    pub in_full_list: bool,
    /// The name, for pool guests only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// The document `felhom-agent guests --json` prints:
/// `{"guests": [{"vmid", "type", "node", "in_pool", "in_full_list", "name"?}], "source":
/// "vmlist|local_commands", "cluster_wide": bool, "source_description": "…"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GuestsReport {
    /// Every guest, by ascending vmid.
    pub guests: Vec<GuestsReportRow>,
    /// `vmlist` or `local_commands`.
    pub source: &'static str,
    /// False when the list came from `pct list` + `qm list` (this node only).
    pub cluster_wide: bool,
    /// The source in words, for the operator.
    pub source_description: String,
}

/// A pool guest as the hub may see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HubPoolGuest {
    /// The vmid.
    pub vmid: u32,
    /// `lxc` or `qemu`.
    #[serde(rename = "type")]
    pub kind: GuestType,
    /// The node it is on.
    pub node: String,
    /// Its name.
    pub name: Option<String>,
    /// Its status.
    pub status: Option<String>,
}

/// The inventory as the hub may see it: pool guests in full, and the vmids held by foreign
/// guests with nothing else about them. Built only by [`Inventory::hub_inventory`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HubInventory {
    /// The pool guests, by ascending vmid.
    pub pool_guests: Vec<HubPoolGuest>,
    /// The vmids held by guests outside the pool, ascending.
    pub foreign_vmids: Vec<u32>,
    /// False when the full list saw only this node.
    pub cluster_wide: bool,
}

// ---------------------------------------------------------------------------------------------
// datacenter.cfg next-id lint

/// The `next-id` value of `datacenter.cfg` text: `Ok(None)` when there is no such line,
/// `Err` with what is wrong when the line cannot be read.
fn parse_next_id(text: &str) -> Result<Option<(u64, u64)>, String> {
    let mut found = None;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        if key.trim() != "next-id" {
            continue;
        }
        let (mut lower, mut upper) = (DEFAULT_NEXT_ID_LOWER, DEFAULT_NEXT_ID_UPPER);
        for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}` is not key=value"))?;
            let n: u64 = v
                .trim()
                .parse()
                .map_err(|_| format!("`{}` is not a whole number", v.trim()))?;
            match k.trim() {
                "lower" => lower = n,
                "upper" => upper = n,
                other => return Err(format!("unknown key `{other}`")),
            }
        }
        found = Some((lower, upper));
    }
    Ok(found)
}

/// A warning when `datacenter.cfg` (its text, and the path it was read from) lets PVE hand
/// out automatic vmids (`GET /cluster/nextid`, the web UI's default) that are reserved
/// fleet-wide: 9999 or the restore-test band. `None` when the range leaves both out.
///
/// `next-id: lower=N,upper=M` sets the range `[N, M)`; without the line (pass `""` when the
/// file does not exist) PVE uses `[100, 1000000)`, which includes both, so that warns too.
/// The suggested fix, `next-id: lower=10000,upper=990000`, excludes both.
pub fn next_id_lint(path: &Path, text: &str) -> Option<String> {
    let path = path.display();
    let (lower, upper, which) = match parse_next_id(text) {
        Err(detail) => {
            return Some(format!(
                "{path}: the next-id line cannot be read ({detail}); PVE expects \
                 `next-id: lower=N,upper=M`; set `{SUGGESTED_NEXT_ID}` so that automatic \
                 vmids leave out 9999 and the restore-test band"
            ))
        }
        Ok(Some((lower, upper))) => (lower, upper, format!("sets next-id [{lower}, {upper})")),
        Ok(None) => (
            DEFAULT_NEXT_ID_LOWER,
            DEFAULT_NEXT_ID_UPPER,
            format!(
                "sets no next-id range, so PVE's default [{DEFAULT_NEXT_ID_LOWER}, \
                 {DEFAULT_NEXT_ID_UPPER}) applies"
            ),
        ),
    };
    let in_range = |v: u32| lower <= u64::from(v) && u64::from(v) < upper;
    let mut hits = Vec::new();
    if in_range(SELFTEST_SCRATCH_VMID) {
        hits.push(format!("{SELFTEST_SCRATCH_VMID} (selftest scratch)"));
    }
    let band_lo = u64::from(*RESTORE_TEST_BAND.start());
    let band_hi = u64::from(*RESTORE_TEST_BAND.end());
    if lower <= band_hi && upper > band_lo {
        hits.push(format!("{band_lo}-{band_hi} (restore-test band)",));
    }
    if hits.is_empty() {
        return None;
    }
    Some(format!(
        "{path} {which}, which includes {}: guests created with an automatic vmid (web UI, \
         `pvesh get /cluster/nextid`) can land on vmids reserved fleet-wide; set \
         `{SUGGESTED_NEXT_ID}` in {path}",
        hits.join(" and ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmid::{check, VmidVerdict};

    const VMLIST_MULTI: &str = "{\n\"version\": 17,\n\"ids\": {\n\"100\": { \"node\": \"pve1\", \"type\": \"qemu\", \"version\": 5 },\n\"101\": { \"node\": \"pve2\", \"type\": \"lxc\", \"version\": 9 }}\n\n}\n";
    const VMLIST_EMPTY: &str = "{\n\"version\": 3\n\n}\n";

    const PCT_LIST: &str = "\
VMID       Status     Lock         Name                
101        running                 web                 
102        stopped    backup       db                  
103        stopped    snapshot-delete longhostname-for-a-container
";

    const QM_LIST: &str =
        "      VMID NAME                 STATUS     MEM(MB)    BOOTDISK(GB) PID       
       100 gw                   running    2048              32.00 4711      
       105 VM 105               stopped    512                0.00 0         
       110 a-very-long-vm-name-over-twenty running    476.837158203125         8.00 99        
";

    fn entry(vmid: u32, kind: GuestType, node: &str, version: Option<u64>) -> GuestEntry {
        GuestEntry {
            vmid,
            kind,
            node: node.into(),
            version,
        }
    }

    fn no_commands(_: ListCommand) -> Result<String, InventoryError> {
        Err(InventoryError::CommandFailed {
            command: "test",
            detail: "must not run".into(),
        })
    }

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

    #[test]
    fn pct_list_sample_with_lock_column() {
        let got = parse_pct_list(PCT_LIST, "pve1").unwrap();
        assert_eq!(
            got,
            vec![
                entry(101, GuestType::Lxc, "pve1", None),
                entry(102, GuestType::Lxc, "pve1", None),
                entry(103, GuestType::Lxc, "pve1", None),
            ]
        );
    }

    #[test]
    fn pct_and_qm_print_nothing_when_empty() {
        assert_eq!(parse_pct_list("", "pve1").unwrap(), vec![]);
        assert_eq!(parse_qm_list("", "pve1").unwrap(), vec![]);
        // A header with no rows is not what they print, but it means no guests either.
        let header = "VMID       Status     Lock         Name                \n";
        assert_eq!(parse_pct_list(header, "pve1").unwrap(), vec![]);
    }

    #[test]
    fn pct_list_rejects_what_pct_does_not_print() {
        let cases: &[(&str, usize, &str)] = &[
            ("101        running                 web\n", 1, "header"),
            // Whitespace splitting would take "backup" for the name here; the layout check does not.
            (
                "VMID       Status     Lock         Name\n101        running    backup\n",
                2,
                "columns",
            ),
            (
                "VMID       Status     Lock         Name\n101 running web\n",
                2,
                "columns",
            ),
            (
                "VMID       Status     Lock         Name\n0101       running                 web\n",
                2,
                "not a vmid",
            ),
            (
                "VMID       Status     Lock         Name\n101        running    backup       db extra\n",
                2,
                "3 or 4 columns",
            ),
            ("VMID       Status     Lock         Name\n101\n", 2, "3 or 4"),
        ];
        for (text, line, want) in cases {
            match parse_pct_list(text, "pve1") {
                Err(InventoryError::PctListInvalid { line: l, detail }) => {
                    assert_eq!(l, *line, "{text:?}");
                    assert!(detail.contains(want), "{text:?}: {detail}");
                }
                other => panic!("{text:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn qm_list_sample_with_spaces_in_names() {
        let got = parse_qm_list(QM_LIST, "pve1").unwrap();
        assert_eq!(
            got,
            vec![
                entry(100, GuestType::Qemu, "pve1", None),
                entry(105, GuestType::Qemu, "pve1", None),
                entry(110, GuestType::Qemu, "pve1", None),
            ]
        );
    }

    #[test]
    fn qm_list_rejects_what_qm_does_not_print() {
        let header =
            "      VMID NAME                 STATUS     MEM(MB)    BOOTDISK(GB) PID       \n";
        let cases: Vec<(String, usize, &str)> = vec![
            ("VMID NAME STATUS\n".into(), 1, "header"),
            (format!("{header}       100 gw running\n"), 2, "6 columns"),
            (
                format!("{header}100 gw                   running    2048              32.00 4711\n"),
                2,
                "columns",
            ),
            (
                format!("{header}       100 gw                   running    2048              32 4711\n"),
                2,
                "BOOTDISK",
            ),
            (
                format!("{header}       100 gw                   running    lots              32.00 4711\n"),
                2,
                "MEM",
            ),
            (
                format!("{header}       100 gw                   running    2048              32.00 x\n"),
                2,
                "PID",
            ),
            (
                format!("{header}        -1 gw                   running    2048              32.00 0\n"),
                2,
                "not a vmid",
            ),
        ];
        for (text, line, want) in &cases {
            match parse_qm_list(text, "pve1") {
                Err(InventoryError::QmListInvalid { line: l, detail }) => {
                    assert_eq!(l, *line, "{text:?}");
                    assert!(detail.contains(want), "{text:?}: {detail}");
                }
                other => panic!("{text:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn read_full_list_prefers_vmlist() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".vmlist");
        std::fs::write(&path, VMLIST_MULTI).unwrap();
        let list = read_full_list(&path, "pve1", &no_commands).unwrap();
        assert_eq!(list.source(), &ListSource::Vmlist { path: path.clone() });
        assert!(list.source().cluster_wide());
        assert_eq!(list.len(), 2);
        assert_eq!(list.lookup(101).map(|e| &*e.node), Some("pve2"));
        assert!(list.lookup(102).is_none());
    }

    #[test]
    fn corrupt_vmlist_is_an_error_not_a_fallback() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".vmlist");
        std::fs::write(&path, "{\"ids\": {}}").unwrap();
        let err = read_full_list(
            &path,
            "pve1",
            &|_: ListCommand| -> Result<String, InventoryError> { panic!("fallback must not run") },
        )
        .unwrap_err();
        assert!(
            matches!(err, InventoryError::VmlistInvalid { .. }),
            "{err:?}"
        );
        assert_eq!(err.code(), ErrorCode::ConfigInvalid);
        assert!(err.to_string().contains(&path.display().to_string()));
    }

    #[test]
    fn missing_vmlist_falls_back_to_local_commands() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing.vmlist");
        let commands = |c: ListCommand| -> Result<String, InventoryError> {
            Ok(match c {
                ListCommand::Pct => PCT_LIST.to_owned(),
                ListCommand::Qm => QM_LIST.to_owned(),
            })
        };
        let list = read_full_list(&path, "pve7", &commands).unwrap();
        assert!(!list.source().cluster_wide());
        assert_eq!(list.source().kind_str(), "local_commands");
        assert!(list.source().describe().contains("only this node"));
        let vmids: Vec<u32> = list.entries().map(|e| e.vmid).collect();
        assert_eq!(vmids, vec![100, 101, 102, 103, 105, 110]);
        assert!(list.entries().all(|e| &*e.node == "pve7"));
        assert_eq!(list.lookup(101).map(|e| e.kind), Some(GuestType::Lxc));
        assert_eq!(list.lookup(105).map(|e| e.kind), Some(GuestType::Qemu));
    }

    #[test]
    fn unreadable_vmlist_falls_back_too() {
        // A directory cannot be read as a file: an IO error other than "not found".
        let dir = tempfile::tempdir().unwrap();
        let commands = |_: ListCommand| -> Result<String, InventoryError> { Ok(String::new()) };
        let list = read_full_list(dir.path(), "pve1", &commands).unwrap();
        assert!(list.is_empty());
        assert!(matches!(list.source(), ListSource::LocalCommands { .. }));
    }

    #[test]
    fn no_vmlist_and_no_commands_is_an_error_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing.vmlist");
        let err = read_full_list(&path, "pve1", &no_commands).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("missing.vmlist"), "{text}");
        assert!(text.contains("`pct list` failed"), "{text}");
        assert_eq!(err.code(), ErrorCode::PveUnreachable);
    }

    #[test]
    fn same_vmid_from_pct_and_qm_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing.vmlist");
        let commands = |c: ListCommand| -> Result<String, InventoryError> {
            Ok(match c {
                ListCommand::Pct => PCT_LIST.to_owned(),
                ListCommand::Qm => "      VMID NAME                 STATUS     MEM(MB)    BOOTDISK(GB) PID       \n       101 x                    stopped    0                  0.00 0         \n".to_owned(),
            })
        };
        let err = read_full_list(&path, "pve1", &commands).unwrap_err();
        assert!(
            matches!(err, InventoryError::DuplicateVmid { vmid: 101, .. }),
            "{err:?}"
        );
    }

    fn script(dir: &Path, name: &str, body: &str) {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    fn commands_in(dir: &Path, timeout: Duration) -> SystemListCommands {
        SystemListCommands {
            timeout,
            bin_dir: Some(dir.to_owned()),
        }
    }

    #[test]
    fn system_commands_run_real_processes() {
        let dir = tempfile::tempdir().unwrap();
        script(
            dir.path(),
            "pct",
            "[ \"$1\" = list ] || exit 9\nprintf '%-10s %-10s %-12s %-20s\\n' VMID Status Lock Name 101 running '' web",
        );
        script(dir.path(), "qm", "exit 0");
        let commands = commands_in(dir.path(), Duration::from_secs(10));
        let out = commands.run(ListCommand::Pct).unwrap();
        assert_eq!(parse_pct_list(&out, "pve1").unwrap().len(), 1);
        assert_eq!(commands.run(ListCommand::Qm).unwrap(), "");

        let missing = dir.path().join("missing.vmlist");
        let list = read_full_list(&missing, "pve1", &commands).unwrap();
        assert_eq!(list.lookup(101).map(|e| e.kind), Some(GuestType::Lxc));
    }

    #[test]
    fn system_commands_report_failure_missing_program_and_timeout() {
        let dir = tempfile::tempdir().unwrap();
        script(
            dir.path(),
            "pct",
            "echo 'ipcc_send_rec[1] failed: Connection refused' >&2\nexit 2",
        );
        script(dir.path(), "qm", "exec sleep 5");
        let commands = commands_in(dir.path(), Duration::from_millis(300));

        let err = commands.run(ListCommand::Pct).unwrap_err().to_string();
        assert!(err.contains("`pct list` failed"), "{err}");
        assert!(
            err.contains("ipcc_send_rec[1] failed: Connection refused"),
            "{err}"
        );

        let started = Instant::now();
        let err = commands.run(ListCommand::Qm).unwrap_err().to_string();
        assert!(err.contains("no answer within"), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{:?}",
            started.elapsed()
        );

        let empty = tempfile::tempdir().unwrap();
        let err = commands_in(empty.path(), Duration::from_secs(1))
            .run(ListCommand::Pct)
            .unwrap_err();
        assert!(
            matches!(&err, InventoryError::CommandFailed { command: "pct list", detail } if detail.contains("cannot start")),
            "{err:?}"
        );
    }

    fn row(vmid: u32, kind: GuestType, node: &str, name: &str, pool: Option<&str>) -> ResourceRow {
        ResourceRow {
            vmid,
            kind,
            node: node.into(),
            name: Some(name.into()),
            status: Some("running".into()),
            pool: pool.map(str::to_owned),
        }
    }

    fn sample_parts() -> (FullGuestList, PoolView) {
        let full = FullGuestList::from_entries(
            ListSource::Vmlist {
                path: DEFAULT_VMLIST_PATH.into(),
            },
            vec![
                entry(101, GuestType::Lxc, "pve2", Some(1)),
                entry(120, GuestType::Lxc, "pve1", Some(1)),
                entry(300, GuestType::Qemu, "pve3", Some(1)),
            ],
        )
        .unwrap();
        let pool = PoolView::from_resources(
            "felhom",
            vec![
                row(120, GuestType::Lxc, "pve1", "web", Some("felhom")),
                // Created after the list was read.
                row(121, GuestType::Qemu, "pve1", "new", Some("felhom")),
                // Visible to the token but in another pool: foreign, name dropped.
                row(300, GuestType::Qemu, "pve3", "secret-name", Some("other")),
            ],
        );
        (full, pool)
    }

    #[test]
    fn join_marks_pool_and_foreign_and_adds_late_pool_guests() {
        let (full, pool) = sample_parts();
        let inv = join(&full, &pool);
        let rows: Vec<(u32, bool, bool)> = inv
            .rows()
            .iter()
            .map(|r| (r.vmid, r.in_pool(), r.in_full_list))
            .collect();
        assert_eq!(
            rows,
            vec![
                (101, false, true),
                (120, true, true),
                (121, true, false),
                (300, false, true)
            ]
        );
        assert_eq!(
            inv.get(120).map(|r| r.membership),
            Some(Membership::Pool {
                name: Some("web".into()),
                status: Some("running".into())
            })
        );
        assert_eq!(
            inv.get(300).map(|r| r.membership),
            Some(Membership::Foreign)
        );
        assert_eq!(inv.get(121).map(|r| r.node), Some("pve1".to_owned()));
        assert_eq!(inv.get(122), None);
    }

    #[test]
    fn verdicts_against_the_joined_inventory() {
        let (full, pool) = sample_parts();
        let inv = join(&full, &pool);
        // In .vmlist, invisible to the token: in use and foreign.
        match check("101", &inv) {
            VmidVerdict::InUse { holder, .. } => {
                assert!(holder.foreign());
                assert_eq!(holder.node, "pve2");
            }
            other => panic!("{other:?}"),
        }
        // A pool guest: in use, not foreign.
        match check("120", &inv) {
            VmidVerdict::InUse { holder, .. } => assert!(!holder.foreign()),
            other => panic!("{other:?}"),
        }
        // A pool guest the full list had not seen yet: still in use.
        assert!(matches!(check("121", &inv), VmidVerdict::InUse { .. }));
        assert!(check("122", &inv).is_free());
        // The name of a guest outside the pool never reaches a message.
        assert!(!check("300", &inv).message().contains("secret-name"));
    }

    #[test]
    fn guests_report_json() {
        let (full, pool) = sample_parts();
        let json = serde_json::to_value(join(&full, &pool).guests_report()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "guests": [
                    {"vmid": 101, "type": "lxc", "node": "pve2", "in_pool": false, "in_full_list": true},
                    {"vmid": 120, "type": "lxc", "node": "pve1", "in_pool": true, "in_full_list": true, "name": "web"},
                    {"vmid": 121, "type": "qemu", "node": "pve1", "in_pool": true, "in_full_list": false, "name": "new"},
                    {"vmid": 300, "type": "qemu", "node": "pve3", "in_pool": false, "in_full_list": true}
                ],
                "source": "vmlist",
                "cluster_wide": true,
                "source_description": "/etc/pve/.vmlist (cluster-wide)"
            })
        );
    }

    #[test]
    fn hub_inventory_carries_no_foreign_detail() {
        let (full, pool) = sample_parts();
        let hub = join(&full, &pool).hub_inventory();
        assert_eq!(hub.foreign_vmids, vec![101, 300]);
        assert_eq!(
            hub.pool_guests.iter().map(|g| g.vmid).collect::<Vec<_>>(),
            vec![120, 121]
        );
        let text = serde_json::to_string(&hub).unwrap();
        assert!(!text.contains("secret-name"), "{text}");
        assert!(
            !text.contains("pve2"),
            "a foreign guest's node leaked: {text}"
        );
    }

    #[test]
    fn pool_view_drops_rows_outside_the_pool() {
        let view = PoolView::from_resources(
            "felhom",
            vec![
                row(120, GuestType::Lxc, "pve1", "web", Some("felhom")),
                row(130, GuestType::Lxc, "pve1", "x", None),
                row(140, GuestType::Lxc, "pve1", "y", Some("other")),
            ],
        );
        assert_eq!(view.guests().map(|g| g.vmid).collect::<Vec<_>>(), vec![120]);
        assert_eq!(view.outside_pool().collect::<Vec<_>>(), vec![130, 140]);
    }

    #[test]
    fn next_id_lint_table() {
        let p = Path::new("/etc/pve/datacenter.cfg");
        let warns = |text: &str| next_id_lint(p, text);
        // No line: PVE's default range includes both.
        let w = warns("keyboard: en-us\n").unwrap();
        assert!(w.contains("sets no next-id range"), "{w}");
        assert!(
            w.contains("9999 (selftest scratch) and 990000-990009"),
            "{w}"
        );
        assert!(w.contains("next-id: lower=10000,upper=990000"), "{w}");
        assert!(w.contains("/etc/pve/datacenter.cfg"), "{w}");
        assert!(warns("").is_some());
        // The suggested range is clean, and so are ranges below 9999 or above the band.
        assert_eq!(warns("next-id: lower=10000,upper=990000\n"), None);
        assert_eq!(warns("next-id: lower=100,upper=9999\n"), None);
        assert_eq!(warns("next-id: lower=990010\n"), None);
        // upper is exclusive: [10000, 990001) reaches 990000.
        let w = warns("next-id: lower=10000,upper=990001\n").unwrap();
        assert!(w.contains("990000-990009") && !w.contains("9999 ("), "{w}");
        let w = warns("next-id: upper=10000\n").unwrap();
        assert!(
            w.contains("9999 (selftest scratch)") && !w.contains("990000-"),
            "{w}"
        );
        assert!(w.contains("[100, 10000)"), "{w}");
        // A commented-out line does not count.
        assert!(warns("# next-id: lower=10000,upper=990000\n")
            .unwrap()
            .contains("sets no next-id range"));
        // An unreadable line is a warning naming the file.
        let w = warns("next-id: lower=abc\n").unwrap();
        assert!(
            w.contains("cannot be read") && w.contains("datacenter.cfg"),
            "{w}"
        );
        assert!(warns("next-id: middle=5\n")
            .unwrap()
            .contains("unknown key"));
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
        fn parsers_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..300)) {
            let _ = parse_vmlist(&bytes);
            let text = String::from_utf8_lossy(&bytes);
            let _ = parse_pct_list(&text, "pve1");
            let _ = parse_qm_list(&text, "pve1");
        }

        #[test]
        fn pct_rows_round_trip(
            rows in proptest::collection::btree_map(
                100u32..1_000_000,
                ("(running|stopped)", "(|backup|create|snapshot-delete|mounted)", "[a-z][a-z0-9-]{0,30}"),
                0..20,
            )
        ) {
            let mut text = String::new();
            if !rows.is_empty() {
                text.push_str(&pct_layout("VMID", "Status", "Lock", "Name"));
                text.push('\n');
            }
            for (vmid, (status, lock, name)) in &rows {
                text.push_str(&pct_layout(&vmid.to_string(), status, lock, name));
                text.push('\n');
            }
            let got: Vec<u32> = parse_pct_list(&text, "n").unwrap().iter().map(|e| e.vmid).collect();
            proptest::prop_assert_eq!(got, rows.keys().copied().collect::<Vec<_>>());
        }

        #[test]
        fn qm_rows_round_trip(
            rows in proptest::collection::btree_map(
                100u32..1_000_000,
                (proptest::option::of("[a-z][a-z0-9-]{0,30}"), "(running|stopped|paused)", 0u64..1_000_000, 0u32..100_000),
                0..20,
            )
        ) {
            let mut text = String::new();
            if !rows.is_empty() {
                text.push_str(&qm_layout("VMID", "NAME", "STATUS", "MEM(MB)", "BOOTDISK(GB)", "PID"));
                text.push('\n');
            }
            for (vmid, (name, status, mem, pid)) in &rows {
                let name = name.clone().unwrap_or_else(|| format!("VM {vmid}"));
                let disk = format!("{:.2}", f64::from(*pid) / 7.0);
                text.push_str(&qm_layout(&vmid.to_string(), &name, status, &mem.to_string(), &disk, &pid.to_string()));
                text.push('\n');
            }
            let got: Vec<u32> = parse_qm_list(&text, "n").unwrap().iter().map(|e| e.vmid).collect();
            proptest::prop_assert_eq!(got, rows.keys().copied().collect::<Vec<_>>());
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
