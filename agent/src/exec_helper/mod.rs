//! The root exec helper: a small process that runs as root and does only what needs root on a
//! Proxmox VE node, commands and files into LXC containers (`pct exec`, a file's bytes on its
//! stdin; never `pct push`), for an agent that runs as an unprivileged system user.
//!
//! It listens on a Unix stream socket (socket-activated by systemd as
//! `felhom-agent-exec.socket`, default `/run/felhom-agent/exec.sock`). Each connection carries
//! one request and one response ([`proto`]). Its callers are not trusted: the peer's uid must be
//! root or the agent's user (`[agent] user`), and before every request the helper reads, fresh
//! and bounded, the journal in `state_dir` (the transaction named must hold an armed claim on
//! the vmid, in a step that runs commands in the guest), the node's guest list (the vmid must be
//! an LXC container on this node), `user.cfg` (the vmid must be in the agent's pool) and the
//! container's own config (unprivileged, no raw `lxc.` keys, no host-path mount point, no
//! device: [`ct_conf`]). A request never names a host path: pushed files travel inline, and
//! are written by a shell inside the container. Every `pct exec` it runs proves, before the
//! command runs, that what `lxc-attach` started is in the namespaces of the init root's LXC
//! monitor named (`crate::guest::lxc`, the first stage; else `exec_attach_mismatch`).
//! Environment values and stdin are never logged.
//!
//! It also hands the agent the files of the cluster file system it reads (`.vmlist`, the full
//! guest list; `sdn/vnets.cfg`; of `datacenter.cfg` only the tag policy and `next-id` lines,
//! [`datacenter_cfg`]; of `user.cfg` only the token, group, role and ACL lines, never a user's
//! with its keys, [`user_cfg`]; of `jobs.cfg` only the backup jobs' lines the agent needs,
//! [`jobs_cfg`]), read as root from the path of its own config and
//! through nothing anyone but root could change ([`cluster_file`]), so that the agent's user
//! needs no pmxcfs group (whose members read every pmxcfs file outside `priv/`, the node's TLS
//! key among them); and says where its own `pct` resolves (`doctor`).
//!
//! [`client`] is the agent's side: [`client::HelperExec`] and the choice between the helper and
//! `pct` itself ([`client::ExecMode`]).

pub mod authorize;
pub mod client;
pub mod cluster_file;
pub mod ct_conf;
pub mod datacenter_cfg;
pub mod jobs_cfg;
pub mod proto;
pub mod server;
pub mod user_cfg;

/// Where `program` resolves on `path` as the agent resolves `pct` (the first executable regular
/// file of that name in a folder of `PATH`).
pub fn resolve_on_path(
    program: &str,
    path: Option<&std::ffi::OsStr>,
) -> Option<std::path::PathBuf> {
    std::env::split_paths(path?)
        .map(|dir| dir.join(program))
        .find(|p| is_executable_file(p))
}

/// Whether `p` is a regular file someone may execute.
pub fn is_executable_file(p: &std::path::Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
