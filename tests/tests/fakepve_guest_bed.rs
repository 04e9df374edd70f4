//! Tests of the test bed's PVE behaviour beyond fakepve 0.5.0 (tests/fakepve/scenario.py, over
//! real HTTPS with the scenario's pool token): QEMU and LXC restores with their backup's config,
//! a bed VM's guest agent running commands in its root filesystem with PVE's shapes, limits and
//! errors, privilege-separated tokens, and the `pct` stand-in refusing what PVE says is absent
//! or stopped.

use std::process::Command;
use std::time::{Duration, Instant};

use felhom_tests::fakepve::{
    add_qemu_backup, api_get as get, api_send as send, api_wait_task, demo_scenario,
    qemu_backup_config, FakePve, QEMU_BACKUP,
};
use felhom_tests::guestbed::{processes_with_marker, unique_marker, GuestBed};
use serde_json::{json, Value};

const LXC_BACKUP: &str = "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst";

async fn post(pve: &FakePve, path: &str, form: &[(&str, &str)]) -> (u16, Value) {
    send(pve, reqwest::Method::POST, path, form).await
}

/// A fake joined to `bed`, with the QEMU backup (stored `config`, guest spec `guest`).
fn bed_fake(bed: &GuestBed, time_scale: f64, config: Value, guest: Value) -> FakePve {
    let mut s = demo_scenario();
    s["time_scale"] = json!(time_scale);
    s["attrs"] = json!({"qemu_restore_secs": 30});
    add_qemu_backup(&mut s, config, guest);
    bed.join_scenario(&mut s);
    FakePve::start(s)
}

/// Restore the QEMU backup into `vmid` and wait for it; then start it when `start`.
async fn restore_vm(pve: &FakePve, vmid: u32, start: bool) {
    let id = vmid.to_string();
    let (status, body) = post(
        pve,
        "/nodes/pve1/qemu",
        &[
            ("vmid", &id),
            ("archive", QEMU_BACKUP),
            ("storage", "local-lvm"),
            ("pool", "felhom"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        api_wait_task(pve, body["data"].as_str().expect("UPID")).await,
        "OK"
    );
    if start {
        let (status, body) = post(pve, &format!("/nodes/pve1/qemu/{vmid}/status/start"), &[]).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            api_wait_task(pve, body["data"].as_str().expect("UPID")).await,
            "OK"
        );
    }
}

/// `agent/exec` of `argv` (with stdin `input`): (status, body).
async fn exec(pve: &FakePve, vmid: u32, argv: &[&str], input: Option<&str>) -> (u16, Value) {
    let mut form: Vec<(&str, &str)> = argv.iter().map(|a| ("command", *a)).collect();
    if let Some(input) = input {
        form.push(("input-data", input));
    }
    post(pve, &format!("/nodes/pve1/qemu/{vmid}/agent/exec"), &form).await
}

/// Poll `agent/exec-status` until the command exited; the final `data`.
async fn exec_result(pve: &FakePve, vmid: u32, pid: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, body) = get(
            pve,
            &format!("/nodes/pve1/qemu/{vmid}/agent/exec-status?pid={pid}"),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        if body["data"]["exited"] == json!(1) {
            return body["data"].clone();
        }
        assert_eq!(body["data"], json!({"exited": 0}), "while running");
        assert!(Instant::now() < deadline, "pid {pid} never exited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn run(pve: &FakePve, vmid: u32, argv: &[&str], input: Option<&str>) -> Value {
    let (status, body) = exec(pve, vmid, argv, input).await;
    assert_eq!(status, 200, "{body}");
    let pid = body["data"]["pid"].as_u64().expect("pid");
    exec_result(pve, vmid, pid).await
}

#[tokio::test]
async fn qemu_restore_is_locked_outside_the_pool_until_its_task_ends_then_has_the_backup_config() {
    let bed = GuestBed::new();
    let pve = bed_fake(&bed, 0.02, qemu_backup_config(), json!({}));
    let (status, body) = post(
        &pve,
        "/nodes/pve1/qemu",
        &[
            ("vmid", "340"),
            ("archive", QEMU_BACKUP),
            ("storage", "local-lvm"),
            ("pool", "felhom"),
            ("unique", "1"),
            ("net0", "virtio,link_down=1"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let upid = body["data"].as_str().expect("UPID").to_string();
    assert!(upid.contains(":qmrestore:340:"), "{upid}");
    // While the task runs: the VM exists (in the full list), locked, outside the pool, so the
    // pool token may not look at it.
    let during = pve.guest(340).expect("the VM exists during the restore");
    assert_eq!(during["lock"], "create");
    assert!(during["pool"].is_null(), "{during:#}");
    let vmlist = std::fs::read_to_string(pve.dir().join("vmlist")).expect("live .vmlist");
    assert!(
        vmlist.contains("\"340\": { \"node\": \"pve1\", \"type\": \"qemu\""),
        "{vmlist}"
    );
    let (status, _) = get(&pve, "/nodes/pve1/qemu/340/status/current").await;
    assert_eq!(status, 403, "outside the pool the token sees nothing");
    // A second restore onto it is refused at once.
    let (status, body) = post(
        &pve,
        "/nodes/pve1/qemu",
        &[
            ("vmid", "340"),
            ("archive", QEMU_BACKUP),
            ("storage", "local-lvm"),
            ("pool", "felhom"),
        ],
    )
    .await;
    assert_eq!(status, 500);
    assert_eq!(
        body["message"],
        "unable to restore VM 340 - VM 340 already exists on node 'pve1'\n"
    );

    assert_eq!(api_wait_task(&pve, &upid).await, "OK");
    let (status, body) = get(&pve, "/nodes/pve1/qemu/340/config").await;
    assert_eq!(status, 200, "{body}");
    let cfg = &body["data"];
    assert!(cfg.get("lock").is_none(), "{cfg:#}");
    assert_eq!(cfg["name"], "felhom-vm");
    assert_eq!(cfg["agent"], "1");
    assert_eq!(cfg["tags"], "customer;prod");
    assert_eq!(cfg["description"], "customer VM of the demo pool");
    let net0 = cfg["net0"].as_str().unwrap_or("");
    assert!(
        net0.starts_with("virtio=") && net0.contains("link_down=1") && !net0.contains("bridge"),
        "the request's net0 wins: {net0}"
    );
    let net1 = cfg["net1"].as_str().unwrap_or("");
    assert!(
        net1.contains("bridge=vmbr1") && !net1.contains("BC:24:11:00:03:01"),
        "the backup's net1 with a new MAC (unique=1): {net1}"
    );
    assert!(
        cfg["scsi0"]
            .as_str()
            .unwrap_or("")
            .starts_with("local-lvm:vm-340-disk-0"),
        "{cfg:#}"
    );
    assert_eq!(pve.guest(340).expect("340")["pool"], "felhom");
}

#[tokio::test]
async fn lxc_restore_carries_its_backup_config_and_unique_nics_win_with_new_macs() {
    let bed = GuestBed::new();
    let mut s = demo_scenario();
    s["volumes"]["local"][0]["config"] = json!({
        "hostname": "shop", "memory": "1024", "net0": "name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:02:00,ip=dhcp",
        "net1": "name=eth1,bridge=vmbr1,hwaddr=BC:24:11:00:02:01", "tags": "customer", "description": "the shop",
        "rootfs": "local-lvm:vm-200-disk-0,size=8G", "unprivileged": "1"
    });
    bed.join_scenario(&mut s);
    let pve = FakePve::start(s);
    let (status, body) = post(
        &pve,
        "/nodes/pve1/lxc",
        &[
            ("vmid", "240"),
            ("restore", "1"),
            ("ostemplate", LXC_BACKUP),
            ("storage", "local-lvm"),
            ("pool", "felhom"),
            ("unique", "1"),
            ("net0", "name=eth0,link_down=1"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        api_wait_task(&pve, body["data"].as_str().expect("UPID")).await,
        "OK"
    );
    let (_, body) = get(&pve, "/nodes/pve1/lxc/240/config").await;
    let cfg = &body["data"];
    assert_eq!(cfg["hostname"], "shop", "{cfg:#}");
    assert_eq!(
        cfg["memory"].to_string().trim_matches('"'),
        "1024",
        "the backup's memory, not fakepve's default: {cfg:#}"
    );
    assert_eq!(cfg["description"], "the shop");
    assert_eq!(cfg["tags"], "customer");
    // With unique=1 PVE writes the backup's NIC over the request's, with a new MAC
    // (pve-container Create.pm sanitize_and_merge_config).
    let net0 = cfg["net0"].as_str().unwrap_or("");
    assert!(
        net0.contains("bridge=vmbr0")
            && !net0.contains("link_down")
            && !net0.contains("BC:24:11:00:02:00"),
        "{net0}"
    );
    let net1 = cfg["net1"].as_str().unwrap_or("");
    assert!(
        net1.contains("bridge=vmbr1") && !net1.contains("BC:24:11:00:02:01"),
        "{net1}"
    );
    assert!(
        cfg["rootfs"].as_str().unwrap_or("").contains("vm-240-disk"),
        "a new disk: {cfg:#}"
    );
    // The bed has its root filesystem, hostname from the config.
    let hostname = std::fs::read_to_string(bed.guest_path(240, "/etc/hostname")).expect("rootfs");
    assert_eq!(hostname, "shop\n");
}

#[tokio::test]
async fn agent_exec_runs_in_the_vm_with_pves_result_shapes() {
    let bed = GuestBed::new();
    let pve = bed_fake(&bed, 0.0, qemu_backup_config(), json!({}));
    restore_vm(&pve, 350, true).await;
    let (status, body) = post(&pve, "/nodes/pve1/qemu/350/agent/ping", &[]).await;
    assert_eq!((status, &body["data"]), (200, &json!({"result": {}})));

    // Exit code, both streams, stdin from input-data; the final status is given once.
    let (status, body) = exec(
        &pve,
        350,
        &["sh", "-c", "echo out; echo err >&2; cat; hostname; exit 7"],
        Some("from stdin\n"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let pid = body["data"]["pid"].as_u64().expect("pid");
    let done = exec_result(&pve, 350, pid).await;
    assert_eq!(
        done,
        json!({"exited": 1, "exitcode": 7, "out-data": "out\nfrom stdin\nfelhom-vm\n", "err-data": "err\n"})
    );
    let (status, body) = get(
        &pve,
        &format!("/nodes/pve1/qemu/350/agent/exec-status?pid={pid}"),
    )
    .await;
    assert_eq!(status, 500);
    assert_eq!(body["message"], "Agent error: Invalid parameter 'pid'\n");

    // No output: no data keys. Stdin without input-data is /dev/null.
    assert_eq!(
        run(&pve, 350, &["cat"], None).await,
        json!({"exited": 1, "exitcode": 0})
    );
    // Killed by a signal: `signal`, no exit code.
    assert_eq!(
        run(&pve, 350, &["sh", "-c", "kill -9 $$"], None).await,
        json!({"exited": 1, "signal": 9})
    );
    // Non-ASCII output arrives as PVE's encoder writes it: one character per byte.
    let done = run(&pve, 350, &["printf", "\\303\\274"], None).await;
    assert_eq!(done["out-data"], "\u{c3}\u{bc}");
    // A program that is not there: no pid, PVE's words.
    let (status, body) = exec(&pve, 350, &["no-such-program"], None).await;
    assert_eq!(status, 500);
    assert_eq!(
        body["message"],
        "Agent error: Guest agent command failed, error was 'Failed to execute child process \"no-such-program\" (No such file or directory)'\n"
    );
    // The schema's limits: input-data at most 65536 characters.
    let big = "x".repeat(65537);
    let (status, body) = exec(&pve, 350, &["cat"], Some(&big)).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["errors"]["input-data"].is_string(), "{body}");
    // Sent over the limit on purpose: the schema check saw it too.
    let seen = pve.take_schema_violations();
    assert!(
        seen.len() == 1 && seen[0].contains("input-data: value may only be 65536 characters long"),
        "{seen:#?}"
    );
    let ok = "x".repeat(65536);
    let done = run(&pve, 350, &["wc", "-c"], Some(&ok)).await;
    assert_eq!(done["out-data"].as_str().map(str::trim), Some("65536"));
    // 16 MiB kept per stream, the rest flagged.
    let done = run(
        &pve,
        350,
        &["sh", "-c", "head -c 16777316 /dev/zero | tr '\\000' y"],
        None,
    )
    .await;
    assert_eq!(done["out-truncated"], json!(1), "{}", done["exitcode"]);
    assert_eq!(
        done["out-data"].as_str().map(str::len),
        Some(16 * 1024 * 1024)
    );
    assert!(done.get("err-truncated").is_none());

    // Files: written through the agent, read back through it and from the bed.
    let (status, body) = post(
        &pve,
        "/nodes/pve1/qemu/350/agent/file-write",
        &[
            ("file", "/root/note"),
            ("content", "written by file-write\n"),
        ],
    )
    .await;
    assert_eq!((status, &body["data"]), (200, &Value::Null), "{body}");
    assert_eq!(
        std::fs::read_to_string(bed.guest_path(350, "/root/note")).expect("in the rootfs"),
        "written by file-write\n"
    );
    let (status, body) = get(&pve, "/nodes/pve1/qemu/350/agent/file-read?file=/root/note").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["data"],
        json!({"content": "written by file-write\n", "bytes-read": 22})
    );
    let (status, body) = get(&pve, "/nodes/pve1/qemu/350/agent/file-read?file=/nope/x").await;
    assert_eq!(status, 500);
    assert_eq!(
        body["message"],
        "Agent error: failed to open file '/nope/x' (mode: 'r'): No such file or directory\n"
    );
    let (status, body) = post(
        &pve,
        "/nodes/pve1/qemu/350/agent/file-write",
        &[("file", "/root/big"), ("content", &"y".repeat(61441))],
    )
    .await;
    assert_eq!(status, 400, "content at most 61440 characters: {body}");
    let seen = pve.take_schema_violations();
    assert!(
        seen.len() == 1 && seen[0].contains("content: value may only be 61440 characters long"),
        "{seen:#?}"
    );
}

/// A bed VM `vmid` restored and started, with a background process started by one exec (it
/// outlives the exec) whose command line holds the returned marker, seen on the host.
async fn vm_with_a_background_process(pve: &FakePve, vmid: u32, prefix: &str) -> String {
    restore_vm(pve, vmid, true).await;
    let marker = unique_marker(prefix);
    let done = run(
        pve,
        vmid,
        &[
            "sh",
            "-c",
            &format!("sh -c 'sleep 300; true {marker}' </dev/null >/dev/null 2>&1 &"),
        ],
        None,
    )
    .await;
    assert_eq!(done["exitcode"], json!(0), "{done}");
    assert!(!processes_with_marker(&marker).is_empty());
    marker
}

#[tokio::test]
async fn a_bed_vm_is_one_guest_its_processes_outlive_an_exec_and_die_with_the_vm() {
    let bed = GuestBed::new();
    let pve = bed_fake(&bed, 0.0, qemu_backup_config(), json!({}));
    // A background process started by one exec is seen by the next one (one PID namespace).
    let marker = vm_with_a_background_process(&pve, 360, "vm-proc").await;
    let ps = run(&pve, 360, &["ps"], None).await;
    assert!(
        ps["out-data"].as_str().unwrap_or("").contains(&marker),
        "{ps}"
    );
    // Powering the VM off ends everything inside it.
    let (status, body) = post(&pve, "/nodes/pve1/qemu/360/status/stop", &[]).await;
    assert_eq!(status, 200, "{body}");
    api_wait_task(&pve, body["data"].as_str().expect("UPID")).await;
    let left = felhom_tests::guestbed::wait_processes_gone(&marker, Duration::from_secs(5));
    assert!(left.is_empty(), "{left:?}");
    let (status, body) = exec(&pve, 360, &["true"], None).await;
    assert_eq!(status, 500);
    assert_eq!(body["message"], "VM 360 is not running\n");
}

/// A fake that ends without its own cleanup (SIGKILL: a test process killed, a shutdown past
/// its grace) takes its bed VMs with it: no guest init is left to spin in a root the test then
/// deletes (one such init, left by a killed fake, kept a core busy for the rest of a run).
#[tokio::test]
async fn a_bed_vm_dies_with_a_fake_killed_without_its_cleanup() {
    let bed = GuestBed::new();
    let pve = bed_fake(&bed, 0.0, qemu_backup_config(), json!({}));
    let marker = vm_with_a_background_process(&pve, 361, "vm-orphan").await;
    let fake = nix::unistd::Pid::from_raw(i32::try_from(pve.pid()).expect("pid"));
    nix::sys::signal::kill(fake, nix::sys::signal::Signal::SIGKILL).expect("kill the fake");
    let left = felhom_tests::guestbed::wait_processes_gone(&marker, Duration::from_secs(10));
    assert!(left.is_empty(), "the bed VM outlived its fake: {left:?}");
}

#[tokio::test]
async fn agent_preconditions_answer_in_pves_order_and_words() {
    // No `agent: 1` in the config.
    let bed = GuestBed::new();
    let mut config = qemu_backup_config();
    config.as_object_mut().expect("config").remove("agent");
    let pve = bed_fake(&bed, 0.0, config, json!({}));
    restore_vm(&pve, 370, false).await;
    let (status, body) = exec(&pve, 370, &["true"], None).await;
    assert_eq!(status, 500);
    assert_eq!(body["message"], "No QEMU guest agent configured\n");
    drop(pve);

    // Configured, VM stopped; then running but no agent inside; then booting.
    let bed = GuestBed::new();
    let pve = bed_fake(&bed, 0.01, qemu_backup_config(), json!({"agent": false}));
    restore_vm(&pve, 371, false).await;
    let (status, body) = exec(&pve, 371, &["true"], None).await;
    assert_eq!(status, 500);
    assert_eq!(body["message"], "VM 371 is not running\n");
    let (status, body) = post(&pve, "/nodes/pve1/qemu/371/status/start", &[]).await;
    assert_eq!(status, 200, "{body}");
    api_wait_task(&pve, body["data"].as_str().expect("UPID")).await;
    let (status, body) = exec(&pve, 371, &["true"], None).await;
    assert_eq!(status, 500);
    assert_eq!(body["message"], "QEMU guest agent is not running\n");
    assert!(
        pve.requests()
            .iter()
            .all(|r| !r.api_path().ends_with("/agent/exec-status")),
        "nothing to ask about"
    );
    drop(pve);

    let bed = GuestBed::new();
    let pve = bed_fake(&bed, 0.01, qemu_backup_config(), json!({"boot_secs": 150}));
    restore_vm(&pve, 372, true).await;
    let (status, body) = post(&pve, "/nodes/pve1/qemu/372/agent/ping", &[]).await;
    assert_eq!(status, 500, "still booting: {body}");
    assert_eq!(body["message"], "QEMU guest agent is not running\n");
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let (status, body) = post(&pve, "/nodes/pve1/qemu/372/agent/ping", &[]).await;
    assert_eq!(status, 200, "booted: {body}");
}

#[tokio::test]
async fn a_privilege_separated_token_holds_only_what_its_user_holds_too() {
    let mut s = demo_scenario();
    // Only the token is granted anything.
    s["grants"] = json!([
        [
            "felhom@pve!agent",
            "/pool/felhom",
            ["PVEVMAdmin", "Pool.Audit"]
        ],
        ["felhom@pve!agent", "/storage/local", ["PVEDatastoreUser"]],
        ["felhom@pve", "/storage/local", ["PVEDatastoreUser"]]
    ]);
    let pve = FakePve::start(s.clone());
    let (status, body) = get(&pve, "/nodes/pve1/lxc/200/status/current").await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(
        body["message"],
        "Permission check failed (/vms/200, VM.Audit)\n"
    );
    let (status, body) = get(&pve, "/access/permissions").await;
    assert_eq!(status, 200, "{body}");
    assert!(body["data"].get("/pool/felhom").is_none(), "{body}");
    assert_eq!(body["data"]["/storage/local"]["Datastore.Audit"], json!(1));
    drop(pve);

    // Without privilege separation the token holds exactly its user's privileges.
    s["token_privsep"] = json!({"felhom@pve!agent": 0});
    s["grants"] = json!([["felhom@pve", "/pool/felhom", ["PVEVMAdmin", "Pool.Audit"]]]);
    let pve = FakePve::start(s);
    let (status, body) = get(&pve, "/nodes/pve1/lxc/200/status/current").await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn pct_refuses_what_pve_says_is_stopped_absent_or_a_vm() {
    let bed = GuestBed::new();
    let pve = bed_fake(&bed, 0.0, qemu_backup_config(), json!({}));
    let pct = |args: &[&str]| {
        let out = Command::new(bed.pct())
            .args(args)
            .output()
            .expect("run pct");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    // A container PVE does not have (200 is in the fake, but has no root filesystem here; 555
    // is nowhere).
    let (code, _, err) = pct(&["exec", "555", "--", "true"]);
    assert_ne!(code, Some(0));
    assert!(
        err.contains("Configuration file 'nodes/") && err.contains("/lxc/555.conf' does not exist"),
        "{err}"
    );
    // Restored: stopped until PVE starts it.
    let (status, body) = post(
        &pve,
        "/nodes/pve1/lxc",
        &[
            ("vmid", "250"),
            ("restore", "1"),
            ("ostemplate", LXC_BACKUP),
            ("storage", "local-lvm"),
            ("pool", "felhom"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    api_wait_task(&pve, body["data"].as_str().expect("UPID")).await;
    let (code, _, err) = pct(&["exec", "250", "--", "true"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("container '250' not running!"), "{err}");
    let (status, body) = post(&pve, "/nodes/pve1/lxc/250/status/start", &[]).await;
    assert_eq!(status, 200, "{body}");
    api_wait_task(&pve, body["data"].as_str().expect("UPID")).await;
    let (code, out, err) = pct(&["exec", "250", "--", "hostname"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out, "CT250\n");
    // Stopped by PVE: refused again.
    let (status, body) = post(&pve, "/nodes/pve1/lxc/250/status/stop", &[]).await;
    assert_eq!(status, 200, "{body}");
    api_wait_task(&pve, body["data"].as_str().expect("UPID")).await;
    let (code, _, err) = pct(&["exec", "250", "--", "true"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("container '250' not running!"), "{err}");
    // Destroyed by PVE: gone.
    let (status, body) = send(
        &pve,
        reqwest::Method::DELETE,
        "/nodes/pve1/lxc/250?purge=0&destroy-unreferenced-disks=0",
        &[],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    api_wait_task(&pve, body["data"].as_str().expect("UPID")).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while bed.state_dir().join("250").exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (code, _, err) = pct(&["exec", "250", "--", "true"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("/lxc/250.conf' does not exist"), "{err}");
    // A VM is no container, even with a root filesystem in the bed.
    restore_vm(&pve, 380, true).await;
    let (code, _, err) = pct(&["exec", "380", "--", "true"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("/lxc/380.conf' does not exist"), "{err}");
}
