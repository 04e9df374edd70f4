//! `--selftest=restore`: prove that this node's backups really restore and boot, every guest's
//! newest backup within `[restore_test] prove_within`.
//!
//! A run reads the backups of the node's pool guests (or the configured
//! `restore_test.sources`) and the proof store ([`coverage`]), and restores every backup that
//! is due, the longest unproven first, up to `[restore_test] at_once` copies at a time within
//! the node's free memory and the band's free vmids. Each copy is its own transaction: the
//! first vmid of the restore-test band 990000..=990009 that is free in the FULL guest list and
//! not taken by another copy, its own vmid lock and guest lock, its own journal entry, checks,
//! verdict and hub result, destroyed through the ownership gate. Restores are submitted one
//! after another ([`SubmitGate`]). A copy that fails never stops the others; Ctrl-C or
//! SIGTERM stops the run, every copy left for `journal resume`. Each settled copy's verdict is
//! recorded against its backup volid; metrics for node_exporter's textfile collector are
//! written atomically after the run.
//!
//! Part of the transaction service: it returns a [`RestoreTestRun`], never printed output.

pub mod coverage;
pub mod group_result;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use self::coverage::{CoverageRow, GuestBackups, Policy, ProofStore, TestRecord, Verdict};
use super::{full_list, pool_view, prepare, prepare_read_only};
use crate::config::Config;
use crate::error::{exit_status, ErrorCode, ExitStatus, Failure};
use crate::inventory::join;
use crate::metrics;
use crate::preflight::PreflightReport;
use crate::provision::effects::{Driven, Executor, Reporter, SubmitGate};
use crate::provision::machine::{Event, OutcomeKind, Request, State, TxnKind};
use crate::provision::{GuestProofLock, LabBridgeLock, VmidLock};
use crate::pve::types::{backup_kind_from_volid, BackupVolume};
use crate::pve::{GuestKind, PveClient};
use crate::vmid::{GuestLookup, RESTORE_TEST_BAND};

/// The run state file in the state dir (runs, skips, the last success).
pub const ROTATION_FILE: &str = "restore-test.json";
/// The metrics file in the textfile collector folder.
pub const METRICS_FILE: &str = metrics::RESTORE_TEST_FILE;

/// The last restore test's result in the state dir (`journal --last restore-test` shows its
/// checks: the journal keeps the transaction, not the rows its checks saw).
pub const LAST_RESULT_FILE: &str = "restore-test-last.json";
/// The most of [`LAST_RESULT_FILE`] that is read.
const LAST_RESULT_MAX_BYTES: u64 = 4 << 20;

/// The last restore test as its run (or the resume that took it up) ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LastResult {
    /// The transaction.
    pub txn: String,
    /// The backup restored.
    pub backup: String,
    /// The copy's vmid.
    pub vmid: Option<u32>,
    /// How it ended (`ok`, `failed`, `refused`, `needs_human`, `skipped`, `interrupted`).
    pub ending: String,
    /// Each check with its verdict and why.
    pub checks: Vec<crate::guest::checks::CheckResult>,
    /// What the boot wait waited for and saw.
    pub boot: Option<String>,
    /// What the isolation changed in the copy.
    pub isolation: Option<String>,
    /// The guest whose backup it proves.
    #[serde(default)]
    pub guest: Option<u32>,
    /// For a member of an application group: the group's run, every member with its verdict.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<group_result::GroupResult>,
}

fn last_result_of(driven: &Driven) -> LastResult {
    LastResult {
        txn: driven.state.txn().to_string(),
        backup: driven.state.request().volid.clone(),
        vmid: driven.state.vmid(),
        ending: metrics_label(driven).to_string(),
        checks: driven.checks.clone(),
        boot: driven.boot.clone(),
        isolation: driven.isolation.clone(),
        guest: proven_guest(&driven.state),
        group: None,
    }
}

/// Store `driven`'s result as the last restore test's; a failure is logged only (the journal
/// holds the transaction either way).
fn store_last_result(cfg: &Config, driven: &Driven) {
    let last = last_result_of(driven);
    let path = cfg.state_dir.join(LAST_RESULT_FILE);
    let stored = serde_json::to_vec_pretty(&last)
        .map_err(std::io::Error::other)
        .and_then(|bytes| write_atomic(&path, &bytes, 0o600));
    if let Err(e) = stored {
        tracing::warn!(path = %path.display(), error = %e, "cannot store the restore test's result; `journal --last restore-test` will show the transaction without its checks");
    }
}

/// The last restore test's stored result, when there is one that reads.
pub fn read_last_result(cfg: &Config) -> Option<LastResult> {
    use std::io::Read;
    let file = fs::File::open(cfg.state_dir.join(LAST_RESULT_FILE)).ok()?;
    let mut bytes = Vec::new();
    file.take(LAST_RESULT_MAX_BYTES)
        .read_to_end(&mut bytes)
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// What the run state remembers between runs (the file keeps its older name).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RotationState {
    /// The guest (or source volid) of the copy settled last.
    pub last: Option<String>,
    /// Unix time of the last successful run.
    pub last_success: Option<u64>,
    /// Runs skipped because the band was full, since the state was created.
    pub skipped_total: u64,
    /// Runs, since the state was created.
    pub runs_total: u64,
}

fn read_rotation(path: &Path) -> RotationState {
    fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// The rotation file, in the state dir (root's, 0700): written through a temporary name.
fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let tmp = path.with_extension("tmp");
    {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Per-guest last results: `restore-test-last-<guest>.json` beside [`LAST_RESULT_FILE`].
fn guest_last_result_path(cfg: &Config, guest: u32) -> std::path::PathBuf {
    cfg.state_dir
        .join(format!("restore-test-last-{guest}.json"))
}

/// The last restore test of guest `guest`'s backups, when one is stored.
pub fn read_guest_last_result(cfg: &Config, guest: u32) -> Option<LastResult> {
    use std::io::Read;
    let file = fs::File::open(guest_last_result_path(cfg, guest)).ok()?;
    let mut bytes = Vec::new();
    file.take(LAST_RESULT_MAX_BYTES)
        .read_to_end(&mut bytes)
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// The guest a restore-test transaction proves: the owner of its backup.
pub fn proven_guest(state: &State) -> Option<u32> {
    crate::pve::types::backup_guest(&state.request().volid)
}

/// The proof store's lock: a run and a resume in another process update the store one at a
/// time (read, change, write).
fn with_store<T>(cfg: &Config, f: impl FnOnce(&mut ProofStore) -> T) -> Result<T, String> {
    use nix::fcntl::{Flock, FlockArg};
    use std::os::unix::fs::OpenOptionsExt;
    let lock_path = cfg.state_dir.join("restore-proofs.lock");
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&lock_path)
        .map_err(|e| format!("cannot open {}: {e}", lock_path.display()))?;
    let _held = Flock::lock(file, FlockArg::LockExclusive)
        .map_err(|(_, e)| format!("cannot lock {}: {e}", lock_path.display()))?;
    let mut store = coverage::read_store(&cfg.state_dir)?;
    let out = f(&mut store);
    store.version = 1;
    let bytes = serde_json::to_vec_pretty(&store).map_err(|e| e.to_string())?;
    let path = cfg.state_dir.join(coverage::PROOFS_FILE);
    write_atomic(&path, &bytes, 0o600)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(out)
}

/// Codes of a preflight refusal that no later run can overcome for the same backup: the
/// backup itself is not fit to be a copy.
fn refuses_for_good(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::BackupPrivileged
            | ErrorCode::BackupMounts
            | ErrorCode::BackupDevices
            | ErrorCode::BackupHookscript
            | ErrorCode::BackupArgs
            | ErrorCode::BackupHostDir
            | ErrorCode::BackupSharedMemory
            | ErrorCode::BackupHostPort
            | ErrorCode::BackupVmstate
            | ErrorCode::BackupTemplate
            | ErrorCode::BackupQuota
            | ErrorCode::GuestAgentOff
            | ErrorCode::GuestOsUnjudged
    )
}

/// A copy that ended on a timeout (a task, its launch proof or its boot): under the load of
/// other copies it may say nothing of the backup.
fn timed_out(driven: &Driven) -> bool {
    driven.state.outcome_kind() == Some(OutcomeKind::Failed)
        && driven.state.failure().is_some_and(|f| {
            matches!(
                f.code,
                ErrorCode::TaskTimeout | ErrorCode::LaunchUnproven | ErrorCode::BootUnfinished
            )
        })
}

/// A failure that says nothing about the backup: the storage's lock timed out while another
/// restore or backup allocated (pve-common `lock_file_full`: "can't lock file '…' - got
/// timeout"; `cfs_lock_storage`: "cfs-lock '…' error: got lock request timeout"), or another
/// node took the vmid first (pmxcfs: "config file already exists"). The guest stays due.
pub fn transient_failure(f: &Failure) -> bool {
    let m = f.message.as_str();
    m.contains("got timeout")
        || m.contains("got lock request timeout")
        || m.contains("already exists")
}

/// What a settled copy proves of its backup, if anything: `None` for an ending that says
/// nothing about the backup (interrupted, needs a human, a transient fault, an environment
/// refusal, a full band).
pub fn verdict_of(driven: &Driven) -> Option<Verdict> {
    let state = &driven.state;
    match state.outcome_kind()? {
        OutcomeKind::Ok => Some(Verdict::Ok),
        OutcomeKind::Failed => match state.failure() {
            Some(f) if transient_failure(f) => None,
            // The copy booted, but its guest agent refuses every command: the backup can no
            // more be judged on the next run than on this one, until the guest allows exec
            // and is backed up again.
            Some(f) if f.code == ErrorCode::GuestExecBlocked => Some(Verdict::Unprovable),
            _ => Some(Verdict::Failed),
        },
        OutcomeKind::Refused => state
            .failure()
            .filter(|f| refuses_for_good(f.code))
            .map(|_| Verdict::Unprovable),
        OutcomeKind::Skipped | OutcomeKind::NeedsHuman => None,
    }
}

/// Record what `driven` proves of its backup in the proof store, and keep its result as its
/// guest's last. A store that cannot be written is logged (the journal keeps the
/// transaction); `Err` says why.
fn record_proof(
    cfg: &Config,
    driven: &Driven,
    guest: Option<u32>,
    backup_time: Option<u64>,
) -> Result<(), String> {
    let state = &driven.state;
    let Some(guest) = guest.or_else(|| proven_guest(state)) else {
        return Ok(());
    };
    store_guest_last_result(cfg, guest, driven);
    let Some(verdict) = verdict_of(driven) else {
        return Ok(());
    };
    let failing = driven
        .checks
        .iter()
        .filter(|c| {
            use crate::guest::checks::CheckStatus;
            matches!(c.status, CheckStatus::Fail | CheckStatus::Error)
        })
        .map(|c| c.name.clone())
        .collect();
    let rec = TestRecord {
        txn: state.txn().to_string(),
        at: unix_now(),
        verdict,
        code: state.failure().map(|f| f.code.as_str().to_string()),
        message: state.failure().map(|f| f.message.clone()),
        failing,
        copy: state.vmid(),
    };
    let volid = state.request().volid.clone();
    with_store(cfg, |store| store.record(&volid, guest, backup_time, rec))
}

fn store_guest_last_result(cfg: &Config, guest: u32, driven: &Driven) {
    let last = last_result_of(driven);
    let path = guest_last_result_path(cfg, guest);
    let stored = serde_json::to_vec_pretty(&last)
        .map_err(std::io::Error::other)
        .and_then(|bytes| write_atomic(&path, &bytes, 0o600));
    if let Err(e) = stored {
        tracing::warn!(path = %path.display(), error = %e, "cannot store guest {guest}'s restore test result");
    }
}

/// One copy of a run.
#[derive(Debug, Clone)]
pub struct CopyRun {
    /// The guest whose backup it proves.
    pub guest: u32,
    /// The guest's name, when known.
    pub name: String,
    /// The backup restored.
    pub backup: String,
    /// The transaction.
    pub driven: Driven,
    /// The preflight's checks.
    pub preflight: Option<PreflightReport>,
    /// What the copy proved of the backup (`None`: nothing, the guest stays due).
    pub verdict: Option<Verdict>,
    /// It ended on a fault that says nothing of the backup ([`transient_failure`]: the
    /// storage's lock, a vmid another node took first): retried once in the run, never red.
    pub transient: bool,
    /// It timed out while other copies ran: tried once more alone, never counted itself.
    pub try_alone: bool,
    /// It is the run's second try of this guest's backup.
    pub retry: bool,
    /// The backup's time, for a retry.
    backup_time: u64,
    /// What a retry needs of the listing.
    notes_first_line: Option<String>,
    listed: bool,
}

/// A due guest a run did not prove, and why.
#[derive(Debug, Clone, Serialize)]
pub struct Left {
    /// The guest.
    pub guest: u32,
    /// Its newest backup.
    pub backup: String,
    /// Why it was left.
    pub reason: String,
    /// The code of why, when it is an error of the environment (it counts in the exit code).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code: Option<ErrorCode>,
}

/// What one restore-test run did.
#[derive(Debug, Clone)]
pub struct RestoreTestRun {
    /// The run's id (the hub's dispatch id; the first copy's transaction).
    pub run: Ulid,
    /// The copies, in the order they settled.
    pub copies: Vec<CopyRun>,
    /// The due guests it did not prove, and why.
    pub left: Vec<Left>,
    /// Guests that were due when it started.
    pub due: usize,
    /// The band, as `990000-990009`.
    pub band: String,
    /// At most this many copies ran at once.
    pub at_once: usize,
    /// Whether it was a dry run.
    pub dry_run: bool,
    /// The coverage after the run (empty for a dry run).
    pub coverage: Vec<CoverageRow>,
    /// Why the metrics file could not be written, if it could not.
    pub metrics_error: Option<String>,
    /// Whether the run was stopped (Ctrl-C, SIGTERM).
    pub interrupted: bool,
    /// Seconds the run took.
    pub duration_s: f64,
    /// The most copies that were running at one time.
    pub peak_at_once: usize,
}

impl RestoreTestRun {
    /// The run's exit status: the worst of its copies' and of what it left for a reason of
    /// the environment (7 > 6 > 5 > 4 > 3 > 0); 130 when it was stopped.
    pub fn status(&self) -> ExitStatus {
        if self.interrupted {
            return ExitStatus::Interrupted;
        }
        let rank = |s: ExitStatus| match s {
            ExitStatus::NeedsHuman => 6,
            ExitStatus::Environment => 5,
            ExitStatus::GuestFailed => 4,
            ExitStatus::PveFailed => 3,
            ExitStatus::Refused => 2,
            ExitStatus::Usage => 1,
            ExitStatus::Interrupted => 7,
            ExitStatus::Ok => 0,
        };
        self.copies
            .iter()
            .filter(|c| !c.transient)
            .map(|c| c.driven.exit_status())
            .chain(self.left.iter().filter_map(|l| l.code.map(exit_status)))
            .max_by_key(|s| rank(*s))
            .unwrap_or(ExitStatus::Ok)
    }

    /// The run's outcome in the metrics: the worst copy's ending, `skipped` when the band left
    /// no room for any, `ok` when nothing was due or every copy proved its backup.
    pub fn metrics_outcome(&self) -> &'static str {
        let endings: Vec<&'static str> = self
            .copies
            .iter()
            .filter(|c| !c.transient)
            .map(|c| metrics_label(&c.driven))
            .collect();
        for worst in ["needs_human", "failed", "refused", "interrupted"] {
            if endings.contains(&worst) {
                return worst;
            }
        }
        if self.left.iter().any(|l| l.code.is_some()) {
            return "error";
        }
        if self.copies.is_empty() && !self.left.is_empty() {
            return "skipped";
        }
        "ok"
    }
}

/// The label of a copy's end in the metrics: its outcome, `interrupted` for a stop the journal
/// resumes, `needs_human` for a drive halted otherwise (open, and nothing resumes it by itself).
pub fn metrics_label(driven: &Driven) -> &'static str {
    driven.ending().unwrap_or("needs_human")
}

/// What a run is asked to do.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// Plan only: nothing is written.
    pub dry_run: bool,
    /// Prove this guest's newest backup now, due or not.
    pub guest: Option<u32>,
}

/// `backup_max_age` when neither the config nor a backup job's schedule says: 8 days (a weekly
/// backup is not stale).
const DEFAULT_BACKUP_MAX_AGE: u64 = 8 * 86_400;

/// The coverage policy of the config.
pub fn policy(cfg: &Config) -> Policy {
    Policy {
        prove_within: cfg.restore_test.prove_within,
        reprove_after: cfg.restore_test.reprove_after,
        backup_max_age: cfg
            .restore_test
            .backup_max_age
            .unwrap_or(DEFAULT_BACKUP_MAX_AGE),
    }
}

/// The time of a backup from its volid's name (`…-2026_01_01-00_00_00…`), for a source the
/// storage was not asked about.
fn time_from_volid(volid: &str) -> Option<u64> {
    let name = volid.rsplit('/').next()?;
    let fmt = time::macros::format_description!("[year]_[month]_[day]-[hour]_[minute]_[second]");
    // vzdump names its files `vzdump-<type>-<vmid>-YYYY_MM_DD-hh_mm_ss.<ext>`.
    name.split('-')
        .collect::<Vec<_>>()
        .windows(2)
        .find_map(|w| {
            let stamp = format!("{}-{}", w[0], w[1].get(..8)?);
            time::PrimitiveDateTime::parse(&stamp, &fmt).ok()
        })
        .and_then(|t| u64::try_from(t.assume_utc().unix_timestamp()).ok())
}

/// The guests whose backups this node proves, with their backups: the pool guests this node
/// holds (its `.vmlist` node), outside the reserved bands; or each configured source.
pub async fn guests_with_backups(
    cfg: &Config,
    pve: &PveClient,
) -> Result<(Vec<GuestBackups>, BTreeSet<String>), Failure> {
    let full = full_list(cfg)?;
    let pool = pool_view(cfg, pve).await?;
    let inventory = join(&full, &pool);
    if !cfg.restore_test.sources.is_empty() {
        let mut by_guest: BTreeMap<u32, GuestBackups> = BTreeMap::new();
        for volid in &cfg.restore_test.sources {
            let owner = crate::pve::types::backup_guest(volid).unwrap_or(0);
            let name = pool
                .get(owner)
                .and_then(|g| g.name.clone())
                .unwrap_or_default();
            by_guest
                .entry(owner)
                .or_insert_with(|| GuestBackups {
                    vmid: owner,
                    name,
                    backups: Vec::new(),
                    max_age: None,
                })
                .backups
                .push(coverage::BackupRef {
                    volid: volid.clone(),
                    time: time_from_volid(volid).unwrap_or(0),
                    size: None,
                    notes_first_line: None,
                });
        }
        return Ok((by_guest.into_values().collect(), BTreeSet::new()));
    }
    let mut volumes: Vec<BackupVolume> = Vec::new();
    for sid in &cfg.restore_test.backup_storages {
        let mut v = pve.backups(&cfg.node, sid, None).await.map_err(|e| {
            Failure::new(
                e.code(),
                format!("cannot list the backups on storage {sid} of node {}: {e}; check that the storage exists and that the token has Datastore.Audit on /storage/{sid}", cfg.node),
            )
        })?;
        volumes.append(&mut v);
    }
    let listed: BTreeSet<String> = volumes.iter().map(|v| v.volid.clone()).collect();
    let mut guests: BTreeMap<u32, GuestBackups> = BTreeMap::new();
    for g in pool.guests() {
        let here = inventory.get(g.vmid).is_some_and(|r| r.node == cfg.node);
        if !here || crate::vmid::ReservedBand::of(g.vmid).is_some() {
            continue;
        }
        guests.insert(
            g.vmid,
            GuestBackups {
                vmid: g.vmid,
                name: g.name.clone().unwrap_or_default(),
                backups: Vec::new(),
                max_age: None,
            },
        );
    }
    for v in volumes {
        let Some(owner) = v.vmid.and_then(|o| u32::try_from(o).ok()) else {
            continue;
        };
        if backup_kind_from_volid(&v.volid).is_none() {
            continue;
        }
        if let Some(g) = guests.get_mut(&owner) {
            g.backups.push(coverage::BackupRef {
                volid: v.volid.clone(),
                time: v.ctime.or_else(|| time_from_volid(&v.volid)).unwrap_or(0),
                size: v.size,
                notes_first_line: v.notes.clone(),
            });
        }
    }
    if cfg.restore_test.backup_max_age.is_none() && !guests.is_empty() {
        let jobs = node_backup_jobs(cfg);
        let now = i64::try_from(unix_now()).unwrap_or(i64::MAX);
        let gaps: Vec<(&crate::exec_helper::jobs_cfg::BackupJob, u64)> = jobs
            .iter()
            .filter_map(|j| Some((j, schedule_gap(j.schedule.as_deref()?, now)?)))
            .collect();
        for g in guests.values_mut() {
            g.max_age = gaps
                .iter()
                .filter(|(j, _)| job_backs_up(j, &cfg.pool, g.vmid))
                .map(|(_, gap)| gap.saturating_add(SCHEDULE_SLACK))
                .min();
        }
    }
    Ok((guests.into_values().collect(), listed))
}

/// What a scheduled backup may take beyond the gap between two starts before its guest is
/// stale: a day (a daily job's backup is stale after two days, a weekly one's after eight).
const SCHEDULE_SLACK: u64 = 86_400;

/// The longest time between two starts of `schedule` over the next five weeks from `now`
/// (`None`: PVE would refuse it, or it starts fewer than twice).
fn schedule_gap(schedule: &str, now: i64) -> Option<u64> {
    let event = crate::pve::calendar::CalendarEvent::parse(schedule).ok()?;
    let end = now.saturating_add(35 * 86_400);
    let mut last = event.next_after(now)?;
    let mut gap: Option<u64> = None;
    // A schedule of every minute has 50400 starts in five weeks; its gap is known after the
    // first few hundred.
    for _ in 0..2000 {
        let Some(next) = event.next_after(last) else {
            break;
        };
        let d = u64::try_from(next.saturating_sub(last)).unwrap_or(0);
        gap = Some(gap.map_or(d, |g| g.max(d)));
        if next > end {
            break;
        }
        last = next;
    }
    gap
}

/// Whether backup job `job` backs up guest `vmid` of the agent's pool `pool` when it starts
/// (pve-manager `PVE/VZDump.pm` `get_included_guests`; a guest belongs to one pool at most).
fn job_backs_up(job: &crate::exec_helper::jobs_cfg::BackupJob, pool: &str, vmid: u32) -> bool {
    use crate::exec_helper::jobs_cfg::Selection;
    match job.selection() {
        Selection::Pool(p) => p == pool,
        Selection::Vmids(v) => v.contains(&vmid),
        Selection::All { exclude } => !exclude.contains(&vmid),
        Selection::Refused(_) => false,
    }
}

/// The coverage of the node now (what `restore-report` shows): reads only.
pub async fn coverage_now(cfg: &Config, pve: &PveClient) -> Result<Vec<CoverageRow>, Failure> {
    let (guests, _) = guests_with_backups(cfg, pve).await?;
    let store = coverage::read_store(&cfg.state_dir)
        .map_err(|m| Failure::new(ErrorCode::ConfigInvalid, m))?;
    Ok(coverage_rows(cfg, &guests, &store))
}

/// The coverage of `guests` now by the proofs in `store`, each row naming its guest's
/// application group by the config.
fn coverage_rows(cfg: &Config, guests: &[GuestBackups], store: &ProofStore) -> Vec<CoverageRow> {
    coverage::name_groups(
        coverage::rows(guests, store, &policy(cfg), unix_now()),
        |vmid| cfg.restore_test.group_of(vmid).map(|g| g.name.clone()),
    )
}

/// The most of a job's state file that is read (PVE writes a small JSON object).
const JOB_STATE_MAX_BYTES: u64 = 64 << 10;

/// The backup jobs of this node: enabled `vzdump` jobs of `jobs.cfg` (handed over by the exec
/// helper) with a schedule, for this node or every node (pve-manager `PVE/Jobs.pm` `run_jobs`
/// schedules only those). Empty when the file cannot be read (the band's `exclude`, which
/// doctor checks, is the guard then).
fn node_backup_jobs(cfg: &Config) -> Vec<crate::exec_helper::jobs_cfg::BackupJob> {
    let Ok(Some(text)) =
        crate::exec_helper::client::node_file(cfg, crate::exec_helper::proto::ClusterFile::JobsCfg)
    else {
        return Vec::new();
    };
    crate::exec_helper::jobs_cfg::parse(&text)
        .into_iter()
        .filter(|j| j.runs_on(&cfg.node))
        // PVE's job ids are config ids (letters, digits, `-`, `_`): nothing else names a file.
        .filter(|j| {
            !j.id.is_empty()
                && j.id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        })
        .collect()
}

/// A job's state file (`<jobs_state_dir>/vzdump-<id>.json`, pve-manager `PVE/Jobs.pm`), read
/// without following a link, never blocking on a FIFO, bounded; `None` when unreadable.
fn job_state(cfg: &Config, id: &str) -> Option<serde_json::Value> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let path = cfg.jobs_state_dir.join(format!("vzdump-{id}.json"));
    let mut bytes = Vec::new();
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(&path)
        .and_then(|f| f.take(JOB_STATE_MAX_BYTES).read_to_end(&mut bytes))
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// The state says the job runs: `starting` or `started` (`starting_job`/`started_job`). Such
/// a job fixed its guest list at its start (pve-manager `PVE/VZDump.pm`
/// `get_included_guests`): a copy started now could be backed up and locked by it, or fail it.
fn job_runs(state: &serde_json::Value) -> bool {
    state
        .get("state")
        .and_then(|s| s.as_str())
        .is_some_and(|s| s == "started" || s == "starting")
}

/// The time pvescheduler counts the job's next start from (`PVE/Jobs.pm` `get_last_runtime`):
/// `updated`, else the start of its last task (its UPID), else `time`, else 0.
fn job_last_run(state: Option<&serde_json::Value>) -> i64 {
    let Some(state) = state else { return 0 };
    if let Some(t) = state.get("updated").and_then(serde_json::Value::as_i64) {
        return t;
    }
    if let Some(upid) = state.get("upid").and_then(|u| u.as_str()) {
        if let Ok(u) = upid.parse::<crate::pve::Upid>() {
            return i64::try_from(u.starttime).unwrap_or(i64::MAX);
        }
    }
    state
        .get("time")
        .and_then(serde_json::Value::as_i64)
        .unwrap_or(0)
}

/// Why no copy may start now because of the node's backup jobs, or `None`: a job of this node
/// runs, or one starts within `[restore_test] backup_guard` (its next start is the first event
/// of its `schedule` after its last run, as pvescheduler computes it; one already past starts
/// within the minute). A schedule PVE would refuse says nothing (PVE does not run the job).
fn backup_window(
    cfg: &Config,
    jobs: &[crate::exec_helper::jobs_cfg::BackupJob],
    now: i64,
) -> Option<String> {
    let mut running = Vec::new();
    let mut soonest: Option<(i64, &str, &str)> = None;
    for j in jobs {
        let state = job_state(cfg, &j.id);
        if state.as_ref().is_some_and(job_runs) {
            running.push(crate::error::outside_text(&j.id));
            continue;
        }
        let Some(schedule) = j.schedule.as_deref() else {
            continue;
        };
        let Ok(event) = crate::pve::calendar::CalendarEvent::parse(schedule) else {
            continue;
        };
        let Some(next) = event.next_after(job_last_run(state.as_ref())) else {
            continue;
        };
        let next = next.max(now);
        if soonest.is_none_or(|(t, _, _)| next < t) {
            soonest = Some((next, &j.id, schedule));
        }
    }
    if !running.is_empty() {
        return Some(format!(
            "backup job {} runs on node {} now (PVE's job state: started); a copy started during it could be backed up and locked by it: the next run proves this guest",
            running.join(", "),
            cfg.node
        ));
    }
    let guard = i64::try_from(cfg.restore_test.backup_guard).unwrap_or(i64::MAX);
    let (next, id, schedule) = soonest?;
    (next.saturating_sub(now) < guard).then(|| {
        format!(
            "backup job {} of node {} starts at {} (schedule {:?}), within [restore_test] backup_guard = {}: a copy started now could be backed up and locked by it; the next run after the job proves this guest",
            crate::error::outside_text(id),
            cfg.node,
            time::OffsetDateTime::from_unix_timestamp(next)
                .map_or_else(|_| next.to_string(), crate::timefmt::rfc3339),
            crate::error::outside_text(schedule),
            crate::config::human_secs(cfg.restore_test.backup_guard),
        )
    })
}

/// `at_once = "auto"`: the band's vmids free in the full guest list, less one for every other
/// node of the cluster (each may run a restore test of its own), at least 1, at most 10.
fn auto_at_once(full: &crate::inventory::FullGuestList, node: &str) -> usize {
    let held = RESTORE_TEST_BAND
        .clone()
        .filter(|v| full.lookup(*v).is_some())
        .count();
    let others: BTreeSet<&str> = full
        .entries()
        .map(|e| &*e.node)
        .filter(|n| *n != node)
        .collect();
    let band = RESTORE_TEST_BAND.clone().count();
    band.saturating_sub(held)
        .saturating_sub(others.len())
        .clamp(1, crate::config::AT_ONCE_MAX)
}

/// `restore-report`: the coverage of every guest this node proves. Reads only.
pub async fn report(cfg: &Config) -> Result<Vec<CoverageRow>, Failure> {
    let prepared = prepare_read_only(cfg)?;
    coverage_now(cfg, &prepared.pve).await
}

/// The node's memory for copies (MiB): what is available now less the reserve.
fn memory_for_copies(cfg: &Config) -> Option<u64> {
    crate::preflight::memory::node_memory_for_copies(cfg).map(|(now, _)| now)
}

/// The spacing of restore requests of one run (see [`SubmitGate`]): an allocation holds the
/// storage's lock for about a second (lvcreate of a thin volume), and a request waits up to
/// 10 s for it, so two seconds apart no restore meets more than one allocation in its way.
const SUBMIT_SPACING: Duration = Duration::from_secs(2);

#[cfg(not(feature = "test-hooks"))]
fn submit_spacing() -> Duration {
    SUBMIT_SPACING
}

#[cfg(feature = "test-hooks")]
fn submit_spacing() -> Duration {
    std::env::var("FELHOM_AGENT_SUBMIT_SPACING_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(SUBMIT_SPACING, Duration::from_millis)
}

/// Container copies at once stay below the exec helper's connections (a container copy holds
/// one for its whole boot; `.vmlist` reads must never wait behind them).
const CONTAINERS_AT_ONCE_MAX: usize = 6;

/// One due guest waiting for its copy.
#[derive(Debug, Clone)]
struct Pending {
    guest: u32,
    name: String,
    volid: String,
    backup_time: u64,
    kind: GuestKind,
    /// The run's second try (after a fault that said nothing of the backup).
    retry: bool,
    /// Tried alone: no other copy runs beside it (the second try of a copy that timed out
    /// while others ran).
    alone: bool,
    /// The first line of the backup's notes as listed (`None` when a source, not listed).
    notes_first_line: Option<String>,
    /// Whether the backup was listed (the notes are written only then).
    listed: bool,
    /// Its place in an application group's run (`None`: a copy alone).
    group: Option<crate::provision::GroupMember>,
}

impl Pending {
    /// The run's first try of `row`'s newest backup `b` (of `kind`), alone or as a member of
    /// an application group.
    fn first_try(
        cfg: &Config,
        row: &CoverageRow,
        b: &coverage::BackupRef,
        kind: GuestKind,
        group: Option<crate::provision::GroupMember>,
    ) -> Pending {
        Pending {
            guest: row.vmid,
            name: row.name.clone(),
            volid: b.volid.clone(),
            backup_time: b.time,
            kind,
            retry: false,
            alone: false,
            notes_first_line: b.notes_first_line.clone(),
            listed: cfg.restore_test.sources.is_empty(),
            group,
        }
    }
}

/// A copy under way, as admission counts it (or the sum of those under way).
struct Running {
    guest: u32,
    kind: GuestKind,
    /// The lab bridge a VM copy's NICs are on (one VM copy per bridge).
    bridge: Option<String>,
    /// Its stored memory (MiB).
    memory: u64,
    /// The bytes its restore allocates on the target storage.
    disks: u64,
    /// It runs alone (nothing is admitted beside it).
    alone: bool,
    /// Set once another copy ran beside it.
    overlapped: Arc<std::sync::atomic::AtomicBool>,
}

/// What the copies under way hold when the next is admitted, and the lab bridge free for it.
struct Room {
    /// Their stored memory (MiB).
    memory: u64,
    /// The bytes their restores allocate on the target storage.
    disks: u64,
    /// The lab bridge no copy under way is on (for a VM copy; `None` for a container, or when
    /// no lab bridge is configured).
    lab_bridge: Option<String>,
}

/// A copy admitted: its locks, held until it settled.
struct Admitted {
    pending: Pending,
    request: Request,
    report: PreflightReport,
    first: Event,
    memory: u64,
    /// The bytes its restore allocates on the target storage.
    disks: u64,
    /// `None` for a dry run, which takes no lock.
    locks: Option<CopyLocks>,
    /// Set once another copy ran beside it (the run loop sets it).
    overlapped: Arc<std::sync::atomic::AtomicBool>,
}

/// A copy's locks: its vmid's, its guest's, the lab bridge's for a VM.
type CopyLocks = (VmidLock, GuestProofLock, Option<LabBridgeLock>);

/// One restore-test run under `run_id` (`--selftest=restore`, the timer, or a hub dispatch;
/// the first copy's transaction is `run_id`). `Err` when it ended before any copy could be
/// considered (PVE not answering, no backup storage, a proof store that cannot be read); the
/// restore-test metrics then say so ([`early_end_label`]), unless it was a dry run.
pub async fn run(
    cfg: &Config,
    opts: RunOptions,
    run_id: Ulid,
    reporter: &dyn Reporter,
    cancel: CancellationToken,
) -> Result<RestoreTestRun, Failure> {
    let started = std::time::Instant::now();
    let ran = run_inner(cfg, opts, run_id, reporter, cancel, started).await;
    if let (Err(f), false) = (&ran, opts.dry_run) {
        if let Err(e) = write_early_end_metrics(cfg, f, started.elapsed().as_secs_f64()) {
            tracing::warn!("restore-test metrics not updated: {e}");
        }
    }
    ran
}

async fn run_inner(
    cfg: &Config,
    opts: RunOptions,
    run_id: Ulid,
    reporter: &dyn Reporter,
    cancel: CancellationToken,
    started: std::time::Instant,
) -> Result<RestoreTestRun, Failure> {
    let prepared = if opts.dry_run {
        prepare_read_only(cfg)?
    } else {
        prepare(cfg, reporter, &cancel).await?
    };
    // The copies at once share one client, at most two requests in flight.
    let pve = &prepared
        .pve
        .clone()
        .with_max_in_flight(crate::pve::client::MAX_IN_FLIGHT);
    let (guests, listed) = guests_with_backups(cfg, pve).await?;
    let store = coverage::read_store(&cfg.state_dir)
        .map_err(|m| Failure::new(ErrorCode::ConfigInvalid, m))?;
    let rows = coverage_rows(cfg, &guests, &store);
    let chosen: Vec<&CoverageRow> = match opts.guest {
        Some(g) => {
            let Some(row) = rows.iter().find(|r| r.vmid == g) else {
                return Err(Failure::new(
                    ErrorCode::VmidInvalid,
                    format!(
                        "guest {g} is not a pool guest of node {} whose backups this node proves (pool {}); `felhom-agent restore-report` lists those it proves",
                        cfg.node, cfg.pool
                    ),
                ));
            };
            if row.newest_backup.is_none() {
                return Err(Failure::new(
                    ErrorCode::BackupMissing,
                    format!(
                        "guest {g} has no backup on the backup storage(s) {} of node {}; back it up first (`vzdump {g} --storage …`) or name its storage in [restore_test] backup_storages of {}",
                        cfg.restore_test.backup_storages.join(", "),
                        cfg.node,
                        cfg.path.display()
                    ),
                ));
            }
            vec![row]
        }
        None => coverage::due_order(&rows),
    };
    if opts.guest.is_none() && rows.iter().all(|r| r.newest_backup.is_none()) && !rows.is_empty() {
        tracing::warn!(
            "no pool guest of node {} has a backup on {}",
            cfg.node,
            cfg.restore_test.backup_storages.join(", ")
        );
    }
    for r in rows.iter().filter(|r| r.newest_backup.is_none()) {
        tracing::warn!(
            guest = r.vmid,
            "guest {} ({}) has no backup on the backup storage(s) {}: it is reported no_backup",
            r.vmid,
            r.name,
            cfg.restore_test.backup_storages.join(", ")
        );
    }
    let mut queue: VecDeque<Pending> = VecDeque::new();
    let mut left: Vec<Left> = Vec::new();
    // Application groups: a group is due when any member is; `--guest N` of a member proves
    // its group. A member is never proven alone.
    let groups: Vec<&crate::config::RestoreGroup> = cfg
        .restore_test
        .groups
        .iter()
        .filter(|g| g.guests.iter().any(|m| chosen.iter().any(|r| r.vmid == *m)))
        .collect();
    for r in &chosen {
        if cfg.restore_test.group_of(r.vmid).is_some() {
            continue;
        }
        let Some(b) = &r.newest_backup else { continue };
        match backup_kind_from_volid(&b.volid) {
            Some(kind) => queue.push_back(Pending::first_try(cfg, r, b, kind, None)),
            None => left.push(Left {
                guest: r.vmid,
                backup: b.volid.clone(),
                reason: format!(
                    "cannot tell whether {} is a container or a VM backup",
                    b.volid
                ),
                code: None,
            }),
        }
    }
    let due = queue.len() + groups.iter().map(|g| g.guests.len()).sum::<usize>();
    // The node's backup jobs, read once; their state and next start are judged before every
    // copy (a run may last hours).
    let backup_jobs = if opts.dry_run || queue.is_empty() {
        Vec::new()
    } else {
        node_backup_jobs(cfg)
    };
    let at_once = match cfg.restore_test.at_once {
        crate::config::AtOnce::Fixed(n) => usize::from(n).max(1),
        // What the band allows, one vmid left for every other node of the cluster (the band
        // is the cluster's); the node's memory is judged copy by copy at admission.
        crate::config::AtOnce::Auto => {
            full_list(cfg).map_or(1, |full| auto_at_once(&full, &cfg.node))
        }
    };
    let band = format!("{}-{}", RESTORE_TEST_BAND.start(), RESTORE_TEST_BAND.end());
    let gate = Arc::new(SubmitGate::new(submit_spacing()));
    let deadline = started + Duration::from_secs(cfg.restore_test.run_budget);
    let mut copies: Vec<CopyRun> = Vec::new();
    let mut taken: BTreeSet<u32> = BTreeSet::new();
    let mut running = FuturesUnordered::new();
    let mut running_kinds: Vec<Running> = Vec::new();
    let mut first_txn = Some(run_id);
    let mut ended: Vec<CopyRun> = Vec::new();
    let mut peak = 0usize;
    let mut interrupted = false;
    // The groups first, one at a time: each group's members at once.
    for g in groups {
        if cancel.is_cancelled() {
            break;
        }
        // Every member runs at once: the group needs that many copies at once.
        if g.guests.len() > at_once {
            let why = format!(
                "its {} members run at once and [restore_test] at_once is {at_once}; raise at_once in {} to at least {}",
                g.guests.len(),
                cfg.path.display(),
                g.guests.len()
            );
            left.extend(group_left(g, &rows, &why));
            continue;
        }
        if let Some(why) = (!opts.dry_run)
            .then(|| {
                backup_window(
                    cfg,
                    &backup_jobs,
                    i64::try_from(unix_now()).unwrap_or(i64::MAX),
                )
            })
            .flatten()
        {
            left.extend(group_left(g, &rows, &why));
            continue;
        }
        let ran = run_group(
            cfg,
            pve,
            &prepared.journal,
            reporter,
            &cancel,
            &gate,
            g,
            &rows,
            &mut taken,
            &mut first_txn,
            opts.dry_run,
        )
        .await;
        peak = peak.max(ran.0.len());
        copies.extend(ran.0);
        left.extend(ran.1);
    }
    loop {
        // Admit what fits.
        while running.len() < at_once && !queue.is_empty() {
            if cancel.is_cancelled() {
                interrupted = true;
                break;
            }
            if Instant::now() >= deadline && !opts.dry_run {
                let budget = cfg.restore_test.run_budget;
                for p in queue.drain(..) {
                    left.push(Left {
                        guest: p.guest,
                        backup: p.volid,
                        reason: format!("the run's budget ([restore_test] run_budget = {}s) was spent; the next run proves it", budget),
                        code: None,
                    });
                }
                break;
            }
            if let Some(why) = backup_window(
                cfg,
                &backup_jobs,
                i64::try_from(unix_now()).unwrap_or(i64::MAX),
            ) {
                for p in queue.drain(..) {
                    left.push(Left {
                        guest: p.guest,
                        backup: p.volid,
                        reason: why.clone(),
                        code: None,
                    });
                }
                break;
            }
            // One VM copy per lab bridge (copies on one bridge would reach each other); with
            // none configured, VM copies start with no NIC and are not bound by a bridge.
            let free_bridge = cfg
                .restore_test
                .lab_bridges
                .iter()
                .find(|b| !running_kinds.iter().any(|r| r.bridge.as_ref() == Some(*b)))
                .cloned();
            let lab_busy = !cfg.restore_test.lab_bridges.is_empty() && free_bridge.is_none();
            let containers = running_kinds
                .iter()
                .filter(|r| r.kind == GuestKind::Lxc)
                .count();
            // A copy tried alone runs with nothing beside it.
            if running_kinds.iter().any(|r| r.alone) {
                break;
            }
            let Some(pos) = queue.iter().position(|p| {
                (!p.alone || running_kinds.is_empty())
                    && match p.kind {
                        GuestKind::Qemu => !lab_busy,
                        GuestKind::Lxc => containers < CONTAINERS_AT_ONCE_MAX,
                    }
            }) else {
                break;
            };
            let Some(p) = queue.remove(pos) else { break };
            let room = Room {
                memory: running_kinds.iter().map(|r| r.memory).sum(),
                disks: running_kinds
                    .iter()
                    .map(|r| r.disks)
                    .fold(0, u64::saturating_add),
                lab_bridge: free_bridge.filter(|_| p.kind == GuestKind::Qemu),
            };
            // The copies under way go on while this one is admitted: its preflight asks PVE
            // through the same client, whose requests in flight a paused copy could hold.
            let admission = {
                let admission = admit(
                    cfg,
                    pve,
                    &p,
                    &mut taken,
                    &mut first_txn,
                    opts.dry_run,
                    &room,
                );
                tokio::pin!(admission);
                loop {
                    tokio::select! {
                        a = &mut admission => break a,
                        Some(done) = running.next(), if !running.is_empty() => ended.push(done),
                    }
                }
            };
            for done in ended.drain(..) {
                settle_copy(
                    done,
                    &mut running_kinds,
                    &mut taken,
                    &mut copies,
                    &mut queue,
                );
            }
            match admission {
                Admission::Go(a) => {
                    // Copies that run side by side: each may time out for the other's load.
                    if !running_kinds.is_empty() {
                        a.overlapped
                            .store(true, std::sync::atomic::Ordering::SeqCst);
                        for r in &running_kinds {
                            r.overlapped
                                .store(true, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                    running_kinds.push(Running {
                        guest: a.pending.guest,
                        kind: a.pending.kind,
                        bridge: a.request.lab_bridge.clone(),
                        memory: a.memory,
                        disks: a.disks,
                        alone: a.pending.alone,
                        overlapped: a.overlapped.clone(),
                    });
                    running.push(drive_copy(
                        cfg,
                        pve,
                        &prepared.journal,
                        reporter,
                        cancel.clone(),
                        gate.clone(),
                        *a,
                        None,
                    ));
                    peak = peak.max(running.len());
                }
                Admission::Wait(p, why) if !running.is_empty() => {
                    tracing::info!(
                        guest = p.guest,
                        "copy of guest {} waits for another copy to end: {why}",
                        p.guest
                    );
                    queue.push_front(p);
                    break;
                }
                Admission::Wait(p, why) | Admission::Leave(p, why, None) => left.push(Left {
                    guest: p.guest,
                    backup: p.volid,
                    reason: why,
                    code: None,
                }),
                Admission::Leave(p, why, Some(code)) => left.push(Left {
                    guest: p.guest,
                    backup: p.volid,
                    reason: why,
                    code: Some(code),
                }),
            }
        }
        if cancel.is_cancelled() && !running.is_empty() {
            interrupted = true;
        }
        let Some(done) = running.next().await else {
            if queue.is_empty() || interrupted || cancel.is_cancelled() {
                break;
            }
            // Nothing runs and nothing fits: what is left stays due, with why.
            continue;
        };
        settle_copy(
            done,
            &mut running_kinds,
            &mut taken,
            &mut copies,
            &mut queue,
        );
    }
    if cancel.is_cancelled() {
        interrupted = true;
        for p in queue.drain(..) {
            left.push(Left {
                guest: p.guest,
                backup: p.volid,
                reason: "the run was stopped before its copy started".to_string(),
                code: None,
            });
        }
    }
    let mut run = RestoreTestRun {
        run: run_id,
        copies,
        left,
        due,
        band,
        at_once,
        dry_run: opts.dry_run,
        coverage: Vec::new(),
        metrics_error: None,
        interrupted,
        duration_s: started.elapsed().as_secs_f64(),
        peak_at_once: peak,
    };
    if !opts.dry_run {
        // Records of backups gone from their storage go (a failure no later proof cleared
        // stays); then the coverage as it is now.
        let storages: BTreeSet<String> = if cfg.restore_test.sources.is_empty() {
            cfg.restore_test.backup_storages.iter().cloned().collect()
        } else {
            BTreeSet::new()
        };
        if let Err(e) = with_store(cfg, |s| s.prune(&listed, &storages)) {
            tracing::warn!("proof store not pruned: {e}");
        }
        let store = coverage::read_store(&cfg.state_dir).unwrap_or_default();
        run.coverage = coverage_rows(cfg, &guests, &store);
        store_guests(cfg, &guests);
        run.metrics_error = write_run_metrics(cfg, &prepared.journal, &run).err();
    }
    Ok(run)
}

/// Members' newest backups further apart than this (seconds) are warned about.
const GROUP_SPREAD_WARN: u64 = 6 * 3600;

/// Every member of group `g` left for this run, with why.
fn group_left(g: &crate::config::RestoreGroup, rows: &[CoverageRow], why: &str) -> Vec<Left> {
    g.guests
        .iter()
        .map(|m| Left {
            guest: *m,
            backup: rows
                .iter()
                .find(|r| r.vmid == *m)
                .and_then(|r| r.newest_backup.as_ref())
                .map_or_else(|| "-".to_string(), |b| b.volid.clone()),
            reason: format!("group {}: {why}", g.name),
            code: None,
        })
        .collect()
}

/// One application group's run: every member's newest backup admitted at once (or none),
/// their copies driven together ([`crate::provision::group`]), the group's lab removed at
/// the end. The copies in start order, and what was left.
#[allow(clippy::too_many_arguments)]
async fn run_group(
    cfg: &Config,
    pve: &PveClient,
    journal: &crate::provision::Journal,
    reporter: &dyn Reporter,
    cancel: &CancellationToken,
    gate: &Arc<SubmitGate>,
    g: &crate::config::RestoreGroup,
    rows: &[CoverageRow],
    taken: &mut BTreeSet<u32>,
    first_txn: &mut Option<Ulid>,
    dry_run: bool,
) -> (Vec<CopyRun>, Vec<Left>) {
    let lab = Ulid::new();
    let warnings = match group_preflight(cfg, pve, g, rows).await {
        Ok(w) => w,
        Err(why) => return (Vec::new(), group_left(g, rows, &why)),
    };
    let mut pendings = Vec::new();
    for (i, &m) in g.guests.iter().enumerate() {
        let row = rows.iter().find(|r| r.vmid == m);
        let Some(row) = row else {
            let why = format!(
                "member {m} is not a pool guest of node {} whose backups this node proves (pool {}); fix [[restore_test.group]] {:?} in {}",
                cfg.node,
                cfg.pool,
                g.name,
                cfg.path.display()
            );
            return (Vec::new(), group_left(g, rows, &why));
        };
        let Some(b) = &row.newest_backup else {
            let why = format!(
                "member {m} has no backup on the backup storage(s) {}; the group is proven once every member has one",
                cfg.restore_test.backup_storages.join(", ")
            );
            return (Vec::new(), group_left(g, rows, &why));
        };
        let kind = match backup_kind_from_volid(&b.volid) {
            Some(GuestKind::Lxc) => GuestKind::Lxc,
            Some(GuestKind::Qemu) => GuestKind::Qemu,
            None => {
                let why = format!(
                    "cannot tell whether member {m}'s backup {} is a container or a VM backup",
                    b.volid
                );
                return (Vec::new(), group_left(g, rows, &why));
            }
        };
        pendings.push(Pending::first_try(
            cfg,
            row,
            b,
            kind,
            Some(crate::provision::GroupMember {
                name: g.name.clone(),
                lab,
                index: u32::try_from(i).unwrap_or(u32::MAX),
                bridge_peers: Vec::new(),
                guests: g.guests.clone(),
                warnings: warnings
                    .iter()
                    .take(8)
                    .map(|w| crate::error::outside_text_max(w, 300))
                    .collect(),
                link_bridge: None,
            }),
        ));
    }
    // Members' newest backups hours or days apart restore a state the group never ran in.
    let times: Vec<u64> = pendings.iter().map(|p| p.backup_time).collect();
    if let (Some(lo), Some(hi)) = (times.iter().min(), times.iter().max()) {
        if hi - lo > GROUP_SPREAD_WARN {
            tracing::warn!(
                group = %g.name,
                "the newest backups of group {}'s members are {}h apart ({}): the copies run a state the group never ran in together; back the members up in one job",
                g.name,
                (hi - lo) / 3600,
                pendings
                    .iter()
                    .map(|p| format!("{} {}", p.guest, p.volid))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    // All or none: a group runs only when it fits whole.
    // VM members share a lab bridge of the group's own, held for the whole run; in a group
    // that also holds containers, root links the containers' lab to that bridge.
    let vms = pendings
        .iter()
        .filter(|p| p.kind == GuestKind::Qemu)
        .count();
    let mixed = vms > 0 && vms < pendings.len();
    let mut bridge_lock = None;
    let mut bridge = None;
    if vms > 0 && !dry_run {
        if cfg.restore_test.lab_bridges.is_empty() {
            let why = format!(
                "its VM members need a lab bridge of the group's own: name one in [restore_test] lab_bridges of {} (README, \"A lab bridge\")",
                cfg.path.display()
            );
            return (Vec::new(), group_left(g, rows, &why));
        }
        for b in &cfg.restore_test.lab_bridges {
            match LabBridgeLock::try_acquire(&cfg.state_dir, b, Some(lab)) {
                Ok(l) => {
                    bridge_lock = Some(l);
                    bridge = Some(b.clone());
                    break;
                }
                Err(e) => {
                    tracing::info!(group = %g.name, "lab bridge {b} is not free for the group: {e}")
                }
            }
        }
        if bridge.is_none() {
            let why = format!(
                "every lab bridge ({}) is held by another copy now; the group runs when one is free",
                cfg.restore_test.lab_bridges.join(", ")
            );
            return (Vec::new(), group_left(g, rows, &why));
        }
    } else if vms > 0 {
        bridge = cfg.restore_test.lab_bridge().map(str::to_string);
    }
    let mut room = Room {
        memory: 0,
        disks: 0,
        lab_bridge: bridge.clone(),
    };
    let mut admitted: Vec<Admitted> = Vec::new();
    for p in &pendings {
        match admit(cfg, pve, p, taken, first_txn, dry_run, &room).await {
            Admission::Go(a) => {
                room.memory += a.memory;
                room.disks = room.disks.saturating_add(a.disks);
                admitted.push(*a);
            }
            Admission::Wait(p, why) | Admission::Leave(p, why, _) => {
                release(taken, admitted);
                let why = format!(
                    "member {} could not be admitted with the others: {why}",
                    p.guest
                );
                return (Vec::new(), group_left(g, rows, &why));
            }
        }
    }
    // The VM members' taps (and the containers' lab's link) are the only ports allowed on the
    // group's bridge; two of them with one stored MAC (clones) would clash on it.
    if vms > 0 {
        let peers: Vec<u32> = admitted
            .iter()
            .filter(|a| a.pending.kind == GuestKind::Qemu)
            .filter_map(|a| a.request.vmid)
            .collect();
        let mut macs: Vec<(String, u32)> = Vec::new();
        for a in &mut admitted {
            let container = a.pending.kind != GuestKind::Qemu;
            if let Some(member) = a.request.group.as_mut() {
                member.bridge_peers = peers.clone();
                if mixed && container {
                    member.link_bridge = bridge.clone();
                }
            }
            if container {
                continue;
            }
            let stored = a
                .report
                .stored_config
                .as_ref()
                .map(|c| crate::pve::guest_config::StoredConfig::parse(&c.text));
            for nic in stored.iter().flat_map(|s| s.nics(GuestKind::Qemu)) {
                let Some(mac) = nic.mac else { continue };
                let mac = mac.to_ascii_uppercase();
                if let Some((_, other)) = macs
                    .iter()
                    .find(|(m, o)| *m == mac && *o != a.pending.guest)
                {
                    let why = format!(
                        "members {other} and {} store the same MAC {mac} (clones): on the group's one lab bridge they would clash; give one of them a MAC of its own",
                        a.pending.guest
                    );
                    release(taken, admitted);
                    return (Vec::new(), group_left(g, rows, &why));
                }
                macs.push((mac, a.pending.guest));
            }
        }
    }
    tracing::info!(
        group = %g.name,
        "restore test of group {} ({} members, started in order: {})",
        g.name,
        g.guests.len(),
        g.guests.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
    );
    let seats = (!dry_run).then(|| {
        crate::provision::group::GroupRun::new(
            &g.name,
            Duration::from_secs(g.boot_delay),
            &pendings
                .iter()
                .map(|p| (p.guest, p.name.clone()))
                .collect::<Vec<_>>(),
        )
    });
    // The container members (the lab's, whose transactions ask root to remove it).
    let members: Vec<(u32, Ulid)> = admitted
        .iter()
        .filter(|a| a.pending.kind != GuestKind::Qemu)
        .filter_map(|a| a.request.vmid.map(|v| (v, a.request.txn)))
        .collect();
    let drives: FuturesUnordered<_> = admitted
        .into_iter()
        .enumerate()
        .map(|(i, a)| {
            drive_copy(
                cfg,
                pve,
                journal,
                reporter,
                cancel.clone(),
                gate.clone(),
                a,
                seats.as_ref().map(|s| s.seat(i)),
            )
        })
        .collect();
    let mut copies: Vec<CopyRun> = drives.collect().await;
    for c in &copies {
        if let Some(v) = c.driven.state.vmid() {
            taken.remove(&v);
        }
    }
    copies.sort_by_key(|c| g.guests.iter().position(|m| *m == c.guest));
    if !dry_run && !members.is_empty() {
        remove_group_lab(cfg, lab, &members).await;
    }
    if !dry_run {
        group_result::store(cfg, &copies);
    }
    drop(bridge_lock);
    (copies, Vec::new())
}

/// Before group `g`'s run, before any admission (reads only): a member in a reserved band is
/// refused (`Err`: why, for every member's left reason); what its members' stored addresses
/// cannot do in the group's lab ([`crate::guest::group_net::address_warnings`]: no static
/// address, no shared subnet) is warned of, and returned for the copies' isolation text. A
/// stored config that cannot be read here is left to the member's preflight, which refuses it.
async fn group_preflight(
    cfg: &Config,
    pve: &PveClient,
    g: &crate::config::RestoreGroup,
    rows: &[CoverageRow],
) -> Result<Vec<String>, String> {
    use crate::guest::group_net::{address_warnings, nic_addresses, Member};
    if let Some((m, band)) = g
        .guests
        .iter()
        .find_map(|m| crate::guest::group_net::reserved_member(*m).map(|b| (*m, b)))
    {
        return Err(format!(
            "member {m} is {band}, never a guest whose backups are proven; fix [[restore_test.group]] {:?} in {}",
            g.name,
            cfg.path.display()
        ));
    }
    let mut members = Vec::new();
    for &m in &g.guests {
        let Some(row) = rows.iter().find(|r| r.vmid == m) else {
            continue;
        };
        let Some(b) = row
            .newest_backup
            .as_ref()
            .filter(|b| backup_kind_from_volid(&b.volid) == Some(GuestKind::Lxc))
        else {
            continue;
        };
        let Ok(text) = pve.extract_config(&cfg.node, &b.volid).await else {
            continue;
        };
        members.push(Member {
            vmid: m,
            name: crate::error::outside_text_max(&row.name, 64),
            nics: nic_addresses(&crate::pve::guest_config::StoredConfig::parse(&text)),
        });
    }
    let warnings = address_warnings(&g.name, &members);
    for w in &warnings {
        tracing::warn!(group = %g.name, "{w}");
    }
    Ok(warnings)
}

/// Let go of copies admitted for a group that does not run: their vmids free for the run
/// again, their locks dropped.
fn release(taken: &mut BTreeSet<u32>, admitted: Vec<Admitted>) {
    for a in &admitted {
        if let Some(v) = a.request.vmid {
            taken.remove(&v);
        }
    }
}

/// Remove a group's lab once its members ended (asked for by a member's transaction, which
/// names it); a failure is logged: the next run's settle step removes it.
async fn remove_group_lab(cfg: &Config, lab: Ulid, members: &[(u32, Ulid)]) {
    let Some((vmid, txn)) = members.first().copied() else {
        return;
    };
    let op = crate::guest::exec::LabOp::Remove { lab };
    match super::lxc_route(cfg).lab_op(vmid, txn, op).await {
        Ok(note) => tracing::info!(lab = %lab, "{note}"),
        Err(why) => tracing::warn!(
            lab = %lab,
            "the group lab {} could not be removed: {why}; the next command removes it",
            crate::guest::group_lab::lab_name(lab)
        ),
    }
}

/// A copy that ended: its guest and vmid are free for the run again. One that ended on a
/// transient fault is tried once more, at the end of the queue (a fresh vmid, and alone of
/// its storage allocation by then, most often).
fn settle_copy(
    done: CopyRun,
    running_kinds: &mut Vec<Running>,
    taken: &mut BTreeSet<u32>,
    copies: &mut Vec<CopyRun>,
    queue: &mut VecDeque<Pending>,
) {
    running_kinds.retain(|r| r.guest != done.guest);
    if let Some(v) = done.driven.state.vmid() {
        taken.remove(&v);
    }
    // A copy tried alone is never tried alone again: its second try is its last.
    if (done.transient && !done.retry) || done.try_alone {
        if let Some(kind) = backup_kind_from_volid(&done.backup) {
            tracing::warn!(guest = done.guest, txn = %done.driven.state.txn(), "the copy of guest {}'s backup {} ended on a fault that says nothing of the backup; it is tried once more in this run", done.guest, done.backup);
            queue.push_back(Pending {
                guest: done.guest,
                name: done.name.clone(),
                volid: done.backup.clone(),
                backup_time: done.backup_time,
                kind,
                retry: true,
                alone: done.try_alone,
                notes_first_line: done.notes_first_line.clone(),
                listed: done.listed,
                group: None,
            });
        }
    }
    copies.push(done);
}

enum Admission {
    /// Admitted: drive it.
    Go(Box<Admitted>),
    /// Not now: wait for a running copy to end (or leave it, when none runs).
    Wait(Pending, String),
    /// Left for this run, with why (and the code when the environment stopped it).
    Leave(Pending, String, Option<ErrorCode>),
}

/// Pick the copy's vmid, run its preflight, check the node's memory and take its locks.
async fn admit(
    cfg: &Config,
    pve: &PveClient,
    p: &Pending,
    taken: &mut BTreeSet<u32>,
    first_txn: &mut Option<Ulid>,
    dry_run: bool,
    room: &Room,
) -> Admission {
    let p = p.clone();
    let full = match full_list(cfg) {
        Ok(f) => f,
        Err(f) => return Admission::Leave(p, f.message, Some(f.code)),
    };
    let pool = crate::inventory::PoolView::default();
    let inventory = join(&full, &pool);
    // Ulid::default() is the nil id: a new copy gets a fresh one.
    let txn = match *first_txn {
        Some(t) => t,
        None => Ulid::new(),
    };
    // The band's free vmids, less those this run's copies hold.
    let free: Vec<u32> = RESTORE_TEST_BAND
        .clone()
        .filter(|v| !inventory.is_held(*v) && !taken.contains(v))
        .collect();
    let mut vmid_lock = None;
    let mut picked = None;
    for v in free {
        if dry_run {
            picked = Some(v);
            break;
        }
        match VmidLock::try_acquire(&cfg.state_dir, v, Some(txn)) {
            Ok(l) => {
                picked = Some(v);
                vmid_lock = Some(l);
                break;
            }
            Err(crate::provision::LockError::Held { .. }) => continue,
            Err(e) => return Admission::Leave(p, e.to_string(), Some(e.code())),
        }
    }
    let Some(vmid) = picked else {
        let why = format!(
            "every vmid of the restore-test band {}-{} is held (by this run's copies, other nodes' guests or another agent process); free one (`felhom-agent guests`) if a stale copy sits there",
            RESTORE_TEST_BAND.start(),
            RESTORE_TEST_BAND.end()
        );
        return if taken.is_empty() {
            Admission::Leave(p, why, None)
        } else {
            Admission::Wait(p, why)
        };
    };
    let request = Request {
        txn,
        kind: TxnKind::SelftestRestore,
        vmid: Some(vmid),
        guest: p.kind,
        volid: p.volid.clone(),
        storage: cfg.restore_test.storage.clone(),
        pool: cfg.pool.clone(),
        isolate_network: true,
        keep: false,
        dry_run,
        profile: None,
        lab_bridge: room.lab_bridge.clone(),
        group: p.group.clone(),
    };
    // --- preflight (DESIGN §2 rule 9): before the first journal intent; reads only ---------
    let (report, first) = crate::preflight::gate(cfg, pve, &request, Event::VmidAccepted).await;
    if let Err(f) = super::environment_refusal(&report, Some(vmid)) {
        return Admission::Leave(
            p.clone(),
            format!("guest {}'s backup {}: {}", p.guest, p.volid, f.message),
            Some(f.code),
        );
    }
    let refused = matches!(first, Event::VmidRefused(_));
    let memory = if refused {
        0
    } else {
        crate::preflight::memory::stored_memory_mib(report.stored_config.as_ref())
    };
    if !dry_run && !refused {
        if let Some(free_mib) = memory_for_copies(cfg) {
            let room = free_mib.saturating_sub(room.memory);
            if memory > room {
                return Admission::Wait(
                    p.clone(),
                    format!(
                        "not enough memory on node {} for a copy of guest {} ({memory} MiB stored; {room} MiB available beside the copies running and [restore_test] memory_reserve = {}%)",
                        cfg.node, p.guest, cfg.restore_test.memory_reserve_percent
                    ),
                );
            }
        }
    }
    // The target storage's free space, less what the copies under way allocate (a thin pool
    // shows their data only as they write it).
    let disks = report.space.map_or(0, |(need, _)| need);
    if let (false, false, Some((need, avail))) = (dry_run, refused, report.space) {
        let room = avail.saturating_sub(room.disks);
        if need > room {
            return Admission::Wait(
                p.clone(),
                format!(
                    "not enough space on storage {:?} of node {} for a copy of guest {} ({} MiB of disks; {} MiB free beside the copies under way)",
                    cfg.restore_test.storage,
                    cfg.node,
                    p.guest,
                    need >> 20,
                    room >> 20
                ),
            );
        }
    }
    let locks = match (dry_run, vmid_lock) {
        (true, _) => None,
        (false, Some(l)) => match locks_for(cfg, &p, request.lab_bridge.as_deref(), txn, l) {
            Ok(l) => Some(l),
            Err((why, code)) => return Admission::Leave(p.clone(), why, code),
        },
        (false, None) => {
            return Admission::Leave(p.clone(), format!("vmid {vmid} could not be locked"), None)
        }
    };
    if *first_txn == Some(txn) {
        *first_txn = None;
    }
    taken.insert(vmid);
    Admission::Go(Box::new(Admitted {
        pending: p,
        request,
        report,
        first,
        memory,
        disks,
        locks,
        overlapped: Arc::new(std::sync::atomic::AtomicBool::new(false)),
    }))
}

/// The copy's locks beside its vmid's (taken by [`admit`]): its guest's, and the lab bridge's
/// for a VM.
fn locks_for(
    cfg: &Config,
    p: &Pending,
    lab_bridge: Option<&str>,
    txn: Ulid,
    vmid_lock: VmidLock,
) -> Result<CopyLocks, (String, Option<ErrorCode>)> {
    use crate::provision::LockError;
    // Held by another process: the guest stays due (no error); any other fault of the lock
    // folder is the environment's, with its code.
    let guest_lock = GuestProofLock::try_acquire(&cfg.state_dir, p.guest, Some(txn)).map_err(|e| match e {
        LockError::Held { path, .. } => (
            format!(
                "another agent process proves guest {}'s backup now (its lock {} is held); this run leaves it",
                p.guest,
                path.display()
            ),
            None,
        ),
        other => (other.to_string(), Some(other.code())),
    })?;
    let lab = match p.kind {
        // A group's VM members share the bridge the group holds.
        GuestKind::Qemu if p.group.is_some() => None,
        GuestKind::Qemu => match lab_bridge {
            Some(bridge) => match LabBridgeLock::try_acquire(&cfg.state_dir, bridge, Some(txn)) {
                Ok(l) => Some(l),
                Err(e @ LockError::BridgeHeld { .. }) => return Err((e.to_string(), None)),
                Err(e) => return Err((e.to_string(), Some(e.code()))),
            },
            None => None,
        },
        GuestKind::Lxc => None,
    };
    Ok((vmid_lock, guest_lock, lab))
}

/// Drive one admitted copy to its end: its transaction, then its proof recorded against its
/// backup. The locks are let go as soon as the transaction settled or stopped.
#[allow(clippy::too_many_arguments)]
async fn drive_copy<'a>(
    cfg: &'a Config,
    pve: &'a PveClient,
    journal: &'a crate::provision::Journal,
    reporter: &'a dyn Reporter,
    cancel: CancellationToken,
    gate: Arc<SubmitGate>,
    a: Admitted,
    seat: Option<crate::provision::group::Seat>,
) -> CopyRun {
    let Admitted {
        pending,
        request,
        report,
        first,
        memory: _,
        disks: _,
        locks,
        overlapped,
    } = a;
    let dry_run = request.dry_run;
    tracing::info!(guest = pending.guest, vmid = ?request.vmid, txn = %request.txn, backup = %pending.volid, "restore test of guest {}'s backup {} in copy {}", pending.guest, pending.volid, request.vmid.unwrap_or(0));
    let mut exec = Executor::new(cfg, pve, journal, reporter, cancel, super::lxc_route(cfg))
        .with_submit_gate(gate);
    let in_group = seat.is_some();
    if let Some(seat) = seat {
        exec = exec.with_group(seat);
    }
    exec.carry_stored_config(report.stored_config.clone());
    let driven: Driven = exec.drive(State::new(request), first).await;
    if let Some(f) = driven.state.failure() {
        exec.group_failed(&f.message);
    }
    drop(exec);
    drop(locks);
    // A copy that timed out while others ran may have timed out for their load: it counts
    // only once tried alone.
    let beside_others = overlapped.load(std::sync::atomic::Ordering::SeqCst);
    let try_alone = !dry_run && !in_group && !pending.alone && beside_others && timed_out(&driven);
    if try_alone {
        tracing::warn!(guest = pending.guest, txn = %driven.state.txn(), "the copy of guest {}'s backup {} timed out while other copies ran; it is tried once more alone before it counts", pending.guest, pending.volid);
    }
    let verdict = if dry_run || try_alone {
        None
    } else {
        verdict_of(&driven)
    };
    if !dry_run && !try_alone {
        if let Err(e) = record_proof(cfg, &driven, Some(pending.guest), Some(pending.backup_time)) {
            tracing::error!(guest = pending.guest, txn = %driven.state.txn(), "the proof of guest {}'s backup {} is not recorded: {e}", pending.guest, pending.volid);
        }
        store_last_result(cfg, &driven);
        if let (true, true, Some(v)) = (cfg.restore_test.note_backups, pending.listed, verdict) {
            let line = note_line(v, &driven);
            if let Err(e) = note_backup(
                cfg,
                pve,
                &pending.volid,
                pending.notes_first_line.as_deref(),
                &line,
            )
            .await
            {
                tracing::warn!(
                    guest = pending.guest,
                    "the verdict was not written into the notes of backup {}: {e}",
                    pending.volid
                );
            }
        }
    }
    let transient = try_alone
        || (!dry_run
            && !in_group
            && driven.state.outcome_kind() == Some(OutcomeKind::Failed)
            && driven.state.failure().is_some_and(transient_failure));
    CopyRun {
        guest: pending.guest,
        name: pending.name,
        backup: pending.volid,
        driven,
        preflight: Some(report),
        verdict,
        transient,
        try_alone,
        retry: pending.retry,
        backup_time: pending.backup_time,
        notes_first_line: pending.notes_first_line,
        listed: pending.listed,
    }
}

/// The start of the agent's own line in a backup's notes.
const NOTE_MARK: &str = "felhom-restore-test:";
/// The most bytes of the agent's line.
const NOTE_LINE_MAX: usize = 200;

/// The agent's line for a verdict: mark, outcome, date, transaction; at most
/// [`NOTE_LINE_MAX`] bytes.
fn note_line(v: Verdict, driven: &Driven) -> String {
    let date = crate::timefmt::rfc3339(time::OffsetDateTime::now_utc());
    let mut line = format!(
        "{NOTE_MARK} {} {date} txn {} copy {}",
        v.as_str(),
        driven.state.txn(),
        driven
            .state
            .vmid()
            .map_or_else(|| "-".to_string(), |v| v.to_string())
    );
    line.truncate(NOTE_LINE_MAX);
    line
}

/// The notes with the agent's line replaced (or added at the end): every other line kept as
/// it was. `None` when the notes read cannot be whole: the listing showed a first line the read
/// did not return (PVE answers no notes when it failed to read them, `Content.pm` `info`).
fn notes_with_line(read: Option<&str>, listed_first: Option<&str>, line: &str) -> Option<String> {
    let read_first = read.and_then(|n| n.lines().next()).unwrap_or("");
    // PVE lists the first line only; compare first lines whatever the listing gave.
    let listed = listed_first.and_then(|n| n.lines().next()).unwrap_or("");
    if listed != read_first {
        return None;
    }
    let mut lines: Vec<&str> = read
        .map(|n| n.lines().filter(|l| !l.starts_with(NOTE_MARK)).collect())
        .unwrap_or_default();
    lines.push(line);
    Some(lines.join("\n"))
}

/// Write the verdict into the backup's notes (`[restore_test] note_backups`): read them whole,
/// replace the agent's line, write them back with `notes` only. `Err`: why nothing was
/// written (the verdict stands either way).
async fn note_backup(
    cfg: &Config,
    pve: &PveClient,
    volid: &str,
    listed_first: Option<&str>,
    line: &str,
) -> Result<(), String> {
    let Some((storage, _)) = volid.split_once(':') else {
        return Err("the volid names no storage".to_string());
    };
    let read = pve
        .volume_notes(&cfg.node, storage, volid)
        .await
        .map_err(|e| format!("cannot read its notes ({e}); nothing written"))?;
    let Some(notes) = notes_with_line(read.as_deref(), listed_first, line) else {
        return Err("its notes did not read whole (the listing shows a first line the read did not return); nothing written, so none is lost".to_string());
    };
    pve.set_volume_notes(&cfg.node, storage, volid, &notes)
        .await
        .map_err(|e| format!("PVE refused the notes ({e}); on Proxmox Backup Server the datastore user must own the backup group or hold Datastore.Modify"))
}

/// Store the run state and write the restore-test metrics of a run: its outcome, the last
/// success, the coverage of every guest, then the journal-derived ones. `Err`: why a metrics
/// file could not be written (the run state's failure is only logged).
fn write_run_metrics(
    cfg: &Config,
    journal: &crate::provision::Journal,
    run: &RestoreTestRun,
) -> Result<(), String> {
    let path = cfg.state_dir.join(ROTATION_FILE);
    let mut rot = read_rotation(&path);
    let now = unix_now();
    let outcome = run.metrics_outcome();
    rot.runs_total += 1;
    if outcome == "skipped" {
        rot.skipped_total += 1;
    }
    if outcome == "ok" {
        rot.last_success = Some(now);
    }
    if let Some(last) = run.copies.last() {
        rot.last = Some(last.guest.to_string());
    }
    store_rotation(&path, &rot);
    let checks: Vec<_> = run
        .copies
        .iter()
        .flat_map(|c| c.driven.checks.iter().map(|r| r.status))
        .collect();
    write_metrics_text(
        cfg,
        journal,
        outcome,
        run.duration_s,
        &rot,
        Some(&run.coverage),
        &checks,
    )
}

fn store_rotation(path: &Path, rot: &RotationState) {
    if let Ok(bytes) = serde_json::to_vec_pretty(rot) {
        if let Err(e) = write_atomic(path, &bytes, 0o600) {
            tracing::error!(path = %path.display(), error = %e, "cannot store the restore test's run state");
        }
    }
}

fn write_metrics_text(
    cfg: &Config,
    journal: &crate::provision::Journal,
    outcome: &str,
    duration_s: f64,
    rot: &RotationState,
    rows: Option<&[CoverageRow]>,
    checks: &[crate::guest::checks::CheckStatus],
) -> Result<(), String> {
    let mut text = metrics::restore_test_text(&metrics::RestoreTestFigures {
        outcome,
        duration_s,
        now: unix_now(),
        last_success: rot.last_success,
        skipped_total: rot.skipped_total,
        runs_total: rot.runs_total,
    });
    text.push_str(&metrics::restore_test_checks_text(checks));
    let mut first_error = metrics::textfile::write(&cfg.metrics.dir, METRICS_FILE, &text)
        .err()
        .map(|e| e.to_string());
    // The coverage in a file of its own: a run that could not work it out leaves the last.
    if let Some(rows) = rows {
        if let Err(e) = metrics::textfile::write(
            &cfg.metrics.dir,
            metrics::COVERAGE_FILE,
            &coverage_metrics(rows),
        ) {
            first_error.get_or_insert(e.to_string());
        }
    }
    if let Err(e) = metrics::update_transactions(&cfg.metrics.dir, journal) {
        first_error.get_or_insert(e);
    }
    first_error.map_or(Ok(()), Err)
}

/// The coverage series of `rows` (one set per guest; the pool bounds the labels).
fn coverage_metrics(rows: &[CoverageRow]) -> String {
    let table: Vec<metrics::CoverageRow<'_>> = rows
        .iter()
        .map(|r| metrics::CoverageRow {
            vmid: r.vmid,
            name: &r.name,
            status: r.status.as_str(),
            stale: r.stale,
            proven_backup_time: r.proven.as_ref().map(|p| p.backup_time),
            newest_backup_time: r.newest_backup.as_ref().map(|b| b.time),
        })
        .collect();
    metrics::coverage_text(&table, unix_now())
}

/// A restore test taken up after its run stopped (`journal resume`, `journal cancel`, the
/// settle every writing command and the daemon's start do first): its verdict is recorded
/// against its backup, and the restore-test metrics say how it ended now, so an `interrupted`
/// (or a stale red) is replaced by the outcome the resume reached.
pub fn record_taken_up(cfg: &Config, journal: &crate::provision::Journal, driven: &Driven) {
    if driven.state.kind() != TxnKind::SelftestRestore || driven.state.request().dry_run {
        return;
    }
    if let Err(e) = record_proof(cfg, driven, None, None) {
        tracing::warn!(txn = %driven.state.txn(), "the proof of backup {} is not recorded: {e}", driven.state.request().volid);
    }
    let path = cfg.state_dir.join(ROTATION_FILE);
    let mut rot = read_rotation(&path);
    if driven.state.outcome_kind() == Some(OutcomeKind::Ok) {
        rot.last_success = Some(unix_now());
        store_rotation(&path, &rot);
    }
    let started_ms = driven.state.txn().timestamp_ms();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let duration_s = now_ms.saturating_sub(started_ms) as f64 / 1000.0;
    // The coverage as the store has it (the guests' names and backups are the last run's).
    let rows = previous_coverage(cfg);
    let rows = (!rows.is_empty()).then_some(rows.as_slice());
    let checks: Vec<_> = driven.checks.iter().map(|r| r.status).collect();
    if let Err(e) = write_metrics_text(
        cfg,
        journal,
        metrics_label(driven),
        duration_s,
        &rot,
        rows,
        &checks,
    ) {
        tracing::warn!(txn = %driven.state.txn(), "restore-test metrics not updated: {e}");
    }
    store_last_result(cfg, driven);
}

/// The guests and backups the last run saw, in the state dir: a resume in another process
/// recomputes their coverage from the proof store without asking PVE.
const GUESTS_FILE: &str = "restore-test-guests.json";

fn store_guests(cfg: &Config, guests: &[GuestBackups]) {
    let path = cfg.state_dir.join(GUESTS_FILE);
    let stored = serde_json::to_vec(guests)
        .map_err(std::io::Error::other)
        .and_then(|bytes| write_atomic(&path, &bytes, 0o600));
    if let Err(e) = stored {
        tracing::warn!(path = %path.display(), error = %e, "cannot store the guests of this run");
    }
}

/// The coverage of the guests the last run saw, by the proof store now.
fn previous_coverage(cfg: &Config) -> Vec<CoverageRow> {
    use std::io::Read;
    let Ok(file) = fs::File::open(cfg.state_dir.join(GUESTS_FILE)) else {
        return Vec::new();
    };
    let mut bytes = Vec::new();
    if file
        .take(LAST_RESULT_MAX_BYTES)
        .read_to_end(&mut bytes)
        .is_err()
    {
        return Vec::new();
    }
    let guests: Vec<GuestBackups> = serde_json::from_slice(&bytes).unwrap_or_default();
    let store = coverage::read_store(&cfg.state_dir).unwrap_or_default();
    coverage_rows(cfg, &guests, &store)
}

/// The restore-test metrics' outcome of a run that ended before it could consider a copy:
/// `interrupted` when the operator stopped it, `refused` for a refusal, `skipped` for a full
/// band, else `error` (the environment: PVE not answering, a wrong token or pin, no backup to
/// test, the exec helper, a full state folder).
pub fn early_end_label(code: ErrorCode) -> &'static str {
    match crate::error::exit_status(code) {
        crate::error::ExitStatus::Interrupted => "interrupted",
        crate::error::ExitStatus::Refused => "refused",
        crate::error::ExitStatus::Ok => "skipped",
        _ => "error",
    }
}

/// Write the restore-test metrics for a run that ended before its transaction existed
/// ([`early_end_label`]): the run counts, the last success stays. `Err`: why the file could
/// not be written.
fn write_early_end_metrics(cfg: &Config, failure: &Failure, duration_s: f64) -> Result<(), String> {
    let rotation_path = cfg.state_dir.join(ROTATION_FILE);
    let mut rot = read_rotation(&rotation_path);
    rot.runs_total += 1;
    if let Ok(bytes) = serde_json::to_vec_pretty(&rot) {
        if let Err(e) = write_atomic(&rotation_path, &bytes, 0o600) {
            tracing::error!(path = %rotation_path.display(), error = %e, "cannot store the rotation");
        }
    }
    let mut text = metrics::restore_test_text(&metrics::RestoreTestFigures {
        outcome: early_end_label(failure.code),
        duration_s,
        now: unix_now(),
        last_success: rot.last_success,
        skipped_total: rot.skipped_total,
        runs_total: rot.runs_total,
    });
    // No copy ran: no check.
    text.push_str(&metrics::restore_test_checks_text(&[]));
    metrics::textfile::write(&cfg.metrics.dir, METRICS_FILE, &text).map_err(|e| e.to_string())
}

/// One restore-test run under `txn` (`--selftest=restore`, the timer, or a hub dispatch).
/// `Err` when it ended before a transaction existed; the restore-test metrics then say so
/// ([`early_end_label`]: `error` for the environment), unless it was a dry run.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backup_time_from_its_name() {
        assert_eq!(
            time_from_volid("local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst"),
            Some(1_767_225_600)
        );
        assert_eq!(time_from_volid("local:backup/other.tar"), None);
    }

    #[test]
    fn the_guest_of_a_backup() {
        assert_eq!(
            crate::pve::types::backup_guest(
                "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst"
            ),
            Some(200)
        );
        assert_eq!(
            crate::pve::types::backup_guest("pbs:backup/ct/201/2026-01-01T00:00:00Z"),
            Some(201)
        );
        assert_eq!(
            crate::pve::types::backup_guest("pbs:backup/vm/300/2026-01-01T00:00:00Z"),
            Some(300)
        );
        assert_eq!(
            crate::pve::types::backup_guest("local:backup/other.tar"),
            None
        );
    }

    #[test]
    fn the_agents_line_in_the_notes_is_replaced_and_the_rest_kept() {
        let line = "felhom-restore-test: ok 2026-12-07T00:00:00Z txn X copy 990002";
        assert_eq!(
            notes_with_line(
                Some("nightly\nkept\nfelhom-restore-test: failed old"),
                Some("nightly"),
                line
            )
            .as_deref(),
            Some("nightly\nkept\nfelhom-restore-test: ok 2026-12-07T00:00:00Z txn X copy 990002")
        );
        assert_eq!(notes_with_line(None, None, line).as_deref(), Some(line));
        // The listing shows notes the read did not return: a failed read; nothing written.
        assert_eq!(notes_with_line(None, Some("nightly"), line), None);
        assert_eq!(notes_with_line(Some("other"), Some("nightly"), line), None);
    }

    #[test]
    fn a_stored_memory() {
        let t = |text: &str| crate::pve::guest_config::StoredConfigText {
            volid: "v".into(),
            text: text.into(),
        };
        assert_eq!(
            crate::preflight::memory::stored_memory_mib(Some(&t("arch: amd64\nmemory: 2048\n"))),
            2048
        );
        assert_eq!(
            crate::preflight::memory::stored_memory_mib(Some(&t("cores: 1\n[snap]\nmemory: 9\n"))),
            512
        );
        assert_eq!(crate::preflight::memory::stored_memory_mib(None), 512);
    }

    #[test]
    fn auto_leaves_a_band_vmid_for_every_other_node() {
        use crate::inventory::{FullGuestList, GuestEntry, GuestType, ListSource, VmlistVia};
        let entry = |vmid: u32, node: &str| GuestEntry {
            vmid,
            kind: GuestType::Lxc,
            node: node.into(),
            version: None,
        };
        let list = |e: Vec<GuestEntry>| {
            FullGuestList::from_entries(
                ListSource::Vmlist {
                    path: "/etc/pve/.vmlist".into(),
                    via: VmlistVia::Direct,
                },
                e,
            )
            .expect("a list")
        };
        assert_eq!(auto_at_once(&list(vec![entry(100, "pve1")]), "pve1"), 10);
        // Two other nodes, one band vmid held by one of them: 10 - 1 - 2.
        let l = list(vec![
            entry(100, "pve1"),
            entry(101, "pve2"),
            entry(990003, "pve3"),
        ]);
        assert_eq!(auto_at_once(&l, "pve1"), 7);
        // A full band still lets one copy be tried (it waits or is left, saying why).
        let full: Vec<GuestEntry> = (990000..=990009).map(|v| entry(v, "pve2")).collect();
        assert_eq!(auto_at_once(&list(full), "pve1"), 1);
    }

    #[test]
    fn transient_faults_say_nothing_of_the_backup() {
        for m in [
            "can't lock file '/var/lock/pve-manager/pve-storage-local-lvm' - got timeout",
            "cfs-lock 'storage-local-lvm' error: got lock request timeout",
            "unable to create CT 990002 - config file already exists",
        ] {
            assert!(
                transient_failure(&Failure::new(ErrorCode::TaskFailed, m)),
                "{m}"
            );
        }
        assert!(!transient_failure(&Failure::new(
            ErrorCode::TaskFailed,
            "unexpected end of archive"
        )));
    }
}
