//! `tests/demo.sh` proves itself: it exits 0 only when its full provision and its restore test
//! end `ok`, the restore test proving the backup of guest 200, the demo's one pool guest with
//! a backup (and every refusal it shows is refused), and it exits non-zero when a step that
//! should succeed fails: here, the exec helper unable to read the container's config because
//! the agent's `[exec] pve_nodes_dir` is left out; and a failed demo ends with the tails of the
//! logs that hold the cause (a container start the fake failed, named in the fake's log).
//!
//! The demo runs the agent binary under test (`FELHOM_AGENT_BIN`), never a build of its own:
//! a plain `cargo build -p felhom-agent` would replace the test binary under the other tests.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use felhom_tests::agent::agent_bin;
use felhom_tests::fakepve::{fakepve_python, workspace_root};
use felhom_tests::reach::{http_as_uid, run_as_uid};

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
    // The demo's one pool guest with a backup (200): one copy, its backup proven.
    let (body, rc) = step(&stdout, "--selftest=restore");
    assert_eq!(rc, 0, "{stdout}");
    assert!(
        body.iter().any(|l| l.starts_with("guest 200")
            && l.contains(": backup local:backup/vzdump-lxc-200-")
            && l.ends_with(": ok")),
        "the restore test did not end ok:\n{}",
        body.join("\n")
    );
    assert!(
        body.iter().any(|l| l.starts_with("restore test run ")
            && l.contains(": 1 due, 1 copies, 1 proven, 0 failed, 0 left;")),
        "the restore test run did not prove the one due backup:\n{}",
        body.join("\n")
    );
    assert!(
        stdout
            .lines()
            .any(|l| l == "felhom_restore_test_outcome{outcome=\"ok\"} 1"),
        "the restore test's metrics file does not say ok:\n{stdout}"
    );
    assert!(
        stdout
            .lines()
            .any(|l| l == "felhom_backup_status{vmid=\"200\",status=\"proven\"} 1"),
        "the coverage metrics do not say guest 200's backup is proven:\n{stdout}"
    );
}

/// A copy of the demo beside it, removed when dropped.
struct ScriptCopy(PathBuf);

impl Drop for ScriptCopy {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// The text of `tests/demo.sh`.
fn demo_text() -> String {
    fs::read_to_string(workspace_root().join("tests/demo.sh")).expect("read tests/demo.sh")
}

/// Runs `broken`, a changed demo, as a copy beside the demo (`tests/.demo-<name>-<pid>.sh`,
/// removed after) on the busybox bed, and checks that it failed (exit 1) with its provision
/// failed: its stdout and stderr.
fn run_failing_demo(name: &str, broken: String) -> (String, String) {
    let copy =
        ScriptCopy(workspace_root().join(format!("tests/.demo-{name}-{}.sh", std::process::id())));
    fs::write(&copy.0, broken).expect("write the demo's copy");
    let out = run_demo_env(&copy.0, &[("FELHOM_DEMO_GUESTS", "busybox")]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(1),
        "the demo did not fail:\n{stdout}\n--- stderr\n{stderr}"
    );
    let (_, rc) = step(&stdout, "--selftest=provision -vmid 120");
    assert_ne!(rc, 0, "{stdout}");
    (stdout, stderr)
}

#[test]
fn demo_fails_when_the_exec_helper_cannot_read_the_container_config() {
    let text = demo_text();
    // The agent's config without `[exec] pve_nodes_dir`: the helper looks in /etc/pve/nodes,
    // finds no config for the container and runs nothing in it.
    let broken: String = text
        .lines()
        .filter(|l| !l.starts_with("pve_nodes_dir = "))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(broken, text, "tests/demo.sh no longer sets pve_nodes_dir");
    // The busybox bed: the failure shown is the helper's, before any guest runs a command, and
    // a real guest would only add a minute.
    let (_, stderr) = run_failing_demo("no-nodes-dir", broken);
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

/// The text after the line that starts with `header` in `text`, up to the next `== ` header
/// line (one log's tail as the demo prints it).
fn section<'a>(text: &'a str, header: &str) -> Option<&'a str> {
    let start = text.find(&format!("\n{header}"))? + 1;
    let body = &text[start..];
    let body = &body[body.find('\n').map_or(body.len(), |i| i + 1)..];
    Some(match body.find("\n== ") {
        Some(end) => &body[..end],
        None => body,
    })
}

/// A failed step is explained by the logs the demo prints: here the fake fails the start task
/// of the provision's container (PVE's own in-task error "missing 'rootfs' configuration"),
/// and the demo's failure ends with the tail of the fake's log, which names that task and why
/// it failed, and of the exec helper's; on the busybox bed it says no container start log
/// exists.
#[test]
fn a_failed_demo_prints_the_tail_of_the_fakes_log_that_holds_the_cause() {
    let text = demo_text();
    let anchor = r#"scenario["user_cfg"] = {"path": work + "/user.cfg"}"#;
    assert!(
        text.contains(anchor),
        "tests/demo.sh no longer writes the scenario's user_cfg"
    );
    let broken = text.replace(
        anchor,
        &format!(
            "{anchor}\nscenario[\"fail\"] = [{{\"method\": \"POST\", \"suffix\": \
             \"/nodes/pve1/lxc/120/status/start\", \"error\": \"missing_rootfs_configuration\"}}]"
        ),
    );
    let (_, stderr) = run_failing_demo("start-fails", broken);
    let (_, summary) = stderr
        .split_once("demo FAILED")
        .unwrap_or_else(|| panic!("no failure summary:\n{stderr}"));
    assert!(
        summary.contains("felhom-agent --selftest=provision -vmid 120 exited"),
        "{summary}"
    );
    let fake = section(summary, "== the fake PVE's log: ")
        .unwrap_or_else(|| panic!("the fake's log is not printed:\n{summary}"));
    // The fake's own line (its log format), naming the task and its error.
    assert!(
        fake.lines().any(|l| l.starts_with("fakepve-scenario[")
            && l.contains(" WARNING fakepve-scenario: task vzstart 120 by ")
            && l.ends_with(" failed: missing 'rootfs' configuration")),
        "the fake's log tail does not name the failed start:\n{fake}"
    );
    assert!(
        (1..=40).contains(&fake.lines().count()),
        "not a tail of at most 40 lines:\n{fake}"
    );
    let helper = section(summary, "== the exec helper's log: ")
        .unwrap_or_else(|| panic!("the exec helper's log is not printed:\n{summary}"));
    assert!((1..=40).contains(&helper.lines().count()), "{summary}");
    assert!(
        summary.contains("== no container start log: no real LXC container was started"),
        "{summary}"
    );
}

/// Every process whose command line names `needle` (the playground's work folder).
fn processes_naming(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in fs::read_dir("/proc").expect("/proc").flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(cmdline) = fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if text.contains(needle) {
            found.push(format!("{name}: {text}"));
        }
    }
    found
}

#[test]
fn the_playground_as_typed_in_the_readme_serves_the_commands_then_ctrl_c_leaves_nothing() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::CommandExt;
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    // The command as the README gives it, run as root (the test is).
    let readme = fs::read_to_string(workspace_root().join("README.md")).expect("README.md");
    let typed = readme
        .split('`')
        .find(|span| span.contains("tests/demo.sh --playground"))
        .expect("the README names the playground command");
    assert_eq!(typed, "sudo tests/demo.sh --playground");
    let argv: Vec<&str> = typed.split_whitespace().skip(1).collect();
    // The busybox bed: the commands are the point here, a real guest would add a minute.
    // Its own process group, as a terminal's foreground job: Ctrl-C is SIGINT to the group.
    let mut child = Command::new(argv[0])
        .args(&argv[1..])
        .process_group(0)
        .current_dir(workspace_root())
        .env("FELHOM_AGENT_BIN", agent_bin())
        .env("FELHOM_FAKEPVE_PYTHON", fakepve_python())
        .env("FELHOM_DEMO_GUESTS", "busybox")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the playground");
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    // A failed assertion below must not leave the root-run fake and helper behind: Ctrl-C to
    // the playground's group as the test unwinds, unless the playground already ended.
    struct CtrlCOnDrop(Option<nix::unistd::Pid>);
    impl Drop for CtrlCOnDrop {
        fn drop(&mut self) {
            if let Some(group) = self.0 {
                let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGINT);
            }
        }
    }
    let mut ctrl_c = CtrlCOnDrop(Some(pid));
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let out = child.stdout.take().expect("stdout");
    let lines_tx = tx.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let err = child.stderr.take().expect("stderr");
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut BufReader::new(err), &mut s);
        s
    });
    drop(tx);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = String::new();
    let env_file = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                seen.push_str(&line);
                seen.push('\n');
                if let Some(path) = line.strip_prefix("playground ready: ") {
                    break PathBuf::from(path);
                }
            }
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "the playground never got ready:\n{seen}\n--- stderr\n{}",
                    stderr.join().unwrap_or_default()
                );
            }
        }
    };
    let work = env_file.parent().expect("work folder").to_path_buf();
    let work_text = work.to_string_lossy().to_string();
    assert!(
        seen.contains(&format!(
            "export FELHOM_AGENT_CONFIG={work_text}/agent.toml"
        )) && seen.contains(&format!("export PATH={work_text}/bin:$PATH")),
        "{seen}"
    );
    // What an operator types in another shell after sourcing what it printed.
    let shell = |cmd: &str| -> (Option<i32>, String) {
        let out = Command::new("bash")
            .arg("-c")
            .arg(format!("source '{}' && {cmd}", env_file.display()))
            .env_remove("FELHOM_AGENT_CONFIG")
            .env_remove("FELHOM_AGENT_BIN")
            .current_dir("/")
            .output()
            .expect("bash");
        (
            out.status.code(),
            format!(
                "{}\n--- stderr\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let (code, out) = shell("command -v pct felhom-agent");
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.starts_with(&format!(
            "{work_text}/bin/pct\n{work_text}/bin/felhom-agent\n"
        )),
        "{out}"
    );
    for (cmd, want) in [
        ("felhom-agent doctor", 0),
        ("felhom-agent guests", 0),
        ("felhom-agent --selftest=provision -vmid 130", 0),
        ("felhom-agent --selftest=provision -vmid 131 --keep", 0),
        ("felhom-agent journal", 0),
        ("felhom-agent destroy -vmid 131", 0),
        ("felhom-agent vmid-check 131", 0),
    ] {
        let (code, out) = shell(cmd);
        assert_eq!(code, Some(want), "{cmd}:\n{out}");
    }
    let (_, journal) = shell("felhom-agent journal");
    assert!(journal.contains("destroy"), "{journal}");

    // Another local user (uid 65534) gets nothing from the playground's fake, which runs as
    // root: its control endpoint refuses a request without the secret (pointing the guest
    // bed's monitor at a program of that user's, then starting a container), and the files
    // with secrets cannot be read.
    let control = seen
        .lines()
        .find_map(|l| l.strip_prefix("control endpoint: http://"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("the playground names its control endpoint:\n{seen}"))
        .to_string();
    for (path, body) in [
        (
            "/set",
            format!(
                r#"{{"guest_bed": {{"lxc_path": "{work_text}/lxc", "monitor": "/tmp/mine"}}}}"#
            ),
        ),
        (
            "/guest",
            r#"{"vmid": 200, "set": {"status": "running"}}"#.to_string(),
        ),
        ("/shutdown", "{}".to_string()),
    ] {
        let (status, answer) = http_as_uid(65534, &control, "POST", path, None, &body);
        assert!(
            status.starts_with("HTTP/1.1 401 "),
            "uid 65534's POST {path} to the playground's fake: {status:?} {answer}"
        );
    }
    for file in [
        "scenario.json",
        "pve-token",
        "certs/control.secret",
        "certs/fakepve.key",
    ] {
        let path = work.join(file);
        assert!(path.exists(), "{}", path.display());
        let (code, out, err) = run_as_uid(65534, "cat", &[&path.to_string_lossy()]);
        assert!(
            code != Some(0) && out.is_empty() && err.contains("Permission denied"),
            "uid 65534 read {}: {code:?} {err}",
            path.display()
        );
    }
    let (code, out) = shell("felhom-agent guests");
    assert_eq!(
        code,
        Some(0),
        "the fake still serves after the refused shutdown:\n{out}"
    );

    // Ctrl-C: everything goes, the script ends 0.
    assert!(
        !processes_naming(&work_text).is_empty(),
        "the fake and the helper run"
    );
    nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGINT).expect("SIGINT");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            ctrl_c.0 = None;
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the playground did not end after Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = stderr.join().unwrap_or_default();
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(!work.exists(), "{} is left", work.display());
    let left = processes_naming(&work_text);
    assert!(left.is_empty(), "left running: {left:#?}");
}
