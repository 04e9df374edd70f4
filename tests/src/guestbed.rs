//! The guest test bed: containers that are real root filesystems driven by the `pct` stand-in
//! (`tests/pct/pct`), so guest commands really run (busybox under unshare + chroot).
//!
//! - [`template_rootfs`] builds `<repo>/.testbed/rootfs` once (`tests/testbed/build-rootfs.sh`,
//!   under a lock; needs root and Debian's busybox-static, which `tests/run.sh` installs).
//! - [`GuestBed`] is one test's private `pct` world: a state folder (`FELHOM_PCT_STATE`), and a
//!   `pct` wrapper in `bin/` that points the stand-in at it. The wrapper is needed because the
//!   agent runs `pct` with a cleared environment.
//! - [`processes_with_marker`] lists live processes whose command line holds a marker, to prove
//!   nothing was left behind.
//! - [`GuestBed::new_real`] (and `World::real`) asks for real guests: the containers the fake
//!   restores are unprivileged LXC containers running Debian with systemd ([`real_lxc`] builds
//!   their root filesystem and probes LXC once), `pct exec` is `lxc-attach`; where LXC does not
//!   run, a one-line reason and the busybox bed ([`require_real_guests`] turns that into a
//!   failure). Dropping a real bed removes its containers, links and cgroups ([`teardown_real`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use felhom_agent::guest::{LxcExec, PctConfig};

/// The repository root (the folder holding `tests/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

/// A file of the tests' own data (`tests/data/<name>`; `tests/data/README.md` names each
/// file's source and version).
pub fn test_data(name: &str) -> PathBuf {
    repo_root().join("tests").join("data").join(name)
}

/// The `pct` stand-in.
pub fn pct_stand_in() -> PathBuf {
    repo_root().join("tests/pct/pct")
}

/// The template root filesystem, built on first use (once per test process; the build script
/// itself locks against other processes and is a no-op when the template is up to date).
///
/// Panics with the build's output when it cannot be built: the guest tests cannot run without
/// it, and `tests/run.sh` installs what it needs.
pub fn template_rootfs() -> &'static Path {
    static TEMPLATE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = TEMPLATE.get_or_init(|| {
        let target = repo_root().join(".testbed/rootfs");
        let out = Command::new("bash")
            .arg(repo_root().join("tests/testbed/build-rootfs.sh"))
            .arg(&target)
            .output()
            .map_err(|e| format!("could not run build-rootfs.sh: {e}"))?;
        if out.status.success() {
            Ok(target)
        } else {
            Err(format!(
                "tests/testbed/build-rootfs.sh failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    });
    match built {
        Ok(p) => p,
        Err(e) => panic!("{e}\n(run tests/run.sh once to install busybox-static)"),
    }
}

/// Ways to make the stand-in misbehave for one container (see `tests/pct/pct`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PctFault {
    /// `pct exec` exits 0 and runs nothing.
    ExecNoop,
    /// The command gets its stdin without the last byte.
    StdinTruncate,
    /// The command escapes pct's process group and PID namespace.
    ExecEscape,
    /// The root filesystem is mounted read-only.
    RootfsReadOnly,
    /// `pct exec` enters the node's own namespaces instead of the container init's (what a
    /// process answering on the container's command socket makes `lxc-attach` do).
    AttachHost,
}

impl PctFault {
    fn word(self) -> &'static str {
        match self {
            Self::ExecNoop => "exec-noop",
            Self::StdinTruncate => "stdin-truncate",
            Self::ExecEscape => "exec-escape",
            Self::RootfsReadOnly => "rootfs-ro",
            Self::AttachHost => "attach-host",
        }
    }
}

/// One start of `pct` through a bed's wrapper.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PctCall {
    /// The process that started it.
    pub parent_pid: u32,
    /// `exec`, `push`, `status`, …
    pub sub: String,
    /// The first argument after the subcommand (the vmid).
    pub vmid: String,
    /// The command line of the process that started it, arguments joined with spaces.
    pub parent_cmdline: String,
}

/// The stand-in of root's LXC monitor (`tests/pct/lxc-monitor`).
pub fn lxc_monitor_stand_in() -> PathBuf {
    repo_root().join("tests/pct/lxc-monitor")
}

/// One stand-in of root's LXC monitor of a running container: killed when dropped (and it ends
/// by itself when its stdin, held here, closes).
#[derive(Debug)]
struct MonitorProc {
    child: std::process::Child,
}

impl Drop for MonitorProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start `tests/pct/lxc-monitor <lxc_path> <vmid> [<rootfs>]` (as `uid`, when given: a
/// squatter), and wait until it listens (and, given `rootfs`, the container's init runs). `None`
/// when the name is taken already.
fn spawn_monitor(
    lxc_path: &Path,
    vmid: u32,
    uid: Option<u32>,
    script: &Path,
    rootfs: Option<&Path>,
) -> Option<std::process::Child> {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new("perl");
    cmd.arg(script)
        .arg(lxc_path)
        .arg(vmid.to_string())
        .args(rootfs)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit());
    if let Some(uid) = uid {
        cmd.uid(uid).gid(uid);
    }
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start the LXC monitor stand-in: {e}"));
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = std::io::BufReader::new(out).read_line(&mut line);
    }
    match line.trim() {
        "ready" => Some(child),
        "busy" => {
            let _ = child.wait();
            None
        }
        other => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the LXC monitor stand-in for {vmid} did not start: {other:?}")
        }
    }
}

/// A listener of container `vmid`'s command socket under `lxc_path` run as `uid`, which is not
/// root's LXC monitor (same name, same command line): killed when dropped.
#[derive(Debug)]
pub struct Squatter {
    _proc: MonitorProc,
    /// The stand-in's copy `uid` can read (the checkout may sit below a folder only root may
    /// enter, as a `mktemp -d` clone does).
    _script: crate::reach::ReachableCopy,
}

impl Squatter {
    /// Bind `@<lxc_path>/<vmid>/command` as `uid` (panics when the name is taken).
    pub fn bind(lxc_path: &Path, vmid: u32, uid: u32) -> Squatter {
        let script = crate::reach::ReachableCopy::new(&lxc_monitor_stand_in());
        let child = spawn_monitor(lxc_path, vmid, Some(uid), script.path(), None)
            .unwrap_or_else(|| panic!("the command socket of {vmid} is held already"));
        Squatter {
            _proc: MonitorProc { child },
            _script: script,
        }
    }
}

/// One test's containers.
#[derive(Debug)]
pub struct GuestBed {
    dir: tempfile::TempDir,
    /// Set when the fake PVE makes this bed's containers real LXC containers.
    real: Option<RealLxc>,
    /// Set when the fake PVE runs a real QEMU for this bed's VMs marked `real` (the image's
    /// folder, [`real_vm_image`]).
    real_vm: Option<PathBuf>,
    /// The LXC monitor stand-ins this bed started for its running containers (those the fake
    /// PVE makes have theirs from the fake).
    monitors: std::sync::Mutex<std::collections::HashMap<u32, MonitorProc>>,
}

impl GuestBed {
    /// A bed with no containers yet (builds the template if needed). Containers come from
    /// [`add_ct`](Self::add_ct), or from the fake PVE once joined to it
    /// ([`join_scenario`](Self::join_scenario)).
    pub fn new() -> Self {
        template_rootfs();
        let dir = crate::scratch_tempdir("felhom-guestbed-");
        std::fs::create_dir_all(dir.path().join("state"))
            .and_then(|()| std::fs::create_dir_all(dir.path().join("bin")))
            .and_then(|()| std::fs::create_dir_all(dir.path().join("scratch")))
            .unwrap_or_else(|e| panic!("cannot lay out the guest bed: {e}"));
        let wrapper = dir.path().join("bin/pct");
        // The wrapper records the environment pct was started with (pct-env.last), so tests can
        // prove what reached pct itself, and every call with the process that started it
        // (pct-calls.log: parent pid, subcommand, vmid, the parent's command line), so tests can
        // prove which process runs pct. It also notes pct's pid (pct-pids), so that the bed,
        // when dropped, kills whatever pct still runs (a test that killed the process that
        // drives a `pct exec` would otherwise leave its guest command running for good).
        let script = format!(
            "#!/bin/sh\nenv > '{}'\n\
             parent=$(tr '\\000\\t\\n' '   ' < /proc/$PPID/cmdline 2>/dev/null)\n\
             printf '%s\\t%s\\t%s\\t%s\\n' \"$PPID\" \"${{1:-}}\" \"${{2:-}}\" \"$parent\" >> '{}'\n\
             echo $$ >> '{}'\n\
             FELHOM_PCT_STATE='{}' FELHOM_PCT_LXCPATH='{}' exec '{}' \"$@\"\n",
            dir.path().join("pct-env.last").display(),
            dir.path().join("pct-calls.log").display(),
            dir.path().join("pct-pids").display(),
            dir.path().join("state").display(),
            dir.path().join("lxc").display(),
            pct_stand_in().display()
        );
        std::fs::write(&wrapper, script)
            .and_then(|()| set_mode(&wrapper, 0o755))
            .unwrap_or_else(|e| panic!("cannot write the pct wrapper: {e}"));
        // The state folder records the lxcpath for the `pct` stand-in (a real container's
        // `pct exec` asks LXC there); a real container's root filesystem sits below the bed
        // folder, which its root (uid 100000) must be able to traverse.
        std::fs::write(
            dir.path().join("state/lxc_path"),
            dir.path().join("lxc").display().to_string(),
        )
        .and_then(|()| set_mode(dir.path(), 0o711))
        .and_then(|()| set_mode(&dir.path().join("state"), 0o711))
        .unwrap_or_else(|e| panic!("cannot lay out the guest bed: {e}"));
        Self {
            dir,
            real: None,
            real_vm: None,
            monitors: std::sync::Mutex::default(),
        }
    }

    /// A bed whose VMs marked `"real": true` in their guest spec are, once the fake PVE restores
    /// and starts them, real QEMU VMs running Debian 12 with the real `qemu-guest-agent`
    /// ([`real_vm_image`]); other VMs and the containers stay the busybox bed's. `Err` with a
    /// one-line reason and the plain bed when QEMU or the image is missing here (printed; a
    /// panic instead when `FELHOM_REQUIRE_REAL_GUESTS=1`).
    pub fn new_real_vm() -> Result<Self, (String, Self)> {
        Self::new().with_real_vm("the modelled guest agent instead")
    }

    /// This bed with real QEMU VMs, or `Err` saying so and what stands `instead`.
    fn with_real_vm(mut self, instead: &str) -> Result<Self, (String, Self)> {
        match real_vm_image() {
            Ok(image) => {
                self.real_vm = Some(image.clone());
                Ok(self)
            }
            Err(reason) => Err(fall_back(
                format!("no real VM here ({reason}): {instead}"),
                reason,
                self,
            )),
        }
    }

    /// A bed of both: real LXC containers ([`GuestBed::new_real`]) and real QEMU VMs for the
    /// VMs marked `"real": true` ([`GuestBed::new_real_vm`]), for an application group of
    /// containers and VMs. `Err` as either.
    pub fn new_real_with_vm() -> Result<Self, (String, Self)> {
        Self::new_real()?.with_real_vm("no group of containers and VMs")
    }

    /// Whether this bed's VMs marked `real` run in a real QEMU.
    pub fn has_real_vm(&self) -> bool {
        self.real_vm.is_some()
    }

    /// The QGA commands the fake forwarded to real VM `vmid`'s guest agent so far, one JSON
    /// object each (`execute`, `arguments`, `answer` or `error`, `t`: Unix time, `secs`: how
    /// long the exchange took), and the QEMU starts (`event`: `qemu-start`).
    pub fn qga_log(&self, vmid: u32) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.state_dir().join(format!("{vmid}.qga.log")))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// What real VM `vmid`'s QEMU printed so far (its own errors), for a failing test to show.
    pub fn qemu_log(&self, vmid: u32) -> String {
        std::fs::read_to_string(self.state_dir().join(vmid.to_string()).join("qemu.log"))
            .unwrap_or_default()
    }

    /// Real VM `vmid`'s serial console so far (the kernel's and systemd's messages), for a
    /// failing test to show.
    pub fn serial_log(&self, vmid: u32) -> String {
        std::fs::read_to_string(self.state_dir().join(vmid.to_string()).join("serial.log"))
            .unwrap_or_default()
    }

    /// A bed whose containers, once the fake PVE restores them, are real LXC containers
    /// running a real Debian with systemd ([`real_lxc`]): `Ok` with the bed when LXC works on
    /// this machine, else `Err` with a one-line reason and the busybox bed to go on with
    /// (printed; a panic instead when `FELHOM_REQUIRE_REAL_GUESTS=1`).
    pub fn new_real() -> Result<Self, (String, Self)> {
        let mut bed = Self::new();
        match real_lxc() {
            Ok(tarballs) => {
                bed.real = Some(RealLxc {
                    tarballs: tarballs.clone(),
                    net_prefix: net_prefix(),
                });
                Ok(bed)
            }
            Err(reason) => Err(fall_back(
                format!("no real guests here ({reason}): the busybox bed instead"),
                reason,
                bed,
            )),
        }
    }

    /// Whether this bed's containers are real LXC containers.
    pub fn is_real(&self) -> bool {
        self.real.is_some()
    }

    /// The prefix of every bridge and veth this bed's fake makes (real beds only).
    pub fn net_prefix(&self) -> Option<&str> {
        self.real.as_ref().map(|r| r.net_prefix.as_str())
    }

    /// The lxcpath of this bed's containers: a running container's LXC monitor stand-in holds
    /// `@<lxc_path>/<vmid>/command` (the agent's `[exec] lxc_path`).
    pub fn lxc_path(&self) -> PathBuf {
        self.dir.path().join("lxc")
    }

    /// Stop the LXC monitor stand-in this bed started for `vmid` (its container still says
    /// running to `pct`): what a stopped container leaves behind for a squatter.
    pub fn stop_monitor(&self, vmid: u32) {
        let mut monitors = self.monitors.lock().unwrap_or_else(|e| e.into_inner());
        monitors.remove(&vmid);
    }

    /// The state folder (`FELHOM_PCT_STATE`).
    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// The environment the last `pct` of this bed was started with (`KEY=value` lines).
    pub fn last_pct_env(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pct-env.last")).unwrap_or_default()
    }

    /// Every `pct push` the bed's `pct` stand-in was asked for (it refuses them): one line each.
    pub fn push_requests(&self) -> Vec<String> {
        std::fs::read_to_string(self.state_dir().join("push-requests.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Assert that nothing asked this bed's `pct` for a `push`: files reach a guest through
    /// `pct exec` only.
    pub fn assert_no_push(&self) {
        let pushes = self.push_requests();
        let calls: Vec<PctCall> = self
            .pct_calls()
            .into_iter()
            .filter(|c| c.sub == "push")
            .collect();
        assert!(
            pushes.is_empty() && calls.is_empty(),
            "`pct push` was asked for: {pushes:#?} {calls:#?}"
        );
    }

    /// Every `pct` this bed's wrapper started so far, in order, with the process that started it.
    pub fn pct_calls(&self) -> Vec<PctCall> {
        std::fs::read_to_string(self.dir.path().join("pct-calls.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                let mut f = line.splitn(4, '\t');
                Some(PctCall {
                    parent_pid: f.next()?.parse().ok()?,
                    sub: f.next()?.to_string(),
                    vmid: f.next()?.to_string(),
                    parent_cmdline: f.next().unwrap_or("").trim_end().to_string(),
                })
            })
            .collect()
    }

    /// A folder holding `pct` (the wrapper), to put on an agent's `PATH`.
    pub fn bin_dir(&self) -> PathBuf {
        self.dir.path().join("bin")
    }

    /// The `pct` wrapper.
    pub fn pct(&self) -> PathBuf {
        self.bin_dir().join("pct")
    }

    /// Create a running container `vmid` from the template; returns its root filesystem.
    pub fn add_ct(&self, vmid: u32) -> PathBuf {
        let ct = self.state_dir().join(vmid.to_string());
        std::fs::create_dir_all(&ct).unwrap_or_else(|e| panic!("cannot create {ct:?}: {e}"));
        let status = Command::new("cp")
            .arg("-a")
            .arg(template_rootfs())
            .arg(ct.join("rootfs"))
            .status()
            .unwrap_or_else(|e| panic!("cannot run cp: {e}"));
        assert!(status.success(), "copying the template rootfs failed");
        self.set_running(vmid, true);
        ct.join("rootfs")
    }

    /// A container's root filesystem.
    pub fn rootfs(&self, vmid: u32) -> PathBuf {
        self.state_dir().join(vmid.to_string()).join("rootfs")
    }

    /// A path inside a container's root filesystem (`guest_path` is absolute in the guest).
    pub fn guest_path(&self, vmid: u32, guest_path: &str) -> PathBuf {
        self.rootfs(vmid).join(guest_path.trim_start_matches('/'))
    }

    /// Start or stop a container (what `pct status` reports, and its LXC monitor stand-in).
    pub fn set_running(&self, vmid: u32, running: bool) {
        let path = self.state_dir().join(vmid.to_string()).join("status");
        std::fs::write(&path, if running { "running\n" } else { "stopped\n" })
            .unwrap_or_else(|e| panic!("cannot write {path:?}: {e}"));
        let mut monitors = self.monitors.lock().unwrap_or_else(|e| e.into_inner());
        if !running {
            monitors.remove(&vmid);
        } else if let std::collections::hash_map::Entry::Vacant(slot) = monitors.entry(vmid) {
            if let Some(child) = spawn_monitor(
                &self.lxc_path(),
                vmid,
                None,
                &lxc_monitor_stand_in(),
                Some(&self.rootfs(vmid)),
            ) {
                slot.insert(MonitorProc { child });
            }
        }
    }

    /// Make the stand-in misbehave for a container.
    pub fn add_fault(&self, vmid: u32, fault: PctFault) {
        use std::io::Write;
        let path = self.state_dir().join(vmid.to_string()).join("faults");
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{}", fault.word()))
            .unwrap_or_else(|e| panic!("cannot write {path:?}: {e}"));
    }

    /// A `pct` configuration for this bed: the wrapper, short grace periods, a private scratch
    /// folder.
    pub fn pct_config(&self) -> PctConfig {
        PctConfig {
            program: self.pct(),
            kill_grace: Duration::from_millis(500),
            drain_grace: Duration::from_millis(500),
            sweep_timeout: Duration::from_secs(10),
            push_timeout: Duration::from_secs(30),
            scratch_dir: self.dir.path().join("scratch"),
            lxc_path: self.lxc_path(),
        }
    }

    /// Exec into container `vmid` through this bed's `pct`.
    pub fn lxc(&self, vmid: u32) -> LxcExec {
        LxcExec::new(vmid, self.pct_config())
    }

    /// Join this bed to a fakepve scenario: the fake makes the guests' root filesystems in this
    /// bed's state folder as it restores them (`guest_bed`), keeps each container's `status`
    /// there in step with its own state (so `pct` refuses what PVE says is absent or stopped),
    /// and runs a VM's guest-agent commands inside its root filesystem. Every backup volume
    /// without a `guest` key restores a guest of the bed (a VM's guest agent runs).
    pub fn join_scenario(&self, scenario: &mut serde_json::Value) {
        scenario["guest_bed"] = serde_json::json!({
            "state": self.state_dir().display().to_string(),
            "template": template_rootfs().display().to_string(),
            "lxc_path": self.lxc_path().display().to_string(),
            "monitor": lxc_monitor_stand_in().display().to_string(),
        });
        if let Some(real) = &self.real {
            let releases: serde_json::Map<String, serde_json::Value> = real
                .tarballs
                .iter()
                .map(|(name, path)| (name.to_string(), path.display().to_string().into()))
                .collect();
            scenario["guest_bed"]["real_lxc"] = serde_json::json!({
                "tarball": real.tarballs[0].1.display().to_string(),
                "releases": releases,
                "osqueryi": repo_root().join("tests/testbed/osqueryi").display().to_string(),
                "net_prefix": real.net_prefix,
            });
        }
        if let Some(image) = &self.real_vm {
            scenario["guest_bed"]["real_qemu"] = serde_json::json!({
                "image": image.display().to_string(),
                "osqueryi": repo_root().join("tests/testbed/osqueryi").display().to_string(),
            });
        }
        if let Some(stores) = scenario
            .get_mut("volumes")
            .and_then(serde_json::Value::as_object_mut)
        {
            for vols in stores.values_mut() {
                for vol in vols.as_array_mut().into_iter().flatten() {
                    if vol.get("guest").is_none()
                        && vol.get("content").is_none_or(|c| c == "backup")
                    {
                        vol["guest"] = serde_json::json!({});
                    }
                }
            }
        }
    }

    /// The scratch folder where pushed bytes are staged.
    pub fn scratch_dir(&self) -> PathBuf {
        self.dir.path().join("scratch")
    }
}

/// No test may ever see a `pct push`: a bed dropped at the end of a passing test checks that
/// its `pct` was never asked for one.
impl Drop for GuestBed {
    fn drop(&mut self) {
        self.kill_running_pct();
        if let Some(real) = &self.real {
            teardown_real(&self.lxc_path(), &real.net_prefix);
        }
        if self.real_vm.is_some() {
            // The fake stops its QEMUs when it ends (and the kernel kills them when it dies);
            // whatever still names this bed's folder is killed here.
            let marker = self.state_dir().display().to_string();
            if !wait_processes_gone(&marker, Duration::from_secs(5)).is_empty() {
                kill_processes_with_marker(&marker);
            }
        }
        if !std::thread::panicking() {
            self.assert_no_push();
        }
    }
}

impl GuestBed {
    /// SIGKILL every `pct` this bed's wrapper started that still runs (recognised by its
    /// environment, which names this bed's state folder, so a reused pid is left alone), with
    /// every process below it: the namespaces and the guest command it runs end with it.
    fn kill_running_pct(&self) {
        let Ok(pids) = std::fs::read_to_string(self.dir.path().join("pct-pids")) else {
            return;
        };
        let mark = format!("FELHOM_PCT_STATE={}", self.state_dir().display());
        for pid in pids.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            let ours = std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|var| var == mark.as_bytes()));
            if ours {
                // pct and everything below it, the deepest first (pct may share its process
                // group with the test, so the group is not killed).
                let mut tree = vec![pid.unsigned_abs()];
                let mut i = 0;
                while i < tree.len() {
                    tree.extend(children_of(tree[i]).into_iter().map(|(child, _)| child));
                    i += 1;
                }
                for p in tree.into_iter().rev() {
                    let p = nix::unistd::Pid::from_raw(p as i32);
                    let _ = nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGKILL);
                }
            }
        }
    }
}

impl Default for GuestBed {
    fn default() -> Self {
        Self::new()
    }
}

fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// Live processes (pid, command line) whose command line contains `marker`, zombies excluded.
pub fn processes_with_marker(marker: &str) -> Vec<(u32, String)> {
    let me = std::process::id();
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if !cmdline.contains(marker) {
            continue;
        }
        let state = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = state
            .rsplit_once(')')
            .map(|(_, rest)| rest.trim_start().starts_with('Z'))
            .unwrap_or(false);
        if !zombie {
            found.push((pid, cmdline));
        }
    }
    found
}

/// Wait up to `timeout` for every process with `marker` to be gone; returns the ones left.
pub fn wait_processes_gone(marker: &str, timeout: Duration) -> Vec<(u32, String)> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = processes_with_marker(marker);
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A marker unique to this call, for command lines.
pub fn unique_marker(label: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!(
        "felhom-{label}-{}-{}-{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
    )
}

/// Kill (SIGKILL) every process whose command line holds `marker`; returns how many. For
/// cleaning up after a test that found leftovers, before it fails.
pub fn kill_processes_with_marker(marker: &str) -> usize {
    let left = processes_with_marker(marker);
    for (pid, _) in &left {
        if let Ok(pid) = i32::try_from(*pid) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    left.len()
}

/// The live children of process `pid` (pid, command line), zombies excluded.
pub fn children_of(pid: u32) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // `pid (comm) S ppid …`: comm may hold spaces and parentheses; the last ')' ends it.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next().unwrap_or("");
        let ppid: Option<u32> = fields.next().and_then(|p| p.parse().ok());
        if ppid != Some(pid) || state.starts_with('Z') {
            continue;
        }
        let cmdline = std::fs::read(entry.path().join("cmdline"))
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .unwrap_or_default();
        found.push((child, cmdline));
    }
    found
}

/// The command line of every process on this machine (`/proc/<pid>/cmdline`, NULs as spaces):
/// what any local user can read.
pub fn all_cmdlines() -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        if !entry
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        if let Ok(bytes) = std::fs::read(entry.path().join("cmdline")) {
            out.push(String::from_utf8_lossy(&bytes).replace('\0', " "));
        }
    }
    out
}

/// A real bed that this machine cannot give: `line` (why, and what is used instead) is reported,
/// or panics with it when `FELHOM_REQUIRE_REAL_GUESTS=1`; the reason and the plain bed.
fn fall_back(line: String, reason: &str, bed: GuestBed) -> (String, GuestBed) {
    if require_real_guests() {
        panic!("{line}, but FELHOM_REQUIRE_REAL_GUESTS=1");
    }
    crate::report(&line);
    (reason.to_string(), bed)
}

/// The Debian root filesystems the real bed's guests run (`tests/testbed/build-debian-rootfs.sh`
/// flavours): a backup volume's `guest.release` names one; bookworm (Debian 12, PVE 8's systemd
/// 252) when it names none. What differs between them is what breaks: systemd 247 (bullseye)
/// and 257 (trixie) fail other units in a user namespace than 252 does; `<release>-ifupdown2`
/// carries ifupdown2 in place of ifupdown, `<release>-nm` NetworkManager beside ifupdown.
pub const DEBIAN_RELEASES: [&str; 9] = [
    "bookworm",
    "bullseye",
    "trixie",
    "bullseye-ifupdown2",
    "bookworm-ifupdown2",
    "trixie-ifupdown2",
    "bullseye-nm",
    "bookworm-nm",
    "trixie-nm",
];

/// The shifted tarball of each release in [`DEBIAN_RELEASES`], the default first.
pub type Releases = Vec<(&'static str, PathBuf)>;

/// What a real bed needs: the Debian root filesystems and its link prefix.
#[derive(Debug)]
struct RealLxc {
    /// The shifted tarball of each release (`tests/testbed/build-debian-rootfs.sh`).
    tarballs: Releases,
    /// `fhb` + 4 characters: every bridge and veth of this bed starts with it.
    net_prefix: String,
}

/// Whether a missing real bed fails the test (`FELHOM_REQUIRE_REAL_GUESTS=1`, set by
/// `tests/run.sh`).
pub fn require_real_guests() -> bool {
    std::env::var("FELHOM_REQUIRE_REAL_GUESTS").is_ok_and(|v| v == "1")
}

/// A link prefix no other bed of this machine uses now: `fhb` and four base-36 characters of
/// the pid, a counter and the time.
fn net_prefix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let mut x = (u128::from(std::process::id()) << 20)
        ^ (u128::from(N.fetch_add(1, Ordering::Relaxed)) << 40)
        ^ nanos;
    let digits = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = String::from("fhb");
    for _ in 0..4 {
        out.push(char::from(digits[(x % 36) as usize]));
        x /= 36;
    }
    out
}

/// The real bed's Debian root filesystems, built on first use, and whether LXC runs a
/// container here: `Ok(shifted tarball of each release)` or a one-line reason (once per test
/// process; a success is remembered for this boot in `target/testbed/`, so later test
/// processes skip the throwaway container).
pub fn real_lxc() -> &'static Result<Releases, String> {
    static REAL: OnceLock<Result<Releases, String>> = OnceLock::new();
    REAL.get_or_init(|| {
        for tool in [
            "lxc-start",
            "lxc-attach",
            "lxc-stop",
            "lxc-wait",
            "mmdebstrap",
        ] {
            if !in_path(tool) {
                return Err(format!(
                    "{tool} is not installed (tests/setup.sh installs it)"
                ));
            }
        }
        let out_dir = repo_root().join("target/testbed");
        let mut tarballs = Releases::new();
        for release in DEBIAN_RELEASES {
            let out = Command::new("bash")
                .arg(repo_root().join("tests/testbed/build-debian-rootfs.sh"))
                .arg(&out_dir)
                .arg(release)
                .output()
                .map_err(|e| format!("cannot run build-debian-rootfs.sh: {e}"))?;
            if !out.status.success() {
                let err = String::from_utf8_lossy(&out.stderr);
                let last = err
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("");
                return Err(format!(
                    "tests/testbed/build-debian-rootfs.sh {release} failed ({}): {last}",
                    out.status
                ));
            }
            let tarball = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            tarballs.push((release, tarball));
        }
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let stamp = out_dir.join(format!("lxc-works-{}", boot.trim()));
        if !stamp.exists() {
            probe_lxc()?;
            let _ = std::fs::write(&stamp, "a throwaway unprivileged container started\n");
        }
        Ok(tarballs)
    })
}

/// The real VMs' image (`tests/testbed/build-debian-vm.sh`: a folder holding `disk.raw`,
/// `vmlinux` and `initrd.img`), built on first use, once QEMU is known to be installed: `Ok`
/// with its folder or a one-line reason (once per test process).
pub fn real_vm_image() -> &'static Result<PathBuf, String> {
    static IMAGE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    IMAGE.get_or_init(|| {
        for tool in ["qemu-system-x86_64", "qemu-img", "mmdebstrap", "mkfs.ext4"] {
            if !in_path(tool) {
                return Err(format!(
                    "{tool} is not installed (tests/setup.sh installs it)"
                ));
            }
        }
        let out = Command::new("bash")
            .arg(repo_root().join("tests/testbed/build-debian-vm.sh"))
            .arg(repo_root().join("target/testbed"))
            .output()
            .map_err(|e| format!("cannot run build-debian-vm.sh: {e}"))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            return Err(format!(
                "tests/testbed/build-debian-vm.sh failed ({}): {last}",
                out.status
            ));
        }
        Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    })
}

fn in_path(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| {
        std::env::split_paths(&p).any(|d| {
            std::fs::metadata(d.join(tool)).is_ok_and(|m| {
                use std::os::unix::fs::PermissionsExt;
                m.is_file() && m.permissions().mode() & 0o111 != 0
            })
        })
    })
}

/// Start a throwaway unprivileged container (the busybox template, owners shifted by 100000,
/// the idmap and includes of a PVE container) and run a command in it; Err: why not.
fn probe_lxc() -> Result<(), String> {
    let dir = tempfile::Builder::new()
        .prefix("felhom-lxcprobe-")
        .tempdir()
        .map_err(|e| format!("cannot make a folder for the LXC probe: {e}"))?;
    set_mode(dir.path(), 0o711).map_err(|e| format!("chmod of the LXC probe folder: {e}"))?;
    let lxc = dir.path().join("lxc");
    let rootfs = dir.path().join("rootfs");
    let name = "probe";
    std::fs::create_dir_all(lxc.join(name)).map_err(|e| format!("LXC probe folder: {e}"))?;
    let copied = Command::new("cp")
        .arg("-a")
        .arg(template_rootfs())
        .arg(&rootfs)
        .status()
        .is_ok_and(|s| s.success())
        && Command::new("chown")
            .args(["-hR", "100000:100000"])
            .arg(&rootfs)
            .status()
            .is_ok_and(|s| s.success());
    if !copied {
        return Err("cannot copy the busybox template for the LXC probe".into());
    }
    let config = format!(
        "lxc.include = /usr/share/lxc/config/common.conf\n\
         lxc.include = /usr/share/lxc/config/userns.conf\n\
         lxc.idmap = u 0 100000 65536\nlxc.idmap = g 0 100000 65536\n\
         lxc.rootfs.path = {}\nlxc.init.cmd = /usr/bin/busybox sleep 60\n\
         lxc.console.path = none\nlxc.uts.name = probe\n",
        rootfs.display()
    );
    std::fs::write(lxc.join(name).join("config"), config)
        .map_err(|e| format!("LXC probe config: {e}"))?;
    let log = dir.path().join("start.log");
    let logf = std::fs::File::create(&log).map_err(|e| format!("LXC probe log: {e}"))?;
    let mut start = Command::new("lxc-start")
        .arg("-P")
        .arg(&lxc)
        .args(["-F", "-n", name])
        .stdin(std::process::Stdio::null())
        .stdout(logf.try_clone().map_err(|e| e.to_string())?)
        .stderr(logf)
        .spawn()
        .map_err(|e| format!("cannot run lxc-start: {e}"))?;
    let running = Command::new("lxc-wait")
        .arg("-P")
        .arg(&lxc)
        .args(["-n", name, "-s", "RUNNING", "-t", "15"])
        .status()
        .is_ok_and(|s| s.success());
    let ran = running
        && Command::new("lxc-attach")
            .arg("-P")
            .arg(&lxc)
            .args(["-n", name, "--clear-env", "--", "/usr/bin/busybox", "true"])
            .status()
            .is_ok_and(|s| s.success());
    let _ = Command::new("lxc-stop")
        .arg("-P")
        .arg(&lxc)
        .args(["-n", name, "--kill"])
        .status();
    let _ = start.kill();
    let _ = start.wait();
    if ran {
        return Ok(());
    }
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let last = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no output");
    Err(format!(
        "a throwaway unprivileged container {} (lxc-start said: {last})",
        if running {
            "started but lxc-attach failed"
        } else {
            "did not start"
        }
    ))
}

/// Stop every container of `lxc_path` through LXC, kill any process still naming it, and
/// remove every link whose name starts with `prefix`: what a real bed leaves nothing of.
pub fn teardown_real(lxc_path: &Path, prefix: &str) {
    if let Ok(entries) = std::fs::read_dir(lxc_path) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let _ = Command::new("lxc-stop")
                .arg("-P")
                .arg(lxc_path)
                .arg("-n")
                .arg(&name)
                .arg("--kill")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
    let marker = lxc_path.display().to_string();
    if !wait_processes_gone(&marker, Duration::from_secs(5)).is_empty() {
        kill_processes_with_marker(&marker);
        let _ = wait_processes_gone(&marker, Duration::from_secs(5));
    }
    // Whatever still runs in the bed's cgroups (a container whose monitor was killed), then
    // the cgroup folders themselves, deepest first.
    let dirs = cgroup_dirs(prefix);
    for _ in 0..50 {
        let mut any = false;
        for d in &dirs {
            for pid in std::fs::read_to_string(d.join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.trim().parse::<i32>().ok())
            {
                any = true;
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        if !any {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    for d in dirs.iter().rev() {
        let _ = std::fs::remove_dir(d);
    }
    for link in links_with_prefix(prefix) {
        let _ = Command::new("ip")
            .args(["link", "del", &link])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// The network links of this machine whose names start with `prefix`.
pub fn links_with_prefix(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// Every cgroup folder of a real bed (`felhom-bed/<prefix>` in each hierarchy, and below),
/// parents before children.
pub fn cgroup_dirs(prefix: &str) -> Vec<PathBuf> {
    let mut tops = vec![PathBuf::from("/sys/fs/cgroup/felhom-bed").join(prefix)];
    for entry in std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
    {
        tops.push(entry.path().join("felhom-bed").join(prefix));
    }
    let mut out = Vec::new();
    for top in tops {
        if !top.is_dir() {
            continue;
        }
        let mut stack = vec![top];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(entry.path());
                }
            }
            out.push(d);
        }
    }
    out.sort_by_key(|p| p.components().count());
    out
}
