//! Guest configurations as PVE writes them: the text stored in a backup (what
//! `vzdump/extractconfig` answers) and the property strings of its values (`net0: name=eth0,
//! bridge=vmbr0,…`). Parsing only: what a configuration requires of the token, and whether a
//! guest's network is isolated, is decided by the preflight and the executor.
//!
//! Formats, from PVE's source: a config file holds `key: value` lines; the description comes
//! first as `#` lines, each percent-encoded (pve-common `PVE/Tools.pm` `encode_text` /
//! `decode_text`, used by qemu-server `PVE/QemuServer.pm` `parse_vm_config` and pve-container
//! `PVE/LXC/Config.pm` `parse_pct_config`); snapshots and pending changes follow in `[name]`
//! sections. A NIC's value is a property string: `name=eth0,bridge=vmbr0,tag=10,link_down=1`
//! for a container (pve-container `parse_lxc_network`), `virtio=BC:24:11:00:00:01,bridge=vmbr0`
//! for a VM, whose first item may be `<model>` or `<model>=<mac>` (qemu-server
//! `PVE/QemuServer/Network.pm` `parse_net`).

use super::GuestKind;

/// At most this many keys are kept of a stored configuration (PVE's own have a few dozen).
const MAX_KEYS: usize = 512;
/// At most this many characters of a value are kept.
const MAX_VALUE_CHARS: usize = 8192;

/// The items of a property string: `a=1,b,c=x` → `[("a", Some("1")), ("b", None), …]`.
pub fn property_items(value: &str) -> Vec<(String, Option<String>)> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|item| match item.split_once('=') {
            Some((k, v)) => (k.trim().to_string(), Some(v.trim().to_string())),
            None => (item.to_string(), None),
        })
        .collect()
}

/// The value of property `name` in a property string's items, given as `name=value`.
fn item_value(items: &[(String, Option<String>)], name: &str) -> Option<String> {
    items
        .iter()
        .find(|(k, v)| k == name && v.is_some())
        .and_then(|(_, v)| v.clone())
}

/// The value of property `name` in a property string's items, given as `name=value` or, PVE's
/// default key, as the bare first item (`virtiofs0: share1`, `rng0: /dev/hwrng`).
fn default_key_value(items: &[(String, Option<String>)], name: &str) -> Option<String> {
    item_value(items, name).or_else(|| {
        items
            .first()
            .filter(|(_, v)| v.is_none())
            .map(|(k, _)| k.clone())
    })
}

/// Whether `key` is `netN`.
pub fn is_net_key(key: &str) -> bool {
    numbered(key, "net")
}

/// Whether `key` is `<prefix>N`.
pub fn numbered(key: &str, prefix: &str) -> bool {
    key.strip_prefix(prefix)
        .is_some_and(|n| !n.is_empty() && n.len() <= 3 && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether a QEMU backup volid is in the old `.tar` format (`.tar`, `.tgz`, `.tar.gz|lzo|zst`),
/// which qemu-server restores with no option at all: `restore_tar_archive` dies with "cannot
/// pass along options (…) when restoring from tar archive" inside the task when the request
/// carries any config key (qemu-server `PVE/QemuServer.pm`).
pub fn is_qemu_tar_archive(volid: &str) -> bool {
    let name = volid.rsplit('/').next().unwrap_or(volid);
    [
        ".tar", ".tgz", ".tar.gz", ".tar.lzo", ".tar.zst", ".tar.bz2",
    ]
    .iter()
    .any(|ext| name.ends_with(ext))
}

/// PVE's boolean in a config value (`1`, `on`, `yes`, `true`).
pub fn is_true(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "1" | "on" | "yes" | "true"
    )
}

/// One NIC of a guest configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    /// `net0`, `net1`, …
    pub key: String,
    /// The interface name inside a container (`name=`).
    pub name: Option<String>,
    /// The model of a VM's NIC (`virtio`, `e1000`, …).
    pub model: Option<String>,
    /// The bridge (or SDN vnet) it is plugged into.
    pub bridge: Option<String>,
    /// The VLAN tag.
    pub tag: Option<String>,
    /// The VLAN trunks (`10;20-30`).
    pub trunks: Option<String>,
    /// `link_down=1`: disconnected, as if the cable were pulled.
    pub link_down: bool,
    /// The MAC address (a VM's `<model>=<mac>` or `macaddr=`, a container's `hwaddr=`), when
    /// it is a well-formed one.
    pub mac: Option<String>,
}

/// Whether `mac` is a MAC address as PVE writes one (`BC:24:11:00:00:01`: six pairs of hex
/// digits separated by colons) and unicast (qemu-server's `pve-macaddr` format refuses a
/// multicast one: the low bit of the first octet).
pub fn valid_mac(mac: &str) -> bool {
    let parts: Vec<&str> = mac.split(':').collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()))
        && u8::from_str_radix(parts[0], 16).is_ok_and(|b| b & 1 == 0)
}

/// The models of a VM NIC that PVE knows (qemu-server `PVE/QemuServer/Network.pm`
/// `$nic_model_list`); a first item of another name is not a model.
const QEMU_NIC_MODELS: [&str; 14] = [
    "e1000",
    "e1000-82540em",
    "e1000-82544gc",
    "e1000-82545em",
    "e1000e",
    "i82551",
    "i82557b",
    "i82559er",
    "ne2k_isa",
    "ne2k_pci",
    "pcnet",
    "rtl8139",
    "virtio",
    "vmxnet3",
];

impl Nic {
    /// The NIC `key` of a guest of `kind` with this value.
    pub fn parse(kind: GuestKind, key: &str, value: &str) -> Self {
        let mut nic = Nic {
            key: key.to_string(),
            name: None,
            model: None,
            bridge: None,
            tag: None,
            trunks: None,
            link_down: false,
            mac: None,
        };
        for (k, v) in property_items(value) {
            match (k.as_str(), v) {
                ("macaddr" | "hwaddr", Some(v)) if valid_mac(&v) => nic.mac = Some(v),
                (m, Some(v)) if kind == GuestKind::Qemu && QEMU_NIC_MODELS.contains(&m) => {
                    nic.model = Some(m.to_string());
                    if valid_mac(&v) {
                        nic.mac = Some(v);
                    }
                }
                ("name", Some(v)) => nic.name = Some(v),
                ("model", Some(v)) => nic.model = Some(v),
                ("bridge", Some(v)) if !v.is_empty() => nic.bridge = Some(v),
                ("tag", Some(v)) if !v.is_empty() => nic.tag = Some(v),
                ("trunks", Some(v)) if !v.is_empty() => nic.trunks = Some(v),
                ("link_down", Some(v)) => nic.link_down = is_true(&v),
                (m, _) if kind == GuestKind::Qemu && QEMU_NIC_MODELS.contains(&m) => {
                    nic.model = Some(m.to_string());
                }
                _ => {}
            }
        }
        nic
    }

    /// Whether this NIC can reach no network: a container's has no bridge and its link down
    /// (a bridge-less veth has no peer on the host); a VM's has its link down (a VM NIC without
    /// a bridge is QEMU's user-mode network, which reaches the host's networks, so for a VM
    /// only the link counts: qemu-server `PVE/QemuServer.pm` `print_netdev_full`).
    pub fn is_isolated(&self, kind: GuestKind) -> bool {
        match kind {
            GuestKind::Lxc => self.link_down && self.bridge.is_none(),
            GuestKind::Qemu => self.link_down,
        }
    }

    /// The value of this NIC isolated: no bridge, link down, nothing else but its name (a
    /// container's) or model (a VM's). PVE gives it a fresh MAC address (pve-container
    /// `parse_lxc_network`, qemu-server `add_random_macs`).
    pub fn isolated_value(&self, kind: GuestKind) -> String {
        let plain = |s: &str, max: usize| {
            !s.is_empty()
                && s.len() <= max
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        };
        match kind {
            GuestKind::Lxc => {
                let fallback = format!("eth{}", self.key.trim_start_matches("net"));
                let name = self
                    .name
                    .as_deref()
                    .filter(|n| plain(n, 15))
                    .unwrap_or(&fallback);
                format!("name={name},link_down=1")
            }
            GuestKind::Qemu => {
                let model = self
                    .model
                    .as_deref()
                    .filter(|m| QEMU_NIC_MODELS.contains(m))
                    .unwrap_or("virtio");
                format!("{model},link_down=1")
            }
        }
    }

    /// The value of this VM NIC on the lab bridge `bridge` (`[restore_test] lab_bridge`): its
    /// stored model and MAC (the guest's own network config, netplan's and NetworkManager's
    /// included, matches its NIC by MAC or by the name the model and slot give it), on that
    /// bridge, and nothing else: no VLAN tag or trunks (the lab bridge carries none), no
    /// firewall (it would put a firewall bridge between), no rate or MTU. A MAC that is not
    /// well-formed is left out (PVE then gives a fresh one: qemu-server `add_random_macs`).
    pub fn lab_value(&self, bridge: &str) -> String {
        let model = self
            .model
            .as_deref()
            .filter(|m| QEMU_NIC_MODELS.contains(m))
            .unwrap_or("virtio");
        match &self.mac {
            Some(mac) => format!("{model}={mac},bridge={bridge}"),
            None => format!("{model},bridge={bridge}"),
        }
    }

    /// Whether this VM NIC is on the lab bridge `bridge` as [`Nic::lab_value`] puts it there:
    /// that bridge, no VLAN tag or trunks, link up or down.
    pub fn is_on_lab_bridge(&self, bridge: &str) -> bool {
        self.bridge.as_deref() == Some(bridge) && self.tag.is_none() && self.trunks.is_none()
    }

    /// `net0 (bridge=vmbr0,tag=10)` for messages.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(b) = &self.bridge {
            parts.push(format!("bridge={b}"));
        }
        if let Some(t) = &self.tag {
            parts.push(format!("tag={t}"));
        }
        if let Some(t) = &self.trunks {
            parts.push(format!("trunks={t}"));
        }
        if self.link_down {
            parts.push("link_down=1".to_string());
        }
        if parts.is_empty() {
            self.key.clone()
        } else {
            format!("{} ({})", self.key, parts.join(","))
        }
    }
}

/// The VLAN ids of a trunks value (`10;20-22` → 10, 20, 21, 22), as pve-guest-common
/// `PVE/GuestHelpers.pm` `get_tags_from_trunk` expands them; at most 4094 ids.
pub fn trunk_tags(trunks: &str) -> Vec<u16> {
    let mut out = Vec::new();
    for part in trunks.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (Ok(a), Ok(b)) = (a.trim().parse::<u16>(), b.trim().parse::<u16>()) else {
            continue;
        };
        let b = if b > a { b } else { a };
        for t in a..=b.min(4094) {
            if !out.contains(&t) {
                out.push(t);
            }
        }
    }
    out.sort_unstable();
    out
}

/// A mount point of a container: a storage volume, or a host path / device (bind or device
/// mount, root only: pve-container `PVE/API2/LXC.pm` `create_vm`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountPoint {
    /// `rootfs`, `mp0`, …
    pub key: String,
    /// The volume as written (`local-lvm:vm-1-disk-0`, `/srv/data`, `/dev/sdb1`).
    pub volume: String,
    /// `quota=1`: user quotas inside the container, which pve-container refuses to start an
    /// unprivileged container with (`PVE/API2/LXC/Status.pm` `vm_start`).
    pub quota: bool,
    /// `size=`, in bytes, when given and readable.
    pub size: Option<u64>,
}

impl MountPoint {
    /// Whether the volume is a host path or device rather than a storage volume (pve-container
    /// `PVE/LXC/Config.pm` `classify_mountpoint`: an absolute path is `bind` or `device`).
    pub fn is_host_path(&self) -> bool {
        self.volume.starts_with('/')
    }
}

/// A host device passed to a VM: `hostpciN` / `usbN` with `host=` (root only) or `mapping=`
/// (`Mapping.Use` on `/mapping/<pci|usb>/<name>`): qemu-server `PVE/API2/Qemu.pm`
/// `check_hostpci_perm` and `check_usb_perm`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostDevice {
    /// `hostpci0`, `usb1`, …
    pub key: String,
    /// The mapping it names, if it is a mapped device; `None`: a raw host device.
    pub mapping: Option<String>,
}

impl HostDevice {
    /// The ACL path of its mapping (`/mapping/pci/<name>`, `/mapping/usb/<name>`).
    pub fn mapping_path(&self) -> Option<String> {
        let class = if self.key.starts_with("hostpci") {
            "pci"
        } else {
            "usb"
        };
        self.mapping
            .as_ref()
            .map(|m| format!("/mapping/{class}/{m}"))
    }
}

/// The current section of a stored guest configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoredConfig {
    keys: Vec<(String, String)>,
    description: String,
}

impl StoredConfig {
    /// Parse the text PVE stores (and `extractconfig` answers): `#` description lines, then
    /// `key: value` lines, up to the first `[section]`. Bounded: at most [`MAX_KEYS`] keys,
    /// values clipped.
    pub fn parse(text: &str) -> Self {
        let mut keys: Vec<(String, String)> = Vec::new();
        let mut description = String::new();
        for line in text.lines() {
            let line = line.trim_end_matches('\r');
            if line.trim_start().starts_with('[') {
                break; // snapshots and pending changes follow the current config
            }
            if let Some(d) = line.strip_prefix('#') {
                // vzdump's own notes in a VM backup's config (`#qmdump#map:…`, the disk map
                // qemu-server `restore_update_config_line` reads and drops) are no description.
                if d.starts_with("qmdump#") || d.starts_with("vzdump#") {
                    continue;
                }
                if description.len() < MAX_VALUE_CHARS {
                    description.push_str(&decode_text(d));
                    description.push('\n');
                }
                continue;
            }
            let Some((k, v)) = line.split_once(':') else {
                continue;
            };
            let k = k.trim();
            let valid = !k.is_empty()
                && k.len() <= 64
                && k.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
            if !valid || keys.len() >= MAX_KEYS {
                continue;
            }
            let v: String = v.trim().chars().take(MAX_VALUE_CHARS).collect();
            if k == "description" {
                // Not PVE's file format, but a value some tools print: take it as well.
                description = v.replace("\\n", "\n");
                continue;
            }
            keys.push((k.to_string(), v));
        }
        let description = description.trim_end_matches('\n').to_string();
        Self { keys, description }
    }

    /// Whether nothing was found.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The number of keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.keys
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Every key, in the order stored.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|(k, _)| k.as_str())
    }

    /// Whether `key` is set to a true boolean.
    pub fn flag(&self, key: &str) -> bool {
        self.get(key).is_some_and(is_true)
    }

    /// The stored description (decoded; empty when none).
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Every NIC, in key order.
    pub fn nics(&self, kind: GuestKind) -> Vec<Nic> {
        let mut nics: Vec<Nic> = self
            .keys
            .iter()
            .filter(|(k, _)| is_net_key(k))
            .map(|(k, v)| Nic::parse(kind, k, v))
            .collect();
        nics.sort_by_key(|n| n.key[3..].parse::<u32>().unwrap_or(u32::MAX));
        nics
    }

    /// Whether the container is unprivileged (`unprivileged: 1`).
    pub fn unprivileged(&self) -> bool {
        self.flag("unprivileged")
    }

    /// Raw `lxc.*` keys (root only; PVE skips them for anyone else at restore).
    pub fn raw_lxc_keys(&self) -> Vec<&str> {
        self.keys()
            .filter(|k| k.starts_with("lxc."))
            .collect::<Vec<_>>()
    }

    /// The container's mount points (`rootfs`, `mpN`).
    pub fn mount_points(&self) -> Vec<MountPoint> {
        self.keys
            .iter()
            .filter(|(k, _)| k == "rootfs" || numbered(k, "mp"))
            .map(|(k, v)| {
                let items = property_items(v);
                let volume = items
                    .iter()
                    .find(|(ik, iv)| ik == "volume" && iv.is_some())
                    .and_then(|(_, iv)| iv.clone())
                    .or_else(|| {
                        items
                            .first()
                            .filter(|(_, iv)| iv.is_none())
                            .map(|(ik, _)| ik.clone())
                    })
                    .unwrap_or_default();
                let get = |name: &str| item_value(&items, name);
                MountPoint {
                    key: k.clone(),
                    volume,
                    quota: get("quota").is_some_and(|q| is_true(&q)),
                    size: get("size").as_deref().and_then(parse_disk_size),
                }
            })
            .collect()
    }

    /// Whether the backup is of a template (`template: 1`): PVE restores it as a template
    /// (pve-container `PVE/API2/LXC.pm` `create_vm`: `$was_template` → `template_create`;
    /// qemu-server `PVE/API2/Qemu.pm` `create_vm`: "Convert to template."), which never starts
    /// ("you can't start a CT if it's a template").
    pub fn is_template(&self) -> bool {
        self.flag("template")
    }

    /// What of this configuration reaches the host or a network without a NIC (see
    /// [`isolation_breaches`]).
    pub fn isolation_breaches(&self, kind: GuestKind) -> Vec<IsolationBreach> {
        isolation_breaches(
            kind,
            self.keys.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        )
    }

    /// The ACL paths of a VM's mapped resources besides devices, where PVE checks
    /// `Mapping.Use` inside the restore task (qemu-server `PVE/QemuServer.pm`
    /// `check_mapping_access`): `virtiofsN` (one digit, as PVE's pattern) on
    /// `/mapping/dir/<dirid>`, an `rngN` whose source is `/dev/hwrng` on `/mapping/hwrng`.
    pub fn resource_mapping_paths(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (k, v) in &self.keys {
            let items = property_items(v);
            let one_digit = k
                .strip_prefix("virtiofs")
                .is_some_and(|n| n.len() == 1 && n.bytes().all(|b| b.is_ascii_digit()));
            if one_digit {
                if let Some(d) = default_key_value(&items, "dirid") {
                    out.push((k.clone(), format!("/mapping/dir/{d}")));
                }
            } else if numbered(k, "rng")
                && default_key_value(&items, "source").as_deref() == Some("/dev/hwrng")
            {
                out.push((k.clone(), "/mapping/hwrng".to_string()));
            }
        }
        out
    }

    /// The volumes a restore of this configuration allocates on the target storage, each with
    /// its stored size in bytes (`None`: no readable `size=`):
    /// - a container: `rootfs` and every `mpN` on a storage volume (pve-container `create_vm`,
    ///   storage only mode: "unable to detect disk size" without one; bind and device mount
    ///   points allocate nothing);
    /// - a VM: every disk (`ideN`, `sataN`, `scsiN`, `virtioN`, `efidiskN`, `tpmstateN`) on a
    ///   storage volume, except CD-ROMs (`media=cdrom`, `none`, `cdrom`) and disks left out of
    ///   the backup (`backup=0`, commented out by qemu-server `restore_update_config_line`),
    ///   which qemu-server allocates before it writes any data (`restore_allocate_devices`).
    pub fn allocated_disks(&self, kind: GuestKind) -> Vec<(String, Option<u64>)> {
        match kind {
            GuestKind::Lxc => self
                .mount_points()
                .into_iter()
                .filter(|m| !m.is_host_path())
                .map(|m| (m.key, m.size))
                .collect(),
            GuestKind::Qemu => self
                .keys
                .iter()
                .filter(|(k, _)| {
                    ["ide", "sata", "scsi", "virtio", "efidisk", "tpmstate"]
                        .iter()
                        .any(|p| numbered(k, p))
                })
                .filter_map(|(k, v)| {
                    let items = property_items(v);
                    let get = |name: &str| item_value(&items, name);
                    let file = default_key_value(&items, "file").unwrap_or_default();
                    let cdrom = get("media").as_deref() == Some("cdrom")
                        || file == "none"
                        || file == "cdrom";
                    let skipped = get("backup").is_some_and(|b| !is_true(&b));
                    if cdrom || skipped || file.starts_with('/') {
                        return None;
                    }
                    Some((k.clone(), get("size").as_deref().and_then(parse_disk_size)))
                })
                .collect(),
        }
    }

    /// Whether the VM has its QEMU guest agent enabled: `agent: 1` or `agent: enabled=1,…`
    /// (qemu-server `PVE/QemuServer/Agent.pm`, `parse_guest_agent`: `enabled` is the default
    /// key and false when the key is absent). Without it PVE answers every guest agent call
    /// "No QEMU guest agent configured" (`assert_agent_available`).
    pub fn guest_agent_enabled(&self) -> bool {
        self.get("agent").is_some_and(|v| {
            let items = property_items(v);
            default_key_value(&items, "enabled").is_some_and(|e| is_true(&e))
        })
    }

    /// The VM's `ostype` when it names a Windows guest: PVE's Windows values (qemu-server
    /// `src/PVE/QemuServer.pm` `ostype` enum: `wxp w2k w2k3 w2k8 wvista win7 win8 win10 win11`,
    /// the ones `QemuServer/Helpers.pm` `windows_version` gives a version), any `win<N>` a
    /// later PVE adds included.
    pub fn windows_ostype(&self) -> Option<&str> {
        let v = self.get("ostype")?.trim();
        let named = matches!(v, "wxp" | "w2k" | "w2k3" | "w2k8" | "wvista");
        let numbered = v
            .strip_prefix("win")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        (named || numbered).then_some(v)
    }

    /// The container's device passthroughs (`devN`, root only).
    pub fn devices(&self) -> Vec<&str> {
        self.keys().filter(|k| numbered(k, "dev")).collect()
    }

    /// The VM's host devices (`hostpciN`, `usbN` that name a host device or a mapping; a USB
    /// `spice` port is no host device).
    pub fn host_devices(&self) -> Vec<HostDevice> {
        self.keys
            .iter()
            .filter(|(k, _)| numbered(k, "hostpci") || numbered(k, "usb"))
            .filter_map(|(k, v)| {
                let items = property_items(v);
                let get = |name: &str| item_value(&items, name);
                let mapping = get("mapping");
                let host = get("host").or_else(|| {
                    // `hostpci0: 0000:01:00.0` (the first item is `host`)
                    items
                        .first()
                        .filter(|(ik, iv)| iv.is_none() && !ik.eq_ignore_ascii_case("spice"))
                        .map(|(ik, _)| ik.clone())
                });
                if mapping.is_none()
                    && host
                        .as_deref()
                        .is_none_or(|h| h.eq_ignore_ascii_case("spice"))
                {
                    return None;
                }
                Some(HostDevice {
                    key: k.clone(),
                    mapping: if host.is_some() && mapping.is_none() {
                        None
                    } else {
                        mapping
                    },
                })
            })
            .collect()
    }
}

/// Why a stored key lets a guest reach the host or a network without any `netN`: what an
/// isolated copy (a restore-test copy, a throwaway selftest) must not start with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IsolationBreach {
    /// The key (`args`, `hostpci0`, `virtiofs1`, `serial0`, …).
    pub key: String,
    /// The stable code a refusal carries.
    pub code: crate::error::ErrorCode,
    /// Why, in a few words, with PVE's function.
    pub why: &'static str,
}

/// The keys of a VM configuration that reach the host or a network without any NIC. A restore
/// keeps every stored line (qemu-server `PVE/QemuServer.pm` `restore_update_config_line`), and
/// `check_restore_permissions` looks at bridges and mappings only, so each of these comes
/// along with a copy:
/// - `args`: raw QEMU arguments (`-netdev user`, `-chardev socket,host=…`), appended to QEMU's
///   command line (`config_to_command`);
/// - `hostpciN`, `usbN` naming a host device or a mapping (an SR-IOV VF or a USB NIC is a NIC
///   no `netN` shows; a USB `spice` port is none);
/// - `virtiofsN`: a host directory shared read-write (`QemuServer/Virtiofs.pm`);
/// - `ivshmem` with a `name`: memory shared with every VM of that name (`print_ivshmem`
///   without a name uses `pve-shm-<vmid>`, the copy's own);
/// - `serialN` / `parallelN` on a host device (`/dev/…`; a `socket` serial stays the VM's);
/// - a CD-ROM on the host's drive (`ide2: cdrom,media=cdrom` is `/dev/cdrom`: qemu-server
///   `get_iso_path`), which a restore keeps verbatim (drives not in the backup's disk map); an
///   ISO volume stays (its start dies when the ISO is gone: a known limit);
/// - `vmstate`: saved RAM the copy resumes (`vm_start_nolock` loads it), the production VM's
///   open connections included.
///
/// `args` and `vmstate` are refused for every VM restore, isolated or not (the preflight's
/// contents check); the others only for an isolated copy.
///
/// A container has none of these; its host access (bind and device mount points, `devN`, raw
/// `lxc.*` keys) is refused for every restore by the preflight's contents check.
pub fn isolation_breaches<'a>(
    kind: GuestKind,
    pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Vec<IsolationBreach> {
    use crate::error::ErrorCode;
    if kind != GuestKind::Qemu {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (key, value) in pairs {
        // A USB port is SPICE's (no host device) only when its `host` is `spice`, given bare or
        // as `host=spice`; `mapping=spice` names a mapping called "spice", a host device
        // (qemu-server `PVE/API2/Qemu.pm` `check_usb_perm`: `host` other than spice is root's,
        // else a `mapping` needs Mapping.Use).
        let items = property_items(value);
        let spice_port = items.iter().all(|(k, _)| k != "mapping")
            && default_key_value(&items, "host").is_some_and(|h| h.eq_ignore_ascii_case("spice"));
        let breach = if key == "args" {
            Some((
                ErrorCode::BackupArgs,
                "raw QEMU arguments can open a network or a host socket without any NIC",
            ))
        } else if numbered(key, "hostpci") {
            Some((
                ErrorCode::BackupDevices,
                "a passed-through PCI device (an SR-IOV VF is a NIC no netN shows)",
            ))
        } else if numbered(key, "usb") && !spice_port {
            Some((
                ErrorCode::BackupDevices,
                "a passed-through USB device (a USB NIC is a NIC no netN shows)",
            ))
        } else if numbered(key, "virtiofs") {
            Some((
                ErrorCode::BackupHostDir,
                "a host directory shared read-write with the VM",
            ))
        } else if key == "ivshmem"
            && property_items(value)
                .iter()
                .any(|(k, v)| k == "name" && v.as_deref().is_some_and(|n| !n.is_empty()))
        {
            Some((
                ErrorCode::BackupSharedMemory,
                "memory shared with every VM that names the same ivshmem",
            ))
        } else if (numbered(key, "serial") && value.trim_start().starts_with("/dev/"))
            || numbered(key, "parallel")
        {
            Some((
                ErrorCode::BackupHostPort,
                "a port connected to a host device",
            ))
        } else if ["ide", "sata", "scsi"].iter().any(|p| numbered(key, p))
            && property_items(value)
                .iter()
                .any(|(k, v)| k == "media" && v.as_deref() == Some("cdrom"))
            && default_key_value(&property_items(value), "file")
                .is_some_and(|f| f == "cdrom" || f.starts_with("/dev/"))
        {
            Some((
                ErrorCode::BackupDevices,
                "the host's CD/DVD drive passed to the VM",
            ))
        } else if key == "vmstate" {
            Some((
                ErrorCode::BackupVmstate,
                "saved RAM: the copy would resume the production VM, its connections included",
            ))
        } else {
            None
        };
        if let Some((code, why)) = breach {
            out.push(IsolationBreach {
                key: key.to_string(),
                code,
                why,
            });
        }
    }
    out
}

/// A disk size as PVE writes it, in bytes (pve-common `PVE/JSONSchema.pm` `parse_size`:
/// `<digits>[.<digits>]` then `K`, `M`, `G`, `T` or `KiB` … `TiB`, powers of 1024, or none);
/// `None` when it is not that.
pub fn parse_disk_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let exp = match unit {
        "" => 0,
        "K" | "KiB" => 1,
        "M" | "MiB" => 2,
        "G" | "GiB" => 3,
        "T" | "TiB" => 4,
        _ => return None,
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, "0"));
    if int.is_empty()
        || frac.is_empty()
        || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let value: f64 = num.parse().ok()?;
    let bytes = value * 1024f64.powi(exp);
    (bytes < 2f64.powi(63)).then_some(bytes as u64)
}

/// pve-common `PVE/Tools.pm` `decode_text`: `%XX` escapes to bytes, read as UTF-8.
fn decode_text(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = std::str::from_utf8(&b[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            if let Some(v) = hex {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The configuration stored in a backup as PVE extracted it (`GET
/// /nodes/N/vzdump/extractconfig?volume=…`), with the volume it came from: the preflight reads
/// it and hands it to the restore, so that a provision asks PVE for it once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredConfigText {
    /// The backup volume.
    pub volid: String,
    /// PVE's answer, as read (bounded by the client's answer limit).
    pub text: String,
}

/// The names PVE's cloud-init drive gives a VM: the `hostname:` and `fqdn:` of the user data
/// it generates at each start (qemu-server `src/PVE/QemuServer/Cloudinit.pm`
/// `cloudinit_userdata`, from `get_hostname_fqdn`). cloud-init sets one of the two as the
/// guest's hostname, which one being the distribution's choice (its `prefer_fqdn_over_hostname`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudInitName {
    /// The short name.
    pub hostname: String,
    /// The fully qualified name (the short name when PVE knows no domain for it).
    pub fqdn: String,
}

/// The names PVE writes into the cloud-init drive of VM `vmid` with config `pairs` (key,
/// value), or `None` when it writes none the guest takes for its hostname:
/// - a cloud-init drive: qemu-server `generate_cloudinit_config`, run by `vm_start_nolock` at
///   every start, generates the drive of each volume whose name holds `vm-<vmid>-cloudinit`
///   (`drive_is_cloudinit`: `<storage>:[<dir>/]vm-<N>-cloudinit[.<format>]`), `vmid` the VM's
///   own: a restored copy's drive is a new `vm-<copy's vmid>-cloudinit` (`restore_allocate_devices`
///   for an `ide`, `sata` or `scsi` cloud-init drive of the backup), so PVE writes it from the
///   copy's config. Only disk keys (`ideN`, `sataN`, `scsiN`, `virtioN`) are looked at.
/// - `cicustom` with `user=`: the user data is the snippet's (`get_custom_cloudinit_files`), not
///   PVE's: `None`.
/// - `citype: opennebula`: only `SET_HOSTNAME=<short name>` is written (`generate_opennebula`),
///   and what FQDN cloud-init makes of it is the guest's: `None`.
/// - the names (`get_hostname_fqdn`): `name`, or `VM<vmid>` when the config has none; a name
///   with a dot is the FQDN and its first label the short name; else the FQDN is
///   `<name>.<searchdomain>` when `searchdomain` is set (its whole value, as Perl
///   interpolates it), else the name.
pub fn cloudinit_name(pairs: &[(&str, &str)], vmid: u32) -> Option<CloudInitName> {
    let get = |key: &str| pairs.iter().find(|(k, _)| *k == key).map(|(_, v)| v.trim());
    let own = format!("vm-{vmid}-cloudinit");
    let has_drive = pairs.iter().any(|(k, v)| {
        if !["ide", "sata", "scsi", "virtio"]
            .iter()
            .any(|p| numbered(k, p))
        {
            return false;
        }
        let items = property_items(v);
        let file = default_key_value(&items, "file").unwrap_or_default();
        let Some((_storage, volname)) = file.split_once(':') else {
            return false;
        };
        let last = volname.rsplit('/').next().unwrap_or(volname);
        match last.strip_prefix(own.as_str()) {
            Some("") => true,
            Some(ext) => ext
                .strip_prefix('.')
                .is_some_and(|f| !f.is_empty() && f.bytes().all(|b| b.is_ascii_alphanumeric())),
            None => false,
        }
    });
    if !has_drive {
        return None;
    }
    if get("cicustom").is_some_and(|c| {
        property_items(c)
            .iter()
            .any(|(k, v)| k == "user" && v.is_some())
    }) {
        return None;
    }
    if get("citype") == Some("opennebula") {
        return None;
    }
    let name = match get("name") {
        Some(n) => n.to_string(),
        None => format!("VM{vmid}"),
    };
    if let Some((short, _)) = name.split_once('.') {
        return Some(CloudInitName {
            hostname: short.to_string(),
            fqdn: name.clone(),
        });
    }
    // Perl's truth: an empty value and "0" are false.
    let fqdn = match get("searchdomain").filter(|s| !s.is_empty() && *s != "0") {
        Some(search) => format!("{name}.{search}"),
        None => name.clone(),
    };
    Some(CloudInitName {
        hostname: name,
        fqdn,
    })
}

impl StoredConfig {
    /// [`cloudinit_name`] of this config for VM `vmid`.
    pub fn cloudinit_name(&self, vmid: u32) -> Option<CloudInitName> {
        let pairs: Vec<(&str, &str)> = self
            .keys
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        cloudinit_name(&pairs, vmid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_container_config_is_read_up_to_its_snapshots() {
        let text = "#customer%20notes%3A\n#second line\narch: amd64\nhostname: web\n\
                    net0: name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:00:01,ip=10.1.2.3/24,type=veth\n\
                    net1: name=eth1,bridge=vmbr1,tag=20\n\
                    rootfs: local-lvm:vm-200-disk-0,size=8G\nmp0: /srv/data,mp=/data\n\
                    mp1: volume=local-lvm:vm-200-disk-1,mp=/var\nonboot: 1\nprotection: 1\n\
                    lxc.apparmor.profile: unconfined\ndev0: /dev/ttyUSB0\n\
                    [snap1]\nnet2: name=eth2,bridge=vmbr9\nunprivileged: 1\n";
        let c = StoredConfig::parse(text);
        assert_eq!(c.description(), "customer notes:\nsecond line");
        let vm =
            StoredConfig::parse("#qmdump#map:scsi0:drive-scsi0:local-lvm:raw:\n#notes\nname: x\n");
        assert_eq!(vm.description(), "notes");
        assert!(!c.unprivileged(), "the snapshot's key does not count");
        assert!(c.flag("onboot") && c.flag("protection"));
        let nics = c.nics(GuestKind::Lxc);
        assert_eq!(nics.len(), 2);
        assert_eq!(nics[0].bridge.as_deref(), Some("vmbr0"));
        assert_eq!(nics[1].tag.as_deref(), Some("20"));
        assert!(!nics[0].is_isolated(GuestKind::Lxc));
        assert_eq!(
            nics[1].isolated_value(GuestKind::Lxc),
            "name=eth1,link_down=1"
        );
        let host: Vec<String> = c
            .mount_points()
            .into_iter()
            .filter(MountPoint::is_host_path)
            .map(|m| m.key)
            .collect();
        assert_eq!(host, ["mp0"]);
        assert_eq!(c.raw_lxc_keys(), ["lxc.apparmor.profile"]);
        assert_eq!(c.devices(), ["dev0"]);
    }

    #[test]
    fn vm_nics_read_their_model_and_isolation_counts_the_link_only() {
        let n = Nic::parse(
            GuestKind::Qemu,
            "net3",
            "e1000=BC:24:11:AA:BB:CC,bridge=vmbr0,firewall=1",
        );
        assert_eq!(n.model.as_deref(), Some("e1000"));
        assert_eq!(n.isolated_value(GuestKind::Qemu), "e1000,link_down=1");
        assert!(!Nic::parse(GuestKind::Qemu, "net0", "virtio").is_isolated(GuestKind::Qemu));
        assert!(
            Nic::parse(GuestKind::Qemu, "net0", "virtio,bridge=vmbr0,link_down=1")
                .is_isolated(GuestKind::Qemu)
        );
        // A container NIC on a bridge is not isolated, link down or not.
        assert!(
            !Nic::parse(GuestKind::Lxc, "net0", "name=eth0,bridge=vmbr0,link_down=1")
                .is_isolated(GuestKind::Lxc)
        );
        assert!(
            Nic::parse(GuestKind::Lxc, "net0", "name=eth0,link_down=1").is_isolated(GuestKind::Lxc)
        );
        // A hostile name is not carried over.
        let odd = Nic::parse(GuestKind::Lxc, "net2", "name=$(reboot),bridge=vmbr0");
        assert_eq!(odd.isolated_value(GuestKind::Lxc), "name=eth2,link_down=1");
    }

    #[test]
    fn host_devices_raw_and_mapped() {
        let c = StoredConfig::parse(
            "hostpci0: 0000:01:00.0,pcie=1\nhostpci1: mapping=gpu\nusb0: host=1234:5678\n\
             usb1: spice\nusb2: mapping=stick\nscsi0: local-lvm:vm-1-disk-0\n",
        );
        let d = c.host_devices();
        let seen: Vec<(&str, Option<String>)> = d
            .iter()
            .map(|h| (h.key.as_str(), h.mapping_path()))
            .collect();
        assert_eq!(
            seen,
            [
                ("hostpci0", None),
                ("hostpci1", Some("/mapping/pci/gpu".to_string())),
                ("usb0", None),
                ("usb2", Some("/mapping/usb/stick".to_string())),
            ]
        );
    }

    #[test]
    fn a_usb_port_is_spices_only_by_its_host() {
        let keys = |text: &str| -> Vec<String> {
            StoredConfig::parse(text)
                .isolation_breaches(GuestKind::Qemu)
                .into_iter()
                .map(|b| b.key)
                .collect()
        };
        assert!(keys("usb0: spice\nusb1: host=spice,usb3=1\n").is_empty());
        assert_eq!(keys("usb0: mapping=spice\n"), ["usb0"]);
        assert_eq!(keys("usb2: host=1234:5678\n"), ["usb2"]);
        assert_eq!(
            keys("ide2: cdrom,media=cdrom\nsata0: /dev/sr0,media=cdrom\nide0: local:iso/d.iso,media=cdrom\nide1: none,media=cdrom\n"),
            ["ide2", "sata0"]
        );
    }

    #[test]
    fn disk_sizes_read_as_pve_parse_size() {
        assert_eq!(parse_disk_size("8G"), Some(8 << 30));
        assert_eq!(parse_disk_size("512M"), Some(512 << 20));
        assert_eq!(parse_disk_size("1.5GiB"), Some(3 << 29));
        assert_eq!(parse_disk_size("4096"), Some(4096));
        assert_eq!(parse_disk_size("1T"), Some(1 << 40));
        for bad in ["", "G", "8g", "8X", "-1G", "1.G", ".5G", "8 G"] {
            assert_eq!(parse_disk_size(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn trunks_expand_as_pve_does() {
        assert_eq!(trunk_tags("10;20-22;10"), [10, 20, 21, 22]);
        assert_eq!(trunk_tags("x;5"), [5]);
    }

    #[test]
    fn hostile_text_is_bounded() {
        let mut text = String::new();
        for i in 0..2000 {
            text.push_str(&format!("k{i}: {}\n", "v".repeat(10_000)));
        }
        let c = StoredConfig::parse(&text);
        assert_eq!(c.len(), MAX_KEYS);
        assert!(c.get("k0").is_some_and(|v| v.len() == MAX_VALUE_CHARS));
        assert_eq!(decode_text("%zz%4"), "%zz%4");
    }

    /// qemu-server's own test config with a cloud-init drive
    /// (`src/test/parse-config-input/cloudinit-snapshot.conf`, VM 120), its pending-section
    /// and snapshot left out by the parser.
    const QEMU_SERVER_CLOUDINIT_CONF: &str = "boot: order=scsi0
cores: 2
cpu: x86-64-v2-AES
ide2: lvm:vm-120-cloudinit,media=cdrom
ipconfig0: ip6=dhcp
memory: 4096
meta: creation-qemu=9.0.2,ctime=1725975013
name: deb1223
net0: vmxnet3=BC:24:11:2C:69:EC,bridge=vnet0,firewall=1
numa: 0
ostype: l26
parent: cloudinit
scsi0: nfs:120/vm-120-disk-0.qcow2,iothread=1,size=4G
scsihw: virtio-scsi-single
smbios1: uuid=b3247ab1-1fe6-428e-965b-08a1b64a8746
sockets: 1
unused0: rbd:vm-120-disk-0
vmgenid: 7079e97c-50e3-4079-afe7-23e67566b946

[special:cloudinit]
ipconfig0: ip=dhcp,ip6=dhcp
name: deb122
";

    fn names(hostname: &str, fqdn: &str) -> Option<CloudInitName> {
        Some(CloudInitName {
            hostname: hostname.to_string(),
            fqdn: fqdn.to_string(),
        })
    }

    #[test]
    fn the_cloud_init_names_are_what_qemu_server_writes_for_the_vms_own_drive() {
        let conf = StoredConfig::parse(QEMU_SERVER_CLOUDINIT_CONF);
        // The current config's name, not the pending section's.
        assert_eq!(conf.cloudinit_name(120), names("deb1223", "deb1223"));
        // Another VM's drive (the config of VM 120 read as another vmid's) is not generated
        // for this one.
        assert_eq!(conf.cloudinit_name(990_000), None);
        // A restored copy: its drive is a new `vm-<copy>-cloudinit`, its name the backup's.
        let copy = QEMU_SERVER_CLOUDINIT_CONF.replace("vm-120-cloudinit", "vm-990000-cloudinit");
        // Keys added to the current config, before the pending section.
        let with = |extra: &str| {
            StoredConfig::parse(&copy.replace("\n[special:", &format!("{extra}\n[special:")))
        };
        assert_eq!(
            StoredConfig::parse(&copy).cloudinit_name(990_000),
            names("deb1223", "deb1223")
        );
        assert_eq!(
            with("searchdomain: example.com\n").cloudinit_name(990_000),
            names("deb1223", "deb1223.example.com")
        );
        assert_eq!(
            with("searchdomain: 0\n").cloudinit_name(990_000),
            names("deb1223", "deb1223")
        );
        // A name with a dot is the FQDN; the searchdomain then plays no part.
        let dotted = copy.replace("name: deb1223\n", "name: web01.corp.example\n");
        assert_eq!(
            StoredConfig::parse(
                &dotted.replace("\n[special:", "searchdomain: other.org\n\n[special:")
            )
            .cloudinit_name(990_000),
            names("web01", "web01.corp.example")
        );
        // No name: PVE's `VM<vmid>`, the copy's vmid.
        let unnamed = copy.replace("name: deb1223\n", "");
        assert_eq!(
            StoredConfig::parse(&unnamed).cloudinit_name(990_000),
            names("VM990000", "VM990000")
        );
        // A custom user data snippet, or OpenNebula's context: PVE's names are not the
        // guest's to take.
        assert_eq!(
            with("cicustom: user=local:snippets/user.yaml\n").cloudinit_name(990_000),
            None
        );
        assert_eq!(
            with("cicustom: network=local:snippets/net.yaml\n").cloudinit_name(990_000),
            names("deb1223", "deb1223")
        );
        assert_eq!(with("citype: opennebula\n").cloudinit_name(990_000), None);
        assert_eq!(
            with("citype: nocloud\n").cloudinit_name(990_000),
            names("deb1223", "deb1223")
        );
        // On a directory storage, with its format; on scsi and sata as on ide.
        for drive in [
            "ide2: local:990000/vm-990000-cloudinit.qcow2,media=cdrom",
            "scsi1: local-lvm:vm-990000-cloudinit,media=cdrom",
            "sata0: file=local-lvm:vm-990000-cloudinit,media=cdrom",
        ] {
            let conf = StoredConfig::parse(&format!("name: web\n{drive}\n"));
            assert_eq!(conf.cloudinit_name(990_000), names("web", "web"), "{drive}");
        }
        // No cloud-init drive: an empty CD-ROM, an ISO, an unused volume, a look-alike name.
        for drive in [
            "ide2: none,media=cdrom",
            "ide2: local:iso/debian.iso,media=cdrom",
            "unused0: local-lvm:vm-990000-cloudinit",
            "ide2: local-lvm:vm-990000-cloudinit-old,media=cdrom",
            "ide2: local-lvm:vm-9900001-cloudinit,media=cdrom",
        ] {
            let conf = StoredConfig::parse(&format!("name: web\n{drive}\n"));
            assert_eq!(conf.cloudinit_name(990_000), None, "{drive}");
        }
    }
}
