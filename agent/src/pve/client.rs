//! The transport: reqwest over rustls with the pinned or CA-trusted certificate, token auth,
//! the `{"data": …}` envelope, and retries of idempotent reads only.

use std::collections::BTreeMap;
use std::time::Duration;

use reqwest::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::error::{decode_error, PveError};
use super::request::{build, token_header, ApiRequest, LxcRestore, Method, QemuRestore};
use super::types::*;
use super::upid::Upid;
use crate::config::{format_fingerprint, PveConfig, TlsTrust};
use crate::tls::{self, PinObserver};

/// pveproxy closes idle keep-alive connections after 5 s; ours are dropped before that.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// Connecting (TCP + TLS) may take this long.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// One request may take this long (PVE answers 401 after a deliberate ~3 s delay).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The largest PVE answer body read; a larger one is an error naming the request path.
pub const MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;
/// What qemu-ga keeps of one stream of a command's output (QEMU `qga/commands.c`
/// `GUEST_EXEC_MAX_OUTPUT`, 16 MiB).
pub const QGA_MAX_OUTPUT: usize = 16 * 1024 * 1024;
/// The largest `agent/info` answer read: qemu-ga 7.2 lists about 45 commands in under 4 KiB;
/// a guest that answers more is not read further.
pub const MAX_AGENT_INFO_BYTES: usize = 256 * 1024;

/// The largest `agent/exec-status` answer read: both streams at qemu-ga's 16 MiB each, every
/// byte at most two in PVE's JSON (qemu-server `PVE/API2/Qemu/Agent.pm` `exec-status` hands the
/// decoded bytes over as characters, which UTF-8 writes as one or two bytes), plus 1 MiB for
/// the envelope and the other fields. Output of control characters (escaped as six) can exceed
/// it; then the error names the request.
pub const MAX_EXEC_STATUS_BYTES: usize = 2 * QGA_MAX_OUTPUT * 2 + 1024 * 1024;

/// How reads are retried after transient failures. Writes are never retried.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Total attempts for a read (1 = no retry).
    pub attempts: u32,
    /// Delay before the first retry; doubled each time.
    pub first_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts: 4,
            first_delay: Duration::from_millis(200),
        }
    }
}

/// A client of one PVE node's API.
#[derive(Debug, Clone)]
pub struct PveClient {
    http: reqwest::Client,
    base: String,
    auth: HeaderValue,
    observer: PinObserver,
    pinned: Option<String>,
    retry: RetryPolicy,
    /// Requests in flight from this client, at most: unbounded but for a restore run, whose
    /// copies at once share one client ([`PveClient::with_max_in_flight`]).
    in_flight: std::sync::Arc<tokio::sync::Semaphore>,
}

/// The most requests a restore run's copies have in flight at once: pvedaemon serves the API
/// with 3 workers (pve-manager `PVE/Service/pvedaemon.pm` `max_workers => 3`), and the copies
/// must leave the node's other callers one.
pub const MAX_IN_FLIGHT: usize = 2;
/// A bound that never binds (a provision sends its few reads together).
const UNBOUNDED_IN_FLIGHT: usize = 1024;

impl PveClient {
    /// Build a client from the `[pve]` config. No request is sent.
    pub fn new(cfg: &PveConfig) -> Result<Self, PveError> {
        let (tls_config, observer) = tls::client_config(&cfg.tls).map_err(|e| PveError::Tls {
            url: cfg.url.clone(),
            detail: e.to_string(),
        })?;
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls_config)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .no_proxy()
            .build()
            .map_err(|e| PveError::Tls {
                url: cfg.url.clone(),
                detail: e.to_string(),
            })?;
        let mut auth = HeaderValue::from_str(&token_header(&cfg.token_id, cfg.token_secret.expose()))
            .map_err(|_| PveError::Tls {
                url: cfg.url.clone(),
                detail: format!(
                    "the token id or the secret in {} contains characters not allowed in an HTTP header",
                    cfg.token_secret_file.display()
                ),
            })?;
        auth.set_sensitive(true);
        let pinned = match &cfg.tls {
            TlsTrust::Pin(p) => Some(format_fingerprint(p)),
            TlsTrust::CaFile(_) => None,
        };
        Ok(Self {
            http,
            base: cfg.url.clone(),
            auth,
            observer,
            pinned,
            retry: RetryPolicy::default(),
            in_flight: std::sync::Arc::new(tokio::sync::Semaphore::new(UNBOUNDED_IN_FLIGHT)),
        })
    }

    /// This client with at most `n` requests in flight at once (its clones share the bound).
    pub fn with_max_in_flight(mut self, n: usize) -> Self {
        self.in_flight = std::sync::Arc::new(tokio::sync::Semaphore::new(n.max(1)));
        self
    }

    /// Replace the retry policy (tests use short delays).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// The base URL.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// Send a request and return the `data` of the envelope. Reads are retried on transient
    /// failures with exponential backoff; writes are sent exactly once.
    pub async fn call(&self, req: &ApiRequest) -> Result<Value, PveError> {
        let mut envelope = self.call_envelope(req).await?;
        Ok(envelope.remove("data").unwrap_or(Value::Null))
    }

    /// Like [`call`](Self::call), but the whole envelope (`data`, `total`, …).
    pub async fn call_envelope(
        &self,
        req: &ApiRequest,
    ) -> Result<serde_json::Map<String, Value>, PveError> {
        let attempts = if req.is_idempotent_read() {
            self.retry.attempts.max(1)
        } else {
            1
        };
        let mut delay = self.retry.first_delay;
        let mut attempt = 1;
        loop {
            match self.send_once(req, MAX_RESPONSE_BYTES).await {
                Err(e) if attempt < attempts && e.is_transient() => {
                    tracing::debug!(method = req.method.as_str(), path = %req.path, attempt, error = %e, "transient PVE error, retrying read");
                    tokio::time::sleep(delay).await;
                    delay = delay.saturating_mul(2);
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// [`call`](Self::call) and decode `data` into `T`.
    pub async fn call_as<T: DeserializeOwned>(&self, req: &ApiRequest) -> Result<T, PveError> {
        let data = self.call(req).await?;
        serde_json::from_value(data).map_err(|e| PveError::Decode {
            method: req.method.as_str(),
            path: req.path.clone(),
            detail: e.to_string(),
        })
    }

    async fn send_once(
        &self,
        req: &ApiRequest,
        max_answer: usize,
    ) -> Result<serde_json::Map<String, Value>, PveError> {
        // A closed semaphore never happens (it is never closed); go on without a permit then.
        let _permit = self.in_flight.acquire().await.ok();
        let started = std::time::Instant::now();
        let result = self.exchange(req, max_answer).await;
        // One line per request, worth turning on: method, path (never the query, a header or
        // a body), PVE's status and the time taken.
        let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        match &result {
            Ok((status, _, _)) => tracing::debug!(
                method = req.method.as_str(),
                path = %req.path,
                status = status.as_u16(),
                ms,
                "PVE request"
            ),
            Err(e) => tracing::debug!(
                method = req.method.as_str(),
                path = %req.path,
                status = "none",
                ms,
                error = e.code().as_str(),
                "PVE request"
            ),
        }
        let (status, reason, bytes) = result?;
        if !status.is_success() {
            let reason = reason.or_else(|| status.canonical_reason().map(str::to_string));
            return Err(PveError::Api(decode_error(
                req.method.as_str(),
                &req.path,
                status.as_u16(),
                reason.as_deref(),
                &bytes,
            )));
        }
        let envelope: Value = serde_json::from_slice(&bytes).map_err(|e| PveError::Decode {
            method: req.method.as_str(),
            path: req.path.clone(),
            detail: format!("not JSON: {e}"),
        })?;
        match envelope {
            Value::Object(m) => Ok(m),
            _ => Err(PveError::Decode {
                method: req.method.as_str(),
                path: req.path.clone(),
                detail: "no {\"data\": …} envelope".to_string(),
            }),
        }
    }

    /// Send the request and read the answer: status, reason phrase, body.
    async fn exchange(
        &self,
        req: &ApiRequest,
        max_answer: usize,
    ) -> Result<(reqwest::StatusCode, Option<String>, Vec<u8>), PveError> {
        let url = req.url(&self.base);
        let method = match req.method {
            Method::Get => reqwest::Method::GET,
            Method::Post => reqwest::Method::POST,
            Method::Put => reqwest::Method::PUT,
            Method::Delete => reqwest::Method::DELETE,
        };
        let mut builder = self
            .http
            .request(method, &url)
            .header(AUTHORIZATION, self.auth.clone());
        if let Some(body) = req.body() {
            builder = builder
                .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
                .body(body);
        }
        let resp = match builder.send().await {
            Ok(r) => r,
            Err(e) => return Err(self.transport_error(&e)),
        };
        let status = resp.status();
        let reason = resp
            .extensions()
            .get::<hyper::ext::ReasonPhrase>()
            .map(|r| String::from_utf8_lossy(r.as_bytes()).into_owned());
        let bytes = self.read_body(req, resp, max_answer).await?;
        Ok((status, reason, bytes))
    }

    /// Read an answer's body, refusing one over `max` bytes (guest agent output reaches the
    /// agent through these bodies).
    async fn read_body(
        &self,
        req: &ApiRequest,
        mut resp: reqwest::Response,
        max: usize,
    ) -> Result<Vec<u8>, PveError> {
        let too_large = || PveError::Decode {
            method: req.method.as_str(),
            path: req.path.clone(),
            detail: format!(
                "the answer is larger than the {} MiB limit and was not read; check what the \
                 guest or the node returns for this request",
                max / (1024 * 1024)
            ),
        };
        if resp.content_length().is_some_and(|n| n > max as u64) {
            return Err(too_large());
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| self.transport_error(&e))? {
            if body.len() + chunk.len() > max {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }

    fn transport_error(&self, e: &reqwest::Error) -> PveError {
        if let (Some(seen), Some(expected)) = (self.observer.mismatch(), self.pinned.clone()) {
            return PveError::TlsPinMismatch {
                url: self.base.clone(),
                expected,
                seen,
            };
        }
        let detail = error_chain(e);
        if detail.contains("certificate")
            || detail.contains("InvalidCertificate")
            || detail.contains("tls") && !e.is_connect()
        {
            return PveError::Tls {
                url: self.base.clone(),
                detail,
            };
        }
        PveError::Unreachable {
            url: self.base.clone(),
            detail,
        }
    }

    // ---- typed calls -------------------------------------------------------------------

    /// `GET /version`.
    pub async fn version(&self) -> Result<VersionInfo, PveError> {
        self.call_as(&build::version()).await
    }

    /// The guests the pool token may see, cluster-wide.
    pub async fn cluster_vms(&self) -> Result<Vec<ClusterVm>, PveError> {
        let rows: Vec<Value> = self.call_as(&build::cluster_vms()).await?;
        // Node, storage and pool rows may come along on some versions; keep guests only.
        Ok(rows
            .into_iter()
            .filter(|r| matches!(r.get("type").and_then(Value::as_str), Some("lxc" | "qemu")))
            .filter_map(|r| serde_json::from_value(r).ok())
            .collect())
    }

    /// `GET …/status/current`.
    pub async fn status_current(
        &self,
        node: &str,
        kind: GuestKind,
        vmid: u32,
    ) -> Result<GuestStatus, PveError> {
        self.call_as(&build::status_current(node, kind, vmid)).await
    }

    /// LXC restore; returns the task's UPID.
    pub async fn lxc_restore(&self, node: &str, r: &LxcRestore) -> Result<Upid, PveError> {
        self.call_upid(&build::lxc_restore(node, r)).await
    }

    /// QEMU restore; returns the task's UPID.
    pub async fn qemu_restore(&self, node: &str, r: &QemuRestore) -> Result<Upid, PveError> {
        self.call_upid(&build::qemu_restore(node, r)).await
    }

    /// Start a guest; returns the task's UPID.
    pub async fn start(&self, node: &str, kind: GuestKind, vmid: u32) -> Result<Upid, PveError> {
        self.call_upid(&build::start(node, kind, vmid)).await
    }

    /// Hard-stop a guest; returns the task's UPID.
    pub async fn stop(&self, node: &str, kind: GuestKind, vmid: u32) -> Result<Upid, PveError> {
        self.call_upid(&build::stop(node, kind, vmid)).await
    }

    /// The guest's config as key → value.
    pub async fn config_get(
        &self,
        node: &str,
        kind: GuestKind,
        vmid: u32,
    ) -> Result<BTreeMap<String, Value>, PveError> {
        self.call_as(&build::config_get(node, kind, vmid)).await
    }

    /// Set and delete config keys (synchronous).
    pub async fn config_put(
        &self,
        node: &str,
        kind: GuestKind,
        vmid: u32,
        set: &[(String, String)],
        delete: &[String],
    ) -> Result<(), PveError> {
        self.call(&build::config_put(node, kind, vmid, set, delete))
            .await
            .map(|_| ())
    }

    /// Destroy, freeing only what the config references (`purge=0&destroy-unreferenced-disks=0`,
    /// see [`build::destroy`]); returns the task's UPID.
    /// Callers must have proven ownership first (see the provision module).
    pub async fn destroy(&self, node: &str, kind: GuestKind, vmid: u32) -> Result<Upid, PveError> {
        self.call_upid(&build::destroy(node, kind, vmid)).await
    }

    /// Backups on a storage the token may see.
    pub async fn backups(
        &self,
        node: &str,
        storage: &str,
        vmid: Option<u32>,
    ) -> Result<Vec<BackupVolume>, PveError> {
        self.call_as(&build::backups(node, storage, vmid)).await
    }

    /// A volume's whole notes (`None`: the answer has none, which PVE also answers when it
    /// failed to read them: `Content.pm` `info` only warns then).
    pub async fn volume_notes(
        &self,
        node: &str,
        storage: &str,
        volume: &str,
    ) -> Result<Option<String>, PveError> {
        let data = self
            .call(&build::volume_info(node, storage, volume))
            .await?;
        Ok(data
            .get("notes")
            .and_then(serde_json::Value::as_str)
            .map(str::to_string))
    }

    /// Replace a backup volume's notes (never its protection).
    pub async fn set_volume_notes(
        &self,
        node: &str,
        storage: &str,
        volume: &str,
        notes: &str,
    ) -> Result<(), PveError> {
        self.call(&build::volume_notes(node, storage, volume, notes))
            .await
            .map(|_| ())
    }

    /// A storage's status on a node (type, content, enabled, active).
    pub async fn storage_status(
        &self,
        node: &str,
        storage: &str,
    ) -> Result<StorageStatus, PveError> {
        self.call_as(&build::storage_status(node, storage)).await
    }

    /// The guest configuration stored in a backup, as PVE extracts it (text).
    pub async fn extract_config(&self, node: &str, volume: &str) -> Result<String, PveError> {
        self.call_as(&build::extract_config(node, volume)).await
    }

    /// The node's tasks for `vmid` that this token may see, started at or after `since` (Unix
    /// seconds), running ones included; at most `limit` rows.
    pub async fn node_tasks(
        &self,
        node: &str,
        vmid: u32,
        since: u64,
        limit: u32,
    ) -> Result<Vec<TaskListEntry>, PveError> {
        self.call_as(&build::node_tasks(node, vmid, since, limit))
            .await
    }

    /// A task's status.
    pub async fn task_status(&self, upid: &Upid) -> Result<TaskStatus, PveError> {
        self.call_as(&build::task_status(upid)).await
    }

    /// Lines of a task log from `start` (0-based), at most `limit`; and the total line count.
    pub async fn task_log(
        &self,
        upid: &Upid,
        start: u64,
        limit: u64,
    ) -> Result<(Vec<TaskLogLine>, Option<u64>), PveError> {
        // `total` sits beside `data` in the envelope.
        let req = build::task_log(upid, start, limit);
        let mut env = self.call_envelope(&req).await?;
        let total = env.get("total").and_then(|t| {
            t.as_u64()
                .or_else(|| t.as_str().and_then(|s| s.parse().ok()))
        });
        let lines: Vec<TaskLogLine> =
            serde_json::from_value(env.remove("data").unwrap_or(Value::Null)).map_err(|e| {
                PveError::Decode {
                    method: "GET",
                    path: req.path.clone(),
                    detail: e.to_string(),
                }
            })?;
        Ok((lines, total))
    }

    /// Ask PVE to stop a task.
    pub async fn task_stop(&self, upid: &Upid) -> Result<(), PveError> {
        self.call(&build::task_stop(upid)).await.map(|_| ())
    }

    /// Start a command in a VM through the guest agent; returns its pid.
    pub async fn agent_exec(
        &self,
        node: &str,
        vmid: u32,
        argv: &[String],
        input: Option<&str>,
    ) -> Result<u64, PveError> {
        let req = build::agent_exec(node, vmid, argv, input);
        let v = self.call(&req).await?;
        v.get("pid")
            .and_then(|p| {
                p.as_u64()
                    .or_else(|| p.as_str().and_then(|s| s.parse().ok()))
            })
            .ok_or_else(|| PveError::Decode {
                method: "POST",
                path: req.path.clone(),
                detail: format!("no pid in {v}"),
            })
    }

    /// The status of a guest-agent command. Once it reports `exited`, the guest forgets it:
    /// never ask again for the same pid.
    pub async fn agent_exec_status(
        &self,
        node: &str,
        vmid: u32,
        pid: u64,
    ) -> Result<AgentExecStatus, PveError> {
        // Not retried: a lost answer after `exited` cannot be fetched again.
        let req = build::agent_exec_status(node, vmid, pid);
        let mut env = self.send_once(&req, MAX_EXEC_STATUS_BYTES).await?;
        serde_json::from_value(env.remove("data").unwrap_or(Value::Null)).map_err(|e| {
            PveError::Decode {
                method: "GET",
                path: req.path.clone(),
                detail: e.to_string(),
            }
        })
    }

    /// Send a request exactly once (no retry, even for a read) and return `data`.
    pub async fn call_once(&self, req: &ApiRequest) -> Result<Value, PveError> {
        self.call_once_max(req, MAX_RESPONSE_BYTES).await
    }

    /// [`call_once`](Self::call_once) reading an answer of up to `max_answer` bytes (the
    /// guest agent's exec-status: [`MAX_EXEC_STATUS_BYTES`]).
    pub async fn call_once_max(
        &self,
        req: &ApiRequest,
        max_answer: usize,
    ) -> Result<Value, PveError> {
        let mut env = self.send_once(req, max_answer).await?;
        Ok(env.remove("data").unwrap_or(Value::Null))
    }

    /// Ping the guest agent: `Ok` once PVE answered 200, which it does only after its own
    /// `guest-ping` got an answer (qemu-server `QemuServer/Agent.pm` `assert_agent_available`),
    /// whatever `result` holds (PVE returns qemu-ga's answer unchecked, an error object
    /// included).
    pub async fn agent_ping(&self, node: &str, vmid: u32) -> Result<(), PveError> {
        self.call(&build::agent_ping(node, vmid)).await.map(|_| ())
    }

    /// qemu-ga's `guest-info` through PVE (`{"result": {...}}`, unchecked by PVE: it may hold
    /// an error object instead), at most [`MAX_AGENT_INFO_BYTES`].
    pub async fn agent_info(&self, node: &str, vmid: u32) -> Result<Value, PveError> {
        self.call_once_max(&build::agent_info(node, vmid), MAX_AGENT_INFO_BYTES)
            .await
    }

    /// The effective privileges of a user or token (default: the caller).
    pub async fn permissions(
        &self,
        userid: Option<&str>,
        path: Option<&str>,
    ) -> Result<Permissions, PveError> {
        self.call_as(&build::permissions(userid, path)).await
    }

    /// The pool, if it exists and the token may see it.
    pub async fn pool(&self, poolid: &str) -> Result<Option<PoolInfo>, PveError> {
        let v: Vec<PoolInfo> = self.call_as(&build::pool(poolid)).await?;
        Ok(v.into_iter().find(|p| p.poolid == poolid))
    }

    /// The node's bridges the token may see (`SDN.Audit` or `SDN.Use` on each), as PVE lists
    /// them: one JSON object per bridge (`iface`, `type`, `bridge_ports`, `active`, `method`,
    /// `address`, `cidr`, `method6`, `address6`, `cidr6`, `options`, `options6`, …), at most
    /// [`MAX_BRIDGES`] of them.
    pub async fn node_bridges(&self, node: &str) -> Result<Vec<Value>, PveError> {
        let rows: Vec<Value> = self.call_as(&build::node_bridges(node)).await?;
        Ok(rows
            .into_iter()
            .filter(Value::is_object)
            .take(MAX_BRIDGES)
            .collect())
    }

    async fn call_upid(&self, req: &ApiRequest) -> Result<Upid, PveError> {
        let v = self.call(req).await?;
        let s = v.as_str().ok_or_else(|| PveError::Decode {
            method: req.method.as_str(),
            path: req.path.clone(),
            detail: format!("expected a task id, got {v}"),
        })?;
        s.parse()
            .map_err(|e: super::upid::UpidError| PveError::Decode {
                method: req.method.as_str(),
                path: req.path.clone(),
                detail: e.to_string(),
            })
    }
}

/// The most bridges [`PveClient::node_bridges`] keeps (a node's answer is outside input).
pub const MAX_BRIDGES: usize = 4096;

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        let t = s.to_string();
        if !parts.iter().any(|p| p.contains(&t)) {
            parts.push(t);
        }
        cur = s.source();
    }
    parts.join(": ")
}
