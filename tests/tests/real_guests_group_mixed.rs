//! An application group of a container and a VM (`[[restore_test.group]]` holding both): the
//! database container (200, real LXC, busybox httpd on its stored address 10.20.0.30) and a VM
//! (300, a real QEMU running Debian 12 with the real guest agent, ens18 static at 10.20.0.31)
//! whose check asks the database for its stock. The VM copy's NIC is on the group's lab bridge,
//! a real kernel bridge this test makes as an operator would (`bridge-ports none`, IPv6 off, the
//! strict reverse-path filter, no forwarding), where the bed's QEMU puts its tap as pve-bridge
//! does; the database's copy joins the group's lab (a bridge in a network namespace of its own)
//! and root links that lab to the lab bridge with one veth pair. The VM's check reaches the
//! database's copy at its stored address; after the run nothing of the link is left on the
//! bridge. Needs LXC and QEMU (`tests/tests/real_guests.rs`, `tests/tests/real_vm.rs`).

use felhom_tests::agent::KERNEL_ROOT_ENV;
use felhom_tests::fakepve::{add_qemu_backup, qemu_backup_config, AgentOptions};
use felhom_tests::groups::{add_group, copy_of, DATABASE_CHECK, SHOP};
use felhom_tests::verdict::check_is;
use felhom_tests::world::World;
use serde_json::{json, Value};

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
fn vm_files() -> Value {
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
fn pack() -> String {
    format!(
        "{DATABASE_CHECK}\n[[check]]\nname = \"stock-from-the-database\"\nsql = \"SELECT response_code FROM curl WHERE url = 'http://{}/stock'\"\nexpect = \"response_code == '200'\"\nguests = [300]\nin_group = true\n",
        SHOP.db_ip()
    )
}

/// The pool: the database container (200) and the VM (300, one NIC on vmbr0), each with a
/// backup; the node's network as PVE lists it with `bridge` as a lab bridge; the token's
/// SDN.Use on it.
fn scenario(bridge: &str) -> Value {
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
    add_qemu_backup(&mut s, config, json!({"real": true, "files": vm_files()}));
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
    let Some(w) = World::real_with_vm_or_skip(scenario(&bridge.name), &opts) else {
        return;
    };
    // Only these checks (the default pack's queries take half a minute in a VM under TCG).
    std::fs::write(w.files.checks_dir.join("default.toml"), pack())
        .unwrap_or_else(|e| panic!("cannot write the pack: {e}"));
    add_group(&w.files.config_path, "shop", &[200, 300], 0);
    let run: felhom_tests::agent::AgentRun = w
        .command()
        // The kernel's own files: the lab bridge above is a real one.
        .env(KERNEL_ROOT_ENV, "/")
        .args(["--selftest=restore", "--guest", "300", "--json"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run the agent: {e}"))
        .into();
    let out = format!("{}\n{}", run.stdout, run.stderr);
    let doc: Value =
        serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"));
    let copies = doc["copies"].as_array().cloned().unwrap_or_default();
    assert_eq!(run.code, Some(0), "{out}");
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
