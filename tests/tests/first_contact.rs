//! What a new operator meets first, on the test bed: a failure of the environment (PVE not
//! answering, a wrong certificate pin, the exec helper down) is exit 6 with its own code,
//! found by the preflight before any write and journaling nothing; `vmid-check` of a pool
//! guest says it cannot tell when PVE does not answer; a backup that does not exist is
//! `backup_missing` whatever the token's ACLs; `destroy` of a vmid where no guest exists is
//! not "needs a human"; and error lines go to stderr, results to stdout.

use std::fs;
use std::net::TcpListener;

use felhom_tests::agent::AgentRun;
use felhom_tests::fakepve::toml_string;
use felhom_tests::world::World;

/// Replace one line of `agent.toml` that starts with `key = `.
fn set_config_line(w: &World, key: &str, value: &str) {
    let text = w.files.config_text();
    let prefix = format!("{key} = ");
    let mut found = false;
    let new: String = text
        .lines()
        .map(|l| {
            if l.starts_with(&prefix) && !found {
                found = true;
                format!("{prefix}{value}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    assert!(found, "agent.toml has no {key}:\n{text}");
    fs::write(&w.files.config_path, new).expect("write agent.toml");
}

/// An https URL on loopback where nothing listens (a port bound, then released).
fn closed_url(w: &World) -> String {
    let l = TcpListener::bind((w.pve.host(), 0)).expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    format!("https://{}:{port}", w.pve.host())
}

/// Files in the state folder's journal (the agent's own record of transactions), counted on
/// disk.
fn journal_files(w: &World) -> Vec<String> {
    let dir = w.state_dir().join("journal");
    let Ok(rd) = fs::read_dir(&dir) else {
        return Vec::new();
    };
    rd.filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect()
}

/// Outbox bytes: what a command line run spooled for the hub.
fn outbox_bytes(w: &World) -> u64 {
    let dir = w.state_dir().join("outbox");
    let Ok(rd) = fs::read_dir(&dir) else {
        return 0;
    };
    rd.filter_map(Result::ok)
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

fn assert_environment(run: &AgentRun, code: &str, names: &[&str]) {
    assert_eq!(
        run.code,
        Some(6),
        "stdout:\n{}\nstderr:\n{}",
        run.stdout,
        run.stderr
    );
    let line = format!("error [{code}]");
    assert!(
        run.stderr.contains(&line),
        "the error line {line:?} is on stderr:\nstdout:\n{}\nstderr:\n{}",
        run.stdout,
        run.stderr
    );
    assert!(
        !run.stdout.contains("error ["),
        "no error line on stdout:\n{}",
        run.stdout
    );
    for n in names {
        assert!(
            run.stderr.contains(n),
            "the error names {n:?}:\n{}",
            run.stderr
        );
    }
}

#[test]
fn pve_unreachable_is_exit_6_with_its_code_and_journals_nothing() {
    let w = World::demo();
    let url = closed_url(&w);
    set_config_line(&w, "url", &toml_string(&url));
    for args in [
        &["--selftest=provision", "-vmid", "120"][..],
        &["--selftest=provision", "-vmid", "120", "--dry-run"][..],
        &["--selftest=restore"][..],
    ] {
        let run = w.agent(args);
        assert_environment(&run, "pve_unreachable", &[&url]);
    }
    assert!(journal_files(&w).is_empty(), "{:?}", journal_files(&w));
    assert_eq!(outbox_bytes(&w), 0, "nothing spooled for the hub");
    assert!(w.pve.requests().is_empty(), "{:?}", w.pve.requests());
}

#[test]
fn a_wrong_pin_is_exit_6_tls_pin_mismatch_and_journals_nothing() {
    let w = World::demo();
    set_config_line(&w, "tls_fingerprint", &toml_string(&"ab".repeat(32)));
    let run = w.agent(&["--selftest=provision", "-vmid", "120"]);
    assert_environment(&run, "tls_pin_mismatch", &[]);
    let run = w.agent(&["--selftest=restore"]);
    assert_environment(&run, "tls_pin_mismatch", &[]);
    assert!(journal_files(&w).is_empty(), "{:?}", journal_files(&w));
    assert_eq!(outbox_bytes(&w), 0, "nothing spooled for the hub");
    // The handshake failed before any request reached the fake's API.
    assert!(w.pve.requests().is_empty(), "{:?}", w.pve.requests());
}

#[test]
fn the_exec_helper_down_is_found_before_the_restore() {
    let mut w = World::demo();
    drop(w.helper.take());
    let run = w.agent(&["--selftest=provision", "-vmid", "120"]);
    assert_environment(&run, "exec_helper_unavailable", &["exec.sock"]);
    assert!(w.pve.writes().is_empty(), "{:?}", w.pve.writes());
    assert!(journal_files(&w).is_empty(), "{:?}", journal_files(&w));
}

#[test]
fn vmid_check_of_a_pool_guest_with_pve_unreachable_cannot_tell() {
    let w = World::demo();
    // 200 is a pool guest: only PVE can say whether it is the pool's.
    let run = w.agent(&["vmid-check", "200"]);
    assert_eq!(run.code, Some(3), "{}\n{}", run.stdout, run.stderr);
    set_config_line(&w, "url", &toml_string(&closed_url(&w)));
    let run = w.agent(&["vmid-check", "200"]);
    assert_environment(&run, "pve_unreachable", &["200"]);
    assert!(
        run.stderr.contains("cannot be told") && !run.stderr.contains("token cannot see"),
        "a pool guest is not called foreign when PVE does not answer:\n{}\n{}",
        run.stdout,
        run.stderr
    );
    // A vmid the full list does not hold needs no PVE: still free.
    let run = w.agent(&["vmid-check", "120"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
}

#[test]
fn a_mistyped_backup_is_backup_missing_whatever_the_acls() {
    let w = World::demo();
    // vmid 999 has no guest and the token holds nothing on /vms/999: PVE's listing hides a
    // backup it may not read, and one that does not exist, alike.
    let missing = "local:backup/vzdump-lxc-999-2026_01_01-00_00_00.tar.zst";
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        "120",
        "--from",
        missing,
        "--json",
    ]);
    let doc = run.json();
    assert_eq!(run.code, Some(3), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["error"]["code"], "backup_missing", "{doc:#}");
    assert!(
        doc["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(missing) && m.contains("does not exist")),
        "{doc:#}"
    );
    assert!(w.pve.writes().is_empty(), "{:?}", w.pve.writes());
}

#[test]
fn destroy_of_a_vmid_without_a_guest_is_not_needs_human() {
    let w = World::demo();
    let run = w.agent(&["destroy", "-vmid", "4321"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("nothing to destroy") && run.stdout.contains("4321"),
        "{}",
        run.stdout
    );
    assert!(w.pve.writes().is_empty(), "{:?}", w.pve.writes());
}

#[test]
fn a_refusal_goes_to_stderr_and_the_result_to_stdout() {
    let w = World::demo();
    // 101 is a foreign container: refused before any write.
    let run = w.agent(&["--selftest=provision", "-vmid", "101"]);
    assert_eq!(run.code, Some(3), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stderr.contains("error [vmid_in_use]"),
        "stderr:\n{}",
        run.stderr
    );
    assert!(!run.stdout.contains("error ["), "stdout:\n{}", run.stdout);
    assert!(
        run.stdout.contains("vmid 101: refused"),
        "the result stays on stdout:\n{}",
        run.stdout
    );
}

#[test]
fn doctor_lists_the_checks_that_need_pve_as_skipped_and_checks_free_space() {
    let w = World::demo();
    set_config_line(&w, "url", &toml_string(&closed_url(&w)));
    let run = w.agent(&["doctor", "--json"]);
    assert_eq!(run.code, Some(6), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    let checks = doc["checks"].as_array().expect("checks");
    let status = |name: &str| {
        checks
            .iter()
            .find(|c| c["name"] == name)
            .map(|c| c["status"].as_str().unwrap_or("").to_string())
            .unwrap_or_else(|| panic!("doctor lists no {name} check: {doc:#}"))
    };
    assert_eq!(status("pve_tls"), "fail", "{doc:#}");
    for name in ["pve_token", "pve_version", "privileges", "pool"] {
        assert_eq!(status(name), "skipped", "{name}: {doc:#}");
    }
    assert_eq!(status("state_space"), "pass", "{doc:#}");
}

#[test]
fn a_token_file_of_two_lines_is_token_file_invalid_not_a_tls_failure() {
    let w = World::demo();
    let secret = w.pve.token_secret();
    let (a, b) = secret.split_at(8);
    fs::write(&w.files.token_secret_file, format!("{a}\n{b}\n")).expect("write the token file");
    let run = w.agent(&["--selftest=provision", "-vmid", "120"]);
    assert_environment(&run, "token_file_invalid", &["holds 2 lines"]);
    assert!(!run.stderr.contains(&secret) && !run.stderr.contains(b));
    let run = w.agent(&["doctor"]);
    assert_eq!(run.code, Some(6), "{}\n{}", run.stdout, run.stderr);
    // The human report wraps a long message at 80 columns, where the file's path (as long as
    // the folder the tests run in) puts the break: the words are read across line ends.
    let words = run.stdout.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        words.contains("token_file_invalid") || words.contains("holds 2 lines"),
        "{}",
        run.stdout
    );
    assert!(w.pve.requests().is_empty(), "{:?}", w.pve.requests());
}

/// Both units that load the hub token start on a node without one: `SetCredential=` with the
/// same name is `LoadCredential=`'s default when the file cannot be read (systemd.exec(5),
/// "SetCredential="); `systemd-analyze verify`, where it runs, accepts the lines.
#[test]
fn the_units_start_on_a_node_without_a_hub_token() {
    let dir = felhom_tests::fakepve::workspace_root().join("systemd");
    let units = ["felhom-agent.service", "felhom-restore-test.service"];
    for u in units {
        let text = fs::read_to_string(dir.join(u)).expect("read unit");
        let lines: Vec<&str> = text.lines().collect();
        let load = lines
            .iter()
            .position(|l| l.starts_with("LoadCredential=hub-token:"))
            .unwrap_or_else(|| panic!("{u} loads no hub-token"));
        assert!(
            lines[load..].contains(&"SetCredential=hub-token:absent"),
            "{u}: no SetCredential=hub-token:absent after its LoadCredential=hub-token"
        );
    }
    let Ok(out) = std::process::Command::new("systemd-analyze")
        .arg("--version")
        .output()
    else {
        eprintln!("systemd-analyze is not installed: the unit syntax is not verified here");
        return;
    };
    assert!(out.status.success());
    let root = tempfile::tempdir().expect("tmp");
    let sys = root.path().join("etc/systemd/system");
    fs::create_dir_all(&sys).expect("mkdir");
    fs::create_dir_all(root.path().join("usr/bin")).expect("mkdir");
    let bin = root.path().join("usr/bin/felhom-agent");
    fs::write(&bin, "#!/bin/sh\n").expect("stub");
    std::process::Command::new("chmod")
        .arg("755")
        .arg(&bin)
        .status()
        .expect("chmod");
    let mut args = vec![
        "verify".to_string(),
        "--man=no".to_string(),
        format!("--root={}", root.path().display()),
    ];
    for u in units {
        fs::copy(dir.join(u), sys.join(u)).expect("copy unit");
        args.push(sys.join(u).display().to_string());
    }
    let out = std::process::Command::new("systemd-analyze")
        .args(&args)
        .output()
        .expect("systemd-analyze verify");
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    // Without a booted system in the root, verify cannot load sysinit.target; anything else
    // (an unknown key, a value systemd refuses) is a message about the units themselves.
    let about_units: Vec<&str> = text
        .lines()
        .filter(|l| !l.contains("sysinit.target") && !l.trim().is_empty())
        .collect();
    assert!(about_units.is_empty(), "systemd-analyze verify:\n{text}");
}

#[test]
fn a_dry_run_creates_no_folder_and_a_negative_vmid_names_the_vmid() {
    let w = World::demo();
    // A state folder that does not exist yet: the dry run must not make it.
    let fresh = w.files.dir().join("state-not-yet");
    set_config_line(&w, "state_dir", &toml_string(&fresh.display().to_string()));
    for args in [
        &["--selftest=provision", "-vmid", "140", "--dry-run"][..],
        &["--selftest=restore", "--dry-run"][..],
    ] {
        let run = w.agent(args);
        assert_eq!(
            run.code,
            Some(0),
            "{args:?}\n{}\n{}",
            run.stdout,
            run.stderr
        );
        assert!(
            !fresh.exists(),
            "{args:?}: the dry run made {} ({:?})",
            fresh.display(),
            fs::read_dir(&fresh).map(|d| d
                .filter_map(Result::ok)
                .map(|e| e.file_name())
                .collect::<Vec<_>>())
        );
    }
    // The restore's dry run planned the copy of the one due backup (guest 200's) all the same.
    let run = w.agent(&["--selftest=restore", "--dry-run"]);
    assert!(
        run.stdout.lines().any(|l| l.starts_with("guest 200")
            && l.contains("would restore backup local:backup/vzdump-lxc-200-")
            && l.ends_with("nothing was written")),
        "{}\n{}",
        run.stdout,
        run.stderr
    );
    assert!(!fresh.exists(), "the dry run made {}", fresh.display());
    for args in [
        &["--selftest=provision", "-vmid", "-5"][..],
        &["vmid-check", "-5"][..],
    ] {
        let run = w.agent(args);
        assert_eq!(
            run.code,
            Some(3),
            "{args:?}\n{}\n{}",
            run.stdout,
            run.stderr
        );
        let all = format!("{}{}", run.stdout, run.stderr);
        assert!(
            all.contains("vmid_invalid") && all.contains("\"-5\""),
            "{args:?}: {all}"
        );
    }
}

#[test]
fn a_fifo_as_config_is_refused_at_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let fifo = dir.path().join("agent.toml");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
    let mut child = felhom_tests::agent::agent_command(&fifo)
        .arg("guests")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start");
    // Nothing ever writes to the FIFO: an agent that opened it for reading would wait forever.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            panic!("the agent waits on a FIFO named as --config");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let out = child.wait_with_output().expect("output");
    assert_eq!(status.code(), Some(6));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not a regular file"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
