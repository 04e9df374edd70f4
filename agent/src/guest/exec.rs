//! The guest exec seam: [`GuestExec`] runs a command inside one guest and pushes files into it.
//!
//! Two implementations exist: [`crate::guest::lxc::LxcExec`] (`pct exec`, files on its stdin) and
//! [`crate::guest::qemu::QemuExec`] (the PVE guest agent API). This module owns what they share:
//! the request and outcome types, the controlled environment every command runs with (the
//! `env -i` wrapper, so nothing from the agent's environment reaches a guest), the tag that lets
//! a timed-out command be found and killed inside the guest, capped output capture, and the
//! read-back verification of pushed files.
//!
//! It never logs or formats environment values or stdin: they may carry secrets.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::error::ErrorCode;
use crate::pve::GuestKind;

/// The default time a command may run.
pub const DEFAULT_EXEC_TIMEOUT: Duration = Duration::from_secs(60);
/// The default number of bytes kept per output stream.
pub const DEFAULT_OUTPUT_CAP: usize = 1024 * 1024;
/// `PATH` inside the guest: what `lxc-attach --clear-env` sets, then NixOS's system profile.
/// A NixOS guest keeps only `/bin/sh` and `/usr/bin/env` in the usual places
/// (nixpkgs `nixos/modules/system/activation/activation-script.nix`, `environment.binsh` and
/// `environment.usrbinenv`); `systemctl`, `ip` and every system package are in
/// `/run/current-system/sw/bin` (`nixos/modules/config/system-path.nix`). Without it, such a
/// guest would read as one without systemd.
pub const GUEST_PATH: &str =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/run/current-system/sw/bin";
/// The variable that tags every process of one exec inside the guest.
pub const EXEC_ID_VAR: &str = "FELHOM_EXEC_ID";
/// The time allowed for reading back a pushed file.
const VERIFY_TIMEOUT: Duration = Duration::from_secs(120);

/// A guest: its kind and vmid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GuestRef {
    /// LXC or QEMU.
    pub kind: GuestKind,
    /// The vmid.
    pub vmid: u32,
}

impl fmt::Display for GuestRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.kind.pve_word(), self.vmid)
    }
}

/// A command to run inside a guest.
///
/// The command runs with only `PATH` ([`GUEST_PATH`]), `LANG=C.UTF-8`, `HOME=/root`, the
/// variables given here and the exec tag. In a container the values travel on stdin and never
/// appear on a command line ([`guest_command`]); a VM's guest agent gets them on the command
/// line it starts inside the VM ([`guest_argv`]).
#[derive(Clone, PartialEq, Eq)]
pub struct ExecRequest {
    /// The program and its arguments; the program is looked up on the guest's `PATH`.
    pub argv: Vec<String>,
    /// Bytes written to the command's stdin (closed afterwards); `None`: stdin is `/dev/null`.
    pub stdin: Option<Vec<u8>>,
    /// Extra environment variables, in order; later entries win.
    pub env: Vec<(String, String)>,
    /// How long the command may run before it is killed.
    pub timeout: Duration,
    /// Bytes kept per output stream; the rest is read and dropped.
    pub output_cap: usize,
}

impl ExecRequest {
    /// A request for `argv` with the default timeout and output cap, no stdin, no extra env.
    pub fn new<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            argv: argv.into_iter().map(Into::into).collect(),
            stdin: None,
            env: Vec::new(),
            timeout: DEFAULT_EXEC_TIMEOUT,
            output_cap: DEFAULT_OUTPUT_CAP,
        }
    }

    /// Give the command these bytes on stdin.
    pub fn stdin(mut self, bytes: impl Into<Vec<u8>>) -> Self {
        self.stdin = Some(bytes.into());
        self
    }

    /// Set one environment variable for the command.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Set the timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Set the per-stream output cap.
    pub fn output_cap(mut self, cap: usize) -> Self {
        self.output_cap = cap;
        self
    }
}

impl fmt::Debug for ExecRequest {
    // Values of env and stdin may be secret: only their keys and sizes are shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecRequest")
            .field("argv", &self.argv)
            .field("stdin_bytes", &self.stdin.as_ref().map(Vec::len))
            .field(
                "env_keys",
                &self.env.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
            )
            .field("timeout", &self.timeout)
            .field("output_cap", &self.output_cap)
            .finish()
    }
}

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestExit {
    /// It exited with this status. Through `pct exec` a command killed by signal S reports
    /// 128+S here (lxc-attach turns the signal into that status).
    Exited(i64),
    /// It was killed by this signal (QEMU guest agent; or `pct` itself was signalled).
    Signaled(i32),
    /// It ran past its timeout and was killed.
    TimedOut,
}

/// One captured output stream: at most the cap, and whether more was produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Captured {
    /// The bytes kept.
    pub bytes: Vec<u8>,
    /// True when the stream produced more than the cap and the rest was dropped.
    pub truncated: bool,
}

impl Captured {
    /// Keep `bytes`, cut to `cap`.
    pub fn capped(mut bytes: Vec<u8>, cap: usize, truncated: bool) -> Self {
        let over = bytes.len() > cap;
        bytes.truncate(cap);
        Self {
            bytes,
            truncated: truncated || over,
        }
    }

    /// Append what fits under `cap`; remember that the rest was dropped.
    pub fn push_capped(&mut self, chunk: &[u8], cap: usize) {
        let room = cap.saturating_sub(self.bytes.len());
        if chunk.len() > room {
            self.truncated = true;
        }
        self.bytes
            .extend_from_slice(&chunk[..chunk.len().min(room)]);
    }

    /// The bytes as text (invalid UTF-8 replaced).
    pub fn text(&self) -> Cow<'_, str> {
        String::from_utf8_lossy(&self.bytes)
    }
}

/// What running a command produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutcome {
    /// How it ended.
    pub exit: GuestExit,
    /// Its stdout, capped.
    pub stdout: Captured,
    /// Its stderr, capped.
    pub stderr: Captured,
    /// From start to end (including the kill after a timeout).
    pub duration: Duration,
}

impl ExecOutcome {
    /// True when the command exited with status 0.
    pub fn success(&self) -> bool {
        self.exit == GuestExit::Exited(0)
    }

    /// The exit status, if the command exited.
    pub fn exit_code(&self) -> Option<i64> {
        match self.exit {
            GuestExit::Exited(code) => Some(code),
            _ => None,
        }
    }

    /// A one-line description of how it ended and the last line of stderr, for messages.
    pub fn summary(&self) -> String {
        let how = match self.exit {
            GuestExit::Exited(code) => format!("exit status {code}"),
            GuestExit::Signaled(sig) => format!("killed by signal {sig}"),
            GuestExit::TimedOut => format!("timed out after {:.1}s", self.duration.as_secs_f64()),
        };
        match last_line(&self.stderr.text()) {
            Some(line) => format!("{how}: {line}"),
            None => how,
        }
    }
}

/// The last non-empty line of a text (guest output), control characters escaped and clipped
/// to about 256 bytes: it goes into messages and log lines.
pub(crate) fn last_line(text: &str) -> Option<String> {
    text.lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(crate::error::outside_text)
}

/// What to push into a guest.
#[derive(Clone, PartialEq, Eq)]
pub enum PushSource {
    /// A file on the node.
    Path(PathBuf),
    /// These bytes.
    Bytes(Vec<u8>),
}

impl fmt::Debug for PushSource {
    // The bytes may be secret: only their size is shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Path(p) => f.debug_tuple("Path").field(p).finish(),
            Self::Bytes(b) => write!(f, "Bytes({} bytes)", b.len()),
        }
    }
}

/// Proof of what arrived in the guest: read back after the push.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushReceipt {
    /// The path in the guest.
    pub path: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its SHA-256, hex.
    pub sha256: String,
    /// Its permission bits.
    pub mode: u32,
}

/// Why a command could not be run (a command that ran and failed is an [`ExecOutcome`]).
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The request cannot be expressed safely.
    #[error("invalid command for {guest}: {reason}")]
    InvalidRequest {
        /// The guest.
        guest: GuestRef,
        /// What is wrong.
        reason: String,
    },
    /// The local helper (`pct`) could not be started.
    #[error("could not start {program} for {guest}: {source}; check that it is installed and that the agent runs as root")]
    Spawn {
        /// The guest.
        guest: GuestRef,
        /// The program.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Waiting for the local helper failed.
    #[error("lost track of the command running in {guest}: {source}")]
    Wait {
        /// The guest.
        guest: GuestRef,
        /// The OS error.
        source: std::io::Error,
    },
    /// The guest does not exist on this node.
    #[error("{guest} does not exist on this node ({detail}); the agent must run on the node that hosts it")]
    NoSuchGuest {
        /// The guest.
        guest: GuestRef,
        /// PVE's words.
        detail: String,
    },
    /// The guest is not running.
    #[error("{guest} is not running; start it and retry")]
    NotRunning {
        /// The guest.
        guest: GuestRef,
    },
    /// The container's LXC command socket is held by someone other than root's LXC monitor of
    /// that container: `pct exec` would enter what that listener names, so it is not run.
    #[error("{guest}: its LXC command socket cannot be trusted ({detail}); `pct exec` was not run. Check `ss -xlp | grep /{vmid}/command` on the node and stop whatever holds it, then `pct status {vmid}`", vmid = guest.vmid)]
    MonitorUntrusted {
        /// The guest.
        guest: GuestRef,
        /// Who holds it, or why it cannot be proven.
        detail: String,
    },
    /// What `pct exec` started could not be proven to run in the namespaces of the container's
    /// init as root's LXC monitor named it (the first stage of [`super::lxc`]): it was killed
    /// before the command ran.
    #[error("{guest}: what `pct exec` started is not proven to run inside the container ({detail}); it was killed before the command ran (root's LXC monitor pid {monitor}, the container's init pid {init}). If the container stopped or restarted meanwhile, retry once it runs; else check `ss -xlp | grep /{vmid}/command` on the node for a process other than `lxc-start -F -n {vmid}` holding its command socket", vmid = guest.vmid)]
    AttachMismatch {
        /// The guest.
        guest: GuestRef,
        /// Root's LXC monitor that named the init.
        monitor: u32,
        /// The init it named.
        init: u32,
        /// What differed, or why it could not be proven.
        detail: String,
    },
    /// The VM runs but its guest agent does not answer.
    #[error("the QEMU guest agent of {guest} is not running; wait for the guest to finish booting or install and start qemu-guest-agent in it")]
    AgentNotRunning {
        /// The guest.
        guest: GuestRef,
    },
    /// The VM has no guest agent configured.
    #[error("{guest} has no QEMU guest agent configured; set `agent: 1` in its config")]
    NoAgentConfigured {
        /// The guest.
        guest: GuestRef,
    },
    /// The guest agent API refused or failed a call.
    #[error("guest agent call for {guest} failed: {message}")]
    Agent {
        /// The guest.
        guest: GuestRef,
        /// PVE's words (or the transport error).
        message: String,
    },
    /// The exit status of a guest agent command can no longer be read.
    #[error("the result of command pid {pid} in {guest} is gone (already read, or the guest agent restarted); re-run the step")]
    StatusLost {
        /// The guest.
        guest: GuestRef,
        /// The guest agent's pid of the command.
        pid: u64,
    },
    /// A local file to push could not be read or staged.
    #[error("could not read {path} to push into {guest}: {source}")]
    LocalFile {
        /// The guest.
        guest: GuestRef,
        /// The local path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Copying a file into the guest failed.
    #[error("pushing {path} into {guest} failed: {detail}")]
    PushFailed {
        /// The guest.
        guest: GuestRef,
        /// The path in the guest.
        path: String,
        /// What went wrong.
        detail: String,
    },
    /// The file in the guest is not what was pushed.
    #[error("{path} in {guest} does not hold what was pushed ({detail}); check free space and permissions in the guest")]
    PushUnverified {
        /// The guest.
        guest: GuestRef,
        /// The path in the guest.
        path: String,
        /// Expected versus found.
        detail: String,
    },
    /// The root exec helper, which runs `pct` for an agent that is not root, cannot be reached
    /// or broke off the exchange.
    #[error("the exec helper at {} did not serve the request for {guest}: {detail}; start it (`systemctl start felhom-agent-exec.socket`) or run the agent as root", socket.display())]
    HelperUnavailable {
        /// The guest.
        guest: GuestRef,
        /// The helper's socket.
        socket: PathBuf,
        /// What went wrong (connect, read, write, timeout, a malformed answer).
        detail: String,
    },
    /// The root exec helper refused the request (nothing ran in the guest), or met an error
    /// of its own running it.
    #[error("the exec helper did not run the request for {guest} ({code}): {message}")]
    HelperRefused {
        /// The guest.
        guest: GuestRef,
        /// The helper's stable code.
        code: ErrorCode,
        /// The helper's message, clipped.
        message: String,
    },
}

impl ExecError {
    /// The stable code.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Spawn { .. } => ErrorCode::ConfigInvalid,
            Self::HelperUnavailable { .. } => ErrorCode::ExecHelperUnavailable,
            Self::HelperRefused { code, .. } => *code,
            Self::MonitorUntrusted { .. } => ErrorCode::ExecMonitorUntrusted,
            Self::AttachMismatch { .. } => ErrorCode::ExecAttachMismatch,
            _ => ErrorCode::LaunchUnproven,
        }
    }

    /// True when the guest itself is not there to run anything (not running, no agent).
    pub fn guest_down(&self) -> bool {
        matches!(
            self,
            Self::NoSuchGuest { .. }
                | Self::NotRunning { .. }
                | Self::AgentNotRunning { .. }
                | Self::NoAgentConfigured { .. }
        )
    }
}

/// Runs commands in one guest and pushes files into it.
///
/// Implementations enforce the timeout (nothing of the command is left running afterwards),
/// cap the output while reading it, and give the command only the controlled environment of
/// [`ExecRequest`].
pub trait GuestExec: Send + Sync {
    /// The guest this runs in.
    fn guest(&self) -> GuestRef;

    /// Run a command and wait for its end (or its timeout).
    fn exec(
        &self,
        request: &ExecRequest,
    ) -> impl Future<Output = Result<ExecOutcome, ExecError>> + Send;

    /// Copy a file into the guest at `guest_path` (absolute; its directory must exist) with
    /// permission bits `mode`, then read it back and check size, SHA-256 and mode.
    fn push_file(
        &self,
        source: &PushSource,
        guest_path: &str,
        mode: u32,
    ) -> impl Future<Output = Result<PushReceipt, ExecError>> + Send;
}

/// A boxed future of the exec seam.
pub type ExecFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, ExecError>> + Send + 'a>>;

/// [`GuestExec`] as a trait object (its futures boxed), for code that receives an exec whose
/// type it does not know (the executor's LXC exec: `pct` directly, or through the exec
/// helper). Every [`GuestExec`] is one; `Box<dyn DynGuestExec>` is a [`GuestExec`] again.
pub trait DynGuestExec: Send + Sync {
    /// [`GuestExec::guest`].
    fn dyn_guest(&self) -> GuestRef;
    /// [`GuestExec::exec`], boxed.
    fn dyn_exec<'a>(&'a self, request: &'a ExecRequest) -> ExecFuture<'a, ExecOutcome>;
    /// [`GuestExec::push_file`], boxed.
    fn dyn_push_file<'a>(
        &'a self,
        source: &'a PushSource,
        guest_path: &'a str,
        mode: u32,
    ) -> ExecFuture<'a, PushReceipt>;
}

impl<T: GuestExec> DynGuestExec for T {
    fn dyn_guest(&self) -> GuestRef {
        self.guest()
    }

    fn dyn_exec<'a>(&'a self, request: &'a ExecRequest) -> ExecFuture<'a, ExecOutcome> {
        Box::pin(self.exec(request))
    }

    fn dyn_push_file<'a>(
        &'a self,
        source: &'a PushSource,
        guest_path: &'a str,
        mode: u32,
    ) -> ExecFuture<'a, PushReceipt> {
        Box::pin(self.push_file(source, guest_path, mode))
    }
}

impl GuestExec for Box<dyn DynGuestExec> {
    fn guest(&self) -> GuestRef {
        self.as_ref().dyn_guest()
    }

    async fn exec(&self, request: &ExecRequest) -> Result<ExecOutcome, ExecError> {
        self.as_ref().dyn_exec(request).await
    }

    async fn push_file(
        &self,
        source: &PushSource,
        guest_path: &str,
        mode: u32,
    ) -> Result<PushReceipt, ExecError> {
        self.as_ref().dyn_push_file(source, guest_path, mode).await
    }
}

/// Makes the exec of one LXC container on behalf of one journal transaction: how the agent
/// reaches into containers (`pct` itself when it runs as root, else the root exec helper, which
/// checks the transaction's claim on the vmid).
pub trait LxcExecFactory: Send + Sync {
    /// The exec of container `vmid` for transaction `txn`.
    fn lxc_exec(&self, vmid: u32, txn: ulid::Ulid) -> Box<dyn DynGuestExec>;
    /// How it reaches into containers, for logs and `doctor` (e.g. `pct` or the helper's
    /// socket).
    fn describe(&self) -> String;
    /// The node's full guest list the same way: `.vmlist` read by this process on the direct
    /// route, handed over by the root exec helper on its route (then the agent's user needs no
    /// pmxcfs group).
    fn full_guest_list(
        &self,
        cfg: &crate::config::Config,
    ) -> Result<crate::inventory::FullGuestList, crate::inventory::InventoryError>;
    /// An application group's lab for container `vmid` of transaction `txn`
    /// ([`super::group_lab`]): root's work, done by this process on the direct route (it is
    /// root there), by the exec helper on its route. What was done, or why not.
    fn lab_op(
        &self,
        vmid: u32,
        txn: ulid::Ulid,
        op: LabOp,
    ) -> futures_util::future::BoxFuture<'static, Result<String, String>>;
}

/// What is asked of an application group's lab.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LabOp {
    /// Join the running copy's stored interfaces (`names`) to lab `lab`.
    Join {
        /// The lab (the transaction's journaled `group.lab`).
        lab: ulid::Ulid,
        /// The stored interface names.
        names: Vec<String>,
        /// The group's lab bridge to link the lab to (a group that also holds VMs). The exec
        /// helper takes it from the journaled request, never from the request on its socket.
        link: Option<String>,
    },
    /// Remove lab `lab`.
    Remove {
        /// The lab (the transaction's journaled `group.lab`).
        lab: ulid::Ulid,
    },
}

/// Exec ids: `<prefix>-<n>`, unique per exec, put into the command's environment as
/// [`EXEC_ID_VAR`] so a timed-out command and everything it started can be found in the guest.
#[derive(Debug)]
pub struct ExecIds {
    prefix: String,
    next: AtomicU64,
}

impl ExecIds {
    /// Ids with a random (ULID) prefix: what production uses.
    pub fn random() -> Self {
        Self::with_prefix_unchecked(ulid::Ulid::new().to_string())
    }

    /// Ids with a fixed prefix (letters, digits and `-`), for tests that must know the argv in
    /// advance. Other characters are dropped.
    pub fn with_prefix(prefix: &str) -> Self {
        let clean: String = prefix
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        Self::with_prefix_unchecked(if clean.is_empty() {
            "x".to_owned()
        } else {
            clean
        })
    }

    fn with_prefix_unchecked(prefix: String) -> Self {
        Self {
            prefix,
            next: AtomicU64::new(1),
        }
    }

    /// The longest id this source can give (its prefix and the largest counter): what sizes
    /// a request before its id is drawn.
    pub fn longest_id(&self) -> String {
        format!("{}-{}", self.prefix, u64::MAX)
    }

    /// The next id.
    pub fn next_id(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{}-{n}", self.prefix)
    }
}

impl Default for ExecIds {
    fn default() -> Self {
        Self::random()
    }
}

fn valid_env_key(key: &str) -> bool {
    let mut chars = key.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The argv that runs `request` inside the guest with exactly the controlled environment:
/// `/usr/bin/env -i PATH=… LANG=C.UTF-8 HOME=/root [K=V…] FELHOM_EXEC_ID=<id> argv…`.
pub fn guest_argv(request: &ExecRequest, exec_id: &str) -> Result<Vec<String>, String> {
    let program = request
        .argv
        .first()
        .ok_or_else(|| "the command is empty".to_owned())?;
    if program.is_empty() {
        return Err("the program name is empty".to_owned());
    }
    if program.contains('=') || program.starts_with('-') {
        return Err(format!(
            "the program name {program:?} cannot start with '-' or contain '='"
        ));
    }
    if request.argv.iter().any(|a| a.contains('\0')) {
        return Err("an argument contains a NUL byte".to_owned());
    }
    let mut env: Vec<(String, String)> = vec![
        ("PATH".to_owned(), GUEST_PATH.to_owned()),
        ("LANG".to_owned(), "C.UTF-8".to_owned()),
        ("HOME".to_owned(), "/root".to_owned()),
    ];
    for (key, value) in &request.env {
        if !valid_env_key(key) {
            return Err(format!("the environment variable name {key:?} is invalid"));
        }
        if key == EXEC_ID_VAR {
            return Err(format!(
                "the environment variable {EXEC_ID_VAR} is reserved"
            ));
        }
        if value.contains('\0') {
            return Err(format!("the value of {key} contains a NUL byte"));
        }
        match env.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1.clone_from(value),
            None => env.push((key.clone(), value.clone())),
        }
    }
    env.push((EXEC_ID_VAR.to_owned(), exec_id.to_owned()));
    let mut argv = Vec::with_capacity(2 + env.len() + request.argv.len());
    argv.push("/usr/bin/env".to_owned());
    argv.push("-i".to_owned());
    argv.extend(env.into_iter().map(|(k, v)| format!("{k}={v}")));
    argv.extend(request.argv.iter().cloned());
    Ok(argv)
}

/// A command as it is handed to `pct exec`: the argv, which names the variables of the
/// request but never their values, and the bytes for its stdin: first the values, one line each
/// ([`encode_env_value`]), then the request's own stdin.
#[derive(Clone, PartialEq, Eq)]
pub struct GuestCommand {
    /// What follows `pct exec <vmid> --keep-env 0 --`.
    pub argv: Vec<String>,
    /// Bytes for stdin; `None`: stdin is `/dev/null` (no variable values and no stdin).
    pub stdin: Option<Vec<u8>>,
}

impl fmt::Debug for GuestCommand {
    // The stdin holds the variable values: only its size is shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuestCommand")
            .field("argv", &self.argv)
            .field("stdin_bytes", &self.stdin.as_ref().map(Vec::len))
            .finish()
    }
}

/// Variables the in-guest shell may add to its environment itself; removed before the command
/// starts unless the request sets them.
const SHELL_ADDED_VARS: [&str; 4] = ["PWD", "OLDPWD", "SHLVL", "_"];

/// `value` as one line the in-guest shell turns back into the bytes with `printf '%b'`: bytes
/// of `[A-Za-z0-9._,:/@+=%-]` as they are, every other byte as `\0` and three octal digits
/// (POSIX `printf %b`). The line never holds a newline.
pub fn encode_env_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 8);
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"._,:/@+=%-".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("\\0{b:03o}"));
        }
    }
    out
}

/// The in-guest script of [`guest_command`]: `$@` is the names of the variables, `--`, then the
/// command. For each name it reads one line of stdin, decodes it with the shell's own `printf`
/// (a builtin: no process, so no command line holds the value) and exports it; then it removes
/// what the shell added itself and runs the command, whose stdin is what is left.
fn env_prelude_script(unset: &[&str]) -> String {
    let unset: String = unset.iter().map(|k| format!(" -u {k}")).collect();
    format!(
        r#"while [ "$1" != -- ]; do
  IFS= read -r felhom_v || {{ echo "felhom-exec: the values of the environment did not arrive" >&2; exit 125; }}
  felhom_v=$(printf '%bx' "$felhom_v")
  export "$1=${{felhom_v%x}}"
  shift
done
shift
exec /usr/bin/env{unset} "$@""#
    )
}

/// The command that runs `request` inside a container with exactly the controlled environment
/// and no variable value on any command line:
/// `/usr/bin/env -i PATH=… LANG=C.UTF-8 HOME=/root FELHOM_EXEC_ID=<id> /bin/sh -c <script>
/// felhom-exec [K…] -- argv…`, the values first on stdin (see [`GuestCommand`]). The defaults
/// (`PATH`, `LANG`, `HOME`) are on the command line; a request that sets one of them passes its
/// value on stdin like any other.
pub fn guest_command(request: &ExecRequest, exec_id: &str) -> Result<GuestCommand, String> {
    // The same checks as the direct form (program name, NUL bytes, names, the reserved tag).
    guest_argv(request, exec_id)?;
    if request.env.iter().any(|(k, _)| k == "felhom_v") {
        return Err("the environment variable name felhom_v is reserved".to_owned());
    }
    let mut keys: Vec<&str> = Vec::new();
    let mut values: Vec<&str> = Vec::new();
    for (key, value) in &request.env {
        match keys.iter().position(|k| *k == key.as_str()) {
            Some(i) => values[i] = value.as_str(),
            None => {
                keys.push(key.as_str());
                values.push(value.as_str());
            }
        }
    }
    let unset: Vec<&str> = SHELL_ADDED_VARS
        .into_iter()
        .filter(|v| !keys.contains(v))
        .collect();
    let mut argv: Vec<String> = vec![
        "/usr/bin/env".to_owned(),
        "-i".to_owned(),
        format!("PATH={GUEST_PATH}"),
        "LANG=C.UTF-8".to_owned(),
        "HOME=/root".to_owned(),
        format!("{EXEC_ID_VAR}={exec_id}"),
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        env_prelude_script(&unset),
        "felhom-exec".to_owned(),
    ];
    argv.extend(keys.iter().map(|k| (*k).to_owned()));
    argv.push("--".to_owned());
    argv.extend(request.argv.iter().cloned());
    let stdin = if values.is_empty() {
        request.stdin.clone()
    } else {
        let mut bytes = Vec::new();
        for v in &values {
            bytes.extend_from_slice(encode_env_value(v).as_bytes());
            bytes.push(b'\n');
        }
        if let Some(rest) = &request.stdin {
            bytes.extend_from_slice(rest);
        }
        Some(bytes)
    };
    Ok(GuestCommand { argv, stdin })
}

/// The in-guest script of a push: `$1` the path, `$2` the mode (octal). It writes stdin to a
/// new private file beside the path (`mktemp`, mode 0600), sets the mode and renames it over
/// the path, so the path is never half-written and a link at the path is replaced, not
/// followed; then it reads the file at the path back ([`READ_BACK`]: size, mode, SHA-256), so
/// one exec both writes and proves what landed. It runs as the guest's root inside the guest, so
/// the path resolves in the guest. Exit 1: the write failed; [`PUSH_READ_BACK_FAILED`]: the
/// file was written but could not be read back.
pub(crate) const PUSH_SCRIPT: &str = r#"umask 077
if [ -d "$1" ]; then echo "failed to create file: $1: Is a directory" >&2; exit 1; fi
t=$(mktemp "$1.XXXXXX") || { echo "failed to create file: $1" >&2; exit 1; }
if cat > "$t" && chmod "$2" "$t" && mv -f "$t" "$1"; then
  stat -c '%s %a' "$1" && sha256sum "$1" && exit 0
  exit 3
fi
rm -f "$t"
echo "failed to write file: $1" >&2
exit 1"#;

/// The exit status of [`PUSH_SCRIPT`] when the file was written but not read back.
pub(crate) const PUSH_READ_BACK_FAILED: i64 = 3;

/// The in-guest read-back of a pushed file (`$1`): `<size> <octal mode>`, then `sha256sum`'s line.
const READ_BACK: &str = "stat -c '%s %a' \"$1\" && sha256sum \"$1\"";

/// The request that writes `bytes` to `path` in the guest with permission bits `mode`.
pub(crate) fn push_request(
    path: &str,
    mode: u32,
    bytes: Vec<u8>,
    timeout: Duration,
) -> ExecRequest {
    ExecRequest::new([
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        PUSH_SCRIPT.to_owned(),
        "felhom-push".to_owned(),
        path.to_owned(),
        format!("{:04o}", mode & 0o7777),
    ])
    .stdin(bytes)
    .timeout(timeout)
    .output_cap(64 * 1024)
}

/// The in-guest script that signals every process tagged with one exec id: `TERM`, a grace
/// period, then `KILL`. Arguments: `$1` the exec id, `$2` the grace in whole seconds. It prints
/// the pids it signalled.
const SWEEP_SCRIPT: &str = r#"id=$1; grace=$2
sweep() {
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = "$$" ] && continue
    if tr '\000' '\n' < "$d/environ" 2>/dev/null | grep -qx "FELHOM_EXEC_ID=$id"; then
      kill -s "$1" "$p" 2>/dev/null && echo "$p"
    fi
  done
}
sweep TERM
[ "$grace" -gt 0 ] && sleep "$grace"
sweep KILL
exit 0"#;

/// The request that kills what is left of exec `exec_id` inside the guest.
pub(crate) fn sweep_request(exec_id: &str, grace: Duration, timeout: Duration) -> ExecRequest {
    let grace_secs = grace.as_secs() + u64::from(grace.subsec_nanos() > 0);
    ExecRequest::new([
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        SWEEP_SCRIPT.to_owned(),
        "felhom-sweep".to_owned(),
        exec_id.to_owned(),
        grace_secs.to_string(),
    ])
    .timeout(timeout + grace)
    .output_cap(64 * 1024)
}

/// Check that a guest path is absolute, plain and free of `..`.
pub(crate) fn check_guest_path(guest: GuestRef, path: &str) -> Result<(), ExecError> {
    let bad = |reason: &str| ExecError::InvalidRequest {
        guest,
        reason: format!("guest path {path:?} {reason}"),
    };
    if !path.starts_with('/') {
        return Err(bad("is not absolute"));
    }
    if path.ends_with('/') {
        return Err(bad("names a directory"));
    }
    if path.chars().any(|c| c == '\0' || c == '\n') {
        return Err(bad("contains a NUL or newline"));
    }
    if path.split('/').any(|part| part == "..") {
        return Err(bad("contains '..'"));
    }
    Ok(())
}

/// SHA-256 of bytes, hex.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Read back `path` in the guest and compare size, SHA-256 and mode with what was sent.
/// `context` (e.g. what the copy tool printed) is added to a mismatch message.
pub(crate) async fn verify_pushed<E: GuestExec + ?Sized>(
    exec: &E,
    path: &str,
    size: u64,
    sha256: &str,
    mode: u32,
    context: &str,
) -> Result<PushReceipt, ExecError> {
    let request = ExecRequest::new(["/bin/sh", "-c", READ_BACK, "felhom-verify", path])
        .timeout(VERIFY_TIMEOUT)
        .output_cap(16 * 1024);
    let outcome = exec.exec(&request).await?;
    check_read_back(exec.guest(), path, size, sha256, mode, context, &outcome)
}

/// Compare a read-back's output (`outcome` of [`READ_BACK`], or of [`PUSH_SCRIPT`], which ends
/// with it) with the size, SHA-256 and mode that were sent.
pub(crate) fn check_read_back(
    guest: GuestRef,
    path: &str,
    size: u64,
    sha256: &str,
    mode: u32,
    context: &str,
    outcome: &ExecOutcome,
) -> Result<PushReceipt, ExecError> {
    let unverified = |detail: String| {
        let detail = if context.is_empty() {
            detail
        } else {
            format!("{detail}; the copy reported: {context}")
        };
        ExecError::PushUnverified {
            guest,
            path: path.to_owned(),
            detail,
        }
    };
    if !outcome.success() {
        return Err(unverified(format!(
            "reading it back failed with {}",
            outcome.summary()
        )));
    }
    let text = outcome.stdout.text();
    let mut lines = text.lines();
    let (found_size, found_mode) = lines
        .next()
        .and_then(|l| l.split_once(' '))
        .and_then(|(s, m)| {
            Some((
                s.trim().parse::<u64>().ok()?,
                u32::from_str_radix(m.trim(), 8).ok()?,
            ))
        })
        .ok_or_else(|| unverified("unreadable stat output".to_owned()))?;
    let found_sha = lines
        .next()
        .and_then(|l| l.split_whitespace().next())
        .map(str::to_ascii_lowercase)
        .ok_or_else(|| unverified("unreadable sha256sum output".to_owned()))?;
    if found_size != size {
        return Err(unverified(format!(
            "expected {size} bytes, found {found_size}"
        )));
    }
    if found_sha != sha256 {
        return Err(unverified(format!(
            "expected sha256 {sha256}, found {found_sha}"
        )));
    }
    if found_mode != mode & 0o7777 {
        return Err(unverified(format!(
            "expected mode {:o}, found {found_mode:o}",
            mode & 0o7777
        )));
    }
    Ok(PushReceipt {
        path: path.to_owned(),
        size,
        sha256: sha256.to_owned(),
        mode: found_mode,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_argv_clears_the_environment_and_tags_the_command() {
        let req = ExecRequest::new(["osqueryi", "--json", "SELECT 1"])
            .env("FELHOM_TXN", "01ABC")
            .env("LANG", "de_DE.UTF-8");
        let argv = guest_argv(&req, "p-7").unwrap();
        assert_eq!(
            argv,
            [
                "/usr/bin/env",
                "-i",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/run/current-system/sw/bin",
                "LANG=de_DE.UTF-8",
                "HOME=/root",
                "FELHOM_TXN=01ABC",
                "FELHOM_EXEC_ID=p-7",
                "osqueryi",
                "--json",
                "SELECT 1",
            ]
        );
    }

    #[test]
    fn guest_command_names_variables_and_sends_their_values_on_stdin() {
        let req = ExecRequest::new(["app", "--serve"])
            .env("TOKEN", "s3cret value\nline2 \\ é")
            .env("LANG", "de_DE.UTF-8")
            .env("TOKEN", "s3cret-final")
            .stdin(b"own stdin".to_vec());
        let cmd = guest_command(&req, "p-7").unwrap();
        let argv = cmd.argv.join(" ");
        assert!(!argv.contains("s3cret"), "{argv}");
        assert!(!argv.contains("de_DE"), "{argv}");
        assert_eq!(cmd.argv[..2], ["/usr/bin/env", "-i"]);
        assert!(cmd.argv.contains(&"FELHOM_EXEC_ID=p-7".to_string()));
        let tail: Vec<&str> = cmd.argv[9..].iter().map(String::as_str).collect();
        assert_eq!(
            tail,
            ["felhom-exec", "TOKEN", "LANG", "--", "app", "--serve"]
        );
        assert_eq!(
            cmd.stdin.as_deref(),
            Some(&b"s3cret-final\nde_DE.UTF-8\nown stdin"[..])
        );
        let enc = encode_env_value("a b\n\\é'$");
        assert_eq!(enc, "a\\0040b\\0012\\0134\\0303\\0251\\0047\\0044");
        // No variables: the request's stdin as it is (None stays /dev/null).
        let plain = guest_command(&ExecRequest::new(["true"]), "x").unwrap();
        assert_eq!(plain.stdin, None);
        assert!(plain
            .argv
            .ends_with(&["felhom-exec".into(), "--".into(), "true".into()]));
        assert!(guest_command(&ExecRequest::new(["true"]).env("felhom_v", "x"), "x").is_err());
        assert!(!format!("{cmd:?}").contains("s3cret"));
    }

    #[test]
    fn guest_argv_refuses_what_env_would_misread() {
        for argv in [vec![], vec![""], vec!["A=B"], vec!["-i"]] {
            assert!(
                guest_argv(&ExecRequest::new(argv.clone()), "x").is_err(),
                "{argv:?}"
            );
        }
        for key in ["", "1A", "A-B", "A B", EXEC_ID_VAR] {
            let req = ExecRequest::new(["true"]).env(key, "v");
            assert!(guest_argv(&req, "x").is_err(), "{key:?}");
        }
        let req = ExecRequest::new(["true"]).env("A", "x\0y");
        assert!(guest_argv(&req, "x").is_err());
    }

    #[test]
    fn captured_keeps_at_most_the_cap() {
        let mut c = Captured::default();
        c.push_capped(b"hello", 8);
        assert!(!c.truncated);
        c.push_capped(b"world", 8);
        assert_eq!(c.bytes, b"hellowor");
        assert!(c.truncated);
        c.push_capped(b"!", 8);
        assert_eq!(c.bytes.len(), 8);
        assert_eq!(Captured::capped(b"abc".to_vec(), 2, false).bytes, b"ab");
        assert!(Captured::capped(b"abc".to_vec(), 2, false).truncated);
        assert!(!Captured::capped(b"abc".to_vec(), 3, false).truncated);
    }

    #[test]
    fn debug_output_hides_env_values_and_stdin() {
        let req = ExecRequest::new(["true"])
            .env("TOKEN", "s3cr3t-value")
            .stdin(b"s3cr3t-stdin".to_vec());
        let shown = format!("{req:?}");
        assert!(shown.contains("TOKEN"));
        assert!(!shown.contains("s3cr3t"), "{shown}");
        let src = PushSource::Bytes(b"s3cr3t".to_vec());
        assert!(!format!("{src:?}").contains("s3cr3t"));
    }

    #[test]
    fn guest_paths_are_checked() {
        let g = GuestRef {
            kind: GuestKind::Lxc,
            vmid: 101,
        };
        assert!(check_guest_path(g, "/var/lib/felhom/x").is_ok());
        for bad in ["relative", "/a/../b", "/dir/", "/a\nb"] {
            assert!(check_guest_path(g, bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn exec_ids_are_unique_and_prefixed() {
        let ids = ExecIds::with_prefix("t e/st");
        assert_eq!(ids.next_id(), "test-1");
        assert_eq!(ids.next_id(), "test-2");
        let a = ExecIds::random();
        let b = ExecIds::random();
        assert_ne!(a.next_id(), b.next_id());
    }

    #[test]
    fn summary_names_the_exit_and_last_stderr_line() {
        let o = ExecOutcome {
            exit: GuestExit::Exited(3),
            stdout: Captured::default(),
            stderr: Captured::capped(b"first\nError: no such table: x\n\n".to_vec(), 100, false),
            duration: Duration::from_millis(5),
        };
        assert_eq!(o.summary(), "exit status 3: Error: no such table: x");
        assert!(!o.success());
        assert_eq!(o.exit_code(), Some(3));
    }
}
