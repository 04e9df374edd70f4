//! `doctor` states the PVE versions the agent supports and fails below the floor, naming the
//! version the node answered.

use felhom_tests::agent::{run_agent, stand_in_pct_path, ExecHelper};
use felhom_tests::fakepve::{AgentFiles, FakePve};
use serde_json::{json, Value};

fn version_check(pve: &FakePve) -> (Option<i32>, Value) {
    let files = AgentFiles::for_fake(pve);
    let _helper = ExecHelper::start(
        &files.config_path,
        files.exec_socket.as_deref().expect("exec helper socket"),
        &stand_in_pct_path(files.config_path.parent().expect("the files' folder")),
    );
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    let check = doc["checks"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["name"] == "pve_version"))
        .cloned()
        .unwrap_or_else(|| panic!("no pve_version check: {doc:#}"));
    (run.code, check)
}

#[test]
fn doctor_states_the_supported_versions_and_fails_below_the_floor() {
    let pve = FakePve::demo();
    pve.set(json!({"version": "9.1.1", "release_version": "9.1"}));
    let (code, check) = version_check(&pve);
    assert_eq!(code, Some(0), "{check:#}");
    assert_eq!(check["status"], "pass", "{check:#}");
    let msg = check["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("PVE 8.1 or newer") && msg.contains("VM.GuestAgent"),
        "{msg}"
    );

    pve.set(json!({"version": "8.0.4", "release_version": "8.0"}));
    let (code, check) = version_check(&pve);
    assert_eq!(code, Some(6), "{check:#}");
    assert_eq!(check["status"], "fail", "{check:#}");
    assert_eq!(check["code"], "pve_unsupported", "{check:#}");
    let msg = check["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("PVE 8.0.4") && msg.contains("PVE 8.1"),
        "{msg}"
    );
}
