//! The transaction service: the one place where provisions, gated destroys and restore tests
//! are started, resumed and settled. Both front ends call it: the operator's command line
//! (`crate::cli`) and the hub's dispatch (`crate::hub`), and it knows neither of them.
//!
//! Every call returns values (a [`Driven`] transaction, a report, a [`Failure`] when the call
//! ended before a transaction existed); formatting for a person, for `--json` or for the wire
//! is the front ends' business.
//!
//! What it owns: opening the PVE client and the journal, taking up what a stopped run left
//! open (DESIGN rule 6: resumed from its last journaled step, or settled through the gate where
//! it cannot be) before anything is written (in the daemon: in the background), the vmid
//! verdict against the FULL guest list, the per-vmid lock, and handing a transaction to the
//! provision executor.
//!
//! It may use `metrics`, `provision`, `guest`, `inventory`, `vmid`, `pve`, `config`, `error` and the
//! hub's wire types (`hub_protocol`), never `cli` or `hub`.

pub mod journal_ops;
pub mod restore_test;

use std::fs::DirBuilder;
use std::os::unix::fs::DirBuilderExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use hub_protocol::{ErrorInfo, TxnId, TxnResult};
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use crate::config::Config;
use crate::error::{ErrorCode, Failure};
use crate::guest::checks::CheckResult;
use crate::guest::LxcExecFactory;
use crate::inventory::{
    join, FullGuestList, GuestType, GuestsReport, Membership, PoolView, ResourceRow,
};
use crate::metrics;
use crate::preflight::{self, PreflightReport};
use crate::provision::effects::{Executor, Reporter};
use crate::provision::journal::{JournalRow, Listing};
use crate::provision::machine::{Event, Request, State, TxnKind};
use crate::provision::{Journal, VmidLock};
use crate::pve::types::backup_kind_from_volid;
use crate::pve::{GuestKind, PveClient};
use crate::vmid::{self, GuestLookup, Holder, VmidVerdict};

pub use crate::provision::effects::Driven;

/// A transaction the service drove, with the preflight's checks when it ran one.
#[derive(Debug, Clone)]
pub struct TxnRun {
    /// The transaction.
    pub driven: Driven,
    /// The preflight's report (provisions; a destroy has none).
    pub preflight: Option<PreflightReport>,
}

/// What a provision asks for: the operator's flags or a hub dispatch's fields.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProvisionRequest {
    /// The vmid as given (validated here; never picked).
    pub vmid: Option<String>,
    /// The backup volid (default: `provision.selftest_source`).
    pub from: Option<String>,
    /// The target storage (default: `provision.storage`).
    pub storage: Option<String>,
    /// Keep the guest instead of destroying it after the checks.
    pub keep: bool,
    /// Plan only: write nothing.
    pub dry_run: bool,
    /// The bootstrap profile (default: `default`).
    pub profile: Option<String>,
    /// `Some(true)`: the guest starts with no NIC (`--network=isolated`); `Some(false)`: with
    /// its stored NICs (`--network=stored`); `None`: the kind's default (a throwaway selftest
    /// is isolated, a kept one and a hub provision keep their network).
    pub isolate_network: Option<bool>,
}

impl ProvisionRequest {
    /// Whether a transaction of `kind` for this request starts its guest with no NIC: a
    /// restore-test copy always; a `--selftest=provision` unless kept or told otherwise (a
    /// throwaway copy of a customer's guest must not meet the customer's network as a twin);
    /// a hub provision only when told.
    pub fn isolates_network(&self, kind: TxnKind) -> bool {
        match kind {
            TxnKind::SelftestRestore => true,
            TxnKind::SelftestProvision => self.isolate_network.unwrap_or(!self.keep),
            _ => self.isolate_network.unwrap_or(false),
        }
    }
}

/// The PVE client and the journal, with the open transactions of a crashed run settled.
pub struct Prepared {
    /// The PVE client.
    pub pve: PveClient,
    /// The journal.
    pub journal: Journal,
}

/// Whether this process takes up leftover transactions in a task of its own (the daemon), so
/// that a writing command it runs leaves them to that task instead of taking them up first.
static LEFTOVERS_IN_BACKGROUND: AtomicBool = AtomicBool::new(false);

/// Leftover transactions are taken up by a task of their own in this process (the daemon's
/// background settle): [`prepare`] no longer takes them up before a command writes.
pub fn take_up_leftovers_in_background() {
    LEFTOVERS_IN_BACKGROUND.store(true, Ordering::SeqCst);
}

/// Open the client and the journal, and take up what a stopped run left open: each open
/// transaction resumes from its last journaled step (see [`settle_open`]). In the daemon
/// ([`take_up_leftovers_in_background`]) that is left to its own task.
pub async fn prepare(
    cfg: &Config,
    reporter: &dyn Reporter,
    cancel: &CancellationToken,
) -> Result<Prepared, Failure> {
    let pve = pve_client(cfg)?;
    // A full disk stops a transaction between two PVE writes: refused before the first.
    preflight::require_state_dir_space(&cfg.state_dir)?;
    let journal = open_journal(cfg)?;
    if !LEFTOVERS_IN_BACKGROUND.load(Ordering::SeqCst) {
        settle_open(cfg, &pve, &journal, reporter, cancel, TakeUp::Resume).await?;
    }
    compact(cfg, &journal);
    Ok(Prepared { pve, journal })
}

/// The open transaction on `vmid` a stopped run left, if any: a new transaction there waits
/// until it has ended (the daemon takes it up in the background).
pub fn open_on_vmid(journal: &Journal, vmid: u32) -> Result<Option<State>, Failure> {
    Ok(journal
        .open_transactions()
        .map_err(|e| Failure::new(e.code(), e.to_string()))?
        .into_iter()
        .map(|t| t.state)
        .find(|s| s.vmid() == Some(vmid)))
}

/// How this process reaches into LXC containers: the root exec helper when `[exec]
/// helper_socket` is set or the agent does not run as root, else `pct` itself.
pub fn lxc_route(cfg: &Config) -> Arc<dyn LxcExecFactory> {
    use crate::exec_helper::client::{ExecMode, HelperRoute};
    // The direct route's scratch folder is made only when `pct` is the route: through the
    // helper (and in a dry run that way) nothing is created in the state folder.
    match ExecMode::of_process(cfg) {
        ExecMode::Helper { socket, .. } => Arc::new(HelperRoute::new(socket)),
        ExecMode::Direct => {
            crate::exec_helper::client::lxc_route(cfg, crate::provision::effects::direct_pct(cfg))
        }
    }
}

/// Move settled transactions older than `[journal] keep_days` into the journal's archive. A
/// failure is logged and changes nothing: the transactions stay where they are.
pub fn compact(cfg: &Config, journal: &Journal) {
    let keep = std::time::Duration::from_secs(u64::from(cfg.journal_keep_days) * 86_400);
    if let Err(e) = journal.compact(keep, time::OffsetDateTime::now_utc()) {
        tracing::warn!(error = %e, "could not move old transactions to the journal's archive; they stay in the journal folder");
    }
}

/// Open the client and the journal for a dry run: nothing is settled, nothing written.
pub fn prepare_read_only(cfg: &Config) -> Result<Prepared, Failure> {
    // A dry run says "nothing was written": it creates no folder either. A state folder that
    // exists is still checked, as its journal is read.
    if cfg.state_dir.is_dir() {
        crate::config::check_trusted_state_dir(cfg)
            .map_err(|why| Failure::new(ErrorCode::ConfigInvalid, why))?;
    }
    Ok(Prepared {
        pve: pve_client(cfg)?,
        journal: Journal::at_read_only(&cfg.state_dir),
    })
}

/// The PVE client of this node's configuration.
pub fn pve_client(cfg: &Config) -> Result<PveClient, Failure> {
    PveClient::new(&cfg.pve).map_err(|e| Failure::new(e.code(), e.to_string()))
}

/// Open the journal, creating the state dir (0700) if needed.
pub fn open_journal(cfg: &Config) -> Result<Journal, Failure> {
    if !cfg.state_dir.is_dir() {
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&cfg.state_dir)
            .map_err(|e| {
                Failure::new(
                    ErrorCode::ConfigInvalid,
                    format!(
                        "cannot create the state dir {}: {e}; fix state_dir in {}",
                        cfg.state_dir.display(),
                        cfg.path.display()
                    ),
                )
            })?;
    }
    // The journal there decides which guests this agent may destroy.
    crate::config::check_trusted_state_dir(cfg)
        .map_err(|why| Failure::new(ErrorCode::ConfigInvalid, why))?;
    Journal::open(&cfg.state_dir).map_err(|e| Failure::new(e.code(), e.to_string()))
}

/// Read the full guest list of this node's cluster (`.vmlist` through the exec helper in its
/// mode: [`crate::exec_helper::client::full_guest_list`]).
pub fn full_list(cfg: &Config) -> Result<FullGuestList, Failure> {
    crate::exec_helper::client::full_guest_list(cfg)
        .map_err(|e| Failure::new(e.code(), e.to_string()))
}

/// The pool view: the guests the pool token sees.
pub async fn pool_view(cfg: &Config, pve: &PveClient) -> Result<PoolView, Failure> {
    let rows = pve
        .cluster_vms()
        .await
        .map_err(|e| Failure::new(e.code(), e.to_string()))?;
    Ok(PoolView::from_resources(
        &cfg.pool,
        rows.into_iter().map(|r| ResourceRow {
            vmid: r.vmid,
            kind: match r.kind {
                GuestKind::Lxc => GuestType::Lxc,
                GuestKind::Qemu => GuestType::Qemu,
            },
            node: r.node,
            name: r.name,
            status: r.status,
            pool: r.pool,
        }),
    ))
}

/// The full list alone, every guest in it taken as foreign until the pool view says otherwise.
struct ListOnly<'a>(&'a FullGuestList);

impl GuestLookup for ListOnly<'_> {
    fn holder(&self, vmid: u32) -> Option<Holder> {
        self.0.lookup(vmid).map(|e| Holder {
            kind: e.kind,
            node: e.node.to_string(),
            membership: Membership::Foreign,
        })
    }
}

/// The verdict on an operator's vmid against the FULL guest list. The API is asked (for pool
/// membership) only when a guest holds the vmid.
pub async fn verdict(
    cfg: &Config,
    pve: &PveClient,
    input: &str,
) -> Result<(VmidVerdict, FullGuestList), Failure> {
    let full = full_list(cfg)?;
    let first = vmid::check(input, &ListOnly(&full));
    let held = match &first {
        VmidVerdict::InUse { .. } => true,
        VmidVerdict::Reserved { holder, .. } => holder.is_some(),
        _ => false,
    };
    if !held {
        return Ok((first, full));
    }
    let refined = match pool_view(cfg, pve).await {
        Ok(pool) => vmid::check(input, &join(&full, &pool)),
        // Without PVE's answer the holder may be the pool's own guest: calling it foreign
        // would be a guess. The vmid is held either way, but what holds it cannot be told.
        Err(e) if crate::error::exit_status(e.code) == crate::error::ExitStatus::Environment => {
            let holder = vmid::parse_vmid(input)
                .ok()
                .and_then(|v| full.lookup(v))
                .map(|h| format!("a guest ({}) on node {}", h.kind.as_str(), h.node))
                .unwrap_or_else(|| "a guest".to_string());
            return Err(Failure::new(
                e.code,
                format!(
                    "vmid {input} is held by {holder} in the full guest list ({}), but whether it is a guest of pool {:?} or a foreign one cannot be told: {}; run the command again once PVE answers (`felhom-agent doctor`)",
                    full.source().describe(),
                    cfg.pool,
                    e.message
                ),
            ));
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the pool view; the holder is reported as foreign");
            first
        }
    };
    Ok((refined, full))
}

/// `guests`: the full guest list joined with the pool view.
pub async fn guests(cfg: &Config) -> Result<GuestsReport, Failure> {
    let pve = pve_client(cfg)?;
    let full = full_list(cfg)?;
    let pool = pool_view(cfg, &pve).await?;
    Ok(join(&full, &pool).guests_report())
}

/// `vmid-check`: the verdict and the full list it was judged against. Never writes.
pub async fn vmid_check(
    cfg: &Config,
    input: &str,
) -> Result<(VmidVerdict, FullGuestList), Failure> {
    let pve = pve_client(cfg)?;
    verdict(cfg, &pve, input).await
}

/// `journal`: every transaction, newest state of each.
pub fn journal_rows(cfg: &Config) -> Result<Vec<JournalRow>, Failure> {
    let mut rows = open_journal(cfg)?
        .list()
        .map_err(|e| Failure::new(e.code(), e.to_string()))?;
    for r in &mut rows {
        r.note_interrupted(&cfg.state_dir);
    }
    Ok(rows)
}

/// How many settled transactions `felhom-agent journal` shows besides those that may still
/// own or concern a guest.
pub const LIST_SETTLED: usize = 50;

/// `felhom-agent journal`: every open, `needs_human` and kept transaction and the
/// [`LIST_SETTLED`] settled ones written last.
pub fn journal_listing(cfg: &Config) -> Result<Listing, Failure> {
    let mut listing = open_journal(cfg)?
        .list_recent(LIST_SETTLED)
        .map_err(|e| Failure::new(e.code(), e.to_string()))?;
    for r in &mut listing.rows {
        r.note_interrupted(&cfg.state_dir);
    }
    Ok(listing)
}

/// Rewrite the journal's metrics file after a transaction; a failure is a warning only.
pub(crate) fn refresh_metrics(cfg: &Config, journal: &Journal) {
    if let Err(e) = metrics::update_transactions(&cfg.metrics.dir, journal) {
        tracing::warn!("metrics not updated: {e}");
    }
}

/// `journal --stats`: the figures of the transactions started within the last `since_s`
/// seconds (all when `None`), from the journal and its archive.
pub fn journal_stats(cfg: &Config, since_s: Option<u64>) -> Result<metrics::stats::Stats, Failure> {
    let timings = open_journal(cfg)?
        .all_timings()
        .map_err(|e| Failure::new(e.code(), e.to_string()))?;
    let cutoff = since_s.map(|s| {
        let back = time::Duration::seconds(i64::try_from(s).unwrap_or(i64::MAX));
        time::OffsetDateTime::now_utc()
            .checked_sub(back)
            .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
    });
    let kept: Vec<_> = timings
        .into_iter()
        .filter(|t| {
            cutoff.is_none_or(|c| {
                time::OffsetDateTime::parse(
                    &t.started_at,
                    &time::format_description::well_known::Rfc3339,
                )
                .is_ok_and(|at| at >= c)
            })
        })
        .collect();
    Ok(metrics::stats::compute(
        &kept,
        cutoff.map(crate::timefmt::rfc3339),
    ))
}

/// The newest transaction of one kind, for `journal --last KIND`.
#[derive(Debug, Clone)]
pub struct LastOfKind {
    /// Its journal row.
    pub row: JournalRow,
    /// The backup it restored (none for a destroy).
    pub backup: Option<String>,
    /// For a restore test: its stored result (checks, boot, isolation), when it is this one's.
    pub restore_test: Option<restore_test::LastResult>,
}

/// `journal --last KIND`: the newest transaction of `kind` (by its start), from the journal
/// folder, else the archive; `None` when there is none. Reads only.
pub fn last_of_kind(
    cfg: &Config,
    kind: TxnKind,
    guest: Option<u32>,
) -> Result<Option<LastOfKind>, Failure> {
    let journal = open_journal(cfg)?;
    let newest = |rows: Vec<JournalRow>| {
        rows.into_iter()
            .filter(|r| r.kind == kind)
            .filter(|r| guest.is_none_or(|g| r.guest == Some(g)))
            .max_by_key(|r| r.txn)
    };
    let mut row = newest(journal_rows(cfg)?);
    if row.is_none() {
        row = newest(archived_rows(cfg)?);
    }
    let Some(row) = row else {
        return Ok(None);
    };
    let backup = journal
        .get_any(row.txn)
        .ok()
        .flatten()
        .map(|t| t.state.request().volid.clone())
        .filter(|v| !v.is_empty() && kind != TxnKind::Destroy);
    let restore_test = (kind == TxnKind::SelftestRestore)
        .then(|| {
            let txn = row.txn.to_string();
            // The guest's own last result, else the run's last copy's.
            row.guest
                .and_then(|g| restore_test::read_guest_last_result(cfg, g))
                .filter(|r| r.txn == txn)
                .or_else(|| restore_test::read_last_result(cfg).filter(|r| r.txn == txn))
        })
        .flatten();
    Ok(Some(LastOfKind {
        row,
        backup,
        restore_test,
    }))
}

/// `journal --all`: the archived transactions (those `journal` no longer lists), oldest first.
pub fn archived_rows(cfg: &Config) -> Result<Vec<JournalRow>, Failure> {
    let journal = open_journal(cfg)?;
    Ok(journal
        .archived()
        .map_err(|e| Failure::new(e.code(), e.to_string()))?
        .iter()
        // One a compaction archived but could not remove yet is listed once, from the folder.
        .filter(|t| !journal.path_of(t.state.txn()).exists())
        .map(JournalRow::from)
        .collect())
}

/// Refuse a new transaction `txn` on `vmid` while another one there is still open (a stopped
/// run's, not taken up yet): one transaction per vmid at a time.
fn refuse_while_open(journal: &Journal, vmid: u32, txn: Ulid) -> Result<(), Failure> {
    match open_on_vmid(journal, vmid)? {
        Some(open) if open.txn() != txn => Err(Failure::new(
            ErrorCode::VmidInUse,
            format!(
                "transaction {} on vmid {vmid} is still open (a stopped run's, being resumed);                  nothing was done. Retry once it has ended (`felhom-agent journal`)",
                open.txn()
            ),
        )),
        _ => Ok(()),
    }
}

/// How an open transaction a stopped run left is taken up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TakeUp {
    /// Go on from its last journaled step to its real end (the machine's `resume`; where that
    /// is impossible it is settled as by [`TakeUp::Settle`]).
    Resume,
    /// End it now (DESIGN rule 6, the machine's `recover`): follow a running task, clean its
    /// own guest up through the gate, `failed` or `needs_human` with the reason.
    Settle,
}

/// Take up every open transaction a stopped run left (DESIGN rule 6): resume it, or settle it
/// (an armed cleanup finished, or `needs_human`), as `how` says. Transactions whose vmid lock
/// is held belong to a live process and are left alone. Returns how many were taken up.
pub async fn settle_open(
    cfg: &Config,
    pve: &PveClient,
    journal: &Journal,
    reporter: &dyn Reporter,
    cancel: &CancellationToken,
    how: TakeUp,
) -> Result<usize, Failure> {
    let open = journal
        .open_transactions()
        .map_err(|e| Failure::new(e.code(), e.to_string()))?;
    let mut settled = 0;
    for t in open {
        if let SettleOne::Settled(driven) =
            settle_one(cfg, pve, journal, reporter, cancel, &t.state, how).await
        {
            if let Some(h) = driven.halted {
                return Err(h);
            }
            settled += 1;
        }
    }
    remove_leftover_labs(cfg, journal).await;
    Ok(settled)
}

/// Remove the application-group labs a stopped run left ([`crate::guest::group_lab`]): a lab
/// whose namespace exists, that a journaled transaction names, and none of whose members is
/// still open (an open member's run may still use it, or its resume will). A name no
/// transaction names is never touched. A failure is logged; the next command tries again.
pub async fn remove_leftover_labs(cfg: &Config, journal: &Journal) {
    let labs = crate::guest::group_lab::existing();
    if labs.is_empty() {
        return;
    }
    let all = match journal.replay() {
        Ok(all) => all,
        Err(e) => {
            tracing::warn!(error = %e, "the journal cannot be read: group labs left by a stopped run stay until the next command");
            return;
        }
    };
    for lab in labs {
        let members: Vec<&State> = all
            .iter()
            .map(|t| &t.state)
            .filter(|s| s.request().group.as_ref().is_some_and(|g| g.lab == lab))
            .collect();
        let Some(first) = members.first() else {
            continue;
        };
        if members.iter().any(|s| s.outcome_kind().is_none()) {
            continue;
        }
        let Some(vmid) = first.vmid() else {
            continue;
        };
        let op = crate::guest::exec::LabOp::Remove { lab };
        match lxc_route(cfg).lab_op(vmid, first.txn(), op).await {
            Ok(note) => {
                tracing::warn!(lab = %lab, txn = %first.txn(), "a stopped run's group lab: {note}")
            }
            Err(why) => tracing::warn!(
                lab = %lab,
                "the group lab {} a stopped run left could not be removed: {why}; the next command tries again",
                crate::guest::group_lab::lab_name(lab)
            ),
        }
    }
}

/// The daemon's background take-up: resume every open transaction a stopped run left, except
/// those in `skip` (open dispatches, which the dispatcher resumes itself). Each runs under its
/// vmid's lock; one held by a live process is left alone. Stops at the first halted drive (the
/// shutdown). Returns how many were taken up.
pub async fn take_up_leftovers(
    cfg: &Config,
    reporter: &dyn Reporter,
    cancel: &CancellationToken,
    skip: &[Ulid],
) -> Result<usize, Failure> {
    let pve = pve_client(cfg)?;
    let journal = open_journal(cfg)?;
    let open = journal
        .open_transactions()
        .map_err(|e| Failure::new(e.code(), e.to_string()))?;
    let mut taken = 0;
    for t in open.iter().filter(|t| !skip.contains(&t.state.txn())) {
        if cancel.is_cancelled() {
            break;
        }
        if let SettleOne::Settled(driven) = settle_one(
            cfg,
            &pve,
            &journal,
            reporter,
            cancel,
            &t.state,
            TakeUp::Resume,
        )
        .await
        {
            if let Some(h) = driven.halted {
                return Err(h);
            }
            taken += 1;
        }
    }
    remove_leftover_labs(cfg, &journal).await;
    compact(cfg, &journal);
    Ok(taken)
}

/// What [`settle_one`] did with one open transaction.
#[derive(Debug)]
pub enum SettleOne {
    /// It was settled (or its drive halted: see [`Driven::halted`]).
    Settled(Box<Driven>),
    /// Its vmid lock is held by a running process: left alone (the reason names the holder).
    Held(String),
    /// An isolated VM copy whose lab bridge another process's copy holds: left alone until
    /// that one has ended (the reason says so).
    BridgeBusy(String),
    /// It has no vmid, or was settled meanwhile: nothing to do.
    NotOpen,
}

/// Take up one open transaction as every writing command does before it writes: under its
/// vmid's lock, re-read from the journal, observed and driven by the machine's resume or
/// recovery (`how`; an armed cleanup only through a fresh ownership re-check).
pub async fn settle_one(
    cfg: &Config,
    pve: &PveClient,
    journal: &Journal,
    reporter: &dyn Reporter,
    cancel: &CancellationToken,
    open: &State,
    how: TakeUp,
) -> SettleOne {
    let Some(vmid) = open.vmid() else {
        return SettleOne::NotOpen;
    };
    let _lock = match VmidLock::try_acquire(&cfg.state_dir, vmid, Some(open.txn())) {
        Ok(l) => l,
        Err(e) => {
            tracing::info!(txn = %open.txn(), vmid, reason = %e, "open transaction belongs to a running agent; left alone");
            return SettleOne::Held(e.to_string());
        }
    };
    // An isolated VM copy goes on (its VM started again, or still running) only while no other
    // copy is on the lab bridge, as a new copy waits for it; a cancel only removes the copy.
    let _lab = match how {
        TakeUp::Resume => match lab_bridge_lock_for(cfg, open) {
            Ok(lock) => lock,
            Err(e) => return SettleOne::BridgeBusy(e.message),
        },
        TakeUp::Settle => None,
    };
    // Re-read under the lock: the other process may have settled it meanwhile.
    let state = match journal.get(open.txn()) {
        Ok(Some(fresh)) if !fresh.state.is_terminal() => {
            // The last record's event may have been lost with the process: report it again
            // (same identity, applied once).
            reporter.phase(&fresh.state, fresh.records);
            fresh.state
        }
        _ => return SettleOne::NotOpen,
    };
    let from = state.clone();
    let mut exec = Executor::new(cfg, pve, journal, reporter, cancel.clone(), lxc_route(cfg));
    let driven = match how {
        TakeUp::Resume => {
            tracing::warn!(txn = %state.txn(), vmid, phase = state.phase().as_str(), step = state.step().as_str(), "resuming a transaction a previous run left open");
            exec.resume(state).await
        }
        TakeUp::Settle => {
            tracing::warn!(txn = %state.txn(), vmid, phase = state.phase().as_str(), "settling a transaction a previous run left open");
            exec.settle(state).await
        }
    };
    if let Some(o) = driven.state.outcome() {
        tracing::warn!(txn = %o.txn, vmid, outcome = o.outcome.as_str(), phase = o.phase.as_str(), destroyed = o.destroyed, "settled");
    }
    refresh_metrics(cfg, journal);
    restore_test::record_taken_up(cfg, journal, &driven);
    reporter.taken_up(&from, &driven);
    SettleOne::Settled(Box::new(driven))
}

/// A provision transaction (an operator's selftest or a hub dispatch) under `txn`. `Err` when
/// it ended before a transaction existed (no vmid, no backup, the journal or PVE client could
/// not be opened, the vmid is locked by another process).
pub async fn provision(
    cfg: &Config,
    req: &ProvisionRequest,
    kind: TxnKind,
    txn: Ulid,
    reporter: &dyn Reporter,
    cancel: CancellationToken,
) -> Result<TxnRun, Failure> {
    let Some(input) = req.vmid.as_deref() else {
        return Err(Failure::new(
            ErrorCode::VmidInvalid,
            "--selftest=provision needs -vmid N: the agent never picks a vmid; choose a free one with `felhom-agent guests` / `felhom-agent vmid-check N`",
        ));
    };
    let volid = req
        .from
        .clone()
        .or_else(|| cfg.provision.selftest_source.clone())
        .ok_or_else(|| {
            Failure::new(
                ErrorCode::ConfigInvalid,
                format!("no backup to restore from: pass --from VOLID or set provision.selftest_source in {}", cfg.path.display()),
            )
        })?;
    let guest = backup_kind_from_volid(&volid).ok_or_else(|| {
        Failure::new(
            // Not a backup this agent can restore: the preflight's refusal, before any read.
            ErrorCode::BackupMissing,
            format!("cannot tell from {volid:?} whether it is a container or a VM backup (expected vzdump-lxc-… or vzdump-qemu-…)"),
        )
    })?;
    let storage = req
        .storage
        .clone()
        .unwrap_or_else(|| cfg.provision.storage.clone());

    // A vmid that is not even a vmid is refused before anything is opened.
    let vmid_num = vmid::parse_vmid(input).map_err(Failure::from)?;
    // A kept VM copy with its network isolated would stay on a lab bridge after this run,
    // and every later copy there would reach it (the bridge's lock is this run's alone).
    if guest == GuestKind::Qemu && req.keep && req.isolates_network(kind) {
        if let Some(bridge) = cfg.restore_test.lab_bridge() {
            return Err(Failure::new(
                ErrorCode::PolicyDenied,
                format!(
                    "VM {vmid_num} would be kept with its NICs on the lab bridge {bridge}, where every later isolated VM copy would reach it; keep it with its stored network (--network=stored) or let it be destroyed after its checks (no --keep); nothing was written"
                ),
            ));
        }
    }
    let prepared = if req.dry_run {
        prepare_read_only(cfg)?
    } else {
        prepare(cfg, reporter, &cancel).await?
    };
    let _lock = if req.dry_run {
        None
    } else {
        Some(
            VmidLock::try_acquire(&cfg.state_dir, vmid_num, Some(txn))
                .map_err(|e| Failure::new(e.code(), e.to_string()))?,
        )
    };
    if !req.dry_run {
        refuse_while_open(&prepared.journal, vmid_num, txn)?;
    }
    let lab = lab_bridge_lock(
        cfg,
        guest,
        req.isolates_network(kind) && !req.dry_run,
        txn,
        None,
    )?;
    // The bridge its NICs go onto: the one locked, or for a dry run's plan the first.
    let lab_bridge = match &lab {
        Some((_, bridge)) => Some(bridge.clone()),
        None if guest == GuestKind::Qemu && req.isolates_network(kind) => {
            cfg.restore_test.lab_bridge().map(str::to_string)
        }
        None => None,
    };
    let request = Request {
        txn,
        kind,
        vmid: Some(vmid_num),
        guest,
        volid,
        storage,
        pool: cfg.pool.clone(),
        isolate_network: req.isolates_network(kind),
        keep: req.keep,
        dry_run: req.dry_run,
        profile: req.profile.clone(),
        lab_bridge,
        group: None,
    };
    let first = match verdict(cfg, &prepared.pve, input).await? {
        (VmidVerdict::Free { .. }, _) => Event::VmidAccepted,
        (v, _) => Event::VmidRefused(Failure::new(
            v.code().unwrap_or(ErrorCode::VmidInUse),
            v.message(),
        )),
    };
    // The preflight (DESIGN rule 9): before the first journal intent; reads only. A refusal
    // becomes the transaction's first event, so nothing is journaled or written.
    let (report, first) = preflight::gate(cfg, &prepared.pve, &request, first).await;
    reporter.preflight(&report.human());
    environment_refusal(&report, request.vmid)?;
    let mut exec = Executor::new(
        cfg,
        &prepared.pve,
        &prepared.journal,
        reporter,
        cancel,
        lxc_route(cfg),
    );
    exec.carry_stored_config(report.stored_config.clone());
    let driven = exec.drive(State::new(request), first).await;
    if !req.dry_run {
        refresh_metrics(cfg, &prepared.journal);
    }
    Ok(TxnRun {
        driven,
        preflight: Some(report),
    })
}

/// A preflight that failed for the environment (exit 6: PVE not answering, a wrong pin, the
/// exec helper, a full state folder) ends the command before its transaction exists: the
/// request was never judged, so nothing is journaled (no refusal a re-dispatch would repeat)
/// and nothing is reported as the transaction's outcome.
pub fn environment_refusal(
    report: &preflight::PreflightReport,
    vmid: Option<u32>,
) -> Result<(), Failure> {
    match report.environment_failure() {
        None => Ok(()),
        Some(f) => Err(Failure::new(
            f.code,
            format!(
                "the preflight of vmid {} could not be completed, nothing was written or journaled: {}",
                vmid.map_or_else(|| "-".to_string(), |v| v.to_string()),
                f.message
            ),
        )),
    }
}

/// `destroy -vmid N` where no guest holds the vmid in the full guest list: there is nothing
/// to destroy and nothing to prove, so no transaction is started (nothing journaled, nothing
/// sent to PVE) and the command ends 0 with a sentence saying so; a repeat of a destroy this
/// agent finished names the transaction that did it. `None`: a guest holds the vmid, or a
/// claim of this agent on it is still armed (the gated destroy withdraws it), so the gated
/// destroy runs.
///
/// Like every writing command it first settles what a stopped run left open (DESIGN rule 6):
/// a guest that settle removes or leaves is then seen as it is.
pub async fn nothing_to_destroy(
    cfg: &Config,
    input: &str,
    reporter: &dyn Reporter,
    cancel: &CancellationToken,
) -> Result<Option<(u32, String)>, Failure> {
    let vmid_num = vmid::parse_vmid(input).map_err(Failure::from)?;
    let prepared = prepare(cfg, reporter, cancel).await?;
    let journal = prepared.journal;
    let full = full_list(cfg)?;
    if full.lookup(vmid_num).is_some() {
        return Ok(None);
    }
    let origin = journal
        .last_owner_record(vmid_num)
        .map_err(|e| Failure::new(e.code(), e.to_string()))?;
    let list = full.source().describe();
    let message = match origin.as_ref().map(|t| &t.state) {
        Some(o) if o.destroyed() => format!(
            "vmid {vmid_num}: nothing to destroy: transaction {} ({}) already destroyed this agent's guest there, and no guest holds the vmid in the full guest list ({list}); nothing was sent to PVE",
            o.txn(),
            o.kind()
        ),
        Some(o) if o.destroy_armed() && o.disarmed().is_none() => return Ok(None),
        _ => format!(
            "vmid {vmid_num}: nothing to destroy: no guest holds it in the full guest list ({list}); nothing was sent to PVE"
        ),
    };
    Ok(Some((vmid_num, message)))
}

/// The gated destroy of a guest an earlier transaction of this agent created, under `txn`.
/// Without that proof nothing is sent and the transaction ends `needs_human`.
pub async fn destroy(
    cfg: &Config,
    input: &str,
    txn: Ulid,
    reporter: &dyn Reporter,
    cancel: CancellationToken,
) -> Result<TxnRun, Failure> {
    let vmid_num = vmid::parse_vmid(input).map_err(Failure::from)?;
    let prepared = prepare(cfg, reporter, &cancel).await?;
    let _lock = VmidLock::try_acquire(&cfg.state_dir, vmid_num, Some(txn))
        .map_err(|e| Failure::new(e.code(), e.to_string()))?;
    refuse_while_open(&prepared.journal, vmid_num, txn)?;
    let origin = prepared
        .journal
        .last_owner_record(vmid_num)
        .map_err(|e| Failure::new(e.code(), e.to_string()))?;
    let (state, effects) = State::for_destroy(
        txn,
        vmid_num,
        GuestKind::Lxc,
        origin.as_ref().map(|t| &t.state),
    );
    // A refusal is only journaled (nothing is sent to PVE); the hub learns of it all the same.
    let mut exec = Executor::new(
        cfg,
        &prepared.pve,
        &prepared.journal,
        reporter,
        cancel,
        lxc_route(cfg),
    );
    let driven = exec.drive_effects(state, effects).await;
    refresh_metrics(cfg, &prepared.journal);
    // The guest was destroyed: the origin's own record says so (its row no longer shows a
    // kept guest armed and not destroyed, and a refresh no longer looks for it).
    if let (true, Some(o)) = (driven.state.destroyed(), origin.as_ref()) {
        if !o.state.destroyed() {
            if let Err(e) = prepared.journal.append(&o.state.destroyed_by(txn)) {
                tracing::warn!(txn = %o.state.txn(), vmid = vmid_num, error = %e, "could not journal that the origin transaction's guest was destroyed; the destroy transaction's own record says it");
            }
        }
    }
    // The guest was seen gone or without its proof: the origin's claim is withdrawn in its
    // own journal too, so `journal` no longer shows it armed.
    if let (Some(reason), Some(o)) = (driven.state.disarmed(), origin.as_ref()) {
        if o.state.destroy_armed() && o.state.disarmed().is_none() {
            if let Err(e) = prepared.journal.append(&o.state.disarmed_by(reason)) {
                tracing::warn!(txn = %o.state.txn(), vmid = vmid_num, error = %e, "could not journal the withdrawn claim of the origin transaction; the destroy transaction's own record withdraws it");
            }
        }
    }
    Ok(TxnRun {
        driven,
        preflight: None,
    })
}

/// The journaled state of a transaction, if this agent knows it.
pub fn known(cfg: &Config, txn: Ulid) -> Option<State> {
    let journal = open_journal(cfg).ok()?;
    journal.get_any(txn).ok().flatten().map(|t| t.state)
}

/// Resume a transaction a dispatch finds open in the journal (the agent was stopped while it
/// ran): go on from its last journaled step to its end, never start it over (where it cannot
/// be resumed, it is settled through the gate). `None` when it cannot be taken up now (PVE
/// client, journal or lock unavailable).
pub async fn resume(
    cfg: &Config,
    state: State,
    reporter: &dyn Reporter,
    cancel: CancellationToken,
) -> Option<Driven> {
    let vmid = state.vmid()?;
    let pve = pve_client(cfg).ok()?;
    let journal = open_journal(cfg).ok()?;
    let _lock = VmidLock::try_acquire(&cfg.state_dir, vmid, Some(state.txn())).ok()?;
    let _lab = lab_bridge_lock_for(cfg, &state).ok()?;
    if let Ok(Some(journaled)) = journal.get(state.txn()) {
        // The last record's event may have been lost with the process: report it again.
        reporter.phase(&journaled.state, journaled.records);
    }
    tracing::warn!(txn = %state.txn(), vmid, phase = state.phase().as_str(), step = state.step().as_str(), "resuming a transaction a previous run left open");
    let mut exec = Executor::new(cfg, &pve, &journal, reporter, cancel, lxc_route(cfg));
    let driven = exec.resume(state).await;
    refresh_metrics(cfg, &journal);
    Some(driven)
}

/// What a restore-test copy (kind `restore-test`) proves, for its results and events: the
/// guest whose backup it restores (the backup's owner, by the volid's name) and that backup's
/// volid (clipped to the protocol's bound). `(None, None)` for every other kind.
pub fn restore_test_subject(state: &State) -> (Option<u32>, Option<String>) {
    if state.kind() != TxnKind::SelftestRestore {
        return (None, None);
    }
    let volid = &state.request().volid;
    if volid.is_empty() {
        return (None, None);
    }
    (
        crate::pve::types::backup_guest(volid),
        Some(hub_protocol::backup_text(volid)),
    )
}

/// The wire form of a settled transaction's result (`None` while it is open). A restore-test
/// copy's names the guest and the backup it proves ([`restore_test_subject`]).
pub fn wire_result(
    state: &State,
    checks: &[CheckResult],
    isolation: Option<&str>,
) -> Option<TxnResult> {
    let outcome = state.outcome()?;
    let (guest, backup) = restore_test_subject(state);
    Some(TxnResult {
        txn: TxnId::from_ulid(state.txn()),
        kind: state.kind(),
        vmid: state.vmid(),
        outcome: outcome.outcome,
        phase: state.phase(),
        destroy_armed: state.destroy_armed(),
        destroyed: state.destroyed(),
        checks: checks.to_vec(),
        error: state.failure().map(error_info),
        isolation: isolation.map(TxnResult::isolation_text),
        guest,
        backup,
        group: wire_group(state),
    })
}

/// A restore-test copy's application group as the hub receives it: the group's name, its
/// run (the lab's id, journaled with every member), the member's place from 1 and the members
/// in start order. `None` for a copy alone and every other kind.
pub fn wire_group(state: &State) -> Option<hub_protocol::GroupInfo> {
    if state.kind() != TxnKind::SelftestRestore {
        return None;
    }
    let g = state.request().group.as_ref()?;
    Some(hub_protocol::GroupInfo::new(
        &g.name,
        TxnId::from_ulid(g.lab),
        g.index.saturating_add(1),
        &g.guests,
    ))
}

/// The wire form of a failure.
pub fn error_info(f: &Failure) -> ErrorInfo {
    ErrorInfo {
        code: f.code,
        message: f.message.clone(),
    }
}

/// [`lab_bridge_lock`] for taking `state` up again: an isolated VM copy goes back onto the lab
/// bridge only while no other copy runs there (a refusal is logged: the copy is left open).
fn lab_bridge_lock_for(
    cfg: &Config,
    state: &State,
) -> Result<Option<crate::provision::LabBridgeLock>, Failure> {
    let r = state.request();
    // The bridge it was started on (a transaction journaled before one was recorded: the
    // first configured).
    let wanted = r
        .lab_bridge
        .as_deref()
        .or_else(|| cfg.restore_test.lab_bridge());
    lab_bridge_lock(cfg, r.guest, r.isolate_network && !r.dry_run, state.txn(), wanted)
        .map(|l| l.map(|(lock, _)| lock))
        .inspect_err(|e| {
            tracing::info!(txn = %state.txn(), vmid = ?r.vmid, reason = %e.message, "open isolated VM copy left alone: its lab bridge is in use");
        })
}

/// The lab bridge's lock for an isolated VM copy (`isolated_copy`: isolated, not a dry run)
/// and the bridge: `wanted`, or else the first of `[restore_test] lab_bridges` no other copy
/// holds; one VM copy per bridge at a time, since copies' NICs would reach each other. `None`
/// for anything else, and when no lab bridge is configured.
pub(crate) fn lab_bridge_lock(
    cfg: &Config,
    guest: GuestKind,
    isolated_copy: bool,
    txn: ulid::Ulid,
    wanted: Option<&str>,
) -> Result<Option<(crate::provision::LabBridgeLock, String)>, Failure> {
    if guest != GuestKind::Qemu || !isolated_copy {
        return Ok(None);
    }
    let candidates: Vec<&str> = match wanted {
        Some(b) => vec![b],
        None => cfg
            .restore_test
            .lab_bridges
            .iter()
            .map(String::as_str)
            .collect(),
    };
    let mut first_err = None;
    for bridge in candidates {
        match crate::provision::LabBridgeLock::try_acquire(&cfg.state_dir, bridge, Some(txn)) {
            Ok(lock) => return Ok(Some((lock, bridge.to_string()))),
            Err(e @ crate::provision::LockError::BridgeHeld { .. }) => {
                first_err.get_or_insert(e);
            }
            Err(e) => return Err(Failure::new(e.code(), e.to_string())),
        }
    }
    match first_err {
        Some(e) => Err(Failure::new(e.code(), e.to_string())),
        None => Ok(None),
    }
}
