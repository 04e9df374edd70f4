//! `--selftest=provision` and the gated `destroy -vmid N`: one transaction each, driven by the
//! provision executor, with the final JSON of DESIGN section 3.
//!
//! Before anything is written, the transactions a crashed run left open are settled. The vmid
//! is validated against the FULL guest list and its lock is held for the whole transaction, so
//! a second agent process on the same vmid is refused cleanly.

use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use crate::app::CommandOutput;
use crate::cli::SelftestOpts;
use crate::commands::{open_journal, settle_open, verdict};
use crate::config::Config;
use crate::error::{ErrorCode, ExitStatus, Failure};
use crate::guest::checks::CheckResult;
use crate::preflight;
use crate::provision::effects::{Driven, Executor, Reporter};
use crate::provision::machine::{Event, Request, State, TxnKind};
use crate::provision::VmidLock;
use crate::pve::types::backup_kind_from_volid;
use crate::pve::{GuestKind, PveClient};
use crate::vmid::{self, VmidVerdict};

/// The final JSON of a transaction: DESIGN section 3's fields, plus `plan` for a dry run.
pub fn result_json(state: &State, checks: &[CheckResult], plan: Option<&Value>) -> Value {
    let outcome = state.outcome();
    let mut v = json!({
        "txn": state.txn().to_string(),
        "kind": state.kind().as_str(),
        "vmid": state.vmid(),
        "outcome": outcome.as_ref().map(|o| o.outcome.as_str()),
        "phase": state.phase().as_str(),
        "reached": state.reached().as_str(),
        "destroy_armed": state.destroy_armed(),
        "destroyed": state.destroyed(),
        "upid": state.upid(),
        "checks": checks,
        "error": state.failure(),
    });
    if let (Some(p), Some(obj)) = (plan, v.as_object_mut()) {
        obj.insert("plan".to_string(), p.clone());
    }
    v
}

fn human(state: &State, checks: &[CheckResult], plan: Option<&Value>) -> String {
    let mut s = String::new();
    if let Some(Value::Array(steps)) = plan {
        s.push_str(&format!(
            "dry run of transaction {} (nothing was written):\n",
            state.txn()
        ));
        for (i, step) in steps.iter().enumerate() {
            s.push_str(&format!("  {}. {}\n", i + 1, step));
        }
    }
    for c in checks {
        s.push_str(&format!(
            "check {:<28} {:?}{}\n",
            c.name,
            c.status,
            c.message
                .as_deref()
                .map(|m| format!(": {m}"))
                .unwrap_or_default()
        ));
    }
    let outcome = state.outcome();
    s.push_str(&format!(
        "transaction {} ({}) vmid {}: {} in phase {}; destroy armed: {}, destroyed: {}\n",
        state.txn(),
        state.kind(),
        state
            .vmid()
            .map(|v| v.to_string())
            .unwrap_or_else(|| "-".into()),
        outcome
            .as_ref()
            .map(|o| o.outcome.as_str())
            .unwrap_or("open"),
        state.phase(),
        state.destroy_armed(),
        state.destroyed(),
    ));
    if let Some(f) = state.failure() {
        s.push_str(&format!("error [{}]: {}\n", f.code, f.message));
    }
    s
}

fn output_of(driven: &Driven) -> CommandOutput {
    let plan = driven
        .plan
        .as_ref()
        .map(|p| serde_json::to_value(p).unwrap_or(Value::Null));
    let mut json = result_json(&driven.state, &driven.checks, plan.as_ref());
    let mut text = human(&driven.state, &driven.checks, plan.as_ref());
    let status = match (&driven.halted, driven.state.outcome()) {
        (Some(h), _) => {
            if let Some(obj) = json.as_object_mut() {
                obj.insert(
                    "halted".into(),
                    json!({"code": h.code.as_str(), "message": h.message}),
                );
            }
            text.push_str(&format!("halted [{}]: {}\n", h.code, h.message));
            h.code.exit_status().max_with(ExitStatus::NeedsHuman)
        }
        (None, Some(o)) => o.exit_status(),
        (None, None) => ExitStatus::NeedsHuman,
    };
    CommandOutput {
        json,
        human: text,
        status,
    }
}

trait MaxWith {
    fn max_with(self, other: ExitStatus) -> ExitStatus;
}

impl MaxWith for ExitStatus {
    /// A halted transaction is open: never report it as done.
    fn max_with(self, other: ExitStatus) -> ExitStatus {
        if self == ExitStatus::Ok {
            other
        } else {
            self
        }
    }
}

/// The shared start of a writing command: PVE client, journal, open transactions settled.
pub struct Prepared {
    /// The PVE client.
    pub pve: PveClient,
    /// The journal.
    pub journal: crate::provision::Journal,
}

/// Open the client and the journal, and settle what a crashed run left open.
pub async fn prepare(
    cfg: &Config,
    reporter: &dyn Reporter,
    cancel: &CancellationToken,
) -> Result<Prepared, Failure> {
    let pve = PveClient::new(&cfg.pve).map_err(|e| Failure::new(e.code(), e.to_string()))?;
    let journal = open_journal(cfg)?;
    settle_open(cfg, &pve, &journal, reporter, cancel).await?;
    Ok(Prepared { pve, journal })
}

/// `--selftest=provision -vmid N`.
pub async fn provision(
    cfg: &Config,
    opts: &SelftestOpts,
    reporter: &dyn Reporter,
    cancel: CancellationToken,
) -> CommandOutput {
    provision_txn(
        cfg,
        opts,
        TxnKind::SelftestProvision,
        Ulid::new(),
        None,
        reporter,
        cancel,
    )
    .await
}

/// A provision transaction (selftest or hub dispatch) with a given transaction id.
pub async fn provision_txn(
    cfg: &Config,
    opts: &SelftestOpts,
    kind: TxnKind,
    txn: Ulid,
    profile: Option<String>,
    reporter: &dyn Reporter,
    cancel: CancellationToken,
) -> CommandOutput {
    let Some(input) = opts.vmid.as_deref() else {
        return CommandOutput::failure(&Failure::new(
            ErrorCode::VmidInvalid,
            "--selftest=provision needs -vmid N: the agent never picks a vmid; choose a free one with `felhom-agent guests` / `felhom-agent vmid-check N`",
        ));
    };
    let volid = match opts.from.clone().or_else(|| cfg.provision.selftest_source.clone()) {
        Some(v) => v,
        None => {
            return CommandOutput::failure(&Failure::new(
                ErrorCode::ConfigInvalid,
                format!("no backup to restore from: pass --from VOLID or set provision.selftest_source in {}", cfg.path.display()),
            ))
        }
    };
    let Some(guest) = backup_kind_from_volid(&volid) else {
        return CommandOutput::failure(&Failure::new(
            ErrorCode::BackupMissing, // preflight: not a backup this agent can restore
            format!("cannot tell from {volid:?} whether it is a container or a VM backup (expected vzdump-lxc-… or vzdump-qemu-…)"),
        ));
    };
    let storage = opts
        .storage
        .clone()
        .unwrap_or_else(|| cfg.provision.storage.clone());

    // A vmid that is not even a vmid is refused before anything is opened.
    if let Err(e) = vmid::parse_vmid(input) {
        return CommandOutput::failure(&Failure::from(e));
    }
    let prepared = if opts.dry_run {
        match PveClient::new(&cfg.pve) {
            Ok(pve) => match open_journal(cfg) {
                Ok(journal) => Prepared { pve, journal },
                Err(f) => return CommandOutput::failure(&f),
            },
            Err(e) => return CommandOutput::failure(&Failure::new(e.code(), e.to_string())),
        }
    } else {
        match prepare(cfg, reporter, &cancel).await {
            Ok(p) => p,
            Err(f) => return CommandOutput::failure(&f),
        }
    };
    let vmid_num = match vmid::parse_vmid(input) {
        Ok(v) => v,
        Err(e) => return CommandOutput::failure(&Failure::from(e)),
    };
    let _lock = if opts.dry_run {
        None
    } else {
        match VmidLock::try_acquire(&cfg.state_dir, vmid_num, Some(txn)) {
            Ok(l) => Some(l),
            Err(e) => return CommandOutput::failure(&Failure::new(e.code(), e.to_string())),
        }
    };
    let request = Request {
        txn,
        kind,
        vmid: Some(vmid_num),
        guest,
        volid,
        storage,
        pool: cfg.pool.clone(),
        isolate_network: kind == TxnKind::SelftestRestore,
        keep: opts.keep,
        dry_run: opts.dry_run,
        profile,
    };
    let first = match verdict(cfg, &prepared.pve, input).await {
        Ok((VmidVerdict::Free { .. }, _)) => Event::VmidAccepted,
        Ok((v, _)) => Event::VmidRefused(Failure::new(
            v.code().unwrap_or(ErrorCode::VmidInUse),
            v.message(),
        )),
        Err(f) => return CommandOutput::failure(&f),
    };
    // --- preflight (DESIGN §2 rule 9): before the first journal intent; reads only ---------
    let (report, first) = preflight::gate(cfg, &prepared.pve, &request, first).await;
    // --- end preflight ---------------------------------------------------------------------
    let mut exec = Executor::new(cfg, &prepared.pve, &prepared.journal, reporter, cancel);
    let driven = exec.drive(State::new(request), first).await;
    preflight::with_report(output_of(&driven), &report)
}

/// `destroy -vmid N`: the gated destroy of a guest an earlier transaction of this agent
/// created. Without that proof nothing is sent and the command exits 7.
pub async fn destroy(
    cfg: &Config,
    input: &str,
    reporter: &dyn Reporter,
    cancel: CancellationToken,
) -> CommandOutput {
    destroy_txn(cfg, input, Ulid::new(), reporter, cancel).await
}

/// A gated destroy under a given transaction id (a hub dispatch's).
pub async fn destroy_txn(
    cfg: &Config,
    input: &str,
    txn: Ulid,
    reporter: &dyn Reporter,
    cancel: CancellationToken,
) -> CommandOutput {
    let vmid_num = match vmid::parse_vmid(input) {
        Ok(v) => v,
        Err(e) => return CommandOutput::failure(&Failure::from(e)),
    };
    let prepared = match prepare(cfg, reporter, &cancel).await {
        Ok(p) => p,
        Err(f) => return CommandOutput::failure(&f),
    };
    let _lock = match VmidLock::try_acquire(&cfg.state_dir, vmid_num, Some(txn)) {
        Ok(l) => l,
        Err(e) => return CommandOutput::failure(&Failure::new(e.code(), e.to_string())),
    };
    let origin = match prepared.journal.last_owner_record(vmid_num) {
        Ok(o) => o,
        Err(e) => return CommandOutput::failure(&Failure::new(e.code(), e.to_string())),
    };
    let (state, effects) = State::for_destroy(
        txn,
        vmid_num,
        GuestKind::Lxc,
        origin.as_ref().map(|t| &t.state),
    );
    if effects.is_empty() {
        // Refused without proof: nothing was sent; the hub learns of the refusal all the same.
        crate::provision::effects::report_final(reporter, &state, &[]);
        return output_of(&Driven {
            state,
            checks: vec![],
            plan: None,
            halted: None,
        });
    }
    let mut exec = Executor::new(cfg, &prepared.pve, &prepared.journal, reporter, cancel);
    let driven = exec.drive_effects(state, effects).await;
    output_of(&driven)
}
