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

/// The publisher's own file in node_exporter's folder: what its last pass published.
const STATUS: &str = "felhom_metrics_publish.prom";

/// What node_exporter's collector reads from `dir`: every `*.prom` but the publisher's
/// [`STATUS`] opened as `os.Open` does (following links, blocking on a FIFO), each with a
/// deadline: name → content, or `None` when the open or read failed or hung.
fn node_exporter_reads(dir: &Path) -> Vec<(String, Option<String>)> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("read_dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".prom") && n != STATUS)
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

/// The publisher's [`STATUS`] in `dir`, as (file, published) in the order of its lines; it
/// is a regular file of root, mode 0644, whose every line is a HELP, a TYPE or a sample of
/// `felhom_metrics_published`.
fn status(dir: &Path) -> Vec<(String, bool)> {
    let path = dir.join(STATUS);
    let meta = std::fs::symlink_metadata(&path).expect("the publisher's status file");
    assert!(meta.file_type().is_file() && meta.uid() == 0 && meta.mode() & 0o7777 == 0o644);
    let text = std::fs::read_to_string(&path).expect("read");
    text.lines()
        .filter(|l| {
            !l.starts_with("# HELP felhom_metrics_published ")
                && *l != "# TYPE felhom_metrics_published gauge"
        })
        .map(|l| {
            let rest = l
                .strip_prefix("felhom_metrics_published{file=\"")
                .unwrap_or_else(|| panic!("{l:?} in {text}"));
            let (file, value) = rest.split_once("\"} ").expect("a sample");
            assert!(value == "0" || value == "1", "{l}");
            (file.to_string(), value == "1")
        })
        .collect()
}

/// The status as the publisher writes it when `published` were published.
fn want_status(published: &[&str]) -> Vec<(String, bool)> {
    [
        "felhom_transactions.prom",
        "felhom_hub.prom",
        "felhom_restore_test.prom",
        "felhom_backup_coverage.prom",
    ]
    .iter()
    .map(|f| (f.to_string(), published.contains(f)))
    .collect()
}

/// A copy of `w`'s config whose `[metrics] dir` is `dir` (metrics-publish refuses a --from
/// that is not [metrics] dir).
fn config_for(w: &World, dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(&w.files.config_path).expect("config");
    let old = format!(
        "[metrics]\ndir = {}\n",
        felhom_tests::fakepve::toml_string(&w.files.metrics_dir.to_string_lossy())
    );
    assert!(text.contains(&old), "{text}");
    let new = format!(
        "[metrics]\ndir = {}\n",
        felhom_tests::fakepve::toml_string(&dir.to_string_lossy())
    );
    let path = dir.with_extension("toml");
    std::fs::write(&path, text.replace(&old, &new)).expect("config copy");
    path
}

fn folder(base: &Path, name: &str) -> PathBuf {
    let d = base.join(name);
    std::fs::create_dir(&d).expect("mkdir");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    d
}

/// A folder of mode 0755 for one test's folders, removed when dropped.
fn base() -> tempfile::TempDir {
    let base = tempfile::Builder::new()
        .prefix("felhom-publish-")
        .tempdir()
        .expect("tempdir");
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    base
}

/// The two folders of a publish in a [`base`] of their own: the agent's (the `[metrics] dir`
/// of `config`, a copy of the world's config) and node_exporter's.
struct Folders {
    base: tempfile::TempDir,
    agent: PathBuf,
    ne: PathBuf,
    config: PathBuf,
}

fn folders(w: &World) -> Folders {
    let base = base();
    let agent = folder(base.path(), "agent");
    let ne = folder(base.path(), "node-exporter");
    let config = config_for(w, &agent);
    Folders {
        base,
        agent,
        ne,
        config,
    }
}

#[test]
fn node_exporter_gets_only_regular_files_the_agent_wrote_or_nothing() {
    let w = World::demo();
    let Folders {
        base,
        agent,
        ne,
        config,
    } = folders(&w);
    let config = &config;

    // A fresh install: nothing written yet, nothing published, nothing for node_exporter to
    // fail on.
    let (code, log) = publish(config, &agent, &ne);
    assert_eq!(code, Some(0), "{log}");
    assert!(
        node_exporter_reads(&ne).is_empty(),
        "{:?}",
        node_exporter_reads(&ne)
    );
    // The publisher says so: nothing published (the alert on a missing file can fire).
    assert_eq!(status(&ne), want_status(&[]), "{log}");

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
    assert_eq!(
        status(&ne),
        want_status(&["felhom_restore_test.prom"]),
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
        // Label sets the agent never writes: __name__, instance=, a broken set, another
        // file's metric.
        (
            "felhom_restore_test.prom",
            "felhom_restore_test_runs_total{__name__=\"node_load1\"} 3\n",
        ),
        (
            "felhom_restore_test.prom",
            "felhom_restore_test_outcome{outcome=\"ok\",instance=\"other-node:9100\"} 1\n",
        ),
        (
            "felhom_restore_test.prom",
            "felhom_restore_test_outcome{outcome=\"ok\" 1\n",
        ),
        ("felhom_restore_test.prom", "felhom_hub_connected 1\n"),
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
    assert_eq!(status(&ne), want_status(&[]), "{log}");
    // Nothing is ever left behind in node_exporter's folder but published files and the
    // publisher's status.
    let left: Vec<_> = std::fs::read_dir(&ne)
        .expect("ls")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(left, vec![STATUS.to_string()]);
}

#[test]
fn what_the_agent_writes_is_published_as_it_wrote_it() {
    let w = World::demo();
    let run = w.agent(&["--selftest=provision", "-vmid", "172", "--json"]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let base = base();
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

#[test]
fn from_must_be_the_folder_the_agent_writes_into() {
    // The unit's --from names the folder its path unit watches; a [metrics] dir elsewhere
    // would publish nothing the agent writes, for good. Refused, naming both.
    let w = World::demo();
    let base = base();
    let other = folder(base.path(), "other");
    let ne = folder(base.path(), "node-exporter");
    std::fs::write(
        other.join("felhom_hub.prom"),
        "felhom_hub_connected 1\nfelhom_outbox_depth 0\n",
    )
    .expect("write");
    let (code, log) = publish(&w.files.config_path, &other, &ne);
    assert_eq!(code, Some(6), "{log}");
    assert!(
        log.contains("is not [metrics] dir")
            && log.contains(&w.files.metrics_dir.to_string_lossy().to_string()),
        "{log}"
    );
    assert!(node_exporter_reads(&ne).is_empty());
}

#[test]
fn a_refused_agent_folder_removes_the_published_copies() {
    let w = World::demo();
    let Folders {
        base: _base,
        agent,
        ne,
        config,
    } = folders(&w);
    std::fs::write(
        agent.join("felhom_hub.prom"),
        "felhom_hub_connected 1\nfelhom_outbox_depth 0\n",
    )
    .expect("write");
    let (code, log) = publish(&config, &agent, &ne);
    assert_eq!(code, Some(0), "{log}");
    assert_eq!(node_exporter_reads(&ne).len(), 1, "{log}");
    // The folder becomes writable by all: the writer's check refuses it, and what was
    // published from it goes.
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let (code, log) = publish(&config, &agent, &ne);
    assert_eq!(code, Some(6), "{log}");
    assert!(node_exporter_reads(&ne).is_empty(), "{log}");
    assert!(log.contains("published copies were removed"), "{log}");
    assert_eq!(status(&ne), want_status(&[]), "{log}");
}

#[test]
fn made_up_label_values_are_refused_so_no_write_can_publish_thousands_of_series() {
    let w = World::demo();
    let Folders {
        base: _base,
        agent,
        ne,
        config,
    } = folders(&w);
    // 5,000 series of kinds the agent never writes, each line well-formed.
    let made_up: String = (0..5000)
        .map(|i| format!("felhom_transactions_total{{kind=\"k{i}\",outcome=\"ok\"}} 1\n"))
        .collect();
    // One made-up outcome among the agent's own.
    let outcome = "felhom_restore_test_outcome{outcome=\"ok\"} 1\n\
                   felhom_restore_test_outcome{outcome=\"aaaaaaaa\"} 0\n";
    // Guests' series: a vmid PVE never gives, a status the agent never writes.
    let coverage = "felhom_backup_stale{vmid=\"100\"} 0\n\
                    felhom_backup_stale{vmid=\"42\"} 0\n\
                    felhom_backup_status{vmid=\"100\",status=\"fine\"} 1\n";
    std::fs::write(agent.join("felhom_transactions.prom"), &made_up).expect("write");
    std::fs::write(agent.join("felhom_restore_test.prom"), outcome).expect("write");
    std::fs::write(agent.join("felhom_backup_coverage.prom"), coverage).expect("write");
    std::fs::write(
        agent.join("felhom_hub.prom"),
        "felhom_hub_configured 0\nfelhom_hub_connected 0\nfelhom_outbox_depth 0\n",
    )
    .expect("write");
    let (code, log) = publish(&config, &agent, &ne);
    assert_eq!(code, Some(0), "{log}");
    let seen: Vec<String> = node_exporter_reads(&ne)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(seen, vec!["felhom_hub.prom".to_string()], "{log}");
    assert!(
        log.contains("felhom_transactions.prom")
            && log.contains("line 1 has a value of label kind"),
        "{log}"
    );
    assert!(
        log.contains("felhom_restore_test.prom")
            && log.contains("line 2 has a value of label outcome"),
        "{log}"
    );
    assert!(
        log.contains("felhom_backup_coverage.prom")
            && log.contains("line 2 has a value of label vmid"),
        "{log}"
    );
    assert_eq!(status(&ne), want_status(&["felhom_hub.prom"]), "{log}");
}

#[test]
fn with_idle_exit_it_follows_every_change_then_exits_when_still() {
    let w = World::demo();
    let Folders {
        base: _base,
        agent,
        ne,
        config,
    } = folders(&w);
    let mut child = agent_command(&config)
        .args(["metrics-publish", "--idle-exit", "3", "--from"])
        .arg(&agent)
        .arg("--to")
        .arg(&ne)
        .env("FELHOM_AGENT_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("metrics-publish");
    let text = |n: u32| format!("felhom_hub_connected 1\nfelhom_outbox_depth {n}\n");
    let published = ne.join("felhom_hub.prom");
    // Every change is followed by the one process, each within a few seconds.
    for n in 1..=5 {
        let tmp = agent.join(".felhom_hub.prom.tmp");
        std::fs::write(&tmp, text(n)).expect("write");
        std::fs::rename(&tmp, agent.join("felhom_hub.prom")).expect("rename");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(&published).ok() != Some(text(n)) {
            assert!(
                Instant::now() < deadline,
                "change {n} not published; the publisher {}",
                match child.try_wait() {
                    Ok(Some(s)) => format!("exited: {s}"),
                    _ => "runs".to_string(),
                }
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            matches!(child.try_wait(), Ok(None)),
            "it exited after change {n}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Still for 3 s: it exits 0.
    let started = Instant::now();
    let status = loop {
        if let Ok(Some(s)) = child.try_wait() {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "it never exited"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().expect("wait");
    assert!(status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "it exited before the folder was still for 3 s"
    );
}
