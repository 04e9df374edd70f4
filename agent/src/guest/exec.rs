//! The guest exec seam: [`GuestExec`] runs a command inside one guest and pushes files into it.
//!
//! Two implementations exist: [`crate::guest::lxc::LxcExec`] (`pct exec` / `pct push`) and
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::error::ErrorCode;
use crate::pve::GuestKind;

/// The default time a command may run.
pub const DEFAULT_EXEC_TIMEOUT: Duration = Duration::from_secs(60);
/// The default number of bytes kept per output stream.
pub const DEFAULT_OUTPUT_CAP: usize = 1024 * 1024;
/// `PATH` inside the guest (what `lxc-attach --clear-env` sets).
pub const GUEST_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
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
/// variables given here and the exec tag. Environment values are visible in the guest's and the
/// node's process lists while the command starts: hand secrets over in a pushed file or on stdin.
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
    Exited(i32),
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
    pub fn exit_code(&self) -> Option<i32> {
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
}

impl ExecError {
    /// The stable code.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Spawn { .. } => ErrorCode::ConfigInvalid,
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

/// The length and SHA-256 (hex) of a local file, read in chunks.
pub(crate) fn hash_local_file(path: &std::path::Path) -> std::io::Result<(u64, String)> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut len = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        len += n as u64;
    }
    Ok((len, hex::encode(hasher.finalize())))
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
    let guest = exec.guest();
    let request = ExecRequest::new([
        "/bin/sh",
        "-c",
        "stat -c '%s %a' \"$1\" && sha256sum \"$1\"",
        "felhom-verify",
        path,
    ])
    .timeout(VERIFY_TIMEOUT)
    .output_cap(16 * 1024);
    let outcome = exec.exec(&request).await?;
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
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
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
