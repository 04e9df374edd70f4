//! Application groups on real containers (`[[restore_test.group]]`): a database guest (200,
//! busybox httpd on its stored address 10.20.0.30) and a shop guest (201, whose order page is a
//! CGI that asks the database over the network and answers 502 when it cannot). The shop's
//! check of its order page is red when the shop is proven alone (its copy reaches nothing) and
//! green when the two are proven as a group (their stored NICs joined to the group's lab, a
//! bridge in a network namespace of its own that the root helper makes); a group whose
//! database is broken is red, and the shop's failing check names the database member. The
//! lab's namespace is gone after the run. A database bound to its hostname serves the shop
//! (the lab gives PVE's /etc/hosts line the stored net0 address back); a shop on another
//! subnet is warned of by the group's run, and cannot reach the database. What a red group's run
//! shows besides its copies: `restore-report`'s group column, `journal --last restore-test`'s
//! member lines, the metrics (one run, the group's outcome) and the hub (one result per member,
//! naming the group and its run). Each test needs LXC (`tests/tests/real_guests.rs`); the last,
//! a group of a container and a VM, also QEMU (`tests/tests/real_vm.rs`).

use std::time::Duration;

use felhom_tests::agent::KERNEL_ROOT_ENV;
use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
use felhom_tests::fakepve::{add_qemu_backup, qemu_backup_config, AgentOptions};
use felhom_tests::groups::{add_group, copy_of, BROKEN_DB_UNIT, DATABASE_CHECK, SHOP};
use felhom_tests::verdict::{check, check_is, ran_check};
use felhom_tests::world::World;
use serde_json::{json, Value};

/// The database bound to the address its hostname resolves to, as a database told to listen on
/// its own name does (`listen_addresses = 'db'`): it waits for eth0's address (failed before
/// it, restarted by the lab after the boot), then binds what `getent` says of `db`. In a copy
/// whose /etc/hosts PVE wrote without net0 (`127.0.1.1 db`) it listens on loopback.
const DB_BY_NAME_UNIT: &str = "[Unit]\nDescription=The database, on its hostname\nWants=network-online.target\nAfter=network-online.target\n\n[Service]\nExecStart=/bin/sh /srv/db-serve\n";

/// What [`DB_BY_NAME_UNIT`] runs.
const DB_SERVE: &str = "#!/bin/sh\nip -o -4 addr show dev eth0 2>/dev/null | grep -q ' inet ' || { echo 'eth0 has no address yet' >&2; exit 1; }\naddr=$(getent ahostsv4 \"$(cat /etc/hostname)\" | awk 'NR == 1 {print $1}')\necho \"listening on $addr\"\nexec /bin/busybox httpd -f -p \"$addr:80\" -h /srv/db\n";

/// The operator's checks of the shop and the database ([`Shop::pack`]), and the shop's order
/// page again as a check that needs the group (`in_group = true`).
fn shop_pack() -> String {
    format!(
        "{}\n[[check]]\nname = \"order-page-with-its-database\"\nsql = \"SELECT response_code FROM curl WHERE url = 'http://{}/cgi-bin/order'\"\nexpect = \"response_code == '200'\"\nguests = [201]\nin_group = true\n",
        SHOP.pack(),
        SHOP.shop_ip()
    )
}

/// The pool with the database (its unit `db_unit`, beside [`DB_SERVE`]) and the shop.
fn scenario(db_unit: &str) -> Value {
    scenario_with(db_unit, &SHOP.shop_ip())
}

/// [`scenario`] with the shop stored at `shop_ip` (/24).
fn scenario_with(db_unit: &str, shop_ip: &str) -> Value {
    SHOP.scenario_with_shop_at(
        db_unit,
        json!({"/srv/db-serve": DB_SERVE}),
        json!({}),
        shop_ip,
    )
}

/// The world of `scenario` with the shop's pack, and the group when `grouped`.
fn world(scenario: Value, grouped: bool) -> Option<World> {
    world_with(scenario, grouped, &AgentOptions::default())
}

/// [`world`] with the agent's options (a hub).
fn world_with(scenario: Value, grouped: bool, opts: &AgentOptions) -> Option<World> {
    let w = World::real_or_skip(scenario, opts)?;
    std::fs::write(w.files.checks_dir.join("shop.toml"), shop_pack())
        .unwrap_or_else(|e| panic!("cannot write the pack: {e}"));
    if grouped {
        add_group(&w.files.config_path, "shop", &[200, 201], 1);
    }
    Some(w)
}

/// `--selftest=restore --guest 201 --json` to its end ([`groups::prove`]).
fn prove_shop(w: &World) -> (Option<i32>, Vec<Value>, String) {
    felhom_tests::groups::prove(w, 201)
}

/// The lab's namespace named in a copy's document is gone.
fn assert_lab_gone(copy: &Value) {
    let lab = copy["group"]["lab"]
        .as_str()
        .unwrap_or_else(|| panic!("no group lab in {copy:#}"));
    assert!(lab.starts_with("felhom-g-"), "{lab}");
    assert!(
        !std::path::Path::new("/run/netns").join(lab).exists(),
        "the group's lab {lab} is left"
    );
}

/// Proven alone, the shop's copy reaches no database: its order page answers 502, red.
#[test]
fn the_shop_proven_alone_cannot_reach_its_database() {
    let Some(w) = world(scenario(&SHOP.db_unit()), false) else {
        return;
    };
    let (code, copies, out) = prove_shop(&w);
    assert_eq!(code, Some(5), "{out}");
    assert_eq!(copies.len(), 1, "{out}");
    let shop = copy_of(&copies, 201);
    assert!(check_is(shop, "order-page", "fail"), "{shop:#}");
    // A check that needs the group (`in_group = true`) never runs in a copy alone.
    assert!(!ran_check(shop, "order-page-with-its-database"), "{shop:#}");
    assert!(shop.get("group").is_none(), "{shop:#}");
}

/// Proven as a group, the database's copy is started first, the shop's after it; the shop's
/// order page reaches the database's copy at its stored address: both green, the lab removed.
#[test]
fn the_shop_and_its_database_proven_as_a_group_are_green() {
    let Some(w) = world(scenario(&SHOP.db_unit()), true) else {
        return;
    };
    let (code, copies, out) = prove_shop(&w);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(copies.len(), 2, "{out}");
    let (db, shop) = (copy_of(&copies, 200), copy_of(&copies, 201));
    for (c, member) in [(db, 1), (shop, 2)] {
        assert_eq!(c["outcome"], "ok", "{c:#}");
        assert_eq!(c["group"]["name"], "shop", "{c:#}");
        assert_eq!(c["group"]["member"], member, "{c:#}");
        assert!(
            c["isolation"]
                .as_str()
                .is_some_and(|i| i.contains("joined to the group's lab")),
            "{c:#}"
        );
    }
    assert!(check_is(shop, "order-page", "pass"), "{shop:#}");
    assert!(
        check_is(shop, "order-page-with-its-database", "pass"),
        "{shop:#}"
    );
    assert!(check_is(db, "database-serves", "pass"), "{db:#}");
    assert_eq!(db["group"]["lab"], shop["group"]["lab"]);
    assert_lab_gone(shop);
}

/// A group whose database backup is broken is red, and the shop's failing order page names
/// the database member that failed before it.
#[test]
fn a_group_whose_database_is_broken_is_red_naming_the_database() {
    let Some(w) = world(scenario(BROKEN_DB_UNIT), true) else {
        return;
    };
    let (code, copies, out) = prove_shop(&w);
    assert_eq!(code, Some(5), "{out}");
    let (db, shop) = (copy_of(&copies, 200), copy_of(&copies, 201));
    assert_eq!(db["outcome"], "failed", "{db:#}");
    assert_eq!(shop["outcome"], "failed", "{shop:#}");
    let said = check(shop, "order-page")["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        said.contains("member 200 (db) of group shop failed before it"),
        "{said}"
    );
    assert_lab_gone(shop);
}

/// A database bound to its hostname (PVE writes `127.0.1.1 db` into the copy's /etc/hosts at
/// its start, the copy having no net0): the lab gives PVE's line the stored net0 address back
/// before the network units are restarted, so the database listens on 10.20.0.30 and the
/// shop's order page reaches it. Without that step, the database's copy listens on loopback
/// and the shop's order page fails.
#[test]
fn a_database_bound_to_its_hostname_serves_the_shop_in_a_group() {
    let Some(w) = world(scenario(DB_BY_NAME_UNIT), true) else {
        return;
    };
    let (code, copies, out) = prove_shop(&w);
    let (db, shop) = (copy_of(&copies, 200), copy_of(&copies, 201));
    assert!(check_is(shop, "order-page", "pass"), "{shop:#}\n{out}");
    assert!(check_is(db, "database-serves", "pass"), "{db:#}");
    let isolation = db["isolation"].as_str().unwrap_or_default();
    assert!(
        isolation.contains("/etc/hosts: db given its stored address 10.20.0.30 in PVE's section"),
        "{db:#}"
    );
    assert!(
        shop["isolation"]
            .as_str()
            .unwrap_or_default()
            .contains("/etc/hosts: shop given its stored address 10.20.0.31"),
        "{shop:#}"
    );
    assert_eq!(code, Some(0), "{out}");
    assert_lab_gone(shop);
}

/// A shop stored on another subnet than its database: the group's run says so before it
/// starts (each member's isolation names both members, their addresses and the fix), and the
/// shop's order page cannot reach the database in a lab without a router.
#[test]
fn members_on_different_subnets_are_warned_of_in_the_groups_run() {
    let Some(w) = world(scenario_with(&SHOP.db_unit(), "10.30.0.31"), true) else {
        return;
    };
    let (code, copies, out) = prove_shop(&w);
    assert_eq!(code, Some(5), "{out}");
    let (db, shop) = (copy_of(&copies, 200), copy_of(&copies, 201));
    for c in [db, shop] {
        assert!(
            c["isolation"].as_str().is_some_and(|i| i.contains(
                "group shop: members 200 (db) (net0 10.20.0.30/24) and 201 (shop) (net0 10.30.0.31/24) share no subnet"
            )),
            "{c:#}"
        );
    }
    assert!(check_is(shop, "order-page", "fail"), "{shop:#}");
    // The warning is the member's own (journaled with it): `journal --last` says it too.
    let last = w.agent(&[
        "journal",
        "--last",
        "restore-test",
        "--guest",
        "201",
        "--json",
    ]);
    assert!(
        last.stdout.contains("share no subnet"),
        "{}\n{}",
        last.stdout,
        last.stderr
    );
    assert_lab_gone(shop);
}

/// A `felhom_*` sample's value in a metrics file of the world.
fn sample(w: &World, file: &str, series: &str) -> Option<f64> {
    let text = std::fs::read_to_string(w.files.metrics_dir.join(file))
        .unwrap_or_else(|e| panic!("cannot read {file}: {e}"));
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// A red group's run as everything but its copies shows it: `restore-report` names the group
/// of each member's row (text and `--json`) and sums the group up; `journal --last
/// restore-test` (of any member) lists every member in start order with its ending and its
/// first failing check; the metrics count one run whose outcome is the group's (`failed`),
/// each member's coverage on its own row; the hub receives one result per member, each naming
/// the group, the same run and its place, and the coverage rows with their group.
#[test]
fn a_red_group_s_run_in_the_report_the_journal_the_metrics_and_the_hub() {
    const WAIT: Duration = Duration::from_secs(120);
    let hub = DevHub::start(DevHubOptions::default());
    let opts = AgentOptions {
        hub: Some(hub.hub_options()),
        ..AgentOptions::default()
    };
    let Some(w) = world_with(scenario(BROKEN_DB_UNIT), true, &opts) else {
        return;
    };
    let run: felhom_tests::agent::AgentRun = w
        .command()
        .args(["--selftest=restore", "--guest", "201", "--json"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run the agent: {e}"))
        .into();
    let out = format!("{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.code, Some(5), "{out}");
    let doc: Value = serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("{e}: {out}"));
    let copies = doc["copies"].as_array().cloned().unwrap_or_default();
    let (db, shop) = (copy_of(&copies, 200).clone(), copy_of(&copies, 201).clone());
    let lab = shop["group"]["lab"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let group_run = lab.trim_start_matches("felhom-g-").to_string();
    assert_eq!(group_run.len(), 26, "{lab}");

    // The run sums its group up: red, as its members.
    let groups = doc["groups"].as_array().cloned().unwrap_or_default();
    assert_eq!(groups.len(), 1, "{doc:#}");
    assert_eq!(groups[0]["name"], "shop", "{doc:#}");
    assert_eq!(groups[0]["run"], json!(group_run), "{doc:#}");
    assert_eq!(groups[0]["ending"], "failed", "{doc:#}");
    assert_eq!(doc["run"]["outcome"], "failed", "{doc:#}");

    // restore-report: each member's row names the group; the group's line names both.
    let report = w.agent(&["restore-report"]);
    assert_eq!(report.code, Some(5), "{}", report.stdout);
    let lines: Vec<&str> = report.stdout.lines().collect();
    let col = lines
        .first()
        .and_then(|h| h.find("GROUP"))
        .unwrap_or_else(|| panic!("no GROUP column: {}", report.stdout));
    for vmid in ["200", "201"] {
        let row = lines
            .iter()
            .find(|l| l.trim_start().starts_with(&format!("{vmid} ")))
            .unwrap_or_else(|| panic!("no row of {vmid}: {}", report.stdout));
        assert_eq!(
            row.get(col..).and_then(|c| c.split_whitespace().next()),
            Some("shop"),
            "{}",
            report.stdout
        );
    }
    assert!(
        report
            .stdout
            .contains("group shop: failed (200 db failed, 201 shop failed)"),
        "{}",
        report.stdout
    );
    let rows = w.agent(&["restore-report", "--json"]).json();
    for r in rows["guests"].as_array().cloned().unwrap_or_default() {
        if r["vmid"] == 200 || r["vmid"] == 201 {
            assert_eq!(r["group"], "shop", "{r:#}");
        } else {
            assert!(r.get("group").is_none(), "{r:#}");
        }
    }

    // journal --last restore-test, of the run and of the database member: every member.
    for args in [
        vec!["journal", "--last", "restore-test"],
        vec!["journal", "--last", "restore-test", "--guest", "200"],
    ] {
        let last = w.agent(&args);
        assert_eq!(last.code, Some(0), "{}\n{}", last.stdout, last.stderr);
        let text = &last.stdout;
        assert!(
            text.contains(&format!(
                "group:      shop (run {group_run}): failed, 2 member(s)"
            )),
            "{args:?}: {text}"
        );
        assert!(
            text.contains(&format!(
                "member 1: guest 200 (db) in copy {} (txn {}): failed",
                db["vmid"],
                db["txn"].as_str().unwrap_or_default()
            )),
            "{args:?}: {text}"
        );
        assert!(
            text.contains(&format!(
                "member 2: guest 201 (shop) in copy {} (txn {}): failed; first failing check order-page fail: ",
                shop["vmid"], shop["txn"].as_str().unwrap_or_default()
            )) && text.contains("member 200 (db) of group shop failed before it"),
            "{args:?}: {text}"
        );
        let mut json_args = args.clone();
        json_args.push("--json");
        let doc = w.agent(&json_args).json();
        let members = doc["group"]["members"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(
            members
                .iter()
                .map(|m| (m["guest"].clone(), m["ending"].clone()))
                .collect::<Vec<_>>(),
            [(json!(200), json!("failed")), (json!(201), json!("failed"))],
            "{doc:#}"
        );
        assert_eq!(members[1]["failing"]["name"], "order-page", "{doc:#}");
    }

    // The metrics: one run, the group's outcome; each member's coverage on its own row.
    let rt = "felhom_restore_test.prom";
    assert_eq!(sample(&w, rt, "felhom_restore_test_runs_total"), Some(1.0));
    assert_eq!(
        sample(&w, rt, "felhom_restore_test_outcome{outcome=\"failed\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(&w, rt, "felhom_restore_test_outcome{outcome=\"ok\"}"),
        Some(0.0)
    );
    let cov = "felhom_backup_coverage.prom";
    for vmid in [200, 201] {
        assert_eq!(
            sample(
                &w,
                cov,
                &format!("felhom_backup_status{{vmid=\"{vmid}\",status=\"failed\"}}")
            ),
            Some(1.0),
            "guest {vmid}"
        );
    }

    // The hub: one result per member, each naming the group, its run and its place; the
    // coverage rows name the group too.
    let path = w.path();
    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str())],
    );
    let state = hub.wait_for("both members' results and the table", WAIT, |s| {
        s.results.values().flatten().count() >= 2 && !s.coverages.is_empty()
    });
    let mut members: Vec<_> = state
        .results
        .values()
        .flatten()
        .map(|(_, r)| r.clone())
        .collect();
    members.sort_by_key(|r| r.guest);
    assert_eq!(members.len(), 2, "{members:#?}");
    for (r, (guest, place, copy)) in members.iter().zip([(200, 1, &db), (201, 2, &shop)]) {
        assert_eq!(r.guest, Some(guest), "{r:?}");
        assert_eq!(r.outcome, hub_protocol::Outcome::Failed, "{r:?}");
        assert_eq!(r.txn.to_string(), copy["txn"].as_str().unwrap_or_default());
        let g = r
            .group
            .as_ref()
            .unwrap_or_else(|| panic!("no group: {r:?}"));
        assert_eq!(
            (
                g.name.as_str(),
                g.run.to_string(),
                g.member,
                g.members.as_slice()
            ),
            ("shop", group_run.clone(), place, &[200, 201][..]),
            "{r:?}"
        );
    }
    let table = &state.coverages[0].1;
    for row in &table.guests {
        let want = [200, 201].contains(&row.vmid).then_some("shop");
        assert_eq!(row.group.as_deref(), want, "{row:?}");
    }
    assert!(table.guests.iter().filter(|r| r.group.is_some()).count() == 2);
    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "the daemon exited {status}:\n{log}");
}

// ---- A group of a container and a VM --------------------------------------------------------
// An application group of a container and a VM (`[[restore_test.group]]` holding both): the
// database container (200, real LXC, busybox httpd on its stored address 10.20.0.30) and a VM
// (300, a real QEMU running Debian 12 with the real guest agent, ens18 static at 10.20.0.31)
// whose check asks the database for its stock. The VM copy's NIC is on the group's lab bridge,
// a real kernel bridge this test makes as an operator would (`bridge-ports none`, IPv6 off, the
// strict reverse-path filter, no forwarding), where the bed's QEMU puts its tap as pve-bridge
// does; the database's copy joins the group's lab (a bridge in a network namespace of its own)
// and root links that lab to the lab bridge with one veth pair. The VM's check reaches the
// database's copy at its stored address; after the run nothing of the link is left on the
// bridge. Needs LXC and QEMU (`tests/tests/real_guests.rs`, `tests/tests/real_vm.rs`).

/// A Linux bridge of the node's namespace made for one test, as the README's lab bridge:
/// no port, no address, IPv6 off, strict reverse-path filter, no forwarding. Deleted when
/// dropped.
struct KernelLabBridge {
    name: String,
}

impl KernelLabBridge {
    fn new() -> KernelLabBridge {
        let name = format!("vmbrt{}", std::process::id() % 1_000_000);
        let ip = |args: &[&str]| {
            let out = std::process::Command::new("ip")
                .args(args)
                .output()
                .expect("run ip");
            assert!(
                out.status.success(),
                "ip {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &name])
            .output();
        ip(&["link", "add", &name, "type", "bridge"]);
        let bridge = KernelLabBridge { name };
        let name = &bridge.name;
        for (file, value) in [
            (format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1"),
            (format!("/proc/sys/net/ipv4/conf/{name}/rp_filter"), "1"),
            (format!("/proc/sys/net/ipv4/conf/{name}/forwarding"), "0"),
        ] {
            std::fs::write(&file, value).unwrap_or_else(|e| panic!("{file}: {e}"));
        }
        ip(&["link", "set", name, "up"]);
        bridge
    }

    /// Its ports now, sorted.
    fn ports(&self) -> Vec<String> {
        let mut ports: Vec<String> =
            std::fs::read_dir(format!("/sys/class/net/{}/brif", self.name))
                .map(|rd| {
                    rd.filter_map(Result::ok)
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
        ports.sort();
        ports
    }
}

impl Drop for KernelLabBridge {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.name])
            .output();
    }
}

/// The VM's files: its hostname and ens18 static on the shop's address.
fn mixed_vm_files() -> Value {
    json!({
        "/etc/hostname": "shop-vm\n",
        "/etc/network/interfaces": format!(
            "source /etc/network/interfaces.d/*\n\nauto lo\niface lo inet loopback\n\nauto ens18\niface ens18 inet static\n    address {}/24\n",
            SHOP.shop_ip()
        ),
    })
}

/// The checks: the database's unit, and the VM's GET of the database's stock (a check that
/// needs the group).
fn mixed_pack() -> String {
    format!(
        "{DATABASE_CHECK}\n[[check]]\nname = \"stock-from-the-database\"\nsql = \"SELECT response_code FROM curl WHERE url = 'http://{}/stock'\"\nexpect = \"response_code == '200'\"\nguests = [300]\nin_group = true\n",
        SHOP.db_ip()
    )
}

/// The pool: the database container (200) and the VM (300, one NIC on vmbr0), each with a
/// backup; the node's network as PVE lists it with `bridge` as a lab bridge; the token's
/// SDN.Use on it.
fn mixed_scenario(bridge: &str) -> Value {
    let mut s = SHOP.scenario(&SHOP.db_unit(), json!({}), json!({}));
    s["volumes"]["local"]
        .as_array_mut()
        .expect("volumes")
        .retain(|v| v["vmid"] != 201);
    s["guests"]
        .as_array_mut()
        .expect("guests")
        .retain(|g| g["vmid"] != 201);
    let mut config = qemu_backup_config();
    config["name"] = json!("shop-vm");
    config["memory"] = json!("1024");
    config["net0"] = json!("virtio=BC:24:11:00:03:31,bridge=vmbr0");
    if let Some(c) = config.as_object_mut() {
        c.remove("net1");
    }
    add_qemu_backup(
        &mut s,
        config,
        json!({"real": true, "files": mixed_vm_files()}),
    );
    s["node_network"] = json!([
        {"iface": "eno1", "type": "eth", "method": "manual", "method6": "manual", "active": 1, "exists": 1},
        {"iface": "vmbr0", "type": "bridge", "bridge_ports": "eno1", "method": "static", "method6": "manual",
         "address": "192.0.2.11", "netmask": "255.255.255.0", "cidr": "192.0.2.11/24", "gateway": "192.0.2.1",
         "active": 1, "autostart": 1},
        {"iface": bridge, "type": "bridge", "bridge_ports": "", "method": "manual", "method6": "manual",
         "active": 1, "autostart": 1},
    ]);
    for who in ["felhom@pve!agent", "felhom@pve"] {
        s["grants"].as_array_mut().expect("grants").push(json!([
            who,
            format!("/sdn/zones/localnetwork/{bridge}"),
            ["PVESDNUser"]
        ]));
    }
    s
}

/// The group of the database container and the VM, proven together on a lab bridge of the
/// kernel: the VM's copy gets the database's stock at its stored address (through the link of
/// the containers' lab to the bridge, which root made and removed), both copies ok.
#[test]
fn a_vm_reaches_its_database_container_through_the_groups_lab_bridge() {
    let bridge = KernelLabBridge::new();
    let opts = AgentOptions {
        extra_toml: format!(
            "launch_timeout_secs = 90\nboot_timeout_secs = 60\n\n[restore_test]\nlab_bridges = [\"{}\"]\n",
            bridge.name
        ),
        ..AgentOptions::default()
    };
    let Some(w) = World::real_with_vm_or_skip(mixed_scenario(&bridge.name), &opts) else {
        return;
    };
    // Only these checks (the default pack's queries take half a minute in a VM under TCG).
    std::fs::write(w.files.checks_dir.join("default.toml"), mixed_pack())
        .unwrap_or_else(|e| panic!("cannot write the pack: {e}"));
    add_group(&w.files.config_path, "shop", &[200, 300], 0);
    let mut cmd = w.command();
    // The kernel's own files: the lab bridge above is a real one.
    cmd.env(KERNEL_ROOT_ENV, "/");
    let (code, copies, out) = felhom_tests::groups::prove_with(cmd, 300);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(copies.len(), 2, "{out}");
    let (db, vm) = (copy_of(&copies, 200), copy_of(&copies, 300));
    for c in [db, vm] {
        assert_eq!(c["outcome"], "ok", "{c:#}");
        assert_eq!(c["group"]["name"], "shop", "{c:#}");
    }
    assert!(check_is(db, "database-serves", "pass"), "{db:#}");
    assert!(check_is(vm, "stock-from-the-database", "pass"), "{vm:#}");
    let isolation = db["isolation"].as_str().unwrap_or_default();
    assert!(
        isolation.contains("joined to the group's lab")
            && isolation.contains(&format!("linked to the group's lab bridge {}", bridge.name)),
        "{db:#}"
    );
    // The VM's copy started with its NIC on the lab bridge.
    let starts = w.pve.start_configs();
    let (_, config) = starts
        .iter()
        .find(|(v, c)| (990_000..=990_009).contains(v) && c.get("net0").is_some())
        .unwrap_or_else(|| panic!("no copy with a NIC was started: {starts:?}"));
    assert!(
        config
            .get("net0")
            .and_then(Value::as_str)
            .is_some_and(|n| n.contains(&format!("bridge={}", bridge.name))),
        "{starts:?}"
    );
    // At the source: nothing is left on the bridge (the VM's tap went with its QEMU, the
    // lab's link with the lab).
    assert!(
        bridge.ports().is_empty(),
        "left on {}: {:?}",
        bridge.name,
        bridge.ports()
    );
}
