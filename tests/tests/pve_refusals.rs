//! PVE's refusals that a person must act on end the transaction with PVE's words and the fix,
//! never in a retry: a replication job on the guest refusing its destroy (pve-guest-common
//! `src/PVE/ReplicationConfig.pm` `check_for_existing_jobs`), a pool that does not exist
//! (pve-access-control), a guest outside the pool after an OK restore task.

use felhom_tests::world::World;

const REPLICATION: &str =
    "There is a replication job '120-0' for guest '120' - Please remove that first.";

#[test]
fn a_destroy_refused_for_a_replication_job_needs_a_human_and_is_not_retried() {
    let w = World::demo();
    w.pve.fail("DELETE", "/lxc/120", 500, REPLICATION, None);
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(7), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "needs_human");
    let msg = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("Please remove that first"),
        "PVE's words: {msg}"
    );
    assert!(msg.contains("pct destroy 120"), "the command: {msg}");
    let deletes: Vec<_> = w
        .pve
        .requests()
        .into_iter()
        .filter(|r| r.method == "DELETE" && r.targets_vmid(120) && !r.path.contains("/tasks/"))
        .collect();
    assert_eq!(deletes.len(), 1, "sent once, not retried: {deletes:?}");
    assert!(w.pve.guest(120).is_some(), "the guest stays for the human");
}
