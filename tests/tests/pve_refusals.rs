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

fn missing_pool_world() -> World {
    let opts = felhom_tests::fakepve::AgentOptions {
        pool: Some("felhom-gone".to_string()),
        ..felhom_tests::fakepve::AgentOptions::default()
    };
    World::with_options(felhom_tests::fakepve::demo_scenario(), &opts)
}

#[test]
fn doctor_names_a_missing_pool_with_its_code_and_the_command_that_creates_it() {
    let w = missing_pool_world();
    let run = w.agent(&["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}\n{}", run.stderr);
    let pool = doc["checks"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["name"] == "pool"))
        .unwrap_or_else(|| panic!("no pool check: {doc:#}"));
    assert_eq!(pool["status"], "fail", "{doc:#}");
    assert_eq!(pool["code"], "pool_missing", "{doc:#}");
    let msg = pool["message"].as_str().unwrap_or("");
    assert!(msg.contains("pveum pool add felhom-gone"), "{msg}");
}

#[test]
fn the_preflight_refuses_a_missing_pool_with_its_code_before_any_write() {
    let w = missing_pool_world();
    for dry in [true, false] {
        let mut args = vec!["--selftest=provision", "-vmid", "140", "--json"];
        if dry {
            args.push("--dry-run");
        }
        let run = w.agent(&args);
        let doc = run.json();
        // The node's configuration, as `config_invalid`: exit 6, an environment failure that
        // ends the command before its transaction exists (nothing journaled).
        assert_eq!(run.code, Some(6), "{doc:#}\n{}", run.stderr);
        assert!(doc.get("txn").is_none(), "no transaction: {doc:#}");
        assert_eq!(doc["error"]["code"], "pool_missing", "{doc:#}");
        let msg = doc["error"]["message"].as_str().unwrap_or("");
        assert!(msg.contains("pveum pool add felhom-gone"), "{msg}");
        assert!(w.pve.writes().is_empty(), "{:?}", w.pve.writes());
    }
}

#[test]
fn a_guest_outside_the_pool_after_an_ok_restore_is_a_clear_failure_left_untouched() {
    let w = World::demo();
    w.pve
        .set(serde_json::json!({"restore_outside_pool": {"120": true}}));
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(7), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "needs_human", "{doc:#}");
    assert_eq!(doc["error"]["code"], "guest_outside_pool", "{doc:#}");
    let msg = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("ended OK") && msg.contains("is not in pool felhom"),
        "the cause, not a marker write: {msg}"
    );
    assert!(!msg.contains("marker could not be written"), "{msg}");
    assert!(msg.contains("pct destroy 120"), "the command: {msg}");
    assert_eq!(doc["destroy_armed"], serde_json::json!(false), "{doc:#}");
    assert!(
        w.pve
            .requests()
            .iter()
            .all(|r| r.method != "DELETE" || r.path.contains("/tasks/")),
        "nothing deleted"
    );
    assert!(w.pve.guest(120).is_some(), "the guest stays for the human");
}
