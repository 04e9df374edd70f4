//! QEMU VMs: commands through the PVE guest agent API (`agent/exec`, then `agent/exec-status`
//! until `exited` is 1).
//!
//! [`GuestAgentApi`] is the seam to the PVE client (implemented there, faked in tests). The
//! command is sent as an array, wrapped in the same controlled environment as every guest
//! command (variable values first on stdin, never on the command line); stdin goes as
//! `input-data`. The final status is read exactly once: the guest agent
//! forgets a pid after it reported `exited`, so this module never asks again after that answer.
//! On timeout an in-guest sweep (a second `agent/exec`) sends SIGTERM, then SIGKILL, to every
//! process carrying the exec's tag, and the killed command's status is then collected once.
//! Files are pushed as base64 chunks through `agent/exec` stdin and verified by reading them
//! back.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use base64_chunks::encode_base64;
use tokio::time::Instant;

use super::exec::{
    check_guest_path, guest_argv, guest_command, sha256_hex, sweep_request, verify_pushed,
    Captured, ExecError, ExecIds, ExecOutcome, ExecRequest, GuestExec, GuestExit, GuestRef,
    PushReceipt, PushSource,
};
use crate::pve::GuestKind;

/// The most `input-data` PVE accepts in one `agent/exec` (characters; qemu-server
/// `PVE/API2/Qemu/Agent.pm` `exec`, schema `maxLength` 65536).
pub const MAX_INPUT_DATA: usize = 65536;
/// The largest POST body every supported PVE accepts: pve-http-server
/// `src/PVE/APIServer/AnyEvent.pm` `authenticate_and_handle_request` answers a `Content-Length`
/// over `$limit_max_post` with `501 for data too large`; that limit was 64 KiB until
/// libpve-http-server-perl 5.2.1 (512 KiB since, "fix #6230"). What counts is the body as
/// sent: the form-encoded `command` values and `input-data`.
pub const MAX_POST_BODY: usize = 64 * 1024;
/// `&input-data=` before the stdin value in the body.
const INPUT_DATA_KEY: &str = "&input-data=";

/// Raw bytes per push chunk when the rest of the `agent/exec` body (the form-encoded argv)
/// takes `fixed` bytes: the chunk is sent as base64 (4 characters per 3 bytes), and the form
/// encoding writes each base64 character that is not alphanumeric (`+`, `/`, the `=` padding)
/// as three (`%2B`, `%2F`, `%3D`); a chunk whose base64 is all such characters must fit, so
/// each base64 character is counted as three. Also within [`MAX_INPUT_DATA`]. `None`: the
/// argv alone leaves no room.
pub fn push_chunk_bytes(fixed: usize) -> Option<usize> {
    let room = MAX_POST_BODY.checked_sub(fixed + INPUT_DATA_KEY.len())?;
    let b64_chars = (room / 3).min(MAX_INPUT_DATA) / 4 * 4;
    let raw = b64_chars / 4 * 3;
    (raw > 0).then_some(raw)
}

/// The `agent/exec` body for `argv` and `input` as the PVE client sends it, in bytes.
fn exec_body_len(argv: &[String], input: Option<&str>) -> usize {
    crate::pve::request::build::agent_exec("node", 0, argv, input)
        .body()
        .map_or(0, |b| b.len())
}
/// Time allowed for each step of a push.
const PUSH_STEP_TIMEOUT: Duration = Duration::from_secs(120);
/// In-guest script: decode base64 stdin into a new private file `$1`.
pub(crate) const CHUNK_FIRST_SCRIPT: &str = "umask 077 && base64 -d > \"$1\"";
/// In-guest script: decode base64 stdin and append it to `$1`.
pub(crate) const CHUNK_APPEND_SCRIPT: &str = "base64 -d >> \"$1\"";
/// In-guest script: set mode `$2` on `$1` and rename it to `$3`.
pub(crate) const FINALIZE_SCRIPT: &str = "chmod \"$2\" \"$1\" && mv -f \"$1\" \"$3\"";
/// In-guest script: remove `$1`.
pub(crate) const REMOVE_SCRIPT: &str = "rm -f \"$1\"";

/// What a guest agent API call can answer besides success.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentApiError {
    /// `VM <vmid> is not running`.
    #[error("the VM is not running")]
    NotRunning,
    /// `QEMU guest agent is not running` (not installed, not started, or still booting).
    #[error("the QEMU guest agent is not running")]
    AgentNotRunning,
    /// `No QEMU guest agent configured`.
    #[error("no QEMU guest agent is configured")]
    NoAgentConfigured,
    /// Any other answer, with PVE's status and words.
    #[error("{status} {message}")]
    Other {
        /// HTTP status.
        status: u16,
        /// PVE's message, first line.
        message: String,
    },
    /// No answer (connection refused, reset, timeout).
    #[error("no answer: {message}")]
    Transport {
        /// What the transport said.
        message: String,
    },
}

impl AgentApiError {
    /// Classify a PVE error answer (status and message) of an agent endpoint by PVE's wording.
    pub fn classify(status: u16, message: &str) -> Self {
        let line = message.lines().next().unwrap_or("").trim();
        if line.starts_with("No QEMU guest agent configured") {
            Self::NoAgentConfigured
        } else if line.starts_with("QEMU guest agent is not running") {
            Self::AgentNotRunning
        } else if line.starts_with("VM ") && line.ends_with(" is not running") {
            Self::NotRunning
        } else {
            Self::Other {
                status,
                message: line.to_owned(),
            }
        }
    }
}

/// The `data` of `agent/exec-status`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentExecStatus {
    /// The command ended and its output pipes closed.
    pub exited: bool,
    /// Its exit status, when it exited normally: an `i64`, as PVE's schema has it (a Windows
    /// guest reports NTSTATUS values such as 3221225477, 0xC0000005).
    pub exitcode: Option<i64>,
    /// The signal that killed it.
    pub signal: Option<i32>,
    /// stdout, already base64-decoded by PVE.
    pub out_data: Option<String>,
    /// stderr, already base64-decoded by PVE.
    pub err_data: Option<String>,
    /// The guest agent cut stdout (16 MiB).
    pub out_truncated: bool,
    /// The guest agent cut stderr.
    pub err_truncated: bool,
}

impl AgentExecStatus {
    /// Decode the `data` object. `exited` and the `*-truncated` flags are accepted as 0/1 (what
    /// PVE sends) or as JSON booleans.
    pub fn from_json(data: &serde_json::Value) -> Result<Self, String> {
        let obj = data
            .as_object()
            .ok_or_else(|| format!("exec-status data is not an object: {data}"))?;
        let flag = |key: &str| -> Result<bool, String> {
            match obj.get(key) {
                None | Some(serde_json::Value::Null) => Ok(false),
                Some(serde_json::Value::Bool(b)) => Ok(*b),
                Some(v) => match v.as_i64() {
                    Some(n) => Ok(n != 0),
                    None => Err(format!("exec-status {key} is not a flag: {v}")),
                },
            }
        };
        let int = |key: &str| -> Result<Option<i64>, String> {
            match obj.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => v
                    .as_i64()
                    .or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()))
                    .map(Some)
                    .ok_or_else(|| format!("exec-status {key} is not an integer: {v}")),
            }
        };
        let text = |key: &str| -> Result<Option<String>, String> {
            match obj.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                Some(v) => Err(format!("exec-status {key} is not a string: {v}")),
            }
        };
        Ok(Self {
            exited: flag("exited")?,
            exitcode: int("exitcode")?,
            signal: int("signal")?
                .map(|n| {
                    i32::try_from(n).map_err(|_| format!("exec-status signal {n} is out of range"))
                })
                .transpose()?,
            out_data: text("out-data")?,
            err_data: text("err-data")?,
            out_truncated: flag("out-truncated")?,
            err_truncated: flag("err-truncated")?,
        })
    }
}

/// The bytes of an `out-data` / `err-data` string. PVE may hand guest output over with every
/// byte as one character (non-ASCII output double-encoded); such text is turned back into
/// its bytes when they form valid UTF-8, else the string is taken as it is.
pub fn agent_output_bytes(text: &str) -> Vec<u8> {
    if text.chars().all(|c| u32::from(c) <= 0xFF) {
        let bytes: Vec<u8> = text
            .chars()
            .map(|c| u8::try_from(u32::from(c)).unwrap_or(b'?'))
            .collect();
        if std::str::from_utf8(&bytes).is_ok() {
            return bytes;
        }
    }
    text.as_bytes().to_vec()
}

/// The guest agent endpoints this module needs. Implemented by the PVE client.
pub trait GuestAgentApi: Send + Sync {
    /// `POST /nodes/{node}/qemu/{vmid}/agent/exec` with `command` as an array and optional
    /// `input-data`; the guest agent's pid of the command.
    fn agent_exec(
        &self,
        node: &str,
        vmid: u32,
        command: &[String],
        input_data: Option<&str>,
    ) -> impl Future<Output = Result<u64, AgentApiError>> + Send;

    /// `GET /nodes/{node}/qemu/{vmid}/agent/exec-status?pid={pid}`.
    fn agent_exec_status(
        &self,
        node: &str,
        vmid: u32,
        pid: u64,
    ) -> impl Future<Output = Result<AgentExecStatus, AgentApiError>> + Send;
}

impl<T: GuestAgentApi> GuestAgentApi for &T {
    fn agent_exec(
        &self,
        node: &str,
        vmid: u32,
        command: &[String],
        input_data: Option<&str>,
    ) -> impl Future<Output = Result<u64, AgentApiError>> + Send {
        (**self).agent_exec(node, vmid, command, input_data)
    }

    fn agent_exec_status(
        &self,
        node: &str,
        vmid: u32,
        pid: u64,
    ) -> impl Future<Output = Result<AgentExecStatus, AgentApiError>> + Send {
        (**self).agent_exec_status(node, vmid, pid)
    }
}

impl<T: GuestAgentApi> GuestAgentApi for Arc<T> {
    fn agent_exec(
        &self,
        node: &str,
        vmid: u32,
        command: &[String],
        input_data: Option<&str>,
    ) -> impl Future<Output = Result<u64, AgentApiError>> + Send {
        (**self).agent_exec(node, vmid, command, input_data)
    }

    fn agent_exec_status(
        &self,
        node: &str,
        vmid: u32,
        pid: u64,
    ) -> impl Future<Output = Result<AgentExecStatus, AgentApiError>> + Send {
        (**self).agent_exec_status(node, vmid, pid)
    }
}

/// How many answers "QEMU guest agent is not running" in a row a command's status poll takes
/// before it gives up: qemu-server pings the guest agent (3 s timeout) before each
/// `exec-status` (`QemuServer/Agent.pm` `agent_cmd` → `assert_agent_available` →
/// `qga_check_running`), so an agent busy for a moment under a long command answers like a dead
/// one; the poll's doubling wait (up to `poll_max`) spaces the tries.
const AGENT_SILENCES: u32 = 3;

/// How the guest agent is polled.
#[derive(Debug, Clone)]
pub struct QemuConfig {
    /// First wait before asking for the status.
    pub poll_initial: Duration,
    /// Longest wait between two status requests (the wait doubles up to it).
    pub poll_max: Duration,
    /// Time between SIGTERM and SIGKILL of the in-guest sweep after a timeout.
    pub kill_grace: Duration,
    /// Time allowed for the sweep itself.
    pub sweep_timeout: Duration,
    /// Time allowed, after the sweep, to collect the killed command's final status.
    pub collect_timeout: Duration,
    /// Consecutive transport failures tolerated while polling.
    pub transport_retries: u32,
}

impl Default for QemuConfig {
    fn default() -> Self {
        Self {
            poll_initial: Duration::from_millis(100),
            poll_max: Duration::from_secs(1),
            kill_grace: Duration::from_secs(3),
            sweep_timeout: Duration::from_secs(15),
            collect_timeout: Duration::from_secs(10),
            transport_retries: 3,
        }
    }
}

/// Exec into one QEMU VM through the guest agent API.
#[derive(Debug)]
pub struct QemuExec<A> {
    api: A,
    node: String,
    vmid: u32,
    config: QemuConfig,
    ids: ExecIds,
}

impl<A: GuestAgentApi> QemuExec<A> {
    /// Exec into VM `vmid` on `node` through `api`.
    pub fn new(api: A, node: impl Into<String>, vmid: u32, config: QemuConfig) -> Self {
        Self {
            api,
            node: node.into(),
            vmid,
            config,
            ids: ExecIds::random(),
        }
    }

    /// Use these exec ids (tests that script the guest agent by exact argv).
    pub fn with_exec_ids(mut self, ids: ExecIds) -> Self {
        self.ids = ids;
        self
    }

    fn guest_ref(&self) -> GuestRef {
        GuestRef {
            kind: GuestKind::Qemu,
            vmid: self.vmid,
        }
    }

    fn map_error(&self, err: AgentApiError, pid: Option<u64>) -> ExecError {
        let guest = self.guest_ref();
        match err {
            AgentApiError::NotRunning => ExecError::NotRunning { guest },
            AgentApiError::AgentNotRunning => ExecError::AgentNotRunning { guest },
            AgentApiError::NoAgentConfigured => ExecError::NoAgentConfigured { guest },
            AgentApiError::Other { message, .. }
                if pid.is_some() && message.contains("Invalid parameter 'pid'") =>
            {
                ExecError::StatusLost {
                    guest,
                    pid: pid.unwrap_or_default(),
                }
            }
            other => ExecError::Agent {
                guest,
                message: other.to_string(),
            },
        }
    }

    /// Start `request` under a fresh exec id: the guest agent pid and the id.
    async fn start(&self, request: &ExecRequest) -> Result<(u64, String), ExecError> {
        let guest = self.guest_ref();
        let exec_id = self.ids.next_id();
        // With variables, their values go first on stdin and the command line names them only
        // (`guest_command`), as in a container: nothing in the VM's process list shows them.
        let (argv, stdin) = if request.env.is_empty() {
            let argv = guest_argv(request, &exec_id)
                .map_err(|reason| ExecError::InvalidRequest { guest, reason })?;
            (argv, request.stdin.clone())
        } else {
            let cmd = guest_command(request, &exec_id)
                .map_err(|reason| ExecError::InvalidRequest { guest, reason })?;
            (cmd.argv, cmd.stdin)
        };
        let input = match &stdin {
            None => None,
            Some(bytes) => {
                let text = std::str::from_utf8(bytes).map_err(|_| ExecError::InvalidRequest {
                    guest,
                    reason: "stdin for a VM must be text (send binary data base64-encoded)"
                        .to_owned(),
                })?;
                if text.chars().count() > MAX_INPUT_DATA {
                    return Err(ExecError::InvalidRequest {
                        guest,
                        reason: format!(
                            "stdin for a VM is limited to {MAX_INPUT_DATA} characters per command"
                        ),
                    });
                }
                Some(text)
            }
        };
        let body = exec_body_len(&argv, input);
        if body > MAX_POST_BODY {
            return Err(ExecError::InvalidRequest {
                guest,
                reason: format!(
                    "the command and its stdin make a {body}-byte request, over the \
                     {MAX_POST_BODY}-byte POST body PVE accepts"
                ),
            });
        }
        let pid = self
            .api
            .agent_exec(&self.node, self.vmid, &argv, input)
            .await
            .map_err(|e| self.map_error(e, None))?;
        Ok((pid, exec_id))
    }

    /// Poll until the command exited (its status, read exactly once) or `deadline` passed
    /// (`None`; asked one last time at the deadline).
    async fn wait_status(
        &self,
        pid: u64,
        deadline: Instant,
    ) -> Result<Option<AgentExecStatus>, ExecError> {
        let mut interval = self.config.poll_initial;
        let mut transport_failures = 0;
        let mut agent_silences = 0;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            tokio::time::sleep(interval.min(remaining)).await;
            match self.api.agent_exec_status(&self.node, self.vmid, pid).await {
                // The final answer: the guest agent forgets the pid now; never ask again.
                Ok(status) if status.exited => return Ok(Some(status)),
                Ok(_) => {
                    transport_failures = 0;
                    agent_silences = 0;
                }
                Err(AgentApiError::Transport { .. })
                    if transport_failures < self.config.transport_retries =>
                {
                    transport_failures += 1;
                }
                // A ping that timed out before the status was asked: asked again, bounded.
                Err(AgentApiError::AgentNotRunning) if agent_silences < AGENT_SILENCES => {
                    agent_silences += 1;
                }
                Err(e) => return Err(self.map_error(e, Some(pid))),
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            interval = (interval * 2).min(self.config.poll_max);
        }
    }

    fn outcome_from(
        &self,
        status: &AgentExecStatus,
        cap: usize,
        duration: Duration,
    ) -> Result<ExecOutcome, ExecError> {
        let exit = match (status.exitcode, status.signal) {
            (Some(code), _) => GuestExit::Exited(code),
            (None, Some(sig)) => GuestExit::Signaled(sig),
            (None, None) => {
                return Err(ExecError::Agent {
                    guest: self.guest_ref(),
                    message: "exec-status reported the end without exit code or signal".to_owned(),
                })
            }
        };
        Ok(ExecOutcome {
            exit,
            stdout: captured(status.out_data.as_deref(), cap, status.out_truncated),
            stderr: captured(status.err_data.as_deref(), cap, status.err_truncated),
            duration,
        })
    }

    /// Kill, inside the VM, everything that carries `exec_id`.
    async fn sweep(&self, exec_id: &str) {
        let request = sweep_request(exec_id, self.config.kill_grace, self.config.sweep_timeout);
        let result = async {
            let (pid, _) = self.start(&request).await?;
            self.wait_status(pid, Instant::now() + request.timeout)
                .await
        }
        .await;
        match result {
            Ok(Some(status)) => {
                let killed = status
                    .out_data
                    .as_deref()
                    .map_or(0, |s| s.split_whitespace().count());
                if killed > 0 {
                    tracing::warn!(
                        vmid = self.vmid,
                        killed,
                        "killed processes of a timed-out command inside the VM"
                    );
                }
            }
            Ok(None) => {
                tracing::warn!(
                    vmid = self.vmid,
                    "in-VM sweep after a timeout did not finish in time"
                );
            }
            Err(e) => {
                tracing::warn!(vmid = self.vmid, error = %e, "in-VM sweep after a timeout could not run");
            }
        }
    }

    /// Run one step of a push; anything but exit 0 is a push failure.
    async fn push_step(
        &self,
        guest_path: &str,
        script: &str,
        args: &[&str],
        stdin: Option<String>,
    ) -> Result<(), ExecError> {
        let mut argv = vec!["/bin/sh", "-c", script, "felhom-push"];
        argv.extend_from_slice(args);
        let mut request = ExecRequest::new(argv)
            .timeout(PUSH_STEP_TIMEOUT)
            .output_cap(16 * 1024);
        if let Some(text) = stdin {
            request = request.stdin(text.into_bytes());
        }
        let outcome = self.exec(&request).await?;
        if outcome.success() {
            Ok(())
        } else {
            Err(ExecError::PushFailed {
                guest: self.guest_ref(),
                path: guest_path.to_owned(),
                detail: outcome.summary(),
            })
        }
    }

    async fn push_bytes(
        &self,
        bytes: &[u8],
        guest_path: &str,
        mode: u32,
    ) -> Result<PushReceipt, ExecError> {
        let part = format!("{guest_path}.felhom-{}.part", ulid::Ulid::new());
        // The chunk size from the longer of the two chunk commands, with the longest exec id.
        let fixed = [CHUNK_FIRST_SCRIPT, CHUNK_APPEND_SCRIPT]
            .iter()
            .map(|script| {
                let request =
                    ExecRequest::new(vec!["/bin/sh", "-c", script, "felhom-push", part.as_str()]);
                guest_argv(&request, &self.ids.longest_id())
                    .map_or(MAX_POST_BODY, |argv| exec_body_len(&argv, None))
            })
            .max()
            .unwrap_or(MAX_POST_BODY);
        let chunk = push_chunk_bytes(fixed).ok_or_else(|| ExecError::InvalidRequest {
            guest: self.guest_ref(),
            reason: format!(
                "the path {guest_path:?} leaves no room for data in a {MAX_POST_BODY}-byte request"
            ),
        })?;
        let copy = async {
            let mut chunks = bytes.chunks(chunk);
            let first = chunks.next().unwrap_or(&[]);
            self.push_step(
                guest_path,
                CHUNK_FIRST_SCRIPT,
                &[&part],
                Some(encode_base64(first)),
            )
            .await?;
            for chunk in chunks {
                self.push_step(
                    guest_path,
                    CHUNK_APPEND_SCRIPT,
                    &[&part],
                    Some(encode_base64(chunk)),
                )
                .await?;
            }
            let mode_text = format!("{:o}", mode & 0o7777);
            self.push_step(
                guest_path,
                FINALIZE_SCRIPT,
                &[&part, &mode_text, guest_path],
                None,
            )
            .await
        }
        .await;
        if let Err(e) = copy {
            // Best effort: do not leave the partial file behind.
            let _ = self
                .push_step(guest_path, REMOVE_SCRIPT, &[&part], None)
                .await;
            return Err(e);
        }
        verify_pushed(
            self,
            guest_path,
            bytes.len() as u64,
            &sha256_hex(bytes),
            mode,
            "",
        )
        .await
    }
}

fn captured(text: Option<&str>, cap: usize, truncated: bool) -> Captured {
    Captured::capped(agent_output_bytes(text.unwrap_or("")), cap, truncated)
}

impl<A: GuestAgentApi> GuestExec for QemuExec<A> {
    fn guest(&self) -> GuestRef {
        self.guest_ref()
    }

    async fn exec(&self, request: &ExecRequest) -> Result<ExecOutcome, ExecError> {
        let started = Instant::now();
        let (pid, exec_id) = self.start(request).await?;
        let deadline = started + request.timeout;
        if let Some(status) = self.wait_status(pid, deadline).await? {
            return self.outcome_from(&status, request.output_cap, started.elapsed());
        }
        self.sweep(&exec_id).await;
        // Collect the killed command's status once, for its output (and so the guest agent
        // can forget it).
        let late = self
            .wait_status(pid, Instant::now() + self.config.collect_timeout)
            .await
            .ok()
            .flatten();
        let (stdout, stderr) = match late {
            Some(s) => (
                captured(s.out_data.as_deref(), request.output_cap, s.out_truncated),
                captured(s.err_data.as_deref(), request.output_cap, s.err_truncated),
            ),
            None => (Captured::default(), Captured::default()),
        };
        Ok(ExecOutcome {
            exit: GuestExit::TimedOut,
            stdout,
            stderr,
            duration: started.elapsed(),
        })
    }

    async fn push_file(
        &self,
        source: &PushSource,
        guest_path: &str,
        mode: u32,
    ) -> Result<PushReceipt, ExecError> {
        let guest = self.guest_ref();
        check_guest_path(guest, guest_path)?;
        match source {
            PushSource::Bytes(bytes) => self.push_bytes(bytes, guest_path, mode).await,
            PushSource::Path(path) => {
                let bytes = tokio::fs::read(path)
                    .await
                    .map_err(|source| ExecError::LocalFile {
                        guest,
                        path: path.clone(),
                        source,
                    })?;
                self.push_bytes(&bytes, guest_path, mode).await
            }
        }
    }
}

/// Standard base64 (RFC 4648, with padding), what `base64 -d` in the guest reads.
mod base64_chunks {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

    /// Encode bytes as base64 text.
    pub fn encode_base64(bytes: &[u8]) -> String {
        let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
        for chunk in bytes.chunks(3) {
            let b = [
                chunk[0],
                chunk.get(1).copied().unwrap_or(0),
                chunk.get(2).copied().unwrap_or(0),
            ];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            let sym = |shift: u32| char::from(ALPHABET[((n >> shift) & 63) as usize]);
            out.push(sym(18));
            out.push(sym(12));
            out.push(if chunk.len() > 1 { sym(6) } else { '=' });
            out.push(if chunk.len() > 2 { sym(0) } else { '=' });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// What the fake guest does with a command.
    #[derive(Clone)]
    enum Script {
        /// Exit after `polls` status requests that answer "still running".
        Exit {
            polls: u32,
            code: i64,
            out: String,
            err: String,
        },
        /// Never end on its own (until a sweep kills it).
        Hang,
    }

    struct Proc {
        exec_id: String,
        polls_left: u32,
        result: Option<AgentExecStatus>,
        fetched: bool,
    }

    #[derive(Default)]
    struct State {
        next_pid: u64,
        procs: HashMap<u64, Proc>,
        /// Every argv sent to agent/exec, as sent.
        execs: Vec<Vec<String>>,
        /// Status requests for a pid whose final answer had already been given.
        asked_after_final: Vec<u64>,
        /// Status requests per pid.
        status_calls: HashMap<u64, u32>,
        /// The simulated guest file system: path -> (bytes, mode).
        files: HashMap<String, (Vec<u8>, u32)>,
        /// Returned by the next agent/exec instead of a pid.
        exec_error: Option<AgentApiError>,
        /// Corrupt every finalized file (drop its last byte).
        corrupt_files: bool,
    }

    type Behaviour = Box<dyn Fn(&[String]) -> Script + Send + Sync>;

    struct FakeAgent {
        state: Mutex<State>,
        behaviour: Behaviour,
    }

    impl FakeAgent {
        fn new(behaviour: impl Fn(&[String]) -> Script + Send + Sync + 'static) -> Self {
            Self {
                state: Mutex::new(State::default()),
                behaviour: Box::new(behaviour),
            }
        }

        fn state(&self) -> std::sync::MutexGuard<'_, State> {
            self.state.lock().unwrap()
        }
    }

    /// Split the controlled-environment wrapper off: (exec id, the command as requested).
    fn unwrap_env(argv: &[String]) -> (String, Vec<String>) {
        assert_eq!(argv[0], "/usr/bin/env");
        assert_eq!(argv[1], "-i");
        let mut id = String::new();
        let mut i = 2;
        while let Some((k, v)) = argv[i].split_once('=') {
            if k == "FELHOM_EXEC_ID" {
                id = v.to_owned();
            }
            i += 1;
        }
        (id, argv[i..].to_vec())
    }

    fn decode_base64(text: &str) -> Vec<u8> {
        let val = |c: u8| -> u32 {
            match c {
                b'A'..=b'Z' => u32::from(c - b'A'),
                b'a'..=b'z' => u32::from(c - b'a') + 26,
                b'0'..=b'9' => u32::from(c - b'0') + 52,
                b'+' => 62,
                b'/' => 63,
                _ => 0,
            }
        };
        let mut out = Vec::new();
        for q in text.as_bytes().chunks(4) {
            let n = (val(q[0]) << 18) | (val(q[1]) << 12) | (val(q[2]) << 6) | val(q[3]);
            out.push((n >> 16) as u8);
            if q[2] != b'=' {
                out.push((n >> 8) as u8);
            }
            if q[3] != b'=' {
                out.push(n as u8);
            }
        }
        out
    }

    fn done(code: i64, out: &str) -> Option<AgentExecStatus> {
        Some(AgentExecStatus {
            exited: true,
            exitcode: Some(code),
            out_data: Some(out.to_owned()),
            err_data: Some(String::new()),
            ..AgentExecStatus::default()
        })
    }

    impl GuestAgentApi for FakeAgent {
        async fn agent_exec(
            &self,
            node: &str,
            vmid: u32,
            command: &[String],
            input_data: Option<&str>,
        ) -> Result<u64, AgentApiError> {
            assert_eq!((node, vmid), ("pve1", 300));
            let mut st = self.state();
            if let Some(e) = st.exec_error.take() {
                return Err(e);
            }
            st.execs.push(command.to_vec());
            st.next_pid += 1;
            let pid = st.next_pid;
            let (exec_id, cmd) = unwrap_env(command);
            let script = cmd.get(2).cloned().unwrap_or_default();
            let result = if cmd.first().map(String::as_str) == Some("/bin/sh")
                && cmd.get(3).map(String::as_str) == Some("felhom-sweep")
            {
                // The sweep: kill every process of the target exec id.
                let target = cmd[4].clone();
                let mut killed = String::new();
                for (p, proc_) in st.procs.iter_mut() {
                    if proc_.exec_id == target && proc_.result.is_none() {
                        proc_.result = Some(AgentExecStatus {
                            exited: true,
                            signal: Some(15),
                            out_data: Some("partial output\n".to_owned()),
                            ..AgentExecStatus::default()
                        });
                        killed.push_str(&format!("{p}\n"));
                    }
                }
                done(0, &killed)
            } else if script == CHUNK_FIRST_SCRIPT || script == CHUNK_APPEND_SCRIPT {
                let data = decode_base64(input_data.unwrap_or(""));
                let entry = st
                    .files
                    .entry(cmd[4].clone())
                    .or_insert((Vec::new(), 0o600));
                if script == CHUNK_FIRST_SCRIPT {
                    entry.0.clear();
                }
                entry.0.extend_from_slice(&data);
                done(0, "")
            } else if script == FINALIZE_SCRIPT {
                let (part, mode, dest) = (cmd[4].clone(), cmd[5].clone(), cmd[6].clone());
                let (mut bytes, _) = st.files.remove(&part).unwrap();
                if st.corrupt_files {
                    bytes.pop();
                }
                let mode = u32::from_str_radix(&mode, 8).unwrap();
                st.files.insert(dest, (bytes, mode));
                done(0, "")
            } else if script == REMOVE_SCRIPT {
                st.files.remove(&cmd[4]);
                done(0, "")
            } else if script.starts_with("stat -c") {
                match st.files.get(&cmd[4]) {
                    Some((bytes, mode)) => done(
                        0,
                        &format!(
                            "{} {:o}\n{}  {}\n",
                            bytes.len(),
                            mode,
                            sha256_hex(bytes),
                            cmd[4]
                        ),
                    ),
                    None => done(1, ""),
                }
            } else {
                match (self.behaviour)(&cmd) {
                    Script::Exit {
                        polls,
                        code,
                        out,
                        err,
                    } => {
                        let mut s = done(code, &out);
                        if let Some(s) = s.as_mut() {
                            s.err_data = Some(err);
                        }
                        st.procs.insert(
                            pid,
                            Proc {
                                exec_id,
                                polls_left: polls,
                                result: s,
                                fetched: false,
                            },
                        );
                        return Ok(pid);
                    }
                    Script::Hang => {
                        st.procs.insert(
                            pid,
                            Proc {
                                exec_id,
                                polls_left: u32::MAX,
                                result: None,
                                fetched: false,
                            },
                        );
                        return Ok(pid);
                    }
                }
            };
            st.procs.insert(
                pid,
                Proc {
                    exec_id,
                    polls_left: 0,
                    result,
                    fetched: false,
                },
            );
            Ok(pid)
        }

        async fn agent_exec_status(
            &self,
            _node: &str,
            _vmid: u32,
            pid: u64,
        ) -> Result<AgentExecStatus, AgentApiError> {
            let mut st = self.state();
            *st.status_calls.entry(pid).or_default() += 1;
            let Some(proc_) = st.procs.get_mut(&pid) else {
                return Err(AgentApiError::Other {
                    status: 500,
                    message: "Agent error: Invalid parameter 'pid'".to_owned(),
                });
            };
            if proc_.fetched {
                st.asked_after_final.push(pid);
                return Err(AgentApiError::Other {
                    status: 500,
                    message: "Agent error: Invalid parameter 'pid'".to_owned(),
                });
            }
            if proc_.polls_left > 0 && proc_.polls_left != u32::MAX {
                proc_.polls_left -= 1;
                return Ok(AgentExecStatus::default());
            }
            match proc_.result.clone() {
                Some(status) => {
                    proc_.fetched = true;
                    Ok(status)
                }
                None => Ok(AgentExecStatus::default()),
            }
        }
    }

    fn fast() -> QemuConfig {
        QemuConfig {
            poll_initial: Duration::from_millis(100),
            poll_max: Duration::from_millis(400),
            kill_grace: Duration::from_secs(1),
            sweep_timeout: Duration::from_secs(5),
            collect_timeout: Duration::from_secs(5),
            transport_retries: 2,
        }
    }

    fn vm(agent: &FakeAgent) -> QemuExec<&FakeAgent> {
        QemuExec::new(agent, "pve1", 300, fast()).with_exec_ids(ExecIds::with_prefix("t"))
    }

    #[tokio::test(start_paused = true)]
    async fn a_windows_exit_status_beyond_i32_is_reported_as_such() {
        // NTSTATUS 0xC0000005 (access violation), as qemu-ga on Windows reports it.
        let agent = FakeAgent::new(|_| Script::Exit {
            polls: 0,
            code: 3_221_225_477,
            out: String::new(),
            err: String::new(),
        });
        let outcome = vm(&agent)
            .exec(&ExecRequest::new(["cmd.exe", "/c", "crash"]))
            .await
            .unwrap();
        assert_eq!(outcome.exit, GuestExit::Exited(3_221_225_477));
        assert_eq!(outcome.exit_code(), Some(3_221_225_477));
        assert_eq!(outcome.summary(), "exit status 3221225477");
        // As PVE's JSON has it, a number or a string.
        for data in [
            serde_json::json!({"exited": 1, "exitcode": 3_221_225_477_i64}),
            serde_json::json!({"exited": 1, "exitcode": "3221225477"}),
        ] {
            let s = AgentExecStatus::from_json(&data).unwrap();
            assert_eq!(s.exitcode, Some(3_221_225_477));
        }
    }

    #[test]
    fn push_chunks_fit_the_post_limit_in_the_worst_case() {
        // The longest exec id and a long path: the argv as the push sends it.
        let ids = ExecIds::random();
        let path = format!("/{}", "p".repeat(1000));
        let part = format!("{path}.felhom-{}.part", ulid::Ulid::new());
        let request =
            ExecRequest::new(["/bin/sh", "-c", CHUNK_APPEND_SCRIPT, "felhom-push", &part]);
        let argv = guest_argv(&request, &ids.longest_id()).unwrap();
        let fixed = exec_body_len(&argv, None);
        let n = push_chunk_bytes(fixed).unwrap();
        // Worst case: bytes whose base64 is all '/' (form-encoded as %2F, three bytes each).
        let worst = encode_base64(&vec![0xFF; n]);
        assert!(worst.chars().all(|c| c == '/'), "{}", &worst[..8]);
        let body = crate::pve::request::build::agent_exec("pve1", 300, &argv, Some(&worst))
            .body()
            .unwrap();
        assert_eq!(body.len(), fixed + "&input-data=".len() + 3 * worst.len());
        assert!(body.len() <= MAX_POST_BODY, "{} bytes", body.len());
        assert!(worst.len() <= MAX_INPUT_DATA);
        // One base64 quantum more would not fit.
        let more = encode_base64(&vec![0xFF; n + 3]);
        assert!(exec_body_len(&argv, Some(&more)) > MAX_POST_BODY);
        // The padding is counted too: a last chunk of 1 or 2 bytes ends in `%3D`.
        let padded = encode_base64(&vec![0xFF; n - 1]);
        assert!(padded.ends_with('='));
        assert!(exec_body_len(&argv, Some(&padded)) <= MAX_POST_BODY);
        // A path that leaves no room is refused, not sent.
        assert_eq!(push_chunk_bytes(MAX_POST_BODY), None);
    }

    #[tokio::test(start_paused = true)]
    async fn exit_code_and_output_are_reported_and_the_status_is_read_once() {
        let agent = FakeAgent::new(|cmd| {
            assert_eq!(cmd, ["sh", "-c", "exit 3"]);
            Script::Exit {
                polls: 4,
                code: 3,
                out: "out\n".into(),
                err: "err\n".into(),
            }
        });
        let outcome = vm(&agent)
            .exec(&ExecRequest::new(["sh", "-c", "exit 3"]))
            .await
            .unwrap();
        assert_eq!(outcome.exit, GuestExit::Exited(3));
        assert_eq!(outcome.stdout.bytes, b"out\n");
        assert_eq!(outcome.stderr.bytes, b"err\n");
        let st = agent.state();
        // Four "still running" answers, then the final one; never asked after it.
        assert_eq!(st.status_calls.get(&1), Some(&5));
        assert!(st.asked_after_final.is_empty());
        // The command went out as an array inside the controlled environment.
        assert_eq!(
            st.execs[0][..3],
            [
                "/usr/bin/env".to_owned(),
                "-i".to_owned(),
                format!("PATH={}", super::super::exec::GUEST_PATH)
            ]
        );
        assert!(st.execs[0].contains(&"FELHOM_EXEC_ID=t-1".to_owned()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_timeout_sweeps_the_command_and_collects_it_once() {
        let agent = FakeAgent::new(|_| Script::Hang);
        let started = Instant::now();
        let outcome = vm(&agent)
            .exec(&ExecRequest::new(["sleep", "1000"]).timeout(Duration::from_secs(5)))
            .await
            .unwrap();
        assert_eq!(outcome.exit, GuestExit::TimedOut);
        assert!(started.elapsed() >= Duration::from_secs(5));
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{:?}",
            started.elapsed()
        );
        // The killed command's output was collected after the sweep.
        assert_eq!(outcome.stdout.bytes, b"partial output\n");
        let st = agent.state();
        assert_eq!(st.execs.len(), 2, "the command and one sweep");
        let (_, sweep) = unwrap_env(&st.execs[1]);
        assert_eq!(sweep[3], "felhom-sweep");
        assert_eq!(sweep[4], "t-1", "the sweep targets the timed-out exec");
        assert_eq!(sweep[5], "1", "grace in seconds");
        assert!(st.procs[&1].fetched);
        assert!(st.asked_after_final.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn output_is_capped_and_truncation_flagged() {
        let agent = FakeAgent::new(|_| Script::Exit {
            polls: 0,
            code: 0,
            out: "x".repeat(100),
            err: String::new(),
        });
        let outcome = vm(&agent)
            .exec(&ExecRequest::new(["yes"]).output_cap(10))
            .await
            .unwrap();
        assert_eq!(outcome.stdout.bytes.len(), 10);
        assert!(outcome.stdout.truncated);
        assert!(!outcome.stderr.truncated);
    }

    #[tokio::test(start_paused = true)]
    async fn not_running_and_agent_not_running_are_distinct() {
        let cases = [
            (AgentApiError::NotRunning, "NotRunning"),
            (AgentApiError::AgentNotRunning, "AgentNotRunning"),
            (AgentApiError::NoAgentConfigured, "NoAgentConfigured"),
        ];
        for (api_err, want) in cases {
            let agent = FakeAgent::new(|_| Script::Hang);
            agent.state().exec_error = Some(api_err);
            let err = vm(&agent)
                .exec(&ExecRequest::new(["true"]))
                .await
                .unwrap_err();
            let got = match &err {
                ExecError::NotRunning { .. } => "NotRunning",
                ExecError::AgentNotRunning { .. } => "AgentNotRunning",
                ExecError::NoAgentConfigured { .. } => "NoAgentConfigured",
                _ => "other",
            };
            assert_eq!(got, want, "{err}");
            assert!(err.guest_down());
            assert!(err.to_string().contains("VM 300"), "{err}");
        }
    }

    #[test]
    fn pve_wording_is_classified() {
        assert_eq!(
            AgentApiError::classify(500, "VM 300 is not running\n"),
            AgentApiError::NotRunning
        );
        assert_eq!(
            AgentApiError::classify(500, "QEMU guest agent is not running\n"),
            AgentApiError::AgentNotRunning
        );
        assert_eq!(
            AgentApiError::classify(500, "No QEMU guest agent configured\n"),
            AgentApiError::NoAgentConfigured
        );
        assert_eq!(
            AgentApiError::classify(500, "Agent error: Invalid parameter 'pid'\n"),
            AgentApiError::Other {
                status: 500,
                message: "Agent error: Invalid parameter 'pid'".into()
            }
        );
    }

    /// qemu-server answers an `exec-status` "QEMU guest agent is not running" when its ping
    /// of the guest agent timed out (3 s): a busy agent under a long command. A few such
    /// answers in a row are asked through, and the command's status still read; more than
    /// [`AGENT_SILENCES`] in a row end the exec.
    #[tokio::test(start_paused = true)]
    async fn a_guest_agent_silent_for_a_moment_during_a_long_command_is_asked_again() {
        struct Busy(std::sync::atomic::AtomicU32, u32);
        impl GuestAgentApi for Busy {
            async fn agent_exec(
                &self,
                _: &str,
                _: u32,
                _: &[String],
                _: Option<&str>,
            ) -> Result<u64, AgentApiError> {
                Ok(7)
            }
            async fn agent_exec_status(
                &self,
                _: &str,
                _: u32,
                _: u64,
            ) -> Result<AgentExecStatus, AgentApiError> {
                let n = self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if n == 0 {
                    return Ok(
                        AgentExecStatus::from_json(&serde_json::json!({"exited": 0}))
                            .expect("status"),
                    );
                }
                if n <= self.1 {
                    return Err(AgentApiError::classify(
                        500,
                        "QEMU guest agent is not running",
                    ));
                }
                Ok(AgentExecStatus::from_json(
                    &serde_json::json!({"exited": 1, "exitcode": 0, "out-data": "done\n"}),
                )
                .expect("status"))
            }
        }
        let out = QemuExec::new(Busy(0.into(), AGENT_SILENCES), "pve1", 300, fast())
            .exec(&ExecRequest::new(["sleep", "60"]))
            .await
            .expect("the status after the agent's silence");
        assert!(out.success(), "{}", out.summary());
        let err = QemuExec::new(Busy(0.into(), AGENT_SILENCES + 1), "pve1", 300, fast())
            .exec(&ExecRequest::new(["sleep", "60"]))
            .await
            .expect_err("silent too long");
        assert!(!matches!(err, ExecError::StatusLost { .. }), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_forgotten_pid_is_status_lost() {
        struct Forgetful;
        impl GuestAgentApi for Forgetful {
            async fn agent_exec(
                &self,
                _: &str,
                _: u32,
                _: &[String],
                _: Option<&str>,
            ) -> Result<u64, AgentApiError> {
                Ok(7)
            }
            async fn agent_exec_status(
                &self,
                _: &str,
                _: u32,
                _: u64,
            ) -> Result<AgentExecStatus, AgentApiError> {
                Err(AgentApiError::classify(
                    500,
                    "Agent error: Invalid parameter 'pid'",
                ))
            }
        }
        let err = QemuExec::new(Forgetful, "pve1", 300, fast())
            .exec(&ExecRequest::new(["true"]))
            .await
            .unwrap_err();
        assert!(matches!(err, ExecError::StatusLost { pid: 7, .. }), "{err}");
    }

    #[test]
    fn exec_status_accepts_pve_integers_and_booleans() {
        let pve =
            serde_json::json!({"exited": 1, "exitcode": 0, "out-data": "hi\n", "out-truncated": 1});
        let s = AgentExecStatus::from_json(&pve).unwrap();
        assert!(s.exited && s.out_truncated && !s.err_truncated);
        assert_eq!(s.exitcode, Some(0));
        assert_eq!(s.out_data.as_deref(), Some("hi\n"));
        let fake =
            serde_json::json!({"exited": true, "exitcode": 2, "out-data": "", "err-data": "e"});
        let s = AgentExecStatus::from_json(&fake).unwrap();
        assert!(s.exited);
        assert_eq!(s.exitcode, Some(2));
        let running = serde_json::json!({"exited": 0});
        assert!(!AgentExecStatus::from_json(&running).unwrap().exited);
        assert!(AgentExecStatus::from_json(&serde_json::json!({"exited": "yes"})).is_err());
    }

    #[test]
    fn double_encoded_output_is_turned_back_into_bytes() {
        // "ü" as UTF-8 is C3 BC; PVE may hand it over as the two characters U+00C3 U+00BC.
        assert_eq!(agent_output_bytes("\u{c3}\u{bc}"), "ü".as_bytes());
        assert_eq!(agent_output_bytes("plain"), b"plain");
        // Already proper text stays as it is.
        assert_eq!(agent_output_bytes("ü€"), "ü€".as_bytes());
    }

    #[test]
    fn base64_matches_the_standard_alphabet() {
        assert_eq!(encode_base64(b""), "");
        assert_eq!(encode_base64(b"f"), "Zg==");
        assert_eq!(encode_base64(b"fo"), "Zm8=");
        assert_eq!(encode_base64(b"foo"), "Zm9v");
        assert_eq!(encode_base64(&[0xff, 0xfe, 0x00]), "//4A");
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        assert_eq!(decode_base64(&encode_base64(&data)), data);
    }

    #[tokio::test(start_paused = true)]
    async fn a_push_goes_in_chunks_and_is_verified() {
        let agent = FakeAgent::new(|_| Script::Hang);
        let payload: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let receipt = vm(&agent)
            .push_file(&PushSource::Bytes(payload.clone()), "/etc/app.conf", 0o640)
            .await
            .unwrap();
        assert_eq!(receipt.size, payload.len() as u64);
        assert_eq!(receipt.mode, 0o640);
        let st = agent.state();
        assert_eq!(st.files["/etc/app.conf"], (payload, 0o640));
        // 100000 bytes in chunks of about 16 KiB (each fits 64 KiB in the worst case of the
        // form encoding): 7 chunk commands, finalize, verify.
        assert_eq!(st.execs.len(), 9);
        assert_eq!(st.files.len(), 1, "no partial file left");
    }

    #[tokio::test(start_paused = true)]
    async fn a_push_that_arrives_damaged_is_refused() {
        let agent = FakeAgent::new(|_| Script::Hang);
        agent.state().corrupt_files = true;
        let err = vm(&agent)
            .push_file(&PushSource::Bytes(b"hello".to_vec()), "/root/x", 0o600)
            .await
            .unwrap_err();
        assert!(matches!(err, ExecError::PushUnverified { .. }), "{err}");
        assert!(
            err.to_string().contains("expected 5 bytes, found 4"),
            "{err}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn binary_stdin_and_oversized_stdin_are_refused_before_sending() {
        let agent = FakeAgent::new(|_| Script::Hang);
        let exec = vm(&agent);
        let err = exec
            .exec(&ExecRequest::new(["cat"]).stdin(vec![0xff, 0xfe]))
            .await
            .unwrap_err();
        assert!(matches!(err, ExecError::InvalidRequest { .. }));
        let err = exec
            .exec(&ExecRequest::new(["cat"]).stdin("a".repeat(MAX_INPUT_DATA + 1)))
            .await
            .unwrap_err();
        assert!(matches!(err, ExecError::InvalidRequest { .. }));
        assert!(agent.state().execs.is_empty());
    }
}
