//! The provision executor behind the hub's [`DispatchRunner`] seam, and the reporters that
//! carry transaction phases and results to the hub (phases synced into the outbox before the
//! journal record counts as done).
//!
//! A dispatch runs exactly the transaction the command line runs (`--selftest=provision`,
//! `destroy`, `--selftest=restore`), under the dispatch's own transaction id, so a re-dispatch
//! of a known id finds it in the journal: a finished one answers with its result, an open one
//! (the agent was stopped) is resumed from its journal and never started over.

use std::path::PathBuf;
use std::sync::Arc;

use hub_protocol::{capability, AgentMessage, Dispatch, DispatchAction, Event, TxnId, TxnResult};
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use super::dispatch::{DispatchRunner, EventSink, RunEnd};
use super::outbox::{event_message_id, now_timestamp, spool, spool_as, Outbox};
use crate::config::Config;
use crate::error::{exit_status, ExitStatus, Failure};
use crate::guest::checks::CheckResult;
use crate::provision::effects::Reporter;
use crate::provision::machine::{Phase, State, TxnKind};
use crate::service::{self, error_info, wire_result, Driven, ProvisionRequest};

/// The wire result of a dispatch that ended before a transaction existed (a refusal of the
/// dispatch itself, e.g. an invalid vmid or a config error).
fn early_result(txn: TxnId, kind: TxnKind, vmid: Option<u32>, failure: &Failure) -> TxnResult {
    let outcome = if exit_status(failure.code) == ExitStatus::Refused {
        hub_protocol::Outcome::Refused
    } else {
        hub_protocol::Outcome::Failed
    };
    TxnResult {
        txn,
        kind,
        vmid,
        outcome,
        phase: Phase::Planned,
        destroy_armed: false,
        destroyed: false,
        checks: vec![],
        isolation: None,
        error: Some(error_info(failure)),
        guest: None,
        backup: None,
        group: None,
    }
}

/// The result of a restore-test dispatch whose run started no copy under the dispatch's id:
/// nothing was due (`left` = 0), or every due guest was left for a later run (the band, the
/// memory, the budget), which is no failure.
fn nothing_started_result(txn: TxnId, kind: TxnKind, left: usize) -> TxnResult {
    TxnResult {
        txn,
        kind,
        vmid: None,
        outcome: hub_protocol::Outcome::Skipped,
        phase: Phase::Skipped,
        destroy_armed: false,
        destroyed: false,
        checks: vec![],
        isolation: None,
        error: (left > 0).then(|| hub_protocol::ErrorInfo {
            code: crate::error::ErrorCode::BandFull,
            message: format!("{left} due guest(s) left for a later run; `felhom-agent restore-report` on the node shows which"),
        }),
        guest: None,
        backup: None,
        group: None,
    }
}

/// The event of transaction `state` at its phase, journaled `at`. A restore-test copy's names
/// the guest and the backup it proves.
pub(crate) fn state_event(
    state: &State,
    at: hub_protocol::Timestamp,
    detail: Option<String>,
    error: Option<hub_protocol::ErrorInfo>,
) -> Event {
    let (guest, backup) = service::restore_test_subject(state);
    Event {
        txn: TxnId::from_ulid(state.txn()),
        kind: state.kind(),
        vmid: state.vmid(),
        phase: state.phase(),
        at,
        detail,
        error,
        guest,
        backup,
    }
}

/// The event telling the hub that transaction `state` stopped on an interrupt at its
/// `record`-th journal record, still open (the resume reports its result later), and its id:
/// derived from the transaction and that record, so a second stop of the same transaction
/// (after a resume went on) is a new event and the same stop reported twice is applied once.
/// `None` when no timestamp can be written.
pub fn interrupted_event(
    state: &State,
    record: u64,
    why: &Failure,
) -> Option<(hub_protocol::MessageId, Event)> {
    let event = state_event(
        state,
        now_timestamp().ok()?,
        Some(format!(
            "interrupted at step {}; open: `felhom-agent journal resume {}` or the next agent command settles it",
            state.step(),
            state.txn()
        )),
        Some(error_info(why)),
    );
    Some((
        super::outbox::derived_message_id(event.txn, &format!("interrupted {record}")),
        event,
    ))
}

/// Reports a transaction's phases to the daemon's outbox, each event synced before
/// [`Reporter::phase`] returns, so a journal record counts as done only once its event is
/// stored: a kill right after a phase cannot lose it. The event's id is derived from the
/// transaction and the journal record ([`event_message_id`]), so the same record reported
/// again after a crash is applied once by the hub. A dispatch's own result is stored by the
/// dispatcher; the result of every other transaction it settles (the other copies of a
/// restore-test run) is stored here as it settles; a transaction settled at start
/// (`spool_results`) spools it.
pub struct OutboxReporter {
    outbox: Outbox,
    results: ResultsTo,
}

/// Where an [`OutboxReporter`] puts results.
enum ResultsTo {
    /// The outbox, except the result of this transaction (the dispatcher stores that one).
    OutboxBut(Ulid),
    /// The spool of this state dir.
    Spool(PathBuf),
}

impl OutboxReporter {
    /// Phases to `outbox`, for the dispatch of transaction `own`: its result is left to the
    /// dispatcher, every other transaction's result goes to `outbox` (synced before
    /// [`Reporter::result`] returns).
    pub fn for_dispatch(outbox: Outbox, own: Ulid) -> Self {
        Self {
            outbox,
            results: ResultsTo::OutboxBut(own),
        }
    }

    /// Phases to `outbox`; results spooled into `state_dir` (for transactions no dispatch
    /// runs, e.g. those settled at start).
    pub fn spooling_results(outbox: Outbox, state_dir: PathBuf) -> Self {
        Self {
            outbox,
            results: ResultsTo::Spool(state_dir),
        }
    }
}

impl Reporter for OutboxReporter {
    fn phase(&self, state: &State, record: u64) {
        let txn = TxnId::from_ulid(state.txn());
        let at = match now_timestamp() {
            Ok(at) => at,
            Err(e) => {
                tracing::error!(%txn, error = %e, "a phase event could not be stored for the hub");
                return;
            }
        };
        let event = state_event(
            state,
            at,
            Some(format!("step {}", state.step())).filter(|_| !state.is_terminal()),
            state.failure().map(error_info),
        );
        if let Err(e) = self
            .outbox
            .push_event_blocking(event_message_id(txn, record), event)
        {
            tracing::error!(%txn, record, error = %e, "a phase event could not be stored for the hub; the journal holds the phase");
        }
    }
    fn result(
        &self,
        state: &State,
        checks: &[CheckResult],
        isolation: Option<&str>,
    ) -> Result<(), String> {
        match &self.results {
            ResultsTo::Spool(dir) => {
                SpoolReporter::new(dir.clone()).result(state, checks, isolation)
            }
            ResultsTo::OutboxBut(own) if state.txn() == *own => Ok(()),
            ResultsTo::OutboxBut(_) => {
                let result = wire_result(state, checks, isolation)
                    .ok_or_else(|| format!("transaction {} is still open", state.txn()))?;
                self.outbox
                    .push_blocking(AgentMessage::Result(result))
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
        }
    }
    fn interrupted(&self, state: &State, record: u64, why: &Failure) {
        let Some((id, event)) = interrupted_event(state, record, why) else {
            return;
        };
        if let Err(e) = self.outbox.push_event_blocking(id, event) {
            tracing::error!(txn = %state.txn(), error = %e, "the interruption could not be stored for the hub; the journal holds it");
        }
    }
}

/// Reports a command-line transaction's result to the hub by spooling it in the state dir;
/// the daemon moves it into its outbox (at once when it runs, else at its next start).
pub struct SpoolReporter {
    state_dir: PathBuf,
}

impl SpoolReporter {
    /// A reporter spooling into `state_dir`.
    pub fn new(state_dir: PathBuf) -> Self {
        Self { state_dir }
    }
}

impl Reporter for SpoolReporter {
    fn phase(&self, _state: &State, _record: u64) {}
    fn result(
        &self,
        state: &State,
        checks: &[CheckResult],
        isolation: Option<&str>,
    ) -> Result<(), String> {
        // A dry run writes nothing, the outbox included: it is no transaction the hub tracks.
        if state.request().dry_run {
            return Ok(());
        }
        let result = wire_result(state, checks, isolation)
            .ok_or_else(|| format!("transaction {} is still open", state.txn()))?;
        spool(&self.state_dir, AgentMessage::Result(result))
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
    fn interrupted(&self, state: &State, record: u64, why: &Failure) {
        let Some((id, event)) = interrupted_event(state, record, why) else {
            return;
        };
        if let Err(e) = spool_as(&self.state_dir, id, AgentMessage::Event(event)) {
            tracing::error!(txn = %state.txn(), error = %e, "the interruption could not be spooled for the hub; the journal holds it");
        }
    }
}

/// The provision executor as the hub's dispatch runner.
pub struct ProvisionRunner {
    cfg: Arc<Config>,
}

impl ProvisionRunner {
    /// A runner for this node.
    pub fn new(cfg: Arc<Config>) -> Self {
        Self { cfg }
    }
}

impl DispatchRunner for ProvisionRunner {
    fn capabilities(&self) -> Vec<&'static str> {
        vec![
            capability::PROVISION,
            capability::DESTROY,
            capability::RESTORE_TEST,
        ]
    }

    async fn prepare(&self, outbox: &Outbox, cancel: CancellationToken) -> Result<(), Failure> {
        // Leftovers are taken up by their own task after READY (`take_up_leftovers`), never
        // before a dispatch's own work.
        service::take_up_leftovers_in_background();
        let reporter = OutboxReporter::spooling_results(outbox.clone(), self.cfg.state_dir.clone());
        service::prepare(&self.cfg, &reporter, &cancel)
            .await
            .map(|_| ())
    }

    async fn take_up_leftovers(
        &self,
        outbox: &Outbox,
        dispatched: Vec<TxnId>,
        cancel: CancellationToken,
    ) {
        let reporter = OutboxReporter::spooling_results(outbox.clone(), self.cfg.state_dir.clone());
        let taken = service::take_up_leftovers(
            &self.cfg,
            &reporter,
            &cancel,
            &dispatched.iter().map(|t| t.ulid()).collect::<Vec<_>>(),
        )
        .await;
        match taken {
            Ok(0) => {}
            Ok(n) => tracing::info!("{n} transaction(s) a previous run left open were taken up"),
            Err(f) if cancel.is_cancelled() => tracing::info!(
                "stopped while taking up transactions a previous run left open ([{}] {}); the next start takes them up from the journal",
                f.code,
                f.message
            ),
            Err(f) => tracing::error!(
                "cannot take up the transactions a previous run left open ([{}] {}); the next start tries again",
                f.code,
                f.message
            ),
        }
    }

    async fn run(
        &self,
        dispatch: Dispatch,
        events: EventSink,
        cancel: CancellationToken,
    ) -> RunEnd {
        let txn: Ulid = dispatch.txn.ulid();
        let reporter = OutboxReporter::for_dispatch(events.outbox().clone(), txn);
        let (kind, vmid) = match &dispatch.action {
            DispatchAction::Provision { vmid, .. } => (TxnKind::Provision, Some(*vmid)),
            DispatchAction::Destroy { vmid } => (TxnKind::Destroy, Some(*vmid)),
            DispatchAction::RestoreTest { .. } => (TxnKind::SelftestRestore, None),
            DispatchAction::InventoryRequest => (TxnKind::Provision, None),
        };
        // A transaction this agent already journaled is settled, never started over.
        let driven: Option<Driven> = if let Some(state) = service::known(&self.cfg, txn) {
            if state.is_terminal() {
                Some(Driven {
                    state,
                    checks: vec![],
                    plan: None,
                    halted: None,
                    boot: None,
                    isolation: None,
                })
            } else {
                service::resume(&self.cfg, state, &reporter, cancel.clone()).await
            }
        } else {
            let ran = match &dispatch.action {
                DispatchAction::Provision {
                    vmid,
                    from,
                    storage,
                    keep,
                    profile,
                    isolate_network,
                } => {
                    let req = ProvisionRequest {
                        vmid: Some(vmid.to_string()),
                        from: Some(from.clone()),
                        storage: Some(storage.clone()),
                        keep: *keep,
                        dry_run: false,
                        profile: profile.clone(),
                        isolate_network: *isolate_network,
                    };
                    service::provision(
                        &self.cfg,
                        &req,
                        TxnKind::Provision,
                        txn,
                        &reporter,
                        cancel.clone(),
                    )
                    .await
                    .map(|run| run.driven)
                }
                DispatchAction::Destroy { vmid } => {
                    service::destroy(&self.cfg, &vmid.to_string(), txn, &reporter, cancel.clone())
                        .await
                        .map(|run| run.driven)
                }
                DispatchAction::RestoreTest { dry_run } => {
                    let opts = service::restore_test::RunOptions {
                        dry_run: *dry_run,
                        guest: None,
                    };
                    match service::restore_test::run(
                        &self.cfg,
                        opts,
                        txn,
                        &reporter,
                        cancel.clone(),
                    )
                    .await
                    {
                        // The dispatch's id is the run's first copy; every other copy's result
                        // reaches the outbox through the reporter as it settles. The coverage
                        // the run worked out follows them.
                        Ok(run) => {
                            if !run.dry_run {
                                super::coverage::push(&self.cfg, events.outbox(), &run.coverage)
                                    .await;
                            }
                            match run.copies.into_iter().find(|c| c.driven.state.txn() == txn) {
                                Some(c) => Ok(c.driven),
                                None => {
                                    return RunEnd::Finished(Box::new(nothing_started_result(
                                        dispatch.txn,
                                        kind,
                                        run.left.len(),
                                    )))
                                }
                            }
                        }
                        Err(f) => Err(f),
                    }
                }
                DispatchAction::InventoryRequest => Err(Failure::new(
                    crate::error::ErrorCode::ConfigInvalid,
                    "inventory requests are answered by the session, not as a transaction",
                )),
            };
            match ran {
                Ok(d) => Some(d),
                Err(f) => {
                    return RunEnd::Finished(Box::new(early_result(dispatch.txn, kind, vmid, &f)));
                }
            }
        };
        match driven {
            // Stopped by the shutdown half-way: the next start takes it up from the journal.
            Some(d) if d.halted.is_some() && cancel.is_cancelled() => {
                match d.state.upid() {
                    Some(upid) => tracing::warn!(
                        txn = %d.state.txn(),
                        vmid = d.state.vmid(),
                        "shutdown: transaction {} stopped waiting for PVE task {upid} at phase {}; the task was not aborted and the next start follows it to its end",
                        d.state.txn(),
                        d.state.phase().as_str()
                    ),
                    None => tracing::warn!(
                        txn = %d.state.txn(),
                        vmid = d.state.vmid(),
                        "shutdown: transaction {} stopped at phase {} (journaled); the next start takes it up",
                        d.state.txn(),
                        d.state.phase().as_str()
                    ),
                }
                RunEnd::Interrupted
            }
            Some(d) => match wire_result(&d.state, &d.checks, d.isolation.as_deref()) {
                Some(r) => RunEnd::Finished(Box::new(r)),
                None => RunEnd::Interrupted,
            },
            None => RunEnd::Interrupted,
        }
    }

    fn state_of(&self, txn: TxnId) -> Option<TxnResult> {
        let state = service::known(&self.cfg, txn.ulid())?;
        wire_result(&state, &[], None)
    }
}
