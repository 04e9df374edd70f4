//! QEMU guests end to end: the real agent binary against fakepve restoring a VM from a backup
//! that carries its config, with tasks that take time, and a guest agent that runs commands in
//! the VM's real root filesystem (the guest bed). A green provision (launch proof, bootstrap,
//! checks, gated destroy), the self-restore-test of a VM with two NICs, and a VM without a
//! guest agent.

use std::process::Stdio;
use std::time::{Duration, Instant};

use felhom_tests::agent::AgentRun;
use felhom_tests::fakepve::{
    add_qemu_backup, demo_scenario, qemu_backup_config, AgentOptions, RecordedRequest, QEMU_BACKUP,
};
use felhom_tests::world::World;
use serde_json::{json, Value};

/// Real seconds per PVE second: a restore takes 60 PVE seconds (1.2 s), the VM's start 10, its
/// boot (until the guest agent answers) 30.
const TIME_SCALE: f64 = 0.02;

fn scenario(config: Value, guest: Value) -> Value {
    let mut s = demo_scenario();
    s["time_scale"] = json!(TIME_SCALE);
    s["attrs"] = json!({"qemu_restore_secs": 60});
    add_qemu_backup(&mut s, config, guest);
    s
}

fn booting_guest() -> Value {
    json!({"agent": true, "boot_secs": 30, "start_secs": 10, "stop_secs": 5})
}

fn world(scenario: Value, extra_toml: &str) -> World {
    let opts = AgentOptions {
        selftest_source: Some(QEMU_BACKUP.to_string()),
        extra_toml: extra_toml.to_string(),
        ..AgentOptions::default()
    };
    World::with_options(scenario, &opts)
}

/// DELETEs of guests (not of tasks).
fn guest_deletes(w: &World) -> Vec<RecordedRequest> {
    w.pve
        .requests()
        .into_iter()
        .filter(|r| r.method == "DELETE" && !r.path.contains("/tasks/"))
        .collect()
}

fn agent_calls(w: &World, vmid: u32, endpoint: &str) -> Vec<RecordedRequest> {
    let suffix = format!("/qemu/{vmid}/agent/{endpoint}");
    w.pve
        .requests()
        .into_iter()
        .filter(|r| r.api_path().ends_with(&suffix))
        .collect()
}

/// Wait until the bed no longer holds the guest's folder (the fake removes it once PVE no
/// longer has the guest).
fn wait_bed_gone(w: &World, vmid: u32) -> bool {
    let dir = w.bed.state_dir().join(vmid.to_string());
    let deadline = Instant::now() + Duration::from_secs(5);
    while dir.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    !dir.exists()
}

#[test]
fn green_qemu_provision_runs_the_bootstrap_for_real_and_destroys_through_the_gate() {
    let w = world(scenario(qemu_backup_config(), booting_guest()), "");
    // The default profile copies its files/ tree over the guest's /: a file only this run
    // knows, to be read back from the VM's root filesystem.
    let probe = format!("qemu probe {}\n", std::process::id());
    let files = w.files.bootstrap_dir.join("default/files/etc");
    std::fs::create_dir_all(&files).expect("mkdir");
    std::fs::write(files.join("felhom-qemu-probe"), &probe).expect("write probe");

    let run = w.agent(&["--selftest=provision", "-vmid", "320", "--keep", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert_eq!(doc["destroyed"], json!(false), "--keep keeps");
    let checks = doc["checks"].as_array().expect("checks");
    assert!(
        !checks.is_empty() && checks.iter().all(|c| c["status"] == "pass"),
        "{doc:#}"
    );

    // The restore went to PVE's QEMU endpoint with the backup, into the pool.
    let reqs = w.pve.requests();
    let restore = reqs
        .iter()
        .find(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/qemu")
        .expect("the QEMU restore");
    assert_eq!(restore.param("vmid"), Some("320"));
    assert_eq!(restore.param("pool"), Some("felhom"));
    assert!(restore.param("archive").is_some(), "{restore:?}");
    // The VM carries the backup's config, and the agent's marker on top.
    let vm = w.pve.guest(320).expect("the kept VM");
    assert_eq!(vm["status"], "running");
    assert_eq!(vm["pool"], "felhom");
    assert_eq!(vm["config"]["name"], "felhom-vm");
    assert!(
        vm["config"]["net1"]
            .as_str()
            .unwrap_or("")
            .contains("bridge=vmbr1"),
        "{vm:#}"
    );
    let tags = vm["config"]["tags"].as_str().unwrap_or("");
    assert!(
        tags.contains("customer") && tags.contains("felhom"),
        "{tags}"
    );

    // The bootstrap really ran inside the VM: its files and its record are in the root
    // filesystem, written through the guest agent.
    let read = |p: &str| std::fs::read_to_string(w.bed.guest_path(320, p));
    assert_eq!(
        read("/etc/felhom-qemu-probe").expect("probe in the VM"),
        probe
    );
    let env = read("/var/lib/felhom/provisioned.env").expect("bootstrap record");
    let txn = doc["txn"].as_str().expect("txn");
    assert!(
        env.contains(&format!("FELHOM_TXN={txn}")) && env.contains("FELHOM_VMID=320"),
        "{env}"
    );
    // Only through the guest agent of this VM; every pid's final status was read once (a
    // second read would have failed the exec).
    // Four guest-agent `exec` calls ran (each through pveproxy and QMP on a node): the launch
    // proof, the boot wait, the bootstrap with its files on stdin, every check. The launch
    // proof is asked again while the VM's agent is not up yet (PVE refuses those: no pid).
    let execs = agent_calls(&w, 320, "exec");
    let proofs = execs
        .iter()
        .filter(|r| r.body.ends_with("command=echo%20felhom-launch-ok"))
        .count();
    assert!(proofs >= 1, "{execs:?}");
    assert_eq!(
        execs.len() - proofs,
        3,
        "boot wait, bootstrap, checks: {execs:?}"
    );
    let mut pids: Vec<String> = agent_calls(&w, 320, "exec-status")
        .iter()
        .map(|r| r.query.clone())
        .collect();
    pids.sort();
    pids.dedup();
    assert_eq!(pids.len(), 4, "the execs that ran: {pids:?}");
    assert!(reqs
        .iter()
        .filter(|r| r.api_path().contains("/agent/"))
        .all(|r| r.targets_vmid(320)));
    assert!(guest_deletes(&w).is_empty(), "nothing deleted yet");

    // The gated destroy removes exactly this VM, and its disks (the root filesystem) go.
    let run = w.agent(&["destroy", "-vmid", "320", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert!(w.pve.guest(320).is_none(), "the VM is gone");
    let deletes = guest_deletes(&w);
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert!(deletes[0].targets_vmid(320), "{deletes:?}");
    assert!(wait_bed_gone(&w, 320), "the VM's root filesystem is gone");
    for vmid in [300, 990000, 200, 101] {
        assert!(w.pve.writes_for(vmid).is_empty(), "{vmid} was written");
    }
}

#[test]
fn qemu_restore_test_comes_up_with_every_nic_isolated() {
    let extra = format!("[restore_test]\nsources = [\"{QEMU_BACKUP}\"]\n");
    let w = world(scenario(qemu_backup_config(), booting_guest()), &extra);
    let mut child = w
        .command()
        .args(["--selftest=restore", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the agent");
    // Watch the copy from PVE's side while the agent works: whenever it runs, what NICs has it?
    let mut seen_running: Option<Value> = None;
    let mut seen_locked_outside_pool = false;
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().expect("wait").is_none() && Instant::now() < deadline {
        if let Some(g) = w.pve.guest(990002) {
            if g["lock"] == "create" && g["pool"].is_null() {
                seen_locked_outside_pool = true;
            }
            if g["status"] == "running" && seen_running.is_none() {
                seen_running = Some(g["config"].clone());
            }
        }
        std::thread::sleep(Duration::from_millis(40));
    }
    let run: AgentRun = child.wait_with_output().expect("agent output").into();
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    // The one copy: of the one source.
    let doc = run.restore_copy();
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert_eq!(doc["vmid"], json!(990002));
    assert_eq!(doc["backup"], QEMU_BACKUP);
    assert_eq!(doc["destroyed"], json!(true));
    let checks = doc["checks"].as_array().expect("checks");
    assert!(
        !checks.is_empty() && checks.iter().all(|c| c["status"] == "pass"),
        "{doc:#}"
    );
    assert!(
        seen_locked_outside_pool,
        "the VM was seen locked `create` outside the pool while its restore ran"
    );

    // It ran with no NIC at all: the restore request gave both stored NICs bridge-less and
    // link-down, and the marker's PUT deleted them before the start.
    let config = seen_running.expect("the copy was seen running");
    let nets: Vec<&String> = config
        .as_object()
        .expect("config")
        .keys()
        .filter(|k| k.starts_with("net"))
        .collect();
    assert!(nets.is_empty(), "{config:#}");
    assert_eq!(w.pve.network_exposures(), Vec::new());

    let reqs = w.pve.requests();
    let pos = |pred: &dyn Fn(&RecordedRequest) -> bool| reqs.iter().position(pred);
    let restore =
        pos(&|r| r.method == "POST" && r.api_path() == "/nodes/pve1/qemu").expect("the restore");
    assert_eq!(reqs[restore].param("unique"), Some("1"));
    // The last read of its config (which refuses the start of a copy not isolated) comes
    // after the restore and right before the start.
    let start =
        pos(&|r| r.method == "POST" && r.api_path() == "/nodes/pve1/qemu/990002/status/start")
            .expect("the start");
    assert!(
        start > 0
            && reqs[start - 1].method == "GET"
            && reqs[start - 1].api_path() == "/nodes/pve1/qemu/990002/config"
            && restore < start,
        "restore, then the config read, then the start: {:#?}",
        &reqs[restore..=start]
    );
    // A copy of a production guest is checked, never changed: no file pushed, no bootstrap.
    assert!(
        !agent_calls(&w, 990002, "exec").is_empty(),
        "the checks ran in the copy"
    );
    assert!(
        agent_calls(&w, 990002, "exec")
            .iter()
            .all(|r| !r.body.contains("bootstrap")),
        "no bootstrap in a restore-test copy"
    );
    let deletes = guest_deletes(&w);
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert!(deletes[0].targets_vmid(990002));
    assert!(w.pve.guest(990002).is_none());
    assert!(wait_bed_gone(&w, 990002));
    for vmid in [300, 990000, 990001, 200, 101] {
        assert!(w.pve.writes_for(vmid).is_empty(), "{vmid} was written");
    }
}

/// A VM copy whose guest calls itself `web01.example.com` while its PVE name is `felhom-vm`:
/// PVE keeps no hostname for a VM, so the default pack's hostname check cannot judge it. It
/// ends `skipped`, never `pass`: in the JSON (kind `restore-test`), in the journal's text (not
/// judged, not among the passed) and in the metrics (`felhom_restore_test_checks`); the copy is
/// still ok (exit 0), the other checks judged as ever.
#[test]
fn a_vm_copy_under_a_name_of_its_own_has_its_hostname_check_skipped_never_passed() {
    let extra = format!("[restore_test]\nsources = [\"{QEMU_BACKUP}\"]\n");
    let mut guest = booting_guest();
    guest["files"] = json!({"/etc/hostname": "web01.example.com\n"});
    let w = world(scenario(qemu_backup_config(), guest), &extra);
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert_eq!(doc["kind"], "restore-test", "{doc:#}");
    let checks = doc["checks"].as_array().expect("checks");
    let hostname = checks
        .iter()
        .find(|c| c["name"] == "hostname")
        .unwrap_or_else(|| panic!("no hostname check: {doc:#}"));
    assert_eq!(hostname["status"], "skipped", "{hostname:#}");
    let message = hostname["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("not judged")
            && message.contains("'felhom-vm'")
            && message.contains("calls itself 'web01.example.com'"),
        "{hostname:#}"
    );
    let count = |status: &str| checks.iter().filter(|c| c["status"] == status).count();
    let passed = count("pass");
    assert_eq!(count("skipped"), 1, "{doc:#}");
    assert_eq!(
        passed,
        checks.len() - 1,
        "every other check judged and passed: {doc:#}"
    );
    assert!(passed > 0, "{doc:#}");

    let prom = std::fs::read_to_string(w.files.metrics_dir.join("felhom_restore_test.prom"))
        .expect("the restore-test metrics");
    for line in [
        format!("felhom_restore_test_checks{{status=\"pass\"}} {passed}"),
        "felhom_restore_test_checks{status=\"skipped\"} 1".to_string(),
        "felhom_restore_test_checks{status=\"fail\"} 0".to_string(),
        "felhom_restore_test_checks{status=\"error\"} 0".to_string(),
        "felhom_restore_test_outcome{outcome=\"ok\"} 1".to_string(),
    ] {
        assert!(prom.lines().any(|l| l == line), "no {line:?} in\n{prom}");
    }

    let text = w.agent(&["journal", "--last", "restore-test"]);
    assert_eq!(text.code, Some(0), "{}", text.stderr);
    assert!(
        text.stdout.contains(&format!(
            "checks: {passed} passed, 0 failed, 0 could not run, 1 not judged"
        )),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout
            .lines()
            .any(|l| l.trim_start().starts_with("check hostname ")
                && l.contains(" skipped: not judged")),
        "{}",
        text.stdout
    );
}

#[test]
fn qemu_guest_whose_agent_is_turned_off_after_its_restore_fails_at_once_and_is_cleaned_up() {
    // The preflight refuses a backup without `agent: 1` before any write (guest_agent_off,
    // restore_contents.rs). A VM whose guest agent is turned off between its restore and its
    // start answers the first exec "No QEMU guest agent configured" (qemu-server
    // QemuServer/Agent.pm assert_agent_available): that is an answer, not a guest still
    // booting, so the launch fails at once instead of waiting the launch timeout.
    let w = world(
        scenario(
            qemu_backup_config(),
            json!({"agent": false, "start_secs": 10}),
        ),
        "launch_timeout_secs = 120\n",
    );
    let vmid = 330;
    w.pve.set(json!({"answer_delay": {
        format!("PUT /api2/json/nodes/pve1/qemu/{vmid}/config"): 1.0
    }}));
    let started = Instant::now();
    let agent = {
        let mut cmd = w.command();
        cmd.args(["--selftest=provision", "-vmid", "330", "--json"]);
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd.spawn().expect("agent")
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut changed = false;
    while Instant::now() < deadline && !changed {
        let marked = w.pve.guest(vmid).is_some_and(|g| {
            g["config"]["tags"]
                .as_str()
                .is_some_and(|t| t.contains("felhom"))
        });
        if marked {
            w.pve
                .guest_set(vmid, json!({"config": {"agent": "enabled=0"}}));
            changed = true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = agent.wait_with_output().expect("agent output");
    let waited = started.elapsed();
    assert!(changed, "the VM was never marked");
    let run = AgentRun {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    let doc = run.json();
    assert_eq!(run.code, Some(5), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["error"]["code"], "launch_unproven", "{doc:#}");
    let msg = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("no QEMU guest agent configured") && msg.contains("agent: 1"),
        "names the missing guest agent and the fix: {msg}"
    );
    assert!(waited < Duration::from_secs(60), "took {waited:?}");
    // PVE was asked once (the launch proof's ping, before any exec) and answered in its
    // words; nothing ran in the guest.
    assert_eq!(agent_calls(&w, vmid, "ping").len(), 1);
    assert!(agent_calls(&w, vmid, "exec").is_empty());
    assert!(agent_calls(&w, vmid, "exec-status").is_empty());
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    let deletes = guest_deletes(&w);
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert!(deletes[0].targets_vmid(vmid));
    assert!(w.pve.guest(vmid).is_none());
    assert!(wait_bed_gone(&w, vmid));
}

#[test]
fn qemu_restore_onto_a_guest_created_after_the_list_was_read_is_refused_with_no_delete() {
    let w = world(scenario(qemu_backup_config(), booting_guest()), "");
    // The list is frozen, then someone else creates CT 131 (not in our pool).
    w.pve.set(json!({"vmlist_frozen": true}));
    w.pve.call(
        "add_ct",
        json!([131, "someone-new"]),
        json!({"status": "running"}),
    );
    let run = w.agent(&["--selftest=provision", "-vmid", "131", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(4), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["error"]["code"], "pve_refused", "{doc:#}");
    assert_eq!(doc["destroy_armed"], json!(false));
    let msg = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("CT 131 already exists on node 'pve1'"),
        "{msg}"
    );
    // PVE refused before any task: one POST, no task, nothing deleted, the CT intact.
    let posts: Vec<_> = w
        .pve
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/qemu")
        .collect();
    assert_eq!(posts.len(), 1, "{posts:?}");
    assert!(w.pve.tasks().is_empty(), "no task");
    assert!(guest_deletes(&w).is_empty());
    assert!(w.pve.writes_for(131).is_empty());
    assert_eq!(w.pve.guest(131).expect("the CT")["status"], "running");
}

#[test]
fn restore_test_dispatched_by_the_hub_runs_isolated_and_reports_once() {
    use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
    use hub_protocol::{Dispatch, DispatchAction, Outcome};

    let hub = DevHub::start(DevHubOptions::default());
    let opts = AgentOptions {
        selftest_source: Some(QEMU_BACKUP.to_string()),
        extra_toml: format!("[restore_test]\nsources = [\"{QEMU_BACKUP}\"]\n"),
        hub: Some(hub.hub_options()),
        ..AgentOptions::default()
    };
    let w = World::with_options(scenario(qemu_backup_config(), booting_guest()), &opts);
    let path = w.path();
    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str())],
    );
    let wait = Duration::from_secs(180);
    hub.wait_for("the session", wait, |s| s.sessions == 1);

    let txn = hub.dispatch(DispatchAction::RestoreTest { dry_run: false });
    let state = hub.wait_for("the restore test's result", wait, |s| {
        s.results.contains_key(&txn)
    });
    let result = &state.results[&txn][0].1;
    assert_eq!(result.outcome, Outcome::Ok, "{result:?}");
    assert_eq!(result.vmid, Some(990002), "{result:?}");
    assert!(result.destroyed, "{result:?}");
    assert!(
        !result.checks.is_empty()
            && result
                .checks
                .iter()
                .all(|c| c.status == hub_protocol::CheckStatus::Pass),
        "{result:?}"
    );
    // Its phases reached the hub as events on the way.
    assert!(
        state.events.len() >= 3,
        "phase events: {}",
        state.events.len()
    );
    // Isolated like the operator's run: every stored NIC given link-down with the restore, and
    // so started.
    let reqs = w.pve.requests();
    let post = reqs
        .iter()
        .find(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/qemu")
        .expect("the restore");
    for key in ["net0", "net1"] {
        assert!(
            post.param(key).is_some_and(|v| v.contains("link_down%3D1")),
            "{key} not isolated: {post:?}"
        );
    }
    let starts = w.pve.start_configs();
    let (_, started) = starts
        .iter()
        .find(|(v, _)| *v == 990002)
        .expect("the copy started");
    assert!(
        started
            .iter()
            .filter(|(k, _)| k.starts_with("net"))
            .all(|(_, v)| v.as_str().unwrap_or("").contains("link_down=1")),
        "{started:#?}"
    );
    let restores = reqs
        .iter()
        .filter(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/qemu")
        .count();
    assert_eq!(restores, 1, "one restore at PVE");

    // Dispatched again under the same transaction: the same result, nothing sent to PVE.
    let before = w.pve.requests().len();
    hub.dispatch_txn(Dispatch {
        txn,
        action: DispatchAction::RestoreTest { dry_run: false },
    });
    std::thread::sleep(Duration::from_millis(1500));
    let state = hub.snapshot();
    assert_eq!(state.results[&txn].len(), 1, "the result is applied once");
    let writes_after: Vec<RecordedRequest> = w.pve.requests()[before..]
        .iter()
        .filter(|r| r.is_write())
        .cloned()
        .collect();
    assert!(
        writes_after.is_empty(),
        "a re-dispatch wrote: {writes_after:?}"
    );
    assert!(w.pve.guest(990002).is_none());
    for vmid in [300, 990000, 990001, 200, 101] {
        assert!(w.pve.writes_for(vmid).is_empty(), "{vmid} was written");
    }
    let (status, log) = agent.terminate(wait);
    assert!(status.success(), "run exited {status}:\n{log}");
}

#[test]
fn qemu_guest_whose_agent_never_answers_is_unproven_within_the_launch_timeout_and_destroyed() {
    // `agent: 1` is configured, but no guest agent ever starts inside the VM: PVE answers
    // every ping with "QEMU guest agent is not running". The provision waits the configured
    // launch timeout (5 s here instead of 180), then fails as unproven and destroys the VM it
    // created through the gate.
    let w = world(
        scenario(
            qemu_backup_config(),
            json!({"agent": false, "start_secs": 10}),
        ),
        "launch_timeout_secs = 5\n",
    );
    let started = Instant::now();
    let run = w.agent(&["--selftest=provision", "-vmid", "331", "--json"]);
    let waited = started.elapsed();
    let doc = run.json();
    assert_eq!(run.code, Some(5), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["error"]["code"], "launch_unproven", "{doc:#}");
    let msg = doc["error"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("331"), "names the vmid: {msg}");
    assert!(
        msg.to_lowercase().contains("not running"),
        "says the guest agent is not running: {msg}"
    );
    // It pinged more than once (it waited for the agent), and never ran anything.
    assert!(agent_calls(&w, 331, "ping").len() >= 2);
    assert!(agent_calls(&w, 331, "exec").is_empty());
    assert!(agent_calls(&w, 331, "exec-status").is_empty());
    assert!(waited >= Duration::from_secs(5), "gave up after {waited:?}");
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    let deletes = guest_deletes(&w);
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert!(deletes[0].targets_vmid(331));
    assert!(w.pve.guest(331).is_none());
}

/// The node's network as PVE lists it: vmbr0 (on eno1, the node's address) and, when given,
/// the lab bridge vmbr9 (no ports, no address, IPv6 off); vmbr1, where the backup's net1 is,
/// is missing.
fn network_without_vmbr1(lab: bool) -> Value {
    let mut list = vec![
        json!({"iface": "vmbr0", "type": "bridge", "bridge_ports": "eno1",
        "method": "static", "address": "192.0.2.11", "cidr": "192.0.2.11/24", "active": 1}),
    ];
    if lab {
        list.push(
            json!({"iface": "vmbr9", "type": "bridge", "bridge_ports": "", "method": "manual",
            "method6": "manual", "active": 1,
            "options": ["post-up sysctl -w net.ipv6.conf.vmbr9.disable_ipv6=1"]}),
        );
    }
    Value::Array(list)
}

/// The demo scenario with the VM backup, the node's network of [`network_without_vmbr1`], and
/// the token's SDN.Use on vmbr9.
fn lab_scenario(lab: bool) -> Value {
    let mut s = scenario(qemu_backup_config(), booting_guest());
    s["node_network"] = network_without_vmbr1(lab);
    for who in ["felhom@pve!agent", "felhom@pve"] {
        s["grants"].as_array_mut().expect("grants").push(json!([
            who,
            "/sdn/zones/localnetwork/vmbr9",
            ["PVESDNUser"]
        ]));
    }
    s
}

/// A VM provision that keeps its network (`--network=stored`) onto a node without the bridge
/// of its net1: the start fails as qemu-server's does (the network script's `bridge 'vmbr1'
/// does not exist`, then `start failed: QEMU exited with code 1`), the provision fails naming
/// it, and the VM it made is destroyed.
#[test]
fn a_vm_start_onto_a_bridge_the_node_lacks_fails_as_qemu_server_does() {
    let w = world(lab_scenario(false), "");
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "320",
        "--network=stored",
        "--json",
    ]);
    let doc = run.json();
    assert_eq!(doc["outcome"], "failed", "{doc:#}\n{}", run.stderr);
    let error = doc["error"]["message"].as_str().unwrap_or_default();
    assert!(
        error.contains("start failed: QEMU exited with code 1") && error.contains("320"),
        "{doc:#}"
    );
    let start = w
        .pve
        .tasks()
        .into_iter()
        .find(|t| t["type"] == "qmstart")
        .unwrap_or_else(|| panic!("no start task: {:#?}", w.pve.tasks()));
    let text = start.to_string();
    assert!(
        text.contains("bridge 'vmbr1' does not exist")
            && text.contains("network script /usr/libexec/qemu-server/pve-bridge failed"),
        "{start:#}"
    );
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    assert!(wait_bed_gone(&w, 320));
}

/// `[restore_test] lab_bridge` names a bridge that is not in the node's network as PVE lists
/// it, or one that has a port: the copy stops at its preflight before any write and its guest
/// is left (`config_invalid`, exit 6: the node's set-up is wrong, not the backup), naming the
/// fix, so no copy ever starts with its original's MACs on a production bridge. A good lab
/// bridge whose lock another process holds (a VM copy on it) leaves the guest for a later run,
/// nothing written; free, the copy starts with its NICs on it only.
/// The restore test of [`QEMU_BACKUP`] with `lab_bridge = bridge` in a node whose network is
/// [`lab_scenario`]`(with_lab)`: no copy, its guest (300) left at the copy's preflight
/// (`config_invalid`, exit 6) with nothing written; why it was left.
fn lab_bridge_refused(with_lab: bool, bridge: &str) -> String {
    let extra =
        format!("[restore_test]\nsources = [\"{QEMU_BACKUP}\"]\nlab_bridge = \"{bridge}\"\n");
    let w = world(lab_scenario(with_lab), &extra);
    let run = w.agent(&["--selftest=restore", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["copies"], json!([]), "{doc:#}");
    let left = doc["left"].as_array().expect("left");
    assert_eq!(left.len(), 1, "{doc:#}");
    assert_eq!(left[0]["guest"], 300, "{doc:#}");
    assert_eq!(left[0]["backup"], QEMU_BACKUP, "{doc:#}");
    assert_eq!(left[0]["code"], "config_invalid", "{doc:#}");
    assert_eq!(doc["run"]["outcome"], "error", "{doc:#}");
    assert!(w.pve.writes().is_empty(), "{:#?}", w.pve.writes());
    left[0]["reason"].as_str().expect("reason").to_string()
}

/// Another process's hold on `w`'s lab bridge vmbr9 (its lock file, as an agent running a VM
/// copy there holds it): a `sleep` holding the locked descriptor; killing it frees the bridge.
fn hold_lab_bridge(w: &World) -> std::process::Child {
    let locks = w.files.state_dir.join("locks");
    std::fs::create_dir_all(&locks).expect("locks folder");
    let lock = locks.join("lab-bridge-vmbr9.lock");
    let holder = std::process::Command::new("sh")
        .arg("-c")
        .arg("exec 9>\"$1\" && flock -x 9 && exec sleep 60")
        .arg("sh")
        .arg(&lock)
        .stdin(Stdio::null())
        .spawn()
        .expect("the lock's holder");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::process::Command::new("flock")
        .args(["-n", "-x"])
        .arg(&lock)
        .arg("true")
        .status()
        .expect("flock -n")
        .success()
    {
        assert!(
            Instant::now() < deadline,
            "the test's holder never took the lock"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    holder
}

#[test]
fn a_lab_bridge_that_is_missing_or_has_a_port_refuses_the_vm_restore_test_before_any_write() {
    let text = lab_bridge_refused(false, "vmbr9");
    assert!(
        text.contains("vmbr9 is not in this node's network configuration")
            && text.contains("bridge-ports none"),
        "{text}"
    );

    // vmbr0 (a port, the node's address) named as the lab bridge.
    let text = lab_bridge_refused(true, "vmbr0");
    assert!(
        text.contains("has port(s) eno1") && text.contains("IPv4 address of the node"),
        "{text}"
    );

    // The lab bridge as it should be, but another process runs a VM copy on it (its lock
    // held): no copy, the guest left for a later run saying why, nothing written; VM copies
    // there run one at a time.
    let extra = format!("[restore_test]\nsources = [\"{QEMU_BACKUP}\"]\nlab_bridge = \"vmbr9\"\n");
    let w = world(lab_scenario(true), &extra);
    let mut holder = hold_lab_bridge(&w);
    let run = w.agent(&["--selftest=restore", "--json"]);
    let _ = holder.kill();
    let _ = holder.wait();
    let doc = run.json();
    assert_eq!(doc["copies"], json!([]), "{doc:#}\n{}", run.stderr);
    let left = doc["left"].as_array().expect("left");
    assert_eq!(left.len(), 1, "{doc:#}");
    assert_eq!(left[0]["guest"], 300, "{doc:#}");
    assert!(
        left[0]["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("the lab bridge vmbr9 is in use"),
        "{doc:#}"
    );
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert!(w.pve.writes().is_empty(), "{:#?}", w.pve.writes());

    // Free again: the guest is still due, and the next run's copy starts with its stored
    // NICs on the lab bridge only.
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert_eq!(doc["guest"], 300, "{doc:#}");
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    let starts = w.pve.start_configs();
    let (_, config) = starts.first().expect("one start request");
    assert_eq!(
        config.get("net0"),
        Some(&json!("virtio=BC:24:11:00:03:00,bridge=vmbr9")),
        "{config:?}"
    );
    assert_eq!(
        config.get("net1"),
        Some(&json!("virtio=BC:24:11:00:03:01,bridge=vmbr9")),
        "{config:?}"
    );
    assert!(
        w.pve.network_exposures().is_empty(),
        "{:?}",
        w.pve.network_exposures()
    );
}

/// An isolated VM copy left open (its process killed after the copy started) goes back onto
/// the lab bridge only as a new copy would: while another process runs a copy there, `journal
/// resume` refuses (exit 3, the bridge named) and sends PVE nothing; once the bridge is free it
/// resumes to its end.
#[test]
fn a_resumed_vm_copy_waits_for_the_lab_bridge_as_a_new_one_does() {
    let extra = format!("[restore_test]\nsources = [\"{QEMU_BACKUP}\"]\nlab_bridge = \"vmbr9\"\n");
    let w = world(lab_scenario(true), &extra);
    let mut cmd = w.command();
    // Killed once `started` is journaled (validated, submitted, marker written and verified,
    // created, started): the copy runs on the lab bridge.
    cmd.args(["--selftest=restore", "--json"])
        .env("FELHOM_AGENT_KILL_AT", "after-journal:6");
    let killed: AgentRun = cmd.output().expect("run agent").into();
    assert_ne!(killed.code, Some(0), "{}\n{}", killed.stdout, killed.stderr);
    let open = w
        .journal()
        .into_iter()
        .find(|t| t["interrupted"] == json!(true))
        .unwrap_or_else(|| panic!("no interrupted transaction: {:#?}", w.journal()));
    let txn = open["txn"].as_str().expect("txn").to_string();
    assert!(
        w.pve.start_configs().len() == 1,
        "the copy was started before the kill: {:#?}",
        w.pve.requests()
    );

    let mut holder = hold_lab_bridge(&w);
    let writes = w.pve.writes().len();
    let run = w.agent(&["journal", "resume", &txn, "--json"]);
    let _ = holder.kill();
    let _ = holder.wait();
    assert_eq!(run.code, Some(3), "{}\n{}", run.stdout, run.stderr);
    let message = run.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        message.contains(&format!("transaction {txn}"))
            && message.contains("was not resumed")
            && message.contains("the lab bridge vmbr9 is in use"),
        "{message}"
    );
    assert_eq!(w.pve.writes().len(), writes, "{:#?}", w.pve.writes());
    assert_eq!(w.journal_txn(&txn)["interrupted"], json!(true));

    let run = w.agent(&["journal", "resume", &txn, "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
}

/// Each copy of a restore run's document: (the guest it proves, its outcome), in run order.
fn copy_outcomes(doc: &Value) -> Vec<(u64, String)> {
    doc["copies"]
        .as_array()
        .expect("copies")
        .iter()
        .map(|c| {
            (
                c["guest"].as_u64().unwrap_or(0),
                c["outcome"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// The bridge of `net0` of every VM start the fake received, sorted.
fn start_bridges(w: &World) -> Vec<String> {
    let mut bridges: Vec<String> = w
        .pve
        .start_configs()
        .iter()
        .map(|(_, config)| {
            let net0 = config.get("net0").and_then(Value::as_str).unwrap_or("");
            net0.split(',')
                .find_map(|p| p.strip_prefix("bridge="))
                .unwrap_or("")
                .to_string()
        })
        .collect();
    bridges.sort();
    bridges
}

/// The restore test of two VMs' backups (guests 300 and 301) with `restore_toml`: its JSON,
/// after both copies ended ok; the bridge of each copy's first NIC at its start, by guest.
fn two_vm_copies(restore_toml: &str) -> (Value, Vec<String>) {
    let (w, run) = two_vm_backups_run("", booting_guest(), restore_toml);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    let outcomes = copy_outcomes(&doc);
    assert_eq!(outcomes.len(), 2, "{doc:#}");
    assert!(outcomes.iter().all(|(_, o)| o == "ok"), "{doc:#}");
    let bridges = start_bridges(&w);
    assert!(
        w.pve.network_exposures().is_empty(),
        "{:?}",
        w.pve.network_exposures()
    );
    (doc, bridges)
}

/// The restore test of two VMs' backups (300's, and 301's whose guest bed spec is `second`)
/// on a node with two lab bridges (vmbr9, vmbr10), restores of 6 s (scaled), at most 2 copies
/// at once, `top_toml` before `[restore_test]` and `restore_toml` in it: the world and the run.
fn two_vm_backups_run(top_toml: &str, second: Value, restore_toml: &str) -> (World, AgentRun) {
    two_vm_backups_run_with(top_toml, second, qemu_backup_config(), restore_toml)
}

/// [`two_vm_backups_run`] with 301's stored config `second_config`.
fn two_vm_backups_run_with(
    top_toml: &str,
    second: Value,
    second_config: Value,
    restore_toml: &str,
) -> (World, AgentRun) {
    const SECOND: &str = "local:backup/vzdump-qemu-301-2026_01_01-00_00_00.vma.zst";
    let mut s = lab_scenario(true);
    // vmbr10 beside vmbr9, made as the README says, with the token's SDN.Use on it.
    s["node_network"].as_array_mut().expect("network").push(
        json!({"iface": "vmbr10", "type": "bridge", "bridge_ports": "", "method": "manual",
            "method6": "manual", "active": 1,
            "options": ["post-up sysctl -w net.ipv6.conf.vmbr10.disable_ipv6=1"]}),
    );
    for who in ["felhom@pve!agent", "felhom@pve"] {
        s["grants"].as_array_mut().expect("grants").push(json!([
            who,
            "/sdn/zones/localnetwork/vmbr10",
            ["PVESDNUser"]
        ]));
    }
    // Guest 301, a pool VM as 300 is, and its backup.
    s["guests"]
        .as_array_mut()
        .expect("guests")
        .push(json!({"vmid": 301, "type": "qemu",
        "name": "felhom-vm2", "node": "pve1", "status": "stopped", "pool": "felhom",
        "config": {"agent": "1"}}));
    s["volumes"]["local"].as_array_mut().expect("volumes").push(
        json!({"volname": SECOND.strip_prefix("local:").expect("local"), "vmid": 301,
            "size": 734003200, "config": second_config, "guest": second}),
    );
    // A restore of 6 s (scaled): a copy is still under way when the next is admitted.
    s["attrs"]["qemu_restore_secs"] = json!(300);
    let extra = format!(
        "{top_toml}[restore_test]\nsources = [\"{QEMU_BACKUP}\", \"{SECOND}\"]\nat_once = 2\n{restore_toml}"
    );
    let w = world(s, &extra);
    let run: AgentRun = w
        .command()
        .env("FELHOM_AGENT_SUBMIT_SPACING_MS", "200")
        .args(["--selftest=restore", "--json"])
        .output()
        .expect("run agent")
        .into();
    (w, run)
}

/// `[restore_test] lab_bridges`: each VM copy gets a lab bridge of its own, one VM copy per
/// bridge at a time (copies on one bridge would reach each other), so two bridges run two VM
/// copies at once, each on its own bridge; with one bridge the same run has one VM copy at a
/// time, both on it.
#[test]
fn two_lab_bridges_run_two_vm_copies_at_once_each_on_its_own() {
    let (doc, bridges) = two_vm_copies("lab_bridges = [\"vmbr9\", \"vmbr10\"]\n");
    assert_eq!(bridges, vec!["vmbr10", "vmbr9"], "{doc:#}");
    assert_eq!(doc["run"]["peak_at_once"], json!(2), "{doc:#}");

    let (doc, bridges) = two_vm_copies("lab_bridge = \"vmbr9\"\n");
    assert_eq!(bridges, vec!["vmbr9", "vmbr9"], "{doc:#}");
    assert_eq!(doc["run"]["peak_at_once"], json!(1), "{doc:#}");
}

/// An application group of two VMs (`[[restore_test.group]]`) shares one lab bridge of the
/// group's own: both copies run at once on vmbr9 (one bridge, where copies alone run one at a
/// time), each its stored NICs there and nothing else, and both end ok. Two VMs with one stored
/// MAC (clones) are refused as a group before any write.
#[test]
fn a_group_of_two_vms_shares_one_lab_bridge_and_clones_are_refused() {
    let group =
        "lab_bridge = \"vmbr9\"\n\n[[restore_test.group]]\nname = \"pair\"\nguests = [300, 301]\n";
    let mut second = qemu_backup_config();
    second["net0"] = json!("virtio=BC:24:11:00:03:10,bridge=vmbr0");
    second["net1"] = json!("virtio=BC:24:11:00:03:11,bridge=vmbr1,tag=20");
    let (w, run) = two_vm_backups_run_with("", booting_guest(), second, group);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    let outcomes = copy_outcomes(&doc);
    assert_eq!(outcomes.len(), 2, "{doc:#}");
    assert!(outcomes.iter().all(|(_, o)| o == "ok"), "{doc:#}");
    assert_eq!(doc["run"]["peak_at_once"], json!(2), "{doc:#}");
    for c in doc["copies"].as_array().expect("copies") {
        assert_eq!(c["group"]["name"], "pair", "{c:#}");
        assert!(
            c["isolation"]
                .as_str()
                .is_some_and(|i| i.contains("shared with the group's VM copies")),
            "{c:#}"
        );
    }
    let bridges = start_bridges(&w);
    assert_eq!(bridges, vec!["vmbr9", "vmbr9"], "{doc:#}");
    assert!(w.pve.network_exposures().is_empty());

    // Clones: one stored MAC on both.
    let (w, run) = two_vm_backups_run("", booting_guest(), group);
    let doc = run.json();
    assert!(copy_outcomes(&doc).is_empty(), "{doc:#}");
    let left = doc["left"].as_array().expect("left");
    assert!(
        left.iter().all(|l| l["reason"]
            .as_str()
            .is_some_and(|r| r.contains("store the same MAC"))),
        "{doc:#}"
    );
    assert!(w.pve.start_configs().is_empty());
}

/// A copy that times out while another copy runs may have timed out for the other's load: it
/// is tried once more alone (nothing admitted beside it) before it counts. Guest 301's VM has
/// no guest agent, so its launch proof times out (5 s) every time: its first try, beside 300's
/// copy, counts for nothing; its second, alone, counts as failed (exit 5, `failed` in the
/// report). With one lab bridge the copies run one at a time: its one try counts at once.
#[test]
fn a_copy_that_timed_out_beside_others_is_tried_once_more_alone_before_it_counts() {
    let no_agent = json!({"agent": false, "start_secs": 10});
    let (w, run) = two_vm_backups_run(
        "launch_timeout_secs = 5\n",
        no_agent.clone(),
        "lab_bridges = [\"vmbr9\", \"vmbr10\"]\n",
    );
    let doc = run.json();
    let tries = copy_outcomes(&doc);
    assert_eq!(run.code, Some(5), "{doc:#}\n{}", run.stderr);
    assert_eq!(
        tries.iter().filter(|(g, _)| *g == 301).count(),
        2,
        "{tries:?}\n{doc:#}"
    );
    assert!(tries.contains(&(300, "ok".to_string())), "{tries:?}");
    // At the source: the last restore (301's second try) began only after both earlier copies
    // were destroyed.
    let tasks = w.pve.tasks();
    let restores: Vec<i64> = tasks
        .iter()
        .filter(|t| t["type"] == "qmrestore")
        .map(|t| t["starttime"].as_i64().expect("start"))
        .collect();
    assert_eq!(restores.len(), 3, "{tasks:#?}");
    let last_restore = restores.iter().max().copied().unwrap_or(0);
    let destroyed: Vec<i64> = tasks
        .iter()
        .filter(|t| t["type"] == "qmdestroy")
        .filter_map(|t| t["endtime"].as_i64())
        .collect();
    assert_eq!(destroyed.len(), 3, "{tasks:#?}");
    assert!(
        destroyed.iter().filter(|e| **e <= last_restore).count() >= 2,
        "the last try began before the other copies were gone: {tasks:#?}"
    );
    let report = w.agent(&["restore-report", "--json"]).json();
    let row = report["guests"]
        .as_array()
        .expect("guests")
        .iter()
        .find(|r| r["vmid"] == 301)
        .cloned()
        .unwrap_or_default();
    assert_eq!(row["status"], "failed", "{report:#}");

    // One lab bridge: one VM copy at a time, nothing beside it, so its one try counts.
    let (_, run) = two_vm_backups_run(
        "launch_timeout_secs = 5\n",
        no_agent,
        "lab_bridge = \"vmbr9\"\n",
    );
    let doc = run.json();
    let of_301 = doc["copies"]
        .as_array()
        .expect("copies")
        .iter()
        .filter(|c| c["guest"] == 301)
        .count();
    assert_eq!((run.code, of_301), (Some(5), 1), "{doc:#}");
}

/// Ctrl-C while a VM proves its launch (its guest agent not answering yet) is an interruption,
/// not a launch that timed out: exit 130 at once with its own code, the transaction left open
/// for a resume (not failed, no alert), nothing destroyed.
#[test]
fn ctrl_c_during_a_vms_launch_wait_is_an_interruption_not_a_timeout() {
    let w = world(
        scenario(
            qemu_backup_config(),
            json!({"agent": false, "start_secs": 10}),
        ),
        "launch_timeout_secs = 120\n",
    );
    let mut agent = w
        .command()
        .args(["--selftest=provision", "-vmid", "332", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the agent");
    // The event: the launch wait is under way (its guest agent pinged twice).
    let deadline = Instant::now() + Duration::from_secs(120);
    while agent_calls(&w, 332, "ping").len() < 2 {
        assert!(Instant::now() < deadline, "the launch wait never began");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = nix::unistd::Pid::from_raw(i32::try_from(agent.id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("SIGINT");
    let sent = Instant::now();
    let status = loop {
        if let Some(s) = agent.try_wait().expect("wait") {
            break s;
        }
        assert!(
            sent.elapsed() < Duration::from_secs(10),
            "the agent did not end within 10 s of Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = agent.wait_with_output().expect("output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(status.code(), Some(130), "{stdout}\n{stderr}");
    let doc: Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(
        (&doc["outcome"], &doc["halted"]["code"], &doc["error"]),
        (&json!("interrupted"), &json!("interrupted"), &Value::Null),
        "{doc:#}"
    );
    let why = doc["halted"]["message"].as_str().unwrap_or("");
    assert!(
        why.contains("VM 332") && !why.contains("did not prove its launch"),
        "{doc:#}"
    );
    let journal = w.journal();
    assert!(
        journal
            .iter()
            .any(|t| t["vmid"] == 332 && t["interrupted"] == true && t["outcome"].is_null()),
        "{journal:#?}"
    );
    assert!(guest_deletes(&w).is_empty(), "{:#?}", guest_deletes(&w));
}

/// A kept VM copy with its network isolated would stay on the lab bridge after its run, where
/// every later copy would reach it: refused before anything is written (`policy_denied`,
/// exit 3), naming the bridge and the two ways out. Without a lab bridge it starts with no NIC,
/// and is kept.
#[test]
fn keeping_an_isolated_vm_on_the_lab_bridge_is_refused() {
    let w = world(
        lab_scenario(true),
        "[restore_test]\nlab_bridge = \"vmbr9\"\n",
    );
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "334",
        "--keep",
        "--network=isolated",
        "--json",
    ]);
    let doc = run.json();
    assert_eq!(run.code, Some(3), "{doc:#}\n{}", run.stderr);
    let text = doc.to_string();
    assert!(
        text.contains("policy_denied")
            && text.contains("334")
            && text.contains("vmbr9")
            && text.contains("--network=stored"),
        "{doc:#}"
    );
    assert!(w.pve.writes().is_empty(), "{:#?}", w.pve.writes());
}
