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
            PveError::Api(a) => match a.kind {
                ApiErrorKind::Auth => ErrorCode::PveAuth,
                ApiErrorKind::Locked => ErrorCode::GuestLocked,
                ApiErrorKind::Quorum | ApiErrorKind::Transient => ErrorCode::PveUnreachable,
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
            PveError::TaskTimeout { .. } | PveError::Interrupted { .. } => ErrorCode::TaskTimeout,
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
    ApiError {
        method,
        path,
        status,
        message,
        errors,
        kind,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            (502, "Bad Gateway", ApiErrorKind::Transient),
            (595, "No route to host", ApiErrorKind::Transient),
            (501, "Method 'GET /x' not implemented", ApiErrorKind::Other),
        ];
        for (status, msg, want) in cases {
            assert_eq!(&classify(*status, msg), want, "{status} {msg}");
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
