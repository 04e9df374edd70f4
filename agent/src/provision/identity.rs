//! The birth identity of a guest: what PVE generated afresh for it when this agent's restore
//! (`unique=1`) created it, recorded once and required again before every destroy.
//!
//! A restore with `unique=1` gives every NIC a new random MAC (LXC `hwaddr=` in `netN`, QEMU
//! `<model>=<MAC>` or `macaddr=` in `netN`); qemu-server also writes a new `vmgenid` on every
//! restore (when the backup's is not `0`) and, with `unique`, a new `uuid=` in `smbios1`. A
//! backup of the guest restored again, a clone, or a hand edit of the tags and description does
//! not reproduce these values, so the marker alone is not the proof: the marker and this
//! identity are.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The most NICs recorded (PVE allows net0..net31).
const MAX_NICS: usize = 32;
/// The most characters kept of one identity value (a MAC is 17, a UUID 36).
const MAX_VALUE_CHARS: usize = 64;

/// The values PVE generated for a guest when it was restored (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BirthIdentity {
    /// `netN` → MAC (uppercase), sorted by key.
    #[serde(default)]
    pub nics: BTreeMap<String, String>,
    /// The QEMU `vmgenid` (absent, or `0`: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmgenid: Option<String>,
    /// The `uuid=` of the QEMU `smbios1` option.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub smbios_uuid: Option<String>,
}

impl BirthIdentity {
    /// The identity in a guest config as the API returns it (`GET .../config`).
    pub fn from_config(cfg: &BTreeMap<String, Value>) -> BirthIdentity {
        let text = |v: &Value| v.as_str().map(str::to_string).unwrap_or_default();
        let mut nics = BTreeMap::new();
        for (key, value) in cfg {
            if nics.len() >= MAX_NICS {
                break;
            }
            if !is_net_key(key) {
                continue;
            }
            if let Some(mac) = nic_mac(&text(value)) {
                nics.insert(key.clone(), mac);
            }
        }
        let vmgenid = cfg
            .get("vmgenid")
            .map(text)
            .map(|v| v.trim().to_ascii_lowercase())
            .filter(|v| !v.is_empty() && v != "0")
            .map(clip);
        let smbios_uuid = cfg
            .get("smbios1")
            .map(text)
            .and_then(|v| prop(&v, "uuid"))
            .map(|v| clip(v.to_ascii_lowercase()));
        BirthIdentity {
            nics,
            vmgenid,
            smbios_uuid,
        }
    }

    /// Whether nothing was generated (no NIC, no vmgenid, no SMBIOS uuid): such a guest cannot
    /// be told from a copy of it.
    pub fn is_empty(&self) -> bool {
        self.nics.is_empty() && self.vmgenid.is_none() && self.smbios_uuid.is_none()
    }

    /// What differs between the recorded identity (`self`) and the one seen now, for the
    /// operator; `None` when they are identical.
    pub fn differences(&self, seen: &BirthIdentity) -> Option<String> {
        let mut out = Vec::new();
        let keys: std::collections::BTreeSet<&String> =
            self.nics.keys().chain(seen.nics.keys()).collect();
        for key in keys {
            let (was, now) = (self.nics.get(key), seen.nics.get(key));
            if was != now {
                out.push(format!(
                    "{key} MAC {} now {}",
                    was.map_or("(none)", String::as_str),
                    now.map_or("(none)", String::as_str)
                ));
            }
        }
        if self.vmgenid != seen.vmgenid {
            out.push(format!(
                "vmgenid {} now {}",
                self.vmgenid.as_deref().unwrap_or("(none)"),
                seen.vmgenid.as_deref().unwrap_or("(none)")
            ));
        }
        if self.smbios_uuid != seen.smbios_uuid {
            out.push(format!(
                "smbios1 uuid {} now {}",
                self.smbios_uuid.as_deref().unwrap_or("(none)"),
                seen.smbios_uuid.as_deref().unwrap_or("(none)")
            ));
        }
        if out.is_empty() {
            None
        } else {
            Some(out.join(", "))
        }
    }
}

impl fmt::Display for BirthIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("(empty: no NIC, no vmgenid, no smbios1 uuid)");
        }
        let mut parts: Vec<String> = self.nics.iter().map(|(k, m)| format!("{k}={m}")).collect();
        if let Some(g) = &self.vmgenid {
            parts.push(format!("vmgenid={g}"));
        }
        if let Some(u) = &self.smbios_uuid {
            parts.push(format!("smbios1 uuid={u}"));
        }
        f.write_str(&parts.join(" "))
    }
}

fn clip(v: String) -> String {
    v.chars().take(MAX_VALUE_CHARS).collect()
}

fn is_net_key(k: &str) -> bool {
    k.strip_prefix("net")
        .is_some_and(|n| !n.is_empty() && n.len() <= 2 && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The value of `key=` in a PVE property string.
fn prop(value: &str, key: &str) -> Option<String> {
    value.split(',').find_map(|part| {
        let (k, v) = part.split_once('=')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

/// The MAC of one `netN` value: LXC `hwaddr=`, QEMU `macaddr=` or `<model>=<MAC>` (any
/// property whose value is a MAC).
fn nic_mac(value: &str) -> Option<String> {
    for key in ["hwaddr", "macaddr"] {
        if let Some(mac) = prop(value, key).filter(|m| is_mac(m)) {
            return Some(mac.to_ascii_uppercase());
        }
    }
    value.split(',').find_map(|part| {
        let (_, v) = part.split_once('=')?;
        let v = v.trim();
        is_mac(v).then(|| v.to_ascii_uppercase())
    })
}

fn is_mac(v: &str) -> bool {
    let parts: Vec<&str> = v.split(':').collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(v: Value) -> BTreeMap<String, Value> {
        serde_json::from_value(v).expect("a config map")
    }

    #[test]
    fn lxc_and_qemu_macs_vmgenid_and_smbios_uuid_are_read() {
        let id = BirthIdentity::from_config(&cfg(json!({
            "net0": "name=eth0,bridge=vmbr0,hwaddr=bc:24:11:aa:bb:cc,ip=dhcp,type=veth",
            "net1": "virtio=BC:24:11:00:00:01,bridge=vmbr1,tag=20",
            "net2": "e1000,macaddr=BC:24:11:00:00:02,bridge=vmbr0",
            "vmgenid": "0E9A1F3C-1111-2222-3333-444455556666",
            "smbios1": "uuid=7b0c3c1e-aaaa-bbbb-cccc-ddddeeeeffff,manufacturer=eA==,base64=1",
            "name": "x",
            "description": "hwaddr=00:00:00:00:00:01",
        })));
        assert_eq!(id.nics.len(), 3);
        assert_eq!(id.nics["net0"], "BC:24:11:AA:BB:CC");
        assert_eq!(id.nics["net1"], "BC:24:11:00:00:01");
        assert_eq!(id.nics["net2"], "BC:24:11:00:00:02");
        assert_eq!(
            id.vmgenid.as_deref(),
            Some("0e9a1f3c-1111-2222-3333-444455556666")
        );
        assert_eq!(
            id.smbios_uuid.as_deref(),
            Some("7b0c3c1e-aaaa-bbbb-cccc-ddddeeeeffff")
        );
        assert!(!id.is_empty());
    }

    #[test]
    fn vmgenid_zero_and_no_nic_is_empty() {
        let id = BirthIdentity::from_config(&cfg(json!({"vmgenid": "0", "memory": "512"})));
        assert!(id.is_empty(), "{id}");
        assert_eq!(id, BirthIdentity::default());
    }

    #[test]
    fn differences_name_every_changed_value() {
        let a = BirthIdentity::from_config(&cfg(json!({
            "net0": "virtio=BC:24:11:00:00:01,bridge=vmbr0",
            "vmgenid": "11111111-1111-1111-1111-111111111111",
        })));
        assert_eq!(a.differences(&a.clone()), None);
        let mut b = a.clone();
        b.vmgenid = Some("22222222-2222-2222-2222-222222222222".into());
        let d = a.differences(&b).expect("differs");
        assert!(d.contains("vmgenid"), "{d}");
        let mut c = a.clone();
        c.nics.insert("net0".into(), "BC:24:11:00:00:09".into());
        c.nics.insert("net1".into(), "BC:24:11:00:00:0A".into());
        let d = a.differences(&c).expect("differs");
        assert!(d.contains("net0") && d.contains("net1"), "{d}");
    }
}
