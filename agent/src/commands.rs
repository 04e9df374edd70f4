//! The read commands (`guests`, `vmid-check`, `journal`) and the pieces every command shares:
//! the full guest list joined with the pool view, the vmid verdict, and settling the
//! transactions a crashed run left open.

use std::fs::DirBuilder;
use std::os::unix::fs::DirBuilderExt;

use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::app::CommandOutput;
use crate::config::Config;
use crate::error::{ErrorCode, ExitStatus, Failure};
use crate::inventory::{
    join, read_full_list, FullGuestList, GuestType, Membership, PoolView, ResourceRow,
    SystemListCommands,
};
use crate::provision::effects::{Executor, Reporter};
use crate::provision::{Journal, VmidLock};
use crate::pve::{GuestKind, PveClient};
use crate::vmid::{self, GuestLookup, Holder, VmidCheckReport, VmidVerdict};

/// Read the full guest list of this node's cluster.
pub fn full_list(cfg: &Config) -> Result<FullGuestList, Failure> {
    read_full_list(&cfg.vmlist_path, &cfg.node, &SystemListCommands::default())
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
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the pool view; the holder is reported as foreign");
            first
        }
    };
    Ok((refined, full))
}

/// `felhom-agent guests`.
pub async fn guests(cfg: &Config) -> CommandOutput {
    let pve = match PveClient::new(&cfg.pve) {
        Ok(p) => p,
        Err(e) => return CommandOutput::failure(&Failure::new(e.code(), e.to_string())),
    };
    let full = match full_list(cfg) {
        Ok(f) => f,
        Err(f) => return CommandOutput::failure(&f),
    };
    let pool = match pool_view(cfg, &pve).await {
        Ok(p) => p,
        Err(f) => return CommandOutput::failure(&f),
    };
    let report = join(&full, &pool).guests_report();
    let mut human = format!(
        "{:>10}  {:<5} {:<12} {:<8} NAME\n",
        "VMID", "TYPE", "NODE", "POOL"
    );
    for g in &report.guests {
        human.push_str(&format!(
            "{:>10}  {:<5} {:<12} {:<8} {}\n",
            g.vmid,
            g.kind.as_str(),
            g.node,
            if g.in_pool { "pool" } else { "foreign" },
            g.name.as_deref().unwrap_or(if g.in_pool {
                ""
            } else {
                "(not visible to the token)"
            }),
        ));
    }
    human.push_str(&format!("source: {}\n", report.source_description));
    CommandOutput {
        json: serde_json::to_value(&report).unwrap_or_else(|_| json!({})),
        human,
        status: ExitStatus::Ok,
    }
}

/// `felhom-agent vmid-check N`. Never writes anything.
pub async fn vmid_check(cfg: &Config, input: &str) -> CommandOutput {
    let pve = match PveClient::new(&cfg.pve) {
        Ok(p) => p,
        Err(e) => return CommandOutput::failure(&Failure::new(e.code(), e.to_string())),
    };
    let (verdict, full) = match verdict(cfg, &pve, input).await {
        Ok(v) => v,
        Err(f) => return CommandOutput::failure(&f),
    };
    let report = VmidCheckReport::from_verdict(&verdict).with_source(full.source());
    let status = if verdict.is_free() {
        ExitStatus::Ok
    } else {
        ExitStatus::Refused
    };
    let human = match report.code {
        None => format!("free: {}", report.message),
        Some(code) => format!("refused [{code}]: {}", report.message),
    };
    CommandOutput {
        json: serde_json::to_value(&report).unwrap_or_else(|_| json!({})),
        human,
        status,
    }
}

/// `felhom-agent journal`.
pub fn journal(cfg: &Config) -> CommandOutput {
    let journal = match open_journal(cfg) {
        Ok(j) => j,
        Err(f) => return CommandOutput::failure(&f),
    };
    let rows = match journal.list() {
        Ok(r) => r,
        Err(e) => return CommandOutput::failure(&Failure::new(e.code(), e.to_string())),
    };
    let mut human = format!(
        "{:<26}  {:<18} {:>10}  {:<12} {:<6} {:<9} {}\n",
        "TXN", "KIND", "VMID", "PHASE", "ARMED", "DESTROYED", "UPDATED"
    );
    for r in &rows {
        human.push_str(&format!(
            "{:<26}  {:<18} {:>10}  {:<12} {:<6} {:<9} {}\n",
            r.txn.to_string(),
            r.kind.as_str(),
            r.vmid.map(|v| v.to_string()).unwrap_or_else(|| "-".into()),
            r.phase.as_str(),
            if r.destroy_armed { "yes" } else { "no" },
            if r.destroyed { "yes" } else { "no" },
            r.updated_at,
        ));
        if let Some(e) = &r.error {
            human.push_str(&format!("{:<28}[{}] {}\n", "", e.code, e.message));
        }
    }
    if rows.is_empty() {
        human.push_str("(no transactions yet)\n");
    }
    CommandOutput {
        json: json!({"transactions": rows}),
        human,
        status: ExitStatus::Ok,
    }
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
    Journal::open(&cfg.state_dir).map_err(|e| Failure::new(e.code(), e.to_string()))
}

/// Settle every open transaction a crashed run left (DESIGN rule 6): finish an armed cleanup,
/// or mark it `needs_human`. Transactions whose vmid lock is held belong to a live process and
/// are left alone. Returns how many were settled.
pub async fn settle_open(
    cfg: &Config,
    pve: &PveClient,
    journal: &Journal,
    reporter: &dyn Reporter,
    cancel: &CancellationToken,
) -> Result<usize, Failure> {
    let open = journal
        .open_transactions()
        .map_err(|e| Failure::new(e.code(), e.to_string()))?;
    let mut settled = 0;
    for t in open {
        let Some(vmid) = t.state.vmid() else { continue };
        let _lock = match VmidLock::try_acquire(&cfg.state_dir, vmid, Some(t.state.txn())) {
            Ok(l) => l,
            Err(e) => {
                tracing::info!(txn = %t.state.txn(), vmid, reason = %e, "open transaction belongs to a running agent; left alone");
                continue;
            }
        };
        // Re-read under the lock: the other process may have settled it meanwhile.
        let state = match journal.get(t.state.txn()) {
            Ok(Some(fresh)) if !fresh.state.is_terminal() => fresh.state,
            _ => continue,
        };
        tracing::warn!(txn = %state.txn(), vmid, phase = state.phase().as_str(), "settling a transaction a previous run left open");
        let mut exec = Executor::new(cfg, pve, journal, reporter, cancel.clone());
        let driven = exec.settle(state).await;
        if let Some(h) = driven.halted {
            return Err(h);
        }
        if let Some(o) = driven.state.outcome() {
            tracing::warn!(txn = %o.txn, vmid, outcome = o.outcome.as_str(), phase = o.phase.as_str(), destroyed = o.destroyed, "settled");
        }
        settled += 1;
    }
    Ok(settled)
}
