//! Response types of the PVE API, decoded leniently: PVE sends integers as numbers or strings
//! and booleans as `0`/`1`, `"0"`/`"1"` or `true`/`false` depending on endpoint and version.

use std::collections::BTreeMap;

use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};

/// The two kinds of guest the agent provisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GuestKind {
    /// An LXC container (`CT` in PVE's messages).
    Lxc,
    /// A QEMU virtual machine (`VM` in PVE's messages).
    Qemu,
}

impl GuestKind {
    /// The API path segment (`lxc` / `qemu`).
    pub fn path(self) -> &'static str {
        match self {
            GuestKind::Lxc => "lxc",
            GuestKind::Qemu => "qemu",
        }
    }
    /// The word PVE uses in messages (`CT` / `VM`).
    pub fn pve_word(self) -> &'static str {
        match self {
            GuestKind::Lxc => "CT",
            GuestKind::Qemu => "VM",
        }
    }
    /// The word for operators (`container` / `VM`).
    pub fn noun(self) -> &'static str {
        match self {
            GuestKind::Lxc => "container",
            GuestKind::Qemu => "VM",
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum NumOrStr {
    U(u64),
    I(i64),
    F(f64),
    S(String),
    B(bool),
}

fn to_u64<E: de::Error>(v: NumOrStr) -> Result<u64, E> {
    match v {
        NumOrStr::U(u) => Ok(u),
        NumOrStr::I(i) => u64::try_from(i).map_err(|_| E::custom(format!("negative number {i}"))),
        NumOrStr::F(f) if f >= 0.0 && f.fract() == 0.0 && f < 1.8e19 => Ok(f as u64),
        NumOrStr::F(f) => Err(E::custom(format!("not an integer: {f}"))),
        NumOrStr::S(s) => s
            .trim()
            .parse()
            .map_err(|_| E::custom(format!("not an integer: {s:?}"))),
        NumOrStr::B(b) => Ok(u64::from(b)),
    }
}

/// Deserialize an integer sent as a number or a string.
pub fn lenient_u64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    to_u64(NumOrStr::deserialize(d)?)
}

/// Deserialize an optional integer sent as a number or a string.
pub fn lenient_opt_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    match Option::<NumOrStr>::deserialize(d)? {
        None => Ok(None),
        Some(NumOrStr::S(s)) if s.is_empty() => Ok(None),
        Some(v) => to_u64(v).map(Some),
    }
}

/// Deserialize a vmid sent as a number or a string.
pub fn lenient_u32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let v = lenient_u64(d)?;
    u32::try_from(v).map_err(|_| de::Error::custom(format!("vmid out of range: {v}")))
}

/// Deserialize a boolean sent as `true`/`false`, `0`/`1` or `"0"`/`"1"`; absent is false.
pub fn lenient_bool<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    match Option::<NumOrStr>::deserialize(d)? {
        None => Ok(false),
        Some(NumOrStr::B(b)) => Ok(b),
        Some(NumOrStr::S(s)) => match s.trim() {
            "1" | "true" => Ok(true),
            "0" | "false" | "" => Ok(false),
            other => Err(de::Error::custom(format!("not a boolean: {other:?}"))),
        },
        Some(v) => to_u64(v).map(|n| n != 0),
    }
}

/// `GET /version`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct VersionInfo {
    /// pve-manager version, e.g. `9.1.1`.
    pub version: String,
    /// Release, e.g. `9.1`.
    #[serde(default)]
    pub release: String,
}

/// A guest row of `GET /cluster/resources?type=vm`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct ClusterVm {
    /// `lxc` or `qemu`.
    #[serde(rename = "type")]
    pub kind: GuestKind,
    /// The vmid.
    #[serde(deserialize_with = "lenient_u32")]
    pub vmid: u32,
    /// The node it lives on.
    pub node: String,
    /// Its name (pool guests only ever reach the agent here).
    #[serde(default)]
    pub name: Option<String>,
    /// `running`, `stopped`, `unknown`.
    #[serde(default)]
    pub status: Option<String>,
    /// The pool, when the token may see it.
    #[serde(default)]
    pub pool: Option<String>,
    /// A config lock, e.g. `create`.
    #[serde(default)]
    pub lock: Option<String>,
    /// `;`-joined tags.
    #[serde(default)]
    pub tags: Option<String>,
    /// Template flag.
    #[serde(default, deserialize_with = "lenient_bool")]
    pub template: bool,
}

/// `GET …/status/current`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct GuestStatus {
    /// `running` / `stopped`.
    pub status: String,
    /// The vmid (absent on some versions).
    #[serde(default, deserialize_with = "lenient_opt_u64")]
    pub vmid: Option<u64>,
    /// Name.
    #[serde(default)]
    pub name: Option<String>,
    /// A config lock, only when set.
    #[serde(default)]
    pub lock: Option<String>,
    /// `;`-joined tags, only when set.
    #[serde(default)]
    pub tags: Option<String>,
    /// QEMU: the QMP status (`running`, `paused`, `prelaunch`).
    #[serde(default)]
    pub qmpstatus: Option<String>,
    /// Uptime in seconds.
    #[serde(default, deserialize_with = "lenient_opt_u64")]
    pub uptime: Option<u64>,
    /// Template flag.
    #[serde(default, deserialize_with = "lenient_bool")]
    pub template: bool,
}

impl GuestStatus {
    /// Running, and for QEMU not paused or still in prelaunch.
    pub fn is_running(&self) -> bool {
        self.status == "running" && self.qmpstatus.as_deref().is_none_or(|q| q == "running")
    }
}

/// `GET /nodes/{node}/tasks/{upid}/status`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct TaskStatus {
    /// `running` or `stopped`.
    pub status: String,
    /// Only when stopped: `OK`, `WARNINGS: N`, or the error text.
    #[serde(default)]
    pub exitstatus: Option<String>,
    /// Task type.
    #[serde(default, rename = "type")]
    pub task_type: Option<String>,
    /// Task id (always a string).
    #[serde(default)]
    pub id: Option<String>,
}

/// One row of `GET /nodes/{node}/tasks`: only the UPID is read; type, vmid, user and start
/// time are taken from it (a listing's other fields vary between versions).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct TaskListEntry {
    /// The task's UPID.
    pub upid: String,
}

/// One line of a task log.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct TaskLogLine {
    /// 1-based line number.
    #[serde(deserialize_with = "lenient_u64")]
    pub n: u64,
    /// The text.
    pub t: String,
}

/// A backup volume of `GET …/storage/{sid}/content?content=backup`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct BackupVolume {
    /// The volid, e.g. `local:backup/vzdump-lxc-200-….tar.zst`.
    pub volid: String,
    /// The owner vmid from the file name.
    #[serde(default, deserialize_with = "lenient_opt_u64")]
    pub vmid: Option<u64>,
    /// Creation time, Unix seconds.
    #[serde(default, deserialize_with = "lenient_opt_u64")]
    pub ctime: Option<u64>,
    /// Size in bytes.
    #[serde(default, deserialize_with = "lenient_opt_u64")]
    pub size: Option<u64>,
    /// `lxc`, `qemu`, `openvz`, `unknown` (absent on some storages).
    #[serde(default)]
    pub subtype: Option<String>,
    /// Format (extension).
    #[serde(default)]
    pub format: Option<String>,
    /// The first line of its notes (the listing gives no more: pve-storage `Plugin.pm`
    /// `file_read_firstline`).
    #[serde(default)]
    pub notes: Option<String>,
}

impl BackupVolume {
    /// The guest kind of the backup: `subtype`, else the `vzdump-<kind>-` file name.
    pub fn guest_kind(&self) -> Option<GuestKind> {
        match self.subtype.as_deref() {
            Some("lxc") => return Some(GuestKind::Lxc),
            Some("qemu") => return Some(GuestKind::Qemu),
            _ => {}
        }
        backup_kind_from_volid(&self.volid)
    }
}

/// The guest kind named in a backup volid (`vzdump-lxc-…`, `vzdump-qemu-…`, `…/ct/…`, `…/vm/…`).
pub fn backup_kind_from_volid(volid: &str) -> Option<GuestKind> {
    let name = volid.split_once(':').map_or(volid, |(_, v)| v);
    if name.contains("vzdump-lxc-")
        || name.contains("vzdump-openvz-")
        || name.starts_with("backup/ct/")
    {
        Some(GuestKind::Lxc)
    } else if name.contains("vzdump-qemu-") || name.starts_with("backup/vm/") {
        Some(GuestKind::Qemu)
    } else {
        None
    }
}

/// The vmid of the guest a vzdump backup was made of (`vzdump-lxc-200-…` gives 200), from its
/// volid; `None` for another name.
pub fn backup_owner_from_volid(volid: &str) -> Option<u32> {
    let name = volid.split_once(':').map_or(volid, |(_, v)| v);
    let file = name.rsplit('/').next().unwrap_or(name);
    let rest = ["vzdump-lxc-", "vzdump-qemu-", "vzdump-openvz-"]
        .iter()
        .find_map(|p| file.strip_prefix(p))?;
    rest.split('-').next()?.parse().ok()
}

/// The guest a backup volid is of: a vzdump file name (`vzdump-lxc-200-…`), or a Proxmox
/// Backup Server snapshot (`<storage>:backup/ct/200/<time>`, `backup/vm/300/<time>`).
pub fn backup_guest(volid: &str) -> Option<u32> {
    backup_owner_from_volid(volid).or_else(|| {
        let name = volid.split_once(':').map_or(volid, |(_, v)| v);
        let rest = name
            .strip_prefix("backup/ct/")
            .or_else(|| name.strip_prefix("backup/vm/"))?;
        rest.split('/').next()?.parse().ok()
    })
}

/// `GET /nodes/{node}/storage/{storage}/status`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, Default)]
pub struct StorageStatus {
    /// The storage type (`dir`, `lvmthin`, `zfspool`, …).
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// Content types, comma-separated (`images,rootdir`).
    #[serde(default)]
    pub content: String,
    /// Enabled on this node.
    #[serde(default, deserialize_with = "lenient_bool")]
    pub enabled: bool,
    /// Active (PVE could activate it).
    #[serde(default, deserialize_with = "lenient_bool")]
    pub active: bool,
    /// Free bytes.
    #[serde(default, deserialize_with = "lenient_opt_u64")]
    pub avail: Option<u64>,
}

impl StorageStatus {
    /// Whether the storage holds content type `c` (`rootdir`, `images`, `backup`).
    pub fn has_content(&self, c: &str) -> bool {
        self.content.split(',').any(|x| x.trim() == c)
    }
}

/// `GET …/agent/exec-status?pid=P`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, Default)]
pub struct AgentExecStatus {
    /// Whether the process has ended. Only the first answer with `exited` is ever given.
    #[serde(default, deserialize_with = "lenient_bool")]
    pub exited: bool,
    /// Exit code, when it exited normally.
    #[serde(default, deserialize_with = "lenient_opt_u64")]
    pub exitcode: Option<u64>,
    /// Signal, when it was killed.
    #[serde(default, deserialize_with = "lenient_opt_u64")]
    pub signal: Option<u64>,
    /// Decoded stdout.
    #[serde(default, rename = "out-data")]
    pub out_data: Option<String>,
    /// Decoded stderr.
    #[serde(default, rename = "err-data")]
    pub err_data: Option<String>,
    /// stdout passed the guest agent's capture limit.
    #[serde(default, rename = "out-truncated", deserialize_with = "lenient_bool")]
    pub out_truncated: bool,
    /// stderr passed the guest agent's capture limit.
    #[serde(default, rename = "err-truncated", deserialize_with = "lenient_bool")]
    pub err_truncated: bool,
}

/// `GET /access/permissions`: path → privilege → propagate flag.
pub type Permissions = BTreeMap<String, BTreeMap<String, serde_json::Value>>;

/// The privileges held on `path`, counting propagated grants on its ancestors.
pub fn held_on(perms: &Permissions, path: &str) -> std::collections::BTreeSet<String> {
    let mut held = std::collections::BTreeSet::new();
    for (p, privs) in perms {
        let applies = p == path
            || p == "/"
            || (path.starts_with(p.as_str()) && path.as_bytes().get(p.len()) == Some(&b'/'));
        if !applies {
            continue;
        }
        for (name, propagate) in privs {
            let propagates = p == path
                || propagate.as_u64().is_none_or(|v| v != 0) && propagate.as_bool() != Some(false);
            if propagates {
                held.insert(name.clone());
            }
        }
    }
    held
}

/// A pool as `GET /pools?poolid=` answers it.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct PoolInfo {
    /// The pool id.
    pub poolid: String,
    /// Members, when listed.
    #[serde(default)]
    pub members: Vec<serde_json::Value>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vmid_as_string_or_number() {
        let a: ClusterVm =
            serde_json::from_str(r#"{"type":"lxc","vmid":"200","node":"pve1","template":"0"}"#)
                .unwrap();
        let b: ClusterVm =
            serde_json::from_str(r#"{"type":"qemu","vmid":300,"node":"pve1","template":1}"#)
                .unwrap();
        assert_eq!((a.vmid, a.template), (200, false));
        assert_eq!((b.vmid, b.template, b.kind), (300, true, GuestKind::Qemu));
        assert!(
            serde_json::from_str::<ClusterVm>(r#"{"type":"lxc","vmid":"x","node":"p"}"#).is_err()
        );
    }

    #[test]
    fn exec_status_booleans() {
        let s: AgentExecStatus = serde_json::from_str(
            r#"{"exited":1,"exitcode":0,"out-data":"hi\n","out-truncated":0}"#,
        )
        .unwrap();
        assert!(s.exited && !s.out_truncated);
        assert_eq!(s.exitcode, Some(0));
        let r: AgentExecStatus = serde_json::from_str(r#"{"exited":false}"#).unwrap();
        assert!(!r.exited);
        let t: AgentExecStatus = serde_json::from_str(r#"{"exited":"1","signal":"9"}"#).unwrap();
        assert_eq!((t.exited, t.signal), (true, Some(9)));
    }

    #[test]
    fn qemu_paused_is_not_running() {
        let s: GuestStatus =
            serde_json::from_str(r#"{"status":"running","qmpstatus":"paused"}"#).unwrap();
        assert!(!s.is_running());
        let s: GuestStatus = serde_json::from_str(r#"{"status":"running"}"#).unwrap();
        assert!(s.is_running());
    }

    #[test]
    fn backup_kind() {
        assert_eq!(
            backup_kind_from_volid("local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst"),
            Some(GuestKind::Lxc)
        );
        assert_eq!(
            backup_kind_from_volid("pbs:backup/vm/100/2024-01-02T03:04:05Z"),
            Some(GuestKind::Qemu)
        );
        assert_eq!(backup_kind_from_volid("local:iso/debian.iso"), None);
    }
}
