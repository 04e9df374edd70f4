//! The PVE client against fakepve over real HTTPS with the pinned certificate.

use std::time::Duration;

use felhom_agent::config::Config;
use felhom_agent::error::ErrorCode;
use felhom_agent::pve::{
    wait_task, ApiErrorKind, GuestKind, LxcRestore, PveClient, PveError, QemuRestore, RetryPolicy,
    WaitOptions,
};
use felhom_tests::fakepve::{AgentFiles, AgentOptions, FakePve, PveTrust};
use serde_json::json;

const BACKUP: &str = "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst";

fn client_for(files: &AgentFiles) -> PveClient {
    let cfg = Config::load(&files.config_path).expect("config loads");
    PveClient::new(&cfg.pve)
        .expect("client builds")
        .with_retry(RetryPolicy {
            attempts: 4,
            first_delay: Duration::from_millis(20),
        })
}

fn restore(vmid: u32, archive: &str) -> LxcRestore {
    LxcRestore {
        vmid,
        archive: archive.to_string(),
        storage: "local-lvm".into(),
        pool: "felhom".into(),
        unique: true,
        extra: vec![],
    }
}

fn assert_no_secret(pve: &FakePve, text: &str) {
    assert!(
        !text.contains(&pve.token_secret()),
        "the token secret leaked into: <redacted text of {} bytes>",
        text.len()
    );
}

#[tokio::test]
async fn pool_token_sees_only_pool_guests() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let client = client_for(&files);
    let mut vmids: Vec<u32> = client
        .cluster_vms()
        .await
        .expect("resources")
        .iter()
        .map(|g| g.vmid)
        .collect();
    vmids.sort();
    assert_eq!(vmids, vec![200, 300]);
    let version = client.version().await.expect("version");
    assert!(!version.version.is_empty());
}

#[tokio::test]
async fn foreign_and_missing_vmids_are_permission_errors() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let client = client_for(&files);
    for vmid in [101u32, 555] {
        let err = client
            .status_current("pve1", GuestKind::Lxc, vmid)
            .await
            .expect_err("must be refused");
        let api = err.api().expect("an API error");
        assert_eq!(api.status, 403, "vmid {vmid}");
        assert_eq!(api.kind, ApiErrorKind::Permission, "vmid {vmid}");
        assert_eq!(
            api.message,
            format!("Permission check failed (/vms/{vmid}, VM.Audit)")
        );
        assert_eq!(err.code(), ErrorCode::PveRefused);
        assert!(!err.is_transient(), "a 403 must not be retried");
        assert_no_secret(&pve, &format!("{err} {err:?}"));
    }
    // A 403 is not retried: exactly one request per vmid.
    let gets = pve
        .requests()
        .iter()
        .filter(|r| r.path.ends_with("/status/current"))
        .count();
    assert_eq!(gets, 2);
    // The pool guest itself answers.
    let st = client
        .status_current("pve1", GuestKind::Lxc, 200)
        .await
        .expect("pool guest");
    assert!(st.is_running());
}

#[tokio::test]
async fn restore_returns_upid_and_wait_task_ok() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let client = client_for(&files);
    let upid = client
        .lxc_restore("pve1", &restore(201, BACKUP))
        .await
        .expect("restore accepted");
    assert_eq!(upid.task_type, "vzrestore");
    assert_eq!(upid.id, "201");
    assert!(upid.user.ends_with("!agent"), "{}", upid.user);
    let outcome = wait_task(
        &client,
        &upid,
        &WaitOptions::timeout(Duration::from_secs(30)),
    )
    .await
    .expect("task ok");
    assert_eq!(outcome.exitstatus, "OK");
    assert_eq!(outcome.warnings, None);
    let post = pve
        .requests()
        .into_iter()
        .find(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/lxc")
        .expect("POST recorded");
    assert_eq!(post.param("unique"), Some("1"));
    assert_eq!(post.param("restore"), Some("1"));
    assert_eq!(post.param("pool"), Some("felhom"));
    let vms = client.cluster_vms().await.expect("resources");
    assert!(vms
        .iter()
        .any(|g| g.vmid == 201 && g.pool.as_deref() == Some("felhom")));
}

#[tokio::test]
async fn collision_with_foreign_guest_is_classified() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let client = client_for(&files);
    let err = client
        .lxc_restore("pve1", &restore(101, BACKUP))
        .await
        .expect_err("collision");
    assert_eq!(
        err.already_exists(),
        Some((GuestKind::Lxc, 101, "pve1".to_string()))
    );
    assert_eq!(
        err.api().map(|a| a.message.as_str()),
        Some("CT 101 already exists on node 'pve1'")
    );
    let err = client
        .lxc_restore("pve1", &restore(990000, BACKUP))
        .await
        .expect_err("collision");
    assert_eq!(
        err.already_exists(),
        Some((GuestKind::Qemu, 990000, "pve1".to_string()))
    );
    assert_eq!(err.code(), ErrorCode::PveRefused);
    // Writes are never retried: one POST each.
    let posts = pve.requests().iter().filter(|r| r.method == "POST").count();
    assert_eq!(posts, 2);
    assert!(pve.deletes_for(101).is_empty());
}

#[tokio::test]
async fn a_qemu_restore_collision_is_refused_synchronously_and_classified() {
    // PVE reserves the vmid with create_and_lock_config before any task: a taken vmid is a
    // synchronous 500 with the restore prefix, never a task (pve-api-facts §4.2, §5.2).
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let client = client_for(&files);
    let err = client
        .qemu_restore(
            "pve1",
            &QemuRestore {
                vmid: 101,
                archive: BACKUP.to_string(),
                storage: "local-lvm".into(),
                pool: "felhom".into(),
                unique: true,
                extra: vec![],
            },
        )
        .await
        .expect_err("collision");
    assert!(
        err.to_string()
            .contains("unable to restore VM 101 - CT 101 already exists on node 'pve1'"),
        "{err}"
    );
    assert_eq!(
        err.already_exists(),
        Some((GuestKind::Lxc, 101, "pve1".to_string()))
    );
    assert_eq!(err.code(), ErrorCode::PveRefused);
    assert!(pve.tasks().is_empty(), "no task");
    let posts = pve.requests().iter().filter(|r| r.method == "POST").count();
    assert_eq!(posts, 1, "never retried");
}

#[tokio::test]
async fn missing_archive_task_error_keeps_pve_text() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let client = client_for(&files);
    let missing = "local:backup/vzdump-lxc-200-2020_01_01-00_00_00.tar.zst";
    let upid = client
        .lxc_restore("pve1", &restore(203, missing))
        .await
        .expect("UPID");
    let err = wait_task(
        &client,
        &upid,
        &WaitOptions::timeout(Duration::from_secs(30)),
    )
    .await
    .expect_err("task error");
    assert_eq!(err.code(), ErrorCode::TaskFailed);
    let PveError::TaskFailed {
        exitstatus,
        log_tail,
        ..
    } = &err
    else {
        panic!("unexpected {err}")
    };
    assert!(
        exitstatus.starts_with("unable to restore CT 203 - "),
        "{exitstatus}"
    );
    assert!(exitstatus.contains("does not exist"), "{exitstatus}");
    assert!(
        log_tail.iter().any(|l| l.starts_with("TASK ERROR:")),
        "{log_tail:?}"
    );
    assert!(err.to_string().contains(upid.as_str()));
}

#[tokio::test]
async fn locked_guest_is_classified() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let client = client_for(&files);
    pve.call("snapshot_lock", json!([200, "backup"]), json!({}));
    let err = client
        .destroy("pve1", GuestKind::Lxc, 200)
        .await
        .expect_err("locked");
    assert_eq!(
        err.api().map(|a| a.kind.clone()),
        Some(ApiErrorKind::Locked),
        "{err}"
    );
    assert_eq!(err.code(), ErrorCode::GuestLocked);
    // A stopped, locked CT: start fails inside the task with the lock.
    pve.guest_set(200, json!({"status": "stopped"}));
    match client.start("pve1", GuestKind::Lxc, 200).await {
        Ok(upid) => {
            let err = wait_task(
                &client,
                &upid,
                &WaitOptions::timeout(Duration::from_secs(30)),
            )
            .await
            .expect_err("locked");
            assert_eq!(err.code(), ErrorCode::GuestLocked, "{err}");
        }
        Err(err) => assert_eq!(err.code(), ErrorCode::GuestLocked, "{err}"),
    }
}

#[tokio::test]
async fn injected_500_is_retried_on_reads_not_on_writes() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let client = client_for(&files);
    pve.fail(
        "GET",
        "/cluster/resources",
        500,
        "temporary failure",
        Some(2),
    );
    let vms = client.cluster_vms().await.expect("retried to success");
    assert_eq!(vms.len(), 2);
    let gets = pve
        .requests()
        .iter()
        .filter(|r| r.path.ends_with("/cluster/resources"))
        .count();
    assert_eq!(gets, 3, "two failures and one success");

    pve.guest_set(200, json!({"status": "stopped"}));
    pve.fail("POST", "/status/start", 500, "temporary failure", Some(1));
    let err = client
        .start("pve1", GuestKind::Lxc, 200)
        .await
        .expect_err("write not retried");
    assert!(err.is_transient());
    let posts = pve
        .requests()
        .iter()
        .filter(|r| r.method == "POST" && r.path.ends_with("/status/start"))
        .count();
    assert_eq!(posts, 1, "a write is sent exactly once");
}

#[tokio::test]
async fn flaky_network_reads_are_retried() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let client = client_for(&files).with_retry(RetryPolicy {
        attempts: 12,
        first_delay: Duration::from_millis(5),
    });
    pve.call(
        "flaky_network",
        json!([]),
        json!({"drop_rate": 0.4, "seed": 7}),
    );
    for _ in 0..10 {
        let vms = client
            .cluster_vms()
            .await
            .expect("reads survive a flaky network");
        assert_eq!(vms.len(), 2);
    }
    // A write that hits a dropped connection is not sent again.
    let no_retry = client_for(&files).with_retry(RetryPolicy {
        attempts: 12,
        first_delay: Duration::from_millis(5),
    });
    pve.call(
        "flaky_network",
        json!([]),
        json!({"drop_rate": 1.0, "seed": 7}),
    );
    let before = pve.requests().len();
    let err = no_retry
        .start("pve1", GuestKind::Lxc, 200)
        .await
        .expect_err("dropped");
    assert_eq!(err.code(), ErrorCode::PveUnreachable, "{err}");
    let after = pve.requests().len();
    assert!(
        after - before <= 1,
        "the write was sent {} times",
        after - before
    );
}

#[tokio::test]
async fn wrong_pin_is_rejected_before_any_request() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let text = files
        .config_text()
        .replace(pve.sha256_hex(), &"ab".repeat(32));
    std::fs::write(&files.config_path, text).expect("rewrite");
    let client = client_for(&files);
    let err = client.version().await.expect_err("pin mismatch");
    assert_eq!(err.code(), ErrorCode::TlsPinMismatch, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&pve.fingerprint_colons()),
        "the seen fingerprint is named: {msg}"
    );
    assert!(pve.requests().is_empty(), "no request may reach the server");
}

#[tokio::test]
async fn ca_file_trust_works() {
    let pve = FakePve::demo();
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            trust: PveTrust::CaFile,
            ..AgentOptions::default()
        },
    );
    let client = client_for(&files);
    assert_eq!(client.cluster_vms().await.expect("resources").len(), 2);
    // A CA file others may change is not trusted.
    use std::os::unix::fs::PermissionsExt;
    let ca = files.dir().join("ca.pem");
    std::fs::copy(pve.cafile(), &ca).expect("copy the CA");
    std::fs::set_permissions(&ca, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let text = files.config_text().replace(
        &pve.cafile().display().to_string(),
        &ca.display().to_string(),
    );
    std::fs::write(&files.config_path, text).expect("rewrite");
    let cfg = Config::load(&files.config_path).expect("config loads");
    let err = PveClient::new(&cfg.pve).expect_err("a world-writable CA file");
    assert!(err.to_string().contains("0666"), "{err}");
}

#[tokio::test]
async fn bad_token_is_an_auth_error() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    std::fs::write(
        &files.token_secret_file,
        "99999999-2222-4333-8444-555555555555\n",
    )
    .expect("rewrite");
    let client = client_for(&files);
    let err = client.version().await.expect_err("auth");
    assert_eq!(err.code(), ErrorCode::PveAuth, "{err}");
    assert_eq!(err.api().map(|a| a.status), Some(401));
    assert!(
        !err.to_string().contains("99999999"),
        "the wrong secret must not be echoed"
    );
    let requests = pve.requests();
    assert_eq!(requests.len(), 1, "auth failures are not retried");
}

#[tokio::test]
async fn interrupt_stops_following_and_never_the_task() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let client = client_for(&files);
    pve.set(json!({"time_scale": 0.05, "ct_secs": {"create": 120}}));
    let upid = client
        .lxc_restore("pve1", &restore(204, BACKUP))
        .await
        .expect("UPID");
    let opts = WaitOptions::timeout(Duration::from_secs(30));
    let cancel = opts.cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        cancel.cancel();
    });
    let err = wait_task(&client, &upid, &opts)
        .await
        .expect_err("interrupted");
    assert!(matches!(err, PveError::Interrupted { .. }), "{err}");
    assert!(err.to_string().contains(upid.as_str()), "{err}");
    let stop = pve
        .requests()
        .into_iter()
        .find(|r| r.method == "DELETE" && r.path.contains("/tasks/"));
    assert!(
        stop.is_none(),
        "a shutdown must not stop PVE's task: {stop:?}"
    );
    // The task really was still running when the wait was interrupted, and goes on.
    let status = client.task_status(&upid).await.expect("status");
    assert_eq!(status.status, "running", "{status:?}");
    assert!(
        pve.deletes_for(204).is_empty(),
        "the guest itself is not deleted"
    );
}

#[tokio::test]
async fn task_timeout_names_the_upid() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let client = client_for(&files);
    pve.set(json!({"time_scale": 0.05, "ct_secs": {"create": 120}}));
    let upid = client
        .lxc_restore("pve1", &restore(205, BACKUP))
        .await
        .expect("UPID");
    let err = wait_task(
        &client,
        &upid,
        &WaitOptions::timeout(Duration::from_millis(300)),
    )
    .await
    .expect_err("timeout");
    assert_eq!(err.code(), ErrorCode::TaskTimeout);
    assert!(err.to_string().contains(upid.as_str()));
}

#[tokio::test]
async fn an_answer_over_8_mib_is_refused_naming_the_path() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let client = client_for(&files);
    // Config values are free text PVE hands back in the config answer; ten keys of 960 KiB
    // (the control endpoint takes 1 MiB a request) make that answer larger than the client reads.
    for i in 0..10 {
        pve.guest_set(
            200,
            json!({"config": {format!("description{i}"): "x".repeat(960 * 1024)}}),
        );
    }
    let before = pve.requests().len();
    let err = client
        .config_get("pve1", GuestKind::Lxc, 200)
        .await
        .expect_err("a 9 MiB answer must be refused");
    let msg = err.to_string();
    assert!(msg.contains("8 MiB"), "{msg}");
    assert!(msg.contains("/nodes/pve1/lxc/200/config"), "{msg}");
    assert_no_secret(&pve, &msg);
    assert!(
        msg.len() < 1024,
        "the message stays short: {} bytes",
        msg.len()
    );
    assert!(
        pve.requests().len() > before,
        "the request reached the server"
    );
}

#[tokio::test]
async fn a_pin_mismatch_is_not_reported_for_a_later_unrelated_failure() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let text = files
        .config_text()
        .replace(pve.sha256_hex(), &"ab".repeat(32));
    std::fs::write(&files.config_path, text).expect("rewrite");
    let client = client_for(&files);
    let err = client.version().await.expect_err("pin mismatch");
    assert_eq!(err.code(), ErrorCode::TlsPinMismatch, "{err}");
    // The server goes away: the next failure is a refused connection, not a pin mismatch.
    drop(pve);
    let err = client.version().await.expect_err("nothing listens");
    assert_eq!(err.code(), ErrorCode::PveUnreachable, "{err}");
}
