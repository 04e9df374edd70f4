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
//! - the guest that holds a vmid as the vmid policy sees it ([`Holder`], [`GuestLookup`]).
//!
//! Where it lives:
//! - this file: the shared types ([`InventoryError`], [`GuestType`], [`GuestEntry`],
//!   [`ListSource`], [`FullGuestList`]), the helpers the three parsers share, the list commands
//!   ([`ListCommand`], [`ListCommands`], [`SystemListCommands`]) and [`read_full_list`];
//! - `vmlist.rs`: the `.vmlist` parser (the direct scanner and the JSON reference decoder);
//! - `pct_list.rs`, `qm_list.rs`: one parser each;
//! - `join.rs`: the pool view, the join and what is built from it.
//!
//! Everything public is re-exported here, so every item is reached as `crate::inventory::X`.
//!
//! It may use only `crate::error`, std and serde: it never writes anything and never talks to
//! the PVE API (the caller fetches the pool view and hands its rows in). The vmid policy
//! (the `vmid` module) builds on this module, never the other way round.

mod join;
mod pct_list;
mod qm_list;
mod vmlist;

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::ErrorCode;

pub use join::{
    join, GuestLookup, GuestsReport, GuestsReportRow, Holder, HubInventory, HubPoolGuest,
    Inventory, InventoryRow, Membership, PoolGuest, PoolView, ResourceRow,
};
pub use pct_list::parse_pct_list;
pub use qm_list::parse_qm_list;
pub use vmlist::{parse_vmlist, parse_vmlist_reference};

/// The default location of the cluster-wide guest list.
pub const DEFAULT_VMLIST_PATH: &str = "/etc/pve/.vmlist";

/// The largest `.vmlist` (or `pct list` / `qm list` output) this agent reads. A 100,000-guest
/// `.vmlist` is about 6 MiB.
pub const MAX_LIST_BYTES: u64 = 64 * 1024 * 1024;

/// How long `pct list` or `qm list` may run before the agent gives up on it.
pub const LIST_COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// The most of a command's stderr an error message repeats.
const STDERR_EXCERPT_CHARS: usize = 400;

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

/// How the bytes of `.vmlist` reached this process.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum VmlistVia {
    /// This process opened the file itself (as root, or as a member of pmxcfs's group
    /// `www-data`).
    #[default]
    Direct,
    /// The root exec helper read the file and handed its bytes over its socket; this process
    /// needs no right on pmxcfs.
    Helper {
        /// The helper's socket.
        socket: PathBuf,
    },
    /// This process opened the file itself because the exec helper did not hand it over.
    DirectAfterHelper {
        /// The helper's socket.
        socket: PathBuf,
        /// Why the helper did not.
        why: String,
    },
}

impl VmlistVia {
    /// `direct` or `exec_helper`, as JSON output names it.
    pub fn kind_str(&self) -> &'static str {
        match self {
            Self::Helper { .. } => "exec_helper",
            Self::Direct | Self::DirectAfterHelper { .. } => "direct",
        }
    }

    /// A sentence part: how the file was read.
    pub fn describe(&self) -> String {
        match self {
            Self::Direct => "read directly by this process".to_string(),
            Self::Helper { socket } => {
                format!("handed over by the root exec helper at {}", socket.display())
            }
            Self::DirectAfterHelper { socket, why } => format!(
                "read directly by this process, because the exec helper at {} did not hand it over ({why})",
                socket.display()
            ),
        }
    }
}

/// Where the full guest list came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListSource {
    /// `/etc/pve/.vmlist`: every guest of the cluster.
    Vmlist {
        /// The file read.
        path: PathBuf,
        /// How its bytes were read.
        via: VmlistVia,
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
            Self::Vmlist {
                path,
                via: VmlistVia::Direct,
            } => format!("{} (cluster-wide)", path.display()),
            Self::Vmlist { path, via } => {
                format!("{} (cluster-wide, {})", path.display(), via.describe())
            }
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
// Helpers the three parsers share

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

// ---------------------------------------------------------------------------------------------
// The list commands and reading the full list

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

/// Why `.vmlist`'s bytes were not had.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmlistUnread {
    /// It cannot be read at all (missing, permission denied, any IO error): the local
    /// commands are asked instead.
    Unreadable(String),
    /// It was refused as not a guest list this agent may trust (too large, not where or what
    /// it should be): an error, never a reason to fall back.
    Refused(InventoryError),
}

/// Where the bytes of `.vmlist` come from: this process's own read ([`DirectVmlist`]), or the
/// root exec helper's (`crate::exec_helper::client::HelperVmlist`).
pub trait VmlistReader {
    /// The file's bytes (at most [`MAX_LIST_BYTES`]) and how they were read.
    fn read_vmlist(&self, path: &Path) -> Result<(Vec<u8>, VmlistVia), VmlistUnread>;
}

/// This process opens `.vmlist` itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct DirectVmlist;

impl VmlistReader for DirectVmlist {
    fn read_vmlist(&self, path: &Path) -> Result<(Vec<u8>, VmlistVia), VmlistUnread> {
        match read_vmlist_file(path) {
            Ok(bytes) if bytes.len() as u64 > MAX_LIST_BYTES => {
                Err(VmlistUnread::Refused(InventoryError::VmlistTooLarge {
                    path: path.to_owned(),
                    max: MAX_LIST_BYTES,
                }))
            }
            Ok(bytes) => Ok((bytes, VmlistVia::Direct)),
            Err(e) => Err(VmlistUnread::Unreadable(e.to_string())),
        }
    }
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
    read_full_list_with(vmlist_path, node, commands, &DirectVmlist)
}

/// [`read_full_list`] with `.vmlist`'s bytes from `reader`. They are parsed as hostile input
/// whoever read them: the same parser, the same refusals.
pub fn read_full_list_with(
    vmlist_path: &Path,
    node: &str,
    commands: &impl ListCommands,
    reader: &impl VmlistReader,
) -> Result<FullGuestList, InventoryError> {
    match reader.read_vmlist(vmlist_path) {
        Err(VmlistUnread::Refused(e)) => Err(e),
        Ok((bytes, via)) => {
            if bytes.len() as u64 > MAX_LIST_BYTES {
                return Err(InventoryError::VmlistTooLarge {
                    path: vmlist_path.to_owned(),
                    max: MAX_LIST_BYTES,
                });
            }
            let entries = vmlist::decode_vmlist(&bytes).map_err(|e| match e {
                InventoryError::VmlistSyntax { detail } => InventoryError::VmlistInvalid {
                    path: vmlist_path.to_owned(),
                    detail,
                },
                other => other,
            })?;
            FullGuestList::from_entries(
                ListSource::Vmlist {
                    path: vmlist_path.to_owned(),
                    via,
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
        Err(VmlistUnread::Unreadable(vmlist_error)) => {
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

/// Sample lists and builders the tests of this module and of the vmid policy share.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;

    pub(crate) const VMLIST_MULTI: &str = "{\n\"version\": 17,\n\"ids\": {\n\"100\": { \"node\": \"pve1\", \"type\": \"qemu\", \"version\": 5 },\n\"101\": { \"node\": \"pve2\", \"type\": \"lxc\", \"version\": 9 }}\n\n}\n";
    pub(crate) const VMLIST_EMPTY: &str = "{\n\"version\": 3\n\n}\n";

    pub(crate) const PCT_LIST: &str = "\
VMID       Status     Lock         Name                
101        running                 web                 
102        stopped    backup       db                  
103        stopped    snapshot-delete longhostname-for-a-container
";

    pub(crate) const QM_LIST: &str =
        "      VMID NAME                 STATUS     MEM(MB)    BOOTDISK(GB) PID       
       100 gw                   running    2048              32.00 4711      
       105 VM 105               stopped    512                0.00 0         
       110 a-very-long-vm-name-over-twenty running    476.837158203125         8.00 99        
";

    pub(crate) fn entry(
        vmid: u32,
        kind: GuestType,
        node: &str,
        version: Option<u64>,
    ) -> GuestEntry {
        GuestEntry {
            vmid,
            kind,
            node: node.into(),
            version,
        }
    }

    pub(crate) fn row(
        vmid: u32,
        kind: GuestType,
        node: &str,
        name: &str,
        pool: Option<&str>,
    ) -> ResourceRow {
        ResourceRow {
            vmid,
            kind,
            node: node.into(),
            name: Some(name.into()),
            status: Some("running".into()),
            pool: pool.map(str::to_owned),
        }
    }

    pub(crate) fn sample_parts() -> (FullGuestList, PoolView) {
        let full = FullGuestList::from_entries(
            ListSource::Vmlist {
                path: DEFAULT_VMLIST_PATH.into(),
                via: VmlistVia::Direct,
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
}

#[cfg(test)]
mod tests {
    use super::fixtures::{PCT_LIST, QM_LIST, VMLIST_MULTI};
    use super::*;

    fn no_commands(_: ListCommand) -> Result<String, InventoryError> {
        Err(InventoryError::CommandFailed {
            command: "test",
            detail: "must not run".into(),
        })
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
    fn read_full_list_prefers_vmlist() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".vmlist");
        std::fs::write(&path, VMLIST_MULTI).unwrap();
        let list = read_full_list(&path, "pve1", &no_commands).unwrap();
        assert_eq!(
            list.source(),
            &ListSource::Vmlist {
                path: path.clone(),
                via: VmlistVia::Direct
            }
        );
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

    proptest::proptest! {
        #[test]
        fn parsers_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..300)) {
            let _ = parse_vmlist(&bytes);
            let text = String::from_utf8_lossy(&bytes);
            let _ = parse_pct_list(&text, "pve1");
            let _ = parse_qm_list(&text, "pve1");
        }
    }
}
