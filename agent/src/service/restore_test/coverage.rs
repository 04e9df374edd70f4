//! Coverage: which guests' backups are proven, which are due, and in what order a run proves
//! them. Pure logic over the node's backup list and the proof store; the run and
//! `restore-report` read both and call [`rows`].
//!
//! A proof belongs to a backup volid: a volid proven `ok` is not restored again (unless
//! `reprove_after` has passed), a newer backup makes its guest due, and a failure stays until a
//! later backup of that guest is proven `ok`. The store keeps one record per volid: its last
//! test and when it was last proven.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// The proof store in the state dir.
pub const PROOFS_FILE: &str = "restore-proofs.json";
/// The most of [`PROOFS_FILE`] that is read (a record is a few hundred bytes).
const PROOFS_MAX_BYTES: u64 = 16 << 20;
/// At most this many failing check names are kept per record.
const FAILING_MAX: usize = 16;
/// A kept message or check name is clipped to this many characters.
const TEXT_MAX: usize = 300;

/// The status of one guest's coverage (precedence: failed > overdue > unprovable > no_backup >
/// due > proven).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Its newest backup is proven (and not due for a re-test).
    Proven,
    /// Its newest backup is not proven yet, within `prove_within`.
    Due,
    /// It has no backup on the backup storages.
    NoBackup,
    /// Its newest backup is refused by the preflight for good (the record names why).
    Unprovable,
    /// Due for longer than `prove_within`.
    Overdue,
    /// A test of one of its backups failed and no later backup of it is proven yet.
    Failed,
}

impl Status {
    /// Every status, in the order reports and metrics list them.
    pub const ALL: [Status; 6] = [
        Status::Proven,
        Status::Due,
        Status::Overdue,
        Status::Failed,
        Status::NoBackup,
        Status::Unprovable,
    ];

    /// The word on the wire, in JSON, text and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Proven => "proven",
            Status::Due => "due",
            Status::Overdue => "overdue",
            Status::Failed => "failed",
            Status::NoBackup => "no_backup",
            Status::Unprovable => "unprovable",
        }
    }

    /// Whether a report with this row exits 0: only a proven or a merely due guest does (with
    /// daily backups every guest is due every morning).
    pub fn is_fine(self) -> bool {
        matches!(self, Status::Proven | Status::Due)
    }
}

/// How one test of a backup ended, as the store keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Restored, booted, its checks passed.
    Ok,
    /// It did not restore, boot or pass its checks.
    Failed,
    /// The preflight refuses this backup for good (hostpci, bind mounts, a template…).
    Unprovable,
}

impl Verdict {
    /// The word in JSON and text.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Failed => "failed",
            Verdict::Unprovable => "unprovable",
        }
    }
}

/// One test of one backup.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TestRecord {
    /// The copy's transaction.
    pub txn: String,
    /// When it settled (Unix seconds).
    pub at: u64,
    /// How it ended.
    pub verdict: Verdict,
    /// The error code, when it did not end `ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    /// Why, clipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The checks that failed or could not run, by name (at most 16).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failing: Vec<String>,
    /// The copy's vmid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy: Option<u32>,
}

impl TestRecord {
    /// A record with its free texts clipped (they come from guests and PVE).
    pub fn clipped(mut self) -> TestRecord {
        self.message = self.message.map(|m| clip(&m));
        self.failing.truncate(FAILING_MAX);
        self.failing = self.failing.iter().map(|f| clip(f)).collect();
        self
    }
}

fn clip(s: &str) -> String {
    let clean: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(TEXT_MAX)
        .collect();
    clean
}

/// What the store knows of one backup volid.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupProof {
    /// The guest whose backup it is.
    pub guest: u32,
    /// The backup's own time (Unix seconds), when known.
    #[serde(default)]
    pub backup_time: Option<u64>,
    /// Its last test.
    pub last: TestRecord,
    /// When it was last proven `ok` (Unix seconds), if ever.
    #[serde(default)]
    pub proven_at: Option<u64>,
}

impl BackupProof {
    /// Proven: its last test ended `ok`.
    pub fn is_proven(&self) -> bool {
        self.last.verdict == Verdict::Ok
    }
}

/// The proof store: one record per backup volid.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProofStore {
    /// The store's format.
    #[serde(default)]
    pub version: u32,
    /// Per volid.
    #[serde(default)]
    pub backups: BTreeMap<String, BackupProof>,
}

impl ProofStore {
    /// Record a test of `volid` (a backup of `guest` made at `backup_time`).
    pub fn record(&mut self, volid: &str, guest: u32, backup_time: Option<u64>, rec: TestRecord) {
        let rec = rec.clipped();
        let proven_at = match rec.verdict {
            Verdict::Ok => Some(rec.at),
            _ => self.backups.get(volid).and_then(|p| p.proven_at),
        };
        self.backups.insert(
            volid.to_string(),
            BackupProof {
                guest,
                backup_time: backup_time
                    .or_else(|| self.backups.get(volid).and_then(|p| p.backup_time)),
                last: rec,
                proven_at,
            },
        );
    }

    /// Drop what no longer matters: records of volids not listed any more on a storage that was
    /// listed whole (`listed`: every volid seen; `storages`: the storages listed), except a
    /// failure no later proof of its guest has cleared (it keeps the guest `failed`).
    pub fn prune(&mut self, listed: &BTreeSet<String>, storages: &BTreeSet<String>) {
        let newest_ok: BTreeMap<u32, u64> =
            self.backups
                .values()
                .filter(|p| p.is_proven())
                .fold(BTreeMap::new(), |mut m, p| {
                    let t = p.backup_time.unwrap_or(0);
                    let e = m.entry(p.guest).or_insert(t);
                    *e = (*e).max(t);
                    m
                });
        self.backups.retain(|volid, p| {
            let storage = volid.split_once(':').map_or("", |(s, _)| s);
            if listed.contains(volid) || !storages.contains(storage) {
                return true;
            }
            p.last.verdict == Verdict::Failed
                && newest_ok
                    .get(&p.guest)
                    .is_none_or(|ok| *ok <= p.backup_time.unwrap_or(0))
        });
    }
}

/// Read the store; a missing file is an empty store. `Err`: it exists but cannot be read as
/// one (the run then proves nothing it could not record: it stops with that error).
pub fn read_store(state_dir: &Path) -> Result<ProofStore, String> {
    let path = state_dir.join(PROOFS_FILE);
    let file = match fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(ProofStore::default()),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let mut bytes = Vec::new();
    file.take(PROOFS_MAX_BYTES)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        format!(
            "{} is not a proof store ({e}); move it aside to start the proofs anew (every guest is then due)",
            path.display()
        )
    })
}

/// One backup of a guest as the storage lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupRef {
    /// Its volid.
    pub volid: String,
    /// Its time (Unix seconds; 0 when the storage gave none).
    pub time: u64,
    /// Its size in bytes, when listed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// The first line of its notes as the listing gave it (kept to tell a whole read of the
    /// notes from a failed one before they are rewritten).
    #[serde(skip)]
    pub notes_first_line: Option<String>,
}

/// One guest as the coverage sees it: its backups on the backup storages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestBackups {
    /// The guest's vmid.
    pub vmid: u32,
    /// Its name, when known.
    pub name: String,
    /// Its backups.
    pub backups: Vec<BackupRef>,
    /// How old its newest backup may be before it is stale, from the schedule of the backup
    /// job that backs it up (`None`: the policy's `backup_max_age`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_age: Option<u64>,
}

/// The bounds the statuses are judged by (seconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// A due backup older than this (counted from the first backup since the last proof) is
    /// overdue.
    pub prove_within: u64,
    /// Re-test a proven backup after this long (`None`: never).
    pub reprove_after: Option<u64>,
    /// A guest whose newest backup is older than this is stale.
    pub backup_max_age: u64,
}

/// The last test of a guest's newest backup, as a report row shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LastTest {
    /// The backup tested.
    pub volid: String,
    /// The test.
    #[serde(flatten)]
    pub record: TestRecord,
}

/// The newest proven restore point of a guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProvenPoint {
    /// The backup.
    pub volid: String,
    /// The backup's time (Unix seconds).
    pub backup_time: u64,
    /// Its age now (seconds): the restore point an operator can fall back to is this old.
    pub age_seconds: u64,
    /// When it was proven (Unix seconds).
    pub proven_at: u64,
}

/// One row of the coverage: one guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CoverageRow {
    /// The guest.
    pub vmid: u32,
    /// Its name.
    pub name: String,
    /// Its status.
    pub status: Status,
    /// Its newest backup is older than `backup_max_age`.
    pub stale: bool,
    /// The age past which its newest backup is stale (seconds): `[restore_test]
    /// backup_max_age`, else what its backup job's schedule allows, else 8 days.
    pub stale_after: u64,
    /// The newest backup's age (seconds).
    pub backup_age: Option<u64>,
    /// The newest backup.
    pub newest_backup: Option<BackupRef>,
    /// The last test of the newest backup, if it was tested.
    pub last_test: Option<LastTest>,
    /// The last failed test that keeps the guest `failed`, when it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed_test: Option<LastTest>,
    /// The newest proven restore point still on storage.
    pub proven: Option<ProvenPoint>,
    /// A newer proven backup that is no longer on storage (pruned), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proven_gone: Option<String>,
    /// Since when it is due (the first backup since the last proof, Unix seconds).
    pub due_since: Option<u64>,
    /// Whether a run would restore its newest backup.
    pub due: bool,
    /// The application group it is proven with (`[[restore_test.group]]`), by the config
    /// ([`name_groups`]); `None` for a guest proven alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
}

impl CoverageRow {
    /// The sort key of a due row: the longest unproven first (no proof at all first), then the
    /// oldest due, then by vmid.
    fn due_key(&self) -> (u64, u64, u32) {
        (
            self.proven.as_ref().map_or(0, |p| p.proven_at),
            self.due_since.unwrap_or(0),
            self.vmid,
        )
    }
}

/// The coverage of `guests` at `now` by the proofs in `store`, one row per guest by vmid.
pub fn rows(
    guests: &[GuestBackups],
    store: &ProofStore,
    policy: &Policy,
    now: u64,
) -> Vec<CoverageRow> {
    let mut out: Vec<CoverageRow> = guests.iter().map(|g| row(g, store, policy, now)).collect();
    out.sort_by_key(|r| r.vmid);
    out
}

/// `rows` with each guest's application group named, as `group_of` (the config) says.
pub fn name_groups(
    mut rows: Vec<CoverageRow>,
    group_of: impl Fn(u32) -> Option<String>,
) -> Vec<CoverageRow> {
    for r in &mut rows {
        r.group = group_of(r.vmid);
    }
    rows
}

fn row(g: &GuestBackups, store: &ProofStore, policy: &Policy, now: u64) -> CoverageRow {
    let newest = g
        .backups
        .iter()
        .max_by(|a, b| (a.time, &a.volid).cmp(&(b.time, &b.volid)))
        .cloned();
    let listed: BTreeSet<&str> = g.backups.iter().map(|b| b.volid.as_str()).collect();
    let proof_of = |volid: &str| store.backups.get(volid);
    // The newest proven restore point still on storage.
    let proven = g
        .backups
        .iter()
        .filter_map(|b| {
            let p = proof_of(&b.volid).filter(|p| p.is_proven())?;
            Some(ProvenPoint {
                volid: b.volid.clone(),
                backup_time: b.time,
                age_seconds: now.saturating_sub(b.time),
                proven_at: p.proven_at.unwrap_or(p.last.at),
            })
        })
        .max_by(|a, b| (a.backup_time, &a.volid).cmp(&(b.backup_time, &b.volid)));
    let proven_time = proven.as_ref().map(|p| p.backup_time);
    // Every record of this guest (listed or not).
    let records: Vec<(&String, &BackupProof)> = store
        .backups
        .iter()
        .filter(|(_, p)| p.guest == g.vmid)
        .collect();
    let proven_gone = records
        .iter()
        .filter(|(v, p)| {
            p.is_proven()
                && !listed.contains(v.as_str())
                && p.backup_time.unwrap_or(0) > proven_time.unwrap_or(0)
        })
        .max_by_key(|(_, p)| p.backup_time)
        .map(|(v, _)| (*v).clone());
    // A failure stays until a later backup of the guest is proven ok.
    let newest_ok_time = records
        .iter()
        .filter(|(_, p)| p.is_proven())
        .map(|(_, p)| p.backup_time.unwrap_or(0))
        .max();
    let failed_test = records
        .iter()
        .filter(|(_, p)| p.last.verdict == Verdict::Failed)
        .filter(|(_, p)| newest_ok_time.is_none_or(|ok| ok <= p.backup_time.unwrap_or(0)))
        .max_by_key(|(_, p)| p.last.at)
        .map(|(v, p)| LastTest {
            volid: (*v).clone(),
            record: p.last.clone(),
        });
    let last_test = newest.as_ref().and_then(|n| {
        proof_of(&n.volid).map(|p| LastTest {
            volid: n.volid.clone(),
            record: p.last.clone(),
        })
    });
    let newest_proof = newest.as_ref().and_then(|n| proof_of(&n.volid));
    let unprovable = newest_proof.is_some_and(|p| p.last.verdict == Verdict::Unprovable);
    let reprove_due = |p: &BackupProof| {
        policy
            .reprove_after
            .is_some_and(|after| now.saturating_sub(p.proven_at.unwrap_or(p.last.at)) >= after)
    };
    let due = newest.is_some()
        && !unprovable
        && newest_proof.is_none_or(|p| !p.is_proven() || reprove_due(p));
    // Due since: the first backup after the newest proven one (or the oldest when none is
    // proven); for a re-test of a proven backup, since its re-test fell due.
    let due_since = if !due {
        None
    } else if let (Some(p), Some(after)) =
        (newest_proof.filter(|p| p.is_proven()), policy.reprove_after)
    {
        Some(p.proven_at.unwrap_or(p.last.at).saturating_add(after))
    } else {
        g.backups
            .iter()
            .filter(|b| proven_time.is_none_or(|t| b.time > t))
            .map(|b| b.time)
            .min()
    };
    let overdue = due_since.is_some_and(|s| now.saturating_sub(s) > policy.prove_within);
    let stale_after = g.max_age.unwrap_or(policy.backup_max_age);
    let stale = newest
        .as_ref()
        .is_some_and(|n| now.saturating_sub(n.time) > stale_after);
    let status = if failed_test.is_some() {
        Status::Failed
    } else if overdue {
        Status::Overdue
    } else if unprovable {
        Status::Unprovable
    } else if newest.is_none() {
        Status::NoBackup
    } else if due {
        Status::Due
    } else {
        Status::Proven
    };
    CoverageRow {
        vmid: g.vmid,
        name: g.name.clone(),
        status,
        stale,
        stale_after,
        backup_age: newest.as_ref().map(|n| now.saturating_sub(n.time)),
        newest_backup: newest,
        last_test,
        failed_test,
        proven,
        proven_gone,
        due_since,
        due,
        group: None,
    }
}

/// The due rows in the order a run proves them: the longest unproven first.
pub fn due_order(rows: &[CoverageRow]) -> Vec<&CoverageRow> {
    let mut due: Vec<&CoverageRow> = rows.iter().filter(|r| r.due).collect();
    due.sort_by_key(|r| r.due_key());
    due
}

/// Whether a report of these rows exits 0: every guest proven or merely due, none stale.
pub fn all_fine(rows: &[CoverageRow]) -> bool {
    rows.iter().all(|r| r.status.is_fine() && !r.stale)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: u64 = 86_400;
    const NOW: u64 = 1_800_000_000;

    fn policy() -> Policy {
        Policy {
            prove_within: 7 * DAY,
            reprove_after: None,
            backup_max_age: 8 * DAY,
        }
    }

    fn b(vmid: u32, days_ago: u64) -> BackupRef {
        BackupRef {
            volid: format!("local:backup/vzdump-lxc-{vmid}-{days_ago}.tar.zst"),
            time: NOW - days_ago * DAY,
            size: None,
            notes_first_line: None,
        }
    }

    fn guest(vmid: u32, backups: Vec<BackupRef>) -> GuestBackups {
        GuestBackups {
            max_age: None,
            vmid,
            name: format!("g{vmid}"),
            backups,
        }
    }

    fn rec(verdict: Verdict, at: u64) -> TestRecord {
        TestRecord {
            txn: "01J".into(),
            at,
            verdict,
            code: None,
            message: None,
            failing: vec![],
            copy: Some(990002),
        }
    }

    fn record(store: &mut ProofStore, r: &BackupRef, guest: u32, v: Verdict, at: u64) {
        store.record(&r.volid, guest, Some(r.time), rec(v, at));
    }

    fn status_of(g: &GuestBackups, store: &ProofStore) -> CoverageRow {
        rows(std::slice::from_ref(g), store, &policy(), NOW).remove(0)
    }

    #[test]
    fn rows_name_the_group_their_guest_is_in_and_none_for_a_guest_alone() {
        let guests = [
            guest(200, vec![b(200, 1)]),
            guest(201, vec![]),
            guest(300, vec![]),
        ];
        let rows = name_groups(
            rows(&guests, &ProofStore::default(), &policy(), NOW),
            |vmid| [200, 201].contains(&vmid).then(|| "shop".to_string()),
        );
        assert_eq!(
            rows.iter()
                .map(|r| (r.vmid, r.group.as_deref()))
                .collect::<Vec<_>>(),
            [(200, Some("shop")), (201, Some("shop")), (300, None)]
        );
        let json = serde_json::to_value(&rows).expect("json");
        assert_eq!(json[0]["group"], "shop");
        assert!(json[2].get("group").is_none(), "{json:#}");
    }

    #[test]
    fn an_unproven_backup_is_due_then_proven_and_not_due_again() {
        let g = guest(200, vec![b(200, 1)]);
        let mut store = ProofStore::default();
        let r = status_of(&g, &store);
        assert_eq!((r.status, r.due), (Status::Due, true));
        record(&mut store, &g.backups[0], 200, Verdict::Ok, NOW);
        let r = status_of(&g, &store);
        assert_eq!((r.status, r.due), (Status::Proven, false));
        assert_eq!(r.proven.expect("proven").age_seconds, DAY);
    }

    #[test]
    fn a_newer_backup_makes_its_guest_due_again() {
        let mut g = guest(200, vec![b(200, 3)]);
        let mut store = ProofStore::default();
        record(&mut store, &g.backups[0], 200, Verdict::Ok, NOW - 2 * DAY);
        g.backups.push(b(200, 1));
        let r = status_of(&g, &store);
        assert_eq!((r.status, r.due), (Status::Due, true));
        assert_eq!(r.newest_backup.expect("newest").volid, b(200, 1).volid);
        // The proven point is the older backup, still on storage.
        assert_eq!(r.proven.expect("proven").volid, b(200, 3).volid);
        assert_eq!(r.due_since, Some(NOW - DAY));
    }

    #[test]
    fn due_for_longer_than_prove_within_is_overdue() {
        let g = guest(200, vec![b(200, 9), b(200, 8)]);
        let mut store = ProofStore::default();
        record(&mut store, &g.backups[0], 200, Verdict::Ok, NOW - 8 * DAY);
        // Due since the backup 8 days ago: overdue (and stale: 8 days and a bit is not > 8).
        let r = status_of(&g, &store);
        assert_eq!(r.status, Status::Overdue);
        // A weekly backup just made after a proven one is merely due.
        let g = guest(201, vec![b(201, 7), b(201, 0)]);
        let mut store = ProofStore::default();
        record(&mut store, &g.backups[0], 201, Verdict::Ok, NOW - 6 * DAY);
        assert_eq!(status_of(&g, &store).status, Status::Due);
    }

    #[test]
    fn a_failure_stays_until_a_later_backup_is_proven() {
        let mut g = guest(200, vec![b(200, 2)]);
        let mut store = ProofStore::default();
        record(&mut store, &g.backups[0], 200, Verdict::Failed, NOW - DAY);
        let r = status_of(&g, &store);
        assert_eq!((r.status, r.due), (Status::Failed, true));
        // A newer backup, not yet tested: still failed.
        g.backups.push(b(200, 1));
        assert_eq!(status_of(&g, &store).status, Status::Failed);
        // The failed one pruned from storage: the failure is kept.
        g.backups.remove(0);
        let listed: BTreeSet<String> = g.backups.iter().map(|b| b.volid.clone()).collect();
        store.prune(&listed, &BTreeSet::from(["local".to_string()]));
        assert_eq!(status_of(&g, &store).status, Status::Failed);
        // The newer one proven: no longer failed, and the old failure may go.
        record(&mut store, &g.backups[0], 200, Verdict::Ok, NOW);
        assert_eq!(status_of(&g, &store).status, Status::Proven);
        store.prune(&listed, &BTreeSet::from(["local".to_string()]));
        assert_eq!(store.backups.len(), 1);
    }

    #[test]
    fn a_failed_backup_proven_on_a_retest_clears() {
        let g = guest(200, vec![b(200, 1)]);
        let mut store = ProofStore::default();
        record(&mut store, &g.backups[0], 200, Verdict::Failed, NOW - 100);
        record(&mut store, &g.backups[0], 200, Verdict::Ok, NOW);
        assert_eq!(status_of(&g, &store).status, Status::Proven);
    }

    #[test]
    fn unprovable_no_backup_and_stale() {
        let g = guest(200, vec![b(200, 1)]);
        let mut store = ProofStore::default();
        record(&mut store, &g.backups[0], 200, Verdict::Unprovable, NOW);
        let r = status_of(&g, &store);
        assert_eq!((r.status, r.due), (Status::Unprovable, false));
        let r = status_of(&guest(201, vec![]), &store);
        assert_eq!((r.status, r.due, r.stale), (Status::NoBackup, false, false));
        let g = guest(202, vec![b(202, 30)]);
        let mut store = ProofStore::default();
        record(&mut store, &g.backups[0], 202, Verdict::Ok, NOW - 29 * DAY);
        let r = status_of(&g, &store);
        assert_eq!((r.status, r.stale), (Status::Proven, true));
        assert!(!all_fine(&[r]));
    }

    #[test]
    fn reprove_after_makes_a_proven_backup_due_again() {
        let g = guest(200, vec![b(200, 20)]);
        let mut store = ProofStore::default();
        record(&mut store, &g.backups[0], 200, Verdict::Ok, NOW - 10 * DAY);
        let p = Policy {
            reprove_after: Some(9 * DAY),
            backup_max_age: 100 * DAY,
            ..policy()
        };
        let r = rows(std::slice::from_ref(&g), &store, &p, NOW).remove(0);
        assert_eq!((r.status, r.due), (Status::Due, true));
        assert_eq!(r.due_since, Some(NOW - DAY));
    }

    #[test]
    fn the_longest_unproven_comes_first() {
        let gs = vec![
            guest(300, vec![b(300, 1)]),
            guest(200, vec![b(200, 5), b(200, 1)]),
            guest(100, vec![b(100, 2), b(100, 1)]),
        ];
        let mut store = ProofStore::default();
        record(
            &mut store,
            &gs[1].backups[0],
            200,
            Verdict::Ok,
            NOW - 4 * DAY,
        );
        record(&mut store, &gs[2].backups[0], 100, Verdict::Ok, NOW - DAY);
        let r = rows(&gs, &store, &policy(), NOW);
        let order: Vec<u32> = due_order(&r).iter().map(|r| r.vmid).collect();
        assert_eq!(order, vec![300, 200, 100]);
    }

    #[test]
    fn records_are_clipped() {
        let mut store = ProofStore::default();
        let mut r = rec(Verdict::Failed, NOW);
        r.message = Some("x\n".repeat(1000));
        r.failing = (0..100).map(|i| format!("check{i}")).collect();
        store.record("local:backup/a", 1, None, r);
        let p = &store.backups["local:backup/a"];
        assert_eq!(p.last.failing.len(), FAILING_MAX);
        let m = p.last.message.as_deref().expect("message");
        assert_eq!(m.chars().count(), TEXT_MAX);
        assert!(!m.contains('\n'));
    }

    #[test]
    fn durations() {
        use crate::config::parse_duration;
        assert_eq!(parse_duration("7d"), Some(7 * DAY));
        assert_eq!(parse_duration("12h"), Some(12 * 3600));
        assert_eq!(parse_duration("30m"), Some(1800));
        assert_eq!(parse_duration("0d"), Some(0));
        for bad in ["", "d", "7", "7w", "-1d", "1.5d", "99999999999999999999d"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }
}
