//! Tests of the fakepve test bed itself, over real HTTPS (reqwest + rustls with ring): the pin,
//! the pool-scoped view, the foreign-vmid refusal, the control endpoint, isolation of
//! instances, and process cleanup.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use felhom_tests::fakepve::{
    add_qemu_backup, api_get as get, api_send as send, demo_scenario, https_client_for,
    qemu_backup_config, vmlist_text, with_datacenter_cfg, AgentFiles, AgentOptions, FakePve,
    PveTrust, VmlistEntry, QEMU_BACKUP,
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

/// A client of tests/fakepve/zygote.py (`python -c CLIENT SOCKET SCENARIO LOG`) that asks for
/// one fake, as the tests' FakePve::start does, and then runs `then` (`s`: the connection, `r`:
/// the fake's stdout).
fn zygote_client(then: &str) -> String {
    format!(
        r#"
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
r, w = os.pipe()
log = os.open(sys.argv[3], os.O_WRONLY | os.O_CREAT, 0o600)
req = json.dumps({{'scenario': sys.argv[2], 'cwd': os.getcwd(), 'env': dict(os.environ)}}) + '\n'
socket.send_fds(s, [req.encode()], [w, log])
os.close(w)
{then}
"#
    )
}

/// A zygote client that prints the fake's pid and its ready line's start, and ends.
fn zygote_client_until_ready() -> String {
    zygote_client(
        "print(json.loads(s.makefile().readline())['pid'], flush=True)\n\
         print(os.read(r, 4096).decode()[:8], flush=True)",
    )
}

/// The zygote (tests/run.sh starts it) forks each fake: the fake runs with the environment of
/// the test that asked for it, serves, ends cleanly on SIGTERM with its status told back, and
/// a fake whose asker ends without stopping it ends too (as a spawned fake ends with its
/// parent). SIGTERM ends the zygote and removes its socket.
#[test]
fn the_zygote_forks_fakes_that_run_as_their_asker_and_end_with_it() {
    use std::io::BufRead as _;
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("sock");
    let mut zygote = std::process::Command::new(felhom_tests::fakepve::fakepve_python())
        .arg(felhom_tests::fakepve::workspace_root().join("tests/fakepve/zygote.py"))
        .arg(&sock)
        .env_remove("FAKEPVE_LOG_LEVEL")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the zygote");
    let mut ready = String::new();
    std::io::BufReader::new(zygote.stdout.take().expect("stdout"))
        .read_line(&mut ready)
        .expect("the zygote's ready line");
    assert_eq!(ready, "ready\n");
    // One test per process (nextest): nothing else reads the environment meanwhile.
    std::env::set_var(felhom_tests::fakeproc::ZYGOTE_ENV, &sock);
    std::env::set_var("FAKEPVE_LOG_LEVEL", "INFO");

    let pve = FakePve::demo();
    let pid = Pid::from_raw(i32::try_from(pve.pid()).expect("pid"));
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let ppid: u32 = stat
        .rsplit(')')
        .next()
        .and_then(|rest| rest.split_whitespace().nth(1))
        .and_then(|p| p.parse().ok())
        .expect("ppid");
    assert_eq!(ppid, zygote.id(), "the fake is the zygote's child");
    assert!(pve.guest(200).is_some(), "the forked fake serves");
    // The asker's FAKEPVE_LOG_LEVEL, not the zygote's (unset), set the fake's log level.
    assert!(
        pve.log()
            .contains(" INFO fakepve-scenario: serving https://"),
        "the fake runs with the asker's environment: {}",
        pve.log()
    );
    let status = pve.terminate();
    assert!(status.success(), "SIGTERM is a clean exit: {status:?}");
    assert_eq!(kill(pid, None), Err(Errno::ESRCH));

    // An asker that ends: its fake follows within a few seconds.
    let mut scenario = demo_scenario();
    scenario["host"] = json!("127.0.0.1");
    scenario["certdir"] = json!(dir.path().join("certs"));
    let path = dir.path().join("scenario.json");
    felhom_tests::fakepve::write_private(&path, scenario.to_string().as_bytes());
    let out = std::process::Command::new(felhom_tests::fakepve::fakepve_python())
        .arg("-c")
        .arg(zygote_client_until_ready())
        .arg(&sock)
        .arg(&path)
        .arg(dir.path().join("log"))
        .output()
        .expect("the client");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    let orphan: i32 = lines.next().and_then(|l| l.parse().ok()).expect("pid");
    assert_eq!(lines.next(), Some("{\"url\": "), "{text}");
    let orphan = Pid::from_raw(orphan);
    let deadline = Instant::now() + Duration::from_secs(10);
    while kill(orphan, None).is_ok() {
        assert!(
            Instant::now() < deadline,
            "the fake outlived its asker by 10 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    nix::sys::signal::kill(
        Pid::from_raw(i32::try_from(zygote.id()).expect("pid")),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    assert!(zygote.wait().expect("wait").success());
    assert!(!sock.exists(), "the zygote leaves no socket");
}

/// A zygote client that prints its first answer line as it came (a pid or an error).
fn zygote_ask() -> String {
    zygote_client("print(s.makefile().readline().strip(), flush=True)")
}

/// A zygote whose fake changed on disk after it imported it forks no more (the fork would run
/// the old code): it answers an error, and the asker starts its fake from scratch. Run on a
/// copy of tests/fakepve, so that the suite's own zygote is not touched.
#[test]
fn a_zygote_forks_nothing_once_the_fakes_code_changed() {
    use std::io::BufRead as _;
    let dir = tempfile::tempdir().expect("tempdir");
    let code = dir.path().join("fakepve");
    std::fs::create_dir(&code).expect("mkdir");
    let src = felhom_tests::fakepve::workspace_root().join("tests/fakepve");
    for entry in std::fs::read_dir(&src).expect("tests/fakepve") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "py") {
            std::fs::copy(&path, code.join(path.file_name().expect("name"))).expect("copy");
        }
    }
    let sock = dir.path().join("sock");
    let mut zygote = std::process::Command::new(felhom_tests::fakepve::fakepve_python())
        .arg(code.join("zygote.py"))
        .arg(&sock)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the zygote");
    let mut ready = String::new();
    std::io::BufReader::new(zygote.stdout.take().expect("stdout"))
        .read_line(&mut ready)
        .expect("the zygote's ready line");
    assert_eq!(ready, "ready\n");
    let mut scenario = demo_scenario();
    scenario["host"] = json!("127.0.0.1");
    scenario["certdir"] = json!(dir.path().join("certs"));
    let path = dir.path().join("scenario.json");
    felhom_tests::fakepve::write_private(&path, scenario.to_string().as_bytes());
    let ask = || {
        let out = std::process::Command::new(felhom_tests::fakepve::fakepve_python())
            .arg("-c")
            .arg(zygote_ask())
            .arg(&sock)
            .arg(&path)
            .arg(dir.path().join("log"))
            .output()
            .expect("the client");
        serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
    };
    let first = ask();
    assert!(first["pid"].as_i64().is_some(), "{first}");
    // That fake ends with its asker, already gone.
    let mut text = std::fs::read_to_string(code.join("scenario.py")).expect("read");
    text.push_str("\n# changed\n");
    std::fs::write(code.join("scenario.py"), text).expect("write");
    let second = ask();
    assert!(second.get("pid").is_none(), "{second}");
    assert!(
        second["error"]
            .as_str()
            .unwrap_or("")
            .contains("changed since the zygote imported it"),
        "{second}"
    );
    let _ = zygote.kill();
    let _ = zygote.wait();
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
        exit.starts_with("can't add VM 202 to pool 'felhom': "),
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

// ------------------------------------------------------------ restores, as PVE does them

/// Task `upid` once it has stopped (the fake's own record: status, exit status, log).
async fn stopped_task(pve: &FakePve, upid: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(t) = pve.tasks().into_iter().find(|t| t["upid"] == upid) {
            if t["status"] == "stopped" {
                return t;
            }
        }
        assert!(Instant::now() < deadline, "task {upid} did not end");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The demo scenario without its SDN.Use grants (the token may use no bridge).
fn without_sdn_grants(mut s: Value) -> Value {
    s["grants"]
        .as_array_mut()
        .expect("grants")
        .retain(|g| !g[1].as_str().unwrap_or("").starts_with("/sdn/"));
    s
}

/// Add a backup volume of the pool guest 200 (so the pool token may read it) on `local`.
fn add_lxc_backup(s: &mut Value, volname: &str, config: Value) -> String {
    s["volumes"]["local"]
        .as_array_mut()
        .expect("volumes on local")
        .push(json!({"volname": volname, "vmid": 200, "config": config}));
    format!("local:{volname}")
}

/// POST an LXC restore of `volid` into `vmid` (pool `felhom`, storage `local-lvm`) with these
/// extra parameters; the answer's status and the UPID (empty on a refusal).
async fn restore_lxc(
    pve: &FakePve,
    vmid: &str,
    volid: &str,
    extra: &[(&str, &str)],
) -> (u16, String) {
    let mut form = vec![
        ("vmid", vmid),
        ("restore", "1"),
        ("ostemplate", volid),
        ("storage", "local-lvm"),
        ("pool", "felhom"),
    ];
    form.extend_from_slice(extra);
    let (status, body) = send(pve, reqwest::Method::POST, "/nodes/pve1/lxc", &form).await;
    (status, body["data"].as_str().unwrap_or("").to_string())
}

fn hwaddr(net: &str) -> Option<&str> {
    net.split(',').find_map(|p| p.strip_prefix("hwaddr="))
}

/// A QEMU restore case: vmid, archive, extra request parameters, the task's exit status.
type QemuCase<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], &'a str);

const STORED_NET0: &str =
    "name=eth0,bridge=vmbr0,ip=10.1.2.3/24,hwaddr=BC:24:11:12:34:56,type=veth";

#[tokio::test]
async fn lxc_restore_merges_the_backup_config_as_pve_does() {
    let mut s = demo_scenario();
    let volid = add_lxc_backup(
        &mut s,
        "backup/vzdump-lxc-200-2026_02_01-00_00_00.tar.zst",
        json!({"net0": STORED_NET0, "unprivileged": "1", "onboot": "1", "protection": "1",
               "description": "the stored description", "hostname": "stored", "memory": "1024"}),
    );
    let pve = FakePve::start(s);
    let config = |vmid: u32| pve.guest(vmid).expect("the restored container")["config"].clone();

    // unique=1: the stored net0 is written over the request's, with a new random MAC.
    let (status, upid) = restore_lxc(
        &pve,
        "401",
        &volid,
        &[("unique", "1"), ("net0", "name=eth0,link_down=1")],
    )
    .await;
    assert_eq!(status, 200, "{upid}");
    assert_eq!(stopped_task(&pve, &upid).await["exitstatus"], "OK");
    let cfg = config(401);
    let net0 = cfg["net0"].as_str().expect("net0");
    assert!(
        net0.contains("bridge=vmbr0")
            && net0.contains("ip=10.1.2.3/24")
            && !net0.contains("link_down"),
        "the stored NIC: {net0}"
    );
    let mac = hwaddr(net0).expect("a MAC");
    assert_ne!(mac, "BC:24:11:12:34:56", "a new MAC: {net0}");
    // The stored keys the request does not give are kept.
    assert_eq!(cfg["onboot"], "1", "{cfg:#}");
    assert_eq!(cfg["protection"], "1", "{cfg:#}");
    assert_eq!(cfg["description"], "the stored description", "{cfg:#}");
    assert_eq!(cfg["hostname"], "stored", "{cfg:#}");
    assert_eq!(cfg["unprivileged"], "1", "{cfg:#}");
    assert_eq!(pve.guest(401).expect("401")["pool"], "felhom");

    // unique=0: the request's net0 wins, with a MAC of its own (it gave none).
    let (status, upid) =
        restore_lxc(&pve, "402", &volid, &[("net0", "name=eth0,link_down=1")]).await;
    assert_eq!(status, 200, "{upid}");
    assert_eq!(stopped_task(&pve, &upid).await["exitstatus"], "OK");
    let net0 = config(402)["net0"].as_str().expect("net0").to_string();
    assert!(
        net0.contains("link_down=1") && !net0.contains("bridge="),
        "the request's NIC: {net0}"
    );
    let mac = hwaddr(&net0).expect("a MAC");
    assert_ne!(mac, "BC:24:11:12:34:56", "{net0}");
    assert_eq!(config(402)["description"], "the stored description");

    // unique=0 without a net0: the stored one, MAC and all.
    let (status, upid) = restore_lxc(&pve, "403", &volid, &[("description", "given")]).await;
    assert_eq!(status, 200, "{upid}");
    assert_eq!(stopped_task(&pve, &upid).await["exitstatus"], "OK");
    assert_eq!(config(403)["net0"], STORED_NET0);
    assert_eq!(
        config(403)["description"],
        "given",
        "the request's key wins"
    );
}

#[tokio::test]
async fn lxc_restore_checks_fail_the_task_and_leave_no_container() {
    let mut s = without_sdn_grants(demo_scenario());
    let bridged = add_lxc_backup(
        &mut s,
        "backup/vzdump-lxc-200-2026_02_01-00_00_00.tar.zst",
        json!({"net0": STORED_NET0, "unprivileged": "1"}),
    );
    let privileged = add_lxc_backup(
        &mut s,
        "backup/vzdump-lxc-200-2026_02_02-00_00_00.tar.zst",
        json!({"hostname": "old-style", "net0": "name=eth0,hwaddr=BC:24:11:12:34:57"}),
    );
    let bind = add_lxc_backup(
        &mut s,
        "backup/vzdump-lxc-200-2026_02_03-00_00_00.tar.zst",
        json!({"unprivileged": "1", "rootfs": "local-lvm:vm-200-disk-0,size=8G", "mp0": "/srv/data,mp=/data"}),
    );
    let pve = FakePve::start(s);
    for (vmid, volid, extra, error) in [
        (
            "410",
            &bridged,
            &[("unique", "1")][..],
            "unable to restore CT 410 - Permission check failed (/sdn/zones/localnetwork/vmbr0, SDN.Use)",
        ),
        ("411", &privileged, &[][..], "unable to restore CT 411 - Permission check failed (/, Sys.Modify)"),
        (
            "412",
            &bind,
            &[][..],
            "unable to restore CT 412 - restoring 'mp0' to bind mount is only possible for root",
        ),
    ] {
        let (status, upid) = restore_lxc(&pve, vmid, volid, extra).await;
        assert_eq!(status, 200, "the checks are inside the task: {upid}");
        let task = stopped_task(&pve, &upid).await;
        assert_eq!(task["exitstatus"], error, "{task:#}");
        let vmid: u32 = vmid.parse().expect("vmid");
        assert!(pve.guest(vmid).is_none(), "no config is left: {:?}", pve.guest(vmid));
    }
    // A NIC the request gives is not the stored one: no bridge to check, the restore works.
    let (status, upid) =
        restore_lxc(&pve, "413", &bridged, &[("net0", "name=eth0,link_down=1")]).await;
    assert_eq!(status, 200, "{upid}");
    assert_eq!(stopped_task(&pve, &upid).await["exitstatus"], "OK");
    assert_eq!(pve.guest(413).expect("413")["pool"], "felhom");
}

#[tokio::test]
async fn lxc_restore_skips_raw_lxc_keys_for_a_token_with_a_warning() {
    let mut s = demo_scenario();
    let volid = add_lxc_backup(
        &mut s,
        "backup/vzdump-lxc-200-2026_02_01-00_00_00.tar.zst",
        json!({"unprivileged": "1", "lxc.apparmor.profile": "unconfined"}),
    );
    let pve = FakePve::start(s);
    let (status, upid) = restore_lxc(&pve, "404", &volid, &[]).await;
    assert_eq!(status, 200, "{upid}");
    let task = stopped_task(&pve, &upid).await;
    assert_eq!(task["exitstatus"], "WARNINGS: 1", "{task:#}");
    let log: Vec<&str> = task["log"]
        .as_array()
        .expect("log")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        log.contains(&"WARN: skipping custom lxc options, restore manually as root:")
            && log.contains(&"lxc.apparmor.profile: unconfined")
            && log.last() == Some(&"TASK WARNINGS: 1"),
        "{log:#?}"
    );
    let cfg = pve.guest(404).expect("404")["config"].clone();
    assert!(cfg.get("lxc.apparmor.profile").is_none(), "{cfg:#}");
    let (status, body) = get(&pve, &format!("/nodes/pve1/tasks/{upid}/status")).await;
    assert_eq!(
        (status, &body["data"]["exitstatus"]),
        (200, &json!("WARNINGS: 1")),
        "{body}"
    );
}

#[tokio::test]
async fn qemu_restore_checks_fail_the_task_and_leave_the_stub() {
    let mut s = without_sdn_grants(demo_scenario());
    add_qemu_backup(&mut s, qemu_backup_config(), json!(false));
    let local = s["volumes"]["local"].as_array_mut().expect("volumes");
    local.push(
        json!({"volname": "backup/vzdump-qemu-300-2026_02_01-00_00_00.tar.zst", "vmid": 300,
                      "config": {"name": "t", "scsi0": "local-lvm:vm-300-disk-0,size=1G"}}),
    );
    local.push(
        json!({"volname": "backup/vzdump-qemu-300-2026_02_02-00_00_00.vma.zst", "vmid": 300,
                      "config": {"name": "p", "scsi0": "local-lvm:vm-300-disk-0,size=1G",
                                 "hostpci0": "0000:01:00.0"}}),
    );
    let pve = FakePve::start(s);
    let restore = |vmid: &'static str,
                   archive: &'static str,
                   extra: &'static [(&'static str, &'static str)]| {
        let mut form = vec![
            ("vmid", vmid),
            ("archive", archive),
            ("storage", "local-lvm"),
            ("pool", "felhom"),
        ];
        form.extend_from_slice(extra);
        form
    };
    let cases: [QemuCase; 3] = [
        (
            "420",
            QEMU_BACKUP,
            &[],
            "Permission check failed (/sdn/zones/localnetwork/vmbr0, SDN.Use)",
        ),
        (
            "421",
            "local:backup/vzdump-qemu-300-2026_02_01-00_00_00.tar.zst",
            &[("description", "x")],
            "cannot pass along options (description) when restoring from tar archive",
        ),
        (
            "422",
            "local:backup/vzdump-qemu-300-2026_02_02-00_00_00.vma.zst",
            &[],
            "only root can set 'hostpci0' config for non-mapped devices",
        ),
    ];
    for (vmid, archive, extra, error) in cases {
        let (status, body) = send(
            &pve,
            reqwest::Method::POST,
            "/nodes/pve1/qemu",
            &restore(vmid, archive, extra),
        )
        .await;
        assert_eq!(status, 200, "the checks are inside the task: {body}");
        let task = stopped_task(&pve, body["data"].as_str().expect("UPID")).await;
        assert_eq!(task["exitstatus"], error, "{task:#}");
        let note = format!(
            "error before or during data restore, some or all disks were not completely restored. VM {vmid} state is NOT cleaned up."
        );
        assert!(
            task["log"].as_array().expect("log").contains(&json!(note)),
            "{task:#}"
        );
        let vmid: u32 = vmid.parse().expect("vmid");
        let stub = pve.guest(vmid).expect("the stub config is left");
        assert!(stub["lock"].is_null(), "{stub:#}");
        assert_ne!(stub["pool"], "felhom", "{stub:#}");
        assert!(stub["config"].get("scsi0").is_none(), "no disk: {stub:#}");
    }
    // The request's own NICs are checked before any task (403, nothing created).
    let (status, body) = send(
        &pve,
        reqwest::Method::POST,
        "/nodes/pve1/qemu",
        &restore(
            "423",
            QEMU_BACKUP,
            &[
                ("net0", "virtio,bridge=vmbr0"),
                ("net1", "virtio,bridge=vmbr1,tag=20"),
            ],
        ),
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(
        body["message"],
        "Permission check failed (/sdn/zones/localnetwork/vmbr0, SDN.Use)\n"
    );
    assert!(pve.guest(423).is_none());
}

#[tokio::test]
async fn protection_refuses_a_destroy_until_the_flag_is_cleared() {
    let mut s = demo_scenario();
    s["guests"][0]["config"] = json!({"protection": "1"});
    s["guests"][0]["status"] = json!("stopped");
    s["guests"][1]["config"]["protection"] = json!("1");
    let pve = FakePve::start(s);
    for (kind, vmid, word) in [("lxc", 200, "CT"), ("qemu", 300, "VM")] {
        let path = format!("/nodes/pve1/{kind}/{vmid}?purge=0&destroy-unreferenced-disks=0");
        let (status, body) = send(&pve, reqwest::Method::DELETE, &path, &[]).await;
        assert_eq!(status, 500, "{body}");
        assert_eq!(
            body["message"],
            format!("can't remove {word} {vmid} - protection mode enabled\n")
        );
        assert!(pve.guest(vmid).is_some(), "the guest stays");
        // Clearing the flag is an ordinary option change (VM.Config.Options, the pool's role).
        let config = format!("/nodes/pve1/{kind}/{vmid}/config");
        let (status, body) =
            send(&pve, reqwest::Method::PUT, &config, &[("protection", "0")]).await;
        assert_eq!(status, 200, "{body}");
        let (status, body) = send(&pve, reqwest::Method::DELETE, &path, &[]).await;
        assert_eq!(status, 200, "{body}");
        let task = stopped_task(&pve, body["data"].as_str().expect("UPID")).await;
        assert_eq!(task["exitstatus"], "OK", "{task:#}");
        assert!(pve.guest(vmid).is_none(), "destroyed");
    }
}

#[tokio::test]
async fn the_tag_policy_of_datacenter_cfg_is_enforced() {
    let mut s = demo_scenario();
    s["guests"][0]["config"] = json!({"tags": "customer"});
    s["guests"][1]["config"]["tags"] = json!("prod");
    s["guests"][2]["config"] = json!({"tags": "foreign"});
    with_datacenter_cfg(
        &mut s,
        json!({"user-tag-access": "user-allow=existing", "registered-tags": "felhom-owned"}),
    );
    let pve = FakePve::start(s);
    let text = std::fs::read_to_string(pve.datacenter_cfg_path()).expect("live datacenter.cfg");
    assert_eq!(
        text,
        "registered-tags: felhom-owned\nuser-tag-access: user-allow=existing\n"
    );
    let tags = |vmid: u32| pve.guest(vmid).expect("guest")["config"]["tags"].clone();
    let put = |kind: &'static str, vmid: u32, value: &'static str| {
        let pve = &pve;
        async move {
            send(
                pve,
                reqwest::Method::PUT,
                &format!("/nodes/pve1/{kind}/{vmid}/config"),
                &[("tags", value)],
            )
            .await
        }
    };
    // A tag no guest the token sees has: Sys.Modify on / needed.
    for (kind, vmid, value, tag) in [
        ("lxc", 200, "customer;brandnew", "brandnew"),
        ("qemu", 300, "prod;foreign", "foreign"),
        ("lxc", 200, "customer;felhom-owned", "felhom-owned"),
    ] {
        let (status, body) = put(kind, vmid, value).await;
        assert_eq!(status, 403, "{body}");
        assert_eq!(
            body["message"],
            format!("Permission check failed (/, Sys.Modify for modifying tag '{tag}')\n")
        );
    }
    assert_eq!(tags(200), "customer");
    assert_eq!(tags(300), "prod");
    // A tag an audited guest already has is allowed.
    let (status, body) = put("lxc", 200, "customer;prod").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(tags(200), "customer;prod");
    // A restore request's tags meet the same policy (on /vms/<vmid>, held here directly).
    for who in ["felhom@pve!agent", "felhom@pve"] {
        pve.call(
            "grant",
            json!([who, "/vms/405", "VM.Config.Options"]),
            json!({}),
        );
    }
    let (status, upid) = restore_lxc(&pve, "405", DEMO_BACKUP, &[("tags", "brandnew")]).await;
    assert_eq!(status, 403, "{upid}");
    assert!(pve.guest(405).is_none());
    // With Sys.Modify on / every tag may be set.
    for who in ["felhom@pve!agent", "felhom@pve"] {
        pve.call("grant", json!([who, "/", "Sys.Modify"]), json!({}));
    }
    let (status, body) = put("lxc", 200, "brandnew;felhom-owned").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(tags(200), "brandnew;felhom-owned");
    // The policy can change while the fake runs; the live file follows.
    pve.set_datacenter_cfg(json!({"user-tag-access": "user-allow=none"}));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !std::fs::read_to_string(pve.datacenter_cfg_path())
        .unwrap_or_default()
        .contains("user-allow=none")
    {
        assert!(Instant::now() < deadline, "datacenter.cfg did not follow");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn extractconfig_answers_the_stored_config_and_checks_vm_backup() {
    let mut s = demo_scenario();
    s["volumes"]["local"][0]["config"]["description"] = json!("line one\nline: two");
    s["volumes"]["local"].as_array_mut().expect("volumes").push(
        json!({"volname": "backup/vzdump-lxc-101-2026_01_01-00_00_00.tar.zst", "vmid": 101,
                     "config": {"hostname": "someone-else"}}),
    );
    let pve = FakePve::start(s);
    let (status, body) = get(
        &pve,
        &format!("/nodes/pve1/vzdump/extractconfig?volume={DEMO_BACKUP}"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["data"],
        "#line one\n#line%3A two\nnet0: name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:02:00,ip=dhcp,type=veth\nunprivileged: 1\n"
    );
    // The backup of a guest outside the pool: VM.Backup on its owner is missing.
    let foreign = "local:backup/vzdump-lxc-101-2026_01_01-00_00_00.tar.zst";
    let (status, body) = get(
        &pve,
        &format!("/nodes/pve1/vzdump/extractconfig?volume={foreign}"),
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(
        body["message"],
        "Permission check failed (/vms/101, VM.Backup)\n"
    );
    // The listing hides it by the same rule.
    let (status, body) = get(&pve, "/nodes/pve1/storage/local/content?content=backup").await;
    assert_eq!(status, 200, "{body}");
    let volids: Vec<&str> = body["data"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|v| v["volid"].as_str())
        .collect();
    assert_eq!(volids, vec![DEMO_BACKUP]);
    // Root reads it.
    let text = pve.call(
        "_extractconfig",
        json!([{"node": "pve1", "volume": foreign}, "root@pam"]),
        json!({}),
    );
    assert_eq!(text, "hostname: someone-else\n");
}

#[tokio::test]
async fn a_container_nic_without_a_bridge_kills_every_config_write_and_start_as_on_pve() {
    // pve-container update_vm writes the config, then update_lxc_config reads each NIC's
    // bridge MTU (pve-common read_bridge_mtu): "bridge '' does not exist", a 500 after the
    // write. vm_start calls update_lxc_config too. With every NIC deleted, both pass.
    let mut s = demo_scenario();
    let volid = add_lxc_backup(
        &mut s,
        "backup/vzdump-lxc-200-2026_03_01-00_00_00.tar.zst",
        json!({"net0": STORED_NET0, "unprivileged": "1"}),
    );
    let pve = FakePve::start(s);
    let (status, upid) =
        restore_lxc(&pve, "403", &volid, &[("net0", "name=eth0,link_down=1")]).await;
    assert_eq!(status, 200, "{upid}");
    assert_eq!(stopped_task(&pve, &upid).await["exitstatus"], "OK");
    let config_path = "/nodes/pve1/lxc/403/config";
    let (status, body) = send(
        &pve,
        reqwest::Method::PUT,
        config_path,
        &[("description", "written before the die")],
    )
    .await;
    assert_eq!(status, 500, "{body}");
    assert!(
        body.to_string().contains("bridge '' does not exist"),
        "{body}"
    );
    let cfg = pve.guest(403).expect("403")["config"].clone();
    assert_eq!(cfg["description"], "written before the die", "{cfg:#}");
    let (status, body) = send(
        &pve,
        reqwest::Method::POST,
        "/nodes/pve1/lxc/403/status/start",
        &[],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let task = stopped_task(&pve, body["data"].as_str().expect("UPID")).await;
    assert_eq!(task["exitstatus"], "bridge '' does not exist", "{task:#}");
    assert!(pve.start_configs().iter().any(|(v, _)| *v == 403));
    // Deleting the NIC in the same PUT: no NIC is left to check.
    let (status, body) = send(
        &pve,
        reqwest::Method::PUT,
        config_path,
        &[("delete", "net0"), ("description", "isolated")],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let (_, body) = send(
        &pve,
        reqwest::Method::POST,
        "/nodes/pve1/lxc/403/status/start",
        &[],
    )
    .await;
    let task = stopped_task(&pve, body["data"].as_str().expect("UPID")).await;
    assert_eq!(task["exitstatus"], "OK", "{task:#}");
    // A container started with a bridged NIC reached a network, one without none.
    assert_eq!(pve.network_exposures(), Vec::new());
}

#[tokio::test]
async fn a_template_backup_comes_back_a_template_that_never_starts() {
    let mut s = demo_scenario();
    let volid = add_lxc_backup(
        &mut s,
        "backup/vzdump-lxc-200-2026_04_01-00_00_00.tar.zst",
        json!({"unprivileged": "1", "template": "1"}),
    );
    let pve = FakePve::start(s);
    let (status, upid) = restore_lxc(&pve, "404", &volid, &[]).await;
    assert_eq!(status, 200, "{upid}");
    assert_eq!(stopped_task(&pve, &upid).await["exitstatus"], "OK");
    let (_, body) = send(
        &pve,
        reqwest::Method::POST,
        "/nodes/pve1/lxc/404/status/start",
        &[],
    )
    .await;
    let task = stopped_task(&pve, body["data"].as_str().expect("UPID")).await;
    assert_eq!(
        task["exitstatus"], "you can't start a CT if it's a template",
        "{task:#}"
    );
}

#[tokio::test]
async fn a_storage_only_restore_keeps_the_stored_mount_options_and_a_quota_never_starts_unprivileged(
) {
    // pve-container create_vm (storage only mode): each stored volume mount point is printed
    // again with only its volume (`<storage>:<size in GiB>`) and size replaced, so its other
    // options (`quota`, `acl`, `backup`, `mp`, …) come back; create_disks allocates it and
    // writes that value. The start (API2/LXC/Status.pm vm_start) of an unprivileged container
    // then dies "Quotas are not supported by unprivileged containers." for any mount point
    // with `quota`.
    let mut s = demo_scenario();
    let volid = add_lxc_backup(
        &mut s,
        "backup/vzdump-lxc-200-2026_04_01-00_00_00.tar.zst",
        json!({"rootfs": "local-lvm:vm-200-disk-0,acl=1,quota=1,size=8G",
               "mp0": "local-lvm:vm-200-disk-1,backup=1,mp=/srv,quota=1,size=2G"}),
    );
    let pve = FakePve::start(s);
    let (status, upid) = restore_lxc(&pve, "404", &volid, &[("unprivileged", "1")]).await;
    assert_eq!(status, 200, "{upid}");
    assert_eq!(stopped_task(&pve, &upid).await["exitstatus"], "OK");
    let cfg = pve.guest(404).expect("404")["config"].clone();
    let rootfs = cfg["rootfs"].as_str().unwrap_or("");
    assert!(
        rootfs.starts_with("local-lvm:") && rootfs.contains("acl=1") && rootfs.contains("quota=1"),
        "{cfg:#}"
    );
    assert!(rootfs.contains("size=8G"), "{cfg:#}");
    let mp0 = cfg["mp0"].as_str().unwrap_or("");
    for option in ["backup=1", "mp=/srv", "quota=1"] {
        assert!(mp0.contains(option), "{option} not in {mp0}");
    }
    let (status, body) = send(
        &pve,
        reqwest::Method::POST,
        "/nodes/pve1/lxc/404/status/start",
        &[],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let task = stopped_task(&pve, body["data"].as_str().expect("UPID")).await;
    assert_eq!(
        task["exitstatus"], "Quotas are not supported by unprivileged containers.",
        "{task:#}"
    );
    assert_eq!(pve.guest(404).expect("404")["status"], "stopped");
}

#[tokio::test]
async fn a_vm_restore_that_cannot_allocate_its_disks_leaves_the_stub() {
    // qemu-server restore_vma_archive allocates the stored disks (restore_allocate_devices);
    // a failed allocation frees what was allocated ($restore_destroy_volumes) and dies with the
    // storage's error; API2/Qemu.pm create_vm removes the create lock, warns "error before or
    // during data restore, … VM <vmid> state is NOT cleaned up." and ends the task with that
    // error: the empty config stays, outside the pool.
    let mut s = demo_scenario();
    add_qemu_backup(&mut s, qemu_backup_config(), json!(false));
    s["storages"] = json!({"local-lvm": {"avail": 1u64 << 30, "total": 100u64 << 30}});
    let pve = FakePve::start(s);
    let (status, body) = send(
        &pve,
        reqwest::Method::POST,
        "/nodes/pve1/qemu",
        &[
            ("vmid", "424"),
            ("archive", QEMU_BACKUP),
            ("storage", "local-lvm"),
            ("pool", "felhom"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let task = stopped_task(&pve, body["data"].as_str().expect("UPID")).await;
    let exit = task["exitstatus"].as_str().unwrap_or("");
    assert!(
        exit.contains("local-lvm") && exit.contains("No space left on device"),
        "{task:#}"
    );
    assert!(
        !exit.contains("NOT cleaned up"),
        "the warning is a log line: {task:#}"
    );
    let note = "error before or during data restore, some or all disks were not completely restored. VM 424 state is NOT cleaned up.";
    assert!(
        task["log"].as_array().expect("log").contains(&json!(note)),
        "{task:#}"
    );
    let stub = pve.guest(424).expect("the stub config is left");
    assert!(stub["lock"].is_null(), "{stub:#}");
    assert_ne!(stub["pool"], "felhom", "{stub:#}");
    assert!(stub["config"].get("scsi0").is_none(), "no disk: {stub:#}");
}
