//! Whether one request may run: checked before every request, from files read fresh each time,
//! never from anything the caller says beyond the vmid and the transaction id.
//!
//! 1. The journal in `state_dir` holds transaction `txn`, of this pool, for this vmid, an LXC
//!    container, with the marker confirmed and destroy armed (not withdrawn, not destroyed),
//!    still open and journaled in a step that runs commands in the guest: the launch proof,
//!    the bootstrap or the checks (also a restore test's checks); else `exec_wrong_phase`. The
//!    agent journals each of these steps before it runs its first command. A transaction that
//!    is settled, kept ones included, runs nothing: a kept guest is the operator's, and no
//!    step of the agent runs commands in it any more. A gated destroy never runs commands and
//!    is not accepted. The state dir
//!    is writable by the agent's user, so it is read as hostile: the journal folder and the
//!    file are opened without following links, the file must be a regular file owned by root
//!    or the agent's user, and the read is capped (the journal's own caps and checks).
//! 2. The node's full guest list (`.vmlist`, else `pct list` + `qm list`) has the vmid as an
//!    LXC container on this node.
//! 3. `user.cfg` lists the vmid in the pool of the config ([`super::user_cfg`]).
//! 4. The container's own config (`[exec] pve_nodes_dir`/`<node>/lxc/<vmid>.conf`, read as root
//!    without following links) is that of an unprivileged container without host access
//!    ([`super::ct_conf`]); else `exec_guest_privileged`.

use std::os::fd::AsFd;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{open, OFlag};
use nix::sys::stat::{fstat, Mode, SFlag};

use super::{ct_conf, user_cfg};
use crate::config::Config;
use crate::error::{outside_text, ErrorCode};
use crate::inventory::{read_full_list, GuestType, SystemListCommands};
use crate::nofollow;
use crate::provision::journal::{file_name, read_opened, JOURNAL_DIR};
use crate::provision::machine::Step;
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

/// The steps in which a transaction runs commands in its guest.
pub const GUEST_STEPS: [Step; 4] = [
    Step::ProveLaunch,
    Step::WaitBoot,
    Step::Bootstrap,
    Step::Checks,
];

/// Check all four before running a request for `vmid` on behalf of `txn`. Blocking (reads
/// files, may run `pct list` / `qm list`): call it off the async threads.
pub fn authorize(cfg: &Config, owners: Owners, vmid: u32, txn: TxnId) -> Result<(), Refusal> {
    let state = read_claim(&cfg.state_dir, owners, vmid, txn)?;
    check_claim(&state, vmid, &cfg.pool, txn)?;
    check_on_node(cfg, vmid)?;
    check_in_pool(cfg, vmid)?;
    check_unprivileged(cfg, vmid)
}

/// Step 4: the container's config keeps it from the node.
pub fn check_unprivileged(cfg: &Config, vmid: u32) -> Result<(), Refusal> {
    let refuse = |why: String| {
        Err(Refusal::new(
            ErrorCode::ExecGuestPrivileged,
            format!(
                "container {vmid}: {why}; nothing was run. The exec helper runs commands only in \
                 an unprivileged container without raw lxc. keys, host-path mount points or \
                 devices (its root must not be the node's root)"
            ),
        ))
    };
    match ct_conf::read(&cfg.exec.pve_nodes_dir, &cfg.node, vmid) {
        Err(e) => refuse(format!(
            "its config cannot be read: {e}. Check [exec] pve_nodes_dir (default {})",
            crate::config::DEFAULT_PVE_NODES_DIR
        )),
        Ok(text) => match ct_conf::check(&text) {
            Ok(()) => Ok(()),
            Err(why) => refuse(format!(
                "{}/{}/lxc/{vmid}.conf: {why}",
                cfg.exec.pve_nodes_dir.display(),
                cfg.node
            )),
        },
    }
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
    let journal_dir = nofollow::folder(base.as_fd(), JOURNAL_DIR).map_err(|e| match e {
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
    let fd =
        nofollow::file(journal_dir.as_fd(), file_name(ulid).as_str()).map_err(|e| match e {
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
    let wrong_phase = |why: String| {
        Err(Refusal::new(
            ErrorCode::ExecWrongPhase,
            format!(
                "transaction {txn} runs no commands in container {vmid} now ({why}); nothing was \
                 run. Only an open transaction in its launch proof, bootstrap or checks may"
            ),
        ))
    };
    if state.is_terminal() {
        return wrong_phase(if state.holds_claim() {
            "it is settled and keeps its guest, which is no longer the agent's to run commands in"
                .to_string()
        } else {
            "it is settled".to_string()
        });
    }
    if !GUEST_STEPS.contains(&state.step()) {
        return wrong_phase(format!("its journaled step is {}", state.step()));
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

#[cfg(test)]
mod tests {
    use super::*;

    const TXN: &str = "01JD0000000000000000000000";

    fn txn() -> TxnId {
        TxnId::parse(TXN).expect("txn")
    }

    fn state_dir() -> tempfile::TempDir {
        let d = tempfile::tempdir().expect("tmp");
        std::fs::create_dir(d.path().join(JOURNAL_DIR)).expect("journal");
        d
    }

    fn refusal(d: &Path) -> Refusal {
        read_claim(d, Owners { agent_uid: None }, 101, txn()).expect_err("refused")
    }

    #[test]
    fn a_missing_journal_or_transaction_is_not_owned() {
        let d = tempfile::tempdir().expect("tmp");
        let r = refusal(d.path());
        assert_eq!(r.code, ErrorCode::ExecNotOwned);
        assert!(
            r.message.contains("101") && r.message.contains(TXN),
            "{}",
            r.message
        );
        std::fs::create_dir(d.path().join(JOURNAL_DIR)).expect("journal");
        assert!(refusal(d.path()).message.contains("does not exist"));
    }

    #[test]
    fn links_fifos_and_foreign_files_in_the_journal_are_refused_unread() {
        let d = state_dir();
        let file = d.path().join(JOURNAL_DIR).join(format!("{TXN}.log"));
        // A link to a file of root's.
        std::os::unix::fs::symlink("/etc/passwd", &file).expect("symlink");
        assert!(refusal(d.path()).message.contains("symbolic link"));
        std::fs::remove_file(&file).expect("rm");
        // A FIFO: opening it must not block, and it is no journal file.
        nix::unistd::mkfifo(&file, Mode::from_bits_truncate(0o600)).expect("mkfifo");
        assert!(refusal(d.path()).message.contains("not a regular file"));
        std::fs::remove_file(&file).expect("rm");
        // A file of another user (not root, not the agent's user).
        std::fs::write(&file, "{}\n{}\n").expect("write");
        nix::unistd::chown(&file, Some(nix::unistd::Uid::from_raw(65534)), None).expect("chown");
        let r = refusal(d.path());
        assert!(r.message.contains("uid 65534"), "{}", r.message);
        // The same file is trusted when 65534 is the agent's user, and then read as a journal
        // (this one is not a valid journal file).
        let r = read_claim(
            d.path(),
            Owners {
                agent_uid: Some(65534),
            },
            101,
            txn(),
        )
        .expect_err("not a journal");
        assert!(r.message.contains("cannot be read"), "{}", r.message);
    }

    #[test]
    fn a_journal_folder_that_is_a_link_is_refused() {
        let d = tempfile::tempdir().expect("tmp");
        let elsewhere = tempfile::tempdir().expect("tmp");
        std::fs::write(elsewhere.path().join(format!("{TXN}.log")), "{}\n").expect("write");
        std::os::unix::fs::symlink(elsewhere.path(), d.path().join(JOURNAL_DIR)).expect("link");
        let r = refusal(d.path());
        assert_eq!(r.code, ErrorCode::ExecNotOwned);
        assert!(r.message.contains("journal folder"), "{}", r.message);
    }

    #[test]
    fn a_journal_folder_of_another_user_is_refused() {
        let d = state_dir();
        nix::unistd::chown(
            &d.path().join(JOURNAL_DIR),
            Some(nix::unistd::Uid::from_raw(65534)),
            None,
        )
        .expect("chown");
        assert!(refusal(d.path()).message.contains("uid 65534"));
    }
}
