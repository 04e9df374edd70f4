//! The QEMU side of guest exec through the real PVE client against fakepve's scripted guest
//! agent: `agent/exec` with the command as an array, `agent/exec-status` read once, and the
//! "not running" outcomes told apart.

use std::time::Duration;

use felhom_agent::config::Config;
use felhom_agent::guest::exec::{
    guest_argv, ExecError, ExecIds, ExecRequest, GuestExec, GuestExit,
};
use felhom_agent::guest::qemu::{QemuConfig, QemuExec};
use felhom_agent::pve::PveClient;
use felhom_tests::fakepve::{AgentFiles, FakePve};
use serde_json::json;

fn client(pve: &FakePve) -> (PveClient, AgentFiles) {
    let files = AgentFiles::for_fake(pve);
    let cfg = Config::load(&files.config_path).expect("config");
    (PveClient::new(&cfg.pve).expect("client"), files)
}

#[tokio::test]
async fn exec_through_the_guest_agent_api() {
    let pve = FakePve::demo();
    let (api, _files) = client(&pve);
    let request = ExecRequest::new(["uname", "-a"]).timeout(Duration::from_secs(20));
    // The exact argv the agent sends (controlled environment, exec tag) is the script's key.
    let argv = guest_argv(&request, "t-1").expect("argv");
    pve.guest_set(
        300,
        json!({"status": "running", "agent": {"exec": {argv.join(" "): {"exitcode": 3, "out-data": "Linux felhom\n", "err-data": "careful\n"}}}}),
    );
    let exec = QemuExec::new(&api, "pve1", 300, QemuConfig::default())
        .with_exec_ids(ExecIds::with_prefix("t"));
    let out = exec.exec(&request).await.expect("ran");
    assert_eq!(out.exit, GuestExit::Exited(3));
    assert_eq!(out.stdout.text(), "Linux felhom\n");
    assert_eq!(out.stderr.text(), "careful\n");

    let reqs = pve.requests();
    let post = reqs
        .iter()
        .find(|r| r.method == "POST" && r.path.ends_with("/qemu/300/agent/exec"))
        .expect("exec POST");
    assert!(
        post.body.contains("command=uname") && post.body.contains("command=-a"),
        "command as an array: {}",
        post.body
    );
    assert!(post.body.matches("command=").count() >= 3, "{}", post.body);
    let statuses = reqs
        .iter()
        .filter(|r| r.path.ends_with("/agent/exec-status"))
        .count();
    assert_eq!(statuses, 1, "the exited result is fetched exactly once");
}

#[tokio::test]
async fn stopped_vm_and_missing_agent_are_their_own_outcomes() {
    let pve = FakePve::demo();
    let (api, _files) = client(&pve);
    let request = ExecRequest::new(["true"]).timeout(Duration::from_secs(10));
    let exec = QemuExec::new(&api, "pve1", 300, QemuConfig::default());
    // 300 is stopped in the demo.
    let err = exec.exec(&request).await.expect_err("stopped");
    assert!(
        matches!(
            err,
            ExecError::NotRunning { .. } | ExecError::AgentNotRunning { .. }
        ),
        "{err}"
    );
    // Running, but no agent answers.
    pve.guest_set(300, json!({"status": "running"}));
    let err = exec.exec(&request).await.expect_err("no agent");
    assert!(matches!(err, ExecError::AgentNotRunning { .. }), "{err}");
    assert!(err.to_string().contains("guest agent"), "{err}");
}

/// PVE returns `ping` and `info` as `{"result": …}` without checking qemu-ga's answer
/// (qemu-server `API2/Qemu/Agent.pm` `register_command`): a ping whose result is an error
/// object is still a 200, so the guest agent answered; an info listing `guest-exec` disabled
/// (EL's qemu-ga) reads as refused, naming both commands.
#[tokio::test]
async fn a_ping_answered_with_an_error_object_proves_the_agent_and_info_tells_exec_refused() {
    use felhom_agent::guest::qga_info::{exec_offer, ExecOffer};
    let pve = FakePve::demo();
    let (api, _files) = client(&pve);
    pve.guest_set(
        300,
        json!({"status": "running", "agent": {
            "ping": {"error": {"class": "GenericError", "desc": "frozen"}},
            "info": {"version": "8.2.0", "supported_commands": [
                {"name": "guest-ping", "enabled": true, "success-response": true},
                {"name": "guest-exec", "enabled": false, "success-response": true},
                {"name": "guest-exec-status", "enabled": false, "success-response": true},
            ]},
        }}),
    );
    api.agent_ping("pve1", 300)
        .await
        .expect("a 200 carrying result.error is an answer");
    let info = api.agent_info("pve1", 300).await.expect("info");
    assert_eq!(
        exec_offer(&info),
        ExecOffer::Refused {
            refused: vec![
                "guest-exec disabled".to_string(),
                "guest-exec-status disabled".to_string()
            ],
            version: Some("8.2.0".to_string()),
        },
        "{info}"
    );
    // A stopped VM's ping is PVE's refusal, as for exec.
    pve.guest_set(300, json!({"status": "stopped"}));
    let err = api.agent_ping("pve1", 300).await.expect_err("stopped");
    assert!(err.to_string().contains("not running"), "{err}");
}
