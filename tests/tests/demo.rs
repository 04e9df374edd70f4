//! `tests/demo.sh` proves itself: it exits 0 only when its full provision and its restore test
//! end `ok` (and every refusal it shows is refused), and it exits non-zero when a step that
//! should succeed fails: here, the exec helper unable to read the container's config because
//! the agent's `[exec] pve_nodes_dir` is left out.
//!
//! The demo runs the agent binary under test (`FELHOM_AGENT_BIN`), never a build of its own:
//! a plain `cargo build -p felhom-agent` would replace the test binary under the other tests.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use felhom_tests::agent::agent_bin;
use felhom_tests::fakepve::{fakepve_python, workspace_root};

fn run_demo(script: &Path) -> Output {
    run_demo_env(script, &[])
}

fn run_demo_env(script: &Path, env: &[(&str, &str)]) -> Output {
    Command::new("bash")
        .arg(script)
        .envs(env.iter().copied())
        .current_dir(workspace_root())
        .env("FELHOM_AGENT_BIN", agent_bin())
        .env("FELHOM_FAKEPVE_PYTHON", fakepve_python())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()))
}

/// The lines after the `$ felhom-agent <cmd>` line up to its `(exit N)` line, and N.
fn step<'a>(stdout: &'a str, cmd: &str) -> (Vec<&'a str>, i32) {
    let header = format!("$ felhom-agent {cmd}");
    let mut lines = stdout.lines().skip_while(|l| *l != header);
    assert!(
        lines.next().is_some(),
        "the demo never ran `{cmd}`:\n{stdout}"
    );
    let mut body = Vec::new();
    for l in lines {
        if let Some(rc) = l.strip_prefix("(exit ").and_then(|r| r.strip_suffix(')')) {
            return (body, rc.parse().expect("exit status"));
        }
        body.push(l);
    }
    panic!("`{cmd}` has no exit line in the demo's output:\n{stdout}");
}

#[test]
fn demo_exits_zero_with_provision_and_restore_test_ok() {
    let out = run_demo(&workspace_root().join("tests/demo.sh"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "the demo failed:\n{stdout}\n--- stderr\n{stderr}"
    );
    // Real guests where LXC runs (the demo's first line says which bed it used).
    let real = stdout
        .lines()
        .any(|l| l.starts_with("guests: real LXC containers"));
    if real {
        felhom_tests::report("real guests: demo_exits_zero_with_provision_and_restore_test_ok");
        assert!(
            stdout.contains("guest 121: its container, root filesystem and LXC config are gone"),
            "{stdout}"
        );
    } else {
        assert!(
            !felhom_tests::guestbed::require_real_guests(),
            "the demo ran on the busybox bed with FELHOM_REQUIRE_REAL_GUESTS=1:\n{stdout}"
        );
    }
    // What the agent itself printed, not what the demo concluded.
    let (body, rc) = step(&stdout, "--selftest=provision -vmid 120");
    assert_eq!(rc, 0, "{stdout}");
    assert!(
        body.iter().any(|l| l.starts_with("transaction ")
            && l.contains("(selftest-provision) vmid 120: ok in phase destroyed")),
        "the provision did not end ok:\n{}",
        body.join("\n")
    );
    let (body, rc) = step(&stdout, "--selftest=restore");
    assert_eq!(rc, 0, "{stdout}");
    assert!(
        body.iter()
            .any(|l| l.starts_with("restore test of ") && l.ends_with(": ok")),
        "the restore test did not end ok:\n{}",
        body.join("\n")
    );
    assert!(
        stdout
            .lines()
            .any(|l| l == "felhom_restore_test_outcome{outcome=\"ok\"} 1"),
        "the restore test's metrics file does not say ok:\n{stdout}"
    );
}

/// A copy of the demo beside it, removed when dropped.
struct ScriptCopy(PathBuf);

impl Drop for ScriptCopy {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

#[test]
fn demo_fails_when_the_exec_helper_cannot_read_the_container_config() {
    let demo = workspace_root().join("tests/demo.sh");
    let text = fs::read_to_string(&demo).expect("read tests/demo.sh");
    // The agent's config without `[exec] pve_nodes_dir`: the helper looks in /etc/pve/nodes,
    // finds no config for the container and runs nothing in it.
    let broken: String = text
        .lines()
        .filter(|l| !l.starts_with("pve_nodes_dir = "))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(broken, text, "tests/demo.sh no longer sets pve_nodes_dir");
    let copy = ScriptCopy(workspace_root().join(format!(
        "tests/.demo-no-nodes-dir-{}.sh",
        std::process::id()
    )));
    fs::write(&copy.0, broken).expect("write the demo's copy");
    // The busybox bed: the failure shown is the helper's, before any guest runs a command, and
    // a real guest would only add a minute.
    let out = run_demo_env(&copy.0, &[("FELHOM_DEMO_GUESTS", "busybox")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "the demo did not fail:\n{stdout}\n--- stderr\n{stderr}"
    );
    let (_, rc) = step(&stdout, "--selftest=provision -vmid 120");
    assert_ne!(rc, 0, "{stdout}");
    // The agent's error line (on stderr) names the helper's refusal.
    assert!(
        stderr.contains("exec_guest_privileged") && stderr.contains("pve_nodes_dir"),
        "the provision failed for another reason:\n{stderr}"
    );
    assert!(
        stderr.contains("felhom-agent --selftest=provision -vmid 120 exited 5, expected 0")
            && stderr.contains("felhom-agent --selftest=restore exited 5, expected 0")
            && stderr.contains("the restore test did not end ok"),
        "the demo does not name the steps that failed:\n{stderr}"
    );
}
