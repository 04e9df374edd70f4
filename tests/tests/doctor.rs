//! `felhom-agent doctor` against fakepve: all pass; a wrong pin exits 6 with
//! `tls_pin_mismatch`; a token file of mode 0644 exits 6 with `config_invalid` before any
//! request; a token without the privileges fails the privileges check; a state_dir that does
//! not survive a reboot (under /tmp, or on tmpfs like /dev/shm) exits 6 naming the file and
//! the key; a token file that is a symlink or owned by another user and a group-writable state
//! dir each get a failing line; the `exec` check names how LXC exec is done and fails when the
//! exec helper does not answer; `backup_jobs` warns about the backup jobs of `jobs.cfg` that
//! would back up restore-test copies, and shows none of a job's other keys.

use std::os::unix::fs::PermissionsExt;

use std::path::Path;

use felhom_tests::agent::{agent_command, run_agent, stand_in_pct_path, AgentRun, ExecHelper};
use felhom_tests::fakepve::{AgentFiles, AgentOptions, FakePve};
use serde_json::{json, Value};

/// The exec helper of `files` (doctor probes it and asks where its `pct` resolves: a stand-in
/// that nothing runs).
fn helper(files: &AgentFiles) -> ExecHelper {
    helper_with_path(
        files,
        &stand_in_pct_path(files.config_path.parent().expect("the files' folder")),
    )
}

fn helper_with_path(files: &AgentFiles, path: &str) -> ExecHelper {
    ExecHelper::start(
        &files.config_path,
        files.exec_socket.as_deref().expect("exec helper socket"),
        path,
    )
}

/// The demo's fake PVE, the agent's files for it and their exec helper.
fn demo_bed() -> (FakePve, AgentFiles, ExecHelper) {
    let pve = FakePve::demo();
    let (files, helper) = files_and_helper(&pve);
    (pve, files, helper)
}

/// The agent's files for `pve` and their exec helper.
fn files_and_helper(pve: &FakePve) -> (AgentFiles, ExecHelper) {
    let files = AgentFiles::for_fake(pve);
    let helper = helper(&files);
    (files, helper)
}

/// `doctor --json` of `files` with the environment variable `key` set to `value`.
fn doctor_json_with(files: &AgentFiles, key: &str, value: &Path) -> AgentRun {
    agent_command(&files.config_path)
        .env(key, value)
        .args(["doctor", "--json"])
        .output()
        .expect("doctor")
        .into()
}

/// Every line of a doctor report named `name`.
fn lines_named<'a>(doc: &'a Value, name: &str) -> Vec<&'a Value> {
    doc["checks"]
        .as_array()
        .map(|a| a.iter().filter(|c| c["name"] == name).collect())
        .unwrap_or_default()
}

/// The first line of a doctor report named `name` (panics where there is none).
fn check<'a>(doc: &'a Value, name: &str) -> &'a Value {
    lines_named(doc, name)
        .first()
        .copied()
        .unwrap_or_else(|| panic!("no check {name} in {doc}"))
}

#[test]
fn all_checks_pass_against_the_demo() {
    let (pve, files, helper) = demo_bed();
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["ok"], json!(true));
    // The probe reached the helper itself (not only the socket), which ran nothing.
    assert!(
        helper.log().contains("answered a probe"),
        "{}",
        helper.log()
    );
    for name in [
        "config",
        "pve_tls",
        "pve_token",
        "privileges",
        "pool",
        "vmlist",
        "state_dir",
        "metrics",
        "exec",
        "check_packs",
        "profiles",
    ] {
        assert_eq!(check(&doc, name)["status"], "pass", "{name}: {doc:#}");
    }
    let exec = check(&doc, "exec")["message"].as_str().unwrap_or("");
    assert!(
        exec.contains("root exec helper")
            && exec.contains(
                &files
                    .exec_socket
                    .as_ref()
                    .expect("socket")
                    .display()
                    .to_string()
            )
            && exec.contains("it answers"),
        "{exec}"
    );
    assert!(
        pve.writes().is_empty(),
        "doctor wrote to PVE: {:?}",
        pve.writes()
    );
    assert!(!run.stdout.contains(&pve.token_secret()) && !run.stderr.contains(&pve.token_secret()));
}

#[test]
fn wrong_pin_exits_6_with_tls_pin_mismatch() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let text = files
        .config_text()
        .replace(pve.sha256_hex(), &"cd".repeat(32));
    std::fs::write(&files.config_path, text).expect("rewrite");
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}");
    assert_eq!(doc["ok"], json!(false));
    let tls = check(&doc, "pve_tls");
    assert_eq!(tls["status"], "fail");
    assert_eq!(tls["code"], "tls_pin_mismatch");
    assert!(
        pve.requests().is_empty(),
        "a request reached the server despite the wrong pin"
    );
}

#[test]
fn world_readable_token_file_exits_6_before_any_request() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    std::fs::set_permissions(
        &files.token_secret_file,
        std::fs::Permissions::from_mode(0o644),
    )
    .expect("chmod");
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}");
    let cfg = check(&doc, "config");
    assert_eq!(cfg["status"], "fail");
    assert_eq!(cfg["code"], "config_invalid");
    assert!(
        cfg["message"].as_str().unwrap_or("").contains("0644"),
        "{cfg}"
    );
    assert!(
        pve.requests().is_empty(),
        "no request may be sent with an unsafe token file"
    );
    assert!(!run.stdout.contains(&pve.token_secret()));
}

#[test]
fn missing_privileges_fail_with_what_to_grant() {
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    scenario["grants"] = json!([
        [
            "felhom@pve!agent",
            "/pool/felhom",
            ["VM.Audit", "Pool.Audit"]
        ],
        ["felhom@pve!agent", "/storage/local", ["PVEDatastoreUser"]],
        // The token's user holds everything: what is missing is the token's own grant.
        ["felhom@pve", "/pool/felhom", ["PVEVMAdmin", "Pool.Audit"]],
        ["felhom@pve", "/storage", ["PVEDatastoreUser"]]
    ]);
    let pve = FakePve::start(scenario);
    let files = AgentFiles::for_fake(&pve);
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}");
    let privs = check(&doc, "privileges");
    assert_eq!(privs["status"], "fail");
    let msg = privs["message"].as_str().unwrap_or("");
    assert!(msg.contains("VM.Allocate on /pool/felhom"), "{msg}");
    assert!(
        msg.contains("Datastore.AllocateSpace on /storage/local-lvm"),
        "{msg}"
    );
    assert!(
        !msg.contains("VM.Audit on"),
        "a held privilege is not reported missing: {msg}"
    );
}

#[test]
fn a_token_whose_user_lacks_the_pool_grant_names_the_user_grant() {
    // The token is granted everything, its user only the storages: a privilege-separated token
    // then holds nothing on the pool (PVE's intersection), and the user's grant is what to add.
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    scenario["grants"] = json!([
        [
            "felhom@pve!agent",
            "/pool/felhom",
            ["PVEVMAdmin", "Pool.Audit"]
        ],
        ["felhom@pve!agent", "/storage/local", ["PVEDatastoreUser"]],
        [
            "felhom@pve!agent",
            "/storage/local-lvm",
            ["PVEDatastoreUser"]
        ],
        ["felhom@pve", "/storage", ["PVEDatastoreUser"]]
    ]);
    let pve = FakePve::start(scenario);
    let files = AgentFiles::for_fake(&pve);
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}");
    let privs = check(&doc, "privileges");
    assert_eq!(privs["status"], "fail");
    let msg = privs["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("user felhom@pve lacks") && msg.contains("VM.Allocate on /pool/felhom"),
        "{msg}"
    );
    assert!(
        msg.contains("--users 'felhom@pve'") && msg.contains("privilege-separated"),
        "{msg}"
    );
    assert!(
        !msg.contains("token felhom@pve!agent lacks"),
        "the token's own grants are there: {msg}"
    );
    assert!(
        !msg.contains("Datastore.AllocateSpace on"),
        "the user holds the storage grants: {msg}"
    );
    assert!(!run.stdout.contains(&pve.token_secret()));
}

#[test]
fn human_output_names_each_check() {
    let (_pve, files, _helper) = demo_bed();
    let run = run_agent(&files.config_path, &["-doctor"]);
    // `-doctor` is not a flag: clap sees an unknown argument and exits 2.
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    let run = run_agent(&files.config_path, &["doctor"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("[ok  ] pve_token"), "{}", run.stdout);
    // No [hub]: its check warns, so not "all checks passed".
    assert!(run.stdout.contains("[warn] hub"), "{}", run.stdout);
    assert!(
        run.stdout.contains("doctor: passed with") && !run.stdout.contains("all checks passed"),
        "{}",
        run.stdout
    );
}

#[test]
fn next_id_range_that_covers_reserved_vmids_warns() {
    let pve = FakePve::demo();
    let opts = felhom_tests::fakepve::AgentOptions {
        datacenter_cfg: Some("keyboard: en-us\nnext-id: lower=100,upper=1000000\n".to_string()),
        ..Default::default()
    };
    let files = AgentFiles::write(&pve, &opts);
    let _helper = helper(&files);
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "a warning does not fail doctor: {doc:#}");
    let lint = check(&doc, "next_id");
    assert_eq!(lint["status"], "warn", "{lint}");
    assert!(
        lint["message"].as_str().unwrap_or("").contains("9999"),
        "{lint}"
    );

    std::fs::write(&files.datacenter_cfg, "next-id: lower=10000,upper=990000\n").expect("write");
    let doc = run_agent(&files.config_path, &["doctor", "--json"]).json();
    assert_eq!(check(&doc, "next_id")["status"], "pass", "{doc:#}");
}

#[test]
fn a_symlinked_or_world_writable_metrics_folder_warns_and_doctor_writes_nothing_there() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let real = files.dir().join("real-metrics");
    std::fs::create_dir(&real).expect("mkdir");
    std::fs::remove_dir(&files.metrics_dir).expect("rmdir");
    std::os::unix::fs::symlink(&real, &files.metrics_dir).expect("symlink");
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    let c = check(&doc, "metrics");
    assert_eq!(c["status"], "warn", "{doc:#}");
    assert!(
        c["message"]
            .as_str()
            .is_some_and(|m| m.contains(&files.metrics_dir.display().to_string())),
        "{c}"
    );
    std::fs::remove_file(&files.metrics_dir).expect("rm symlink");
    std::fs::create_dir(&files.metrics_dir).expect("mkdir");
    std::fs::set_permissions(&files.metrics_dir, std::fs::Permissions::from_mode(0o777))
        .expect("chmod");
    let doc = run_agent(&files.config_path, &["doctor", "--json"]).json();
    let c = check(&doc, "metrics");
    assert_eq!(c["status"], "warn", "{doc:#}");
    assert!(
        c["message"]
            .as_str()
            .is_some_and(|m| m.contains("chmod o-w")),
        "{c}"
    );
    for d in [&real, &files.metrics_dir] {
        assert_eq!(
            std::fs::read_dir(d).expect("ls").count(),
            0,
            "doctor wrote into {}",
            d.display()
        );
    }
}

#[test]
fn a_volatile_state_dir_exits_6_naming_the_file_and_the_key() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let original = files.config_text();
    let state_line = original
        .lines()
        .find(|l| l.starts_with("state_dir = "))
        .expect("state_dir line")
        .to_string();
    for (dir, why) in [
        ("/tmp/felhom-agent-doctor", "is under /tmp"),
        ("/dev/shm/felhom-agent-doctor", "is on tmpfs"),
    ] {
        let text = original.replace(&state_line, &format!("state_dir = \"{dir}\""));
        std::fs::write(&files.config_path, text).expect("rewrite");
        let run = run_agent(&files.config_path, &["doctor", "--json"]);
        let doc = run.json();
        assert_eq!(run.code, Some(6), "{dir}: {doc:#}");
        assert_eq!(doc["ok"], json!(false));
        let config = check(&doc, "config");
        assert_eq!(config["status"], "fail", "{dir}: {doc:#}");
        assert_eq!(config["code"], "config_invalid");
        let message = config["message"].as_str().expect("message");
        for part in [
            files.config_path.to_str().expect("utf8"),
            "state_dir",
            dir,
            why,
            "/var/lib/felhom-agent",
        ] {
            assert!(message.contains(part), "{dir}: no {part:?} in {message}");
        }
        assert!(!std::path::Path::new(dir).exists(), "doctor created {dir}");
        assert!(
            pve.requests().is_empty(),
            "doctor talked to PVE with a refused config"
        );
    }
}

#[test]
fn untrusted_files_and_folders_each_get_a_clear_line() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    // A token file that is a symlink (to a file that would pass on its own): refused.
    let real = files.dir().join("pve-token.real");
    std::fs::rename(&files.token_secret_file, &real).expect("move");
    std::os::unix::fs::symlink(&real, &files.token_secret_file).expect("symlink");
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}");
    let msg = check(&doc, "config")["message"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(
        msg.contains("symbolic link") && msg.contains("pve-token"),
        "{msg}"
    );
    assert!(
        pve.requests().is_empty(),
        "nothing sent with an untrusted token file"
    );
    std::fs::remove_file(&files.token_secret_file).expect("rm link");
    std::fs::rename(&real, &files.token_secret_file).expect("move back");
    // A token file owned by another user: refused.
    nix::unistd::chown(
        &files.token_secret_file,
        Some(nix::unistd::Uid::from_raw(65534)),
        None,
    )
    .expect("chown (the suite runs as root)");
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}");
    let msg = check(&doc, "config")["message"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(
        msg.contains("uid 65534") && msg.contains("chown root:root"),
        "{msg}"
    );
    nix::unistd::chown(&files.token_secret_file, Some(nix::unistd::geteuid()), None)
        .expect("chown back");
    // A group-writable state_dir: its own failing line.
    std::fs::set_permissions(&files.state_dir, std::fs::Permissions::from_mode(0o770))
        .expect("chmod");
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}");
    let state = check(&doc, "state_dir");
    assert_eq!(state["status"], "fail", "{doc:#}");
    assert!(
        state["message"].as_str().unwrap_or("").contains("0770"),
        "{state}"
    );
    assert_eq!(check(&doc, "config")["status"], "pass", "{doc:#}");
    assert!(!run.stdout.contains(&pve.token_secret()));
}

#[test]
fn exec_check_names_the_mode_and_fails_when_the_helper_does_not_answer() {
    let pve = FakePve::demo();
    // The helper socket configured, nothing listening.
    let files = AgentFiles::for_fake(&pve);
    let socket = files.exec_socket.clone().expect("socket");
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}");
    let exec = check(&doc, "exec");
    assert_eq!(exec["status"], "fail", "{exec}");
    assert_eq!(exec["code"], "exec_helper_unavailable", "{exec}");
    let msg = exec["message"].as_str().unwrap_or("");
    assert!(
        msg.contains(&socket.display().to_string())
            && msg.contains("systemctl start felhom-agent-exec.socket"),
        "{msg}"
    );
    // A helper that was there and is gone (a stale socket file): the same.
    helper(&files).kill();
    let doc = run_agent(&files.config_path, &["doctor", "--json"]).json();
    assert_eq!(check(&doc, "exec")["status"], "fail", "{doc:#}");

    // No [exec] and the agent runs as root: pct itself.
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            exec_helper: false,
            ..AgentOptions::default()
        },
    );
    // `pct` is looked up on the PATH the agent runs with, as the exec does: a provision without
    // it would restore and start its guest, then fail its launch proof (exit 5).
    let bin = tempfile::tempdir().expect("tempdir");
    let pct = bin.path().join("pct");
    std::fs::write(&pct, "#!/bin/sh\nexit 0\n").expect("write pct");
    std::fs::set_permissions(&pct, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let doctor_with_path = |path: &str| {
        let out = felhom_tests::agent::agent_command(&files.config_path)
            .env("PATH", path)
            .args(["doctor", "--json"])
            .output()
            .expect("run doctor");
        felhom_tests::agent::AgentRun::from(out).json()
    };
    let doc = doctor_with_path(&format!("{}:/usr/bin:/bin", bin.path().display()));
    let exec = check(&doc, "exec");
    assert_eq!(exec["status"], "pass", "{exec}");
    let msg = exec["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("runs `pct exec` itself") && msg.contains(&pct.display().to_string()),
        "{exec}"
    );
    let doc = doctor_with_path("/usr/bin:/bin");
    assert_eq!(doc["ok"], json!(false), "{doc:#}");
    let exec = check(&doc, "exec");
    assert_eq!(exec["status"], "fail", "{exec}");
    let msg = exec["message"].as_str().unwrap_or("");
    for part in [
        "`pct` is not on",
        "/usr/bin:/bin",
        "/usr/sbin/pct",
        "helper_socket",
    ] {
        assert!(msg.contains(part), "no {part:?} in {msg}");
    }
}

/// A pack file that defines no check, and a check for a guest the cluster does not have
/// (`guests = [99]`): neither is refused by the preflight, but doctor warns about each (one
/// never runs), naming it.
#[test]
fn an_empty_pack_and_a_check_for_a_guest_that_does_not_exist_are_warned_about() {
    let (_pve, files, _helper) = demo_bed();
    std::fs::write(
        files.checks_dir.join("half-written.toml"),
        "# nothing yet\n",
    )
    .expect("write pack");
    std::fs::write(
        files.checks_dir.join("shop.toml"),
        "[[check]]\nname = \"shop-answers\"\nsql = \"SELECT 1\"\nguests = [99]\n",
    )
    .expect("write pack");
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    let packs = check(&doc, "check_packs");
    assert_eq!(packs["status"], "warn", "{packs}");
    let msg = packs["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("pack half-written.toml defines no check")
            && msg.contains("check shop-answers names guest 99"),
        "{msg}"
    );
}

#[test]
fn a_pack_or_profile_the_preflight_would_refuse_fails_doctor_naming_the_file_and_the_fix() {
    let (_pve, files, _helper) = demo_bed();
    let doc = run_agent(&files.config_path, &["doctor", "--json"]).json();
    for name in ["check_packs", "profiles"] {
        assert_eq!(check(&doc, name)["status"], "pass", "{name}: {doc:#}");
    }
    assert!(
        check(&doc, "check_packs")["message"]
            .as_str()
            .unwrap_or("")
            .contains("default.toml"),
        "{doc:#}"
    );

    // A pack the preflight refuses (an unknown placeholder): the next provision and the
    // nightly restore test would be refused (exit 3); doctor fails now, naming the file.
    let broken = files.checks_dir.join("zz-broken.toml");
    std::fs::write(
        &broken,
        "[[check]]\nname = \"broken\"\nsql = \"SELECT 1\"\nexpect = \"x == '{colour}'\"\n",
    )
    .expect("write pack");
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}");
    let packs = check(&doc, "check_packs");
    assert_eq!(packs["status"], "fail", "{packs}");
    assert_eq!(packs["code"], "checks_invalid", "{packs}");
    let msg = packs["message"].as_str().unwrap_or("");
    for part in ["zz-broken.toml", "colour", "fix or remove", "restore test"] {
        assert!(msg.contains(part), "no {part:?} in {msg}");
    }
    // As the preflight judges it: the same pack refuses a dry run.
    let dry = run_agent(
        &files.config_path,
        &[
            "--selftest=provision",
            "-vmid",
            "150",
            "--dry-run",
            "--json",
        ],
    );
    assert_eq!(dry.code, Some(3), "{}\n{}", dry.stdout, dry.stderr);
    std::fs::remove_file(&broken).expect("rm pack");

    // A profile without its run script, and the default profile gone.
    std::fs::create_dir(files.bootstrap_dir.join("web")).expect("mkdir web");
    std::fs::remove_dir_all(files.bootstrap_dir.join("default")).expect("rm default");
    let doc = run_agent(&files.config_path, &["doctor", "--json"]).json();
    let profiles = check(&doc, "profiles");
    assert_eq!(profiles["status"], "fail", "{profiles}");
    assert_eq!(profiles["code"], "profile_invalid", "{profiles}");
    let msg = profiles["message"].as_str().unwrap_or("");
    for part in [
        "\"web\"",
        &files.bootstrap_dir.join("web/run").display().to_string(),
        "\"default\" (the default)",
        "create it",
    ] {
        assert!(msg.contains(part), "no {part:?} in {msg}");
    }
    assert_eq!(doc["ok"], json!(false), "{doc:#}");
}

#[test]
fn a_socket_bound_by_another_user_gets_nothing_and_fails_the_exec_check() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let socket = files.exec_socket.clone().expect("socket");
    let received = files.dir().join("received");
    // An impostor at the helper's path: bound by root, listening as uid 65534 (the peer's
    // credentials are those of listen()); it counts the bytes it is sent over every
    // connection (doctor connects for `.vmlist` and for the exec check) until none comes for
    // 8 s.
    let script = "import os,socket,sys\n\
        s=socket.socket(socket.AF_UNIX)\n\
        s.bind(sys.argv[1])\n\
        os.chmod(sys.argv[1],0o666)\n\
        os.setgid(65534)\n\
        os.setuid(65534)\n\
        s.listen(4)\n\
        print('ready',flush=True)\n\
        s.settimeout(8)\n\
        n=0\n\
        try:\n  while True:\n    c,_=s.accept()\n    c.settimeout(3)\n    try:\n      while True:\n        d=c.recv(65536)\n        if not d: break\n        n+=len(d)\n    except Exception:\n      pass\n\
        except Exception:\n  pass\n\
        open(sys.argv[2],'w').write(str(n))\n";
    std::fs::write(&received, "").expect("received file");
    std::fs::set_permissions(&received, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let mut impostor = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&socket)
        .arg(&received)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(impostor.stdout.as_mut().expect("stdout")),
        &mut line,
    )
    .expect("ready");
    assert_eq!(line.trim(), "ready");
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    let exec = check(&doc, "exec");
    assert_eq!(exec["status"], "fail", "{exec}");
    assert!(
        exec["message"]
            .as_str()
            .unwrap_or("")
            .contains("uid 65534, not root"),
        "{exec}"
    );
    // Nor was `.vmlist` asked of it: read directly, saying why.
    let vmlist = check(&doc, "vmlist");
    assert!(
        vmlist["message"]
            .as_str()
            .unwrap_or("")
            .contains("uid 65534, not root"),
        "{vmlist}"
    );
    let status = impostor.wait().expect("impostor");
    assert!(status.success());
    assert_eq!(
        std::fs::read_to_string(&received).expect("received").trim(),
        "0",
        "the impostor was sent bytes"
    );
}

/// `[agent] user` as the example config sets it (nobody, uid 65534, stands for it), no
/// `[exec]` table and no helper: every other command switches to that user and reaches
/// containers through the helper, so `doctor` must judge the exec check as that user too,
/// with the code the dry run gives. Run as root (the switch needs it).
#[test]
fn with_agent_user_doctor_judges_exec_as_that_user_like_the_dry_run() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test switches users and must run as root"
    );
    let default_socket = std::path::Path::new("/run/felhom-agent/exec.sock");
    assert!(
        !default_socket.exists(),
        "{} exists on this machine: a helper may answer there, so this test cannot show a missing one",
        default_socket.display()
    );
    let pve = FakePve::demo();
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            exec_helper: false,
            extra_toml: "\n[agent]\nuser = \"nobody\"\n".to_string(),
            ..AgentOptions::default()
        },
    );
    nix::unistd::chown(
        &files.state_dir,
        Some(nix::unistd::Uid::from_raw(65534)),
        Some(nix::unistd::Gid::from_raw(65534)),
    )
    .expect("chown state_dir");
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}\n{}", run.stderr);
    assert_eq!(check(&doc, "agent_user")["status"], "pass", "{doc:#}");
    let exec = check(&doc, "exec");
    assert_eq!(exec["status"], "fail", "{doc:#}");
    assert_eq!(exec["code"], "exec_helper_unavailable", "{exec}");
    assert!(
        exec["message"]
            .as_str()
            .unwrap_or("")
            .contains(&default_socket.display().to_string()),
        "{exec}"
    );

    let dry = run_agent(
        &files.config_path,
        &[
            "--selftest=provision",
            "-vmid",
            "140",
            "--dry-run",
            "--json",
        ],
    );
    assert_eq!(dry.code, Some(6), "{}\n{}", dry.stdout, dry.stderr);
    assert_eq!(
        dry.json()["error"]["code"],
        exec["code"],
        "doctor and the dry run disagree: {}",
        dry.stdout
    );
}

/// The human report: a line per check, each within a terminal's 80 columns (a long message
/// wraps under its check), and the last line says whether warnings were printed.
#[test]
fn the_human_report_fits_80_columns_and_counts_its_warnings() {
    let pve = FakePve::demo();
    // No [hub]: the hub check warns.
    let (files, _helper) = files_and_helper(&pve);
    let run = run_agent(&files.config_path, &["doctor"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    for line in run.stdout.lines() {
        assert!(
            line.chars().count() <= 80,
            "a line of {} characters: {line}",
            line.chars().count()
        );
    }
    let warnings = run
        .stdout
        .lines()
        .filter(|l| l.starts_with("[warn]"))
        .count();
    assert!(warnings >= 1, "{}", run.stdout);
    let last = run.stdout.lines().last().unwrap_or("");
    assert!(
        !run.stdout.contains("all checks passed"),
        "all passed, under {warnings} warnings: {}",
        run.stdout
    );
    let plural = if warnings == 1 { "" } else { "s" };
    assert!(
        last.starts_with(&format!("doctor: passed with {warnings} warning{plural}")),
        "{last}"
    );
}

/// `[agent] user` names no user of this node: the switch fails (its own line, the code every
/// other command stops with), and the exec check is still judged as the commands would run
/// once the user exists: through the helper, never as root's `pct`.
#[test]
fn an_unknown_agent_user_fails_and_exec_is_still_judged_for_that_user() {
    assert!(nix::unistd::geteuid().is_root(), "run as root");
    assert!(
        !std::path::Path::new("/run/felhom-agent/exec.sock").exists(),
        "a helper may answer at the default socket on this machine"
    );
    let pve = FakePve::demo();
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            exec_helper: false,
            extra_toml: "\n[agent]\nuser = \"no-such-user-x\"\n".to_string(),
            ..AgentOptions::default()
        },
    );
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}");
    let user = check(&doc, "agent_user");
    assert_eq!(user["status"], "fail", "{doc:#}");
    assert_eq!(user["code"], "config_invalid", "{user}");
    let guests = run_agent(&files.config_path, &["guests", "--json"]);
    assert_eq!(
        guests.json()["error"]["code"],
        user["code"],
        "{}",
        guests.stdout
    );
    let exec = check(&doc, "exec");
    assert_eq!(exec["status"], "fail", "{doc:#}");
    assert_eq!(exec["code"], "exec_helper_unavailable", "{exec}");
}

/// `doctor` with `[restore_test] lab_bridge = "vmbr9"` against a node whose network PVE lists
/// as `network` (scenario `node_network`), the token (and its user) granted SDN.Use on the lab
/// bridge when `sdn_use`: the exit code and the `lab_bridge` check.
fn doctor_lab(network: Value, sdn_use: bool) -> (Option<i32>, Value) {
    doctor_labs(network, sdn_use, &["vmbr9"])
}

/// [`doctor_lab`] with `[restore_test] lab_bridges = bridges`.
fn doctor_labs(network: Value, sdn_use: bool, bridges: &[&str]) -> (Option<i32>, Value) {
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    scenario["node_network"] = network;
    if sdn_use {
        for who in ["felhom@pve!agent", "felhom@pve"] {
            for b in bridges {
                scenario["grants"]
                    .as_array_mut()
                    .expect("grants")
                    .push(json!([
                        who,
                        format!("/sdn/zones/localnetwork/{b}"),
                        ["PVESDNUser"]
                    ]));
            }
        }
    }
    let pve = FakePve::start(scenario);
    let opts = felhom_tests::fakepve::AgentOptions {
        extra_toml: format!("[restore_test]\nlab_bridges = {bridges:?}\n"),
        ..felhom_tests::fakepve::AgentOptions::default()
    };
    let files = AgentFiles::write(&pve, &opts);
    let _helper = helper(&files);
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert!(pve.writes().is_empty(), "{:?}", pve.writes());
    (run.code, check(&doc, "lab_bridge").clone())
}

/// The production bridge and `lab`, as pve-manager lists /etc/network/interfaces.
fn network_with(lab: Option<Value>) -> Value {
    let mut list = vec![
        json!({"iface": "eno1", "type": "eth", "method": "manual", "method6": "manual", "active": 1, "exists": 1}),
        json!({"iface": "vmbr0", "type": "bridge", "bridge_ports": "eno1", "method": "static",
               "method6": "manual", "address": "192.0.2.11", "netmask": "255.255.255.0",
               "cidr": "192.0.2.11/24", "gateway": "192.0.2.1", "active": 1, "autostart": 1}),
    ];
    list.extend(lab);
    Value::Array(list)
}

/// A lab bridge as the README's stanza makes it: no port, no address, up, its `post-up`
/// lines (IPv6 off, the strict reverse-path filter, no forwarding) among PVE's `options`.
fn good_lab() -> Value {
    json!({"iface": "vmbr9", "type": "bridge", "bridge_ports": "", "method": "manual",
           "method6": "manual", "active": 1, "autostart": 1,
           "options": ["post-up sysctl -w net.ipv6.conf.vmbr9.disable_ipv6=1",
                       "post-up sysctl -w net.ipv4.conf.vmbr9.rp_filter=1",
                       "post-up sysctl -w net.ipv4.conf.vmbr9.forwarding=0"]})
}

/// [`good_lab`] with `changes` ({key: value}) applied.
fn lab_with(changes: Value) -> Value {
    let mut lab = good_lab();
    for (k, v) in changes.as_object().expect("an object of changes") {
        lab[k] = v.clone();
    }
    lab
}

/// `doctor` against the node's `lab` bridge (`None`: missing), which must fail it (exit 6,
/// `lab_bridge` failed): its message.
fn lab_fails(lab: Option<Value>, sdn_use: bool) -> String {
    let (code, c) = doctor_lab(network_with(lab), sdn_use);
    assert_eq!((code, &c["status"]), (Some(6), &json!("fail")), "{c:#}");
    c["message"].as_str().unwrap_or("").to_string()
}

/// With two lab bridges, doctor judges each and says how many VM copies run at once: two
/// when both are right, and a fault of the second names it.
#[test]
fn two_lab_bridges_are_each_judged_and_allow_two_vm_copies_at_once() {
    let vmbr10 = {
        let mut lab = good_lab();
        lab["iface"] = json!("vmbr10");
        lab["options"] = json!([
            "post-up sysctl -w net.ipv6.conf.vmbr10.disable_ipv6=1",
            "post-up sysctl -w net.ipv4.conf.vmbr10.rp_filter=1",
            "post-up sysctl -w net.ipv4.conf.vmbr10.forwarding=0"
        ]);
        lab
    };
    let mut network = network_with(Some(good_lab()));
    network.as_array_mut().expect("list").push(vmbr10);
    let (code, c) = doctor_labs(network, true, &["vmbr9", "vmbr10"]);
    assert_eq!((code, &c["status"]), (Some(0), &json!("pass")), "{c:#}");
    let m = c["message"].as_str().unwrap_or("");
    assert!(
        m.contains("bridge vmbr9 has no port")
            && m.contains("bridge vmbr10 has no port")
            && m.contains("proves 2 VMs at once"),
        "{m}"
    );
    // vmbr10 missing from the node: the check fails naming it.
    let (code, c) = doctor_labs(network_with(Some(good_lab())), true, &["vmbr9", "vmbr10"]);
    assert_eq!((code, &c["status"]), (Some(6), &json!("fail")), "{c:#}");
    assert!(
        c["message"]
            .as_str()
            .is_some_and(|m| m.contains("vmbr10 is not in this node's network configuration")),
        "{c:#}"
    );
}

#[test]
fn the_lab_bridge_passes_only_without_ports_or_addresses_and_each_fault_names_its_fix() {
    let (code, c) = doctor_lab(network_with(Some(good_lab())), true);
    assert_eq!(c["status"], "pass", "{c:#}");
    assert_eq!(code, Some(0), "{c:#}");

    // Missing from the node's configuration: the stanza to add.
    let m = lab_fails(None, true);
    assert!(
        m.contains("vmbr9 is not in this node's network configuration")
            && m.contains("bridge-ports none")
            && m.contains("disable_ipv6=1")
            && m.contains("ifreload -a"),
        "{m}"
    );

    // With a port: `bridge-ports none`.
    let m = lab_fails(Some(lab_with(json!({"bridge_ports": "eno2"}))), true);
    assert!(
        m.contains("has port(s) eno2") && m.contains("set `bridge-ports none`"),
        "{m}"
    );

    // With an IPv4 address, then an IPv6 one: `inet manual` and no address; no inet6 stanza.
    let v4 = json!({"method": "static", "address": "10.99.0.1", "cidr": "10.99.0.1/24"});
    let m = lab_fails(Some(lab_with(v4)), true);
    assert!(
        m.contains("IPv4 address of the node (address 10.99.0.1, cidr 10.99.0.1/24, inet static)")
            && m.contains("`iface vmbr9 inet manual` with no address"),
        "{m}"
    );
    let v6 = json!({"method6": "static", "address6": "fd00::1", "cidr6": "fd00::1/64"});
    let m = lab_fails(Some(lab_with(v6)), true);
    assert!(
        m.contains("IPv6 address of the node")
            && m.contains("remove its `iface vmbr9 inet6` stanza"),
        "{m}"
    );

    // The kernel is right (the bed's tree), but the stanza sets none of it: a warning naming
    // each line (a reboot or an `ip_forward` write would undo it); one line missing: that one.
    let (code, c) = doctor_lab(network_with(Some(lab_with(json!({"options": []})))), true);
    assert_eq!((code, &c["status"]), (Some(0), &json!("warn")), "{c:#}");
    let m = c["message"].as_str().unwrap_or("");
    for line in [
        "post-up sysctl -w net.ipv6.conf.vmbr9.disable_ipv6=1",
        "post-up sysctl -w net.ipv4.conf.vmbr9.rp_filter=1",
        "post-up sysctl -w net.ipv4.conf.vmbr9.forwarding=0",
    ] {
        assert!(m.contains(line), "{line}: {c:#}");
    }
    let some = json!({"options": ["post-up sysctl -w net.ipv6.conf.vmbr9.disable_ipv6=1",
                                  "post-up sysctl -w net.ipv4.conf.vmbr9.rp_filter=1"]});
    let (code, c) = doctor_lab(network_with(Some(lab_with(some))), true);
    assert_eq!((code, &c["status"]), (Some(0), &json!("warn")), "{c:#}");
    let m = c["message"].as_str().unwrap_or("");
    assert!(
        m.contains("net.ipv4.conf.vmbr9.forwarding=0") && !m.contains("rp_filter=1`"),
        "{c:#}"
    );

    // No SDN.Use on it: the grant (PVE also leaves the bridge out of the token's list then).
    let m = lab_fails(Some(good_lab()), false);
    assert!(
        m.contains("lacks SDN.Use on /sdn/zones/localnetwork/vmbr9")
            && m.contains("pveum acl modify /sdn/zones/localnetwork/vmbr9 --tokens 'felhom@pve!agent' --roles PVESDNUser"),
        "{m}"
    );
}

/// With the exec helper (the package's way), `pct` must resolve on the helper's `PATH`, not
/// the agent's: a helper whose `PATH` has none fails `exec` with the fix (doctor before, not a
/// provision after its restore and start, exit 5); with a `pct` there, the line names it.
#[test]
fn with_the_helper_exec_fails_when_its_pct_does_not_resolve_naming_the_fix() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let empty = tempfile::tempdir().expect("tmp");
    let helper = helper_with_path(&files, &empty.path().display().to_string());
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}\n{}", run.stderr);
    let exec = check(&doc, "exec");
    assert_eq!(exec["status"], "fail", "{exec}");
    assert_eq!(exec["code"], "config_invalid", "{exec}");
    let msg = exec["message"].as_str().unwrap_or("");
    for part in [
        "not on the helper's PATH",
        &empty.path().display().to_string(),
        "launch_unproven",
        "/usr/sbin/pct",
        "systemctl edit felhom-agent-exec.service",
    ] {
        assert!(msg.contains(part), "{part:?} missing: {msg}");
    }
    // The helper itself was asked (not only its socket reached).
    assert!(
        helper.log().contains("answered a status request"),
        "{}",
        helper.log()
    );
    drop(helper);

    let path = stand_in_pct_path(files.config_path.parent().expect("folder"));
    let _helper = helper_with_path(&files, &path);
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    let exec = check(&doc, "exec");
    assert_eq!(exec["status"], "pass", "{exec}");
    let pct = files.config_path.parent().expect("folder").join("bin/pct");
    assert!(
        exec["message"]
            .as_str()
            .unwrap_or("")
            .contains(&pct.display().to_string()),
        "{exec}"
    );
}

/// `vmlist` says how the list is read: with the helper, handed over by it (the agent's user,
/// `nobody` here, needs no pmxcfs group). `node_keys` warns while that user can open the
/// node's TLS key in the (fake) pmxcfs, naming the key and the fix, and passes once it cannot.
#[test]
fn the_vmlist_line_names_the_way_and_node_keys_warns_while_the_agents_user_reads_a_key() {
    assert!(nix::unistd::geteuid().is_root(), "run as root");
    let pve = FakePve::demo();
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            extra_toml: "\n[agent]\nuser = \"nobody\"\n".to_string(),
            ..AgentOptions::default()
        },
    );
    nix::unistd::chown(
        &files.state_dir,
        Some(nix::unistd::Uid::from_raw(65534)),
        Some(nix::unistd::Gid::from_raw(65534)),
    )
    .expect("chown state_dir");
    let helper = helper(&files);
    let key_dir = files.pve_nodes_dir.join("pve1");
    std::fs::create_dir_all(&key_dir).expect("node folder");
    let key = key_dir.join("pve-ssl.key");
    std::fs::write(&key, "-----BEGIN PRIVATE KEY-----\nnot a key\n").expect("key");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).expect("chmod");

    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(check(&doc, "agent_user")["status"], "pass", "{doc:#}");
    let vmlist = check(&doc, "vmlist");
    assert_eq!(vmlist["status"], "pass", "{vmlist}");
    let msg = vmlist["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("handed over by the root exec helper")
            && msg.contains(&files.vmlist_path.display().to_string()),
        "{msg}"
    );
    assert!(
        helper
            .log()
            .lines()
            .any(|l| l.contains("handed over") && l.contains("uid=65534")),
        "{}",
        helper.log()
    );
    let keys = check(&doc, "node_keys");
    assert_eq!(keys["status"], "warn", "{keys}");
    let msg = keys["message"].as_str().unwrap_or("");
    assert!(
        msg.contains(&key.display().to_string()) && msg.contains("gpasswd -d nobody www-data"),
        "{msg}"
    );
    assert!(
        !run.stdout.contains("not a key"),
        "the key's bytes were shown"
    );

    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let doc = run_agent(&files.config_path, &["doctor", "--json"]).json();
    let keys = check(&doc, "node_keys");
    assert_eq!(keys["status"], "pass", "{keys}");
    assert!(
        keys["message"]
            .as_str()
            .unwrap_or("")
            .contains("cannot read"),
        "{keys}"
    );
}

/// Every `backup_jobs` line of a doctor report.
fn backup_jobs_lines(doc: &Value) -> Vec<&Value> {
    lines_named(doc, "backup_jobs")
}

/// The restore-test band as `pvesh … --exclude` takes it.
const BAND: &str = "990000,990001,990002,990003,990004,990005,990006,990007,990008,990009";

/// `backup_jobs` (the backup jobs of `jobs.cfg`, handed over by the exec helper): an `all` job
/// whose `exclude` leaves out vmids of the restore-test band warns, naming the job, the
/// missing vmids and the `pvesh` command that excludes the band (merged with the job's own
/// excludes); with all ten excluded it passes. A disabled job and another node's job do not
/// warn; a pool job of the agent's pool does (it cannot exclude). No `jobs.cfg` passes. A
/// warning never fails doctor.
#[test]
fn backup_jobs_that_would_back_up_restore_test_copies_warn_naming_the_job_and_the_fix() {
    let pve = FakePve::demo();
    let job = |exclude: &str| {
        format!(
            "vzdump: backup-6f1a2b3c-1234\n\tschedule 21:00\n\tall 1\n\tenabled 1\n\texclude {exclude}\n\
             \tmode snapshot\n\tstorage local\n\tnode pve1\n\n\
             realm-sync: sync-ldap\n\tschedule daily\n\trealm ldap\n"
        )
    };
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            jobs_cfg: Some(job("120,990000,990001")),
            ..AgentOptions::default()
        },
    );
    let helper = helper(&files);
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(
        run.code,
        Some(0),
        "a warning does not fail doctor: {doc:#}\n{}",
        run.stderr
    );
    assert_eq!(doc["ok"], json!(true));
    let lines = backup_jobs_lines(&doc);
    assert_eq!(lines.len(), 1, "{doc:#}");
    assert_eq!(lines[0]["status"], "warn", "{doc:#}");
    let msg = lines[0]["message"].as_str().unwrap_or("");
    for part in [
        "backup job backup-6f1a2b3c-1234",
        "restore-test vmids 990002,990003,990004,990005,990006,990007,990008,990009:",
        &format!("`pvesh set /cluster/backup/backup-6f1a2b3c-1234 --exclude 120,{BAND}`"),
    ] {
        assert!(msg.contains(part), "no {part:?} in {msg}");
    }
    assert!(
        helper
            .log()
            .lines()
            .any(|l| l.contains("handed over") && l.contains("jobs.cfg")),
        "{}",
        helper.log()
    );

    // The whole band excluded: it passes, naming how many jobs it read.
    files.write_jobs_cfg(&job(&format!("{BAND},120")));
    let doc = run_agent(&files.config_path, &["doctor", "--json"]).json();
    let lines = backup_jobs_lines(&doc);
    assert_eq!(lines.len(), 1, "{doc:#}");
    assert_eq!(lines[0]["status"], "pass", "{doc:#}");
    let msg = lines[0]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("read 1 backup job from") && msg.contains("1 of them runs on node pve1"),
        "{msg}"
    );

    // A disabled job, and a job of another node: neither runs here.
    files.write_jobs_cfg(
        "vzdump: backup-off\n\tschedule 21:00\n\tall 1\n\tenabled 0\n\n\
         vzdump: backup-pve2\n\tschedule 21:00\n\tall 1\n\tnode pve2\n",
    );
    let doc = run_agent(&files.config_path, &["doctor", "--json"]).json();
    let lines = backup_jobs_lines(&doc);
    assert_eq!(lines.len(), 1, "{doc:#}");
    assert_eq!(lines[0]["status"], "pass", "{doc:#}");
    assert!(
        lines[0]["message"]
            .as_str()
            .unwrap_or("")
            .contains("read 2 backup jobs from"),
        "{doc:#}"
    );

    // A pool job of the agent's pool, beside a good all job: only the pool job warns.
    files.write_jobs_cfg(&format!(
        "vzdump: backup-pool\n\tschedule sat 02:00\n\tpool felhom\n\tstorage local\n\n\
         vzdump: backup-all\n\tschedule 21:00\n\tall 1\n\texclude {BAND}\n"
    ));
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}");
    let lines = backup_jobs_lines(&doc);
    assert_eq!(lines.len(), 1, "{doc:#}");
    assert_eq!(lines[0]["status"], "warn", "{doc:#}");
    let msg = lines[0]["message"].as_str().unwrap_or("");
    for part in [
        "backup job backup-pool backs up pool felhom, the agent's pool",
        "cannot exclude",
        &format!("`pvesh set /cluster/backup/backup-pool --all 1 --exclude {BAND}`"),
    ] {
        assert!(msg.contains(part), "no {part:?} in {msg}");
    }

    // No jobs.cfg: no backup job was ever made.
    std::fs::remove_file(&files.jobs_cfg).expect("rm jobs.cfg");
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}");
    let lines = backup_jobs_lines(&doc);
    assert_eq!(lines.len(), 1, "{doc:#}");
    assert_eq!(lines[0]["status"], "pass", "{doc:#}");
    let msg = lines[0]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains(&files.jobs_cfg.display().to_string()) && msg.contains("does not exist"),
        "{msg}"
    );
    assert!(
        pve.writes().is_empty(),
        "doctor wrote to PVE: {:?}",
        pve.writes()
    );
}

/// Of `jobs.cfg` the exec helper hands over only what the check needs: a job's mail address,
/// notes template, comment, a comment line and another job type never reach the agent, so
/// they show nowhere in doctor's output (JSON or human), even in a warning about that very
/// job. The agent runs as its own user (`nobody` here), which cannot read the file itself.
/// A `jobs.cfg` that cannot be read warns, naming it, and never fails.
#[test]
fn a_backup_jobs_other_keys_never_reach_doctors_output() {
    assert!(nix::unistd::geteuid().is_root(), "run as root");
    let pve = FakePve::demo();
    let marker = "MARKER-7f3a9c";
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            extra_toml: "\n[agent]\nuser = \"nobody\"\n".to_string(),
            jobs_cfg: Some(format!(
                "# {marker} in a comment\n\
                 vzdump: backup-secret\n\
                 \tschedule 21:00\n\
                 \tall 1\n\
                 \tmailto ops-{marker}@example.net\n\
                 \tnotes-template {{{{guestname}}}} {marker}\n\
                 \tcomment {marker}\n\
                 \tfleecing enabled=1,storage={marker}\n\
                 \tstorage local\n\
                 \n\
                 realm-sync: sync-{marker}\n\
                 \tschedule daily\n\
                 \trealm ldap\n\
                 \tcomment {marker}\n"
            )),
            ..AgentOptions::default()
        },
    );
    nix::unistd::chown(
        &files.state_dir,
        Some(nix::unistd::Uid::from_raw(65534)),
        Some(nix::unistd::Gid::from_raw(65534)),
    )
    .expect("chown state_dir");
    let helper = helper(&files);
    // (The `agent_user_*` checks judge `nobody` on this machine and may fail: the exit code
    // is not this test's.)
    let json_run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = json_run.json();
    let lines = backup_jobs_lines(&doc);
    assert_eq!(lines.len(), 1, "{doc:#}");
    assert_eq!(lines[0]["status"], "warn", "{doc:#}");
    assert!(
        lines[0]["message"]
            .as_str()
            .unwrap_or("")
            .contains("backup job backup-secret"),
        "{doc:#}"
    );
    let human_run = run_agent(&files.config_path, &["doctor"]);
    assert!(
        human_run.stdout.contains("[warn] backup_jobs"),
        "{}",
        human_run.stdout
    );
    for (what, text) in [
        ("doctor --json stdout", &json_run.stdout),
        ("doctor --json stderr", &json_run.stderr),
        ("doctor stdout", &human_run.stdout),
        ("doctor stderr", &human_run.stderr),
        ("the exec helper's log", &helper.log()),
    ] {
        assert!(!text.contains(marker), "{what} shows the marker:\n{text}");
    }
    assert!(
        helper.log().lines().any(|l| l.contains("handed over")
            && l.contains("jobs.cfg")
            && l.contains("uid=65534")),
        "{}",
        helper.log()
    );
    // What crosses the helper's socket, byte for byte.
    let crossed = felhom_agent::exec_helper::client::read_cluster_file(
        files.exec_socket.as_deref().expect("socket"),
        felhom_agent::exec_helper::proto::ClusterFile::JobsCfg,
    )
    .expect("an answer")
    .expect("the file exists");
    assert_eq!(
        String::from_utf8_lossy(&crossed),
        "vzdump: backup-secret\n\tschedule 21:00\n\tall 1\n\n"
    );

    // A jobs.cfg the helper refuses and the agent's user cannot read: a warning naming the
    // file, not a failure.
    std::fs::remove_file(&files.jobs_cfg).expect("rm");
    std::fs::create_dir(&files.jobs_cfg).expect("mkdir");
    let doc = run_agent(&files.config_path, &["doctor", "--json"]).json();
    let lines = backup_jobs_lines(&doc);
    assert_eq!(lines.len(), 1, "{doc:#}");
    assert_eq!(lines[0]["status"], "warn", "{doc:#}");
    assert_eq!(lines[0]["code"], Value::Null, "{doc:#}");
    let msg = lines[0]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains(&files.jobs_cfg.display().to_string())
            && msg.contains("not a regular file")
            && msg.contains("were not checked"),
        "{msg}"
    );
}

/// `guest_backups`: a pool guest of this node with no backup on `[restore_test]
/// backup_storages` is named (the demo's VM 300), a warning (doctor still exits 0); with every
/// guest backed up it passes.
#[test]
fn a_pool_guest_without_a_backup_is_named() {
    let (_pve, files, _helper) = demo_bed();
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    let line = check(&doc, "guest_backups");
    assert_eq!(line["status"], "warn", "{doc:#}");
    let msg = line["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("300 (felhom-vm)") && !msg.contains("200") && msg.contains("no_backup"),
        "{msg}"
    );

    let pve = FakePve::start(felhom_tests::fakepve::pool_with_backups(&[(210, "shop")]));
    let (files, _helper) = files_and_helper(&pve);
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    let line = check(&doc, "guest_backups");
    assert_eq!(line["status"], "pass", "{doc:#}");
    assert!(
        line["message"]
            .as_str()
            .is_some_and(|m| m.contains("each of the 2 pool guest(s)")),
        "{doc:#}"
    );
}

/// A mistyped pool: doctor says the pool does not exist, and gives no recipe of grants on it
/// (the privileges are not judged against a pool that is not there).
#[test]
fn a_mistyped_pool_is_named_missing_before_any_grant_recipe() {
    let (_pve, files, _helper) = demo_bed();
    let config = std::fs::read_to_string(&files.config_path).expect("config");
    assert!(config.contains("pool = \"felhom\""), "{config}");
    std::fs::write(
        &files.config_path,
        config.replacen("pool = \"felhom\"", "pool = \"felhmo\"", 1),
    )
    .expect("config");
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    let doc = run.json();
    let pool = check(&doc, "pool");
    assert_eq!(
        (&pool["status"], &pool["code"]),
        (&json!("fail"), &json!("pool_missing")),
        "{doc:#}"
    );
    assert!(
        pool["message"].as_str().unwrap_or("").contains("felhmo"),
        "{pool}"
    );
    let privileges = check(&doc, "privileges");
    assert_eq!(privileges["status"], "skipped", "{doc:#}");
    assert!(
        !run.stdout.contains("pveum acl modify /pool/felhmo"),
        "{}",
        run.stdout
    );
    let names: Vec<&str> = doc["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    let at = |n: &str| names.iter().position(|x| *x == n);
    assert!(at("pool") < at("privileges"), "{names:?}");
}

/// A lab bridge of a smaller MTU than the node's other networks: a VM copy's NIC gets the
/// bridge's MTU (qemu-server `print_netdevice_full`, `host_mtu`), so doctor warns, naming both
/// MTUs, the device and the stanza line; with equal MTUs it passes. The kernel's files are a
/// tree of the test's (`/sys/class/net/<dev>/mtu`).
#[test]
fn a_lab_bridge_of_a_smaller_mtu_than_the_node_is_warned_about() {
    let doctor_with_mtus = |lab: u32, uplink: u32| -> Value {
        let mut scenario = felhom_tests::fakepve::demo_scenario();
        scenario["node_network"] = network_with(Some(good_lab()));
        for who in ["felhom@pve!agent", "felhom@pve"] {
            scenario["grants"]
                .as_array_mut()
                .expect("grants")
                .push(json!([
                    who,
                    "/sdn/zones/localnetwork/vmbr9",
                    ["PVESDNUser"]
                ]));
        }
        let pve = FakePve::start(scenario);
        let opts = AgentOptions {
            extra_toml: "[restore_test]\nlab_bridge = \"vmbr9\"\n".to_string(),
            ..AgentOptions::default()
        };
        let files = AgentFiles::write(&pve, &opts);
        let _helper = helper(&files);
        let kernel = tempfile::tempdir().expect("a kernel tree");
        let copied = std::process::Command::new("cp")
            .arg("-a")
            .arg(format!(
                "{}/.",
                felhom_tests::agent::bed_kernel_root().display()
            ))
            .arg(kernel.path())
            .status()
            .expect("cp");
        assert!(copied.success());
        let net = kernel.path().join("sys/class/net");
        std::fs::write(net.join("vmbr9/mtu"), format!("{lab}\n")).expect("mtu");
        std::fs::create_dir_all(net.join("eno1")).expect("eno1");
        std::fs::write(net.join("eno1/mtu"), format!("{uplink}\n")).expect("mtu");
        let run = doctor_json_with(&files, felhom_tests::agent::KERNEL_ROOT_ENV, kernel.path());
        check(&run.json(), "lab_bridge").clone()
    };
    let c = doctor_with_mtus(1500, 9000);
    assert_eq!(c["status"], "warn", "{c:#}");
    let m = c["message"].as_str().unwrap_or("");
    assert!(
        m.contains("MTU 1500") && m.contains("eno1 has 9000") && m.contains("`mtu 9000`"),
        "{m}"
    );
    let c = doctor_with_mtus(9000, 9000);
    assert_eq!(c["status"], "pass", "{c:#}");
}

/// Reports the outbox dropped while no hub was configured (`<state_dir>/outbox/dropped`, as the
/// daemon writes it): doctor warns with how many, since when, the bounds and what to do; with
/// no such file its line passes.
#[test]
fn reports_dropped_from_the_outbox_without_a_hub_are_warned_about() {
    let (_pve, files, _helper) = demo_bed();
    let doc = run_agent(&files.config_path, &["doctor", "--json"]).json();
    let c = check(&doc, "outbox");
    assert_eq!(c["status"], "pass", "{doc:#}");
    let outbox = files.state_dir.join("outbox");
    std::fs::create_dir_all(&outbox).expect("mkdir");
    std::fs::write(
        outbox.join("dropped"),
        "{\"count\":23,\"since\":\"2026-01-01T00:00:00Z\",\"last\":\"2026-01-05T00:00:00Z\"}\n",
    )
    .expect("write");
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    assert_eq!(run.code, Some(0), "a warning does not fail doctor");
    let doc = run.json();
    let c = check(&doc, "outbox");
    assert_eq!(c["status"], "warn", "{doc:#}");
    let message = c["message"].as_str().unwrap_or_default();
    for want in [
        "23 reports were dropped",
        "since 2026-01-01T00:00:00Z",
        "the newest 1000 reports, none older than 30 days",
        "Configure [hub]",
        &format!("remove {}", outbox.join("dropped").display()),
    ] {
        assert!(message.contains(want), "{want:?} not in {message}");
    }
    // The human report names it too, within 80 columns.
    let run = run_agent(&files.config_path, &["doctor"]);
    assert!(run.stdout.contains("[warn] outbox"), "{}", run.stdout);
    assert!(
        run.stdout.lines().all(|l| l.chars().count() <= 80),
        "{}",
        run.stdout
    );
}

/// Every `restore_group` line of a doctor report.
fn group_lines(doc: &Value) -> Vec<&Value> {
    lines_named(doc, "restore_group")
}

/// How many `restore_group` lines of a doctor report have a message that `fits`.
fn group_lines_saying(doc: &Value, fits: impl Fn(&str) -> bool) -> usize {
    group_lines(doc)
        .iter()
        .filter(|l| l["message"].as_str().is_some_and(&fits))
        .count()
}

/// The `restore_group` line of `group` whose message holds `part` (panics naming them all).
fn group_line<'a>(doc: &'a Value, group: &str, part: &str) -> &'a Value {
    let lines = group_lines(doc);
    lines
        .iter()
        .copied()
        .find(|c| {
            c["message"]
                .as_str()
                .is_some_and(|m| m.starts_with(&format!("group {group}: ")) && m.contains(part))
        })
        .unwrap_or_else(|| panic!("no restore_group line of {group} with {part:?} in {lines:#?}"))
}

/// The demo pool with containers of these (vmid, name, stored config) on node pve1, each with
/// a backup on `local`, and a pool container on another node (215).
fn pool_for_groups(members: &[(u32, &str, Value)]) -> Value {
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    let guests = scenario["guests"].as_array_mut().expect("guests");
    for (vmid, name, _) in members {
        guests.push(
            json!({"vmid": vmid, "type": "lxc", "name": name, "node": "pve1",
            "status": "running", "pool": "felhom", "config": {"unprivileged": "1"}}),
        );
    }
    guests.push(
        json!({"vmid": 214, "type": "lxc", "name": "nobackup", "node": "pve1",
        "status": "running", "pool": "felhom"}),
    );
    guests.push(
        json!({"vmid": 215, "type": "lxc", "name": "elsewhere", "node": "pve2",
        "status": "running", "pool": "felhom"}),
    );
    let volumes = scenario["volumes"]["local"]
        .as_array_mut()
        .expect("volumes");
    for (vmid, _, config) in members {
        volumes.push(json!({
            "volname": format!("backup/vzdump-lxc-{vmid}-2026_12_01-00_00_00.tar.zst"),
            "vmid": vmid, "config": config}));
    }
    scenario
}

/// A container's stored config with one NIC whose `ip=`/`ip6=` items are `addr`, and `memory`.
fn ct_config(addr: &str, memory: u32) -> Value {
    json!({"unprivileged": "1", "memory": memory.to_string(), "hostname": "m",
        "net0": format!("name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:02:99,{addr},type=veth")})
}

/// `restore_group`: doctor names what would stop each `[[restore_test.group]]`, each line
/// naming the group and the member: a member in the restore-test band or 9999, one that is no
/// pool guest of this node (not in the pool, on another node) (fail, `config_invalid`);
/// a member without a backup, a group larger than the band's free vmids (warn); a member without a static stored address, and members
/// that share no subnet (warn, naming the netN and the fix); a group whose members' stored
/// memory together is more than the node can ever give copies (fail) or gives now (warn). A
/// group with nothing in its way passes; a config without groups has no such line.
#[test]
fn doctor_names_what_would_stop_each_group_naming_the_member() {
    let (_pve, files, _helper) = demo_bed();
    let run = run_agent(&files.config_path, &["doctor", "--json"]);
    assert!(group_lines(&run.json()).is_empty(), "{}", run.stdout);
    drop(_helper);

    let pve = FakePve::start(pool_for_groups(&[
        (210, "db", ct_config("ip=10.20.0.30/24", 512)),
        (211, "shop", ct_config("ip=10.20.0.31/24,ip6=auto", 512)),
        (212, "dhcp", ct_config("ip=dhcp,ip6=auto", 256)),
        (213, "far", ct_config("ip=10.30.0.5/24", 256)),
        (216, "near", ct_config("ip=10.20.0.40/24", 256)),
        (217, "big1", ct_config("ip=10.40.0.1/24", 3000)),
        (218, "big2", ct_config("ip=10.40.0.2/24", 3000)),
    ]));
    let (files, _helper) = files_and_helper(&pve);
    let mut cfg = files.config_text();
    cfg.push_str(concat!(
        "\n[[restore_test.group]]\nname = \"shop\"\nguests = [210, 211]\n",
        "\n[[restore_test.group]]\nname = \"broken\"\nguests = [990005, 9999, 101, 300, 214, 215, 997, 998, 999]\n",
        "\n[[restore_test.group]]\nname = \"nets\"\nguests = [212, 213, 216]\n",
        "\n[[restore_test.group]]\nname = \"big\"\nguests = [217, 218]\n",
    ));
    std::fs::write(&files.config_path, cfg).expect("config");
    // `doctor --json` on a node whose /proc/meminfo says `meminfo`.
    let with_meminfo = |meminfo: &str| {
        let path = files.config_path.with_file_name("meminfo");
        std::fs::write(&path, meminfo).expect("meminfo");
        doctor_json_with(&files, "FELHOM_AGENT_MEMINFO", &path)
    };
    // A node of 4 GiB, 1 GiB available: 614 MiB for copies now (10% reserved), 3686 at most.
    let run = with_meminfo("MemTotal: 4194304 kB\nMemFree: 1048576 kB\nMemAvailable: 1048576 kB\n");
    let doc = run.json();
    assert_eq!(run.code, Some(6), "{doc:#}\n{}", run.stderr);

    let fail = |group: &str, part: &str| {
        let l = group_line(&doc, group, part);
        assert_eq!(l["status"], "fail", "{l:#}");
        assert_eq!(l["code"], "config_invalid", "{l:#}");
        l["message"].as_str().unwrap_or_default().to_string()
    };
    let warn = |group: &str, part: &str| {
        let l = group_line(&doc, group, part);
        assert_eq!(l["status"], "warn", "{l:#}");
        l["message"].as_str().unwrap_or_default().to_string()
    };
    assert!(fail("broken", "member 990005 ").contains("restore-test band 990000-990009"));
    assert!(fail("broken", "member 9999 ").contains("scratch vmid 9999"));
    fail("broken", "member 101 ");
    // A VM may be a member (a group of VMs shares a lab bridge): 300 has no backup.
    warn("broken", "member 300 (felhom-vm) has no backup on");
    assert!(fail("broken", "member 215 (elsewhere) is on node pve2").contains("proves only"));
    assert!(fail("broken", "member 999 ").contains("not a guest of pool felhom on node pve1"));
    assert!(warn("broken", "member 214 (nobackup) has no backup on").contains("local"));
    // The demo's cluster holds 990000 and 990001: 8 of the band's vmids are free.
    assert!(warn("broken", "its 9 members need as many vmids").contains("and 8 are free"));

    let m = warn("nets", "member 212 (dhcp) has no static stored address");
    assert!(
        m.contains("net0 (ip=dhcp, ip6=auto)") && m.contains("`pct set 212 -net0 "),
        "{m}"
    );
    let m = warn("nets", "share no subnet");
    assert!(
        m.contains("213 (far) (net0 10.30.0.5/24) and 216 (near) (net0 10.20.0.40/24)"),
        "{m}"
    );
    assert_eq!(
        group_lines_saying(&doc, |m| m.contains("share no subnet")),
        1,
        "212 has no static address: it is in no pair"
    );

    let m = fail("big", "stored memory together (6000 MiB");
    assert!(
        m.contains("can ever give copies (3686 MiB") && m.contains("memory_reserve = 10%"),
        "{m}"
    );
    // shop: 1024 MiB together, 614 allowed now: a warning, not a pass.
    let m = warn(
        "shop",
        "stored memory together (1024 MiB: 210: 512 MiB, 211: 512 MiB)",
    );
    assert!(m.contains("allows copies now (614 MiB"), "{m}");

    // With the node's memory free, the shop's group passes.
    let doc = with_meminfo("MemTotal: 4194304 kB\nMemFree: 4000000 kB\nMemAvailable: 4000000 kB\n")
        .json();
    let l = group_line(
        &doc,
        "shop",
        "members 210, 211 are pool guests of node pve1",
    );
    assert_eq!(l["status"], "pass", "{l:#}");
    assert_eq!(
        group_lines_saying(&doc, |m| m.starts_with("group shop: ")),
        1,
        "{doc:#}"
    );
    // A group of containers: the helper made a lab as a run would, and removed it.
    let lab = check(&doc, "restore_group_lab");
    assert_eq!(lab["status"], "pass", "{lab:#}");
    let said = lab["message"].as_str().unwrap_or_default();
    assert!(
        said.contains("the root exec helper") && said.contains(", and removed it"),
        "{said}"
    );
    let name = said
        .split("made the lab ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .unwrap_or_else(|| panic!("no lab named: {said}"));
    assert!(name.starts_with("felhom-g-"), "{said}");
    assert!(
        !std::path::Path::new("/run/netns").join(name).exists(),
        "doctor's lab {name} is left"
    );
    assert!(
        pve.writes().is_empty(),
        "doctor wrote to PVE: {:?}",
        pve.writes()
    );
}
