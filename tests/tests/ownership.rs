//! Ownership that a backup, a clone or a hand edit cannot reproduce: the agent destroys a guest
//! only when it carries the marker *and* the birth identity (MACs, vmgenid, smbios1 uuid) PVE
//! gave it at this agent's restore. Guests are removed and copied behind the agent's back
//! (root, outside the API the agent uses); every DELETE is counted at fakepve.

use std::time::{Duration, Instant};

use felhom_tests::agent::AgentRun;
use felhom_tests::fakepve::{
    add_qemu_backup, demo_scenario, qemu_backup_config, AgentOptions, RecordedRequest, QEMU_BACKUP,
};
use felhom_tests::world::World;
use serde_json::{json, Value};

/// DELETEs of guests (not of tasks) PVE received.
fn guest_deletes(w: &World) -> Vec<RecordedRequest> {
    w.pve
        .requests()
        .into_iter()
        .filter(|r| r.method == "DELETE" && !r.path.contains("/tasks/"))
        .collect()
}

fn config_of(w: &World, vmid: u32) -> Value {
    w.pve
        .guest(vmid)
        .unwrap_or_else(|| panic!("guest {vmid} missing"))["config"]
        .clone()
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

/// A kept provision of `vmid`; returns its transaction id.
fn keep(w: &World, vmid: u32) -> String {
    let vmid = vmid.to_string();
    let run = w.agent(&["--selftest=provision", "-vmid", &vmid, "--keep", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["destroy_armed"], json!(true), "{doc:#}");
    text(&doc["txn"])
}

/// Root puts a container into the pool (`pct create`/`restore` outside the agent); the live
/// `.vmlist` is rewritten before this returns, as pmxcfs does.
fn add_ct(w: &World, args: Value, kwargs: Value) {
    w.pve.call("add_ct", args, kwargs);
    w.pve.call("write_vmlist", json!([]), json!({}));
}

fn destroy(w: &World, vmid: u32) -> AgentRun {
    w.agent(&["destroy", "-vmid", &vmid.to_string(), "--json"])
}

/// Wait until guest `vmid` exists and is unlocked (a restore task done).
fn wait_restored(w: &World, vmid: u32) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(g) = w.pve.guest(vmid) {
            if g["lock"].is_null() && g["config"].get("lock").is_none_or(Value::is_null) {
                return g;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the restore of {vmid} never ended"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_restore_request_carries_the_description_line_and_never_tags() {
    let w = World::demo();
    let txn = keep(&w, 149);
    let restores: Vec<RecordedRequest> = w
        .pve
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/lxc")
        .collect();
    assert_eq!(restores.len(), 1, "{restores:?}");
    let description = restores[0].param("description").unwrap_or_default();
    assert!(
        description.contains(&txn),
        "the restore request names the transaction in its description: {:?}",
        restores[0]
    );
    assert!(restores[0].param("tags").is_none(), "{:?}", restores[0]);
    // The tags follow with the marker write; the MAC is the one PVE generated (unique=1), not
    // the backup's.
    let cfg = config_of(&w, 149);
    assert!(text(&cfg["tags"]).contains("felhom"), "{cfg}");
    assert!(
        !text(&cfg["net0"]).contains("BC:24:11:00:02:00"),
        "unique=1 gives a new MAC: {cfg}"
    );
}

#[test]
fn a_copy_with_the_marker_at_the_vmid_of_a_kept_container_is_never_destroyed() {
    let w = World::demo();
    let origin = keep(&w, 150);
    let cfg = config_of(&w, 150);

    // Root removes the kept guest and puts another one at 150 into the pool, with the same
    // tags and description (a hand edit, or a clone: a new MAC).
    w.pve.call("remove_guest", json!([150]), json!({}));
    add_ct(
        &w,
        json!([150, "copy"]),
        json!({"pool": "felhom", "status": "running", "config": {
            "hostname": "copy",
            "tags": cfg["tags"],
            "description": cfg["description"],
            "net0": "name=eth0,bridge=vmbr0,hwaddr=BC:24:11:0C:0F:0E,ip=dhcp,type=veth",
        }}),
    );
    let before = w.pve.requests().len();

    let run = destroy(&w, 150);
    let doc = run.json();
    assert_eq!(run.code, Some(7), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["error"]["code"], "ownership_unproven", "{doc:#}");
    let msg = text(&doc["error"]["message"]);
    assert!(msg.contains("150") && msg.contains("copy"), "{msg}");
    assert!(guest_deletes(&w).is_empty(), "{:?}", guest_deletes(&w));
    let sent: Vec<RecordedRequest> = w.pve.requests()[before..]
        .iter()
        .filter(|r| r.is_write())
        .cloned()
        .collect();
    assert!(sent.is_empty(), "the refused destroy wrote: {sent:?}");
    assert!(w.pve.guest(150).is_some(), "the copy is still there");

    // The journal shows the refusal and the withdrawn claim.
    let txns = w.journal();
    let refusal = txns
        .iter()
        .find(|t| t["txn"] == doc["txn"])
        .expect("the destroy is journaled");
    assert_eq!(refusal["outcome"], "needs_human", "{refusal:#}");
    let o = w.journal_txn(&origin);
    assert_eq!(o["destroy_armed"], json!(false), "{o:#}");
    assert!(text(&o["disarmed"]).contains("copy"), "{o:#}");

    // A later destroy is refused from the journal: still no DELETE.
    let again = destroy(&w, 150);
    assert_eq!(again.code, Some(7), "{}\n{}", again.stdout, again.stderr);
    assert!(guest_deletes(&w).is_empty());
}

#[test]
fn a_kept_guest_removed_behind_the_agents_back_is_disarmed_and_never_destroyed_later() {
    let w = World::demo();
    let origin = keep(&w, 151);
    let cfg = config_of(&w, 151);
    w.pve.call("remove_guest", json!([151]), json!({}));

    let run = destroy(&w, 151);
    let doc = run.json();
    assert_eq!(run.code, Some(7), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "refused", "{doc:#}");
    assert!(text(&doc["error"]["message"]).contains("gone"), "{doc:#}");
    assert!(guest_deletes(&w).is_empty());
    let o = w.journal_txn(&origin);
    assert_eq!(o["destroy_armed"], json!(false), "{o:#}");
    assert!(text(&o["disarmed"]).contains("gone"), "{o:#}");

    // Even the very same config (tags, description and MAC) restored there later is refused:
    // the claim is withdrawn.
    add_ct(
        &w,
        json!([151, "back"]),
        json!({"pool": "felhom", "config": {
            "hostname": "back", "tags": cfg["tags"], "description": cfg["description"],
            "net0": cfg["net0"],
        }}),
    );
    let run = destroy(&w, 151);
    assert_eq!(run.code, Some(7), "{}\n{}", run.stdout, run.stderr);
    assert!(guest_deletes(&w).is_empty(), "{:?}", guest_deletes(&w));
    assert!(w.pve.guest(151).is_some());
}

#[test]
fn a_later_free_verdict_voids_the_claim_even_for_a_restore_with_the_same_macs() {
    let w = World::demo();
    keep(&w, 152);
    let backup = w.pve.call(
        "backup_guest",
        json!([152, "backup/vzdump-lxc-152-2026_02_01-00_00_00.tar.zst"]),
        json!({}),
    );
    let volid = text(&backup);
    w.pve.call("remove_guest", json!([152]), json!({}));

    // A later provision finds 152 free; PVE refuses its restore (nothing is created).
    w.pve.fail(
        "POST",
        "/nodes/pve1/lxc",
        500,
        "storage 'local-lvm' is full",
        Some(1),
    );
    // A 500 could come after PVE made the task: the agent searches the task list for its own
    // for the settle window (30 s in a release build), here shortened to what the fake needs.
    let run: felhom_tests::agent::AgentRun = w
        .command()
        .args(["--selftest=provision", "-vmid", "152", "--json"])
        .env("FELHOM_AGENT_SUBMIT_SETTLE_MS", "3000")
        .output()
        .expect("the agent runs")
        .into();
    assert_ne!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(w.pve.guest(152).is_none());

    // Root restores the old backup without unique: the same MACs, tags and description.
    w.pve.call(
        "_lxc_create",
        json!(["root@pam", {"node": "pve1", "vmid": 152, "ostemplate": volid, "restore": 1,
                            "storage": "local-lvm", "pool": "felhom"}]),
        json!({}),
    );
    let g = wait_restored(&w, 152);
    assert!(text(&g["config"]["tags"]).contains("felhom"), "{g:#}");

    let run = destroy(&w, 152);
    let doc = run.json();
    assert_eq!(run.code, Some(7), "{doc:#}\n{}", run.stderr);
    assert!(
        text(&doc["error"]["message"]).contains("found vmid 152 free"),
        "{doc:#}"
    );
    assert!(guest_deletes(&w).is_empty(), "{:?}", guest_deletes(&w));
}

#[test]
fn a_qemu_guest_restored_from_a_backup_of_the_kept_vm_is_never_destroyed() {
    let mut scenario = demo_scenario();
    scenario["time_scale"] = json!(0.02);
    scenario["attrs"] = json!({"qemu_restore_secs": 30});
    let mut config = qemu_backup_config();
    config["vmgenid"] = json!("3f0e3a9c-1d7e-4c55-9a4e-0123456789ab");
    config["smbios1"] = json!("uuid=6a1c2f00-5b1e-4f7a-8d39-000000000300");
    add_qemu_backup(
        &mut scenario,
        config,
        json!({"agent": true, "boot_secs": 5, "start_secs": 2, "stop_secs": 2}),
    );
    let opts = AgentOptions {
        selftest_source: Some(QEMU_BACKUP.to_string()),
        ..AgentOptions::default()
    };
    let w = World::with_options(scenario, &opts);
    let origin = keep(&w, 320);
    let born = config_of(&w, 320);
    assert_ne!(
        born["vmgenid"], "3f0e3a9c-1d7e-4c55-9a4e-0123456789ab",
        "the restore gave a new vmgenid: {born:#}"
    );

    // Root backs the VM up, removes it, and restores the backup into 320 again.
    let volid = text(&w.pve.call(
        "backup_guest",
        json!([320, "backup/vzdump-qemu-320-2026_02_01-00_00_00.vma.zst"]),
        json!({}),
    ));
    w.pve.call("remove_guest", json!([320]), json!({}));
    w.pve.call(
        "_qm_create",
        json!([{"node": "pve1", "vmid": 320, "archive": volid, "storage": "local-lvm",
                "pool": "felhom", "unique": 1}, "root@pam"]),
        json!({}),
    );
    let copy = wait_restored(&w, 320)["config"].clone();
    assert_eq!(
        copy["tags"], born["tags"],
        "the copy carries the marker tags"
    );
    assert_eq!(copy["description"], born["description"]);
    assert_ne!(copy["vmgenid"], born["vmgenid"], "{copy:#}");

    let run = destroy(&w, 320);
    let doc = run.json();
    assert_eq!(run.code, Some(7), "{doc:#}\n{}", run.stderr);
    let msg = text(&doc["error"]["message"]);
    assert!(msg.contains("vmgenid"), "{msg}");
    assert!(guest_deletes(&w).is_empty(), "{:?}", guest_deletes(&w));
    assert!(w.pve.guest(320).is_some());
    assert_eq!(w.journal_txn(&origin)["destroy_armed"], json!(false));
}

fn run_killed(w: &World, args: &[&str], kill_at: &str) -> AgentRun {
    let mut cmd = w.command();
    cmd.args(args).env("FELHOM_AGENT_KILL_AT", kill_at);
    cmd.output().expect("run agent").into()
}

/// Any writing command takes up what a crash left (resumes it, or settles it through the gate):
/// a kept provision of another vmid.
fn settle(w: &World, other: u32) {
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        &other.to_string(),
        "--keep",
        "--json",
    ]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
}

#[test]
fn a_crash_between_the_restore_and_the_marker_write_resumes_through_the_description_line() {
    // Journal records of a provision: 1 validated, 2 submitted (UPID), 3 task OK (the marker
    // write comes next). Killed before record 3: the task's end was never journaled; after
    // it: the marker write was never sent. Either way the guest holds the description line
    // only this transaction's restore request wrote: the next writing command resumes the
    // provision (marker written and read back, birth identity recorded, then start, bootstrap,
    // checks) and it ends `ok`, its guest destroyed through the gate. (Before resuming
    // existed, it was settled `failed` and destroyed.)
    for kill_at in ["after-journal:3", "before-journal:3"] {
        let w = World::demo();
        let first = run_killed(
            &w,
            &["--selftest=provision", "-vmid", "140", "--json"],
            kill_at,
        );
        assert_eq!(first.code, None, "{kill_at}: not killed: {}", first.stdout);
        // The guest holds the description line of the restore request, but no marker tags.
        let cfg = wait_restored(&w, 140)["config"].clone();
        assert!(
            text(&cfg["description"]).contains("felhom-agent transaction"),
            "{kill_at}: {cfg:#}"
        );
        assert!(!text(&cfg["tags"]).contains("felhom"), "{kill_at}: {cfg:#}");

        settle(&w, 141);
        let t = w
            .journal()
            .into_iter()
            .find(|t| t["vmid"] == 140)
            .expect("the crashed transaction");
        assert_eq!(t["outcome"], "ok", "{kill_at}: {t:#}");
        assert_eq!(t["error"], Value::Null, "{kill_at}: {t:#}");
        assert_eq!(t["destroyed"], json!(true), "{kill_at}: {t:#}");
        assert_eq!(w.pve.deletes_for(140).len(), 1, "{kill_at}");
        assert!(w.pve.guest(140).is_none(), "{kill_at}");
    }
}

#[test]
fn the_settle_of_an_armed_transaction_whose_guest_was_swapped_destroys_nothing() {
    let w = World::demo();
    // Record 5 is the armed state before the start (created, marker read back).
    let first = run_killed(
        &w,
        &["--selftest=provision", "-vmid", "142", "--json"],
        "after-journal:5",
    );
    assert_eq!(first.code, None, "not killed: {}", first.stdout);
    let open = w
        .journal()
        .into_iter()
        .find(|t| t["vmid"] == 142)
        .expect("open transaction");
    assert_eq!(open["destroy_armed"], json!(true), "{open:#}");
    let cfg = config_of(&w, 142);

    w.pve.call("remove_guest", json!([142]), json!({}));
    add_ct(
        &w,
        json!([142, "copy"]),
        json!({"pool": "felhom", "config": {
            "hostname": "copy", "tags": cfg["tags"], "description": cfg["description"],
            "net0": "name=eth0,bridge=vmbr0,hwaddr=BC:24:11:0C:0F:0F,ip=dhcp,type=veth",
        }}),
    );
    let before = w.pve.requests().len();
    settle(&w, 143);

    let t = w.journal_txn(&text(&open["txn"]));
    assert_eq!(t["outcome"], "needs_human", "{t:#}");
    assert_eq!(t["destroy_armed"], json!(false), "{t:#}");
    assert!(text(&t["disarmed"]).contains("copy"), "{t:#}");
    assert!(w.pve.deletes_for(142).is_empty());
    let sent: Vec<RecordedRequest> = w.pve.requests()[before..]
        .iter()
        .filter(|r| r.is_write() && r.targets_vmid(142))
        .cloned()
        .collect();
    assert!(sent.is_empty(), "the settle wrote to the copy: {sent:?}");
    assert!(w.pve.guest(142).is_some());
}

#[test]
fn a_passing_pve_error_at_the_recheck_keeps_the_claim_and_the_next_command_finishes_it() {
    let w = World::demo();
    let origin = keep(&w, 153);
    // Every attempt of the config read (the client retries reads 4 times) answers 503.
    w.pve.fail(
        "GET",
        "/nodes/pve1/lxc/153/config",
        503,
        "Service Unavailable",
        Some(4),
    );
    let run = destroy(&w, 153);
    assert_ne!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(guest_deletes(&w).is_empty(), "{:?}", guest_deletes(&w));
    let o = w.journal_txn(&origin);
    assert_eq!(o["destroy_armed"], json!(true), "{o:#}");
    assert!(o["disarmed"].is_null(), "{o:#}");
    let open: Vec<Value> = w
        .journal()
        .into_iter()
        .filter(|t| t["vmid"] == 153 && t["outcome"].is_null())
        .collect();
    assert_eq!(open.len(), 1, "the destroy stays open: {open:#?}");

    // The next writing command settles it: re-check, then the gated destroy.
    settle(&w, 154);
    assert_eq!(w.pve.deletes_for(153).len(), 1);
    assert!(w.pve.guest(153).is_none());
    let d = w.journal_txn(&text(&open[0]["txn"]));
    assert_eq!(d["destroyed"], json!(true), "{d:#}");
}

#[test]
fn a_qemu_server_that_refuses_the_description_with_archive_gets_it_from_the_marker_write() {
    let mut scenario = demo_scenario();
    scenario["time_scale"] = json!(0.02);
    scenario["attrs"] = json!({"qemu_restore_secs": 30});
    add_qemu_backup(
        &mut scenario,
        qemu_backup_config(),
        json!({"agent": true, "boot_secs": 5, "start_secs": 2, "stop_secs": 2}),
    );
    let opts = AgentOptions {
        selftest_source: Some(QEMU_BACKUP.to_string()),
        ..AgentOptions::default()
    };
    let w = World::with_options(scenario, &opts);
    // qemu-server before 7.2 takes no other options with `archive` (a synchronous 400).
    w.pve.fail(
        "POST",
        "/nodes/pve1/qemu",
        400,
        "archive: option conflicts with other options (description)",
        Some(1),
    );
    let txn = keep(&w, 321);
    let posts: Vec<RecordedRequest> = w
        .pve
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/qemu")
        .collect();
    assert_eq!(posts.len(), 2, "one retry: {posts:?}");
    assert!(posts[0].param("description").is_some(), "{:?}", posts[0]);
    assert!(posts[1].param("description").is_none(), "{:?}", posts[1]);
    let cfg = config_of(&w, 321);
    assert!(text(&cfg["description"]).contains(&txn), "{cfg:#}");
    assert!(text(&cfg["tags"]).contains("felhom"), "{cfg:#}");
    // And it is destroyed through the gate.
    let run = destroy(&w, 321);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(w.pve.deletes_for(321).len(), 1);
}

/// The wrapper models PVE's tag check at create/restore (pve-api-facts.md §2.4): `tags` need
/// VM.Config.Options on /vms/<vmid> itself, which the pool token does not hold; root passes.
#[test]
fn fakepve_refuses_tags_in_a_restore_request_from_the_pool_token() {
    let pve = felhom_tests::fakepve::FakePve::demo();
    let volid = "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst";
    let request = |tags: bool| {
        let mut v = json!({"node": "pve1", "vmid": 160, "ostemplate": volid, "restore": 1,
                           "storage": "local-lvm", "pool": "felhom", "unique": 1});
        if tags {
            v["tags"] = json!("felhom");
        }
        v
    };
    let token = pve.token_id();
    let err = pve
        .try_call("_lxc_create", json!([token, request(true)]), json!({}))
        .expect_err("tags from the pool token are refused");
    let err = err.to_string();
    assert!(
        err.contains("Permission check failed (/vms/160, VM.Config.Options)"),
        "{err}"
    );
    assert!(pve.guest(160).is_none(), "nothing was created");
    // Without tags the same token restores; with tags, root does.
    pve.call("_lxc_create", json!([token, request(false)]), json!({}));
    pve.call(
        "_lxc_create",
        json!(["root@pam", {"node": "pve1", "vmid": 161,
        "ostemplate": volid, "restore": 1, "storage": "local-lvm", "tags": "x"}]),
        json!({}),
    );
}

#[test]
fn a_kept_isolated_container_is_reported_as_not_destroyable_by_the_agent_everywhere() {
    // An isolated container copy has every NIC removed before its start, so PVE generated
    // nothing for it that a copy of it would not carry: an empty birth identity. Kept, the
    // agent can never prove it later, and says so from the first line on.
    let w = World::demo();
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "153",
        "--keep",
        "--network=isolated",
        "--json",
    ]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert_eq!(doc["destroy_armed"], json!(false), "{doc:#}");
    let why = text(&doc["disarmed"]);
    assert!(
        why.contains("empty birth identity") && why.contains("pct destroy 153"),
        "{doc:#}"
    );
    let txn = text(&doc["txn"]);
    assert!(w.pve.guest(153).is_some(), "kept");

    // The text result line says the same.
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "154",
        "--keep",
        "--network=isolated",
    ]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("destroy armed: false")
            && run.stdout.contains("empty birth identity")
            && run.stdout.contains("pct destroy 154"),
        "{}",
        run.stdout
    );

    // The journal: not armed, with the reason.
    let row = w.journal_txn(&txn);
    assert_eq!(row["destroy_armed"], json!(false), "{row:#}");
    // `journal refresh` never calls it a guest it could prove and destroy.
    let refresh = w.agent(&["journal", "refresh", "--json"]);
    assert_eq!(
        refresh.code,
        Some(0),
        "{}\n{}",
        refresh.stdout,
        refresh.stderr
    );
    let rows = refresh.json()["transactions"].clone();
    assert!(
        !rows
            .as_array()
            .expect("rows")
            .iter()
            .any(|r| r["txn"] == json!(txn) && r["finding"] == "present_with_proof"),
        "{rows:#}"
    );
    let refresh = w.agent(&["journal", "refresh"]);
    assert!(
        !refresh.stdout.contains("present with its proof"),
        "{}",
        refresh.stdout
    );

    // `destroy` refuses it, naming why and the command that removes it; nothing is deleted.
    let before = guest_deletes(&w).len();
    let run = destroy(&w, 153);
    assert_eq!(run.code, Some(7), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("pct destroy 153") || run.stderr.contains("pct destroy 153"),
        "{}\n{}",
        run.stdout,
        run.stderr
    );
    assert_eq!(guest_deletes(&w).len(), before);
    assert!(w.pve.guest(153).is_some());

    // `--help` says it before anyone keeps one.
    let help = w.agent(&["--help"]);
    let flat = help.stdout.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        flat.contains("--network=isolated has no NIC")
            && flat.contains("the agent cannot destroy it later"),
        "{}",
        help.stdout
    );
}
