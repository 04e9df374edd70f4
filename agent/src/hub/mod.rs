//! `felhom-agent run`: the daemon that keeps the hub session, runs dispatches and reports every
//! event and result through a durable outbox (DESIGN sections 2 rule 8 and 6).
//!
//! The parts:
//! - [`store`]: records by id and kind with completion marks and compaction, on a
//!   [`crate::durable_log`] file (checksummed, crash-safe, size-capped, group-committed);
//! - [`outbox`]: the outbox (messages until the hub acks them) and the inbox (dispatches until
//!   they are finished) in `<state_dir>/outbox/`, behind one writer thread;
//! - [`dispatch`]: the [`DispatchRunner`] seam, the [`EventSink`] a runner reports through,
//!   and the dispatcher (bounded concurrency, per-vmid exclusion, idempotent by transaction);
//! - [`session`]: connecting to the hub (bearer credential, rustls, pin or CA or system roots)
//!   and one hello/welcome session;
//! - [`backoff`]: reconnect delays (capped exponential, full jitter);
//! - [`notify`]: systemd `READY=1`, `WATCHDOG=1`, `STOPPING=1`;
//! - [`inventory`]: the inventory the hub may see, from PVE and the full guest list;
//! - [`facts`]: host facts for the hello;
//! - [`aftercare`]: the daily journal refresh against PVE, and a closed `needs_human` as an
//!   event for the hub;
//! - [`coverage`]: the restore test's coverage table as a `coverage` message (protocol
//!   version 2), queued after every run that worked it out.
//!
//! Other commands report through [`outbox::spool`]; the daemon moves what they spooled into
//! the outbox.
//!
//! [`run_daemon`] ties them together: open the outbox, feed systemd's watchdog while the
//! daemon's own loops turn ([`Liveness`]; a hub outage is reported, never a reason to stop
//! the pings), the runner's local start, READY (the hub's state in STATUS=), then in the
//! background the take-up of what a previous run left open (open dispatches by the
//! dispatcher, other open transactions by [`DispatchRunner::take_up_leftovers`], each resumed
//! from its journal), while it either idles until SIGTERM (no `[hub]`: reports wait in the
//! outbox) or keeps a session with the hub, reconnecting with backoff. SIGTERM stops new work and every wait for PVE (never a PVE task:
//! the journal holds each transaction's UPID and the next start follows it), lets running
//! transactions reach a journaled step (up to [`session::SHUTDOWN_GRACE`]), flushes the
//! outbox to the hub if a session is up, and closes the outbox.
//!
//! Nothing here ever logs or returns the hub credential.
//!
//! The hub is a front end, like the command line: it calls the transaction service
//! (`crate::service`) and never a command-line module.

pub mod aftercare;
pub mod backoff;
pub mod coverage;
pub mod dispatch;
pub mod facts;
pub mod inventory;
pub mod notify;
pub mod outbox;
pub mod runner;
pub mod session;
pub mod store;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

pub use dispatch::{
    DispatchRunner, Dispatcher, EventSink, InventoryRead, RefusingRunner, RunEnd,
    MAX_CONCURRENT_TRANSACTIONS,
};
pub use inventory::PveInventory;
pub use notify::{DaemonLoop, Liveness, Notifier};
pub use outbox::{derived_message_id, spool, Outbox, OutboxError};
pub use session::{HubEndpoint, SessionEnd, Timing};

use crate::config::{Config, HubConfig};
use crate::error::{ErrorCode, Failure};
use backoff::Backoff;
use session::SessionContext;

/// What the daemon needs from the configuration.
#[derive(Debug, Clone)]
pub struct DaemonSettings {
    /// This node.
    pub node: String,
    /// The fleet's pool.
    pub pool: String,
    /// The state dir (the outbox lives in `<state_dir>/outbox/`).
    pub state_dir: PathBuf,
    /// The hub, if configured.
    pub hub: Option<HubConfig>,
    /// What the outbox keeps while no hub is configured ([`outbox::Retention::WITHOUT_HUB`]).
    pub keep_without_hub: outbox::Retention,
    /// The session timing.
    pub timing: Timing,
    /// node_exporter's textfile folder (`None`: no metrics files).
    pub metrics_dir: Option<PathBuf>,
}

/// How the daemon ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonReport {
    /// Sessions that reached the welcome.
    pub sessions: u64,
    /// Messages still waiting for the hub at exit.
    pub outbox_depth: u64,
    /// Dispatches still open at exit (resumed at the next start).
    pub open_dispatches: u64,
}

/// `felhom-agent run`: the daemon until `shutdown` is cancelled.
pub async fn run(cfg: &Config, shutdown: CancellationToken) -> Result<DaemonReport, Failure> {
    let timing = Timing::from_env()?;
    let client = crate::service::pve_client(cfg)?;
    let inventory = Arc::new(PveInventory::new(
        client,
        cfg.vmlist_path.clone(),
        crate::exec_helper::client::vmlist_reader(cfg),
        cfg.node.clone(),
        cfg.pool.clone(),
    ));
    let settings = DaemonSettings {
        node: cfg.node.clone(),
        pool: cfg.pool.clone(),
        state_dir: cfg.state_dir.clone(),
        hub: cfg.hub.clone(),
        keep_without_hub: outbox::Retention::WITHOUT_HUB,
        timing,
        metrics_dir: Some(cfg.metrics.dir.clone()),
    };
    let runner = Arc::new(runner::ProvisionRunner::new(Arc::new(cfg.clone())));
    aftercare::report_unreported(cfg);
    let refresh_stop = shutdown.child_token();
    let refresher = tokio::spawn(aftercare::refresh_loop(
        Arc::new(cfg.clone()),
        aftercare::refresh_interval(),
        refresh_stop.clone(),
    ));
    let unreported = tokio::spawn(aftercare::unreported_loop(
        Arc::new(cfg.clone()),
        aftercare::unreported_interval(),
        refresh_stop.clone(),
    ));
    let ended = run_daemon(settings, runner, inventory, Notifier::from_env(), shutdown).await;
    // A refresh in progress is dropped between two journal writes; it runs again next time.
    refresh_stop.cancel();
    refresher.abort();
    unreported.abort();
    ended
}

/// The daemon: see the module docs. Returns when `shutdown` fired and everything stopped, or
/// at once with a failure when the hub settings or the outbox cannot be used.
pub async fn run_daemon<R: DispatchRunner, I: InventoryRead>(
    settings: DaemonSettings,
    runner: Arc<R>,
    inventory: Arc<I>,
    notifier: Notifier,
    shutdown: CancellationToken,
) -> Result<DaemonReport, Failure> {
    let started = Instant::now();
    let endpoint = settings.hub.as_ref().map(HubEndpoint::new).transpose()?;
    // Without a hub nothing acknowledges a report: the outbox keeps only the newest.
    let (outbox, summary) = match endpoint {
        None => Outbox::open_keeping(&settings.state_dir, settings.keep_without_hub),
        Some(_) => Outbox::open(&settings.state_dir),
    }
    .map_err(|e| Failure::new(ErrorCode::ConfigInvalid, e.to_string()))?;
    tracing::info!(
        "outbox {}: {} messages wait for the hub, {} dispatches are open",
        outbox.dir().display(),
        summary.pending_messages,
        summary.open_dispatches
    );
    let notifier = Arc::new(notifier);
    // The watchdog vouches for the daemon's own loops, never for the hub: a loop still for
    // two ping intervals (the whole WatchdogSec) stops the pings.
    let liveness = Arc::new(Liveness::new(
        notifier
            .watchdog_interval()
            .map_or(Duration::from_secs(60), |every| every * 2)
            .max(notify::LIVENESS_TICK * 4),
    ));
    let background = CancellationToken::new();
    if let Some(every) = notifier.watchdog_interval() {
        tokio::spawn(watchdog_loop(
            every,
            notifier.clone(),
            liveness.clone(),
            background.clone(),
        ));
    }
    tokio::spawn(spool_ingester(
        outbox.clone(),
        liveness.clone(),
        background.clone(),
    ));
    // The local start only (journal, PVE client): quick whatever PVE and the hub do. What a
    // previous run left open is taken up after READY, in the background.
    let prepared = liveness
        .beat_while(DaemonLoop::Hub, runner.prepare(&outbox, shutdown.clone()))
        .await;
    if let Err(f) = prepared {
        background.cancel();
        let report = DaemonReport {
            sessions: 0,
            outbox_depth: outbox.depth(),
            open_dispatches: outbox.open_dispatch_count(),
        };
        outbox.close().await;
        if shutdown.is_cancelled() {
            notifier.stopping("stopping");
            // SIGTERM while a transaction left open was being followed: its UPID stays in
            // the journal and the next start follows it on. Nothing was aborted.
            tracing::info!(
                "stopped while settling open transactions ([{}] {}); the next start takes them up from the journal",
                f.code,
                f.message
            );
            return Ok(report);
        }
        return Err(f);
    }
    // READY once the local start is done, whatever the hub (its state goes into STATUS=) and
    // whatever is left to take up (that goes on in the background).
    let ready_sent = AtomicBool::new(true);
    notifier.ready(&match &endpoint {
        None => "no hub configured: reports wait in the outbox".to_string(),
        Some(e) => format!("started; hub: connecting to {}", e.url()),
    });
    tracing::info!(
        "started in {:.1} s; leftovers are taken up in the background",
        started.elapsed().as_secs_f32()
    );
    let dispatched: Vec<hub_protocol::TxnId> = match outbox.open_dispatches().await {
        Ok(open) => open.iter().map(|d| d.txn).collect(),
        Err(e) => {
            tracing::error!("cannot read the open dispatches: {e}");
            Vec::new()
        }
    };
    let leftovers = {
        let (runner, outbox, cancel) = (runner.clone(), outbox.clone(), shutdown.clone());
        tokio::spawn(async move {
            runner.take_up_leftovers(&outbox, dispatched, cancel).await;
        })
    };
    let (acks_tx, mut acks_rx) = mpsc::unbounded_channel();
    let dispatcher = Dispatcher::new(runner, inventory.clone(), outbox.clone(), acks_tx);
    if let Err(e) = dispatcher.resume().await {
        tracing::error!("cannot read the open dispatches: {e}");
    }
    let contact = Arc::new(HubContact::default());
    if let Some(dir) = settings.metrics_dir.clone() {
        tokio::spawn(metrics_loop(
            dir,
            settings.state_dir.clone(),
            endpoint.is_some(),
            contact.clone(),
            outbox.clone(),
            background.clone(),
        ));
    }
    let mut sessions = 0u64;
    match endpoint {
        None => {
            tracing::info!(
                "no [hub] configured: reports wait in the outbox until a hub is configured"
            );
            liveness
                .beat_while(DaemonLoop::Hub, shutdown.cancelled())
                .await;
            notifier.stopping("stopping");
            dispatcher.shutdown(settings.timing.shutdown_grace).await;
        }
        Some(endpoint) => {
            let inventory_now = Arc::new(Notify::new());
            // The inventory is not read once the daemon stops: a read goes through the exec
            // helper's socket, and a connection left in its queue by a daemon that exits
            // starts the helper again after an operator stopped it (systemd starts a socket's
            // service while a connection waits).
            let inventory_stop = background.child_token();
            {
                let (shutdown, inventory_stop) = (shutdown.clone(), inventory_stop.clone());
                tokio::spawn(async move {
                    shutdown.cancelled().await;
                    inventory_stop.cancel();
                });
            }
            tokio::spawn(inventory_poller(
                inventory,
                outbox.clone(),
                settings.timing.inventory_poll,
                inventory_now.clone(),
                inventory_stop,
            ));
            // SIGTERM: stop taking work, let running work reach a journaled step while the
            // session goes on (so its results still reach the hub), then end the session.
            let stop_session = CancellationToken::new();
            {
                let (shutdown, stop_session, dispatcher, notifier) = (
                    shutdown.clone(),
                    stop_session.clone(),
                    dispatcher.clone(),
                    notifier.clone(),
                );
                let grace = settings.timing.shutdown_grace;
                tokio::spawn(async move {
                    shutdown.cancelled().await;
                    notifier
                        .stopping("stopping: letting running transactions reach a journaled step");
                    dispatcher.shutdown(grace).await;
                    stop_session.cancel();
                });
            }
            let ctx = SessionContext {
                endpoint: &endpoint,
                timing: &settings.timing,
                node: &settings.node,
                pool: &settings.pool,
                outbox: &outbox,
                dispatcher: &dispatcher,
                liveness: &liveness,
                notifier: &notifier,
                ready_sent: &ready_sent,
                inventory_now: &inventory_now,
                contact: &contact,
                started,
            };
            let mut backoff =
                Backoff::new(settings.timing.backoff_initial, settings.timing.backoff_cap);
            let mut last_status: Option<String> = None;
            loop {
                let outcome = ctx.run(&mut acks_rx, &stop_session).await;
                liveness.beat(DaemonLoop::Hub);
                if outcome.welcomed {
                    sessions += 1;
                    backoff.reset();
                    last_status = None;
                }
                if outcome.end == SessionEnd::Stopped
                    || stop_session.is_cancelled()
                    || shutdown.is_cancelled()
                {
                    break;
                }
                let delay = backoff.next_delay();
                tracing::warn!(
                    "hub session ended: {}; reconnecting in {:.1} s (attempt {})",
                    outcome.end,
                    delay.as_secs_f32(),
                    backoff.attempts()
                );
                // An outage is reported, not punished: the watchdog keeps being fed while this
                // loop turns, so systemd does not restart an agent that only lost its hub.
                let status = format!(
                    "hub unreachable ({}); reconnecting; running transactions go on",
                    outcome.end
                );
                if last_status.as_deref() != Some(status.as_str()) {
                    notifier.status(&status);
                    last_status = Some(status);
                }
                let stopped = liveness
                    .beat_while(DaemonLoop::Hub, async {
                        tokio::select! {
                            _ = tokio::time::sleep(delay) => false,
                            _ = stop_session.cancelled() => true,
                            _ = shutdown.cancelled() => true,
                        }
                    })
                    .await;
                if stopped {
                    break;
                }
            }
            // Whatever way the loop ended, work must have stopped before the outbox closes.
            notifier.stopping("stopping");
            dispatcher.shutdown(settings.timing.shutdown_grace).await;
        }
    }
    // The background take-up stops at its next journaled step (the shutdown stops its
    // waiting, never PVE's work) before the outbox closes.
    if tokio::time::timeout(settings.timing.shutdown_grace, leftovers)
        .await
        .is_err()
    {
        tracing::warn!("the take-up of leftover transactions did not stop within the grace; the next start takes them up from the journal");
    }
    background.cancel();
    let report = DaemonReport {
        sessions,
        outbox_depth: outbox.depth(),
        open_dispatches: outbox.open_dispatch_count(),
    };
    outbox.close().await;
    if let Some(dir) = &settings.metrics_dir {
        let text = crate::metrics::hub_text(settings.hub.is_some(), false, report.outbox_depth)
            + &crate::metrics::outbox_dropped_text(outbox.dropped());
        if let Err(e) = crate::metrics::textfile::write(dir, crate::metrics::HUB_FILE, &text) {
            tracing::warn!("metrics not updated: {e}");
        }
    }
    tracing::info!(
        "stopped: {} messages wait in the outbox, {} dispatches are open",
        report.outbox_depth,
        report.open_dispatches
    );
    Ok(report)
}

/// Moves messages other commands spooled into the outbox, at start and every
/// [`outbox::SPOOL_POLL_INTERVAL`].
async fn spool_ingester(outbox: Outbox, liveness: Arc<Liveness>, stop: CancellationToken) {
    loop {
        liveness.beat(DaemonLoop::Spool);
        match outbox.ingest_spool().await {
            Ok(0) => {}
            Ok(n) => tracing::info!("moved {n} spooled reports into the outbox"),
            Err(OutboxError::Closed) => return,
            Err(e) => tracing::warn!("cannot move spooled reports into the outbox: {e}"),
        }
        let stopped = liveness
            .beat_while(DaemonLoop::Spool, async {
                tokio::select! {
                    _ = tokio::time::sleep(outbox::SPOOL_POLL_INTERVAL) => false,
                    _ = stop.cancelled() => true,
                }
            })
            .await;
        if stopped {
            return;
        }
    }
}

/// When the hub was last heard from in the current session (none between sessions): what
/// `felhom_hub_connected` reports.
#[derive(Debug, Default)]
pub struct HubContact(std::sync::Mutex<Option<Instant>>);

impl HubContact {
    /// How long after the last frame from the hub it still counts as connected.
    pub const WITHIN: Duration = Duration::from_secs(30);

    /// A frame came from the hub.
    pub fn heard(&self) {
        if let Ok(mut at) = self.0.lock() {
            *at = Some(Instant::now());
        }
    }

    /// The session ended.
    pub fn lost(&self) {
        if let Ok(mut at) = self.0.lock() {
            *at = None;
        }
    }

    /// Whether the hub was heard from within [`Self::WITHIN`] in a session still open.
    pub fn connected(&self, now: Instant) -> bool {
        self.0
            .lock()
            .ok()
            .and_then(|at| *at)
            .is_some_and(|at| now.saturating_duration_since(at) <= Self::WITHIN)
    }
}

/// Keeps the metrics files current: the hub's (connected while the hub was heard from within
/// [`HubContact::WITHIN`] in an open session; outbox depth) within a second of a change and at least every
/// [`crate::metrics::DAEMON_INTERVAL`], the journal's every [`crate::metrics::DAEMON_INTERVAL`].
async fn metrics_loop(
    dir: PathBuf,
    state_dir: PathBuf,
    hub_configured: bool,
    contact: Arc<HubContact>,
    outbox: Outbox,
    stop: CancellationToken,
) {
    let every = crate::metrics::DAEMON_INTERVAL;
    let mut warned = false;
    let mut written: Option<(bool, u64, u64)> = None;
    let mut hub_at: Option<Instant> = None;
    let mut journal_at: Option<Instant> = None;
    loop {
        let connected = hub_configured && contact.connected(Instant::now());
        let now = (connected, outbox.depth(), outbox.dropped());
        let mut result = Ok(());
        if written != Some(now) || hub_at.is_none_or(|t| t.elapsed() >= every) {
            let text = crate::metrics::hub_text(hub_configured, now.0, now.1)
                + &crate::metrics::outbox_dropped_text(now.2);
            result = crate::metrics::textfile::write(&dir, crate::metrics::HUB_FILE, &text)
                .map_err(|e| e.to_string());
            if result.is_ok() {
                written = Some(now);
                hub_at = Some(Instant::now());
            }
        }
        if result.is_ok() && journal_at.is_none_or(|t| t.elapsed() >= every) {
            result = crate::provision::Journal::open(&state_dir)
                .map_err(|e| e.to_string())
                .and_then(|j| crate::metrics::update_transactions(&dir, &j));
            journal_at = Some(Instant::now());
        }
        match result {
            Err(e) if !warned => {
                tracing::warn!("metrics not updated (retried every second): {e}");
                warned = true;
            }
            Err(_) => {}
            Ok(()) => warned = false,
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// Pings systemd's watchdog every `every` while [`Liveness`] says every loop turns; a still
/// loop is logged once and the pings stop, so systemd restarts the agent.
async fn watchdog_loop(
    every: Duration,
    notifier: Arc<Notifier>,
    liveness: Arc<Liveness>,
    stop: CancellationToken,
) {
    let mut reported = false;
    loop {
        match liveness.check(Instant::now()) {
            Ok(()) => {
                reported = false;
                notifier.watchdog();
            }
            Err((lp, still)) if !reported => {
                reported = true;
                tracing::error!(
                    "the {} has not turned for {:.1} s: no watchdog ping; systemd restarts the agent after WatchdogSec",
                    lp.as_str(),
                    still.as_secs_f32()
                );
                notifier.status(&format!("{} stuck: watchdog pings stopped", lp.as_str()));
            }
            Err(_) => {}
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// Reads the inventory every `every` (and at once when `now` is notified, on each new
/// session) and stores it in the outbox when it changed, or when a new session asked for it.
async fn inventory_poller<I: InventoryRead>(
    inventory: Arc<I>,
    outbox: Outbox,
    every: Duration,
    now: Arc<Notify>,
    stop: CancellationToken,
) {
    let mut last_sent: Option<hub_protocol::Inventory> = None;
    let mut last_error: Option<String> = None;
    loop {
        let forced = tokio::select! {
            _ = tokio::time::sleep(every) => false,
            _ = now.notified() => true,
            _ = stop.cancelled() => return,
        };
        let read = tokio::select! {
            r = inventory.read() => r,
            _ = stop.cancelled() => return,
        };
        match read {
            Ok(current) => {
                last_error = None;
                if forced || last_sent.as_ref() != Some(&current) {
                    match outbox
                        .push(hub_protocol::AgentMessage::Inventory(current.clone()))
                        .await
                    {
                        Ok(_) => last_sent = Some(current),
                        Err(e) => tracing::warn!("cannot store the inventory: {e}"),
                    }
                }
            }
            Err(f) => {
                // Logged once per distinct error, not on every poll.
                if last_error.as_deref() != Some(f.message.as_str()) {
                    tracing::warn!("cannot read the inventory: [{}] {}", f.code, f.message);
                    last_error = Some(f.message);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use hub_protocol::{Dispatch, Inventory, TxnId, TxnResult};

    use super::*;

    struct NoInventory;

    impl InventoryRead for NoInventory {
        async fn read(&self) -> Result<Inventory, Failure> {
            Err(Failure::new(
                ErrorCode::PveUnreachable,
                "no PVE in this test",
            ))
        }
    }

    struct FailingPrepare;

    impl DispatchRunner for FailingPrepare {
        fn capabilities(&self) -> Vec<&'static str> {
            Vec::new()
        }

        async fn prepare(
            &self,
            _outbox: &Outbox,
            _cancel: CancellationToken,
        ) -> Result<(), Failure> {
            Err(Failure::new(
                ErrorCode::PveUnreachable,
                "cannot settle open transactions",
            ))
        }

        async fn run(
            &self,
            dispatch: Dispatch,
            _events: EventSink,
            _cancel: CancellationToken,
        ) -> RunEnd {
            RunEnd::Finished(Box::new(RefusingRunner::refusal(&dispatch)))
        }

        fn state_of(&self, _txn: TxnId) -> Option<TxnResult> {
            None
        }
    }

    fn settings(dir: &std::path::Path) -> DaemonSettings {
        DaemonSettings {
            metrics_dir: None,
            node: "pve1".into(),
            pool: "felhom".into(),
            state_dir: dir.to_path_buf(),
            hub: None,
            keep_without_hub: outbox::Retention::WITHOUT_HUB,
            timing: Timing::default(),
        }
    }

    /// An inventory whose read never ends, counting the reads begun.
    struct HangingInventory(std::sync::atomic::AtomicUsize);

    impl InventoryRead for HangingInventory {
        async fn read(&self) -> Result<Inventory, Failure> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::future::pending().await
        }
    }

    /// A read under way when the daemon stops is dropped, and none begins after: each goes
    /// through the exec helper's socket, where a connection left behind starts the helper
    /// again after an operator stopped it.
    #[tokio::test]
    async fn the_inventory_poller_ends_with_a_read_under_way_and_begins_none_after() {
        let dir = tempfile::tempdir().expect("tmp");
        let (outbox, _) = Outbox::open(dir.path()).expect("outbox");
        let inventory = Arc::new(HangingInventory(std::sync::atomic::AtomicUsize::new(0)));
        let now = Arc::new(Notify::new());
        let stop = CancellationToken::new();
        let poller = tokio::spawn(inventory_poller(
            inventory.clone(),
            outbox.clone(),
            Duration::from_millis(10),
            now,
            stop.clone(),
        ));
        while inventory.0.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(10), poller)
            .await
            .expect("the poller ended with its read under way")
            .expect("no panic");
        assert_eq!(inventory.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        outbox.close().await;
    }

    #[tokio::test]
    async fn without_a_hub_it_idles_until_shutdown_and_keeps_reports() {
        let dir = tempfile::tempdir().expect("tmp");
        spool(
            dir.path(),
            hub_protocol::AgentMessage::Inventory(Inventory {
                request: None,
                guests: vec![],
                foreign_vmids: vec![101],
            }),
        )
        .expect("spool");
        let shutdown = CancellationToken::new();
        let stopper = shutdown.clone();
        let spool_dir = dir.path().join(outbox::OUTBOX_DIR).join(outbox::SPOOL_DIR);
        tokio::spawn(async move {
            // Shut down once the spooled report is in the outbox (its spool file goes only
            // after it is stored): an event, not a time a loaded machine may overrun.
            let deadline = Instant::now() + Duration::from_secs(60);
            while std::fs::read_dir(&spool_dir).is_ok_and(|mut d| d.next().is_some())
                && Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            stopper.cancel();
        });
        let report = run_daemon(
            settings(dir.path()),
            Arc::new(RefusingRunner),
            Arc::new(NoInventory),
            Notifier::disabled(),
            shutdown,
        )
        .await
        .expect("run");
        assert_eq!(report.sessions, 0);
        assert_eq!(
            report.outbox_depth, 1,
            "the spooled report waits in the outbox"
        );
        // The outbox was closed and its lock released.
        let (outbox, summary) = Outbox::open(dir.path()).expect("reopen");
        assert_eq!(summary.pending_messages, 1);
        outbox.close().await;
    }

    /// Spool `n` events and run the daemon without a hub (keeping at most 3) until the spool is
    /// empty; returns the ids spooled, oldest first.
    async fn spool_and_run_without_hub(
        dir: &std::path::Path,
        metrics: &std::path::Path,
        n: u128,
    ) -> Vec<hub_protocol::MessageId> {
        let mut ids = Vec::new();
        for i in 0..n {
            ids.push(
                spool(
                    dir,
                    hub_protocol::AgentMessage::Event(hub_protocol::Event {
                        txn: TxnId::from_ulid(ulid::Ulid::from_parts(1_767_225_600_000, i)),
                        kind: hub_protocol::TxnKind::Provision,
                        vmid: Some(120),
                        phase: hub_protocol::Phase::Validated,
                        at: outbox::now_timestamp().expect("now"),
                        detail: None,
                        error: None,
                        guest: None,
                        backup: None,
                    }),
                )
                .expect("spool"),
            );
            // Spool files are taken in name order: one id per millisecond keeps the order.
            std::thread::sleep(Duration::from_millis(2));
        }
        let shutdown = CancellationToken::new();
        let stopper = shutdown.clone();
        let spool_dir = dir.join(outbox::OUTBOX_DIR).join(outbox::SPOOL_DIR);
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            while std::fs::read_dir(&spool_dir).is_ok_and(|mut d| d.next().is_some())
                && Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            stopper.cancel();
        });
        let mut settings = settings(dir);
        settings.metrics_dir = Some(metrics.to_path_buf());
        settings.keep_without_hub = outbox::Retention {
            max_messages: 3,
            max_age: Duration::from_secs(86_400),
        };
        let report = run_daemon(
            settings,
            Arc::new(RefusingRunner),
            Arc::new(NoInventory),
            Notifier::disabled(),
            shutdown,
        )
        .await
        .expect("run");
        assert_eq!(report.outbox_depth, 3, "the outbox keeps 3");
        ids
    }

    /// The ids waiting in the outbox, read back from its files.
    async fn waiting(dir: &std::path::Path) -> Vec<hub_protocol::MessageId> {
        let (outbox, _) = Outbox::open(dir).expect("reopen");
        let ids = outbox
            .pending_after(0)
            .await
            .expect("read")
            .iter()
            .map(|o| o.id)
            .collect();
        outbox.close().await;
        ids
    }

    #[tokio::test]
    async fn without_a_hub_the_oldest_reports_go_past_the_bound_and_the_count_outlives_a_restart() {
        let dir = tempfile::tempdir().expect("tmp");
        let metrics = tempfile::tempdir().expect("tmp");
        let hub_prom = metrics.path().join(crate::metrics::HUB_FILE);
        let first = spool_and_run_without_hub(dir.path(), metrics.path(), 5).await;
        assert_eq!(waiting(dir.path()).await, first[2..].to_vec());
        let dropped = crate::outbox_keep::read(&dir.path().join(outbox::OUTBOX_DIR))
            .expect("read")
            .expect("a count");
        assert_eq!(dropped.count, 2);
        let text = std::fs::read_to_string(&hub_prom).expect("metrics");
        assert!(
            text.contains("\nfelhom_outbox_dropped_total 2\n")
                && text.contains("felhom_outbox_depth 3\n"),
            "{text}"
        );
        // Started again: the count goes on from what the first run stored.
        let second = spool_and_run_without_hub(dir.path(), metrics.path(), 2).await;
        assert_eq!(
            waiting(dir.path()).await,
            vec![first[4], second[0], second[1]]
        );
        let again = crate::outbox_keep::read(&dir.path().join(outbox::OUTBOX_DIR))
            .expect("read")
            .expect("a count");
        assert_eq!(again.count, 4);
        assert_eq!(again.since, dropped.since, "the first drop's time stays");
        let text = std::fs::read_to_string(&hub_prom).expect("metrics");
        assert!(text.contains("\nfelhom_outbox_dropped_total 4\n"), "{text}");
    }

    #[tokio::test]
    async fn a_failed_prepare_stops_run_and_releases_the_outbox() {
        let dir = tempfile::tempdir().expect("tmp");
        let err = run_daemon(
            settings(dir.path()),
            Arc::new(FailingPrepare),
            Arc::new(NoInventory),
            Notifier::disabled(),
            CancellationToken::new(),
        )
        .await
        .unwrap_err();
        assert_eq!(err.code, ErrorCode::PveUnreachable);
        let (outbox, _) = Outbox::open(dir.path()).expect("the lock was released");
        outbox.close().await;
    }

    #[tokio::test]
    async fn a_second_run_on_the_same_state_dir_is_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        let (outbox, _) = Outbox::open(dir.path()).expect("open");
        let err = run_daemon(
            settings(dir.path()),
            Arc::new(RefusingRunner),
            Arc::new(NoInventory),
            Notifier::disabled(),
            CancellationToken::new(),
        )
        .await
        .unwrap_err();
        assert_eq!(err.code, ErrorCode::ConfigInvalid);
        assert!(err.message.contains("already running"), "{}", err.message);
        outbox.close().await;
    }
}
