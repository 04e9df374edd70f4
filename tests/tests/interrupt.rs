//! Ctrl-C during a bootstrap stops what runs in the guest: the agent hangs up on the exec
//! helper, which stops the command's process group inside the container; the run ends with its
//! own code (`interrupted`, exit 130) within seconds, not when the profile would have ended, and
//! no process is left in the guest. The transaction stays open, to be resumed.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use felhom_tests::world::World;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Processes whose root directory is `rootfs` (the guest's, as the `pct` stand-in enters it),
/// with their command lines: read from /proc, the source. The container's own init (PID 1 of
/// its PID namespace, `tests/pct/lxc-monitor`) and the `sleep 3600` it waits on are the
/// container's, not an exec's, and are left out.
fn processes_in(rootfs: &Path) -> Vec<(u32, String)> {
    let want = fs::canonicalize(rootfs).unwrap_or_else(|_| rootfs.to_path_buf());
    let mut found = Vec::new();
    let Ok(rd) = fs::read_dir("/proc") else {
        return found;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(root) = fs::read_link(e.path().join("root")) else {
            continue;
        };
        if root != want {
            continue;
        }
        let stat = fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        if stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        {
            continue;
        }
        let cmdline = fs::read(e.path().join("cmdline"))
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .unwrap_or_default();
        let status = fs::read_to_string(e.path().join("status")).unwrap_or_default();
        let ns_pid = |status: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .and_then(|ids| ids.split_whitespace().last())
                .map(str::to_string)
        };
        if ns_pid(&status).as_deref() == Some("1") {
            continue;
        }
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1).map(str::to_string))
            .unwrap_or_default();
        let parent = fs::read_to_string(format!("/proc/{ppid}/status")).unwrap_or_default();
        if cmdline == "sleep 3600 " && ns_pid(&parent).as_deref() == Some("1") {
            continue;
        }
        found.push((pid, cmdline));
    }
    found
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn ctrl_c_stops_a_bootstrap_running_sleep_60_and_leaves_no_process_in_the_guest() {
    let w = World::demo();
    let rootfs = w.bed.rootfs(120);
    ctrl_c_in_bootstrap(&w, &|| {
        processes_in(&rootfs)
            .into_iter()
            .map(|(_, c)| c.trim_end().to_string())
            .collect()
    });
}

/// The same on a real guest: a Debian container with systemd whose `pct exec` is
/// `lxc-attach`; what runs in the guest is what `ps` inside it lists (its own PID namespace,
/// its own /proc).
#[test]
fn ctrl_c_stops_a_bootstrap_running_sleep_60_in_a_real_guest_and_leaves_no_process_in_it() {
    let Some(w) = World::real_or_skip(
        felhom_tests::verdict::static_debian_backup(),
        &felhom_tests::fakepve::AgentOptions::default(),
    ) else {
        return;
    };
    let pct = w.bed.pct();
    ctrl_c_in_bootstrap(&w, &|| {
        let out = std::process::Command::new(&pct)
            .args([
                "exec",
                "120",
                "--keep-env",
                "0",
                "--",
                "ps",
                "-e",
                "-o",
                "args=",
            ])
            .output()
            .expect("pct exec ps");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| l.trim_end().to_string())
            .filter(|l| l != "ps -e -o args=")
            .collect()
    });
}

/// Ctrl-C while the bootstrap of guest 120 runs `sleep 60`; `guest_processes` lists the
/// command lines of what runs in the guest (beyond its own init and services).
fn ctrl_c_in_bootstrap(w: &World, guest_processes: &dyn Fn() -> Vec<String>) {
    let run_script: PathBuf = w.files.bootstrap_dir.join("default").join("run");
    fs::write(&run_script, "#!/bin/sh\nsleep 60\n").expect("write the profile");
    let mut agent = w
        .command()
        .args(["--selftest=provision", "-vmid", "120"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the agent");
    // The event: `sleep 60` runs inside the guest.
    wait_for("sleep 60 in guest 120", Duration::from_secs(180), || {
        guest_processes().iter().any(|c| c == "sleep 60")
    });
    let pid = Pid::from_raw(i32::try_from(agent.id()).expect("pid"));
    kill(pid, Signal::SIGINT).expect("SIGINT");
    let sent = Instant::now();
    let mut status = None;
    while sent.elapsed() < Duration::from_secs(5) {
        if let Some(s) = agent.try_wait().expect("wait") {
            status = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let Some(status) = status else {
        let _ = agent.kill();
        let out = agent.wait_with_output().expect("output");
        panic!(
            "the agent did not end within 5 s of Ctrl-C:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let out = agent.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(status.code(), Some(130), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("[interrupted]") && stderr.contains("120"),
        "the interruption has its own code and names the vmid:\n{stdout}\n{stderr}"
    );
    // The helper stops the command's process group and sweeps its tag: wait for the guest
    // to hold no process of the bootstrap (the event), then count.
    let left = {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left: Vec<String> = guest_processes()
                .into_iter()
                .filter(|c| c.contains("sleep") || c.contains("felhom"))
                .collect();
            if left.is_empty() || Instant::now() >= deadline {
                break left;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    assert!(left.is_empty(), "processes left in guest 120: {left:?}");
    // The transaction is open (interrupted), not failed: a resume takes it up.
    let journal = w.journal();
    assert!(
        journal
            .iter()
            .any(|t| t["vmid"] == 120 && t["interrupted"] == true),
        "{journal:#?}"
    );
}
