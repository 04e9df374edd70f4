//! Errors of the PVE client, keeping PVE's status and wording, classified so callers can act.
//!
//! The message comes from the body's `message` (libpve-http-server-perl ≥ 5.2.0, all of PVE 9)
//! or, on older PVE, from the HTTP reason phrase, which PVE sets to the first line of the
//! message. Per-parameter `errors` are kept. Secrets never enter these types.

use std::collections::BTreeMap;
use std::time::Duration;

use super::types::GuestKind;
use super::upid::Upid;
use crate::error::ErrorCode;

/// What kind of refusal or failure an API answer is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiErrorKind {
    /// 401: the token was not accepted.
    Auth,
    /// 403: permission check failed. Foreign and missing vmids look the same here.
    Permission,
    /// 400: parameter verification failed.
    Parameter,
    /// `CT 101 already exists on node 'pve1'` (also inside `unable to restore …`).
    AlreadyExists {
        /// CT or VM.
        holder: GuestKind,
        /// The vmid.
        vmid: u32,
        /// The node PVE named.
        node: String,
    },
    /// `CT is locked (backup)`, `can't lock file … got timeout`.
    Locked,
    /// `cluster not ready - no quorum?`.
    Quorum,
    /// `CT 201 already running`, `VM 201 already running`.
    AlreadyRunning,
    /// `VM 300 is not running`, `container '300' not running!`.
    NotRunning,
    /// `QEMU guest agent is not running` / `No QEMU guest agent configured`.
    AgentUnavailable,
    /// `hostname lookup 'pve9' failed - …` / `no such cluster node 'pve9'`: the node of the
    /// path is no node of this cluster (pve-cluster `PVE/Cluster.pm` `remote_node_ip` →
    /// pve-common `PVE/Network.pm` `get_ip_from_hostname`, `check_node_exists`): the agent's
    /// `node` is wrong.
    NoSuchNode,
    /// PVE answered and refused: a 5xx whose wording is one of PVE's known refusals (`storage
    /// 'x' does not exist`, `Parameter verification failed.`, `unable to use volume …`).
    /// Never retried, never "unreachable".
    Refusal,
    /// 5xx/59x and proxy errors that may pass: worth retrying a read.
    Transient,
    /// Anything else (e.g. 501, 500 with a definite handler message).
    Other,
}

/// An error answer of the API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP method.
    pub method: &'static str,
    /// Path below `/api2/json`, without the query.
    pub path: String,
    /// HTTP status.
    pub status: u16,
    /// PVE's message, trailing newline removed.
    pub message: String,
    /// Per-parameter errors.
    pub errors: BTreeMap<String, String>,
    /// The classification.
    pub kind: ApiErrorKind,
}

/// Everything the PVE client can fail with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PveError {
    /// The server's certificate does not match the pin; no request was sent.
    #[error("the certificate of {url} has SHA-256 fingerprint {seen}, but the config pins {expected}; no request was sent. If the node's certificate was renewed, check it with `pvenode cert info` on the node and update [pve] tls_fingerprint")]
    TlsPinMismatch {
        /// The URL.
        url: String,
        /// The pinned fingerprint.
        expected: String,
        /// The fingerprint the server presented.
        seen: String,
    },
    /// TLS failed for another reason (CA mismatch, bad certificate).
    #[error("TLS with {url} failed: {detail}; check [pve] ca_file / tls_fingerprint")]
    Tls {
        /// The URL.
        url: String,
        /// What failed.
        detail: String,
    },
    /// No answer: connection refused or reset, DNS, timeout.
    #[error("PVE at {url} is unreachable: {detail}; check that pveproxy runs (`systemctl status pveproxy`) and [pve] url")]
    Unreachable {
        /// The URL.
        url: String,
        /// What failed.
        detail: String,
    },
    /// PVE answered with an error.
    #[error("{}", api_message(.0))]
    Api(ApiError),
    /// PVE answered something this client cannot read.
    #[error("unexpected answer to {method} {path}: {detail}")]
    Decode {
        /// HTTP method.
        method: &'static str,
        /// Path.
        path: String,
        /// What was wrong.
        detail: String,
    },
    /// A task ended with an error.
    #[error("task {upid} failed: {exitstatus}{}", log_tail_suffix(.log_tail))]
    TaskFailed {
        /// The task.
        upid: Upid,
        /// PVE's exit status text.
        exitstatus: String,
        /// The last lines of the task log.
        log_tail: Vec<String>,
    },
    /// A task did not end in time.
    #[error("task {upid} did not finish within {}s; it may still be running: check `pvenode task status {upid}` on node {}", .waited.as_secs(), .upid.node)]
    TaskTimeout {
        /// The task.
        upid: Upid,
        /// How long it was followed.
        waited: Duration,
    },
    /// Interrupted (Ctrl-C / SIGTERM) while following a task. The task goes on in PVE: the
    /// agent never aborts its own task on a shutdown (a stopped QEMU restore leaves a config
    /// outside the pool), and the next start follows it by its UPID.
    #[error(
        "interrupted while following task {upid}; the task goes on in PVE and the next agent start follows it to its end"
    )]
    Interrupted {
        /// The task.
        upid: Upid,
    },
}

fn api_message(e: &ApiError) -> String {
    let mut s = format!(
        "PVE refused {} {} ({}): {}",
        e.method, e.path, e.status, e.message
    );
    for (k, v) in &e.errors {
        s.push_str(&format!("; {k}: {}", v.trim_end()));
    }
    match e.kind {
        ApiErrorKind::Auth => s.push_str("; check [pve] token_id and the token secret file, and that the token exists and is not expired (`pveum user token list`)"),
        ApiErrorKind::Permission => s.push_str("; the pool token lacks this privilege or the guest is outside the pool (foreign and missing vmids answer alike); `felhom-agent doctor` lists missing privileges"),
        ApiErrorKind::Quorum => s.push_str("; the cluster has no quorum, check `pvecm status`"),
        ApiErrorKind::NoSuchNode => s.push_str("; `node` in the agent's config names no node of this cluster: set it to this node's name (`hostname` on the node; `pvecm nodes` lists the cluster's nodes)"),
        _ => {}
    }
    s
}

fn log_tail_suffix(tail: &[String]) -> String {
    if tail.is_empty() {
        String::new()
    } else {
        format!(" (log tail: {})", tail.join(" | "))
    }
}

impl PveError {
    /// The stable code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            PveError::TlsPinMismatch { .. } => ErrorCode::TlsPinMismatch,
            PveError::Tls { .. } | PveError::Unreachable { .. } => ErrorCode::PveUnreachable,
            PveError::Api(a) if is_pool_missing_message(&a.message) => ErrorCode::PoolMissing,
            PveError::Api(a) => match a.kind {
                ApiErrorKind::Auth => ErrorCode::PveAuth,
                ApiErrorKind::Locked => ErrorCode::GuestLocked,
                ApiErrorKind::Quorum => ErrorCode::PveUnreachable,
                ApiErrorKind::NoSuchNode => ErrorCode::ConfigInvalid,
                // PVE itself answered 500 (a handler's `die`): an answer, not unreachability. A
                // proxy's 502-504 or AnyEvent's 59x mean the node behind it gave no answer.
                ApiErrorKind::Transient if a.status == 500 => ErrorCode::PveRefused,
                ApiErrorKind::Transient => ErrorCode::PveUnreachable,
                _ => ErrorCode::PveRefused,
            },
            PveError::Decode { .. } => ErrorCode::PveRefused,
            PveError::TaskFailed { exitstatus, .. } => {
                if is_locked_message(exitstatus) {
                    ErrorCode::GuestLocked
                } else {
                    ErrorCode::TaskFailed
                }
            }
            PveError::TaskTimeout { .. } => ErrorCode::TaskTimeout,
            PveError::Interrupted { .. } => ErrorCode::Interrupted,
        }
    }

    /// The API error, if this is one.
    pub fn api(&self) -> Option<&ApiError> {
        match self {
            PveError::Api(a) => Some(a),
            _ => None,
        }
    }

    /// Whether a read may be retried after this error.
    pub fn is_transient(&self) -> bool {
        match self {
            PveError::Unreachable { .. } => true,
            PveError::Api(a) => a.kind == ApiErrorKind::Transient,
            _ => false,
        }
    }

    /// `already exists` refusal: (holder kind, vmid, node).
    pub fn already_exists(&self) -> Option<(GuestKind, u32, String)> {
        match self {
            PveError::Api(ApiError {
                kind: ApiErrorKind::AlreadyExists { holder, vmid, node },
                ..
            }) => Some((*holder, *vmid, node.clone())),
            PveError::TaskFailed { exitstatus, .. } => parse_already_exists(exitstatus),
            _ => None,
        }
    }
}

fn is_locked_message(m: &str) -> bool {
    (m.contains(" is locked (") || m.starts_with("CT is locked") || m.starts_with("VM is locked"))
        || (m.contains("can't lock file") && m.contains("got timeout"))
}

/// Find `CT|VM <vmid> already exists on node '<node>'` anywhere in a message.
pub fn parse_already_exists(m: &str) -> Option<(GuestKind, u32, String)> {
    let idx = m.find(" already exists on node '")?;
    let before = &m[..idx];
    let vmid_str = before.rsplit(' ').next()?;
    let vmid: u32 = vmid_str.parse().ok()?;
    let word_end = before.len().checked_sub(vmid_str.len() + 1)?;
    let word = before[..word_end].rsplit(' ').next()?;
    let holder = match word {
        "CT" => GuestKind::Lxc,
        "VM" => GuestKind::Qemu,
        _ => return None,
    };
    let rest = &m[idx + " already exists on node '".len()..];
    let node = rest.split('\'').next()?.to_string();
    Some((holder, vmid, node))
}

/// PVE's wordings of a definite refusal that it sends as a plain 500 (a handler's `die`).
/// Sources: pve-storage `PVE/Storage.pm` and plugins, pve-access-control `RPCEnvironment.pm`,
/// pve-container `API2/LXC.pm`, qemu-server `API2/Qemu.pm`, pve-guest-common
/// `AbstractConfig.pm`, pve-common `JSONSchema.pm` / `RESTHandler.pm`, as read for this
/// project's PVE notes.
const REFUSAL_WORDINGS: &[&str] = &[
    // `storage 'x' does not exist`, `pool 'x' does not exist`, `volume '…' does not exist`,
    // `Configuration file 'nodes/…/lxc/120.conf' does not exist`, `snapshot 'x' does not exist`
    " does not exist",
    "Parameter verification failed",
    "unable to use volume ",
    "missing privileges to access ",
    "unable to parse directory volume name",
    "unable to parse volume ID",
    "does not support container directories",
    "is not available on storage",
    "does not allow content type",
    "is not available on node",
    "' is disabled",
    "is not online",
    "Only root can",
    "protection mode enabled",
    "can't overwrite running container",
    "no such ",
    // pve-guest-common `src/PVE/ReplicationConfig.pm` `check_for_existing_jobs`, which a guest
    // DELETE without `purge` runs: "There is a replication job '<id>' for guest '<vmid>' -
    // Please remove that first." A person must remove the job; sending again changes nothing.
    "Please remove that first",
];

/// Whether `message` says a pool does not exist: pve-access-control `src/PVE/RPCEnvironment.pm`
/// `check_pool_exist` (`403 Permission check failed (pool 'x' does not exist)`, a restore into
/// it) and pve-manager `PVE/API2/Pool.pm` `index` (`500 pool 'x' does not exist`,
/// `GET /pools?poolid=x`).
pub fn is_pool_missing_message(message: &str) -> bool {
    let Some(start) = message.find("pool '") else {
        return false;
    };
    let rest = &message[start + "pool '".len()..];
    rest.split_once('\'')
        .is_some_and(|(id, after)| !id.is_empty() && after.starts_with(" does not exist"))
        && !message[..start].ends_with("of ")
}

/// Whether `message` is one of PVE's known refusals (see [`REFUSAL_WORDINGS`]).
pub fn is_refusal_message(message: &str) -> bool {
    REFUSAL_WORDINGS.iter().any(|w| message.contains(w))
}

/// Classify an error answer from its status and message.
pub fn classify(status: u16, message: &str) -> ApiErrorKind {
    if status == 401 {
        return ApiErrorKind::Auth;
    }
    if status == 403 {
        return ApiErrorKind::Permission;
    }
    if status == 400 {
        return ApiErrorKind::Parameter;
    }
    if let Some((holder, vmid, node)) = parse_already_exists(message) {
        return ApiErrorKind::AlreadyExists { holder, vmid, node };
    }
    if is_locked_message(message) {
        return ApiErrorKind::Locked;
    }
    if message.contains("no quorum") {
        return ApiErrorKind::Quorum;
    }
    if (message.starts_with("hostname lookup '") && message.contains("' failed"))
        || message.starts_with("no such cluster node '")
    {
        return ApiErrorKind::NoSuchNode;
    }
    if message.contains("already running") {
        return ApiErrorKind::AlreadyRunning;
    }
    if message.contains("QEMU guest agent is not running")
        || message.contains("No QEMU guest agent configured")
    {
        return ApiErrorKind::AgentUnavailable;
    }
    if message.contains("is not running") || message.contains("not running!") {
        return ApiErrorKind::NotRunning;
    }
    if (500..600).contains(&status) && is_refusal_message(message) {
        return ApiErrorKind::Refusal;
    }
    match status {
        500 | 502 | 503 | 504 | 590..=599 => ApiErrorKind::Transient,
        _ => ApiErrorKind::Other,
    }
}

/// Decode an error answer: the body's `message` (new PVE) or the reason phrase (old PVE), plus
/// `errors`. `reason` is the reason phrase as sent, when known.
pub fn decode_error(
    method: &'static str,
    path: &str,
    status: u16,
    reason: Option<&str>,
    body: &[u8],
) -> ApiError {
    let parsed: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let body_message = parsed
        .as_ref()
        .and_then(|v| v.get("message"))
        .and_then(|m| m.as_str())
        .map(|s| s.trim_end().to_string())
        .filter(|s| !s.is_empty());
    let mut errors = BTreeMap::new();
    if let Some(obj) = parsed
        .as_ref()
        .and_then(|v| v.get("errors"))
        .and_then(|e| e.as_object())
    {
        for (k, v) in obj {
            let text = v
                .as_str()
                .map_or_else(|| v.to_string(), |s| s.trim_end().to_string());
            errors.insert(k.clone(), text);
        }
    }
    let plain_body = if parsed.is_none() {
        let s = String::from_utf8_lossy(body);
        let first = s.lines().next().unwrap_or("").trim().to_string();
        (!first.is_empty() && !first.starts_with('<')).then_some(first)
    } else {
        None
    };
    let message = body_message
        .or_else(|| {
            reason
                .map(|r| r.trim().to_string())
                .filter(|r| !r.is_empty())
        })
        .or(plain_body)
        .unwrap_or_else(|| format!("HTTP {status}"));
    let kind = classify(status, &message);
    let path = path.split('?').next().unwrap_or(path).to_string();
    // PVE's own wordings are short; what is longer came from elsewhere (a guest, a backup).
    let message = clip_pve_text(message, MAX_API_MESSAGE_BYTES);
    let errors = errors
        .into_iter()
        .take(32)
        .map(|(k, v)| (clip_pve_text(k, 128), clip_pve_text(v, 512)))
        .collect();
    ApiError {
        method,
        path,
        status,
        message,
        errors,
        kind,
    }
}

/// The longest error message kept from a PVE answer.
pub const MAX_API_MESSAGE_BYTES: usize = 2048;

fn clip_pve_text(text: String, max: usize) -> String {
    if text.len() <= max {
        text
    } else {
        crate::error::outside_text_max(&text, max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_pool_has_its_own_code() {
        for (status, m) in [
            (
                403,
                "Permission check failed (pool 'felhom' does not exist)",
            ),
            (500, "pool 'felhom' does not exist"),
        ] {
            let e = PveError::Api(decode_error("GET", "/pools", status, Some(m), b""));
            assert_eq!(e.code(), ErrorCode::PoolMissing, "{m}");
        }
        for m in [
            "storage 'local' does not exist",
            "parent 'a' of pool 'a/b' does not exist",
            "Permission check failed (/pool/felhom, Pool.Audit)",
        ] {
            assert!(!is_pool_missing_message(m), "{m}");
        }
    }

    #[test]
    fn a_replication_job_is_a_refusal_never_retried() {
        let m = "There is a replication job '120-0' for guest '120' - Please remove that first.";
        let e = decode_error(
            "DELETE",
            "/nodes/pve1/lxc/120",
            500,
            Some(m),
            format!("{{\"data\":null,\"message\":\"{m}\\n\"}}").as_bytes(),
        );
        assert_eq!(e.kind, ApiErrorKind::Refusal);
        assert_eq!(e.message, m);
        let err = PveError::Api(e);
        assert!(!err.is_transient());
        assert_eq!(err.code(), ErrorCode::PveRefused);
    }

    #[test]
    fn new_format_message_wins() {
        let e = decode_error(
            "POST",
            "/nodes/pve1/lxc",
            500,
            Some("CT 101 already exists on node 'pve1'"),
            br#"{"data":null,"message":"CT 101 already exists on node 'pve1'\n"}"#,
        );
        assert_eq!(e.message, "CT 101 already exists on node 'pve1'");
        assert_eq!(
            e.kind,
            ApiErrorKind::AlreadyExists {
                holder: GuestKind::Lxc,
                vmid: 101,
                node: "pve1".into()
            }
        );
    }

    #[test]
    fn old_format_uses_reason_phrase() {
        let e = decode_error(
            "GET",
            "/nodes/pve1/lxc/101/status/current",
            403,
            Some("Permission check failed (/vms/101, VM.Audit)"),
            br#"{"data":null}"#,
        );
        assert_eq!(e.message, "Permission check failed (/vms/101, VM.Audit)");
        assert_eq!(e.kind, ApiErrorKind::Permission);
    }

    #[test]
    fn parameter_errors_are_kept() {
        let e = decode_error(
            "POST",
            "/nodes/pve1/lxc",
            400,
            Some("Parameter verification failed."),
            br#"{"data":null,"errors":{"storage":"storage 'local' does not support container directories\n"},"message":"Parameter verification failed.\n"}"#,
        );
        assert_eq!(e.kind, ApiErrorKind::Parameter);
        assert_eq!(
            e.errors.get("storage").map(String::as_str),
            Some("storage 'local' does not support container directories")
        );
        let shown = PveError::Api(e).to_string();
        assert!(
            shown.contains("storage: storage 'local' does not support"),
            "{shown}"
        );
    }

    #[test]
    fn auth_has_empty_body() {
        let e = decode_error("GET", "/version", 401, Some("Authentication failed!"), b"");
        assert_eq!(e.kind, ApiErrorKind::Auth);
        assert_eq!(PveError::Api(e).code(), ErrorCode::PveAuth);
    }

    #[test]
    fn classification_table() {
        let cases: &[(u16, &str, ApiErrorKind)] = &[
            (
                500,
                "VM 990000 already exists on node 'pve1'",
                ApiErrorKind::AlreadyExists {
                    holder: GuestKind::Qemu,
                    vmid: 990000,
                    node: "pve1".into(),
                },
            ),
            (
                500,
                "unable to restore CT 123 - CT 123 already exists on node 'pve2'",
                ApiErrorKind::AlreadyExists {
                    holder: GuestKind::Lxc,
                    vmid: 123,
                    node: "pve2".into(),
                },
            ),
            (500, "CT is locked (backup)", ApiErrorKind::Locked),
            (
                500,
                "can't lock file '/run/lock/lxc/pve-config-200.lock' - got timeout",
                ApiErrorKind::Locked,
            ),
            (500, "cluster not ready - no quorum?", ApiErrorKind::Quorum),
            (500, "CT 201 already running", ApiErrorKind::AlreadyRunning),
            (
                500,
                "QEMU guest agent is not running",
                ApiErrorKind::AgentUnavailable,
            ),
            (500, "VM 300 is not running", ApiErrorKind::NotRunning),
            (500, "internal error", ApiErrorKind::Transient),
            (
                500,
                "storage 'nosuchstore' does not exist",
                ApiErrorKind::Refusal,
            ),
            (502, "Bad Gateway", ApiErrorKind::Transient),
            (595, "No route to host", ApiErrorKind::Transient),
            (501, "Method 'GET /x' not implemented", ApiErrorKind::Other),
        ];
        for (status, msg, want) in cases {
            assert_eq!(&classify(*status, msg), want, "{status} {msg}");
        }
    }

    /// PVE's own wordings (status, message) and the code each must get. Copied from the
    /// project's PVE API notes, which cite: pve-storage `PVE/Storage.pm`
    /// (`check_volume_access`, `storage_config`), pve-container `src/PVE/API2/LXC.pm`
    /// (`create_vm`), pve-guest-common `PVE/AbstractConfig.pm` (`load_config`),
    /// pve-access-control `RPCEnvironment.pm` (`check_pool_exist`), pve-common
    /// `JSONSchema.pm`, pve-cluster `Cluster.pm`, pve-http-server `AnyEvent.pm`, and fakepve
    /// 0.5.0's copies of them.
    const PVE_WORDINGS: &[(u16, &str, ErrorCode)] = &[
        // storage src/PVE/Storage.pm storage_config (and fakepve lxc.py _storage_for)
        (
            500,
            "storage 'nosuchstore' does not exist",
            ErrorCode::PveRefused,
        ),
        // manager PVE/API2/Pool.pm: unknown pool after Pool.Audit
        (500, "pool 'nope' does not exist", ErrorCode::PoolMissing),
        // guest PVE/AbstractConfig.pm load_config, for a token with rights on /vms
        (
            500,
            "Configuration file 'nodes/pve1/lxc/555.conf' does not exist",
            ErrorCode::PveRefused,
        ),
        // container LXC.pm create_vm step 6 (storage check_volume_access)
        (
            500,
            "unable to use volume local:iso/x.iso - content type needs to be 'backup'",
            ErrorCode::PveRefused,
        ),
        (
            500,
            "missing privileges to access local:backup/vzdump-lxc-101-2024_01_02-03_04_05.tar.zst",
            ErrorCode::PveRefused,
        ),
        // qemu-server restore: storage content errors
        (
            500,
            "Content type 'images' is not available on storage 'local'",
            ErrorCode::PveRefused,
        ),
        // storage: disabled / not on this node / offline (fakepve storage.py _check_enabled)
        (500, "storage 'nfs1' is disabled", ErrorCode::PveRefused),
        (
            500,
            "storage 'nfs1' is not available on node 'pve1'",
            ErrorCode::PveRefused,
        ),
        (500, "storage 'nfs1' is not online", ErrorCode::PveRefused),
        // container LXC.pm create_vm with force=1
        (
            500,
            "can't overwrite running container",
            ErrorCode::PveRefused,
        ),
        (
            500,
            "unable to restore CT 123 - protection mode enabled",
            ErrorCode::PveRefused,
        ),
        // common JSONSchema.pm / RESTHandler.pm: parameter verification is a 400 exception
        (400, "Parameter verification failed.", ErrorCode::PveRefused),
        // the same wording where a handler re-dies with it as a plain 500
        (500, "Parameter verification failed.", ErrorCode::PveRefused),
        // cluster Cluster.pm check_vmid_unused
        (
            500,
            "CT 123 already exists on node 'pve1'",
            ErrorCode::PveRefused,
        ),
        // acl RPCEnvironment.pm check_pool_exist
        (
            403,
            "Permission check failed (pool 'nope' does not exist)",
            ErrorCode::PoolMissing,
        ),
        (401, "Authentication failed!", ErrorCode::PveAuth),
        (500, "CT is locked (backup)", ErrorCode::GuestLocked),
        // cluster Cluster.pm check_cfs_quorum: the cluster cannot answer for its state
        (
            500,
            "cluster not ready - no quorum?",
            ErrorCode::PveUnreachable,
        ),
        // a handler's unknown 500 is still an answer
        (500, "internal error", ErrorCode::PveRefused),
        // proxies and AnyEvent::HTTP's synthetic codes: no answer from the node
        (502, "Bad Gateway", ErrorCode::PveUnreachable),
        (595, "No route to host", ErrorCode::PveUnreachable),
        (596, "Connection timed out", ErrorCode::PveUnreachable),
    ];

    #[test]
    fn pve_wordings_are_classified_by_what_they_say() {
        for (status, message, want) in PVE_WORDINGS {
            let e = decode_error(
                "POST",
                "/nodes/pve1/lxc",
                *status,
                Some(message),
                format!("{{\"data\":null,\"message\":\"{message}\\n\"}}").as_bytes(),
            );
            assert_eq!(&e.message, message, "message kept");
            let err = PveError::Api(e);
            assert_eq!(err.code(), *want, "{status} {message:?}: {err}");
            if *want == ErrorCode::PveRefused && is_refusal_message(message) {
                assert!(!err.is_transient(), "{status} {message:?} is not retried");
            }
        }
        // Known refusal wordings never read as unreachable, whatever 5xx carries them.
        for (_, message, want) in PVE_WORDINGS {
            if *want == ErrorCode::PveRefused && is_refusal_message(message) {
                let kind = classify(500, message);
                assert!(
                    matches!(
                        kind,
                        ApiErrorKind::Refusal | ApiErrorKind::AlreadyExists { .. }
                    ),
                    "{message:?}: {kind:?}"
                );
            }
        }
    }

    #[test]
    fn html_proxy_page_falls_back_to_reason() {
        let e = decode_error(
            "GET",
            "/version",
            502,
            Some("Bad Gateway"),
            b"<html><body>proxy</body></html>",
        );
        assert_eq!(e.message, "Bad Gateway");
        assert!(PveError::Api(e).is_transient());
    }

    #[test]
    fn task_error_locked_code() {
        let u: Upid = "UPID:pve1:000003E8:00001B58:6B0CA4FD:vzstart:200:a@pve!t:"
            .parse()
            .unwrap();
        let e = PveError::TaskFailed {
            upid: u,
            exitstatus: "CT is locked (backup)".into(),
            log_tail: vec![],
        };
        assert_eq!(e.code(), ErrorCode::GuestLocked);
    }
}
