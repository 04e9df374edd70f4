//! The exec helper's wire format: one request and one response per connection on a Unix stream
//! socket.
//!
//! The caller sends one request frame, then nothing more, and keeps the connection open until
//! it has read the response frame; the helper then closes it.
//!
//! A frame is a 4-byte big-endian length, then that many bytes of JSON. A length above the
//! limit ([`MAX_REQUEST_FRAME`] for a request, [`MAX_RESPONSE_FRAME`] for a response) is refused
//! before a byte of the body is read. Byte strings (stdin, a pushed file, output) are standard
//! base64 with padding.
//!
//! Request (`v` is [`PROTO_VERSION`]; an unknown field or version is refused):
//!
//! ```json
//! {"v":1,"op":"exec","vmid":101,"txn":"01J…","argv":["sh","-c","id"],
//!  "env":[["KEY","value"]],"stdin":"aGk=","timeout_ms":60000,"output_cap":1048576}
//! {"v":1,"op":"push","vmid":101,"txn":"01J…","path":"/etc/x","mode":420,"data":"aGk="}
//! ```
//!
//! `env`, `stdin`, `timeout_ms` and `output_cap` are optional (no extra variables, stdin from
//! `/dev/null`, [`DEFAULT_EXEC_TIMEOUT`], [`DEFAULT_OUTPUT_CAP`]). A push carries the file's
//! bytes, never a path on the node: the helper runs as root and reads no file its caller names.
//!
//! Response, one of:
//!
//! ```json
//! {"v":1,"exec":{"exit":{"exited":0},"stdout":"…","stdout_truncated":false,
//!  "stderr":"","stderr_truncated":false,"duration_ms":12}}
//! {"v":1,"push":{"path":"/etc/x","size":2,"sha256":"…","mode":420}}
//! {"v":1,"error":{"code":"exec_not_owned","message":"…","kind":"refused"}}
//! ```
//!
//! `exit` is `{"exited":N}`, `{"signaled":N}` or `"timed_out"`. An error's `kind` says which
//! [`ExecError`] the helper met when it ran the request (`refused`: the helper itself refused
//! it), so the caller can rebuild the error ([`WireError::into_exec_error`]).
//!
//! Two requests name no guest and carry nothing else ([`decode_incoming`]):
//!
//! ```json
//! {"v":1,"op":"read","file":"vmlist"}
//! {"v":1,"op":"status"}
//! {"v":1,"op":"lab_probe"}
//! ```
//!
//! `read` asks for the bytes of one file of the cluster file system, named from a closed set
//! ([`ClusterFile`]: `vmlist`, `datacenter.cfg`, `user.cfg`, `sdn/vnets.cfg`, `jobs.cfg`, none
//! of them a key or a secret); the helper reads it as root from the path of its own config
//! (`vmlist_path`, `/etc/pve/.vmlist`, …), following no link and only through folders of
//! root's nobody else can write (`super::cluster_file`), at most [`MAX_CLUSTER_FILE_BYTES`].
//! Of `jobs.cfg` only the lines the agent needs cross: each backup job's id, guest selection,
//! node, schedule and whether it is enabled (`super::jobs_cfg`), never its other keys.
//! The agent's user thus needs no pmxcfs group. `status` asks where the helper's `pct`
//! resolves (`doctor`). Their answers (`data` null: the file does not exist):
//!
//! ```json
//! {"v":1,"file":{"name":"vmlist","data":"…"}}
//! {"v":1,"status":{"pct":"/usr/sbin/pct","path":"/usr/sbin:/usr/bin:/sbin:/bin"}}
//! ```
//!
//! A file the helper will not hand over is an error answer: `config_invalid` when it is not
//! what it should be (a link, a folder or file someone else could change, too large),
//! `pve_unreachable` when it cannot be read at all (pmxcfs down). A helper of an
//! older version refuses both requests as invalid (`exec_request_invalid`).
//!
//! A body of `{"v":0}` ([`PROBE_VERSION`]) is a probe: the helper refuses it as another version
//! (`exec_request_invalid`), which shows that it answers, and runs nothing.
//!
//! Limits: a pushed file or stdin of at most [`MAX_BLOB_BYTES`] (16 MiB, 21.4 MiB as base64);
//! a request frame of at most [`MAX_REQUEST_FRAME`] (24 MiB, which leaves room for the rest);
//! argv and env of at most [`MAX_ARGS`] entries and [`MAX_ARGS_BYTES`] together; timeouts and
//! output caps above [`MAX_TIMEOUT`] and [`MAX_OUTPUT_CAP`] are clamped by the helper; a
//! response frame of at most [`MAX_RESPONSE_FRAME`] (two streams of [`MAX_OUTPUT_CAP`] as
//! base64 fit).

use std::fmt;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{outside_text, outside_text_max, ErrorCode};
use crate::guest::exec::{
    Captured, ExecError, ExecOutcome, ExecRequest, GuestExit, GuestRef, PushReceipt,
    DEFAULT_EXEC_TIMEOUT, DEFAULT_OUTPUT_CAP,
};
use hub_protocol::TxnId;

/// The version of the request and response format.
pub const PROTO_VERSION: u32 = 1;
/// The version of a probe (`{"v":0}`): refused, logged as a probe.
pub const PROBE_VERSION: u64 = 0;
/// The most bytes of a pushed file or of stdin.
pub const MAX_BLOB_BYTES: usize = 16 * 1024 * 1024;
/// The largest request frame body: a [`MAX_BLOB_BYTES`] blob as base64 (22,369,624 bytes) and
/// room for the rest of the request.
pub const MAX_REQUEST_FRAME: u32 = 24 * 1024 * 1024;
/// The most bytes kept per output stream, whatever the caller asks.
pub const MAX_OUTPUT_CAP: usize = 8 * 1024 * 1024;
/// The largest response frame body: two streams of [`MAX_OUTPUT_CAP`] as base64 (22,369,622
/// bytes) and the rest.
pub const MAX_RESPONSE_FRAME: u32 = 24 * 1024 * 1024;
/// The longest a command may run, whatever the caller asks.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(2 * 3600);
/// The most argv entries plus env entries.
pub const MAX_ARGS: usize = 4096;
/// The most bytes of argv and env together.
pub const MAX_ARGS_BYTES: usize = 1024 * 1024;
/// The longest guest path of a push.
pub const MAX_GUEST_PATH_BYTES: usize = 4096;
/// How many bytes of a message (an error's) the other side keeps.
pub const MAX_MESSAGE_BYTES: usize = 4096;
/// The largest cluster file the helper hands over (a 100,000-guest `.vmlist` is about 6 MiB;
/// as base64 it fits a [`MAX_RESPONSE_FRAME`]).
pub const MAX_CLUSTER_FILE_BYTES: usize = MAX_BLOB_BYTES;
/// The most bytes of the helper's `PATH` a status answer carries.
pub const MAX_STATUS_PATH_BYTES: usize = 4096;

/// Why a frame or a request could not be read or is refused.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    /// The peer closed the connection before a whole frame arrived.
    #[error("the connection closed in the middle of a frame ({got} of {want} bytes)")]
    Truncated {
        /// Bytes read.
        got: usize,
        /// Bytes expected.
        want: usize,
    },
    /// The length prefix is above the limit.
    #[error("frame of {len} bytes is larger than the limit of {max} bytes")]
    TooLarge {
        /// The announced length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// Reading or writing the socket failed.
    #[error("socket error: {0}")]
    Io(#[from] std::io::Error),
    /// The request's version is not [`PROTO_VERSION`].
    #[error("request version {0} is not supported (this helper speaks version {PROTO_VERSION}); install the same felhom-agent version for the agent and the helper")]
    Version(u64),
    /// The body is not a valid request or response.
    #[error("invalid request: {0}")]
    Invalid(String),
}

impl ProtoError {
    /// The stable code a refusal of this error carries.
    pub fn code(&self) -> ErrorCode {
        ErrorCode::ExecRequestInvalid
    }
}

/// Read one frame body of at most `max` bytes. The length is checked before the body is read.
pub async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    max: u32,
) -> Result<Vec<u8>, ProtoError> {
    let mut len = [0u8; 4];
    read_full(reader, &mut len).await?;
    let len = u32::from_be_bytes(len);
    if len > max {
        return Err(ProtoError::TooLarge { len, max });
    }
    let mut body = vec![0u8; len as usize];
    read_full(reader, &mut body).await?;
    Ok(body)
}

async fn read_full<R: AsyncRead + Unpin>(reader: &mut R, buf: &mut [u8]) -> Result<(), ProtoError> {
    let mut got = 0;
    while got < buf.len() {
        let n = reader.read(&mut buf[got..]).await?;
        if n == 0 {
            return Err(ProtoError::Truncated {
                got,
                want: buf.len(),
            });
        }
        got += n;
    }
    Ok(())
}

/// Write one frame (length, then `body`) and flush. A body above `max` is refused unwritten.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    writer: &mut W,
    body: &[u8],
    max: u32,
) -> Result<(), ProtoError> {
    let len = u32::try_from(body.len())
        .ok()
        .filter(|l| *l <= max)
        .ok_or(ProtoError::TooLarge {
            len: u32::try_from(body.len()).unwrap_or(u32::MAX),
            max,
        })?;
    writer.write_all(&len.to_be_bytes()).await?;
    writer.write_all(body).await?;
    writer.flush().await?;
    Ok(())
}

/// What a request asks for.
#[derive(Clone, PartialEq, Eq)]
pub enum Op {
    /// Run a command in the container.
    Exec(ExecRequest),
    /// Copy these bytes into the container.
    Push {
        /// The absolute path in the guest.
        path: String,
        /// Permission bits.
        mode: u32,
        /// The file's bytes.
        data: Vec<u8>,
    },
    /// Join the running copy to its application group's lab ([`crate::guest::group_lab::join`]):
    /// one veth pair per stored interface name. Only for the lab the transaction journaled.
    LabJoin {
        /// The lab (the transaction's `group.lab`).
        lab: ulid::Ulid,
        /// The stored interface names.
        names: Vec<String>,
    },
    /// Remove the group's lab ([`crate::guest::group_lab::remove`]): only the lab the transaction
    /// journaled; the container may be gone.
    LabRemove {
        /// The lab (the transaction's `group.lab`).
        lab: ulid::Ulid,
    },
}

impl Op {
    /// `exec`, `push`, `lab_join` or `lab_remove`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Exec(_) => "exec",
            Self::Push { .. } => "push",
            Self::LabJoin { .. } => "lab_join",
            Self::LabRemove { .. } => "lab_remove",
        }
    }
}

impl fmt::Debug for Op {
    // Env values, stdin and file bytes may be secret: the request's Debug shows only sizes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exec(r) => f.debug_tuple("Exec").field(r).finish(),
            Self::Push { path, mode, data } => f
                .debug_struct("Push")
                .field("path", path)
                .field("mode", &format_args!("{mode:o}"))
                .field("bytes", &data.len())
                .finish(),
            Self::LabJoin { lab, names } => f
                .debug_struct("LabJoin")
                .field("lab", lab)
                .field("names", names)
                .finish(),
            Self::LabRemove { lab } => f.debug_struct("LabRemove").field("lab", lab).finish(),
        }
    }
}

/// One request: an operation on one container, on behalf of one journal transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The container.
    pub vmid: u32,
    /// The transaction that holds the claim on it.
    pub txn: TxnId,
    /// What to do.
    pub op: Op,
}

/// A file of the cluster file system the helper hands over: a closed set, each read from the
/// path the helper's own config names; of some only the lines the agent reads
/// (`super::cluster_file::what_crosses`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterFile {
    /// `.vmlist`: every guest of the cluster (`vmlist_path`, default `/etc/pve/.vmlist`).
    Vmlist,
    /// `datacenter.cfg`: only the tag policy and the `next-id` range
    /// (`super::datacenter_cfg::needed_lines`; `datacenter_cfg`).
    DatacenterCfg,
    /// `user.cfg`: only the token, group, role and ACL lines, never a user's
    /// (`super::user_cfg::needed_lines`; `user_cfg_path`).
    UserCfg,
    /// `sdn/vnets.cfg`: which SDN zone each vnet is in (beside `.vmlist`).
    VnetsCfg,
    /// `jobs.cfg`: the cluster's backup jobs, only the lines the agent needs
    /// (`super::jobs_cfg::needed_lines`; `jobs_cfg`).
    JobsCfg,
}

impl ClusterFile {
    /// Every file the helper hands over.
    pub const ALL: [ClusterFile; 5] = [
        Self::Vmlist,
        Self::DatacenterCfg,
        Self::UserCfg,
        Self::VnetsCfg,
        Self::JobsCfg,
    ];

    /// Whether the helper hands the file over whole (`.vmlist`, `sdn/vnets.cfg`); of the
    /// others only the lines the agent reads.
    pub fn crosses_whole(self) -> bool {
        matches!(self, Self::Vmlist | Self::VnetsCfg)
    }

    /// Its name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Self::Vmlist => "vmlist",
            Self::DatacenterCfg => "datacenter.cfg",
            Self::UserCfg => "user.cfg",
            Self::VnetsCfg => "sdn/vnets.cfg",
            Self::JobsCfg => "jobs.cfg",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }
}

/// One request as the helper reads it: for a guest, or about the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Incoming {
    /// An exec or a push for one container.
    Guest(Request),
    /// The bytes of one cluster file.
    Read(ClusterFile),
    /// Where the helper's `pct` resolves.
    Status,
    /// Whether the helper can make an application group's lab here: one made and removed
    /// ([`crate::guest::group_lab::probe`]).
    LabProbe,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequest {
    v: u64,
    op: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    vmid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    txn: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    argv: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    env: Option<Vec<(String, String)>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    stdin: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    output_cap: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mode: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    data: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lab: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    names: Option<Vec<String>>,
}

/// Only the version, read when a body is not a valid request, to say which is wrong.
#[derive(Deserialize)]
struct VersionOnly {
    v: Option<u64>,
}

fn invalid(msg: impl Into<String>) -> ProtoError {
    ProtoError::Invalid(msg.into())
}

fn decode_b64(field: &str, text: &str, max: usize) -> Result<Vec<u8>, ProtoError> {
    // Checked before decoding: base64 is 4 characters per 3 bytes.
    if text.len() / 4 * 3 > max + 3 {
        return Err(invalid(format!(
            "{field} holds more than {max} bytes; send at most {max}"
        )));
    }
    let bytes = B64
        .decode(text)
        .map_err(|e| invalid(format!("{field} is not base64: {e}")))?;
    if bytes.len() > max {
        return Err(invalid(format!(
            "{field} holds {} bytes, more than the {max} allowed",
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// Decode and check a guest request body ([`decode_incoming`] for every request): a `read` or
/// `status` request is refused here. Pure: no IO, every size bounded (the fuzz target's entry).
pub fn decode_request(body: &[u8]) -> Result<Request, ProtoError> {
    match decode_incoming(body)? {
        Incoming::Guest(r) => Ok(r),
        Incoming::Read(_) | Incoming::Status | Incoming::LabProbe => Err(invalid(
            "a read, status or lab_probe request names no guest; an exec or push request was expected",
        )),
    }
}

/// Decode and check any request body. Pure: no IO, every size bounded.
///
/// Refuses an unknown version or field, an op that is neither `exec` nor `push`, a field of the
/// other op, a vmid outside PVE's range, a transaction id that is not a ULID, an empty argv,
/// argv or env entries with NUL bytes, an env key that is not a plain name, a guest path that
/// is not absolute or holds `..`, NUL or a newline, a mode above `0o7777`, a blob above
/// [`MAX_BLOB_BYTES`]; a `read` of a file outside [`ClusterFile`], and a `read` or `status`
/// carrying any other field. Timeouts and caps are taken as given (the helper clamps them).
pub fn decode_incoming(body: &[u8]) -> Result<Incoming, ProtoError> {
    if body.len() > MAX_REQUEST_FRAME as usize {
        return Err(ProtoError::TooLarge {
            len: u32::try_from(body.len()).unwrap_or(u32::MAX),
            max: MAX_REQUEST_FRAME,
        });
    }
    let raw: RawRequest = match serde_json::from_slice(body) {
        Ok(raw) => raw,
        Err(e) => {
            if let Ok(VersionOnly { v: Some(v) }) = serde_json::from_slice::<VersionOnly>(body) {
                if v != u64::from(PROTO_VERSION) {
                    return Err(ProtoError::Version(v));
                }
            }
            return Err(invalid(outside_text(&e.to_string())));
        }
    };
    if raw.v != u64::from(PROTO_VERSION) {
        return Err(ProtoError::Version(raw.v));
    }
    if raw.op == "read" || raw.op == "status" || raw.op == "lab_probe" {
        let only_op = raw.vmid.is_none()
            && raw.txn.is_none()
            && raw.argv.is_none()
            && raw.env.is_none()
            && raw.stdin.is_none()
            && raw.timeout_ms.is_none()
            && raw.output_cap.is_none()
            && raw.path.is_none()
            && raw.mode.is_none()
            && raw.data.is_none()
            && raw.lab.is_none()
            && raw.names.is_none();
        if !only_op {
            return Err(invalid(format!(
                "a {} request carries nothing but {}",
                raw.op,
                if raw.op == "read" { "file" } else { "v and op" }
            )));
        }
        if raw.op == "status" || raw.op == "lab_probe" {
            return match raw.file {
                None if raw.op == "status" => Ok(Incoming::Status),
                None => Ok(Incoming::LabProbe),
                Some(_) => Err(invalid(format!("a {} request carries no file", raw.op))),
            };
        }
        let name = raw.file.ok_or_else(|| {
            invalid("a read request needs file (vmlist, datacenter.cfg, user.cfg, sdn/vnets.cfg or jobs.cfg)")
        })?;
        return ClusterFile::from_name(&name)
            .map(Incoming::Read)
            .ok_or_else(|| {
                invalid(format!(
                    "file {} is not one the helper hands over; only vmlist, datacenter.cfg, user.cfg, sdn/vnets.cfg and jobs.cfg",
                    outside_text(&name)
                ))
            });
    }
    if raw.file.is_some() {
        return Err(invalid("an exec or push request carries no file"));
    }
    let (Some(vmid), Some(raw_txn)) = (raw.vmid, raw.txn.as_deref()) else {
        return Err(invalid(
            "an exec or push request needs vmid and txn (the container and the transaction)",
        ));
    };
    if !(100..=999_999_999).contains(&vmid) {
        return Err(invalid(format!(
            "vmid {vmid} is outside PVE's range 100 to 999999999"
        )));
    }
    let txn = TxnId::parse(raw_txn).map_err(|_| {
        invalid(format!(
            "txn {} is not a transaction id (ULID)",
            outside_text(raw_txn)
        ))
    })?;
    let lab_fields = raw.lab.is_some() || raw.names.is_some();
    if lab_fields && !raw.op.starts_with("lab_") {
        return Err(invalid("an exec or push request carries no lab or names"));
    }
    let op = match raw.op.as_str() {
        "lab_join" | "lab_remove" => {
            if raw.argv.is_some()
                || raw.env.is_some()
                || raw.stdin.is_some()
                || raw.timeout_ms.is_some()
                || raw.output_cap.is_some()
                || raw.path.is_some()
                || raw.mode.is_some()
                || raw.data.is_some()
            {
                return Err(invalid(
                    "a lab request carries only vmid, txn, lab and names",
                ));
            }
            let text = raw
                .lab
                .ok_or_else(|| invalid("a lab request needs lab (the group's lab id, a ULID)"))?;
            let lab = ulid::Ulid::from_string(&text)
                .map_err(|_| invalid(format!("lab {} is not a ULID", outside_text(&text))))?;
            if raw.op == "lab_remove" {
                if raw.names.is_some() {
                    return Err(invalid("a lab_remove request carries no names"));
                }
                Op::LabRemove { lab }
            } else {
                let names = raw.names.unwrap_or_default();
                if names.is_empty() || names.len() > 8 {
                    return Err(invalid(format!(
                        "a lab_join request names {} interfaces; 1 to 8",
                        names.len()
                    )));
                }
                if let Some(bad) = names.iter().find(|n| !crate::guest::lab::valid_ifname(n)) {
                    return Err(invalid(format!(
                        "{} is not an interface name",
                        outside_text_max(bad, 20)
                    )));
                }
                Op::LabJoin { lab, names }
            }
        }
        "exec" => {
            if raw.path.is_some() || raw.mode.is_some() || raw.data.is_some() {
                return Err(invalid("an exec request carries no path, mode or data"));
            }
            let argv = raw.argv.unwrap_or_default();
            let env = raw.env.unwrap_or_default();
            if argv.is_empty() || argv[0].is_empty() {
                return Err(invalid("argv is empty; name the program to run"));
            }
            if argv.len() + env.len() > MAX_ARGS {
                return Err(invalid(format!(
                    "argv and env hold {} entries, more than the {MAX_ARGS} allowed",
                    argv.len() + env.len()
                )));
            }
            let bytes: usize = argv.iter().map(String::len).sum::<usize>()
                + env.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
            if bytes > MAX_ARGS_BYTES {
                return Err(invalid(format!(
                    "argv and env hold {bytes} bytes, more than the {MAX_ARGS_BYTES} allowed"
                )));
            }
            if argv.iter().any(|a| a.contains('\0')) {
                return Err(invalid("an argv entry holds a NUL byte"));
            }
            for (k, v) in &env {
                let plain = !k.is_empty()
                    && !k.starts_with(|c: char| c.is_ascii_digit())
                    && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                if !plain {
                    // The key is not secret; its value is never shown.
                    return Err(invalid(format!(
                        "env key {} is not a variable name (letters, digits, _)",
                        outside_text(k)
                    )));
                }
                if v.contains('\0') {
                    return Err(invalid(format!("the value of env {k} holds a NUL byte")));
                }
            }
            let stdin = raw
                .stdin
                .map(|s| decode_b64("stdin", &s, MAX_BLOB_BYTES))
                .transpose()?;
            let timeout = raw
                .timeout_ms
                .map_or(DEFAULT_EXEC_TIMEOUT, Duration::from_millis);
            let output_cap = raw.output_cap.map_or(DEFAULT_OUTPUT_CAP, |c| {
                usize::try_from(c).unwrap_or(usize::MAX)
            });
            Op::Exec(ExecRequest {
                argv,
                stdin,
                env,
                timeout,
                output_cap,
            })
        }
        "push" => {
            if raw.argv.is_some()
                || raw.env.is_some()
                || raw.stdin.is_some()
                || raw.timeout_ms.is_some()
                || raw.output_cap.is_some()
            {
                return Err(invalid(
                    "a push request carries no argv, env, stdin, timeout_ms or output_cap",
                ));
            }
            let path = raw.path.ok_or_else(|| {
                invalid("a push request needs path (the absolute path in the guest)")
            })?;
            check_push_path(&path)?;
            let mode = raw
                .mode
                .ok_or_else(|| invalid("a push request needs mode (permission bits)"))?;
            if mode > 0o7777 {
                return Err(invalid(format!(
                    "mode {mode:o} is not permission bits (at most 7777)"
                )));
            }
            let data = raw
                .data
                .ok_or_else(|| invalid("a push request needs data (the file's bytes, base64)"))?;
            let data = decode_b64("data", &data, MAX_BLOB_BYTES)?;
            Op::Push { path, mode, data }
        }
        other => {
            return Err(invalid(format!(
                "op {} is unknown; use exec, push, lab_join, lab_remove, read or status",
                outside_text(other)
            )))
        }
    };
    Ok(Incoming::Guest(Request { vmid, txn, op }))
}

fn check_push_path(path: &str) -> Result<(), ProtoError> {
    if path.len() > MAX_GUEST_PATH_BYTES {
        return Err(invalid(format!(
            "path holds {} bytes, more than the {MAX_GUEST_PATH_BYTES} allowed",
            path.len()
        )));
    }
    if !path.starts_with('/')
        || path.ends_with('/')
        || path.split('/').any(|c| c == "..")
        || path.contains(['\0', '\n', '\r'])
    {
        return Err(invalid(format!(
            "path {} must be an absolute file path in the guest, without `..`, NUL or newlines",
            outside_text(path)
        )));
    }
    Ok(())
}

/// The request as bytes (a frame body).
pub fn encode_request(request: &Request) -> Vec<u8> {
    let mut raw = RawRequest {
        v: u64::from(PROTO_VERSION),
        op: request.op.name().to_string(),
        vmid: Some(request.vmid),
        txn: Some(request.txn.to_string()),
        file: None,
        argv: None,
        env: None,
        stdin: None,
        timeout_ms: None,
        output_cap: None,
        path: None,
        mode: None,
        data: None,
        lab: None,
        names: None,
    };
    match &request.op {
        Op::Exec(r) => {
            raw.argv = Some(r.argv.clone());
            raw.env = (!r.env.is_empty()).then(|| r.env.clone());
            raw.stdin = r.stdin.as_ref().map(|b| B64.encode(b));
            raw.timeout_ms = Some(u64::try_from(r.timeout.as_millis()).unwrap_or(u64::MAX));
            raw.output_cap = Some(u64::try_from(r.output_cap).unwrap_or(u64::MAX));
        }
        Op::Push { path, mode, data } => {
            raw.path = Some(path.clone());
            raw.mode = Some(*mode);
            raw.data = Some(B64.encode(data));
        }
        Op::LabJoin { lab, names } => {
            raw.lab = Some(lab.to_string());
            raw.names = Some(names.clone());
        }
        Op::LabRemove { lab } => raw.lab = Some(lab.to_string()),
    }
    serde_json::to_vec(&raw).unwrap_or_default()
}

/// A `read` request for `file` (a frame body).
pub fn encode_read_request(file: ClusterFile) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "v": PROTO_VERSION,
        "op": "read",
        "file": file.name(),
    }))
    .unwrap_or_default()
}

/// A `status` request (a frame body).
pub fn encode_status_request() -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"v": PROTO_VERSION, "op": "status"})).unwrap_or_default()
}

/// A `lab_probe` request (a frame body).
pub fn encode_lab_probe_request() -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"v": PROTO_VERSION, "op": "lab_probe"}))
        .unwrap_or_default()
}

/// A cluster file's bytes on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireFile {
    /// Which file ([`ClusterFile::name`]).
    pub name: String,
    /// Its bytes, base64; null when it does not exist.
    pub data: Option<String>,
}

impl WireFile {
    /// The bytes (`None`: it does not exist), if this is `file` and holds at most
    /// [`MAX_CLUSTER_FILE_BYTES`] (checked before decoding). `Err`: what is wrong with the
    /// answer.
    pub fn into_bytes(self, file: ClusterFile) -> Result<Option<Vec<u8>>, ProtoError> {
        if self.name != file.name() {
            return Err(invalid(format!(
                "asked for {}, the answer is {}",
                file.name(),
                outside_text_max(&self.name, 64)
            )));
        }
        self.data
            .map(|d| decode_b64("data", &d, MAX_CLUSTER_FILE_BYTES))
            .transpose()
    }
}

/// The helper's answer to `status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireStatus {
    /// Where `pct` resolves for the helper, or null when it does not.
    pub pct: Option<String>,
    /// The helper's `PATH` (clipped), or null when it has none.
    pub path: Option<String>,
}

/// How a command ended, on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum WireExit {
    /// Exited with this status.
    Exited(i64),
    /// Killed by this signal.
    Signaled(i32),
    /// Killed at its timeout.
    TimedOut,
}

/// An [`ExecOutcome`] on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireOutcome {
    /// How it ended.
    pub exit: WireExit,
    /// stdout, base64.
    pub stdout: String,
    /// More stdout was produced than kept.
    pub stdout_truncated: bool,
    /// stderr, base64.
    pub stderr: String,
    /// More stderr was produced than kept.
    pub stderr_truncated: bool,
    /// Run time in milliseconds.
    pub duration_ms: u64,
}

/// A [`PushReceipt`] on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireReceipt {
    /// The path in the guest.
    pub path: String,
    /// Its size.
    pub size: u64,
    /// Its SHA-256, hex.
    pub sha256: String,
    /// Its permission bits.
    pub mode: u32,
}

/// A message or detail cut to fit under [`MAX_MESSAGE_BYTES`] (control characters escaped).
fn clip(text: &str) -> String {
    crate::error::outside_text_max(text, MAX_MESSAGE_BYTES - 128)
}

/// Which [`ExecError`] (or the helper's own refusal) an error response stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The helper refused the request (caller, authorization, malformed request, limits).
    Refused,
    /// [`ExecError::InvalidRequest`].
    InvalidRequest,
    /// [`ExecError::Spawn`]: `pct` could not be started.
    Spawn,
    /// [`ExecError::Wait`].
    Wait,
    /// [`ExecError::NoSuchGuest`].
    NoSuchGuest,
    /// [`ExecError::NotRunning`].
    NotRunning,
    /// [`ExecError::PushFailed`].
    PushFailed,
    /// [`ExecError::PushUnverified`].
    PushUnverified,
    /// Any other error while running the request.
    Other,
}

/// An error response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireError {
    /// The stable code.
    pub code: ErrorCode,
    /// What happened and what to do; names the vmid, transaction or file. Never a secret.
    pub message: String,
    /// Which error it stands for.
    pub kind: ErrorKind,
    /// The error's detail alone (PVE's or `pct`'s words), when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl WireError {
    /// A refusal by the helper itself.
    pub fn refused(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: clip(&message.into()),
            kind: ErrorKind::Refused,
            detail: None,
        }
    }

    /// The error of running a request.
    pub fn from_exec_error(e: &ExecError) -> Self {
        let (kind, detail) = match e {
            ExecError::InvalidRequest { reason, .. } => {
                (ErrorKind::InvalidRequest, Some(reason.clone()))
            }
            ExecError::Spawn { source, .. } => (ErrorKind::Spawn, Some(source.to_string())),
            ExecError::Wait { source, .. } => (ErrorKind::Wait, Some(source.to_string())),
            ExecError::NoSuchGuest { detail, .. } => (ErrorKind::NoSuchGuest, Some(detail.clone())),
            ExecError::NotRunning { .. } => (ErrorKind::NotRunning, None),
            ExecError::PushFailed { detail, .. } => (ErrorKind::PushFailed, Some(detail.clone())),
            ExecError::PushUnverified { detail, .. } => {
                (ErrorKind::PushUnverified, Some(detail.clone()))
            }
            _ => (ErrorKind::Other, None),
        };
        Self {
            code: e.code(),
            message: clip(&e.to_string()),
            kind,
            detail: detail.map(|d| clip(&d)),
        }
    }

    /// The [`ExecError`] this stands for, for `guest` (a refusal becomes
    /// [`ExecError::InvalidRequest`] carrying the code and message; `path` is the pushed path,
    /// if any).
    pub fn into_exec_error(self, guest: GuestRef, path: Option<&str>) -> ExecError {
        let detail = self.detail.unwrap_or_else(|| self.message.clone());
        let path = path.unwrap_or_default().to_string();
        match self.kind {
            ErrorKind::NoSuchGuest => ExecError::NoSuchGuest { guest, detail },
            ErrorKind::NotRunning => ExecError::NotRunning { guest },
            ErrorKind::PushFailed => ExecError::PushFailed {
                guest,
                path,
                detail,
            },
            ErrorKind::PushUnverified => ExecError::PushUnverified {
                guest,
                path,
                detail,
            },
            ErrorKind::Spawn => ExecError::Spawn {
                guest,
                program: "pct (through the exec helper)".to_string(),
                source: std::io::Error::other(detail),
            },
            ErrorKind::Wait => ExecError::Wait {
                guest,
                source: std::io::Error::other(detail),
            },
            ErrorKind::InvalidRequest => ExecError::InvalidRequest {
                guest,
                reason: detail,
            },
            ErrorKind::Refused | ErrorKind::Other => ExecError::InvalidRequest {
                guest,
                reason: format!("the exec helper answered {}: {}", self.code, self.message),
            },
        }
    }
}

/// A response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Response {
    /// The command ran (whatever its exit status).
    Exec(WireOutcome),
    /// The file arrived and was verified.
    Push(WireReceipt),
    /// A cluster file's bytes.
    File(WireFile),
    /// Where the helper's `pct` resolves.
    Status(WireStatus),
    /// What a lab request did (clipped text for the report).
    Lab(String),
    /// Refused or failed.
    Error(WireError),
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawResponse {
    v: u64,
    #[serde(flatten)]
    body: Response,
}

impl Response {
    /// The response for an outcome.
    pub fn from_outcome(o: &ExecOutcome) -> Self {
        Self::Exec(WireOutcome {
            exit: match o.exit {
                GuestExit::Exited(c) => WireExit::Exited(c),
                GuestExit::Signaled(s) => WireExit::Signaled(s),
                GuestExit::TimedOut => WireExit::TimedOut,
            },
            stdout: B64.encode(&o.stdout.bytes),
            stdout_truncated: o.stdout.truncated,
            stderr: B64.encode(&o.stderr.bytes),
            stderr_truncated: o.stderr.truncated,
            duration_ms: u64::try_from(o.duration.as_millis()).unwrap_or(u64::MAX),
        })
    }

    /// The response for a receipt.
    pub fn from_receipt(r: &PushReceipt) -> Self {
        Self::Push(WireReceipt {
            path: r.path.clone(),
            size: r.size,
            sha256: r.sha256.clone(),
            mode: r.mode,
        })
    }

    /// The bytes of this response (a frame body).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(&RawResponse {
            v: u64::from(PROTO_VERSION),
            body: self.clone(),
        })
        .unwrap_or_default()
    }

    /// Decode a response body (from the helper: still bounded, and checked).
    pub fn decode(body: &[u8]) -> Result<Self, ProtoError> {
        if body.len() > MAX_RESPONSE_FRAME as usize {
            return Err(ProtoError::TooLarge {
                len: u32::try_from(body.len()).unwrap_or(u32::MAX),
                max: MAX_RESPONSE_FRAME,
            });
        }
        let raw: RawResponse = serde_json::from_slice(body)
            .map_err(|e| invalid(format!("response: {}", outside_text(&e.to_string()))))?;
        if raw.v != u64::from(PROTO_VERSION) {
            return Err(ProtoError::Version(raw.v));
        }
        if let Self::Error(e) = &raw.body {
            if e.message.len() > MAX_MESSAGE_BYTES
                || e.detail
                    .as_ref()
                    .is_some_and(|d| d.len() > MAX_MESSAGE_BYTES)
            {
                return Err(invalid("response: error message too long"));
            }
        }
        if let Self::Lab(note) = &raw.body {
            if note.len() > MAX_MESSAGE_BYTES {
                return Err(invalid("response: lab note too long"));
            }
        }
        if let Self::Status(st) = &raw.body {
            if [&st.pct, &st.path]
                .into_iter()
                .flatten()
                .any(|t| t.len() > MAX_STATUS_PATH_BYTES)
            {
                return Err(invalid("response: status too long"));
            }
        }
        Ok(raw.body)
    }
}

impl WireOutcome {
    /// The [`ExecOutcome`] this stands for; output longer than `cap` is cut to it.
    pub fn into_outcome(self, cap: usize) -> Result<ExecOutcome, ProtoError> {
        let cap = cap.min(MAX_OUTPUT_CAP);
        let stdout = decode_b64("stdout", &self.stdout, MAX_OUTPUT_CAP)?;
        let stderr = decode_b64("stderr", &self.stderr, MAX_OUTPUT_CAP)?;
        Ok(ExecOutcome {
            exit: match self.exit {
                WireExit::Exited(c) => GuestExit::Exited(c),
                WireExit::Signaled(s) => GuestExit::Signaled(s),
                WireExit::TimedOut => GuestExit::TimedOut,
            },
            stdout: Captured::capped(stdout, cap, self.stdout_truncated),
            stderr: Captured::capped(stderr, cap, self.stderr_truncated),
            duration: Duration::from_millis(self.duration_ms),
        })
    }
}

impl WireReceipt {
    /// The [`PushReceipt`] this stands for.
    pub fn into_receipt(self) -> PushReceipt {
        PushReceipt {
            path: self.path,
            size: self.size,
            sha256: self.sha256,
            mode: self.mode,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TXN: &str = "01JD0000000000000000000000";

    fn exec_body(extra: &str) -> Vec<u8> {
        format!(r#"{{"v":1,"op":"exec","vmid":101,"txn":"{TXN}","argv":["id"]{extra}}}"#)
            .into_bytes()
    }

    #[test]
    fn exec_round_trips() {
        let req = Request {
            vmid: 4242,
            txn: TxnId::parse(TXN).expect("txn"),
            op: Op::Exec(
                ExecRequest::new(["sh", "-c", "cat"])
                    .stdin(b"secret\0bytes".to_vec())
                    .env("TOKEN", "v")
                    .timeout(Duration::from_millis(1500))
                    .output_cap(77),
            ),
        };
        let back = decode_request(&encode_request(&req)).expect("decode");
        assert_eq!(back, req);
    }

    #[test]
    fn push_round_trips() {
        let req = Request {
            vmid: 101,
            txn: TxnId::parse(TXN).expect("txn"),
            op: Op::Push {
                path: "/etc/x.conf".into(),
                mode: 0o640,
                data: (0..=255).collect(),
            },
        };
        assert_eq!(decode_request(&encode_request(&req)).expect("decode"), req);
        // Debug never shows the bytes.
        assert!(!format!("{req:?}").contains("255"));
    }

    #[test]
    fn defaults_apply() {
        let r = decode_request(&exec_body("")).expect("decode");
        let Op::Exec(e) = r.op else { panic!("exec") };
        assert_eq!(e.timeout, DEFAULT_EXEC_TIMEOUT);
        assert_eq!(e.output_cap, DEFAULT_OUTPUT_CAP);
        assert!(e.stdin.is_none());
    }

    #[test]
    fn refusals() {
        let cases: &[&[u8]] = &[
            br#"{"v":2,"op":"exec","vmid":101,"txn":"01JD0000000000000000000000","argv":["id"]}"#,
            br#"{"v":2,"op":"exec","vmid":101,"new_field":1}"#,
            br#"{"v":1,"op":"exec","vmid":101,"txn":"01JD0000000000000000000000","argv":["id"],"host_path":"/etc/shadow"}"#,
            br#"{"v":1,"op":"exec","vmid":101,"txn":"01JD0000000000000000000000","argv":[]}"#,
            br#"{"v":1,"op":"exec","vmid":99,"txn":"01JD0000000000000000000000","argv":["id"]}"#,
            br#"{"v":1,"op":"exec","vmid":101,"txn":"nope","argv":["id"]}"#,
            br#"{"v":1,"op":"exec","vmid":101,"txn":"01JD0000000000000000000000","argv":["id"],"env":[["A=B","x"]]}"#,
            br#"{"v":1,"op":"exec","vmid":101,"txn":"01JD0000000000000000000000","argv":["id"],"path":"/x"}"#,
            br#"{"v":1,"op":"push","vmid":101,"txn":"01JD0000000000000000000000","path":"rel","mode":420,"data":""}"#,
            br#"{"v":1,"op":"push","vmid":101,"txn":"01JD0000000000000000000000","path":"/a/../etc/passwd","mode":420,"data":""}"#,
            br#"{"v":1,"op":"push","vmid":101,"txn":"01JD0000000000000000000000","path":"/a","mode":65535,"data":""}"#,
            br#"{"v":1,"op":"push","vmid":101,"txn":"01JD0000000000000000000000","path":"/a","mode":420,"data":"!!"}"#,
            br#"{"v":1,"op":"shell","vmid":101,"txn":"01JD0000000000000000000000"}"#,
            b"not json",
        ];
        for body in cases {
            let err = decode_request(body).expect_err(&String::from_utf8_lossy(body));
            assert_eq!(err.code(), ErrorCode::ExecRequestInvalid);
        }
        assert!(matches!(
            decode_request(cases[0]),
            Err(ProtoError::Version(2))
        ));
        assert!(matches!(
            decode_request(cases[1]),
            Err(ProtoError::Version(2))
        ));
    }

    #[test]
    fn read_and_status_requests_name_nothing_else() {
        assert_eq!(
            decode_incoming(&encode_read_request(ClusterFile::Vmlist)).expect("read"),
            Incoming::Read(ClusterFile::Vmlist)
        );
        // Every file of the closed set, by its name on the wire.
        for file in ClusterFile::ALL {
            assert_eq!(
                decode_incoming(&encode_read_request(file)).expect("read"),
                Incoming::Read(file)
            );
        }
        assert_eq!(
            decode_incoming(br#"{"v":1,"op":"read","file":"jobs.cfg"}"#).expect("jobs.cfg"),
            Incoming::Read(ClusterFile::JobsCfg)
        );
        assert_eq!(
            decode_incoming(&encode_status_request()).expect("status"),
            Incoming::Status
        );
        assert_eq!(
            decode_incoming(&encode_lab_probe_request()).expect("lab_probe"),
            Incoming::LabProbe
        );
        // None is a guest request.
        assert!(decode_request(&encode_read_request(ClusterFile::Vmlist)).is_err());
        assert!(decode_request(&encode_lab_probe_request()).is_err());
        let refused: &[&[u8]] = &[
            // Only the closed set: no path, no other name.
            br#"{"v":1,"op":"read","file":"priv/token.cfg"}"#,
            br#"{"v":1,"op":"read","file":"nodes/pve1/pve-ssl.key"}"#,
            br#"{"v":1,"op":"read","file":"../priv/authkey.key"}"#,
            br#"{"v":1,"op":"read","file":"/etc/pve/jobs.cfg"}"#,
            br#"{"v":1,"op":"read","file":"vzdump.cron"}"#,
            br#"{"v":1,"op":"read"}"#,
            br#"{"v":1,"op":"read","file":"vmlist","path":"/etc/pve/nodes/pve1/pve-ssl.key"}"#,
            br#"{"v":1,"op":"read","file":"vmlist","vmid":101}"#,
            br#"{"v":1,"op":"status","file":"vmlist"}"#,
            br#"{"v":1,"op":"status","argv":["id"]}"#,
            // A probe names no lab, guest or file: it makes one of its own and removes it.
            br#"{"v":1,"op":"lab_probe","lab":"01JD0000000000000000000000"}"#,
            br#"{"v":1,"op":"lab_probe","vmid":101,"txn":"01JD0000000000000000000000"}"#,
            br#"{"v":1,"op":"lab_probe","file":"vmlist"}"#,
            // A guest request carries no file, and still needs its vmid and transaction.
            br#"{"v":1,"op":"exec","vmid":101,"txn":"01JD0000000000000000000000","argv":["id"],"file":"vmlist"}"#,
            br#"{"v":1,"op":"exec","argv":["id"]}"#,
        ];
        for body in refused {
            let err = decode_incoming(body).expect_err(&String::from_utf8_lossy(body));
            assert_eq!(err.code(), ErrorCode::ExecRequestInvalid);
        }
    }

    #[test]
    fn a_file_answer_is_checked_before_its_bytes_are_taken() {
        let ok = WireFile {
            name: "vmlist".into(),
            data: Some(B64.encode(b"{}")),
        };
        assert_eq!(
            ok.clone().into_bytes(ClusterFile::Vmlist).expect("bytes"),
            Some(b"{}".to_vec())
        );
        let missing = WireFile {
            name: "datacenter.cfg".into(),
            data: None,
        };
        assert_eq!(
            missing
                .into_bytes(ClusterFile::DatacenterCfg)
                .expect("none"),
            None
        );
        let back = Response::decode(&Response::File(ok).encode()).expect("decode");
        assert!(matches!(back, Response::File(_)), "{back:?}");
        let other = WireFile {
            name: "user.cfg".into(),
            data: Some(B64.encode(b"{}")),
        };
        assert!(other.into_bytes(ClusterFile::Vmlist).is_err());
        let big = WireFile {
            name: "vmlist".into(),
            data: Some("A".repeat((MAX_CLUSTER_FILE_BYTES / 3 + 8) * 4)),
        };
        assert!(big.into_bytes(ClusterFile::Vmlist).is_err());
        let status = Response::Status(WireStatus {
            pct: None,
            path: Some("x".repeat(MAX_STATUS_PATH_BYTES + 1)),
        });
        assert!(Response::decode(&status.encode()).is_err());
    }

    #[test]
    fn oversized_blob_refused_before_decoding() {
        let big = "A".repeat((MAX_BLOB_BYTES / 3 + 8) * 4);
        let body = exec_body(&format!(r#","stdin":"{big}""#));
        assert!(
            matches!(decode_request(&body), Err(ProtoError::Invalid(m)) if m.contains("stdin"))
        );
    }

    #[tokio::test]
    async fn frame_limit_checked_before_body() {
        // A length of 4 GiB - 1 with no body behind it: refused at once, nothing allocated.
        let bytes = u32::MAX.to_be_bytes();
        let mut r: &[u8] = &bytes;
        assert!(matches!(
            read_frame(&mut r, MAX_REQUEST_FRAME).await,
            Err(ProtoError::TooLarge { .. })
        ));
        let mut out = Vec::new();
        write_frame(&mut out, b"{}", 16).await.expect("write");
        let mut r: &[u8] = &out;
        assert_eq!(read_frame(&mut r, 16).await.expect("read"), b"{}");
        let mut r: &[u8] = &out[..4];
        assert!(matches!(
            read_frame(&mut r, 16).await,
            Err(ProtoError::Truncated { .. })
        ));
    }

    #[test]
    fn error_messages_fit_the_limit() {
        let long = "x\n".repeat(10_000);
        let e = Response::Error(WireError::refused(ErrorCode::ExecNotOwned, long));
        let back = Response::decode(&e.encode()).expect("a long message is clipped, not refused");
        let Response::Error(w) = back else {
            panic!("error")
        };
        assert!(w.message.len() <= MAX_MESSAGE_BYTES && !w.message.contains('\n'));
    }

    #[test]
    fn responses_round_trip() {
        let o = ExecOutcome {
            exit: GuestExit::Exited(3),
            stdout: Captured::capped(b"out".to_vec(), 10, false),
            stderr: Captured::capped(b"err".to_vec(), 10, true),
            duration: Duration::from_millis(1234),
        };
        let r = Response::from_outcome(&o);
        let back = Response::decode(&r.encode()).expect("decode");
        let Response::Exec(w) = back else {
            panic!("exec")
        };
        assert_eq!(w.into_outcome(10).expect("outcome"), o);
        let e = Response::Error(WireError::refused(ErrorCode::ExecNotOwned, "no"));
        let text = String::from_utf8(e.encode()).expect("utf8");
        assert!(text.contains(r#""code":"exec_not_owned""#), "{text}");
        assert_eq!(Response::decode(text.as_bytes()).expect("decode"), e);
        let timed = Response::from_outcome(&ExecOutcome {
            exit: GuestExit::TimedOut,
            ..o
        });
        assert!(String::from_utf8(timed.encode())
            .expect("utf8")
            .contains(r#""exit":"timed_out""#));
    }
}
