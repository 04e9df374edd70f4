//! What the restore-test benchmarks (`tests/benches/restore_coverage.rs` and
//! `restore_group.rs`) share: their real-time scenario, their world on real LXC guests, the
//! report they check and how often each kind runs.

use serde_json::{json, Value};

use crate::fakepve::AgentOptions;
use crate::world::World;

/// `scenario` with its tasks in real time at the lengths of a small container on a node: a
/// 10 s restore and a 2 s destroy.
pub fn in_real_time(mut scenario: Value) -> Value {
    scenario["attrs"] = json!({"ct_secs": {"create": 10, "destroy": 2}});
    scenario["time_scale"] = json!(1.0);
    scenario
}

/// A world for `scenario` on the bed's real LXC guests; panics, saying why, where this machine
/// has none.
pub fn real_world(scenario: Value) -> World {
    World::real(scenario, &AgentOptions::default())
        .unwrap_or_else(|(why, _)| panic!("no real guests here: {why}"))
}

/// The `--selftest=restore --json` report on `stdout`, checked to hold `copies` copies that all
/// ended ok; it and `stderr` are printed where it does not.
pub fn proven_report(stdout: &[u8], stderr: &str, copies: usize) -> Value {
    let doc: Value = serde_json::from_slice(stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\n{stderr}",
            String::from_utf8_lossy(stdout)
        )
    });
    let list = doc["copies"].as_array().expect("copies");
    assert_eq!(list.len(), copies, "{doc:#}");
    assert!(
        list.iter().all(|c| c["outcome"] == "ok"),
        "a copy did not end ok: {doc:#}\n{stderr}"
    );
    doc
}

/// How many times a benchmark runs each kind: `FELHOM_BENCH_RUNS` (default 1); `None` when it
/// is only asked to list itself (`--list`: it runs nothing then).
pub fn runs() -> Option<usize> {
    if std::env::args().any(|a| a == "--list") {
        return None;
    }
    Some(
        std::env::var("FELHOM_BENCH_RUNS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or(1),
    )
}

/// The fastest of `runs` runs of `run` by `wall`, its wall seconds.
pub fn best<T>(runs: usize, mut run: impl FnMut() -> T, wall: impl Fn(&T) -> f64) -> T {
    (0..runs)
        .map(|_| run())
        .min_by(|a, b| wall(a).total_cmp(&wall(b)))
        .expect("a run")
}
