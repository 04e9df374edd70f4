//! Pure vmid policy: range, format, reserved bands and collisions → a [`VmidVerdict`].
//!
//! This module owns the answer to "may a guest be provisioned at this vmid?". It does no IO:
//! the caller hands it the operator's input and a [`GuestLookup`] built from the node's full
//! guest list (see [`crate::inventory`]).
//!
//! It never suggests another vmid (DESIGN rule 3): a refusal tells the operator what is wrong
//! and where to look, never which number to take instead. The only vmid this module ever picks
//! is one inside the restore-test band, for the self-restore-test ([`restore_band_pick`]).
//!
//! The order of the checks is fixed and every input gets exactly one verdict:
//! 1. [`VmidVerdict::Invalid`]: not in PVE's vmid format (`^[1-9][0-9]{2,8}$`, which is the
//!    same as the range 100..=999999999 written without leading zeros, signs or spaces);
//! 2. [`VmidVerdict::Reserved`]: 9999 or 990000..=990009. A reserved vmid is refused for every
//!    provision whether or not a guest sits there, so this check comes before the collision
//!    check; when a guest does sit there, the verdict carries it as well so the message can
//!    say so;
//! 3. [`VmidVerdict::InUse`]: a guest holds the vmid (type, node, pool or foreign);
//! 4. [`VmidVerdict::Free`].
//!
//! It also checks the `next-id` range of `/etc/pve/datacenter.cfg` against the reserved vmids
//! ([`next_id_lint`]); the caller reads the file and hands its text in.
//!
//! It may use the types of [`crate::inventory`] ([`Holder`] and [`GuestLookup`] live there and
//! are re-exported here); `inventory` never uses this module.

use std::fmt;
use std::ops::RangeInclusive;
use std::path::Path;

use serde::Serialize;

use crate::error::{ErrorCode, Failure};
use crate::inventory::{GuestType, ListSource, Membership};

/// The guest holding a vmid and the lookup that finds it live with the inventory they are built
/// from; they are re-exported here because the policy is written in their terms.
pub use crate::inventory::{GuestLookup, Holder};

/// The smallest vmid PVE accepts (`pve-vmid` minimum).
pub const VMID_MIN: u32 = 100;

/// The largest vmid PVE accepts (`pve-vmid` maximum).
pub const VMID_MAX: u32 = 999_999_999;

/// The standing selftest scratch vmid. Reserved fleet-wide: on every node of every cluster of
/// the fleet, no provision may use it.
pub const SELFTEST_SCRATCH_VMID: u32 = 9999;

/// The restore-test scratch band. Reserved fleet-wide: no provision may use these vmids; the
/// self-restore-test restores into the first of them that is free ([`restore_band_pick`]).
pub const RESTORE_TEST_BAND: RangeInclusive<u32> = 990_000..=990_009;

/// The command an operator runs to see which vmids are taken; refusals point at it.
const GUESTS_COMMAND: &str = "felhom-agent guests";

/// The longest part of an operator's input that a message repeats.
const SHOWN_INPUT_MAX_CHARS: usize = 32;

/// Why an input is not a vmid in PVE's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InvalidReason {
    /// Nothing was given.
    Empty,
    /// The input contains whitespace (also leading or trailing).
    Whitespace,
    /// The input starts with `+` or `-`.
    Sign,
    /// The input contains a character other than the digits 0-9.
    NotDigits,
    /// The input starts with `0` (this includes `0` itself).
    LeadingZero,
    /// Fewer than 3 digits: below 100.
    TooShort,
    /// More than 9 digits: above 999999999.
    TooLong,
}

impl fmt::Display for InvalidReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Empty => "it is empty",
            Self::Whitespace => "it contains whitespace",
            Self::Sign => "it starts with a sign",
            Self::NotDigits => "it contains characters other than the digits 0-9",
            Self::LeadingZero => "it starts with a zero",
            Self::TooShort => "it has fewer than 3 digits (the smallest vmid is 100)",
            Self::TooLong => "it has more than 9 digits (the largest vmid is 999999999)",
        })
    }
}

/// A fleet-wide reserved vmid band.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReservedBand {
    /// [`SELFTEST_SCRATCH_VMID`] (9999).
    SelftestScratch,
    /// [`RESTORE_TEST_BAND`] (990000..=990009).
    RestoreTestBand,
}

impl ReservedBand {
    /// The band that reserves `vmid`, if any.
    pub fn of(vmid: u32) -> Option<Self> {
        if vmid == SELFTEST_SCRATCH_VMID {
            Some(Self::SelftestScratch)
        } else if RESTORE_TEST_BAND.contains(&vmid) {
            Some(Self::RestoreTestBand)
        } else {
            None
        }
    }

    /// The vmids of the band.
    pub fn range(self) -> RangeInclusive<u32> {
        match self {
            Self::SelftestScratch => SELFTEST_SCRATCH_VMID..=SELFTEST_SCRATCH_VMID,
            Self::RestoreTestBand => RESTORE_TEST_BAND,
        }
    }

    /// The band's name as it appears in JSON output.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SelftestScratch => "selftest_scratch",
            Self::RestoreTestBand => "restore_test_band",
        }
    }
}

/// A refused vmid: the error form of the three refusing verdicts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VmidError {
    /// The input is not a vmid in PVE's format.
    #[error("{}", invalid_message(input, *reason))]
    Invalid {
        /// What the operator gave.
        input: String,
        /// Why it is not a vmid.
        reason: InvalidReason,
    },
    /// The vmid is in a fleet-wide reserved band.
    #[error("{}", reserved_message(*vmid, *band, holder.as_ref()))]
    Reserved {
        /// The vmid.
        vmid: u32,
        /// Which band.
        band: ReservedBand,
        /// The guest that sits there anyway, if any.
        holder: Option<Holder>,
    },
    /// A guest holds the vmid.
    #[error("{}", in_use_message(*vmid, holder))]
    InUse {
        /// The vmid.
        vmid: u32,
        /// The guest holding it.
        holder: Holder,
    },
}

impl VmidError {
    /// The stable error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Invalid { .. } => ErrorCode::VmidInvalid,
            Self::Reserved { .. } => ErrorCode::VmidReserved,
            Self::InUse { .. } => ErrorCode::VmidInUse,
        }
    }
}

impl From<VmidError> for Failure {
    fn from(e: VmidError) -> Self {
        Failure::new(e.code(), e.to_string())
    }
}

/// The verdict on one operator-supplied vmid. Exactly one per input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmidVerdict {
    /// Not a vmid in PVE's format.
    Invalid {
        /// What the operator gave.
        input: String,
        /// Why it is not a vmid.
        reason: InvalidReason,
    },
    /// In a fleet-wide reserved band; refused whether or not a guest sits there.
    Reserved {
        /// The vmid.
        vmid: u32,
        /// Which band.
        band: ReservedBand,
        /// The guest that sits there anyway, if any.
        holder: Option<Holder>,
    },
    /// Held by a guest of the full guest list (or of the pool view).
    InUse {
        /// The vmid.
        vmid: u32,
        /// The guest holding it.
        holder: Holder,
    },
    /// Valid, not reserved, and no guest holds it.
    Free {
        /// The vmid.
        vmid: u32,
    },
}

impl VmidVerdict {
    /// The vmid, when the input was a valid one.
    pub fn vmid(&self) -> Option<u32> {
        match self {
            Self::Invalid { .. } => None,
            Self::Reserved { vmid, .. } | Self::InUse { vmid, .. } | Self::Free { vmid } => {
                Some(*vmid)
            }
        }
    }

    /// The verdict's name as it appears in JSON output.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Invalid { .. } => "invalid",
            Self::Reserved { .. } => "reserved",
            Self::InUse { .. } => "in_use",
            Self::Free { .. } => "free",
        }
    }

    /// True only for [`VmidVerdict::Free`].
    pub fn is_free(&self) -> bool {
        matches!(self, Self::Free { .. })
    }

    /// The stable error code of a refusal; `None` when the vmid is free.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Invalid { .. } => Some(ErrorCode::VmidInvalid),
            Self::Reserved { .. } => Some(ErrorCode::VmidReserved),
            Self::InUse { .. } => Some(ErrorCode::VmidInUse),
            Self::Free { .. } => None,
        }
    }

    /// The guest at the vmid, if the verdict knows one (in use, or reserved with a guest there).
    pub fn holder(&self) -> Option<&Holder> {
        match self {
            Self::InUse { holder, .. } => Some(holder),
            Self::Reserved { holder, .. } => holder.as_ref(),
            Self::Invalid { .. } | Self::Free { .. } => None,
        }
    }

    /// The operator-facing text: names the vmid (and the node of a holder) and says what to do.
    /// It never names a foreign guest and never suggests another vmid.
    pub fn message(&self) -> String {
        match self {
            Self::Invalid { input, reason } => invalid_message(input, *reason),
            Self::Reserved { vmid, band, holder } => reserved_message(*vmid, *band, holder.as_ref()),
            Self::InUse { vmid, holder } => in_use_message(*vmid, holder),
            Self::Free { vmid } => format!(
                "vmid {vmid} is free: it is not reserved and no guest in the full guest list holds it"
            ),
        }
    }

    /// The free vmid, or the refusal as an error (for callers that go on to provision).
    pub fn into_result(self) -> Result<u32, VmidError> {
        match self {
            Self::Invalid { input, reason } => Err(VmidError::Invalid { input, reason }),
            Self::Reserved { vmid, band, holder } => {
                Err(VmidError::Reserved { vmid, band, holder })
            }
            Self::InUse { vmid, holder } => Err(VmidError::InUse { vmid, holder }),
            Self::Free { vmid } => Ok(vmid),
        }
    }
}

/// Why `input` is not a vmid, or the vmid. Follows PVE's `^[1-9][0-9]{2,8}$` exactly.
fn classify(input: &str) -> Result<u32, InvalidReason> {
    let bytes = input.as_bytes();
    let Some(&first) = bytes.first() else {
        return Err(InvalidReason::Empty);
    };
    if input.chars().any(char::is_whitespace) {
        return Err(InvalidReason::Whitespace);
    }
    if first == b'+' || first == b'-' {
        return Err(InvalidReason::Sign);
    }
    if !bytes.iter().all(u8::is_ascii_digit) {
        return Err(InvalidReason::NotDigits);
    }
    if first == b'0' {
        return Err(InvalidReason::LeadingZero);
    }
    if bytes.len() < 3 {
        return Err(InvalidReason::TooShort);
    }
    if bytes.len() > 9 {
        return Err(InvalidReason::TooLong);
    }
    // 3 to 9 ASCII digits, no leading zero: always fits a u32 and lies in VMID_MIN..=VMID_MAX.
    Ok(bytes
        .iter()
        .fold(0u32, |acc, d| acc * 10 + u32::from(d - b'0')))
}

/// Parse an operator-supplied vmid in PVE's format (`^[1-9][0-9]{2,8}$`): 100..=999999999,
/// no leading zeros, no sign, no whitespace.
pub fn parse_vmid(input: &str) -> Result<u32, VmidError> {
    classify(input).map_err(|reason| VmidError::Invalid {
        input: input.to_owned(),
        reason,
    })
}

/// The verdict on one operator input against the guests in `guests`.
///
/// Order: invalid, reserved, in use, free (see the module documentation).
pub fn check(input: &str, guests: &impl GuestLookup) -> VmidVerdict {
    match classify(input) {
        Ok(vmid) => check_valid(vmid, guests),
        Err(reason) => VmidVerdict::Invalid {
            input: input.to_owned(),
            reason,
        },
    }
}

/// The verdict on a vmid that arrived as a number (a hub dispatch). Numbers outside
/// [`VMID_MIN`]..=[`VMID_MAX`] are invalid, exactly as their decimal form would be.
pub fn check_number(vmid: u32, guests: &impl GuestLookup) -> VmidVerdict {
    check(&vmid.to_string(), guests)
}

fn check_valid(vmid: u32, guests: &impl GuestLookup) -> VmidVerdict {
    let holder = guests.holder(vmid);
    if let Some(band) = ReservedBand::of(vmid) {
        return VmidVerdict::Reserved { vmid, band, holder };
    }
    match holder {
        Some(holder) => VmidVerdict::InUse { vmid, holder },
        None => VmidVerdict::Free { vmid },
    }
}

/// The vmid the self-restore-test restores into: the first vmid of [`RESTORE_TEST_BAND`] that no
/// guest holds, stepping past any guest (foreign or not) parked in the band. `None` when the
/// whole band is taken: the run is then skipped, which is not a failure.
pub fn restore_band_pick(guests: &impl GuestLookup) -> Option<u32> {
    ReservedBand::RestoreTestBand
        .range()
        .find(|&vmid| !guests.is_held(vmid))
}

/// The input as a message shows it: quoted, escaped, cut to a readable length.
fn shown_input(input: &str) -> String {
    if input.chars().count() > SHOWN_INPUT_MAX_CHARS {
        let cut: String = input.chars().take(SHOWN_INPUT_MAX_CHARS).collect();
        format!("\"{}\"…", cut.escape_debug())
    } else {
        format!("\"{}\"", input.escape_debug())
    }
}

fn invalid_message(input: &str, reason: InvalidReason) -> String {
    format!(
        "vmid {} is not valid: {reason}; give a number from {VMID_MIN} to {VMID_MAX} written \
         without leading zeros, signs or spaces",
        shown_input(input)
    )
}

fn reserved_message(vmid: u32, band: ReservedBand, holder: Option<&Holder>) -> String {
    let what = match band {
        ReservedBand::SelftestScratch => {
            "the standing selftest scratch vmid, reserved fleet-wide".to_owned()
        }
        ReservedBand::RestoreTestBand => format!(
            "in the restore-test band {}-{}, reserved fleet-wide for the self-restore-test",
            RESTORE_TEST_BAND.start(),
            RESTORE_TEST_BAND.end()
        ),
    };
    match holder {
        None => format!("vmid {vmid} is {what}; pick another vmid"),
        Some(holder) => format!(
            "vmid {vmid} is {what} (it is held now by {}); pick another vmid",
            describe_holder(holder)
        ),
    }
}

/// How a message names the guest holding a vmid: "a container on node pve2 that this agent's
/// token cannot see", "pool container 'web' on node pve1".
fn describe_holder(holder: &Holder) -> String {
    match &holder.membership {
        Membership::Foreign => format!(
            "{} on node {} that this agent's token cannot see",
            holder.kind.noun_with_article(),
            holder.node
        ),
        Membership::Pool {
            name: Some(name), ..
        } => format!(
            "pool {} '{}' on node {}",
            holder.kind.noun(),
            name.escape_debug(),
            holder.node
        ),
        Membership::Pool { name: None, .. } => {
            format!("a pool {} on node {}", holder.kind.noun(), holder.node)
        }
    }
}

fn in_use_message(vmid: u32, holder: &Holder) -> String {
    format!(
        "vmid {vmid} is in use by {}; pick a vmid that `{GUESTS_COMMAND}` does not list",
        describe_holder(holder)
    )
}

/// The `holder` object of `vmid-check --json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HolderReport {
    /// `lxc`, `qemu` or `openvz`.
    #[serde(rename = "type")]
    pub kind: GuestType,
    /// The node the guest is on.
    pub node: String,
    /// True when the agent's token cannot see the guest.
    pub foreign: bool,
}

impl From<&Holder> for HolderReport {
    fn from(h: &Holder) -> Self {
        Self {
            kind: h.kind,
            node: h.node.clone(),
            foreign: h.foreign(),
        }
    }
}

/// The JSON document `felhom-agent vmid-check N --json` prints (DESIGN section 3):
/// `{"vmid": 120|null, "verdict": "free|invalid|reserved|in_use", "code": null|"vmid_…",
/// "message": "…", "holder": null|{"type", "node", "foreign"}}`, plus `band` for a reserved
/// vmid and `source` / `cluster_wide` once [`VmidCheckReport::with_source`] has been applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VmidCheckReport {
    /// The vmid; `null` when the input was invalid.
    pub vmid: Option<u32>,
    /// `free`, `invalid`, `reserved` or `in_use`.
    pub verdict: &'static str,
    /// `null` when free, otherwise the refusal's code.
    pub code: Option<ErrorCode>,
    /// The operator-facing text.
    pub message: String,
    /// The guest at the vmid, if any. Never carries a name.
    pub holder: Option<HolderReport>,
    /// The reserved band, for a reserved vmid.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub band: Option<ReservedBand>,
    /// Where the full guest list came from: `vmlist` or `local_commands`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<&'static str>,
    /// False when the list came from `pct list` + `qm list`, which see only this node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_wide: Option<bool>,
}

impl VmidCheckReport {
    /// The report of a verdict.
    pub fn from_verdict(verdict: &VmidVerdict) -> Self {
        Self {
            vmid: verdict.vmid(),
            verdict: verdict.as_str(),
            code: verdict.code(),
            message: verdict.message(),
            holder: verdict.holder().map(HolderReport::from),
            band: match verdict {
                VmidVerdict::Reserved { band, .. } => Some(*band),
                _ => None,
            },
            source: None,
            cluster_wide: None,
        }
    }

    /// Record which list the verdict was reached against. When that list saw only this node,
    /// a `free` message says so: another cluster node may still hold the vmid (PVE then refuses
    /// the create with "already exists", and nothing is touched).
    pub fn with_source(mut self, source: &ListSource) -> Self {
        self.source = Some(source.kind_str());
        self.cluster_wide = Some(source.cluster_wide());
        if self.verdict == "free" && !source.cluster_wide() {
            self.message.push_str(&format!(
                " on this node; the list came from {}, so a guest on another cluster node \
                 may still hold it",
                source.describe()
            ));
        }
        self
    }
}

// ---------------------------------------------------------------------------------------------
// datacenter.cfg next-id lint

/// The `next-id` range that leaves out 9999 and the restore-test band.
const SUGGESTED_NEXT_ID: &str = "next-id: lower=10000,upper=990000";

/// PVE's default `next-id` range when `datacenter.cfg` sets none: `[100, 1000000)`.
const DEFAULT_NEXT_ID_LOWER: u64 = 100;
const DEFAULT_NEXT_ID_UPPER: u64 = 1_000_000;

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
    use crate::inventory::fixtures::sample_parts;
    use crate::inventory::join;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn foreign(kind: GuestType, node: &str) -> Holder {
        Holder {
            kind,
            node: node.to_owned(),
            membership: Membership::Foreign,
        }
    }

    fn pooled(kind: GuestType, node: &str, name: Option<&str>) -> Holder {
        Holder {
            kind,
            node: node.to_owned(),
            membership: Membership::Pool {
                name: name.map(str::to_owned),
                status: None,
            },
        }
    }

    fn sample_guests() -> BTreeMap<u32, Holder> {
        let mut m = BTreeMap::new();
        m.insert(101, foreign(GuestType::Lxc, "pve2"));
        m.insert(120, pooled(GuestType::Lxc, "pve1", Some("web")));
        m.insert(130, pooled(GuestType::Qemu, "pve1", None));
        m.insert(140, foreign(GuestType::Qemu, "pve3"));
        m.insert(150, foreign(GuestType::OpenVz, "pve1"));
        m.insert(990_003, foreign(GuestType::Lxc, "pve2"));
        m
    }

    #[test]
    fn parse_vmid_table() {
        let cases: &[(&str, Result<u32, InvalidReason>)] = &[
            ("100", Ok(100)),
            ("120", Ok(120)),
            ("999999999", Ok(999_999_999)),
            ("9999", Ok(9999)),
            ("", Err(InvalidReason::Empty)),
            (" 120", Err(InvalidReason::Whitespace)),
            ("120 ", Err(InvalidReason::Whitespace)),
            ("1 20", Err(InvalidReason::Whitespace)),
            ("120\n", Err(InvalidReason::Whitespace)),
            ("+120", Err(InvalidReason::Sign)),
            ("-120", Err(InvalidReason::Sign)),
            ("12a", Err(InvalidReason::NotDigits)),
            ("1e3", Err(InvalidReason::NotDigits)),
            ("١٢٠", Err(InvalidReason::NotDigits)),
            ("120.0", Err(InvalidReason::NotDigits)),
            ("0120", Err(InvalidReason::LeadingZero)),
            ("0", Err(InvalidReason::LeadingZero)),
            ("000", Err(InvalidReason::LeadingZero)),
            ("99", Err(InvalidReason::TooShort)),
            ("5", Err(InvalidReason::TooShort)),
            ("1000000000", Err(InvalidReason::TooLong)),
            ("99999999999999999999999", Err(InvalidReason::TooLong)),
        ];
        for (input, want) in cases {
            let got = parse_vmid(input).map_err(|e| match e {
                VmidError::Invalid { input: i, reason } => {
                    assert_eq!(&i, input);
                    reason
                }
                other => panic!("parse_vmid gave a non-invalid error: {other:?}"),
            });
            assert_eq!(&got, want, "input {input:?}");
        }
    }

    #[test]
    fn every_verdict_with_code_and_message() {
        let guests = sample_guests();

        let v = check("0120", &guests);
        assert_eq!(
            v,
            VmidVerdict::Invalid {
                input: "0120".into(),
                reason: InvalidReason::LeadingZero
            }
        );
        assert_eq!(v.code(), Some(ErrorCode::VmidInvalid));
        assert_eq!(
            v.message(),
            "vmid \"0120\" is not valid: it starts with a zero; give a number from 100 to \
             999999999 written without leading zeros, signs or spaces"
        );

        let v = check("9999", &guests);
        assert_eq!(
            v,
            VmidVerdict::Reserved {
                vmid: 9999,
                band: ReservedBand::SelftestScratch,
                holder: None
            }
        );
        assert_eq!(v.code(), Some(ErrorCode::VmidReserved));
        assert_eq!(
            v.message(),
            "vmid 9999 is the standing selftest scratch vmid, reserved fleet-wide; pick another vmid"
        );

        let v = check("990001", &guests);
        assert_eq!(v.code(), Some(ErrorCode::VmidReserved));
        assert_eq!(
            v.message(),
            "vmid 990001 is in the restore-test band 990000-990009, reserved fleet-wide for the \
             self-restore-test; pick another vmid"
        );

        // A guest parked in the band: reserved wins, and the message mentions the holder.
        let v = check("990003", &guests);
        assert!(matches!(
            v,
            VmidVerdict::Reserved {
                vmid: 990_003,
                band: ReservedBand::RestoreTestBand,
                holder: Some(_)
            }
        ));
        assert_eq!(
            v.message(),
            "vmid 990003 is in the restore-test band 990000-990009, reserved fleet-wide for the \
             self-restore-test (it is held now by a container on node pve2 that this agent's \
             token cannot see); pick another vmid"
        );

        let v = check("101", &guests);
        assert_eq!(v.code(), Some(ErrorCode::VmidInUse));
        assert_eq!(v.holder().map(Holder::foreign), Some(true));
        assert_eq!(
            v.message(),
            "vmid 101 is in use by a container on node pve2 that this agent's token cannot see; \
             pick a vmid that `felhom-agent guests` does not list"
        );

        let v = check("120", &guests);
        assert_eq!(v.holder().map(Holder::foreign), Some(false));
        assert_eq!(
            v.message(),
            "vmid 120 is in use by pool container 'web' on node pve1; pick a vmid that \
             `felhom-agent guests` does not list"
        );

        let v = check("130", &guests);
        assert_eq!(
            v.message(),
            "vmid 130 is in use by a pool virtual machine on node pve1; pick a vmid that \
             `felhom-agent guests` does not list"
        );

        let v = check("140", &guests);
        assert!(v
            .message()
            .contains("a virtual machine on node pve3 that this agent's token"));
        let v = check("150", &guests);
        assert!(v
            .message()
            .contains("a legacy OpenVZ container on node pve1"));

        let v = check("121", &guests);
        assert_eq!(v, VmidVerdict::Free { vmid: 121 });
        assert_eq!(v.code(), None);
        assert_eq!(
            v.message(),
            "vmid 121 is free: it is not reserved and no guest in the full guest list holds it"
        );
    }

    #[test]
    fn into_result_and_failure_keep_code_and_message() {
        let guests = sample_guests();
        assert_eq!(check("121", &guests).into_result(), Ok(121));
        for input in ["abc", "9999", "101"] {
            let verdict = check(input, &guests);
            let message = verdict.message();
            let code = verdict.code();
            let err = verdict.into_result().err();
            assert_eq!(err.as_ref().map(VmidError::code), code);
            assert_eq!(err.as_ref().map(ToString::to_string), Some(message.clone()));
            let failure = err.map(Failure::from);
            assert_eq!(
                failure.map(|f| (f.code, f.message)),
                code.map(|c| (c, message))
            );
        }
    }

    #[test]
    fn check_number_uses_the_same_range() {
        let guests = BTreeMap::new();
        assert!(matches!(
            check_number(5, &guests),
            VmidVerdict::Invalid {
                reason: InvalidReason::TooShort,
                ..
            }
        ));
        assert!(matches!(
            check_number(0, &guests),
            VmidVerdict::Invalid {
                reason: InvalidReason::LeadingZero,
                ..
            }
        ));
        assert!(matches!(
            check_number(1_000_000_000, &guests),
            VmidVerdict::Invalid {
                reason: InvalidReason::TooLong,
                ..
            }
        ));
        assert_eq!(check_number(100, &guests), VmidVerdict::Free { vmid: 100 });
    }

    #[test]
    fn long_or_odd_inputs_are_shown_quoted_and_cut() {
        let input = "x".repeat(500);
        let msg = check(&input, &BTreeMap::new()).message();
        assert!(msg.len() < 200, "{msg}");
        assert!(msg.contains("\"xxxxxxxx"), "{msg}");
        let msg = check("12\u{1b}[31m", &BTreeMap::new()).message();
        assert!(!msg.contains('\u{1b}'), "{msg}");
    }

    #[test]
    fn restore_band_pick_steps_past_taken_vmids() {
        let mut guests = BTreeMap::new();
        assert_eq!(restore_band_pick(&guests), Some(990_000));
        guests.insert(990_000, foreign(GuestType::Lxc, "pve2"));
        guests.insert(990_001, pooled(GuestType::Qemu, "pve1", None));
        assert_eq!(restore_band_pick(&guests), Some(990_002));
        for vmid in RESTORE_TEST_BAND {
            guests.insert(vmid, foreign(GuestType::Qemu, "pve3"));
        }
        assert_eq!(restore_band_pick(&guests), None);
        guests.remove(&990_009);
        assert_eq!(restore_band_pick(&guests), Some(990_009));
    }

    #[test]
    fn report_json_matches_design() {
        let guests = sample_guests();
        let report = VmidCheckReport::from_verdict(&check("101", &guests));
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "vmid": 101,
                "verdict": "in_use",
                "code": "vmid_in_use",
                "message": "vmid 101 is in use by a container on node pve2 that this agent's token cannot see; pick a vmid that `felhom-agent guests` does not list",
                "holder": {"type": "lxc", "node": "pve2", "foreign": true}
            })
        );

        let json =
            serde_json::to_value(VmidCheckReport::from_verdict(&check("12", &guests))).unwrap();
        assert_eq!(json["vmid"], serde_json::Value::Null);
        assert_eq!(json["verdict"], "invalid");
        assert_eq!(json["code"], "vmid_invalid");
        assert_eq!(json["holder"], serde_json::Value::Null);

        let json =
            serde_json::to_value(VmidCheckReport::from_verdict(&check("990005", &guests))).unwrap();
        assert_eq!(json["verdict"], "reserved");
        assert_eq!(json["band"], "restore_test_band");
        assert_eq!(json["code"], "vmid_reserved");

        let json =
            serde_json::to_value(VmidCheckReport::from_verdict(&check("120", &guests))).unwrap();
        assert_eq!(json["holder"]["foreign"], false);
        assert_eq!(json["holder"]["type"], "lxc");
        assert!(json["holder"].get("name").is_none());

        let json =
            serde_json::to_value(VmidCheckReport::from_verdict(&check("121", &guests))).unwrap();
        assert_eq!(json["verdict"], "free");
        assert_eq!(json["code"], serde_json::Value::Null);
    }

    #[test]
    fn report_says_when_the_list_saw_only_this_node() {
        let guests = sample_guests();
        let local = ListSource::LocalCommands {
            node: "pve1".into(),
            vmlist_path: "/etc/pve/.vmlist".into(),
            vmlist_error: "No such file or directory (os error 2)".into(),
        };
        let report = VmidCheckReport::from_verdict(&check("121", &guests)).with_source(&local);
        assert_eq!(report.source, Some("local_commands"));
        assert_eq!(report.cluster_wide, Some(false));
        assert!(
            report.message.contains("another cluster node"),
            "{}",
            report.message
        );

        let vmlist = ListSource::Vmlist {
            path: "/etc/pve/.vmlist".into(),
            via: crate::inventory::VmlistVia::Direct,
        };
        let report = VmidCheckReport::from_verdict(&check("121", &guests)).with_source(&vmlist);
        assert_eq!(report.source, Some("vmlist"));
        assert_eq!(report.cluster_wide, Some(true));
        assert!(!report.message.contains("another cluster node"));
    }

    /// The oracle for PVE's `^[1-9][0-9]{2,8}$`, written independently of `classify`.
    fn matches_pve_format(s: &str) -> bool {
        let mut chars = s.chars();
        let Some(first) = chars.next() else {
            return false;
        };
        let rest: Vec<char> = chars.collect();
        ('1'..='9').contains(&first)
            && (2..=8).contains(&rest.len())
            && rest.iter().all(|c| c.is_ascii_digit())
    }

    fn arb_guests() -> impl Strategy<Value = BTreeMap<u32, Holder>> {
        let vmid = prop_oneof![
            100u32..1000,
            9990u32..10010,
            989_995u32..990_015,
            Just(999_999_999u32),
        ];
        let holder = (
            prop_oneof![
                Just(GuestType::Lxc),
                Just(GuestType::Qemu),
                Just(GuestType::OpenVz)
            ],
            "[a-z][a-z0-9]{0,5}",
            any::<bool>(),
        )
            .prop_map(|(kind, node, in_pool)| Holder {
                kind,
                node,
                membership: if in_pool {
                    Membership::Pool {
                        name: Some("n".into()),
                        status: None,
                    }
                } else {
                    Membership::Foreign
                },
            });
        proptest::collection::btree_map(vmid, holder, 0..40)
    }

    fn arb_input() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            "[0-9]{0,12}",
            "[+ -]?[0-9]{1,10}[ ]?",
            (100u32..1000).prop_map(|v| v.to_string()),
            (9990u32..10010).prop_map(|v| v.to_string()),
            (989_995u32..990_015).prop_map(|v| v.to_string()),
        ]
    }

    proptest! {
        #[test]
        fn parse_vmid_accepts_exactly_the_pve_format(s in arb_input()) {
            let parsed = parse_vmid(&s);
            prop_assert_eq!(parsed.is_ok(), matches_pve_format(&s), "input {:?}", s);
            if let Ok(v) = parsed {
                prop_assert_eq!(v.to_string(), s);
                prop_assert!((VMID_MIN..=VMID_MAX).contains(&v));
            }
        }

        #[test]
        fn parse_vmid_accepts_every_generated_match(s in "[1-9][0-9]{2,8}") {
            prop_assert_eq!(parse_vmid(&s).ok().map(|v| v.to_string()), Some(s));
        }

        #[test]
        fn one_consistent_verdict_per_input(s in arb_input(), guests in arb_guests()) {
            let verdict = check(&s, &guests);
            // Exactly one of the four, and the one the independent facts call for.
            let valid = matches_pve_format(&s);
            let vmid = s.parse::<u32>().ok().filter(|_| valid);
            let reserved = vmid.is_some_and(|v| v == 9999 || (990_000..=990_009).contains(&v));
            let held = vmid.is_some_and(|v| guests.contains_key(&v));
            let want = if !valid {
                "invalid"
            } else if reserved {
                "reserved"
            } else if held {
                "in_use"
            } else {
                "free"
            };
            prop_assert_eq!(verdict.as_str(), want, "input {:?}", s);
            prop_assert_eq!(verdict.code().is_none(), verdict.is_free());
            prop_assert_eq!(verdict.vmid(), vmid);
            let prefix = match vmid {
                Some(v) => format!("vmid {v} "),
                None => "vmid \"".to_owned(),
            };
            prop_assert!(verdict.message().starts_with(&prefix), "{}", verdict.message());
        }

        #[test]
        fn reserved_is_never_free(
            v in prop_oneof![Just(9999u32), 990_000u32..=990_009],
            guests in arb_guests(),
        ) {
            let verdict = check(&v.to_string(), &guests);
            prop_assert!(!verdict.is_free());
            prop_assert_eq!(verdict.code(), Some(ErrorCode::VmidReserved));
        }

        #[test]
        fn in_use_iff_held_outside_the_bands(v in VMID_MIN..=VMID_MAX, guests in arb_guests()) {
            let verdict = check(&v.to_string(), &guests);
            let in_use = matches!(verdict, VmidVerdict::InUse { .. });
            prop_assert_eq!(in_use, guests.contains_key(&v) && ReservedBand::of(v).is_none());
            if let VmidVerdict::InUse { holder, .. } = &verdict {
                prop_assert_eq!(Some(holder), guests.get(&v));
            }
        }

        #[test]
        fn band_pick_is_free_and_first(guests in arb_guests()) {
            match restore_band_pick(&guests) {
                Some(v) => {
                    prop_assert!(RESTORE_TEST_BAND.contains(&v));
                    prop_assert!(!guests.contains_key(&v));
                    prop_assert!((*RESTORE_TEST_BAND.start()..v).all(|w| guests.contains_key(&w)));
                }
                None => prop_assert!(ReservedBand::RestoreTestBand.range().all(|w| guests.contains_key(&w))),
            }
        }
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
}
