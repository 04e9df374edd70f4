//! Provision benchmark (prints figures; not a timed test): a full `--selftest=provision`
//! against fakepve with tasks that take real time, and the same with instant tasks.
//!
//! - wall: the agent's whole run;
//! - tasks: the nominal duration of the PVE tasks it waits for (restore + destroy);
//! - fixed: the wall time of the same provision with instant tasks (in-guest work: launch
//!   proof, bootstrap, checks; local reads);
//! - task overhead: (wall - fixed - tasks) / tasks, the cost of following the tasks;
//! - API calls per provision, and per minute of task (the calls the slow run makes beyond the
//!   instant one, over the task time).
//!
//! Every API answer takes 10 ms more than the fake needs (`api_latency_ms`), a round trip to a
//! real pveproxy; the tasks run in real time at realistic lengths (a 30 s restore, a 4 s
//! destroy), so the agent's polling meets the durations it meets on a node.
//!
//! Run: `cargo bench -p felhom-tests --bench provision` (after `cargo build -p felhom-agent`).

use std::time::Instant;

use felhom_tests::agent::agent_command;
use felhom_tests::fakepve::{AgentFiles, FakePve};
use felhom_tests::guestbed::GuestBed;
use serde_json::json;

const RUNS: u32 = 3;
/// PVE seconds → real seconds.
const TIME_SCALE: f64 = 1.0;
/// Restore and destroy durations, in PVE seconds.
const RESTORE_SECS: f64 = 30.0;
const DESTROY_SECS: f64 = 4.0;
/// Added to every API answer.
const API_LATENCY_MS: u64 = 10;

fn one(slow: bool, vmid: u32) -> (f64, usize) {
    let bed = GuestBed::new();
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    bed.join_scenario(&mut scenario);
    let pve = FakePve::start(scenario);
    pve.set(json!({"api_latency_ms": API_LATENCY_MS}));
    if slow {
        pve.set(json!({"time_scale": TIME_SCALE, "ct_secs": {"create": RESTORE_SECS, "destroy": DESTROY_SECS}}));
    }
    let files = AgentFiles::for_fake(&pve);
    felhom_tests::world::install_default_profile_and_checks(&files);
    let before = pve.requests().len();
    let path = felhom_tests::world::bed_path(&bed);
    let _helper = files
        .exec_socket
        .as_deref()
        .map(|socket| felhom_tests::agent::ExecHelper::start(&files.config_path, socket, &path));
    let started = Instant::now();
    let out = agent_command(&files.config_path)
        .env("PATH", path)
        .args(["--selftest=provision", "-vmid", &vmid.to_string(), "--json"])
        .output()
        .expect("run agent");
    let wall = started.elapsed().as_secs_f64();
    assert!(
        out.status.success(),
        "provision failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    (wall, pve.requests().len() - before)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let tasks = (RESTORE_SECS + DESTROY_SECS) * TIME_SCALE;
    let mut fixed = Vec::new();
    let mut wall = Vec::new();
    let mut calls = Vec::new();
    let mut fixed_calls = Vec::new();
    for i in 0..RUNS {
        let (w, c) = one(false, 150 + i);
        fixed.push(w);
        fixed_calls.push(c);
        let (w, c) = one(true, 160 + i);
        wall.push(w);
        calls.push(c);
    }
    let (fixed, wall) = (median(fixed), median(wall));
    let overhead = (wall - fixed - tasks) / tasks * 100.0;
    calls.sort_unstable();
    fixed_calls.sort_unstable();
    let per_minute = (calls[calls.len() / 2] as f64 - fixed_calls[fixed_calls.len() / 2] as f64)
        / (tasks / 60.0);
    println!(
        "provision benchmark ({RUNS} runs each, medians; {API_LATENCY_MS} ms per API round trip)"
    );
    println!("  PVE task time (restore + destroy): {tasks:.2} s");
    println!("  wall time with those tasks:        {wall:.2} s");
    println!("  wall time with instant tasks:      {fixed:.2} s (in-guest work and local reads)");
    println!(
        "  overhead of following the tasks:   {overhead:.1} % of the task time (goal: within 5 %)"
    );
    println!(
        "  API calls per provision:           {} (min {}, max {})",
        calls[calls.len() / 2],
        calls.iter().min().unwrap_or(&0),
        calls.iter().max().unwrap_or(&0)
    );
    println!(
        "  API calls with instant tasks:      {}",
        fixed_calls[fixed_calls.len() / 2]
    );
    println!("  API calls per minute of task:      {per_minute:.0}");
}
