//! The preflight end to end against fakepve: every cause a provision can be refused for before
//! the first write exits 3 with its own code, names what it concerns and sends no
//! POST/PUT/DELETE to PVE; `--dry-run` runs the same preflight and says so; a hub dispatch the
//! preflight refuses gets a `refused` result and nothing is written.

use std::time::Duration;

use felhom_tests::agent::AgentRun;
use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
use felhom_tests::fakepve::{demo_scenario, AgentOptions};
use felhom_tests::world::World;
use hub_protocol::{DispatchAction, ErrorCode, Outcome};
use serde_json::{json, Value};

const BACKUP: &str = "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst";
const WAIT: Duration = Duration::from_secs(60);

fn assert_no_writes(w: &World, what: &str) {
    let writes = w.pve.writes();
    assert!(writes.is_empty(), "{what}: PVE writes: {writes:?}");
}

/// The refused run's document: exit 3, outcome refused, this code, the message names `names`.
fn assert_refused(run: &AgentRun, code: &str, names: &[&str]) -> Value {
    let doc = run.json();
    assert_eq!(run.code, Some(3), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "refused", "{doc:#}");
    assert_eq!(doc["error"]["code"], code, "{doc:#}");
    let msg = doc["error"]["message"].as_str().unwrap_or("");
    for n in names {
        assert!(msg.contains(n), "the message names {n:?}: {msg}");
    }
    assert_eq!(doc["preflight"]["verdict"], "refused", "{doc:#}");
    assert_eq!(doc["destroy_armed"], json!(false));
    doc
}

/// The selftest and its dry run are both refused for `code`, and neither writes.
fn refused_both_ways(w: &World, extra: &[&str], code: &str, names: &[&str]) {
    for dry in [true, false] {
        let mut args = vec!["--selftest=provision", "-vmid", "140", "--json"];
        args.extend_from_slice(extra);
        if dry {
            args.push("--dry-run");
        }
        let run = w.agent(&args);
        let doc = assert_refused(&run, code, names);
        let failing: Vec<&Value> = doc["preflight"]["checks"]
            .as_array()
            .expect("checks")
            .iter()
            .filter(|c| c["status"] == "fail")
            .collect();
        assert!(
            failing.iter().any(|c| c["code"] == code),
            "dry {dry}: the failing check carries {code}: {doc:#}"
        );
        assert!(doc.get("plan").is_none(), "no plan for a refused request");
        assert_no_writes(w, &format!("{code} (dry run: {dry})"));
        // The human form names the cause too.
        let mut human_args: Vec<&str> = args.iter().copied().filter(|a| *a != "--json").collect();
        human_args.dedup();
        let human = w.agent(&human_args);
        assert_eq!(human.code, Some(3), "{}", human.stderr);
        assert!(
            human
                .stdout
                .contains(&format!("preflight: refused [{code}]")),
            "{}",
            human.stdout
        );
    }
    assert!(w.pve.guest(140).is_none());
}

#[test]
fn missing_backup_is_refused_before_any_write() {
    let w = World::demo();
    let missing = "local:backup/vzdump-lxc-200-2025_05_05-00_00_00.tar.zst";
    refused_both_ways(&w, &["--from", missing], "backup_missing", &[missing]);
}

#[test]
fn storage_that_does_not_exist_is_refused_before_any_write() {
    let w = World::demo();
    refused_both_ways(
        &w,
        &["--storage", "nosuchstore"],
        "storage_invalid",
        &["nosuchstore", "pve1"],
    );
}

#[test]
fn storage_without_rootdir_content_is_refused_before_any_write() {
    let w = World::demo();
    // `local` is a directory storage with iso, vztmpl and backup content: no rootdir.
    refused_both_ways(
        &w,
        &["--storage", "local"],
        "storage_invalid",
        &["local", "rootdir"],
    );
}

#[test]
fn invalid_check_pack_is_refused_before_any_write() {
    let w = World::demo();
    std::fs::write(
        w.files.checks_dir.join("zz-broken.toml"),
        "[[check]]\nname = \"broken\"\nsql = \"SELECT 1\"\nexpect = \"x == '{colour}'\"\n",
    )
    .expect("write pack");
    refused_both_ways(&w, &[], "checks_invalid", &["zz-broken.toml", "colour"]);
}

#[test]
fn missing_default_profile_is_refused_before_any_write() {
    let w = World::demo();
    std::fs::remove_dir_all(w.files.bootstrap_dir.join("default")).expect("rm profile");
    refused_both_ways(&w, &[], "profile_invalid", &["default"]);
}

#[test]
fn a_group_writable_checks_or_bootstrap_folder_is_refused_before_any_write() {
    use std::os::unix::fs::PermissionsExt;
    let w = World::demo();
    let chmod = |p: &std::path::Path, mode: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod")
    };
    chmod(&w.files.checks_dir, 0o775);
    refused_both_ways(
        &w,
        &[],
        "checks_invalid",
        &["checks.d", "0775", "chmod go-w"],
    );
    chmod(&w.files.checks_dir, 0o755);
    chmod(&w.files.bootstrap_dir, 0o757);
    refused_both_ways(
        &w,
        &[],
        "profile_invalid",
        &["bootstrap.d", "0757", "chmod go-w"],
    );
    chmod(&w.files.bootstrap_dir, 0o755);
    // doctor names both.
    chmod(&w.files.checks_dir, 0o770);
    let run = w.agent(&["doctor", "--json"]);
    let doc = run.json();
    let check = doc["checks"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["name"] == "checks_dir"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(check["status"], "fail", "{doc:#}");
    assert!(
        check["message"].as_str().unwrap_or("").contains("0770"),
        "{doc:#}"
    );
}

fn policy_world(policy: &str) -> World {
    let opts = AgentOptions {
        extra_toml: format!("\n[policy]\n{policy}\n"),
        ..AgentOptions::default()
    };
    World::with_options(demo_scenario(), &opts)
}

#[test]
fn storage_source_or_profile_outside_the_policy_is_refused() {
    let w = policy_world("storages = [\"fast-lvm\"]");
    refused_both_ways(
        &w,
        &[],
        "policy_denied",
        &["local-lvm", "fast-lvm", "[policy]"],
    );
    let w = policy_world("sources = [\"nfs:backup/*\"]");
    refused_both_ways(&w, &[], "policy_denied", &[BACKUP, "nfs:backup/*"]);
    let w = policy_world("profiles = [\"web\"]");
    refused_both_ways(&w, &[], "policy_denied", &["\"default\"", "web"]);
}

#[test]
fn dry_run_of_a_good_request_passes_every_check_and_writes_nothing() {
    let w = policy_world(
        "storages = [\"local-lvm\"]\nsources = [\"local:backup/vzdump-*\"]\nprofiles = [\"default\"]",
    );
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "140",
        "--dry-run",
        "--json",
    ]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["preflight"]["verdict"], "pass", "{doc:#}");
    let checks = doc["preflight"]["checks"].as_array().expect("checks");
    let names: Vec<&str> = checks.iter().filter_map(|c| c["name"].as_str()).collect();
    assert_eq!(
        names,
        [
            "vmid",
            "policy",
            "backup_access",
            "backup",
            "contents",
            "network",
            "tags",
            "storage",
            "space",
            "pool",
            "profile",
            "checks",
            "state_space",
            "exec_helper"
        ]
    );
    assert!(
        checks.iter().all(|c| c["status"] == "pass"),
        "every check passes: {doc:#}"
    );
    assert!(
        doc["plan"].as_array().is_some_and(|p| !p.is_empty()),
        "{doc:#}"
    );
    let human = w.agent(&["--selftest=provision", "-vmid", "140", "--dry-run"]);
    assert_eq!(human.code, Some(0), "{}", human.stderr);
    assert!(
        human.stdout.contains("preflight: pass") && human.stdout.contains("storage  pass"),
        "{}",
        human.stdout
    );
    assert_no_writes(&w, "dry run");
    // The preflight read the backup's listing, the storage, and the pool: it asked PVE.
    let reads: Vec<String> = w
        .pve
        .requests()
        .iter()
        .map(|r| r.api_path().to_string())
        .collect();
    for p in [
        "/nodes/pve1/storage/local/content",
        "/nodes/pve1/storage/local-lvm/status",
        "/pools",
    ] {
        assert!(reads.iter().any(|r| r == p), "{p} was read: {reads:?}");
    }
}

#[test]
fn a_pack_using_node_and_txn_passes_on_a_healthy_guest() {
    let w = World::demo();
    // The default profile, plus two lines: the guest records its transaction id (from the
    // bootstrap's FELHOM_TXN) and this node's name where osquery's os_version reads them.
    let run_path = w.files.bootstrap_dir.join("default/run");
    let script = std::fs::read_to_string(&run_path).expect("read run");
    let script = script.replacen(
        "set -eu\n",
        "set -eu\nprintf 'BUILD_ID=%s\\nVERSION_CODENAME=felhom-pve1\\n' \"$FELHOM_TXN\" >>/etc/os-release\n",
        1,
    );
    assert!(
        script.contains("FELHOM_TXN\" >>/etc/os-release"),
        "{script}"
    );
    std::fs::write(&run_path, script).expect("write run");
    std::fs::write(
        w.files.checks_dir.join("zz-node-txn.toml"),
        "[[check]]\nname = \"txn-recorded\"\nsql = \"SELECT build FROM os_version\"\nexpect = \"build == '{txn}'\"\n\n\
         [[check]]\nname = \"node-recorded\"\nsql = \"SELECT codename FROM os_version\"\nexpect = \"codename == 'felhom-{node}'\"\n",
    )
    .expect("write pack");
    let run = w.agent(&["--selftest=provision", "-vmid", "141", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    let checks = doc["checks"].as_array().expect("checks");
    for name in ["txn-recorded", "node-recorded"] {
        let c = checks
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no check {name}: {doc:#}"));
        assert_eq!(c["status"], "pass", "{name}: {doc:#}");
    }
    // The preflight passed the pack with its placeholders before anything was written.
    assert_eq!(doc["preflight"]["verdict"], "pass", "{doc:#}");
}

#[test]
fn hub_dispatches_refused_by_the_preflight_get_refused_results_and_write_nothing() {
    let hub = DevHub::start(DevHubOptions::default());
    let opts = AgentOptions {
        hub: Some(hub.hub_options()),
        extra_toml: "\n[policy]\nstorages = [\"local-lvm\", \"local\"]\n".to_string(),
        ..AgentOptions::default()
    };
    let w = World::with_options(demo_scenario(), &opts);
    let path = w.path();
    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str())],
    );
    hub.wait_for("the session", WAIT, |s| s.sessions == 1);

    let cases: Vec<(DispatchAction, ErrorCode, &str)> = vec![
        (
            DispatchAction::Provision {
                vmid: 6300,
                from: BACKUP.to_string(),
                storage: "local-lvm".to_string(),
                keep: false,
                profile: Some("../../../../etc".to_string()),
                isolate_network: None,
            },
            ErrorCode::ProfileInvalid,
            "../../../../etc",
        ),
        (
            DispatchAction::Provision {
                vmid: 6301,
                from: BACKUP.to_string(),
                storage: "local-lvm".to_string(),
                keep: false,
                profile: Some("nosuchprofile".to_string()),
                isolate_network: None,
            },
            ErrorCode::ProfileInvalid,
            "nosuchprofile",
        ),
        (
            DispatchAction::Provision {
                vmid: 6302,
                from: BACKUP.to_string(),
                storage: "nosuchstore".to_string(),
                keep: false,
                profile: None,
                isolate_network: None,
            },
            ErrorCode::PolicyDenied,
            "nosuchstore",
        ),
        (
            DispatchAction::Provision {
                vmid: 6303,
                from: "local:backup/vzdump-lxc-200-2025_05_05-00_00_00.tar.zst".to_string(),
                storage: "local-lvm".to_string(),
                keep: false,
                profile: None,
                isolate_network: None,
            },
            ErrorCode::BackupMissing,
            "2025_05_05",
        ),
        (
            DispatchAction::Provision {
                vmid: 6304,
                from: BACKUP.to_string(),
                storage: "local".to_string(),
                keep: false,
                profile: None,
                isolate_network: None,
            },
            ErrorCode::StorageInvalid,
            "rootdir",
        ),
    ];
    for (action, code, named) in cases {
        let txn = hub.dispatch(action.clone());
        let state = hub.wait_for("the dispatch's result", WAIT, |s| {
            s.results.contains_key(&txn)
        });
        let result = &state.results[&txn][0].1;
        assert_eq!(result.outcome, Outcome::Refused, "{action:?}: {result:?}");
        let error = result.error.as_ref().expect("an error");
        assert_eq!(error.code, code, "{action:?}: {result:?}");
        assert!(error.message.contains(named), "{named}: {}", error.message);
        assert!(!result.destroy_armed && !result.destroyed, "{result:?}");
        assert_no_writes(&w, &format!("{action:?}"));
    }
    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
}

/// PVE's refusals sent as a plain 500 are refusals (`pve_refused`), read once, never
/// "unreachable": the answers of the real fake, not a table.
#[tokio::test]
async fn pve_refusals_sent_as_500_are_pve_refused_not_unreachable() {
    use felhom_agent::config::Config;
    use felhom_agent::error::ErrorCode as AgentCode;
    use felhom_agent::pve::{ApiErrorKind, LxcRestore, PveClient, RetryPolicy};
    use felhom_tests::fakepve::{AgentFiles, FakePve};

    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let cfg = Config::load(&files.config_path).expect("config loads");
    let client = PveClient::new(&cfg.pve)
        .expect("client builds")
        .with_retry(RetryPolicy {
            attempts: 4,
            first_delay: Duration::from_millis(20),
        });
    let err = client
        .lxc_restore(
            "pve1",
            &LxcRestore {
                vmid: 150,
                archive: BACKUP.to_string(),
                storage: "nosuchstore".into(),
                pool: "felhom".into(),
                unique: true,
                extra: vec![],
            },
        )
        .await
        .expect_err("PVE refuses an unknown storage");
    let api = err.api().expect("an answer from PVE");
    assert_eq!(api.status, 500, "{err}");
    assert!(
        api.message.contains("storage 'nosuchstore' does not exist"),
        "{err}"
    );
    assert_eq!(api.kind, ApiErrorKind::Refusal, "{err}");
    assert_eq!(err.code(), AgentCode::PveRefused, "{err}");
    assert!(!err.is_transient());

    // A read refused the same way is not retried either.
    let before = pve.requests().len();
    let err = client.pool("nope").await.expect_err("no such pool");
    assert_eq!(err.code(), AgentCode::PoolMissing, "{err}");
    assert_eq!(pve.requests().len() - before, 1, "asked once: {err}");
}

#[test]
fn restore_test_onto_a_storage_without_rootdir_is_refused_before_any_write() {
    let opts = AgentOptions {
        extra_toml: "[restore_test]\nstorage = \"local\"\n".to_string(),
        ..AgentOptions::default()
    };
    let w = World::with_options(demo_scenario(), &opts);
    for args in [
        &["--selftest=restore", "--dry-run", "--json"][..],
        &["--selftest=restore", "--json"][..],
    ] {
        let run = w.agent(args);
        assert_eq!(
            run.code,
            Some(3),
            "{args:?}: {}\n{}",
            run.stdout,
            run.stderr
        );
        // The copy of the one due backup (guest 200's) is a refused transaction.
        let doc = run.restore_copy();
        assert_eq!(doc["guest"], 200, "{doc:#}");
        assert_eq!(doc["backup"], BACKUP, "{doc:#}");
        assert_eq!(doc["outcome"], "refused", "{doc:#}");
        assert_eq!(doc["error"]["code"], "storage_invalid", "{doc:#}");
        assert_eq!(doc["preflight"]["verdict"], "refused", "{doc:#}");
        assert_eq!(doc["destroy_armed"], json!(false), "{doc:#}");
        // The target storage refused it, not the backup: it proves nothing of the backup.
        assert_eq!(doc["verdict"], Value::Null, "{doc:#}");
        let profile = doc["preflight"]["checks"]
            .as_array()
            .expect("checks")
            .iter()
            .find(|c| c["name"] == "profile")
            .cloned()
            .unwrap_or_default();
        assert_eq!(
            profile["status"], "skipped",
            "no bootstrap in a copy: {doc:#}"
        );
        assert_no_writes(&w, &format!("{args:?}"));
    }
}

#[test]
fn a_volid_that_is_no_guest_backup_is_refused_as_backup_missing() {
    let w = World::demo();
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "142",
        "--from",
        "local:iso/debian.iso",
        "--json",
    ]);
    let doc = run.json();
    assert_eq!(run.code, Some(3), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["error"]["code"], "backup_missing", "{doc:#}");
    assert!(
        doc["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("local:iso/debian.iso"),
        "{doc:#}"
    );
    assert_no_writes(&w, "a volid that is no backup");
}

#[test]
fn doctor_shows_the_policy() {
    let w = policy_world("storages = [\"local-lvm\"]\nprofiles = [\"default\", \"web\"]");
    let run = w.agent(&["doctor", "--json"]);
    let doc = run.json();
    let policy = doc["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["name"] == "policy")
        .cloned()
        .unwrap_or_else(|| panic!("no policy check: {doc:#}"));
    assert_eq!(policy["status"], "pass", "{doc:#}");
    let msg = policy["message"].as_str().unwrap_or("");
    for part in [
        "storages: local-lvm",
        "sources: any",
        "profiles: default, web",
    ] {
        assert!(msg.contains(part), "{part}: {msg}");
    }
    let human = w.agent(&["doctor"]);
    assert!(
        human.stdout.contains("profiles: default, web"),
        "{}",
        human.stdout
    );
    let w = World::demo();
    let doc = w.agent(&["doctor", "--json"]).json();
    let text = doc.to_string();
    assert!(text.contains("no [policy]"), "{doc:#}");
}

/// A `node` in the config that names no node of the cluster: PVE answers every call under
/// `/nodes/<node>` with "hostname lookup '<node>' failed" (pve-cluster `remote_node_ip` →
/// pve-common `get_ip_from_hostname`); the agent says the node name is wrong and how to find
/// the right one, not that the backup is missing or the token lacks a grant.
#[test]
fn a_node_name_that_is_no_node_of_the_cluster_is_named_as_such() {
    let w = felhom_tests::world::World::demo();
    let config = std::fs::read_to_string(&w.files.config_path).expect("config");
    std::fs::write(
        &w.files.config_path,
        config.replacen("node = \"pve1\"", "node = \"pve9\"", 1),
    )
    .expect("config");
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    let text = doc.to_string();
    assert_ne!(run.code, Some(0), "{doc:#}");
    assert!(
        text.contains("pve9") && text.contains("names no node of this cluster"),
        "{doc:#}\n{}",
        run.stderr
    );
    assert!(w.pve.writes().is_empty(), "{:#?}", w.pve.writes());
}
