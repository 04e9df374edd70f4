//! The agent's user cannot bind an abstract socket in the node's network namespace from the
//! daemon's or the restore test's unit: both refuse `bind(2)` and `listen(2)` (and io_uring,
//! whose bind and listen bypass the filter) with a seccomp filter
//! (`SystemCallFilter=~bind listen io_uring_*`, `SystemCallErrorNumber=EPERM`).
//!
//! systemd is not PID 1 where the tests run, so the units themselves cannot be started: the
//! test reads their filter lines and applies exactly those syscalls the way systemd does
//! (no_new_privs, then a seccomp filter answering EPERM; `tests/pct/seccomp-run`). The squat of
//! a stopped container's LXC command socket by uid 65534 (`tests/pct/lxc-monitor`, the same
//! name and command line as root's monitor) succeeds on this machine without the filter and is
//! refused with it; and the agent itself, under the same filter, runs a whole provision (its
//! execs through the exec helper), so it needs neither call.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use felhom_agent::guest::lxc_monitor::{check_monitor, Monitor};
use felhom_tests::guestbed::{lxc_monitor_stand_in, repo_root};
use felhom_tests::reach::ReachableCopy;
use felhom_tests::world::World;

/// What the filter must refuse.
const MUST_DENY: &[&str] = &[
    "bind",
    "listen",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
];

fn seccomp_run() -> PathBuf {
    repo_root().join("tests/pct/seccomp-run")
}

/// The syscalls a unit file's `SystemCallFilter=~…` lines refuse by name (groups, `@…`, left
/// out), and whether it refuses with EPERM.
fn unit_denies(unit: &str) -> (BTreeSet<String>, bool) {
    let path = repo_root().join("systemd").join(unit);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut denied = BTreeSet::new();
    let mut eperm = false;
    for line in text.lines().map(str::trim) {
        if let Some(v) = line.strip_prefix("SystemCallFilter=~") {
            denied.extend(
                v.split_whitespace()
                    .filter(|n| !n.starts_with('@'))
                    .map(str::to_string),
            );
        }
        if line == "SystemCallErrorNumber=EPERM" {
            eperm = true;
        }
    }
    (denied, eperm)
}

/// Bind `@<lxc_path>/<vmid>/command` as uid 65534 through the LXC monitor stand-in (a copy that
/// uid can read: the checkout may sit below a folder only root may enter), under the deny list
/// `deny` (none: no filter): what it printed, its exit status; a listener that started is
/// killed after the check.
fn squat(lxc_path: &Path, vmid: u32, deny: Option<&BTreeSet<String>>) -> (String, Option<i32>) {
    let script = ReachableCopy::new(&lxc_monitor_stand_in());
    let mut cmd = Command::new("python3");
    cmd.arg(seccomp_run());
    if let Some(deny) = deny {
        cmd.arg("--deny")
            .arg(deny.iter().cloned().collect::<Vec<_>>().join(","));
    }
    cmd.args(["--uid", "65534", "--", "perl"])
        .arg(script.path())
        .arg(lxc_path)
        .arg(vmid.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd.spawn().expect("seccomp-run");
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        use std::io::BufRead;
        let _ = std::io::BufReader::new(out).read_line(&mut line);
    }
    let listening = check_monitor(lxc_path, vmid);
    let _ = child.kill();
    let status = child.wait().expect("wait");
    if line.trim() == "ready" {
        assert!(
            matches!(listening, Monitor::Untrusted(ref d) if d.contains("uid 65534")),
            "{listening:?}"
        );
    } else {
        assert_eq!(listening, Monitor::Absent, "nobody may hold the name");
    }
    (line.trim().to_string(), status.code())
}

#[test]
fn the_daemon_and_restore_test_units_refuse_the_squat_of_a_containers_command_socket() {
    let lxc = tempfile::Builder::new()
        .prefix("felhom-lxc-")
        .tempdir()
        .expect("tempdir");
    // This machine lets uid 65534 bind the name of a container nobody runs.
    let (line, _) = squat(lxc.path(), 170, None);
    assert_eq!(
        line, "ready",
        "the squat needs no privilege on this machine"
    );
    for unit in ["felhom-agent.service", "felhom-restore-test.service"] {
        let (denied, eperm) = unit_denies(unit);
        assert!(eperm, "{unit}: SystemCallErrorNumber=EPERM");
        for s in MUST_DENY {
            assert!(
                denied.contains(*s),
                "{unit} does not refuse {s}: {denied:?}"
            );
        }
        let (line, _) = squat(lxc.path(), 170, Some(&denied));
        assert_eq!(
            line, "refused: Operation not permitted",
            "{unit}: the squat under the unit's filter"
        );
    }
}

#[test]
fn the_agent_runs_a_whole_provision_under_the_units_filter() {
    let (denied, _) = unit_denies("felhom-agent.service");
    let w = World::demo();
    let mut probe = w.command();
    let program = PathBuf::from(probe.get_program());
    let args: Vec<_> = probe.get_args().map(ToOwned::to_owned).collect();
    let envs: Vec<_> = probe
        .get_envs()
        .map(|(k, v)| (k.to_owned(), v.map(ToOwned::to_owned)))
        .collect();
    let _ = probe.stdin(Stdio::null());
    let mut cmd = Command::new("python3");
    cmd.arg(seccomp_run())
        .arg("--deny")
        .arg(denied.iter().cloned().collect::<Vec<_>>().join(","))
        .arg("--")
        .arg(program)
        .args(args)
        .args(["--selftest=provision", "-vmid", "171", "--json"]);
    for (k, v) in envs {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let out = cmd.output().expect("the agent under seccomp-run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_str(&stdout).expect("json");
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert!(w.assert_pct_only_from_helper() > 0);
}

#[test]
fn doctor_says_whether_the_units_of_the_agents_user_refuse_abstract_sockets() {
    let w = World::demo();
    let doc = w.agent(&["doctor", "--json"]).json();
    let check = doc["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["name"] == "abstract_sockets")
        .cloned()
        .unwrap_or_else(|| panic!("no abstract_sockets check: {doc:#}"));
    // No systemd as PID 1 here (or no such units loaded): doctor cannot confirm the filter, and
    // says so with what to do; a warning, the exec helper's own check still stands.
    assert_eq!(check["status"], "warn", "{check:#}");
    let msg = check["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("felhom-agent.service")
            && msg.contains("felhom-restore-test.service")
            && msg.contains("SystemCallFilter=~bind listen")
            && msg.contains("exec_monitor_untrusted"),
        "{msg}"
    );
}

/// A fake `systemctl` in `dir` that shows the units' filter as the packaged units have it and
/// `SystemCallArchitectures=` as `archs`, answering both the `-p A -p B` form and
/// `-p SystemCallFilter --value`.
fn fake_systemctl(dir: &Path, archs: &str) {
    use std::os::unix::fs::PermissionsExt;
    let filter = "~bind io_uring_enter io_uring_register io_uring_setup listen";
    let script = format!(
        "#!/bin/sh\ncase \"$*\" in\n  *--value*) echo '{filter}' ;;\n  show*) printf 'SystemCallFilter={filter}\\nSystemCallArchitectures={archs}\\n' ;;\n  is-enabled*) echo masked ;;\nesac\n"
    );
    let path = dir.join("systemctl");
    std::fs::write(&path, script).expect("write systemctl");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

#[test]
fn doctor_warns_when_a_drop_in_resets_system_call_architectures() {
    let w = World::demo();
    let bin = tempfile::tempdir().expect("tempdir");
    let run = |archs: &str| {
        fake_systemctl(bin.path(), archs);
        let mut cmd = w.command();
        cmd.env("PATH", format!("{}:{}", bin.path().display(), w.path()))
            .args(["doctor", "--json"]);
        let out = cmd.output().expect("doctor");
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        doc["checks"]
            .as_array()
            .expect("checks")
            .iter()
            .find(|c| c["name"] == "abstract_sockets")
            .cloned()
            .unwrap_or_else(|| panic!("no abstract_sockets check: {doc:#}"))
    };
    let check = run("native");
    assert_eq!(check["status"], "pass", "{check:#}");
    // `SystemCallArchitectures=` in a drop-in resets the list: every architecture's calls.
    let check = run("");
    assert_eq!(check["status"], "warn", "{check:#}");
    let msg = check["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("felhom-agent.service: SystemCallArchitectures is empty")
            && msg.contains("SystemCallArchitectures=native"),
        "{msg}"
    );
    let check = run("native x86");
    assert_eq!(check["status"], "warn", "{check:#}");
}
