//! `--selftest=restore`: prove that this node's backups really restore and boot.
//!
//! One run picks one backup (the newest backup of each pool guest, in a rotation remembered in
//! the state dir, or the configured `restore_test.sources`), picks the first vmid of the
//! restore-test band 990000..=990009 that is free in the FULL guest list (walking around any
//! foreign guest parked there), restores it with its network isolated (a container with new
//! MACs; a VM's NICs with their stored MACs on `[restore_test] lab_bridge`, or none), starts it,
//! proves the launch, runs the restore-test checks, reports, and destroys the copy through the
//! ownership gate. A full band skips the run (reported, exit 0). Metrics for node_exporter's
//! textfile collector are written atomically after every run.
//!
//! Part of the transaction service: it returns a [`RestoreTestRun`], never printed output.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use super::{full_list, pool_view, prepare, prepare_read_only};
use crate::config::Config;
use crate::error::{ErrorCode, Failure};
use crate::inventory::join;
use crate::metrics;
use crate::preflight::PreflightReport;
use crate::provision::effects::{Driven, Executor, Reporter};
use crate::provision::machine::{Event, OutcomeKind, Request, State, TxnKind};
use crate::provision::VmidLock;
use crate::pve::types::{backup_kind_from_volid, BackupVolume};
use crate::pve::PveClient;
use crate::vmid::{restore_band_pick, RESTORE_TEST_BAND};

/// The rotation state file in the state dir.
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
}

/// Store `driven`'s result as the last restore test's; a failure is logged only (the journal
/// holds the transaction either way).
fn store_last_result(cfg: &Config, driven: &Driven) {
    let last = LastResult {
        txn: driven.state.txn().to_string(),
        backup: driven.state.request().volid.clone(),
        vmid: driven.state.vmid(),
        ending: metrics_label(driven).to_string(),
        checks: driven.checks.clone(),
        boot: driven.boot.clone(),
        isolation: driven.isolation.clone(),
    };
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

/// What the rotation remembers between runs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RotationState {
    /// The owner vmid (or source volid) tested last.
    pub last: Option<String>,
    /// Unix time of the last successful run.
    pub last_success: Option<u64>,
    /// Runs skipped because the band was full, since the state was created.
    pub skipped_total: u64,
    /// Runs, since the state was created.
    pub runs_total: u64,
}

/// One candidate backup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The rotation key (owner vmid, or the volid of a configured source).
    pub key: String,
    /// The backup volid.
    pub volid: String,
}

/// The newest backup of each pool guest, by owner vmid.
pub fn newest_per_guest(volumes: &[BackupVolume], pool_vmids: &[u32]) -> Vec<Candidate> {
    let mut newest: BTreeMap<u32, &BackupVolume> = BTreeMap::new();
    for v in volumes {
        let Some(owner) = v.vmid.and_then(|o| u32::try_from(o).ok()) else {
            continue;
        };
        if !pool_vmids.contains(&owner) || backup_kind_from_volid(&v.volid).is_none() {
            continue;
        }
        let better = newest
            .get(&owner)
            .is_none_or(|cur| (v.ctime, &v.volid) > (cur.ctime, &cur.volid));
        if better {
            newest.insert(owner, v);
        }
    }
    newest
        .into_iter()
        .map(|(owner, v)| Candidate {
            key: owner.to_string(),
            volid: v.volid.clone(),
        })
        .collect()
}

/// The candidate after `last` in the rotation (the first when `last` is unknown or gone).
pub fn next_in_rotation<'a>(
    candidates: &'a [Candidate],
    last: Option<&str>,
) -> Option<&'a Candidate> {
    let pos = last.and_then(|l| candidates.iter().position(|c| c.key == l));
    match pos {
        Some(i) => candidates.get((i + 1) % candidates.len()),
        None => candidates.first(),
    }
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

async fn candidates(
    cfg: &Config,
    pve: &PveClient,
    pool_vmids: &[u32],
) -> Result<Vec<Candidate>, Failure> {
    if !cfg.restore_test.sources.is_empty() {
        return Ok(cfg
            .restore_test
            .sources
            .iter()
            .map(|v| Candidate {
                key: v.clone(),
                volid: v.clone(),
            })
            .collect());
    }
    let mut volumes = Vec::new();
    for sid in &cfg.restore_test.backup_storages {
        let mut v = pve.backups(&cfg.node, sid, None).await.map_err(|e| {
            Failure::new(
                e.code(),
                format!("cannot list the backups on storage {sid}: {e}"),
            )
        })?;
        volumes.append(&mut v);
    }
    Ok(newest_per_guest(&volumes, pool_vmids))
}

/// The label of a run's end in the metrics: its outcome, `interrupted` for a stop the journal
/// resumes, `needs_human` for a drive halted otherwise (open, and nothing resumes it by itself).
pub fn metrics_label(driven: &Driven) -> &'static str {
    driven.ending().unwrap_or("needs_human")
}

/// Store the rotation (`rot`, with the last success set when `driven` ended `ok`) and write
/// the restore-test metrics for how `driven` ended, then the journal-derived ones. `Err`: why
/// a metrics file could not be written (the rotation's failure is only logged).
fn write_metrics(
    cfg: &Config,
    journal: &crate::provision::Journal,
    driven: &Driven,
    rot: &mut RotationState,
    duration_s: f64,
) -> Result<(), String> {
    let rotation_path = cfg.state_dir.join(ROTATION_FILE);
    let now = unix_now();
    if driven.state.outcome_kind() == Some(OutcomeKind::Ok) {
        rot.last_success = Some(now);
    }
    if let Ok(bytes) = serde_json::to_vec_pretty(&rot) {
        if let Err(e) = write_atomic(&rotation_path, &bytes, 0o600) {
            tracing::error!(path = %rotation_path.display(), error = %e, "cannot store the rotation");
        }
    }
    let text = metrics::restore_test_text(&metrics::RestoreTestFigures {
        outcome: metrics_label(driven),
        duration_s,
        now,
        last_success: rot.last_success,
        skipped_total: rot.skipped_total,
        runs_total: rot.runs_total,
    });
    let mut first_error = metrics::textfile::write(&cfg.metrics.dir, METRICS_FILE, &text)
        .err()
        .map(|e| e.to_string());
    if let Err(e) = metrics::update_transactions(&cfg.metrics.dir, journal) {
        first_error.get_or_insert(e);
    }
    first_error.map_or(Ok(()), Err)
}

/// A restore test taken up after its run stopped (`journal resume`, `journal cancel`, the
/// settle every writing command and the daemon's start do first): the restore-test metrics
/// say how it ended now, so an `interrupted` (or a stale red) is replaced by the outcome the
/// resume reached. Its duration counts from the transaction's start. The run was counted when
/// it started; the rotation only gains the last success.
pub fn record_taken_up(cfg: &Config, journal: &crate::provision::Journal, driven: &Driven) {
    if driven.state.kind() != TxnKind::SelftestRestore || driven.state.request().dry_run {
        return;
    }
    let mut rot = read_rotation(&cfg.state_dir.join(ROTATION_FILE));
    let started_ms = driven.state.txn().timestamp_ms();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let duration_s = now_ms.saturating_sub(started_ms) as f64 / 1000.0;
    if let Err(e) = write_metrics(cfg, journal, driven, &mut rot, duration_s) {
        tracing::warn!(txn = %driven.state.txn(), "restore-test metrics not updated: {e}");
    }
    store_last_result(cfg, driven);
}

/// What one restore-test run did.
#[derive(Debug, Clone)]
pub struct RestoreTestRun {
    /// The transaction.
    pub driven: Driven,
    /// The backup chosen by the rotation.
    pub backup: String,
    /// The band, as `990000-990009`.
    pub band: String,
    /// The vmid picked in the band (`None`: the band was full and the run skipped).
    pub vmid: Option<u32>,
    /// Why the metrics file could not be written, if it could not.
    pub metrics_error: Option<String>,
    /// The preflight's checks (`None` when the run was skipped before it).
    pub preflight: Option<PreflightReport>,
}

/// The restore-test metrics' outcome of a run that ended before its transaction existed:
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
    let text = metrics::restore_test_text(&metrics::RestoreTestFigures {
        outcome: early_end_label(failure.code),
        duration_s,
        now: unix_now(),
        last_success: rot.last_success,
        skipped_total: rot.skipped_total,
        runs_total: rot.runs_total,
    });
    metrics::textfile::write(&cfg.metrics.dir, METRICS_FILE, &text).map_err(|e| e.to_string())
}

/// One restore-test run under `txn` (`--selftest=restore`, the timer, or a hub dispatch).
/// `Err` when it ended before a transaction existed; the restore-test metrics then say so
/// ([`early_end_label`]: `error` for the environment), unless it was a dry run.
pub async fn run(
    cfg: &Config,
    dry_run: bool,
    txn: Ulid,
    reporter: &dyn Reporter,
    cancel: CancellationToken,
) -> Result<RestoreTestRun, Failure> {
    let started = std::time::Instant::now();
    let ran = run_txn(cfg, dry_run, txn, reporter, cancel, started).await;
    if let (Err(f), false) = (&ran, dry_run) {
        if let Err(e) = write_early_end_metrics(cfg, f, started.elapsed().as_secs_f64()) {
            tracing::warn!("restore-test metrics not updated: {e}");
        }
    }
    ran
}

async fn run_txn(
    cfg: &Config,
    dry_run: bool,
    txn: Ulid,
    reporter: &dyn Reporter,
    cancel: CancellationToken,
    started: std::time::Instant,
) -> Result<RestoreTestRun, Failure> {
    let prepared = if dry_run {
        prepare_read_only(cfg)?
    } else {
        prepare(cfg, reporter, &cancel).await?
    };
    let pve = &prepared.pve;
    let full = full_list(cfg)?;
    let pool = pool_view(cfg, pve).await?;
    let pool_vmids: Vec<u32> = pool.guests().map(|g| g.vmid).collect();
    let inventory = join(&full, &pool);
    let mut rot = read_rotation(&cfg.state_dir.join(ROTATION_FILE));

    let cands = candidates(cfg, pve, &pool_vmids).await?;
    let Some(chosen) = next_in_rotation(&cands, rot.last.as_deref()).cloned() else {
        return Err(Failure::new(
            ErrorCode::ConfigInvalid,
            format!(
                "no backup of a pool guest is visible on storage(s) {}; set restore_test.backup_storages or restore_test.sources in {}",
                cfg.restore_test.backup_storages.join(", "),
                cfg.path.display()
            ),
        ));
    };
    let Some(guest) = backup_kind_from_volid(&chosen.volid) else {
        return Err(Failure::new(
            ErrorCode::ConfigInvalid,
            format!(
                "cannot tell whether {} is a container or a VM backup",
                chosen.volid
            ),
        ));
    };
    let picked = restore_band_pick(&inventory);
    let request = Request {
        txn,
        kind: TxnKind::SelftestRestore,
        vmid: picked,
        guest,
        volid: chosen.volid.clone(),
        storage: cfg.restore_test.storage.clone(),
        pool: cfg.pool.clone(),
        isolate_network: true,
        keep: false,
        dry_run,
        profile: None,
    };
    let band = format!("{}-{}", RESTORE_TEST_BAND.start(), RESTORE_TEST_BAND.end());
    let first = match picked {
        Some(_) => Event::VmidAccepted,
        None => Event::BandFull {
            message: format!(
                "every vmid of the restore-test band {band} is held in the full guest list; the run is skipped. Free one (`felhom-agent guests`) if a stale copy sits there"
            ),
        },
    };
    // --- preflight (DESIGN §2 rule 9): before the first journal intent; reads only ---------
    let (report, first) = crate::preflight::gate(cfg, pve, &request, first).await;
    reporter.preflight(&report.human());
    super::environment_refusal(&report, picked)?;
    // --- end preflight ---------------------------------------------------------------------
    let lock = match (picked, dry_run) {
        (Some(v), false) => Some(
            VmidLock::try_acquire(&cfg.state_dir, v, Some(txn))
                .map_err(|e| Failure::new(e.code(), e.to_string()))?,
        ),
        _ => None,
    };
    let _lab = super::lab_bridge_lock(cfg, guest, picked.is_some() && !dry_run, txn)?;
    let mut exec = Executor::new(
        cfg,
        pve,
        &prepared.journal,
        reporter,
        cancel,
        super::lxc_route(cfg),
    );
    exec.carry_stored_config(report.stored_config.clone());
    let driven: Driven = exec.drive(State::new(request), first).await;
    // The transaction is settled or left for `journal resume`: the vmid is free for that at
    // once, and `journal` shows a stopped run as interrupted while this process still writes
    // its metrics.
    drop(exec);
    drop(lock);

    let outcome = driven.state.outcome_kind();
    let mut metrics_error = None;
    if !dry_run {
        rot.runs_total += 1;
        if outcome == Some(OutcomeKind::Skipped) {
            rot.skipped_total += 1;
        } else {
            rot.last = Some(chosen.key.clone());
        }
        metrics_error = write_metrics(
            cfg,
            &prepared.journal,
            &driven,
            &mut rot,
            started.elapsed().as_secs_f64(),
        )
        .err();
        store_last_result(cfg, &driven);
    }
    Ok(RestoreTestRun {
        driven,
        backup: chosen.volid,
        band,
        vmid: picked,
        metrics_error,
        preflight: Some(report),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(volid: &str, vmid: u64, ctime: u64) -> BackupVolume {
        BackupVolume {
            volid: volid.into(),
            vmid: Some(vmid),
            ctime: Some(ctime),
            size: None,
            subtype: None,
            format: None,
        }
    }

    #[test]
    fn newest_backup_of_each_pool_guest_only() {
        let vols = vec![
            vol(
                "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst",
                200,
                10,
            ),
            vol(
                "local:backup/vzdump-lxc-200-2026_02_01-00_00_00.tar.zst",
                200,
                20,
            ),
            vol(
                "local:backup/vzdump-qemu-300-2026_01_01-00_00_00.vma.zst",
                300,
                5,
            ),
            vol(
                "local:backup/vzdump-lxc-101-2026_03_01-00_00_00.tar.zst",
                101,
                30,
            ),
        ];
        let c = newest_per_guest(&vols, &[200, 300]);
        assert_eq!(c.len(), 2);
        assert_eq!(
            c[0].volid,
            "local:backup/vzdump-lxc-200-2026_02_01-00_00_00.tar.zst"
        );
        assert_eq!(c[1].key, "300");
    }

    #[test]
    fn rotation_walks_and_wraps() {
        let c: Vec<Candidate> = ["200", "300", "400"]
            .iter()
            .map(|k| Candidate {
                key: k.to_string(),
                volid: format!("v{k}"),
            })
            .collect();
        assert_eq!(
            next_in_rotation(&c, None).map(|c| c.key.as_str()),
            Some("200")
        );
        assert_eq!(
            next_in_rotation(&c, Some("200")).map(|c| c.key.as_str()),
            Some("300")
        );
        assert_eq!(
            next_in_rotation(&c, Some("400")).map(|c| c.key.as_str()),
            Some("200")
        );
        assert_eq!(
            next_in_rotation(&c, Some("gone")).map(|c| c.key.as_str()),
            Some("200")
        );
        assert!(next_in_rotation(&[], None).is_none());
    }
}
