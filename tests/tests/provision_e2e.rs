//! `--selftest=provision` end to end: fakepve over HTTPS for PVE, the `pct` stand-in with a real
//! root filesystem for the guest, the real agent binary.
//!
//! The busybox bed: these tests drive PVE-side faults and count requests, which a real guest
//! would only slow down (about 10 s a guest on 2 cores). A provision of a real Debian guest with
//! the default check pack runs in `tests/demo.sh` (`demo.rs`); `real_guests.rs` has more.

use felhom_tests::agent::AgentRun;
use felhom_tests::world::World;
use serde_json::{json, Value};

#[test]
fn happy_path_is_ok_and_cleans_up() {
    let w = World::demo();
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok");
    assert_eq!(doc["destroyed"], json!(true));
    assert_eq!(doc["kind"], "selftest-provision");
    let checks = doc["checks"].as_array().expect("checks");
    assert!(
        !checks.is_empty() && checks.iter().all(|c| c["status"] == "pass"),
        "{doc:#}"
    );
    assert!(w.pve.guest(120).is_none(), "the selftest guest is gone");
    let deletes: Vec<_> = w
        .pve
        .requests()
        .into_iter()
        .filter(|r| r.method == "DELETE" && !r.path.contains("/tasks/"))
        .collect();
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert!(
        deletes[0].targets_vmid(120),
        "only vmid 120 was deleted: {deletes:?}"
    );
    // The destroy frees what the config references and nothing else: no unreferenced disks
    // of the vmid on other storages, no edits to jobs the agent never wrote.
    let query: Vec<&str> = deletes[0].query.split('&').collect();
    assert!(
        query.contains(&"destroy-unreferenced-disks=0") && query.contains(&"purge=0"),
        "the DELETE must say destroy-unreferenced-disks=0 and purge=0: {:?}",
        deletes[0]
    );
}

fn writes(w: &World) -> Vec<felhom_tests::fakepve::RecordedRequest> {
    w.pve.writes()
}

#[test]
fn foreign_guest_only_in_the_local_list_is_refused_with_zero_writes() {
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    scenario["vmlist_extra"] = json!([{"vmid": 4100, "node": "pve2", "type": "lxc"}]);
    let w = World::new(scenario);
    let run = w.agent(&["--selftest=provision", "-vmid", "4100", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(3), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "refused");
    assert_eq!(doc["error"]["code"], "vmid_in_use");
    let msg = doc["error"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("4100") && msg.contains("pve2"), "{msg}");
    assert!(writes(&w).is_empty(), "writes: {:?}", writes(&w));
}

#[test]
fn reserved_vmids_are_refused_with_zero_writes() {
    let w = World::demo();
    for vmid in ["9999", "990003", "990000"] {
        let run = w.agent(&["--selftest=provision", "-vmid", vmid, "--json"]);
        let doc = run.json();
        assert_eq!(run.code, Some(3), "{vmid}: {doc:#}");
        assert_eq!(doc["error"]["code"], "vmid_reserved", "{vmid}: {doc:#}");
    }
    let run = w.agent(&["--selftest=provision", "-vmid", "0120", "--json"]);
    assert_eq!(run.code, Some(3));
    assert_eq!(run.json()["error"]["code"], "vmid_invalid");
    assert!(writes(&w).is_empty(), "writes: {:?}", writes(&w));
}

#[test]
fn guest_created_after_the_list_was_read_fails_with_4_and_no_delete() {
    let w = World::demo();
    // The list is frozen, then someone else creates CT 130 (not in our pool).
    w.pve.set(json!({"vmlist_frozen": true}));
    w.pve.call(
        "add_ct",
        json!([130, "someone-new"]),
        json!({"status": "running"}),
    );
    let run = w.agent(&["--selftest=provision", "-vmid", "130", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(4), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "failed");
    assert_eq!(doc["error"]["code"], "pve_refused");
    assert_eq!(doc["destroy_armed"], json!(false));
    assert!(
        doc["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("CT 130 already exists on node 'pve1'"),
        "{doc:#}"
    );
    assert!(w.pve.deletes_for(130).is_empty());
    assert!(
        w.pve.requests().iter().all(|r| r.method != "DELETE"),
        "no DELETE at all"
    );
    let guest = w.pve.guest(130).expect("the foreign guest is intact");
    assert_eq!(guest["status"], "running");
}

#[test]
fn failing_check_destroys_only_our_guest_and_exits_5() {
    let w = World::demo();
    std::fs::write(
        w.files.checks_dir.join("zz-impossible.toml"),
        "[[check]]\nname = \"impossible\"\nsql = \"SELECT name FROM os_version\"\nexpect = \"rows == 0\"\n",
    )
    .expect("write pack");
    let run = w.agent(&["--selftest=provision", "-vmid", "121", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(5), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["error"]["code"], "check_failed");
    assert_eq!(doc["destroyed"], json!(true));
    let failed: Vec<&Value> = doc["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .filter(|c| c["status"] != "pass")
        .collect();
    assert_eq!(failed.len(), 1, "{doc:#}");
    assert_eq!(failed[0]["name"], "impossible");
    let deletes: Vec<_> = w
        .pve
        .requests()
        .into_iter()
        .filter(|r| r.method == "DELETE" && !r.path.contains("/tasks/"))
        .collect();
    assert_eq!(deletes.len(), 1);
    assert!(deletes[0].targets_vmid(121));
    assert!(w.pve.guest(121).is_none());
    assert!(w.pve.guest(101).is_some() && w.pve.guest(200).is_some());
}

#[test]
fn keep_keeps_and_destroy_then_removes_it_through_the_gate() {
    let w = World::demo();
    let run = w.agent(&["--selftest=provision", "-vmid", "122", "--keep", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["destroyed"], json!(false));
    assert_eq!(doc["destroy_armed"], json!(true));
    let guest = w.pve.guest(122).expect("kept");
    let tags = guest["config"]["tags"].as_str().unwrap_or("");
    assert!(
        tags.contains("felhom"),
        "marker tags on the kept guest: {guest}"
    );
    assert!(w.pve.deletes_for(122).is_empty());

    let kept_txn = doc["txn"].clone();
    let run = w.agent(&["destroy", "-vmid", "122", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["destroyed"], json!(true));
    assert_eq!(w.pve.deletes_for(122).len(), 1);
    assert!(w.pve.guest(122).is_none());
    // The kept provision's own row says its guest was destroyed, and a refresh looks for it
    // no more.
    let journal = w.agent(&["journal", "--json"]).json();
    let kept = journal["transactions"]
        .as_array()
        .expect("transactions")
        .iter()
        .find(|t| t["txn"] == kept_txn)
        .cloned()
        .unwrap_or_default();
    assert_eq!(kept["destroyed"], json!(true), "{journal:#}");
    let refresh = w.agent(&["journal", "refresh", "--json"]);
    assert_eq!(
        refresh.code,
        Some(0),
        "{}\n{}",
        refresh.stdout,
        refresh.stderr
    );
    let looked_at = refresh.json()["transactions"].clone();
    assert!(
        looked_at
            .as_array()
            .expect("transactions")
            .iter()
            .all(|t| t["txn"] != kept_txn),
        "{looked_at:#}"
    );
}

#[test]
fn destroy_of_a_pool_guest_this_agent_did_not_create_exits_7_without_delete() {
    let w = World::demo();
    let run = w.agent(&["destroy", "-vmid", "200", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(7), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["error"]["code"], "ownership_unproven");
    assert!(w.pve.requests().iter().all(|r| r.method != "DELETE"));
    assert!(w.pve.writes().is_empty());
    assert!(w.pve.guest(200).is_some());
}

#[test]
fn dry_run_prints_the_plan_and_writes_nothing() {
    let w = World::demo();
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "123",
        "--dry-run",
        "--json",
    ]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    let plan = doc["plan"].as_array().expect("plan");
    // A throwaway container copy: isolated, so `unique=0` (the request's bridge-less NICs win
    // over the stored ones), and the document says so.
    assert!(
        plan.iter().any(|s| s["call"] == "restore"
            && s["unique"] == json!(false)
            && s["isolate_network"] == json!(true)),
        "{doc:#}"
    );
    assert_eq!(doc["network"], "isolated", "{doc:#}");
    assert!(w.pve.writes().is_empty());
    let journal = w.agent(&["journal", "--json"]).json();
    assert_eq!(
        journal["transactions"],
        json!([]),
        "a dry run journals nothing"
    );
}

#[test]
fn two_selftests_on_one_vmid_one_runs_the_other_is_refused() {
    let w = World::demo();
    // Slow restores, so the first run holds the vmid while the second starts.
    w.pve
        .set(json!({"time_scale": 0.02, "ct_secs": {"create": 100}}));
    let first = w
        .command()
        .args(["--selftest=provision", "-vmid", "124", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    // Wait until the first one has submitted its restore.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !w
        .pve
        .requests()
        .iter()
        .any(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/lxc")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the first selftest never submitted"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let second = w.agent(&["--selftest=provision", "-vmid", "124", "--json"]);
    let doc = second.json();
    assert_eq!(second.code, Some(3), "{doc:#}");
    assert_eq!(doc["error"]["code"], "vmid_in_use");
    let first: AgentRun = first.wait_with_output().expect("first").into();
    assert_eq!(first.code, Some(0), "{}\n{}", first.stdout, first.stderr);
    let posts = w
        .pve
        .requests()
        .iter()
        .filter(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/lxc")
        .count();
    assert_eq!(posts, 1, "only one restore was sent");
}

#[test]
fn failed_qemu_restore_leftover_needs_a_human_with_the_command() {
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    scenario["qemu_restore"] = json!("leftover");
    scenario["volumes"]["local"]
        .as_array_mut()
        .expect("volumes")
        .push(
            json!({"volname": "backup/vzdump-qemu-300-2026_01_01-00_00_00.vma.zst", "vmid": 300,
                   "config": felhom_tests::fakepve::qemu_backup_config()}),
        );
    let w = World::new(scenario);
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "310",
        "--from",
        "local:backup/vzdump-qemu-300-2026_01_01-00_00_00.vma.zst",
        "--json",
    ]);
    let doc = run.json();
    assert_eq!(run.code, Some(7), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "needs_human");
    assert_eq!(doc["destroy_armed"], json!(false));
    let msg = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("qm destroy 310"),
        "the exact command for the operator: {msg}"
    );
    assert!(
        w.pve.requests().iter().all(|r| r.method != "DELETE"),
        "nothing deleted"
    );
    assert!(
        w.pve.guest(310).is_some(),
        "the leftover stays for the human"
    );
}

#[test]
fn every_settled_selftest_leaves_its_final_result_for_the_hub() {
    let w = World::demo();
    std::fs::write(
        w.files.checks_dir.join("zz-impossible.toml"),
        "[[check]]\nname = \"impossible\"\nsql = \"SELECT name FROM os_version\"\nexpect = \"rows == 0\"\n",
    )
    .expect("write pack");
    let failed = w
        .agent(&["--selftest=provision", "-vmid", "125", "--json"])
        .json();
    let refused = w.agent(&["destroy", "-vmid", "200", "--json"]).json();
    let dry = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "126",
        "--dry-run",
        "--json",
    ]);
    assert_eq!(dry.code, Some(0));
    let messages = w.spooled();
    assert_eq!(messages.len(), 2, "one final result each for the failed provision and the refused destroy, none for the dry run: {messages:#?}");
    let failed_msg = messages
        .iter()
        .find(|m| m.contains(failed["txn"].as_str().expect("txn")))
        .expect("the failed provision's result");
    assert!(
        failed_msg.contains("\"type\":\"result\"")
            && failed_msg.contains("check_failed")
            && failed_msg.contains("\"destroyed\":true"),
        "{failed_msg}"
    );
    let refused_msg = messages
        .iter()
        .find(|m| m.contains(refused["txn"].as_str().expect("txn")))
        .expect("the refused destroy's result");
    assert!(refused_msg.contains("ownership_unproven"), "{refused_msg}");
}

/// A guest whose osquery prints a 1 MiB value and many rows: its checks fail, the guest is
/// destroyed through the gate all the same, the journal stays readable and the result waiting
/// for the hub stays small.
#[test]
fn a_guest_printing_a_huge_value_is_still_destroyed_and_bounded() {
    let w = World::demo();
    // The bootstrap runs in the guest before its checks: it makes the osquery stand-in report
    // one failed unit with a 1 MiB description and 60 more with 4 KiB ones.
    let run_script = w.files.bootstrap_dir.join("default").join("run");
    std::fs::write(
        &run_script,
        "#!/bin/sh\nset -eu\nmkdir -p /usr/share/osquery-standin\n\
         awk 'BEGIN { s = \"x\"; while (length(s) < 1048576) s = s s; \
         printf \"huge.service\\t%s\\tloaded\\tfailed\\tfailed\\tenabled\\n\", s; \
         d = substr(s, 1, 4096); \
         for (i = 0; i < 60; i++) printf \"u%d.service\\t%s\\tloaded\\tfailed\\tfailed\\tenabled\\n\", i, d }' \
         >> /usr/share/osquery-standin/systemd_units\n",
    )
    .expect("write run");
    let run = w.agent(&["--selftest=provision", "-vmid", "127", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(5), "{}", run.stderr);
    assert_eq!(doc["error"]["code"], "check_failed");
    assert_eq!(doc["destroyed"], json!(true));
    assert_eq!(w.pve.deletes_for(127).len(), 1, "the gated destroy ran");
    assert!(w.pve.guest(127).is_none(), "the guest is gone");
    let units = doc["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["name"] == "no-failed-units")
        .cloned()
        .expect("the units check");
    assert_eq!(units["status"], "fail", "{units}");
    assert_eq!(units["row_count"], 61, "counted in full");
    assert_eq!(units["rows_truncated"], true);
    assert!(
        run.stdout.len() < 256 * 1024,
        "the printed result is bounded: {} bytes",
        run.stdout.len()
    );
    assert!(
        run.stderr.lines().all(|l| l.len() < 16 * 1024),
        "no log line carries the guest's value"
    );
    // The journal reads back, and the result for the hub is far below its frame cap.
    let journal = w.agent(&["journal", "--json"]);
    assert_eq!(journal.code, Some(0), "{}", journal.stderr);
    let _: Value = serde_json::from_str(&journal.stdout).expect("journal --json parses");
    let messages = w.spooled();
    let result = messages
        .iter()
        .find(|m| m.contains(doc["txn"].as_str().expect("txn")))
        .expect("the result waits for the hub");
    assert!(
        result.len() < 128 * 1024,
        "the result is {} bytes",
        result.len()
    );
}

#[test]
fn lxc_execs_and_pushes_run_only_in_the_exec_helper() {
    let w = World::demo();
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    // The agent's PATH holds the bed's pct too: an agent that ran pct itself would show up.
    let calls = w.bed.pct_calls();
    let execs = calls.iter().filter(|c| c.sub == "exec").count();
    // Files (the bootstrap profile) reach the guest through `pct exec`, never `pct push`.
    let pushes = calls.iter().filter(|c| c.sub == "push").count();
    // Four trips into the guest (each a `pct` process on a node): the launch proof; the boot
    // wait; the bootstrap, its files on the exec's stdin; every check of every pack.
    assert!(
        execs == 4 && pushes == 0,
        "the launch proof, the boot wait, the bootstrap (its files too) and the checks, one exec each: {calls:#?}"
    );
    w.bed.assert_no_push();
    assert!(
        calls
            .iter()
            .filter(|c| c.sub == "exec" || c.sub == "push")
            .all(|c| c.vmid == "120"),
        "{calls:#?}"
    );
    assert_eq!(w.assert_pct_only_from_helper(), execs + pushes);
}

#[test]
fn with_the_exec_helper_down_a_container_provision_is_refused_before_the_restore() {
    let mut w = World::demo();
    let socket = w.helper().socket().display().to_string();
    w.helper.take().expect("helper").kill();
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    // The preflight asks the helper before the first write: an environment failure (exit 6),
    // not a failed launch found after a full restore.
    assert_eq!(run.code, Some(6), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["error"]["code"], "exec_helper_unavailable", "{doc:#}");
    let message = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains(&socket)
            && message.contains("systemctl start felhom-agent-exec.socket")
            && message.contains("120"),
        "the operator learns which socket and what to do: {message}"
    );
    assert!(
        w.pve.writes().is_empty(),
        "nothing written: {:?}",
        w.pve.writes()
    );
    assert!(w.pve.guest(120).is_none(), "nothing restored");
    assert!(w.bed.pct_calls().is_empty(), "{:#?}", w.bed.pct_calls());
}

#[test]
fn a_refusal_by_the_exec_helper_fails_the_provision_and_the_gate_still_cleans_up() {
    let mut w = World::demo();
    // The helper reads a user.cfg from before the restore: the new container is not in the
    // pool there, so it refuses every exec into it (PVE and the agent see it in the pool).
    let frozen = w.files.dir().join("user.cfg.frozen");
    std::fs::copy(&w.files.user_cfg_path, &frozen).expect("copy user.cfg");
    let text = w.files.config_text().replace(
        &format!(
            "user_cfg_path = {}",
            felhom_tests::fakepve::toml_string(&w.files.user_cfg_path.display().to_string())
        ),
        &format!(
            "user_cfg_path = {}",
            felhom_tests::fakepve::toml_string(&frozen.display().to_string())
        ),
    );
    assert!(text.contains("user.cfg.frozen"), "{text}");
    std::fs::write(&w.files.config_path, text).expect("write agent.toml");
    w.restart_helper();

    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(5), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "failed", "not needs_human: {doc:#}");
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    let message = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("exec_not_in_pool") && message.contains("120"),
        "the helper's code reaches the operator: {message}"
    );
    assert!(w.pve.guest(120).is_none(), "the guest is destroyed");
    assert!(
        w.bed
            .pct_calls()
            .iter()
            .all(|c| c.sub != "exec" && c.sub != "push"),
        "nothing ran in the guest: {:#?}",
        w.bed.pct_calls()
    );
    assert!(
        w.helper().log().contains("exec_not_in_pool"),
        "{}",
        w.helper().log()
    );
}
