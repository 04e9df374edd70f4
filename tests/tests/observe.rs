//! What an operator watches, end to end against fakepve with tasks that take time:
//!
//! - `journal --stats --json` agrees with the phase timestamps of the journal's records
//!   (recomputed here from the files, nearest-rank), and a phase that waits on a PVE task lasts
//!   at least as long as the fake's task;
//! - every metrics file the agent writes passes `promtool check metrics` (promtool is required:
//!   tests/setup.sh installs it), and its counters match the transactions run;
//! - the Grafana dashboard parses and uses only metric names the agent writes;
//! - a symlink at every name the agent writes in the metrics folder (final names and the
//!   predictable temporary names) leaves its target untouched.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use felhom_tests::guestbed::repo_root;
use felhom_tests::world::World;
use serde_json::Value;

/// The fake's container restore: 30 PVE seconds at the world's time scale (world.rs).
const RESTORE_TASK_S: f64 = 30.0 * 0.01;

/// The names the agent writes in the metrics folder.
const METRICS_FILES: [&str; 4] = [
    "felhom_transactions.prom",
    "felhom_hub.prom",
    "felhom_restore_test.prom",
    "felhom_backup_coverage.prom",
];

fn promtool() -> PathBuf {
    let out = Command::new("sh")
        .args(["-c", "command -v promtool"])
        .output()
        .expect("sh");
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        out.status.success() && !path.is_empty(),
        "promtool is missing: run tests/setup.sh (it installs the Debian package prometheus)"
    );
    PathBuf::from(path)
}

fn promtool_check_metrics(file: &Path) {
    let text = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let mut child = Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(&text).expect("write");
    }
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics {}:\n{}{}",
        file.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `name{labels}` → value of every sample.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, v) = l.rsplit_once(' ').expect("sample");
            (series.to_string(), v.parse::<f64>().expect("value"))
        })
        .collect()
}

fn sample_names(text: &str) -> BTreeSet<String> {
    samples(text)
        .keys()
        .map(|s| s.split('{').next().unwrap_or(s).to_string())
        .collect()
}

fn nearest_rank(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn parse_rfc3339(s: &str) -> f64 {
    let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|e| panic!("{s}: {e}"));
    t.unix_timestamp_nanos() as f64 / 1e9
}

/// Per (kind, phase), every duration recomputed from the journal files' record timestamps: a
/// phase lasts from the first record in it to the first record of the next phase.
fn durations_from_journal(state_dir: &Path) -> BTreeMap<(String, String), Vec<f64>> {
    let mut out: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    let dir = state_dir.join("journal");
    for entry in std::fs::read_dir(&dir).expect("journal dir") {
        let path = entry.expect("entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("log") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("journal file");
        let mut current: Option<(String, f64)> = None;
        let mut kind = String::new();
        for line in text.lines() {
            let v: Value = serde_json::from_str(line).expect("record line");
            let rec = &v["rec"];
            let at = parse_rfc3339(rec["at"].as_str().expect("at"));
            let phase = rec["state"]["phase"].as_str().expect("phase").to_string();
            kind = rec["state"]["request"]["kind"]
                .as_str()
                .expect("kind")
                .to_string();
            match &current {
                Some((p, _)) if *p == phase => {}
                Some((p, since)) => {
                    out.entry((kind.clone(), p.clone()))
                        .or_default()
                        .push(at - since);
                    current = Some((phase, at));
                }
                None => current = Some((phase, at)),
            }
        }
        assert!(!kind.is_empty(), "{} holds records", path.display());
    }
    for v in out.values_mut() {
        v.sort_by(f64::total_cmp);
    }
    out
}

fn run_ok(w: &World, args: &[&str]) -> Value {
    let run = w.agent(args);
    assert_eq!(
        run.code,
        Some(0),
        "{args:?}: {}\n{}",
        run.stdout,
        run.stderr
    );
    run.json()
}

/// Start the daemon (no hub configured) until it wrote its metrics file, then stop it.
fn run_daemon_once(w: &World) {
    let hub_file = w.files.metrics_dir.join("felhom_hub.prom");
    let before = std::fs::symlink_metadata(&hub_file)
        .ok()
        .filter(|m| m.file_type().is_file())
        .and_then(|m| m.modified().ok());
    let child = w
        .command()
        .arg("run")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("daemon");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now_file = std::fs::symlink_metadata(&hub_file)
            .ok()
            .filter(|m| m.file_type().is_file())
            .and_then(|m| m.modified().ok());
        if now_file.is_some() && now_file != before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the daemon wrote no {} in 20 s",
            hub_file.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let out = child.wait_with_output().expect("daemon exit");
    assert!(
        out.status.success(),
        "daemon: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn stats_agree_with_the_journal_and_every_metrics_file_passes_promtool() {
    let w = World::demo();
    for vmid in ["120", "121", "122"] {
        let doc = run_ok(&w, &["--selftest=provision", "-vmid", vmid, "--json"]);
        assert_eq!(doc["outcome"], "ok", "{doc:#}");
    }
    let doc = run_ok(&w, &["--selftest=restore", "--json"]);
    assert_eq!(doc["run"]["outcome"], "ok", "{doc:#}");
    let copies = doc["copies"].as_array().expect("copies");
    assert_eq!(copies.len(), 1, "{doc:#}");
    assert_eq!(copies[0]["outcome"], "ok", "{doc:#}");
    run_daemon_once(&w);

    let stats = run_ok(&w, &["journal", "--stats", "--json"]);
    let want = durations_from_journal(&w.state_dir());
    let mut seen = 0;
    for k in stats["kinds"].as_array().expect("kinds") {
        let kind = k["kind"].as_str().expect("kind");
        for p in k["phases"].as_array().expect("phases") {
            let phase = p["phase"].as_str().expect("phase");
            let v = want
                .get(&(kind.to_string(), phase.to_string()))
                .unwrap_or_else(|| panic!("{kind}/{phase} in the stats, not in the journal"));
            assert_eq!(p["count"], v.len(), "{kind}/{phase}");
            for (field, expected) in [
                ("p50", nearest_rank(v, 50.0)),
                ("p95", nearest_rank(v, 95.0)),
                ("max", *v.last().expect("one")),
            ] {
                let got = p[field].as_f64().expect("number");
                assert!(
                    (got - expected).abs() <= 0.0015,
                    "{kind}/{phase} {field}: stats {got}, journal timestamps {expected}"
                );
            }
            seen += 1;
        }
    }
    assert_eq!(
        seen,
        want.len(),
        "every phase of the journal is in the stats"
    );
    let provision = stats["kinds"]
        .as_array()
        .and_then(|ks| ks.iter().find(|k| k["kind"] == "selftest-provision"))
        .expect("selftest-provision figures");
    assert_eq!(provision["transactions"], 3);
    assert_eq!(provision["outcomes"]["ok"], 3);
    let submitted = provision["phases"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["phase"] == "submitted"))
        .expect("the submitted phase (waits on the restore task)");
    assert!(
        submitted["p50"].as_f64().expect("p50") >= RESTORE_TASK_S,
        "submitted waits on the fake's {RESTORE_TASK_S} s restore task: {submitted}"
    );

    // --since keeps only transactions started within it.
    let recent = run_ok(&w, &["journal", "--stats", "--since", "1h", "--json"]);
    assert_eq!(recent["transactions"], stats["transactions"]);
    assert_eq!(recent["kinds"], stats["kinds"]);
    assert!(recent["since"].is_string(), "{recent}");
    let none = run_ok(&w, &["journal", "--stats", "--since", "0s", "--json"]);
    assert_eq!(none["transactions"], 0, "{none}");
    for bad in [
        &["journal", "--stats", "--since", "3w"][..],
        &["journal", "--since", "1h"][..],
    ] {
        let run = w.agent(bad);
        assert_eq!(run.code, Some(2), "{bad:?}: {}{}", run.stdout, run.stderr);
    }
    let human = w.agent(&["journal", "--stats"]);
    assert_eq!(human.code, Some(0));
    assert!(
        human
            .stdout
            .contains("selftest-provision: 3 transactions (ok 3)")
            && human.stdout.contains("submitted"),
        "{}",
        human.stdout
    );

    // Every file the agent wrote passes promtool, and says what the journal says.
    let mut written = Vec::new();
    for name in METRICS_FILES {
        let path = w.files.metrics_dir.join(name);
        assert!(path.is_file(), "{} was written", path.display());
        promtool_check_metrics(&path);
        written.push(std::fs::read_to_string(&path).expect("read"));
    }
    let tx = samples(&written[0]);
    assert_eq!(
        tx["felhom_transactions_total{kind=\"selftest-provision\",outcome=\"ok\"}"],
        3.0
    );
    assert_eq!(
        tx["felhom_transactions_total{kind=\"restore-test\",outcome=\"ok\"}"],
        1.0
    );
    assert_eq!(tx["felhom_needs_human"], 0.0);
    assert_eq!(
        tx["felhom_phase_duration_seconds_count{kind=\"selftest-provision\",phase=\"submitted\"}"],
        submitted["count"].as_f64().expect("count")
    );
    let coverage = samples(&written[3]);
    assert_eq!(
        coverage["felhom_backup_status{vmid=\"200\",status=\"proven\"}"], 1.0,
        "guest 200's backup is proven: {}",
        written[3]
    );
    let hub = samples(&written[1]);
    assert_eq!(hub["felhom_hub_connected"], 0.0, "no hub configured");
    // And it says it has none, so FelhomHubDisconnected stays quiet on it.
    assert_eq!(hub["felhom_hub_configured"], 0.0, "no hub configured");
    assert!(hub.contains_key("felhom_outbox_depth"));

    // The dashboard uses only names these files hold.
    let names: BTreeSet<String> = written.iter().flat_map(|t| sample_names(t)).collect();
    let dashboard = repo_root().join("packaging/grafana/felhom-agent.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&dashboard).expect("read"))
        .expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    collect_exprs(&doc, &mut exprs);
    assert!(exprs.len() >= 8, "the dashboard's queries: {exprs:?}");
    let mut used = BTreeSet::new();
    for e in &exprs {
        for token in e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if token.starts_with("felhom_") {
                used.insert(token.to_string());
            }
        }
    }
    let unknown: Vec<_> = used.difference(&names).collect();
    assert!(
        unknown.is_empty(),
        "the dashboard queries {unknown:?}, which no written file holds ({names:?})"
    );
    for must in [
        "felhom_phase_duration_seconds_bucket",
        "felhom_transactions_total",
        "felhom_restore_test_outcome",
    ] {
        assert!(used.contains(must), "the dashboard shows {must}");
    }
}

/// Every `expr` and template `query` string of a Grafana dashboard.
fn collect_exprs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("expr" | "query" | "definition", Value::String(s)) => out.push(s.clone()),
                    _ => collect_exprs(x, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|x| collect_exprs(x, out)),
        _ => {}
    }
}

#[test]
fn symlinks_at_every_metrics_name_leave_their_targets_untouched() {
    let w = World::demo();
    let dir = w.files.metrics_dir.clone();
    let victims = tempfile::tempdir().expect("tmp");
    let mut names: Vec<String> = Vec::new();
    for f in METRICS_FILES {
        let stem = f.trim_end_matches(".prom");
        names.push(f.to_string());
        // Predictable temporary names a writer might use.
        names.push(format!("{stem}.tmp"));
        names.push(format!("{f}.tmp"));
        names.push(format!(".{f}.tmp"));
        names.push(format!(".{f}"));
        names.push(format!("{f}.new"));
    }
    let mut targets = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let target = victims.path().join(format!("victim-{i}"));
        std::fs::write(&target, format!("precious {i}\n")).expect("victim");
        std::os::unix::fs::symlink(&target, dir.join(name)).expect("symlink");
        targets.push((name.clone(), target, format!("precious {i}\n")));
    }
    let doc = run_ok(&w, &["--selftest=provision", "-vmid", "120", "--json"]);
    assert_eq!(doc["outcome"], "ok");
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.restore_copy()["outcome"], "ok");
    let doc = run.json();
    assert!(doc.get("metrics_error").is_none(), "{doc:#}");
    run_daemon_once(&w);

    for (name, target, content) in &targets {
        assert_eq!(
            std::fs::read_to_string(target).expect("victim"),
            *content,
            "the target of the symlink {name} was written"
        );
    }
    for f in METRICS_FILES {
        let meta = std::fs::symlink_metadata(dir.join(f)).expect("final name");
        assert!(
            meta.file_type().is_file(),
            "{f} is a regular file now (the symlink was replaced as a name)"
        );
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(meta.permissions().mode() & 0o777, 0o644, "{f}");
    }
    // No temporary file is left behind.
    for entry in std::fs::read_dir(&dir).expect("ls") {
        let name = entry
            .expect("entry")
            .file_name()
            .to_string_lossy()
            .to_string();
        assert!(
            METRICS_FILES.contains(&name.as_str()) || names.contains(&name),
            "left behind: {name}"
        );
    }
}

fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Run the agent under a pseudo-terminal (`script` from util-linux): returns everything the
/// terminal showed, and whether `seen` appeared while the agent was still running.
fn under_a_terminal(w: &World, args: &[&str], seen: &str) -> (String, bool) {
    let mut cmdline = vec![
        sh_quote(&felhom_tests::agent::agent_bin().to_string_lossy()),
        "--config".to_string(),
        sh_quote(&w.files.config_path.to_string_lossy()),
    ];
    cmdline.extend(args.iter().map(|a| sh_quote(a)));
    let mut child = Command::new("script")
        .args(["-qfec", &cmdline.join(" "), "/dev/null"])
        .env_remove("FELHOM_AGENT_CONFIG")
        .env_remove("FELHOM_AGENT_LOG")
        .env("PATH", w.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("script (util-linux) runs");
    let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
    let reader = {
        let buf = buf.clone();
        let mut out = child.stdout.take().expect("stdout");
        std::thread::spawn(move || {
            use std::io::Read;
            let mut chunk = [0u8; 4096];
            while let Ok(n) = out.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                buf.lock().expect("buf").extend_from_slice(&chunk[..n]);
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut while_running = false;
    loop {
        let text = String::from_utf8_lossy(&buf.lock().expect("buf")).to_string();
        let running = child.try_wait().expect("try_wait").is_none();
        if running && text.contains(seen) {
            while_running = true;
        }
        if !running {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not end in 120 s:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    reader.join().expect("reader");
    let text = String::from_utf8_lossy(&buf.lock().expect("buf")).to_string();
    (text, while_running)
}

#[test]
fn on_a_terminal_a_line_per_phase_appears_while_the_provision_runs() {
    let w = World::demo();
    let (text, live) = under_a_terminal(
        &w,
        &["--selftest=provision", "-vmid", "120"],
        "waiting on PVE task UPID:",
    );
    assert!(
        live,
        "the spinner line with the UPID was drawn while the provision ran:\n{text}"
    );
    let mut last = 0;
    for phase in [
        "validated",
        "submitted",
        "created",
        "started",
        "launched",
        "booted",
        "bootstrapped",
        "verified",
    ] {
        let line = format!("+ {phase:<13}");
        let at = text
            .find(&line)
            .unwrap_or_else(|| panic!("no finished line for {phase}:\n{text}"));
        assert!(at > last, "{phase} drawn in order:\n{text}");
        last = at;
    }
    assert!(
        text.contains("PHASE") && text.contains("total"),
        "summary:\n{text}"
    );
    assert!(
        text.contains(" pass"),
        "check statuses print lowercase:\n{text}"
    );
    assert!(!text.contains("Pass"), "no Debug-cased status:\n{text}");

    // Without a terminal, or with --log-format json on one, nothing of the view is drawn.
    let plain = w.agent(&["--selftest=provision", "-vmid", "121"]);
    assert_eq!(plain.code, Some(0), "{}", plain.stderr);
    for out in [&plain.stdout, &plain.stderr] {
        assert!(
            !out.contains("\x1b[2K") && !out.contains("SECONDS"),
            "{out}"
        );
    }
    let (json_logs, live) = under_a_terminal(
        &w,
        &[
            "--selftest=provision",
            "-vmid",
            "122",
            "--log-format",
            "json",
        ],
        "waiting on PVE task",
    );
    assert!(!live, "no view with --log-format json:\n{json_logs}");
    assert!(
        !json_logs.contains("\x1b[2K") && !json_logs.contains("SECONDS"),
        "{json_logs}"
    );
    assert!(json_logs.contains("transaction "), "{json_logs}");

    // The restore test drives its copies side by side, so it draws no one-line view: a line
    // per phase of each copy instead, naming the guest whose backup it proves and the copy.
    let (restore, live) = under_a_terminal(&w, &["--selftest=restore"], "+ guest    200 copy ");
    assert!(
        live,
        "the copy's phase lines were drawn while it ran:\n{restore}"
    );
    // The copy the result names (the demo's one pool guest with a backup, 200).
    let copy = restore
        .lines()
        .find(|l| l.starts_with("guest 200 (") && l.trim_end().ends_with(": ok"))
        .and_then(|l| l.split(" in copy ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no ok result line for guest 200:\n{restore}"))
        .to_string();
    assert!(copy.starts_with("99000"), "{copy}:\n{restore}");
    let mut last = 0;
    for phase in [
        "validated",
        "submitted",
        "created",
        "started",
        "launched",
        "booted",
        "verified",
        "destroyed",
    ] {
        let line = format!("  + guest    200 copy {copy:>6}  {phase}\r\n");
        let at = restore
            .find(&line)
            .unwrap_or_else(|| panic!("no line for {phase} of copy {copy}:\n{restore}"));
        assert!(at > last, "{phase} drawn in order:\n{restore}");
        last = at;
    }
    assert!(
        !restore.contains("\x1b[2K") && !restore.contains("SECONDS"),
        "no one-line view for a restore run:\n{restore}"
    );
    assert!(restore.contains("restore test run "), "{restore}");
    // Without a terminal, no copy lines.
    let plain = w.agent(&["--selftest=restore", "--guest", "200"]);
    assert_eq!(plain.code, Some(0), "{}", plain.stderr);
    for out in [&plain.stdout, &plain.stderr] {
        assert!(!out.contains("+ guest "), "{out}");
    }
}

fn wait_for_sample(w: &World, file: &str, series: &str, want: f64, timeout: Duration) {
    let path = w.files.metrics_dir.join(file);
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    while Instant::now() < deadline {
        last = std::fs::read_to_string(&path).unwrap_or_default();
        if samples(&last).get(series) == Some(&want) {
            promtool_check_metrics(&path);
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!(
        "{series} did not become {want} in {timeout:?} in {}:\n{last}",
        path.display()
    );
}

#[test]
fn felhom_hub_connected_follows_the_hub_session() {
    use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
    let mut hub = DevHub::start(DevHubOptions::default());
    let opts = felhom_tests::fakepve::AgentOptions {
        hub: Some(hub.hub_options()),
        ..felhom_tests::fakepve::AgentOptions::default()
    };
    let w = World::with_options(felhom_tests::fakepve::demo_scenario(), &opts);
    let path = w.path();
    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str())],
    );
    hub.wait_for("the session", Duration::from_secs(30), |s| s.sessions == 1);
    wait_for_sample(
        &w,
        "felhom_hub.prom",
        "felhom_hub_connected",
        1.0,
        Duration::from_secs(10),
    );
    // Heartbeats keep it at 1 while the session lasts.
    std::thread::sleep(Duration::from_secs(3));
    let text = std::fs::read_to_string(w.files.metrics_dir.join("felhom_hub.prom")).expect("read");
    assert_eq!(samples(&text)["felhom_hub_connected"], 1.0, "{text}");
    assert_eq!(samples(&text)["felhom_hub_configured"], 1.0, "{text}");
    hub.stop();
    wait_for_sample(
        &w,
        "felhom_hub.prom",
        "felhom_hub_connected",
        0.0,
        Duration::from_secs(15),
    );
    // Still a node with a hub: the disconnection is what the alert is for.
    let text = std::fs::read_to_string(w.files.metrics_dir.join("felhom_hub.prom")).expect("read");
    assert_eq!(samples(&text)["felhom_hub_configured"], 1.0, "{text}");
    let (status, log) = agent.terminate(Duration::from_secs(20));
    assert!(status.success(), "{log}");
}
