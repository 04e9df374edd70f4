//! LXC exec and push against real processes: the `pct` stand-in runs every command in a real
//! root filesystem (busybox under unshare + chroot).
//!
//! The busybox bed on purpose: several tests inject the stand-in's faults (`PctFault`: a no-op exec,
//! a cut stdin, an escape, a read-only root), which a real container cannot be made to show.

use std::time::{Duration, Instant};

use felhom_agent::guest::{ExecError, ExecRequest, GuestExec, GuestExit, PushSource};
use felhom_tests::guestbed::{
    all_cmdlines, kill_processes_with_marker, processes_with_marker, unique_marker,
    wait_processes_gone, GuestBed, PctFault,
};

fn sh(script: &str) -> ExecRequest {
    ExecRequest::new(["/bin/sh", "-c", script]).timeout(Duration::from_secs(20))
}

/// Fails the test when processes with `marker` are still alive, after killing them.
fn assert_no_leftovers(marker: &str) {
    let left = wait_processes_gone(marker, Duration::from_secs(3));
    if !left.is_empty() {
        kill_processes_with_marker(marker);
        panic!("processes left behind: {left:?}");
    }
}

#[tokio::test]
async fn exit_codes_propagate_from_the_guest() {
    let bed = GuestBed::new();
    bed.add_ct(101);
    let ct = bed.lxc(101);
    let cases = [
        ("exit 0", GuestExit::Exited(0)),
        ("exit 42", GuestExit::Exited(42)),
        ("exit 255", GuestExit::Exited(255)),
        // A command killed by a signal: lxc-attach reports 128 + signal.
        ("kill -TERM $$", GuestExit::Exited(143)),
        ("kill -KILL $$", GuestExit::Exited(137)),
    ];
    for (script, want) in cases {
        let outcome = ct.exec(&sh(script)).await.unwrap();
        assert_eq!(outcome.exit, want, "{script}");
        // Nothing but the command writes to its stderr (no shell reports "Killed").
        assert!(
            outcome.stderr.bytes.is_empty(),
            "{script}: {}",
            outcome.stderr.text()
        );
    }
    // A program that does not exist in the guest.
    let outcome = ct
        .exec(&ExecRequest::new(["no-such-program"]))
        .await
        .unwrap();
    assert_eq!(outcome.exit, GuestExit::Exited(127));
}

#[tokio::test]
async fn stdout_stderr_and_stdin_are_carried_as_bytes() {
    let bed = GuestBed::new();
    bed.add_ct(101);
    let ct = bed.lxc(101);
    let outcome = ct
        .exec(&sh("echo out; echo err >&2; hostname"))
        .await
        .unwrap();
    assert!(outcome.success());
    assert_eq!(outcome.stdout.bytes, b"out\ntestbed\n");
    assert_eq!(outcome.stderr.bytes, b"err\n");
    assert!(!outcome.stdout.truncated);

    let input: Vec<u8> = (0..=255u8).cycle().take(200_000).collect();
    let outcome = ct
        .exec(&ExecRequest::new(["cat"]).stdin(input.clone()))
        .await
        .unwrap();
    assert!(outcome.success());
    assert_eq!(outcome.stdout.bytes, input);
}

#[tokio::test]
async fn the_output_cap_holds_while_the_command_keeps_writing() {
    let bed = GuestBed::new();
    bed.add_ct(101);
    let ct = bed.lxc(101);
    // 20 MB on stdout and 1 MB on stderr; only the cap is kept, the rest is read and dropped.
    let outcome = ct
        .exec(
            &sh("head -c 20000000 /dev/zero; head -c 1000000 /dev/zero >&2; echo done >&2")
                .output_cap(4096),
        )
        .await
        .unwrap();
    assert!(outcome.success(), "{}", outcome.summary());
    assert_eq!(outcome.stdout.bytes.len(), 4096);
    assert!(outcome.stdout.truncated);
    assert_eq!(outcome.stderr.bytes.len(), 4096);
    assert!(outcome.stderr.truncated);

    let outcome = ct.exec(&sh("echo small").output_cap(4096)).await.unwrap();
    assert_eq!(outcome.stdout.bytes, b"small\n");
    assert!(!outcome.stdout.truncated);
}

#[tokio::test]
async fn a_timeout_kills_the_command_and_leaves_no_process() {
    let bed = GuestBed::new();
    bed.add_ct(101);
    let ct = bed.lxc(101);
    let marker = unique_marker("timeout");
    // Ignores SIGTERM, so only the SIGKILL after the grace period stops it; it also starts a
    // child of its own.
    let request = ExecRequest::new([
        "/bin/sh",
        "-c",
        "trap '' TERM; sleep 1000 & while :; do sleep 1; done",
        &marker,
    ])
    .timeout(Duration::from_secs(1));
    let started = Instant::now();
    let outcome = ct.exec(&request).await.unwrap();
    let took = started.elapsed();
    assert_eq!(outcome.exit, GuestExit::TimedOut);
    assert!(took >= Duration::from_secs(1), "{took:?}");
    // The command never ends by itself: any end well inside this generous bound is the
    // timeout's doing, on a loaded machine too.
    assert!(took < Duration::from_secs(120), "{took:?}");
    assert_no_leftovers(&marker);
}

#[tokio::test]
async fn a_command_that_escapes_the_process_group_is_killed_inside_the_guest() {
    let bed = GuestBed::new();
    bed.add_ct(101);
    bed.add_fault(101, PctFault::ExecEscape);
    let ct = bed.lxc(101);
    let marker = unique_marker("escape");
    let request = ExecRequest::new([
        "/bin/sh",
        "-c",
        "trap '' TERM; while :; do sleep 1; done",
        &marker,
    ])
    .timeout(Duration::from_secs(1));
    let outcome = ct.exec(&request).await.unwrap();
    assert_eq!(outcome.exit, GuestExit::TimedOut);
    assert_no_leftovers(&marker);
}

/// The control for the test above: with the escape fault, killing pct's process group does not
/// stop the command; only the in-guest sweep does.
#[tokio::test]
async fn the_escape_fault_really_survives_a_group_kill() {
    use std::os::unix::process::CommandExt;
    let bed = GuestBed::new();
    bed.add_ct(101);
    bed.add_fault(101, PctFault::ExecEscape);
    let marker = unique_marker("control");
    let mut child = std::process::Command::new(bed.pct())
        .args(["exec", "101", "--keep-env", "0", "--"])
        .args([
            "/bin/sh",
            "-c",
            "trap '' TERM; while :; do sleep 1; done",
            &marker,
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    // Wait for the command itself (pct's own command line holds the marker too).
    let started = |marker: &str| {
        processes_with_marker(marker)
            .iter()
            .any(|(_, cmd)| cmd.starts_with("/bin/sh -c trap"))
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !started(&marker) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let pgid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL).unwrap();
    let _ = child.wait();
    std::thread::sleep(Duration::from_millis(300));
    let survivors = processes_with_marker(&marker);
    let killed = kill_processes_with_marker(&marker);
    assert!(
        !survivors.is_empty() && killed > 0,
        "the escaped command should have survived the group kill"
    );
}

#[tokio::test]
async fn a_secret_in_the_agents_environment_never_reaches_the_guest() {
    // Only this test sets it; the value is unique so it cannot be present by chance.
    let secret = unique_marker("s3cret");
    std::env::set_var("FELHOM_TEST_SECRET_TOKEN", &secret);
    let bed = GuestBed::new();
    bed.add_ct(101);
    let ct = bed.lxc(101);
    let outcome = ct
        .exec(
            &sh("env; echo ---; cat /proc/self/environ | tr '\\000' '\\n'")
                .env("FELHOM_REQUESTED", "visible"),
        )
        .await
        .unwrap();
    std::env::remove_var("FELHOM_TEST_SECRET_TOKEN");
    assert!(outcome.success());
    let seen = outcome.stdout.text().into_owned();
    assert!(!seen.contains("FELHOM_TEST_SECRET_TOKEN"), "{seen}");
    assert!(!seen.contains(&secret), "{seen}");
    // What was asked for does arrive, with the controlled defaults and nothing else.
    assert!(seen.contains("FELHOM_REQUESTED=visible"), "{seen}");
    let keys: std::collections::BTreeSet<&str> = seen
        .split("---")
        .next()
        .unwrap_or("")
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, _)| k))
        .collect();
    let allowed = [
        "PATH",
        "LANG",
        "HOME",
        "FELHOM_EXEC_ID",
        "FELHOM_REQUESTED",
        "PWD",
        "SHLVL",
    ];
    for key in &keys {
        assert!(
            allowed.contains(key),
            "unexpected variable {key} in the guest: {seen}"
        );
    }
    // pct itself was started with a cleared environment too.
    let pct_env = bed.last_pct_env();
    assert!(pct_env.contains("PATH="), "{pct_env}");
    assert!(!pct_env.contains(&secret), "{pct_env}");
}

#[tokio::test]
async fn a_stopped_or_missing_container_is_an_error_not_an_outcome() {
    let bed = GuestBed::new();
    bed.add_ct(101);
    bed.set_running(101, false);
    let err = bed.lxc(101).exec(&sh("true")).await.unwrap_err();
    assert!(matches!(err, ExecError::NotRunning { .. }), "{err}");
    assert!(err.to_string().contains("CT 101"), "{err}");
    // No container 202: no LXC monitor holds its command socket, so `pct exec` is not even run
    // (checked before every `pct exec`), and the container counts as not running.
    let err = bed.lxc(202).exec(&sh("true")).await.unwrap_err();
    assert!(matches!(err, ExecError::NotRunning { .. }), "{err}");
    let err = bed
        .lxc(101)
        .push_file(&PushSource::Bytes(b"x".to_vec()), "/root/x", 0o600)
        .await
        .unwrap_err();
    assert!(matches!(err, ExecError::NotRunning { .. }), "{err}");
}

#[tokio::test]
async fn pushed_files_arrive_verified_with_their_mode() {
    use std::os::unix::fs::PermissionsExt;
    let bed = GuestBed::new();
    bed.add_ct(101);
    let ct = bed.lxc(101);
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let receipt = ct
        .push_file(
            &PushSource::Bytes(payload.clone()),
            "/root/payload.bin",
            0o640,
        )
        .await
        .unwrap();
    assert_eq!(receipt.size, payload.len() as u64);
    assert_eq!(receipt.mode, 0o640);
    let landed = bed.guest_path(101, "/root/payload.bin");
    assert_eq!(std::fs::read(&landed).unwrap(), payload);
    assert_eq!(
        std::fs::metadata(&landed).unwrap().permissions().mode() & 0o7777,
        0o640
    );
    // The staged copy on the node is gone.
    assert_eq!(std::fs::read_dir(bed.scratch_dir()).unwrap().count(), 0);

    let local = bed.scratch_dir().join("script.sh");
    std::fs::write(&local, "#!/bin/sh\necho pushed-script\n").unwrap();
    ct.push_file(&PushSource::Path(local), "/usr/local/bin/pushed", 0o755)
        .await
        .unwrap();
    let outcome = ct.exec(&ExecRequest::new(["pushed"])).await.unwrap();
    assert_eq!(outcome.stdout.bytes, b"pushed-script\n");
}

#[tokio::test]
async fn a_push_whose_write_did_nothing_is_detected() {
    let bed = GuestBed::new();
    bed.add_ct(101);
    // `pct exec` exits 0 and runs nothing: the write "succeeds", the read-back finds nothing.
    bed.add_fault(101, PctFault::ExecNoop);
    let err = bed
        .lxc(101)
        .push_file(
            &PushSource::Bytes(b"config".to_vec()),
            "/root/app.conf",
            0o600,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ExecError::PushUnverified { .. }), "{err}");
    assert!(!bed.guest_path(101, "/root/app.conf").exists());
}

#[tokio::test]
async fn a_push_that_arrives_short_is_detected() {
    let bed = GuestBed::new();
    bed.add_ct(101);
    bed.add_fault(101, PctFault::StdinTruncate);
    let err = bed
        .lxc(101)
        .push_file(
            &PushSource::Bytes(b"0123456789".to_vec()),
            "/root/app.conf",
            0o600,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ExecError::PushUnverified { .. }), "{err}");
    assert!(
        err.to_string().contains("expected 10 bytes, found 9"),
        "{err}"
    );
}

#[tokio::test]
async fn a_push_into_a_missing_folder_or_onto_a_folder_fails_in_the_guests_words() {
    let bed = GuestBed::new();
    bed.add_ct(101);
    let err = bed
        .lxc(101)
        .push_file(
            &PushSource::Bytes(b"x".to_vec()),
            "/no/such/dir/file",
            0o600,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ExecError::PushFailed { .. }), "{err}");
    assert!(err.to_string().contains("failed to create file"), "{err}");
    let err = bed
        .lxc(101)
        .push_file(&PushSource::Bytes(b"x".to_vec()), "/etc", 0o600)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("Is a directory"), "{err}");
    assert!(bed.guest_path(101, "/etc/hostname").exists());
    bed.assert_no_push();
}

/// A push replaces a link at its path instead of writing through it, and writes through the
/// guest's own root: a link to an absolute path resolves inside the guest, never on the node.
#[tokio::test]
async fn a_push_replaces_a_link_and_never_leaves_the_guest() {
    let bed = GuestBed::new();
    let rootfs = bed.add_ct(101);
    // A link in the guest pointing at an absolute path: on the node that would be the node's
    // file; in the guest it is the guest's.
    let outside = tempfile::tempdir().unwrap();
    let victim = outside.path().join("victim");
    std::fs::write(&victim, "node file\n").unwrap();
    std::os::unix::fs::symlink(&victim, rootfs.join("root/link")).unwrap();
    let ct = bed.lxc(101);
    ct.push_file(
        &PushSource::Bytes(b"guest bytes\n".to_vec()),
        "/root/link",
        0o644,
    )
    .await
    .unwrap();
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "node file\n");
    let landed = bed.guest_path(101, "/root/link");
    assert!(!std::fs::symlink_metadata(&landed)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::read(&landed).unwrap(), b"guest bytes\n");
    // No temporary file is left beside it.
    let left: Vec<_> = std::fs::read_dir(rootfs.join("root"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("link."))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// `exec_until` (what the exec helper runs when its caller may go away): the stop ends a
/// command long before its timeout, as a timeout would, the sweep included, so even a command
/// that escaped pct's process group is gone.
#[tokio::test]
async fn a_stopped_exec_ends_at_once_and_leaves_nothing_even_when_it_escaped() {
    let bed = GuestBed::new();
    bed.add_ct(101);
    bed.add_fault(101, PctFault::ExecEscape);
    let ct = bed.lxc(101);
    let marker = unique_marker("stopped");
    let request = ExecRequest::new([
        "/bin/sh",
        "-c",
        "trap '' TERM; while :; do sleep 1; done",
        &marker,
    ])
    .timeout(Duration::from_secs(600));
    let stop = tokio_util::sync::CancellationToken::new();
    let trigger = stop.clone();
    let watch = marker.clone();
    tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(20);
        while processes_with_marker(&watch).is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        trigger.cancel();
    });
    let started = Instant::now();
    let outcome = ct.exec_until(&request, &stop).await.unwrap();
    assert_eq!(outcome.exit, GuestExit::TimedOut);
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "stopped, not timed out: {:?}",
        started.elapsed()
    );
    assert_no_leftovers(&marker);
}

/// Every process's command line, read from the node's `/proc` (what any local user can read).

#[tokio::test]
async fn environment_values_never_appear_on_a_command_line() {
    let bed = GuestBed::new();
    bed.add_ct(101);
    let ct = bed.lxc(101);
    // Letters and digits only, so its form on stdin is the value itself: a search for the
    // value finds either.
    let secret = unique_marker("envsecret").replace(|c: char| !c.is_ascii_alphanumeric(), "");
    let other = "line one\nline two \\ 'quoted' $HOME é";
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let stop = stop.clone();
        let secret = secret.clone();
        std::thread::spawn(move || {
            let mut scans = 0u32;
            let mut seen = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                for line in all_cmdlines() {
                    if line.contains(&secret) {
                        seen.push(line);
                    }
                }
                scans += 1;
            }
            (scans, seen)
        })
    };
    let outcome = ct
        .exec(
            &sh("sleep 2; printf '%s|' \"$FELHOM_SECRET\" \"$FELHOM_OTHER\"; cat")
                .env("FELHOM_SECRET", &secret)
                .env("FELHOM_OTHER", other)
                .stdin(b"the command's own stdin\n".to_vec()),
        )
        .await
        .unwrap();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (scans, seen) = watcher.join().unwrap();
    assert!(outcome.success(), "{outcome:?}");
    assert_eq!(
        outcome.stdout.text(),
        format!("{secret}|{other}|the command's own stdin\n")
    );
    assert!(scans > 5, "the command lines were read only {scans} times");
    assert!(seen.is_empty(), "a command line held the value: {seen:#?}");
}

/// The squat: container 101's monitor is gone (the container stopped, for LXC) while `pct`
/// would still take it for running, and a process that is not root's binds its command socket
/// `@<lxcpath>/101/command` with the monitor's very command line. `lxc-attach` would enter what
/// that listener names; the exec is refused before `pct` is started.
#[tokio::test]
async fn a_command_socket_not_held_by_roots_lxc_monitor_is_refused_before_pct_runs() {
    use felhom_agent::guest::lxc_monitor::{check_monitor, Monitor};
    let bed = GuestBed::new();
    bed.add_ct(101);
    let out = bed.lxc(101).exec(&sh("echo up")).await.expect("exec");
    assert_eq!(out.stdout.text(), "up\n");
    let execs = |bed: &GuestBed| {
        bed.pct_calls()
            .iter()
            .filter(|c| c.sub == "exec" && c.vmid == "101")
            .count()
    };
    let before = execs(&bed);
    assert_eq!(before, 1, "{:#?}", bed.pct_calls());

    bed.stop_monitor(101);
    assert_eq!(check_monitor(&bed.lxc_path(), 101), Monitor::Absent);
    let _squatter = felhom_tests::guestbed::Squatter::bind(&bed.lxc_path(), 101, 65534);
    let err = bed
        .lxc(101)
        .exec(&sh(": > /root/squatted"))
        .await
        .unwrap_err();
    assert!(matches!(err, ExecError::MonitorUntrusted { .. }), "{err}");
    assert_eq!(err.code().as_str(), "exec_monitor_untrusted");
    let msg = err.to_string();
    assert!(
        msg.contains("CT 101") && msg.contains("uid 65534") && msg.contains("/101/command"),
        "{msg}"
    );
    let err = bed
        .lxc(101)
        .push_file(&PushSource::Bytes(b"x".to_vec()), "/root/x", 0o600)
        .await
        .unwrap_err();
    assert!(matches!(err, ExecError::MonitorUntrusted { .. }), "{err}");
    assert_eq!(execs(&bed), before, "pct ran: {:#?}", bed.pct_calls());
    assert!(!bed.guest_path(101, "/root/squatted").exists());
    assert!(!bed.guest_path(101, "/root/x").exists());
}

/// A bed dropped while a `pct exec` still runs kills that `pct` and the command in the guest: no
/// test leaves a guest command running after it (one whose test had killed the exec helper that
/// drove it once spun for hours on its deleted root filesystem, beside the rest of the suite).
#[test]
fn a_dropped_bed_leaves_no_guest_command_running() {
    let marker = unique_marker("dropped-bed");
    let bed = GuestBed::new();
    bed.add_ct(101);
    let mut pct = std::process::Command::new(bed.pct())
        .args(["exec", "101", "--", "/bin/sh", "-c"])
        .arg(format!("while :; do sleep 1; done # {marker}"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("pct exec");
    let deadline = Instant::now() + Duration::from_secs(20);
    while processes_with_marker(&marker).len() < 2 {
        assert!(Instant::now() < deadline, "the guest command never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(bed);
    let left = wait_processes_gone(&marker, Duration::from_secs(10));
    // Whatever is left is killed before the verdict (it would hold the test's output open).
    kill_processes_with_marker(&marker);
    let _ = pct.kill();
    let _ = pct.wait();
    assert!(
        left.is_empty(),
        "still running after the bed was dropped: {left:#?}"
    );
}
