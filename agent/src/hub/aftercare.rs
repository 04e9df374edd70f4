//! The daemon's daily `journal refresh` and the hub's view of a closed `needs_human`.
//!
//! Once a day the daemon re-reads the guests of every transaction that may still own or
//! concern one ([`crate::service::journal_ops::refresh`]): a kept guest gone or without its
//! proof is disarmed, a `needs_human` whose guest is gone is closed. It never writes to PVE.
//! A closure, whoever made it (an operator's `journal resolve` or a refresh), is spooled for
//! the hub as an event of its transaction; one a killed command left unspooled is spooled by
//! the daemon at its start and then every [`UNREPORTED_INTERVAL`] while it runs.

use std::sync::Arc;
use std::time::Duration;

use hub_protocol::AgentMessage;
use tokio_util::sync::CancellationToken;

use super::outbox::{event_message_id, now_timestamp, spool_as};
use crate::config::Config;
use crate::provision::machine::{ResolvedBy, State};
use crate::service::journal_ops;

/// How often the daemon refreshes the journal against PVE.
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(24 * 60 * 60);

/// The environment variable that shortens [`REFRESH_INTERVAL`] in tests (milliseconds; only in a
/// build with the `test-hooks` feature).
#[cfg(feature = "test-hooks")]
pub const REFRESH_ENV: &str = "FELHOM_AGENT_REFRESH_MS";

/// The refresh interval: [`REFRESH_INTERVAL`], or the test build's override.
pub fn refresh_interval() -> Duration {
    #[cfg(feature = "test-hooks")]
    if let Some(ms) = std::env::var(REFRESH_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        return Duration::from_millis(ms.max(10));
    }
    REFRESH_INTERVAL
}

/// Refresh the journal every `every` until `stop`, the first time one interval after start.
pub async fn refresh_loop(cfg: Arc<Config>, every: Duration, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        match journal_ops::refresh(&cfg).await {
            Ok(report) => {
                for row in report.changed() {
                    tracing::warn!(txn = %row.txn, vmid = row.vmid, change = row.change.as_deref().unwrap_or(""), "journal refresh changed a transaction");
                    if row.state.resolution().is_some() {
                        spool_resolution(&cfg, &row.state);
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "journal refresh failed; nothing was changed, it runs again at the next interval");
            }
        }
    }
}

/// Spool a closed `needs_human` for the hub (when one is configured) as an event of its
/// transaction, under an id derived from the transaction and the closure's journal record (the
/// same closure spooled again is applied once); the daemon sends it. Returns what happened, for
/// the operator.
pub fn spool_resolution(cfg: &Config, state: &State) -> Option<String> {
    cfg.hub.as_ref()?;
    state.resolution()?;
    let record = match journal_ops::closure_record(cfg, state.txn()) {
        Ok(Some((_, record))) => record,
        Ok(None) => return Some("not queued for the hub: it is not in the journal".to_string()),
        Err(e) => return Some(format!("not queued for the hub: {}", e.message)),
    };
    Some(match spool_closure(cfg, state, record) {
        Ok(()) => {
            journal_ops::reported(cfg, state.txn());
            "queued for the hub".to_string()
        }
        Err(e) => {
            tracing::error!(txn = %state.txn(), error = %e, "the closure could not be queued for the hub; it is in the journal and the daemon's next start queues it");
            format!("not queued for the hub: {e}")
        }
    })
}

fn spool_closure(cfg: &Config, state: &State, record: u64) -> Result<(), String> {
    let Some(resolution) = state.resolution() else {
        return Ok(());
    };
    let at = now_timestamp().map_err(|e| e.to_string())?;
    let by = match resolution.by {
        ResolvedBy::Operator => "an operator",
        ResolvedBy::Refresh => "a journal refresh",
    };
    let event = super::runner::state_event(
        state,
        at,
        Some(format!("needs_human closed by {by}: {}", resolution.reason)),
        None,
    );
    spool_as(
        &cfg.state_dir,
        event_message_id(event.txn, record),
        AgentMessage::Event(event),
    )
    .map(|_| ())
    .map_err(|e| e.to_string())
}

/// How often the running daemon spools the closures a killed command left journaled but not
/// spooled (besides once at its start).
pub const UNREPORTED_INTERVAL: Duration = Duration::from_secs(60);

/// The environment variable that shortens [`UNREPORTED_INTERVAL`] in tests (milliseconds; only
/// in a build with the `test-hooks` feature).
#[cfg(feature = "test-hooks")]
pub const UNREPORTED_ENV: &str = "FELHOM_AGENT_UNREPORTED_MS";

/// A note whose closure is not journaled yet may belong to a `journal resolve` still running
/// (the note is written before its journal record): the periodic pass leaves it this long.
pub const UNREPORTED_NOTE_GRACE: Duration = Duration::from_secs(600);

/// The interval of the periodic pass: [`UNREPORTED_INTERVAL`], or the test build's override.
pub fn unreported_interval() -> Duration {
    #[cfg(feature = "test-hooks")]
    if let Some(ms) = std::env::var(UNREPORTED_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        return Duration::from_millis(ms.max(10));
    }
    UNREPORTED_INTERVAL
}

/// While the daemon runs: every `every` until `stop`, spool the closures a killed command left
/// journaled but not spooled, so they reach the hub without waiting for a restart.
pub async fn unreported_loop(cfg: Arc<Config>, every: Duration, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let cfg = cfg.clone();
        match tokio::task::spawn_blocking(move || spool_unreported(&cfg, UNREPORTED_NOTE_GRACE))
            .await
        {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                "{n} closure(s) a stopped command left unreported were queued for the hub"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "the pass over unreported closures did not finish; it runs again")
            }
        }
    }
}

/// At the daemon's start: spool the closures a kill left journaled but not spooled (see
/// [`journal_ops::UNREPORTED_DIR`]); a note whose closure was never journaled is dropped.
/// Returns how many were spooled.
pub fn report_unreported(cfg: &Config) -> usize {
    spool_unreported(cfg, Duration::ZERO)
}

/// Spool the closures journaled but not spooled; a note whose closure is not journaled is
/// dropped once it is older than `grace` (a command may be between the note and its journal
/// record). Returns how many were spooled.
fn spool_unreported(cfg: &Config, grace: Duration) -> usize {
    let mut spooled = 0;
    for txn in journal_ops::unreported(cfg) {
        match journal_ops::closure_record(cfg, txn) {
            Ok(Some((state, record))) => match spool_closure(cfg, &state, record) {
                Ok(()) => {
                    tracing::info!(%txn, record, "a closure journaled before a crash is queued for the hub");
                    journal_ops::reported(cfg, txn);
                    spooled += 1;
                }
                Err(e) => {
                    tracing::error!(%txn, error = %e, "the closure of {txn} could not be queued for the hub; the next start tries again");
                }
            },
            Ok(None) => {
                let young = !grace.is_zero()
                    && std::fs::metadata(
                        cfg.state_dir
                            .join(journal_ops::UNREPORTED_DIR)
                            .join(txn.to_string()),
                    )
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|at| at.elapsed().ok())
                    .is_none_or(|age| age < grace);
                if !young {
                    journal_ops::reported(cfg, txn);
                }
            }
            Err(e) => {
                tracing::warn!(%txn, error = %e.message, "cannot read the closure of {txn}; the next start tries again");
            }
        }
    }
    spooled
}
