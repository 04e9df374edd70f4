//! A Debian machine with a real systemd as PID 1, booted with `systemd-nspawn`, for the tests
//! that run the package's units as a node runs them (tests/tests/package_systemd.rs).
//!
//! The root is built once by `tests/testbed/build-systemd-root.sh` (Debian bookworm with
//! systemd 252, PVE 8's) and never changed: each machine boots an overlay of it (upper layer in
//! a temporary folder), mounted in a private mount namespace that exists only as long as the
//! machine (`unshare -m` + `systemd-nspawn -D <overlay> --register=no --keep-unit --boot
//! --console=pipe`). Without `--private-network` the machine shares the host's network
//! namespace, so the daemon inside reaches the fake PVE and the dev hub on their 127.x
//! addresses. Commands run inside with `nsenter -t <its systemd's pid> -a`; files are read and
//! written through `/proc/<that pid>/root`.
//!
//! Cleanup: killing `systemd-nspawn` does not stop the machine (its PID 1 outlives it), so the
//! machine is ended by SIGKILL to its PID 1, which ends every process of its PID namespace; the
//! overlay mount goes with nspawn's mount namespace. [`Machine`]'s `Drop` does that (passed,
//! failed or panicked), and a watcher process in its own session does it too when the test
//! process dies without unwinding (the watcher reads a pipe only the test holds open).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::fakepve::{state_base, workspace_root};

/// Set to 1 (tests/run.sh does): a machine where the real systemd cannot boot fails the tests
/// that need it instead of skipping them with a one-line reason.
pub const REQUIRE_ENV: &str = "FELHOM_REQUIRE_REAL_SYSTEMD";
/// How long a boot may take until `systemctl is-system-running` answers running or degraded.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(90);

/// Why the real systemd cannot run here, or the root to boot: builds the cached root
/// (tests/testbed/build-systemd-root.sh) when it is missing.
pub fn systemd_root() -> Result<PathBuf, String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("not root (systemd-nspawn needs root)".to_string());
    }
    // mmdebstrap: checked by the build script, needed only when the root is not cached.
    for tool in ["systemd-nspawn", "nsenter", "unshare", "setsid"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            return Err(format!(
                "{tool} is missing (tests/setup.sh installs systemd-container and util-linux)"
            ));
        }
    }
    let script = workspace_root().join("tests/testbed/build-systemd-root.sh");
    let out = Command::new(&script)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("").to_string();
        return Err(format!(
            "{} failed ({}): {last}",
            script.display(),
            out.status
        ));
    }
    let root = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !root.join("usr/lib/systemd/systemd").exists() {
        return Err(format!("{} holds no systemd", root.display()));
    }
    Ok(root)
}

/// What a test does when the real systemd cannot run: with [`REQUIRE_ENV`]=1 it fails with
/// `reason`; otherwise it reports the reason in one line (never a silent pass).
pub fn unavailable(test: &str, reason: &str) {
    let line = format!("real systemd: {test} NOT RUN: {reason}");
    if std::env::var(REQUIRE_ENV).as_deref() == Ok("1") {
        panic!("{line} ({REQUIRE_ENV}=1)");
    }
    crate::report(&line);
}

/// One booted machine; see the module docs.
pub struct Machine {
    nspawn: Child,
    init: u32,
    watcher: Option<Child>,
    log_path: PathBuf,
    dir: Option<tempfile::TempDir>,
}

impl std::fmt::Debug for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Machine")
            .field("nspawn", &self.nspawn.id())
            .field("init", &self.init)
            .finish_non_exhaustive()
    }
}

/// The host pid of `pid`'s child whose command name is `comm`, if any.
fn child_named(pid: u32, comm: &str) -> Option<u32> {
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
    children
        .split_whitespace()
        .filter_map(|c| c.parse::<u32>().ok())
        .find(|c| {
            std::fs::read_to_string(format!("/proc/{c}/comm")).is_ok_and(|n| n.trim() == comm)
        })
}

impl Machine {
    /// Boot an overlay of `root`; `Err` says why it did not come up (and nothing is left).
    pub fn boot(root: &Path) -> Result<Machine, String> {
        let dir = tempfile::Builder::new()
            .prefix("nspawn-")
            .tempdir_in(state_base())
            .map_err(|e| format!("cannot make a temporary folder: {e}"))?;
        for d in ["upper", "work", "merged"] {
            std::fs::create_dir(dir.path().join(d)).map_err(|e| format!("mkdir {d}: {e}"))?;
        }
        let log_path = dir.path().join("nspawn.log");
        let log = std::fs::File::create(&log_path).map_err(|e| format!("log: {e}"))?;
        let log2 = log.try_clone().map_err(|e| format!("log: {e}"))?;
        let d = dir.path();
        // CAP_NET_ADMIN, which a node's root has and nspawn drops from a machine that shares
        // the host's network: the exec helper makes a group's lab (links in a namespace of the
        // lab's own, never the host's) and systemd brings up a PrivateNetwork= unit's loopback.
        let script = format!(
            "set -e; mount -t overlay overlay -o lowerdir={},upperdir={},workdir={} {}; \
             exec systemd-nspawn -q -D {} --register=no --keep-unit --boot --console=pipe \
             --capability=CAP_NET_ADMIN",
            root.display(),
            d.join("upper").display(),
            d.join("work").display(),
            d.join("merged").display(),
            d.join("merged").display()
        );
        let nspawn = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .env_remove("NOTIFY_SOCKET")
            .env_remove("LISTEN_FDS")
            .env_remove("LISTEN_PID")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| format!("cannot start unshare + systemd-nspawn: {e}"))?;
        let mut m = Machine {
            nspawn,
            init: 0,
            watcher: None,
            log_path,
            dir: Some(dir),
        };
        let deadline = Instant::now() + BOOT_TIMEOUT;
        // Its PID 1: nspawn's child named systemd.
        loop {
            if let Some(pid) = child_named(m.nspawn.id(), "systemd") {
                m.init = pid;
                break;
            }
            if let Ok(Some(status)) = m.nspawn.try_wait() {
                return Err(format!(
                    "systemd-nspawn exited ({status}) before systemd ran: {}",
                    m.log().lines().last().unwrap_or("")
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "no systemd under systemd-nspawn within {BOOT_TIMEOUT:?}"
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // The watcher: ends the machine if this process dies without running Drop.
        let watcher = Command::new("setsid")
            .args([
                "sh",
                "-c",
                "read _ignored; kill -KILL \"$1\" 2>/dev/null",
                "felhom-nspawn-watcher",
                &m.init.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start the machine's watcher: {e}"))?;
        m.watcher = Some(watcher);
        loop {
            let out = m.sh("systemctl is-system-running 2>/dev/null || true");
            let state = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if state == "running" || state == "degraded" {
                return Ok(m);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "systemd in the machine is {state:?} after {BOOT_TIMEOUT:?}, not running"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The machine's PID 1, as the host sees it.
    pub fn init_pid(&self) -> u32 {
        self.init
    }

    /// The `systemd-nspawn` process.
    pub fn nspawn_pid(&self) -> u32 {
        self.nspawn.id()
    }

    /// Where the overlay is mounted (in nspawn's private mount namespace only).
    pub fn overlay(&self) -> PathBuf {
        self.dir
            .as_ref()
            .map(|d| d.path().join("merged"))
            .unwrap_or_default()
    }

    /// What nspawn and the machine's console printed.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// `script` run by `/bin/sh` inside the machine (all its namespaces, a clean environment).
    pub fn sh(&self, script: &str) -> Output {
        self.sh_input(script, None)
    }

    /// [`Machine::sh`] with `input` on stdin.
    pub fn sh_input(&self, script: &str, input: Option<&[u8]>) -> Output {
        let mut child = Command::new("nsenter")
            .args(["-t", &self.init.to_string(), "-a", "--"])
            .args([
                "/usr/bin/env",
                "-i",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "LANG=C.UTF-8",
                "SYSTEMD_PAGER=",
                "/bin/sh",
                "-c",
                script,
            ])
            .stdin(if input.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run nsenter: {e}"));
        if let Some(bytes) = input {
            let mut stdin = child.stdin.take().expect("stdin");
            stdin.write_all(bytes).expect("write stdin");
        }
        child.wait_with_output().expect("nsenter")
    }

    /// [`Machine::sh`] that must exit 0: its stdout, trimmed.
    pub fn ok(&self, script: &str) -> String {
        let out = self.sh(script);
        assert!(
            out.status.success(),
            "in the machine: {script}\nexit {}\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// One property of a unit (`systemctl show -p NAME --value UNIT`).
    pub fn prop(&self, unit: &str, name: &str) -> String {
        self.ok(&format!("systemctl show -p {name} --value {unit}"))
    }

    /// A path inside the machine as the host reaches it.
    pub fn path(&self, inside: &str) -> PathBuf {
        PathBuf::from(format!(
            "/proc/{}/root/{}",
            self.init,
            inside.trim_start_matches('/')
        ))
    }

    /// Write `bytes` to `inside` (root's, `mode`).
    pub fn write(&self, inside: &str, bytes: &[u8], mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        let p = self.path(inside);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent)
                .unwrap_or_else(|e| panic!("mkdir {}: {e}", parent.display()));
        }
        std::fs::write(&p, bytes).unwrap_or_else(|e| panic!("write {inside}: {e}"));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode))
            .unwrap_or_else(|e| panic!("chmod {inside}: {e}"));
    }

    /// Wait until `cond` holds (checked every 50 ms) or panic after `timeout` with `what` and
    /// the last reading.
    pub fn wait_for<T: std::fmt::Debug>(
        &self,
        what: &str,
        timeout: Duration,
        mut read: impl FnMut(&Machine) -> T,
        cond: impl Fn(&T) -> bool,
    ) -> T {
        let deadline = Instant::now() + timeout;
        loop {
            let v = read(self);
            if cond(&v) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {timeout:?}; last: {v:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stop(&mut self) {
        // The watcher first (it would kill the pid after EOF, which must not outlive the
        // machine's PID 1 and be reused).
        if let Some(mut w) = self.watcher.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
        if self.init != 0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.init as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if !matches!(self.nspawn.try_wait(), Ok(None)) {
                break;
            }
            if Instant::now() >= deadline {
                let _ = self.nspawn.kill();
                let _ = self.nspawn.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.init = 0;
    }

    /// Stop the machine now and return whether anything of it is left: its PID 1, nspawn, the
    /// overlay mount (for the test that shows the cleanup).
    pub fn shut_down(mut self) -> Vec<String> {
        let (init, nspawn, merged) = (self.init, self.nspawn.id(), self.overlay());
        self.stop();
        leftovers(init, nspawn, &merged)
    }
}

/// What is left of a machine whose PID 1 was `init`, whose nspawn was `nspawn` and whose
/// overlay was mounted on `overlay`: processes still there (zombies waiting for their reaper
/// count as gone), a mount of the overlay in any mount namespace.
pub fn leftovers(init: u32, nspawn: u32, overlay: &Path) -> Vec<String> {
    let mut left = Vec::new();
    for pid in [init, nspawn] {
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            let state = stat.rsplit_once(") ").map(|(_, r)| r.chars().next());
            if state != Some(Some('Z')) {
                left.push(format!("process {pid}: {}", stat.trim()));
            }
        }
    }
    let needle = overlay.to_string_lossy().to_string();
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for p in procs.flatten() {
            let mounts = std::fs::read_to_string(p.path().join("mountinfo")).unwrap_or_default();
            if !needle.is_empty() && mounts.contains(&needle) {
                left.push(format!(
                    "a mount on {} (seen by {})",
                    overlay.display(),
                    p.path().display()
                ));
                break;
            }
        }
    }
    left
}

impl Drop for Machine {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let journal = if self.init != 0 {
                String::from_utf8_lossy(
                    &self
                        .sh("journalctl -b --no-pager -n 200 -o short-monotonic 2>&1 | tail -n 200")
                        .stdout,
                )
                .into_owned()
            } else {
                String::new()
            };
            eprintln!(
                "--- machine console ---\n{}--- machine journal (last 200 lines) ---\n{journal}--- end ---",
                self.log()
            );
        }
        self.stop();
        // The overlay's upper layer; the mount went with nspawn's mount namespace.
        if let Some(d) = self.dir.take() {
            let _ = d.close();
        }
    }
}
