//! `--selftest=restore` against fakepve and the pct stand-in: band choice around foreign
//! guests (also one only the local list knows), a full band skips with zero writes, the restore
//! carries the network isolation (every stored NIC given, no `unique`), only the agent's own copy is destroyed, and the
//! metrics file is Prometheus text.
//!
//! The busybox bed: these tests walk the band, count writes and read the metrics, which a real
//! guest would only slow down (about 10 s a guest on 2 cores). Restore tests of real Debian
//! guests with the default check pack run in `real_guests_verdict.rs`.

use felhom_tests::agent::AgentRun;
use felhom_tests::fakepve::AgentOptions;
use felhom_tests::world::World;
use serde_json::{json, Value};

struct RestoreWorld {
    world: World,
}

impl RestoreWorld {
    fn new(scenario: Value) -> RestoreWorld {
        RestoreWorld {
            world: World::with_options(scenario, &AgentOptions::default()),
        }
    }

    fn metrics_dir(&self) -> &std::path::Path {
        &self.world.files.metrics_dir
    }

    fn agent(&self, args: &[&str]) -> AgentRun {
        self.world.agent(args)
    }

    fn metrics(&self) -> String {
        std::fs::read_to_string(self.metrics_dir().join("felhom_restore_test.prom"))
            .expect("metrics file")
    }
}

/// A strict reading of the Prometheus text format: HELP/TYPE comments, then
/// `name{labels} value` samples of declared metrics.
fn parse_prometheus(text: &str) -> Vec<(String, f64)> {
    let mut declared = std::collections::BTreeSet::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split(' ');
            let name = it.next().expect("name");
            let kind = it.next().expect("kind");
            assert!(["gauge", "counter"].contains(&kind), "{line}");
            declared.insert(name.to_string());
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        assert!(
            !line.starts_with('#') && !line.is_empty(),
            "stray line {line:?}"
        );
        let (series, value) = line.rsplit_once(' ').expect("sample");
        let name = series.split('{').next().expect("name");
        assert!(declared.contains(name), "{name} sampled before its TYPE");
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "{name}"
        );
        if let Some(labels) = series.strip_prefix(name) {
            if !labels.is_empty() {
                assert!(labels.starts_with('{') && labels.ends_with('}'), "{series}");
            }
        }
        samples.push((series.to_string(), value.parse::<f64>().expect("value")));
    }
    samples
}

fn sample(samples: &[(String, f64)], series: &str) -> f64 {
    samples
        .iter()
        .find(|(s, _)| s == series)
        .map(|(_, v)| *v)
        .unwrap_or_else(|| panic!("no {series}"))
}

#[test]
fn band_walks_around_foreign_guests_and_destroys_only_its_copy() {
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    // 990000 and 990001 are foreign guests the fake has; 990002 sits on another node and only
    // the local list knows it.
    scenario["vmlist_extra"] = json!([{"vmid": 990002, "node": "pve2", "type": "lxc"}]);
    let w = RestoreWorld::new(scenario);
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert_eq!(doc["guest"], json!(200));
    assert_eq!(doc["vmid"], json!(990003));
    assert_eq!(doc["outcome"], "ok");
    assert_eq!(doc["destroyed"], json!(true));
    assert_eq!(doc["kind"], "restore-test");
    // The copy's checks ran through the exec helper only, in three trips into the copy (each a
    // `pct` process on a node): the launch proof; the boot wait with the lab around it; every
    // check of every pack. A copy is never bootstrapped.
    assert_eq!(
        w.world.assert_pct_only_from_helper(),
        3,
        "{:#?}",
        w.world.bed.pct_calls()
    );

    let post = w
        .world
        .pve
        .requests()
        .into_iter()
        .find(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/lxc")
        .expect("the restore");
    // No `unique`: with it pve-container writes the backup's NICs over the request's.
    assert_eq!(post.param("unique"), None, "{post:?}");
    assert_eq!(post.param("vmid"), Some("990003"));
    let net0 = post.param("net0").unwrap_or("");
    assert!(
        net0.contains("link_down%3D1") || net0.contains("link_down=1"),
        "isolation in the request: {post:?}"
    );
    assert!(!net0.contains("bridge"), "no bridge: {net0}");

    let deletes: Vec<_> = w
        .world
        .pve
        .requests()
        .into_iter()
        .filter(|r| r.method == "DELETE" && !r.path.contains("/tasks/"))
        .collect();
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert!(deletes[0].targets_vmid(990003));
    for vmid in [990000, 990001, 101, 200] {
        assert!(
            w.world.pve.writes_for(vmid).is_empty(),
            "{vmid} was written"
        );
    }
    let samples = parse_prometheus(&w.metrics());
    assert_eq!(
        sample(&samples, "felhom_restore_test_outcome{outcome=\"ok\"}"),
        1.0
    );
    assert!(
        sample(
            &samples,
            "felhom_restore_test_last_success_timestamp_seconds"
        ) > 1.7e9
    );
}

#[test]
fn a_full_band_skips_with_zero_writes() {
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    scenario["vmlist_extra"] = json!((990002..=990009)
        .map(|v| json!({"vmid": v, "node": "pve2", "type": "qemu"}))
        .collect::<Vec<_>>());
    let w = RestoreWorld::new(scenario);
    let run = w.agent(&["--selftest=restore", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["run"]["outcome"], "skipped", "{doc:#}");
    assert_eq!(doc["copies"], json!([]), "{doc:#}");
    // The guest is left for a later run, named with its backup and why.
    assert_eq!(doc["left"][0]["guest"], json!(200), "{doc:#}");
    assert!(
        doc["left"][0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("990000-990009")),
        "{doc:#}"
    );
    assert!(
        w.world.pve.writes().is_empty(),
        "writes: {:?}",
        w.world.pve.writes()
    );
    let samples = parse_prometheus(&w.metrics());
    assert_eq!(
        sample(&samples, "felhom_restore_test_outcome{outcome=\"skipped\"}"),
        1.0
    );
    assert_eq!(sample(&samples, "felhom_restore_test_skipped_total"), 1.0);
    // A skip is a success (exit 0): it says why, and prints no `error` line.
    let run = w.agent(&["--selftest=restore"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout
            .contains("guest 200: backup local:backup/vzdump-lxc-200-")
            && run.stdout.contains("left for a later run"),
        "{}",
        run.stdout
    );
    for (name, text) in [("stdout", &run.stdout), ("stderr", &run.stderr)] {
        assert!(
            !text.lines().any(|l| l.starts_with("error [")),
            "an error line on {name} of a skip that exits 0: {text}"
        );
    }
}

#[test]
fn dry_run_names_backup_and_vmid_and_writes_nothing() {
    let w = RestoreWorld::new(felhom_tests::fakepve::demo_scenario());
    let run = w.agent(&["--selftest=restore", "--dry-run", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert_eq!(doc["vmid"], json!(990002));
    assert_eq!(doc["guest"], json!(200));
    assert_eq!(
        doc["backup"],
        "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst"
    );
    assert!(w.world.pve.writes().is_empty());
    assert!(
        !w.metrics_dir().join("felhom_restore_test.prom").exists(),
        "a dry run writes no metrics"
    );
}

/// The `--selftest=restore` run started (with `extra` args), SIGTERMed once its restore task's
/// UPID is journaled while the task still runs; its output.
fn sigterm_during_the_restore(w: &RestoreWorld, extra: &[&str]) -> AgentRun {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    use std::time::{Duration, Instant};
    // A restore of 8 real seconds, so SIGTERM lands inside it.
    w.world
        .pve
        .set(json!({"time_scale": 0.02, "ct_secs": {"create": 400}}));
    let mut args = vec!["--selftest=restore"];
    args.extend_from_slice(extra);
    let child = w
        .world
        .command()
        .args(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the agent");
    let deadline = Instant::now() + Duration::from_secs(60);
    let upid = loop {
        let open = w.world.journal().into_iter().find(|t| {
            t["kind"] == "restore-test" && t["upid"].is_string() && t["outcome"].is_null()
        });
        if let Some(t) = open {
            break t["upid"].as_str().expect("upid").to_string();
        }
        assert!(Instant::now() < deadline, "no restore UPID journaled");
        std::thread::sleep(Duration::from_millis(50));
    };
    let running = w
        .world
        .pve
        .tasks()
        .iter()
        .any(|t| t["upid"].as_str() == Some(upid.as_str()) && t["status"] == "running");
    assert!(
        running,
        "the restore task ended before the SIGTERM: the test proves nothing"
    );
    kill(
        Pid::from_raw(i32::try_from(child.id()).expect("pid")),
        Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let run: AgentRun = child.wait_with_output().expect("output").into();
    // Back to quick tasks for what follows.
    w.world
        .pve
        .set(json!({"time_scale": 0.01, "ct_secs": {"create": 30}}));
    run
}

#[test]
fn sigterm_during_the_restore_is_interrupted_and_the_resume_writes_its_outcome() {
    let w = RestoreWorld::new(felhom_tests::fakepve::demo_scenario());
    let run = sigterm_during_the_restore(&w, &["--json"]);
    assert_eq!(run.code, Some(130), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(
        run.json()["run"]["outcome"],
        "interrupted",
        "{}",
        run.stdout
    );
    let doc = run.restore_copy();
    assert_eq!(doc["outcome"], "interrupted", "{doc:#}");
    assert_eq!(doc["halted"]["code"], "interrupted", "{doc:#}");
    let metrics = w.metrics();
    let samples = parse_prometheus(&metrics);
    assert_eq!(
        sample(
            &samples,
            "felhom_restore_test_outcome{outcome=\"interrupted\"}"
        ),
        1.0,
        "{metrics}"
    );
    assert!(
        samples
            .iter()
            .filter(|(s, _)| s.contains("needs_human") || s.contains("failed"))
            .all(|(_, v)| *v == 0.0),
        "an interruption is no failure and needs no person:\n{metrics}"
    );
    let txn = doc["txn"].as_str().expect("txn").to_string();
    let row = w.world.journal_txn(&txn);
    assert_eq!(row["interrupted"], json!(true), "{row:#}");
    // The hub is told: an event of the open transaction with the code `interrupted` (no
    // result: nothing is settled yet, and nothing needs a person).
    let frames: Vec<Value> = w
        .world
        .spooled()
        .iter()
        .map(|f| serde_json::from_str(f).expect("a spooled frame is JSON"))
        .collect();
    let about: Vec<&Value> = frames
        .iter()
        .filter(|f| f["body"]["txn"] == json!(txn))
        .collect();
    assert_eq!(about.len(), 1, "{frames:#?}");
    assert_eq!(about[0]["type"], "event", "{:#}", about[0]);
    assert_eq!(
        about[0]["body"]["error"]["code"], "interrupted",
        "{:#}",
        about[0]
    );
    assert!(
        about[0]["body"]["detail"]
            .as_str()
            .is_some_and(|d| d.contains(&format!("journal resume {txn}"))),
        "{:#}",
        about[0]
    );

    // The resume follows the task to its end, checks and destroys the copy: `ok`, also in
    // the metrics (the last success with it).
    let resumed = w.agent(&["journal", "resume", &txn, "--json"]);
    assert_eq!(
        resumed.code,
        Some(0),
        "{}\n{}",
        resumed.stdout,
        resumed.stderr
    );
    assert_eq!(resumed.json()["outcome"], "ok", "{}", resumed.stdout);
    // Then its result, `ok`, beside the interruption's event.
    let results: Vec<Value> = w
        .world
        .spooled()
        .iter()
        .map(|f| serde_json::from_str::<Value>(f).expect("JSON"))
        .filter(|f| f["type"] == "result" && f["body"]["txn"] == json!(txn))
        .collect();
    assert_eq!(results.len(), 1, "{results:#?}");
    assert_eq!(results[0]["body"]["outcome"], "ok", "{:#}", results[0]);
    let metrics = w.metrics();
    let samples = parse_prometheus(&metrics);
    assert_eq!(
        sample(&samples, "felhom_restore_test_outcome{outcome=\"ok\"}"),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        sample(
            &samples,
            "felhom_restore_test_outcome{outcome=\"interrupted\"}"
        ),
        0.0,
        "{metrics}"
    );
    assert!(
        sample(
            &samples,
            "felhom_restore_test_last_success_timestamp_seconds"
        ) > 1.7e9,
        "{metrics}"
    );

    // The text says it too (the backup is proven now: `--guest` proves it again).
    let run = sigterm_during_the_restore(&w, &["--guest", "200"]);
    assert_eq!(run.code, Some(130), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains(": interrupted") && !run.stdout.contains("needs_human"),
        "{}",
        run.stdout
    );
}

#[test]
fn a_run_the_environment_stops_is_an_error_in_the_metrics_not_the_last_ok() {
    // A good run first: the metrics say `ok`, with its success time.
    let w = RestoreWorld::new(felhom_tests::fakepve::demo_scenario());
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let before = parse_prometheus(&w.metrics());
    let last_success = sample(
        &before,
        "felhom_restore_test_last_success_timestamp_seconds",
    );
    // The token's secret becomes a wrong one (the file keeps its owner and mode): PVE answers
    // 401, the run ends before its transaction exists, exit 6.
    std::fs::write(
        &w.world.files.token_secret_file,
        "00000000-0000-0000-0000-000000000000\n",
    )
    .expect("a wrong secret");
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(6), "{}\n{}", run.stdout, run.stderr);
    let metrics = w.metrics();
    let samples = parse_prometheus(&metrics);
    assert_eq!(
        sample(&samples, "felhom_restore_test_outcome{outcome=\"error\"}"),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        sample(&samples, "felhom_restore_test_outcome{outcome=\"ok\"}"),
        0.0,
        "{metrics}"
    );
    assert_eq!(
        sample(
            &samples,
            "felhom_restore_test_last_success_timestamp_seconds"
        ),
        last_success,
        "the last success stays: {metrics}"
    );
    assert_eq!(
        sample(&samples, "felhom_restore_test_runs_total"),
        2.0,
        "{metrics}"
    );
    // A dry run writes nothing, also when it fails.
    std::fs::remove_file(w.metrics_dir().join("felhom_restore_test.prom")).expect("rm");
    let run = w.agent(&["--selftest=restore", "--dry-run", "--json"]);
    assert_eq!(run.code, Some(6), "{}\n{}", run.stdout, run.stderr);
    assert!(!w.metrics_dir().join("felhom_restore_test.prom").exists());
}

/// The demo pool without its VM, and three more containers, each with a backup made an hour
/// ago: four guests whose backups are due.
fn pool_of_four() -> Value {
    felhom_tests::fakepve::pool_with_backups(&[(210, "shop"), (220, "shop-db"), (230, "mail")])
}

/// A backup of `vmid` made now (vzdump of the guest onto `local`), whose copy boots in the
/// bed; its volid.
fn newer_backup(w: &RestoreWorld, vmid: u32) -> Value {
    let volid = w.world.pve.call(
        "backup_guest",
        json!([
            vmid,
            format!("backup/vzdump-lxc-{vmid}-2026_12_07-00_00_00.tar.zst")
        ]),
        json!({}),
    );
    let key = volid.as_str().expect("volid").to_string();
    w.world.pve.set(json!({"backup_guests": {key: {}}}));
    volid
}

/// Add `line` to the world's `[restore_test]` section (made when missing).
fn set_restore_key(w: &RestoreWorld, line: &str) {
    let path = &w.world.files.config_path;
    let config = std::fs::read_to_string(path).expect("config");
    let config = if config.contains("[restore_test]") {
        config.replacen("[restore_test]", &format!("[restore_test]\n{line}"), 1)
    } else {
        format!("{config}\n[restore_test]\n{line}\n")
    };
    std::fs::write(path, config).expect("config");
}

/// The restore POSTs PVE received (one per copy).
fn restores(w: &RestoreWorld) -> usize {
    w.world
        .pve
        .requests()
        .iter()
        .filter(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/lxc")
        .count()
}

/// The copies of a run's document by the guest they prove: (guest, outcome, backup).
fn copies(doc: &Value) -> Vec<(u64, String, String)> {
    let mut out: Vec<(u64, String, String)> = doc["copies"]
        .as_array()
        .expect("copies")
        .iter()
        .map(|c| {
            (
                c["guest"].as_u64().expect("guest"),
                c["outcome"].as_str().unwrap_or("-").to_string(),
                c["backup"].as_str().unwrap_or("-").to_string(),
            )
        })
        .collect();
    out.sort();
    out
}

/// The report's rows as (vmid, status).
fn report_statuses(w: &RestoreWorld) -> (Option<i32>, Vec<(u64, String)>, Value) {
    let run = w.agent(&["restore-report", "--json"]);
    let doc = run.json();
    let rows = doc["guests"]
        .as_array()
        .expect("guests")
        .iter()
        .map(|r| {
            (
                r["vmid"].as_u64().expect("vmid"),
                r["status"].as_str().expect("status").to_string(),
            )
        })
        .collect();
    (run.code, rows, doc)
}

#[test]
fn one_run_proves_every_due_backup_several_at_once_and_only_a_newer_backup_is_due_again() {
    let w = RestoreWorld::new(pool_of_four());
    // Restores of 3 real seconds each, requests spaced by half a second (3 s on a node, where
    // a restore takes minutes): copies started together overlap at PVE.
    w.world
        .pve
        .set(json!({"time_scale": 0.01, "ct_secs": {"create": 300}}));
    let run: AgentRun = w
        .world
        .command()
        .env("FELHOM_AGENT_SUBMIT_SPACING_MS", "500")
        .args(["--selftest=restore", "--json"])
        .output()
        .expect("run the agent")
        .into();
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    let got = copies(&doc);
    assert_eq!(
        got.iter().map(|c| (c.0, c.1.as_str())).collect::<Vec<_>>(),
        vec![(200, "ok"), (210, "ok"), (220, "ok"), (230, "ok")],
        "{doc:#}"
    );
    assert_eq!(doc["run"]["due"], json!(4), "{doc:#}");
    assert_eq!(doc["run"]["peak_at_once"], json!(2), "{doc:#}");
    // At the source: two restore tasks of two copies ran at the same time, and never more
    // than `at_once` (2) copies existed at once.
    let tasks = w.world.pve.tasks();
    let restores_seen: Vec<(i64, i64)> = tasks
        .iter()
        .filter(|t| t["type"] == "vzcreate" || t["type"] == "vzrestore")
        .map(|t| {
            (
                t["starttime"].as_i64().expect("start"),
                t["endtime"].as_i64().expect("end"),
            )
        })
        .collect();
    assert_eq!(restores_seen.len(), 4, "{tasks:#?}");
    let overlapping = restores_seen.iter().enumerate().any(|(i, a)| {
        restores_seen
            .iter()
            .skip(i + 1)
            .any(|b| b.0 + 1 < a.1 && a.0 + 1 < b.1)
    });
    assert!(
        overlapping,
        "no two restores ran at once: {restores_seen:?}"
    );
    assert_eq!(restores(&w), 4);
    // Every copy destroyed, nothing else written to.
    for vmid in [200, 210, 220, 230, 101, 990000, 990001] {
        assert!(
            w.world.pve.writes_for(vmid).is_empty(),
            "{vmid} was written"
        );
    }
    for c in doc["copies"].as_array().expect("copies") {
        assert_eq!(c["destroyed"], json!(true), "{c:#}");
    }
    let (code, rows, report) = report_statuses(&w);
    assert_eq!(code, Some(0), "{report:#}");
    assert!(rows.iter().all(|(_, s)| s == "proven"), "{report:#}");
    assert_eq!(rows.len(), 4, "{report:#}");

    // A second run: nothing is due, nothing restored.
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.json()["copies"], json!([]), "{}", run.stdout);
    assert_eq!(restores(&w), 4, "a proven backup was restored again");
    let text = w.agent(&["--selftest=restore"]);
    assert!(text.stdout.contains("nothing due"), "{}", text.stdout);

    // A newer backup of 210: only 210 is due, and that backup is restored.
    let newer = newer_backup(&w, 210);
    let (code, rows, report) = report_statuses(&w);
    assert_eq!(code, Some(0), "merely due is not a failure: {report:#}");
    assert!(rows.contains(&(210, "due".to_string())), "{report:#}");
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let one = run.restore_copy();
    assert_eq!(one["guest"], json!(210), "{one:#}");
    assert_eq!(one["backup"], newer, "{one:#}");
    assert_eq!(restores(&w), 5);
    let (_, rows, report) = report_statuses(&w);
    assert!(rows.iter().all(|(_, s)| s == "proven"), "{report:#}");
    let r210 = &report["guests"][1];
    assert_eq!(r210["proven"]["volid"], newer, "{report:#}");

    // A newer backup of 220 whose copy fails the database's own check: 220 is failed, the
    // others proven, and the report exits 5.
    newer_backup(&w, 220);
    let pack = w.world.files.checks_dir.join("db.toml");
    std::fs::write(
        &pack,
        "[[check]]\nname = \"db-answers\"\nsql = \"SELECT 1 WHERE 1 = 0\"\nguests = [220]\n",
    )
    .expect("the db pack");
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(5), "{}\n{}", run.stdout, run.stderr);
    let one = run.restore_copy();
    assert_eq!(
        (one["guest"].clone(), one["verdict"].clone()),
        (json!(220), json!("failed")),
        "{one:#}"
    );
    let (code, rows, report) = report_statuses(&w);
    assert_eq!(code, Some(5), "{report:#}");
    assert_eq!(
        rows,
        vec![
            (200, "proven".to_string()),
            (210, "proven".to_string()),
            (220, "failed".to_string()),
            (230, "proven".to_string())
        ],
        "{report:#}"
    );
    let text = w.agent(&["restore-report"]);
    assert_eq!(text.code, Some(5));
    assert!(
        text.stdout
            .contains("failed test of local:backup/vzdump-lxc-220-2026_12_07")
            && text.stdout.contains("failing checks: db-answers"),
        "{}",
        text.stdout
    );
    // The guest's own record: the journal names it beside the copy.
    let last = w.agent(&[
        "journal",
        "--last",
        "restore-test",
        "--guest",
        "220",
        "--json",
    ]);
    let last = last.json();
    assert_eq!(last["guest"], json!(220), "{last:#}");
    assert_eq!(last["transaction"]["vmid"], json!(990002), "{last:#}");
    assert_eq!(last["transaction"]["outcome"], "failed", "{last:#}");
    // The failed backup is due again at the next run (the database answers now): proven.
    std::fs::remove_file(&pack).expect("rm the db pack");
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.restore_copy()["guest"], json!(220));
    let (code, _, report) = report_statuses(&w);
    assert_eq!(code, Some(0), "{report:#}");
}

#[test]
fn coverage_config_out_of_range_names_the_key() {
    let w = RestoreWorld::new(felhom_tests::fakepve::demo_scenario());
    for (line, key) in [
        ("prove_within = \"0d\"", "prove_within"),
        ("at_once = 11", "at_once"),
        ("at_once = \"many\"", "at_once"),
        ("run_budget = \"4x\"", "run_budget"),
        ("memory_reserve = \"95%\"", "memory_reserve"),
    ] {
        let before = std::fs::read_to_string(&w.world.files.config_path).expect("config");
        set_restore_key(&w, line);
        let run = w.agent(&["--selftest=restore", "--json"]);
        assert_eq!(run.code, Some(6), "{line}: {}\n{}", run.stdout, run.stderr);
        let doc = run.json();
        assert_eq!(doc["error"]["code"], "config_invalid", "{line}: {doc:#}");
        assert!(
            doc["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(&format!("[restore_test] {key}"))),
            "{line}: {doc:#}"
        );
        assert!(w.world.pve.writes().is_empty());
        std::fs::write(&w.world.files.config_path, before).expect("config");
    }
}

#[test]
fn the_coverage_metrics_name_each_guest_and_its_status() {
    let w = RestoreWorld::new(pool_of_four());
    let run = w.agent(&["--selftest=restore", "--guest", "210", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.restore_copy()["guest"], json!(210));
    let text = std::fs::read_to_string(w.metrics_dir().join("felhom_backup_coverage.prom"))
        .expect("the coverage file");
    let samples = parse_prometheus(&text);
    assert_eq!(
        sample(
            &samples,
            "felhom_backup_status{vmid=\"210\",status=\"proven\"}"
        ),
        1.0,
        "{text}"
    );
    for vmid in [200, 220, 230] {
        assert_eq!(
            sample(
                &samples,
                &format!("felhom_backup_status{{vmid=\"{vmid}\",status=\"due\"}}")
            ),
            1.0,
            "{text}"
        );
    }
    assert_eq!(
        sample(&samples, "felhom_guest_info{vmid=\"220\",name=\"shop-db\"}"),
        1.0,
        "{text}"
    );
}

/// Six guests, three copies at once, every PVE answer 250 ms late (so the copies under way
/// are nearly always in the middle of a request): when a copy ends, the next one's preflight
/// asks PVE while the other two go on; the client has two requests in flight at most, which
/// paused copies would otherwise hold for good. The run ends, every guest proven. Killed after
/// 90 s: a run whose copies wait on each other never ends.
#[test]
fn copies_under_way_go_on_while_the_next_is_admitted() {
    use std::time::{Duration, Instant};
    let w = RestoreWorld::new(felhom_tests::fakepve::pool_with_backups(&[
        (210, "shop"),
        (220, "shop-db"),
        (230, "mail"),
        (240, "dns"),
        (250, "wiki"),
    ]));
    w.world.pve.set(json!({"api_latency_ms": 250}));
    set_restore_key(&w, "at_once = 3");
    let mut child = w
        .world
        .command()
        .env("FELHOM_AGENT_SUBMIT_SPACING_MS", "200")
        .args(["--selftest=restore", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the agent");
    let deadline = Instant::now() + Duration::from_secs(90);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "the run did not end within 90 s:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let run: AgentRun = child.wait_with_output().expect("output").into();
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    assert_eq!(doc["run"]["peak_at_once"], json!(3), "{doc:#}");
    assert_eq!(copies(&doc).len(), 6, "{doc:#}");
    // At the source: never more than two of the run's requests at PVE at once (pvedaemon has
    // three workers), though three copies ran.
    let timings = w.world.pve.timings();
    let most = timings
        .iter()
        .map(|t| {
            timings
                .iter()
                .filter(|o| o.start <= t.start && t.start < o.end)
                .count()
        })
        .max()
        .unwrap_or(0);
    assert!(most <= 2, "{most} requests at PVE at once");
    assert_eq!(
        most, 2,
        "the copies never asked PVE together: the bound proves nothing"
    );
}

/// The storage's lock timing out in the restore task (pve-common `lock_file_full`: "can't lock
/// file '…' - got timeout", when another allocation holds it past 10 s) says nothing of the
/// backup: the copy is tried once more in the run, which then proves the guest; no red, and
/// nothing left for a person.
#[test]
fn a_storage_lock_timeout_is_tried_again_and_never_red() {
    let mut scenario = felhom_tests::fakepve::pool_with_backups(&[]);
    scenario["extra_errors"] = json!([{
        "key": "POST /nodes/{node}/lxc",
        "name": "storage_lock_timeout",
        "status": 500,
        "message": "can't lock file '/var/lock/pve-manager/pve-storage-local-lvm' - got timeout",
        "in_task": true
    }]);
    let w = RestoreWorld::new(scenario);
    w.world.pve.call(
        "fail",
        json!(["POST", "/nodes/pve1/lxc"]),
        json!({"error": "storage_lock_timeout", "times": 1}),
    );
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    let tries = doc["copies"].as_array().expect("copies");
    assert_eq!(tries.len(), 2, "{doc:#}");
    assert_eq!(tries[0]["outcome"], "failed", "{doc:#}");
    assert_eq!(tries[0]["verdict"], Value::Null, "{doc:#}");
    assert!(
        tries[0]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("got timeout")),
        "{doc:#}"
    );
    assert_eq!(tries[1]["outcome"], "ok", "{doc:#}");
    assert_eq!(doc["run"]["outcome"], "ok", "{doc:#}");
    assert_eq!(restores(&w), 2);
    let samples = parse_prometheus(&w.metrics());
    assert_eq!(
        sample(&samples, "felhom_restore_test_outcome{outcome=\"ok\"}"),
        1.0
    );
    let (code, rows, report) = report_statuses(&w);
    assert_eq!(code, Some(0), "{report:#}");
    assert_eq!(rows, vec![(200, "proven".to_string())], "{report:#}");
}

/// Now, in Unix seconds.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A vzdump task's UPID on node pve1 started at `start` (Unix seconds), as a job's state
/// names its last run (pve-manager `PVE/Jobs.pm` `started_job`).
fn vzdump_upid(start: u64) -> String {
    format!("UPID:pve1:00001234:00005678:{start:08X}:vzdump::root@pam:")
}

/// A world whose node has these backup jobs (`jobs.cfg`) and a job state folder of its own
/// (`jobs_state_dir`), with the demo pool's guest 200 and its backup.
fn world_with_jobs(jobs: &str) -> (RestoreWorld, tempfile::TempDir) {
    world_with_jobs_in(felhom_tests::fakepve::pool_with_backups(&[]), jobs)
}

/// [`world_with_jobs`] on this scenario.
fn world_with_jobs_in(scenario: Value, jobs: &str) -> (RestoreWorld, tempfile::TempDir) {
    let w = RestoreWorld {
        world: World::with_options(
            scenario,
            &AgentOptions {
                jobs_cfg: Some(jobs.to_string()),
                ..AgentOptions::default()
            },
        ),
    };
    let state = tempfile::tempdir().expect("a job state folder");
    let config = std::fs::read_to_string(&w.world.files.config_path).expect("config");
    std::fs::write(
        &w.world.files.config_path,
        format!(
            "jobs_state_dir = {:?}\n{config}",
            state.path().display().to_string()
        ),
    )
    .expect("config");
    (w, state)
}

/// The band's ten vmids as a backup job's `exclude` names them.
fn band_exclude() -> String {
    (990000..=990009)
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// While a backup job of this node runs (PVE's job state `started`, pve-manager `PVE/Jobs.pm`),
/// no copy starts: the job fixed its guest list at its start and could back up and lock a copy
/// (or fail on one gone by its turn). The guests stay due, named with the job; once the job
/// has stopped, the next run proves them. The job's next start is twelve hours away (its
/// schedule, counted from the run it just made), far outside the backup guard.
#[test]
fn no_copy_starts_while_a_backup_job_of_this_node_runs() {
    let now = unix_now();
    let far_hour = (now / 3600 + 12) % 24;
    let jobs = format!(
        "vzdump: backup-nightly\n\tschedule {far_hour:02}:00 UTC\n\tall 1\n\texclude {}\n\tmailto ops@example.net\n\nvzdump: backup-other-node\n\tschedule 22:00\n\tall 1\n\tnode pve2\n",
        band_exclude()
    );
    let (w, state) = world_with_jobs(&jobs);
    let job_state = |s: &str| {
        std::fs::write(
            state.path().join("vzdump-backup-nightly.json"),
            format!("{{\"state\":\"{s}\",\"upid\":\"{}\"}}", vzdump_upid(now)),
        )
        .expect("job state")
    };
    // Another node's job running says nothing of this node.
    std::fs::write(
        state.path().join("vzdump-backup-other-node.json"),
        "{\"state\":\"started\"}",
    )
    .expect("job state");
    job_state("started");
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    assert_eq!(doc["copies"], json!([]), "{doc:#}");
    assert!(
        doc["left"][0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("backup job backup-nightly runs on node pve1")),
        "{doc:#}"
    );
    assert_eq!(restores(&w), 0);
    let (code, rows, report) = report_statuses(&w);
    assert_eq!(code, Some(0), "merely due: {report:#}");
    assert_eq!(rows, vec![(200, "due".to_string())]);
    // The job stopped: the next run proves the guest.
    job_state("stopped");
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.restore_copy()["outcome"], "ok");
    assert_eq!(restores(&w), 1);
}

/// No copy starts within `[restore_test] backup_guard` (default 1 h) of a backup job's next
/// start: a daily job of this node that last ran yesterday starts again in about half an
/// hour (the first event of its schedule after its last run, pve-manager `PVE/Jobs.pm`
/// `run_jobs`), so the guest is left, the job and its start named. With a guard of ten
/// minutes the copy runs. A disabled job and another node's job never count, although by
/// their schedules (never run: their next start is now) they would start at once.
#[test]
fn no_copy_starts_within_the_backup_guard_of_a_jobs_next_start() {
    let now = unix_now();
    let start = (now + 30 * 60) / 60 * 60;
    let (h, m) = (start / 3600 % 24, start / 60 % 60);
    let jobs = format!(
        "vzdump: daily\n\tschedule {h:02}:{m:02} UTC\n\tpool felhom\n\nvzdump: paused\n\tschedule *:0/5\n\tall 1\n\tenabled 0\n\nvzdump: elsewhere\n\tschedule *:0/5\n\tall 1\n\tnode pve2\n"
    );
    let (w, state) = world_with_jobs(&jobs);
    std::fs::write(
        state.path().join("vzdump-daily.json"),
        format!(
            "{{\"state\":\"stopped\",\"upid\":\"{}\"}}",
            vzdump_upid(start - 86_400)
        ),
    )
    .expect("job state");
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    assert_eq!(doc["copies"], json!([]), "{doc:#}");
    let reason = doc["left"][0]["reason"].as_str().unwrap_or_default();
    let at = time::OffsetDateTime::from_unix_timestamp(start as i64)
        .expect("a time")
        .format(&time::format_description::well_known::Rfc3339)
        .expect("RFC 3339");
    assert!(
        reason.contains(&format!("backup job daily of node pve1 starts at {at}"))
            && reason.contains("backup_guard = 1h"),
        "{doc:#}"
    );
    assert_eq!(restores(&w), 0);
    set_restore_key(&w, "backup_guard = \"10m\"");
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.restore_copy()["outcome"], "ok", "{}", run.stdout);
    assert_eq!(restores(&w), 1);
}

/// How old a guest's newest backup may be comes from the schedule of the job that backs it up
/// when `[restore_test] backup_max_age` is not set: a day between two runs of a daily job
/// and one day more (2 days), a week and a day for a weekly one, 8 days with no job. A backup
/// three days old is stale under a daily job only; the config's key wins over any schedule.
#[test]
fn a_backup_is_stale_by_its_jobs_schedule() {
    let stale_of = |jobs: &str, key: Option<&str>| -> (Option<i32>, Value) {
        // The guest's backup was made three days ago.
        let mut scenario = felhom_tests::fakepve::pool_with_backups(&[]);
        for v in scenario["volumes"]["local"]
            .as_array_mut()
            .expect("volumes")
        {
            v["ctime"] = json!(unix_now() - 3 * 86_400);
        }
        let (w, _state) = world_with_jobs_in(scenario, jobs);
        if let Some(k) = key {
            set_restore_key(&w, k);
        }
        let run = w.agent(&["restore-report", "--json"]);
        let doc = run.json();
        (run.code, doc["guests"][0].clone())
    };
    let daily = "vzdump: daily\n\tschedule 02:00\n\tpool felhom\n";
    let (code, row) = stale_of(daily, None);
    assert_eq!(
        (code, &row["stale"], &row["stale_after"]),
        (Some(5), &json!(true), &json!(2 * 86_400)),
        "{row:#}"
    );
    let weekly = format!(
        "vzdump: weekly\n\tschedule sat 02:00\n\tall 1\n\texclude {}\n",
        band_exclude()
    );
    let (_, row) = stale_of(&weekly, None);
    assert_eq!(
        (&row["stale"], &row["stale_after"]),
        (&json!(false), &json!(8 * 86_400)),
        "{row:#}"
    );
    // A daily job of another pool does not back the guest up: the default holds.
    let (_, row) = stale_of("vzdump: other\n\tschedule 02:00\n\tpool shop\n", None);
    assert_eq!(
        (&row["stale"], &row["stale_after"]),
        (&json!(false), &json!(8 * 86_400)),
        "{row:#}"
    );
    let (_, row) = stale_of(daily, Some("backup_max_age = \"4d\""));
    assert_eq!(
        (&row["stale"], &row["stale_after"]),
        (&json!(false), &json!(4 * 86_400)),
        "{row:#}"
    );
}

/// Four copies allowed at once, but each restore allocates 8 GiB and the target storage has
/// 20 GiB free: two at a time, the others wait for a copy to end; then a node whose memory
/// (its meminfo) leaves room for one 512 MiB copy beside the reserve: one at a time. Every
/// guest is proven either way, never started into a full storage or an out-of-memory node.
#[test]
fn copies_wait_for_the_storage_space_and_the_memory_they_need() {
    let with_disks = || {
        let mut s = pool_of_four();
        for v in s["volumes"]["local"].as_array_mut().expect("volumes") {
            let vmid = v["vmid"].as_u64().expect("vmid");
            v["config"]["rootfs"] = json!(format!("local-lvm:vm-{vmid}-disk-0,size=8G"));
        }
        s
    };
    let run_at_four = |w: &RestoreWorld, meminfo: Option<&std::path::Path>| -> Value {
        set_restore_key(w, "at_once = 4");
        let mut cmd = w.world.command();
        cmd.env("FELHOM_AGENT_SUBMIT_SPACING_MS", "200")
            .args(["--selftest=restore", "--json"]);
        if let Some(m) = meminfo {
            cmd.env("FELHOM_AGENT_MEMINFO", m);
        }
        let run: AgentRun = cmd.output().expect("run the agent").into();
        assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
        run.json()
    };
    // The storage: 20 GiB free, 8 GiB a copy.
    let mut scenario = with_disks();
    scenario["storages"] = json!({"local-lvm": {"avail": 20u64 << 30}});
    let w = RestoreWorld::new(scenario);
    let doc = run_at_four(&w, None);
    assert_eq!(copies(&doc).len(), 4, "{doc:#}");
    assert!(copies(&doc).iter().all(|c| c.1 == "ok"), "{doc:#}");
    assert_eq!(doc["run"]["peak_at_once"], json!(2), "{doc:#}");

    // The memory: 4 GiB in all, 1000 MiB available, 10 % kept: room for one copy of 512 MiB.
    let w = RestoreWorld::new(with_disks());
    let dir = tempfile::tempdir().expect("tmp");
    let meminfo = dir.path().join("meminfo");
    std::fs::write(
        &meminfo,
        "MemTotal:        4194304 kB\nMemFree:          512000 kB\nMemAvailable:    1024000 kB\n",
    )
    .expect("meminfo");
    let doc = run_at_four(&w, Some(&meminfo));
    assert_eq!(copies(&doc).len(), 4, "{doc:#}");
    assert!(copies(&doc).iter().all(|c| c.1 == "ok"), "{doc:#}");
    assert_eq!(doc["run"]["peak_at_once"], json!(1), "{doc:#}");

    // Too little for even one: nothing restored, every guest left due with why.
    let w = RestoreWorld::new(with_disks());
    std::fs::write(
        &meminfo,
        "MemTotal:        4194304 kB\nMemFree:          100000 kB\nMemAvailable:     600000 kB\n",
    )
    .expect("meminfo");
    let doc = run_at_four(&w, Some(&meminfo));
    assert_eq!(doc["copies"], json!([]), "{doc:#}");
    let left = doc["left"].as_array().expect("left");
    assert_eq!(left.len(), 4, "{doc:#}");
    assert!(
        left.iter().all(|l| l["reason"]
            .as_str()
            .is_some_and(|r| r.contains("not enough memory on node pve1"))),
        "{doc:#}"
    );
    assert_eq!(restores(&w), 0);
}

/// A form-encoded value as text (`+` a space, `%XX` a byte).
fn form_decode(v: &str) -> String {
    let mut out = Vec::new();
    let b = v.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).expect("hex");
                out.push(u8::from_str_radix(hex, 16).expect("hex"));
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).expect("UTF-8")
}

/// `[restore_test] note_backups = true`: the verdict goes into the backup's notes as one line of
/// the agent's, replaced at the next proof, every other line kept, `protected` never sent; when
/// the notes cannot be read, nothing is written (a rewrite would erase them).
#[test]
fn the_verdict_is_noted_beside_the_backup_keeping_what_was_there() {
    const VOLID: &str = "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst";
    let mut scenario = felhom_tests::fakepve::pool_with_backups(&[]);
    scenario["volumes"]["local"][0]["notes"] = json!("web1 nightly\nkept for the audit");
    let w = RestoreWorld::new(scenario);
    set_restore_key(&w, "note_backups = true");
    // The notes as PVE last received them: the body of the last PUT of the volume.
    let notes = |w: &RestoreWorld| -> String {
        let put = w
            .world
            .pve
            .requests()
            .into_iter()
            .rev()
            .find(|r| r.method == "PUT" && r.path.contains("/storage/local/content/"))
            .expect("a PUT of the backup's notes");
        form_decode(put.param("notes").expect("notes in the PUT"))
    };
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let txn = run.restore_copy()["txn"].as_str().expect("txn").to_string();
    assert!(
        !run.stderr.contains("was not written into the notes"),
        "{}",
        run.stderr
    );
    let first = notes(&w);
    let lines: Vec<&str> = first.lines().collect();
    assert_eq!(lines.len(), 3, "{first}");
    assert_eq!(
        &lines[..2],
        ["web1 nightly", "kept for the audit"],
        "{first}"
    );
    assert!(
        lines[2].starts_with("felhom-restore-test: ok ") && lines[2].contains(&txn),
        "{first}"
    );
    assert!(lines[2].len() <= 200);
    // Proven again: the agent's line is replaced, not added.
    let run = w.agent(&["--selftest=restore", "--guest", "200", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let txn2 = run.restore_copy()["txn"].as_str().expect("txn").to_string();
    let second = notes(&w);
    assert_eq!(second.lines().count(), 3, "{second}");
    assert!(second.contains(&txn2) && !second.contains(&txn), "{second}");
    let puts: Vec<_> = w
        .world
        .pve
        .requests()
        .into_iter()
        .filter(|r| r.method == "PUT" && r.path.contains("/storage/local/content/"))
        .collect();
    assert_eq!(puts.len(), 2, "{puts:?}");
    assert!(
        puts.iter().all(|r| !r.body.contains("protected")),
        "{puts:?}"
    );
    // The notes do not read: nothing is written, the verdict stands.
    w.world.pve.call(
        "fail",
        json!(["GET", format!("/nodes/pve1/storage/local/content/{VOLID}")]),
        json!({"status": 500, "message": "got timeout"}),
    );
    let run = w.agent(&["--selftest=restore", "--guest", "200", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.restore_copy()["verdict"], "ok");
    assert_eq!(notes(&w), second, "the notes changed after a failed read");
    assert!(
        run.stderr.contains("was not written into the notes"),
        "{}",
        run.stderr
    );
}

/// A backup job that started while a copy existed holds it: vzdump locks the copy's config
/// `backup` for the whole backup (pve-manager `PVE/VZDump.pm`), and PVE refuses to stop or
/// destroy a locked guest. The copy is waited for (the agent says so, naming it) and
/// destroyed once the backup unlocked it: the run ends ok and nothing is left. Waited for too
/// long (a test bound of 1.5 s), it is left for a human, named with its lock and the command.
#[test]
fn a_copy_a_backup_holds_is_destroyed_once_the_backup_lets_go() {
    use std::io::BufRead;
    let w = RestoreWorld::new(felhom_tests::fakepve::pool_with_backups(&[]));
    // The copy's vmid: the band's first free one (the demo's foreign guests hold 990000 and
    // 990001).
    // Held from the copy's start until the test lets go (an hour, far beyond the test).
    w.world
        .pve
        .set(json!({"backup_lock_after_start": {"990002": 3600}}));
    let mut child = w
        .world
        .command()
        .args(["--selftest=restore", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the agent");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line.clone());
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let mut waiting = None;
    while std::time::Instant::now() < deadline {
        match rx.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok(line) if line.contains("guest 990002 is locked by a backup") => {
                waiting = Some(line);
                break;
            }
            Ok(_) | Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    // While it waits, nothing of the destroy reached PVE.
    let deletes = w.world.pve.deletes_for(990002).len();
    w.world.pve.guest_set(990002, json!({"lock": null}));
    let out = child.wait_with_output().expect("the agent ends");
    let stderr = reader.join().expect("stderr reader");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        waiting.is_some_and(|l| l.contains("waiting up to 120 min")),
        "no word of the wait: {stderr}"
    );
    assert_eq!(
        deletes, 0,
        "a destroy was sent while the backup held the copy"
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let doc: Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(doc["copies"][0]["outcome"], "ok", "{doc:#}");
    assert!(w.world.pve.guest(990002).is_none(), "the copy is left");

    // Held longer than the agent waits: left for a human, named with the lock.
    w.world
        .pve
        .set(json!({"backup_lock_after_start": {"990002": 3600}}));
    let out = w
        .world
        .command()
        .env("FELHOM_AGENT_BACKUP_LOCK_WAIT_MS", "1500")
        .args(["--selftest=restore", "--guest", "200", "--json"])
        .output()
        .expect("run the agent");
    let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let copy = &doc["copies"][0];
    assert_eq!(out.status.code(), Some(7), "{doc:#}");
    assert_eq!(copy["error"]["code"], "guest_locked", "{doc:#}");
    assert!(
        copy["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("is locked (backup)") && m.contains("pct destroy 990002")),
        "{doc:#}"
    );
    assert_eq!(
        w.world
            .pve
            .guest(990002)
            .and_then(|g| g["lock"].as_str().map(str::to_string)),
        Some("backup".to_string())
    );
    w.world.pve.guest_set(990002, json!({"lock": null}));
}
