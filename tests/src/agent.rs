//! Running the `felhom-agent` binary under test.
//!
//! The binary is `$FELHOM_AGENT_BIN` (tests/run.sh builds it and sets it) or
//! `<target dir>/debug/felhom-agent`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// The agent binary.
pub fn agent_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("FELHOM_AGENT_BIN") {
        return PathBuf::from(p);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::fakepve::workspace_root().join("target"));
    let p = target.join("debug").join("felhom-agent");
    assert!(
        p.exists(),
        "{} is missing: build it first (`cargo build -p felhom-agent`; tests/run.sh does)",
        p.display()
    );
    p
}

/// What one run of the agent produced.
#[derive(Debug)]
pub struct AgentRun {
    /// Exit code (`None`: killed by a signal).
    pub code: Option<i32>,
    /// stdout.
    pub stdout: String,
    /// stderr.
    pub stderr: String,
}

impl AgentRun {
    /// stdout parsed as the one JSON document of `--json`.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not one JSON document ({e}):\n{}\nstderr:\n{}",
                self.stdout, self.stderr
            )
        })
    }

    /// The one copy of a `--selftest=restore --json` run (`copies[0]`: its transaction's
    /// document, with `guest`, `backup` and `preflight`); panics unless the run made exactly
    /// one copy.
    pub fn restore_copy(&self) -> Value {
        let doc = self.json();
        match doc["copies"].as_array().map(Vec::as_slice) {
            Some([one]) => one.clone(),
            _ => panic!(
                "not one copy in the restore run:\n{doc:#}\nstderr:\n{}",
                self.stderr
            ),
        }
    }
}

impl From<Output> for AgentRun {
    fn from(o: Output) -> Self {
        AgentRun {
            code: o.status.code(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

/// The test hook naming the folder the agent reads the kernel's network files under
/// (`agent/src/lab_kernel.rs`).
pub const KERNEL_ROOT_ENV: &str = "FELHOM_AGENT_KERNEL_ROOT";

/// The lab bridges of the bed's kernel tree ([`bed_kernel_root`]): those the bed's scenarios
/// name as `[restore_test] lab_bridge`.
pub const BED_LAB_BRIDGES: &[&str] = &["vmbr9", "vmbr10"];

/// A kernel tree for the bed, where the fake PVE's lab bridges are not in this machine's
/// kernel (its VMs' NICs on them are QEMU hubs): each of [`BED_LAB_BRIDGES`] a bridge with no
/// port and no device on top, IPv6 off, the strict reverse-path filter and no forwarding, as
/// the README's stanza sets them; no IPv6 address. Their IPv4 addresses are read from this
/// machine's kernel, which has no such bridge. Made once under the target folder (into a
/// folder of its own, then renamed into place: test processes make it at once).
pub fn bed_kernel_root() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::fakepve::workspace_root().join("target"));
    let root = target.join("felhom-bed-kernel-v2");
    if root.join("ready").exists() {
        return root;
    }
    std::fs::create_dir_all(&target).expect("target folder");
    let tmp = tempfile::Builder::new()
        .prefix(".felhom-bed-kernel-")
        .tempdir_in(&target)
        .expect("a folder for the bed's kernel tree");
    let w = |rel: &str, v: &str| {
        let p = tmp.path().join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, v).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    };
    w("proc/net/if_inet6", "");
    w("proc/sys/net/ipv4/conf/all/rp_filter", "0\n");
    for b in BED_LAB_BRIDGES {
        for d in ["brif", "bridge"] {
            std::fs::create_dir_all(tmp.path().join(format!("sys/class/net/{b}/{d}")))
                .expect("mkdir");
        }
        w(&format!("proc/sys/net/ipv6/conf/{b}/disable_ipv6"), "1\n");
        w(&format!("proc/sys/net/ipv4/conf/{b}/rp_filter"), "1\n");
        w(&format!("proc/sys/net/ipv4/conf/{b}/forwarding"), "0\n");
    }
    w("ready", "");
    let tmp = tmp.keep();
    if std::fs::rename(&tmp, &root).is_err() {
        // Another test process put its (identical) tree in place first.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    assert!(
        root.join("ready").exists(),
        "{} was not made",
        root.display()
    );
    root
}

/// A command for the agent with `--config config` and a clean environment; the kernel's
/// network files are the bed's ([`bed_kernel_root`]).
pub fn agent_command(config: &Path) -> Command {
    let mut cmd = Command::new(agent_bin());
    cmd.env_remove("FELHOM_AGENT_CONFIG")
        .env_remove("FELHOM_AGENT_LOG")
        .env(KERNEL_ROOT_ENV, bed_kernel_root())
        .arg("--config")
        .arg(config);
    cmd
}

/// Run the agent with `--config config` and `args`.
pub fn run_agent(config: &Path, args: &[&str]) -> AgentRun {
    let out = agent_command(config)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", agent_bin().display()));
    out.into()
}

/// How long the exec helper may take from spawn until its socket accepts connections (well under
/// a second on a quiet machine; a loaded one can take many: a helper that never listens still
/// fails here).
pub const HELPER_READY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// `felhom-agent exec-helper` as a child process for one test: the root helper that runs
/// `pct exec` for the agent, listening on its own socket. Its stderr goes to a log
/// file beside the socket; it is killed (SIGKILL) when the value is dropped.
pub struct ExecHelper {
    child: std::process::Child,
    socket: PathBuf,
    log_path: PathBuf,
}

impl std::fmt::Debug for ExecHelper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecHelper")
            .field("pid", &self.child.id())
            .field("socket", &self.socket)
            .finish_non_exhaustive()
    }
}

/// A `PATH` for an exec helper that only needs `pct` to resolve (`doctor` asks where it does;
/// nothing runs it): `<dir>/bin`, holding a `pct` stand-in that exits 0, before this
/// process's `PATH`.
pub fn stand_in_pct_path(dir: &Path) -> String {
    use std::os::unix::fs::PermissionsExt;
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).expect("bin");
    let pct = bin.join("pct");
    std::fs::write(&pct, "#!/bin/sh\nexit 0\n").expect("pct stand-in");
    std::fs::set_permissions(&pct, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

impl ExecHelper {
    /// Start `$FELHOM_AGENT_BIN exec-helper --config <config> --socket <socket>` with `PATH`
    /// set to `path` (where it finds `pct`), and wait until the socket accepts a connection.
    /// Panics with the helper's log when it exits or does not listen within
    /// [`HELPER_READY_TIMEOUT`].
    pub fn start(config: &Path, socket: &Path, path: &str) -> ExecHelper {
        Self::start_env(config, socket, path, &[])
    }

    /// [`ExecHelper::start`] with extra environment variables (e.g. `FELHOM_AGENT_LOG`).
    pub fn start_env(config: &Path, socket: &Path, path: &str, env: &[(&str, &str)]) -> ExecHelper {
        let log_path = socket.with_extension("log");
        let log = std::fs::File::create(&log_path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", log_path.display()));
        let child = Command::new(agent_bin())
            .env_remove("FELHOM_AGENT_CONFIG")
            .env_remove("FELHOM_AGENT_LOG")
            .env_remove("LISTEN_FDS")
            .env_remove("LISTEN_PID")
            .env("PATH", path)
            .envs(env.iter().copied())
            .arg("exec-helper")
            .arg("--config")
            .arg(config)
            .arg("--socket")
            .arg(socket)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {} exec-helper: {e}", agent_bin().display()));
        let mut helper = ExecHelper {
            child,
            socket: socket.to_path_buf(),
            log_path,
        };
        let deadline = std::time::Instant::now() + HELPER_READY_TIMEOUT;
        loop {
            if std::os::unix::net::UnixStream::connect(socket).is_ok() {
                return helper;
            }
            if let Ok(Some(status)) = helper.child.try_wait() {
                panic!(
                    "the exec helper exited ({status}) before its socket {} accepted a connection; its log:\n{}",
                    socket.display(),
                    helper.log()
                );
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the exec helper's socket {} did not accept a connection within {HELPER_READY_TIMEOUT:?}; its log:\n{}",
                socket.display(),
                helper.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// The helper's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// What it wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Whether the process still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL it and wait; returns its log.
    pub fn kill(mut self) -> String {
        self.stop();
        self.log()
    }

    fn stop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Drop for ExecHelper {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!(
                "--- felhom-agent exec-helper log ---\n{}--- end of log ---",
                self.log()
            );
        }
    }
}
