//! What a backup brings along, on the bed that restores as PVE does (`tests/fakepve/README.md`,
//! "Restores, as PVE does them"): a restore-test copy never starts on a network, a backup's
//! `protection` and `onboot` never keep a selftest guest alive, and what PVE would refuse only
//! inside the restore task (SDN.Use on a bridge, a privileged container, a bind mount point, a
//! tag policy that refuses the marker) is refused by the preflight with no write at all.
//!
//! Each test counts at the source: the fake's requests, the config every guest was started
//! with (`FakePve::start_configs`), and the guests left in the full list.

use felhom_tests::fakepve::{demo_scenario, with_datacenter_cfg, AgentOptions};
use felhom_tests::world::World;
use serde_json::{json, Value};

/// The demo's backup of 200: a container with a bridged NIC holding a static address, a second
/// one on a VLAN, and the settings a customer's guest may carry.
fn customer_backup_config() -> Value {
    json!({
        "unprivileged": "1",
        "hostname": "shop",
        "net0": "name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:02:00,ip=192.0.2.10/24,gw=192.0.2.1,type=veth",
        "net1": "name=eth1,bridge=vmbr1,tag=20,hwaddr=BC:24:11:00:02:01,ip=198.51.100.10/24,type=veth",
        "onboot": "1",
        "protection": "1",
        "description": "customer 4711: shop, do not reboot on Fridays"
    })
}

fn scenario_with_backup(config: Value) -> Value {
    let mut s = demo_scenario();
    s["volumes"]["local"][0]["config"] = config;
    s
}

/// Whether a container NIC value (as the fake holds it) is isolated: no bridge, link down.
fn isolated(nic: &str) -> bool {
    let items: Vec<&str> = nic.split(',').collect();
    !items.iter().any(|i| i.starts_with("bridge=")) && items.contains(&"link_down=1")
}

/// The restore request the fake received (`kind`: `lxc` or `qemu`).
fn restore_post(w: &World, kind: &str) -> felhom_tests::fakepve::RecordedRequest {
    let path = format!("/nodes/pve1/{kind}");
    w.pve
        .requests()
        .into_iter()
        .find(|r| r.method == "POST" && r.api_path() == path)
        .expect("the restore")
}

/// The demo with an old-format (`.tar.lzo`) backup of VM 300 on `local`.
const TAR_BACKUP: &str = "local:backup/vzdump-qemu-300-2014_01_01-00_00_00.tar.lzo";

fn with_tar_backup(mut s: Value) -> Value {
    s["volumes"]["local"]
        .as_array_mut()
        .expect("volumes")
        .push(json!({
            "volname": TAR_BACKUP.trim_start_matches("local:"), "vmid": 300, "size": 1048576,
            "config": felhom_tests::fakepve::qemu_backup_config(), "guest": {"agent": true}
        }));
    s
}

/// The config guest `vmid` had at its first start (panics when it was never started).
fn started_config(w: &World, vmid: u32) -> serde_json::Map<String, Value> {
    w.pve
        .start_configs()
        .into_iter()
        .find(|(v, _)| *v == vmid)
        .map(|(_, c)| c)
        .unwrap_or_else(|| panic!("guest {vmid} was never started"))
}

/// The `netN` keys of a config and their values.
fn nics_of(config: &serde_json::Map<String, Value>) -> Vec<(String, String)> {
    config
        .iter()
        .filter(|(k, _)| k.starts_with("net"))
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
        .collect()
}

/// Neither `onboot` nor `protection` set in `config`.
fn assert_no_onboot_nor_protection(config: &serde_json::Map<String, Value>) {
    assert!(!is_true(config.get("onboot")), "{config:#?}");
    assert!(!is_true(config.get("protection")), "{config:#?}");
}

fn is_true(v: Option<&Value>) -> bool {
    v.and_then(Value::as_str).is_some_and(|s| s == "1")
}

/// Guests left in the restore-test band that the scenario did not have (990000 and 990001 are
/// foreign guests of the demo).
fn left_in_band(w: &World) -> Vec<u32> {
    w.pve
        .vmlist_entries()
        .into_iter()
        .map(|e| e.vmid)
        .filter(|v| (990_002..=990_009).contains(v))
        .collect()
}

#[test]
fn a_restore_test_copy_of_a_bridged_container_starts_with_every_nic_isolated() {
    let w = World::new(scenario_with_backup(customer_backup_config()));
    let run = w.agent(&["--selftest=restore", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    let vmid = doc["vmid"].as_u64().expect("vmid") as u32;

    // The copy was started once, and with no NIC on a bridge, none with its link up, no onboot
    // and no protection.
    let starts = w
        .pve
        .start_configs()
        .into_iter()
        .filter(|(v, _)| *v == vmid)
        .count();
    assert_eq!(starts, 1, "{:#?}", w.pve.start_configs());
    let config = started_config(&w, vmid);
    let nics = nics_of(&config);
    assert_eq!(nics.len(), 2, "both stored NICs are there: {config:#?}");
    for (key, nic) in &nics {
        assert!(isolated(nic), "{key} = {nic} reaches a network");
        assert!(
            !nic.contains("192.0.2.10") && !nic.contains("198.51.100.10"),
            "{key} = {nic} answers for the original's address"
        );
        assert!(
            !nic.contains("BC:24:11:00:02:0"),
            "{key} = {nic} keeps the original's MAC"
        );
    }
    assert_no_onboot_nor_protection(&config);

    // The request that made it so: no `unique` (with it PVE writes the stored NICs over the
    // request's), every stored NIC given.
    let post = restore_post(&w, "lxc");
    assert!(matches!(post.param("unique"), None | Some("0")), "{post:?}");
    assert!(post.param("net1").is_some(), "{post:?}");

    // Nothing left in the band, and the original untouched.
    assert_eq!(left_in_band(&w), Vec::<u32>::new());
    assert!(w.pve.writes_for(200).is_empty());
}

#[test]
fn a_copy_whose_config_gained_a_bridged_nic_is_never_started_and_is_destroyed() {
    // The last read before the start decides, whatever the restore did: the copy's config
    // gains a bridged NIC with the original's address right after its marker is written (the
    // fake holds the marker PUT's answer for a second, the test adds the NIC meanwhile).
    let w = World::new(scenario_with_backup(customer_backup_config()));
    let vmid = 990_002;
    w.pve.set(json!({"answer_delay": {
        format!("PUT /api2/json/nodes/pve1/lxc/{vmid}/config"): 1.0
    }}));
    let agent = {
        let mut cmd = w.command();
        cmd.args(["--selftest=restore", "--json"]);
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        cmd.spawn().expect("agent")
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut changed = false;
    while std::time::Instant::now() < deadline && !changed {
        let marked = w.pve.guest(vmid).is_some_and(|g| {
            g["config"]["tags"]
                .as_str()
                .is_some_and(|t| t.contains("felhom"))
        });
        if marked {
            w.pve.guest_set(
                vmid,
                json!({"config": {"net2": "name=eth2,bridge=vmbr0,ip=192.0.2.10/24,type=veth"}}),
            );
            changed = true;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = agent.wait_with_output().expect("agent output");
    assert!(changed, "the copy was never marked");
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert_eq!(doc["vmid"], json!(vmid), "{doc:#}");
    assert_ne!(doc["outcome"], "ok", "{doc:#}");
    let message = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("net2") && message.contains("not started"),
        "{doc:#}"
    );
    assert!(
        w.pve.start_configs().iter().all(|(v, _)| *v != vmid),
        "the copy was started: {:?}",
        w.pve.start_configs()
    );
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    assert_eq!(left_in_band(&w), Vec::<u32>::new());
}

#[test]
fn a_selftest_of_a_protected_onboot_backup_ends_destroyed_and_leaves_nothing() {
    let w = World::new(scenario_with_backup(customer_backup_config()));
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    assert!(w.pve.guest(120).is_none(), "guest 120 is left");
    assert!(
        w.pve.vmlist_entries().iter().all(|e| e.vmid != 120),
        "120 in the full list"
    );
    let config = started_config(&w, 120);
    assert_no_onboot_nor_protection(&config);
    // The customer's notes stay, under the marker line.
    let description = config
        .get("description")
        .and_then(Value::as_str)
        .unwrap_or("");
    assert!(
        description.contains("felhom-agent transaction")
            && description.contains("customer 4711: shop"),
        "{description:?}"
    );
}

#[test]
fn a_kept_guest_that_gained_protection_is_still_destroyed_by_its_proof() {
    let w = World::new(scenario_with_backup(customer_backup_config()));
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--keep", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    // Someone (or the backup of a hub provision) sets protection: PVE refuses the DELETE of a
    // protected guest, so the agent lifts it, proves the guest again, then deletes it.
    w.pve.guest_set(120, json!({"config": {"protection": "1"}}));
    let run = w.agent(&["destroy", "-vmid", "120", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    assert!(w.pve.guest(120).is_none(), "guest 120 is left");
    let lifted = w.pve.requests().into_iter().any(|r| {
        r.method == "PUT"
            && r.api_path() == "/nodes/pve1/lxc/120/config"
            && r.param("delete").is_some_and(|d| d.contains("protection"))
    });
    assert!(lifted, "no PUT lifted the protection");
}

/// A world whose token holds no SDN.Use anywhere.
fn without_sdn(mut s: Value) -> Value {
    let grants: Vec<Value> = s["grants"]
        .as_array()
        .expect("grants")
        .iter()
        .filter(|g| !g[1].as_str().unwrap_or("").starts_with("/sdn"))
        .cloned()
        .collect();
    s["grants"] = json!(grants);
    s
}

/// `--selftest=provision -vmid 120` must exit 3 with `code`, nothing written; doctor must fail
/// `check` with the same code and say `names`.
fn refused_before_any_write(w: &World, code: &str, doctor_check: &str, names: &[&str]) {
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(3), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["error"]["code"], code, "{doc:#}");
    let message = doc["error"]["message"].as_str().unwrap_or("");
    for n in names {
        assert!(message.contains(n), "{n:?} not in {message}");
    }
    assert!(w.pve.writes().is_empty(), "{:#?}", w.pve.writes());
    let run = w.agent(&["doctor", "--json"]);
    let doc = run.json();
    let check = doc["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["name"] == doctor_check)
        .unwrap_or_else(|| panic!("no {doctor_check} check: {doc:#}"))
        .clone();
    assert_eq!(check["status"], "fail", "{check:#}");
    assert_eq!(check["code"], code, "{check:#}");
    for n in names {
        assert!(
            check["message"].as_str().unwrap_or("").contains(n),
            "{n:?} not in {check:#}"
        );
    }
    assert_ne!(run.code, Some(0));
    assert!(w.pve.writes().is_empty(), "doctor wrote");
}

#[test]
fn a_bridge_the_token_may_not_use_is_refused_before_any_write() {
    let w = World::new(without_sdn(demo_scenario()));
    refused_before_any_write(
        &w,
        "sdn_denied",
        "selftest_source",
        &[
            "SDN.Use",
            "/sdn/zones/localnetwork/vmbr0",
            "pveum acl modify /sdn/zones/localnetwork/vmbr0 --tokens 'felhom@pve!agent' --roles PVESDNUser",
        ],
    );
}

#[test]
fn a_restore_test_copy_needs_no_sdn_use() {
    // Its NICs are all overridden, bridge-less: PVE checks no bridge, and neither does the
    // preflight.
    let w = World::new(without_sdn(demo_scenario()));
    let run = w.agent(&["--selftest=restore", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
}

#[test]
fn a_privileged_container_backup_is_refused_before_any_write() {
    let w = World::new(scenario_with_backup(json!({
        "net0": "name=eth0,bridge=vmbr0,ip=dhcp,type=veth"
    })));
    refused_before_any_write(&w, "backup_privileged", "selftest_source", &["privileged"]);
}

#[test]
fn a_bind_mount_point_is_refused_before_any_write() {
    let w = World::new(scenario_with_backup(json!({
        "unprivileged": "1",
        "net0": "name=eth0,bridge=vmbr0,ip=dhcp,type=veth",
        "mp0": "/srv/customer,mp=/data"
    })));
    refused_before_any_write(
        &w,
        "backup_mounts",
        "selftest_source",
        &["mp0", "/srv/customer"],
    );
}

#[test]
fn a_tag_policy_of_existing_is_refused_before_any_write() {
    let mut s = demo_scenario();
    with_datacenter_cfg(&mut s, json!({"user-tag-access": "user-allow=existing"}));
    let w = World::with_options(s, &AgentOptions::default());
    refused_before_any_write(
        &w,
        "tag_policy",
        "tag_policy",
        &["user-allow=existing", "user-allow=free"],
    );
}

#[test]
fn the_same_provision_passes_once_the_grant_is_given() {
    // The refusal is about the grant, not the backup: with SDN.Use on the bridge the same
    // selftest provisions green (the bed checks SDN.Use inside its restore task).
    let w = World::new(demo_scenario());
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    let post = restore_post(&w, "lxc");
    assert_eq!(post.param("unprivileged"), Some("1"), "{post:?}");
}

#[test]
fn a_restore_test_copy_of_a_bridged_vm_starts_with_every_nic_link_down() {
    // qemu-server lets the request's NICs win over the backup's (restore_merge_config), so a
    // VM copy keeps `unique=1` (new MACs, SMBIOS uuid) with every stored NIC given link-down.
    let mut s = demo_scenario();
    let mut config = felhom_tests::fakepve::qemu_backup_config();
    config["onboot"] = json!("1");
    config["protection"] = json!("1");
    felhom_tests::fakepve::add_qemu_backup(&mut s, config, json!({"agent": true}));
    s["attrs"] = json!({"qemu_restore_secs": 5});
    let opts = AgentOptions {
        extra_toml: format!(
            "[restore_test]\nsources = [\"{}\"]\n",
            felhom_tests::fakepve::QEMU_BACKUP
        ),
        ..AgentOptions::default()
    };
    let w = World::with_options(s, &opts);
    let run = w.agent(&["--selftest=restore", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    let vmid = doc["vmid"].as_u64().expect("vmid") as u32;
    let post = restore_post(&w, "qemu");
    assert_eq!(post.param("unique"), Some("1"), "{post:?}");
    let config = started_config(&w, vmid);
    let nics = nics_of(&config);
    assert_eq!(nics.len(), 2, "{config:#?}");
    for (key, nic) in nics {
        assert!(
            nic.split(',').any(|i| i == "link_down=1"),
            "{key} = {nic} has its link up"
        );
        assert!(
            !nic.contains("BC:24:11:00:03:0"),
            "{key} = {nic} keeps the MAC"
        );
    }
    assert_no_onboot_nor_protection(&config);
    assert_eq!(left_in_band(&w), Vec::<u32>::new());
}

#[test]
fn an_old_tar_vm_backup_is_restored_with_no_option_and_marked_afterwards() {
    // qemu-server's restore_tar_archive refuses any config key inside the task (the stub left
    // outside the pool); the agent sends none and writes its marker after the restore.
    let mut s = with_tar_backup(demo_scenario());
    s["attrs"] = json!({"qemu_restore_secs": 5});
    let opts = AgentOptions {
        selftest_source: Some(TAR_BACKUP.to_string()),
        ..AgentOptions::default()
    };
    let w = World::with_options(s, &opts);
    let run = w.agent(&["--selftest=provision", "-vmid", "130", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    let post = restore_post(&w, "qemu");
    for key in ["description", "net0", "onboot", "protection"] {
        assert_eq!(post.param(key), None, "{key} sent: {post:?}");
    }
    assert!(w.pve.guest(130).is_none(), "guest 130 is left");
    // A restore test of it is refused before any write: its copy's NICs could not be isolated.
    let w = World::with_options(
        with_tar_backup(demo_scenario()),
        &AgentOptions {
            extra_toml: format!("[restore_test]\nsources = [\"{TAR_BACKUP}\"]\n"),
            ..AgentOptions::default()
        },
    );
    let run = w.agent(&["--selftest=restore", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(3), "{doc:#}\n{}", run.stderr);
    assert!(
        doc["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains(".tar format"),
        "{doc:#}"
    );
    assert!(w.pve.writes().is_empty(), "{:#?}", w.pve.writes());
}
