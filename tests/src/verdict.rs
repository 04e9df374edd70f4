//! What the restore-test tests on real guests share: the backup of an unprivileged Debian
//! container, the operator's pack that lists every failed unit, and the report's words.

use serde_json::{json, Value};

/// The demo scenario whose backup of container 200 (on `local`) is an unprivileged Debian
/// guest: `release` picks the bed's root filesystem (`guest.release`; bookworm without), `nics`
/// its stored `netN` in order, `files` and `links` what its root holds beside the release's own.
pub fn debian_backup(release: Option<&str>, nics: &[&str], files: Value, links: Value) -> Value {
    let mut s = crate::fakepve::demo_scenario();
    let vol = &mut s["volumes"]["local"][0];
    vol["config"] = json!({
        "arch": "amd64",
        "ostype": "debian",
        "hostname": "web1",
        "memory": "512",
        "rootfs": "local-lvm:vm-200-disk-0,size=8G",
        "unprivileged": "1",
    });
    for (i, nic) in nics.iter().enumerate() {
        vol["config"][format!("net{i}")] = json!(nic);
    }
    vol["guest"] = json!({ "files": files, "links": links });
    if let Some(release) = release {
        vol["guest"]["release"] = json!(release);
    }
    s
}

/// A NIC as pve-container stores it with a static address on vmbr0 (no gateway answers on the
/// bed's bridge, and none is needed: ifupdown brings a static address up at once).
pub const STATIC_NET0: &str =
    "name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:02:00,ip=10.20.0.31/24,gw=10.20.0.1,mtu=1450,type=veth";

/// [`debian_backup`] with [`STATIC_NET0`]: a real guest that keeps its network boots in
/// seconds. (The demo's own backup asks for DHCP, and no server answers on the bed's bridge:
/// Debian's dhclient then holds `networking.service`, and the boot, for 60 s.)
pub fn static_debian_backup() -> Value {
    debian_backup(None, &[STATIC_NET0], json!({}), json!({}))
}

/// An operator's own pack that lists every failed unit, leaving none out: in a copy whose
/// backup is fine it passes only when the isolation left nothing failed that is not the
/// backup's.
pub const EVERY_FAILED_PACK: &str = r#"
[[check]]
name = "no-failed-unit-at-all"
sql = "SELECT id FROM systemd_units WHERE active_state = 'failed'"
expect = "rows == 0"
"#;

/// Whether the report's check `name` has `status`.
pub fn check_is(doc: &Value, name: &str, status: &str) -> bool {
    doc["checks"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["name"] == name && c["status"] == status))
}

/// Whether the report ran a check `name` at all.
pub fn ran_check(doc: &Value, name: &str) -> bool {
    doc["checks"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["name"] == name))
}

/// The report's check `name`; a panic showing the report when it has none.
pub fn check<'a>(doc: &'a Value, name: &str) -> &'a Value {
    doc["checks"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no check {name}: {doc:#}"))
}

/// What the report says when a mount the user namespace cannot make was reset
/// (`tests/data/guest-units-facts.md` section 1a).
pub fn userns_reset(unit: &str, fstype: &str) -> String {
    format!(
        "{unit} failed as in every unprivileged container ({fstype} cannot be mounted in a user \
         namespace); its failed state reset"
    )
}

/// The links `systemctl mask networking.service` and `systemctl enable systemd-networkd
/// systemd-networkd-wait-online` make in a guest whose units live in `lib`
/// (`/lib/systemd/system`, `/usr/lib/systemd/system`): a systemd-networkd guest.
pub fn networkd_links(lib: &str) -> Value {
    json!({
        "/etc/systemd/system/networking.service": "/dev/null",
        "/etc/systemd/system/multi-user.target.wants/systemd-networkd.service":
            format!("{lib}/systemd-networkd.service"),
        "/etc/systemd/system/sockets.target.wants/systemd-networkd.socket":
            format!("{lib}/systemd-networkd.socket"),
        "/etc/systemd/system/network-online.target.wants/systemd-networkd-wait-online.service":
            format!("{lib}/systemd-networkd-wait-online.service"),
    })
}

/// The shop: busybox's httpd bound to the stored static address 10.20.0.31, ordered after
/// `network-online.target` (which it pulls in).
pub const SHOP_ONLINE_UNIT: &str = "[Unit]\nDescription=The shop\nWants=network-online.target\nAfter=network-online.target\n\n[Service]\nExecStart=/bin/busybox httpd -f -p 10.20.0.31:80 -h /srv/www\n";
