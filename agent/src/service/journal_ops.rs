//! The operator's journal verbs for a node that runs for years: `journal resolve` closes a
//! `needs_human` transaction a person has handled, `journal refresh` compares what the journal
//! believes about its guests with PVE now, `journal cancel` settles one transaction a dead
//! process left open. None of them writes to PVE except `cancel`, and that only through the
//! same gate every writing command uses first ([`super::settle_one`]). Each writes a
//! transaction's journal only under its vmid's lock.

use serde::Serialize;
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use super::{full_list, open_journal, pve_client, settle_one, Driven, SettleOne, TakeUp};
use crate::config::Config;
use crate::error::{ErrorCode, Failure};
use crate::inventory::GuestType;
use crate::provision::effects::Reporter;
use crate::provision::machine::{Finding, GuestView, OutcomeKind, ResolvedBy, State};
use crate::provision::{Journal, VmidLock};
use crate::pve::{ApiErrorKind, GuestKind, PveClient};
use crate::timefmt::now_rfc3339;

/// The folder of the closures the hub has not been told of yet: `<state_dir>/unreported/<txn>`,
/// written (synced) before a closure is journaled and removed once its event is spooled, so a
/// kill between the journal and the spool is reported by the daemon's next start.
pub const UNREPORTED_DIR: &str = "unreported";

/// Note that transaction `txn`'s next record must reach the hub (only with a hub configured).
fn note_unreported(cfg: &Config, txn: Ulid) -> Result<(), Failure> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if cfg.hub.is_none() {
        return Ok(());
    }
    let dir = cfg.state_dir.join(UNREPORTED_DIR);
    let path = dir.join(txn.to_string());
    let fail = |p: &std::path::Path, e: std::io::Error| {
        Failure::new(
            ErrorCode::ConfigInvalid,
            format!(
                "cannot write {}: {e}; nothing was journaled. Check the state dir's disk and \
                 permissions, then run the command again",
                p.display()
            ),
        )
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|e| fail(&dir, e))?;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .and_then(|f| f.sync_all())
        .map_err(|e| fail(&path, e))?;
    std::fs::File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| fail(&dir, e))
}

/// The transactions whose closure may not have reached the hub yet.
pub fn unreported(cfg: &Config) -> Vec<Ulid> {
    let Ok(entries) = std::fs::read_dir(cfg.state_dir.join(UNREPORTED_DIR)) else {
        return Vec::new();
    };
    let mut out: Vec<Ulid> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| Ulid::from_string(e.file_name().to_str()?).ok())
        .collect();
    out.sort();
    out
}

/// Transaction `txn`'s closure is spooled for the hub (or was never journaled).
pub fn reported(cfg: &Config, txn: Ulid) {
    let path = cfg.state_dir.join(UNREPORTED_DIR).join(txn.to_string());
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove {}; the closure will be reported again (the hub applies it once)", path.display());
        }
    }
}

/// A closed `needs_human` as it is journaled and reported: its state, and the number of its
/// journal record (1-based: the event's identity).
pub fn closure_record(cfg: &Config, txn: Ulid) -> Result<Option<(State, u64)>, Failure> {
    let journal = open_journal(cfg)?;
    Ok(journal
        .get_any(txn)
        .map_err(journal_failure)?
        .filter(|t| t.state.resolution().is_some())
        .map(|t| (t.state, t.records)))
}

fn journal_failure(e: crate::provision::JournalError) -> Failure {
    Failure::new(e.code(), e.to_string())
}

/// The journaled state of the transaction the operator named.
fn named(journal: &Journal, input: &str) -> Result<State, Failure> {
    let txn = Ulid::from_string(input.trim()).map_err(|_| {
        Failure::new(
            ErrorCode::TxnUnknown,
            format!(
                "{input:?} is not a transaction id (a 26-character ULID); list them with \
                 `felhom-agent journal`"
            ),
        )
    })?;
    journal
        .get_any(txn)
        .map_err(journal_failure)?
        .map(|t| t.state)
        .ok_or_else(|| {
            Failure::new(
                ErrorCode::TxnUnknown,
                format!(
                    "the journal in {} has no transaction {txn}; list them with `felhom-agent \
                     journal`",
                    journal.dir().display()
                ),
            )
        })
}

fn describe_outcome(state: &State) -> String {
    match (state.outcome_kind(), state.resolution()) {
        (None, _) => "still open".to_string(),
        (Some(OutcomeKind::NeedsHuman), Some(r)) => {
            format!("needs_human, already closed at {} ({})", r.at, r.reason)
        }
        (Some(o), _) => format!("settled {o}"),
    }
}

fn not_needs_human(state: &State) -> Failure {
    Failure::new(
        ErrorCode::NotNeedsHuman,
        format!(
            "transaction {} (vmid {}) is {}, not awaiting a human; nothing was written. `journal \
             resolve` closes only a needs_human transaction (an open one is settled with `journal \
             cancel` or by the next writing command)",
            state.txn(),
            state.vmid().map_or("-".to_string(), |v| v.to_string()),
            describe_outcome(state)
        ),
    )
}

/// `journal resolve TXN --reason TEXT`: close a `needs_human` transaction a person has handled.
/// Journals the reason (clipped) and the time under the vmid's lock; never touches PVE.
pub fn resolve(cfg: &Config, input: &str, reason: &str) -> Result<State, Failure> {
    let journal = open_journal(cfg)?;
    let state = named(&journal, input)?;
    if !state.awaits_human() {
        return Err(not_needs_human(&state));
    }
    let _lock = match state.vmid() {
        Some(vmid) => Some(
            VmidLock::try_acquire(&cfg.state_dir, vmid, Some(state.txn()))
                .map_err(|e| Failure::new(e.code(), e.to_string()))?,
        ),
        None => None,
    };
    // Re-read under the lock: another process may have closed it meanwhile.
    let state = named(&journal, input)?;
    let closed = state
        .resolved(ResolvedBy::Operator, reason, now_rfc3339())
        .ok_or_else(|| not_needs_human(&state))?;
    note_unreported(cfg, closed.txn())?;
    journal.append(&closed).map_err(journal_failure)?;
    #[cfg(feature = "test-hooks")]
    crate::provision::effects::kill_point("after-resolve-journal");
    tracing::info!(txn = %closed.txn(), vmid = ?closed.vmid(), "needs_human transaction closed by hand");
    // felhom_needs_human drops at once (its alert clears).
    super::refresh_metrics(cfg, &journal);
    Ok(closed)
}

/// One transaction a refresh looked at.
#[derive(Debug, Clone, Serialize)]
pub struct RefreshRow {
    /// The transaction.
    pub txn: Ulid,
    /// Its vmid.
    pub vmid: u32,
    /// `open`, `needs_human` or `kept` (an armed claim).
    pub concern: &'static str,
    /// What PVE shows at the vmid; `None` when it could not be read or the lock was held.
    pub finding: Option<Finding>,
    /// What the refresh journaled for it (a withdrawn claim, a closed `needs_human`).
    pub change: Option<String>,
    /// Why it was left alone (lock held, PVE unreadable); nothing was written then.
    pub skipped: Option<String>,
    /// Whether the skip was an error (PVE or the guest list unreadable), not a busy lock.
    #[serde(skip)]
    pub error: bool,
    /// The journaled state after the refresh.
    #[serde(skip)]
    pub state: State,
}

/// What `journal refresh` did.
#[derive(Debug, Clone, Serialize)]
pub struct RefreshReport {
    /// When it looked (UTC, RFC 3339).
    pub at: String,
    /// Every transaction it looked at.
    pub rows: Vec<RefreshRow>,
}

impl RefreshReport {
    /// Rows it changed.
    pub fn changed(&self) -> impl Iterator<Item = &RefreshRow> {
        self.rows.iter().filter(|r| r.change.is_some())
    }
    /// Whether some guest could not be read (a PVE or guest-list error).
    pub fn had_errors(&self) -> bool {
        self.rows.iter().any(|r| r.error)
    }
}

/// Why a transaction may still own or concern a guest, if it may.
fn concern(state: &State) -> Option<&'static str> {
    if !state.is_terminal() {
        Some("open")
    } else if state.awaits_human() {
        Some("needs_human")
    } else if state.holds_claim() {
        Some("kept")
    } else {
        None
    }
}

/// The guest at `vmid`: presence from the full guest list, marker and identity from the config
/// through the pool token. `Err` for a read that says nothing about the guest (nothing is
/// decided on it).
async fn observe(
    cfg: &Config,
    pve: &PveClient,
    vmid: u32,
    guest: GuestKind,
) -> Result<GuestView, String> {
    let list = full_list(cfg).map_err(|f| f.message)?;
    let Some(entry) = list.lookup(vmid) else {
        return Ok(GuestView::Absent);
    };
    let kind = match entry.kind {
        GuestType::Qemu => GuestKind::Qemu,
        GuestType::Lxc => GuestKind::Lxc,
        _ => guest,
    };
    match pve.config_get(&entry.node, kind, vmid).await {
        Ok(config) => Ok(GuestView::from_config(&config)),
        // PVE's answer about this guest: outside the pool token's reach (403), or refused
        // (its config does not exist). Anything else (the token refused, PVE unreachable, no
        // quorum, a TLS failure, an answer that does not decode) says nothing about the guest.
        Err(e)
            if !e.is_transient()
                && e.api().is_some_and(|a| {
                    matches!(a.kind, ApiErrorKind::Permission | ApiErrorKind::Refusal)
                }) =>
        {
            Ok(GuestView::Unreadable {
                reason: e.to_string(),
            })
        }
        Err(e) => Err(e.to_string()),
    }
}

fn change_text(before: &State, after: &State) -> String {
    let mut parts = Vec::new();
    if before.disarmed().is_none() {
        if let Some(why) = after.disarmed() {
            parts.push(format!("destroy disarmed: {why}"));
        }
    }
    if before.resolution().is_none() {
        if let Some(r) = after.resolution() {
            parts.push(format!("needs_human closed: {}", r.reason));
        }
    }
    parts.join("; ")
}

/// `journal refresh`: for every transaction that may still own or concern a guest (open,
/// `needs_human`, kept and armed), read the guest at its vmid again and journal what changes:
/// a kept guest gone or without its proof is disarmed, a `needs_human` whose guest is gone is
/// closed. Never writes to PVE; a read that may pass changes nothing; a held lock is skipped.
pub async fn refresh(cfg: &Config) -> Result<RefreshReport, Failure> {
    let pve = pve_client(cfg)?;
    let journal = open_journal(cfg)?;
    // The guest list must be readable at all before anything is judged on it.
    full_list(cfg)?;
    let at = now_rfc3339();
    let mut rows = Vec::new();
    for t in journal.replay().map_err(journal_failure)? {
        let (Some(vmid), Some(_)) = (t.state.vmid(), concern(&t.state)) else {
            continue;
        };
        let mut row = RefreshRow {
            txn: t.state.txn(),
            vmid,
            concern: concern(&t.state).unwrap_or("open"),
            finding: None,
            change: None,
            skipped: None,
            error: false,
            state: t.state.clone(),
        };
        let _lock = match VmidLock::try_acquire(&cfg.state_dir, vmid, Some(t.state.txn())) {
            Ok(l) => l,
            Err(e) => {
                row.skipped = Some(format!("left alone: {e}"));
                rows.push(row);
                continue;
            }
        };
        // Re-read under the lock: a writer may have moved it on meanwhile.
        let state = match journal.get(t.state.txn()).map_err(journal_failure)? {
            Some(fresh) if concern(&fresh.state).is_some() => fresh.state,
            _ => continue,
        };
        row.concern = concern(&state).unwrap_or("open");
        row.state = state.clone();
        let view = match observe(cfg, &pve, vmid, state.request().guest).await {
            Ok(v) => v,
            Err(reason) => {
                row.skipped = Some(format!(
                    "guest {vmid} on node {} could not be read ({reason}); nothing was changed, \
                     run `felhom-agent journal refresh` again later",
                    cfg.node
                ));
                row.error = true;
                rows.push(row);
                continue;
            }
        };
        row.finding = Some(state.finding(&view));
        if let Some(next) = state.refreshed(&view, at.clone()) {
            if state.resolution().is_none() && next.resolution().is_some() {
                note_unreported(cfg, next.txn())?;
            }
            journal.append(&next).map_err(journal_failure)?;
            row.change = Some(change_text(&state, &next));
            tracing::warn!(txn = %next.txn(), vmid, change = row.change.as_deref().unwrap_or(""), "journal refresh");
            row.state = next;
        }
        rows.push(row);
    }
    super::compact(cfg, &journal);
    super::refresh_metrics(cfg, &journal);
    Ok(RefreshReport { at, rows })
}

/// `journal cancel TXN`: end one open transaction whose process is gone without resuming it
/// (its vmid's lock, the recorded task followed and the guest observed, an armed cleanup only
/// through a fresh ownership re-check; `failed` or `needs_human`). Refused while its lock is
/// held or when it is not open.
pub async fn cancel(
    cfg: &Config,
    input: &str,
    reporter: &dyn Reporter,
    token: CancellationToken,
) -> Result<Driven, Failure> {
    take_up(cfg, input, reporter, token, TakeUp::Settle).await
}

/// `journal resume TXN`: resume one open transaction whose process is gone from its last
/// journaled step, exactly as the next writing command would, and drive it to its end (where
/// it cannot be resumed it is settled through the gate). Refused while its lock is held or
/// when it is not open.
pub async fn resume(
    cfg: &Config,
    input: &str,
    reporter: &dyn Reporter,
    token: CancellationToken,
) -> Result<Driven, Failure> {
    take_up(cfg, input, reporter, token, TakeUp::Resume).await
}

async fn take_up(
    cfg: &Config,
    input: &str,
    reporter: &dyn Reporter,
    token: CancellationToken,
    how: TakeUp,
) -> Result<Driven, Failure> {
    let verb = match how {
        TakeUp::Resume => "resume",
        TakeUp::Settle => "cancel",
    };
    let journal = open_journal(cfg)?;
    let state = named(&journal, input)?;
    let not_open = |s: &State| {
        Failure::new(
            ErrorCode::TxnNotOpen,
            format!(
                "transaction {} (vmid {}) is {}; `journal {verb}` takes up only an open \
                 transaction. Nothing was done",
                s.txn(),
                s.vmid().map_or("-".to_string(), |v| v.to_string()),
                describe_outcome(s)
            ),
        )
    };
    if state.is_terminal() {
        return Err(not_open(&state));
    }
    let Some(vmid) = state.vmid() else {
        return Err(Failure::new(
            ErrorCode::TxnNotOpen,
            format!(
                "open transaction {} has no vmid, so there is no guest to settle it against; \
                 nothing was done (move its file {} aside once you have checked the node)",
                state.txn(),
                journal.path_of(state.txn()).display()
            ),
        ));
    };
    let pve = pve_client(cfg)?;
    match settle_one(cfg, &pve, &journal, reporter, &token, &state, how).await {
        SettleOne::Settled(driven) => Ok(*driven),
        SettleOne::Held(reason) => Err(Failure::new(
            ErrorCode::VmidInUse,
            format!(
                "transaction {} on vmid {vmid} is still running in another process ({reason}); \
                 nothing was done. Wait for it, or stop that process first",
                state.txn()
            ),
        )),
        SettleOne::BridgeBusy(reason) => Err(Failure::new(
            ErrorCode::VmidInUse,
            format!(
                "transaction {} on vmid {vmid} was not resumed: {reason}",
                state.txn()
            ),
        )),
        SettleOne::NotOpen => {
            let now = named(&journal, input)?;
            Err(not_open(&now))
        }
    }
}
