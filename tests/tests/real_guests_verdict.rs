//! The restore test's verdict on real guests (unprivileged LXC containers running Debian 12
//! with systemd, `tests/tests/real_guests.rs` describes the bed): the checks judge a booted
//! guest. Each test needs LXC: on a machine where it does not work, the test prints why and
//! ends (`FELHOM_REQUIRE_REAL_GUESTS=1` makes that a failure).

use felhom_tests::fakepve::AgentOptions;
use felhom_tests::verdict::{self, check_is, debian_backup, EVERY_FAILED_PACK, SHOP_ONLINE_UNIT};
use felhom_tests::world::World;
use serde_json::{json, Value};

/// The backup of the demo's container 200 as a Debian guest with a static `eth0`.
const NET0: &str =
    "name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:02:00,ip=10.20.0.31/24,gw=10.20.0.1,type=veth";

/// A unit of the backup that sleeps 5 s, then fails, started by the boot (`multi-user.target`
/// wants it): it is failed only 5 s into the boot.
const LATE_UNIT: &str = "[Unit]\nDescription=Sleeps 5 s, then fails\n\n[Service]\nType=oneshot\nExecStart=/bin/sh -c 'sleep 5; exit 1'\n";
const LATE_WANTS: &str = "[Unit]\nWants=late.service\n";

fn debian_scenario(files: Value) -> Value {
    debian_scenario_with(files, Some(NET0))
}

/// The same guest; `net0`: its stored NIC (`None`: the backup stores none).
fn debian_scenario_with(files: Value, net0: Option<&str>) -> Value {
    debian_backup(None, net0.as_slice(), files, json!({}))
}

/// The failed-unit check, leaving out the two units this bed's isolated Debian copy shows
/// failed whatever its backup holds (`networking.service`: no NIC; `sys-kernel-debug.mount`:
/// Debian's `userns.conf`), so this file judges the boot wait alone.
const PACK: &str = r#"
[[check]]
name = "no-other-failed-units"
sql = "SELECT id, active_state, sub_state FROM systemd_units WHERE active_state = 'failed' AND id != 'networking.service' AND id != 'sys-kernel-debug.mount'"
expect = "rows == 0"

[[check]]
name = "systemd-runs"
sql = "SELECT id FROM systemd_units WHERE id = 'systemd-journald.service' AND active_state = 'active'"
expect = "rows == 1"
"#;

fn real_world(files: Value) -> Option<World> {
    let w = World::real_or_skip(debian_scenario(files), &AgentOptions::default())?;
    // The restore test reads the provision's check packs (no [restore_test] checks_dir).
    std::fs::write(w.files.checks_dir.join("default.toml"), PACK)
        .unwrap_or_else(|e| panic!("cannot write the check pack: {e}"));
    Some(w)
}

#[test]
fn a_unit_failing_5_s_into_the_boot_of_a_real_copy_turns_its_restore_test_red_naming_it() {
    let Some(w) = real_world(json!({
        "/etc/systemd/system/late.service": LATE_UNIT,
        "/etc/systemd/system/multi-user.target.d/late.conf": LATE_WANTS,
    })) else {
        return;
    };
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(5), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert_eq!(doc["error"]["code"], "check_failed", "{doc:#}");
    let message = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("no-other-failed-units") && message.contains("late.service"),
        "{message}"
    );
    assert!(
        doc["boot"]
            .as_str()
            .is_some_and(|b| b.starts_with("systemd: degraded")),
        "{doc:#}"
    );
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
}

#[test]
fn a_real_copy_whose_backup_is_fine_ends_ok_after_its_boot() {
    let Some(w) = real_world(json!({})) else {
        return;
    };
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    // The boot as first seen, then the wait that followed the isolation's restarts.
    assert!(
        doc["boot"]
            .as_str()
            .is_some_and(|b| b.starts_with("systemd: ")
                && b.contains("; after the isolation, systemd: running after")),
        "{doc:#}"
    );
}

/// The default pack as shipped, and an operator's pack that lists every failed unit, judge a
/// real unprivileged Debian copy whose backup is fine and stores no NIC (no interface to give):
/// ok; `sys-kernel-debug.mount`, failed in it as in every unprivileged container on PVE
/// (`tests/data/guest-units-facts.md` section 1), had its failed state reset, and that is all
/// the isolation says.
#[test]
fn the_default_pack_passes_a_real_unprivileged_debian_copy_whose_backup_is_fine() {
    let Some(w) = world_with_every_failed_pack(debian_scenario_with(json!({}), None)) else {
        return;
    };
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert!(check_is(&doc, "no-failed-units", "pass"), "{doc:#}");
    assert!(check_is(&doc, "no-failed-unit-at-all", "pass"), "{doc:#}");
    assert_eq!(doc["isolation"], json!(DEBUGFS_RESET), "{doc:#}");
}

/// The links of the network namespace of process `pid`, as `ip -o link show` prints them there.
fn links_in_netns_of(pid: &str) -> String {
    let out = std::process::Command::new("nsenter")
        .args(["-t", pid, "-n", "ip", "-o", "link", "show"])
        .output()
        .expect("nsenter");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every link of this machine whose name starts with `prefix`, with its bridge ports.
fn bed_links_and_ports(prefix: &str) -> Vec<String> {
    let mut all = Vec::new();
    for link in felhom_tests::guestbed::links_with_prefix(prefix) {
        let brif = std::path::Path::new("/sys/class/net")
            .join(&link)
            .join("brif");
        let mut ports: Vec<String> = std::fs::read_dir(&brif)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        ports.sort();
        all.push(format!("{link} ports {ports:?}"));
    }
    all.sort();
    all
}

/// LXC's init pid of container `vmid` once it runs (180 s at most).
fn init_pid_of(lxc_path: &str, vmid: u32) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
    loop {
        let out = std::process::Command::new("lxc-info")
            .args(["-P", lxc_path, "-n", &vmid.to_string(), "-p", "-H"])
            .output()
            .expect("lxc-info");
        let pid = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && !pid.is_empty() && pid.chars().all(|c| c.is_ascii_digit()) {
            return pid;
        }
        assert!(std::time::Instant::now() < deadline, "CT {vmid} never ran");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// The two looks of the isolation test below see a guest that is connected: a guest provisioned
/// with its stored network has an `eth0` whose peer is outside its namespace (`link-netnsid`),
/// and the bed's bridge gained that peer as a port. So that test fails when a copy is wired to
/// the outside.
#[test]
fn the_looks_from_the_host_see_a_guest_with_its_stored_network_wired_to_the_bridge() {
    let Some(w) = real_world(json!({})) else {
        return;
    };
    let prefix = w.bed.net_prefix().expect("real bed").to_string();
    let before = bed_links_and_ports(&prefix);
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "123",
        "--network",
        "stored",
        "--keep",
        "--json",
    ]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let pid = init_pid_of(&w.bed.lxc_path().display().to_string(), 123);
    let links = links_in_netns_of(&pid);
    assert!(
        links.contains(": eth0@") && links.contains("link-netnsid"),
        "{links}"
    );
    let during = bed_links_and_ports(&prefix);
    assert_ne!(
        before, during,
        "no bridge port appeared for the connected guest"
    );
}

/// From the host, while a restore-test copy of a guest with a stored NIC runs: no interface in
/// the copy's network namespace has a peer outside it (`ip` prints `link-netnsid` for a veth
/// whose other end is in another namespace), also once it was given its stored `eth0` as a
/// pair, and no link or bridge port of the bed appeared.
#[test]
fn a_running_restore_test_copy_has_no_interface_with_a_peer_outside_and_the_bridges_gain_no_port() {
    // A boot of 5 s more (a unit that sleeps, then succeeds): the copy runs long enough to look.
    let slow =
        "[Unit]\nDescription=Sleeps 5 s\n\n[Service]\nType=oneshot\nExecStart=/bin/sleep 5\n";
    let Some(w) = real_world(json!({
        "/etc/systemd/system/slow.service": slow,
        "/etc/systemd/system/multi-user.target.d/slow.conf": "[Unit]\nWants=slow.service\n",
    })) else {
        return;
    };
    let prefix = w.bed.net_prefix().expect("real bed").to_string();
    let before = bed_links_and_ports(&prefix);
    let lxc_path = w.bed.lxc_path().display().to_string();
    let child = w
        .command()
        .args(["--selftest=restore", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("agent");
    let pid = init_pid_of(&lxc_path, 990002);
    // Until the copy has been given its eth0 (after its boot), then look.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let links = loop {
        let links = links_in_netns_of(&pid);
        if links.contains(": eth0") || std::time::Instant::now() >= deadline {
            break links;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let during = bed_links_and_ports(&prefix);
    let out: felhom_tests::agent::AgentRun = child.wait_with_output().expect("agent").into();
    assert_eq!(out.code, Some(0), "{}\n{}", out.stdout, out.stderr);
    assert!(
        links.contains(": eth0@") && links.contains(": felab0@"),
        "the copy was not given its eth0 as a pair:\n{links}"
    );
    assert!(
        !links.contains("link-netnsid"),
        "an interface of the copy has its peer in another namespace:\n{links}"
    );
    assert_eq!(
        before, during,
        "the bed's links or bridge ports changed while the copy ran"
    );
}

/// What the report says when a restore-test copy's `sys-kernel-debug.mount` was reset
/// (`tests/data/guest-units-facts.md` section 1).
const DEBUGFS_RESET: &str = "sys-kernel-debug.mount failed as in every unprivileged container \
(debugfs cannot be mounted in a user namespace); its failed state reset";

/// The world of `scenario` with the shipped default pack and the operator's pack that lists
/// every failed unit.
fn world_with_every_failed_pack(scenario: Value) -> Option<World> {
    let w = World::real_or_skip(scenario, &AgentOptions::default())?;
    std::fs::write(w.files.checks_dir.join("operator.toml"), EVERY_FAILED_PACK)
        .unwrap_or_else(|e| panic!("cannot write the operator's pack: {e}"));
    Some(w)
}

/// A Debian guest with a static `eth0` stored in its backup: its isolated copy is given `eth0`
/// as a veth pair whose other end is inside the copy too, before its boot wait (so
/// `networking.service` finds it, or, when it ran before the device was there, is restarted),
/// `sys-kernel-debug.mount` (failed as in every unprivileged container) is reset, and the
/// restore test ends ok with the default pack as shipped and with an operator's pack that
/// lists every failed unit; the report names what the isolation changed.
#[test]
fn an_isolated_copy_with_a_static_eth0_is_given_it_and_ends_ok_with_the_default_and_an_every_failed_unit_pack(
) {
    let Some(w) = world_with_every_failed_pack(debian_scenario(json!({}))) else {
        return;
    };
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert!(check_is(&doc, "no-failed-units", "pass"), "{doc:#}");
    assert!(check_is(&doc, "no-failed-unit-at-all", "pass"), "{doc:#}");
    let changed = doc["isolation"].as_str().unwrap_or("");
    assert!(
        changed.contains("eth0 given as an unconnected veth pair")
            && changed.contains(DEBUGFS_RESET),
        "{doc:#}"
    );
    // The backup is proven now: `--guest 200` tests it again, for the text.
    let text = w.agent(&["--selftest=restore", "--guest", "200"]);
    assert_eq!(text.code, Some(0), "{}\n{}", text.stdout, text.stderr);
    assert!(
        text.stdout.contains("\n  isolation: eth0 given"),
        "{}",
        text.stdout
    );
}

/// A Debian guest with DHCP on `eth0` and `eth1`: both are given inside the copy; no lease can
/// come in a copy that reaches nothing, so `networking.service` fails again for the DHCP
/// stanzas alone, its failed state is reset and the report says so: the restore test ends ok
/// with the default pack and with an operator's pack that lists every failed unit
/// (`sys-kernel-debug.mount` reset and named too).
#[test]
fn an_isolated_copy_with_dhcp_on_eth0_and_eth1_ends_ok_without_a_lease() {
    let mut scenario = debian_scenario_with(
        json!({ "/etc/dhcp/dhclient.conf": DHCLIENT_CONF }),
        Some("name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:02:00,ip=dhcp,type=veth"),
    );
    scenario["volumes"]["local"][0]["config"]["net1"] =
        json!("name=eth1,bridge=vmbr0,hwaddr=BC:24:11:00:02:01,ip=dhcp,type=veth");
    let Some(w) = world_with_every_failed_pack(scenario) else {
        return;
    };
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert!(check_is(&doc, "no-failed-units", "pass"), "{doc:#}");
    assert!(check_is(&doc, "no-failed-unit-at-all", "pass"), "{doc:#}");
    let changed = doc["isolation"].as_str().unwrap_or("");
    // With isc-dhcp-client (every real template has it), `dhclient` gives up after its timeout
    // and goes on in the background, so `ifup` and networking.service succeed without a lease
    // (`tests/data/guest-units-facts.md` section 2): nothing is left failed to reset.
    assert!(
        changed.contains("eth0 given as an unconnected veth pair")
            && changed.contains("eth1 given as an unconnected veth pair")
            && changed.contains(DEBUGFS_RESET),
        "{doc:#}"
    );
}

/// isc-dhcp-client's settings in the DHCP guests' backups: `ifup` runs `dhclient -1`, which
/// gives up after `timeout` seconds without a lease (60 by default, per interface, one after
/// the other: a copy with two DHCP stanzas boots 2 minutes longer than production). 2 s keeps
/// the test's boot short; what the copy then shows is the same.
const DHCLIENT_CONF: &str = "timeout 2;\nretry 5;\n";

/// A unit of the backup that fails at its first start in a boot and would succeed when
/// started again: it passes only when `/srv/www/flaky-ran` exists, which its `ExecStopPost`
/// writes (`ExecStopPost` runs after a failed start too). It has no network ordering.
const FLAKY_UNIT: &str = "[Unit]\nDescription=Fails at its first start only\n\n[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/test -e /srv/www/flaky-ran\nExecStopPost=/bin/sh -c 'echo ran >/srv/www/flaky-ran'\n";

/// Beside the shop's pack ([`SHOP_PACK`]): the shop serves the file the flaky unit's
/// `ExecStopPost` wrote (so a restart of that unit would have succeeded).
const FLAKY_PACK: &str = r#"
[[check]]
name = "flaky-would-start-now"
sql = "SELECT response_code FROM curl WHERE url = 'http://10.20.0.31/flaky-ran'"
expect = "response_code == '200'"
guests = [200]
"#;

/// The restart after the interfaces were given is narrow: a unit with no network ordering that
/// failed at the boot for a reason of its own (and would succeed if restarted) is left failed,
/// named in the report, and the operator's pack that lists every failed unit turns the restore
/// test red naming it; the shop (`After=network-online.target`, bound to the stored address)
/// answers; `sys-kernel-debug.mount` is not what the check names.
#[test]
fn a_unit_failing_at_boot_for_its_own_reason_is_not_restarted_and_turns_the_restore_test_red() {
    let files = json!({
        "/etc/systemd/system/flaky.service": FLAKY_UNIT,
        "/etc/systemd/system/multi-user.target.d/flaky.conf": "[Unit]\nWants=flaky.service\n",
        "/etc/systemd/system/shop.service": SHOP_ONLINE_UNIT,
        "/etc/systemd/system/multi-user.target.d/shop.conf": "[Unit]\nWants=shop.service\n",
        "/srv/www/index.html": "the shop\n",
    });
    let Some(w) = world_with_every_failed_pack(debian_scenario(files)) else {
        return;
    };
    for (file, pack) in [("shop.toml", SHOP_PACK), ("flaky.toml", FLAKY_PACK)] {
        std::fs::write(w.files.checks_dir.join(file), pack)
            .unwrap_or_else(|e| panic!("cannot write {file}: {e}"));
    }
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(5), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert_eq!(doc["error"]["code"], "check_failed", "{doc:#}");
    let message = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("no-failed-unit-at-all") && message.contains("flaky.service"),
        "{message}"
    );
    assert!(!message.contains("sys-kernel-debug.mount"), "{message}");
    assert!(check_is(&doc, "no-failed-unit-at-all", "fail"), "{doc:#}");
    assert!(check_is(&doc, "no-failed-units", "fail"), "{doc:#}");
    assert!(check_is(&doc, "shop-answers", "pass"), "{doc:#}");
    assert!(check_is(&doc, "flaky-would-start-now", "pass"), "{doc:#}");
    let changed = doc["isolation"].as_str().unwrap_or("");
    assert!(
        changed
            .contains("left failed (no network ordering: its failure is its own): flaky.service")
            && !changed.contains("flaky.service (")
            && changed.contains(DEBUGFS_RESET),
        "{doc:#}"
    );
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
}

/// A systemd-networkd guest: `networking.service` masked, `systemd-networkd` (with its socket)
/// and `systemd-networkd-wait-online.service` enabled (the links `systemctl enable` and `mask`
/// make), the stored static address in `/etc/systemd/network/eth0.network` (nothing else: IPv6
/// router advertisements are accepted, networkd's default), and the shop
/// (`After=network-online.target`, which pulls the wait in) bound to it. wait-online's own
/// timeout is 2 minutes (`--timeout=120` by default); a drop-in makes it 5 s so the copy's
/// boot, where no link can come online, ends within the test's time. `eth0` is given before
/// the boot wait: networkd sets its address (the shop answers) but keeps it `configuring` (no
/// router advertisement can come), so wait-online fails, and again after its restart; the isolation
/// resets it and says why (`tests/data/guest-units-facts.md` section 2).
#[test]
fn an_isolated_copy_of_a_systemd_networkd_guest_ends_ok_with_the_default_pack() {
    let lib = "/lib/systemd/system";
    let mut scenario = debian_scenario(json!({
        "/etc/systemd/network/eth0.network":
            "[Match]\nName=eth0\n\n[Network]\nAddress=10.20.0.31/24\nGateway=10.20.0.1\n",
        "/etc/systemd/system/systemd-networkd-wait-online.service.d/timeout.conf":
            "[Service]\nExecStart=\nExecStart=/lib/systemd/systemd-networkd-wait-online --timeout=5\n",
        "/etc/systemd/system/shop.service": SHOP_ONLINE_UNIT,
        "/etc/systemd/system/multi-user.target.d/shop.conf": "[Unit]\nWants=shop.service\n",
        "/srv/www/index.html": "the shop\n",
    }));
    scenario["volumes"]["local"][0]["guest"]["links"] = felhom_tests::verdict::networkd_links(lib);
    let Some(w) = world_with_every_failed_pack(scenario) else {
        return;
    };
    std::fs::write(w.files.checks_dir.join("shop.toml"), SHOP_PACK)
        .unwrap_or_else(|e| panic!("cannot write the shop pack: {e}"));
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert!(check_is(&doc, "no-failed-units", "pass"), "{doc:#}");
    assert!(check_is(&doc, "no-failed-unit-at-all", "pass"), "{doc:#}");
    assert!(check_is(&doc, "shop-answers", "pass"), "{doc:#}");
    let changed = doc["isolation"].as_str().unwrap_or("");
    assert!(
        changed.contains("eth0 given as an unconnected veth pair")
            && changed.contains("restarted systemd-networkd-wait-online.service (failed)")
            && changed.contains(
                "systemd-networkd-wait-online.service failed although every given interface \
                 networkd manages is online"
            )
            && changed.contains(DEBUGFS_RESET)
            && !changed.contains("networking.service"),
        "{doc:#}"
    );
}

/// The shop: busybox's httpd bound to the guest's stored address (it fails at the copy's boot,
/// the address being missing, and runs once the copy was given its eth0).
const SHOP_UNIT: &str = "[Unit]\nDescription=The shop\nAfter=network.target\n\n[Service]\nExecStart=/bin/busybox httpd -f -p 10.20.0.31:80 -h /srv/www\n";

/// The application checks: the shop answers from inside the copy (osquery's `curl` table), for
/// the copies of guest 200 only; a check for another guest does not run.
const SHOP_PACK: &str = r#"
[[check]]
name = "shop-answers"
sql = "SELECT response_code FROM curl WHERE url = 'http://10.20.0.31/'"
expect = "response_code == '200'"
guests = [200]

[[check]]
name = "other-guests-app"
sql = "SELECT response_code FROM curl WHERE url = 'http://10.20.0.99/'"
expect = "response_code == '200'"
guests = [999]
guest_tags = ["not-this-one"]
"#;

fn shop_world(enabled: bool) -> Option<World> {
    let mut files = json!({
        "/etc/systemd/system/shop.service": SHOP_UNIT,
        "/srv/www/index.html": "the shop\n",
    });
    if enabled {
        files["/etc/systemd/system/multi-user.target.d/shop.conf"] =
            json!("[Unit]\nWants=shop.service\n");
    }
    let w = World::real_or_skip(debian_scenario(files), &AgentOptions::default())?;
    std::fs::write(w.files.checks_dir.join("shop.toml"), SHOP_PACK)
        .unwrap_or_else(|e| panic!("cannot write the shop pack: {e}"));
    Some(w)
}

#[test]
fn the_shop_answers_from_inside_its_isolated_copy() {
    let Some(w) = shop_world(true) else {
        return;
    };
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert!(check_is(&doc, "shop-answers", "pass"), "{doc:#}");
    assert!(
        !verdict::ran_check(&doc, "other-guests-app"),
        "a check for other guests ran: {doc:#}"
    );
    assert!(
        doc["isolation"]
            .as_str()
            .is_some_and(|i| i.contains("eth0 given as an unconnected veth pair")),
        "{doc:#}"
    );
}

#[test]
fn with_the_shops_unit_disabled_in_the_backup_the_restore_test_is_red_naming_the_check() {
    let Some(w) = shop_world(false) else {
        return;
    };
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(5), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    let message = doc["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("shop-answers"), "{message}");
    assert!(
        !verdict::ran_check(&doc, "other-guests-app"),
        "a check for other guests ran: {doc:#}"
    );
}

/// The same restore test dispatched by the hub: the result the hub received says what the
/// isolation changed (the copy's `eth0` given as an unconnected pair), as `--json` does.
#[test]
fn a_hub_dispatched_restore_test_of_a_real_copy_tells_the_hub_what_the_isolation_changed() {
    use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
    use hub_protocol::{DispatchAction, Outcome};

    let hub = DevHub::start(DevHubOptions::default());
    let opts = AgentOptions {
        hub: Some(hub.hub_options()),
        ..AgentOptions::default()
    };
    let Some(w) = World::real_or_skip(debian_scenario(json!({})), &opts) else {
        return;
    };
    let path = w.path();
    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str())],
    );
    let wait = std::time::Duration::from_secs(300);
    hub.wait_for("the session", wait, |s| s.sessions == 1);
    let txn = hub.dispatch(DispatchAction::RestoreTest { dry_run: false });
    let state = hub.wait_for("the restore test's result", wait, |s| {
        s.results.contains_key(&txn)
    });
    let result = &state.results[&txn][0].1;
    assert_eq!(result.outcome, Outcome::Ok, "{result:?}");
    let changed = result.isolation.as_deref().unwrap_or("");
    assert!(
        changed.contains("eth0 given as an unconnected veth pair")
            && changed.contains(DEBUGFS_RESET),
        "{result:?}"
    );
    drop(agent);
}
