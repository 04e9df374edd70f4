//! Privilege separation, command-line side: a run started as root with `[agent] user` switches
//! to that user after reading the config and the secrets, so the files it writes afterwards
//! are the user's and a root-only folder stays out of its reach; an unknown user is a coded
//! refusal. Secrets come from `$CREDENTIALS_DIRECTORY` when systemd hands them over.
//!
//! Run as root (the switch needs it); `nobody` (uid 65534) stands for the agent's user.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use felhom_tests::fakepve::{demo_scenario, AgentOptions};
use felhom_tests::world::World;

const NOBODY: u32 = 65534;

fn world(extra_toml: &str) -> World {
    let opts = AgentOptions {
        extra_toml: extra_toml.to_string(),
        ..AgentOptions::default()
    };
    World::with_options(demo_scenario(), &opts)
}

/// Every file and folder under `dir` (not `dir` itself).
fn tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let p = e.expect("entry").path();
            if p.symlink_metadata().expect("lstat").is_dir() {
                todo.push(p.clone());
            }
            out.push(p);
        }
    }
    out.sort();
    out
}

fn chown(path: &Path, uid: u32) {
    nix::unistd::chown(
        path,
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(uid)),
    )
    .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
}

fn assert_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "these tests switch users and must run as root"
    );
}

/// `[agent] user` (and a 5 s launch proof, so the provision below ends quickly: the guest bed's
/// `pct` needs root, and guest exec through the helper is not this test's business). The text
/// lands in the config's `[provision]` table, which the written config ends with.
fn as_user(user: &str) -> String {
    format!("launch_timeout_secs = 5\n\n[agent]\nuser = \"{user}\"\n")
}

#[test]
fn a_run_started_as_root_writes_as_the_agent_user_and_cannot_write_roots_folders() {
    assert_root();
    let w = world(&as_user("nobody"));
    chown(&w.state_dir(), NOBODY);
    // The metrics folder stays root's, mode 0755: only root may write there.
    let metrics = w.files.metrics_dir.clone();
    assert_eq!(metrics.metadata().expect("metrics dir").uid(), 0);
    let run = w.agent(&["--selftest=provision", "-vmid", "140", "--json"]);
    assert!(
        run.stderr.contains("switched to the agent's user") && run.stderr.contains("uid=65534"),
        "{}",
        run.stderr
    );
    // It wrote its journal, lock and outbox: every one of them the user's.
    let written = tree(&w.state_dir());
    for want in ["journal", "locks", "outbox"] {
        assert!(
            written
                .iter()
                .any(|p| p.starts_with(w.state_dir().join(want))
                    && p.symlink_metadata().expect("lstat").is_file()),
            "no file under state/{want}: {written:?}\n{}",
            run.stderr
        );
    }
    for p in &written {
        let m = p.symlink_metadata().expect("lstat");
        assert_eq!(
            (m.uid(), m.gid()),
            (NOBODY, NOBODY),
            "{} belongs to {}:{}, not the agent's user",
            p.display(),
            m.uid(),
            m.gid()
        );
    }
    // The transaction ran green as the agent's user: PVE restored and destroyed the guest,
    // and every command in the container went through the root exec helper.
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(
        w.pve.writes().iter().any(|r| r.method == "POST"),
        "no restore reached PVE: {}",
        run.stderr
    );
    assert!(
        w.assert_pct_only_from_helper() > 0,
        "the provision ran no command in its container"
    );
    // ... but the root-only metrics folder stayed out of reach: the write was refused.
    let left: Vec<_> = std::fs::read_dir(&metrics)
        .expect("metrics dir")
        .map(|e| e.expect("entry").path())
        .collect();
    assert!(
        left.is_empty(),
        "the user wrote into root's folder: {left:?}"
    );
    assert!(
        run.stderr.contains("metrics not updated") && run.stderr.contains("Permission denied"),
        "{}",
        run.stderr
    );
}

#[test]
fn without_agent_user_a_root_run_stays_root() {
    // The other side of the test above: the same run without [agent] user writes its files as
    // root and its metrics into root's folder.
    assert_root();
    let w = world("launch_timeout_secs = 5\n");
    let run = w.agent(&["--selftest=provision", "-vmid", "140", "--json"]);
    assert!(!run.stderr.contains("switched to"), "{}", run.stderr);
    let written = tree(&w.state_dir());
    assert!(!written.is_empty());
    assert!(written
        .iter()
        .all(|p| p.symlink_metadata().expect("lstat").uid() == 0));
    assert!(
        w.files
            .metrics_dir
            .join("felhom_transactions.prom")
            .is_file(),
        "{}",
        run.stderr
    );
}

#[test]
fn an_unknown_agent_user_is_refused_before_anything_is_written() {
    assert_root();
    // No exec helper: it would refuse the same config before the agent runs.
    let opts = AgentOptions {
        extra_toml: as_user("felhom-no-such-user"),
        exec_helper: false,
        ..AgentOptions::default()
    };
    let w = World::with_options(demo_scenario(), &opts);
    let run = w.agent(&["--selftest=provision", "-vmid", "140", "--json"]);
    assert_ne!(run.code, Some(0), "{}", run.stdout);
    let doc = run.json();
    assert_eq!(doc["error"]["code"], "config_invalid", "{doc:#}");
    let msg = doc["error"]["message"].as_str().expect("message");
    assert!(msg.contains("\"felhom-no-such-user\""), "{msg}");
    assert!(msg.contains("adduser --system"), "{msg}");
    assert!(
        tree(&w.state_dir()).is_empty(),
        "{:?}",
        tree(&w.state_dir())
    );
    assert!(w.pve.requests().is_empty(), "{:?}", w.pve.requests());
}

/// A credentials folder as systemd makes it: 0500, the credential 0400.
fn credentials(dir: &Path, name: &str, secret: &str) {
    std::fs::create_dir_all(dir).expect("mkdir");
    let f = dir.join(name);
    std::fs::write(&f, secret).expect("write credential");
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o400)).expect("chmod");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o500)).expect("chmod");
}

#[test]
fn the_pve_token_comes_from_credentials_directory_when_systemd_hands_it_over() {
    assert_root();
    let w = world("");
    let secret = std::fs::read_to_string(&w.files.token_secret_file).expect("secret");
    // The configured file now holds a wrong secret: only the credential can authenticate.
    std::fs::write(&w.files.token_secret_file, "not-the-secret\n").expect("write");
    let creds = w.files.metrics_dir.with_file_name("credentials");
    credentials(&creds, "pve-token", secret.trim());
    let with = w
        .command()
        .args([
            "--selftest=provision",
            "-vmid",
            "140",
            "--dry-run",
            "--json",
        ])
        .env("CREDENTIALS_DIRECTORY", &creds)
        .output()
        .expect("run");
    let without = w
        .command()
        .args([
            "--selftest=provision",
            "-vmid",
            "140",
            "--dry-run",
            "--json",
        ])
        .env_remove("CREDENTIALS_DIRECTORY")
        .output()
        .expect("run");
    let (with_out, without_out) = (
        String::from_utf8_lossy(&with.stdout),
        String::from_utf8_lossy(&without.stdout),
    );
    assert!(!with_out.contains(secret.trim()) && !without_out.contains(secret.trim()));
    assert_eq!(
        with.status.code(),
        Some(0),
        "{with_out}\n{}",
        String::from_utf8_lossy(&with.stderr)
    );
    assert_ne!(without.status.code(), Some(0), "{without_out}");
}
