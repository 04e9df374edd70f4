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
fn a_restore_test_copy_of_a_bridged_container_starts_with_no_nic_and_ends_ok() {
    let w = World::new(scenario_with_backup(customer_backup_config()));
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    // The one copy: of the demo's backup of 200.
    let doc = run.restore_copy();
    assert_eq!(doc["guest"], 200, "{doc:#}");
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    assert_eq!(doc["network"], "isolated", "{doc:#}");
    let vmid = doc["vmid"].as_u64().expect("vmid") as u32;

    // The copy was started once, with no NIC at all (a bridge-less container NIC kills every
    // config write and start on PVE, a bridged one is plugged into the production bridge), no onboot
    // and no protection; no start reached a network.
    let starts = w
        .pve
        .start_configs()
        .into_iter()
        .filter(|(v, _)| *v == vmid)
        .count();
    assert_eq!(starts, 1, "{:#?}", w.pve.start_configs());
    let config = started_config(&w, vmid);
    assert_eq!(nics_of(&config), Vec::new(), "{config:#?}");
    assert_eq!(w.pve.network_exposures(), Vec::new());
    assert_no_onboot_nor_protection(&config);

    // The requests that made it so: the restore overrides every stored NIC without a bridge
    // (no `unique`: with it PVE writes the stored NICs over the request's, and no SDN.Use is
    // checked on the stored bridges), and the marker's PUT deletes them before the start.
    let post = restore_post(&w, "lxc");
    assert!(matches!(post.param("unique"), None | Some("0")), "{post:?}");
    for key in ["net0", "net1"] {
        let nic = post
            .param(key)
            .unwrap_or_else(|| panic!("{key} not overridden: {post:?}"));
        assert!(!nic.contains("bridge="), "{key} = {nic}");
    }
    let path = format!("/nodes/pve1/lxc/{vmid}/config");
    let deleted = w.pve.requests().into_iter().any(|r| {
        r.method == "PUT" && r.api_path() == path && r.param("delete") == Some("net0%2Cnet1")
    });
    assert!(
        deleted,
        "no config PUT deleted net0,net1: {:#?}",
        w.pve.writes()
    );

    // No needs_human, nothing left in the band, and the original untouched.
    let journal = w.agent(&["journal", "--json"]).json();
    assert!(!journal.to_string().contains("needs_human"), "{journal:#}");
    assert_eq!(left_in_band(&w), Vec::<u32>::new());
    assert!(w.pve.writes_for(200).is_empty());
}

#[test]
fn a_throwaway_selftest_starts_with_no_nic_and_a_kept_one_with_its_stored_bridge() {
    let w = World::new(scenario_with_backup(customer_backup_config()));
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["network"], "isolated", "{doc:#}");
    assert_eq!(nics_of(&started_config(&w, 120)), Vec::new());
    assert_eq!(w.pve.network_exposures(), Vec::new());
    // The dry run says which, before anything is written.
    let run = w.agent(&["--selftest=provision", "-vmid", "121", "--dry-run"]);
    assert!(run.stdout.contains("network: isolated"), "{}", run.stdout);

    let run = w.agent(&["--selftest=provision", "-vmid", "122", "--keep", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["network"], "stored", "{doc:#}");
    let nics = nics_of(&started_config(&w, 122));
    let net0 = nics
        .iter()
        .find(|(k, _)| k == "net0")
        .map(|(_, v)| v.as_str());
    assert!(net0.is_some_and(|n| n.contains("bridge=vmbr0")), "{nics:?}");

    // --network overrides either default.
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "123",
        "--keep",
        "--network=isolated",
        "--json",
    ]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(nics_of(&started_config(&w, 123)), Vec::new());
}

#[test]
fn a_marker_write_that_fails_after_writing_is_read_back() {
    // A backup whose NIC has no bridge, provisioned with its stored network: PVE writes the
    // marker's config, then dies reading the bridge's MTU (update_lxc_config) and answers 500.
    // The agent reads the config back, sees its marker, and goes on to the start, which dies
    // the same way on PVE; the guest is then its own to destroy.
    let w = World::new(scenario_with_backup(json!({
        "unprivileged": "1",
        "net0": "name=eth0,hwaddr=BC:24:11:00:02:00,type=veth"
    })));
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "120",
        "--network=stored",
        "--json",
    ]);
    let doc = run.json();
    assert_ne!(doc["outcome"], "ok", "{doc:#}");
    let message = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("start") && message.contains("bridge '' does not exist"),
        "{doc:#}"
    );
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    assert!(w.pve.guest(120).is_none(), "guest 120 is left");
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
    // The run's one copy (of the demo's backup of 200).
    let doc = felhom_tests::agent::AgentRun::from(out).restore_copy();
    assert_eq!(doc["guest"], 200, "{doc:#}");
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
    // Only a guest that keeps its stored network needs SDN.Use on its bridges.
    let w = World::new(without_sdn(demo_scenario()));
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "120",
        "--network=stored",
        "--json",
    ]);
    let doc = run.json();
    assert_eq!(run.code, Some(3), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["error"]["code"], "sdn_denied", "{doc:#}");
    let message = doc["error"]["message"].as_str().unwrap_or("");
    for n in [
        "SDN.Use",
        "/sdn/zones/localnetwork/vmbr0",
        "pveum acl modify /sdn/zones/localnetwork/vmbr0 --tokens 'felhom@pve!agent' --roles PVESDNUser",
    ] {
        assert!(message.contains(n), "{n:?} not in {message}");
    }
    assert!(w.pve.writes().is_empty(), "{:#?}", w.pve.writes());
}

#[test]
fn a_restore_test_copy_needs_no_sdn_use() {
    // Its NICs are all overridden, bridge-less: PVE checks no bridge, and neither does the
    // preflight.
    let w = World::new(without_sdn(demo_scenario()));
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert_eq!(doc["guest"], 200, "{doc:#}");
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
}

#[test]
fn a_privileged_container_backup_is_restored_unprivileged() {
    // The request's unprivileged=1 wins over the stored value (pve-container create_vm), so PVE
    // checks no Sys.Modify and the copy is an unprivileged container the exec helper enters.
    let w = World::new(scenario_with_backup(json!({
        "net0": "name=eth0,bridge=vmbr0,ip=dhcp,type=veth"
    })));
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    let contents = doc["preflight"]["checks"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "contents"))
        .cloned()
        .unwrap_or_default();
    assert!(
        contents["message"]
            .as_str()
            .unwrap_or("")
            .contains("restored as an unprivileged"),
        "{contents:#}"
    );
    assert_eq!(
        started_config(&w, 120).get("unprivileged"),
        Some(&json!("1"))
    );
}

#[test]
fn a_template_backup_is_refused_before_any_write() {
    let w = World::new(scenario_with_backup(json!({
        "unprivileged": "1", "template": "1"
    })));
    refused_before_any_write(&w, "backup_template", "selftest_source", &["template"]);
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

/// A world whose restore test restores only [`felhom_tests::fakepve::QEMU_BACKUP`], stored
/// with `config`; the token holds Mapping.Use on `/mapping/pci/vf0`.
fn vm_restore_world(config: Value) -> World {
    let mut s = demo_scenario();
    felhom_tests::fakepve::add_qemu_backup(&mut s, config, json!({"agent": true}));
    s["attrs"] = json!({"qemu_restore_secs": 5});
    for who in ["felhom@pve!agent", "felhom@pve"] {
        s["grants"].as_array_mut().expect("grants").push(json!([
            who,
            "/mapping/pci/vf0",
            ["PVEMappingUser"]
        ]));
    }
    let opts = AgentOptions {
        extra_toml: format!(
            "[restore_test]\nsources = [\"{}\"]\n",
            felhom_tests::fakepve::QEMU_BACKUP
        ),
        ..AgentOptions::default()
    };
    World::with_options(s, &opts)
}

#[test]
fn a_restore_test_copy_of_a_vm_with_two_bridged_nics_starts_with_no_nic() {
    // qemu-server lets the request's NICs win over the backup's (restore_merge_config), so a
    // VM copy keeps `unique=1` (new MACs, SMBIOS uuid) with every stored NIC given bridge-less
    // and link-down; the marker's PUT deletes them before the start.
    let mut config = felhom_tests::fakepve::qemu_backup_config();
    config["onboot"] = json!("1");
    config["protection"] = json!("1");
    let w = vm_restore_world(config);
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    // The one copy: of the one source, VM 300's backup.
    let doc = run.restore_copy();
    assert_eq!(doc["backup"], felhom_tests::fakepve::QEMU_BACKUP, "{doc:#}");
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    let vmid = doc["vmid"].as_u64().expect("vmid") as u32;
    let post = restore_post(&w, "qemu");
    assert_eq!(post.param("unique"), Some("1"), "{post:?}");
    let config = started_config(&w, vmid);
    assert_eq!(nics_of(&config), Vec::new(), "{config:#?}");
    assert_eq!(w.pve.network_exposures(), Vec::new());
    assert_no_onboot_nor_protection(&config);
    assert_eq!(left_in_band(&w), Vec::<u32>::new());
}

#[test]
fn a_vm_backup_that_reaches_the_host_without_a_nic_is_refused_before_any_write() {
    for (key, value, code) in [
        (
            "args",
            "-netdev user,id=n9 -device virtio-net,netdev=n9",
            "backup_args",
        ),
        ("hostpci0", "mapping=vf0", "backup_devices"),
        ("virtiofs0", "share0", "backup_host_dir"),
        ("ivshmem", "size=32,name=prod-shm", "backup_shared_memory"),
        ("serial0", "/dev/ttyS0", "backup_host_port"),
        (
            "vmstate",
            "local-lvm:vm-300-state-suspend-2026-01-01",
            "backup_vmstate",
        ),
    ] {
        let mut config = felhom_tests::fakepve::qemu_backup_config();
        config[key] = json!(value);
        let w = vm_restore_world(config);
        let run = w.agent(&["--selftest=restore", "--json"]);
        assert_eq!(run.code, Some(3), "{key}: {}\n{}", run.stdout, run.stderr);
        // The copy of the one source is a refused transaction, and the backup unprovable.
        let doc = run.restore_copy();
        assert_eq!(doc["outcome"], "refused", "{key}: {doc:#}");
        assert_eq!(doc["error"]["code"], code, "{key}: {doc:#}");
        assert_eq!(doc["verdict"], "unprovable", "{key}: {doc:#}");
        assert!(
            doc["error"]["message"].as_str().unwrap_or("").contains(key),
            "{key}: {doc:#}"
        );
        assert!(w.pve.writes().is_empty(), "{key}: {:#?}", w.pve.writes());
        assert!(w.pve.start_configs().is_empty(), "{key}");
    }
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
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "130",
        "--network=stored",
        "--json",
    ]);
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
    assert_eq!(run.code, Some(3), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert_eq!(doc["backup"], TAR_BACKUP, "{doc:#}");
    assert_eq!(doc["outcome"], "refused", "{doc:#}");
    assert!(
        doc["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains(".tar format"),
        "{doc:#}"
    );
    assert!(w.pve.writes().is_empty(), "{:#?}", w.pve.writes());
}

#[test]
fn a_privileged_backup_with_a_quota_is_refused_before_any_write() {
    // The storage-only restore keeps each stored mount point's options (pve-container
    // create_vm, `print_ct_mountpoint` of the stored mount point with only volume and size
    // replaced), so `quota=1` survives the conversion to unprivileged, and every start then
    // dies "Quotas are not supported by unprivileged containers." (`API2/LXC/Status.pm`).
    for (key, value) in [
        ("rootfs", "local-lvm:vm-200-disk-0,size=8G,quota=1"),
        ("mp0", "local-lvm:vm-200-disk-1,mp=/srv,size=2G,quota=1"),
    ] {
        let mut config = json!({
            "rootfs": "local-lvm:vm-200-disk-0,size=8G",
            "net0": "name=eth0,bridge=vmbr0,ip=dhcp,type=veth"
        });
        config[key] = json!(value);
        let w = World::new(scenario_with_backup(config));
        refused_before_any_write(&w, "backup_quota", "selftest_source", &["quota", key]);
    }
}

/// A world whose `selftest_source` is [`felhom_tests::fakepve::QEMU_BACKUP`], stored with
/// `config`; `storages`: the scenario's storage options (e.g. `avail`).
fn vm_provision_world(config: Value, storages: Value) -> World {
    let mut s = demo_scenario();
    felhom_tests::fakepve::add_qemu_backup(&mut s, config, json!({"agent": true}));
    s["attrs"] = json!({"qemu_restore_secs": 5});
    s["storages"] = storages;
    let opts = AgentOptions {
        selftest_source: Some(felhom_tests::fakepve::QEMU_BACKUP.to_string()),
        ..AgentOptions::default()
    };
    World::with_options(s, &opts)
}

#[test]
fn saved_ram_and_raw_args_are_refused_for_a_provision_that_keeps_its_network() {
    // A restore keeps `vmstate` and `args` verbatim (qemu-server restore_update_config_line):
    // the copy would resume the production VM's memory on the production network and free the
    // state volume, which is the production VM's, at its first start (vm_start_nolock); `args`
    // is root's (check_vm_modify_config_perm: "only root can set 'args' config").
    for (key, value, code) in [
        (
            "vmstate",
            "local-lvm:vm-300-state-suspend-2026-01-01",
            "backup_vmstate",
        ),
        (
            "args",
            "-chardev socket,id=prod,path=/run/prod.sock",
            "backup_args",
        ),
    ] {
        let mut config = felhom_tests::fakepve::qemu_backup_config();
        config[key] = json!(value);
        let w = vm_provision_world(config, json!({}));
        let run = w.agent(&[
            "--selftest=provision",
            "-vmid",
            "130",
            "--network=stored",
            "--json",
        ]);
        let doc = run.json();
        assert_eq!(run.code, Some(3), "{key}: {doc:#}\n{}", run.stderr);
        assert_eq!(doc["error"]["code"], code, "{key}: {doc:#}");
        assert!(
            doc["error"]["message"].as_str().unwrap_or("").contains(key),
            "{key}: {doc:#}"
        );
        assert!(w.pve.writes().is_empty(), "{key}: {:#?}", w.pve.writes());
        assert!(w.pve.start_configs().is_empty(), "{key}");
    }
}

#[test]
fn a_vm_restore_onto_a_storage_too_small_for_its_disks_is_refused_before_any_write() {
    // qemu-server allocates every stored disk at its stored size before any data is written
    // (restore_vma_archive → restore_allocate_devices); a failed allocation ends the task and
    // leaves the VM's config behind, empty and outside the pool (API2/Qemu.pm create_vm: "VM
    // <vmid> state is NOT cleaned up"). The stored config gives each disk's size and PVE's
    // storage status its free space: 8 GiB + 4 GiB do not fit into 10 GiB.
    let mut config = felhom_tests::fakepve::qemu_backup_config();
    config["scsi1"] = json!("local-lvm:vm-300-disk-1,size=4G");
    config["ide2"] = json!("local:iso/debian.iso,media=cdrom,size=600M");
    let w = vm_provision_world(
        config,
        json!({"local-lvm": {"avail": 10u64 << 30, "total": 100u64 << 30}}),
    );
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "130",
        "--network=stored",
        "--json",
    ]);
    let doc = run.json();
    assert_eq!(run.code, Some(3), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["error"]["code"], "storage_full", "{doc:#}");
    let message = doc["error"]["message"].as_str().unwrap_or("");
    for n in ["local-lvm", "scsi0", "scsi1", "130"] {
        assert!(message.contains(n), "{n:?} not in {message}");
    }
    assert!(
        !message.contains("ide2"),
        "a CD-ROM is not allocated: {message}"
    );
    assert!(w.pve.writes().is_empty(), "{:#?}", w.pve.writes());
    // The same disks fit into 13 GiB: the check counts only what is allocated.
    let mut config = felhom_tests::fakepve::qemu_backup_config();
    config["scsi1"] = json!("local-lvm:vm-300-disk-1,size=4G");
    let w = vm_provision_world(
        config,
        json!({"local-lvm": {"avail": 13u64 << 30, "total": 100u64 << 30}}),
    );
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "130",
        "--network=stored",
        "--dry-run",
        "--json",
    ]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
}

#[test]
fn a_vm_without_a_guest_agent_is_refused_before_any_write() {
    // Without `agent: 1` PVE answers every guest agent call "No QEMU guest agent configured"
    // (qemu-server `PVE/QemuServer/Agent.pm` assert_agent_available): nothing can prove the
    // VM's launch, bootstrap it or check it, so the provision is refused before its restore
    // rather than after a start.
    for agent in [None, Some("0"), Some("enabled=0,fstrim_cloned_disks=1")] {
        let mut config = felhom_tests::fakepve::qemu_backup_config();
        match agent {
            None => {
                config.as_object_mut().expect("config").remove("agent");
            }
            Some(v) => config["agent"] = json!(v),
        }
        let w = vm_provision_world(config, json!({}));
        let started = std::time::Instant::now();
        let run = w.agent(&[
            "--selftest=provision",
            "-vmid",
            "130",
            "--network=stored",
            "--json",
        ]);
        let doc = run.json();
        assert_eq!(run.code, Some(3), "{agent:?}: {doc:#}\n{}", run.stderr);
        assert_eq!(
            doc["error"]["code"], "guest_agent_off",
            "{agent:?}: {doc:#}"
        );
        let message = doc["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains("agent: 1"), "{message}");
        assert!(
            w.pve.writes().is_empty(),
            "{agent:?}: {:#?}",
            w.pve.writes()
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "{:?}",
            started.elapsed()
        );
    }
}

#[test]
fn an_isolated_hub_provision_of_an_onboot_protected_backup_ends_ok() {
    // The last read before the start refuses onboot and protection for every isolated
    // transaction, so the restore of every isolated one sends both off, not only a selftest's.
    use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
    use hub_protocol::{DispatchAction, Outcome};
    let wait = std::time::Duration::from_secs(90);
    let hub = DevHub::start(DevHubOptions::default());
    let opts = AgentOptions {
        hub: Some(hub.hub_options()),
        ..AgentOptions::default()
    };
    let w = World::with_options(scenario_with_backup(customer_backup_config()), &opts);
    let path = w.path();
    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str())],
    );
    hub.wait_for("the session", wait, |s| s.sessions == 1);
    let txn = hub.dispatch(DispatchAction::Provision {
        vmid: 6201,
        from: "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst".to_string(),
        storage: "local-lvm".to_string(),
        keep: false,
        profile: None,
        isolate_network: Some(true),
    });
    let state = hub.wait_for("the provision's result", wait, |s| {
        s.results.contains_key(&txn)
    });
    let result = &state.results[&txn][0].1;
    assert_eq!(result.outcome, Outcome::Ok, "{result:?}");
    assert!(result.destroyed, "{result:?}");
    let config = started_config(&w, 6201);
    assert_eq!(nics_of(&config), Vec::new(), "{config:#?}");
    assert_no_onboot_nor_protection(&config);
    assert_eq!(w.pve.network_exposures(), Vec::new());
    let post = restore_post(&w, "lxc");
    assert_eq!(post.param("onboot"), Some("0"), "{post:?}");
    assert_eq!(post.param("protection"), Some("0"), "{post:?}");
    assert!(w.pve.guest(6201).is_none(), "guest 6201 is left");
    let (status, log) = agent.terminate(wait);
    assert!(status.success(), "run exited {status}:\n{log}");
}

#[test]
fn a_backup_of_a_guest_outside_the_pool_asks_for_vm_backup_alone_and_passes_with_it() {
    // pve-storage check_volume_access (backup branch) and pve-manager extractconfig check
    // VM.Backup on the backup's owner, nothing else: the advice is a role of that one
    // privilege, never PVEVMUser (console, power and, on PVE 9, guest file access on a
    // production guest).
    const FOREIGN: &str = "local:backup/vzdump-lxc-101-2026_01_01-00_00_00.tar.zst";
    let foreign_backup = || {
        let mut s = demo_scenario();
        s["volumes"]["local"]
            .as_array_mut()
            .expect("volumes")
            .push(json!({"volname": FOREIGN.trim_start_matches("local:"), "vmid": 101,
                         "config": {"unprivileged": "1", "net0": "name=eth0,bridge=vmbr0,ip=dhcp,type=veth"}}));
        s
    };
    let opts = AgentOptions {
        selftest_source: Some(FOREIGN.to_string()),
        ..AgentOptions::default()
    };
    let w = World::with_options(foreign_backup(), &opts);
    let names = [
        "VM.Backup on /vms/101",
        "pveum role add FelhomVMBackup -privs VM.Backup",
        "pveum acl modify /vms/101 --tokens 'felhom@pve!agent' --roles FelhomVMBackup",
        "--users 'felhom@pve' --roles FelhomVMBackup",
    ];
    // PVE's listing drops a backup the token may not access (check_volume_access), so the
    // preflight cannot tell a missing backup from a hidden one, and says both; doctor, which
    // asks for the privileges first, names the access.
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(3), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["error"]["code"], "backup_missing", "{doc:#}");
    let doctor = w.agent(&["doctor", "--json"]);
    let check = doctor.json()["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["name"] == "selftest_source")
        .cloned()
        .expect("selftest_source");
    assert_eq!(check["code"], "backup_access", "{check:#}");
    for (text, what) in [
        (doc["error"]["message"].as_str().unwrap_or(""), "provision"),
        (check["message"].as_str().unwrap_or(""), "doctor"),
    ] {
        for n in names {
            assert!(text.contains(n), "{what}: {n:?} not in {text}");
        }
        assert!(
            !text.contains("PVEVM"),
            "{what}: a built-in VM role is advised: {text}"
        );
    }
    assert!(w.pve.writes().is_empty(), "{:#?}", w.pve.writes());
    // The one privilege is enough.
    let mut s = foreign_backup();
    for who in ["felhom@pve!agent", "felhom@pve"] {
        s["grants"]
            .as_array_mut()
            .expect("grants")
            .push(json!([who, "/vms/101", ["VM.Backup"]]));
    }
    let w = World::with_options(s, &opts);
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    let guest_grants = |w: &World| {
        w.agent(&["doctor", "--json"]).json()["checks"]
            .as_array()
            .expect("checks")
            .iter()
            .find(|c| c["name"] == "guest_grants")
            .cloned()
            .expect("guest_grants")
    };
    assert_eq!(guest_grants(&w)["status"], "pass");
    // The grant an older README gave there: doctor warns and names the one-privilege role.
    let mut s = foreign_backup();
    for who in ["felhom@pve!agent", "felhom@pve"] {
        s["grants"]
            .as_array_mut()
            .expect("grants")
            .push(json!([who, "/vms/101", ["PVEVMUser"]]));
    }
    let w = World::with_options(s, &opts);
    let check = guest_grants(&w);
    assert_eq!(check["status"], "warn", "{check:#}");
    let message = check["message"].as_str().unwrap_or("");
    assert!(
        message.contains("/vms/101")
            && message.contains("VM.Console")
            && message.contains("--roles FelhomVMBackup"),
        "{check:#}"
    );
}
