//! An unknown answer to the restore request is never a refusal, and a failed restore task is
//! never settled as "nothing left" without a look: the real agent binary against the fakepve
//! wrapper with tasks that take time.
//!
//! - "5xx but created" (`/set {"create_answer": …}`): PVE answers the create POST with a 500 or
//!   a 596 while its restore task runs to the end. The agent must find its own task in the
//!   node's task list, follow it, prove the guest its own (task OK + marker read back) and clean
//!   it up through the gate.
//! - "LXC restore fails after create" (`/set {"lxc_restore_fail": …}`): the task ends in error
//!   with the container present outside the pool. The agent must report it to a human with
//!   the command, never "nothing left".
//! - A lost answer where PVE created nothing ends `failed` only after the task list and the
//!   full guest list showed nothing for the whole settle window.

use felhom_tests::agent::AgentRun;
use felhom_tests::world::World;
use serde_json::{json, Value};

const VMID: u32 = 140;
const FOREIGN: [u32; 3] = [101, 990000, 990001];

fn run(w: &World, args: &[&str], settle_ms: Option<u64>) -> AgentRun {
    let mut cmd = w.command();
    cmd.args(args);
    if let Some(ms) = settle_ms {
        cmd.env("FELHOM_AGENT_SUBMIT_SETTLE_MS", ms.to_string());
    }
    cmd.output().expect("run the agent").into()
}

fn provision(w: &World, vmid: u32, settle_ms: Option<u64>) -> (AgentRun, Value) {
    let vmid = vmid.to_string();
    let r = run(
        w,
        &["--selftest=provision", "-vmid", &vmid, "--json"],
        settle_ms,
    );
    let doc = r.json();
    (r, doc)
}

/// The journal's row of the transaction on `vmid` (exactly one).
fn journal_row(w: &World, vmid: u32) -> Value {
    let journal = run(w, &["journal", "--json"], None).json();
    let rows: Vec<Value> = journal["transactions"]
        .as_array()
        .expect("transactions")
        .iter()
        .filter(|t| t["vmid"] == vmid)
        .cloned()
        .collect();
    assert_eq!(
        rows.len(),
        1,
        "one journaled transaction on {vmid}: {journal:#}"
    );
    rows.into_iter().next().unwrap_or_default()
}

/// The restore tasks the fake ran for `vmid`.
fn restore_tasks(w: &World, vmid: u32) -> Vec<Value> {
    let id = vmid.to_string();
    w.pve
        .tasks()
        .into_iter()
        .filter(|t| {
            t["id"].as_str() == Some(id.as_str())
                && matches!(t["type"].as_str(), Some("vzrestore" | "qmrestore"))
        })
        .collect()
}

fn guest_deletes(w: &World, vmid: u32) -> usize {
    w.pve
        .deletes_for(vmid)
        .iter()
        .filter(|r| !r.path.contains("/tasks/"))
        .count()
}

fn assert_foreign_untouched(w: &World) {
    for vmid in FOREIGN {
        assert!(w.pve.writes_for(vmid).is_empty(), "foreign {vmid} written");
        assert!(w.pve.guest(vmid).is_some(), "foreign {vmid} gone");
    }
}

fn qemu_world() -> World {
    World::qemu(
        30,
        json!({"agent": true, "boot_secs": 0, "start_secs": 0, "stop_secs": 0}),
    )
}

/// The 5xx-but-created case: the task is found, followed, proven and cleaned up.
fn five_xx_but_created_is_cleaned_up_through_the_gate(w: &World, status: u16, exit: i32) {
    w.pve
        .set(json!({"create_answer": {VMID.to_string(): status}}));
    let (r, doc) = provision(w, VMID, None);
    assert_eq!(r.code, Some(exit), "{doc:#}\n{}", r.stderr);
    assert_eq!(doc["outcome"], "failed", "{doc:#}");
    assert_eq!(doc["destroy_armed"], json!(true), "{doc:#}");
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");

    // PVE really created the guest: one restore task, ended OK.
    let tasks = restore_tasks(w, VMID);
    assert_eq!(tasks.len(), 1, "one restore task ran: {tasks:#?}");
    assert_eq!(tasks[0]["exitstatus"], "OK", "{tasks:#?}");

    // The transaction recorded that task's UPID, found in the task list.
    let row = journal_row(w, VMID);
    assert_eq!(row["upid"], tasks[0]["upid"], "{row:#}");
    assert_eq!(row["outcome"], "failed", "{row:#}");

    // Destroyed through the gate, counted at PVE: one DELETE, and the guest is gone.
    assert_eq!(guest_deletes(w, VMID), 1, "one DELETE of {VMID}");
    assert!(w.pve.guest(VMID).is_none(), "guest {VMID} is gone");
    let posts = w
        .pve
        .requests()
        .iter()
        .filter(|q| {
            q.method == "POST" && matches!(q.api_path(), "/nodes/pve1/lxc" | "/nodes/pve1/qemu")
        })
        .count();
    assert_eq!(posts, 1, "the restore was sent once, never again");
    assert_foreign_untouched(w);
}

#[test]
fn lxc_500_but_created_is_followed_and_destroyed_through_the_gate() {
    let w = World::demo();
    // A plain 500 is PVE answering: pve_refused, exit 4 (README).
    five_xx_but_created_is_cleaned_up_through_the_gate(&w, 500, 4);
}

#[test]
fn lxc_596_but_created_is_followed_and_destroyed_through_the_gate() {
    let w = World::demo();
    // AnyEvent's 596 is no answer from the node: pve_unreachable, exit 6 (README).
    five_xx_but_created_is_cleaned_up_through_the_gate(&w, 596, 6);
}

#[test]
fn qemu_596_but_created_is_followed_and_destroyed_through_the_gate() {
    let w = qemu_world();
    five_xx_but_created_is_cleaned_up_through_the_gate(&w, 596, 6);
}

#[test]
fn lxc_restore_failing_after_the_create_needs_a_human_with_the_command() {
    let w = World::demo();
    w.pve
        .set(json!({"lxc_restore_fail": {VMID.to_string(): true}}));
    let (r, doc) = provision(&w, VMID, None);
    assert_eq!(r.code, Some(7), "{doc:#}\n{}", r.stderr);
    assert_eq!(doc["outcome"], "needs_human", "{doc:#}");
    assert_eq!(doc["destroy_armed"], json!(false), "{doc:#}");
    let msg = doc["error"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("pct destroy 140"), "the command: {msg}");
    assert!(msg.contains("pct config 140"), "how to inspect: {msg}");

    let tasks = restore_tasks(&w, VMID);
    assert_eq!(tasks.len(), 1, "{tasks:#?}");
    let exit = tasks[0]["exitstatus"].as_str().unwrap_or("");
    assert!(exit.contains("can't add VM 140 to pool"), "{tasks:#?}");

    let row = journal_row(&w, VMID);
    assert_eq!(row["outcome"], "needs_human", "{row:#}");
    assert_eq!(row["upid"], tasks[0]["upid"], "{row:#}");

    // The container is there, outside the pool, and was not touched.
    assert!(
        w.pve.guest(VMID).is_some(),
        "the container stays for the human"
    );
    assert_eq!(guest_deletes(&w, VMID), 0, "nothing deleted");
    assert_foreign_untouched(&w);
}

#[test]
fn lxc_500_then_restore_failing_after_the_create_needs_a_human() {
    let w = World::demo();
    w.pve.set(json!({
        "create_answer": {VMID.to_string(): 500},
        "lxc_restore_fail": {VMID.to_string(): true},
    }));
    let (r, doc) = provision(&w, VMID, None);
    assert_eq!(r.code, Some(7), "{doc:#}\n{}", r.stderr);
    assert_eq!(doc["outcome"], "needs_human", "{doc:#}");
    let msg = doc["error"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("pct destroy 140"), "the command: {msg}");
    let tasks = restore_tasks(&w, VMID);
    assert_eq!(tasks.len(), 1, "{tasks:#?}");
    // The task was found in the task list and recorded.
    assert_eq!(journal_row(&w, VMID)["upid"], tasks[0]["upid"]);
    assert!(w.pve.guest(VMID).is_some());
    assert_eq!(guest_deletes(&w, VMID), 0);
    assert_foreign_untouched(&w);
}

#[test]
fn a_lost_answer_that_created_nothing_fails_only_after_the_settle_window() {
    let w = World::demo();
    // fakepve's own fault: the answer is a 596 and the handler never runs (no task, no guest).
    w.pve.fail(
        "POST",
        "/nodes/pve1/lxc",
        596,
        "Connection timed out",
        Some(1),
    );
    let started = std::time::Instant::now();
    let (r, doc) = provision(&w, VMID, Some(1500));
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(1500),
        "nothing was concluded before the settle window passed"
    );
    assert_eq!(r.code, Some(6), "{doc:#}\n{}", r.stderr);
    assert_eq!(doc["outcome"], "failed", "{doc:#}");
    let msg = doc["error"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("task list"), "{msg}");
    assert!(restore_tasks(&w, VMID).is_empty());
    // The task list was read (for this vmid), and nothing else was written.
    let searches = w
        .pve
        .requests()
        .iter()
        .filter(|q| q.method == "GET" && q.api_path() == "/nodes/pve1/tasks")
        .filter(|q| q.param("vmid") == Some("140"))
        .count();
    assert!(
        searches >= 2,
        "the task list was searched repeatedly: {searches}"
    );
    assert!(w.pve.guest(VMID).is_none());
    assert_eq!(w.pve.writes_for(VMID).len(), 0);
    assert_foreign_untouched(&w);
}

#[test]
fn a_guest_appearing_after_a_lost_answer_without_our_task_needs_a_human() {
    let w = World::demo();
    // The answer is lost and PVE started nothing for us; meanwhile someone else creates a
    // container at the vmid (outside the pool). The full list shows a guest, the task list no
    // task of ours: nothing proves it ours, and "nothing left" would be wrong.
    w.pve.fail(
        "POST",
        "/nodes/pve1/lxc",
        596,
        "Connection timed out",
        Some(1),
    );
    let child = w
        .command()
        .args(["--selftest=provision", "-vmid", "140", "--json"])
        .env("FELHOM_AGENT_SUBMIT_SETTLE_MS", "2500")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the agent");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let searching = w
            .pve
            .requests()
            .iter()
            .any(|q| q.method == "GET" && q.api_path() == "/nodes/pve1/tasks");
        if searching {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no task search seen");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    w.pve.call(
        "add_ct",
        json!([VMID, "someone-else"]),
        json!({"node": "pve1"}),
    );
    let r: AgentRun = child.wait_with_output().expect("wait for the agent").into();
    let doc = r.json();
    assert_eq!(r.code, Some(7), "{doc:#}\n{}", r.stderr);
    assert_eq!(doc["outcome"], "needs_human", "{doc:#}");
    assert_eq!(doc["destroy_armed"], json!(false), "{doc:#}");
    let msg = doc["error"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("pct destroy 140"), "the command: {msg}");
    assert!(msg.contains("pvenode task list --vmid 140"), "{msg}");
    assert_eq!(journal_row(&w, VMID)["outcome"], "needs_human");
    assert!(restore_tasks(&w, VMID).is_empty());
    assert!(w.pve.guest(VMID).is_some(), "the guest is not touched");
    assert_eq!(w.pve.writes_for(VMID).len(), 0, "nothing written to it");
    assert_foreign_untouched(&w);
}
