//! The `coverage` message (protocol version 2): which of the node's pool guests have a proven
//! restore point, as `felhom-agent restore-report --json` shows it, sent after every restore
//! test run that worked the coverage out.
//!
//! Times inside a row are Unix seconds, as `restore-report --json` prints them; the message's
//! own `at` is a protocol [`Timestamp`]. The table is bounded: at most [`MAX_COVERAGE_ROWS`]
//! rows (a decoder refuses more with `invalid_field`), its texts clipped, and it fits one frame
//! ([`Coverage::bounded`] builds such a table and says in `guest_count` how many guests there
//! were).

use serde::{Deserialize, Deserializer, Serialize};

use crate::ids::TxnId;
use crate::timestamp::Timestamp;
use crate::txn::ErrorCode;

/// The most rows a `coverage` message carries; a decoder refuses more.
pub const MAX_COVERAGE_ROWS: usize = 10_000;
/// The longest guest name a row carries; longer names are clipped.
pub const MAX_GUEST_NAME_BYTES: usize = 256;
/// The longest backup volume id a row, a result or an event carries; longer ones are clipped.
pub const MAX_BACKUP_BYTES: usize = 1024;
/// The longest test message a row carries; longer ones are clipped.
pub const MAX_TEST_MESSAGE_BYTES: usize = 1024;
/// The most failing check names a test in a row carries.
pub const MAX_FAILING_CHECKS: usize = 16;
/// The longest failing check name a row carries; longer ones are clipped.
pub const MAX_CHECK_NAME_BYTES: usize = 256;
/// The longest node name a `coverage` message carries; a longer one is clipped.
pub const MAX_NODE_BYTES: usize = 256;
/// What [`Coverage::bounded`] leaves of a frame for the envelope and the node name.
const ENVELOPE_RESERVE_BYTES: usize = 8 * 1024;

/// `text` clipped to `max_bytes` on a char boundary, owned.
fn clipped(text: &str, max_bytes: usize) -> String {
    crate::clip(text, max_bytes).to_owned()
}

/// The status of one guest's coverage. Closed within a protocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CoverageStatus {
    /// Its newest backup is proven (and not due for a re-test).
    Proven,
    /// Its newest backup is not proven yet, within the node's `prove_within`.
    Due,
    /// Due for longer than `prove_within`.
    Overdue,
    /// A test of one of its backups failed and no later backup of it is proven yet.
    Failed,
    /// It has no backup on the node's backup storages.
    NoBackup,
    /// Its newest backup is refused by the preflight for good, or its copy could not be
    /// judged (its guest agent refuses exec); the last test says why.
    Unprovable,
}

impl CoverageStatus {
    /// Every status.
    pub const ALL: [CoverageStatus; 6] = [
        CoverageStatus::Proven,
        CoverageStatus::Due,
        CoverageStatus::Overdue,
        CoverageStatus::Failed,
        CoverageStatus::NoBackup,
        CoverageStatus::Unprovable,
    ];

    /// The value on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            CoverageStatus::Proven => "proven",
            CoverageStatus::Due => "due",
            CoverageStatus::Overdue => "overdue",
            CoverageStatus::Failed => "failed",
            CoverageStatus::NoBackup => "no_backup",
            CoverageStatus::Unprovable => "unprovable",
        }
    }

    /// How much a row of this status matters when a table must leave rows out (higher is
    /// kept first): failed, overdue, unprovable, no backup, due, proven.
    fn weight(self) -> u8 {
        match self {
            CoverageStatus::Failed => 5,
            CoverageStatus::Overdue => 4,
            CoverageStatus::Unprovable => 3,
            CoverageStatus::NoBackup => 2,
            CoverageStatus::Due => 1,
            CoverageStatus::Proven => 0,
        }
    }
}

/// How one test of a backup ended. Closed within a protocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TestVerdict {
    /// Restored, booted, its checks passed.
    Ok,
    /// It did not restore, boot or pass its checks.
    Failed,
    /// The preflight refuses this backup for good, or its copy cannot be judged (its guest
    /// agent refuses exec).
    Unprovable,
}

/// One backup of a guest as its storage lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupRef {
    /// Its volume id (at most [`MAX_BACKUP_BYTES`]).
    pub volid: String,
    /// Its time (Unix seconds; 0 when the storage gave none).
    pub time: u64,
    /// Its size in bytes, when the storage listed one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
}

/// One test of one backup: a restore-test copy's verdict on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupTest {
    /// The backup tested (at most [`MAX_BACKUP_BYTES`]).
    pub volid: String,
    /// The copy's transaction (its `result` names the same id).
    pub txn: TxnId,
    /// When the test settled (Unix seconds).
    pub at: u64,
    /// How it ended.
    pub verdict: TestVerdict,
    /// The error code, when it did not end `ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<ErrorCode>,
    /// Why, for a human (at most [`MAX_TEST_MESSAGE_BYTES`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The checks that failed or could not run, by name (at most [`MAX_FAILING_CHECKS`], each
    /// at most [`MAX_CHECK_NAME_BYTES`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failing: Vec<String>,
    /// The copy's vmid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy: Option<u32>,
}

/// The newest proven restore point of a guest still on storage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProvenPoint {
    /// The backup (at most [`MAX_BACKUP_BYTES`]).
    pub volid: String,
    /// The backup's time (Unix seconds).
    pub backup_time: u64,
    /// Its age when the table was made (seconds).
    pub age_seconds: u64,
    /// When it was proven (Unix seconds).
    pub proven_at: u64,
}

/// One guest of the coverage table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoverageRow {
    /// The guest's vmid.
    pub vmid: u32,
    /// Its name (at most [`MAX_GUEST_NAME_BYTES`]; empty when it has none).
    pub name: String,
    /// Its status.
    pub status: CoverageStatus,
    /// Its newest backup is older than the node's `backup_max_age`.
    pub stale: bool,
    /// The age past which its newest backup is stale (seconds): the node's `backup_max_age`,
    /// else what the guest's backup job schedule allows, else 8 days. Absent from agents
    /// before it was added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale_after: Option<u64>,
    /// The newest backup's age (seconds).
    pub backup_age: Option<u64>,
    /// The newest backup.
    pub newest_backup: Option<BackupRef>,
    /// The last test of the newest backup, if it was tested.
    pub last_test: Option<BackupTest>,
    /// The failed test that keeps the guest `failed`, when it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_test: Option<BackupTest>,
    /// The newest proven restore point still on storage.
    pub proven: Option<ProvenPoint>,
    /// A newer proven backup that is no longer on storage (its volume id), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proven_gone: Option<String>,
    /// Since when it is due (Unix seconds).
    pub due_since: Option<u64>,
    /// Whether the next run restores its newest backup.
    pub due: bool,
    /// The application group the guest is proven with (its name, at most
    /// [`MAX_GROUP_NAME_BYTES`](crate::MAX_GROUP_NAME_BYTES)); absent for a guest proven alone
    /// and from agents before groups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
}

impl BackupTest {
    fn clip(mut self) -> Self {
        self.volid = clipped(&self.volid, MAX_BACKUP_BYTES);
        self.message = self.message.map(|m| clipped(&m, MAX_TEST_MESSAGE_BYTES));
        self.failing.truncate(MAX_FAILING_CHECKS);
        self.failing = self
            .failing
            .iter()
            .map(|f| clipped(f, MAX_CHECK_NAME_BYTES))
            .collect();
        self
    }
}

impl CoverageRow {
    /// The row with every text clipped to its bound.
    pub fn clipped(mut self) -> Self {
        self.name = clipped(&self.name, MAX_GUEST_NAME_BYTES);
        if let Some(b) = &mut self.newest_backup {
            b.volid = clipped(&b.volid, MAX_BACKUP_BYTES);
        }
        self.last_test = self.last_test.map(BackupTest::clip);
        self.failed_test = self.failed_test.map(BackupTest::clip);
        if let Some(p) = &mut self.proven {
            p.volid = clipped(&p.volid, MAX_BACKUP_BYTES);
        }
        self.proven_gone = self.proven_gone.map(|v| clipped(&v, MAX_BACKUP_BYTES));
        self.group = self
            .group
            .map(|g| clipped(&g, crate::agent::MAX_GROUP_NAME_BYTES));
        self
    }
}

/// The coverage table of one node: every pool guest whose backups the node proves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Coverage {
    /// The node (at most [`MAX_NODE_BYTES`]).
    pub node: String,
    /// When the table was worked out.
    pub at: Timestamp,
    /// How many guests the table had; more than `guests.len()` when rows were left out to
    /// bound the message (the most serious statuses are kept first).
    pub guest_count: u32,
    /// The guests, by vmid (at most [`MAX_COVERAGE_ROWS`]).
    #[serde(deserialize_with = "bounded_rows")]
    pub guests: Vec<CoverageRow>,
}

fn bounded_rows<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<CoverageRow>, D::Error> {
    let rows = Vec::<CoverageRow>::deserialize(d)?;
    if rows.len() > MAX_COVERAGE_ROWS {
        return Err(serde::de::Error::custom(format!(
            "`guests` holds {} rows; at most {MAX_COVERAGE_ROWS} are accepted",
            rows.len()
        )));
    }
    Ok(rows)
}

impl Coverage {
    /// A table that can be sent: `rows` with their texts clipped, at most
    /// [`MAX_COVERAGE_ROWS`] of them, and no more than fit one frame with its envelope. When
    /// rows must be left out, the most serious statuses are kept first (failed, overdue,
    /// unprovable, no backup, due, proven; then by vmid); `guest_count` says how many there
    /// were. The rows kept are in vmid order.
    pub fn bounded(node: &str, at: Timestamp, rows: Vec<CoverageRow>) -> Coverage {
        let guest_count = u32::try_from(rows.len()).unwrap_or(u32::MAX);
        let rows = rows.into_iter().map(CoverageRow::clipped).collect();
        Coverage {
            node: clipped(node, MAX_NODE_BYTES),
            at,
            guest_count,
            guests: keep(
                rows,
                MAX_COVERAGE_ROWS,
                crate::MAX_FRAME_BYTES - ENVELOPE_RESERVE_BYTES,
            ),
        }
    }
}

/// At most `max_rows` of `rows` whose JSON (with a comma each) takes at most `budget` bytes,
/// the most serious statuses first, then by vmid; returned in vmid order.
fn keep(rows: Vec<CoverageRow>, max_rows: usize, budget: usize) -> Vec<CoverageRow> {
    let mut sized: Vec<(usize, CoverageRow)> = rows
        .into_iter()
        .map(|r| {
            // A row that cannot be serialized would not go out anyway: it counts as too big.
            let len = serde_json::to_vec(&r).map_or(usize::MAX, |v| v.len());
            (len.saturating_add(1), r)
        })
        .collect();
    let total = sized
        .iter()
        .fold(0usize, |sum, (len, _)| sum.saturating_add(*len));
    if sized.len() > max_rows || total > budget {
        sized.sort_by_key(|(_, r)| (std::cmp::Reverse(r.status.weight()), r.vmid));
        let mut used = 0usize;
        let mut kept = Vec::new();
        for (len, row) in sized {
            if kept.len() >= max_rows {
                break;
            }
            if used.saturating_add(len) <= budget {
                used += len;
                kept.push((len, row));
            }
        }
        sized = kept;
    }
    let mut rows: Vec<CoverageRow> = sized.into_iter().map(|(_, r)| r).collect();
    rows.sort_by_key(|r| r.vmid);
    rows
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn ts() -> Timestamp {
        Timestamp::parse("2026-03-01T12:00:00Z").unwrap()
    }

    fn row(vmid: u32, status: CoverageStatus) -> CoverageRow {
        CoverageRow {
            vmid,
            name: format!("g{vmid}"),
            status,
            stale: false,
            stale_after: None,
            backup_age: None,
            newest_backup: None,
            last_test: None,
            failed_test: None,
            proven: None,
            proven_gone: None,
            due_since: None,
            due: false,
            group: None,
        }
    }

    #[test]
    fn statuses_on_the_wire() {
        for s in CoverageStatus::ALL {
            assert_eq!(serde_json::to_value(s).unwrap(), json!(s.as_str()));
        }
        assert!(serde_json::from_value::<CoverageStatus>(json!("lost")).is_err());
    }

    #[test]
    fn a_small_table_is_kept_whole_in_vmid_order() {
        let c = Coverage::bounded(
            "pve1",
            ts(),
            vec![
                row(300, CoverageStatus::Due),
                row(100, CoverageStatus::Proven),
            ],
        );
        assert_eq!(c.guest_count, 2);
        assert_eq!(
            c.guests.iter().map(|r| r.vmid).collect::<Vec<_>>(),
            vec![100, 300]
        );
    }

    #[test]
    fn rows_over_the_row_bound_keep_the_serious_ones() {
        let mut rows: Vec<CoverageRow> = (0..15).map(|v| row(v, CoverageStatus::Proven)).collect();
        rows.push(row(99, CoverageStatus::Failed));
        rows.push(row(98, CoverageStatus::Due));
        rows.push(row(97, CoverageStatus::NoBackup));
        let kept = keep(rows, 10, usize::MAX);
        assert_eq!(
            kept.iter().map(|r| r.vmid).collect::<Vec<_>>(),
            vec![0, 1, 2, 3, 4, 5, 6, 97, 98, 99]
        );
    }

    #[test]
    fn a_table_over_the_row_bound_is_bounded_by_rows_and_the_frame() {
        let mut rows: Vec<CoverageRow> = (0..MAX_COVERAGE_ROWS as u32 + 5)
            .map(|v| row(v, CoverageStatus::Proven))
            .collect();
        rows.push(row(u32::MAX, CoverageStatus::Failed));
        let c = Coverage::bounded("pve1", ts(), rows);
        // Even the smallest rows do not fit 10,000 to a frame: the frame bounds them first.
        assert!(c.guests.len() <= MAX_COVERAGE_ROWS && c.guests.len() > 1000);
        assert_eq!(c.guest_count as usize, MAX_COVERAGE_ROWS + 6);
        assert_eq!(
            c.guests.last().unwrap().vmid,
            u32::MAX,
            "the failed row stays"
        );
        assert!(c.guests.windows(2).all(|w| w[0].vmid < w[1].vmid));
        let env = crate::Envelope::new(
            2,
            crate::MessageId::parse("01KJMMB1F8D3N6R0S2V5Y7ZA9C").unwrap(),
            ts(),
            crate::AgentMessage::Coverage(c),
        );
        assert!(crate::encode(&env).is_ok());
    }

    #[test]
    fn texts_are_clipped_and_a_big_table_fits_a_frame() {
        let long = "é".repeat(4096);
        let test = BackupTest {
            volid: long.clone(),
            txn: TxnId::parse("01KJMMB1F8D3N6R0S2V5Y7ZA9B").unwrap(),
            at: 1,
            verdict: TestVerdict::Failed,
            code: Some(ErrorCode::CheckFailed),
            message: Some(long.clone()),
            failing: vec![long.clone(); 40],
            copy: Some(990_000),
        };
        let big = |vmid: u32, status| CoverageRow {
            name: long.clone(),
            newest_backup: Some(BackupRef {
                volid: long.clone(),
                time: 1,
                size: Some(2),
            }),
            last_test: Some(test.clone()),
            failed_test: Some(test.clone()),
            proven_gone: Some(long.clone()),
            ..row(vmid, status)
        };
        let rows: Vec<CoverageRow> = (0..400)
            .map(|v| {
                big(
                    v,
                    if v % 7 == 0 {
                        CoverageStatus::Failed
                    } else {
                        CoverageStatus::Proven
                    },
                )
            })
            .collect();
        let c = Coverage::bounded(&long, ts(), rows);
        assert_eq!(c.guest_count, 400);
        assert!(c.guests.len() < 400 && !c.guests.is_empty());
        assert!(c.node.len() <= MAX_NODE_BYTES);
        for r in &c.guests {
            assert!(r.name.len() <= MAX_GUEST_NAME_BYTES);
            let t = r.last_test.as_ref().unwrap();
            assert!(t.volid.len() <= MAX_BACKUP_BYTES);
            assert!(t.message.as_ref().unwrap().len() <= MAX_TEST_MESSAGE_BYTES);
            assert_eq!(t.failing.len(), MAX_FAILING_CHECKS);
            assert!(t.failing.iter().all(|f| f.len() <= MAX_CHECK_NAME_BYTES));
        }
        // Every failed row (one in seven) is kept before any proven one.
        let failed = c
            .guests
            .iter()
            .filter(|r| r.status == CoverageStatus::Failed)
            .count();
        assert_eq!(failed, (0..400).filter(|v| v % 7 == 0).count());
        let env = crate::Envelope::new(
            2,
            crate::MessageId::parse("01KJMMB1F8D3N6R0S2V5Y7ZA9C").unwrap(),
            ts(),
            crate::AgentMessage::Coverage(c),
        );
        let frame = crate::encode(&env).expect("a bounded table fits a frame");
        assert!(frame.len() <= crate::MAX_FRAME_BYTES);
    }

    #[test]
    fn more_rows_than_the_bound_do_not_decode() {
        let minimal = json!({"vmid": 1, "name": "", "status": "due", "stale": false, "due": true});
        let body = |n: usize| {
            json!({"node": "pve1", "at": "2026-03-01T12:00:00Z", "guest_count": n,
                   "guests": vec![minimal.clone(); n]})
        };
        let ok: Coverage = serde_json::from_value(body(MAX_COVERAGE_ROWS)).unwrap();
        assert_eq!(ok.guests.len(), MAX_COVERAGE_ROWS);
        assert_eq!(
            ok.guests[0].last_test, None,
            "absent optional fields are None"
        );
        let err = serde_json::from_value::<Coverage>(body(MAX_COVERAGE_ROWS + 1)).unwrap_err();
        assert!(err.to_string().contains("at most 10000"), "{err}");
    }
}
