//! What a backup's restore needs that the preflight can know before the first write: read from
//! the configuration stored in the backup (`vzdump/extractconfig`), the token's privileges on
//! the paths PVE will check (`GET /access/permissions?path=`) and the cluster files the agent
//! can read beside `.vmlist` (`datacenter.cfg`, `sdn/vnets.cfg`).
//!
//! Each rule is PVE's, checked by PVE only inside the restore task or at the marker write,
//! where a refusal costs a half-made guest:
//! - NICs: `SDN.Use` on every bridge a NIC the request does not override is plugged into
//!   (pve-guest-common `PVE/GuestHelpers.pm` `check_vnet_access`; pve-container
//!   `PVE/API2/LXC.pm` `create_vm` and `PVE/LXC/Create.pm` `sanitize_and_merge_config`;
//!   qemu-server `PVE/API2/Qemu.pm` `create_vm` → `check_restore_permissions`);
//! - a privileged container needs `Sys.Modify` on `/` (pve-container `create_vm`); bind and
//!   device mount points are root's (same); raw `lxc.*` keys and `devN` are root's;
//! - a VM's host devices are root's, mapped ones need `Mapping.Use` (qemu-server
//!   `check_hostpci_perm`, `check_usb_perm`, via `check_mapping_access`);
//! - a `hookscript` runs as root on the node at every start and only root may set one;
//! - another guest's backup needs `VM.Backup` on its owner (always: pve-manager
//!   `PVE/API2/VZDump.pm` `extractconfig`) and `Datastore.AllocateSpace` on its storage unless
//!   `Datastore.Allocate` there (pve-storage `PVE/Storage.pm` `check_volume_access`); the
//!   grant advised is [`BACKUP_OWNER_ROLE`], that one privilege;
//! - `quota` on a mount point survives the storage-only restore and an unprivileged container
//!   never starts with it (pve-container `create_vm`, `API2/LXC/Status.pm` `vm_start`);
//! - a VM's `vmstate` and `args`, for every restore, and a VM without its guest agent
//!   (qemu-server `vm_start_nolock`, `check_vm_modify_config_perm`, `QemuServer/Agent.pm`);
//! - the disks a restore allocates must fit into the target storage's free space (qemu-server
//!   `restore_vma_archive` leaves a stub when they do not);
//! - the marker's tags must pass the cluster's tag policy (pve-guest-common
//!   `assert_tag_permissions`, `get_allowed_tags`).

use std::collections::{BTreeMap, BTreeSet};

use super::PreflightCheck;
use crate::error::ErrorCode;
use crate::pve::guest_config::{is_qemu_tar_archive, trunk_tags, StoredConfig};
use crate::pve::types::held_on;
use crate::pve::{GuestKind, PveClient};

/// The zone PVE assumes for a bridge that is no SDN vnet (`check_vnet_access`).
pub const LOCAL_ZONE: &str = "localnetwork";

/// The privileges the token holds, per path asked.
#[derive(Debug, Clone, Default)]
pub struct Held {
    by_path: BTreeMap<String, BTreeSet<String>>,
    unreadable: Option<String>,
    /// The code of the read that failed: no answer or no trust is the environment's (exit 6).
    unreadable_code: Option<ErrorCode>,
}

impl Held {
    /// Ask PVE for the token's privileges on each path (one request a path; PVE computes
    /// inheritance, pools and privilege separation). The requests are independent and go out
    /// together: one round trip, not one a path. The first path (in order) whose answer is an
    /// error makes the privileges unreadable.
    pub async fn read(pve: &PveClient, paths: &BTreeSet<String>) -> Self {
        let answers = futures_util::future::join_all(
            paths
                .iter()
                .map(|path| async move { (path, pve.permissions(None, Some(path)).await) }),
        )
        .await;
        let mut held = Held::default();
        for (path, answer) in answers {
            match answer {
                Ok(perms) => {
                    held.by_path.insert(path.clone(), held_on(&perms, path));
                }
                Err(e) => {
                    held.unreadable = Some(format!("GET /access/permissions?path={path}: {e}"));
                    held.unreadable_code = Some(e.code());
                    break;
                }
            }
        }
        held
    }

    /// A table, for tests: path → privileges.
    pub fn from_table(table: &[(&str, &[&str])]) -> Self {
        Held {
            by_path: table
                .iter()
                .map(|(p, privs)| (p.to_string(), privs.iter().map(|s| s.to_string()).collect()))
                .collect(),
            unreadable: None,
            unreadable_code: None,
        }
    }

    /// Whether `privilege` is held on `path`.
    pub fn has(&self, path: &str, privilege: &str) -> bool {
        self.by_path
            .get(path)
            .is_some_and(|privs| privs.contains(privilege))
    }
}

/// The cluster files read beside `.vmlist`.
#[derive(Debug, Clone, Default)]
pub struct ClusterFiles {
    /// `datacenter.cfg`: `None` when it does not exist (PVE's defaults hold).
    pub datacenter: Option<Result<String, String>>,
    /// SDN vnet → zone, from `sdn/vnets.cfg`.
    pub vnet_zones: BTreeMap<String, String>,
}

/// At most this much of a cluster file is read.
const CLUSTER_FILE_MAX: u64 = 1 << 20;

impl ClusterFiles {
    /// From the texts of `datacenter.cfg` and `sdn/vnets.cfg` as read (`None`: the file does
    /// not exist; `Err`: why it could not be read, naming it). A `vnets.cfg` that cannot be
    /// read counts as no vnet.
    pub fn from_texts(
        datacenter: Option<Result<String, String>>,
        vnets: Option<Result<String, String>>,
    ) -> Self {
        let vnet_zones = match vnets {
            Some(Ok(text)) => parse_vnet_zones(&text),
            _ => BTreeMap::new(),
        };
        ClusterFiles {
            datacenter: datacenter
                .map(|r| r.map(|text| text.chars().take(CLUSTER_FILE_MAX as usize).collect())),
            vnet_zones,
        }
    }

    /// The zone of a bridge: its SDN vnet's, else [`LOCAL_ZONE`].
    pub fn zone_of(&self, bridge: &str) -> &str {
        self.vnet_zones
            .get(bridge)
            .map_or(LOCAL_ZONE, String::as_str)
    }
}

/// `sdn/vnets.cfg` (pve-network `PVE/Network/SDN/VnetPlugin.pm`, a section config):
/// `vnet: <name>` then indented `zone <zone>` lines.
pub fn parse_vnet_zones(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if let Some(name) = line.strip_prefix("vnet:") {
            current = Some(name.trim().to_string());
            continue;
        }
        if !line.starts_with(char::is_whitespace) {
            current = None;
            continue;
        }
        let mut words = line.split_whitespace();
        if let (Some("zone"), Some(zone), Some(vnet)) = (words.next(), words.next(), &current) {
            out.insert(vnet.clone(), zone.to_string());
        }
    }
    out
}

/// What is asked: enough to know which paths and rules apply.
#[derive(Debug, Clone)]
pub struct Asked<'a> {
    /// This node.
    pub node: &'a str,
    /// The guest kind restored.
    pub guest: GuestKind,
    /// The backup volid.
    pub volid: &'a str,
    /// The target vmid (a backup of the same vmid needs no `VM.Backup`).
    pub vmid: Option<u32>,
    /// The backup's owner vmid (from PVE's listing or its name).
    pub owner: Option<u32>,
    /// Every NIC is overridden, isolated, by the request (a restore-test copy).
    pub isolate: bool,
    /// `[restore_test] lab_bridge`: an isolated VM copy's NICs are restored onto it.
    pub lab_bridge: Option<&'a str>,
    /// The token (for the grant commands).
    pub token_id: &'a str,
}

impl Asked<'_> {
    /// The lab bridge this restore puts NICs on: an isolated VM copy's, when the backup stores
    /// any NIC.
    pub fn lab_for(&self, stored: &StoredConfig) -> Option<&str> {
        self.lab_bridge.filter(|_| {
            self.isolate && self.guest == GuestKind::Qemu && !stored.nics(self.guest).is_empty()
        })
    }
}

/// The SDN paths PVE checks `SDN.Use` on for the stored NICs the request does not override.
pub fn sdn_paths(stored: &StoredConfig, asked: &Asked<'_>, files: &ClusterFiles) -> Vec<String> {
    if let Some(lab) = asked.lab_for(stored) {
        // Untagged NICs on the lab bridge (pve-guest-common `check_vnet_access`: the bridge's
        // own path when there is neither tag nor trunks).
        return vec![format!("/sdn/zones/{}/{lab}", files.zone_of(lab))];
    }
    if asked.isolate {
        return Vec::new();
    }
    let mut out = Vec::new();
    for nic in stored.nics(asked.guest) {
        let Some(bridge) = &nic.bridge else { continue };
        let base = format!("/sdn/zones/{}/{bridge}", files.zone_of(bridge));
        let mut paths = Vec::new();
        if let Some(tag) = &nic.tag {
            paths.push(format!("{base}/{tag}"));
        }
        if let Some(trunks) = &nic.trunks {
            paths.extend(trunk_tags(trunks).iter().map(|t| format!("{base}/{t}")));
        }
        if nic.tag.is_none() && nic.trunks.is_none() {
            paths.push(base);
        }
        for p in paths {
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

/// The backup's storage id.
fn backup_sid(volid: &str) -> &str {
    volid.split_once(':').map_or("", |(s, _)| s)
}

/// Every path whose privileges the checks need.
pub fn paths_needed(
    stored: Option<&StoredConfig>,
    asked: &Asked<'_>,
    files: &ClusterFiles,
) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    out.insert("/".to_string());
    let sid = backup_sid(asked.volid);
    if !sid.is_empty() {
        out.insert(format!("/storage/{sid}"));
    }
    if let Some(owner) = asked.owner {
        out.insert(format!("/vms/{owner}"));
    }
    if let Some(stored) = stored {
        out.extend(sdn_paths(stored, asked, files));
        out.extend(
            stored
                .host_devices()
                .iter()
                .filter_map(|d| d.mapping_path()),
        );
        if asked.guest == GuestKind::Qemu {
            out.extend(stored.resource_mapping_paths().into_iter().map(|(_, p)| p));
        }
    }
    out
}

/// `pveum` commands that grant `role` on `path` to the token and to its user (a
/// privilege-separated token holds only what both hold).
pub fn grant_commands(path: &str, role: &str, token_id: &str) -> String {
    let user = token_id.split('!').next().unwrap_or(token_id);
    format!(
        "`pveum acl modify {path} --tokens '{token_id}' --roles {role}` and `pveum acl modify {path} --users '{user}' --roles {role}`"
    )
}

/// The role of one privilege, `VM.Backup`, granted on the owner of a backup whose guest is
/// not in the pool: what pve-storage `check_volume_access` (backup branch) and pve-manager
/// `PVE/API2/VZDump.pm` `extractconfig` check there, and nothing else (no console, no power,
/// no guest agent: PVE's built-in `PVEVMUser` holds all three). With it the token may also
/// back that guest up and restore a backup over it with `force` (pve-container and
/// qemu-server `create_vm`), which the agent never sends.
pub const BACKUP_OWNER_ROLE: &str = "FelhomVMBackup";

/// `pveum role add` for [`BACKUP_OWNER_ROLE`].
pub fn backup_owner_role_add() -> String {
    format!("`pveum role add {BACKUP_OWNER_ROLE} -privs VM.Backup` (once per cluster)")
}

/// Another guest's backup: reading its stored configuration needs `VM.Backup` on its owner
/// always (pve-manager `PVE/API2/VZDump.pm` `extractconfig`: `check_volume_access` with no
/// vmid, then `VM.Backup` on the owner whatever the storage privileges); restoring it needs
/// `Datastore.Allocate` on its storage, or `Datastore.AllocateSpace` there and `VM.Backup` on
/// the owner, unless the owner is the target vmid (pve-storage `check_volume_access`).
pub fn access_check(asked: &Asked<'_>, held: &Held) -> PreflightCheck {
    let name = "backup_access";
    if let Some(why) = &held.unreadable {
        return PreflightCheck::fail(
            name,
            held.unreadable_code.unwrap_or(ErrorCode::PveRefused),
            format!("the token's privileges could not be read ({why}); check that PVE answers `pveum user permissions '{}'`", asked.token_id),
        );
    }
    let sid = backup_sid(asked.volid);
    let storage = format!("/storage/{sid}");
    let Some(owner) = asked.owner else {
        return PreflightCheck::pass(name, "the backup names no owner vmid");
    };
    let owner_path = format!("/vms/{owner}");
    let mut missing = Vec::new();
    let storage_ok = asked.vmid == Some(owner)
        || held.has(&storage, "Datastore.Allocate")
        || held.has(&storage, "Datastore.AllocateSpace");
    if !storage_ok {
        missing.push((
            format!("Datastore.AllocateSpace on {storage}"),
            grant_commands(&storage, "PVEDatastoreUser", asked.token_id),
        ));
    }
    if !held.has(&owner_path, "VM.Backup") {
        missing.push((
            format!("VM.Backup on {owner_path}"),
            format!(
                "{} (the role: {})",
                grant_commands(&owner_path, BACKUP_OWNER_ROLE, asked.token_id),
                backup_owner_role_add()
            ),
        ));
    }
    if missing.is_empty() {
        return PreflightCheck::pass(
            name,
            format!("the token holds VM.Backup on {owner_path} and may use backups on {storage} (backup of vmid {owner})"),
        );
    }
    let (what, how): (Vec<String>, Vec<String>) = missing.into_iter().unzip();
    PreflightCheck::fail(
        name,
        ErrorCode::BackupAccess,
        format!(
            "backup {} belongs to vmid {owner}; reading its stored configuration and restoring it need {} (pve-manager extractconfig, pve-storage check_volume_access), which token {} lacks; grant them: {}",
            asked.volid,
            what.join(" and "),
            asked.token_id,
            how.join("; ")
        ),
    )
}

/// The `/etc/network/interfaces` stanza of a lab bridge named `bridge`: no ports, no address,
/// IPv6 off (else the kernel gives it a link-local address, and pveproxy and sshd listen on
/// `::`), the strict IPv4 reverse-path filter and no forwarding on it
/// ([`crate::lab_kernel::post_up_lines`]).
pub fn lab_bridge_stanza(bridge: &str) -> String {
    let post_up: Vec<String> = crate::lab_kernel::post_up_lines(bridge)
        .iter()
        .map(|l| format!(" / `    {l}`"))
        .collect();
    format!(
        "`auto {bridge}` / `iface {bridge} inet manual` / `    bridge-ports none` / `    bridge-stp off` / `    bridge-fd 0`{} in /etc/network/interfaces, then `ifreload -a`",
        post_up.concat()
    )
}

/// What is wrong with the lab bridge `bridge` as PVE lists it (`GET /nodes/{node}/network`: a
/// row of pve-common `PVE/Network/Interfaces.pm` `__read_etc_network_interfaces`), each with
/// its fix. `row`: `None` when the list has no such bridge. What the list cannot show (IPv6,
/// the reverse-path filter, forwarding, ports and addresses added outside the file) is
/// [`crate::lab_kernel::faults`]'s.
pub fn lab_bridge_faults(bridge: &str, row: Option<&serde_json::Value>) -> Vec<String> {
    let Some(row) = row else {
        return vec![format!(
            "bridge {bridge} is not in this node's network configuration; make it: {}",
            lab_bridge_stanza(bridge)
        )];
    };
    let text = |k: &str| -> String {
        match row.get(k) {
            Some(serde_json::Value::String(s)) => crate::error::outside_text_max(s.trim(), 256),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => String::new(),
        }
    };
    let mut faults = Vec::new();
    let kind = text("type");
    if kind != "bridge" {
        faults.push(format!(
            "{bridge} is a {} in /etc/network/interfaces, not a Linux bridge; make it one: {}",
            if kind.is_empty() {
                "interface of no type"
            } else {
                &kind
            },
            lab_bridge_stanza(bridge)
        ));
    }
    let ports = text("bridge_ports");
    if !ports.is_empty() && ports != "none" {
        faults.push(format!(
            "bridge {bridge} has port(s) {ports}: a VM copy on it would reach their network as a twin of its original; set `bridge-ports none` in its stanza of /etc/network/interfaces (and give those ports another bridge), then `ifreload -a`"
        ));
    }
    let v4: Vec<String> = ["address", "cidr", "gateway"]
        .iter()
        .filter(|k| !text(k).is_empty())
        .map(|k| format!("{k} {}", text(k)))
        .chain(
            matches!(text("method").as_str(), "static" | "dhcp")
                .then(|| format!("inet {}", text("method"))),
        )
        .collect();
    if !v4.is_empty() {
        faults.push(format!(
            "bridge {bridge} has an IPv4 address of the node ({}): a VM copy on it would reach the node (pveproxy, sshd); make its stanza `iface {bridge} inet manual` with no address or gateway line, then `ifreload -a`",
            v4.join(", ")
        ));
    }
    let v6: Vec<String> = ["address6", "cidr6", "gateway6"]
        .iter()
        .filter(|k| !text(k).is_empty())
        .map(|k| format!("{k} {}", text(k)))
        .chain(
            matches!(text("method6").as_str(), "static" | "dhcp" | "auto")
                .then(|| format!("inet6 {}", text("method6"))),
        )
        .collect();
    if !v6.is_empty() {
        faults.push(format!(
            "bridge {bridge} has an IPv6 address of the node ({}): a VM copy on it would reach the node (pveproxy and sshd listen on `::`); remove its `iface {bridge} inet6` stanza and address lines, then `ifreload -a`",
            v6.join(", ")
        ));
    }
    if text("active") != "1" && faults.is_empty() {
        faults.push(format!(
            "bridge {bridge} is configured but not up in the kernel (PVE's `active` is not set), so a VM copy's start would fail (qemu-server's pve-bridge: \"bridge '{bridge}' does not exist\"); bring it up: `ifreload -a` (or `ifup {bridge}`)"
        ));
    }
    faults
}

/// The lab bridge an isolated VM copy's NICs go onto, as PVE lists the node's bridges
/// (`GET /nodes/{node}/network`) and as the kernel has it: refused before any write when it is
/// missing, has ports, an address of the node, or is down ([`lab_bridge_faults`],
/// `config_invalid`), or when the kernel shows a port, a device on top, an address, IPv6 on,
/// no strict IPv4 reverse-path filter or forwarding on it ([`crate::lab_kernel::faults`],
/// `lab_bridge_open`), so no copy ever lands on a production bridge with its original's MACs,
/// nor reaches the node or beyond from the lab bridge.
pub async fn lab_bridge_check(pve: &PveClient, node: &str, bridge: &str) -> PreflightCheck {
    let name = "lab_bridge";
    let rows = match pve.node_bridges(node).await {
        Ok(rows) => rows,
        Err(e) => {
            return PreflightCheck::fail(
                name,
                e.code(),
                format!("cannot read node {node}'s bridges (GET /nodes/{node}/network) to check the lab bridge {bridge}: {e}; nothing was restored"),
            )
        }
    };
    let row = rows
        .iter()
        .find(|row| row.get("iface").and_then(serde_json::Value::as_str) == Some(bridge));
    let faults = lab_bridge_faults(bridge, row);
    // The kernel's own view: what PVE's list cannot show (ports and devices added outside
    // /etc/network/interfaces, IPv6, the reverse-path filter, forwarding).
    let kernel = crate::lab_kernel::faults_now(bridge, crate::lab_kernel::Ports::None);
    if faults.is_empty() && kernel.is_empty() {
        return PreflightCheck::pass(
            name,
            format!("the lab bridge {bridge} has no port and no address of node {node}, IPv6 is off on it, and the kernel drops what a copy sends there to the node or beyond (strict IPv4 reverse-path filter, no forwarding)"),
        );
    }
    let code = if faults.is_empty() {
        ErrorCode::LabBridgeOpen
    } else {
        ErrorCode::ConfigInvalid
    };
    PreflightCheck::fail(
        name,
        code,
        format!(
            "[restore_test] lab_bridge: {}; an isolated VM copy is not restored onto it (`felhom-agent doctor` checks it)",
            faults.into_iter().chain(kernel).collect::<Vec<_>>().join("; ")
        ),
    )
}

/// The stored NICs' bridges: `SDN.Use` on each path PVE checks.
pub fn network_check(
    stored: &StoredConfig,
    asked: &Asked<'_>,
    files: &ClusterFiles,
    held: &Held,
) -> PreflightCheck {
    let name = "network";
    if let Some(lab) = asked.lab_for(stored) {
        let paths = sdn_paths(stored, asked, files);
        let lacking: Vec<&String> = paths.iter().filter(|p| !held.has(p, "SDN.Use")).collect();
        if lacking.is_empty() {
            return PreflightCheck::pass(
                name,
                format!(
                    "{} stored NIC(s) are restored onto the lab bridge {lab} with their stored models and MACs; the token holds SDN.Use on {}",
                    stored.nics(asked.guest).len(),
                    paths.join(", ")
                ),
            );
        }
        return PreflightCheck::fail(
            name,
            ErrorCode::SdnDenied,
            format!(
                "the restore of backup {} puts its NIC(s) onto the lab bridge {lab} ([restore_test] lab_bridge); PVE checks SDN.Use on {} before the restore (qemu-server check_bridge_access, pve-guest-common check_vnet_access), and token {} lacks it; grant it: {}",
                asked.volid,
                lacking.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", "),
                asked.token_id,
                lacking
                    .iter()
                    .map(|p| grant_commands(p, "PVESDNUser", asked.token_id))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        );
    }
    if asked.isolate {
        return PreflightCheck::pass(
            name,
            format!(
                "{} stored NIC(s) are all replaced by isolated ones (no bridge, link down): no SDN.Use needed",
                stored.nics(asked.guest).len()
            ),
        );
    }
    let paths = sdn_paths(stored, asked, files);
    let lacking: Vec<&String> = paths.iter().filter(|p| !held.has(p, "SDN.Use")).collect();
    if lacking.is_empty() {
        return PreflightCheck::pass(
            name,
            if paths.is_empty() {
                "the backup's NICs are on no bridge".to_string()
            } else {
                format!("the token holds SDN.Use on {}", paths.join(", "))
            },
        );
    }
    let nics: Vec<String> = stored
        .nics(asked.guest)
        .iter()
        .filter(|n| n.bridge.is_some())
        .map(|n| n.describe())
        .collect();
    let how: Vec<String> = lacking
        .iter()
        .map(|p| grant_commands(p, "PVESDNUser", asked.token_id))
        .collect();
    PreflightCheck::fail(
        name,
        ErrorCode::SdnDenied,
        format!(
            "backup {} restores NIC(s) {}; PVE checks SDN.Use on {} inside the restore task (check_vnet_access), and token {} lacks it; grant it: {}",
            asked.volid,
            nics.join(", "),
            lacking
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            asked.token_id,
            how.join("; ")
        ),
    )
}

/// What the backup carries that only root may restore or that the agent refuses to bring onto
/// the node.
pub fn contents_check(stored: &StoredConfig, asked: &Asked<'_>, held: &Held) -> PreflightCheck {
    let name = "contents";
    let volid = asked.volid;
    if let Some(script) = stored.get("hookscript") {
        return PreflightCheck::fail(
            name,
            ErrorCode::BackupHookscript,
            format!(
                "backup {volid} carries hookscript {:?}, a script PVE runs as root on node {} at every start of the guest, which this token could not remove; remove it from the guest (`{} set <vmid> --delete hookscript`), back it up again and restore that backup",
                crate::error::outside_text(script),
                asked.node,
                match asked.guest {
                    GuestKind::Lxc => "pct",
                    GuestKind::Qemu => "qm",
                }
            ),
        );
    }
    if asked.isolate && asked.guest == GuestKind::Qemu && is_qemu_tar_archive(volid) {
        return PreflightCheck::fail(
            name,
            ErrorCode::BackupMissing,
            format!(
                "backup {volid} is a VM backup in the old .tar format, which PVE restores with no option (qemu-server restore_tar_archive), so its copy's NICs cannot be overridden at the restore and the restore test does not restore it; back the VM up again (vma) or leave it out of [restore_test] sources"
            ),
        );
    }
    if stored.is_template() {
        return PreflightCheck::fail(
            name,
            ErrorCode::BackupTemplate,
            format!(
                "backup {volid} is of a template (`template: 1`): PVE restores it as a template (pve-container and qemu-server create_vm convert it again after the restore), which never starts, so nothing can be verified in it; back up a guest made from the template instead{}",
                if asked.isolate { " and list that backup in the restore test's sources" } else { "" }
            ),
        );
    }
    let mut converted = false;
    match asked.guest {
        GuestKind::Lxc => {
            // A privileged backup: the agent restores every container with `unprivileged=1`,
            // which wins over the stored value (pve-container `PVE/API2/LXC.pm` `create_vm`
            // takes the request's `unprivileged` when given, so no `Sys.Modify` is checked) and
            // makes the copy an unprivileged container, its files shifted into the container's
            // id range at extraction: PVE's documented conversion.
            converted = !stored.unprivileged();
            let host: Vec<String> = stored
                .mount_points()
                .into_iter()
                .filter(|m| m.is_host_path())
                .map(|m| format!("{} ({})", m.key, crate::error::outside_text(&m.volume)))
                .collect();
            let quota: Vec<String> = stored
                .mount_points()
                .into_iter()
                .filter(|m| m.quota)
                .map(|m| m.key)
                .collect();
            if !quota.is_empty() {
                return PreflightCheck::fail(
                    name,
                    ErrorCode::BackupQuota,
                    format!(
                        "backup {volid} has quota=1 on mount point(s) {}: the restore keeps each stored mount point's options (pve-container create_vm, storage only mode) and the agent restores every container unprivileged, which PVE never starts with quotas (\"Quotas are not supported by unprivileged containers.\", pve-container vm_start); turn the quota off in the guest (`pct set <vmid> --{} <volume>,…` without quota=1), back it up again and restore that backup",
                        quota.join(", "),
                        quota[0]
                    ),
                );
            }
            let raw: Vec<&str> = stored.raw_lxc_keys();
            let devs = stored.devices();
            if !host.is_empty() || !raw.is_empty() || !devs.is_empty() {
                let mut what = Vec::new();
                if !host.is_empty() {
                    what.push(format!("bind or device mount point(s) {}", host.join(", ")));
                }
                if !devs.is_empty() {
                    what.push(format!("device passthrough {}", devs.join(", ")));
                }
                if !raw.is_empty() {
                    what.push(format!("raw lxc keys {}", raw.join(", ")));
                }
                return PreflightCheck::fail(
                    name,
                    ErrorCode::BackupMounts,
                    format!(
                        "backup {volid} carries {}, which only root may restore (pve-container create_vm: \"restoring '<mp>' to bind mount is only possible for root\"); remove them from the guest (`pct set <vmid> --delete mp0` …), back it up again and restore that backup",
                        what.join("; ")
                    ),
                );
            }
        }
        GuestKind::Qemu => {
            let breaches = stored.isolation_breaches(GuestKind::Qemu);
            // Refused for every restore, isolated or not: `vmstate` is resumed at the first
            // start, twin of the production VM on whatever network it keeps, and then freed,
            // though it is the production VM's volume (qemu-server `vm_start_nolock`: resume,
            // then `vdisk_free` of the state); `args` is root's to set (qemu-server
            // `check_vm_modify_config_perm`: "only root can set 'args' config") and restored
            // verbatim (`restore_update_config_line`), so it may name the production VM's host
            // resources (a disk, a socket, a chardev) for the copy to open.
            let always: Vec<String> = breaches
                .iter()
                .filter(|b| b.key == "vmstate" || b.key == "args")
                .map(|b| format!("{} ({})", b.key, b.why))
                .collect();
            if let Some(first) = breaches
                .iter()
                .find(|b| b.key == "vmstate" || b.key == "args")
            {
                return PreflightCheck::fail(
                    name,
                    first.code,
                    format!(
                        "backup {volid} carries {}: a restore keeps every stored line (qemu-server restore_update_config_line), `vmstate` makes the restored VM resume the production VM's memory, connections included, and free that state volume at its start (vm_start_nolock), and `args` is set only by root (check_vm_modify_config_perm); remove them from the guest (`qm set <vmid> --delete vmstate,args`, or start the hibernated VM once), back it up again and restore that backup",
                        always.join(", ")
                    ),
                );
            }
            if asked.isolate {
                if let Some(first) = breaches.first() {
                    let all: Vec<String> = breaches
                        .iter()
                        .map(|b| format!("{} ({})", b.key, b.why))
                        .collect();
                    return PreflightCheck::fail(
                        name,
                        first.code,
                        format!(
                            "backup {volid} carries {}: a restored copy keeps every stored line (qemu-server restore_update_config_line), so it would reach the host or a network without any NIC; an isolated copy of it is refused before any write; leave this backup out of the restore test's sources, or run the selftest with `--network=stored` on a guest meant to serve",
                            all.join(", ")
                        ),
                    );
                }
            }
            let devices = stored.host_devices();
            let raw: Vec<&str> = devices
                .iter()
                .filter(|d| d.mapping.is_none())
                .map(|d| d.key.as_str())
                .collect();
            if !raw.is_empty() {
                return PreflightCheck::fail(
                    name,
                    ErrorCode::BackupDevices,
                    format!(
                        "backup {volid} passes host device(s) {} to the VM, which only root may restore (qemu-server: \"only root can set '<key>' config for non-mapped devices\"); use a resource mapping instead (`pvesh create /cluster/mapping/pci …`), or remove them, back the VM up again and restore that backup",
                        raw.join(", ")
                    ),
                );
            }
            let unmapped: Vec<String> = devices
                .iter()
                .filter_map(|d| d.mapping_path())
                .chain(stored.resource_mapping_paths().into_iter().map(|(_, p)| p))
                .filter(|p| !held.has(p, "Mapping.Use"))
                .collect();
            if !unmapped.is_empty() {
                let how: Vec<String> = unmapped
                    .iter()
                    .map(|p| grant_commands(p, "PVEMappingUser", asked.token_id))
                    .collect();
                return PreflightCheck::fail(
                    name,
                    ErrorCode::BackupDevices,
                    format!(
                        "backup {volid} uses mapped resource(s) on {}, and token {} lacks Mapping.Use there (PVE checks it inside the restore task: qemu-server check_mapping_access); grant it: {}",
                        unmapped.join(", "),
                        asked.token_id,
                        how.join("; ")
                    ),
                );
            }
            if !stored.guest_agent_enabled() {
                return PreflightCheck::fail(
                    name,
                    ErrorCode::GuestAgentOff,
                    format!(
                        "backup {volid} is of a VM whose config does not enable its QEMU guest agent (`agent: 1`; the backup has {}), so PVE would answer every command in it \"No QEMU guest agent configured\" (qemu-server QemuServer/Agent.pm assert_agent_available) and nothing could prove its launch, bootstrap or check it; install qemu-guest-agent in the guest, set `qm set <vmid> --agent 1`, back it up again and restore that backup",
                        stored
                            .get("agent")
                            .map_or("no agent line".to_string(), |a| format!("agent: {}", crate::error::outside_text(a)))
                    ),
                );
            }
            if let Some(os) = stored.windows_ostype() {
                return PreflightCheck::fail(
                    name,
                    ErrorCode::GuestOsUnjudged,
                    format!(
                        "backup {volid} is of a Windows VM (`ostype: {os}`), which the agent cannot judge: its launch proof, boot wait, bootstrap and checks run /bin/sh, systemd and osquery's Linux tables inside the guest, none of which a Windows guest has; it is not restored. Leave it out of [restore_test] sources (or its guest out of the pool) and prove its backups another way"
                    ),
                );
            }
        }
    }
    PreflightCheck::pass(
        name,
        if converted {
            format!("no hookscript, host path or host device in the backup; backup {volid} is of a privileged container and is restored as an unprivileged one (the request's unprivileged=1, PVE's conversion: no Sys.Modify needed)")
        } else {
            "no hookscript, host path, host device or template in the backup".to_string()
        },
    )
}

/// Whether the target storage has room for the disks the restore allocates there, at their
/// stored sizes ([`StoredConfig::allocated_disks`]; the request names one storage, and PVE
/// puts every disk on it). A VM restore that fails to allocate leaves its config behind,
/// empty and outside the pool, where the token cannot remove it (qemu-server
/// `PVE/API2/Qemu.pm` `create_vm`: "VM <vmid> state is NOT cleaned up"); a thin pool filled
/// by a restore stops every guest on it. So the stored sizes must fit into what PVE reports
/// free (`avail` of `GET /nodes/<node>/storage/<storage>/status`), thin storage or not.
pub fn space_check(
    stored: &StoredConfig,
    asked: &Asked<'_>,
    storage: &str,
    avail: Option<u64>,
) -> PreflightCheck {
    let name = "space";
    let disks = stored.allocated_disks(asked.guest);
    // Sizes come from a backup: hostile until checked, so the sum saturates.
    let known: u64 = disks
        .iter()
        .filter_map(|(_, s)| *s)
        .fold(0, u64::saturating_add);
    let no_size: Vec<&str> = disks
        .iter()
        .filter(|(_, s)| s.is_none())
        .map(|(k, _)| k.as_str())
        .collect();
    let listed = |disks: &[(String, Option<u64>)]| {
        disks
            .iter()
            .map(|(k, s)| match s {
                Some(s) => format!("{k} {}", gib(*s)),
                None => format!("{k} (no size)"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some(avail) = avail else {
        return PreflightCheck::pass(
            name,
            format!(
                "storage {storage:?} reports no free space; the backup's disks need {}",
                gib(known)
            ),
        );
    };
    let vmid = asked
        .vmid
        .map_or("the new guest".to_string(), |v| format!("vmid {v}"));
    if known > avail {
        return PreflightCheck::fail(
            name,
            ErrorCode::StorageFull,
            format!(
                "the restore of backup {} into {vmid} allocates {} on storage {storage:?} of node {} ({}), which has {} free; PVE allocates every disk at its stored size before it writes any data, and a VM restore that fails there leaves its config behind outside the pool; free space on {storage:?} or restore onto a storage with room (`pvesm status --content {}`)",
                asked.volid,
                gib(known),
                asked.node,
                listed(&disks),
                gib(avail),
                super::content_needed(asked.guest)
            ),
        );
    }
    PreflightCheck::pass(
        name,
        format!(
            "the backup's disks ({}) fit into the {} free on storage {storage:?}{}",
            if disks.is_empty() {
                "none".to_string()
            } else {
                listed(&disks)
            },
            gib(avail),
            if no_size.is_empty() {
                String::new()
            } else {
                format!(
                    " (no stored size for {}: PVE refuses or sizes those itself)",
                    no_size.join(", ")
                )
            }
        ),
    )
}

/// Bytes as GiB with two decimals, and the bytes.
fn gib(bytes: u64) -> String {
    format!(
        "{:.2} GiB ({bytes} bytes)",
        bytes as f64 / f64::from(1u32 << 30)
    )
}

/// The checks of one backup by itself (for `doctor`, which has no request): its stored
/// configuration read from PVE, then [`access_check`], [`contents_check`] and
/// [`network_check`] for a restore into some other vmid. `isolate`: restored as a restore-test
/// copy.
pub async fn backup_checks(
    pve: &PveClient,
    node: &str,
    volid: &str,
    isolate: bool,
    lab_bridge: Option<&str>,
    token_id: &str,
    files: &ClusterFiles,
) -> Vec<PreflightCheck> {
    let guest = crate::pve::types::backup_kind_from_volid(volid).unwrap_or(GuestKind::Lxc);
    let asked = Asked {
        node,
        guest,
        volid,
        vmid: None,
        owner: super::owner_from_volid(volid),
        isolate,
        lab_bridge,
        token_id,
    };
    let stored = pve.extract_config(node, volid).await;
    let stored = stored.as_deref().map(StoredConfig::parse);
    let held = Held::read(pve, &paths_needed(stored.as_ref().ok(), &asked, files)).await;
    let mut out = vec![access_check(&asked, &held)];
    match &stored {
        Ok(sc) => {
            out.push(contents_check(sc, &asked, &held));
            out.push(network_check(sc, &asked, files, &held));
        }
        Err(e) => out.push(PreflightCheck::fail(
            "backup",
            ErrorCode::BackupMissing,
            format!("the configuration stored in backup {volid} could not be read ({e}); check that it exists (`pvesm list {} --content backup`) and that the token may read it", backup_sid(volid)),
        )),
    }
    out
}

/// `datacenter.cfg`'s tag policy: the marker adds the tags `felhom` and `felhom-<txn>`; a token
/// without `Sys.Modify` on `/` may add a tag only when the policy is `free` (PVE's default), or
/// the tag is listed or (`existing`) already on a guest, and never a registered tag. The
/// per-transaction tag is new by construction, so only `free` lets the marker through.
pub fn tags_check(
    files: &ClusterFiles,
    held: &Held,
    fleet_tag: &str,
    token_id: &str,
) -> PreflightCheck {
    let name = "tags";
    if held.has("/", "Sys.Modify") {
        return PreflightCheck::pass(
            name,
            "the token holds Sys.Modify on /: no tag policy applies to it",
        );
    }
    let text = match &files.datacenter {
        None => {
            return PreflightCheck::pass(
                name,
                "no datacenter.cfg: PVE's default tag policy (user-allow=free) lets the marker's tags through",
            )
        }
        Some(Err(e)) => {
            return PreflightCheck::fail(
                name,
                ErrorCode::ConfigInvalid,
                format!("the cluster's tag policy could not be read ({e}); the root exec helper hands datacenter.cfg over to the agent (`systemctl start felhom-agent-exec.socket`), or without it the agent's user must read it"),
            )
        }
        Some(Ok(t)) => t,
    };
    let policy = TagPolicy::parse(text);
    let fix = "`pvesh set /cluster/options --user-tag-access user-allow=free`";
    if policy.user_allow != "free" {
        return PreflightCheck::fail(
            name,
            ErrorCode::TagPolicy,
            format!(
                "the cluster's tag policy (datacenter.cfg user-tag-access: user-allow={}) lets token {token_id} add only tags that are listed or already in use, and the marker's tag {fleet_tag}-<transaction> is new for every transaction (pve-guest-common assert_tag_permissions); allow free tags with {fix}, or grant Sys.Modify on /",
                policy.user_allow
            ),
        );
    }
    let registered: Vec<&String> = policy
        .registered
        .iter()
        .filter(|t| t.as_str() == fleet_tag || t.starts_with(&format!("{fleet_tag}-")))
        .collect();
    if !registered.is_empty() {
        return PreflightCheck::fail(
            name,
            ErrorCode::TagPolicy,
            format!(
                "the cluster registers tag(s) {} (datacenter.cfg registered-tags), which only a holder of Sys.Modify on / may set, and the agent's marker uses them; remove them from registered-tags (`pvesh set /cluster/options --registered-tags …`)",
                registered.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
            ),
        );
    }
    PreflightCheck::pass(
        name,
        "the cluster's tag policy (user-allow=free) lets the marker's tags through",
    )
}

/// `user-tag-access` and `registered-tags` of `datacenter.cfg` (pve-cluster
/// `PVE/DataCenterConfig.pm`: `user-tag-access: user-allow=<free|existing|list|none>,
/// user-allow-list=<tag;…>`, `registered-tags: <tag;…>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagPolicy {
    /// `free` (PVE's default), `existing`, `list` or `none`.
    pub user_allow: String,
    /// Registered tags.
    pub registered: Vec<String>,
}

impl TagPolicy {
    /// Read from `datacenter.cfg`'s text.
    pub fn parse(text: &str) -> Self {
        let mut p = TagPolicy {
            user_allow: "free".to_string(),
            registered: Vec::new(),
        };
        for line in text.lines() {
            let Some((k, v)) = line.split_once(':') else {
                continue;
            };
            match k.trim() {
                "user-tag-access" => {
                    for item in v.trim().split(',') {
                        if let Some(("user-allow", a)) =
                            item.split_once('=').map(|(a, b)| (a.trim(), b.trim()))
                        {
                            p.user_allow = a.to_ascii_lowercase();
                        }
                    }
                }
                "registered-tags" => {
                    p.registered = v
                        .split(|c: char| c == ';' || c == ',' || c.is_whitespace())
                        .filter(|t| !t.is_empty())
                        .map(str::to_ascii_lowercase)
                        .collect();
                }
                _ => {}
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "felhom@pve!agent";

    fn asked(guest: GuestKind, isolate: bool) -> Asked<'static> {
        Asked {
            node: "pve1",
            guest,
            volid: "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst",
            vmid: Some(120),
            owner: Some(200),
            isolate,
            lab_bridge: None,
            token_id: TOKEN,
        }
    }

    const CT: &str = "arch: amd64\nunprivileged: 1\nrootfs: local-lvm:vm-200-disk-0,size=8G\n\
                      net0: name=eth0,bridge=vmbr0,ip=10.1.2.3/24\nnet1: name=eth1,bridge=vnet7,tag=30\n\
                      net2: name=eth2,bridge=vmbr2,trunks=10;12-13\n";

    #[test]
    fn sdn_paths_follow_check_vnet_access() {
        let files = ClusterFiles {
            datacenter: None,
            vnet_zones: parse_vnet_zones(
                "vnet: vnet7\n\tzone evpn1\n\ttag 30\n\nvnet: other\n\tzone z2\n",
            ),
        };
        let stored = StoredConfig::parse(CT);
        assert_eq!(
            sdn_paths(&stored, &asked(GuestKind::Lxc, false), &files),
            [
                "/sdn/zones/localnetwork/vmbr0",
                "/sdn/zones/evpn1/vnet7/30",
                "/sdn/zones/localnetwork/vmbr2/10",
                "/sdn/zones/localnetwork/vmbr2/12",
                "/sdn/zones/localnetwork/vmbr2/13",
            ]
        );
        assert!(sdn_paths(&stored, &asked(GuestKind::Lxc, true), &files).is_empty());
    }

    #[test]
    fn an_isolated_vm_copy_with_a_lab_bridge_needs_sdn_use_there_and_nowhere_else() {
        let stored = StoredConfig::parse(
            "net0: virtio=BC:24:11:00:03:00,bridge=vmbr0\nnet1: e1000=BC:24:11:00:03:01,bridge=vmbr1,tag=20\n",
        );
        let files = ClusterFiles::default();
        let vm = Asked {
            guest: GuestKind::Qemu,
            lab_bridge: Some("vmbr9"),
            ..asked(GuestKind::Qemu, true)
        };
        assert_eq!(
            sdn_paths(&stored, &vm, &files),
            ["/sdn/zones/localnetwork/vmbr9"]
        );
        let stored_bridges = Held::from_table(&[
            ("/sdn/zones/localnetwork/vmbr0", &["SDN.Use"]),
            ("/sdn/zones/localnetwork/vmbr1", &["SDN.Use"]),
        ]);
        let c = network_check(&stored, &vm, &files, &stored_bridges);
        assert_eq!(c.code, Some(ErrorCode::SdnDenied), "{c:?}");
        assert!(
            c.message.contains("lab bridge vmbr9")
                && c.message.contains("pveum acl modify /sdn/zones/localnetwork/vmbr9 --tokens 'felhom@pve!agent' --roles PVESDNUser"),
            "{}",
            c.message
        );
        let lab = Held::from_table(&[("/sdn/zones/localnetwork/vmbr9", &["SDN.Use"])]);
        let c = network_check(&stored, &vm, &files, &lab);
        assert_eq!(c.code, None, "{c:?}");
        // Without NICs, a container, or not isolated: the lab bridge is not asked for.
        let bare = StoredConfig::parse("scsi0: x\n");
        assert!(sdn_paths(&bare, &vm, &files).is_empty());
        let ct = Asked {
            lab_bridge: Some("vmbr9"),
            ..asked(GuestKind::Lxc, true)
        };
        assert!(sdn_paths(&StoredConfig::parse(CT), &ct, &files).is_empty());
    }

    #[test]
    fn a_bridge_without_sdn_use_is_refused_with_the_grant() {
        let stored = StoredConfig::parse("unprivileged: 1\nnet0: name=eth0,bridge=vmbr0\n");
        let files = ClusterFiles::default();
        let none = Held::from_table(&[]);
        let c = network_check(&stored, &asked(GuestKind::Lxc, false), &files, &none);
        assert_eq!(c.code, Some(ErrorCode::SdnDenied), "{c:?}");
        assert!(
            c.message
                .contains("SDN.Use on /sdn/zones/localnetwork/vmbr0"),
            "{}",
            c.message
        );
        assert!(c.message.contains("pveum acl modify /sdn/zones/localnetwork/vmbr0 --tokens 'felhom@pve!agent' --roles PVESDNUser"), "{}", c.message);
        assert!(c.message.contains("--users 'felhom@pve'"), "{}", c.message);
        let held = Held::from_table(&[("/sdn/zones/localnetwork/vmbr0", &["SDN.Use"])]);
        let c = network_check(&stored, &asked(GuestKind::Lxc, false), &files, &held);
        assert_eq!(c.code, None, "{c:?}");
        // An isolated copy needs none.
        let c = network_check(&stored, &asked(GuestKind::Lxc, true), &files, &none);
        assert_eq!(c.code, None, "{c:?}");
    }

    #[test]
    fn what_only_root_may_restore_is_refused_each_with_its_code() {
        let none = Held::from_table(&[]);
        let a = asked(GuestKind::Lxc, false);
        // A privileged backup is restored unprivileged (the request's unprivileged=1 wins):
        // no refusal, and the check says so.
        let converted = contents_check(&StoredConfig::parse("arch: amd64\nrootfs: x\n"), &a, &none);
        assert_eq!(converted.code, None, "{converted:?}");
        assert!(
            converted.message.contains("restored as an unprivileged"),
            "{converted:?}"
        );
        let cases = [
            ("unprivileged: 1\ntemplate: 1\n", ErrorCode::BackupTemplate),
            (
                "unprivileged: 1\nmp0: /srv/data,mp=/data\n",
                ErrorCode::BackupMounts,
            ),
            (
                "unprivileged: 1\nlxc.mount.entry: /dev/x dev/x none bind\n",
                ErrorCode::BackupMounts,
            ),
            (
                "unprivileged: 1\ndev0: /dev/ttyUSB0\n",
                ErrorCode::BackupMounts,
            ),
            (
                "unprivileged: 1\nhookscript: local:snippets/x.pl\n",
                ErrorCode::BackupHookscript,
            ),
        ];
        for (text, code) in cases {
            let c = contents_check(&StoredConfig::parse(text), &a, &none);
            assert_eq!(c.code, Some(code), "{text}: {c:?}");
        }
        let ok = contents_check(
            &StoredConfig::parse("unprivileged: 1\nmp0: local-lvm:vm-200-disk-1,mp=/var\n"),
            &a,
            &none,
        );
        assert_eq!(ok.code, None, "{ok:?}");
        let vm = asked(GuestKind::Qemu, false);
        let raw = contents_check(&StoredConfig::parse("hostpci0: 0000:01:00.0\n"), &vm, &none);
        assert_eq!(raw.code, Some(ErrorCode::BackupDevices));
        let mapped = StoredConfig::parse("usb0: mapping=stick\n");
        assert_eq!(
            contents_check(&mapped, &vm, &none).code,
            Some(ErrorCode::BackupDevices)
        );
        let held = Held::from_table(&[("/mapping/usb/stick", &["Mapping.Use"])]);
        assert_eq!(
            contents_check(&mapped, &vm, &held).code,
            Some(ErrorCode::GuestAgentOff)
        );
        let mapped_agent =
            StoredConfig::parse("usb0: mapping=stick\nagent: 1,fstrim_cloned_disks=1\n");
        assert_eq!(contents_check(&mapped_agent, &vm, &held).code, None);
        // A virtiofs directory and the host's RNG: Mapping.Use inside the task too.
        for (text, path) in [
            ("virtiofs0: share1,cache=auto\n", "/mapping/dir/share1"),
            ("rng0: source=/dev/hwrng\n", "/mapping/hwrng"),
        ] {
            let sc = StoredConfig::parse(text);
            let c = contents_check(&sc, &vm, &none);
            assert_eq!(c.code, Some(ErrorCode::BackupDevices), "{text}: {c:?}");
            assert!(c.message.contains(path), "{c:?}");
            assert!(paths_needed(Some(&sc), &vm, &ClusterFiles::default()).contains(path));
            let held = Held::from_table(&[(path, &["Mapping.Use"])]);
            let with_agent = StoredConfig::parse(&format!("{text}agent: enabled=1\n"));
            assert_eq!(contents_check(&with_agent, &vm, &held).code, None, "{text}");
        }
        // An isolated copy: every key that reaches the host or a network without a NIC is
        // refused, mapped and held or not.
        let iso = Asked {
            volid: "local:backup/vzdump-qemu-300-2026_01_01-00_00_00.vma.zst",
            ..asked(GuestKind::Qemu, true)
        };
        for (text, code) in [
            ("args: -netdev user,id=x\n", ErrorCode::BackupArgs),
            ("hostpci0: mapping=vf\n", ErrorCode::BackupDevices),
            ("virtiofs0: share1\n", ErrorCode::BackupHostDir),
            (
                "ivshmem: size=32,name=prod\n",
                ErrorCode::BackupSharedMemory,
            ),
            ("serial0: /dev/ttyS0\n", ErrorCode::BackupHostPort),
            (
                "vmstate: local:100/vm-100-state-s1.raw\n",
                ErrorCode::BackupVmstate,
            ),
        ] {
            let held = Held::from_table(&[("/mapping/pci/vf", &["Mapping.Use"])]);
            let c = contents_check(&StoredConfig::parse(text), &iso, &held);
            assert_eq!(c.code, Some(code), "{text}: {c:?}");
        }
        // An old .tar VM backup takes no override: no isolated copy of it.
        let tar = Asked {
            volid: "local:backup/vzdump-qemu-300-2014_01_01-00_00_00.tar.lzo",
            ..asked(GuestKind::Qemu, true)
        };
        let empty = StoredConfig::parse("scsi0: x\nagent: 1\n");
        assert_eq!(
            contents_check(&empty, &tar, &none).code,
            Some(ErrorCode::BackupMissing)
        );
        let provision = Asked {
            isolate: false,
            ..tar
        };
        assert_eq!(contents_check(&empty, &provision, &none).code, None);
    }

    #[test]
    fn a_quota_saved_ram_raw_args_or_no_guest_agent_are_refused_for_every_restore() {
        let none = Held::from_table(&[]);
        for isolate in [false, true] {
            let ct = asked(GuestKind::Lxc, isolate);
            for text in [
                "rootfs: local-lvm:vm-200-disk-0,size=8G,quota=1\n",
                "unprivileged: 1\nrootfs: local-lvm:vm-200-disk-0,size=8G\nmp1: local-lvm:vm-200-disk-1,mp=/srv,quota=on,size=1G\n",
            ] {
                let c = contents_check(&StoredConfig::parse(text), &ct, &none);
                assert_eq!(c.code, Some(ErrorCode::BackupQuota), "{text}: {c:?}");
                assert!(c.message.contains("quota"), "{c:?}");
            }
            let vm = Asked {
                volid: "local:backup/vzdump-qemu-300-2026_01_01-00_00_00.vma.zst",
                ..asked(GuestKind::Qemu, isolate)
            };
            for (text, code) in [
                (
                    "agent: 1\nvmstate: local:300/vm-300-state-x.raw\n",
                    ErrorCode::BackupVmstate,
                ),
                ("agent: 1\nargs: -cpu host\n", ErrorCode::BackupArgs),
                (
                    "scsi0: local-lvm:vm-300-disk-0,size=8G\n",
                    ErrorCode::GuestAgentOff,
                ),
                ("agent: 0\n", ErrorCode::GuestAgentOff),
                (
                    "agent: enabled=0,fstrim_cloned_disks=1\n",
                    ErrorCode::GuestAgentOff,
                ),
            ] {
                let c = contents_check(&StoredConfig::parse(text), &vm, &none);
                assert_eq!(c.code, Some(code), "{isolate} {text}: {c:?}");
            }
            let c = contents_check(
                &StoredConfig::parse("agent: fstrim_cloned_disks=1,enabled=1\n"),
                &vm,
                &none,
            );
            assert_eq!(c.code, None, "{c:?}");
            // A Windows guest has no /bin/sh, systemd or Linux osquery tables: not judged.
            for os in [
                "wxp", "w2k", "w2k3", "w2k8", "wvista", "win7", "win8", "win10", "win11", "win12",
            ] {
                let c = contents_check(
                    &StoredConfig::parse(&format!("agent: 1\nostype: {os}\n")),
                    &vm,
                    &none,
                );
                assert_eq!(c.code, Some(ErrorCode::GuestOsUnjudged), "{os}: {c:?}");
                assert!(
                    c.message.contains(&format!("ostype: {os}")) && c.message.contains("/bin/sh"),
                    "{c:?}"
                );
            }
            for os in ["l26", "l24", "other", "solaris", "win", "winx", "w2k12"] {
                let c = contents_check(
                    &StoredConfig::parse(&format!("agent: 1\nostype: {os}\n")),
                    &vm,
                    &none,
                );
                assert_eq!(c.code, None, "{os}: {c:?}");
            }
        }
    }

    #[test]
    fn the_disks_a_restore_allocates_must_fit_into_the_free_space() {
        let vm = Asked {
            volid: "local:backup/vzdump-qemu-300-2026_01_01-00_00_00.vma.zst",
            ..asked(GuestKind::Qemu, false)
        };
        let stored = StoredConfig::parse(
            "agent: 1\nscsi0: local-lvm:vm-300-disk-0,size=8G\nvirtio1: ceph:vm-300-disk-1,size=512M\n\
             ide2: local:iso/d.iso,media=cdrom,size=600M\nide0: none,media=cdrom\n\
             sata0: local-lvm:vm-300-disk-2,backup=0,size=100G\nefidisk0: local-lvm:vm-300-disk-3,size=4M\n",
        );
        let need = (8u64 << 30) + (512 << 20) + (4 << 20);
        assert_eq!(
            space_check(&stored, &vm, "local-lvm", Some(need)).code,
            None
        );
        let c = space_check(&stored, &vm, "local-lvm", Some(need - 1));
        assert_eq!(c.code, Some(ErrorCode::StorageFull), "{c:?}");
        for n in ["scsi0", "virtio1", "efidisk0", "local-lvm", "vmid 120"] {
            assert!(c.message.contains(n), "{n}: {}", c.message);
        }
        for n in ["ide2", "ide0", "sata0"] {
            assert!(!c.message.contains(n), "{n}: {}", c.message);
        }
        assert_eq!(space_check(&stored, &vm, "local-lvm", None).code, None);
        let huge = StoredConfig::parse(
            "scsi0: a:x,size=8000000T\nscsi1: a:y,size=8000000T\nscsi2: a:z,size=8000000T\n",
        );
        assert_eq!(
            space_check(&huge, &vm, "local-lvm", Some(u64::MAX - 1)).code,
            Some(ErrorCode::StorageFull)
        );
        let ct = StoredConfig::parse(
            "rootfs: local-lvm:vm-200-disk-0,size=8G\nmp0: /srv,mp=/srv\nmp1: local-lvm:vm-200-disk-1,mp=/a,size=2G\n",
        );
        let a = asked(GuestKind::Lxc, false);
        assert_eq!(space_check(&ct, &a, "local-lvm", Some(10 << 30)).code, None);
        assert_eq!(
            space_check(&ct, &a, "local-lvm", Some((10 << 30) - 1)).code,
            Some(ErrorCode::StorageFull)
        );
    }

    #[test]
    fn another_guests_backup_needs_vm_backup_on_its_owner() {
        let a = asked(GuestKind::Lxc, false);
        let space = Held::from_table(&[("/storage/local", &["Datastore.AllocateSpace"])]);
        let c = access_check(&a, &space);
        assert_eq!(c.code, Some(ErrorCode::BackupAccess));
        assert!(c.message.contains("VM.Backup on /vms/200"), "{}", c.message);
        assert!(
            !c.message.contains("Datastore.AllocateSpace on"),
            "{}",
            c.message
        );
        let both = Held::from_table(&[
            ("/storage/local", &["Datastore.AllocateSpace"]),
            ("/vms/200", &["VM.Backup"]),
        ]);
        assert_eq!(access_check(&a, &both).code, None);
        // Datastore.Allocate restores any backup, but extractconfig still checks VM.Backup on
        // the owner: the grant is the one-privilege role, never a built-in VM role.
        let alloc = Held::from_table(&[("/storage/local", &["Datastore.Allocate"])]);
        let c = access_check(&a, &alloc);
        assert_eq!(c.code, Some(ErrorCode::BackupAccess), "{c:?}");
        assert!(
            c.message.contains("--roles FelhomVMBackup"),
            "{}",
            c.message
        );
        assert!(
            c.message
                .contains("pveum role add FelhomVMBackup -privs VM.Backup"),
            "{}",
            c.message
        );
        assert!(!c.message.contains("PVEVM"), "{}", c.message);
        let alloc_backup = Held::from_table(&[
            ("/storage/local", &["Datastore.Allocate"]),
            ("/vms/200", &["VM.Backup"]),
        ]);
        assert_eq!(access_check(&a, &alloc_backup).code, None);
        let own = Asked {
            vmid: Some(200),
            ..asked(GuestKind::Lxc, false)
        };
        let c = access_check(&own, &Held::from_table(&[]));
        assert!(
            c.message.contains("VM.Backup on /vms/200") && !c.message.contains("Datastore"),
            "{c:?}"
        );
        let own_held = Held::from_table(&[("/vms/200", &["VM.Backup"])]);
        assert_eq!(access_check(&own, &own_held).code, None);
    }

    #[test]
    fn only_a_free_tag_policy_lets_the_marker_through() {
        let files = |text: &str| ClusterFiles {
            datacenter: Some(Ok(text.to_string())),
            vnet_zones: BTreeMap::new(),
        };
        let none = Held::from_table(&[]);
        for (text, refused) in [
            ("keyboard: en-us\n", false),
            ("user-tag-access: user-allow=free\n", false),
            ("user-tag-access: user-allow=existing\n", true),
            (
                "user-tag-access: user-allow-list=felhom,user-allow=list\n",
                true,
            ),
            ("user-tag-access: user-allow=none\n", true),
            ("registered-tags: prod;felhom\n", true),
            ("registered-tags: prod\n", false),
        ] {
            let c = tags_check(&files(text), &none, "felhom", TOKEN);
            assert_eq!(
                c.code == Some(ErrorCode::TagPolicy),
                refused,
                "{text}: {c:?}"
            );
        }
        let root = Held::from_table(&[("/", &["Sys.Modify"])]);
        let c = tags_check(
            &files("user-tag-access: user-allow=none\n"),
            &root,
            "felhom",
            TOKEN,
        );
        assert_eq!(c.code, None);
        assert_eq!(
            tags_check(&ClusterFiles::default(), &none, "felhom", TOKEN).code,
            None
        );
    }
}
