//! Application-group benchmark (prints figures; not a timed test): a restore-test run that
//! proves a group of two real LXC containers (`[[restore_test.group]]`: the database guest 200
//! and the shop guest 201 of `felhom_tests::groups`, Debian 12 with systemd, each with a static
//! address on its stored NIC), beside the runs that prove each member alone (the same pool
//! without the group, `--guest 200` and `--guest 201`).
//!
//! - group: the wall time of `--selftest=restore --guest 201` with the group configured (both
//!   backups restored at once, the database started first, the shop once the database booted
//!   and the boot delay passed, the checks once both booted, both destroyed once both were
//!   judged);
//! - 200 alone / 201 alone: the wall time of each member proven alone, with the checks it can
//!   pass alone (the shop's order page, which needs the database, is left out);
//! - the ratio of the group over the longer member alone, and the goal: the group within
//!   1.3 × the longer member alone plus its boot delay;
//! - where the group's time went: each member's steps (the journal's phase records, seconds
//!   after the run started).
//!
//! The fake's tasks run in real time at lengths of a small container on a node, as in
//! `restore_coverage`: a 10 s restore and a 2 s destroy (the guests' own boots and checks take
//! what they take on this machine). Restore requests go out 2 s apart as on a node.
//!
//! Run: `cargo bench -p felhom-tests --bench restore_group` after `cargo build -p
//! felhom-agent --features test-hooks` (tests/run.sh's build) and the real roots
//! (tests/testbed/build-debian-rootfs.sh, also built by tests/run.sh). `FELHOM_BENCH_RUNS=N`
//! repeats each kind N times (default 1) and prints the best; `FELHOM_BENCH_BOOT_DELAY=S`
//! sets the group's `boot_delay` (default 2).

use std::io::BufRead as _;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use felhom_tests::groups::{add_group, DATABASE_CHECK, SHOP};
use felhom_tests::restore_bench::{best, in_real_time, proven_report, real_world, runs};
use serde_json::{json, Value};

/// The pool of the database and the shop, its tasks in real time.
fn pool() -> Value {
    in_real_time(SHOP.scenario(&SHOP.db_unit(), json!({}), json!({})))
}

/// One run: its wall seconds, the copies' outcomes by guest, and each member's steps
/// (`(vmid, step, seconds after the start)`, from the journal's phase records on stderr).
struct Run {
    wall: f64,
    outcomes: Vec<(u64, String)>,
    steps: Vec<(u64, String, f64)>,
}

/// Prove `guest` in a fresh world: with the group configured (`boot_delay`) or alone.
fn run(guest: u32, group: Option<u64>) -> Run {
    let w = real_world(pool());
    let pack = match group {
        Some(_) => SHOP.pack(),
        // Alone, the shop's order page cannot pass (no database answers it): left out.
        None => DATABASE_CHECK.to_string(),
    };
    std::fs::write(w.files.checks_dir.join("shop.toml"), pack).expect("the pack");
    if let Some(delay) = group {
        add_group(&w.files.config_path, "shop", &[200, 201], delay);
    }
    let started = Instant::now();
    let mut child = w
        .command()
        .args([
            "--selftest=restore",
            "--guest",
            &guest.to_string(),
            "--json",
            "--log-format",
            "json",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the agent");
    let steps = Arc::new(Mutex::new(Vec::new()));
    let stderr = child.stderr.take().expect("stderr");
    let reader = {
        let steps = steps.clone();
        std::thread::spawn(move || {
            let mut all = String::new();
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                let at = started.elapsed().as_secs_f64();
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    let msg = v["message"].as_str().unwrap_or_default();
                    if let (Some(step), Some(vmid)) = (
                        msg.split_whitespace()
                            .skip_while(|w| *w != "step")
                            .nth(1)
                            .map(str::to_string),
                        v["vmid"].as_u64(),
                    ) {
                        steps.lock().expect("steps").push((vmid, step, at));
                    }
                }
                all.push_str(&line);
                all.push('\n');
            }
            all
        })
    };
    let out = child.wait_with_output().expect("the agent's output");
    let wall = started.elapsed().as_secs_f64();
    let stderr = reader.join().unwrap_or_default();
    let want = if group.is_some() { 2 } else { 1 };
    let doc = proven_report(&out.stdout, &stderr, want);
    let outcomes: Vec<(u64, String)> = doc["copies"]
        .as_array()
        .expect("copies")
        .iter()
        .map(|c| {
            (
                c["guest"].as_u64().unwrap_or(0),
                c["outcome"].as_str().unwrap_or("?").to_string(),
            )
        })
        .collect();
    let steps = std::mem::take(&mut *steps.lock().expect("steps"));
    Run {
        wall,
        outcomes,
        steps,
    }
}

fn main() {
    let Some(runs) = runs() else {
        return;
    };
    let delay: u64 = std::env::var("FELHOM_BENCH_BOOT_DELAY")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let best = |guest: u32, group: Option<u64>| best(runs, || run(guest, group), |r: &Run| r.wall);
    let db = best(200, None);
    let shop = best(201, None);
    let group = best(201, Some(delay));
    let longer = db.wall.max(shop.wall);
    let goal = 1.3 * longer + delay as f64;
    println!(
        "application group on real LXC guests ({} cores; a 10 s restore, a 2 s destroy, boot_delay = {delay}):",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("  200 (db) alone:            {:7.1} s", db.wall);
    println!("  201 (shop) alone:          {:7.1} s", shop.wall);
    println!(
        "  the group (200, 201):      {:7.1} s ({})",
        group.wall,
        group
            .outcomes
            .iter()
            .map(|(g, o)| format!("{g} {o}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "  group / longer alone:      {:7.2}  (goal: group <= 1.3 x {longer:.1} + {delay} = {goal:.1} s: {})",
        group.wall / longer,
        if group.wall <= goal { "met" } else { "missed" }
    );
    println!(
        "  group / sum alone:         {:7.2}",
        group.wall / (db.wall + shop.wall)
    );
    for (name, r) in [("the group", &group), ("201 alone", &shop)] {
        println!("  steps of {name} (seconds after the start):");
        let mut vmids: Vec<u64> = r.steps.iter().map(|s| s.0).collect();
        vmids.sort_unstable();
        vmids.dedup();
        for vmid in vmids {
            let line: Vec<String> = r
                .steps
                .iter()
                .filter(|s| s.0 == vmid)
                .map(|(_, step, at)| format!("{step} {at:.1}"))
                .collect();
            println!("    copy {vmid}: {}", line.join(", "));
        }
    }
}
