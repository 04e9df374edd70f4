//! `felhom-agent metrics-publish` (root, `felhom-agent-metrics.service`): node_exporter's
//! textfile folder gets only regular files root wrote from what the agent wrote, or nothing.
//! The reader here does what node_exporter's textfile collector does (`collector/textfile.go`:
//! list the folder, `os.Open` every `*.prom`, following links and blocking on a FIFO), with a
//! deadline instead of hanging.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use felhom_tests::agent::agent_command;
use felhom_tests::world::World;

/// Run `metrics-publish --from from --to to` with a deadline: its exit status and stderr.
fn publish(config: &Path, from: &Path, to: &Path) -> (Option<i32>, String) {
    let mut child = agent_command(config)
        .arg("metrics-publish")
        .arg("--from")
        .arg(from)
        .arg("--to")
        .arg(to)
        .env("FELHOM_AGENT_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("metrics-publish");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("wait");
            panic!(
                "metrics-publish hung (a FIFO opened?): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("wait");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// What node_exporter's collector reads from `dir`: every `*.prom` opened as `os.Open` does
/// (following links, blocking on a FIFO), each with a deadline: name → content, or `None`
/// when the open or read failed or hung.
fn node_exporter_reads(dir: &Path) -> Vec<(String, Option<String>)> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("read_dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".prom"))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let path = dir.join(&n);
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = tx.send(std::fs::read_to_string(&path).ok());
            });
            let got = rx.recv_timeout(Duration::from_secs(5)).ok().flatten();
            (n, got)
        })
        .collect()
}

fn folder(base: &Path, name: &str) -> PathBuf {
    let d = base.join(name);
    std::fs::create_dir(&d).expect("mkdir");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    d
}

#[test]
fn node_exporter_gets_only_regular_files_the_agent_wrote_or_nothing() {
    let w = World::demo();
    let base = tempfile::Builder::new()
        .prefix("felhom-publish-")
        .tempdir()
        .expect("tempdir");
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let agent = folder(base.path(), "agent");
    let ne = folder(base.path(), "node-exporter");
    let config = &w.files.config_path;

    // A fresh install: nothing written yet, nothing published, nothing for node_exporter to
    // fail on.
    let (code, log) = publish(config, &agent, &ne);
    assert_eq!(code, Some(0), "{log}");
    assert!(
        node_exporter_reads(&ne).is_empty(),
        "{:?}",
        node_exporter_reads(&ne)
    );

    // What the agent's user could put there: a FIFO, a link to a file node_exporter may read,
    // samples of another metric, a timestamp, a file of another user; and one good file.
    let secret = base.path().join("secret");
    std::fs::write(&secret, "felhom_stolen 1\n").expect("secret");
    nix::unistd::mkfifo(
        &agent.join("felhom_hub.prom"),
        nix::sys::stat::Mode::from_bits_truncate(0o644),
    )
    .expect("mkfifo");
    std::os::unix::fs::symlink(&secret, agent.join("felhom_transactions.prom")).expect("symlink");
    let good = "# HELP felhom_restore_test_runs_total Restore-test runs.\n\
                # TYPE felhom_restore_test_runs_total counter\n\
                felhom_restore_test_runs_total 3\n";
    std::fs::write(agent.join("felhom_restore_test.prom"), good).expect("good");
    // Copies published earlier, and the link an older package made: all must go.
    std::fs::write(ne.join("felhom_hub.prom"), "felhom_hub_connected 1\n").expect("old copy");
    std::os::unix::fs::symlink(
        agent.join("felhom_transactions.prom"),
        ne.join("felhom_transactions.prom"),
    )
    .expect("old link");

    let (code, log) = publish(config, &agent, &ne);
    assert_eq!(code, Some(0), "{log}");
    let seen = node_exporter_reads(&ne);
    assert_eq!(
        seen,
        vec![(
            "felhom_restore_test.prom".to_string(),
            Some(good.to_string())
        )],
        "{log}"
    );
    let meta = std::fs::symlink_metadata(ne.join("felhom_restore_test.prom")).expect("meta");
    assert!(meta.file_type().is_file() && meta.uid() == 0 && meta.mode() & 0o7777 == 0o644);
    assert!(
        log.contains("felhom_hub.prom") && log.contains("not a regular file"),
        "{log}"
    );
    assert!(
        log.contains("felhom_transactions.prom") && log.contains("symbolic link"),
        "{log}"
    );

    // Text the agent does not write, and a file of another user: refused, removed.
    for (name, text) in [
        ("felhom_restore_test.prom", "node_load1 99\n"),
        (
            "felhom_restore_test.prom",
            "felhom_restore_test_runs_total 3 1700000000000\n",
        ),
    ] {
        std::fs::write(agent.join(name), text).expect("write");
        let (code, log) = publish(config, &agent, &ne);
        assert_eq!(code, Some(0), "{log}");
        assert!(node_exporter_reads(&ne).is_empty(), "{text:?}: {log}");
    }
    std::fs::write(agent.join("felhom_restore_test.prom"), good).expect("good");
    nix::unistd::chown(
        &agent.join("felhom_restore_test.prom"),
        Some(65534.into()),
        None,
    )
    .expect("chown");
    let (_, log) = publish(config, &agent, &ne);
    assert!(node_exporter_reads(&ne).is_empty(), "{log}");
    assert!(log.contains("uid 65534"), "{log}");
    // Nothing is ever left behind in node_exporter's folder but published files.
    let left: Vec<_> = std::fs::read_dir(&ne).expect("ls").flatten().collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn what_the_agent_writes_is_published_as_it_wrote_it() {
    let w = World::demo();
    let run = w.agent(&["--selftest=provision", "-vmid", "172", "--json"]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let base = tempfile::Builder::new()
        .prefix("felhom-publish-")
        .tempdir()
        .expect("tempdir");
    let ne = folder(base.path(), "node-exporter");
    let (code, log) = publish(&w.files.config_path, &w.files.metrics_dir, &ne);
    assert_eq!(code, Some(0), "{log}");
    let seen = node_exporter_reads(&ne);
    let written = std::fs::read_to_string(w.files.metrics_dir.join("felhom_transactions.prom"))
        .expect("the agent's metrics file");
    assert!(
        seen.contains(&("felhom_transactions.prom".to_string(), Some(written))),
        "{seen:?}\n{log}"
    );
}
