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
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use super::dispatch::{DispatchRunner, EventSink, RunEnd};
use super::outbox::spool;
use crate::app::CommandOutput;
use crate::cli::SelftestOpts;
use crate::commands::open_journal;
use crate::config::Config;
use crate::error::Failure;
use crate::guest::checks::CheckResult;
use crate::provision::effects::{Executor, Reporter};
use crate::provision::machine::{State, TxnKind};
use crate::provision::VmidLock;
use crate::pve::PveClient;
use crate::selftest::result_json;

/// The wire result of a transaction's final JSON (the same fields, same words).
pub fn wire_result(doc: &Value) -> Option<TxnResult> {
    serde_json::from_value(doc.clone()).ok()
}

/// The wire result of a command that ended before a transaction existed (a refusal of the
/// dispatch itself, e.g. an invalid vmid or a config error).
fn early_result(txn: TxnId, kind: TxnKind, vmid: Option<u32>, out: &CommandOutput) -> TxnResult {
    let error = out.json.get("error").cloned().unwrap_or(Value::Null);
    let code = error
        .get("code")
        .cloned()
        .unwrap_or(Value::String("config_invalid".into()));
    let refused = out.status.code() == 3;
    let doc = serde_json::json!({
        "txn": txn.to_string(),
        "kind": kind.as_str(),
        "vmid": vmid,
        "outcome": if refused { "refused" } else { "failed" },
        "phase": "planned",
        "destroy_armed": false,
        "destroyed": false,
        "checks": [],
        "error": {"code": code, "message": error.get("message").cloned().unwrap_or(Value::String(String::new()))},
    });
    wire_result(&doc).unwrap_or_else(|| TxnResult {
        txn,
        kind: hub_protocol::TxnKind::Provision,
        vmid,
        outcome: hub_protocol::Outcome::Failed,
        phase: hub_protocol::Phase::Planned,
        destroy_armed: false,
        destroyed: false,
        checks: vec![],
        error: Some(hub_protocol::ErrorInfo {
            code: hub_protocol::ErrorCode::ConfigInvalid,
            message: "the transaction could not be started".to_string(),
        }),
    })
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
                let phase =
                    serde_json::from_value(Value::String(state.phase().as_str().to_string()));
                let Ok(phase) = phase else { continue };
                let error = state
                    .failure()
                    .and_then(|f| serde_json::from_value(serde_json::to_value(f).ok()?).ok());
                let detail =
                    Some(format!("step {}", state.step())).filter(|_| !state.is_terminal());
                if let Err(e) = sink.phase(phase, detail, error).await {
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
        let doc = result_json(state, checks, None);
        let result = wire_result(&doc)
            .ok_or_else(|| format!("transaction {} has no wire form", state.txn()))?;
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

    fn known(&self, txn: Ulid) -> Option<State> {
        let journal = open_journal(&self.cfg).ok()?;
        journal.get(txn).ok().flatten().map(|t| t.state)
    }

    async fn resume(
        &self,
        state: State,
        reporter: &dyn Reporter,
        cancel: CancellationToken,
    ) -> Option<Value> {
        let vmid = state.vmid()?;
        let pve = PveClient::new(&self.cfg.pve).ok()?;
        let journal = open_journal(&self.cfg).ok()?;
        let _lock = VmidLock::try_acquire(&self.cfg.state_dir, vmid, Some(state.txn())).ok()?;
        let mut exec = Executor::new(&self.cfg, &pve, &journal, reporter, cancel);
        let driven = exec.settle(state).await;
        Some(result_json(&driven.state, &driven.checks, None))
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
        crate::selftest::prepare(&self.cfg, &reporter, &CancellationToken::new())
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
        let out_doc = if let Some(state) = self.known(txn) {
            if state.is_terminal() {
                Some(result_json(&state, &[], None))
            } else {
                self.resume(state, &reporter, cancel.clone()).await
            }
        } else {
            let out =
                match &dispatch.action {
                    DispatchAction::Provision {
                        vmid,
                        from,
                        storage,
                        keep,
                        profile,
                    } => {
                        let opts = SelftestOpts {
                            vmid: Some(vmid.to_string()),
                            from: Some(from.clone()),
                            storage: Some(storage.clone()),
                            keep: *keep,
                            dry_run: false,
                        };
                        crate::selftest::provision_txn(
                            &self.cfg,
                            &opts,
                            TxnKind::Provision,
                            txn,
                            profile.clone(),
                            &reporter,
                            cancel.clone(),
                        )
                        .await
                    }
                    DispatchAction::Destroy { vmid } => {
                        crate::selftest::destroy_txn(
                            &self.cfg,
                            &vmid.to_string(),
                            txn,
                            &reporter,
                            cancel.clone(),
                        )
                        .await
                    }
                    DispatchAction::RestoreTest { dry_run } => {
                        crate::restore_test::run_txn(
                            &self.cfg,
                            *dry_run,
                            txn,
                            &reporter,
                            cancel.clone(),
                        )
                        .await
                    }
                    DispatchAction::InventoryRequest => return RunEnd::Finished(early_result(
                        dispatch.txn,
                        kind,
                        None,
                        &CommandOutput::failure(&Failure::new(
                            crate::error::ErrorCode::ConfigInvalid,
                            "inventory requests are answered by the session, not as a transaction",
                        )),
                    )),
                };
            if out.json.get("txn").is_some() {
                Some(out.json)
            } else {
                drop(reporter);
                let _ = forward.await;
                return RunEnd::Finished(early_result(dispatch.txn, kind, vmid, &out));
            }
        };
        drop(reporter);
        let _ = forward.await;
        match out_doc {
            Some(doc) if doc.get("halted").is_none() || !cancel.is_cancelled() => {
                match wire_result(&doc) {
                    Some(r) if doc.get("outcome").is_some_and(|o| !o.is_null()) => {
                        RunEnd::Finished(r)
                    }
                    _ => RunEnd::Interrupted,
                }
            }
            _ => RunEnd::Interrupted,
        }
    }

    fn state_of(&self, txn: TxnId) -> Option<TxnResult> {
        let state = self.known(txn.ulid())?;
        if !state.is_terminal() {
            return None;
        }
        wire_result(&result_json(&state, &[], None))
    }
}
