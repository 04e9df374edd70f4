//! Journal tests against a real temporary directory.

use super::*;
use crate::provision::machine::{step, Event, GuestView, Marker, Request, TaskExit};
use crate::pve::GuestKind;
use std::fs::OpenOptions;
use std::io::Write;
use std::time::Duration;
use time::OffsetDateTime;

const UPID: &str = "UPID:pve1:0003A2F1:01B7E4C0:6650C0DE:vzrestore:120:felhom@pve!agent:";

fn request(txn: Ulid, vmid: u32) -> Request {
    Request {
        txn,
        kind: TxnKind::SelftestProvision,
        vmid: Some(vmid),
        guest: GuestKind::Lxc,
        volid: "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst".to_string(),
        storage: "local-lvm".to_string(),
        pool: "felhom".to_string(),
        isolate_network: false,
        keep: false,
        dry_run: false,
        profile: None,
        lab_bridge: None,
        group: None,
    }
}

fn next(s: &State, e: Event) -> State {
    match step(s, e) {
        Ok((s, _)) => s,
        Err(d) => panic!("{d}"),
    }
}

/// The journaled states of one transaction up to the created (armed) phase.
fn states(txn: Ulid, vmid: u32) -> Vec<State> {
    let s0 = State::new(request(txn, vmid));
    let s1 = next(&s0, Event::VmidAccepted);
    let s2 = next(
        &s1,
        Event::Submitted {
            upid: UPID.to_string(),
        },
    );
    let s3 = next(
        &s2,
        Event::TaskEnded {
            upid: UPID.to_string(),
            exit: TaskExit::Ok,
        },
    );
    let s4 = next(&s3, Event::MarkerWritten);
    let m = Marker::new(txn);
    let s5 = next(
        &s4,
        Event::GuestObserved(GuestView::Present {
            tags: m.tags().join(";"),
            description: m.description_line(),
            lock: None,
            identity: Default::default(),
        }),
    );
    vec![s1, s2, s3, s4, s5]
}

fn txn(n: u64) -> Ulid {
    Ulid::from_parts(1_767_225_600_000 + n, u128::from(n))
}

fn write_all(j: &Journal, states: &[State]) -> TxnState {
    let mut last = None;
    for s in states {
        last = Some(j.record(s).expect("record"));
    }
    last.expect("at least one state")
}

#[test]
fn records_replay_to_the_last_state_with_times_and_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    assert!(dir.path().join("journal").is_dir());
    let t = txn(1);
    let st = states(t, 120);
    let written = write_all(&j, &st);
    assert_eq!(written.records, 5);
    assert_eq!(written.state, st[4]);

    let all = j.replay().expect("replay");
    assert_eq!(all.len(), 1);
    let got = &all[0];
    assert_eq!(got.state, st[4]);
    assert!(got.state.destroy_armed());
    assert_eq!(got.records, 5);
    assert!(!got.torn_tail);
    assert!(got.started_at.ends_with('Z') && got.updated_at.ends_with('Z'));
    assert!(got.started_at <= got.updated_at);
    assert_eq!(got.path, j.path_of(t));

    // A re-dispatch with the same id reads the state back.
    assert_eq!(j.get(t).expect("get").map(|g| g.state), Some(st[4].clone()));
    assert_eq!(j.get(txn(99)).expect("get unknown"), None);

    let rows = j.list().expect("list");
    let row = &rows[0];
    assert_eq!(row.txn, t);
    assert_eq!(row.vmid, Some(120));
    assert_eq!(row.phase, Phase::Created);
    assert!(row.destroy_armed);
    assert_eq!(row.upid.as_deref(), Some(UPID));
    assert_eq!(row.outcome, None);
    let json = serde_json::to_value(row).expect("row json");
    for key in [
        "txn",
        "kind",
        "vmid",
        "phase",
        "destroy_armed",
        "upid",
        "started_at",
        "updated_at",
        "outcome",
    ] {
        assert!(json.get(key).is_some(), "row lacks {key}: {json}");
    }
    assert_eq!(json["kind"], "selftest-provision");
    assert_eq!(json["phase"], "created");
}

#[test]
fn each_record_is_one_versioned_checksummed_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    let t = txn(2);
    write_all(&j, &states(t, 120)[..2]);
    let text = fs::read_to_string(j.path_of(t)).expect("read");
    assert!(text.ends_with('\n'));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2);
    for (i, line) in lines.iter().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).expect("json line");
        assert_eq!(v["v"], 1);
        assert_eq!(v["rec"]["seq"], i as u64);
        // A durable-log record (its format is tested there) whose payload is the record.
        let (rec, sum) = durable_log::decode_line(line.as_bytes()).expect("durable-log line");
        assert_eq!(v["sum"].as_str(), Some(sum));
        let record: Record = serde_json::from_str(rec).expect("record");
        assert_eq!(record.seq, i as u64);
        assert_eq!(record.state.txn(), t);
    }
    // The second record is the write-ahead one: the UPID is in it.
    assert!(lines[1].contains(UPID));
}

#[test]
fn a_torn_last_line_is_ignored_then_cut_off_by_the_next_append() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    let t = txn(3);
    let st = states(t, 120);
    write_all(&j, &st[..2]);
    let path = j.path_of(t);
    let good_len = fs::metadata(&path).expect("meta").len();
    // A crash in the middle of the third write: half a line, no newline.
    let third = {
        let probe = tempfile::tempdir().expect("tempdir");
        let pj = Journal::open(probe.path()).expect("open");
        write_all(&pj, &st[..3]);
        let text = fs::read_to_string(pj.path_of(t)).expect("read");
        text.lines().nth(2).map(str::to_string).expect("third line")
    };
    let mut f = OpenOptions::new().append(true).open(&path).expect("open");
    f.write_all(&third.as_bytes()[..third.len() / 2])
        .expect("torn write");
    drop(f);

    let got = j.get(t).expect("get").expect("present");
    assert!(got.torn_tail);
    assert_eq!(got.records, 2);
    assert_eq!(got.state, st[1]);
    assert_eq!(j.replay().expect("replay").len(), 1);

    // The next append cuts the torn tail off and continues the numbering.
    let after = j.append(&st[2]).expect("append");
    assert_eq!(after.records, 3);
    let text = fs::read_to_string(&path).expect("read");
    assert_eq!(text.lines().count(), 3);
    assert!(fs::metadata(&path).expect("meta").len() > good_len);
    let again = j.get(t).expect("get").expect("present");
    assert!(!again.torn_tail);
    assert_eq!(again.state, st[2]);
}

#[test]
fn a_complete_last_line_with_a_bad_checksum_counts_as_torn() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    let t = txn(4);
    let st = states(t, 120);
    write_all(&j, &st[..3]);
    let path = j.path_of(t);
    let mut bytes = fs::read(&path).expect("read");
    let last_line_start = bytes[..bytes.len() - 1]
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(0, |i| i + 1);
    let flip = last_line_start + (bytes.len() - last_line_start) * 3 / 4;
    bytes[flip] ^= 0x01;
    fs::write(&path, &bytes).expect("write");
    let got = j.get(t).expect("get").expect("present");
    assert!(got.torn_tail);
    assert_eq!(got.state, st[1]);
}

#[test]
fn a_flipped_byte_in_the_middle_is_corruption_naming_the_file_and_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    let t = txn(5);
    write_all(&j, &states(t, 120));
    let path = j.path_of(t);
    let mut bytes = fs::read(&path).expect("read");
    let second_line_start = bytes.iter().position(|b| *b == b'\n').map_or(0, |i| i + 1);
    let third_line_start = bytes[second_line_start..]
        .iter()
        .position(|b| *b == b'\n')
        .map_or(0, |i| second_line_start + i + 1);
    // Flip a byte inside the record of line 2 (a digit of the timestamp or a letter).
    let flip = second_line_start + (third_line_start - second_line_start) / 2;
    bytes[flip] ^= 0x02;
    fs::write(&path, &bytes).expect("write");

    for result in [j.replay().map(|_| ()), j.get(t).map(|_| ())] {
        match result {
            Err(JournalError::Corrupt { path: p, line, .. }) => {
                assert_eq!(p, path);
                assert_eq!(line, 2);
            }
            other => panic!("expected corruption, got {other:?}"),
        }
    }
    let err = j.replay().expect_err("corrupt");
    let msg = err.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("line 2"), "{msg}");
    assert_eq!(err.code(), ErrorCode::ConfigInvalid);
    // Appending to a corrupt file is refused too.
    assert!(matches!(
        j.append(&states(t, 120)[4]),
        Err(JournalError::Corrupt { .. })
    ));
}

#[test]
fn records_out_of_order_or_of_another_transaction_are_corruption() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    let (a, b) = (txn(6), txn(7));
    write_all(&j, &states(a, 120)[..2]);
    write_all(&j, &states(b, 121)[..3]);
    let text_a = fs::read_to_string(j.path_of(a)).expect("read a");
    let text_b = fs::read_to_string(j.path_of(b)).expect("read b");
    let lines_a: Vec<&str> = text_a.lines().collect();
    let lines_b: Vec<&str> = text_b.lines().collect();

    // Line 2 repeated: valid checksums, wrong numbering.
    fs::write(
        j.path_of(a),
        format!("{}\n{}\n{}\n", lines_a[0], lines_a[1], lines_a[1]),
    )
    .expect("write");
    match j.get(a) {
        Err(JournalError::Corrupt { line, reason, .. }) => {
            assert_eq!(line, 3);
            assert!(reason.contains("record number 1 where 2"), "{reason}");
        }
        other => panic!("expected corruption, got {other:?}"),
    }

    // A record of b spliced into a's file.
    fs::write(
        j.path_of(a),
        format!("{}\n{}\n{}\n", lines_a[0], lines_b[1], lines_a[1]),
    )
    .expect("write");
    match j.get(a) {
        Err(JournalError::Corrupt { line, reason, .. }) => {
            assert_eq!(line, 2);
            assert!(reason.contains(&b.to_string()), "{reason}");
        }
        other => panic!("expected corruption, got {other:?}"),
    }
}

#[test]
fn a_newer_format_version_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    let t = txn(8);
    write_all(&j, &states(t, 120)[..2]);
    let text = fs::read_to_string(j.path_of(t)).expect("read");
    fs::write(j.path_of(t), text.replacen("{\"v\":1,", "{\"v\":2,", 1)).expect("write");
    match j.get(t) {
        Err(JournalError::UnsupportedVersion { version, line, .. }) => {
            assert_eq!((version, line), (2, 1));
        }
        other => panic!("expected a version error, got {other:?}"),
    }
}

#[test]
fn size_caps_refuse_and_say_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    let limits = Limits {
        max_record_bytes: 4096,
        max_file_bytes: 8 * 1024,
    };
    let j = Journal::open_with_limits(dir.path(), limits).expect("open");

    // One record over the per-record cap: nothing is written.
    let t = txn(9);
    let mut req = request(t, 120);
    req.volid = "x".repeat(5000);
    let big = next(&State::new(req), Event::VmidAccepted);
    match j.record(&big) {
        Err(JournalError::RecordTooLarge { txn, size, max, .. }) => {
            assert_eq!(txn, t);
            assert!(size > 4096);
            assert_eq!(max, 4096);
        }
        other => panic!("expected RecordTooLarge, got {other:?}"),
    }
    assert!(!j.path_of(t).exists());
    let msg = j.record(&big).expect_err("too large").to_string();
    assert!(
        msg.contains(&t.to_string()) && msg.contains("4096"),
        "{msg}"
    );

    // Appends until the per-file cap: refused, and the file stays readable.
    let u = txn(10);
    let st = states(u, 120);
    j.begin(&st[0]).expect("begin");
    let mut appended = 1;
    let err = loop {
        match j.append(&st[1]) {
            Ok(_) => appended += 1,
            Err(e) => break e,
        }
        assert!(appended < 100, "the file cap never hit");
    };
    assert!(
        matches!(err, JournalError::FileFull { txn, max, .. } if txn == u && max == 8 * 1024),
        "{err:?}"
    );
    let size = fs::metadata(j.path_of(u)).expect("meta").len();
    assert!(size <= 8 * 1024);
    let got = j.get(u).expect("get").expect("present");
    assert_eq!(got.records, appended);

    // A file over the cap on disk is not read.
    let big_file = j.path_of(txn(11));
    fs::write(&big_file, vec![b'x'; 9 * 1024]).expect("write");
    assert!(matches!(
        j.get(txn(11)),
        Err(JournalError::FileTooLarge { .. })
    ));
}

#[test]
fn many_transactions_replay_in_order_and_open_ones_are_listed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    let n = 150u64;
    for i in 0..n {
        let st = states(txn(1000 + i), 1000 + i as u32);
        // Every third transaction is settled (refused at submit), the others stay open.
        if i % 3 == 0 {
            let refused = next(
                &st[0],
                Event::SubmitRefused(Failure::new(
                    ErrorCode::PveRefused,
                    format!("CT {} already exists on node 'pve1'", 1000 + i),
                )),
            );
            write_all(&j, &[st[0].clone(), refused]);
        } else {
            write_all(&j, &st[..(i as usize % 5) + 1]);
        }
    }
    // Noise in the folder is ignored.
    fs::write(j.dir().join("README"), "not a journal").expect("write");
    fs::write(j.dir().join("not-a-ulid.log"), "x").expect("write");

    let all = j.replay().expect("replay");
    assert_eq!(all.len(), n as usize);
    let ids: Vec<Ulid> = all.iter().map(|t| t.state.txn()).collect();
    let mut sorted = ids.clone();
    sorted.sort();
    assert_eq!(ids, sorted);
    let open = j.open_transactions().expect("open txns");
    assert_eq!(open.len(), (n - n.div_ceil(3)) as usize);
    assert!(open.iter().all(|t| !t.state.is_terminal()));
    assert_eq!(j.list().expect("list").len(), n as usize);
}

#[test]
fn begin_and_append_guard_their_preconditions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    let t = txn(12);
    let st = states(t, 120);
    assert!(matches!(
        j.append(&st[0]),
        Err(JournalError::NotFound { txn, .. }) if txn == t
    ));
    j.begin(&st[0]).expect("begin");
    assert!(matches!(
        j.begin(&st[0]),
        Err(JournalError::AlreadyExists { txn, .. }) if txn == t
    ));

    // A file whose first record was torn holds nothing: begin reuses it.
    let u = txn(13);
    fs::write(j.path_of(u), b"{\"v\":1,\"sha").expect("write");
    assert_eq!(j.get(u).expect("get"), None);
    assert!(j
        .replay()
        .expect("replay")
        .iter()
        .all(|x| x.state.txn() != u));
    let began = j
        .begin(&states(u, 121)[0])
        .expect("begin over a torn first record");
    assert_eq!(began.records, 1);
    assert_eq!(j.get(u).expect("get").map(|g| g.records), Some(1));
}

#[test]
fn the_owner_record_of_a_vmid_is_its_latest_transaction_with_a_upid_or_a_free_verdict() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    let armed = states(txn(20), 130);
    write_all(&j, &armed);
    // A later attempt on the same vmid found it free in the full guest list (PVE then refused
    // the restore, so no UPID): the earlier claim is void, the latest record is this one.
    let later = states(txn(21), 130);
    let refused = next(
        &later[0],
        Event::SubmitRefused(Failure::new(
            ErrorCode::PveRefused,
            "CT 130 already exists on node 'pve1'",
        )),
    );
    write_all(&j, &[later[0].clone(), refused]);
    write_all(&j, &states(txn(22), 131));
    let owner = j.last_owner_record(130).expect("lookup").expect("found");
    assert_eq!(owner.state.txn(), txn(21));
    assert!(owner.state.upid().is_none() && !owner.state.destroy_armed());
    // Without that later verdict the armed transaction is the owner record.
    let dir2 = tempfile::tempdir().expect("tempdir");
    let j2 = Journal::open(dir2.path()).expect("open");
    write_all(&j2, &armed);
    let owner = j2.last_owner_record(130).expect("lookup").expect("found");
    assert_eq!(owner.state.txn(), txn(20));
    assert!(owner.state.destroy_armed());
    assert_eq!(j.last_owner_record(999).expect("lookup"), None);
}

#[test]
fn journal_files_are_private_to_root() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    let t = txn(30);
    write_all(&j, &states(t, 120)[..1]);
    let mode = |p: &Path| fs::metadata(p).expect("meta").permissions().mode() & 0o777;
    assert_eq!(mode(j.dir()), 0o700);
    assert_eq!(mode(&j.path_of(t)), 0o600);
}

#[test]
fn each_phase_that_ends_is_journaled_with_its_duration() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    let t = txn(42);
    let all = states(t, 120);
    let mut expected = Vec::new();
    let mut entered = std::time::Instant::now();
    for (i, s) in all.iter().enumerate() {
        if i > 0 && all[i - 1].phase() != s.phase() {
            expected.push((all[i - 1].phase(), entered.elapsed().as_secs_f64()));
            entered = std::time::Instant::now();
        }
        j.record(s).expect("record");
        std::thread::sleep(std::time::Duration::from_millis(20 * (i as u64 + 1)));
    }
    let timings = j.timings().expect("timings");
    assert_eq!(timings.len(), 1);
    let got = &timings[0];
    assert_eq!(got.txn, t);
    assert_eq!(got.kind, TxnKind::SelftestProvision);
    assert_eq!(got.outcome, None);
    assert!(!got.needs_human);
    assert_eq!(
        got.phases.iter().map(|p| p.phase).collect::<Vec<_>>(),
        expected.iter().map(|e| e.0).collect::<Vec<_>>(),
        "one duration per phase that ended, none for a record in the same phase"
    );
    assert!(
        expected.len() >= 2,
        "the fixture changes phase: {expected:?}"
    );
    for (p, (_, measured)) in got.phases.iter().zip(&expected) {
        assert!(
            (p.seconds - measured).abs() < 0.05,
            "{:?}: journaled {} s, measured {measured} s",
            p.phase,
            p.seconds
        );
    }
    // The file says so too, in the record that entered the next phase.
    let text = std::fs::read_to_string(j.path_of(t)).expect("read");
    assert_eq!(text.matches("\"phase_done\"").count(), expected.len());
}

#[test]
fn a_failure_record_over_the_cap_is_stored_reduced_not_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let limits = Limits {
        max_record_bytes: 4096,
        max_file_bytes: 64 * 1024,
    };
    let j = Journal::open_with_limits(dir.path(), limits).expect("open");
    let t = txn(11);
    let st = states(t, 120);
    j.record(&st[0]).expect("vmid accepted");
    j.record(&st[1]).expect("submitted");
    // Guest or PVE text fills the failure message to the machine's own clip (4 KiB).
    let failed = next(
        &st[1],
        Event::TaskEnded {
            upid: UPID.to_string(),
            exit: TaskExit::Error {
                message: "guest said: ".to_string() + &"x\n".repeat(8000),
            },
        },
    );
    let stored = j.record(&failed).expect("stored reduced, not refused");
    let back = j.get(t).expect("readable").expect("present");
    assert_eq!(back.records, 3);
    assert_eq!(back.state.phase(), failed.phase());
    let message = &back.state.failure().expect("a failure").message;
    assert!(message.len() < 512, "{} bytes", message.len());
    assert!(message.starts_with("guest said") || message.contains("guest said"));
    assert_eq!(stored.state, back.state);
}

fn refused_at_submit(txn: Ulid, vmid: u32) -> Vec<State> {
    let st = states(txn, vmid);
    let refused = next(
        &st[0],
        Event::SubmitRefused(Failure::new(
            ErrorCode::PveRefused,
            format!("CT {vmid} already exists on node 'pve1'"),
        )),
    );
    vec![st[0].clone(), refused]
}

#[test]
fn compaction_archives_old_settled_transactions_but_nothing_that_may_own_a_guest() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    // vmid 200: one settled transaction. vmid 201: a settled one, then an open one, then a
    // settled one newer than the open one (kept: the open one may still own the guest).
    write_all(&j, &refused_at_submit(txn(1), 200));
    write_all(&j, &refused_at_submit(txn(2), 201));
    write_all(&j, &states(txn(3), 201));
    write_all(&j, &refused_at_submit(txn(4), 201));
    let day = Duration::from_secs(86_400);
    let now = OffsetDateTime::now_utc();

    // Too young: nothing moves.
    assert_eq!(j.compact(day, now).expect("compact").archived, 0);
    assert_eq!(j.replay().expect("replay").len(), 4);

    let later = now + Duration::from_secs(2 * 86_400);
    let done = j.compact(day, later).expect("compact");
    assert_eq!(done.archived, 2, "{done:?}");
    let live: Vec<Ulid> = j
        .replay()
        .expect("replay")
        .iter()
        .map(|t| t.state.txn())
        .collect();
    assert_eq!(live, vec![txn(3), txn(4)]);
    assert!(!j.path_of(txn(1)).exists() && !j.path_of(txn(2)).exists());
    let archived: Vec<Ulid> = j
        .archived()
        .expect("archived")
        .iter()
        .map(|t| t.state.txn())
        .collect();
    assert_eq!(archived, vec![txn(1), txn(2)]);
    assert_eq!(done.files.len(), 1);
    let name = done.files[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    assert!(
        name.len() == "YYYY-MM.log".len() && name.ends_with(".log"),
        "{name}"
    );

    // An old transaction id is still found (a re-dispatch answers from it), and the owner
    // record of a vmid with an open transaction is unchanged.
    assert!(j.get(txn(1)).expect("get").is_none());
    let found = j.get_any(txn(1)).expect("get_any").expect("archived");
    assert_eq!(found.state.outcome_kind(), Some(OutcomeKind::Failed));
    assert_eq!(
        j.last_owner_record(201)
            .expect("owner")
            .map(|t| t.state.txn()),
        Some(txn(4))
    );

    // A crash after the append but before the file was removed: the next compaction removes
    // it without appending it twice.
    write_all(&j, &refused_at_submit(txn(1), 200));
    let again = j
        .compact(day, later + Duration::from_secs(86_400))
        .expect("compact");
    assert_eq!(again.archived, 1);
    assert_eq!(j.archived().expect("archived").len(), 2);
    let lines: usize = fs::read_dir(j.archive_dir())
        .expect("dir")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
        .map(|e| fs::read_to_string(e.path()).expect("read").lines().count())
        .sum();
    assert_eq!(lines, 2, "each transaction archived once");
}

/// Settled transactions counted, and phase durations counted, as the metrics see them.
fn counted(j: &Journal) -> (u64, u64, f64) {
    let view = j.timings_with_archive().expect("view");
    let live_settled = view.live.iter().filter(|t| t.outcome.is_some()).count() as u64;
    let live_phases: u64 = view.live.iter().map(|t| t.phases.len() as u64).sum();
    let live_sum: f64 = view
        .live
        .iter()
        .flat_map(|t| t.phases.iter().map(|p| p.seconds))
        .sum();
    let archived_phases: u64 = view
        .archived
        .phases
        .values()
        .flat_map(|m| m.values().map(|b| b.count))
        .sum();
    let archived_sum: f64 = view
        .archived
        .phases
        .values()
        .flat_map(|m| m.values().map(|b| b.sum))
        .sum();
    (
        live_settled + view.archived.transactions,
        live_phases + archived_phases,
        ((live_sum + archived_sum) * 1e6).round() / 1e6,
    )
}

#[test]
fn the_default_listing_shows_what_may_own_a_guest_and_the_last_settled_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    for n in 1..=60 {
        write_all(&j, &refused_at_submit(txn(n), 300 + n as u32));
    }
    // Open (it may still own its guest), older than every settled one but one.
    write_all(&j, &states(txn(0), 299));
    let listing = j.list_recent(50).expect("listing");
    let ids: Vec<Ulid> = listing.rows.iter().map(|r| r.txn).collect();
    let mut want = vec![txn(0)];
    want.extend((11..=60).map(txn));
    assert_eq!(
        ids, want,
        "the open one and the 50 settled ones written last"
    );
    assert_eq!(listing.not_shown, 10);
    assert_eq!(
        j.list().expect("all").len(),
        61,
        "the whole folder for --all"
    );

    // Everything settled moves to the archive: the listing takes the newest from there.
    let later = OffsetDateTime::now_utc() + Duration::from_secs(5);
    assert_eq!(
        j.compact(Duration::ZERO, later).expect("compact").archived,
        60
    );
    assert_eq!(j.replay().expect("replay").len(), 1);
    let listing = j.list_recent(50).expect("listing");
    let ids: Vec<Ulid> = listing.rows.iter().map(|r| r.txn).collect();
    assert_eq!(ids, want, "the same rows, read from the archive's end");
    assert_eq!(listing.not_shown, 10);

    // A few settled in the folder again: they come first, the archive fills up the rest.
    for n in 61..=65 {
        write_all(&j, &refused_at_submit(txn(n), 300 + n as u32));
    }
    let listing = j.list_recent(50).expect("listing");
    let ids: Vec<Ulid> = listing.rows.iter().map(|r| r.txn).collect();
    let mut want = vec![txn(0)];
    want.extend((16..=65).map(txn));
    assert_eq!(ids, want);
    assert_eq!(listing.not_shown, 15);
}

#[test]
fn archive_totals_count_each_transaction_once_across_a_kill_between_append_and_totals() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    for n in 1..=5 {
        write_all(&j, &refused_at_submit(txn(n), 400 + n as u32));
    }
    write_all(&j, &states(txn(9), 499));
    let before = counted(&j);
    assert_eq!(before.0, 5, "five settled");
    assert!(
        before.1 >= 5,
        "each settled one has a phase duration: {before:?}"
    );

    let files: Vec<(PathBuf, Vec<u8>)> = (1..=5)
        .map(|n| {
            let p = j.path_of(txn(n));
            let b = fs::read(&p).expect("read");
            (p, b)
        })
        .collect();
    let totals = j.archive_dir().join(TOTALS_FILE);
    let later = OffsetDateTime::now_utc() + Duration::from_secs(5);
    assert_eq!(
        j.compact(Duration::ZERO, later).expect("compact").archived,
        5
    );
    assert_eq!(j.replay().expect("replay").len(), 1);
    assert!(totals.exists());
    assert_eq!(
        counted(&j),
        before,
        "moving to the archive changes no count"
    );

    // A kill after the archive append, before the totals were written and the files
    // removed: the archive holds the five, the totals do not, the folder still does.
    fs::remove_file(&totals).expect("rm totals");
    for (p, b) in &files {
        fs::write(p, b).expect("restore");
    }
    assert_eq!(counted(&j), before, "counted once, not twice");
    // The next compaction removes the files without appending them again.
    assert_eq!(
        j.compact(Duration::ZERO, later).expect("compact").archived,
        5
    );
    assert_eq!(counted(&j), before);
    let lines = fs::read_dir(j.archive_dir())
        .expect("dir")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
        .map(|e| fs::read_to_string(e.path()).expect("read").lines().count())
        .sum::<usize>();
    assert_eq!(lines, 5);

    // Stale totals (an append they do not count yet) are caught up, not trusted.
    let stale = fs::read_to_string(&totals).expect("totals");
    for n in 6..=7 {
        write_all(&j, &refused_at_submit(txn(n), 400 + n as u32));
    }
    let more = counted(&j);
    assert_eq!(more.0, 7);
    j.compact(Duration::ZERO, later + Duration::from_secs(5))
        .expect("compact");
    fs::write(&totals, &stale).expect("stale totals back");
    assert_eq!(counted(&j), more);
    // Totals that count more than the archive holds are rebuilt from it.
    let log = fs::read_dir(j.archive_dir())
        .expect("dir")
        .filter_map(|e| e.ok())
        .find(|e| e.path().extension().is_some_and(|x| x == "log"))
        .expect("an archive file")
        .path();
    let text = fs::read_to_string(&log).expect("archive");
    let first_two: String = text.split_inclusive('\n').take(2).collect();
    let copy = fs::read_to_string(&totals).expect("totals");
    fs::write(&log, &first_two).expect("shorter archive");
    let shrunk = counted(&j);
    assert_eq!(shrunk.0, 2, "counted from the two records left");
    fs::write(&log, &text).expect("archive back");
    fs::write(&totals, copy).expect("totals back");
    assert_eq!(counted(&j), more);
}

#[test]
fn archive_records_written_without_phase_durations_still_count() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    for n in 1..=3 {
        write_all(&j, &refused_at_submit(txn(n), 500 + n as u32));
    }
    let later = OffsetDateTime::now_utc() + Duration::from_secs(5);
    j.compact(Duration::ZERO, later).expect("compact");
    let log = fs::read_dir(j.archive_dir())
        .expect("dir")
        .filter_map(|e| e.ok())
        .find(|e| e.path().extension().is_some_and(|x| x == "log"))
        .expect("an archive file")
        .path();
    // The same records as an agent that did not keep phase durations wrote them.
    let text = fs::read_to_string(&log).expect("archive");
    assert_eq!(text.matches("\"phases\"").count(), 3, "durations are kept");
    let mut old = String::new();
    for line in text.lines() {
        let (payload, _) = durable_log::decode_line(line.as_bytes()).expect("line");
        let mut v: serde_json::Value = serde_json::from_str(payload).expect("json");
        v.as_object_mut().expect("object").remove("phases");
        old.push_str(
            &durable_log::Limits {
                max_record_bytes: 1 << 20,
                max_file_bytes: 1 << 30,
            }
            .encode(&v.to_string())
            .expect("encode"),
        );
    }
    fs::write(&log, old).expect("old archive");
    fs::remove_file(j.archive_dir().join(TOTALS_FILE)).expect("rm totals");
    let view = j.timings_with_archive().expect("view");
    assert_eq!(view.archived.transactions, 3);
    assert!(view.archived.phases.values().all(|m| m.is_empty()));
    assert_eq!(j.archived().expect("archived").len(), 3);
    assert_eq!(j.all_timings().expect("all").len(), 3);
}

/// Totals an earlier version wrote count the restore test under `selftest-restore`: read
/// back, they count under `restore-test`, joined with what is already there, so the metrics'
/// counters never go down after an upgrade; a name that is no kind is left alone.
#[test]
fn archive_totals_of_the_restore_tests_older_name_count_under_its_name() {
    let mut t = ArchiveTotals::default();
    let mut add = |kind: &str, outcome: &str, n: u64| {
        *t.outcomes
            .entry(kind.to_string())
            .or_default()
            .entry(outcome.to_string())
            .or_default() += n;
    };
    add("selftest-restore", "ok", 3);
    add("selftest-restore", "failed", 1);
    add("restore-test", "ok", 2);
    add("made-up", "ok", 7);
    let mut old = PhaseBuckets::default();
    old.observe(0.2);
    let mut new = PhaseBuckets::default();
    new.observe(20.0);
    t.phases
        .entry("selftest-restore".to_string())
        .or_default()
        .insert(Phase::Created, old);
    t.phases
        .entry("restore-test".to_string())
        .or_default()
        .insert(Phase::Created, new);

    let t = t.kinds_renamed();
    assert_eq!(t.outcomes.get("selftest-restore"), None);
    let rt = &t.outcomes["restore-test"];
    assert_eq!((rt["ok"], rt["failed"]), (5, 1));
    assert_eq!(t.outcomes["made-up"]["ok"], 7);
    assert_eq!(t.phases.get("selftest-restore"), None);
    let created = &t.phases["restore-test"][&Phase::Created];
    assert_eq!(created.count, 2);
    // 0.2 s is within the 0.5 s bucket, 20 s is not.
    assert_eq!(created.le[1], 1);
    assert_eq!(created.le[PHASE_BUCKETS.len() - 1], 2);
}

/// A journal an earlier version wrote names the restore test `selftest-restore`: its records
/// still replay, as the restore test, and the state written again names it `restore-test`.
#[test]
fn a_restore_test_journaled_under_its_older_name_replays() {
    let dir = tempfile::tempdir().expect("tempdir");
    let j = Journal::open(dir.path()).expect("open");
    let t = txn(7);
    let s0 = State::new(Request {
        kind: TxnKind::SelftestRestore,
        ..request(t, 990_000)
    });
    write_all(&j, &[s0.clone(), next(&s0, Event::VmidAccepted)]);
    let path = j.path_of(t);
    let text = fs::read_to_string(&path).expect("read");
    assert!(text.contains("\"restore-test\""), "{text}");
    // The same records as the earlier version wrote them: the old name, checksums of their own.
    let mut old = String::new();
    for line in text.lines() {
        let (payload, _) = crate::durable_log::decode_line(line.as_bytes()).expect("a record");
        let payload = payload.replace("\"restore-test\"", "\"selftest-restore\"");
        old.push_str(&j.log_limits().encode(&payload).expect("encode"));
    }
    assert!(!old.contains("\"restore-test\""), "{old}");
    fs::write(&path, &old).expect("write");

    let replayed = j.replay().expect("replay");
    assert_eq!(replayed.len(), 1);
    assert_eq!(replayed[0].records, 2, "no record dropped");
    assert_eq!(replayed[0].state.kind(), TxnKind::SelftestRestore);
    let again = serde_json::to_value(&replayed[0].state).expect("json");
    assert!(again.to_string().contains("\"restore-test\""), "{again}");
}
