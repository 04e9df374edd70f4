//! The fake PVE runs as root, and its control endpoint listens on a loopback port that every
//! local user can reach. Another uid (65534, through util-linux's `setpriv`, the way the bed
//! runs its other programs as that uid) gets nothing from it: every control request without the
//! fake's secret, or with a wrong one, is answered 401 and changes nothing the fake does; that
//! uid can read neither the scenario (the token secrets) nor the control secret. And the control
//! endpoint cannot point the guest bed at a program, not even for root with the secret: the
//! programs and paths root runs or writes come from the scenario file only.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use felhom_tests::fakepve::{demo_scenario, form_urlencode, state_base, FakePve};
use felhom_tests::guestbed::GuestBed;
use felhom_tests::reach::{http_as_uid, reachable_tempdir, run_as_uid};
use serde_json::{json, Value};
use tempfile::TempDir;

/// The uid that stands for any other local user.
const OTHER_UID: u32 = 65534;
/// A container of the bed the scenario makes stopped: its LXC monitor stand-in (the program
/// `guest_bed.monitor` names, run by root as `perl <monitor> …`) starts when it starts.
const VMID: u32 = 250;

/// The demo scenario joined to `bed`, with container [`VMID`] stopped and given a root
/// filesystem at the fake's start.
fn fake_with_bed(bed: &GuestBed) -> FakePve {
    let mut scenario = demo_scenario();
    bed.join_scenario(&mut scenario);
    scenario["guests"].as_array_mut().expect("guests").push(
        json!({"vmid": VMID, "type": "lxc", "name": "bedct", "status": "stopped",
                     "pool": "felhom", "bed": {"files": {"/etc/motd": "bed\n"}}}),
    );
    FakePve::start(scenario)
}

/// What another user would point `guest_bed.monitor` at: a script, in a folder that user can
/// reach, that leaves `<script>.ran` behind when it runs (and then acts as a monitor that
/// started). Returns its folder (removed when dropped), the script and the marker.
fn payload() -> (TempDir, PathBuf, PathBuf) {
    let dir = reachable_tempdir("felhom-payload-", &state_base());
    let script = dir.path().join("monitor");
    let marker = dir.path().join("monitor.ran");
    std::fs::write(
        &script,
        "#!/usr/bin/perl\nopen(my $f, '>', \"$0.ran\") and print $f \"$<\\n\";\n$| = 1;\nprint \"ready\\n\";\nsleep 600;\n",
    )
    .expect("write the payload");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    (dir, script, marker)
}

/// `program args…` run as uid 65534.
fn as_other_uid(program: &str, args: &[&str]) -> (Option<i32>, String, String) {
    run_as_uid(OTHER_UID, program, args)
}

/// One control request to the fake sent by uid 65534: the answer's status line and body.
fn control_as_other_uid(
    pve: &FakePve,
    method: &str,
    path: &str,
    auth: Option<&str>,
    body: &Value,
) -> (String, String) {
    let addr = pve
        .control_url()
        .strip_prefix("http://")
        .expect("the control url is http");
    http_as_uid(OTHER_UID, addr, method, path, auth, &body.to_string())
}

/// Whether `@<lxc_path>/<vmid>/command` (the LXC monitor's command socket) is bound.
fn monitor_socket_bound(lxc_path: &Path, vmid: u32) -> bool {
    let want = format!(" @{}/{vmid}/command", lxc_path.display());
    std::fs::read_to_string("/proc/net/unix")
        .expect("/proc/net/unix")
        .lines()
        .any(|l| l.ends_with(&want))
}

/// Start container [`VMID`] through the control endpoint with the fake's own secret and check
/// that the monitor that started is the scenario's (its socket is bound) and the payload never
/// ran; then stop it again.
fn start_proves_scenario_monitor(pve: &FakePve, bed: &GuestBed, marker: &Path) {
    assert!(
        !monitor_socket_bound(&bed.lxc_path(), VMID),
        "no monitor before the start"
    );
    let g = pve.guest_set(VMID, json!({"status": "running"}));
    assert_eq!(g["status"], "running", "{g:#}");
    assert!(
        monitor_socket_bound(&bed.lxc_path(), VMID),
        "the scenario's monitor (tests/pct/lxc-monitor) holds the container's socket"
    );
    assert!(
        !marker.exists(),
        "root ran the payload another user named as guest_bed.monitor"
    );
    pve.guest_set(VMID, json!({"status": "stopped"}));
}

#[test]
fn another_uid_cannot_drive_the_fake_or_read_its_secrets() {
    let bed = GuestBed::new();
    let pve = fake_with_bed(&bed);
    let (_dir, script, marker) = payload();
    let lxc = bed.lxc_path().display().to_string();
    let monitor = script.display().to_string();
    let requests_before = pve.requests().len();

    // What uid 65534 sent to a fake before: the bed's monitor pointed at its own script, then
    // the container started so that root runs it. Also every other kind of request, reads
    // included, and the secret guessed wrong.
    let wrong = format!("Bearer {}", "0".repeat(64));
    let attempts: Vec<(&str, &str, Option<&str>, Value)> = vec![
        (
            "POST",
            "/set",
            None,
            json!({"guest_bed": {"state": bed.state_dir(), "template": "/", "lxc_path": lxc, "monitor": monitor}}),
        ),
        (
            "POST",
            "/set",
            Some(wrong.as_str()),
            json!({"guest_bed": {"lxc_path": lxc, "monitor": monitor}}),
        ),
        ("POST", "/set", None, json!({"time_scale": 5})),
        (
            "POST",
            "/call",
            None,
            json!({"method": "bed_monitor", "args": [VMID, true], "kwargs": {}}),
        ),
        (
            "POST",
            "/call",
            Some("Basic bm9ib2R5OnNlY3JldA=="),
            json!({"method": "guest", "args": [VMID], "kwargs": {}}),
        ),
        (
            "POST",
            "/guest",
            None,
            json!({"vmid": VMID, "set": {"status": "running"}}),
        ),
        ("GET", "/requests", None, Value::Null),
        ("GET", "/tasks", None, Value::Null),
        ("POST", "/shutdown", None, json!({})),
    ];
    for (method, path, auth, body) in &attempts {
        let (status, answer) = control_as_other_uid(&pve, method, path, *auth, body);
        assert!(
            status.starts_with("HTTP/1.1 401 "),
            "uid {OTHER_UID}'s {method} {path} was answered {status:?}: {answer}"
        );
        assert!(answer.contains("control_secret_file"), "{answer}");
    }

    // At the source: the fake logged each refusal (and never the secret), still runs (the
    // shutdown did nothing), saw no API request, and the container is still stopped without a
    // monitor.
    let log = pve.log();
    assert_eq!(
        log.matches("refused: no valid control secret").count(),
        attempts.len(),
        "{log}"
    );
    let secret = std::fs::read_to_string(pve.control_secret_file()).expect("the control secret");
    assert!(!log.contains(secret.trim()), "the fake logged its secret");
    assert_eq!(pve.requests().len(), requests_before, "no API request came");
    assert_eq!(pve.guest(VMID).expect("guest")["status"], "stopped");
    // The one start that happens, root's, runs the scenario's monitor.
    start_proves_scenario_monitor(&pve, &bed, &marker);

    // The files that hold secrets: the scenario (the token secrets), the control secret, the
    // TLS key. Each is 0600 and its folder root's alone; uid 65534 reads none of them.
    let private = pve.private_dir();
    for file in [
        pve.scenario_file(),
        pve.control_secret_file().to_path_buf(),
        private.join("fakepve.key"),
    ] {
        assert_eq!(file.parent(), Some(private.as_path()));
        let mode = std::fs::metadata(&file).expect("stat").permissions().mode() & 0o7777;
        assert_eq!(mode, 0o600, "{} has mode {mode:o}", file.display());
        let (code, out, err) = as_other_uid("cat", &[&file.display().to_string()]);
        assert_ne!(code, Some(0), "uid {OTHER_UID} read {}", file.display());
        assert!(out.is_empty(), "uid {OTHER_UID} read {}", file.display());
        assert!(
            err.contains("Permission denied"),
            "{}: {err}",
            file.display()
        );
    }
    let mode = std::fs::metadata(&private)
        .expect("stat")
        .permissions()
        .mode()
        & 0o7777;
    assert_eq!(mode, 0o700, "{} has mode {mode:o}", private.display());
}

#[test]
fn the_control_endpoint_sets_no_program_or_path_even_with_the_secret() {
    let bed = GuestBed::new();
    let pve = fake_with_bed(&bed);
    let (_dir, script, marker) = payload();
    let lxc = bed.lxc_path().display().to_string();

    // Every attribute that names a program or a path the fake runs or writes as root is the
    // scenario file's: refused 403 with its name, and nothing of the request is set.
    for (attr, value) in [
        (
            "guest_bed",
            json!({"lxc_path": lxc, "monitor": script.display().to_string()}),
        ),
        ("vmlist_path", json!("/etc/felhom-test-vmlist")),
        ("user_cfg_path", json!("/etc/felhom-test-user.cfg")),
        (
            "datacenter_cfg_path",
            json!("/etc/felhom-test-datacenter.cfg"),
        ),
        ("ct_conf_dir", json!("/etc/felhom-test-nodes")),
    ] {
        let err = pve
            .try_set(json!({ attr: value, "time_scale": 5 }))
            .expect_err(attr);
        assert_eq!(err.status, 403, "{attr}: {err}");
        assert!(err.message.contains(attr), "{attr}: {err}");
        assert!(err.message.contains("scenario file only"), "{attr}: {err}");
    }
    // An attribute outside the settable ones, named.
    let err = pve
        .try_set(json!({"bed_monitors": {}}))
        .expect_err("bed_monitors");
    assert_eq!(err.status, 403, "{err}");
    assert!(err.message.contains("bed_monitors"), "{err}");
    // Methods that start programs or make the bed's files: not callable, named.
    for method in ["bed_monitor", "bed_create", "bed_start", "stop"] {
        let err = pve
            .try_call(method, json!([VMID, true]), json!({}))
            .expect_err(method);
        assert_eq!(err.status, 403, "{method}: {err}");
        assert!(err.message.contains(method), "{method}: {err}");
    }
    // A guest's bookkeeping beyond PVE's view of it.
    let err = pve
        .try_guest_set(VMID, json!({"vmid": 4242}))
        .expect_err("vmid");
    assert_eq!(err.status, 403, "{err}");
    assert!(err.message.contains("vmid"), "{err}");
    assert!(pve.guest(VMID).is_some(), "guest {VMID} is still there");

    // What the tests set still is (the settable ones), and the start runs the scenario's
    // monitor, not the payload.
    pve.set(json!({"time_scale": 0.0, "vmlist_frozen": false}));
    start_proves_scenario_monitor(&pve, &bed, &marker);

    // A client without the secret (the fake's own client, its header left out) is refused.
    let err = pve
        .control_with_secret(None, "GET", "/tasks", None)
        .expect_err("no secret");
    assert_eq!(err.status, 401, "{err}");
}

/// fakepve's own default root password is the word `secret`; the fake answers every local user
/// on its HTTPS port, so the wrapper gives the root login a password nobody is told when the
/// scenario names none. The login with the old default is refused as PVE refuses it, and so
/// the only way in is a token whose secret only root can read.
#[tokio::test]
async fn the_root_login_has_no_known_password() {
    let pve = FakePve::demo();
    assert!(
        pve.scenario().get("password").is_none(),
        "the demo names no password"
    );
    for password in ["secret", ""] {
        let answer = pve
            .https_client()
            .post(format!("{}/access/ticket", pve.api_url()))
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body(form_urlencode(&[
                ("username", "root@pam"),
                ("password", password),
            ]))
            .send()
            .await
            .expect("the ticket request is answered");
        assert_eq!(answer.status(), 401, "root@pam with {password:?}");
    }
}
