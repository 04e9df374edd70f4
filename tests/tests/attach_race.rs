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

use std::path::PathBuf;

use felhom_agent::guest::{ExecError, ExecRequest, GuestExec, LxcExec, PctConfig};
use felhom_tests::guestbed::GuestBed;

const VMID: u32 = 191;
const TRIES: usize = 200;
/// Real containers the real race runs against at once, each taking every `REAL_AT_ONCE`-th try
/// (so each spans the whole range of offsets), each its own vmid from [`VMID`] on and its own
/// lxcpath. A try's time is mostly LXC starting and stopping the container, which waits more
/// than it computes (four at once take about a quarter of the time of one); tests/nextest.toml
/// counts that test as two of the runner's slots.
const REAL_AT_ONCE: usize = 4;
/// The same for the test bed's containers, each in a bed of its own: a try there mostly waits
/// too (for the stop at its offset, up to 300 ms; one bed: 16 s of processor time in 43 s).
const BEDS_AT_ONCE: usize = 4;
const FIRST_MS: f64 = -50.0;
const LAST_MS: f64 = 300.0;
/// The uid that squats the name.
const SQUATTER_UID: u32 = 65534;

/// Loops on `bind()` of `@<name>` until it holds it, then answers as an LXC monitor would
/// (LXC's wire format, `tests/data/lxc-attach-facts.md` section 2) for a container whose init is
/// itself, a process of the node's own namespaces: `LXC_CMD_GET_INIT_PID` its own pid,
/// `LXC_CMD_GET_STATE` RUNNING, `LXC_CMD_GET_CLONE_FLAGS` the mount, PID, UTS and IPC
/// namespaces, every other command -ENOSYS (the real lxc-attach 5.0.2 then runs its command as
/// root in the node's namespaces). It prints `answered` for each init pid it gave.
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
        my ($cmd, $len) = unpack("iiq", $req);
        sysread($c, my $data, $len) if $len > 0 && $len < 65536;
        my $rsp = pack("iiq", -38, 0, 0);
        $rsp = pack("iiq", 0, 0, $$) if $cmd == 4;
        $rsp = pack("iiq", 2, 0, 0) if $cmd == 3;
        $rsp = pack("iiq", 0, 0, 0x00020000 | 0x20000000 | 0x04000000 | 0x08000000) if $cmd == 5;
        syswrite($c, $rsp);
        print "answered\n" if $cmd == 4;
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

impl Tally {
    fn add(&mut self, other: Tally) {
        self.inside += other.inside;
        self.inside_cut += other.inside_cut;
        self.not_running += other.not_running;
        self.monitor_untrusted += other.monitor_untrusted;
        self.attach_mismatch += other.attach_mismatch;
        self.squatter_answered += other.squatter_answered;
        self.unclear.extend(other.unclear);
    }
}

/// One container the race runs against.
trait Container: Sync {
    /// Its vmid.
    fn vmid(&self) -> u32;
    /// Start it (it runs on return).
    fn start(&self);
    /// Stop it (its command socket is free, or about to be, on return).
    fn stop(&self);
    /// An exec into it through `pct exec`, as the agent runs it.
    fn lxc(&self) -> LxcExec;
    /// Its lxcpath.
    fn lxc_path(&self) -> PathBuf;
    /// Where a path of the container is on the node.
    fn guest_path(&self, guest_path: &str) -> PathBuf;
}

impl Container for GuestBed {
    fn vmid(&self) -> u32 {
        VMID
    }
    fn start(&self) {
        self.set_running(VMID, true);
    }
    fn stop(&self) {
        self.stop_monitor(VMID);
    }
    fn lxc(&self) -> LxcExec {
        GuestBed::lxc(self, VMID)
    }
    fn lxc_path(&self) -> PathBuf {
        GuestBed::lxc_path(self)
    }
    fn guest_path(&self, guest_path: &str) -> PathBuf {
        GuestBed::guest_path(self, VMID, guest_path)
    }
}

/// The race against `cts`, the tries spread over them (each container takes every n-th try, in
/// a thread of its own): the tally, and the tries whose command ran on the node.
fn race(cts: &[&dyn Container]) -> (Tally, Vec<String>) {
    let host_dir = tempfile::Builder::new()
        .prefix("felhom-attach-race-")
        .tempdir()
        .expect("tempdir");
    let host = host_dir.path().display().to_string();
    for ct in cts {
        assert!(
            !ct.guest_path(&host).exists(),
            "the node's folder must not exist in the container"
        );
    }
    let tally = std::thread::scope(|scope| {
        let racers: Vec<_> = cts
            .iter()
            .enumerate()
            .map(|(first, ct)| {
                let host = host.as_str();
                scope.spawn(move || race_tries(*ct, host, (first..TRIES).step_by(cts.len())))
            })
            .collect();
        let mut tally = Tally::default();
        let mut panic = None;
        for racer in racers {
            match racer.join() {
                Ok(part) => tally.add(part),
                Err(payload) => {
                    panic.get_or_insert(payload);
                }
            }
        }
        if let Some(payload) = panic {
            std::panic::resume_unwind(payload);
        }
        tally
    });
    let ran_outside: Vec<String> = std::fs::read_dir(host_dir.path())
        .expect("read the node's folder")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    (tally, ran_outside)
}

/// The tries `tries` (of `0..TRIES`) against `ct`; a command that runs on the node leaves a
/// file in `host`.
fn race_tries(ct: &dyn Container, host: &str, tries: impl Iterator<Item = usize>) -> Tally {
    let vmid = ct.vmid();
    let name = format!("{}/{vmid}/command", ct.lxc_path().display());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut tally = Tally::default();
    for i in tries {
        let offset = FIRST_MS + (LAST_MS - FIRST_MS) * i as f64 / (TRIES - 1) as f64;
        ct.start();
        let squatter = Squatter::start(&name);
        let script = format!(
            "if [ -d '{host}' ]; then : > '{host}/ran-{i}'; echo outside; else echo inside; fi"
        );
        let request = ExecRequest::new(["/bin/sh", "-c", &script]).timeout(Duration::from_secs(30));
        let lxc = ct.lxc();
        let result = std::thread::scope(|scope| {
            let stop_in = Duration::from_secs_f64(offset.abs() / 1000.0);
            if offset < 0.0 {
                ct.stop();
                std::thread::sleep(stop_in);
                rt.block_on(lxc.exec(&request))
            } else {
                let start = Instant::now();
                scope.spawn(move || {
                    std::thread::sleep(stop_in.saturating_sub(start.elapsed()));
                    ct.stop();
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
                assert!(e.to_string().contains(&format!("CT {vmid}")), "{e}");
                tally.attach_mismatch += 1;
            }
            Err(e) => tally
                .unclear
                .push(format!("try {i} ({offset:.1} ms): {} {e}", e.code())),
        }
    }
    ct.stop();
    tally
}

fn assert_never_outside(what: &str, tally: &Tally, ran_outside: &[String]) {
    eprintln!(
        "{what}: {tally:#?}; runs outside the container: {}",
        ran_outside.len()
    );
    assert!(
        ran_outside.is_empty(),
        "{what}: the command ran outside the container, as root, in {} of {TRIES} tries: {ran_outside:?} ({tally:?})",
        ran_outside.len()
    );
    assert!(
        tally.unclear.is_empty(),
        "{what}: tries that ended neither in a clear refusal nor in a run inside: {:#?}",
        tally.unclear
    );
    // The tries reached both ends: runs inside, and the squatter answering the attach itself.
    assert!(tally.inside > 0, "{what}: {tally:?}");
    assert!(
        tally.squatter_answered > 0,
        "{what}: the race was never reached: {tally:?}"
    );
}

/// The race on the test bed ([`BEDS_AT_ONCE`] beds, the tries spread over them).
#[test]
fn a_container_stopped_around_an_exec_never_lets_the_command_run_outside_it() {
    let beds: Vec<GuestBed> = (0..BEDS_AT_ONCE)
        .map(|_| {
            let bed = GuestBed::new();
            bed.add_ct(VMID);
            bed
        })
        .collect();
    let racers: Vec<&dyn Container> = beds.iter().map(|bed| bed as &dyn Container).collect();
    let (tally, ran_outside) = race(&racers);
    assert_never_outside("the test bed", &tally, &ran_outside);
}

/// A real unprivileged LXC container as PVE starts one (`lxc-start -F -n <vmid>`, the idmap
/// `0 100000 65536`; `tests/data/lxc-attach-facts.md`), its root filesystem the bed's busybox
/// template shifted to uid 100000 and its init a shell that waits, and `pct exec` as
/// pve-container's: `check_running` on `/proc/net/unix`, then the real `lxc-attach` in its
/// place. Stopped with `lxc-stop --kill`.
struct RealCt {
    vmid: u32,
    dir: tempfile::TempDir,
    monitor: std::sync::Mutex<Option<std::process::Child>>,
}

impl RealCt {
    /// Make it as `vmid`, or say why this machine cannot run it.
    fn new(vmid: u32) -> Result<RealCt, String> {
        for tool in ["lxc-start", "lxc-stop", "lxc-attach", "lxc-wait"] {
            let found = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
                .any(|d| d.join(tool).exists());
            if !found {
                return Err(format!("{tool} is not installed (Debian's lxc)"));
            }
        }
        let subuid = std::fs::read_to_string("/etc/subuid").unwrap_or_default();
        if !subuid.lines().any(|l| l.starts_with("root:100000:")) {
            return Err("/etc/subuid has no root:100000:65536".into());
        }
        let dir = tempfile::Builder::new()
            .prefix("felhom-attach-lxc-")
            .tempdir()
            .map_err(|e| e.to_string())?;
        let lxc = dir.path();
        let ct = lxc.join(vmid.to_string());
        let rootfs = ct.join("rootfs");
        std::fs::create_dir_all(&ct).map_err(|e| e.to_string())?;
        let run = |cmd: &mut Command| -> Result<(), String> {
            let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "{cmd:?}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ))
            }
        };
        run(Command::new("chmod").arg("0755").arg(lxc).arg(&ct))?;
        run(Command::new("cp")
            .arg("-a")
            .arg(felhom_tests::guestbed::template_rootfs())
            .arg(&rootfs))?;
        std::fs::write(
            rootfs.join("ct-init"),
            "#!/bin/sh\nwhile [ -e /bin/sh ]; do sleep 3600 & wait; done\n",
        )
        .map_err(|e| e.to_string())?;
        run(Command::new("chmod")
            .arg("0755")
            .arg(rootfs.join("ct-init")))?;
        run(Command::new("chown")
            .arg("-hR")
            .arg("100000:100000")
            .arg(&rootfs))?;
        std::fs::write(
            ct.join("config"),
            format!(
                "lxc.include = /usr/share/lxc/config/common.conf\n\
                 lxc.include = /usr/share/lxc/config/userns.conf\n\
                 lxc.mount.auto = sys:mixed\n\
                 lxc.idmap = u 0 100000 65536\n\
                 lxc.idmap = g 0 100000 65536\n\
                 lxc.rootfs.path = dir:{}\n\
                 lxc.uts.name = ct{vmid}\n\
                 lxc.init.cmd = /ct-init\n",
                rootfs.display()
            ),
        )
        .map_err(|e| e.to_string())?;
        let pct = lxc.join("pct");
        std::fs::write(
            &pct,
            format!(
                "#!/bin/sh\n\
                 [ \"$1\" = exec ] || exit 2\n\
                 vmid=$2; shift 2\n\
                 while [ $# -gt 0 ]; do case $1 in --) shift; break ;; --keep-env) shift 2 ;; *) break ;; esac; done\n\
                 awk -v want=\"@{lxc}/$vmid/command\" '$NF == want {{f=1}} END {{exit !f}}' /proc/net/unix || {{ echo \"container '$vmid' not running!\" >&2; exit 255; }}\n\
                 exec lxc-attach -P '{lxc}' -n \"$vmid\" --clear-env -- \"$@\"\n",
                lxc = lxc.display()
            ),
        )
        .map_err(|e| e.to_string())?;
        run(Command::new("chmod").arg("0755").arg(&pct))?;
        let real = RealCt {
            vmid,
            dir,
            monitor: std::sync::Mutex::new(None),
        };
        real.try_start()?;
        Ok(real)
    }

    fn try_start(&self) -> Result<(), String> {
        let lxc = self.dir.path();
        let child = Command::new("lxc-start")
            .arg("-P")
            .arg(lxc)
            .args(["-F", "-n", &self.vmid.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| format!("lxc-start: {e}"))?;
        *self.monitor.lock().unwrap_or_else(|e| e.into_inner()) = Some(child);
        let out = Command::new("lxc-wait")
            .arg("-P")
            .arg(lxc)
            .args(["-n", &self.vmid.to_string(), "-s", "RUNNING", "-t", "20"])
            .output()
            .map_err(|e| format!("lxc-wait: {e}"))?;
        if !out.status.success() {
            self.stop();
            return Err(format!(
                "the container did not reach RUNNING: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(())
    }
}

impl Container for RealCt {
    fn vmid(&self) -> u32 {
        self.vmid
    }
    fn start(&self) {
        self.try_start().expect("the real container starts");
    }
    fn stop(&self) {
        let _ = Command::new("lxc-stop")
            .arg("-P")
            .arg(self.dir.path())
            .args(["-n", &self.vmid.to_string(), "--kill"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if let Some(mut child) = self
            .monitor
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
    fn lxc(&self) -> LxcExec {
        LxcExec::new(
            self.vmid,
            PctConfig {
                program: self.dir.path().join("pct"),
                kill_grace: Duration::from_millis(500),
                drain_grace: Duration::from_millis(500),
                lxc_path: self.dir.path().to_path_buf(),
                ..PctConfig::default()
            },
        )
    }
    fn lxc_path(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
    fn guest_path(&self, guest_path: &str) -> PathBuf {
        self.dir
            .path()
            .join(self.vmid.to_string())
            .join("rootfs")
            .join(guest_path.trim_start_matches('/'))
    }
}

impl Drop for RealCt {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The same race against real LXC containers ([`REAL_AT_ONCE`] of them, the tries spread over
/// them). A machine without LXC says why on stderr and runs nothing here, unless
/// `FELHOM_REQUIRE_REAL_GUESTS=1` (then it fails).
#[test]
fn a_real_lxc_container_stopped_around_an_exec_never_lets_the_command_run_outside_it() {
    let cts: Result<Vec<RealCt>, String> = (0..REAL_AT_ONCE as u32)
        .map(|n| RealCt::new(VMID + n))
        .collect();
    let cts = match cts {
        Ok(cts) => cts,
        Err(why) => {
            assert!(
                std::env::var("FELHOM_REQUIRE_REAL_GUESTS").as_deref() != Ok("1"),
                "real LXC is required (FELHOM_REQUIRE_REAL_GUESTS=1) and unusable: {why}"
            );
            eprintln!(
                "no real LXC container on this machine ({why}): the race ran on the test bed only"
            );
            return;
        }
    };
    let racers: Vec<&dyn Container> = cts.iter().map(|ct| ct as &dyn Container).collect();
    let (tally, ran_outside) = race(&racers);
    drop(cts);
    assert_never_outside("real LXC", &tally, &ran_outside);
}
