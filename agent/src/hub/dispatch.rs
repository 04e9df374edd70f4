//! Dispatches from the hub: accepted durably, run with bounded concurrency and per-vmid
//! exclusion, idempotent by transaction id, reported through the outbox.
//!
//! The work itself is behind the [`DispatchRunner`] seam (the provision executor implements
//! it); an `inventory_request` is answered here through [`InventoryRead`]. The order for a
//! transaction dispatch is:
//!
//! 1. A transaction already running or queued in this process is not started again; the
//!    dispatch is acknowledged once the first copy is stored, and its result follows.
//! 2. A transaction the runner already finished ([`DispatchRunner::state_of`]) is not run
//!    again: its result is stored again under the same derived message id (the hub applies it
//!    once) and the dispatch is acknowledged.
//! 3. Otherwise the dispatch is stored in the inbox (synced) and only then acknowledged; it is
//!    run when its vmid is free and one of [`MAX_CONCURRENT_TRANSACTIONS`] slots is free; its
//!    result is stored in the outbox and the inbox entry is closed. A dispatch still open at
//!    start (the agent died) is run again: the runner settles or resumes it from its journal.
//!
//! Nothing here talks to the hub: acknowledgements go out through a channel the session
//! drains, results through the outbox.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hub_protocol::{
    capability, AgentMessage, Dispatch, DispatchAction, ErrorCode, ErrorInfo, Event, Inventory,
    MessageId, Outcome, Phase, TxnId, TxnKind, TxnResult,
};
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use super::outbox::{now_timestamp, Outbox, OutboxError};
use crate::error::Failure;

/// Transactions that run at once. More wait for a slot.
pub const MAX_CONCURRENT_TRANSACTIONS: usize = 2;
/// Inventory reads that run at once (each is one PVE request and one `.vmlist` read).
pub const MAX_CONCURRENT_INVENTORY_READS: usize = 1;

/// How a transaction run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunEnd {
    /// The transaction ended; this is its result.
    Finished(Box<TxnResult>),
    /// The agent is shutting down and the transaction stopped at a journaled step before it
    /// ended. Its dispatch stays open and is run again (resumed) when the agent starts.
    Interrupted,
}

/// The seam to the work a dispatch asks for: provision, destroy, restore-test.
///
/// The dispatcher calls [`DispatchRunner::run`] at most once at a time per transaction, with
/// the vmid of the dispatch (and the restore-test band) free of other dispatches of this
/// process. `run` may be called for a transaction the runner has seen before (a dispatch still
/// open after a crash): it must then settle or resume it from its journal and never repeat a
/// write. It reports phase changes through `events` and returns the final result, or
/// [`RunEnd::Interrupted`] once `cancel` fired and it stopped at a journaled step.
pub trait DispatchRunner: Send + Sync + 'static {
    /// The capability names this runner provides ([`hub_protocol::capability`]); the hello
    /// announces them (and `inventory`, which the dispatcher provides itself).
    fn capabilities(&self) -> Vec<&'static str>;

    /// Called once when `run` starts, before READY and before any dispatch is taken or
    /// resumed: the local start only (configuration, journal, PVE client), quick whatever PVE
    /// and the hub do. An error stops `run` with that failure (systemd starts it again). The
    /// default does nothing.
    fn prepare(
        &self,
        outbox: &Outbox,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<(), Failure>> + Send {
        let _ = (outbox, cancel);
        async { Ok(()) }
    }

    /// Called once after READY, in a task of its own while the session runs: take up the
    /// transactions a stopped run left open that no open dispatch (`dispatched`, which the
    /// dispatcher resumes itself) owns, reporting their phases and results to `outbox`; each
    /// resumes from its last journaled step (DESIGN rule 6). `cancel` (the shutdown) stops the
    /// waiting, never PVE's work. The default does nothing.
    fn take_up_leftovers(
        &self,
        outbox: &Outbox,
        dispatched: Vec<TxnId>,
        cancel: CancellationToken,
    ) -> impl Future<Output = ()> + Send {
        let _ = (outbox, dispatched, cancel);
        async {}
    }

    /// Run one transaction dispatch (never an `inventory_request`).
    fn run(
        &self,
        dispatch: Dispatch,
        events: EventSink,
        cancel: CancellationToken,
    ) -> impl Future<Output = RunEnd> + Send;

    /// The result of transaction `txn` if it already ended on this node (read from the
    /// journal), so that a re-dispatch returns it instead of running it again. `None` for a
    /// transaction that is unknown or still open.
    fn state_of(&self, txn: TxnId) -> Option<TxnResult>;
}

/// Reads the inventory the hub may see: pool guests, and foreign vmids as bare numbers.
pub trait InventoryRead: Send + Sync + 'static {
    /// The current inventory, with `request: None`.
    fn read(&self) -> impl Future<Output = Result<Inventory, Failure>> + Send;
}

/// Where a running transaction reports its phase changes: each event is stored in the outbox
/// (synced) before `emit` returns, and reaches the hub when a session is up.
#[derive(Debug, Clone)]
pub struct EventSink {
    outbox: Outbox,
    txn: TxnId,
    kind: TxnKind,
    vmid: Option<u32>,
}

impl EventSink {
    /// A sink for transaction `txn`.
    pub fn new(outbox: Outbox, txn: TxnId, kind: TxnKind, vmid: Option<u32>) -> Self {
        Self {
            outbox,
            txn,
            kind,
            vmid,
        }
    }

    /// The transaction.
    pub fn txn(&self) -> TxnId {
        self.txn
    }

    /// The outbox the events go to.
    pub fn outbox(&self) -> &Outbox {
        &self.outbox
    }

    /// Set the vmid once the transaction has one (the restore-test picks it from its band).
    pub fn set_vmid(&mut self, vmid: Option<u32>) {
        self.vmid = vmid;
    }

    /// Report that the transaction reached `phase` now.
    pub async fn phase(
        &self,
        phase: Phase,
        detail: Option<String>,
        error: Option<ErrorInfo>,
    ) -> Result<MessageId, OutboxError> {
        let at = now_timestamp().map_err(|e| OutboxError::Encode {
            type_name: "event",
            id: MessageId::from_ulid(self.txn.ulid()),
            detail: e.to_string(),
        })?;
        self.emit(Event {
            txn: self.txn,
            kind: self.kind,
            vmid: self.vmid,
            phase,
            at,
            detail,
            error,
            guest: None,
            backup: None,
        })
        .await
    }

    /// Store an event as it is.
    pub async fn emit(&self, event: Event) -> Result<MessageId, OutboxError> {
        self.outbox.push(AgentMessage::Event(event)).await
    }
}

/// The runner of an agent that runs no transactions: it announces no transaction capability
/// and answers every provision, destroy or restore-test dispatch at once with outcome
/// `refused`, phase `planned` and error code `config_invalid` (nothing was touched). The
/// dispatcher still answers inventory requests.
#[derive(Debug, Clone, Copy, Default)]
pub struct RefusingRunner;

impl RefusingRunner {
    /// The result of a refused dispatch.
    pub fn refusal(dispatch: &Dispatch) -> TxnResult {
        let (kind, vmid, action) = match &dispatch.action {
            DispatchAction::Provision { vmid, .. } => {
                (TxnKind::Provision, Some(*vmid), "provision")
            }
            DispatchAction::Destroy { vmid } => (TxnKind::Destroy, Some(*vmid), "destroy"),
            DispatchAction::RestoreTest { .. } => (TxnKind::SelftestRestore, None, "restore_test"),
            DispatchAction::InventoryRequest => (TxnKind::Provision, None, "inventory_request"),
        };
        TxnResult {
            txn: dispatch.txn,
            kind,
            vmid,
            outcome: Outcome::Refused,
            phase: Phase::Planned,
            destroy_armed: false,
            destroyed: false,
            checks: Vec::new(),
            isolation: None,
            guest: None,
            backup: None,
            error: Some(ErrorInfo {
                code: ErrorCode::ConfigInvalid,
                message: format!(
                    "this agent does not run `{action}` dispatches (it did not announce the \
                     capability); transaction {} was refused before any write, nothing was \
                     touched",
                    dispatch.txn
                ),
            }),
            group: None,
        }
    }
}

impl DispatchRunner for RefusingRunner {
    fn capabilities(&self) -> Vec<&'static str> {
        Vec::new()
    }

    async fn run(
        &self,
        dispatch: Dispatch,
        _events: EventSink,
        _cancel: CancellationToken,
    ) -> RunEnd {
        RunEnd::Finished(Box::new(Self::refusal(&dispatch)))
    }

    fn state_of(&self, _txn: TxnId) -> Option<TxnResult> {
        None
    }
}

/// Counts spawned tasks so that shutdown can wait for them.
#[derive(Debug, Clone, Default)]
struct Tracker(Arc<TrackerInner>);

#[derive(Debug, Default)]
struct TrackerInner {
    count: AtomicUsize,
    idle: Notify,
}

impl Tracker {
    fn spawn<F>(&self, future: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.0.count.fetch_add(1, Ordering::SeqCst);
        let tracker = self.clone();
        tokio::spawn(async move {
            future.await;
            if tracker.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
                tracker.0.idle.notify_waiters();
            }
        });
    }

    async fn wait(&self) {
        loop {
            let notified = self.0.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.0.count.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }

    fn len(&self) -> usize {
        self.0.count.load(Ordering::SeqCst)
    }
}

/// What excludes two dispatches from running at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum ExclusionKey {
    Vmid(u32),
    RestoreBand,
}

fn exclusion_key(action: &DispatchAction) -> Option<ExclusionKey> {
    match action {
        DispatchAction::Provision { vmid, .. } | DispatchAction::Destroy { vmid } => {
            Some(ExclusionKey::Vmid(*vmid))
        }
        DispatchAction::RestoreTest { .. } => Some(ExclusionKey::RestoreBand),
        DispatchAction::InventoryRequest => None,
    }
}

#[derive(Debug, Default)]
struct ActiveTxn {
    stored: bool,
    waiting_acks: Vec<MessageId>,
}

struct Inner<R, I> {
    runner: Arc<R>,
    inventory: Arc<I>,
    outbox: Outbox,
    slots: Semaphore,
    inventory_slots: Semaphore,
    keys: Mutex<HashMap<ExclusionKey, Arc<tokio::sync::Mutex<()>>>>,
    active: Mutex<HashMap<TxnId, ActiveTxn>>,
    running: AtomicU32,
    tasks: Tracker,
    cancel: CancellationToken,
    acks: mpsc::UnboundedSender<MessageId>,
}

/// Runs dispatches; cheap to clone. See the module docs.
pub struct Dispatcher<R, I> {
    inner: Arc<Inner<R, I>>,
}

impl<R, I> Clone for Dispatcher<R, I> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<R: DispatchRunner, I: InventoryRead> Dispatcher<R, I> {
    /// A dispatcher; acknowledgements of hub messages are sent into `acks`.
    pub fn new(
        runner: Arc<R>,
        inventory: Arc<I>,
        outbox: Outbox,
        acks: mpsc::UnboundedSender<MessageId>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                runner,
                inventory,
                outbox,
                slots: Semaphore::new(MAX_CONCURRENT_TRANSACTIONS),
                inventory_slots: Semaphore::new(MAX_CONCURRENT_INVENTORY_READS),
                keys: Mutex::new(HashMap::new()),
                active: Mutex::new(HashMap::new()),
                running: AtomicU32::new(0),
                tasks: Tracker::default(),
                cancel: CancellationToken::new(),
                acks,
            }),
        }
    }

    /// The capabilities to announce: the runner's and `inventory`.
    pub fn capabilities(&self) -> Vec<String> {
        let mut caps: Vec<String> = self
            .inner
            .runner
            .capabilities()
            .into_iter()
            .map(str::to_string)
            .collect();
        caps.push(capability::INVENTORY.to_string());
        caps.sort();
        caps.dedup();
        caps
    }

    /// Transactions running now.
    pub fn in_flight(&self) -> u32 {
        self.inner.running.load(Ordering::Relaxed)
    }

    /// Dispatches accepted and not finished (queued or running) in this process.
    pub fn active(&self) -> usize {
        self.inner.active.lock().map(|a| a.len()).unwrap_or(0)
    }

    /// Whether shutdown has begun (new dispatches are no longer accepted).
    pub fn stopping(&self) -> bool {
        self.inner.cancel.is_cancelled()
    }

    /// Run again the dispatches left open by an earlier run of the agent.
    pub async fn resume(&self) -> Result<usize, OutboxError> {
        let open = self.inner.outbox.open_dispatches().await?;
        let count = open.len();
        for dispatch in open {
            if let Ok(mut active) = self.inner.active.lock() {
                active.insert(
                    dispatch.txn,
                    ActiveTxn {
                        stored: true,
                        waiting_acks: Vec::new(),
                    },
                );
            }
            tracing::info!(
                txn = %dispatch.txn,
                "resuming dispatch {} left open by an earlier run",
                dispatch.txn
            );
            let this = self.clone();
            self.inner.tasks.spawn(async move {
                this.settle_or_execute(dispatch).await;
            });
        }
        Ok(count)
    }

    /// Take a dispatch the hub sent as message `message_id`. Returns at once; the message is
    /// acknowledged (through the acks channel) once the dispatch is stored durably, or, for an
    /// inventory request, once the inventory answering it is stored.
    pub fn accept(&self, message_id: MessageId, dispatch: Dispatch) {
        if self.stopping() {
            // Not acknowledged: the hub sends it again to the next run of the agent.
            tracing::info!(
                txn = %dispatch.txn,
                "shutting down: dispatch {} is left for the next run",
                dispatch.txn
            );
            return;
        }
        if matches!(dispatch.action, DispatchAction::InventoryRequest) {
            let this = self.clone();
            self.inner.tasks.spawn(async move {
                this.answer_inventory_request(message_id, dispatch.txn)
                    .await;
            });
            return;
        }
        {
            let Ok(mut active) = self.inner.active.lock() else {
                return;
            };
            if let Some(entry) = active.get_mut(&dispatch.txn) {
                tracing::info!(
                    txn = %dispatch.txn,
                    "dispatch {} is already queued or running; it is not started again",
                    dispatch.txn
                );
                if entry.stored {
                    let _ = self.inner.acks.send(message_id);
                } else {
                    entry.waiting_acks.push(message_id);
                }
                return;
            }
            active.insert(
                dispatch.txn,
                ActiveTxn {
                    stored: false,
                    waiting_acks: vec![message_id],
                },
            );
        }
        let this = self.clone();
        self.inner.tasks.spawn(async move {
            this.take(dispatch).await;
        });
    }

    async fn take(&self, dispatch: Dispatch) {
        let txn = dispatch.txn;
        if let Some(result) = self.inner.runner.state_of(txn) {
            tracing::info!(
                txn = %txn,
                "transaction {txn} already ended ({:?}); reporting its result again instead of \
                 running it",
                result.outcome
            );
            match self.inner.outbox.push(AgentMessage::Result(result)).await {
                Ok(_) => {
                    self.mark_stored(txn);
                }
                Err(e) => tracing::error!(txn = %txn, "cannot store the result of {txn}: {e}"),
            }
            self.forget(txn);
            return;
        }
        if let Err(e) = self.inner.outbox.accept_dispatch(&dispatch).await {
            // Not acknowledged: the hub keeps it and sends it again.
            tracing::error!(txn = %txn, "cannot store dispatch {txn}, it is not accepted: {e}");
            self.forget(txn);
            return;
        }
        self.mark_stored(txn);
        self.execute(dispatch).await;
    }

    async fn settle_or_execute(&self, dispatch: Dispatch) {
        let txn = dispatch.txn;
        if let Some(result) = self.inner.runner.state_of(txn) {
            self.report(txn, result).await;
            self.forget(txn);
            return;
        }
        self.execute(dispatch).await;
    }

    async fn execute(&self, dispatch: Dispatch) {
        let txn = dispatch.txn;
        let cancel = self.inner.cancel.clone();
        let key_lock = exclusion_key(&dispatch.action).map(|key| self.key_lock(key));
        // Shutdown starts no queued work. `select!` picks at random among the branches ready
        // at the same poll, and a shutdown makes both ready at once: the cancel, and the lock
        // (or slot) the interrupted transaction just let go. `biased` polls the cancel first,
        // so a fired cancel always wins; the re-check after each wait covers a lock or slot
        // handed over before the cancel fired but taken after it.
        let _key_guard = match key_lock {
            Some(lock) => tokio::select! {
                biased;
                _ = cancel.cancelled() => { self.forget(txn); return; }
                guard = lock.lock_owned() => Some(guard),
            },
            None => None,
        };
        if cancel.is_cancelled() {
            self.forget(txn);
            return;
        }
        let _slot = tokio::select! {
            biased;
            _ = cancel.cancelled() => { self.forget(txn); return; }
            permit = self.inner.slots.acquire() => match permit {
                Ok(p) => p,
                Err(_) => { self.forget(txn); return; }
            },
        };
        if cancel.is_cancelled() {
            self.forget(txn);
            return;
        }
        let (kind, vmid) = match &dispatch.action {
            DispatchAction::Provision { vmid, .. } => (TxnKind::Provision, Some(*vmid)),
            DispatchAction::Destroy { vmid } => (TxnKind::Destroy, Some(*vmid)),
            DispatchAction::RestoreTest { .. } => (TxnKind::SelftestRestore, None),
            DispatchAction::InventoryRequest => (TxnKind::Provision, None),
        };
        let events = EventSink::new(self.inner.outbox.clone(), txn, kind, vmid);
        self.inner.running.fetch_add(1, Ordering::Relaxed);
        tracing::info!(txn = %txn, "running dispatch {txn}");
        let end = self.inner.runner.run(dispatch, events, cancel).await;
        self.inner.running.fetch_sub(1, Ordering::Relaxed);
        match end {
            RunEnd::Finished(result) => self.report(txn, *result).await,
            RunEnd::Interrupted => tracing::info!(
                txn = %txn,
                "transaction {txn} stopped for shutdown at a journaled step; it resumes at the \
                 next start"
            ),
        }
        self.forget(txn);
    }

    async fn report(&self, txn: TxnId, result: TxnResult) {
        let outcome = result.outcome;
        match self.inner.outbox.push(AgentMessage::Result(result)).await {
            Ok(id) => {
                tracing::info!(txn = %txn, "transaction {txn} ended {outcome:?}; result {id} stored for the hub");
                self.inner.outbox.dispatch_finished(txn);
            }
            // The dispatch stays open in the inbox: the result is stored at the next start.
            Err(e) => tracing::error!(txn = %txn, "cannot store the result of {txn}: {e}"),
        }
    }

    async fn answer_inventory_request(&self, message_id: MessageId, txn: TxnId) {
        let cancel = self.inner.cancel.clone();
        let _permit = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            p = self.inner.inventory_slots.acquire() => match p { Ok(p) => p, Err(_) => return },
        };
        if cancel.is_cancelled() {
            return;
        }
        match self.inner.inventory.read().await {
            Ok(mut inventory) => {
                inventory.request = Some(txn);
                match self
                    .inner
                    .outbox
                    .push(AgentMessage::Inventory(inventory))
                    .await
                {
                    Ok(_) => {
                        let _ = self.inner.acks.send(message_id);
                    }
                    Err(e) => tracing::error!(
                        txn = %txn,
                        "cannot store the inventory answering {txn}: {e}"
                    ),
                }
            }
            // Not acknowledged: the hub sends the request again.
            Err(f) => tracing::warn!(
                txn = %txn,
                "cannot read the inventory for request {txn}: {}",
                f.message
            ),
        }
    }

    fn key_lock(&self, key: ExclusionKey) -> Arc<tokio::sync::Mutex<()>> {
        match self.inner.keys.lock() {
            Ok(mut keys) => {
                keys.retain(|_, lock| Arc::strong_count(lock) > 1);
                keys.entry(key).or_default().clone()
            }
            Err(_) => Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    fn mark_stored(&self, txn: TxnId) {
        let waiting = match self.inner.active.lock() {
            Ok(mut active) => match active.get_mut(&txn) {
                Some(entry) => {
                    entry.stored = true;
                    std::mem::take(&mut entry.waiting_acks)
                }
                None => Vec::new(),
            },
            Err(_) => Vec::new(),
        };
        for id in waiting {
            let _ = self.inner.acks.send(id);
        }
    }

    fn forget(&self, txn: TxnId) {
        if let Ok(mut active) = self.inner.active.lock() {
            active.remove(&txn);
        }
    }

    /// Stop: refuse new dispatches, tell running transactions to stop at their next journaled
    /// step, and wait up to `grace` for every task. Returns the number still running when the
    /// grace ran out.
    pub async fn shutdown(&self, grace: Duration) -> usize {
        self.inner.cancel.cancel();
        if tokio::time::timeout(grace, self.inner.tasks.wait())
            .await
            .is_err()
        {
            let left = self.inner.tasks.len();
            tracing::warn!(
                "{left} dispatch tasks did not stop within {} s; their dispatches stay open and \
                 resume at the next start",
                grace.as_secs()
            );
            return left;
        }
        0
    }

    /// Wait until no task runs (tests).
    pub async fn idle(&self) {
        self.inner.tasks.wait().await;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::sync::atomic::AtomicBool;

    use hub_protocol::{decode, AgentEnvelope};
    use ulid::Ulid;

    use super::*;

    fn txn(n: u128) -> TxnId {
        TxnId::from_ulid(Ulid::from_parts(1_767_225_600_000, n))
    }

    fn msg(n: u128) -> MessageId {
        MessageId::from_ulid(Ulid::from_parts(1_767_225_700_000, n))
    }

    fn provision(n: u128, vmid: u32) -> Dispatch {
        Dispatch {
            txn: txn(n),
            action: DispatchAction::Provision {
                vmid,
                from: "local:backup/x.tar.zst".into(),
                storage: "local-lvm".into(),
                keep: false,
                profile: None,
                isolate_network: None,
            },
        }
    }

    struct FixedInventory;

    impl InventoryRead for FixedInventory {
        async fn read(&self) -> Result<Inventory, Failure> {
            Ok(Inventory {
                request: None,
                guests: vec![],
                foreign_vmids: vec![101],
            })
        }
    }

    /// Records concurrency; each run waits until released.
    struct GatedRunner {
        gate: tokio::sync::Semaphore,
        running: Mutex<HashSet<u32>>,
        max_parallel: AtomicUsize,
        overlap_same_vmid: AtomicBool,
        runs: Mutex<Vec<TxnId>>,
        finished: Mutex<HashMap<TxnId, TxnResult>>,
    }

    impl Default for GatedRunner {
        fn default() -> Self {
            Self {
                gate: tokio::sync::Semaphore::new(0),
                running: Mutex::default(),
                max_parallel: AtomicUsize::default(),
                overlap_same_vmid: AtomicBool::default(),
                runs: Mutex::default(),
                finished: Mutex::default(),
            }
        }
    }

    impl DispatchRunner for GatedRunner {
        fn capabilities(&self) -> Vec<&'static str> {
            vec![capability::PROVISION]
        }

        async fn run(
            &self,
            dispatch: Dispatch,
            events: EventSink,
            cancel: CancellationToken,
        ) -> RunEnd {
            let DispatchAction::Provision { vmid, .. } = dispatch.action else {
                return RunEnd::Finished(Box::new(RefusingRunner::refusal(&dispatch)));
            };
            {
                let mut running = self.running.lock().expect("lock");
                if !running.insert(vmid) {
                    self.overlap_same_vmid.store(true, Ordering::SeqCst);
                }
                self.max_parallel.fetch_max(running.len(), Ordering::SeqCst);
            }
            self.runs.lock().expect("lock").push(dispatch.txn);
            events
                .phase(Phase::Validated, None, None)
                .await
                .expect("event");
            let end = tokio::select! {
                p = self.gate.acquire() => { p.expect("gate").forget(); None }
                _ = cancel.cancelled() => Some(RunEnd::Interrupted),
            };
            self.running.lock().expect("lock").remove(&vmid);
            if let Some(end) = end {
                return end;
            }
            let result = TxnResult {
                outcome: Outcome::Ok,
                phase: Phase::Reported,
                isolation: None,
                error: None,
                ..RefusingRunner::refusal(&dispatch)
            };
            self.finished
                .lock()
                .expect("lock")
                .insert(dispatch.txn, result.clone());
            RunEnd::Finished(Box::new(result))
        }

        fn state_of(&self, txn: TxnId) -> Option<TxnResult> {
            self.finished.lock().expect("lock").get(&txn).cloned()
        }
    }

    async fn stored(outbox: &Outbox) -> Vec<AgentEnvelope> {
        outbox
            .pending_after(0)
            .await
            .expect("read")
            .into_iter()
            .map(|o| decode(&o.frame).expect("decode"))
            .collect()
    }

    fn results(envs: &[AgentEnvelope]) -> Vec<(MessageId, TxnId)> {
        envs.iter()
            .filter_map(|e| match &e.message {
                AgentMessage::Result(r) => Some((e.id, r.txn)),
                _ => None,
            })
            .collect()
    }

    async fn wait_for(what: &str, mut check: impl FnMut() -> bool) {
        for _ in 0..500 {
            if check() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for {what}");
    }

    fn setup(
        dir: &std::path::Path,
    ) -> (
        Dispatcher<GatedRunner, FixedInventory>,
        Arc<GatedRunner>,
        Outbox,
        mpsc::UnboundedReceiver<MessageId>,
    ) {
        let (outbox, _) = Outbox::open(dir).expect("open");
        let runner = Arc::new(GatedRunner::default());
        let (tx, rx) = mpsc::unbounded_channel();
        let d = Dispatcher::new(runner.clone(), Arc::new(FixedInventory), outbox.clone(), tx);
        (d, runner, outbox, rx)
    }

    #[tokio::test]
    async fn bounded_concurrency_and_one_run_per_vmid_at_a_time() {
        let dir = tempfile::tempdir().expect("tmp");
        let (d, runner, outbox, mut acks) = setup(dir.path());
        // Three on vmid 120, one each on 121 and 122.
        for (n, vmid) in [(1, 120), (2, 120), (3, 121), (4, 120), (5, 122)] {
            d.accept(msg(n), provision(n, vmid));
        }
        wait_for("two running", || {
            runner.running.lock().expect("l").len() == 2
        })
        .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(d.in_flight(), 2);
        runner.gate.add_permits(5);
        wait_for("all done", || runner.runs.lock().expect("l").len() == 5).await;
        d.idle().await;
        assert!(runner.max_parallel.load(Ordering::SeqCst) <= MAX_CONCURRENT_TRANSACTIONS);
        assert!(!runner.overlap_same_vmid.load(Ordering::SeqCst));
        let mut acked = Vec::new();
        while let Ok(id) = acks.try_recv() {
            acked.push(id);
        }
        acked.sort();
        assert_eq!(acked, (1..=5).map(msg).collect::<Vec<_>>());
        let envs = stored(&outbox).await;
        let res = results(&envs);
        assert_eq!(res.len(), 5);
        for (id, t) in &res {
            assert_eq!(*id, crate::hub::outbox::derived_message_id(*t, "result"));
        }
        assert_eq!(outbox.open_dispatches().await.expect("read").len(), 0);
        outbox.close().await;
    }

    #[tokio::test]
    async fn a_re_dispatch_never_runs_a_transaction_twice() {
        let dir = tempfile::tempdir().expect("tmp");
        let (d, runner, outbox, mut acks) = setup(dir.path());
        d.accept(msg(1), provision(1, 130));
        wait_for("running", || runner.runs.lock().expect("l").len() == 1).await;
        // While it runs: the same transaction again, under a new message id.
        d.accept(msg(2), provision(1, 130));
        runner.gate.add_permits(1);
        d.idle().await;
        // After it ended: once more.
        d.accept(msg(3), provision(1, 130));
        d.idle().await;
        assert_eq!(runner.runs.lock().expect("l").len(), 1, "ran twice");
        let mut acked = Vec::new();
        while let Ok(id) = acks.try_recv() {
            acked.push(id);
        }
        acked.sort();
        assert_eq!(acked, vec![msg(1), msg(2), msg(3)]);
        let envs = stored(&outbox).await;
        assert_eq!(results(&envs).len(), 1, "one result message for the hub");
        outbox.close().await;
    }

    #[tokio::test]
    async fn shutdown_interrupts_and_the_dispatch_resumes_at_the_next_start() {
        let dir = tempfile::tempdir().expect("tmp");
        {
            let (d, runner, outbox, _acks) = setup(dir.path());
            d.accept(msg(1), provision(1, 140));
            d.accept(msg(2), provision(2, 140));
            wait_for("running", || runner.runs.lock().expect("l").len() == 1).await;
            assert_eq!(d.shutdown(Duration::from_secs(5)).await, 0);
            // Refused while stopping: not acknowledged, not stored.
            d.accept(msg(3), provision(3, 141));
            d.idle().await;
            assert_eq!(runner.runs.lock().expect("l").len(), 1);
            assert_eq!(outbox.open_dispatches().await.expect("read").len(), 2);
            outbox.close().await;
        }
        let (d, runner, outbox, _acks) = setup(dir.path());
        runner.gate.add_permits(2);
        assert_eq!(d.resume().await.expect("resume"), 2);
        d.idle().await;
        let runs = runner.runs.lock().expect("l").clone();
        assert_eq!(runs, vec![txn(1), txn(2)], "resumed in order");
        assert_eq!(outbox.open_dispatches().await.expect("read").len(), 0);
        let envs = stored(&outbox).await;
        let mut txns: Vec<TxnId> = results(&envs).into_iter().map(|(_, t)| t).collect();
        txns.sort();
        assert_eq!(txns, vec![txn(1), txn(2)]);
        outbox.close().await;
    }

    /// The moment of a shutdown where `select!` used to pick at random: the cancel fires and,
    /// before any queued dispatch is polled again, the vmid locks and the slots they wait for
    /// come free (as when the interrupted transactions let go of theirs). Each round queues
    /// dispatches behind held vmid locks and behind held slots, then fires the cancel and lets
    /// go of the locks and slots with no await in between. A random pick starts some of them
    /// in nearly every round; none may start.
    #[tokio::test]
    async fn shutdown_starts_no_queued_dispatch_when_its_lock_and_slot_come_free_with_it() {
        const ROUNDS: u128 = 16;
        const PER_GROUP: u128 = 4;
        for round in 0..ROUNDS {
            let dir = tempfile::tempdir().expect("tmp");
            let (d, runner, outbox, _acks) = setup(dir.path());
            let slots = d
                .inner
                .slots
                .acquire_many(MAX_CONCURRENT_TRANSACTIONS as u32)
                .await
                .expect("slots");
            let mut locks = Vec::new();
            for k in 0..PER_GROUP {
                let vmid = 200 + k as u32;
                locks.push(d.key_lock(ExclusionKey::Vmid(vmid)).lock_owned().await);
            }
            let base = round * 100;
            for k in 0..PER_GROUP {
                // Behind a held vmid lock.
                d.accept(msg(base + k), provision(base + k, 200 + k as u32));
                // Its vmid free, behind the held slots.
                d.accept(msg(base + 50 + k), provision(base + 50 + k, 300 + k as u32));
            }
            let want = 2 * PER_GROUP as usize;
            // Stored, so queued (or about to queue) behind their lock or slot.
            let stored = std::time::Instant::now();
            while outbox.open_dispatches().await.expect("read").len() < want {
                assert!(
                    stored.elapsed() < Duration::from_secs(30),
                    "dispatches not stored"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            // No await between the cancel and the release: at their next poll the queued
            // dispatches find the cancel and their lock or slot ready together.
            d.inner.cancel.cancel();
            drop(locks);
            drop(slots);
            assert_eq!(d.shutdown(Duration::from_secs(5)).await, 0);
            let runs = runner.runs.lock().expect("l").clone();
            assert!(
                runs.is_empty(),
                "round {round}: {} queued dispatches started after the cancel fired: {runs:?}",
                runs.len()
            );
            assert_eq!(
                outbox.open_dispatches().await.expect("read").len(),
                want,
                "every queued dispatch stays open for the next start"
            );
            outbox.close().await;
        }
    }

    #[tokio::test]
    async fn inventory_requests_are_answered_then_acked() {
        let dir = tempfile::tempdir().expect("tmp");
        let (d, _runner, outbox, mut acks) = setup(dir.path());
        d.accept(
            msg(9),
            Dispatch {
                txn: txn(9),
                action: DispatchAction::InventoryRequest,
            },
        );
        d.idle().await;
        assert_eq!(acks.try_recv().ok(), Some(msg(9)));
        let envs = stored(&outbox).await;
        assert_eq!(envs.len(), 1);
        let AgentMessage::Inventory(inv) = &envs[0].message else {
            panic!("not an inventory: {envs:?}");
        };
        assert_eq!(inv.request, Some(txn(9)));
        assert_eq!(
            envs[0].id,
            crate::hub::outbox::derived_message_id(txn(9), "inventory")
        );
        outbox.close().await;
    }

    #[tokio::test]
    async fn the_refusing_runner_refuses_before_any_write() {
        let dir = tempfile::tempdir().expect("tmp");
        let (outbox, _) = Outbox::open(dir.path()).expect("open");
        let (tx, mut acks) = mpsc::unbounded_channel();
        let d = Dispatcher::new(
            Arc::new(RefusingRunner),
            Arc::new(FixedInventory),
            outbox.clone(),
            tx,
        );
        assert_eq!(d.capabilities(), vec!["inventory".to_string()]);
        d.accept(msg(1), provision(1, 150));
        d.idle().await;
        assert_eq!(acks.try_recv().ok(), Some(msg(1)));
        let envs = stored(&outbox).await;
        let AgentMessage::Result(r) = &envs[0].message else {
            panic!("{envs:?}")
        };
        assert_eq!(r.outcome, Outcome::Refused);
        assert_eq!(r.phase, Phase::Planned);
        assert_eq!(
            r.error.as_ref().map(|e| e.code),
            Some(ErrorCode::ConfigInvalid)
        );
        assert!(!r.destroy_armed && !r.destroyed);
        outbox.close().await;
    }
}
