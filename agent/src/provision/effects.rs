//! The one executor of the provision machine's effects.
//!
//! It drives a [`State`] with [`step`] (or [`recover`], [`resume`]) and performs every [`Effect`] through
//! the PVE client, the full guest list and the guest exec seam, in order: the journal record
//! first (fsynced), then the PVE write it announces (write-ahead). It holds no decision of its
//! own about ownership: whether a destroy may happen is the machine's, and this module only
//! reports what it observed.
//!
//! With the `test-hooks` feature (test builds only; the package is built without it) a kill
//! switch in the environment (see `KILL_AT_ENV`) lets the crash tests SIGKILL the process at a
//! phase boundary: just before or just after the N-th journal record.

use std::collections::BTreeSet;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::journal::Journal;
use super::machine::{
    recover, resume, step, Effect, Event, GuestView, Marker, PlanStep, RecoveryObservation, State,
    SubmitProbe, TaskExit, TaskObservation, TxnKind,
};
use crate::config::Config;
use crate::error::{ErrorCode, Failure};
use crate::guest::checks::CheckResult;
use crate::guest::exec::{DynGuestExec, LxcExecFactory};
use crate::guest::exec::{ExecRequest, GuestExec, GuestRef};
use crate::guest::lxc::PctConfig;
use crate::guest::qemu::{QemuConfig, QemuExec};
use crate::inventory::GuestType;
use crate::pve::guest_config::{
    is_net_key, is_qemu_tar_archive, is_true, isolation_breaches, Nic, StoredConfig,
    StoredConfigText,
};
use crate::pve::request::{LxcRestore, QemuRestore};
use crate::pve::{wait_task, ApiErrorKind, GuestKind, PveClient, PveError, Upid, WaitOptions};
use serde_json::Value;

mod guest;
mod lab;

/// A guest's configuration as `GET …/config` answers it.
type GuestConfig = std::collections::BTreeMap<String, Value>;

/// A guest's name as a config read of this run gave it, for the checks' `{hostname}`.
#[derive(Debug, Clone)]
struct GuestName {
    vmid: u32,
    /// `hostname` (a container), `name` (a VM); empty when unset.
    name: String,
    /// A VM with a cloud-init drive: the names PVE writes into it.
    cloudinit: Option<crate::pve::guest_config::CloudInitName>,
}

impl GuestName {
    fn of(vmid: u32, guest: GuestKind, cfg: &GuestConfig) -> Self {
        let text = |v: &Value| match v {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            Value::Bool(b) => u8::from(*b).to_string(),
            _ => String::new(),
        };
        let key = if guest == GuestKind::Lxc {
            "hostname"
        } else {
            "name"
        };
        let cloudinit = (guest == GuestKind::Qemu).then(|| {
            let values: Vec<(&str, String)> =
                cfg.iter().map(|(k, v)| (k.as_str(), text(v))).collect();
            let pairs: Vec<(&str, &str)> = values.iter().map(|(k, v)| (*k, v.as_str())).collect();
            crate::pve::guest_config::cloudinit_name(&pairs, vmid)
        });
        GuestName {
            vmid,
            name: cfg
                .get(key)
                .and_then(|v| v.as_str())
                .unwrap_or("")
                .to_string(),
            cloudinit: cloudinit.flatten(),
        }
    }
}

/// How long a restore task may run.
pub const RESTORE_TIMEOUT: Duration = Duration::from_secs(4 * 3600);
/// How long a start, stop or destroy task may run.
pub const POWER_TIMEOUT: Duration = Duration::from_secs(600);
/// How long the guest may take to answer its first exec after the start, unless
/// `[provision] launch_timeout_secs` says otherwise.
pub const LAUNCH_PROOF_TIMEOUT: Duration = Duration::from_secs(180);
/// How long a destroyed guest may take to leave the full guest list.
pub const CONFIRM_GONE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the node's task list and full guest list are searched after a restore request
/// whose answer is unknown, before "nothing was created" is concluded (the request may still be
/// on its way through pveproxy to pvedaemon, whose create takes the config lock first).
pub const SUBMIT_SETTLE: Duration = Duration::from_secs(30);
/// How long a guest of ours that a backup holds (config `lock: backup`) is waited for before
/// its destroy: vzdump locks each guest it backs up for the whole backup (pve-manager
/// `PVE/VZDump.pm`), and PVE refuses to stop or destroy a locked guest. Longer, the guest is
/// left for a human with the command.
pub const BACKUP_LOCK_WAIT: Duration = Duration::from_secs(2 * 3600);
/// How often a backup-locked guest is read again while it is waited for.
const BACKUP_LOCK_POLL: Duration = Duration::from_secs(5);
/// Test hook (only with the `test-hooks` feature): [`BACKUP_LOCK_WAIT`] in milliseconds.
#[cfg(feature = "test-hooks")]
pub const BACKUP_LOCK_WAIT_ENV: &str = "FELHOM_AGENT_BACKUP_LOCK_WAIT_MS";
/// At most this many rows of the node's task list are read per search.
pub const TASK_LIST_LIMIT: u32 = 500;
/// Test hook (only with the `test-hooks` feature): the settle window of the task search, in
/// milliseconds, instead of [`SUBMIT_SETTLE`].
#[cfg(feature = "test-hooks")]
pub const SUBMIT_SETTLE_ENV: &str = "FELHOM_AGENT_SUBMIT_SETTLE_MS";
/// The bootstrap profile a provision runs.
pub const DEFAULT_PROFILE: &str = "default";
/// Test hook (only with the `test-hooks` feature): `before-journal:N` or `after-journal:N`
/// SIGKILLs the process at that journal record (1-based, counted per process).
#[cfg(feature = "test-hooks")]
pub const KILL_AT_ENV: &str = "FELHOM_AGENT_KILL_AT";

/// Where the executor reports phase changes and the final result (the outbox for the hub).
pub trait Reporter: Send + Sync {
    /// A transaction's state was journaled (a phase change, or a step within a phase) as its
    /// `record`-th journal record. The record number is the event's identity: the same record
    /// reported again (after a crash between the journal record and the report) is applied
    /// once by the hub. A reporter that keeps events must have stored this one durably when
    /// it returns: only then does the journal record count as done.
    fn phase(&self, state: &State, record: u64);
    /// The result of a transaction is final (settled, whatever the outcome); queue it for the
    /// hub. Called once per settled transaction, never for a dry run. `Err` says why it could
    /// not be stored. `isolation`: what the isolation changed in the copy, when it did.
    fn result(
        &self,
        state: &State,
        checks: &[CheckResult],
        isolation: Option<&str>,
    ) -> Result<(), String>;
    /// The preflight ran (before the first journal record): `text` is its report for a person.
    /// Only a live view on a terminal shows it (before the phases that follow); others ignore
    /// it, as the command's output holds the report.
    fn preflight(&self, _text: &str) {}
    /// The drive stopped on an interrupt (Ctrl-C, SIGTERM) with the transaction open at
    /// `state`, its last journal record being the `record`-th: no result (the transaction is
    /// not settled; a resume settles it and reports the result), but the hub may be told that
    /// it stopped and why. Never called for a dry run.
    fn interrupted(&self, _state: &State, _record: u64, _why: &Failure) {}
    /// Before its own work, this process took up a transaction a stopped run left open (found
    /// at `from`) and drove it to `driven`: a command's output says so, whatever it was asked
    /// to do.
    fn taken_up(&self, _from: &State, _driven: &Driven) {}
}

/// Hand a settled transaction's result to the reporter (nothing for an open one or a dry run).
pub fn report_final(
    reporter: &dyn Reporter,
    state: &State,
    checks: &[CheckResult],
    isolation: Option<&str>,
) {
    if !state.is_terminal() || state.request().dry_run {
        return;
    }
    if let Err(e) = reporter.result(state, checks, isolation) {
        tracing::error!(txn = %state.txn(), error = %e, "the result could not be stored for the hub; it is in the journal");
    }
}

/// A reporter that only logs (no outbox).
#[derive(Debug, Default)]
pub struct LogReporter;

impl Reporter for LogReporter {
    fn phase(&self, _state: &State, _record: u64) {}
    fn result(
        &self,
        _state: &State,
        _checks: &[CheckResult],
        _isolation: Option<&str>,
    ) -> Result<(), String> {
        Ok(())
    }
}

/// Timeouts of one executor (tests shorten them).
#[derive(Debug, Clone)]
pub struct Timeouts {
    /// Restore task.
    pub restore: Duration,
    /// Start, stop, destroy tasks.
    pub power: Duration,
    /// First exec answer after the start.
    pub launch_proof: Duration,
    /// The guest's boot ending, after the launch proof.
    pub boot: Duration,
    /// A destroyed guest leaving the list.
    pub confirm_gone: Duration,
    /// The search for the task of a restore request whose answer is unknown.
    pub submit_settle: Duration,
    /// A guest of ours held by a backup (`lock: backup`), before its destroy.
    pub backup_lock: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            restore: RESTORE_TIMEOUT,
            power: POWER_TIMEOUT,
            launch_proof: LAUNCH_PROOF_TIMEOUT,
            boot: crate::guest::boot::BOOT_TIMEOUT,
            confirm_gone: CONFIRM_GONE_TIMEOUT,
            submit_settle: submit_settle(),
            backup_lock: backup_lock_wait(),
        }
    }
}

/// Journal records this process wrote, for the test bed's kill switch.
static JOURNAL_RECORDS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Performs effects for one transaction at a time.
pub struct Executor<'a> {
    cfg: &'a Config,
    pve: &'a PveClient,
    journal: &'a Journal,
    reporter: &'a dyn Reporter,
    cancel: CancellationToken,
    timeouts: Timeouts,
    /// How containers are reached: `pct` itself, or the root exec helper.
    lxc: Arc<dyn LxcExecFactory>,
    /// Check results of the transaction being driven.
    checks: Vec<CheckResult>,
    /// What the boot wait of this drive saw, for the report.
    boot: Option<String>,
    /// What the isolation changed in the copy, for the report.
    isolation: Option<String>,
    /// The units the isolation left failed on purpose, with why: a failing check that names
    /// one says why.
    lab_kept: Vec<(String, String)>,
    /// The dry-run plan of the transaction being driven.
    plan: Option<Vec<PlanStep>>,
    /// Set when the drive stopped before the transaction settled (interrupt, journal failure).
    halted: Option<Failure>,
    started: Instant,
    journal_count: u32,
    /// The number of the last journal record this drive wrote (0: none yet).
    last_record: u64,
    kill_at: Option<(bool, u32)>,
    /// The backup's stored configuration as the preflight read it, for the restore request.
    carried_config: Option<StoredConfigText>,
    /// The guest config the last effect read (vmid, config): still fresh for the effect right
    /// after it, and only when that is the start (nothing is sent to PVE in between); every
    /// other effect drops it. Saves a second read of the same config before the start.
    fresh_config: std::sync::Mutex<Option<(u32, GuestConfig)>>,
    /// A start's config read, taken over from `fresh_config` by the start effect.
    start_config: Option<(u32, GuestConfig)>,
    /// The guest's name (`hostname`, QEMU `name`) from a config read of this run, for the
    /// checks' context (PVE changes it only when asked), and for a VM with a cloud-init drive
    /// the names PVE writes into it.
    guest_name: std::sync::Mutex<Option<GuestName>>,
    /// Spaces the restore requests of copies driven side by side (see [`SubmitGate`]).
    submit_gate: Option<Arc<SubmitGate>>,
    /// The copy's seat in its application group's run (`None`: a copy alone).
    group: Option<super::group::Seat>,
}

/// The ports allowed on a VM copy's lab bridge after its start: its own taps, those of the
/// other VM copies of its application group (which share the group's bridge), and the link of
/// the group's containers' lab (made by root when a container member joins).
fn allowed_ports(state: &State, vmid: u32) -> crate::lab_kernel::Ports {
    match state.request().group.as_ref() {
        Some(g) if !g.bridge_peers.is_empty() => {
            let mut vmids = g.bridge_peers.clone();
            if !vmids.contains(&vmid) {
                vmids.push(vmid);
            }
            let has_containers = g.guests.len() > g.bridge_peers.len();
            crate::lab_kernel::Ports::TapsOfAny(
                vmids,
                has_containers.then(|| crate::guest::group_lab::link_port_name(g.lab)),
            )
        }
        _ => crate::lab_kernel::Ports::TapsOf(vmid),
    }
}

/// Restores submitted one after another: every disk allocation takes the target storage's
/// lock, waited for at most 10 s (pve-storage `vdisk_alloc`, pve-common `lock_file_full`; a
/// shared storage's `cfs_lock_storage` alike), so copies started at once would fail on "can't
/// lock file … got timeout". Each restore request waits until `spacing` has passed since the
/// previous one was answered.
#[derive(Debug)]
pub struct SubmitGate {
    last: tokio::sync::Mutex<Option<Instant>>,
    spacing: Duration,
}

impl SubmitGate {
    /// A gate that spaces restore requests by `spacing`.
    pub fn new(spacing: Duration) -> SubmitGate {
        SubmitGate {
            last: tokio::sync::Mutex::new(None),
            spacing,
        }
    }

    /// Wait for this request's turn; the guard is held until the request was answered, and
    /// [`SubmitGate::done`] then starts the next one's wait.
    async fn turn(&self) -> tokio::sync::MutexGuard<'_, Option<Instant>> {
        let guard = self.last.lock().await;
        if let Some(last) = *guard {
            let next = last + self.spacing;
            let now = Instant::now();
            if next > now {
                tokio::time::sleep(next - now).await;
            }
        }
        guard
    }

    fn done(mut guard: tokio::sync::MutexGuard<'_, Option<Instant>>) {
        *guard = Some(Instant::now());
    }
}

/// What driving a transaction left behind.
#[derive(Debug, Clone)]
pub struct Driven {
    /// The last state (journaled unless `halted` says otherwise).
    pub state: State,
    /// The check results, if checks ran.
    pub checks: Vec<CheckResult>,
    /// The plan, for a dry run.
    pub plan: Option<Vec<PlanStep>>,
    /// Why the drive stopped before the transaction settled.
    pub halted: Option<Failure>,
    /// What the boot wait waited for and saw (`None` when the drive did not wait for a boot).
    pub boot: Option<String>,
    /// What the isolation changed in an isolated restore-test copy (its stored interfaces given
    /// as unconnected pairs, the units restarted), `None` when it changed nothing.
    pub isolation: Option<String>,
}

impl Driven {
    /// The exit status of the drive: its outcome's, and never "done" for a halted (open)
    /// transaction.
    pub fn exit_status(&self) -> crate::error::ExitStatus {
        use crate::error::{exit_status, ExitStatus};
        match (&self.halted, self.state.outcome()) {
            (Some(h), _) => match exit_status(h.code) {
                ExitStatus::Ok => ExitStatus::NeedsHuman,
                other => other,
            },
            (None, Some(o)) => o.exit_status(),
            (None, None) => ExitStatus::NeedsHuman,
        }
    }

    /// Stopped by the operator or the service manager (Ctrl-C, SIGTERM) before it settled:
    /// the transaction is open where the journal holds it, to be resumed. Not an outcome.
    pub fn interrupted(&self) -> bool {
        self.state.outcome().is_none()
            && self
                .halted
                .as_ref()
                .is_some_and(|h| h.code == ErrorCode::Interrupted)
    }

    /// The word for how the drive ended: the outcome once settled, `interrupted` for a stop
    /// the journal can resume, else `None` (open for another reason).
    pub fn ending(&self) -> Option<&'static str> {
        match self.state.outcome_kind() {
            Some(o) => Some(o.as_str()),
            None if self.interrupted() => Some("interrupted"),
            None => None,
        }
    }
}

/// How long a backup's lock is waited for (a test build may change it through the
/// environment).
#[cfg(not(feature = "test-hooks"))]
fn backup_lock_wait() -> Duration {
    BACKUP_LOCK_WAIT
}

#[cfg(feature = "test-hooks")]
fn backup_lock_wait() -> Duration {
    std::env::var(BACKUP_LOCK_WAIT_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(BACKUP_LOCK_WAIT, Duration::from_millis)
}

/// The settle window of the task search (a test build may shorten it through the environment).
#[cfg(not(feature = "test-hooks"))]
fn submit_settle() -> Duration {
    SUBMIT_SETTLE
}

#[cfg(feature = "test-hooks")]
fn submit_settle() -> Duration {
    std::env::var(SUBMIT_SETTLE_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(SUBMIT_SETTLE, Duration::from_millis)
}

/// A build without the `test-hooks` feature has no kill switch at all.
#[cfg(not(feature = "test-hooks"))]
fn parse_kill_at() -> Option<(bool, u32)> {
    None
}

#[cfg(feature = "test-hooks")]
fn parse_kill_at() -> Option<(bool, u32)> {
    let v = std::env::var(KILL_AT_ENV).ok()?;
    let (when, n) = v.split_once(':')?;
    let n: u32 = n.parse().ok()?;
    match when {
        "before-journal" => Some((true, n)),
        "after-journal" => Some((false, n)),
        _ => None,
    }
}

/// Test hook (only with the `test-hooks` feature): SIGKILL the process here when
/// `FELHOM_AGENT_KILL_AT` names this point (e.g. `after-resolve-journal`). Nothing in a
/// package build (callers are compiled only with the feature).
#[cfg(feature = "test-hooks")]
pub fn kill_point(name: &str) {
    if std::env::var(KILL_AT_ENV).ok().as_deref() == Some(name) {
        kill_self(name);
    }
}

fn kill_self(point: &str) {
    tracing::warn!(point, "test kill switch: SIGKILL now");
    let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL);
    // SIGKILL cannot be caught; wait for it to land.
    std::thread::sleep(Duration::from_secs(60));
}

impl<'a> Executor<'a> {
    /// An executor for this node that reaches into containers through `lxc` (the service
    /// chooses: `pct` itself as root, else the root exec helper; every exec names the
    /// transaction being driven).
    pub fn new(
        cfg: &'a Config,
        pve: &'a PveClient,
        journal: &'a Journal,
        reporter: &'a dyn Reporter,
        cancel: CancellationToken,
        lxc: Arc<dyn LxcExecFactory>,
    ) -> Self {
        Self {
            cfg,
            pve,
            journal,
            reporter,
            cancel,
            timeouts: Timeouts {
                launch_proof: cfg.provision.launch_timeout,
                boot: cfg.provision.boot_timeout,
                ..Timeouts::default()
            },
            lxc,
            checks: Vec::new(),
            boot: None,
            isolation: None,
            lab_kept: Vec::new(),
            plan: None,
            halted: None,
            started: Instant::now(),
            journal_count: 0,
            last_record: 0,
            kill_at: parse_kill_at(),
            carried_config: None,
            fresh_config: std::sync::Mutex::new(None),
            start_config: None,
            guest_name: std::sync::Mutex::new(None),
            submit_gate: None,
            group: None,
        }
    }

    /// Drive this copy as a member of an application group: its start, checks and destroy
    /// wait for the other members ([`super::group`]).
    pub fn with_group(mut self, seat: super::group::Seat) -> Self {
        self.group = Some(seat);
        self
    }

    /// Record why this group member failed (said by the members started after it).
    pub fn group_failed(&self, why: &str) {
        if let Some(seat) = &self.group {
            seat.fail(why);
        }
    }

    /// The failure of a group wait the run's stop ended.
    fn group_stopped(&self, state: &State, what: &str) -> Failure {
        Failure::new(
            ErrorCode::Interrupted,
            format!(
                "interrupted while the copy (transaction {}) waited for the other members of its group {what}; `felhom-agent journal resume {}` settles it",
                state.txn(),
                state.txn()
            ),
        )
    }

    /// Space this executor's restore request from those of other copies driven beside it.
    pub fn with_submit_gate(mut self, gate: Arc<SubmitGate>) -> Self {
        self.submit_gate = Some(gate);
        self
    }

    /// Hand over the backup's stored configuration the preflight read: the restore request
    /// uses it instead of asking PVE again (a provision reads it once). Without it (a resumed
    /// transaction, a preflight that could not read it) the restore reads it itself.
    pub fn carry_stored_config(&mut self, stored: Option<StoredConfigText>) {
        self.carried_config = stored;
    }

    /// The stored configuration of `volid`: the carried one when it is this volume's, else
    /// read from PVE.
    async fn stored_config_text(&mut self, node: &str, volid: &str) -> Result<String, PveError> {
        match &self.carried_config {
            Some(c) if c.volid == volid => Ok(c.text.clone()),
            _ => self.pve.extract_config(node, volid).await,
        }
    }

    /// Replace the timeouts.
    pub fn with_timeouts(mut self, timeouts: Timeouts) -> Self {
        self.timeouts = timeouts;
        self
    }

    /// Drive `state` from `first` until it settles or the drive halts.
    pub async fn drive(&mut self, state: State, first: Event) -> Driven {
        self.reset();
        match step(&state, first) {
            Ok((next, effects)) => self.run(next, effects).await,
            Err(d) => self.finish(state, Some(Failure::new(d.code(), d.to_string()))),
        }
    }

    /// Drive `state` from effects already decided (a gated destroy's first re-check).
    pub async fn drive_effects(&mut self, state: State, effects: Vec<Effect>) -> Driven {
        self.reset();
        self.run(state, effects).await
    }

    /// Settle a transaction a crashed run left open: observe the recorded task and the guest,
    /// let the machine's [`recover`] decide (an interrupted transaction ends `failed` or
    /// `needs_human`, its own guest cleaned up through the gate), and drive the result.
    pub async fn settle(&mut self, state: State) -> Driven {
        self.take_up(state, false).await
    }

    /// Resume a transaction a stopped run left open from its last journaled step: observe the
    /// recorded task and the guest, let the machine's [`resume`] decide (it falls back to
    /// [`recover`] where resuming is impossible), and drive it to its end.
    pub async fn resume(&mut self, state: State) -> Driven {
        self.take_up(state, true).await
    }

    async fn take_up(&mut self, state: State, resuming: bool) -> Driven {
        self.reset();
        let task = match state.upid() {
            None => TaskObservation::Unknown {
                message: "no task was recorded".to_string(),
            },
            Some(u) => match u.parse::<Upid>() {
                Err(e) => TaskObservation::Unknown {
                    message: e.to_string(),
                },
                Ok(upid) => match self.pve.task_status(&upid).await {
                    Ok(s) if s.status != "stopped" => TaskObservation::Running,
                    Ok(s) => {
                        let exit = s
                            .exitstatus
                            .unwrap_or_else(|| "unexpected status".to_string());
                        if exit == "OK" || exit.starts_with("WARNINGS: ") {
                            TaskObservation::Ok
                        } else {
                            TaskObservation::Error { message: exit }
                        }
                    }
                    Err(e) => TaskObservation::Unknown {
                        message: e.to_string(),
                    },
                },
            },
        };
        let vmid = state.vmid();
        let guest = match vmid {
            Some(v) if state.destroy_armed() => {
                match self
                    .observe_for_proof(&state, v, state.request().guest)
                    .await
                {
                    Ok(view) => view,
                    Err(f) => return self.finish(state, Some(f)),
                }
            }
            Some(v) => self.observe(v, state.request().guest).await,
            None => GuestView::Absent,
        };
        let observed = RecoveryObservation { task, guest };
        let (next, effects) = if resuming {
            resume(&state, &observed)
        } else {
            recover(&state, &observed)
        };
        self.run(next, effects).await
    }

    fn reset(&mut self) {
        self.checks.clear();
        self.plan = None;
        self.halted = None;
        self.started = Instant::now();
    }

    fn finish(&mut self, state: State, halted: Option<Failure>) -> Driven {
        if halted.is_none() && self.halted.is_none() {
            report_final(
                self.reporter,
                &state,
                &self.checks,
                self.isolation.as_deref(),
            );
        }
        if let Some(why) = halted.as_ref().filter(|h| h.code == ErrorCode::Interrupted) {
            // A resume stopped before it wrote a record of its own: the journal's last one.
            let record = match self.last_record {
                0 => self
                    .journal
                    .get(state.txn())
                    .ok()
                    .flatten()
                    .map_or(0, |t| t.records),
                n => n,
            };
            if !state.is_terminal() && !state.request().dry_run && record > 0 {
                self.reporter.interrupted(&state, record, why);
            }
        }
        Driven {
            state,
            checks: std::mem::take(&mut self.checks),
            plan: self.plan.take(),
            halted: halted.or_else(|| self.halted.take()),
            boot: self.boot.take(),
            isolation: self.isolation.take(),
        }
    }

    async fn run(&mut self, mut state: State, mut effects: Vec<Effect>) -> Driven {
        loop {
            let answer = match self.perform_all(&state, effects).await {
                Ok(a) => a,
                Err(f) => return self.finish(state, Some(f)),
            };
            let Some(event) = answer else {
                return self.finish(state, None);
            };
            match step(&state, event) {
                Ok((next, more)) => {
                    state = next;
                    effects = more;
                }
                Err(d) => {
                    tracing::error!(error = %d, "the executor produced an event the machine refuses");
                    return self.finish(state, Some(Failure::new(d.code(), d.to_string())));
                }
            }
        }
    }

    /// Perform the effects in order; the answer of the last answering effect comes back.
    async fn perform_all(
        &mut self,
        state: &State,
        effects: Vec<Effect>,
    ) -> Result<Option<Event>, Failure> {
        let mut answer = None;
        for effect in effects {
            if let Effect::Journal(s) = &effect {
                self.record(s)?;
                continue;
            }
            if self.cancel.is_cancelled() {
                return Err(Failure::new(
                    ErrorCode::Interrupted,
                    format!(
                        "interrupted before {} of transaction {}; the journal holds its state and the next agent command settles it",
                        effect.name(),
                        state.txn()
                    ),
                ));
            }
            tracing::debug!(txn = %state.txn(), effect = effect.name(), "performing");
            if let Some(ev) = self.perform(state, effect).await? {
                answer = Some(ev);
            }
        }
        Ok(answer)
    }

    fn record(&mut self, s: &State) -> Result<(), Failure> {
        // Counted for the whole process: with copies driven side by side, each kill point of
        // the bed's walk is one moment of the run, whichever copy writes the record.
        self.journal_count = JOURNAL_RECORDS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if self.kill_at == Some((true, self.journal_count)) {
            kill_self("before-journal");
        }
        let journaled = self
            .journal
            .record(s)
            .map_err(|e| Failure::new(e.code(), e.to_string()))?;
        if self.kill_at == Some((false, self.journal_count)) {
            kill_self("after-journal");
        }
        let elapsed = self.started.elapsed().as_secs_f64();
        tracing::info!(
            txn = %s.txn(),
            vmid = s.vmid(),
            destroy_armed = s.destroy_armed(),
            "phase {:<12} step {:<17} +{elapsed:.2}s",
            s.phase().as_str(),
            s.step().as_str(),
        );
        // The record counts as done once its event is stored (a reporter that keeps events
        // syncs it before returning). A kill between the two is made good by the next start,
        // which reports the last journaled record again under the same identity.
        self.last_record = journaled.records;
        self.reporter.phase(s, journaled.records);
        Ok(())
    }

    async fn perform(&mut self, state: &State, effect: Effect) -> Result<Option<Event>, Failure> {
        let node = self.cfg.node.clone();
        let fresh = self.fresh_config.lock().ok().and_then(|mut f| f.take());
        self.start_config = fresh.filter(|_| matches!(effect, Effect::Start { .. }));
        Ok(match effect {
            Effect::Journal(_) => None,
            Effect::Plan { steps } => {
                self.plan = Some(steps);
                None
            }
            Effect::SubmitRestore {
                vmid,
                guest,
                volid,
                storage,
                pool,
                unique,
                isolate_network,
            } => {
                // The configuration stored in the backup: what the restore brings along (its
                // NICs, description, onboot, protection), read as the preflight read it.
                let stored = match self.stored_config_text(&node, &volid).await {
                    Ok(text) => Some(StoredConfig::parse(&text)),
                    Err(e) if isolate_network => {
                        // Without it the stored NICs cannot all be overridden: nothing is sent.
                        return Ok(Some(Event::SubmitRefused(Failure::new(
                            ErrorCode::BackupMissing,
                            format!(
                                "the configuration stored in backup {volid} could not be read                                  ({e}), so the restore of vmid {vmid} on node {node} could not                                  isolate every NIC of the copy; nothing was restored; check                                  that `pvesh get /nodes/{node}/vzdump/extractconfig --volume                                  {volid}` works with the agent's token"
                            ),
                        ))));
                    }
                    Err(e) => {
                        tracing::warn!(vmid, volid, error = %e, "the backup's stored config could not be read; restoring with the marker line as its description");
                        None
                    }
                };
                let selftest = matches!(
                    state.kind(),
                    TxnKind::SelftestProvision | TxnKind::SelftestRestore
                );
                // A VM backup in the old `.tar` format takes no config key at all: the marker
                // follows with its write (the preflight refuses such a backup for a restore
                // test, whose NICs could not be overridden).
                let mut extra = if guest == GuestKind::Qemu && is_qemu_tar_archive(&volid) {
                    Vec::new()
                } else {
                    restore_options(
                        guest,
                        isolate_network,
                        selftest,
                        stored.as_ref(),
                        state.marker(),
                        self.lab_bridge(state, guest),
                    )
                };
                let target = RestoreTarget {
                    vmid,
                    guest,
                    volid: &volid,
                    storage: &storage,
                    pool: &pool,
                    unique,
                };
                if state.kind() == TxnKind::SelftestRestore {
                    if let Some(kib) = self.cfg.restore_test.bwlimit {
                        extra.push(("bwlimit".to_string(), kib.to_string()));
                    }
                }
                let gate = self.submit_gate.clone();
                let turn = match &gate {
                    Some(g) => Some(g.turn().await),
                    None => None,
                };
                let mut res = self.submit_restore(&target, &extra).await;
                if let Some(t) = turn {
                    SubmitGate::done(t);
                }
                if res.as_ref().err().is_some_and(refuses_description) {
                    // A synchronous 400 created nothing: send it once more without the
                    // description; the marker write adds it after the restore.
                    tracing::warn!(
                        vmid,
                        "PVE refused a description with the restore; restoring without it"
                    );
                    extra.retain(|(k, _)| k != "description");
                    res = self.submit_restore(&target, &extra).await;
                }
                Some(match res {
                    Ok(upid) => Event::Submitted { upid: upid.to_string() },
                    Err(e) if submit_outcome_unknown(&e) => {
                        Event::SubmitUnknown(Failure::new(e.code(), format!("the answer to the restore of vmid {vmid} on node {node} is unknown (PVE may have started it): {e}")))
                    }
                    Err(e) => Event::SubmitRefused(submit_refusal(&e, vmid, &node)),
                })
            }
            Effect::WaitTask { upid } => Some(self.wait(&upid, self.timeouts.restore).await?),
            Effect::StopTask { upid } => {
                if let Ok(u) = upid.parse::<Upid>() {
                    if let Err(e) = self.pve.task_stop(&u).await {
                        tracing::warn!(upid, error = %e, "could not ask PVE to stop the task");
                    }
                }
                None
            }
            Effect::ProbeGuest { vmid } => Some(Event::GuestObserved(
                self.observe(vmid, state.request().guest).await,
            )),
            Effect::FindOwnTask { vmid, guest } => Some(Event::SubmitProbed(
                self.find_own_task(state, vmid, guest).await?,
            )),
            Effect::VerifyMarker { vmid, guest } => {
                Some(Event::GuestObserved(self.observe(vmid, guest).await))
            }
            Effect::RecheckOwnership { vmid, guest } => {
                // A guest of ours a backup holds (a backup job that started while the copy
                // existed) is waited for, bounded: PVE refuses to stop or destroy it until the
                // backup unlocks it. What the last read shows decides, as always.
                let deadline = Instant::now() + self.timeouts.backup_lock;
                let mut said = false;
                loop {
                    let seen = if state.destroy_armed() {
                        self.observe_for_proof(state, vmid, guest).await?
                    } else {
                        self.observe(vmid, guest).await
                    };
                    if !state.held_by_backup(&seen) || Instant::now() >= deadline {
                        break Some(Event::GuestObserved(seen));
                    }
                    if !said {
                        said = true;
                        tracing::warn!(
                            vmid,
                            txn = %state.txn(),
                            "guest {vmid} is locked by a backup (lock: backup, a vzdump of the node); waiting up to {} min for it to end before the destroy",
                            self.timeouts.backup_lock.as_secs().div_ceil(60)
                        );
                    }
                    let cancel = self.cancel.clone();
                    tokio::select! {
                        () = tokio::time::sleep(BACKUP_LOCK_POLL.min(self.timeouts.backup_lock)) => {}
                        () = cancel.cancelled() => {
                            return Err(Failure::new(
                                ErrorCode::Interrupted,
                                format!(
                                    "interrupted while guest {vmid} (transaction {}) was locked by a backup, before its destroy; nothing was destroyed; `felhom-agent journal resume {}` waits for the backup again and destroys it",
                                    state.txn(),
                                    state.txn()
                                ),
                            ));
                        }
                    }
                }
            }
            Effect::ConfirmDestroyed { vmid, guest } => {
                let deadline = Instant::now() + self.timeouts.confirm_gone;
                loop {
                    let seen = self.observe(vmid, guest).await;
                    // A guest PVE is destroying leaves the pool before its config goes (the
                    // token reads 403 for it until `.vmlist` drops it: pve-container
                    // `API2/LXC.pm` destroy_vm, qemu-server `destroy_vm`): an unreadable guest
                    // is read again until the deadline, never taken for gone.
                    let unreadable = matches!(seen, GuestView::Unreadable { .. });
                    if seen == GuestView::Absent
                        || Instant::now() >= deadline
                        || (!unreadable && !state.shows_proof(&seen))
                    {
                        break Some(Event::GuestObserved(seen));
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            Effect::WriteMarker {
                vmid,
                guest,
                marker,
            } => Some(
                match self
                    .write_marker(
                        vmid,
                        guest,
                        marker,
                        &state.request().pool,
                        state.request().isolate_network,
                        self.lab_bridge(state, guest),
                    )
                    .await
                {
                    Ok(()) => Event::MarkerWritten,
                    Err(f) => Event::MarkerWriteFailed(f),
                },
            ),
            Effect::Start { vmid, guest } => {
                if let Some(seat) = &self.group {
                    if seat.before_start(&self.cancel).await.is_err() {
                        return Err(self.group_stopped(state, "before its start"));
                    }
                }
                let lab = match self.check_before_start(state, vmid, guest).await {
                    Err(refused) => return Ok(Some(Event::StartFailed { message: refused })),
                    Ok(lab) => lab,
                };
                let started = self.start(state, vmid, guest).await?;
                match (&started, lab) {
                    (Event::Started, Some(bridge)) => Some(
                        self.lab_after_start(state, vmid, guest, &bridge)
                            .await?
                            .unwrap_or(started),
                    ),
                    _ => Some(started),
                }
            }
            Effect::ProveLaunch { vmid, guest } => {
                Some(match self.prove_launch(vmid, guest, state.txn()).await {
                    Ok(()) => Event::LaunchProven,
                    Err(guest::LaunchEnd::Unproven(message)) => Event::LaunchUnproven { message },
                    Err(guest::LaunchEnd::ExecBlocked(message)) => {
                        Event::GuestExecBlocked { message }
                    }
                    Err(guest::LaunchEnd::Interrupted) => {
                        return Err(Failure::new(
                            ErrorCode::Interrupted,
                            format!(
                                "interrupted while {} {vmid} (transaction {}) was proving its launch; nothing is judged; `felhom-agent journal resume {}` waits for it again",
                                guest.pve_word(),
                                state.txn(),
                                state.txn()
                            ),
                        ));
                    }
                })
            }
            Effect::WaitBoot { vmid, guest } => {
                let ended = self.wait_boot(state, vmid, guest).await?;
                if let Some(seat) = &self.group {
                    match &ended {
                        Event::BootUnfinished { message } => seat.booted(Some(message)),
                        _ => seat.booted(None),
                    }
                }
                Some(ended)
            }
            Effect::Bootstrap { vmid, guest } => {
                // Ctrl-C stops what runs in the guest: the bootstrap's exec is dropped, which
                // hangs up on the exec helper (it stops the command's process group and sweeps
                // its tag in the container) or kills the group of a `pct` of our own. The
                // transaction stays open at this step; a resume runs the profile again.
                let cancel = self.cancel.clone();
                let ran = tokio::select! {
                    r = self.bootstrap(state, vmid, guest) => r,
                    () = cancel.cancelled() => {
                        return Err(Failure::new(
                            ErrorCode::Interrupted,
                            format!(
                                "interrupted during the bootstrap of vmid {vmid} (transaction {}): the command in the guest was stopped; the journal holds the transaction and `felhom-agent journal resume {}` runs the profile again",
                                state.txn(),
                                state.txn()
                            ),
                        ));
                    }
                };
                Some(match ran {
                    Ok(()) => Event::Bootstrapped,
                    Err(message) => Event::BootstrapFailed { message },
                })
            }
            Effect::RunChecks { vmid, guest } => {
                if let Some(seat) = &self.group {
                    if seat.before_checks(&self.cancel).await.is_err() {
                        return Err(self.group_stopped(state, "before its checks"));
                    }
                }
                let ran = self
                    .run_checks(
                        vmid,
                        guest,
                        state.kind() == TxnKind::SelftestRestore,
                        state.txn(),
                        &state.request().volid,
                    )
                    .await;
                let ran =
                    match self.group.take() {
                        None => ran,
                        Some(seat) => {
                            let judged = seat
                                .judged(ran.as_ref().err().map(String::as_str), &self.cancel)
                                .await;
                            let before = seat.failed_before();
                            self.group = Some(seat);
                            if judged.is_err() {
                                return Err(self.group_stopped(state, "after its checks"));
                            }
                            match (ran, before) {
                                (Err(message), Some(before)) => {
                                    for c in self.checks.iter_mut().filter(|c| {
                                        c.status == crate::guest::checks::CheckStatus::Fail
                                    }) {
                                        let said = c.message.take().unwrap_or_default();
                                        let sep = if said.is_empty() { "" } else { "; " };
                                        c.message = Some(format!("{said}{sep}{before}"));
                                    }
                                    Err(format!("{message}; {before}"))
                                }
                                (ran, _) => ran,
                            }
                        }
                    };
                Some(match ran {
                    Ok(()) => Event::ChecksPassed,
                    Err(message) => Event::ChecksFailed { message },
                })
            }
            // The phase is already with the reporter (journaled just before); the final result
            // follows once the transaction settles, cleanup included (see `finish`).
            Effect::Report => Some(Event::ReportQueued),
            Effect::Destroy { vmid, guest } => Some(self.destroy(state, vmid, guest).await?),
        })
    }

    /// POST the restore (`restore=1`, into the pool, on the storage) with these extra
    /// parameters.
    async fn submit_restore(
        &self,
        t: &RestoreTarget<'_>,
        extra: &[(String, String)],
    ) -> Result<Upid, PveError> {
        let node = &self.cfg.node;
        match t.guest {
            GuestKind::Lxc => {
                self.pve
                    .lxc_restore(
                        node,
                        &LxcRestore {
                            vmid: t.vmid,
                            archive: t.volid.to_string(),
                            storage: t.storage.to_string(),
                            pool: t.pool.to_string(),
                            unique: t.unique,
                            extra: extra.to_vec(),
                        },
                    )
                    .await
            }
            GuestKind::Qemu => {
                self.pve
                    .qemu_restore(
                        node,
                        &QemuRestore {
                            vmid: t.vmid,
                            archive: t.volid.to_string(),
                            storage: t.storage.to_string(),
                            pool: t.pool.to_string(),
                            unique: t.unique,
                            extra: extra.to_vec(),
                        },
                    )
                    .await
            }
        }
    }

    /// Start the guest and follow its start task.
    async fn start(
        &mut self,
        state: &State,
        vmid: u32,
        guest: GuestKind,
    ) -> Result<Event, Failure> {
        let node = self.cfg.node.clone();
        // A resumed start: the stopped run may have started the guest already.
        if state.recovered() {
            if let Ok(now) = self.pve.status_current(&node, guest, vmid).await {
                if now.status == "running" {
                    tracing::info!(vmid, "the guest already runs; its launch is proven next");
                    return Ok(Event::Started);
                }
            }
        }
        Ok(match self.pve.start(&node, guest, vmid).await {
            Err(e) => Event::StartFailed {
                message: format!(
                    "start of {} {vmid} on node {node} refused: {e}",
                    guest.pve_word()
                ),
            },
            Ok(upid) => match self.wait(upid.as_str(), self.timeouts.power).await? {
                Event::TaskEnded {
                    exit: TaskExit::Ok, ..
                } => Event::Started,
                Event::TaskEnded {
                    exit: TaskExit::Error { message },
                    ..
                } => Event::StartFailed {
                    message: format!("start task {upid} failed: {message}"),
                },
                _ => Event::StartFailed {
                    message: format!("start task {upid} did not end in time"),
                },
            },
        })
    }

    /// The last read before a selftest guest's first start: its configuration as PVE has it
    /// now, which must hold no NIC that can reach a network (an isolated restore-test copy)
    /// and neither `onboot` nor `protection`, and, for an isolated VM copy with NICs, its lab
    /// bridge still isolated in the kernel. `Err(why)`: it is not started, and the
    /// transaction ends through the gate like any failed start; `Ok(Some(bridge))`: its NICs
    /// are on the lab bridge `bridge`, read again right after the start.
    async fn check_before_start(
        &self,
        state: &State,
        vmid: u32,
        guest: GuestKind,
    ) -> Result<Option<String>, String> {
        let isolate = state.request().isolate_network;
        if !isolate && state.kind() != TxnKind::SelftestProvision {
            return Ok(None);
        }
        let node = &self.cfg.node;
        let what = if state.kind() == TxnKind::SelftestRestore {
            "restore-test copy"
        } else if isolate {
            "isolated guest"
        } else {
            "selftest guest"
        };
        let refused = |why: String| {
            format!(
                "the {what} {} {vmid} on node {node} was not started: {why}; it is destroyed through the gate",
                guest.pve_word()
            )
        };
        let cfg = self
            .config_before_start(node, guest, vmid)
            .await
            .map_err(|e| {
                format!(
                    "the {what} {} {vmid} on node {node} was not started: its configuration could not be read before the start ({e})",
                    guest.pve_word()
                )
            })?;
        if let Some(why) = start_refusal(guest, isolate, &cfg, self.lab_bridge(state, guest)) {
            return Err(refused(why));
        }
        // An isolated VM copy with NICs (start_refusal let only NICs on the lab bridge
        // through): the lab bridge as the kernel has it now (the preflight read it before the
        // restore), only this copy's own taps (a resumed start's) on it.
        let Some(bridge) = self
            .copy_lab_bridge(state, guest)
            .filter(|_| cfg.iter().any(|(k, _)| is_net_key(k)))
        else {
            return Ok(None);
        };
        let faults = crate::lab_kernel::faults_now(bridge, allowed_ports(state, vmid));
        if faults.is_empty() {
            Ok(Some(bridge.to_string()))
        } else {
            Err(refused(format!(
                "its NICs are on the lab bridge {bridge}, which is no longer isolated: {}",
                faults.join("; ")
            )))
        }
    }

    /// The lab bridge an isolated VM copy's NICs are on (`[restore_test] lab_bridge`, for an
    /// isolated VM); `None` for any other guest.
    fn copy_lab_bridge<'s>(&'s self, state: &'s State, guest: GuestKind) -> Option<&'s str> {
        self.lab_bridge(state, guest)
            .filter(|_| state.request().isolate_network)
    }

    /// Right after an isolated VM copy's start: the lab bridge read again in the kernel (only
    /// this copy's taps on it; a write of net.ipv4.ip_forward or of an `all` value meanwhile
    /// resets every device's). `Some(StartFailed)` when it is no longer isolated: the copy was
    /// stopped at once (a hard stop, followed to its end), and the transaction destroys it.
    async fn lab_after_start(
        &mut self,
        state: &State,
        vmid: u32,
        guest: GuestKind,
        bridge: &str,
    ) -> Result<Option<Event>, Failure> {
        let faults = crate::lab_kernel::faults_now(bridge, allowed_ports(state, vmid));
        if faults.is_empty() {
            return Ok(None);
        }
        let node = self.cfg.node.clone();
        tracing::warn!(
            vmid,
            bridge,
            "the lab bridge is no longer isolated after the copy's start; stopping the copy"
        );
        let stopped = match self.pve.stop(&node, guest, vmid).await {
            Ok(upid) => match self.wait(upid.as_str(), self.timeouts.power).await? {
                Event::TaskEnded {
                    exit: TaskExit::Ok, ..
                } => "it was stopped at once".to_string(),
                _ => format!("its stop task {upid} did not end OK"),
            },
            Err(e) => format!("its stop was refused ({e})"),
        };
        Ok(Some(Event::StartFailed {
            message: format!(
                "the lab bridge {bridge} of the copy {} {vmid} on node {node} was no longer isolated right after its start: {}; {stopped}, and it is destroyed through the gate; fix the bridge before the next restore test",
                guest.pve_word(),
                faults.join("; ")
            ),
        }))
    }

    /// The config for the check before the start: the one the effect right before it read
    /// (the marker's read-back; nothing was sent to PVE since), else read now.
    async fn config_before_start(
        &self,
        node: &str,
        guest: GuestKind,
        vmid: u32,
    ) -> Result<GuestConfig, PveError> {
        match &self.start_config {
            Some((v, cfg)) if *v == vmid => Ok(cfg.clone()),
            _ => self.pve.config_get(node, guest, vmid).await,
        }
    }

    /// The lab bridge of an isolated copy of a `guest` in transaction `state`: for a VM, the
    /// one its request names (picked among `[restore_test] lab_bridges` when it began), else
    /// (a transaction journaled before requests named one) the first configured; never for a
    /// container (the lab gives a container its interfaces from inside).
    fn lab_bridge<'s>(&'s self, state: &'s State, guest: GuestKind) -> Option<&'s str> {
        match guest {
            GuestKind::Qemu => state
                .request()
                .lab_bridge
                .as_deref()
                .or_else(|| self.cfg.restore_test.lab_bridge()),
            GuestKind::Lxc => None,
        }
    }

    /// Remember a config just read: fresh for a start right after it, and the guest's name.
    fn saw_config(&self, vmid: u32, guest: GuestKind, cfg: &GuestConfig) {
        if let Ok(mut n) = self.guest_name.lock() {
            *n = Some(GuestName::of(vmid, guest, cfg));
        }
        if let Ok(mut f) = self.fresh_config.lock() {
            *f = Some((vmid, cfg.clone()));
        }
    }

    async fn wait(&mut self, upid: &str, timeout: Duration) -> Result<Event, Failure> {
        let parsed: Upid = match upid.parse() {
            Ok(u) => u,
            Err(e) => {
                return Ok(Event::TaskEnded {
                    upid: upid.to_string(),
                    exit: TaskExit::Error {
                        message: e.to_string(),
                    },
                });
            }
        };
        let opts = WaitOptions {
            timeout,
            cancel: self.cancel.clone(),
        };
        match wait_task(self.pve, &parsed, &opts).await {
            Ok(o) => {
                if let Some(n) = o.warnings {
                    tracing::warn!(upid, warnings = n, lines = ?o.warning_lines, "task ended with warnings (counted as success)");
                }
                Ok(Event::TaskEnded {
                    upid: upid.to_string(),
                    exit: TaskExit::Ok,
                })
            }
            Err(PveError::TaskFailed { exitstatus, .. }) => Ok(Event::TaskEnded {
                upid: upid.to_string(),
                exit: TaskExit::Error {
                    message: exitstatus,
                },
            }),
            Err(e @ PveError::Interrupted { .. }) => Err(Failure::new(
                ErrorCode::Interrupted,
                format!(
                    "{e}; the journal holds the transaction and the next agent command settles it"
                ),
            )),
            Err(e) => {
                tracing::warn!(upid, error = %e, "lost track of the task");
                Ok(Event::TaskWaitTimedOut {
                    upid: upid.to_string(),
                })
            }
        }
    }

    /// The Unix second at or after which this transaction's restore task can have started: when
    /// its first journal record (the restore's intent) was written; the transaction id's own
    /// time when the journal cannot say.
    fn intent_secs(&self, state: &State) -> u64 {
        let from_id = state.txn().timestamp_ms() / 1000;
        let journaled = self
            .journal
            .get(state.txn())
            .ok()
            .flatten()
            .and_then(|t| {
                time::OffsetDateTime::parse(
                    &t.started_at,
                    &time::format_description::well_known::Rfc3339,
                )
                .ok()
            })
            .and_then(|t| u64::try_from(t.unix_timestamp()).ok());
        journaled.unwrap_or(from_id)
    }

    /// After a restore request whose answer is unknown: search the node's task list for this
    /// token's restore task of `vmid` started since the intent, and the full guest list, until
    /// one task shows or the settle window passes.
    async fn find_own_task(
        &self,
        state: &State,
        vmid: u32,
        guest: GuestKind,
    ) -> Result<SubmitProbe, Failure> {
        let node = &self.cfg.node;
        let since = self.intent_secs(state);
        let task_type = restore_task_type(guest);
        let token = self.cfg.pve.token_id.as_str();
        // The tasks other transactions of this journal submitted are theirs: a UPID's start time
        // has only a second's resolution, and this token's earlier restore of the same vmid (a
        // kept guest since removed) can have started in the second of this intent.
        let others: BTreeSet<String> = match self.journal.replay() {
            Ok(all) => all
                .iter()
                .filter(|t| t.state.txn() != state.txn())
                .filter_map(|t| t.state.upid().map(str::to_string))
                .collect(),
            Err(e) => {
                tracing::warn!(txn = %state.txn(), error = %e, "the journal could not be read to leave out other transactions' restore tasks");
                BTreeSet::new()
            }
        };
        let started = Instant::now();
        let deadline = started + self.timeouts.submit_settle;
        loop {
            let listed = self
                .pve
                .node_tasks(node, vmid, since, TASK_LIST_LIMIT)
                .await
                .map(|rows| {
                    let mut own: Vec<String> = rows
                        .into_iter()
                        .filter(|r| is_own_restore_task(&r.upid, task_type, vmid, token, since))
                        .filter(|r| !others.contains(&r.upid))
                        .map(|r| r.upid)
                        .collect();
                    own.sort();
                    own.dedup();
                    own
                });
            match &listed {
                Ok(own) if own.len() == 1 => {
                    tracing::warn!(txn = %state.txn(), vmid, upid = %own[0], "the answer to the restore request was unknown; its task is in the node's task list and is followed");
                    return Ok(SubmitProbe::OwnTask {
                        upid: own[0].clone(),
                    });
                }
                Ok(own) if own.len() > 1 => {
                    return Ok(SubmitProbe::Unproven {
                        guest: self.observe(vmid, guest).await,
                        detail: format!(
                            "{} {task_type} tasks of token {token} for vmid {vmid} started since \
                             the transaction's intent ({}), so none can be told to be its own",
                            own.len(),
                            own.join(", ")
                        ),
                    })
                }
                _ => {}
            }
            if self.cancel.is_cancelled() {
                return Err(Failure::new(
                    ErrorCode::Interrupted,
                    format!(
                        "interrupted while searching the task list of node {node} for the restore \
                         task of transaction {} (vmid {vmid}); the journal holds the transaction \
                         and the next agent command searches again",
                        state.txn()
                    ),
                ));
            }
            if Instant::now() >= deadline {
                let seen = self.observe(vmid, guest).await;
                let waited_secs = started.elapsed().as_secs();
                return Ok(match listed {
                    Ok(_) if seen == GuestView::Absent => SubmitProbe::Nothing { waited_secs },
                    Ok(_) => SubmitProbe::Unproven {
                        guest: seen,
                        detail: format!(
                            "no {task_type} task of token {token} for vmid {vmid} started since \
                             the transaction's intent is in node {node}'s task list after \
                             {waited_secs}s"
                        ),
                    },
                    Err(e) => SubmitProbe::Unproven {
                        guest: seen,
                        detail: format!("node {node}'s task list could not be read: {e}"),
                    },
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Presence from the full guest list; tags, description, lock and birth identity from the
    /// API config.
    pub async fn observe(&self, vmid: u32, guest: GuestKind) -> GuestView {
        match self.observe_checked(vmid, guest).await {
            Ok(view) => view,
            Err(reason) => GuestView::Unreadable { reason },
        }
    }

    /// [`Executor::observe`], but a transient failure of the config read (PVE unreachable, a
    /// 5xx that may pass) is an `Err` with the reason instead of an unreadable guest: an armed
    /// transaction must not lose its proof to a passing error.
    async fn observe_checked(&self, vmid: u32, guest: GuestKind) -> Result<GuestView, String> {
        self.observe_with_config(vmid, guest).await.map(|(v, _)| v)
    }

    /// [`Executor::observe_checked`], with the config it read (when the guest was present and
    /// readable).
    async fn observe_with_config(
        &self,
        vmid: u32,
        guest: GuestKind,
    ) -> Result<(GuestView, Option<GuestConfig>), String> {
        let list = match self.lxc.full_guest_list(self.cfg) {
            Ok(l) => l,
            Err(e) => {
                return Ok((
                    GuestView::Unreadable {
                        reason: e.to_string(),
                    },
                    None,
                ))
            }
        };
        let Some(entry) = list.lookup(vmid) else {
            return Ok((GuestView::Absent, None));
        };
        let kind = match entry.kind {
            GuestType::Qemu => GuestKind::Qemu,
            GuestType::Lxc => GuestKind::Lxc,
            _ => guest,
        };
        match self.pve.config_get(&entry.node, kind, vmid).await {
            Ok(cfg) => {
                self.saw_config(vmid, kind, &cfg);
                Ok((GuestView::from_config(&cfg), Some(cfg)))
            }
            Err(e) if e.is_transient() => Err(e.to_string()),
            Err(e) => Ok((
                GuestView::Unreadable {
                    reason: e.to_string(),
                },
                None,
            )),
        }
    }

    /// The guest read for an ownership decision of an armed transaction: a transient failure
    /// halts the drive (the journal keeps the transaction open, the next settle reads again).
    async fn observe_for_proof(
        &self,
        state: &State,
        vmid: u32,
        guest: GuestKind,
    ) -> Result<GuestView, Failure> {
        self.observe_for_proof_with_config(state, vmid, guest)
            .await
            .map(|(v, _)| v)
    }

    /// [`Executor::observe_for_proof`], with the config it read.
    async fn observe_for_proof_with_config(
        &self,
        state: &State,
        vmid: u32,
        guest: GuestKind,
    ) -> Result<(GuestView, Option<GuestConfig>), Failure> {
        self.observe_with_config(vmid, guest)
            .await
            .map_err(|reason| {
                Failure::new(
                    ErrorCode::PveUnreachable,
                    format!(
                        "guest {vmid} on node {} could not be read to check the ownership of \
                     transaction {} ({reason}); nothing was destroyed, the transaction stays open \
                     and the next agent command settles it",
                        self.cfg.node,
                        state.txn()
                    ),
                )
            })
    }

    /// Write the marker (tags and the description's marker line) with one config PUT. For an
    /// isolated copy the same PUT deletes every `netN`: the restore request gave each stored NIC
    /// a bridge-less, link-down value (so PVE neither checks `SDN.Use` on the stored bridges nor
    /// writes them, see [`restore_options`]), but such a container NIC dies at every later
    /// config write and start (pve-container `PVE/API2/LXC/Config.pm` `update_vm` writes the
    /// config, then `PVE/LXC.pm` `update_lxc_config` reads each NIC's bridge MTU: pve-common
    /// `PVE/Network.pm` `read_bridge_mtu` "bridge '' does not exist"), and a VM NIC without a
    /// bridge is QEMU's user-mode network (qemu-server `print_netdev_full`) whose `link_down`
    /// is applied only after QEMU runs (`vm_start_nolock` → `qemu_set_link_status`). The
    /// container's PVE checks its remaining NICs only after the write, so with none left it
    /// passes. A 5xx or lost answer may come after the write: the config is read back and the
    /// write counts as done when it shows.
    async fn write_marker(
        &self,
        vmid: u32,
        guest: GuestKind,
        marker: Marker,
        pool: &str,
        isolate: bool,
        lab_bridge: Option<&str>,
    ) -> Result<(), Failure> {
        let node = &self.cfg.node;
        let refused = |e: PveError, what: String| async move {
            match self.outside_pool(vmid, pool, &e).await {
                Some(f) => f,
                None => Failure::new(e.code(), what),
            }
        };
        let cfg = match self.pve.config_get(node, guest, vmid).await {
            Ok(c) => c,
            Err(e) => {
                let what = e.to_string();
                return Err(refused(e, what).await);
            }
        };
        let text = |k: &str| {
            cfg.get(k)
                .and_then(|v| v.as_str())
                .unwrap_or("")
                .to_string()
        };
        let set = vec![
            ("tags".to_string(), marker.merged_tags(&text("tags"))),
            (
                "description".to_string(),
                marker.merged_description(&text("description")),
            ),
        ];
        let delete: Vec<String> = if isolate {
            nics_off_the_lab(&cfg, lab_bridge)
        } else {
            Vec::new()
        };
        match self.pve.config_put(node, guest, vmid, &set, &delete).await {
            Ok(()) => Ok(()),
            Err(e) if put_may_have_written(&e) => {
                // PVE may have written the config before it failed (a container's config
                // is written before `update_lxc_config` runs) or the answer was lost: what
                // counts is what the config says now.
                let now = self.pve.config_get(node, guest, vmid).await;
                match now {
                    Ok(now) if marker_write_shows(&now, marker, isolate, lab_bridge) => {
                        tracing::warn!(vmid, error = %e, "the marker write answered an error, but the config read back shows it written");
                        Ok(())
                    }
                    _ => Err(Failure::new(
                        e.code(),
                        format!(
                            "marking {} {vmid} on node {node} failed: {e}; the config read back does not show the marker{}",
                            guest.pve_word(),
                            if isolate { " with every NIC off the lab bridge removed" } else { "" }
                        ),
                    )),
                }
            }
            Err(e) => {
                let what = format!(
                    "marking {} {vmid} on node {node} failed: {e}",
                    guest.pve_word()
                );
                Err(refused(e, what).await)
            }
        }
    }

    /// After a permission refusal on a just-restored guest: when the pool (read by id) lists
    /// the guest's vmid no more, the failure is that (`guest_outside_pool`), not the marker.
    async fn outside_pool(&self, vmid: u32, pool: &str, e: &PveError) -> Option<Failure> {
        if e.api().map(|a| &a.kind) != Some(&ApiErrorKind::Permission) {
            return None;
        }
        let info = self.pve.pool(pool).await.ok()??;
        let member = info.members.iter().any(|m| {
            m.get("vmid").and_then(|v| {
                v.as_u64()
                    .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            }) == Some(u64::from(vmid))
        });
        (!member).then(|| {
            Failure::new(
                ErrorCode::GuestOutsidePool,
                format!("guest {vmid} is not in pool {pool} after its restore task ended OK ({e})"),
            )
        })
    }

    /// The exec of guest `vmid` for transaction `txn` (the exec helper checks the
    /// transaction's claim on the vmid).
    fn exec_for(&self, vmid: u32, guest: GuestKind, txn: ulid::Ulid) -> AnyExec<'_> {
        match guest {
            GuestKind::Lxc => AnyExec::Lxc(self.lxc.lxc_exec(vmid, txn)),
            GuestKind::Qemu => AnyExec::Qemu(QemuExec::new(
                self.pve,
                self.cfg.node.clone(),
                vmid,
                QemuConfig::default(),
            )),
        }
    }

    /// Stop (if it runs), re-read, and DELETE right after that read while it still proves
    /// ownership ([`State::proves`]); no other request and no wait in between.
    async fn destroy(
        &mut self,
        state: &State,
        vmid: u32,
        guest: GuestKind,
    ) -> Result<Event, Failure> {
        let node = self.cfg.node.clone();
        let ended = |exit: TaskExit| Ok(Event::DestroyEnded(exit));
        if let Ok(st) = self.pve.status_current(&node, guest, vmid).await {
            if st.status == "running" {
                match self.pve.stop(&node, guest, vmid).await {
                    Ok(upid) => {
                        if let Event::TaskEnded {
                            exit: TaskExit::Error { message },
                            ..
                        } = self.wait(upid.as_str(), self.timeouts.power).await?
                        {
                            return ended(TaskExit::Error {
                                message: format!(
                                    "stopping {} {vmid} before the destroy failed: {message}",
                                    guest.pve_word()
                                ),
                            });
                        }
                    }
                    Err(e) => {
                        return ended(TaskExit::Error {
                            message: format!(
                                "stopping {} {vmid} before the destroy was refused: {e}",
                                guest.pve_word()
                            ),
                        })
                    }
                }
            }
        }
        // The last read before the DELETE: the full list and the config, marker and birth
        // identity. Nothing else is sent between this read and the DELETE but, for a guest
        // whose backup carried `protection`, the lifting of it and one more read.
        let (seen, cfg) = self
            .observe_for_proof_with_config(state, vmid, guest)
            .await?;
        if !state.proves(&seen) {
            return Ok(Event::GuestObserved(seen));
        }
        let protected = cfg
            .as_ref()
            .and_then(|c| c.get("protection"))
            .is_some_and(|v| v.as_str().map_or(v.as_u64() == Some(1), is_true));
        if protected {
            // PVE refuses to destroy a protected guest (pve-guest-common
            // `PVE/AbstractConfig.pm` `check_protection`, called by pve-container and
            // qemu-server `destroy_vm`). This one is proven ours: lift it, then prove again.
            tracing::info!(
                vmid,
                "lifting the protection this guest's backup carried before its destroy"
            );
            let lifted = match self
                .pve
                .config_put(&node, guest, vmid, &[], &["protection".to_string()])
                .await
            {
                // A 5xx or lost answer may come after the write (a container's config is
                // written before `update_lxc_config` runs): the config read back decides.
                Err(e) if put_may_have_written(&e) => {
                    match self.pve.config_get(&node, guest, vmid).await {
                        Ok(now)
                            if !now.get("protection").is_some_and(|v| {
                                v.as_str().map_or(v.as_u64() == Some(1), is_true)
                            }) =>
                        {
                            tracing::warn!(vmid, error = %e, "lifting the protection answered an error, but the config read back shows it lifted");
                            Ok(())
                        }
                        _ => Err(e),
                    }
                }
                other => other,
            };
            if let Err(e) = lifted {
                return ended(TaskExit::Error {
                    message: format!(
                        "{} {vmid} carries protection, which could not be lifted before its destroy: {e}",
                        guest.pve_word()
                    ),
                });
            }
            let again = self.observe_for_proof(state, vmid, guest).await?;
            if !state.proves(&again) {
                return Ok(Event::GuestObserved(again));
            }
        }
        match self.pve.destroy(&node, guest, vmid).await {
            Err(e) => ended(TaskExit::Error {
                message: e.to_string(),
            }),
            Ok(upid) => ended(match self.wait(upid.as_str(), self.timeouts.power).await? {
                Event::TaskEnded { exit, .. } => exit,
                _ => TaskExit::Error {
                    message: format!("destroy task {upid} did not end in time"),
                },
            }),
        }
    }
}

/// The options a restore request sends besides its target, from the configuration stored in
/// the backup (`None`: unreadable):
/// - isolated (a restore-test copy, a throwaway selftest, a provision told to isolate): every
///   NIC the backup stores given with no bridge and its link down (a backup without NICs gets
///   none). The request's NICs win over the stored ones for a container restored
///   without `unique` (pve-container `PVE/LXC/Create.pm` `sanitize_and_merge_config`) and for
///   a VM always (qemu-server `PVE/QemuServer.pm` `restore_merge_config`: the request's
///   parameters override the backup's); PVE gives each a new MAC. A VM's, with `[restore_test]
///   lab_bridge`, go instead onto that bridge with their stored models and MACs
///   ([`Nic::lab_value`]).
/// - a selftest guest (`--selftest=…`, restore test) and every isolated guest: `onboot=0` and
///   `protection=0`, so a copy never starts at the node's boot and its destroy is never
///   refused, and [`start_refusal`], which refuses both for exactly these transactions, lets
///   it start; the request's keys win for both kinds (same functions).
/// - `description`: the marker line first, then the backup's own description, so the guest
///   carries the marker from its first write and keeps the customer's notes (a description
///   given with the restore replaces the stored one). `tags` cannot go with it: PVE checks them
///   on `/vms/<vmid>` without the pool fallback, which a pool token does not pass; they follow
///   with the marker write.
pub fn restore_options(
    guest: GuestKind,
    isolate: bool,
    selftest: bool,
    stored: Option<&StoredConfig>,
    marker: Marker,
    lab_bridge: Option<&str>,
) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    if isolate {
        // Only the NICs the backup stores: a backup without any gets none. A VM copy's go onto
        // the lab bridge when there is one, with their stored models and MACs; otherwise they
        // are isolated here and the marker write deletes them before any start.
        let nics = stored.map(|c| c.nics(guest)).unwrap_or_default();
        for nic in nics {
            let value = match lab_bridge.filter(|_| guest == GuestKind::Qemu) {
                Some(bridge) => nic.lab_value(bridge),
                None => nic.isolated_value(guest),
            };
            out.push((nic.key, value));
        }
    }
    if selftest || isolate {
        out.push(("onboot".to_string(), "0".to_string()));
        out.push(("protection".to_string(), "0".to_string()));
    }
    let description = stored.map_or("", StoredConfig::description);
    out.push((
        "description".to_string(),
        marker.merged_description(description),
    ));
    out
}

/// Why a guest about to be started for a selftest may not start: a NIC of an isolated copy
/// that can reach a network, or `onboot`/`protection` set. `None`: it may start.
pub fn start_refusal(
    guest: GuestKind,
    isolate: bool,
    cfg: &GuestConfig,
    lab_bridge: Option<&str>,
) -> Option<String> {
    let text = |k: &str| match cfg.get(k) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        Some(Value::Bool(b)) => u8::from(*b).to_string(),
        _ => String::new(),
    };
    let mut wrong: Vec<String> = Vec::new();
    if isolate {
        // No NIC at all: a container NIC without a bridge kills the start (`update_lxc_config`),
        // one on a bridge needs that bridge (and `SDN.Use` on it) and is one `link_down` edit
        // from the production network, and a VM's is up until its start task has set the link
        // down (`qemu_set_link_status`), or user-mode NAT without a bridge.
        // A VM's NIC may be on the lab bridge only (no ports, no node address: doctor checks
        // it), untagged.
        let mut keys: Vec<&String> = cfg.keys().filter(|k| is_net_key(k)).collect();
        keys.sort();
        for k in keys {
            let nic = Nic::parse(guest, k, &text(k));
            match lab_bridge.filter(|_| guest == GuestKind::Qemu) {
                Some(lab) if nic.is_on_lab_bridge(lab) => {}
                Some(lab) => wrong.push(format!(
                    "{} is a NIC of an isolated copy that is not on the lab bridge {lab}",
                    nic.describe()
                )),
                None => wrong.push(format!("{} is a NIC of an isolated copy", nic.describe())),
            }
        }
        let values: Vec<(String, String)> = cfg.keys().map(|k| (k.clone(), text(k))).collect();
        for b in isolation_breaches(guest, values.iter().map(|(k, v)| (k.as_str(), v.as_str()))) {
            wrong.push(format!("{} ({})", b.key, b.why));
        }
    }
    if is_true(&text("template")) {
        wrong.push("it is a template".to_string());
    }
    for k in ["onboot", "protection"] {
        if is_true(&text(k)) {
            wrong.push(format!("{k} is set"));
        }
    }
    if wrong.is_empty() {
        None
    } else {
        Some(wrong.join("; "))
    }
}

/// Whether a config PUT that answered `e` may have been written all the same: no answer, an
/// unreadable one, or a 5xx (pve-container's `update_vm` writes the config before
/// `update_lxc_config` can die; a proxy can fail after the daemon wrote).
fn put_may_have_written(e: &PveError) -> bool {
    match e {
        PveError::Unreachable { .. } | PveError::Decode { .. } => true,
        PveError::Api(a) => a.status >= 500 && a.status != 501,
        _ => false,
    }
}

/// Whether a config read back after a failed marker write shows the write done: the marker's
/// tags and description line, and, for an isolated copy, no `netN` left.
fn marker_write_shows(
    cfg: &GuestConfig,
    marker: Marker,
    isolate: bool,
    lab_bridge: Option<&str>,
) -> bool {
    let text = |k: &str| cfg.get(k).and_then(|v| v.as_str()).unwrap_or("");
    let no_nics = !isolate || nics_off_the_lab(cfg, lab_bridge).is_empty();
    marker.is_carried_by(text("tags"), text("description")) && no_nics
}

/// The `netN` keys of an isolated copy's config that the marker write deletes: every NIC,
/// but, for a VM with a lab bridge (`lab_bridge` is only given for a VM), those on it.
fn nics_off_the_lab(cfg: &GuestConfig, lab_bridge: Option<&str>) -> Vec<String> {
    let mut nics: Vec<String> = cfg
        .iter()
        .filter(|(k, _)| is_net_key(k))
        .filter(|(k, v)| {
            lab_bridge.is_none_or(|lab| {
                !Nic::parse(GuestKind::Qemu, k, v.as_str().unwrap_or("")).is_on_lab_bridge(lab)
            })
        })
        .map(|(k, _)| k.clone())
        .collect();
    nics.sort_by_key(|k| k[3..].parse::<u32>().unwrap_or(u32::MAX));
    nics
}

/// What a restore request restores where.
struct RestoreTarget<'a> {
    vmid: u32,
    guest: GuestKind,
    volid: &'a str,
    storage: &'a str,
    pool: &'a str,
    unique: bool,
}

/// Whether PVE refused the restore request because of its `description`: a 400 naming it,
/// e.g. a qemu-server before 7.2, which takes no other options with `archive` (`archive:
/// option conflicts with other options (description)`).
fn refuses_description(e: &PveError) -> bool {
    e.api().is_some_and(|a| {
        a.status == 400
            && (a.message.contains("description")
                || a.errors
                    .iter()
                    .any(|(k, v)| k == "description" || v.contains("description")))
    })
}

/// The task type of a restore of this kind (facts §4, §5).
fn restore_task_type(guest: GuestKind) -> &'static str {
    match guest {
        GuestKind::Lxc => "vzrestore",
        GuestKind::Qemu => "qmrestore",
    }
}

/// Whether `upid` is a restore task of `task_type` for `vmid`, started by `token` (the UPID's
/// user field holds the token id, facts §6.1) at or after `since`.
fn is_own_restore_task(upid: &str, task_type: &str, vmid: u32, token: &str, since: u64) -> bool {
    match upid.parse::<Upid>() {
        Ok(u) => {
            u.task_type == task_type
                && u.id == vmid.to_string()
                && u.user == token
                && u.starttime >= since
        }
        Err(_) => false,
    }
}

/// Whether an error answer to the restore POST leaves its outcome unknown: no answer at all
/// (timeout, reset: the request may have reached PVE), an answer that cannot be read, or a 5xx
/// that is not one of PVE's certain synchronous refusals (pveproxy can answer 500 or a 59x while
/// pvedaemon goes on creating the guest). A 4xx, a 501, the "already exists" 500, the quorum
/// and lock refusals and PVE's known refusal wordings are certain: no task was started.
pub fn submit_outcome_unknown(e: &PveError) -> bool {
    match e {
        PveError::Unreachable { .. } | PveError::Decode { .. } => true,
        // 501 is PVE's router: no handler ran.
        PveError::Api(a) => match a.kind {
            ApiErrorKind::Transient => true,
            ApiErrorKind::Other => a.status >= 500 && a.status != 501,
            _ => false,
        },
        _ => false,
    }
}

/// The failure of a synchronous refusal of the restore, with what the operator can do.
fn submit_refusal(e: &PveError, vmid: u32, node: &str) -> Failure {
    if let Some((holder, v, on)) = e.already_exists() {
        return Failure::new(
            ErrorCode::PveRefused,
            format!(
                "PVE refused the restore: {} {v} already exists on node '{on}'. The guest at vmid {vmid} was not touched; it was not in this node's guest list when the provision was validated (created since, or on a node the list did not show). Pick a free vmid with `felhom-agent guests` and retry",
                holder.pve_word()
            ),
        );
    }
    Failure::new(
        e.code(),
        format!("PVE refused the restore into vmid {vmid} on node {node}: {e}"),
    )
}

/// Either guest exec, so the effects can run the same code for both kinds.
enum AnyExec<'a> {
    Lxc(Box<dyn DynGuestExec>),
    Qemu(QemuExec<&'a PveClient>),
}

impl GuestExec for AnyExec<'_> {
    fn guest(&self) -> GuestRef {
        match self {
            AnyExec::Lxc(e) => e.guest(),
            AnyExec::Qemu(e) => e.guest(),
        }
    }

    async fn exec(
        &self,
        request: &ExecRequest,
    ) -> Result<crate::guest::exec::ExecOutcome, crate::guest::exec::ExecError> {
        match self {
            AnyExec::Lxc(e) => e.exec(request).await,
            AnyExec::Qemu(e) => e.exec(request).await,
        }
    }

    async fn push_file(
        &self,
        source: &crate::guest::exec::PushSource,
        guest_path: &str,
        mode: u32,
    ) -> Result<crate::guest::exec::PushReceipt, crate::guest::exec::ExecError> {
        match self {
            AnyExec::Lxc(e) => e.push_file(source, guest_path, mode).await,
            AnyExec::Qemu(e) => e.push_file(source, guest_path, mode).await,
        }
    }
}

/// Where a transaction's scratch files go.
pub fn scratch_dir(cfg: &Config) -> PathBuf {
    cfg.state_dir.join("scratch")
}

/// How the agent runs `pct` itself (as root): the defaults, the [`scratch_dir`] (created 0700
/// here; files themselves go on `pct exec`'s stdin, nothing is staged) and `[exec] lxc_path`.
pub fn direct_pct(cfg: &Config) -> PctConfig {
    let scratch = scratch_dir(cfg);
    if let Err(e) = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&scratch)
    {
        tracing::warn!(path = %scratch.display(), error = %e, "cannot create the scratch dir for files pushed into guests");
    }
    PctConfig {
        scratch_dir: scratch,
        lxc_path: cfg.exec.lxc_path.clone(),
        ..PctConfig::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pve::error::decode_error;

    const STORED_CT: &str =
        "#customer notes\narch: amd64\nhostname: web\nonboot: 1\nprotection: 1\n\
        net0: name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:00:01,ip=10.1.2.3/24,type=veth\n\
        net3: name=lan,bridge=vmbr1,tag=20\nrootfs: local-lvm:vm-200-disk-0,size=8G\n";

    fn marker() -> Marker {
        Marker::new(ulid::Ulid::from_string("01JD0000000000000000000000").expect("ulid"))
    }

    fn opts(v: &[(String, String)]) -> Vec<(&str, &str)> {
        v.iter().map(|(k, x)| (k.as_str(), x.as_str())).collect()
    }

    #[test]
    fn an_isolated_copy_overrides_every_stored_nic_and_keeps_the_description() {
        let stored = StoredConfig::parse(STORED_CT);
        let o = restore_options(GuestKind::Lxc, true, true, Some(&stored), marker(), None);
        let line = marker().description_line();
        assert_eq!(
            opts(&o),
            [
                ("net0", "name=eth0,link_down=1"),
                ("net3", "name=lan,link_down=1"),
                ("onboot", "0"),
                ("protection", "0"),
                ("description", format!("{line}\ncustomer notes").as_str()),
            ]
        );
        // A VM: every stored NIC by its model, and no NIC the backup does not store.
        let vm = StoredConfig::parse("net1: e1000=BC:24:11:00:00:02,bridge=vmbr0\nscsi0: x\n");
        let o = restore_options(GuestKind::Qemu, true, true, Some(&vm), marker(), None);
        assert_eq!(
            &opts(&o)[..2],
            [("net1", "e1000,link_down=1"), ("onboot", "0")]
        );
        let none = StoredConfig::parse("scsi0: x\n");
        let o = restore_options(GuestKind::Qemu, true, true, Some(&none), marker(), None);
        assert!(o.iter().all(|(k, _)| !is_net_key(k)), "{o:?}");
    }

    #[test]
    fn a_vm_copy_with_a_lab_bridge_keeps_its_stored_models_and_macs_on_that_bridge_only() {
        let vm = StoredConfig::parse(
            "net0: virtio=BC:24:11:00:03:00,bridge=vmbr0,firewall=1\n\
             net1: e1000=BC:24:11:00:03:01,bridge=vmbr1,tag=20,rate=10\n\
             net2: model=rtl8139,macaddr=01:00:5E:00:00:01,bridge=vmbr2,trunks=10;20\nscsi0: x\n",
        );
        let o = restore_options(
            GuestKind::Qemu,
            true,
            true,
            Some(&vm),
            marker(),
            Some("vmbr9"),
        );
        assert_eq!(
            &opts(&o)[..3],
            [
                ("net0", "virtio=BC:24:11:00:03:00,bridge=vmbr9"),
                ("net1", "e1000=BC:24:11:00:03:01,bridge=vmbr9"),
                // A multicast MAC is no MAC PVE takes: a fresh one is given.
                ("net2", "rtl8139,bridge=vmbr9"),
            ]
        );
        // A container ignores it: its lab gives interfaces from inside.
        let ct = StoredConfig::parse(STORED_CT);
        let o = restore_options(
            GuestKind::Lxc,
            true,
            true,
            Some(&ct),
            marker(),
            Some("vmbr9"),
        );
        assert_eq!(opts(&o)[0], ("net0", "name=eth0,link_down=1"));
        // Not isolated: the stored NICs stay, whatever the key says.
        let o = restore_options(
            GuestKind::Qemu,
            false,
            false,
            Some(&vm),
            marker(),
            Some("vmbr9"),
        );
        assert!(o.iter().all(|(k, _)| !is_net_key(k)), "{o:?}");

        // The start check: on the lab bridge, untagged, passes; on another bridge, tagged, or
        // bridge-less (user-mode networking) is refused, naming the NIC and the lab bridge.
        let cfg = |pairs: &[(&str, &str)]| -> GuestConfig {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), Value::from(*v)))
                .collect()
        };
        let lab = cfg(&[
            ("net0", "virtio=BC:24:11:00:03:00,bridge=vmbr9"),
            ("net1", "e1000=BC:24:11:00:03:01,bridge=vmbr9,link_down=1"),
        ]);
        assert_eq!(
            start_refusal(GuestKind::Qemu, true, &lab, Some("vmbr9")),
            None
        );
        assert!(start_refusal(GuestKind::Qemu, true, &lab, None).is_some());
        for bad in [
            "virtio=BC:24:11:00:03:00,bridge=vmbr0",
            "virtio=BC:24:11:00:03:00,bridge=vmbr9,tag=20",
            "virtio=BC:24:11:00:03:00,bridge=vmbr9,trunks=10",
            "virtio=BC:24:11:00:03:00",
        ] {
            let why = start_refusal(GuestKind::Qemu, true, &cfg(&[("net0", bad)]), Some("vmbr9"))
                .unwrap_or_else(|| panic!("{bad} started"));
            assert!(
                why.contains("net0") && why.contains("lab bridge vmbr9"),
                "{why}"
            );
        }
        // The marker write deletes what is off the lab bridge, and only that.
        let mixed = cfg(&[
            ("net0", "virtio=BC:24:11:00:03:00,bridge=vmbr9"),
            ("net1", "virtio=BC:24:11:00:03:01,bridge=vmbr0"),
            ("net10", "virtio,link_down=1"),
        ]);
        assert_eq!(nics_off_the_lab(&mixed, Some("vmbr9")), ["net1", "net10"]);
        assert_eq!(nics_off_the_lab(&mixed, None), ["net0", "net1", "net10"]);
    }

    #[test]
    fn every_isolated_restore_sends_onboot_and_protection_off_as_its_start_check_demands() {
        // start_refusal refuses onboot and protection for every isolated transaction: the
        // restore of every isolated one sends both off, selftest or hub provision.
        let stored = StoredConfig::parse(STORED_CT);
        for selftest in [true, false] {
            let o = restore_options(
                GuestKind::Lxc,
                true,
                selftest,
                Some(&stored),
                marker(),
                None,
            );
            let o = opts(&o);
            assert!(
                o.contains(&("onboot", "0")) && o.contains(&("protection", "0")),
                "{o:?}"
            );
        }
    }

    #[test]
    fn a_customer_provision_sends_only_the_description() {
        let stored = StoredConfig::parse(STORED_CT);
        let o = restore_options(GuestKind::Lxc, false, false, Some(&stored), marker(), None);
        assert_eq!(o.len(), 1);
        assert_eq!(o[0].0, "description");
        assert!(o[0].1.ends_with("customer notes"));
        let o = restore_options(GuestKind::Lxc, false, false, None, marker(), None);
        assert_eq!(
            opts(&o),
            [("description", marker().description_line().as_str())]
        );
    }

    #[test]
    fn an_isolated_copy_starts_with_no_nic_and_nothing_that_reaches_the_host() {
        let cfg = |pairs: &[(&str, &str)]| -> GuestConfig {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), Value::from(*v)))
                .collect()
        };
        assert_eq!(
            start_refusal(GuestKind::Qemu, true, &cfg(&[("scsi0", "x")]), None),
            None
        );
        for (key, value) in [
            ("net0", "virtio,link_down=1"),
            ("args", "-netdev user,id=n0"),
            ("hostpci0", "mapping=vf0"),
            ("usb0", "host=1234:5678"),
            ("virtiofs0", "share"),
            ("ivshmem", "size=32,name=prod"),
            ("serial0", "/dev/ttyS0"),
            ("parallel0", "/dev/parport0"),
            ("vmstate", "local:vm-100-state-x"),
            ("template", "1"),
        ] {
            let why = start_refusal(GuestKind::Qemu, true, &cfg(&[(key, value)]), None);
            assert!(
                why.as_deref()
                    .is_some_and(|w| w.contains(key) || w.contains("template")),
                "{key}: {why:?}"
            );
        }
        // What stays the VM's own passes.
        for (key, value) in [
            ("usb0", "spice"),
            ("serial0", "socket"),
            ("ivshmem", "size=32"),
        ] {
            assert_eq!(
                start_refusal(GuestKind::Qemu, true, &cfg(&[(key, value)]), None),
                None,
                "{key}"
            );
        }
        // A container's bridge-less NIC too: it would kill the start (update_lxc_config).
        let why = start_refusal(
            GuestKind::Lxc,
            true,
            &cfg(&[("net0", "name=eth0,link_down=1")]),
            None,
        );
        assert!(why.is_some_and(|w| w.contains("net0")));
    }

    #[test]
    fn a_copy_with_a_bridged_or_linked_nic_or_onboot_is_not_started() {
        let cfg = |pairs: &[(&str, Value)]| -> GuestConfig {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect()
        };
        let ok = cfg(&[("hostname", Value::from("ct")), ("onboot", Value::from(0))]);
        assert_eq!(start_refusal(GuestKind::Lxc, true, &ok, None), None);
        let bridged = cfg(&[
            ("net0", Value::from("name=eth0,link_down=1")),
            ("net1", Value::from("name=eth1,bridge=vmbr0,ip=10.1.2.3/24")),
            ("onboot", Value::from(1)),
        ]);
        let why = start_refusal(GuestKind::Lxc, true, &bridged, None).expect("refused");
        assert!(
            why.contains("net1 (bridge=vmbr0)") && why.contains("onboot"),
            "{why}"
        );
        // A VM NIC without a bridge is user-mode networking.
        let slirp = cfg(&[("net0", Value::from("virtio=BC:24:11:00:00:01"))]);
        assert!(start_refusal(GuestKind::Qemu, true, &slirp, None).is_some());
        // Not isolated (a selftest provision): NICs do not count, protection does.
        let protected = cfg(&[
            ("net0", Value::from("name=eth0,bridge=vmbr0")),
            ("protection", Value::from(1)),
        ]);
        let why = start_refusal(GuestKind::Lxc, false, &protected, None).expect("refused");
        assert_eq!(why, "protection is set");
    }

    fn api(status: u16, message: &str) -> PveError {
        PveError::Api(decode_error(
            "POST",
            "/nodes/pve1/lxc",
            status,
            Some(message),
            b"{\"data\":null}",
        ))
    }

    #[test]
    fn only_certain_refusals_of_the_restore_are_refusals() {
        // Unknown: PVE may have started the task.
        for e in [
            api(500, "Internal Server Error"),
            api(596, "Connection timed out"),
            api(599, "Broken pipe"),
            api(502, "Bad Gateway"),
            PveError::Unreachable {
                url: "https://127.0.0.1:8006".into(),
                detail: "operation timed out".into(),
            },
            PveError::Decode {
                method: "POST",
                path: "/nodes/pve1/lxc".into(),
                detail: "not JSON".into(),
            },
        ] {
            assert!(submit_outcome_unknown(&e), "{e}");
        }
        // Certain: PVE refused before any task (facts §4.2, §5.2).
        for e in [
            api(500, "CT 140 already exists on node 'pve1'"),
            api(
                500,
                "unable to restore VM 140 - VM 140 already exists on node 'pve1'",
            ),
            api(500, "storage 'nope' does not exist"),
            api(500, "cluster not ready - no quorum?"),
            api(400, "Parameter verification failed."),
            api(403, "Permission check failed"),
            api(401, "Authentication failed!"),
            api(501, "Method 'POST /nodes/pve1/lxc' not implemented"),
        ] {
            assert!(!submit_outcome_unknown(&e), "{e}");
        }
    }

    #[test]
    fn an_own_restore_task_matches_type_vmid_token_and_time() {
        let token = "felhom@pve!agent";
        // starttime 0x6650C0DE = 1716568286.
        let upid = |ty: &str, id: &str, user: &str| {
            format!("UPID:pve1:0003A2F1:01B7E4C0:6650C0DE:{ty}:{id}:{user}:")
        };
        let since = 1_716_568_286;
        assert!(is_own_restore_task(
            &upid("vzrestore", "140", token),
            "vzrestore",
            140,
            token,
            since
        ));
        for (u, why) in [
            (upid("qmrestore", "140", token), "other type"),
            (upid("vzcreate", "140", token), "a create, not a restore"),
            (upid("vzrestore", "141", token), "other vmid"),
            (
                upid("vzrestore", "140", "felhom@pve"),
                "the user, not the token",
            ),
            (
                upid("vzrestore", "140", "felhom@pve!other"),
                "another token",
            ),
            ("not a upid".to_string(), "garbage"),
        ] {
            assert!(
                !is_own_restore_task(&u, "vzrestore", 140, token, since),
                "{why}"
            );
        }
        assert!(
            !is_own_restore_task(
                &upid("vzrestore", "140", token),
                "vzrestore",
                140,
                token,
                since + 1
            ),
            "started before the intent"
        );
    }
}
