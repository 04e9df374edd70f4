//! The restore test's verdict on the Debian releases a fleet runs, each a real unprivileged
//! LXC container (`tests/tests/real_guests.rs` describes the bed): Debian 11 (systemd 247),
//! 12 (252) and 13 (257), nothing masked, built as `tests/testbed/build-debian-rootfs.sh` says;
//! and Debian 12 with ifupdown2, and each with NetworkManager beside ifupdown.
//! What differs between them is what breaks: systemd 247 fails journald's audit socket in a
//! user namespace, and every release fails the mounts of filesystems a user namespace cannot
//! mount (the node's doing: `tests/data/guest-units-facts.md` section 1).
//!
//! Each good backup's isolated copy must end `ok` with the default pack and with an
//! operator's pack that lists every failed unit; a unit of its own that fails must turn it red,
//! named. Each test needs LXC: on a machine where it does not work, the test prints why and ends
//! (`FELHOM_REQUIRE_REAL_GUESTS=1` makes that a failure).

use felhom_tests::fakepve::AgentOptions;
use felhom_tests::verdict::{
    check_is, debian_backup, networkd_links, userns_reset, EVERY_FAILED_PACK,
    SHOP_ONLINE_UNIT as SHOP_UNIT,
};
use felhom_tests::world::World;
use serde_json::{json, Value};

/// The shop answers on its stored address from inside the copy.
const SHOP_PACK: &str = r#"
[[check]]
name = "shop-answers"
sql = "SELECT response_code FROM curl WHERE url = 'http://10.20.0.31/'"
expect = "response_code == '200'"
guests = [200]
"#;

/// A unit the boot waits for, with no timeout, until `eth0` holds its stored address: the boot
/// of a copy whose interface came late would hang on it until the agent's boot timeout.
const WAITER_UNIT: &str = "[Unit]\nDescription=Waits for the stored address\nWants=network-online.target\nAfter=network-online.target\n\n[Service]\nType=oneshot\nRemainAfterExit=yes\nTimeoutStartSec=infinity\nExecStart=/bin/sh -c 'until ip -4 -o addr show dev eth0 | grep -q 10.20.0.31/; do sleep 0.2; done'\n";

/// A unit of the backup, ordered after `network-online.target`, that fails for its own reason.
const BROKEN_UNIT: &str = "[Unit]\nDescription=Broken for its own reason\nWants=network-online.target\nAfter=network-online.target\n\n[Service]\nType=oneshot\nExecStart=/bin/false\n";

/// isc-dhcp-client's settings: `dhclient` gives up after `timeout` seconds without a lease (60
/// by default, per interface one after the other, IPv4 and IPv6 alike) and then goes on in the
/// background; 2 s keeps the test's boot short, what the copy shows is the same.
const DHCLIENT_CONF: &str = "timeout 2;\nretry 5;\n";

/// `sys-kernel-config.mount` as a PVE node makes it fail: the node loads configfs, so
/// `/sys/kernel/config` exists in every container and systemd tries the mount, which the kernel
/// refuses in a user namespace. This machine's kernel has no configfs; the drop-in lifts the
/// unit's path condition so the same unit (`Type=configfs`) fails the same way.
const CONFIGFS_AS_ON_A_NODE: &str = "[Unit]\nConditionPathExists=\n";

/// The backup of container 200 as a Debian guest of `release`.
fn scenario(release: &str, nics: &[&str], files: Value, links: Value) -> Value {
    debian_backup(Some(release), nics, files, links)
}

/// The world of `scenario` with the shipped default pack, the operator's every-failed-unit
/// pack and the shop's pack.
fn world(scenario: Value) -> Option<World> {
    let w = World::real_or_skip(scenario, &AgentOptions::default())?;
    for (file, pack) in [
        ("operator.toml", EVERY_FAILED_PACK),
        ("shop.toml", SHOP_PACK),
    ] {
        std::fs::write(w.files.checks_dir.join(file), pack)
            .unwrap_or_else(|e| panic!("cannot write {file}: {e}"));
    }
    Some(w)
}

/// How long the lab lets a copy's `dhclient -6` wait for a lease in these tests (the agent's
/// test hook; 60 s by default, as IPv4's `dhclient` gives up by itself).
const DHCP6_GIVE_UP_SECS: &str = "2";

/// The restore test of `w`'s backup (its one pool guest's), `--json`: one copy.
fn restore_test(w: &World) -> felhom_tests::agent::AgentRun {
    w.command()
        .args(["--selftest=restore", "--json"])
        .env("FELHOM_AGENT_DHCP6_GIVE_UP_SECS", DHCP6_GIVE_UP_SECS)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the agent: {e}"))
        .into()
}

/// The seconds of the first boot wait (`systemd: <state> after <s>s`).
fn first_boot_secs(doc: &Value) -> f64 {
    let boot = doc["boot"].as_str().unwrap_or("");
    boot.split(" after ")
        .nth(1)
        .and_then(|rest| rest.split('s').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no boot time in {boot:?}"))
}

/// An ifupdown guest as pve-container's `Setup/Debian.pm` writes it: `eth0` static with
/// `ip6=dhcp` (`iface eth0 inet6 dhcp`), `eth1` and `eth2` on DHCP (two DHCP clients waiting for
/// a lease no server gives, on two bridges); the shop on `eth0`'s address, a unit
/// the boot waits for with no timeout until that address is there; `sys-kernel-config.mount`
/// failing as on a node.
fn ifupdown_guest(release: &str, extra: Value) -> Value {
    let mut files = json!({
        "/etc/dhcp/dhclient.conf": DHCLIENT_CONF,
        "/etc/systemd/system/sys-kernel-config.mount.d/node.conf": CONFIGFS_AS_ON_A_NODE,
        "/etc/systemd/system/shop.service": SHOP_UNIT,
        "/etc/systemd/system/waiter.service": WAITER_UNIT,
        "/etc/systemd/system/multi-user.target.d/app.conf":
            "[Unit]\nWants=shop.service waiter.service\n",
        "/srv/www/index.html": "the shop\n",
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        files[k] = v.clone();
    }
    scenario(
        release,
        &[
            "name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:02:00,ip=10.20.0.31/24,gw=10.20.0.1,ip6=dhcp,type=veth",
            "name=eth1,bridge=vmbr0,hwaddr=BC:24:11:00:02:01,ip=dhcp,type=veth",
            "name=eth2,bridge=vmbr1,hwaddr=BC:24:11:00:02:02,ip=dhcp,type=veth",
        ],
        files,
        json!({}),
    )
}

/// The restore test of a good backup (`scenario`) ends ok: the default pack's failed-unit
/// check, the operator's every-failed-unit check and the shop's all pass. Its report, or `None`
/// where the machine has no real guests.
fn a_good_copy_ends_ok(scenario: Value) -> Option<Value> {
    let w = world(scenario)?;
    let run = restore_test(&w);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    for check in ["no-failed-units", "no-failed-unit-at-all", "shop-answers"] {
        assert!(check_is(&doc, check, "pass"), "{check}: {doc:#}");
    }
    Some(doc)
}

/// A good ifupdown backup of `release` ends ok: both packs pass, the shop answers, the boot
/// that waits for the stored address ended within seconds (its interfaces were given before
/// the boot wait, the DHCPv6 client that waits for ever was stopped), and the report names what
/// the isolation gave, stopped and reset.
fn a_good_ifupdown_copy_ends_ok(release: &str) {
    let Some(doc) = a_good_copy_ends_ok(ifupdown_guest(release, json!({}))) else {
        return;
    };
    let changed = doc["isolation"].as_str().unwrap_or("");
    assert!(
        changed.contains("eth0 given as an unconnected veth pair")
            && changed.contains("eth1 given as an unconnected veth pair")
            && changed.contains("eth2 given as an unconnected veth pair")
            && changed.contains(&userns_reset("sys-kernel-debug.mount", "debugfs"))
            && changed.contains(&userns_reset("sys-kernel-config.mount", "configfs")),
        "{doc:#}"
    );
    // `iface eth0 inet6 dhcp`: `dhclient -6` would hold the boot until networking.service's
    // 5-minute start timeout; the lab stops it, then resets networking.service's failure, which
    // is the DHCP stanzas' alone. ifupdown2 does not wait for the DHCPv6 client, and its
    // networking.service ignores what `ifup` says: nothing to stop, nothing to reset.
    assert_eq!(
        changed.contains("the DHCPv6 client of eth0 (ip6=dhcp) waited"),
        !release.ends_with("-ifupdown2"),
        "{doc:#}"
    );
    assert_eq!(
        changed.contains("networking.service failed for the DHCP stanza of eth0, eth1, eth2"),
        !release.ends_with("-ifupdown2"),
        "{doc:#}"
    );
    // NetworkManager beside ifupdown leaves eth0 and eth1 to ifupdown (their `iface` stanzas),
    // but would manage the lab's veth peers and wait for a lease on them: the lab leaves them
    // unmanaged before they exist.
    assert_eq!(
        changed.contains("the veth peers (felabN) left unmanaged by NetworkManager"),
        release.ends_with("-nm"),
        "{doc:#}"
    );
    // systemd 247 takes the audit socket for usable in a user namespace; 252.11 and later (the
    // check's backport) do not try it there.
    assert_eq!(
        changed.contains("systemd-journald-audit.socket failed as under every systemd older"),
        release.starts_with("bullseye"),
        "{doc:#}"
    );
    // Without its interfaces before the wait, the waiter would hold the boot until the boot
    // timeout (300 s).
    let secs = first_boot_secs(&doc);
    assert!(secs < 120.0, "the boot took {secs} s: {doc:#}");
}

/// A unit of the backup ordered after `network-online.target` that fails for its own reason
/// (`ExecStart=/bin/false`) turns the copy red, named, and it alone: everything else of the
/// same guest passes, the shop answers.
fn a_broken_unit_after_network_online_turns_the_copy_red_naming_it(scenario: Value) {
    let Some(w) = world(scenario) else {
        return;
    };
    let run = restore_test(&w);
    assert_eq!(run.code, Some(5), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert_eq!(doc["error"]["code"], "check_failed", "{doc:#}");
    assert!(check_is(&doc, "no-failed-units", "fail"), "{doc:#}");
    assert!(check_is(&doc, "no-failed-unit-at-all", "fail"), "{doc:#}");
    assert!(check_is(&doc, "shop-answers", "pass"), "{doc:#}");
    let failing: Vec<&Value> = doc["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .filter(|c| c["status"] == "fail")
        .collect();
    for check in &failing {
        let rows = check["rows"].to_string();
        assert!(
            rows.contains("broken.service"),
            "{} does not name broken.service: {doc:#}",
            check["name"]
        );
        assert_eq!(
            rows.matches(".service").count()
                + rows.matches(".mount").count()
                + rows.matches(".socket").count(),
            1,
            "{} names more than broken.service: {doc:#}",
            check["name"]
        );
    }
    assert_eq!(failing.len(), 2, "{doc:#}");
    let changed = doc["isolation"].as_str().unwrap_or("");
    assert!(changed.contains("broken.service (failed)"), "{doc:#}");
    // The copy's interfaces were there for its boot: nothing waited out a timeout
    // (systemd-networkd-wait-online's is 2 minutes).
    let secs = first_boot_secs(&doc);
    assert!(secs < 60.0, "the boot took {secs} s: {doc:#}");
}

/// A systemd-networkd guest as pve-container's `Setup/Base.pm` `setup_systemd_networkd` writes
/// it (`/etc/systemd/network/eth0.network`: the static address and gateway, `DHCP = no`,
/// `IPv6AcceptRA = false`), networking.service masked, networkd and its wait-online enabled with
/// wait-online's own 2-minute timeout, the shop after `network.target`; `extra`: more files.
fn networkd_guest(release: &str, extra: Value) -> Value {
    let lib = if release == "bullseye" {
        "/lib/systemd/system"
    } else {
        "/usr/lib/systemd/system"
    };
    let mut files = json!({
        "/etc/systemd/network/eth0.network":
            "[Match]\nName=eth0\n\n[Network]\nDescription = Interface eth0 autoconfigured by PVE\nAddress = 10.20.0.31/24\nGateway = 10.20.0.1\nDHCP = no\nIPv6AcceptRA = false\n",
        "/etc/systemd/system/shop.service": SHOP_UNIT,
        "/etc/systemd/system/multi-user.target.d/app.conf": "[Unit]\nWants=shop.service\n",
        "/srv/www/index.html": "the shop\n",
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        files[k] = v.clone();
    }
    scenario(
        release,
        &["name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:02:00,ip=10.20.0.31/24,gw=10.20.0.1,type=veth"],
        files,
        networkd_links(lib),
    )
}

/// The same with a broken unit after `network-online.target`.
fn networkd_guest_with_a_broken_unit(release: &str) -> Value {
    networkd_guest(release, broken_unit_files())
}

/// A good systemd-networkd backup of `release` ends ok with both packs, the shop answering: the
/// copy was given its eth0 (networkd configured it, no `networking.service` involved) and its
/// boot waited out no timeout.
fn a_good_networkd_copy_ends_ok(release: &str) {
    let Some(doc) = a_good_copy_ends_ok(networkd_guest(release, json!({}))) else {
        return;
    };
    let changed = doc["isolation"].as_str().unwrap_or("");
    assert!(
        changed.contains("eth0 given as an unconnected veth pair")
            && !changed.contains("networking.service"),
        "{doc:#}"
    );
    let secs = first_boot_secs(&doc);
    assert!(secs < 60.0, "the boot took {secs} s: {doc:#}");
}

#[test]
fn a_good_debian_11_networkd_copy_ends_ok() {
    a_good_networkd_copy_ends_ok("bullseye");
}

#[test]
fn a_good_debian_13_networkd_copy_ends_ok() {
    a_good_networkd_copy_ends_ok("trixie");
}

#[test]
fn a_good_debian_11_ifupdown_copy_ends_ok() {
    a_good_ifupdown_copy_ends_ok("bullseye");
}

#[test]
fn a_good_debian_12_ifupdown_copy_ends_ok() {
    a_good_ifupdown_copy_ends_ok("bookworm");
}

#[test]
fn a_good_debian_13_ifupdown_copy_ends_ok() {
    a_good_ifupdown_copy_ends_ok("trixie");
}

/// ifupdown2 in place of ifupdown (Debian 11's 3.0.0): the same `/etc/network/interfaces`.
#[test]
fn a_good_debian_11_ifupdown2_copy_ends_ok() {
    a_good_ifupdown_copy_ends_ok("bullseye-ifupdown2");
}

/// ifupdown2 in place of ifupdown (Debian 12's 3.0.0).
#[test]
fn a_good_debian_12_ifupdown2_copy_ends_ok() {
    a_good_ifupdown_copy_ends_ok("bookworm-ifupdown2");
}

/// ifupdown2 in place of ifupdown (Debian 13's).
#[test]
fn a_good_debian_13_ifupdown2_copy_ends_ok() {
    a_good_ifupdown_copy_ends_ok("trixie-ifupdown2");
}

/// A copy of an ifupdown guest of `release` that has NetworkManager beside ifupdown, as a Debian
/// desktop install has it (`<release>-nm`: network-manager 1.30, 1.42, 1.52):
/// `NetworkManager-wait-online.service`, which the package enables, runs before
/// `network-online.target`, which the shop and the waiter pull in.
fn network_manager_guest(release: &str, extra: Value) -> Value {
    ifupdown_guest(&format!("{release}-nm"), extra)
}

/// The broken unit of `a_broken_unit_after_network_online_turns_the_copy_red_naming_it`, for an
/// ifupdown guest.
fn broken_unit_files() -> Value {
    json!({
        "/etc/systemd/system/broken.service": BROKEN_UNIT,
        "/etc/systemd/system/multi-user.target.d/broken.conf": "[Unit]\nWants=broken.service\n",
    })
}

#[test]
fn a_good_debian_11_copy_with_network_manager_ends_ok() {
    a_good_ifupdown_copy_ends_ok("bullseye-nm");
}

#[test]
fn a_good_debian_12_copy_with_network_manager_ends_ok() {
    a_good_ifupdown_copy_ends_ok("bookworm-nm");
}

#[test]
fn a_good_debian_13_copy_with_network_manager_ends_ok() {
    a_good_ifupdown_copy_ends_ok("trixie-nm");
}

#[test]
fn a_debian_11_copy_with_network_manager_and_a_broken_unit_after_network_online_is_red_naming_it() {
    a_broken_unit_after_network_online_turns_the_copy_red_naming_it(network_manager_guest(
        "bullseye",
        broken_unit_files(),
    ));
}

#[test]
fn a_debian_12_copy_with_network_manager_and_a_broken_unit_after_network_online_is_red_naming_it() {
    a_broken_unit_after_network_online_turns_the_copy_red_naming_it(network_manager_guest(
        "bookworm",
        broken_unit_files(),
    ));
}

#[test]
fn a_debian_13_copy_with_network_manager_and_a_broken_unit_after_network_online_is_red_naming_it() {
    a_broken_unit_after_network_online_turns_the_copy_red_naming_it(network_manager_guest(
        "trixie",
        broken_unit_files(),
    ));
}

#[test]
fn a_debian_12_ifupdown_copy_with_a_broken_unit_after_network_online_is_red_naming_it() {
    a_broken_unit_after_network_online_turns_the_copy_red_naming_it(ifupdown_guest(
        "bookworm",
        broken_unit_files(),
    ));
}

#[test]
fn a_debian_12_ifupdown2_copy_with_a_broken_unit_after_network_online_is_red_naming_it() {
    a_broken_unit_after_network_online_turns_the_copy_red_naming_it(ifupdown_guest(
        "bookworm-ifupdown2",
        broken_unit_files(),
    ));
}

#[test]
fn a_debian_11_networkd_copy_with_a_broken_unit_after_network_online_is_red_naming_it() {
    a_broken_unit_after_network_online_turns_the_copy_red_naming_it(
        networkd_guest_with_a_broken_unit("bullseye"),
    );
}

#[test]
fn a_debian_12_networkd_copy_with_a_broken_unit_after_network_online_is_red_naming_it() {
    a_broken_unit_after_network_online_turns_the_copy_red_naming_it(
        networkd_guest_with_a_broken_unit("bookworm"),
    );
}

#[test]
fn a_debian_13_networkd_copy_with_a_broken_unit_after_network_online_is_red_naming_it() {
    a_broken_unit_after_network_online_turns_the_copy_red_naming_it(
        networkd_guest_with_a_broken_unit("trixie"),
    );
}

/// `/etc/network/interfaces` of a guest whose one NIC, `eth0`, is stored with `ip=dhcp` and
/// `ip6=dhcp`, as pve-container's `Setup/Debian.pm` writes it (`auto eth0`, `iface eth0 inet
/// dhcp`, `iface eth0 inet6 dhcp`), and `extra`: stanzas of the guest's own after it (what
/// `setup_network` keeps of a file it rewrites).
fn dhcp_eth0_interfaces(extra: &str) -> String {
    format!(
        "auto lo\niface lo inet loopback\n\nauto eth0\niface eth0 inet dhcp\n\niface eth0 inet6 \
         dhcp\n\n{extra}"
    )
}

/// A VLAN stanza of the guest's own that fails on every kernel: its raw device, `eth1`, is no
/// NIC of the backup (a VLAN left on a NIC the container no longer has). ifupdown 0.8's
/// built-in VLAN support (`link.defn`, for an interface named `<raw>.<id>`) makes the VLAN only
/// when `/sys/class/net/<raw>` exists, so `ip addr add … dev eth1.5` then fails ("Cannot find
/// device") and `ifup -a`, so `networking.service`, fails for it, in production as in the copy.
/// (`eth0.5` would fail in this bed too, whose kernel has no 802.1Q support, but come up on a
/// node that has it: `tests/data/guest-units-facts.md` section 2.)
const BROKEN_VLAN: &str = "auto eth1.5\niface eth1.5 inet static\n\taddress 10.5.0.31/24\n";

/// A Debian 12 ifupdown guest with DHCP on `eth0` (IPv4 and IPv6: `dhclient -6` waits for ever,
/// the lab stops it, so `networking.service` fails for the DHCP stanza) and `extra` stanzas of
/// its own; the world with the shipped default pack and the operator's every-failed-unit pack.
fn dhcp_guest_world(extra: &str) -> Option<World> {
    let s = scenario(
        "bookworm",
        &["name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:02:00,ip=dhcp,ip6=dhcp,type=veth"],
        json!({
            "/etc/dhcp/dhclient.conf": DHCLIENT_CONF,
            "/etc/network/interfaces": dhcp_eth0_interfaces(extra),
        }),
        json!({}),
    );
    let w = World::real_or_skip(s, &AgentOptions::default())?;
    std::fs::write(w.files.checks_dir.join("operator.toml"), EVERY_FAILED_PACK)
        .unwrap_or_else(|e| panic!("cannot write the operator's pack: {e}"));
    Some(w)
}

/// The control of the test below: the same DHCP guest without the VLAN stanza. No lease can
/// come in the copy, `networking.service` fails for `eth0`'s DHCP stanza alone (every other
/// `auto` stanza, `lo`, is up), its failed state is reset, and the copy ends ok.
#[test]
fn a_debian_12_ifupdown_copy_with_a_dhcp_nic_ends_ok_its_dhcp_failure_reset() {
    let Some(w) = dhcp_guest_world("") else {
        return;
    };
    let run = restore_test(&w);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert!(check_is(&doc, "no-failed-units", "pass"), "{doc:#}");
    assert!(check_is(&doc, "no-failed-unit-at-all", "pass"), "{doc:#}");
    let changed = doc["isolation"].as_str().unwrap_or("");
    assert!(
        changed.contains("networking.service failed for the DHCP stanza of eth0")
            && !changed.contains("left failed"),
        "{doc:#}"
    );
}

/// A DHCP NIC does not hide a broken stanza: with [`BROKEN_VLAN`] beside the DHCP `eth0`,
/// `networking.service` fails for both; the lab resets it only when every `auto` stanza that
/// did not come up is a stored DHCP one, so here it stays failed, the copy is red, and the
/// failing checks name the unit and, in their message, the VLAN's interface.
#[test]
fn a_debian_12_ifupdown_copy_with_a_dhcp_nic_and_a_broken_vlan_stanza_is_red_naming_it() {
    let Some(w) = dhcp_guest_world(BROKEN_VLAN) else {
        return;
    };
    let run = restore_test(&w);
    assert_eq!(run.code, Some(5), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert_eq!(doc["error"]["code"], "check_failed", "{doc:#}");
    for check in ["no-failed-units", "no-failed-unit-at-all"] {
        assert!(check_is(&doc, check, "fail"), "{check}: {doc:#}");
    }
    let message = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("networking.service")
            && message.contains("the stanza of eth1.5 did not come up"),
        "{message}"
    );
    let changed = doc["isolation"].as_str().unwrap_or("");
    assert!(
        changed.contains("networking.service left failed: the stanza of eth1.5")
            && !changed.contains("networking.service failed for the DHCP stanza"),
        "{doc:#}"
    );
}
