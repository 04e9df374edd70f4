//! The test bed's real VM: a VM the fake PVE restores from a backup marked `"real": true` runs
//! in a real QEMU (TCG) with Debian 12 and the real `qemu-guest-agent`
//! (`tests/testbed/build-debian-vm.sh`, `guest_bed.real_qemu` in `tests/fakepve/scenario.py`),
//! and the fake's `agent/*` endpoints speak QGA's protocol to it as qemu-server does
//! (`tests/data/real-vm-facts.md`). Every test but the one without QEMU boots one VM once;
//! they run at once. The first two are provisions; the restore tests after them put a VM
//! copy's stored NICs on the lab bridge (`[restore_test] lab_bridge`, an isolated QEMU hub in
//! the bed: real-vm-facts.md section 5) and judge it with the default pack and a pack that
//! lists every failed unit, and one runs without a lab bridge. On a machine without QEMU or
//! the image, each test prints why and ends (`FELHOM_REQUIRE_REAL_GUESTS=1`, set by
//! `tests/run.sh`, makes that a failure); `without_qemu_…` shows that behaviour on a `PATH`
//! without QEMU.

use std::time::{Duration, Instant};

use felhom_tests::fakepve::{add_qemu_backup, demo_scenario, AgentOptions, QEMU_BACKUP};
use felhom_tests::guestbed::wait_processes_gone;
use felhom_tests::verdict::{self, check_is, EVERY_FAILED_PACK};
use felhom_tests::world::World;
use serde_json::{json, Value};

/// The VM's backup as a Debian 12 guest whose hostname is its PVE name, with the network
/// config Debian's installer leaves for a DHCP install (`allow-hotplug ens18`), and the guest
/// agent enabled: two NICs (ens18, ens19), kept by a provision.
fn scenario(guest: Value) -> Value {
    let mut s = demo_scenario();
    let config = json!({
        "name": "felhom-vm",
        "agent": "1",
        "ostype": "l26",
        "memory": "1024",
        "scsi0": "local-lvm:vm-300-disk-0,size=8G",
        "net0": "virtio=BC:24:11:00:03:00,bridge=vmbr0",
        "net1": "virtio=BC:24:11:00:03:01,bridge=vmbr1,tag=20",
        "tags": "customer;prod",
    });
    add_qemu_backup(&mut s, config, guest);
    s
}

fn debian_files() -> Value {
    json!({
        "/etc/hostname": "felhom-vm\n",
        "/etc/network/interfaces":
            "source /etc/network/interfaces.d/*\n\nauto lo\niface lo inet loopback\n\n\
             allow-hotplug ens18\niface ens18 inet dhcp\n",
    })
}

/// A world whose QEMU backup restores a real VM (`guest`: the guest spec, `"real": true`
/// added), with the launch proof and the boot wait bounded by `launch_secs` so that no test
/// waits longer than a minute.
fn real_world(guest: Value, launch_secs: u64) -> Option<World> {
    let mut guest = guest;
    guest["real"] = json!(true);
    let opts = AgentOptions {
        selftest_source: Some(QEMU_BACKUP.to_string()),
        extra_toml: format!("launch_timeout_secs = {launch_secs}\nboot_timeout_secs = 40\n"),
        ..AgentOptions::default()
    };
    let w = World::real_vm_or_skip(scenario(guest), &opts)?;
    std::fs::write(w.files.checks_dir.join("default.toml"), PACK)
        .unwrap_or_else(|e| panic!("cannot write the check pack: {e}"));
    Some(w)
}

/// Two checks of the default pack, what the guest is and its name: each query of the osqueryi
/// stand-in takes seconds in a guest under TCG, the whole default pack about half a minute.
const PACK: &str = r#"
[[check]]
name = "os-identified"
sql = "SELECT name, version, platform FROM os_version WHERE platform = 'debian' AND version LIKE '12%'"
expect = "rows >= 1"

[[check]]
name = "hostname"
sql = "SELECT hostname FROM system_info"
expect = "hostname == '{hostname}'"
"#;

/// The QGA commands the fake forwarded to VM `vmid`'s guest agent named `execute`.
fn forwarded(w: &World, vmid: u32, execute: &str) -> Vec<Value> {
    w.bed
        .qga_log(vmid)
        .into_iter()
        .filter(|e| e["execute"] == execute)
        .collect()
}

/// Run `argv` in VM `vmid` through the fake's API as the agent's token does (`agent/exec`,
/// then `agent/exec-status` until it exited): its final status.
fn api_exec(w: &World, vmid: u32, argv: &[&str]) -> Value {
    let client = w.pve.https_client();
    let auth = w.pve.auth_header();
    let base = format!("{}/api2/json/nodes/pve1/qemu/{vmid}/agent", w.pve.url());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let form: Vec<String> = argv
            .iter()
            .map(|a| {
                let enc: String = a
                    .bytes()
                    .map(|b| {
                        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                            char::from(b).to_string()
                        } else {
                            format!("%{b:02X}")
                        }
                    })
                    .collect();
                format!("command={enc}")
            })
            .collect();
        let started: Value = client
            .post(format!("{base}/exec"))
            .header("Authorization", &auth)
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body(form.join("&"))
            .send()
            .await
            .expect("agent/exec")
            .json()
            .await
            .expect("agent/exec answer");
        let pid = started["data"]["pid"]
            .as_u64()
            .unwrap_or_else(|| panic!("agent/exec gave no pid: {started}"));
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let status: Value = client
                .get(format!("{base}/exec-status?pid={pid}"))
                .header("Authorization", &auth)
                .send()
                .await
                .expect("agent/exec-status")
                .json()
                .await
                .expect("agent/exec-status answer");
            if status["data"]["exited"] == 1 {
                return status["data"].clone();
            }
            assert!(Instant::now() < deadline, "{argv:?} did not end: {status}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

#[test]
fn a_vm_provision_is_proven_launched_through_the_real_guest_agent() {
    let Some(w) = real_world(json!({"files": debian_files()}), 55) else {
        return;
    };
    let started = Instant::now();
    let run = w.agent(&["--selftest=provision", "-vmid", "320", "--keep", "--json"]);
    let took = started.elapsed();
    let doc = run.json();
    let serial = w.bed.serial_log(320) + &w.bed.qemu_log(320);
    let tail: String = serial.lines().rev().take(30).collect::<Vec<_>>().join("\n");
    assert_eq!(
        run.code,
        Some(0),
        "{doc:#}\n{}\nserial console (last lines, reversed):\n{tail}",
        run.stderr
    );
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    // A provision keeps the backup's network: its NICs, on their bridges.
    assert_eq!(doc["network"], "stored", "{doc:#}");

    let log = w.bed.qga_log(320);
    // QEMU ran, once, and its guest agent answered guest-ping only once it had booted.
    let qemu_start = log
        .iter()
        .filter(|e| e["event"] == "qemu-start")
        .map(|e| e["t"].as_f64().unwrap_or_default())
        .collect::<Vec<_>>();
    assert_eq!(qemu_start.len(), 1, "{log:#?}");
    let first_answer = log
        .iter()
        .find(|e| e["execute"] == "guest-ping" && e.get("answer").is_some())
        .and_then(|e| e["t"].as_f64())
        .expect("a guest-ping the guest agent answered");
    felhom_tests::report(&format!(
        "real VM: its guest agent answered {:.1} s after QEMU started; the provision took {:.1} s",
        first_answer - qemu_start[0],
        took.as_secs_f64()
    ));

    // The launch proof ran in the guest, through the real guest agent: the fake forwarded its
    // command as guest-exec (PVE's path and arg split), the agent gave a pid, and that pid's
    // status came back exited 0 with the proof's output.
    let execs = forwarded(&w, 320, "guest-exec");
    // (The agent's argv starts with `/usr/bin/env -i` and the environment it sets.)
    let proof = execs
        .iter()
        .find(|e| {
            e["arguments"]["arg"].as_array().is_some_and(|a| {
                a.ends_with(&[
                    json!("/bin/sh"),
                    json!("-c"),
                    json!("echo felhom-launch-ok"),
                ])
            })
        })
        .unwrap_or_else(|| panic!("no launch proof reached the guest agent: {execs:#?}"));
    assert_eq!(proof["arguments"]["path"], "/usr/bin/env", "{proof}");
    assert_eq!(proof["arguments"]["capture-output"], true, "{proof}");
    let pid = proof["answer"]["pid"].as_u64().expect("the guest's pid");
    let statuses = forwarded(&w, 320, "guest-exec-status");
    let done = statuses
        .iter()
        .find(|e| e["arguments"]["pid"] == pid && e["answer"]["exited"] == true)
        .unwrap_or_else(|| panic!("the proof's status was never read: {statuses:#?}"));
    assert_eq!(done["answer"]["exitcode"], 0, "{done}");
    // Every trip into the guest is one guest-exec: the launch proof, the boot wait, the
    // bootstrap and the checks, four at most (the proof is not asked again once the agent
    // answers; while it does not, PVE refuses before any guest-exec).
    assert!(execs.len() <= 4, "{} guest-exec: {execs:#?}", execs.len());
    assert_eq!(
        execs.len(),
        execs.iter().filter(|e| e["answer"]["pid"].is_u64()).count(),
        "{execs:#?}"
    );

    // What the bootstrap wrote, read back from inside the VM through the fake's API and the
    // real guest agent: the bootstrap ran in this guest, for this transaction.
    let env = api_exec(&w, 320, &["cat", "/var/lib/felhom/provisioned.env"]);
    assert_eq!(env["exitcode"], 0, "{env}");
    let txn = doc["txn"].as_str().expect("txn");
    let text = env["out-data"].as_str().unwrap_or_default();
    assert!(
        text.contains(&format!("FELHOM_TXN={txn}")) && text.contains("FELHOM_VMID=320"),
        "{env}"
    );
    // The guest has both NICs of its PVE config, with their MACs (the restore gave new ones),
    // named as Debian names PVE's slots 18 and 19.
    let links = api_exec(&w, 320, &["ip", "-o", "link", "show"]);
    let links = links["out-data"]
        .as_str()
        .unwrap_or_default()
        .to_lowercase();
    let config = &w.pve.guest(320).expect("the kept VM")["config"];
    for (key, name) in [("net0", "ens18"), ("net1", "ens19")] {
        let mac = config[key]
            .as_str()
            .and_then(|n| n.split(',').next())
            .and_then(|m| m.split_once('='))
            .map(|(_, mac)| mac.to_lowercase())
            .unwrap_or_else(|| panic!("no MAC in {key}: {config}"));
        assert!(
            links
                .split("\n")
                .any(|l| l.contains(&format!(": {name}:")) && l.contains(&mac)),
            "{key} ({mac}) is not {name}: {links}"
        );
    }
}

#[test]
fn with_the_guest_agent_stopped_inside_the_launch_proof_fails_naming_the_vm() {
    // The same guest with qemu-guest-agent masked: QEMU runs, the channel is there, nothing in
    // the guest answers it.
    // The shortest launch timeout: two tries, each refused after qemu-server's 3 s ping.
    let Some(w) = real_world(json!({"files": debian_files(), "agent": false}), 5) else {
        return;
    };
    let run = w.agent(&["--selftest=provision", "-vmid", "321", "--json"]);
    let doc = run.json();
    assert_ne!(run.code, Some(0), "{doc:#}");
    assert_eq!(doc["error"]["code"], "launch_unproven", "{doc:#}");
    let error = doc["error"]["message"].as_str().unwrap_or_default();
    assert!(
        error.contains("VM 321")
            && error.contains("not running")
            && error.contains("start qemu-guest-agent")
            && error.contains("launch_timeout_secs"),
        "{doc:#}\n{}",
        run.stderr
    );
    // The fake asked the real guest agent (guest-ping, qemu-server's 3 s) and got no answer;
    // no command ever reached the guest.
    let log = w.bed.qga_log(321);
    let pings = forwarded(&w, 321, "guest-ping");
    assert!(
        !pings.is_empty() && pings.iter().all(|p| p["error"] == "got timeout"),
        "{log:#?}"
    );
    assert!(forwarded(&w, 321, "guest-exec").is_empty(), "{log:#?}");
    // The failed provision destroyed the VM it made: its QEMU ended and its disk went with it.
    let dir = w.bed.state_dir().join("321");
    let left = wait_processes_gone(&dir.display().to_string(), Duration::from_secs(10));
    assert!(
        left.is_empty(),
        "QEMU of the destroyed VM still runs: {left:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while dir.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        !dir.exists(),
        "the destroyed VM's overlay is left: {}",
        dir.display()
    );
}

/// A machine without QEMU (here: a `PATH` without `qemu-system-x86_64`): a test asking for the
/// real VM gets a one-line reason and the modelled guest agent, and fails instead with
/// `FELHOM_REQUIRE_REAL_GUESTS=1`.
#[test]
fn without_qemu_the_reason_is_printed_unless_real_guests_are_required() {
    let bin = tempfile::tempdir().expect("tempdir");
    let mut linked = 0;
    for dir in ["/usr/local/bin", "/usr/bin", "/usr/sbin", "/sbin", "/bin"] {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name();
            if name == "qemu-system-x86_64" || bin.path().join(&name).exists() {
                continue;
            }
            if std::os::unix::fs::symlink(entry.path(), bin.path().join(&name)).is_ok() {
                linked += 1;
            }
        }
    }
    assert!(linked > 100, "{linked}");
    let probe = |require: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_real-bed-probe"));
        cmd.arg("vm")
            .env("PATH", bin.path())
            .env_remove("FELHOM_TEST_REPORTS");
        match require {
            Some(v) => cmd.env("FELHOM_REQUIRE_REAL_GUESTS", v),
            None => cmd.env_remove("FELHOM_REQUIRE_REAL_GUESTS"),
        };
        cmd.output().expect("real-bed-probe")
    };
    let out = probe(None);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert_eq!(
        stdout.trim(),
        "modelled qemu-system-x86_64 is not installed (tests/setup.sh installs it)"
    );
    let out = probe(Some("1"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("qemu-system-x86_64 is not installed")
            && stderr.contains("FELHOM_REQUIRE_REAL_GUESTS=1"),
        "{stderr}"
    );
}

/// The node's network as PVE lists it (`GET /nodes/{node}/network`): the production bridges
/// the backup's NICs are on (vmbr0 on eno1 with the node's address, vmbr1 on eno2) and the lab
/// bridge vmbr9 (`bridge-ports none`, no address), which the bed runs as an isolated QEMU hub.
fn node_network() -> Value {
    json!([
        {"iface": "eno1", "type": "eth", "method": "manual", "method6": "manual", "active": 1, "exists": 1},
        {"iface": "eno2", "type": "eth", "method": "manual", "method6": "manual", "active": 1, "exists": 1},
        {"iface": "vmbr0", "type": "bridge", "bridge_ports": "eno1", "method": "static", "method6": "manual",
         "address": "192.0.2.11", "netmask": "255.255.255.0", "cidr": "192.0.2.11/24", "gateway": "192.0.2.1",
         "active": 1, "autostart": 1},
        {"iface": "vmbr1", "type": "bridge", "bridge_ports": "eno2", "method": "manual", "method6": "manual",
         "active": 1, "autostart": 1},
        {"iface": "vmbr9", "type": "bridge", "bridge_ports": "", "method": "manual", "method6": "manual",
         "active": 1, "autostart": 1,
         "options": ["post-up echo 1 > /proc/sys/net/ipv6/conf/vmbr9/disable_ipv6"]},
    ])
}

/// isc-dhcp-client's settings in the DHCP backup: `ifup` runs `dhclient` without `-1`, which
/// gives up after `timeout` seconds without a lease (60 by default) and detaches
/// (`tests/data/guest-units-facts.md`); 5 s keeps the boot under TCG short.
const DHCLIENT_CONF: &str = "timeout 5;\nretry 5;\n";

/// A Debian 12 VM's files with `interfaces` as its `/etc/network/interfaces` stanza for ens18,
/// its hostname its PVE name.
fn vm_files(interfaces: &str) -> Value {
    vm_files_named(interfaces, "felhom-vm")
}

/// [`vm_files`] with the guest's own hostname `hostname`.
fn vm_files_named(interfaces: &str, hostname: &str) -> Value {
    json!({
        "/etc/hostname": format!("{hostname}\n"),
        "/etc/dhcp/dhclient.conf": DHCLIENT_CONF,
        "/etc/network/interfaces": format!(
            "source /etc/network/interfaces.d/*\n\nauto lo\niface lo inet loopback\n\n{interfaces}"
        ),
    })
}

/// A world whose restore test restores [`QEMU_BACKUP`] as a real VM (`guest`: its spec),
/// with `[restore_test] lab_bridge = "vmbr9"` when `lab`, the node network of
/// [`node_network`], the token's SDN.Use on the lab bridge, and two packs: the default pack as
/// shipped and an operator's pack that lists every failed unit.
fn lab_world(guest: Value, lab: bool) -> Option<World> {
    let mut guest = guest;
    guest["real"] = json!(true);
    let mut s = scenario(guest);
    s["node_network"] = node_network();
    for who in ["felhom@pve!agent", "felhom@pve"] {
        s["grants"].as_array_mut().expect("grants").push(json!([
            who,
            "/sdn/zones/localnetwork/vmbr9",
            ["PVESDNUser"]
        ]));
    }
    let opts = AgentOptions {
        selftest_source: Some(QEMU_BACKUP.to_string()),
        extra_toml: format!(
            "launch_timeout_secs = 90\nboot_timeout_secs = 60\n\n[restore_test]\nsources = [{QEMU_BACKUP:?}]\n{}",
            if lab { "lab_bridge = \"vmbr9\"\n" } else { "" }
        ),
        ..AgentOptions::default()
    };
    let w = World::real_vm_or_skip(s, &opts)?;
    std::fs::write(w.files.checks_dir.join("operator.toml"), EVERY_FAILED_PACK)
        .unwrap_or_else(|e| panic!("cannot write the operator's pack: {e}"));
    Some(w)
}

/// The restore test's copy started with both stored NICs on the lab bridge, with their stored
/// models and MACs, and nothing else: read from the host side (the config the copy started
/// with, as the fake recorded it at the start request, and what the fake found exposed).
fn assert_copy_on_the_lab_bridge(w: &World) {
    let starts = w.pve.start_configs();
    let (vmid, config) = starts
        .iter()
        .find(|(v, _)| (990_000..=990_009).contains(v))
        .unwrap_or_else(|| panic!("no copy was started: {starts:?}"));
    let nics: Vec<(&String, &Value)> = config
        .iter()
        .filter(|(k, _)| k.starts_with("net"))
        .collect();
    assert_eq!(
        nics,
        [
            (
                &"net0".to_string(),
                &json!("virtio=BC:24:11:00:03:00,bridge=vmbr9")
            ),
            (
                &"net1".to_string(),
                &json!("virtio=BC:24:11:00:03:01,bridge=vmbr9")
            ),
        ],
        "copy {vmid}: {config:?}"
    );
    assert!(
        w.pve.network_exposures().is_empty(),
        "{:?}",
        w.pve.network_exposures()
    );
    // The QEMU the bed started for the copy had both NICs on the lab bridge's isolated hub (no
    // user networking, nothing else), read from its command line as the bed logged it.
    let log = w.bed.qga_log(*vmid);
    let starts: Vec<&Value> = log.iter().filter(|e| e["event"] == "qemu-start").collect();
    assert_eq!(starts.len(), 1, "{log:#?}");
    let netdevs = starts[0]["netdevs"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        netdevs,
        [
            json!("hubport,id=net0,hubid=10"),
            json!("hubport,id=net1,hubid=10")
        ],
        "{log:#?}"
    );
}

/// One isolated restore test of a good Debian 12 VM backup whose ens18 stanza is
/// `interfaces`: it ends ok with the default pack and with the pack that lists every failed
/// unit, the copy's NICs were on the lab bridge only, and the report says what the isolation
/// changed (the NICs moved onto the lab bridge, which link each is in the copy).
fn good_backup_ends_ok(interfaces: &str) -> Option<Value> {
    good_backup_named_ends_ok(interfaces, "felhom-vm")
}

/// [`good_backup_ends_ok`] for a guest whose own hostname is `hostname`: the restore test's
/// document.
fn good_backup_named_ends_ok(interfaces: &str, hostname: &str) -> Option<Value> {
    let w = lab_world(json!({"files": vm_files_named(interfaces, hostname)}), true)?;
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    // The one copy: of the one source, the VM backup.
    let doc = run.restore_copy();
    assert_eq!(doc["backup"], QEMU_BACKUP, "{doc:#}");
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert!(check_is(&doc, "no-failed-units", "pass"), "{doc:#}");
    assert!(check_is(&doc, "no-failed-unit-at-all", "pass"), "{doc:#}");
    // Under its PVE name the hostname is judged and passes; under a name of its own it is
    // not judged: skipped, never a pass.
    let hostname_status = if hostname == "felhom-vm" {
        "pass"
    } else {
        "skipped"
    };
    assert!(check_is(&doc, "hostname", hostname_status), "{doc:#}");
    let changed = doc["isolation"].as_str().unwrap_or("");
    assert!(
        changed.contains("restored onto the lab bridge vmbr9")
            && changed.contains("net0 (bridge=vmbr0)")
            && changed.contains("net1 (bridge=vmbr1,tag=20)")
            && changed.contains("ens18 is bc:24:11:00:03:00")
            && changed.contains("ens19 is bc:24:11:00:03:01"),
        "{doc:#}"
    );
    assert_copy_on_the_lab_bridge(&w);
    Some(doc)
}

/// `auto ens18` with a static address: without its NIC `networking.service` fails (the red
/// verdict of a NIC-less copy); on the lab bridge ens18 is there and comes up.
#[test]
fn a_good_vm_backup_with_a_static_auto_ens18_ends_ok_on_the_lab_bridge() {
    let _ = good_backup_ends_ok(
        "auto ens18\niface ens18 inet static\n    address 10.20.0.40/24\n    gateway 10.20.0.1\n",
    );
}

/// `allow-hotplug ens18` with a static address (what Debian's installer writes), brought up by
/// udev's `ifup@ens18.service`; the guest calls itself `web01.example.com`, its PVE name is
/// `felhom-vm`: the default pack's hostname check is `skipped` (not a pass) saying it could not
/// judge the name (PVE keeps no hostname for a VM), with what the guest calls itself; the copy
/// still ends ok.
#[test]
fn a_good_vm_backup_with_allow_hotplug_ens18_and_its_own_hostname_ends_ok_on_the_lab_bridge() {
    let Some(doc) = good_backup_named_ends_ok(
        "allow-hotplug ens18\niface ens18 inet static\n    address 10.20.0.40/24\n    gateway 10.20.0.1\n",
        "web01.example.com",
    ) else {
        return;
    };
    let hostname = verdict::check(&doc, "hostname");
    assert_eq!(hostname["status"], "skipped", "{hostname:#}");
    let message = hostname["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("not judged")
            && message.contains("'felhom-vm'")
            && message.contains("calls itself 'web01.example.com'"),
        "{hostname:#}"
    );
}

/// DHCP on ens18 (`auto`): no DHCP server answers on the lab bridge; `dhclient` gives up and
/// detaches, and nothing the isolation made fail is left failed.
#[test]
fn a_good_vm_backup_with_dhcp_on_ens18_ends_ok_on_the_lab_bridge() {
    let _ = good_backup_ends_ok("auto ens18\niface ens18 inet dhcp\n");
}

/// How long the lab lets a VM copy's `dhclient -6` wait for a lease in these tests (the agent's
/// test hook; 60 s by default, as IPv4's `dhclient` gives up by itself).
const DHCP6_GIVE_UP_SECS: &str = "5";

/// `auto ens18` with `iface ens18 inet6 dhcp` (the guest's own stanza, as cloud-init writes
/// it for `ipconfig0: ip6=dhcp`): ifupdown runs `dhclient -6` without `-1`, which solicits for
/// ever on the lab bridge, and `ifup -a` (networking.service, the boot) waits on it until the
/// unit's 5-minute start timeout: without the lab's watch the boot runs out the 60 s boot
/// timeout (`boot_unfinished`). With it the client is stopped after the give-up time, the boot
/// ends, networking.service's failure (that stanza's alone) is reset, and the good backup is
/// green with both packs; the report says what was stopped and reset.
#[test]
fn a_good_vm_backup_with_an_inet6_dhcp_stanza_ends_its_boot_and_ok_on_the_lab_bridge() {
    let Some(w) = lab_world(
        json!({"files": vm_files("auto ens18\niface ens18 inet6 dhcp\n")}),
        true,
    ) else {
        return;
    };
    let run: felhom_tests::agent::AgentRun = w
        .command()
        .args(["--selftest=restore", "--json"])
        .env("FELHOM_AGENT_DHCP6_GIVE_UP_SECS", DHCP6_GIVE_UP_SECS)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the agent: {e}"))
        .into();
    let doc = run.restore_copy();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    for check in ["no-failed-units", "no-failed-unit-at-all", "hostname"] {
        assert!(check_is(&doc, check, "pass"), "{check}: {doc:#}");
    }
    let changed = doc["isolation"].as_str().unwrap_or("");
    assert!(
        changed.contains("the DHCPv6 client of ens18 (its `iface ens18 inet6 dhcp` stanza) waited")
            && changed.contains("networking.service failed for the DHCP stanza of ens18"),
        "{doc:#}"
    );
    assert_copy_on_the_lab_bridge(&w);
}

/// The static `auto ens18` backup with an application unit that fails at once (`shop.service`,
/// `ExecStart=/bin/false`, started by the boot) and one that fails 5 s into the boot
/// (`late.service`): red, both units named by both packs; the network, which the lab bridge
/// gave, is not.
#[test]
fn a_vm_backup_whose_application_units_fail_at_once_and_5_s_in_is_red_naming_them() {
    let mut files = vm_files(
        "auto ens18\niface ens18 inet static\n    address 10.20.0.40/24\n    gateway 10.20.0.1\n",
    );
    files["/etc/systemd/system/shop.service"] = json!(
        "[Unit]\nDescription=The shop\nAfter=network-online.target\nWants=network-online.target\n\n\
         [Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/false\n\n\
         [Install]\nWantedBy=multi-user.target\n"
    );
    // And one that fails 5 s into the boot (the boot waits for it: a oneshot).
    files["/etc/systemd/system/late.service"] = json!(
        "[Unit]\nDescription=Fails 5 s into the boot\n\n\
         [Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/sh -c 'sleep 5; exit 3'\n\n\
         [Install]\nWantedBy=multi-user.target\n"
    );
    let guest = json!({
        "files": files,
        "links": {
            "/etc/systemd/system/multi-user.target.wants/shop.service": "/etc/systemd/system/shop.service",
            "/etc/systemd/system/multi-user.target.wants/late.service": "/etc/systemd/system/late.service",
        },
    });
    let Some(w) = lab_world(guest, true) else {
        return;
    };
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_ne!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert_eq!(doc["outcome"], "failed", "{doc:#}");
    for name in ["no-failed-units", "no-failed-unit-at-all"] {
        let check = verdict::check(&doc, name);
        assert_eq!(check["status"], "fail", "{doc:#}");
        let text = check.to_string();
        assert!(
            text.contains("shop.service")
                && text.contains("late.service")
                && !text.contains("networking.service"),
            "{name}: {check:#}"
        );
    }
    assert_copy_on_the_lab_bridge(&w);
}

/// The same static `auto ens18` backup without `[restore_test] lab_bridge`: the copy starts
/// with no NIC (qemu-server gives QEMU no network device without a `netN`), its
/// `networking.service` fails for the missing ens18, the test is red naming it, and the report
/// says the copy had no NIC and which failures it therefore cannot judge.
#[test]
fn without_a_lab_bridge_the_static_auto_ens18_copy_is_red_and_the_report_says_what_it_cannot_judge()
{
    let Some(w) = lab_world(
        json!({"files": vm_files(
            "auto ens18\niface ens18 inet static\n    address 10.20.0.40/24\n    gateway 10.20.0.1\n"
        )}),
        false,
    ) else {
        return;
    };
    let run = w.agent(&["--selftest=restore", "--json"]);
    let doc = run.restore_copy();
    assert_eq!(doc["outcome"], "failed", "{doc:#}\n{}", run.stderr);
    assert!(check_is(&doc, "no-failed-units", "fail"), "{doc:#}");
    let changed = doc["isolation"].as_str().unwrap_or("");
    assert!(
        changed.contains("started with no NIC")
            && changed.contains("lab_bridge is not set")
            && changed.contains("cannot be judged")
            && changed.contains("networking.service"),
        "{doc:#}"
    );
    let starts = w.pve.start_configs();
    assert!(
        starts
            .iter()
            .filter(|(v, _)| (990_000..=990_009).contains(v))
            .all(|(_, c)| c.keys().all(|k| !k.starts_with("net"))),
        "{starts:?}"
    );
    // Its QEMU had no network device at all.
    let (vmid, _) = starts
        .iter()
        .find(|(v, _)| (990_000..=990_009).contains(v))
        .expect("the copy's start");
    let log = w.bed.qga_log(*vmid);
    let qemu = log
        .iter()
        .find(|e| e["event"] == "qemu-start")
        .unwrap_or_else(|| panic!("{log:#?}"));
    assert_eq!(qemu["netdevs"], json!([]), "{log:#?}");
}

/// A systemd drop-in for Debian's `qemu-guest-agent.service` that runs the real qemu-ga with
/// `guest-exec` and `guest-exec-status` blocked, as RHEL, Rocky and Alma ship it (their
/// `/etc/sysconfig/qemu-ga` feeds the same option to the same daemon).
const BLOCK_EXEC_DROPIN: &str = "[Service]\nExecStart=\n\
     ExecStart=-/usr/sbin/qemu-ga --block-rpcs=guest-exec,guest-exec-status\n";

/// A VM backup whose guest agent refuses exec: the copy boots and its real qemu-ga answers
/// the ping and `guest-info` (both exec commands `enabled: false`), so the restore test ends
/// with `guest_exec_blocked` (exit 5, verdict `unprovable`) naming the copy and the guest's
/// setting that allows it, not `launch_unproven` after the launch timeout; no exec was
/// forwarded, and the copy was destroyed: no guest at its vmid, no QEMU, no overlay.
#[test]
fn a_vm_whose_guest_agent_blocks_exec_ends_with_its_own_code_and_nothing_is_left() {
    let mut files = vm_files(
        "auto ens18\niface ens18 inet static\n    address 10.20.0.40/24\n    gateway 10.20.0.1\n",
    );
    files["/etc/systemd/system/qemu-guest-agent.service.d/block-exec.conf"] =
        json!(BLOCK_EXEC_DROPIN);
    let Some(w) = lab_world(json!({ "files": files }), true) else {
        return;
    };
    let started = Instant::now();
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(5), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert_eq!(doc["outcome"], "failed", "{doc:#}");
    assert_eq!(doc["error"]["code"], "guest_exec_blocked", "{doc:#}");
    // Not a failed backup: one that cannot be judged until the guest allows exec and is
    // backed up again.
    assert_eq!(doc["verdict"], "unprovable", "{doc:#}");
    let vmid = doc["vmid"]
        .as_u64()
        .and_then(|v| u32::try_from(v).ok())
        .unwrap_or_else(|| panic!("no vmid in {doc:#}"));
    let message = doc["error"]["message"].as_str().unwrap_or_default();
    for part in [
        format!("VM {vmid}"),
        "node pve1".to_string(),
        "guest-exec disabled".to_string(),
        "guest-exec-status disabled".to_string(),
        "/etc/sysconfig/qemu-ga".to_string(),
        "systemctl restart qemu-guest-agent".to_string(),
    ] {
        assert!(message.contains(&part), "{part:?} not in {doc:#}");
    }
    // Judged from what the guest agent said, not after the launch timeout (90 s here).
    assert!(
        started.elapsed() < Duration::from_secs(85),
        "{:?}",
        started.elapsed()
    );
    // The real guest agent was asked for its info and answered; no exec reached it.
    let log = w.bed.qga_log(vmid);
    let infos = forwarded(&w, vmid, "guest-info");
    assert!(
        infos.iter().any(|i| i["answer"]["supported_commands"]
            .as_array()
            .is_some_and(|c| c
                .iter()
                .any(|c| c["name"] == "guest-exec" && c["enabled"] == false))),
        "{log:#?}"
    );
    assert!(forwarded(&w, vmid, "guest-exec").is_empty(), "{log:#?}");
    // Nothing is left: the copy is gone from PVE, its QEMU ended and its overlay went with it.
    assert!(w.pve.guest(vmid).is_none(), "{:?}", w.pve.guest(vmid));
    let dir = w.bed.state_dir().join(vmid.to_string());
    let left = wait_processes_gone(&dir.display().to_string(), Duration::from_secs(10));
    assert!(left.is_empty(), "QEMU of the copy still runs: {left:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while dir.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        !dir.exists(),
        "the copy's overlay is left: {}",
        dir.display()
    );
}
