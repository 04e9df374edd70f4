//! Application groups on real containers (`[[restore_test.group]]`): a database guest (200,
//! busybox httpd on its stored address 10.20.0.30) and a shop guest (201, whose order page is a
//! CGI that asks the database over the network and answers 502 when it cannot). The shop's
//! check of its order page is red when the shop is proven alone (its copy reaches nothing) and
//! green when the two are proven as a group (their stored NICs joined to the group's lab, a
//! bridge in a network namespace of its own that the root helper makes); a group whose
//! database is broken is red, and the shop's failing check names the database member. The
//! lab's namespace is gone after the run. A database bound to its hostname serves the shop
//! (the lab gives PVE's /etc/hosts line the stored net0 address back); a shop on another
//! subnet is warned of by the group's run, and cannot reach the database. Each test needs LXC
//! (`tests/tests/real_guests.rs`).

use felhom_tests::fakepve::AgentOptions;
use felhom_tests::verdict::{check, check_is, debian_backup, ran_check};
use felhom_tests::world::World;
use serde_json::{json, Value};

/// The database: busybox's httpd bound to its stored address, after the network is online.
const DB_UNIT: &str = "[Unit]\nDescription=The database\nWants=network-online.target\nAfter=network-online.target\n\n[Service]\nExecStart=/bin/busybox httpd -f -p 10.20.0.30:80 -h /srv/db\n";

/// The database bound to the address its hostname resolves to, as a database told to listen on
/// its own name does (`listen_addresses = 'db'`): it waits for eth0's address (failed before
/// it, restarted by the lab after the boot), then binds what `getent` says of `db`. In a copy
/// whose /etc/hosts PVE wrote without net0 (`127.0.1.1 db`) it listens on loopback.
const DB_BY_NAME_UNIT: &str = "[Unit]\nDescription=The database, on its hostname\nWants=network-online.target\nAfter=network-online.target\n\n[Service]\nExecStart=/bin/sh /srv/db-serve\n";

/// What [`DB_BY_NAME_UNIT`] runs.
const DB_SERVE: &str = "#!/bin/sh\nip -o -4 addr show dev eth0 2>/dev/null | grep -q ' inet ' || { echo 'eth0 has no address yet' >&2; exit 1; }\naddr=$(getent ahostsv4 \"$(cat /etc/hostname)\" | awk 'NR == 1 {print $1}')\necho \"listening on $addr\"\nexec /bin/busybox httpd -f -p \"$addr:80\" -h /srv/db\n";

/// A database that fails for its own reason (a broken backup).
const BROKEN_DB_UNIT: &str = "[Unit]\nDescription=The database\nWants=network-online.target\nAfter=network-online.target\n\n[Service]\nType=oneshot\nExecStart=/bin/false\n";

/// The shop: busybox's httpd on its stored address, with the order page a CGI (made
/// executable first: the bed writes a backup's files 0644).
const SHOP_UNIT: &str = "[Unit]\nDescription=The shop\nWants=network-online.target\nAfter=network-online.target\n\n[Service]\nExecStartPre=/bin/chmod 0755 /srv/www/cgi-bin/order\nExecStart=/bin/busybox httpd -f -p 10.20.0.31:80 -h /srv/www\n";

/// The order page: 200 with the stock when the database answers, else 502 (bounded by
/// `timeout`: Debian 12's busybox wget crashes on its own `-T`).
const ORDER_CGI: &str = "#!/bin/sh\nif stock=$(timeout 5 /bin/busybox wget -q -O - http://10.20.0.30/stock 2>/dev/null); then\n  printf 'Content-Type: text/plain\\r\\n\\r\\n%s\\n' \"$stock\"\nelse\n  printf 'Status: 502 Bad Gateway\\r\\nContent-Type: text/plain\\r\\n\\r\\nno database\\n'\nfi\n";

/// The operator's check of the shop: its order page answers 200.
const SHOP_PACK: &str = r#"
[[check]]
name = "order-page"
sql = "SELECT response_code FROM curl WHERE url = 'http://10.20.0.31/cgi-bin/order'"
expect = "response_code == '200'"
guests = [201]

[[check]]
name = "order-page-with-its-database"
sql = "SELECT response_code FROM curl WHERE url = 'http://10.20.0.31/cgi-bin/order'"
expect = "response_code == '200'"
guests = [201]
in_group = true

[[check]]
name = "database-serves"
sql = "SELECT id FROM systemd_units WHERE id = 'db.service' AND active_state = 'active'"
expect = "rows == 1"
guests = [200]
"#;

/// A guest's stored config and root (Debian 12, one static NIC on vmbr0).
fn member(hostname: &str, ip: &str, mac: &str, files: Value) -> (Value, Value) {
    let config = json!({
        "arch": "amd64",
        "ostype": "debian",
        "hostname": hostname,
        "memory": "256",
        "rootfs": "local-lvm:vm-200-disk-0,size=8G",
        "unprivileged": "1",
        "net0": format!("name=eth0,bridge=vmbr0,hwaddr={mac},ip={ip}/24,type=veth"),
    });
    (config, json!({ "files": files, "links": {} }))
}

/// The pool with the database (200) and the shop (201), each with one backup on `local`.
fn scenario(db_unit: &str) -> Value {
    scenario_with(db_unit, "10.20.0.31")
}

/// [`scenario`] with the shop stored at `shop_ip` (/24).
fn scenario_with(db_unit: &str, shop_ip: &str) -> Value {
    let mut s = debian_backup(None, &[], json!({}), json!({}));
    let (db_config, db_guest) = member(
        "db",
        "10.20.0.30",
        "BC:24:11:00:02:30",
        json!({
            "/etc/systemd/system/db.service": db_unit,
            "/etc/systemd/system/multi-user.target.d/app.conf": "[Unit]\nWants=db.service\n",
            "/srv/db/stock": "42 tins\n",
            "/srv/db-serve": DB_SERVE,
        }),
    );
    let vol = &mut s["volumes"]["local"][0];
    vol["config"] = db_config;
    vol["guest"] = db_guest;
    let (shop_config, shop_guest) = member(
        "shop",
        shop_ip,
        "BC:24:11:00:02:31",
        json!({
            "/etc/systemd/system/shop.service": SHOP_UNIT,
            "/etc/systemd/system/multi-user.target.d/app.conf": "[Unit]\nWants=shop.service\n",
            "/srv/www/cgi-bin/order": ORDER_CGI,
        }),
    );
    s["volumes"]["local"]
        .as_array_mut()
        .unwrap_or_else(|| panic!("no volumes"))
        .push(json!({
            "volname": "backup/vzdump-lxc-201-2026_01_01-00_00_00.tar.zst",
            "vmid": 201,
            "size": 123456789,
            "config": shop_config,
            "guest": shop_guest,
        }));
    let guests = s["guests"]
        .as_array_mut()
        .unwrap_or_else(|| panic!("no guests"));
    for g in guests.iter_mut().filter(|g| g["vmid"] == 200) {
        g["name"] = json!("db");
    }
    guests.push(
        json!({"vmid": 201, "type": "lxc", "name": "shop", "node": "pve1",
            "status": "running", "pool": "felhom"}),
    );
    s
}

/// The world of `scenario` with the shop's pack, and the group when `grouped`.
fn world(scenario: Value, grouped: bool) -> Option<World> {
    let w = World::real_or_skip(scenario, &AgentOptions::default())?;
    std::fs::write(w.files.checks_dir.join("shop.toml"), SHOP_PACK)
        .unwrap_or_else(|e| panic!("cannot write the pack: {e}"));
    if grouped {
        let mut cfg = std::fs::read_to_string(&w.files.config_path)
            .unwrap_or_else(|e| panic!("cannot read agent.toml: {e}"));
        cfg.push_str(
            "\n[[restore_test.group]]\nname = \"shop\"\nguests = [200, 201]\nboot_delay = 1\n",
        );
        std::fs::write(&w.files.config_path, cfg)
            .unwrap_or_else(|e| panic!("cannot write agent.toml: {e}"));
    }
    Some(w)
}

/// `--selftest=restore --guest 201 --json`: the copies' documents.
fn prove_shop(w: &World) -> (Option<i32>, Vec<Value>, String) {
    let run: felhom_tests::agent::AgentRun = w
        .command()
        .args(["--selftest=restore", "--guest", "201", "--json"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run the agent: {e}"))
        .into();
    let doc: Value = serde_json::from_str(&run.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", run.stdout, run.stderr));
    let copies = doc["copies"].as_array().cloned().unwrap_or_default();
    (run.code, copies, format!("{}\n{}", run.stdout, run.stderr))
}

fn copy_of(copies: &[Value], guest: u32) -> &Value {
    copies
        .iter()
        .find(|c| c["guest"] == guest)
        .unwrap_or_else(|| panic!("no copy of guest {guest}: {copies:#?}"))
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
    let Some(w) = world(scenario(DB_UNIT), false) else {
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
    let Some(w) = world(scenario(DB_UNIT), true) else {
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
    let Some(w) = world(scenario_with(DB_UNIT, "10.30.0.31"), true) else {
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
    assert_lab_gone(shop);
}
