//! LXC containers: commands through `pct exec <vmid> --keep-env 0 -- …`, run locally as root
//! (PVE has no API for it). Files travel through `pct exec` too, never `pct push`: their bytes
//! go on stdin to a shell inside the container that writes them as the guest's root, in the
//! guest's namespaces ([`super::exec::PUSH_SCRIPT`]), so no host path is opened for the guest
//! and the guest's links resolve inside the guest.
//!
//! `pct` runs with a cleared environment (only `PATH`), in its own process group, with stdin,
//! stdout and stderr as pipes (a TTY would make lxc-attach allocate a pty). The command inside
//! gets only the controlled environment of [`ExecRequest`]; the values of its variables travel
//! on stdin, never on a command line ([`super::exec::guest_command`]). Output is capped while it
//! is read. On timeout the whole process group gets SIGTERM, then SIGKILL after a grace period,
//! and a sweep inside the container kills whatever still carries the exec's tag (killing `pct`
//! is not guaranteed to stop the attached process). Every pushed file is read back and
//! verified.
//!
//! Before every `pct exec` root's LXC monitor of the container names its init, whose namespaces
//! are held open ([`super::lxc_monitor::container_init`]); `pct exec` runs [`FIRST_STAGE`],
//! which waits on stdin until the agent has proven, from the node's `/proc`, that it runs in
//! exactly those namespaces; only then do the command, its environment values and its stdin
//! follow (`tests/data/lxc-attach-facts.md`).

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::exec::{
    check_guest_path, check_read_back, guest_command, push_request, sha256_hex, sweep_request,
    Captured, ExecError, ExecIds, ExecOutcome, ExecRequest, GuestExec, GuestExit, GuestRef,
    PushReceipt, PushSource, PUSH_READ_BACK_FAILED,
};

/// The largest file a push reads from the node (a file named by [`PushSource::Path`]).
pub const MAX_PUSH_BYTES: u64 = 64 * 1024 * 1024;
use super::lxc_monitor::Monitor;
use crate::pve::GuestKind;

/// `PATH` given to the `pct` process (what PVE's CLI handler sets itself).
const PCT_PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

/// The first stage of every `pct exec`: `/bin/sh -c FIRST_STAGE felhom-attach <nonce> <command…>`.
/// It says it is ready on stdout, then waits for the go line on stdin and only then runs the
/// command (`exec`, the rest of stdin left to it); anything else on stdin, or its end, and it
/// exits 125 having run nothing. Between its ready line and the go line the agent proves, from
/// the node's `/proc`, that this process, the only one below its own `pct` carrying the nonce,
/// runs in the namespaces of the container's init as root's LXC monitor named it
/// ([`super::lxc_monitor::container_init`]): whatever answered `lxc-attach` on the command
/// socket, the command runs there or not at all.
pub(crate) const FIRST_STAGE: &str = "echo felhom-attach-ready || exit 125
IFS= read -r felhom_go || exit 125
[ \"$felhom_go\" = go ] || exit 125
shift
exec \"$@\"";

/// The first stage's `$0`.
const FIRST_STAGE_NAME: &str = "felhom-attach";
/// What the first stage prints once it runs.
const READY_LINE: &[u8] = b"felhom-attach-ready\n";
/// What lets it run the command.
const GO_LINE: &[u8] = b"go\n";
/// The most processes below one `pct` that are looked at.
const MAX_DESCENDANTS: usize = 4096;

/// How `pct` is run.
#[derive(Debug, Clone)]
pub struct PctConfig {
    /// The `pct` program: a path, or a name looked up on the agent's `PATH` (default `pct`).
    pub program: PathBuf,
    /// Time between SIGTERM and SIGKILL when a command times out.
    pub kill_grace: Duration,
    /// Time to wait for the output pipes to close after `pct` ended.
    pub drain_grace: Duration,
    /// Time allowed for the in-guest sweep after a timeout.
    pub sweep_timeout: Duration,
    /// Time allowed for writing one pushed file inside the container.
    pub push_timeout: Duration,
    /// Formerly where pushed bytes were staged for `pct push`; pushes now go through
    /// `pct exec` and stage nothing on the node.
    pub scratch_dir: PathBuf,
    /// LXC's lxcpath: before every `pct exec`, the container's command socket under it must be
    /// held by root's LXC monitor of that container ([`super::lxc_monitor`]).
    pub lxc_path: PathBuf,
}

impl Default for PctConfig {
    fn default() -> Self {
        Self {
            program: PathBuf::from("pct"),
            kill_grace: Duration::from_secs(3),
            drain_grace: Duration::from_secs(1),
            sweep_timeout: Duration::from_secs(15),
            push_timeout: Duration::from_secs(300),
            scratch_dir: std::env::temp_dir(),
            lxc_path: PathBuf::from(super::lxc_monitor::DEFAULT_LXC_PATH),
        }
    }
}

/// Exec into one LXC container through `pct`.
#[derive(Debug)]
pub struct LxcExec {
    vmid: u32,
    config: PctConfig,
    ids: ExecIds,
}

impl LxcExec {
    /// Exec into container `vmid` with this configuration.
    pub fn new(vmid: u32, config: PctConfig) -> Self {
        Self {
            vmid,
            config,
            ids: ExecIds::random(),
        }
    }

    /// Use these exec ids (tests that need predictable argv).
    pub fn with_exec_ids(mut self, ids: ExecIds) -> Self {
        self.ids = ids;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &PctConfig {
        &self.config
    }

    fn guest_ref(&self) -> GuestRef {
        GuestRef {
            kind: GuestKind::Lxc,
            vmid: self.vmid,
        }
    }

    /// The program to spawn: a path as given, a bare name resolved on the agent's `PATH` (not
    /// on the cleared `PATH` given to `pct`).
    fn resolve_program(&self) -> PathBuf {
        let program = &self.config.program;
        if program.as_os_str().as_bytes().contains(&b'/') {
            return program.clone();
        }
        if let Some(path) = std::env::var_os("PATH") {
            for dir in std::env::split_paths(&path) {
                let candidate = dir.join(program);
                if is_executable(&candidate) {
                    return candidate;
                }
            }
        }
        program.clone()
    }

    /// [`GuestExec::exec`] that also ends when `stop` fires (the caller went away): the command
    /// is then stopped as at its timeout (SIGTERM to `pct`'s process group, the grace, SIGKILL,
    /// then the sweep inside the container for whatever still carries its tag) and the outcome
    /// says [`GuestExit::TimedOut`].
    pub async fn exec_until(
        &self,
        request: &ExecRequest,
        stop: &CancellationToken,
    ) -> Result<ExecOutcome, ExecError> {
        let (outcome, exec_id) = self.run_tagged(request, Some(stop)).await?;
        if outcome.exit == GuestExit::TimedOut {
            self.sweep(&exec_id).await;
        }
        Ok(outcome)
    }

    /// Run `request` through `pct exec` under a fresh exec id; returns the outcome and the id.
    async fn run_tagged(
        &self,
        request: &ExecRequest,
        stop: Option<&CancellationToken>,
    ) -> Result<(ExecOutcome, String), ExecError> {
        let guest = self.guest_ref();
        let exec_id = self.ids.next_id();
        let inner = guest_command(request, &exec_id)
            .map_err(|reason| ExecError::InvalidRequest { guest, reason })?;
        let outcome = self
            .run_pct(
                inner.argv,
                inner.stdin.as_deref(),
                request.timeout,
                request.output_cap,
                stop,
            )
            .await?;
        if let Some(err) = classify_pct_failure(guest, &outcome) {
            return Err(err);
        }
        Ok((outcome, exec_id))
    }

    /// Kill, inside the container, whatever still carries `exec_id` after a timeout.
    async fn sweep(&self, exec_id: &str) {
        let request = sweep_request(exec_id, Duration::ZERO, self.config.sweep_timeout);
        match self.run_tagged(&request, None).await {
            Ok((o, _)) if o.success() => {
                let killed = o.stdout.text().split_whitespace().count();
                if killed > 0 {
                    tracing::warn!(
                        vmid = self.vmid,
                        killed,
                        "killed processes left by a timed-out command inside the container"
                    );
                }
            }
            Ok((o, _)) => {
                tracing::warn!(vmid = self.vmid, outcome = %o.summary(), "in-container sweep after a timeout did not finish cleanly");
            }
            Err(e) => {
                tracing::warn!(vmid = self.vmid, error = %e, "in-container sweep after a timeout could not run");
            }
        }
    }

    /// Spawn `pct exec` of `inner` (behind the first stage, [`FIRST_STAGE`]) in its own process
    /// group, prove that the first stage runs in the namespaces of the container's init, let it
    /// run `inner` with `stdin`, and wait for it, its timeout, or both (`stop` firing counts as
    /// the timeout).
    async fn run_pct(
        &self,
        inner: Vec<String>,
        stdin: Option<&[u8]>,
        timeout: Duration,
        cap: usize,
        stop: Option<&CancellationToken>,
    ) -> Result<ExecOutcome, ExecError> {
        let guest = self.guest_ref();
        // Right before `pct exec`: the container's command socket must be root's monitor's, and
        // that monitor names the init whose namespaces the command must enter (held open here
        // until the first stage was compared with them).
        let (lxc_path, vmid) = (self.config.lxc_path.clone(), self.vmid);
        // Blocking socket and /proc reads (root's monitor has a few seconds to answer).
        let init = tokio::task::spawn_blocking(move || {
            super::lxc_monitor::container_init(&lxc_path, vmid)
        })
        .await
        .unwrap_or_else(|e| {
            Err(Monitor::Untrusted(format!(
                "the look-up of the container's init did not finish: {e}"
            )))
        });
        let init = match init {
            Ok(init) => init,
            Err(Monitor::Absent) => return Err(ExecError::NotRunning { guest }),
            Err(Monitor::Untrusted(detail)) => {
                return Err(ExecError::MonitorUntrusted { guest, detail });
            }
            Err(Monitor::Trusted(_)) => unreachable!("container_init never errs with Trusted"),
        };
        let nonce = ulid::Ulid::new().to_string();
        let mut args: Vec<OsString> = vec![
            "exec".into(),
            self.vmid.to_string().into(),
            "--keep-env".into(),
            "0".into(),
            "--".into(),
            "/bin/sh".into(),
            "-c".into(),
            FIRST_STAGE.into(),
            FIRST_STAGE_NAME.into(),
            nonce.clone().into(),
        ];
        args.extend(inner.into_iter().map(OsString::from));
        let program = self.resolve_program();
        let mut cmd = tokio::process::Command::new(&program);
        cmd.args(&args)
            .env_clear()
            .env("PATH", PCT_PATH)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + timeout;
        let mut child = cmd.spawn().map_err(|source| ExecError::Spawn {
            guest,
            program: program.display().to_string(),
            source,
        })?;
        let mut group = GroupGuard::new(child.id());
        let stopped = || async {
            match stop {
                Some(token) => token.cancelled().await,
                None => std::future::pending().await,
            }
        };
        let stderr_buf = Arc::new(Mutex::new(Captured::default()));
        let stderr_task = child
            .stderr
            .take()
            .map(|r| tokio::spawn(read_capped(r, Arc::clone(&stderr_buf), cap)));
        let mut stdin_pipe = child.stdin.take();
        let mut stdout_pipe = child.stdout.take();

        // The first stage: its ready line, then the check of where it runs.
        let hand = match stdout_pipe.as_mut() {
            Some(out) => tokio::select! {
                h = read_ready_line(out) => h,
                () = tokio::time::sleep_until(deadline) => Handshake::TimedOut,
                () = stopped() => Handshake::TimedOut,
            },
            None => Handshake::Ended(Vec::new()),
        };
        let (monitor, init_pid) = (init.monitor, init.pid);
        let refuse = |detail: String| ExecError::AttachMismatch {
            guest,
            monitor,
            init: init_pid,
            detail,
        };
        let mut verified = false;
        match &hand {
            Handshake::Ready => {
                let pct_pid = child.id().unwrap_or(0);
                let held: Vec<(&'static str, u64, u64)> = init
                    .namespaces
                    .iter()
                    .map(|n| (n.name, n.dev, n.ino))
                    .collect();
                let nonce = nonce.clone();
                let checked =
                    tokio::task::spawn_blocking(move || verify_first_stage(pct_pid, &nonce, &held))
                        .await
                        .unwrap_or_else(|e| Err(format!("the check did not finish: {e}")));
                if let Err(detail) = checked {
                    group.kill();
                    let _ = child.wait().await;
                    if let Some(t) = &stderr_task {
                        t.abort();
                    }
                    return Err(refuse(detail));
                }
                verified = true;
            }
            Handshake::Garbage(bytes) => {
                group.kill();
                let _ = child.wait().await;
                if let Some(t) = &stderr_task {
                    t.abort();
                }
                return Err(refuse(format!(
                    "what `pct exec` started wrote {} before the first stage's ready line",
                    crate::error::outside_text(&String::from_utf8_lossy(bytes))
                )));
            }
            // pct ended (or closed its output) before the first stage started: nothing ran. Its
            // stdin closes, its end is waited for below and said as an error.
            Handshake::Ended(_) => {
                stdin_pipe = None;
            }
            Handshake::TimedOut => {}
        }
        drop(init);

        let stdin_task = match (verified, stdin_pipe) {
            (true, Some(mut pipe)) => {
                let mut bytes = GO_LINE.to_vec();
                bytes.extend_from_slice(stdin.unwrap_or_default());
                Some(tokio::spawn(async move {
                    // A command that does not read its stdin closes the pipe: not an error.
                    let _ = pipe.write_all(&bytes).await;
                    let _ = pipe.shutdown().await;
                }))
            }
            _ => None,
        };
        let stdout_buf = Arc::new(Mutex::new(Captured::default()));
        let stdout_task =
            stdout_pipe.map(|r| tokio::spawn(read_capped(r, Arc::clone(&stdout_buf), cap)));

        let waited = if matches!(hand, Handshake::TimedOut) {
            Err(())
        } else {
            tokio::select! {
                r = child.wait() => Ok(r),
                () = tokio::time::sleep_until(deadline) => Err(()),
                () = stopped() => Err(()),
            }
        };
        let exit = match waited {
            Ok(Ok(status)) => {
                group.disarm();
                match (status.code(), status.signal()) {
                    (Some(code), _) => GuestExit::Exited(i64::from(code)),
                    (None, Some(sig)) => GuestExit::Signaled(sig),
                    (None, None) => GuestExit::Exited(-1),
                }
            }
            Ok(Err(source)) => {
                group.kill();
                return Err(ExecError::Wait { guest, source });
            }
            Err(()) => {
                group.signal(Signal::SIGTERM);
                let _ = tokio::time::timeout(self.config.kill_grace, child.wait()).await;
                // Also after the leader ended: members that ignored SIGTERM are still there.
                group.kill();
                if let Err(source) = child.wait().await {
                    return Err(ExecError::Wait { guest, source });
                }
                GuestExit::TimedOut
            }
        };

        // Output still buffered in the pipes arrives now; a process that escaped the group may
        // hold a pipe open, so do not wait for it forever: after the grace the readers are
        // aborted, which closes their ends of the pipes (a guest process that keeps its end
        // open holds no descriptor of ours).
        let aborts: Vec<tokio::task::AbortHandle> = [&stdout_task, &stderr_task, &stdin_task]
            .into_iter()
            .flatten()
            .map(tokio::task::JoinHandle::abort_handle)
            .collect();
        let readers = async {
            if let Some(t) = stdout_task {
                let _ = t.await;
            }
            if let Some(t) = stderr_task {
                let _ = t.await;
            }
        };
        let _ = tokio::time::timeout(self.config.drain_grace, readers).await;
        for task in aborts {
            task.abort();
        }
        let take = |buf: &Arc<Mutex<Captured>>| {
            std::mem::take(&mut *buf.lock().unwrap_or_else(|e| e.into_inner()))
        };
        let outcome = ExecOutcome {
            exit,
            stdout: take(&stdout_buf),
            stderr: take(&stderr_buf),
            duration: started.elapsed(),
        };
        if matches!(hand, Handshake::Ended(_)) {
            // Nothing of the command ran: pct's own refusal, or an attach that failed.
            if let Some(err) = classify_pct_failure(guest, &outcome) {
                return Err(err);
            }
            let said = super::exec::last_line(&outcome.stderr.text())
                .map(|l| format!("; it said: {l}"))
                .unwrap_or_default();
            return Err(ExecError::AttachMismatch {
                guest,
                monitor,
                init: init_pid,
                detail: format!(
                    "`pct exec` ended ({}) before the first stage started in the container{said}",
                    outcome.summary()
                ),
            });
        }
        Ok(outcome)
    }

    /// Write `bytes` to `guest_path` through `pct exec` (the bytes on stdin), then read the
    /// file back and verify it.
    async fn push_bytes(
        &self,
        bytes: Vec<u8>,
        guest_path: &str,
        mode: u32,
    ) -> Result<PushReceipt, ExecError> {
        let guest = self.guest_ref();
        let size = bytes.len() as u64;
        let sha = sha256_hex(&bytes);
        let request = push_request(guest_path, mode, bytes, self.config.push_timeout);
        let outcome = self.exec(&request).await?;
        match outcome.exit {
            // Written and read back in the same exec: its output is the read-back.
            GuestExit::Exited(0) | GuestExit::Exited(PUSH_READ_BACK_FAILED) => {}
            GuestExit::Exited(_) => {
                return Err(ExecError::PushFailed {
                    guest,
                    path: guest_path.to_owned(),
                    detail: format!("writing it in the guest ended with {}", outcome.summary()),
                });
            }
            GuestExit::Signaled(_) | GuestExit::TimedOut => {
                return Err(ExecError::PushFailed {
                    guest,
                    path: guest_path.to_owned(),
                    detail: format!("writing it in the guest {}", outcome.summary()),
                });
            }
        }
        let context = super::exec::last_line(&outcome.stderr.text()).unwrap_or_default();
        check_read_back(guest, guest_path, size, &sha, mode, &context, &outcome)
    }
}

impl GuestExec for LxcExec {
    fn guest(&self) -> GuestRef {
        self.guest_ref()
    }

    async fn exec(&self, request: &ExecRequest) -> Result<ExecOutcome, ExecError> {
        let (outcome, exec_id) = self.run_tagged(request, None).await?;
        if outcome.exit == GuestExit::TimedOut {
            self.sweep(&exec_id).await;
        }
        Ok(outcome)
    }

    async fn push_file(
        &self,
        source: &PushSource,
        guest_path: &str,
        mode: u32,
    ) -> Result<PushReceipt, ExecError> {
        let guest = self.guest_ref();
        check_guest_path(guest, guest_path)?;
        let bytes = match source {
            PushSource::Bytes(bytes) => bytes.clone(),
            PushSource::Path(path) => {
                let local = |source: std::io::Error| ExecError::LocalFile {
                    guest,
                    path: path.clone(),
                    source,
                };
                let file = tokio::fs::File::open(path).await.map_err(local)?;
                let meta = file.metadata().await.map_err(local)?;
                if !meta.is_file() {
                    return Err(local(std::io::Error::other("not a regular file")));
                }
                let mut bytes = Vec::new();
                file.take(MAX_PUSH_BYTES + 1)
                    .read_to_end(&mut bytes)
                    .await
                    .map_err(local)?;
                if bytes.len() as u64 > MAX_PUSH_BYTES {
                    return Err(local(std::io::Error::other(format!(
                        "larger than the {MAX_PUSH_BYTES} bytes a push takes"
                    ))));
                }
                bytes
            }
        };
        self.push_bytes(bytes, guest_path, mode).await
    }
}

/// The agent runs `pct` itself (it is root): every container's exec is an [`LxcExec`] with this
/// configuration.
impl super::exec::LxcExecFactory for PctConfig {
    fn lxc_exec(&self, vmid: u32, _txn: ulid::Ulid) -> Box<dyn super::exec::DynGuestExec> {
        Box::new(LxcExec::new(vmid, self.clone()))
    }

    fn describe(&self) -> String {
        format!(
            "`{}` run by the agent itself (as root)",
            self.program.display()
        )
    }

    fn full_guest_list(
        &self,
        cfg: &crate::config::Config,
    ) -> Result<crate::inventory::FullGuestList, crate::inventory::InventoryError> {
        crate::inventory::read_full_list(
            &cfg.vmlist_path,
            &cfg.node,
            &crate::inventory::SystemListCommands::default(),
        )
    }

    fn lab_op(
        &self,
        vmid: u32,
        _txn: ulid::Ulid,
        op: super::exec::LabOp,
    ) -> futures_util::future::BoxFuture<'static, Result<String, String>> {
        use super::exec::LabOp;
        let lxc_path = self.lxc_path.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || match op {
                LabOp::Join { lab, names, link } => {
                    super::group_lab::join_and_link(&lxc_path, lab, vmid, &names, link.as_deref())
                }
                LabOp::Remove { lab } => crate::guest::group_lab::remove(lab).map(|had| {
                    format!(
                        "the group lab {} was {}",
                        crate::guest::group_lab::lab_name(lab),
                        if had { "removed" } else { "already gone" }
                    )
                }),
            })
            .await
            .unwrap_or_else(|e| Err(format!("the lab request failed: {e}")))
        })
    }
}

/// How the first stage's ready line went.
enum Handshake {
    /// It came, alone.
    Ready,
    /// Output came that is not it.
    Garbage(Vec<u8>),
    /// The output closed first (with what came before).
    Ended(#[allow(dead_code)] Vec<u8>),
    /// The exec's time ran out (or it was stopped) first.
    TimedOut,
}

/// Read the first stage's ready line from `out`, nothing more.
async fn read_ready_line<R: AsyncRead + Unpin>(out: &mut R) -> Handshake {
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    loop {
        match out.read(&mut buf).await {
            Ok(0) | Err(_) => return Handshake::Ended(got),
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                if got.len() >= READY_LINE.len() || !READY_LINE.starts_with(&got) {
                    return if got == READY_LINE {
                        Handshake::Ready
                    } else {
                        Handshake::Garbage(got)
                    };
                }
            }
        }
    }
}

/// The ids of the processes below `root` (not `root` itself), through
/// `/proc/<pid>/task/<tid>/children`, or by reading every `/proc/<pid>/stat` where the kernel
/// has no `children` files.
fn descendants(root: u32) -> Vec<u32> {
    let children_file = format!("/proc/{root}/task/{root}/children");
    let mut found = Vec::new();
    if Path::new(&children_file).exists() {
        let mut queue = vec![root];
        while let Some(p) = queue.pop() {
            let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
                continue;
            };
            for task in tasks.flatten() {
                let text =
                    std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
                for child in text
                    .split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok())
                {
                    if found.len() < MAX_DESCENDANTS && !found.contains(&child) {
                        found.push(child);
                        queue.push(child);
                    }
                }
            }
        }
        return found;
    }
    let mut parents: Vec<(u32, u32)> = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        if let Some(ppid) = stat_ppid(&stat) {
            parents.push((pid, ppid));
        }
    }
    let mut queue = vec![root];
    while let Some(p) = queue.pop() {
        for (pid, _) in parents.iter().filter(|(_, pp)| *pp == p) {
            if found.len() < MAX_DESCENDANTS && !found.contains(pid) {
                found.push(*pid);
                queue.push(*pid);
            }
        }
    }
    found
}

/// The parent pid in a `/proc/<pid>/stat` line (after the command name in parentheses, which
/// may itself hold `)` and spaces).
fn stat_ppid(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Prove that the one process below `pct` running the first stage with `nonce` runs in the
/// namespaces `held` (name, device, inode) of the container's init. `Err` says what differed.
fn verify_first_stage(
    pct: u32,
    nonce: &str,
    held: &[(&'static str, u64, u64)],
) -> Result<(), String> {
    use nix::fcntl::{openat, OFlag};
    use nix::sys::stat::{fstatat, Mode};
    use std::io::Read;
    let want: [&[u8]; 5] = [
        b"/bin/sh",
        b"-c",
        FIRST_STAGE.as_bytes(),
        FIRST_STAGE_NAME.as_bytes(),
        nonce.as_bytes(),
    ];
    let mut stages = Vec::new();
    for pid in descendants(pct) {
        // The process's folder, opened once: what is read through it is that process's even if
        // it ends and its pid is reused meanwhile (reads then fail).
        let Ok(dir) = nix::fcntl::open(
            format!("/proc/{pid}").as_str(),
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) else {
            continue;
        };
        let mut cmdline = Vec::new();
        if let Ok(fd) = openat(
            &dir,
            "cmdline",
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) {
            let _ = std::fs::File::from(fd)
                .take(64 * 1024)
                .read_to_end(&mut cmdline);
        }
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if args.len() >= want.len() && args[..want.len()] == want {
            stages.push((pid, dir));
        }
    }
    let (pid, dir) = match stages.len() {
        1 => stages.remove(0),
        0 => {
            return Err(format!(
            "no process below pct (pid {pct}) runs the first stage; it ended or was never started"
        ))
        }
        n => {
            return Err(format!(
                "{n} processes below pct (pid {pct}) run the first stage; exactly one must"
            ))
        }
    };
    let mut differ = Vec::new();
    for (name, dev, ino) in held {
        match fstatat(
            &dir,
            format!("ns/{name}").as_str(),
            nix::fcntl::AtFlags::empty(),
        ) {
            Ok(st) if st.st_dev == *dev && st.st_ino == *ino => {}
            Ok(st) => differ.push(format!(
                "{name} (namespace {}, the init's {ino})",
                st.st_ino
            )),
            Err(e) => differ.push(format!("{name} (unreadable: {e})")),
        }
    }
    if differ.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the first stage (pid {pid}) does not run in the container init's namespaces: {}",
            differ.join(", ")
        ))
    }
}

/// Turn `pct`'s own refusals (before it ran anything) into errors. Only an exact match counts:
/// a non-zero exit, nothing on stdout, and stderr that is just pct's message.
fn classify_pct_failure(guest: GuestRef, outcome: &ExecOutcome) -> Option<ExecError> {
    match outcome.exit {
        GuestExit::Exited(code) if code != 0 => {}
        _ => return None,
    }
    if !outcome.stdout.bytes.is_empty() {
        return None;
    }
    let stderr = outcome.stderr.text();
    let stderr = stderr.trim();
    if stderr.lines().count() != 1 {
        return None;
    }
    if stderr.starts_with(&format!("container '{}' not running!", guest.vmid)) {
        return Some(ExecError::NotRunning { guest });
    }
    classify_missing_config(guest, stderr)
}

fn classify_missing_config(guest: GuestRef, stderr: &str) -> Option<ExecError> {
    let line = stderr.lines().next()?.trim();
    (line.starts_with("Configuration file 'nodes/")
        && line.contains(&format!("/lxc/{}.conf' does not exist", guest.vmid)))
    .then(|| ExecError::NoSuchGuest {
        guest,
        detail: line.to_owned(),
    })
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Read a stream to its end, keeping at most `cap` bytes in `buf` and dropping the rest (so
/// the writer never blocks on a full pipe).
async fn read_capped<R: AsyncRead + Unpin>(mut reader: R, buf: Arc<Mutex<Captured>>, cap: usize) {
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        match reader.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => buf
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_capped(&chunk[..n], cap),
        }
    }
}

/// The process group of a spawned `pct`. Dropped while armed (the exec was cancelled or failed
/// half-way), it kills the whole group, so nothing outlives the agent's interest in it.
struct GroupGuard {
    pgid: Option<Pid>,
}

impl GroupGuard {
    fn new(pid: Option<u32>) -> Self {
        Self {
            pgid: pid.and_then(|p| i32::try_from(p).ok()).map(Pid::from_raw),
        }
    }

    fn signal(&self, signal: Signal) {
        if let Some(pgid) = self.pgid {
            // ESRCH: the group is already gone.
            let _ = killpg(pgid, signal);
        }
    }

    fn kill(&mut self) {
        self.signal(Signal::SIGKILL);
        self.pgid = None;
    }

    fn disarm(&mut self) {
        self.pgid = None;
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.signal(Signal::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(code: i32, stdout: &str, stderr: &str) -> ExecOutcome {
        ExecOutcome {
            exit: GuestExit::Exited(i64::from(code)),
            stdout: Captured::capped(stdout.as_bytes().to_vec(), 1000, false),
            stderr: Captured::capped(stderr.as_bytes().to_vec(), 1000, false),
            duration: Duration::ZERO,
        }
    }

    const CT: GuestRef = GuestRef {
        kind: GuestKind::Lxc,
        vmid: 120,
    };

    #[test]
    fn pct_refusals_become_errors() {
        let e = classify_pct_failure(CT, &outcome(255, "", "container '120' not running!\n"));
        assert!(matches!(e, Some(ExecError::NotRunning { .. })), "{e:?}");
        let e = classify_pct_failure(
            CT,
            &outcome(
                2,
                "",
                "Configuration file 'nodes/pve1/lxc/120.conf' does not exist\n",
            ),
        );
        assert!(matches!(e, Some(ExecError::NoSuchGuest { .. })), "{e:?}");
    }

    #[test]
    fn command_output_is_never_mistaken_for_a_pct_refusal() {
        // The command printed it, with other output: an ordinary outcome.
        assert!(
            classify_pct_failure(CT, &outcome(1, "x", "container '120' not running!\n")).is_none()
        );
        assert!(
            classify_pct_failure(CT, &outcome(1, "", "log\ncontainer '120' not running!\n"))
                .is_none()
        );
        // Another vmid's message.
        assert!(
            classify_pct_failure(CT, &outcome(255, "", "container '121' not running!")).is_none()
        );
        // Exit 0 is never a refusal.
        assert!(
            classify_pct_failure(CT, &outcome(0, "", "container '120' not running!")).is_none()
        );
    }

    #[test]
    fn the_parent_pid_is_read_after_the_last_parenthesis() {
        assert_eq!(stat_ppid("42 (sh) S 7 42 42 0"), Some(7));
        assert_eq!(stat_ppid("42 (a) b) (c) R 9 1 1"), Some(9));
        assert_eq!(stat_ppid("42 (sh"), None);
        assert_eq!(stat_ppid(""), None);
    }

    #[tokio::test]
    async fn only_the_exact_ready_line_is_ready() {
        let ready = |bytes: &'static [u8]| async move {
            let mut r = bytes;
            read_ready_line(&mut r).await
        };
        assert!(matches!(
            ready(b"felhom-attach-ready\n").await,
            Handshake::Ready
        ));
        // Anything more, or other, is not (the first stage writes nothing after it until go).
        assert!(matches!(
            ready(b"felhom-attach-ready\nx").await,
            Handshake::Garbage(_)
        ));
        assert!(matches!(ready(b"hello\n").await, Handshake::Garbage(_)));
        assert!(matches!(
            ready(b"felhom-attach-ready-").await,
            Handshake::Garbage(_)
        ));
        // The end before the line: pct ended first.
        assert!(matches!(ready(b"felhom-att").await, Handshake::Ended(_)));
        assert!(matches!(ready(b"").await, Handshake::Ended(_)));
    }

    #[test]
    fn the_first_stage_runs_its_command_only_after_go() {
        let run = |stdin: &str| {
            let out = std::process::Command::new("/bin/sh")
                .args([
                    "-c",
                    FIRST_STAGE,
                    FIRST_STAGE_NAME,
                    "NONCE",
                    "/bin/sh",
                    "-c",
                ])
                .arg("echo ran; cat")
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .and_then(|mut c| {
                    use std::io::Write;
                    c.stdin.take().map(|mut i| i.write_all(stdin.as_bytes()));
                    c.wait_with_output()
                })
                .expect("sh");
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
            )
        };
        assert_eq!(
            run("go\nrest\n"),
            (Some(0), "felhom-attach-ready\nran\nrest\n".to_string())
        );
        assert_eq!(run(""), (Some(125), "felhom-attach-ready\n".to_string()));
        assert_eq!(
            run("no\nrest\n"),
            (Some(125), "felhom-attach-ready\n".to_string())
        );
    }

    #[test]
    fn a_bare_program_name_is_resolved_on_the_agents_path() {
        let exec = LxcExec::new(
            101,
            PctConfig {
                program: PathBuf::from("sh"),
                ..PctConfig::default()
            },
        );
        let resolved = exec.resolve_program();
        assert!(resolved.is_absolute(), "{resolved:?}");
        let exec = LxcExec::new(
            101,
            PctConfig {
                program: PathBuf::from("./relative/pct"),
                ..PctConfig::default()
            },
        );
        assert_eq!(exec.resolve_program(), PathBuf::from("./relative/pct"));
    }
}
