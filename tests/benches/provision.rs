//! Provision benchmark (prints figures; not a timed test): a full `--selftest=provision`
//! of a container against fakepve with tasks that take real time, and the same with instant
//! tasks.
//!
//! - wall: the agent's whole run; wall over task time: that over the nominal duration of the
//!   PVE tasks it waits for (restore + destroy);
//! - fixed: the wall time of the same provision with instant tasks (in-guest work: launch
//!   proof, bootstrap, checks; local reads);
//! - task overhead: (wall - fixed - tasks) / tasks, the cost of following the tasks;
//! - requests per LXC provision (instant tasks), by kind: the backup's stored config
//!   (`vzdump/extractconfig`, read once), the privilege reads (`/access/permissions`), the
//!   guest config reads; the round trips one after the other before the restore POST (answers
//!   that overlap in the fake's timings went out together);
//! - API calls per minute of task (the calls the slow run makes beyond the instant one, over
//!   the task time);
//! - against a proxmoxer script: the same provision by `proxmoxer_provision.py` (restore, start,
//!   the default bootstrap profile and checks through `pct exec`, stop, destroy; each task
//!   followed with proxmoxer's `Tasks.blocking_status`) and by the agent, alternating, in a
//!   world of a 1.0 s restore and a 0.5 s destroy; the agent's wall time over the script's.
//!
//! Every API answer takes 10 ms more than the fake needs (`api_latency_ms`), a round trip to a
//! real pveproxy; the tasks run in real time at realistic lengths (a 30 s restore, a 4 s
//! destroy), so the agent's polling meets the durations it meets on a node.
//!
//! Run: `tests/setup-bench.sh` once (proxmoxer), then `cargo bench -p felhom-tests --bench
//! provision` (after `cargo build --workspace`; `FELHOM_AGENT_BIN=target/release/felhom-agent`
//! after `cargo build --release -p felhom-agent` measures the shipped build);
//! `FELHOM_BENCH_RUNS=N` sets the runs of each kind (default 3); `FELHOM_BENCH_LIST=1` lists
//! the requests of the typical instant run; `FELHOM_BENCH_VERSUS_ONLY=1` runs only the
//! comparison; `FELHOM_BENCH_TRACE=1` prints the agent's `-v` log of each run.

use std::time::Instant;

use felhom_tests::agent::agent_command;
use felhom_tests::fakepve::{
    sequential_round_trips, AgentFiles, AnswerTiming, FakePve, RecordedRequest,
};
use felhom_tests::guestbed::GuestBed;
use serde_json::json;

const RUNS: u32 = 3;

fn runs() -> u32 {
    std::env::var("FELHOM_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(RUNS)
}

/// What one provision asked of PVE.
struct Asked {
    requests: Vec<RecordedRequest>,
    /// Round trips one after the other before the restore POST.
    serial_before_restore: usize,
    /// The answers before the restore POST.
    before_restore: Vec<AnswerTiming>,
}

impl Asked {
    fn count(&self, what: impl Fn(&RecordedRequest) -> bool) -> usize {
        self.requests.iter().filter(|r| what(r)).count()
    }
}

fn is_restore_post(method: &str, path: &str) -> bool {
    method == "POST" && path.ends_with("/lxc") && path.contains("/nodes/")
}
/// PVE seconds → real seconds.
const TIME_SCALE: f64 = 1.0;
/// Restore and destroy durations, in PVE seconds.
const RESTORE_SECS: f64 = 30.0;
const DESTROY_SECS: f64 = 4.0;
/// Added to every API answer.
const API_LATENCY_MS: u64 = 10;

/// The comparison's world: a restore of 1.0 s and a destroy of 0.5 s (1.5 s of task time).
const VERSUS_RESTORE_SECS: f64 = 1.0;
const VERSUS_DESTROY_SECS: f64 = 0.5;

/// A fake PVE joined to a fresh guest bed, every answer `API_LATENCY_MS` late, its container
/// restores and destroys taking `tasks` (restore, destroy) real seconds (instant: `None`), and
/// the agent's files with the default profile and checks.
fn world(tasks: Option<(f64, f64)>) -> (GuestBed, FakePve, AgentFiles) {
    let bed = GuestBed::new();
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    bed.join_scenario(&mut scenario);
    let pve = FakePve::start(scenario);
    pve.set(json!({"api_latency_ms": API_LATENCY_MS}));
    if let Some((restore, destroy)) = tasks {
        pve.set(
            json!({"time_scale": TIME_SCALE, "ct_secs": {"create": restore, "destroy": destroy}}),
        );
    }
    let files = AgentFiles::for_fake(&pve);
    felhom_tests::world::install_default_profile_and_checks(&files);
    (bed, pve, files)
}

fn one(tasks: Option<(f64, f64)>, vmid: u32) -> (f64, Asked) {
    let (bed, pve, files) = world(tasks);
    let before = pve.requests().len();
    let timings_before = pve.timings().len();
    let path = felhom_tests::world::bed_path(&bed);
    let _helper = files
        .exec_socket
        .as_deref()
        .map(|socket| felhom_tests::agent::ExecHelper::start(&files.config_path, socket, &path));
    let started = Instant::now();
    let out = agent_command(&files.config_path)
        .env("PATH", path)
        .args(["--selftest=provision", "-vmid", &vmid.to_string(), "--json"])
        .args(trace().then_some("-v"))
        .output()
        .expect("run agent");
    let wall = started.elapsed().as_secs_f64();
    if trace() {
        println!(
            "the agent's log ({wall:.2} s):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(
        out.status.success(),
        "provision failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let requests = pve.requests().split_off(before);
    let timings = pve.timings().split_off(timings_before);
    let until = timings
        .iter()
        .position(|t| is_restore_post(&t.method, &t.path))
        .expect("a restore POST");
    let restore_start = timings[until].start;
    let before_restore: Vec<_> = timings
        .into_iter()
        .filter(|t| t.end <= restore_start)
        .collect();
    (
        wall,
        Asked {
            requests,
            serial_before_restore: sequential_round_trips(&before_restore),
            before_restore,
        },
    )
}

/// The same provision by the proxmoxer script (`proxmoxer_provision.py`) in a world like
/// [`one`]'s: its wall time (the whole process, as the agent's) and the requests PVE received.
fn script_one(tasks: Option<(f64, f64)>, vmid: u32) -> (f64, usize) {
    let python = felhom_tests::fakepve::fakepve_python();
    let (bed, pve, files) = world(tasks);
    let plan = json!({
        "host": pve.host(),
        "port": pve.port(),
        "cafile": pve.cafile(),
        "token_id": pve.token_id(),
        "token_secret_file": files.token_secret_file,
        "node": "pve1",
        "vmid": vmid,
        "archive": "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst",
        "storage": "local-lvm",
        "pool": pve.pool(),
        "profile_dir": files.bootstrap_dir.join("default"),
        "checks_file": files.checks_dir.join("default.toml"),
    });
    let plan_path = files.config_path.with_file_name("plan.json");
    std::fs::write(&plan_path, plan.to_string()).expect("write the script's plan");
    let script =
        felhom_tests::fakepve::workspace_root().join("tests/benches/proxmoxer_provision.py");
    let before = pve.requests().len();
    let started = Instant::now();
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(&plan_path)
        .env("PATH", felhom_tests::world::bed_path(&bed))
        .output()
        .expect("run the proxmoxer script");
    let wall = started.elapsed().as_secs_f64();
    assert!(
        out.status.success(),
        "the proxmoxer script failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(pve.guest(vmid).is_none(), "the script left guest {vmid}");
    (wall, pve.requests().len() - before)
}

/// `FELHOM_BENCH_TRACE=1`: run the agent with `-v` and print its log (timestamped).
fn trace() -> bool {
    std::env::var_os("FELHOM_BENCH_TRACE").is_some()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The agent's provision side by side with the proxmoxer script's, alternating, in the
/// comparison's world; prints both medians and their ratio.
fn versus_script(runs: u32) {
    let tasks = Some((VERSUS_RESTORE_SECS, VERSUS_DESTROY_SECS));
    let mut agent = Vec::new();
    let mut script = Vec::new();
    let mut script_requests = Vec::new();
    let has_proxmoxer = std::process::Command::new(felhom_tests::fakepve::fakepve_python())
        .args(["-c", "import proxmoxer"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_proxmoxer {
        println!(
            "  against a proxmoxer script: skipped, the fake's Python has no proxmoxer \
             (tests/setup-bench.sh installs it)"
        );
        return;
    }
    for i in 0..runs {
        let (w, n) = script_one(tasks, 170 + i);
        script.push(w);
        script_requests.push(n as f64);
        agent.push(one(tasks, 180 + i).0);
    }
    let (agent, script) = (median(agent), median(script));
    println!(
        "  against a proxmoxer script ({runs} runs each, alternating; a {VERSUS_RESTORE_SECS} s \
         restore, a {VERSUS_DESTROY_SECS} s destroy, {API_LATENCY_MS} ms per round trip):"
    );
    println!(
        "    the script (tests/benches/proxmoxer_provision.py): {script:.2} s, {:.0} requests",
        median(script_requests)
    );
    println!("    the agent:                                         {agent:.2} s");
    println!(
        "    the agent's wall time over the script's:           {:.2} (goal: at most 0.30)",
        agent / script
    );
}

fn main() {
    let runs = runs();
    if std::env::var_os("FELHOM_BENCH_VERSUS_ONLY").is_some() {
        versus_script(runs);
        return;
    }
    let tasks = (RESTORE_SECS + DESTROY_SECS) * TIME_SCALE;
    let mut fixed = Vec::new();
    let mut wall = Vec::new();
    let mut calls = Vec::new();
    let mut fixed_calls = Vec::new();
    let mut instant = Vec::new();
    for i in 0..runs {
        let (w, asked) = one(None, 150 + i);
        fixed.push(w);
        fixed_calls.push(asked.requests.len());
        instant.push(asked);
        let (w, asked) = one(Some((RESTORE_SECS, DESTROY_SECS)), 160 + i);
        wall.push(w);
        calls.push(asked.requests.len());
    }
    let (fixed, wall) = (median(fixed), median(wall));
    let overhead = (wall - fixed - tasks) / tasks * 100.0;
    calls.sort_unstable();
    fixed_calls.sort_unstable();
    let per_minute = (calls[calls.len() / 2] as f64 - fixed_calls[fixed_calls.len() / 2] as f64)
        / (tasks / 60.0);
    // The instant run with the median request count stands for the kinds.
    instant.sort_by_key(|a| a.requests.len());
    let typical = &instant[instant.len() / 2];
    let get_config = |r: &RecordedRequest| {
        r.method == "GET" && r.path.contains("/lxc/") && r.path.ends_with("/config")
    };
    println!(
        "provision benchmark, LXC ({runs} runs each, medians; {API_LATENCY_MS} ms per API round trip)"
    );
    println!("  PVE task time (restore + destroy): {tasks:.2} s");
    println!("  wall time with those tasks:        {wall:.2} s");
    println!("  wall time over the task time:      {:.3}", wall / tasks);
    println!("  wall time with instant tasks:      {fixed:.2} s (in-guest work and local reads)");
    println!(
        "  overhead of following the tasks:   {overhead:.1} % of the task time (goal: within 5 %)"
    );
    println!(
        "  requests per LXC provision:        {} with instant tasks (min {}, max {}); {} with those tasks",
        typical.requests.len(),
        fixed_calls.first().unwrap_or(&0),
        fixed_calls.last().unwrap_or(&0),
        calls[calls.len() / 2],
    );
    println!(
        "    vzdump/extractconfig:            {}",
        typical.count(|r| r.path.ends_with("/vzdump/extractconfig"))
    );
    println!(
        "    access/permissions:              {}",
        typical.count(|r| r.path.ends_with("/access/permissions"))
    );
    println!(
        "    GET lxc/<vmid>/config:           {}",
        typical.count(get_config)
    );
    println!(
        "  round trips one after the other before the restore POST: {} (of {} requests)",
        typical.serial_before_restore,
        typical
            .requests
            .iter()
            .position(|r| is_restore_post(&r.method, &r.path))
            .unwrap_or(0)
    );
    println!("  API calls per minute of task:      {per_minute:.0}");
    if std::env::var_os("FELHOM_BENCH_LIST").is_some() {
        for r in &typical.requests {
            println!("    {} {}?{}", r.method, r.path, r.query);
        }
        let t0 = typical.before_restore.first().map_or(0.0, |t| t.start);
        println!("  answers before the restore POST (ms from the first):");
        for t in &typical.before_restore {
            println!(
                "    {:7.1} {:7.1}  {} {}",
                (t.start - t0) * 1000.0,
                (t.end - t0) * 1000.0,
                t.method,
                t.path
            );
        }
    }
    versus_script(runs);
}
