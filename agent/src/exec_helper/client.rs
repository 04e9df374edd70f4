//! The agent's side of the exec helper: [`HelperExec`] runs commands in one LXC container and
//! pushes files into it through the root helper's socket, on behalf of one journal transaction
//! (the helper checks that transaction's claim on the vmid); [`lxc_route`] decides whether the
//! agent goes through the helper or runs `pct` itself.
//!
//! One connection per request. A pushed file is read here, with the agent's own rights, and its
//! bytes travel in the request: the helper never opens a path its caller names. The answer is
//! read with a bound that follows what was asked (the output cap), within the exec's own
//! timeout plus a margin for the helper's kill and sweep. The helper's words are outside text:
//! clipped before they go into an error. Dropping a call closes the connection, which tells the
//! helper to stop the command.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;

use super::proto::{
    encode_read_request, encode_request, encode_status_request, read_frame, write_frame,
    ClusterFile, ErrorKind, Op, ProtoError, Request, Response, WireStatus, MAX_BLOB_BYTES,
    MAX_CLUSTER_FILE_BYTES, MAX_MESSAGE_BYTES, MAX_OUTPUT_CAP, MAX_REQUEST_FRAME,
    MAX_RESPONSE_FRAME, MAX_STATUS_PATH_BYTES, MAX_TIMEOUT, PROBE_VERSION,
};
use crate::config::{Config, DEFAULT_EXEC_HELPER_SOCKET};
use crate::error::{outside_text_max, ErrorCode};
use crate::guest::exec::{
    check_guest_path, guest_argv, sha256_hex, DynGuestExec, ExecError, ExecOutcome, ExecRequest,
    GuestExec, GuestRef, LxcExecFactory, PushReceipt, PushSource,
};
use crate::guest::lxc::PctConfig;
use crate::inventory::{
    read_full_list_with, DirectVmlist, FullGuestList, InventoryError, SystemListCommands,
    VmlistReader, VmlistUnread, VmlistVia,
};
use crate::pve::GuestKind;
use hub_protocol::TxnId;

/// The time allowed to connect and hand over a request.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Waited beyond an exec's own timeout: the helper's SIGTERM grace, the drain of the output and
/// the in-container sweep of a timed-out command, and the transfer of the answer.
pub const EXEC_MARGIN: Duration = Duration::from_secs(45);
/// The longest wait for a push's answer: the helper's `pct exec` that writes the file, its
/// read-back, and transfer.
pub const PUSH_WAIT: Duration = Duration::from_secs(480);
/// How long a lab request may take (a few `ip` calls).
pub const LAB_WAIT: Duration = Duration::from_secs(60);
/// How many bytes of the helper's message an error keeps.
const MESSAGE_KEEP: usize = 512;
/// Room in an answer beyond its output (JSON keys, exit, duration, an error's message).
const ANSWER_SLACK: usize = 64 * 1024;

/// Exec into one LXC container through the root exec helper, for one transaction.
#[derive(Debug, Clone)]
pub struct HelperExec {
    vmid: u32,
    txn: TxnId,
    socket: PathBuf,
}

impl HelperExec {
    /// Exec into container `vmid` for transaction `txn` through the helper at `socket`.
    pub fn new(vmid: u32, txn: TxnId, socket: impl Into<PathBuf>) -> Self {
        Self {
            vmid,
            txn,
            socket: socket.into(),
        }
    }

    /// The helper's socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn guest_ref(&self) -> GuestRef {
        GuestRef {
            kind: GuestKind::Lxc,
            vmid: self.vmid,
        }
    }

    /// Ask the helper to join this copy to its group's lab, or to remove the lab: what it did,
    /// or why not.
    pub async fn lab(&self, op: Op) -> Result<String, String> {
        match self
            .call(
                op,
                LAB_WAIT,
                u32::try_from(ANSWER_SLACK).unwrap_or(u32::MAX),
            )
            .await
        {
            Ok(Response::Lab(note)) => Ok(outside_text_max(&note, MESSAGE_KEEP)),
            Ok(Response::Error(e)) => Err(format!(
                "{}: {}",
                e.code,
                outside_text_max(&e.message, MESSAGE_KEEP)
            )),
            Ok(_) => Err("the exec helper answered a lab request with something else".to_string()),
            Err(e) => Err(e.to_string()),
        }
    }

    fn unavailable(&self, detail: impl Into<String>) -> ExecError {
        ExecError::HelperUnavailable {
            guest: self.guest_ref(),
            socket: self.socket.clone(),
            detail: detail.into(),
        }
    }

    /// Send `op` and read the answer, at most `answer_max` bytes, within `wait` after the
    /// request was handed over.
    async fn call(&self, op: Op, wait: Duration, answer_max: u32) -> Result<Response, ExecError> {
        let body = encode_request(&Request {
            vmid: self.vmid,
            txn: self.txn,
            op,
        });
        let handover = async {
            let mut stream = UnixStream::connect(&self.socket)
                .await
                .map_err(|e| self.connect_error(&e))?;
            // Only root's helper gets the request (its env values, stdin, files): a socket
            // some other user bound at the path is refused before a byte is sent.
            let peer = stream.peer_cred().map_err(|e| {
                self.unavailable(format!("cannot read the peer's credentials: {e}"))
            })?;
            if peer.uid() != 0 {
                return Err(self.unavailable(format!(
                    "the process on the socket runs as uid {}, not root; nothing was sent. Check \
                     who owns the socket and its folder",
                    peer.uid()
                )));
            }
            write_frame(&mut stream, &body, MAX_REQUEST_FRAME)
                .await
                .map_err(|e| self.unavailable(format!("sending the request failed: {e}")))?;
            Ok::<_, ExecError>(stream)
        };
        let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, handover)
            .await
            .map_err(|_| {
                self.unavailable(format!(
                    "it did not take the request within {}s",
                    CONNECT_TIMEOUT.as_secs()
                ))
            })??;
        let answer = tokio::time::timeout(wait, read_frame(&mut stream, answer_max))
            .await
            .map_err(|_| {
                self.unavailable(format!(
                    "no answer within {}s (the command's timeout and the helper's margin)",
                    wait.as_secs()
                ))
            })?
            .map_err(|e| self.unavailable(format!("reading the answer failed: {e}")))?;
        Response::decode(&answer).map_err(|e| match e {
            ProtoError::Version(v) => self.unavailable(format!(
                "it answered in protocol version {v}; install the same felhom-agent version for the agent and the helper"
            )),
            other => self.unavailable(format!("its answer is not valid: {other}")),
        })
    }

    fn connect_error(&self, e: &std::io::Error) -> ExecError {
        use std::io::ErrorKind as K;
        let what = match e.kind() {
            K::NotFound => "the socket does not exist".to_string(),
            K::ConnectionRefused => "nothing listens on the socket".to_string(),
            K::PermissionDenied => {
                "permission denied on the socket (the agent's user must be allowed to connect)"
                    .to_string()
            }
            _ => format!("connecting failed: {e}"),
        };
        self.unavailable(what)
    }

    /// The error a helper's error answer stands for; a refusal keeps the helper's code.
    fn answer_error(&self, e: super::proto::WireError, path: Option<&str>) -> ExecError {
        let guest = self.guest_ref();
        let clip = |t: &str| outside_text_max(t, MESSAGE_KEEP);
        match e.kind {
            ErrorKind::Refused | ErrorKind::Other => ExecError::HelperRefused {
                guest,
                code: e.code,
                message: clip(&e.message),
            },
            _ => {
                let clipped = super::proto::WireError {
                    message: clip(&e.message),
                    detail: e.detail.as_deref().map(clip),
                    ..e
                };
                clipped.into_exec_error(guest, path)
            }
        }
    }
}

/// The largest answer to an exec with this output cap: both streams as base64, and slack.
fn exec_answer_max(cap: usize) -> u32 {
    let cap = cap.min(MAX_OUTPUT_CAP);
    let b64 = cap.div_ceil(3) * 4;
    u32::try_from(2 * b64 + ANSWER_SLACK)
        .unwrap_or(u32::MAX)
        .min(MAX_RESPONSE_FRAME)
}

/// Read a local file to push, at most [`MAX_BLOB_BYTES`].
async fn read_local(guest: GuestRef, path: &Path) -> Result<Vec<u8>, ExecError> {
    let local = |source: std::io::Error| ExecError::LocalFile {
        guest,
        path: path.to_path_buf(),
        source,
    };
    let file = tokio::fs::File::open(path).await.map_err(local)?;
    let meta = file.metadata().await.map_err(local)?;
    if !meta.is_file() {
        return Err(local(std::io::Error::other("not a regular file")));
    }
    let too_big = || {
        local(std::io::Error::other(format!(
            "larger than the {MAX_BLOB_BYTES} bytes the exec helper takes"
        )))
    };
    if meta.size() > MAX_BLOB_BYTES as u64 {
        return Err(too_big());
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.size()).unwrap_or(0));
    file.take(MAX_BLOB_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(local)?;
    if bytes.len() > MAX_BLOB_BYTES {
        return Err(too_big());
    }
    Ok(bytes)
}

impl GuestExec for HelperExec {
    fn guest(&self) -> GuestRef {
        self.guest_ref()
    }

    async fn exec(&self, request: &ExecRequest) -> Result<ExecOutcome, ExecError> {
        let guest = self.guest_ref();
        // Refuse here what the helper would refuse, with the same words as a direct exec.
        guest_argv(request, "check")
            .map_err(|reason| ExecError::InvalidRequest { guest, reason })?;
        if request
            .stdin
            .as_ref()
            .is_some_and(|s| s.len() > MAX_BLOB_BYTES)
        {
            return Err(ExecError::InvalidRequest {
                guest,
                reason: format!(
                    "stdin is larger than the {MAX_BLOB_BYTES} bytes the exec helper takes"
                ),
            });
        }
        let wait = request.timeout.min(MAX_TIMEOUT) + EXEC_MARGIN;
        match self
            .call(
                Op::Exec(request.clone()),
                wait,
                exec_answer_max(request.output_cap),
            )
            .await?
        {
            Response::Exec(outcome) => outcome
                .into_outcome(request.output_cap)
                .map_err(|e| self.unavailable(format!("its answer is not valid: {e}"))),
            Response::Error(e) => Err(self.answer_error(e, None)),
            Response::Push(_) | Response::File(_) | Response::Status(_) | Response::Lab(_) => {
                Err(self.unavailable("it answered an exec with something else"))
            }
        }
    }

    async fn push_file(
        &self,
        source: &PushSource,
        guest_path: &str,
        mode: u32,
    ) -> Result<PushReceipt, ExecError> {
        let guest = self.guest_ref();
        check_guest_path(guest, guest_path)?;
        let data = match source {
            PushSource::Path(path) => read_local(guest, path).await?,
            PushSource::Bytes(bytes) => {
                if bytes.len() > MAX_BLOB_BYTES {
                    return Err(ExecError::InvalidRequest {
                        guest,
                        reason: format!(
                            "{} bytes to push into {guest_path}, more than the {MAX_BLOB_BYTES} the exec helper takes",
                            bytes.len()
                        ),
                    });
                }
                bytes.clone()
            }
        };
        let size = data.len() as u64;
        let sha256 = sha256_hex(&data);
        let mode = mode & 0o7777;
        let op = Op::Push {
            path: guest_path.to_string(),
            mode,
            data,
        };
        let receipt = match self
            .call(
                op,
                PUSH_WAIT,
                u32::try_from(ANSWER_SLACK).unwrap_or(u32::MAX),
            )
            .await?
        {
            Response::Push(r) => r.into_receipt(),
            Response::Error(e) => return Err(self.answer_error(e, Some(guest_path))),
            Response::Exec(_) | Response::File(_) | Response::Status(_) | Response::Lab(_) => {
                return Err(self.unavailable("it answered a push with something else"))
            }
        };
        // The helper read the file back; its receipt must name what was sent.
        if receipt.path != guest_path
            || receipt.size != size
            || receipt.sha256 != sha256
            || receipt.mode & 0o7777 != mode
        {
            return Err(ExecError::PushUnverified {
                guest,
                path: guest_path.to_string(),
                detail: format!(
                    "sent {size} bytes, sha256 {sha256}, mode {mode:o}; the helper's receipt says {} bytes, sha256 {}, mode {:o} at {}",
                    receipt.size,
                    outside_text_max(&receipt.sha256, 80),
                    receipt.mode,
                    outside_text_max(&receipt.path, MESSAGE_KEEP)
                ),
            });
        }
        Ok(receipt)
    }
}

/// How the agent reaches into LXC containers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecMode {
    /// The agent runs `pct` itself (it is root and no helper socket is configured).
    Direct,
    /// Through the root exec helper at this socket.
    Helper {
        /// The socket.
        socket: PathBuf,
        /// Whether `[exec] helper_socket` named it (else: the default, as the agent is not
        /// root).
        configured: bool,
    },
}

impl ExecMode {
    /// The mode for this config and effective uid: `[exec] helper_socket` set → always the
    /// helper; unset → the helper at [`DEFAULT_EXEC_HELPER_SOCKET`] when not root, `pct` itself
    /// when root.
    pub fn choose(cfg: &Config, euid: u32) -> ExecMode {
        match &cfg.exec.helper_socket {
            Some(socket) => ExecMode::Helper {
                socket: socket.clone(),
                configured: true,
            },
            None if euid != 0 => ExecMode::Helper {
                socket: PathBuf::from(DEFAULT_EXEC_HELPER_SOCKET),
                configured: false,
            },
            None => ExecMode::Direct,
        }
    }

    /// The mode of this process.
    pub fn of_process(cfg: &Config) -> ExecMode {
        Self::choose(cfg, nix::unistd::geteuid().as_raw())
    }

    /// One line for `doctor` and logs.
    pub fn describe(&self) -> String {
        match self {
            ExecMode::Direct => {
                "the agent runs `pct exec` itself (it runs as root and [exec] helper_socket is not set)".to_string()
            }
            ExecMode::Helper { socket, configured: true } => format!(
                "through the root exec helper at {} ([exec] helper_socket)",
                socket.display()
            ),
            ExecMode::Helper { socket, configured: false } => format!(
                "through the root exec helper at {} (the agent does not run as root)",
                socket.display()
            ),
        }
    }
}

/// Every container's exec goes through the helper at this socket.
#[derive(Debug, Clone)]
pub struct HelperRoute {
    socket: PathBuf,
}

impl HelperRoute {
    /// Through the helper at `socket`.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
        }
    }
}

impl LxcExecFactory for HelperRoute {
    fn lxc_exec(&self, vmid: u32, txn: ulid::Ulid) -> Box<dyn DynGuestExec> {
        Box::new(HelperExec::new(
            vmid,
            TxnId::from_ulid(txn),
            self.socket.clone(),
        ))
    }

    fn lab_op(
        &self,
        vmid: u32,
        txn: ulid::Ulid,
        op: crate::guest::exec::LabOp,
    ) -> futures_util::future::BoxFuture<'static, Result<String, String>> {
        use crate::guest::exec::LabOp;
        let op = match op {
            // The link bridge is not sent: the helper reads it from the journaled request.
            LabOp::Join { lab, names, .. } => Op::LabJoin { lab, names },
            LabOp::Remove { lab } => Op::LabRemove { lab },
        };
        let exec = HelperExec::new(vmid, TxnId::from_ulid(txn), self.socket.clone());
        Box::pin(async move { exec.lab(op).await })
    }

    fn describe(&self) -> String {
        format!("the root exec helper at {}", self.socket.display())
    }

    fn full_guest_list(&self, cfg: &Config) -> Result<FullGuestList, InventoryError> {
        read_full_list_with(
            &cfg.vmlist_path,
            &cfg.node,
            &SystemListCommands::default(),
            &VmlistRoute::Helper(HelperVmlist::new(self.socket.clone())),
        )
    }
}

/// How this process reaches into LXC containers ([`ExecMode::of_process`]); `pct` is the
/// direct route's configuration (its scratch folder).
pub fn lxc_route(cfg: &Config, pct: PctConfig) -> Arc<dyn LxcExecFactory> {
    match ExecMode::of_process(cfg) {
        ExecMode::Direct => Arc::new(pct),
        ExecMode::Helper { socket, .. } => Arc::new(HelperRoute::new(socket)),
    }
}

/// Whether the helper at `socket` answers: connect and send a request it must refuse unread
/// (another protocol version); a well-formed refusal is an answer. `Err`: what went wrong.
pub async fn probe(socket: &Path) -> Result<(), String> {
    let exchange = async {
        let mut stream = UnixStream::connect(socket)
            .await
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => "the socket does not exist".to_string(),
                std::io::ErrorKind::ConnectionRefused => {
                    "nothing listens on the socket".to_string()
                }
                std::io::ErrorKind::PermissionDenied => {
                    "permission denied on the socket".to_string()
                }
                _ => format!("connecting failed: {e}"),
            })?;
        // As for a request: nothing goes to a socket another user bound at the path.
        let peer = stream
            .peer_cred()
            .map_err(|e| format!("cannot read the peer's credentials: {e}"))?;
        if peer.uid() != 0 {
            return Err(format!(
                "the process on the socket runs as uid {}, not root; nothing was sent. Check \
                 who owns the socket and its folder",
                peer.uid()
            ));
        }
        let probe = format!(r#"{{"v":{PROBE_VERSION}}}"#);
        write_frame(&mut stream, probe.as_bytes(), MAX_REQUEST_FRAME)
            .await
            .map_err(|e| format!("sending the probe failed: {e}"))?;
        let answer = read_frame(
            &mut stream,
            u32::try_from(MAX_MESSAGE_BYTES * 2 + ANSWER_SLACK).unwrap_or(u32::MAX),
        )
        .await
        .map_err(|e| format!("reading its answer failed: {e}"))?;
        match Response::decode(&answer) {
            Ok(Response::Error(_)) => Ok(()),
            Ok(_) => Err("it answered the probe with an outcome".to_string()),
            Err(e) => Err(format!("its answer is not valid: {e}")),
        }
    };
    tokio::time::timeout(CONNECT_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("no answer within {}s", CONNECT_TIMEOUT.as_secs()))?
}

/// How long a request about the node ([`read_cluster_file`], [`helper_status`]) may take to
/// be handed over, and then to be answered.
pub const NODE_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Why the helper gave no cluster file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileAnswer {
    /// Nothing usable came back: no helper on the socket, no answer in time, a helper that
    /// does not know the request (an older version), a malformed answer. Its words, for a
    /// message.
    Unavailable(String),
    /// The helper cannot read the file at all (missing, pmxcfs down): `pve_unreachable`.
    Unreadable(String),
    /// The helper refused the file as not what it should be (a link, a path someone else could
    /// change, too large): `config_invalid`, or any other refusal.
    Refused(String),
}

/// One request about the node, blocking (it is called from code that reads files the same
/// way): connect, check that root answers, send `body`, read one answer of at most
/// `answer_max` bytes. `Err`: what went wrong, for a message.
fn node_request(socket: &Path, body: &[u8], answer_max: u32) -> Result<Response, String> {
    use nix::sys::socket::{getsockopt, sockopt};
    use std::io::{Read, Write};
    let mut stream =
        std::os::unix::net::UnixStream::connect(socket).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => "the socket does not exist".to_string(),
            std::io::ErrorKind::ConnectionRefused => "nothing listens on the socket".to_string(),
            std::io::ErrorKind::PermissionDenied => "permission denied on the socket".to_string(),
            _ => format!("connecting failed: {e}"),
        })?;
    let peer = getsockopt(&stream, sockopt::PeerCredentials)
        .map_err(|e| format!("cannot read the peer's credentials: {e}"))?;
    if peer.uid() != 0 {
        return Err(format!(
            "the process on the socket runs as uid {}, not root; nothing was sent. Check who \
             owns the socket and its folder",
            peer.uid()
        ));
    }
    let io = |what: &str, e: std::io::Error| format!("{what} failed: {e}");
    stream
        .set_write_timeout(Some(NODE_REQUEST_TIMEOUT))
        .and_then(|()| stream.set_read_timeout(Some(NODE_REQUEST_TIMEOUT)))
        .map_err(|e| io("setting the socket's timeouts", e))?;
    let len = u32::try_from(body.len()).map_err(|_| "the request is too large".to_string())?;
    stream
        .write_all(&len.to_be_bytes())
        .and_then(|()| stream.write_all(body))
        .and_then(|()| stream.flush())
        .map_err(|e| io("sending the request", e))?;
    let mut prefix = [0u8; 4];
    stream
        .read_exact(&mut prefix)
        .map_err(|e| io("reading the answer", e))?;
    let len = u32::from_be_bytes(prefix);
    if len > answer_max {
        return Err(format!(
            "its answer of {len} bytes is larger than the limit of {answer_max} bytes"
        ));
    }
    let mut answer = vec![0u8; len as usize];
    stream
        .read_exact(&mut answer)
        .map_err(|e| io("reading the answer", e))?;
    Response::decode(&answer).map_err(|e| format!("its answer is not valid: {e}"))
}

/// The bytes of `file` as the helper at `socket` reads them as root. The answer is outside
/// text: its size is bounded before it is read, its name checked, and the bytes are for the
/// caller to parse as hostile input.
pub fn read_cluster_file(socket: &Path, file: ClusterFile) -> Result<Option<Vec<u8>>, FileAnswer> {
    let answer_max = u32::try_from(MAX_CLUSTER_FILE_BYTES.div_ceil(3) * 4 + ANSWER_SLACK)
        .unwrap_or(u32::MAX)
        .min(MAX_RESPONSE_FRAME);
    let clip = |t: &str| outside_text_max(t, MESSAGE_KEEP);
    match node_request(socket, &encode_read_request(file), answer_max)
        .map_err(FileAnswer::Unavailable)?
    {
        Response::File(f) => f
            .into_bytes(file)
            .map_err(|e| FileAnswer::Unavailable(format!("its answer is not valid: {e}"))),
        Response::Error(e) => Err(match e.code {
            ErrorCode::ExecRequestInvalid => FileAnswer::Unavailable(format!(
                "it does not hand over cluster files (an older version?): {}",
                clip(&e.message)
            )),
            ErrorCode::PveUnreachable => FileAnswer::Unreadable(clip(&e.message)),
            code => FileAnswer::Refused(format!("{code}: {}", clip(&e.message))),
        }),
        Response::Exec(_) | Response::Push(_) | Response::Status(_) | Response::Lab(_) => Err(
            FileAnswer::Unavailable("it answered a read with something else".to_string()),
        ),
    }
}

/// `.vmlist` through the root exec helper, else (the helper does not hand it over) read by
/// this process itself.
#[derive(Debug, Clone)]
pub struct HelperVmlist {
    socket: PathBuf,
}

impl HelperVmlist {
    /// Through the helper at `socket`.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
        }
    }
}

impl VmlistReader for HelperVmlist {
    fn read_vmlist(&self, path: &Path) -> Result<(Vec<u8>, VmlistVia), VmlistUnread> {
        let socket = self.socket.clone();
        let why = match read_cluster_file(&self.socket, ClusterFile::Vmlist) {
            Ok(Some(bytes)) => return Ok((bytes, VmlistVia::Helper { socket })),
            Ok(None) => format!("it says {} does not exist", path.display()),
            // Root read nothing from a path someone else could have placed; this process may
            // still read what its own user can (as without a helper), and says why.
            Err(FileAnswer::Refused(why)) => format!("it refused to hand it over: {why}"),
            Err(FileAnswer::Unavailable(why) | FileAnswer::Unreadable(why)) => why,
        };
        tracing::debug!(socket = %self.socket.display(), "the exec helper did not hand over {}: {why}; reading it directly", path.display());
        let (bytes, _) = DirectVmlist.read_vmlist(path).map_err(|e| match e {
            VmlistUnread::Unreadable(direct) => VmlistUnread::Unreadable(format!(
                "the exec helper at {} did not hand it over ({why}), and reading it directly \
                 failed: {direct}",
                self.socket.display()
            )),
            refused => refused,
        })?;
        Ok((bytes, VmlistVia::DirectAfterHelper { socket, why }))
    }
}

/// How this process reads `.vmlist`: through the helper in the helper mode
/// ([`ExecMode::of_process`]), itself otherwise.
pub fn vmlist_reader(cfg: &Config) -> VmlistRoute {
    match ExecMode::of_process(cfg) {
        ExecMode::Direct => VmlistRoute::Direct,
        ExecMode::Helper { socket, .. } => VmlistRoute::Helper(HelperVmlist::new(socket)),
    }
}

/// [`vmlist_reader`]'s answer.
#[derive(Debug, Clone)]
pub enum VmlistRoute {
    /// This process reads the file.
    Direct,
    /// The helper does, else this process.
    Helper(HelperVmlist),
}

impl VmlistReader for VmlistRoute {
    fn read_vmlist(&self, path: &Path) -> Result<(Vec<u8>, VmlistVia), VmlistUnread> {
        match self {
            Self::Direct => DirectVmlist.read_vmlist(path),
            Self::Helper(h) => h.read_vmlist(path),
        }
    }
}

/// The node's full guest list as this process reads it ([`vmlist_reader`], then `pct list` +
/// `qm list` when `.vmlist` cannot be read).
pub fn full_guest_list(cfg: &Config) -> Result<FullGuestList, InventoryError> {
    read_full_list_with(
        &cfg.vmlist_path,
        &cfg.node,
        &SystemListCommands::default(),
        &vmlist_reader(cfg),
    )
}

/// A cluster file as this process reads it ([`ClusterFile`], at the path the config names):
/// through the root exec helper in its mode, else (no helper, or it gives no usable answer)
/// directly. `Ok(None)`: it does not exist. `Err`: why it cannot be had, for a message. Its
/// text is outside text for the caller to parse. Read directly, it is cut as the helper cuts
/// it (of `jobs.cfg`, `user.cfg` and
/// `datacenter.cfg` only the lines the agent reads: [`super::cluster_file::what_crosses`]).
pub fn node_file(cfg: &Config, file: ClusterFile) -> Result<Option<String>, String> {
    let path = super::cluster_file::path_of(cfg, file);
    let mut helper_why = None;
    if let ExecMode::Helper { socket, .. } = ExecMode::of_process(cfg) {
        match read_cluster_file(&socket, file) {
            Ok(bytes) => return Ok(bytes.map(|b| String::from_utf8_lossy(&b).into_owned())),
            Err(FileAnswer::Refused(why)) => {
                helper_why = Some(format!(
                    "the exec helper at {} refused to hand it over ({why}), and ",
                    socket.display()
                ));
            }
            Err(FileAnswer::Unavailable(why) | FileAnswer::Unreadable(why)) => {
                helper_why = Some(format!(
                    "the exec helper at {} did not hand it over ({why}), and ",
                    socket.display()
                ));
            }
        }
    }
    let direct = std::fs::File::open(&path).and_then(|f| {
        use std::io::Read;
        let mut bytes = Vec::new();
        f.take(MAX_CLUSTER_FILE_BYTES as u64 + 1)
            .read_to_end(&mut bytes)
            .map(|_| bytes)
    });
    match direct {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!(
            "{}: {}reading it directly failed: {e}",
            path.display(),
            helper_why.unwrap_or_default()
        )),
        Ok(b) if b.len() > MAX_CLUSTER_FILE_BYTES => Err(format!(
            "{} is larger than {MAX_CLUSTER_FILE_BYTES} bytes",
            path.display()
        )),
        Ok(b) => super::cluster_file::what_crosses(file, &path, b, MAX_CLUSTER_FILE_BYTES as u64)
            .map(|b| Some(String::from_utf8_lossy(&b).into_owned()))
            .map_err(|r| r.message),
    }
}

/// What the helper at `socket` says of itself. `Err`: no usable answer (for an older helper:
/// its refusal of the request, which shows that it answers).
pub fn helper_status(socket: &Path) -> Result<WireStatus, StatusAnswer> {
    let answer_max = u32::try_from(2 * MAX_STATUS_PATH_BYTES + ANSWER_SLACK).unwrap_or(u32::MAX);
    match node_request(socket, &encode_status_request(), answer_max)
        .map_err(StatusAnswer::NoAnswer)?
    {
        Response::Status(st) => Ok(st),
        Response::Error(e) => Err(StatusAnswer::Refused(format!(
            "{}: {}",
            e.code,
            outside_text_max(&e.message, MESSAGE_KEEP)
        ))),
        _ => Err(StatusAnswer::NoAnswer(
            "it answered a status request with something else".to_string(),
        )),
    }
}

/// Ask the helper at `socket` to make an application group's lab and remove it
/// ([`crate::guest::group_lab::probe`]). `Ok`: what it did; `Err`: why it could not (its
/// refusal's code and message, or why nothing answered).
pub fn lab_probe(socket: &Path) -> Result<String, StatusAnswer> {
    let answer_max = u32::try_from(MESSAGE_KEEP + ANSWER_SLACK).unwrap_or(u32::MAX);
    match node_request(
        socket,
        &super::proto::encode_lab_probe_request(),
        answer_max,
    )
    .map_err(StatusAnswer::NoAnswer)?
    {
        Response::Lab(note) => Ok(outside_text_max(&note, MESSAGE_KEEP)),
        Response::Error(e) => Err(StatusAnswer::Refused(format!(
            "{}: {}",
            e.code,
            outside_text_max(&e.message, MESSAGE_KEEP)
        ))),
        _ => Err(StatusAnswer::NoAnswer(
            "it answered a lab probe with something else".to_string(),
        )),
    }
}

/// Why [`helper_status`] has no status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StatusAnswer {
    /// Nothing answered (or not validly).
    NoAnswer(String),
    /// The helper answered with a refusal (an older version does not know the request).
    Refused(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec_helper::proto::{
        decode_request, WireError, WireExit, WireOutcome, WireReceipt,
    };
    use tokio::net::UnixListener;

    const TXN: &str = "01JD0000000000000000000000";

    /// A fake helper, serving until it is told to stop (never on a timer: a slow machine
    /// must not end it between two requests of the client under test).
    struct FakeHelper {
        stop: tokio_util::sync::CancellationToken,
        task: tokio::task::JoinHandle<Vec<Request>>,
    }

    impl FakeHelper {
        /// Stop serving; the requests it received. Every request a client got an answer to
        /// is in (the request is recorded before the answer goes out).
        async fn requests(self) -> Vec<Request> {
            self.stop.cancel();
            self.task.await.expect("server")
        }
    }

    /// A fake helper: answers each connection's request with what `answer` returns for it.
    fn serve(
        dir: &Path,
        answer: impl Fn(Request) -> Vec<u8> + Send + Sync + 'static,
    ) -> (PathBuf, FakeHelper) {
        let socket = dir.join("exec.sock");
        let listener = UnixListener::bind(&socket).expect("bind");
        let stop = tokio_util::sync::CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let mut seen = Vec::new();
            loop {
                let mut s = tokio::select! {
                    biased;
                    _ = stopped.cancelled() => break,
                    accepted = listener.accept() => match accepted {
                        Ok((s, _)) => s,
                        Err(_) => break,
                    },
                };
                let body = read_frame(&mut s, MAX_REQUEST_FRAME).await.expect("frame");
                let req = decode_request(&body).expect("a valid request");
                let out = answer(req.clone());
                seen.push(req);
                let _ = write_frame(&mut s, &out, u32::MAX).await;
            }
            seen
        });
        (socket, FakeHelper { stop, task })
    }

    fn exec_for(socket: &Path) -> HelperExec {
        HelperExec::new(120, TxnId::parse(TXN).expect("txn"), socket)
    }

    #[tokio::test]
    async fn exec_goes_over_the_socket_with_vmid_and_txn() {
        let dir = tempfile::tempdir().expect("tmp");
        let (socket, task) = serve(dir.path(), |_| {
            Response::Exec(WireOutcome {
                exit: WireExit::Exited(3),
                stdout: "aGk=".into(),
                stdout_truncated: false,
                stderr: String::new(),
                stderr_truncated: false,
                duration_ms: 5,
            })
            .encode()
        });
        let exec = exec_for(&socket);
        let out = exec
            .exec(&ExecRequest::new(["echo", "hi"]).env("K", "v"))
            .await
            .expect("outcome");
        assert_eq!(out.exit_code(), Some(3));
        assert_eq!(out.stdout.bytes, b"hi");
        let seen = task.requests().await;
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].vmid, 120);
        assert_eq!(seen[0].txn.to_string(), TXN);
        let Op::Exec(r) = &seen[0].op else {
            panic!("exec")
        };
        assert_eq!(r.argv, ["echo", "hi"]);
        assert_eq!(r.env, [("K".to_string(), "v".to_string())]);
    }

    #[tokio::test]
    async fn a_refusal_keeps_the_helpers_code_and_a_clipped_message() {
        let dir = tempfile::tempdir().expect("tmp");
        let long = format!("vmid 120 is not yours\n{}", "x".repeat(5000));
        let (socket, _task) = serve(dir.path(), move |_| {
            let mut e = WireError::refused(ErrorCode::ExecNotOwned, long.clone());
            e.message.truncate(MAX_MESSAGE_BYTES);
            Response::Error(e).encode()
        });
        let err = exec_for(&socket)
            .exec(&ExecRequest::new(["true"]))
            .await
            .expect_err("refused");
        assert_eq!(err.code(), ErrorCode::ExecNotOwned);
        let ExecError::HelperRefused { message, .. } = &err else {
            panic!("{err:?}")
        };
        assert!(message.len() < 700 && !message.contains('\n'), "{message}");
        assert!(err.to_string().contains("exec_not_owned"), "{err}");
    }

    #[tokio::test]
    async fn an_unreachable_helper_names_the_socket_and_what_to_do() {
        let dir = tempfile::tempdir().expect("tmp");
        let socket = dir.path().join("missing.sock");
        let err = exec_for(&socket)
            .exec(&ExecRequest::new(["true"]))
            .await
            .expect_err("no helper");
        assert_eq!(err.code(), ErrorCode::ExecHelperUnavailable);
        let text = err.to_string();
        assert!(text.contains(&socket.display().to_string()), "{text}");
        assert!(
            text.contains("systemctl start felhom-agent-exec.socket"),
            "{text}"
        );
        assert!(text.contains("run the agent as root"), "{text}");
        assert!(text.contains("lxc 120") || text.contains("120"), "{text}");
    }

    #[tokio::test]
    async fn push_sends_the_bytes_and_checks_the_receipt() {
        let dir = tempfile::tempdir().expect("tmp");
        let local = dir.path().join("payload");
        std::fs::write(&local, b"payload").expect("write");
        let (socket, task) = serve(dir.path(), |req| match req.op {
            Op::Push { path, mode, data } => Response::Push(WireReceipt {
                path,
                size: data.len() as u64,
                sha256: sha256_hex(&data),
                mode,
            })
            .encode(),
            _ => b"{}".to_vec(),
        });
        let exec = exec_for(&socket);
        let receipt = exec
            .push_file(&PushSource::Path(local), "/root/p", 0o640)
            .await
            .expect("pushed");
        assert_eq!(receipt.size, 7);
        let seen = task.requests().await;
        let Op::Push { data, mode, path } = &seen[0].op else {
            panic!("push")
        };
        assert_eq!(
            (data.as_slice(), *mode, path.as_str()),
            (&b"payload"[..], 0o640, "/root/p")
        );
    }

    #[tokio::test]
    async fn a_receipt_for_other_bytes_is_unverified() {
        let dir = tempfile::tempdir().expect("tmp");
        let (socket, _task) = serve(dir.path(), |req| match req.op {
            Op::Push { path, mode, .. } => Response::Push(WireReceipt {
                path,
                size: 1,
                sha256: sha256_hex(b"x"),
                mode,
            })
            .encode(),
            _ => b"{}".to_vec(),
        });
        let err = exec_for(&socket)
            .push_file(&PushSource::Bytes(b"payload".to_vec()), "/root/p", 0o600)
            .await
            .expect_err("unverified");
        assert!(matches!(err, ExecError::PushUnverified { .. }), "{err:?}");
    }

    #[tokio::test]
    async fn an_oversized_answer_is_refused_before_it_is_read() {
        let dir = tempfile::tempdir().expect("tmp");
        let socket = dir.path().join("exec.sock");
        let listener = UnixListener::bind(&socket).expect("bind");
        tokio::spawn(async move {
            if let Ok((mut s, _)) = listener.accept().await {
                let _ = read_frame(&mut s, MAX_REQUEST_FRAME).await;
                // Announces 16 MiB for an exec whose output cap is 10 bytes.
                use tokio::io::AsyncWriteExt;
                let _ = s.write_all(&(16u32 << 20).to_be_bytes()).await;
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        });
        let err = exec_for(&socket)
            .exec(&ExecRequest::new(["true"]).output_cap(10))
            .await
            .expect_err("too large");
        assert_eq!(err.code(), ErrorCode::ExecHelperUnavailable, "{err}");
        assert!(err.to_string().contains("larger than the limit"), "{err}");
    }

    #[test]
    fn the_mode_follows_the_socket_setting_and_the_uid() {
        let dir = tempfile::tempdir().expect("tmp");
        let secret = dir.path().join("token");
        std::fs::write(&secret, "s\n").expect("write");
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .expect("chmod");
        let base = format!(
            "node = \"pve1\"\npool = \"p\"\nstate_dir = \"/var/lib/felhom-agent\"\n[pve]\nurl = \"https://127.0.0.1:8006\"\ntoken_id = \"felhom@pve!agent\"\ntoken_secret_file = \"{}\"\ntls_fingerprint = \"{}\"\n",
            secret.display(),
            "AA:".repeat(31) + "AA"
        );
        let parse = |extra: &str| {
            Config::parse(Path::new("/x.toml"), &format!("{base}{extra}")).expect("config")
        };
        let plain = parse("");
        assert_eq!(ExecMode::choose(&plain, 0), ExecMode::Direct);
        assert_eq!(
            ExecMode::choose(&plain, 998),
            ExecMode::Helper {
                socket: PathBuf::from(DEFAULT_EXEC_HELPER_SOCKET),
                configured: false
            }
        );
        let set = parse("[exec]\nhelper_socket = \"/run/x/exec.sock\"\n");
        for uid in [0, 998] {
            assert_eq!(
                ExecMode::choose(&set, uid),
                ExecMode::Helper {
                    socket: PathBuf::from("/run/x/exec.sock"),
                    configured: true
                }
            );
        }
    }

    /// A fake helper answering every node request with `answer` (as root: the test runs as
    /// root), in a thread, so the blocking client can be driven from the test thread.
    fn serve_node(dir: &Path, answer: Vec<u8>) -> PathBuf {
        let socket = dir.join("node.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            for stream in listener.incoming() {
                let Ok(mut s) = stream else { return };
                let mut len = [0u8; 4];
                if s.read_exact(&mut len).is_err() {
                    continue;
                }
                let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
                let _ = s.read_exact(&mut body);
                let _ = s.write_all(&(answer.len() as u32).to_be_bytes());
                let _ = s.write_all(&answer);
            }
        });
        socket
    }

    fn file_answer(name: &str, data: &[u8]) -> Vec<u8> {
        use base64::Engine as _;
        Response::File(super::super::proto::WireFile {
            name: name.into(),
            data: Some(base64::engine::general_purpose::STANDARD.encode(data)),
        })
        .encode()
    }

    #[test]
    fn a_helpers_vmlist_is_parsed_as_hostile_and_its_refusals_sorted() {
        use crate::inventory::ListSource;
        let dir = tempfile::tempdir().expect("tmp");
        let vmlist = dir.path().join("vmlist-not-readable-here");
        let no_commands = |_: crate::inventory::ListCommand| -> Result<String, InventoryError> {
            Err(InventoryError::CommandFailed {
                command: "pct list",
                detail: "not on this test's node".into(),
            })
        };
        let read = |socket: &Path| {
            crate::inventory::read_full_list_with(
                &vmlist,
                "pve1",
                &no_commands,
                &HelperVmlist::new(socket),
            )
        };
        // A list the helper hands over is taken, and the source says so.
        let good = "{\n\"version\": 3,\n\"ids\": {\n\"101\": { \"node\": \"pve1\", \"type\": \"lxc\", \"version\": 1 }}\n\n}\n";
        let dir_ok = tempfile::tempdir().expect("tmp");
        let list = read(&serve_node(
            dir_ok.path(),
            file_answer("vmlist", good.as_bytes()),
        ))
        .expect("list");
        assert!(list.contains(101));
        assert!(
            matches!(
                list.source(),
                ListSource::Vmlist {
                    via: VmlistVia::Helper { .. },
                    ..
                }
            ),
            "{:?}",
            list.source()
        );
        // Hostile bytes: refused as an invalid list naming the file, never a fallback.
        for (i, hostile) in [
            &b"{\"version\": 1, \"ids\": {\"101\": {\"node\": \"pve1\", \"type\": \"lxc\"}, \"101\": {\"node\": \"x\", \"type\": \"qemu\"}}}"[..],
            b"\x00\xff\x1b[2J not json",
            b"{\"ids\": {}}",
        ]
        .into_iter()
        .enumerate()
        {
            let d = tempfile::tempdir().expect("tmp");
            let err = read(&serve_node(d.path(), file_answer("vmlist", hostile)))
                .expect_err(&format!("hostile {i}"));
            assert!(matches!(err, InventoryError::VmlistInvalid { .. }), "{i}: {err:?}");
            assert!(!err.to_string().contains('\x1b'), "{err}");
        }
        // The answer for another file, an answer over the limit, garbage: no usable answer,
        // so the file is read directly (here it does not exist, and the local commands fail).
        for answer in [
            file_answer("user.cfg", good.as_bytes()),
            b"{\"v\":1,\"file\":{\"name\":\"vmlist\",\"data\":\"!!\"}}".to_vec(),
            b"not json".to_vec(),
        ] {
            let d = tempfile::tempdir().expect("tmp");
            let err = read(&serve_node(d.path(), answer)).expect_err("unusable");
            let text = err.to_string();
            assert!(matches!(err, InventoryError::NoGuestList { .. }), "{err:?}");
            assert!(text.contains("did not hand it over"), "{text}");
        }
        // A refusal of the file (a link, a path others could change): root read nothing;
        // this process reads what its own user can (here: nothing), naming the refusal.
        let d = tempfile::tempdir().expect("tmp");
        let refusal = Response::Error(WireError::refused(
            ErrorCode::ConfigInvalid,
            "/etc/pve/.vmlist: the file is a symbolic link",
        ))
        .encode();
        let err = read(&serve_node(d.path(), refusal)).expect_err("refused");
        assert!(matches!(err, InventoryError::NoGuestList { .. }), "{err:?}");
        assert!(
            err.to_string().contains("refused to hand it over")
                && err.to_string().contains("symbolic link"),
            "{err}"
        );
        // No helper at all: the direct read, with the reason kept.
        std::fs::write(&vmlist, good).expect("write");
        let list = read(&dir.path().join("missing.sock")).expect("direct");
        assert!(
            matches!(list.source(), ListSource::Vmlist { via: VmlistVia::DirectAfterHelper { why, .. }, .. } if why.contains("does not exist")),
            "{:?}",
            list.source()
        );
    }

    #[test]
    fn an_oversized_file_answer_is_refused_before_it_is_read() {
        let dir = tempfile::tempdir().expect("tmp");
        let socket = dir.path().join("node.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            if let Ok((mut s, _)) = listener.accept() {
                let mut len = [0u8; 4];
                let _ = s.read_exact(&mut len);
                let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
                let _ = s.read_exact(&mut body);
                // Announces 1 GiB, sends nothing behind it.
                let _ = s.write_all(&(1u32 << 30).to_be_bytes());
                std::thread::sleep(Duration::from_secs(5));
            }
        });
        let started = std::time::Instant::now();
        match read_cluster_file(&socket, ClusterFile::Vmlist) {
            Err(FileAnswer::Unavailable(why)) => {
                assert!(why.contains("larger than the limit"), "{why}")
            }
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(4));
    }

    #[test]
    fn answer_bounds_follow_the_cap() {
        assert!(exec_answer_max(10) < 70 * 1024);
        assert_eq!(exec_answer_max(usize::MAX), exec_answer_max(MAX_OUTPUT_CAP));
        assert!(exec_answer_max(MAX_OUTPUT_CAP) <= MAX_RESPONSE_FRAME);
    }
}
