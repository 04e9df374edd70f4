//! Coverage benchmark (prints figures; not a timed test): a restore-test run that proves 8
//! guests' backups on the bed's real LXC guests (Debian 12 with systemd, each with a static
//! address on its stored NIC), once with `[restore_test] at_once = 1` and once with
//! `at_once = 8`, beside the wall time of one copy alone (a pool of one guest).
//!
//! - one: the wall time of a run proving one guest's backup;
//! - 8 at once / 8 one by one: the wall times of the two runs proving the 8 guests;
//! - the ratio of 8 at once over one (goal: at most 2.5 on 2 cores), and the speed-up over one
//!   by one;
//! - the most copies that ran at once (container copies keep below the exec helper's 8
//!   connections: at most 6), and the agent's peak resident memory over the runs.
//!
//! The fake's tasks run in real time at lengths of a small container on a node: a 10 s restore
//! and a 2 s destroy (the guests' own boots and checks take what they take on this machine).
//! Restore requests go out 2 s apart as on a node.
//!
//! Run: `cargo bench -p felhom-tests --bench restore_coverage` after `cargo build -p
//! felhom-agent --features test-hooks` (tests/run.sh's build) and the real roots
//! (tests/testbed/build-debian-rootfs.sh, also built by tests/run.sh). `FELHOM_BENCH_RUNS=N`
//! repeats each kind N times (default 1) and prints the best.

use std::time::Instant;

use felhom_tests::restore_bench::{best, in_real_time, proven_report, real_world, runs};
use serde_json::{json, Value};

/// The pool: guest 200 (the demo's, made a real Debian guest) and seven more like it.
fn pool(guests: usize) -> Value {
    let mut s = felhom_tests::verdict::static_debian_backup();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let template = s["volumes"]["local"][0].clone();
    let list = s["guests"].as_array_mut().expect("guests");
    list.retain(|g| g["vmid"] != json!(300));
    for i in 1..guests {
        let vmid = 200 + 10 * i as u32;
        list.push(
            json!({"vmid": vmid, "type": "lxc", "name": format!("ct{vmid}"),
            "node": "pve1", "status": "running", "pool": "felhom"}),
        );
    }
    let vols = s["volumes"]["local"].as_array_mut().expect("volumes");
    vols[0]["ctime"] = json!(now - 3600);
    for i in 1..guests {
        let vmid = 200 + 10 * i as u32;
        let mut v = template.clone();
        v["volname"] = json!(format!(
            "backup/vzdump-lxc-{vmid}-2026_12_01-00_00_00.tar.zst"
        ));
        v["vmid"] = json!(vmid);
        v["ctime"] = json!(now - 3600);
        v["config"]["hostname"] = json!(format!("ct{vmid}"));
        v["config"]["rootfs"] = json!(format!("local-lvm:vm-{vmid}-disk-0,size=8G"));
        vols.push(v);
    }
    in_real_time(s)
}

/// One run proving every guest of a pool of `guests` with `at_once`: wall seconds, the most
/// copies at once, the agent's peak resident memory (KiB, its VmHWM read while it ran).
fn run(guests: usize, at_once: usize) -> (f64, u64, u64) {
    let w = real_world(pool(guests));
    let config = std::fs::read_to_string(&w.files.config_path).expect("config");
    let line = format!("at_once = {at_once}");
    let config = if config.contains("[restore_test]") {
        config.replacen("[restore_test]", &format!("[restore_test]\n{line}"), 1)
    } else {
        format!("{config}\n[restore_test]\n{line}\n")
    };
    std::fs::write(&w.files.config_path, config).expect("config");
    let started = Instant::now();
    let child = w
        .command()
        .args(["--selftest=restore", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the agent");
    let status = format!("/proc/{}/status", child.id());
    let hwm = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let watch = {
        let hwm = hwm.clone();
        std::thread::spawn(move || {
            while let Ok(text) = std::fs::read_to_string(&status) {
                let kib = text
                    .lines()
                    .find_map(|l| l.strip_prefix("VmHWM:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
                match kib {
                    Some(k) => hwm.fetch_max(k, std::sync::atomic::Ordering::SeqCst),
                    // A zombie has no memory lines: the run is over.
                    None => break,
                };
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        })
    };
    let out = child.wait_with_output().expect("the agent's output");
    let wall = started.elapsed().as_secs_f64();
    let _ = watch.join();
    let doc = proven_report(&out.stdout, &String::from_utf8_lossy(&out.stderr), guests);
    (
        wall,
        doc["run"]["peak_at_once"].as_u64().unwrap_or(0),
        hwm.load(std::sync::atomic::Ordering::SeqCst),
    )
}

fn main() {
    let Some(runs) = runs() else {
        return;
    };
    let best = |guests: usize, at_once: usize| {
        best(runs, || run(guests, at_once), |r: &(f64, u64, u64)| r.0)
    };
    let (one, _, mem_one) = best(1, 1);
    let (serial, _, mem_serial) = best(8, 1);
    let (parallel, peak, mem_parallel) = best(8, 8);
    println!(
        "restore coverage on real LXC guests ({} cores):",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("  one copy alone:          {one:7.1} s");
    println!("  8 guests one by one:     {serial:7.1} s");
    println!("  8 guests, at_once = 8:   {parallel:7.1} s (at most {peak} copies at once)");
    println!(
        "  8 at once / one copy:    {:7.2}  (goal <= 2.5)",
        parallel / one
    );
    println!("  speed-up over one by one: {:6.2}", serial / parallel);
    println!(
        "  the agent's peak memory: {:7.1} MiB alone, {:.1} MiB one by one, {:.1} MiB 8 at once",
        mem_one as f64 / 1024.0,
        mem_serial as f64 / 1024.0,
        mem_parallel as f64 / 1024.0
    );
}
