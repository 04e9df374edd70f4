//! Whether one request may run: checked before every request, from files read fresh each time,
//! never from anything the caller says beyond the vmid and the transaction id.
//!
//! 1. The journal in `state_dir` holds transaction `txn`, of this pool, for this vmid, an LXC
//!    container, with the marker confirmed and destroy armed (not withdrawn, not destroyed),
//!    and either still open or settled and kept (its claim held). The agent arms a
//!    transaction when it reads its marker back, before it starts the guest, so every step
//!    that runs commands in the guest (launch proof, bootstrap, checks, the restore test's
//!    checks) is armed. A gated destroy never runs commands and is not accepted. The state dir
//!    is writable by the agent's user, so it is read as hostile: the journal folder and the
//!    file are opened without following links, the file must be a regular file owned by root
//!    or the agent's user, and the read is capped (the journal's own caps and checks).
//! 2. The node's full guest list (`.vmlist`, else `pct list` + `qm list`) has the vmid as an
//!    LXC container on this node.
//! 3. `user.cfg` lists the vmid in the pool of the config ([`super::user_cfg`]).

use std::os::fd::AsFd;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{open, openat, OFlag};
use nix::sys::stat::{fstat, Mode, SFlag};

use super::user_cfg;
use crate::config::Config;
use crate::error::{outside_text, ErrorCode};
use crate::inventory::{read_full_list, GuestType, SystemListCommands};
use crate::provision::journal::{file_name, read_opened, JOURNAL_DIR};
use crate::provision::{State, TxnKind};
use crate::pve::GuestKind;
use hub_protocol::TxnId;

/// A refusal: its code and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// `exec_not_owned`, `exec_not_in_pool`, …
    pub code: ErrorCode,
    /// Names the vmid, the transaction and the file, and says what to do next.
    pub message: String,
}

impl Refusal {
    fn new(code: ErrorCode, message: String) -> Self {
        Self { code, message }
    }
}

/// Who may own files the helper trusts in the state dir: root and the agent's user.
#[derive(Debug, Clone, Copy)]
pub struct Owners {
    /// The agent's uid, if it runs as another user than root.
    pub agent_uid: Option<u32>,
}

impl Owners {
    fn trusted(self, uid: u32) -> bool {
        uid == 0 || Some(uid) == self.agent_uid
    }
}

/// Check all three before running a request for `vmid` on behalf of `txn`. Blocking (reads
/// files, may run `pct list` / `qm list`): call it off the async threads.
pub fn authorize(cfg: &Config, owners: Owners, vmid: u32, txn: TxnId) -> Result<(), Refusal> {
    let state = read_claim(&cfg.state_dir, owners, vmid, txn)?;
    check_claim(&state, vmid, &cfg.pool, txn)?;
    check_on_node(cfg, vmid)?;
    check_in_pool(cfg, vmid)
}

/// The last journaled state of `txn`, read as hostile input (`vmid`: the container asked for,
/// for the messages).
pub fn read_claim(
    state_dir: &Path,
    owners: Owners,
    vmid: u32,
    txn: TxnId,
) -> Result<State, Refusal> {
    let ulid = txn.ulid();
    let dir = state_dir.join(JOURNAL_DIR);
    let path = dir.join(file_name(ulid));
    let not_owned =
        |why: String| Refusal::new(ErrorCode::ExecNotOwned, format!("container {vmid}: {why}"));
    let unreadable = |what: &str, e: Errno| {
        not_owned(format!(
            "transaction {txn}: {what} cannot be opened ({}); nothing was run. Check `felhom-agent \
             journal` and the ownership of {} (root or the agent's user, no links)",
            e.desc(),
            dir.display()
        ))
    };
    let base = open(
        state_dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| unreadable("the state dir", e))?;
    let journal_dir = openat(
        base.as_fd(),
        JOURNAL_DIR,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| match e {
        Errno::ENOENT => not_owned(format!(
            "transaction {txn} is not in the journal ({} does not exist); nothing was run. Only \
             a transaction of this agent that holds an armed claim on the container may run \
             commands in it",
            dir.display()
        )),
        e => unreadable("the journal folder", e),
    })?;
    let dir_meta = fstat(journal_dir.as_fd()).map_err(|e| unreadable("the journal folder", e))?;
    if !owners.trusted(dir_meta.st_uid) {
        return Err(not_owned(format!(
            "the journal folder {} is owned by uid {}, not by root or the agent's user; nothing \
             was run for transaction {txn}. Fix its owner (`chown`) or the [agent] user setting",
            dir.display(),
            dir_meta.st_uid
        )));
    }
    let fd = openat(
        journal_dir.as_fd(),
        file_name(ulid).as_str(),
        OFlag::O_RDONLY
            | OFlag::O_NOFOLLOW
            | OFlag::O_NONBLOCK
            | OFlag::O_CLOEXEC
            | OFlag::O_NOCTTY,
        Mode::empty(),
    )
    .map_err(|e| match e {
        Errno::ENOENT => not_owned(format!(
            "transaction {txn} is not in the journal ({} does not exist); nothing was run. Only \
             a transaction of this agent that holds an armed claim on the container may run \
             commands in it",
            path.display()
        )),
        Errno::ELOOP => not_owned(format!(
            "{} is a symbolic link; nothing was run for transaction {txn}. The journal holds \
             only regular files: remove the link",
            path.display()
        )),
        e => unreadable("its journal file", e),
    })?;
    let meta = fstat(fd.as_fd()).map_err(|e| unreadable("its journal file", e))?;
    if SFlag::from_bits_truncate(meta.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
        return Err(not_owned(format!(
            "{} is not a regular file; nothing was run for transaction {txn}",
            path.display()
        )));
    }
    if !owners.trusted(meta.st_uid) {
        return Err(not_owned(format!(
            "{} is owned by uid {}, not by root or the agent's user; nothing was run for \
             transaction {txn}. Fix its owner or the [agent] user setting",
            path.display(),
            meta.st_uid
        )));
    }
    let file = std::fs::File::from(fd);
    match read_opened(file, &path, ulid) {
        Ok(Some(t)) => Ok(t.state),
        Ok(None) => Err(not_owned(format!(
            "transaction {txn} has no complete record in {}; nothing was run",
            path.display()
        ))),
        Err(e) => {
            tracing::warn!(txn = %txn, path = %path.display(), error = %e, "journal file refused");
            Err(not_owned(format!(
                "the journal file {} of transaction {txn} cannot be read ({}); nothing was run. \
                 Check it with `felhom-agent journal`",
                path.display(),
                outside_text(&e.to_string())
            )))
        }
    }
}

/// Whether `state` holds an armed claim on `vmid` in `pool`: the checks of step 1 on an
/// already read state.
pub fn check_claim(state: &State, vmid: u32, pool: &str, txn: TxnId) -> Result<(), Refusal> {
    let req = state.request();
    let refuse = |why: String| {
        Err(Refusal::new(
            ErrorCode::ExecNotOwned,
            format!(
                "transaction {txn} holds no armed claim on container {vmid} ({why}); nothing was \
                 run. Only the transaction that restored the container, proved it carries its \
                 marker and armed its destroy (open, or settled and kept) may run commands in it"
            ),
        ))
    };
    if req.vmid != Some(vmid) {
        return refuse(match req.vmid {
            Some(other) => format!("its vmid is {other}"),
            None => "it has no vmid".to_string(),
        });
    }
    if req.kind == TxnKind::Destroy {
        return refuse("it is a destroy".to_string());
    }
    if req.guest != GuestKind::Lxc {
        return refuse(format!("its guest is a {}", req.guest.pve_word()));
    }
    if req.pool != pool {
        return refuse(format!(
            "it is of pool {}, not {pool}",
            outside_text(&req.pool)
        ));
    }
    if !state.marker_confirmed() || !state.destroy_armed() {
        return refuse("its marker is not confirmed and its destroy not armed".to_string());
    }
    if let Some(why) = state.disarmed() {
        return refuse(format!("its claim was withdrawn: {}", outside_text(why)));
    }
    if state.destroyed() {
        return refuse("its guest was destroyed".to_string());
    }
    if state.is_terminal() && !state.holds_claim() {
        return refuse("it is settled and does not keep its guest".to_string());
    }
    Ok(())
}

/// Step 2: the vmid is an LXC container on this node in the full guest list.
fn check_on_node(cfg: &Config, vmid: u32) -> Result<(), Refusal> {
    let list = read_full_list(&cfg.vmlist_path, &cfg.node, &SystemListCommands::default())
        .map_err(|e| {
            Refusal::new(
                ErrorCode::ExecNotOwned,
                format!(
                    "the node's guest list cannot be read ({}); nothing was run in {vmid}. Check \
                     {} (vmlist_path) and pve-cluster",
                    outside_text(&e.to_string()),
                    cfg.vmlist_path.display()
                ),
            )
        })?;
    let on_node = |why: String| {
        Err(Refusal::new(
            ErrorCode::ExecNotOwned,
            format!(
                "{vmid} {why} in {} ; nothing was run. The helper runs commands only in \
                 containers on this node ({})",
                list.source().describe(),
                cfg.node
            ),
        ))
    };
    match list.lookup(vmid) {
        None => on_node("is not in the full guest list".to_string()),
        Some(e) if e.kind != GuestType::Lxc => {
            on_node(format!("is {}", e.kind.noun_with_article()))
        }
        Some(e) if *e.node != *cfg.node => on_node(format!("is on node {}", e.node)),
        Some(_) => Ok(()),
    }
}

/// Step 3: `user.cfg` lists the vmid in the config's pool.
fn check_in_pool(cfg: &Config, vmid: u32) -> Result<(), Refusal> {
    let text = user_cfg::read(&cfg.user_cfg_path).map_err(|e| {
        Refusal::new(
            ErrorCode::ExecNotInPool,
            format!("the pool of container {vmid} cannot be read: {e}; nothing was run"),
        )
    })?;
    match user_cfg::pool_of(&text, vmid) {
        Some(p) if p == cfg.pool => Ok(()),
        other => Err(Refusal::new(
            ErrorCode::ExecNotInPool,
            format!(
                "container {vmid} is not in pool {} in {} ({}); nothing was run. Put it back \
                 with `pveum pool modify {} --vms {vmid}` if it belongs to this agent",
                cfg.pool,
                cfg.user_cfg_path.display(),
                match other {
                    Some(p) => format!("it is in pool {}", outside_text(p)),
                    None => "it is in no pool".to_string(),
                },
                cfg.pool
            ),
        )),
    }
}
