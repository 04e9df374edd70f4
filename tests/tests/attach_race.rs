//! The race between the agent's check of a container's LXC command socket and `lxc-attach`'s
//! own connect to it (issue 39, finding 2).
//!
//! `pct exec` (pve-container `src/PVE/CLI/pct.pm`, `exec`) checks the name in `/proc/net/unix`
//! (`src/PVE/LXC.pm` `check_running`) and execs `lxc-attach`, which connects to the name again
//! and enters the namespaces of whatever init the listener names (lxc `src/lxc/attach.c`
//! `get_attach_context`: `lxc_cmd_get_init_pidfd`, else `lxc_cmd_get_init_pid`). A container
//! that stops after the agent's check frees the name; a process of another uid that loops on
//! `bind()` of it then answers, and the command would run, as root, wherever it says.
//!
//! Each try: the container runs (the bed's LXC monitor stand-in and its init), uid 65534 loops
//! on `bind()` of the name and, once it holds it, names itself (a process of the node's own
//! namespaces) as the container's init; an exec starts and the container stops at an offset
//! from -50 to +300 ms around the exec's start (200 tries, evenly spread). The command creates
//! a file in a folder that exists only on the node, outside the container, or prints `inside`
//! when that folder is missing. The files are counted on the node: none may exist, and every try
//! must end in a clear refusal (the container is not running, its command socket is not root's
//! monitor's, or what `pct exec` started is not in the container's namespaces) or a run inside
//! the container.
//!
//! Against the agent before the first stage (the exec helper's check, then `pct exec` of the
//! command itself), the same tries ran the command on the node.

use std::io::BufRead;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use felhom_agent::guest::{ExecError, ExecRequest, GuestExec};
use felhom_tests::guestbed::GuestBed;

const VMID: u32 = 191;
const TRIES: usize = 200;
const FIRST_MS: f64 = -50.0;
const LAST_MS: f64 = 300.0;
/// The uid that squats the name.
const SQUATTER_UID: u32 = 65534;

/// Loops on `bind()` of `@<name>` until it holds it, then answers `LXC_CMD_GET_INIT_PID` with
/// its own pid (LXC's wire format), printing `answered` for each answer.
const SQUATTER: &str = r#"
use Socket;
my ($name) = @ARGV;
socket(my $s, AF_UNIX, SOCK_STREAM, 0) or die "socket: $!";
$| = 1;
print "looping\n";
until (bind($s, pack_sockaddr_un("\0$name"))) { select(undef, undef, undef, 0.0003) }
listen($s, 128) or die "listen: $!";
while (1) {
    accept(my $c, $s) or next;
    my $n = sysread($c, my $req, 16);
    if ($n && $n == 16) {
        syswrite($c, pack("iiq", 0, 0, $$));
        print "answered\n";
    }
    close $c;
}
"#;

struct Squatter {
    child: std::process::Child,
}

impl Squatter {
    fn start(name: &str) -> Squatter {
        let mut child = Command::new("perl")
            .arg("-e")
            .arg(SQUATTER)
            .arg(name)
            .uid(SQUATTER_UID)
            .gid(SQUATTER_UID)
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the squatter starts");
        let mut line = String::new();
        let out = child.stdout.as_mut().expect("stdout");
        let _ = std::io::BufReader::new(out).read_line(&mut line);
        assert_eq!(line.trim(), "looping", "the squatter did not start");
        Squatter { child }
    }

    /// Stop it; how many times it named itself as the container's init.
    fn stop(mut self) -> usize {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut text = String::new();
        if let Some(mut out) = self.child.stdout.take() {
            use std::io::Read;
            let _ = out.read_to_string(&mut text);
        }
        text.lines().filter(|l| *l == "answered").count()
    }
}

#[derive(Debug, Default)]
struct Tally {
    /// The command ran inside and printed `inside`.
    inside: usize,
    /// It was let run inside (the first stage was proven there) and ended otherwise: the
    /// container stopped under it.
    inside_cut: usize,
    not_running: usize,
    monitor_untrusted: usize,
    attach_mismatch: usize,
    /// Tries in which the squatter answered `lxc-attach` (the race was won at the socket).
    squatter_answered: usize,
    unclear: Vec<String>,
}

#[test]
fn a_container_stopped_around_an_exec_never_lets_the_command_run_outside_it() {
    let bed = GuestBed::new();
    bed.add_ct(VMID);
    let host_dir = tempfile::Builder::new()
        .prefix("felhom-attach-race-")
        .tempdir()
        .expect("tempdir");
    let host = host_dir.path().display().to_string();
    assert!(
        !bed.guest_path(VMID, &host).exists(),
        "the node's folder must not exist in the container"
    );
    let name = format!("{}/{VMID}/command", bed.lxc_path().display());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut tally = Tally::default();
    for i in 0..TRIES {
        let offset = FIRST_MS + (LAST_MS - FIRST_MS) * i as f64 / (TRIES - 1) as f64;
        bed.set_running(VMID, true);
        let squatter = Squatter::start(&name);
        let script = format!(
            "if [ -d '{host}' ]; then : > '{host}/ran-{i}'; echo outside; else echo inside; fi"
        );
        let request = ExecRequest::new(["/bin/sh", "-c", &script]).timeout(Duration::from_secs(30));
        let lxc = bed.lxc(VMID);
        let result = std::thread::scope(|scope| {
            let stop_in = Duration::from_secs_f64(offset.abs() / 1000.0);
            if offset < 0.0 {
                bed.stop_monitor(VMID);
                std::thread::sleep(stop_in);
                rt.block_on(lxc.exec(&request))
            } else {
                let start = Instant::now();
                let bed = &bed;
                scope.spawn(move || {
                    std::thread::sleep(stop_in.saturating_sub(start.elapsed()));
                    bed.stop_monitor(VMID);
                });
                rt.block_on(lxc.exec(&request))
            }
        });
        tally.squatter_answered += usize::from(squatter.stop() > 0);
        match result {
            Ok(outcome) if outcome.stdout.text() == "inside\n" => tally.inside += 1,
            Ok(outcome) if outcome.stdout.text().is_empty() => tally.inside_cut += 1,
            Ok(outcome) => tally
                .unclear
                .push(format!("try {i} ({offset:.1} ms): {}", outcome.summary())),
            Err(ExecError::NotRunning { .. }) => tally.not_running += 1,
            Err(ExecError::MonitorUntrusted { .. }) => tally.monitor_untrusted += 1,
            Err(e @ ExecError::AttachMismatch { .. }) => {
                assert!(e.to_string().contains("CT 191"), "{e}");
                tally.attach_mismatch += 1;
            }
            Err(e) => tally
                .unclear
                .push(format!("try {i} ({offset:.1} ms): {} {e}", e.code())),
        }
    }
    bed.stop_monitor(VMID);
    let ran_outside: Vec<String> = std::fs::read_dir(host_dir.path())
        .expect("read the node's folder")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    eprintln!(
        "{tally:#?}; runs outside the container: {}",
        ran_outside.len()
    );
    assert!(
        ran_outside.is_empty(),
        "the command ran outside the container, as root, in {} of {TRIES} tries: {ran_outside:?} ({tally:?})",
        ran_outside.len()
    );
    assert!(
        tally.unclear.is_empty(),
        "tries that ended neither in a clear refusal nor in a run inside: {:#?}",
        tally.unclear
    );
    // The tries reached both ends: runs inside, and the squatter answering the attach itself.
    assert!(tally.inside > 0, "{tally:?}");
    assert!(
        tally.squatter_answered > 0,
        "the race was never reached: {tally:?}"
    );
}
