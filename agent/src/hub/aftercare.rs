//! The daemon's daily `journal refresh` and the hub's view of a closed `needs_human`.
//!
//! Once a day the daemon re-reads the guests of every transaction that may still own or
//! concern one ([`crate::service::journal_ops::refresh`]): a kept guest gone or without its
//! proof is disarmed, a `needs_human` whose guest is gone is closed. It never writes to PVE.
//! A closure, whoever made it (an operator's `journal resolve` or a refresh), is spooled for
//! the hub as an event of its transaction.

use std::sync::Arc;
use std::time::Duration;

use hub_protocol::{AgentMessage, Event, TxnId};
use tokio_util::sync::CancellationToken;

use super::outbox::{now_timestamp, spool};
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
/// transaction; the daemon sends it. Returns what happened, for the operator.
pub fn spool_resolution(cfg: &Config, state: &State) -> Option<String> {
    cfg.hub.as_ref()?;
    let resolution = state.resolution()?;
    let at = match now_timestamp() {
        Ok(t) => t,
        Err(e) => return Some(format!("not queued for the hub: {e}")),
    };
    let by = match resolution.by {
        ResolvedBy::Operator => "an operator",
        ResolvedBy::Refresh => "a journal refresh",
    };
    let event = Event {
        txn: TxnId::from_ulid(state.txn()),
        kind: state.kind(),
        vmid: state.vmid(),
        phase: state.phase(),
        at,
        detail: Some(format!("needs_human closed by {by}: {}", resolution.reason)),
        error: None,
    };
    Some(match spool(&cfg.state_dir, AgentMessage::Event(event)) {
        Ok(_) => "queued for the hub".to_string(),
        Err(e) => {
            tracing::error!(txn = %state.txn(), error = %e, "the closure could not be queued for the hub; it is in the journal");
            format!("not queued for the hub: {e}")
        }
    })
}
