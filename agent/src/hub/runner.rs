//! The provision executor behind the hub's [`DispatchRunner`] seam, and the reporters that
//! carry transaction phases and results to the hub.
//!
//! A dispatch runs exactly the transaction the command line runs (`--selftest=provision`,
//! `destroy`, `--selftest=restore`), under the dispatch's own transaction id, so a re-dispatch
//! of a known id finds it in the journal: a finished one answers with its result, an open one
//! (the agent died) is settled from the journal and never started over.

use std::path::PathBuf;
use std::sync::Arc;

use hub_protocol::{capability, AgentMessage, Dispatch, DispatchAction, TxnId, TxnResult};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use super::dispatch::{DispatchRunner, EventSink, RunEnd};
use super::outbox::spool;
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
        error: Some(error_info(failure)),
    }
}

/// Reports to the daemon's outbox through a dispatch's [`EventSink`]: phase changes as
/// events, in order. The result itself is stored by the dispatcher.
pub struct SinkReporter {
    tx: mpsc::UnboundedSender<State>,
}

impl SinkReporter {
    /// A reporter feeding `sink`; the returned task forwards the events and ends when the
    /// reporter is dropped.
    pub fn new(sink: EventSink) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, mut rx) = mpsc::unbounded_channel::<State>();
        let task = tokio::spawn(async move {
            let mut sink = sink;
            while let Some(state) = rx.recv().await {
                sink.set_vmid(state.vmid());
                let error = state.failure().map(error_info);
                let detail =
                    Some(format!("step {}", state.step())).filter(|_| !state.is_terminal());
                if let Err(e) = sink.phase(state.phase(), detail, error).await {
                    tracing::error!(error = %e, "a phase event could not be stored for the hub");
                }
            }
        });
        (Self { tx }, task)
    }
}

impl Reporter for SinkReporter {
    fn phase(&self, state: &State) {
        let _ = self.tx.send(state.clone());
    }
    fn result(&self, _state: &State, _checks: &[CheckResult]) -> Result<(), String> {
        Ok(())
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
    fn phase(&self, _state: &State) {}
    fn result(&self, state: &State, checks: &[CheckResult]) -> Result<(), String> {
        let result = wire_result(state, checks)
            .ok_or_else(|| format!("transaction {} is still open", state.txn()))?;
        spool(&self.state_dir, AgentMessage::Result(result))
            .map(|_| ())
            .map_err(|e| e.to_string())
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

    async fn prepare(&self) -> Result<(), Failure> {
        let reporter = SpoolReporter::new(self.cfg.state_dir.clone());
        service::prepare(&self.cfg, &reporter, &CancellationToken::new())
            .await
            .map(|_| ())
    }

    async fn run(
        &self,
        dispatch: Dispatch,
        events: EventSink,
        cancel: CancellationToken,
    ) -> RunEnd {
        let txn: Ulid = dispatch.txn.ulid();
        let (reporter, forward) = SinkReporter::new(events);
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
                } => {
                    let req = ProvisionRequest {
                        vmid: Some(vmid.to_string()),
                        from: Some(from.clone()),
                        storage: Some(storage.clone()),
                        keep: *keep,
                        dry_run: false,
                        profile: profile.clone(),
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
                    service::restore_test::run(&self.cfg, *dry_run, txn, &reporter, cancel.clone())
                        .await
                        .map(|run| run.driven)
                }
                DispatchAction::InventoryRequest => Err(Failure::new(
                    crate::error::ErrorCode::ConfigInvalid,
                    "inventory requests are answered by the session, not as a transaction",
                )),
            };
            match ran {
                Ok(d) => Some(d),
                Err(f) => {
                    drop(reporter);
                    let _ = forward.await;
                    return RunEnd::Finished(early_result(dispatch.txn, kind, vmid, &f));
                }
            }
        };
        drop(reporter);
        let _ = forward.await;
        match driven {
            // Stopped by the shutdown half-way: the next start takes it up from the journal.
            Some(d) if d.halted.is_some() && cancel.is_cancelled() => RunEnd::Interrupted,
            Some(d) => match wire_result(&d.state, &d.checks) {
                Some(r) => RunEnd::Finished(r),
                None => RunEnd::Interrupted,
            },
            None => RunEnd::Interrupted,
        }
    }

    fn state_of(&self, txn: TxnId) -> Option<TxnResult> {
        let state = service::known(&self.cfg, txn.ulid())?;
        wire_result(&state, &[])
    }
}
