//! The restore test's coverage table for the hub: the `coverage` message (protocol version 2),
//! made from the rows a run worked out (`RestoreTestRun::coverage`, what `restore-report`
//! prints), and queued like a result: into the daemon's outbox after a dispatched run
//! ([`push`]), spooled for the daemon after a run of the command line or the timer ([`spool`]).
//! A newer table supersedes an older one still waiting; a session of protocol version 1 drops
//! it unsent (see [`super::session`]).

use hub_protocol::{
    AgentMessage, BackupRef, BackupTest, Coverage, CoverageRow, CoverageStatus, ErrorCode,
    ProvenPoint, TestVerdict, Timestamp, TxnId,
};

use super::outbox::{now_timestamp, Outbox};
use crate::config::Config;
use crate::service::restore_test::coverage as local;

fn status(s: local::Status) -> CoverageStatus {
    match s {
        local::Status::Proven => CoverageStatus::Proven,
        local::Status::Due => CoverageStatus::Due,
        local::Status::Overdue => CoverageStatus::Overdue,
        local::Status::Failed => CoverageStatus::Failed,
        local::Status::NoBackup => CoverageStatus::NoBackup,
        local::Status::Unprovable => CoverageStatus::Unprovable,
    }
}

fn verdict(v: local::Verdict) -> TestVerdict {
    match v {
        local::Verdict::Ok => TestVerdict::Ok,
        local::Verdict::Failed => TestVerdict::Failed,
        local::Verdict::Unprovable => TestVerdict::Unprovable,
    }
}

/// A test as the wire carries it. `None` when the proof store's record names no transaction
/// id (a store edited by hand): the hub could not tie it to a result.
fn test(t: &local::LastTest) -> Option<BackupTest> {
    let txn = TxnId::parse(&t.record.txn).ok()?;
    Some(BackupTest {
        volid: t.volid.clone(),
        txn,
        at: t.record.at,
        verdict: verdict(t.record.verdict),
        // The store keeps the code as its text; one this version does not know is left out.
        code: t
            .record
            .code
            .as_deref()
            .and_then(|c| serde_json::from_value::<ErrorCode>(serde_json::json!(c)).ok()),
        message: t.record.message.clone(),
        failing: t.record.failing.clone(),
        copy: t.record.copy,
    })
}

/// One row of the table as the wire carries it (texts are clipped by [`Coverage::bounded`]).
pub fn row(r: &local::CoverageRow) -> CoverageRow {
    CoverageRow {
        vmid: r.vmid,
        name: r.name.clone(),
        status: status(r.status),
        stale: r.stale,
        stale_after: Some(r.stale_after),
        backup_age: r.backup_age,
        newest_backup: r.newest_backup.as_ref().map(|b| BackupRef {
            volid: b.volid.clone(),
            time: b.time,
            size: b.size,
        }),
        last_test: r.last_test.as_ref().and_then(test),
        failed_test: r.failed_test.as_ref().and_then(test),
        proven: r.proven.as_ref().map(|p| ProvenPoint {
            volid: p.volid.clone(),
            backup_time: p.backup_time,
            age_seconds: p.age_seconds,
            proven_at: p.proven_at,
        }),
        proven_gone: r.proven_gone.clone(),
        due_since: r.due_since,
        due: r.due,
        group: r.group.clone(),
    }
}

/// The `coverage` message of node `node` made `at` from `rows`, bounded to one frame.
pub fn message(node: &str, at: Timestamp, rows: &[local::CoverageRow]) -> AgentMessage {
    AgentMessage::Coverage(Coverage::bounded(node, at, rows.iter().map(row).collect()))
}

/// The `coverage` message of this node now, from `rows`; `None` (logged) when the clock gives
/// no protocol timestamp.
fn message_now(cfg: &Config, rows: &[local::CoverageRow]) -> Option<AgentMessage> {
    match now_timestamp() {
        Ok(at) => Some(message(&cfg.node, at, rows)),
        Err(e) => {
            tracing::warn!(error = %e, "the coverage table is not queued for the hub: no timestamp");
            None
        }
    }
}

/// Queue the table after a run the daemon ran (a `restore_test` dispatch) into its outbox.
/// A failure is logged: the next run queues a new table.
pub async fn push(cfg: &Config, outbox: &Outbox, rows: &[local::CoverageRow]) {
    let Some(message) = message_now(cfg, rows) else {
        return;
    };
    match outbox.push(message).await {
        Ok(id) => tracing::info!(
            id = %id,
            "the coverage table of {} guest(s) is queued for the hub",
            rows.len()
        ),
        Err(e) => {
            tracing::warn!(error = %e, "the coverage table is not queued for the hub; the next run queues a new one")
        }
    }
}

/// Spool the table after a run of the command line or the timer, for the daemon to send (only
/// when a hub is configured). A failure is logged: the next run spools a new table.
pub fn spool(cfg: &Config, rows: &[local::CoverageRow]) {
    if cfg.hub.is_none() {
        return;
    }
    let Some(message) = message_now(cfg, rows) else {
        return;
    };
    match super::outbox::spool(&cfg.state_dir, message) {
        Ok(id) => tracing::info!(
            id = %id,
            "the coverage table of {} guest(s) is spooled for the hub",
            rows.len()
        ),
        Err(e) => {
            tracing::warn!(error = %e, "the coverage table is not spooled for the hub; the next run spools a new one")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local_row() -> local::CoverageRow {
        let volid = "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst".to_string();
        let rec = local::TestRecord {
            txn: "01KJGXA2B4C6D8E0F2G4H6J8K0".to_string(),
            at: 1_772_248_350,
            verdict: local::Verdict::Failed,
            code: Some("check_failed".to_string()),
            message: Some("1 row where none were expected".to_string()),
            failing: vec!["no-other-failed-units".to_string()],
            copy: Some(990_001),
        };
        local::CoverageRow {
            vmid: 200,
            name: "shop".to_string(),
            status: local::Status::Failed,
            stale: true,
            stale_after: 8 * 86_400,
            backup_age: Some(60),
            newest_backup: Some(local::BackupRef {
                volid: volid.clone(),
                time: 1_772_244_000,
                size: Some(1024),
                notes_first_line: None,
            }),
            last_test: Some(local::LastTest {
                volid: volid.clone(),
                record: rec.clone(),
            }),
            failed_test: Some(local::LastTest {
                volid: volid.clone(),
                record: local::TestRecord {
                    txn: "not a ulid".to_string(),
                    code: Some("no_such_code".to_string()),
                    ..rec
                },
            }),
            proven: Some(local::ProvenPoint {
                volid: volid.clone(),
                backup_time: 1,
                age_seconds: 2,
                proven_at: 3,
            }),
            proven_gone: Some("local:backup/gone".to_string()),
            due_since: Some(4),
            due: true,
            group: None,
        }
    }

    #[test]
    fn a_row_says_on_the_wire_what_restore_report_json_says() {
        let local = local_row();
        let wire = row(&local);
        let mut report = serde_json::to_value(&local).expect("report json");
        let mut sent = serde_json::to_value(&wire).expect("wire json");
        // The test the store cannot tie to a transaction is left out on the wire.
        assert_eq!(wire.failed_test, None);
        report
            .as_object_mut()
            .expect("object")
            .remove("failed_test");
        sent.as_object_mut().expect("object").remove("failed_test");
        assert_eq!(sent, report);
        let t = wire.last_test.expect("last test");
        assert_eq!(t.code, Some(ErrorCode::CheckFailed));
        assert_eq!(t.verdict, TestVerdict::Failed);
    }

    #[test]
    fn a_member_s_row_names_its_group_on_the_wire_as_in_the_report() {
        let alone = row(&local_row());
        assert_eq!(alone.group, None);
        assert!(serde_json::to_value(&alone)
            .expect("json")
            .get("group")
            .is_none());
        let member = local::CoverageRow {
            group: Some("shop".to_string()),
            ..local_row()
        };
        let wire = row(&member);
        assert_eq!(wire.group.as_deref(), Some("shop"));
        assert_eq!(
            serde_json::to_value(&wire).expect("json")["group"],
            serde_json::to_value(&member).expect("json")["group"]
        );
    }

    #[test]
    fn the_message_is_a_bounded_coverage_of_the_node() {
        let at = Timestamp::parse("2026-03-01T12:00:00Z").expect("ts");
        let AgentMessage::Coverage(c) = message("pve1", at, &[local_row()]) else {
            panic!("not a coverage message");
        };
        assert_eq!(
            (c.node.as_str(), c.guest_count, c.guests.len()),
            ("pve1", 1, 1)
        );
        assert_eq!(c.guests[0].status, CoverageStatus::Failed);
    }
}
