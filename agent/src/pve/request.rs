//! PVE API requests built without IO, so their URLs and bodies can be tested as strings.
//!
//! Rules of the PVE API server encoded here:
//! - GET and DELETE carry parameters only in the query string (a body is refused with 501);
//! - POST and PUT carry them as an `application/x-www-form-urlencoded` body;
//! - booleans are `0`/`1` (`true` fails PVE's type check);
//! - the server splits pairs on `&` **and** `;`, so everything outside the unreserved set,
//!   `;` included, is percent-encoded;
//! - a repeated key (agent exec's `command`) becomes an array.

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

use super::types::GuestKind;
use super::upid::Upid;

/// Everything but RFC 3986's unreserved characters is encoded.
const ENCODE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Percent-encode one query value, form value or path segment.
pub fn encode(s: &str) -> String {
    utf8_percent_encode(s, ENCODE).to_string()
}

/// HTTP method of a PVE request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Read.
    Get,
    /// Create / action.
    Post,
    /// Update.
    Put,
    /// Remove.
    Delete,
}

impl Method {
    /// The method's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Post => "POST",
            Method::Put => "PUT",
            Method::Delete => "DELETE",
        }
    }
}

/// One PVE API request, not yet sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiRequest {
    /// The method.
    pub method: Method,
    /// The path below `/api2/json`, already percent-encoded per segment.
    pub path: String,
    /// Parameters, in order; repeated keys allowed.
    pub params: Vec<(String, String)>,
}

impl ApiRequest {
    fn new(method: Method, segments: &[&str]) -> Self {
        let mut path = String::new();
        for s in segments {
            path.push('/');
            path.push_str(&encode(s));
        }
        Self {
            method,
            path,
            params: Vec::new(),
        }
    }

    /// A GET of the given path segments.
    pub fn get(segments: &[&str]) -> Self {
        Self::new(Method::Get, segments)
    }
    /// A POST.
    pub fn post(segments: &[&str]) -> Self {
        Self::new(Method::Post, segments)
    }
    /// A PUT.
    pub fn put(segments: &[&str]) -> Self {
        Self::new(Method::Put, segments)
    }
    /// A DELETE.
    pub fn delete(segments: &[&str]) -> Self {
        Self::new(Method::Delete, segments)
    }

    /// Add a parameter.
    pub fn param(mut self, key: &str, value: impl ToString) -> Self {
        self.params.push((key.to_string(), value.to_string()));
        self
    }

    /// Add a boolean parameter as PVE wants it: `0` or `1`.
    pub fn flag(self, key: &str, value: bool) -> Self {
        self.param(key, if value { "1" } else { "0" })
    }

    /// Add a parameter when it is set.
    pub fn opt_param(self, key: &str, value: Option<impl ToString>) -> Self {
        match value {
            Some(v) => self.param(key, v),
            None => self,
        }
    }

    /// Whether the request may be sent again after a transient failure (reads only).
    pub fn is_idempotent_read(&self) -> bool {
        self.method == Method::Get
    }

    fn encoded_params(&self) -> String {
        self.params
            .iter()
            .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
            .collect::<Vec<_>>()
            .join("&")
    }

    /// The path and query, relative to `<base>/api2/json`.
    pub fn path_and_query(&self) -> String {
        match self.method {
            Method::Get | Method::Delete if !self.params.is_empty() => {
                format!("{}?{}", self.path, self.encoded_params())
            }
            _ => self.path.clone(),
        }
    }

    /// The full URL for a base such as `https://127.0.0.1:8006`.
    pub fn url(&self, base: &str) -> String {
        format!(
            "{}/api2/json{}",
            base.trim_end_matches('/'),
            self.path_and_query()
        )
    }

    /// The form body of a POST/PUT; GET and DELETE never have one.
    pub fn body(&self) -> Option<String> {
        match self.method {
            Method::Post | Method::Put => Some(self.encoded_params()),
            Method::Get | Method::Delete => None,
        }
    }
}

/// The `Authorization` header value for an API token: `PVEAPIToken=USER@REALM!ID=SECRET`.
pub fn token_header(token_id: &str, secret: &str) -> String {
    format!("PVEAPIToken={token_id}={secret}")
}

/// Parameters of an LXC restore (`POST /nodes/{node}/lxc` with `restore=1`). Every restore
/// asks for `unprivileged=1`, whatever the backup says: the agent's containers are
/// unprivileged (the exec helper runs commands in no other), and PVE needs no extra privilege
/// for it (a privileged restore would need `Sys.Modify` on `/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LxcRestore {
    /// Target vmid.
    pub vmid: u32,
    /// Backup volid (`ostemplate`).
    pub archive: String,
    /// Target storage (always explicit: PVE defaults to `local`, which rarely holds CTs).
    pub storage: String,
    /// The pool the guest joins when the task ends.
    pub pool: String,
    /// New random MAC addresses.
    pub unique: bool,
    /// Extra config keys (e.g. `net0` to isolate the network).
    pub extra: Vec<(String, String)>,
}

/// Parameters of a QEMU restore (`POST /nodes/{node}/qemu` with `archive`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuRestore {
    /// Target vmid.
    pub vmid: u32,
    /// Backup volid.
    pub archive: String,
    /// Target storage.
    pub storage: String,
    /// The pool.
    pub pool: String,
    /// New random MAC addresses.
    pub unique: bool,
    /// Extra config keys.
    pub extra: Vec<(String, String)>,
}

/// The typed requests the agent makes.
pub mod build {
    use super::*;

    /// `GET /version`.
    pub fn version() -> ApiRequest {
        ApiRequest::get(&["version"])
    }

    /// `GET /cluster/resources?type=vm` (filtered by the token's `VM.Audit`).
    pub fn cluster_vms() -> ApiRequest {
        ApiRequest::get(&["cluster", "resources"]).param("type", "vm")
    }

    /// `GET /nodes/{node}/lxc` or `/qemu`.
    pub fn node_guests(node: &str, kind: GuestKind) -> ApiRequest {
        ApiRequest::get(&["nodes", node, kind.path()])
    }

    /// `GET /nodes/{node}/{kind}/{vmid}/status/current`.
    pub fn status_current(node: &str, kind: GuestKind, vmid: u32) -> ApiRequest {
        ApiRequest::get(&[
            "nodes",
            node,
            kind.path(),
            &vmid.to_string(),
            "status",
            "current",
        ])
    }

    /// LXC restore into the pool.
    pub fn lxc_restore(node: &str, r: &LxcRestore) -> ApiRequest {
        let mut req = ApiRequest::post(&["nodes", node, "lxc"])
            .param("vmid", r.vmid)
            .param("ostemplate", &r.archive)
            .flag("restore", true)
            .param("storage", &r.storage)
            .param("pool", &r.pool)
            .flag("unprivileged", true);
        if r.unique {
            req = req.flag("unique", true);
        }
        for (k, v) in &r.extra {
            if k != "unprivileged" {
                req = req.param(k, v);
            }
        }
        req
    }

    /// QEMU restore into the pool.
    pub fn qemu_restore(node: &str, r: &QemuRestore) -> ApiRequest {
        let mut req = ApiRequest::post(&["nodes", node, "qemu"])
            .param("vmid", r.vmid)
            .param("archive", &r.archive)
            .param("storage", &r.storage)
            .param("pool", &r.pool);
        if r.unique {
            req = req.flag("unique", true);
        }
        for (k, v) in &r.extra {
            req = req.param(k, v);
        }
        req
    }

    /// `POST /nodes/{node}/{kind}/{vmid}/status/start`.
    pub fn start(node: &str, kind: GuestKind, vmid: u32) -> ApiRequest {
        ApiRequest::post(&[
            "nodes",
            node,
            kind.path(),
            &vmid.to_string(),
            "status",
            "start",
        ])
    }

    /// `POST /nodes/{node}/{kind}/{vmid}/status/stop` (hard stop, used before a gated destroy).
    pub fn stop(node: &str, kind: GuestKind, vmid: u32) -> ApiRequest {
        ApiRequest::post(&[
            "nodes",
            node,
            kind.path(),
            &vmid.to_string(),
            "status",
            "stop",
        ])
    }

    /// `GET /nodes/{node}/{kind}/{vmid}/config`.
    pub fn config_get(node: &str, kind: GuestKind, vmid: u32) -> ApiRequest {
        ApiRequest::get(&["nodes", node, kind.path(), &vmid.to_string(), "config"])
    }

    /// `PUT /nodes/{node}/{kind}/{vmid}/config` with keys to set and keys to delete.
    pub fn config_put(
        node: &str,
        kind: GuestKind,
        vmid: u32,
        set: &[(String, String)],
        delete: &[String],
    ) -> ApiRequest {
        let mut req = ApiRequest::put(&["nodes", node, kind.path(), &vmid.to_string(), "config"]);
        for (k, v) in set {
            req = req.param(k, v);
        }
        if !delete.is_empty() {
            req = req.param("delete", delete.join(","));
        }
        req
    }

    /// `DELETE /nodes/{node}/{kind}/{vmid}?purge=0&destroy-unreferenced-disks=0`: free what the
    /// guest's config references and nothing else.
    ///
    /// - `destroy-unreferenced-disks=0`, sent explicitly: with 1, PVE also frees every volume
    ///   named for this vmid on every enabled storage that the config does not reference (an
    ///   earlier holder's orphans; on storage shared between clusters, another cluster's live
    ///   disk). The schema gives QEMU a default of 0 and LXC none, so it is never left unset.
    /// - `purge=0`: with 1, PVE also edits backup jobs, replication jobs and HA resources that
    ///   name the vmid, none of which the agent wrote. A guest someone put under HA is refused
    ///   by PVE ("used in HA resources and purge parameter not set") and left to a human.
    ///
    /// Never `force` (QEMU has no such parameter; a running CT is stopped first instead).
    pub fn destroy(node: &str, kind: GuestKind, vmid: u32) -> ApiRequest {
        ApiRequest::delete(&["nodes", node, kind.path(), &vmid.to_string()])
            .flag("purge", false)
            .flag("destroy-unreferenced-disks", false)
    }

    /// `GET /nodes/{node}/storage/{storage}/content?content=backup[&vmid=N]`.
    pub fn backups(node: &str, storage: &str, vmid: Option<u32>) -> ApiRequest {
        ApiRequest::get(&["nodes", node, "storage", storage, "content"])
            .param("content", "backup")
            .opt_param("vmid", vmid)
    }

    /// `GET /nodes/{node}/storage/{storage}/content/{volume}`: one volume's attributes (its
    /// whole notes, unlike the listing's first line).
    pub fn volume_info(node: &str, storage: &str, volume: &str) -> ApiRequest {
        ApiRequest::get(&["nodes", node, "storage", storage, "content", volume])
    }

    /// `PUT /nodes/{node}/storage/{storage}/content/{volume}` with `notes` only (the same call
    /// sets `protected`, which the agent never sends).
    pub fn volume_notes(node: &str, storage: &str, volume: &str, notes: &str) -> ApiRequest {
        ApiRequest::put(&["nodes", node, "storage", storage, "content", volume])
            .param("notes", notes)
    }

    /// `GET /nodes/{node}/storage/{storage}/status`: type, content, enabled, active.
    pub fn storage_status(node: &str, storage: &str) -> ApiRequest {
        ApiRequest::get(&["nodes", node, "storage", storage, "status"])
    }

    /// `GET /nodes/{node}/vzdump/extractconfig?volume=V`: the guest config stored in a backup.
    pub fn extract_config(node: &str, volume: &str) -> ApiRequest {
        ApiRequest::get(&["nodes", node, "vzdump", "extractconfig"]).param("volume", volume)
    }

    /// `GET /nodes/{node}/tasks?vmid=N&source=all&since=T&limit=L`: the node's tasks for one
    /// vmid that this token may see (its own), running ones included (`source=all`: PVE's
    /// default `archive` lists finished tasks only; pve-apidoc.json, facts §6.4).
    pub fn node_tasks(node: &str, vmid: u32, since: u64, limit: u32) -> ApiRequest {
        ApiRequest::get(&["nodes", node, "tasks"])
            .param("vmid", vmid)
            .param("source", "all")
            .param("since", since)
            .param("limit", limit)
    }

    /// `GET /nodes/{upid.node}/tasks/{upid}/status`.
    pub fn task_status(upid: &Upid) -> ApiRequest {
        ApiRequest::get(&["nodes", &upid.node, "tasks", upid.as_str(), "status"])
    }

    /// `GET /nodes/{upid.node}/tasks/{upid}/log?start=S&limit=L`.
    pub fn task_log(upid: &Upid, start: u64, limit: u64) -> ApiRequest {
        ApiRequest::get(&["nodes", &upid.node, "tasks", upid.as_str(), "log"])
            .param("start", start)
            .param("limit", limit)
    }

    /// `DELETE /nodes/{upid.node}/tasks/{upid}`: stop a task.
    pub fn task_stop(upid: &Upid) -> ApiRequest {
        ApiRequest::delete(&["nodes", &upid.node, "tasks", upid.as_str()])
    }

    /// `POST /nodes/{node}/qemu/{vmid}/agent/exec`: the command as an array (repeated key).
    pub fn agent_exec(node: &str, vmid: u32, argv: &[String], input: Option<&str>) -> ApiRequest {
        let mut req =
            ApiRequest::post(&["nodes", node, "qemu", &vmid.to_string(), "agent", "exec"]);
        for a in argv {
            req = req.param("command", a);
        }
        req.opt_param("input-data", input)
    }

    /// `GET /nodes/{node}/qemu/{vmid}/agent/exec-status?pid=P`.
    pub fn agent_exec_status(node: &str, vmid: u32, pid: u64) -> ApiRequest {
        ApiRequest::get(&[
            "nodes",
            node,
            "qemu",
            &vmid.to_string(),
            "agent",
            "exec-status",
        ])
        .param("pid", pid)
    }

    /// `POST /nodes/{node}/qemu/{vmid}/agent/ping`.
    pub fn agent_ping(node: &str, vmid: u32) -> ApiRequest {
        ApiRequest::post(&["nodes", node, "qemu", &vmid.to_string(), "agent", "ping"])
    }

    /// `GET /nodes/{node}/qemu/{vmid}/agent/info`: qemu-ga's `guest-info` (its version and
    /// every command it knows, each with `enabled`).
    pub fn agent_info(node: &str, vmid: u32) -> ApiRequest {
        ApiRequest::get(&["nodes", node, "qemu", &vmid.to_string(), "agent", "info"])
    }

    /// `GET /access/permissions[?userid=ID][&path=P]`.
    pub fn permissions(userid: Option<&str>, path: Option<&str>) -> ApiRequest {
        ApiRequest::get(&["access", "permissions"])
            .opt_param("userid", userid)
            .opt_param("path", path)
    }

    /// `GET /pools?poolid=ID` (the current form; `/pools/{id}` is deprecated).
    pub fn pool(poolid: &str) -> ApiRequest {
        ApiRequest::get(&["pools"]).param("poolid", poolid)
    }

    /// `GET /nodes/{node}/network?type=any_bridge`: the node's bridges as
    /// `/etc/network/interfaces` configures them (pve-manager `PVE/API2/Network.pm` `index`),
    /// only those the caller holds SDN.Audit or SDN.Use on.
    pub fn node_bridges(node: &str) -> ApiRequest {
        ApiRequest::get(&["nodes", node, "network"]).param("type", "any_bridge")
    }
}

#[cfg(test)]
mod tests {
    use super::build::*;
    use super::*;

    const BASE: &str = "https://127.0.0.1:8006";

    #[test]
    fn get_parameters_only_in_query() {
        let r = cluster_vms();
        assert_eq!(
            r.url(BASE),
            "https://127.0.0.1:8006/api2/json/cluster/resources?type=vm"
        );
        assert_eq!(r.body(), None);
        assert!(r.is_idempotent_read());
    }

    #[test]
    fn delete_parameters_only_in_query_and_booleans_are_digits() {
        let r = destroy("pve1", GuestKind::Lxc, 201);
        assert_eq!(
            r.url(BASE),
            "https://127.0.0.1:8006/api2/json/nodes/pve1/lxc/201?purge=0&destroy-unreferenced-disks=0"
        );
        assert_eq!(r.body(), None);
        assert!(!r.is_idempotent_read());
        assert!(!r.url(BASE).contains("force"));
        let q = destroy("pve1", GuestKind::Qemu, 301);
        assert!(!q.url(BASE).contains("force"));
    }

    #[test]
    fn restore_body_is_form_encoded() {
        let r = lxc_restore(
            "pve1",
            &LxcRestore {
                vmid: 201,
                archive: "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst".into(),
                storage: "local-lvm".into(),
                pool: "felhom".into(),
                unique: true,
                extra: vec![],
            },
        );
        assert_eq!(
            r.url(BASE),
            "https://127.0.0.1:8006/api2/json/nodes/pve1/lxc"
        );
        assert_eq!(
            r.body().as_deref(),
            Some("vmid=201&ostemplate=local%3Abackup%2Fvzdump-lxc-200-2026_01_01-00_00_00.tar.zst&restore=1&storage=local-lvm&pool=felhom&unprivileged=1&unique=1")
        );
        let q = qemu_restore(
            "pve1",
            &QemuRestore {
                vmid: 301,
                archive: "local:backup/vzdump-qemu-300-2026_01_01-00_00_00.vma.zst".into(),
                storage: "local-lvm".into(),
                pool: "felhom".into(),
                unique: true,
                extra: vec![],
            },
        );
        let body = q.body().unwrap_or_default();
        assert!(
            body.contains("archive=local%3Abackup%2Fvzdump-qemu-300"),
            "{body}"
        );
        assert!(body.ends_with("&unique=1"), "{body}");
        assert!(!body.contains("restore="));
    }

    #[test]
    fn semicolons_and_spaces_are_percent_encoded() {
        let r = config_put(
            "pve1",
            GuestKind::Lxc,
            201,
            &[
                ("tags".into(), "felhom;felhom-01j".into()),
                ("description".into(), "a b+c&d=e".into()),
            ],
            &["protection".into()],
        );
        assert_eq!(
            r.body().as_deref(),
            Some("tags=felhom%3Bfelhom-01j&description=a%20b%2Bc%26d%3De&delete=protection")
        );
    }

    #[test]
    fn agent_exec_repeats_command_key() {
        let argv = vec![
            "/bin/sh".to_string(),
            "-c".to_string(),
            "echo hi".to_string(),
        ];
        let r = agent_exec("pve1", 300, &argv, None);
        assert_eq!(
            r.body().as_deref(),
            Some("command=%2Fbin%2Fsh&command=-c&command=echo%20hi")
        );
        assert_eq!(
            agent_exec_status("pve1", 300, 1001).url(BASE),
            "https://127.0.0.1:8006/api2/json/nodes/pve1/qemu/300/agent/exec-status?pid=1001"
        );
    }

    #[test]
    fn upid_is_encoded_in_path_and_uses_its_node() {
        let u: Upid = "UPID:pve2:000003E8:00001B58:6B0CA4FD:vzrestore:201:agent@pve!felhom:"
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            task_status(&u).url(BASE),
            "https://127.0.0.1:8006/api2/json/nodes/pve2/tasks/UPID%3Apve2%3A000003E8%3A00001B58%3A6B0CA4FD%3Avzrestore%3A201%3Aagent%40pve%21felhom%3A/status"
        );
        assert!(task_log(&u, 0, 50)
            .url(BASE)
            .ends_with("/log?start=0&limit=50"));
        assert_eq!(task_stop(&u).method, Method::Delete);
    }

    #[test]
    fn token_header_format() {
        assert_eq!(
            token_header("felhom@pve!agent", "s3cr3t"),
            "PVEAPIToken=felhom@pve!agent=s3cr3t"
        );
    }

    #[test]
    fn backups_and_permissions_queries() {
        assert_eq!(
            backups("pve1", "local", Some(200)).url(BASE),
            "https://127.0.0.1:8006/api2/json/nodes/pve1/storage/local/content?content=backup&vmid=200"
        );
        assert_eq!(
            permissions(Some("felhom@pve!agent"), None).url(BASE),
            "https://127.0.0.1:8006/api2/json/access/permissions?userid=felhom%40pve%21agent"
        );
    }
}
