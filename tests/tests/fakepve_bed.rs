//! Tests of the fakepve test bed itself, over real HTTPS (reqwest + rustls with ring): the pin,
//! the pool-scoped view, the foreign-vmid refusal, the control endpoint, isolation of
//! instances, and process cleanup.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use felhom_tests::fakepve::{
    api_get as get, api_send as send, demo_scenario, https_client_for, vmlist_text, AgentFiles,
    AgentOptions, FakePve, PveTrust, VmlistEntry,
};
use nix::errno::Errno;
use nix::sys::signal::kill;
use nix::unistd::Pid;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const DEMO_BACKUP: &str = "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst";

fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

#[tokio::test]
async fn ready_line_pin_is_the_served_certificate() {
    let pve = FakePve::demo();
    assert_eq!(pve.sha256_hex().len(), 64);
    let resp = pve
        .https_client()
        .get(format!("{}/version", pve.api_url()))
        .header("Authorization", pve.auth_header())
        .send()
        .await
        .expect("GET /version over HTTPS, verified against the cafile");
    assert_eq!(resp.status().as_u16(), 200);
    let info = resp
        .extensions()
        .get::<reqwest::tls::TlsInfo>()
        .expect("TLS info of the connection");
    let served = info.peer_certificate().expect("the server's certificate");
    assert_eq!(sha256_hex(served), pve.sha256_hex());
    // The cafile holds the same certificate.
    use rustls::pki_types::pem::PemObject;
    let der = rustls::pki_types::CertificateDer::from_pem_file(pve.cafile()).expect("cafile PEM");
    assert_eq!(der.as_ref(), served);
    assert_eq!(
        pve.fingerprint_colons().replace(':', "").to_lowercase(),
        pve.sha256_hex()
    );
    let version: Value = resp.json().await.expect("JSON");
    assert!(version["data"]["version"].is_string(), "{version}");
}

#[tokio::test]
async fn pool_token_sees_exactly_the_pool_guests() {
    let pve = FakePve::demo();
    let (status, body) = get(&pve, "/cluster/resources?type=vm").await;
    assert_eq!(status, 200, "{body}");
    let items = body["data"].as_array().expect("a list");
    let ids: BTreeSet<&str> = items.iter().filter_map(|g| g["id"].as_str()).collect();
    assert_eq!(ids, BTreeSet::from(["lxc/200", "qemu/300"]));
    for g in items {
        assert_eq!(g["pool"], "felhom", "{g}");
    }
    let (status, body) = get(&pve, "/nodes/pve1/lxc").await;
    assert_eq!(status, 200);
    let vmids: Vec<u64> = body["data"]
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|g| g["vmid"].as_u64())
        .collect();
    assert_eq!(vmids, vec![200]);
    let (status, body) = get(&pve, "/nodes/pve1/storage/local/content?content=backup").await;
    assert_eq!(status, 200);
    let volids: Vec<&str> = body["data"]
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|v| v["volid"].as_str())
        .collect();
    assert_eq!(volids, vec![DEMO_BACKUP]);
    // The control side sees every guest, foreign ones included.
    assert_eq!(pve.guest(101).expect("guest 101")["status"], "running");
    assert_eq!(pve.guest(990000).expect("guest 990000")["type"], "qemu");
    assert!(pve.guest(555).is_none());
}

#[tokio::test]
async fn foreign_vmid_answers_permission_check_failed() {
    let pve = FakePve::demo();
    let (status, body) = get(&pve, "/nodes/pve1/lxc/101/status/current").await;
    assert_eq!(status, 403);
    assert_eq!(
        body["message"],
        "Permission check failed (/vms/101, VM.Audit)\n"
    );
    assert!(body["data"].is_null());
    // A vmid nobody has answers the same: existence does not leak.
    let (status, body) = get(&pve, "/nodes/pve1/lxc/555/status/current").await;
    assert_eq!(status, 403);
    assert_eq!(
        body["message"],
        "Permission check failed (/vms/555, VM.Audit)\n"
    );
    let (status, _) = get(&pve, "/nodes/pve1/lxc/200/status/current").await;
    assert_eq!(status, 200);
    // A wrong secret is an authentication failure.
    let resp = pve
        .https_client()
        .get(format!("{}/nodes/pve1/lxc", pve.api_url()))
        .header(
            "Authorization",
            format!(
                "PVEAPIToken={}=00000000-0000-4000-8000-000000000000",
                pve.token_id()
            ),
        )
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status().as_u16(), 401);
}

#[tokio::test]
async fn control_records_requests_and_injects_faults() {
    let pve = FakePve::demo();
    pve.fail(
        "GET",
        "/nodes/pve1/lxc/200/status/current",
        500,
        "injected failure",
        Some(1),
    );
    let (status, body) = get(&pve, "/nodes/pve1/lxc/200/status/current").await;
    assert_eq!(status, 500);
    assert_eq!(body["message"], "injected failure\n");
    let (status, body) = get(&pve, "/nodes/pve1/lxc/200/status/current").await;
    assert_eq!(status, 200, "the fault was for one request only: {body}");
    assert_eq!(body["data"]["status"], "running");

    let (status, _) = get(&pve, "/cluster/resources?type=vm").await;
    assert_eq!(status, 200);
    let (status, body) = send(
        &pve,
        reqwest::Method::DELETE,
        "/nodes/pve1/lxc/101?purge=1",
        &[],
    )
    .await;
    assert_eq!(status, 403);
    assert_eq!(
        body["message"],
        "Permission check failed (/vms/101, VM.Allocate)\n"
    );

    let reqs = pve.requests();
    let paths: Vec<(&str, &str, &str)> = reqs
        .iter()
        .map(|r| (r.method.as_str(), r.api_path(), r.query.as_str()))
        .collect();
    assert_eq!(
        paths,
        vec![
            ("GET", "/nodes/pve1/lxc/200/status/current", ""),
            ("GET", "/nodes/pve1/lxc/200/status/current", ""),
            ("GET", "/cluster/resources", "type=vm"),
            ("DELETE", "/nodes/pve1/lxc/101", "purge=1"),
        ]
    );
    assert_eq!(pve.writes().len(), 1);
    assert_eq!(pve.deletes_for(101).len(), 1);
    assert!(pve.deletes_for(200).is_empty());
    assert!(pve.deletes_for(10).is_empty());
    // 101 is untouched.
    assert_eq!(pve.guest(101).expect("guest 101")["status"], "running");
    // A guest DELETE that asks for more than the config references is recorded, so that
    // dropping the fake fails the test that sent it (this one sent it on purpose).
    let violations = pve.destroy_violations();
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].contains("purge set")
            && violations[0].contains("destroy-unreferenced-disks not said"),
        "{violations:?}"
    );
    pve.call("clear_violations", json!([]), json!({}));
    assert!(pve.destroy_violations().is_empty());
}

#[tokio::test]
async fn restore_collisions_are_refused_synchronously_as_pve_does() {
    let pve = FakePve::demo();
    let form = [
        ("vmid", "101"),
        ("restore", "1"),
        ("ostemplate", DEMO_BACKUP),
        ("storage", "local-lvm"),
        ("pool", "felhom"),
    ];
    let (status, body) = send(&pve, reqwest::Method::POST, "/nodes/pve1/lxc", &form).await;
    assert_eq!(status, 500);
    assert_eq!(body["message"], "CT 101 already exists on node 'pve1'\n");
    // A QEMU restore onto a taken vmid: create_and_lock_config refuses before any task, with
    // the restore prefix (pve-api-facts §5.2).
    let form_qm = [
        ("vmid", "101"),
        ("archive", DEMO_BACKUP),
        ("storage", "local-lvm"),
        ("pool", "felhom"),
    ];
    let (status, body) = send(&pve, reqwest::Method::POST, "/nodes/pve1/qemu", &form_qm).await;
    assert_eq!(status, 500, "{body}");
    assert_eq!(
        body["message"],
        "unable to restore VM 101 - CT 101 already exists on node 'pve1'\n"
    );
    let form_qm = [
        ("vmid", "990000"),
        ("archive", DEMO_BACKUP),
        ("storage", "local-lvm"),
        ("pool", "felhom"),
    ];
    let (status, body) = send(&pve, reqwest::Method::POST, "/nodes/pve1/qemu", &form_qm).await;
    assert_eq!(status, 500, "{body}");
    assert_eq!(
        body["message"],
        "unable to restore VM 990000 - VM 990000 already exists on node 'pve1'\n"
    );
    assert!(pve.tasks().is_empty(), "no task for a synchronous refusal");
    // The bodies are recorded (form fields, nothing secret in them).
    let posts: Vec<_> = pve.writes();
    assert_eq!(posts.len(), 3);
    assert_eq!(posts[0].param("vmid"), Some("101"));
    assert_eq!(posts[0].param("pool"), Some("felhom"));
    assert_eq!(pve.guest(101).expect("101")["status"], "running");

    // A good restore into a free vmid lands in the pool.
    let form = [
        ("vmid", "201"),
        ("restore", "1"),
        ("ostemplate", DEMO_BACKUP),
        ("storage", "local-lvm"),
        ("pool", "felhom"),
    ];
    let (status, body) = send(&pve, reqwest::Method::POST, "/nodes/pve1/lxc", &form).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = get(&pve, "/nodes/pve1/lxc/201/status/current").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(pve.guest(201).expect("guest 201")["pool"], "felhom");
}

#[tokio::test]
async fn set_and_guest_set_change_the_running_fake() {
    let pve = FakePve::demo();
    // Scripted guest agent on VM 300, started through the control endpoint.
    let g = pve.guest_set(
        300,
        json!({"status": "running", "agent": {"exec": {"uname -a": {"exitcode": 0, "out-data": "Linux felhom\n"}}}}),
    );
    assert_eq!(g["status"], "running");
    let (status, body) = send(
        &pve,
        reqwest::Method::POST,
        "/nodes/pve1/qemu/300/agent/exec",
        &[("command", "uname"), ("command", "-a")],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let pid = body["data"]["pid"].as_u64().expect("exec pid");
    let (status, body) = get(
        &pve,
        &format!("/nodes/pve1/qemu/300/agent/exec-status?pid={pid}"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"]["out-data"], "Linux felhom\n");
    assert_eq!(body["data"]["exitcode"], 0);

    // Slow tasks: a restore stays running for a while, then ends OK.
    pve.set(json!({"time_scale": 0.01, "ct_secs": {"create": 50}}));
    let form = [
        ("vmid", "202"),
        ("restore", "1"),
        ("ostemplate", DEMO_BACKUP),
        ("storage", "local-lvm"),
        ("pool", "felhom"),
    ];
    let (status, body) = send(&pve, reqwest::Method::POST, "/nodes/pve1/lxc", &form).await;
    assert_eq!(status, 200, "{body}");
    let upid = body["data"].as_str().expect("UPID").to_string();
    let task_path = format!("/nodes/pve1/tasks/{upid}/status");
    let (_, task) = get(&pve, &task_path).await;
    assert_eq!(task["data"]["status"], "running", "{task}");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, task) = get(&pve, &task_path).await;
        if task["data"]["status"] == "stopped" {
            assert_eq!(task["data"]["exitstatus"], "OK", "{task}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "restore task never ended: {task}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A refused control call is reported, not swallowed.
    let err = pve
        .try_call("no_such_method", Value::Null, Value::Null)
        .expect_err("unknown method");
    assert_eq!(err.status, 404);
    let err = pve
        .try_call("fail", json!(["GET", "/x"]), Value::Null)
        .expect_err("fail without status");
    assert!(err.message.contains("needs status and message"), "{err}");
}

#[tokio::test]
async fn two_instances_run_side_by_side() {
    let a = FakePve::demo();
    let mut scenario = demo_scenario();
    scenario["guests"]
        .as_array_mut()
        .expect("guests")
        .push(json!({"vmid": 210, "type": "lxc", "name": "second", "pool": "felhom"}));
    let b = FakePve::start(scenario);
    assert_ne!(a.host(), b.host());
    assert_ne!(a.sha256_hex(), b.sha256_hex());
    let (_, va) = get(&a, "/cluster/resources?type=vm").await;
    let (_, vb) = get(&b, "/cluster/resources?type=vm").await;
    assert_eq!(va["data"].as_array().expect("list").len(), 2);
    assert_eq!(vb["data"].as_array().expect("list").len(), 3);
    // A's certificate does not vouch for B.
    let err = https_client_for(a.cafile())
        .get(format!("{}/version", b.api_url()))
        .send()
        .await
        .expect_err("B's certificate must not verify against A's");
    assert!(err.is_connect(), "{err:?}");
    assert!(a.requests().len() == 1 && b.requests().len() == 1);
}

#[test]
fn drop_and_terminate_end_the_process() {
    let pve = FakePve::demo();
    let pid = Pid::from_raw(i32::try_from(pve.pid()).expect("pid"));
    assert_eq!(kill(pid, None), Ok(()), "the fake runs");
    drop(pve);
    assert_eq!(
        kill(pid, None),
        Err(Errno::ESRCH),
        "the fake is gone after drop"
    );

    let pve = FakePve::demo();
    let pid = Pid::from_raw(i32::try_from(pve.pid()).expect("pid"));
    let status = pve.terminate();
    assert!(status.success(), "SIGTERM is a clean exit: {status:?}");
    assert_eq!(kill(pid, None), Err(Errno::ESRCH));
}

#[test]
#[should_panic(expected = "neither a role")]
fn a_bad_scenario_fails_loudly() {
    let mut scenario = demo_scenario();
    scenario["grants"] = json!([["felhom@pve!agent", "/pool/felhom", ["PVEVMAdmn"]]]);
    let _ = FakePve::start(scenario);
}

#[test]
fn agent_files_load_as_a_valid_config() {
    use std::os::unix::fs::PermissionsExt;
    let pve = FakePve::demo();
    let files = AgentFiles::write(
        &pve,
        &felhom_tests::fakepve::AgentOptions {
            vmlist: felhom_tests::fakepve::VmlistSource::FromScenario,
            ..Default::default()
        },
    );
    let cfg = felhom_agent::config::Config::load(&files.config_path).expect("agent.toml loads");
    assert_eq!(cfg.node, "pve1");
    assert_eq!(cfg.pool, "felhom");
    assert_eq!(cfg.pve.url, pve.url());
    assert_eq!(cfg.pve.token_id, "felhom@pve!agent");
    assert_eq!(cfg.pve.token_secret.expose(), pve.token_secret());
    let pin: [u8; 32] = hex::decode(pve.sha256_hex())
        .expect("hex")
        .try_into()
        .expect("32 bytes");
    assert_eq!(cfg.pve.tls, felhom_agent::config::TlsTrust::Pin(pin));
    assert_eq!(cfg.provision.selftest_source.as_deref(), Some(DEMO_BACKUP));
    assert_eq!(cfg.state_dir, files.state_dir);
    let mode = std::fs::metadata(&files.token_secret_file)
        .expect("token file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let vmlist = std::fs::read_to_string(&files.vmlist_path).expect("vmlist");
    assert_eq!(
        vmlist,
        vmlist_text(&[
            (200u32, "pve1", "lxc"),
            (300, "pve1", "qemu"),
            (101, "pve1", "lxc"),
            (990000, "pve1", "qemu"),
            (990001, "pve1", "lxc"),
        ])
    );
    assert!(!files.config_text().contains(&pve.token_secret()));

    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            node: "pve2".into(),
            trust: PveTrust::CaFile,
            vmlist: felhom_tests::fakepve::VmlistSource::Entries(vec![VmlistEntry::new(
                120, "pve2", "qemu",
            )]),
            ..AgentOptions::default()
        },
    );
    let cfg = felhom_agent::config::Config::load(&files.config_path).expect("agent.toml loads");
    assert_eq!(cfg.node, "pve2");
    assert_eq!(
        cfg.pve.tls,
        felhom_agent::config::TlsTrust::CaFile(pve.cafile().to_path_buf())
    );
    assert!(std::fs::read_to_string(&files.vmlist_path)
        .expect("vmlist")
        .contains("\"120\": { \"node\": \"pve2\", \"type\": \"qemu\""));
}

#[test]
fn live_vmlist_follows_the_fake_and_can_be_frozen() {
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    scenario["vmlist_extra"] = json!([{"vmid": 4100, "node": "pve2", "type": "lxc"}]);
    let pve = FakePve::start(scenario);
    let files = AgentFiles::for_fake(&pve);
    let read = || std::fs::read_to_string(&files.vmlist_path).expect("live vmlist");
    let first = read();
    for vmid in [
        "\"200\"",
        "\"300\"",
        "\"101\"",
        "\"990000\"",
        "\"990001\"",
        "\"4100\"",
    ] {
        assert!(first.contains(vmid), "{vmid} missing from {first}");
    }
    assert!(first.contains("\"node\": \"pve2\""));
    // A guest added behind the agent's back shows up once the fake has seen a request.
    pve.call("add_ct", json!([777, "late"]), json!({}));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !read().contains("\"777\"") {
        assert!(
            std::time::Instant::now() < deadline,
            "777 never appeared: {}",
            read()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Frozen: a guest created now is invisible to the list.
    pve.set(json!({"vmlist_frozen": true}));
    pve.call("add_ct", json!([778, "later"]), json!({}));
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(!read().contains("\"778\""));
}

/// The restore task of `vmid`, once it has stopped.
async fn stopped_restore_task(pve: &FakePve, vmid: u32) -> Value {
    let id = vmid.to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let task = pve
            .tasks()
            .into_iter()
            .find(|t| t["type"] == "vzrestore" && t["id"].as_str() == Some(id.as_str()));
        if let Some(t) = task.filter(|t| t["status"] == "stopped") {
            return t;
        }
        assert!(
            Instant::now() < deadline,
            "the restore of {vmid} did not end"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_create_answered_5xx_runs_on_and_an_lxc_restore_can_fail_in_its_pool_join() {
    let mut scenario = demo_scenario();
    felhom_tests::world::tasks_take_time(&mut scenario);
    let pve = FakePve::start(scenario);
    pve.set(json!({"create_answer": {"201": 596}, "lxc_restore_fail": {"202": true}}));
    let form = |vmid: &'static str| {
        [
            ("vmid", vmid),
            ("restore", "1"),
            ("ostemplate", DEMO_BACKUP),
            ("storage", "local-lvm"),
            ("pool", "felhom"),
        ]
    };

    // 5xx but created: the answer is AnyEvent's 596, yet the vmid is reserved and the task runs
    // to its end, the container joining the pool.
    let (status, body) = send(&pve, reqwest::Method::POST, "/nodes/pve1/lxc", &form("201")).await;
    assert_eq!(status, 596, "{body}");
    let (status, body) = send(&pve, reqwest::Method::POST, "/nodes/pve1/lxc", &form("201")).await;
    assert_eq!(status, 500, "the vmid is taken: {body}");
    assert_eq!(body["message"], "CT 201 already exists on node 'pve1'\n");
    let task = stopped_restore_task(&pve, 201).await;
    assert_eq!(task["exitstatus"], "OK", "{task}");
    assert_eq!(task["user"], pve.token_id(), "{task}");
    assert_eq!(pve.guest(201).expect("guest 201")["pool"], "felhom");
    // The task is in the node's task list for the token (running ones too: source=all).
    let (status, body) = get(&pve, "/nodes/pve1/tasks?vmid=201&source=all&since=0").await;
    assert_eq!(status, 200, "{body}");
    let upids: Vec<&str> = body["data"]
        .as_array()
        .expect("task list")
        .iter()
        .filter_map(|t| t["upid"].as_str())
        .collect();
    assert_eq!(upids, vec![task["upid"].as_str().unwrap_or("")]);

    // LXC restore failing after the create: the answer is a UPID, the task ends in error in
    // the pool join, and the container stays, unlocked, outside the pool (403 for the token).
    let (status, body) = send(&pve, reqwest::Method::POST, "/nodes/pve1/lxc", &form("202")).await;
    assert_eq!(status, 200, "{body}");
    let task = stopped_restore_task(&pve, 202).await;
    let exit = task["exitstatus"].as_str().unwrap_or("");
    assert!(
        exit.starts_with("can't add VM 202 to pool: "),
        "the pool join failed: {task}"
    );
    let guest = pve.guest(202).expect("the container is left behind");
    assert!(guest["lock"].is_null(), "{guest}");
    assert_ne!(guest["pool"], "felhom", "{guest}");
    let (status, _) = get(&pve, "/nodes/pve1/lxc/202/config").await;
    assert_eq!(status, 403, "outside the pool, the token cannot read it");
}

/// The member field of pool `pool`'s line in a user.cfg text, or `None` without such a line.
fn pool_members(user_cfg: &str, pool: &str) -> Option<String> {
    user_cfg.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        (fields.len() == 6 && fields[0] == "pool" && fields[1] == pool && fields[5].is_empty())
            .then(|| fields[3].to_string())
    })
}

#[tokio::test]
async fn live_user_cfg_follows_restores_into_the_pool_member_removal_and_destroys() {
    let mut scenario = demo_scenario();
    felhom_tests::world::tasks_take_time(&mut scenario);
    scenario["pools"] = json!({"felhom": {"comment": "tenant: a"}});
    // An operator's token that may edit the pool (the agent's never holds Pool.Allocate).
    for who in ["felhom@pve!agent", "felhom@pve"] {
        scenario["grants"]
            .as_array_mut()
            .expect("grants")
            .push(json!([who, "/pool/felhom", ["Pool.Allocate"]]));
    }
    let pve = FakePve::start(scenario);
    let path = pve.user_cfg_path();
    let read = || std::fs::read_to_string(&path).expect("live user.cfg");
    let members = || pool_members(&read(), "felhom").unwrap_or_else(|| panic!("{}", read()));
    // The comment is encoded so its ':' cannot split the record.
    assert!(
        read().contains("pool:felhom:tenant%3A%20a:"),
        "the pool line: {}",
        read()
    );
    assert_eq!(members(), "200,300");

    let restore = |vmid: &'static str| {
        [
            ("vmid", vmid),
            ("restore", "1"),
            ("ostemplate", DEMO_BACKUP),
            ("storage", "local-lvm"),
            ("pool", "felhom"),
        ]
    };
    for vmid in ["1000", "201"] {
        let (status, body) = send(
            &pve,
            reqwest::Method::POST,
            "/nodes/pve1/lxc",
            &restore(vmid),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    // Read the moment each task is seen stopped: the pool join was written with it. Members
    // are sorted as strings (pmxcfs's order), so 1000 comes first.
    stopped_restore_task(&pve, 1000).await;
    stopped_restore_task(&pve, 201).await;
    assert_eq!(members(), "1000,200,201,300");

    // A member removed from the pool through the API.
    let (status, body) = send(
        &pve,
        reqwest::Method::PUT,
        "/pools/felhom",
        &[("vms", "1000"), ("delete", "1")],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(members(), "200,201,300");

    // A destroyed guest leaves its pool with its destroy task.
    let (status, body) = send(
        &pve,
        reqwest::Method::DELETE,
        "/nodes/pve1/lxc/201?purge=0&destroy-unreferenced-disks=0",
        &[],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let upid = body["data"].as_str().expect("destroy UPID").to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let task = pve.tasks().into_iter().find(|t| t["upid"] == upid.as_str());
        if task.is_some_and(|t| t["status"] == "stopped") {
            break;
        }
        assert!(Instant::now() < deadline, "the destroy of 201 did not end");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(pve.guest(201).is_none(), "201 is destroyed");
    assert_eq!(members(), "200,300");
    // Written by rename: no temporary file is left beside it.
    let tmp = path.with_file_name("user.cfg.tmp");
    assert!(!tmp.exists(), "{} left behind", tmp.display());
}
