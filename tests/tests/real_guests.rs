//! The test bed on real guests: containers the fake PVE restores are real unprivileged LXC
//! containers running Debian 12 with systemd (`tests/testbed/build-debian-rootfs.sh`,
//! `guest_bed.real_lxc` in `tests/fakepve/scenario.py`), and `pct exec` is `lxc-attach`
//! (`tests/pct/pct`). Each test here but the last needs LXC: on a machine where it does not
//! work, the test prints why and ends (`tests/run.sh` sets `FELHOM_REQUIRE_REAL_GUESTS=1`, which
//! makes that a failure); the last shows that behaviour on a `PATH` without LXC.

use std::process::Command;
use std::time::Duration;

use felhom_tests::fakepve::AgentOptions;
use felhom_tests::guestbed::{cgroup_dirs, links_with_prefix, processes_with_marker};
use felhom_tests::world::World;
use serde_json::{json, Value};

/// The backup of the demo's container 200 as a Debian guest with a static address on vmbr0
/// (pve-container writes it into `/etc/network/interfaces` at each start).
fn debian_scenario() -> Value {
    felhom_tests::verdict::static_debian_backup()
}

/// A check pack without `no-failed-units`: a real unprivileged Debian container here shows
/// `sys-kernel-debug.mount` failed (Debian's userns.conf), and an isolated copy
/// `networking.service`; what the verdict makes of them is not this file's subject.
const PACK: &str = r#"
[[check]]
name = "os-identified"
sql = "SELECT name, version, platform FROM os_version WHERE platform = 'debian' AND version LIKE '12%'"
expect = "rows >= 1"

[[check]]
name = "hostname"
sql = "SELECT hostname FROM system_info"
expect = "hostname == '{hostname}'"

[[check]]
name = "root-fs-read-write"
sql = "SELECT path, type, flags FROM mounts WHERE path = '/' AND (flags = 'rw' OR flags LIKE 'rw,%')"
expect = "rows >= 1"

[[check]]
name = "systemd-runs"
sql = "SELECT id FROM systemd_units WHERE id = 'systemd-journald.service' AND active_state = 'active'"
expect = "rows == 1"
"#;

fn real_world(opts: &AgentOptions) -> Option<World> {
    let w = World::real_or_skip(debian_scenario(), opts)?;
    std::fs::write(w.files.checks_dir.join("default.toml"), PACK)
        .unwrap_or_else(|e| panic!("cannot write the check pack: {e}"));
    Some(w)
}

/// `pct exec <vmid> --keep-env 0 -- argv` through the bed's `pct`: (exit code, stdout, stderr).
fn pct_exec(w: &World, vmid: u32, argv: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(w.bed.pct())
        .args(["exec", &vmid.to_string(), "--keep-env", "0", "--"])
        .args(argv)
        .output()
        .unwrap_or_else(|e| panic!("cannot run pct: {e}"));
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Wait (60 s at most) until `pct exec` in the guest answers (`up`) or is refused.
fn wait_exec(w: &World, vmid: u32, up: bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let (code, _, err) = pct_exec(w, vmid, &["true"]);
        if (code == Some(0)) == up {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "CT {vmid} did not {} within 60 s: {err}",
            if up { "answer" } else { "stop" }
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// Wait (60 s at most) until systemd inside the guest has finished starting up
/// (`is-system-running --wait` answers `running` or `degraded`); returns that answer. Right
/// after its start the guest's PID 1 may not have its bus yet (`Failed to connect to bus`, no
/// state word): that is asked again, as the agent's boot wait does.
fn wait_booted(w: &World, vmid: u32) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let (_, out, err) = pct_exec(
            w,
            vmid,
            &["timeout", "60", "systemctl", "is-system-running", "--wait"],
        );
        let state = out.trim().to_string();
        if state == "running" || state == "degraded" {
            return state;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "systemd in {vmid} did not finish starting within 60 s: {state:?} {err}"
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
}

#[test]
fn isolated_copy_of_a_debian_guest_shows_networking_failed() {
    let Some(w) = real_world(&AgentOptions::default()) else {
        return;
    };
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "122",
        "--network",
        "isolated",
        "--keep",
        "--json",
    ]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["network"], "isolated", "{doc:#}");
    let config = &w.pve.guest(122).expect("kept")["config"];
    assert!(
        config
            .as_object()
            .is_some_and(|c| !c.keys().any(|k| k.starts_with("net"))),
        "the isolated copy has a NIC: {config}"
    );

    // The agent gave the copy its eth0 as a pair whose other end stays inside it, before the
    // boot wait (networking.service found it, or was restarted when it ran before it).
    let isolation = doc["isolation"].as_str().unwrap_or_default();
    assert!(isolation.contains("eth0 given"), "{doc:#}");
    // A selftest's guest is the agent's own throwaway copy: sys-kernel-debug.mount, failed in
    // its user namespace, is reset and named, never "left failed".
    assert!(
        isolation.contains("sys-kernel-debug.mount failed as in every unprivileged container")
            && !isolation.contains("left failed"),
        "{doc:#}"
    );
    // PVE stops and starts the copy: it boots again as PVE boots it, with no NIC, and the pair
    // the agent gave it went with its old network namespace.
    w.pve.guest_set(122, json!({"status": "stopped"}));
    wait_exec(&w, 122, false);
    // LXC's monitor often leaves the container's cgroup behind at a stop (its rmdir meets
    // processes still exiting); PVE's pre-start hook removes it, else lxc-start fails (ERANGE).
    let prefix = w.bed.net_prefix().expect("a real bed");
    let left = [
        "/sys/fs/cgroup/pids",
        "/sys/fs/cgroup/unified",
        "/sys/fs/cgroup",
    ]
    .iter()
    .map(|h| format!("{h}/felhom-bed/{prefix}/lxc"))
    .find(|p| std::path::Path::new(p).is_dir())
    .map(|p| format!("{p}/122/ns/left"))
    .expect("the bed's cgroup folder");
    std::fs::create_dir_all(&left).unwrap_or_else(|e| panic!("{left}: {e}"));
    w.pve.guest_set(122, json!({"status": "running"}));
    wait_exec(&w, 122, true);

    // What the backup's guest had: eth0, static, written by pve-container at its last start.
    let (code, interfaces, err) = pct_exec(&w, 122, &["cat", "/etc/network/interfaces"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        interfaces.contains("auto eth0") && interfaces.contains("address 10.20.0.31/24"),
        "{interfaces}"
    );
    // No NIC: the container's own network namespace holds only lo.
    let (_, links, _) = pct_exec(&w, 122, &["ip", "-o", "link", "show"]);
    let names: Vec<&str> = links
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n))
        .collect();
    assert_eq!(names, ["lo"], "{links}");

    wait_booted(&w, 122);
    let (_, failed, err) = pct_exec(
        &w,
        122,
        &[
            "systemctl",
            "list-units",
            "--state=failed",
            "--no-legend",
            "--plain",
            "--no-pager",
        ],
    );
    assert!(
        failed
            .lines()
            .any(|l| l.starts_with("networking.service ") && l.contains(" failed ")),
        "networking.service is not failed in the isolated copy:\n{failed}{err}"
    );
    // The same, as the checks read it: the osqueryi stand-in's systemd_units from systemd.
    let (code, json_out, err) = pct_exec(
        &w,
        122,
        &[
            "osqueryi",
            "--json",
            "SELECT id, sub_state FROM systemd_units WHERE active_state = 'failed'",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    let rows: Value = serde_json::from_str(&json_out).expect("osqueryi JSON");
    assert!(
        rows.as_array()
            .expect("rows")
            .iter()
            .any(|r| r == &json!({"id": "networking.service", "sub_state": "failed"})),
        "{json_out}"
    );
}

#[test]
fn provision_with_the_stored_network_boots_eth0_on_the_bed_bridge_and_passes_its_checks() {
    let Some(w) = real_world(&AgentOptions::default()) else {
        return;
    };
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "123",
        "--network",
        "stored",
        "--keep",
        "--json",
    ]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["network"], "stored", "{doc:#}");
    let checks = doc["checks"].as_array().expect("checks");
    assert_eq!(checks.len(), 4, "{doc:#}");
    assert!(checks.iter().all(|c| c["status"] == "pass"), "{doc:#}");

    wait_booted(&w, 123);
    let (_, addr, err) = pct_exec(&w, 123, &["ip", "-o", "-4", "addr", "show", "dev", "eth0"]);
    assert!(addr.contains("inet 10.20.0.31/24"), "{addr}{err}");
    // The NIC LXC made is the one PVE's config describes (its hwaddr: the restore may have
    // given it a new one).
    let net0 = w.pve.guest(123).expect("kept")["config"]["net0"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let hwaddr = net0
        .split(',')
        .find_map(|p| p.strip_prefix("hwaddr="))
        .unwrap_or_else(|| panic!("no hwaddr in {net0}"))
        .to_lowercase();
    let (_, link, _) = pct_exec(&w, 123, &["ip", "-o", "link", "show", "dev", "eth0"]);
    assert!(
        link.contains("state UP")
            && link.contains(" mtu 1450 ")
            && link.contains(&format!("link/ether {hwaddr} ")),
        "{link} (PVE: {net0})"
    );
    let (_, state, _) = pct_exec(&w, 123, &["systemctl", "is-active", "networking.service"]);
    assert_eq!(state.trim(), "active");
    // The default bootstrap profile ran in the real guest (its shell is dash).
    let (_, env, err) = pct_exec(&w, 123, &["cat", "/var/lib/felhom/provisioned.env"]);
    assert!(env.contains("FELHOM_VMID=123\n"), "{env}{err}");
    // The osqueryi stand-in's `curl` table fetches from inside the guest: a page served by
    // busybox httpd on the guest's own address.
    let (code, _, err) = pct_exec(
        &w,
        123,
        &[
            "sh",
            "-c",
            "mkdir -p /srv/www && echo hello-from-web1 > /srv/www/index.html && \
             busybox httpd -p 10.20.0.31:8080 -h /srv/www",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    let (code, rows, err) = pct_exec(
        &w,
        123,
        &[
            "osqueryi",
            "--json",
            "SELECT url, response_code, result FROM curl WHERE url = 'http://10.20.0.31:8080/index.html'",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    let rows: Value = serde_json::from_str(&rows).expect("osqueryi JSON");
    assert_eq!(
        rows,
        json!([{"response_code": "200", "result": "hello-from-web1",
                "url": "http://10.20.0.31:8080/index.html"}]),
        "{err}"
    );
    // The host end is on a bridge of this bed (its name starts with the bed's prefix), and the
    // bridge has no uplink and no address.
    let prefix = w.bed.net_prefix().expect("real bed").to_string();
    let bridges: Vec<String> = links_with_prefix(&prefix)
        .into_iter()
        .filter(|l| {
            std::path::Path::new("/sys/class/net")
                .join(l)
                .join("bridge")
                .exists()
        })
        .collect();
    assert_eq!(bridges.len(), 1, "{bridges:?}");
    let ports: Vec<String> = std::fs::read_dir(format!("/sys/class/net/{}/brif", bridges[0]))
        .expect("brif")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(ports.len(), 1, "{ports:?}");
    assert!(ports[0].starts_with(&prefix), "{ports:?}");
    let out = Command::new("ip")
        .args(["-o", "addr", "show", "dev", &bridges[0]])
        .output()
        .expect("ip");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // Stopped behind PVE's back (through LXC): PVE sees it stopped, and `pct exec` refuses as
    // pve-container's does (check_running finds no command socket), exit 255.
    let stopped = Command::new("lxc-stop")
        .arg("-P")
        .arg(w.bed.lxc_path())
        .args(["-n", "123", "--kill"])
        .status()
        .expect("lxc-stop");
    assert!(stopped.success());
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while w.pve.guest(123).expect("kept")["status"] != "stopped" {
        assert!(
            std::time::Instant::now() < deadline,
            "PVE never saw 123 stop"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, out, err) = pct_exec(&w, 123, &["true"]);
    assert_eq!(
        (code, out.as_str(), err.as_str()),
        (Some(255), "", "container '123' not running!\n")
    );
}

/// Everything a real bed started is gone once its world is dropped, also when the test
/// panicked in the middle of a provision.
#[test]
fn nothing_of_a_real_bed_is_left_after_a_panic_mid_provision() {
    let Some(w) = real_world(&AgentOptions::default()) else {
        return;
    };
    let lxc_path = w.bed.lxc_path().display().to_string();
    let prefix = w.bed.net_prefix().expect("real bed").to_string();
    let monitor = format!("{lxc_path} -F -n 124");
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let mut child = w
            .command()
            .args([
                "--selftest=provision",
                "-vmid",
                "124",
                "--network",
                "stored",
                "--json",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("agent");
        // Until the container runs (its monitor holds the command socket).
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while processes_with_marker(&monitor).is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "the container never started"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        let _keep = &w;
        panic!("a test failing in the middle of a provision");
    }));
    assert!(outcome.is_err());
    assert_eq!(processes_with_marker(&lxc_path), vec![], "processes left");
    assert_eq!(
        links_with_prefix(&prefix),
        Vec::<String>::new(),
        "links left"
    );
    assert_eq!(
        cgroup_dirs(&prefix),
        Vec::<std::path::PathBuf>::new(),
        "cgroups left"
    );
    assert!(!std::path::Path::new(&lxc_path).exists(), "{lxc_path} left");
}

/// `--selftest=restore` on a real guest: the isolated copy is restored, booted (systemd runs
/// in it while its checks read it), checked and destroyed; afterwards nothing of it is left on
/// the machine: no LXC config, no root filesystem, no monitor, no link.
#[test]
fn restore_test_of_a_real_guest_restores_boots_checks_and_destroys_it() {
    let Some(w) = real_world(&AgentOptions::default()) else {
        return;
    };
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    // The one copy: of the backup of 200, the one pool guest with a backup.
    let doc = run.restore_copy();
    assert_eq!(doc["guest"], 200, "{doc:#}");
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    let vmid = doc["vmid"].as_u64().expect("vmid");
    let checks = doc["checks"].as_array().expect("checks");
    assert_eq!(checks.len(), 4, "{doc:#}");
    assert!(checks.iter().all(|c| c["status"] == "pass"), "{doc:#}");
    // It was started with no NIC (the start's record); that systemd ran in it while it was
    // checked, the pack's `systemd-runs` shows.
    let starts = w.pve.start_configs();
    let (_, config) = starts
        .iter()
        .find(|(v, _)| u64::from(*v) == vmid)
        .unwrap_or_else(|| panic!("{vmid} was never started: {starts:#?}"));
    assert!(!config.keys().any(|k| k.starts_with("net")), "{config:#?}");
    // And it is gone, with everything the bed made for it.
    let lxc_path = w.bed.lxc_path();
    assert!(!lxc_path.join(vmid.to_string()).exists());
    assert!(!w.bed.state_dir().join(vmid.to_string()).exists());
    let monitor = format!("{} -F -n {vmid}", lxc_path.display());
    assert_eq!(processes_with_marker(&monitor), vec![]);
    let prefix = w.bed.net_prefix().expect("real bed");
    assert_eq!(links_with_prefix(prefix), Vec::<String>::new());
}

/// A machine without LXC (here: a `PATH` without `lxc-*`): a test asking for real guests gets
/// a one-line reason and the busybox bed, and fails instead with `FELHOM_REQUIRE_REAL_GUESTS=1`.
#[test]
fn without_lxc_the_reason_is_printed_and_the_busybox_bed_used_unless_real_guests_are_required() {
    let bin = tempfile::tempdir().expect("tempdir");
    let mut linked = 0;
    for dir in ["/usr/local/bin", "/usr/bin", "/usr/sbin"] {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name();
            let text = name.to_string_lossy();
            if text.starts_with("lxc-") || bin.path().join(&name).exists() {
                continue;
            }
            if std::os::unix::fs::symlink(entry.path(), bin.path().join(&name)).is_ok() {
                linked += 1;
            }
        }
    }
    assert!(linked > 100, "{linked}");
    let probe = |require: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_real-bed-probe"));
        cmd.env("PATH", bin.path())
            .env_remove("FELHOM_TEST_REPORTS");
        match require {
            Some(v) => cmd.env("FELHOM_REQUIRE_REAL_GUESTS", v),
            None => cmd.env_remove("FELHOM_REQUIRE_REAL_GUESTS"),
        };
        cmd.output().expect("real-bed-probe")
    };
    let out = probe(None);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert_eq!(
        stdout.trim(),
        "busybox lxc-start is not installed (tests/setup.sh installs it)"
    );
    let said: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("no real guests here"))
        .collect();
    assert_eq!(
        said,
        ["no real guests here (lxc-start is not installed (tests/setup.sh installs it)): the busybox bed instead"],
        "{stderr}"
    );
    let out = probe(Some("1"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("lxc-start is not installed")
            && stderr.contains("FELHOM_REQUIRE_REAL_GUESTS=1"),
        "{stderr}"
    );
}
