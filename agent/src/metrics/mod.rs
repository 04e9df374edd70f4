//! What an operator watches: the metrics files for node_exporter's textfile collector and the
//! figures of `journal --stats`.
//!
//! Three files in `[metrics] dir`, each written whole and safely ([`textfile`]):
//!
//! - [`TRANSACTIONS_FILE`]: from the journal only, rewritten after every transaction (command
//!   line or hub dispatch) and by the daemon every [`DAEMON_INTERVAL`]:
//!   `felhom_phase_duration_seconds` (histogram by `kind` and `phase`),
//!   `felhom_transactions_total` (by `kind` and `outcome`), `felhom_needs_human`;
//! - [`HUB_FILE`]: the daemon's, within a second of a change, at least every
//!   [`DAEMON_INTERVAL`] and when it stops:
//!   `felhom_hub_configured`, `felhom_hub_connected`, `felhom_outbox_depth`,
//!   `felhom_outbox_dropped_total`;
//! - [`RESTORE_TEST_FILE`]: after every restore-test run: the `felhom_restore_test_*` gauges
//!   and counters, the run's checks by status ([`restore_test_checks_text`]);
//! - [`COVERAGE_FILE`]: whenever the pool guests' restore-test coverage is worked out
//!   ([`coverage_text`]): `felhom_backup_*` by `vmid` (and `status`), `felhom_guest_info`
//!   (`vmid`, `name`), the totals. Its own file, so a run that ends before it could work the
//!   coverage out (`error`) leaves the last coverage in place rather than erasing it.
//!
//! It may use `provision` (the journal's types), `vmid`, `config` and `error`.

pub mod publish;
pub mod stats;
pub mod textfile;

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use crate::provision::journal::{ArchiveTotals, PhaseBuckets, TxnTimings};
use crate::provision::machine::{OutcomeKind, Phase, TxnKind};
use crate::provision::Journal;

/// The journal-derived metrics.
pub const TRANSACTIONS_FILE: &str = "felhom_transactions.prom";
/// The daemon's hub metrics.
pub const HUB_FILE: &str = "felhom_hub.prom";
/// The restore test's metrics.
pub const RESTORE_TEST_FILE: &str = "felhom_restore_test.prom";
/// Each pool guest's restore-test coverage ([`coverage_text`]).
pub const COVERAGE_FILE: &str = "felhom_backup_coverage.prom";
/// How often the daemon rewrites its files at least.
pub const DAEMON_INTERVAL: Duration = Duration::from_secs(15);

/// Upper bounds of the phase-duration histogram buckets, seconds.
pub const BUCKETS: [f64; 13] = crate::provision::journal::PHASE_BUCKETS;

/// Every kind of transaction, for series that exist before the first transaction; the only
/// values of the `kind` label.
pub const KINDS: [TxnKind; 4] = [
    TxnKind::Provision,
    TxnKind::Destroy,
    TxnKind::SelftestProvision,
    TxnKind::SelftestRestore,
];

/// Every outcome: the only values of `felhom_transactions_total`'s `outcome` label.
pub const OUTCOMES: [OutcomeKind; 5] = [
    OutcomeKind::Ok,
    OutcomeKind::Refused,
    OutcomeKind::Failed,
    OutcomeKind::Skipped,
    OutcomeKind::NeedsHuman,
];

fn header(s: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(s, "# HELP {name} {help}");
    let _ = writeln!(s, "# TYPE {name} {kind}");
}

/// A float as Prometheus text: integers without a fraction, `+Inf` for infinity.
fn num(v: f64) -> String {
    if v.is_infinite() {
        "+Inf".to_string()
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

/// The journal-derived exposition: phase-duration histograms, transactions by outcome, and
/// the transactions that need a person. `timings` are the journal folder's transactions,
/// `archived` the totals of those moved to the archive (so the counters never go down when
/// old transactions are archived).
pub fn transactions_text(timings: &[TxnTimings], archived: &ArchiveTotals) -> String {
    use std::collections::BTreeMap;
    let mut hist: BTreeMap<(String, Phase), PhaseBuckets> = BTreeMap::new();
    let mut totals: BTreeMap<(String, String), u64> = BTreeMap::new();
    for k in KINDS {
        for o in OUTCOMES {
            totals.insert((k.as_str().to_string(), o.as_str().to_string()), 0);
        }
    }
    // The archive's totals are keyed by the names it was given; a name this agent does not
    // write (another version's, a damaged file's) is left out, so every label value is one of
    // the few known ones and the series stay bounded.
    let known_kind = |k: &str| KINDS.iter().any(|x| x.as_str() == k);
    let known_outcome = |o: &str| OUTCOMES.iter().any(|x| x.as_str() == o);
    for (kind, outcomes) in &archived.outcomes {
        for (outcome, n) in outcomes {
            if !known_kind(kind) || !known_outcome(outcome) {
                continue;
            }
            *totals.entry((kind.clone(), outcome.clone())).or_default() += n;
        }
    }
    for (kind, phases) in &archived.phases {
        if !known_kind(kind) {
            continue;
        }
        for (phase, b) in phases {
            let h = hist.entry((kind.clone(), *phase)).or_default();
            h.le.resize(BUCKETS.len(), 0);
            for (n, add) in h.le.iter_mut().zip(&b.le) {
                *n += add;
            }
            h.count += b.count;
            h.sum += b.sum;
        }
    }
    let mut needs_human = 0u64;
    for t in timings {
        for p in &t.phases {
            hist.entry((t.kind.as_str().to_string(), p.phase))
                .or_default()
                .observe(p.seconds);
        }
        if let Some(o) = t.outcome {
            *totals
                .entry((t.kind.as_str().to_string(), o.as_str().to_string()))
                .or_default() += 1;
        }
        if t.needs_human {
            needs_human += 1;
        }
    }
    let mut s = String::new();
    header(
        &mut s,
        "felhom_phase_duration_seconds",
        "histogram",
        "How long each phase of a transaction lasted, from the journal and its archive.",
    );
    for ((kind, phase), h) in &hist {
        let labels = format!("kind=\"{kind}\",phase=\"{}\"", phase.as_str());
        for (le, n) in BUCKETS.iter().zip(h.le.iter().chain(std::iter::repeat(&0))) {
            let _ = writeln!(
                s,
                "felhom_phase_duration_seconds_bucket{{{labels},le=\"{}\"}} {n}",
                num(*le)
            );
        }
        let _ = writeln!(
            s,
            "felhom_phase_duration_seconds_bucket{{{labels},le=\"+Inf\"}} {}",
            h.count
        );
        let _ = writeln!(
            s,
            "felhom_phase_duration_seconds_sum{{{labels}}} {}",
            num((h.sum * 1000.0).round() / 1000.0)
        );
        let _ = writeln!(
            s,
            "felhom_phase_duration_seconds_count{{{labels}}} {}",
            h.count
        );
    }
    header(
        &mut s,
        "felhom_transactions_total",
        "counter",
        "Settled transactions in the journal and its archive, by kind and outcome.",
    );
    for ((kind, outcome), n) in &totals {
        let _ = writeln!(
            s,
            "felhom_transactions_total{{kind=\"{kind}\",outcome=\"{outcome}\"}} {n}"
        );
    }
    header(
        &mut s,
        "felhom_needs_human",
        "gauge",
        "Transactions in the journal that need a person (outcome needs_human).",
    );
    let _ = writeln!(s, "felhom_needs_human {needs_human}");
    s
}

/// The daemon's exposition. `configured`: whether `[hub]` is set; a node without a hub
/// reports 0 there, and the hub alert looks at nodes that have one only.
pub fn hub_text(configured: bool, connected: bool, outbox_depth: u64) -> String {
    let mut s = String::new();
    header(
        &mut s,
        "felhom_hub_configured",
        "gauge",
        "1 when the node reports to a hub ([hub] in the config), 0 for a node without one.",
    );
    let _ = writeln!(s, "felhom_hub_configured {}", u8::from(configured));
    header(
        &mut s,
        "felhom_hub_connected",
        "gauge",
        "1 while the hub was heard from within two heartbeats, else 0.",
    );
    let _ = writeln!(s, "felhom_hub_connected {}", u8::from(connected));
    header(
        &mut s,
        "felhom_outbox_depth",
        "gauge",
        "Messages waiting in the outbox for the hub.",
    );
    let _ = writeln!(s, "felhom_outbox_depth {outbox_depth}");
    s
}

/// `felhom_outbox_dropped_total`: reports the outbox dropped unsent while no hub was
/// configured (the count kept across restarts in `<state_dir>/outbox/dropped`); written after
/// [`hub_text`] in [`HUB_FILE`].
pub fn outbox_dropped_text(dropped: u64) -> String {
    let mut s = String::new();
    header(
        &mut s,
        "felhom_outbox_dropped_total",
        "counter",
        "Reports dropped from the outbox unsent while no hub was configured (the oldest first, past the count or age it keeps).",
    );
    let _ = writeln!(s, "felhom_outbox_dropped_total {dropped}");
    s
}

/// The values of `felhom_restore_test_outcome`'s `outcome` label: the settled outcomes, and
/// `interrupted` for a run stopped (Ctrl-C, SIGTERM) before it settled, whose transaction the
/// journal resumes (the resume writes the outcome it reaches), and `error` for a run that
/// could not start its transaction (the environment: PVE not answering, a wrong token or pin,
/// the exec helper, a full state folder). `failed`, `needs_human` and `refused` raise
/// `FelhomRestoreTestFailed`, `error` raises `FelhomRestoreTestError`.
pub const RESTORE_TEST_OUTCOMES: [&str; 7] = [
    "ok",
    "failed",
    "skipped",
    "needs_human",
    "refused",
    "interrupted",
    "error",
];

/// What the restore-test metrics say about the last run.
#[derive(Debug, Clone, PartialEq)]
pub struct RestoreTestFigures<'a> {
    /// One of [`RESTORE_TEST_OUTCOMES`].
    pub outcome: &'a str,
    /// How long the run took, seconds.
    pub duration_s: f64,
    /// When it ended (Unix time).
    pub now: u64,
    /// When a run last succeeded (Unix time).
    pub last_success: Option<u64>,
    /// Runs skipped because the band was full.
    pub skipped_total: u64,
    /// Runs.
    pub runs_total: u64,
}

/// The restore test's exposition.
pub fn restore_test_text(f: &RestoreTestFigures<'_>) -> String {
    let mut s = String::new();
    header(
        &mut s,
        "felhom_restore_test_last_run_timestamp_seconds",
        "gauge",
        "When the last self-restore-test run ended.",
    );
    let _ = writeln!(
        s,
        "felhom_restore_test_last_run_timestamp_seconds {}",
        f.now
    );
    header(
        &mut s,
        "felhom_restore_test_last_success_timestamp_seconds",
        "gauge",
        "When a self-restore-test last succeeded (0: never).",
    );
    let _ = writeln!(
        s,
        "felhom_restore_test_last_success_timestamp_seconds {}",
        f.last_success.unwrap_or(0)
    );
    header(
        &mut s,
        "felhom_restore_test_duration_seconds",
        "gauge",
        "How long the last run took.",
    );
    let _ = writeln!(
        s,
        "felhom_restore_test_duration_seconds {:.3}",
        f.duration_s
    );
    header(
        &mut s,
        "felhom_restore_test_outcome",
        "gauge",
        "The outcome of the last run (1 for the outcome it had).",
    );
    for o in RESTORE_TEST_OUTCOMES {
        let _ = writeln!(
            s,
            "felhom_restore_test_outcome{{outcome=\"{o}\"}} {}",
            u8::from(o == f.outcome)
        );
    }
    header(
        &mut s,
        "felhom_restore_test_skipped_total",
        "counter",
        "Runs skipped because the restore-test band was full.",
    );
    let _ = writeln!(s, "felhom_restore_test_skipped_total {}", f.skipped_total);
    header(
        &mut s,
        "felhom_restore_test_runs_total",
        "counter",
        "Self-restore-test runs.",
    );
    let _ = writeln!(s, "felhom_restore_test_runs_total {}", f.runs_total);
    s
}

/// The values of `felhom_restore_test_checks`' `status` label: every check status. `skipped`
/// (the check could not judge the guest) is its own, never counted as `pass`.
pub const CHECK_STATUSES: [hub_protocol::CheckStatus; 4] = [
    hub_protocol::CheckStatus::Pass,
    hub_protocol::CheckStatus::Fail,
    hub_protocol::CheckStatus::Error,
    hub_protocol::CheckStatus::Skipped,
];

/// `felhom_restore_test_checks{status}`: how many checks of the run's copies (or of the copy a
/// resume settled) ended with each status, every status written (0 when none). Goes after
/// [`restore_test_text`] in [`RESTORE_TEST_FILE`].
pub fn restore_test_checks_text(statuses: &[hub_protocol::CheckStatus]) -> String {
    let mut s = String::new();
    header(
        &mut s,
        "felhom_restore_test_checks",
        "gauge",
        "The last run's checks by status (skipped: the check could not judge the guest; never \
         counted as pass).",
    );
    for st in CHECK_STATUSES {
        let n = statuses.iter().filter(|x| **x == st).count();
        let _ = writeln!(s, "felhom_restore_test_checks{{status=\"{st}\"}} {n}");
    }
    s
}

/// The values of the coverage `status` label, one per pool guest: `overdue` and `failed` raise
/// `FelhomBackupUnproven`, `no_backup` and `unprovable` raise `FelhomBackupMissing`, `due`
/// raises nothing (its restore test is coming).
pub const COVERAGE_STATUSES: [&str; 6] = [
    "proven",
    "due",
    "overdue",
    "failed",
    "no_backup",
    "unprovable",
];

/// One guest's coverage, as the metrics show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoverageRow<'a> {
    /// The guest.
    pub vmid: u32,
    /// The guest's name (hostname or VM name), as PVE has it: any text ([`guest_name_label`]).
    pub name: &'a str,
    /// One of [`COVERAGE_STATUSES`].
    pub status: &'a str,
    /// Its newest backup is older than `backup_max_age`.
    pub stale: bool,
    /// Unix time of the newest proven restore point's backup (`None`: none proven).
    pub proven_backup_time: Option<u64>,
    /// Unix time of the newest backup (`None`: no backup).
    pub newest_backup_time: Option<u64>,
}

/// A guest's name as the value of `felhom_guest_info`'s `name` label, escaped for the text
/// format (`\` `"` and a line break as `\\` `\"` `\n`): any other control character becomes
/// U+FFFD (no carriage return or terminal escape reaches an alert's text), and the name is
/// clipped to [`publish::MAX_LABEL_VALUE`] bytes at a character boundary, the longest label
/// value the publisher takes. `None` for an empty name: the publisher refuses an empty value
/// (and Prometheus reads one as no label).
pub fn guest_name_label(name: &str) -> Option<String> {
    let mut clipped = String::new();
    for c in name.chars() {
        let c = if c.is_control() && c != '\n' {
            '\u{fffd}'
        } else {
            c
        };
        if clipped.len() + c.len_utf8() > publish::MAX_LABEL_VALUE {
            break;
        }
        clipped.push(c);
    }
    if clipped.is_empty() {
        return None;
    }
    let mut out = String::with_capacity(clipped.len() + 8);
    for c in clipped.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    Some(out)
}

/// The coverage exposition ([`COVERAGE_FILE`]): each pool guest's coverage status, by vmid,
/// and the totals. `now` is the Unix time the ages count to. The rows are written by vmid; a
/// vmid given twice counts once (its first row), as a series may appear once. Every series
/// but `felhom_guest_info` carries the vmid only, so a guest's name never splits its history.
pub fn coverage_text(rows: &[CoverageRow<'_>], now: u64) -> String {
    use std::collections::BTreeMap;
    let mut guests: BTreeMap<u32, &CoverageRow<'_>> = BTreeMap::new();
    for r in rows {
        debug_assert!(COVERAGE_STATUSES.contains(&r.status), "{}", r.status);
        guests.entry(r.vmid).or_insert(r);
    }
    let mut s = String::new();
    header(
        &mut s,
        "felhom_backup_status",
        "gauge",
        "Each pool guest's restore-test coverage: 1 for its status (proven, due, overdue, \
         failed, no_backup, unprovable), 0 for the other five; `felhom-agent restore-report` \
         on the node explains it.",
    );
    for (vmid, r) in &guests {
        for st in COVERAGE_STATUSES {
            let _ = writeln!(
                s,
                "felhom_backup_status{{vmid=\"{vmid}\",status=\"{st}\"}} {}",
                u8::from(st == r.status)
            );
        }
    }
    header(
        &mut s,
        "felhom_backup_proven",
        "gauge",
        "1 when a restore test proved one of the guest's backups (it has a proven restore \
         point), else 0.",
    );
    for (vmid, r) in &guests {
        let _ = writeln!(
            s,
            "felhom_backup_proven{{vmid=\"{vmid}\"}} {}",
            u8::from(r.proven_backup_time.is_some())
        );
    }
    header(
        &mut s,
        "felhom_backup_proven_age_seconds",
        "gauge",
        "Age of the backup of the guest's newest proven restore point when the file was \
         written; no sample for a guest with none proven (felhom_backup_proven 0).",
    );
    for (vmid, r) in &guests {
        if let Some(t) = r.proven_backup_time {
            let _ = writeln!(
                s,
                "felhom_backup_proven_age_seconds{{vmid=\"{vmid}\"}} {}",
                now.saturating_sub(t)
            );
        }
    }
    header(
        &mut s,
        "felhom_backup_stale",
        "gauge",
        "1 when the guest's newest backup is older than backup_max_age, else 0.",
    );
    for (vmid, r) in &guests {
        let _ = writeln!(
            s,
            "felhom_backup_stale{{vmid=\"{vmid}\"}} {}",
            u8::from(r.stale)
        );
    }
    header(
        &mut s,
        "felhom_backup_newest_age_seconds",
        "gauge",
        "Age of the guest's newest backup when the file was written; no sample for a guest \
         without a backup.",
    );
    for (vmid, r) in &guests {
        if let Some(t) = r.newest_backup_time {
            let _ = writeln!(
                s,
                "felhom_backup_newest_age_seconds{{vmid=\"{vmid}\"}} {}",
                now.saturating_sub(t)
            );
        }
    }
    header(
        &mut s,
        "felhom_guest_info",
        "gauge",
        "1 for each pool guest, with its name (at most 64 bytes; no sample for a guest \
         without one), for joining on vmid.",
    );
    for (vmid, r) in &guests {
        if let Some(name) = guest_name_label(r.name) {
            let _ = writeln!(s, "felhom_guest_info{{vmid=\"{vmid}\",name=\"{name}\"}} 1");
        }
    }
    header(
        &mut s,
        "felhom_backup_guests",
        "gauge",
        "Pool guests by restore-test coverage status.",
    );
    for st in COVERAGE_STATUSES {
        let n = guests.values().filter(|r| r.status == st).count();
        let _ = writeln!(s, "felhom_backup_guests{{status=\"{st}\"}} {n}");
    }
    header(
        &mut s,
        "felhom_backup_guests_stale",
        "gauge",
        "Pool guests whose newest backup is older than backup_max_age.",
    );
    let stale = guests.values().filter(|r| r.stale).count();
    let _ = writeln!(s, "felhom_backup_guests_stale {stale}");
    s
}

/// Rewrite [`TRANSACTIONS_FILE`] from the journal. The error's message names the folder or
/// journal file and what to do; a caller logs it and never fails a transaction for it.
pub fn update_transactions(dir: &Path, journal: &Journal) -> Result<(), String> {
    let view = journal.timings_with_archive().map_err(|e| e.to_string())?;
    textfile::write(
        dir,
        TRANSACTIONS_FILE,
        &transactions_text(&view.live, &view.archived),
    )
    .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provision::journal::PhaseDone;
    use ulid::Ulid;

    fn assert_exposition(text: &str) {
        for line in text.lines() {
            if line.starts_with('#') {
                assert!(
                    line.starts_with("# HELP felhom_") || line.starts_with("# TYPE felhom_"),
                    "{line}"
                );
                continue;
            }
            let (name, value) = line.rsplit_once(' ').unwrap_or(("", ""));
            assert!(name.starts_with("felhom_"), "{line}");
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let t = TxnTimings {
            txn: Ulid::new(),
            kind: TxnKind::Provision,
            started_at: "2026-01-01T00:00:00Z".into(),
            outcome: Some(OutcomeKind::NeedsHuman),
            needs_human: true,
            phases: vec![
                PhaseDone {
                    phase: Phase::Submitted,
                    seconds: 0.3,
                },
                PhaseDone {
                    phase: Phase::Created,
                    seconds: 7.0,
                },
            ],
        };
        let mut t2 = t.clone();
        t2.outcome = Some(OutcomeKind::Ok);
        t2.needs_human = false;
        t2.phases[0].seconds = 40.0;
        let text = transactions_text(&[t, t2], &ArchiveTotals::default());
        assert_exposition(&text);
        let b = "felhom_phase_duration_seconds_bucket{kind=\"provision\",phase=\"submitted\"";
        assert!(text.contains(&format!("{b},le=\"0.1\"}} 0\n")), "{text}");
        assert!(text.contains(&format!("{b},le=\"0.5\"}} 1\n")), "{text}");
        assert!(text.contains(&format!("{b},le=\"60\"}} 2\n")), "{text}");
        assert!(text.contains(&format!("{b},le=\"+Inf\"}} 2\n")), "{text}");
        assert!(text.contains(
            "felhom_phase_duration_seconds_sum{kind=\"provision\",phase=\"submitted\"} 40.3\n"
        ));
        assert!(text
            .contains("felhom_transactions_total{kind=\"provision\",outcome=\"needs_human\"} 1\n"));
        assert!(text.contains("felhom_transactions_total{kind=\"destroy\",outcome=\"ok\"} 0\n"));
        assert!(text.contains("felhom_needs_human 1\n"));
    }

    #[test]
    fn archived_totals_add_to_the_live_counts() {
        let mut archived = ArchiveTotals::default();
        archived.transactions = 3;
        archived
            .outcomes
            .entry("provision".into())
            .or_default()
            .insert("ok".into(), 3);
        let b = archived
            .phases
            .entry("provision".into())
            .or_default()
            .entry(Phase::Submitted)
            .or_default();
        for s in [0.05, 2.0, 4000.0] {
            b.observe(s);
        }
        let live = TxnTimings {
            txn: Ulid::new(),
            kind: TxnKind::Provision,
            started_at: "2026-01-01T00:00:00Z".into(),
            outcome: Some(OutcomeKind::Ok),
            needs_human: false,
            phases: vec![PhaseDone {
                phase: Phase::Submitted,
                seconds: 0.3,
            }],
        };
        // Names this agent does not write (another version's, a damaged totals file's) are
        // left out: every label value stays one of the known few.
        archived
            .outcomes
            .entry("made-up-kind".into())
            .or_default()
            .insert("ok".into(), 7);
        archived
            .outcomes
            .entry("provision".into())
            .or_default()
            .insert("made-up-outcome".into(), 7);
        archived
            .phases
            .entry("made-up-kind".into())
            .or_default()
            .entry(Phase::Created)
            .or_default()
            .observe(1.0);
        let text = transactions_text(&[live], &archived);
        assert_exposition(&text);
        assert!(!text.contains("made-up"), "{text}");
        assert_eq!(publish::validate(TRANSACTIONS_FILE, &text), Ok(()));
        assert!(text.contains("felhom_transactions_total{kind=\"provision\",outcome=\"ok\"} 4\n"));
        let b = "felhom_phase_duration_seconds_bucket{kind=\"provision\",phase=\"submitted\"";
        assert!(text.contains(&format!("{b},le=\"0.1\"}} 1\n")), "{text}");
        assert!(text.contains(&format!("{b},le=\"0.5\"}} 2\n")), "{text}");
        assert!(text.contains(&format!("{b},le=\"2.5\"}} 3\n")), "{text}");
        assert!(text.contains(&format!("{b},le=\"3600\"}} 3\n")), "{text}");
        assert!(text.contains(&format!("{b},le=\"+Inf\"}} 4\n")), "{text}");
        assert!(text.contains(
            "felhom_phase_duration_seconds_count{kind=\"provision\",phase=\"submitted\"} 4\n"
        ));
        assert!(text.contains(
            "felhom_phase_duration_seconds_sum{kind=\"provision\",phase=\"submitted\"} 4002.35\n"
        ));
    }

    fn row<'a>(vmid: u32, name: &'a str, status: &'a str) -> CoverageRow<'a> {
        CoverageRow {
            vmid,
            name,
            status,
            stale: false,
            proven_backup_time: None,
            newest_backup_time: None,
        }
    }

    #[test]
    fn coverage_text_of_a_small_table() {
        let rows = [
            CoverageRow {
                stale: false,
                proven_backup_time: Some(1_700_000_000),
                newest_backup_time: Some(1_700_050_000),
                ..row(200, "web", "proven")
            },
            CoverageRow {
                stale: true,
                newest_backup_time: Some(1_699_000_000),
                ..row(101, "db", "failed")
            },
            // A backup time after `now` (a clock ahead) is age 0, never a wrapped one.
            CoverageRow {
                proven_backup_time: Some(1_700_100_001),
                newest_backup_time: Some(1_700_100_001),
                ..row(300, "", "due")
            },
        ];
        let text = coverage_text(&rows, 1_700_100_000);
        assert_exposition(&text);
        assert_eq!(publish::validate(COVERAGE_FILE, &text), Ok(()));
        let want = "\
# HELP felhom_backup_status Each pool guest's restore-test coverage: 1 for its status (proven, due, overdue, failed, no_backup, unprovable), 0 for the other five; `felhom-agent restore-report` on the node explains it.
# TYPE felhom_backup_status gauge
felhom_backup_status{vmid=\"101\",status=\"proven\"} 0
felhom_backup_status{vmid=\"101\",status=\"due\"} 0
felhom_backup_status{vmid=\"101\",status=\"overdue\"} 0
felhom_backup_status{vmid=\"101\",status=\"failed\"} 1
felhom_backup_status{vmid=\"101\",status=\"no_backup\"} 0
felhom_backup_status{vmid=\"101\",status=\"unprovable\"} 0
felhom_backup_status{vmid=\"200\",status=\"proven\"} 1
felhom_backup_status{vmid=\"200\",status=\"due\"} 0
felhom_backup_status{vmid=\"200\",status=\"overdue\"} 0
felhom_backup_status{vmid=\"200\",status=\"failed\"} 0
felhom_backup_status{vmid=\"200\",status=\"no_backup\"} 0
felhom_backup_status{vmid=\"200\",status=\"unprovable\"} 0
felhom_backup_status{vmid=\"300\",status=\"proven\"} 0
felhom_backup_status{vmid=\"300\",status=\"due\"} 1
felhom_backup_status{vmid=\"300\",status=\"overdue\"} 0
felhom_backup_status{vmid=\"300\",status=\"failed\"} 0
felhom_backup_status{vmid=\"300\",status=\"no_backup\"} 0
felhom_backup_status{vmid=\"300\",status=\"unprovable\"} 0
# HELP felhom_backup_proven 1 when a restore test proved one of the guest's backups (it has a proven restore point), else 0.
# TYPE felhom_backup_proven gauge
felhom_backup_proven{vmid=\"101\"} 0
felhom_backup_proven{vmid=\"200\"} 1
felhom_backup_proven{vmid=\"300\"} 1
# HELP felhom_backup_proven_age_seconds Age of the backup of the guest's newest proven restore point when the file was written; no sample for a guest with none proven (felhom_backup_proven 0).
# TYPE felhom_backup_proven_age_seconds gauge
felhom_backup_proven_age_seconds{vmid=\"200\"} 100000
felhom_backup_proven_age_seconds{vmid=\"300\"} 0
# HELP felhom_backup_stale 1 when the guest's newest backup is older than backup_max_age, else 0.
# TYPE felhom_backup_stale gauge
felhom_backup_stale{vmid=\"101\"} 1
felhom_backup_stale{vmid=\"200\"} 0
felhom_backup_stale{vmid=\"300\"} 0
# HELP felhom_backup_newest_age_seconds Age of the guest's newest backup when the file was written; no sample for a guest without a backup.
# TYPE felhom_backup_newest_age_seconds gauge
felhom_backup_newest_age_seconds{vmid=\"101\"} 1100000
felhom_backup_newest_age_seconds{vmid=\"200\"} 50000
felhom_backup_newest_age_seconds{vmid=\"300\"} 0
# HELP felhom_guest_info 1 for each pool guest, with its name (at most 64 bytes; no sample for a guest without one), for joining on vmid.
# TYPE felhom_guest_info gauge
felhom_guest_info{vmid=\"101\",name=\"db\"} 1
felhom_guest_info{vmid=\"200\",name=\"web\"} 1
# HELP felhom_backup_guests Pool guests by restore-test coverage status.
# TYPE felhom_backup_guests gauge
felhom_backup_guests{status=\"proven\"} 1
felhom_backup_guests{status=\"due\"} 1
felhom_backup_guests{status=\"overdue\"} 0
felhom_backup_guests{status=\"failed\"} 1
felhom_backup_guests{status=\"no_backup\"} 0
felhom_backup_guests{status=\"unprovable\"} 0
# HELP felhom_backup_guests_stale Pool guests whose newest backup is older than backup_max_age.
# TYPE felhom_backup_guests_stale gauge
felhom_backup_guests_stale 1
";
        assert_eq!(text, want);
    }

    #[test]
    fn coverage_of_no_guests_still_has_every_total() {
        let text = coverage_text(&[], 5);
        assert_eq!(publish::validate(COVERAGE_FILE, &text), Ok(()));
        for st in COVERAGE_STATUSES {
            assert!(
                text.contains(&format!("felhom_backup_guests{{status=\"{st}\"}} 0\n")),
                "{text}"
            );
        }
        assert!(text.contains("felhom_backup_guests_stale 0\n"), "{text}");
        assert!(!text.contains("vmid="), "{text}");
    }

    #[test]
    fn coverage_totals_count_each_guest_once() {
        let mut rows = Vec::new();
        for (i, st) in [
            "proven", "proven", "due", "overdue", "failed", "failed", "failed",
        ]
        .into_iter()
        .enumerate()
        {
            rows.push(CoverageRow {
                stale: i % 2 == 0,
                ..row(100 + i as u32, "g", st)
            });
        }
        // The same vmid again: its first row counts, once.
        rows.push(CoverageRow {
            stale: true,
            ..row(100, "again", "no_backup")
        });
        let text = coverage_text(&rows, 10);
        assert_eq!(publish::validate(COVERAGE_FILE, &text), Ok(()));
        for (st, n) in [
            ("proven", 2),
            ("due", 1),
            ("overdue", 1),
            ("failed", 3),
            ("no_backup", 0),
            ("unprovable", 0),
        ] {
            assert!(
                text.contains(&format!("felhom_backup_guests{{status=\"{st}\"}} {n}\n")),
                "{st}: {text}"
            );
        }
        assert!(text.contains("felhom_backup_guests_stale 4\n"), "{text}");
        assert!(text.contains("felhom_backup_status{vmid=\"100\",status=\"proven\"} 1\n"));
        assert!(text.contains("felhom_backup_status{vmid=\"100\",status=\"no_backup\"} 0\n"));
        assert!(!text.contains("again"), "{text}");
        // Each guest: its six statuses, one of them 1.
        assert_eq!(text.matches("felhom_backup_status{").count(), 7 * 6);
        assert_eq!(text.matches("felhom_backup_status{vmid=\"106\"").count(), 6);
        assert_eq!(
            text.lines()
                .filter(|l| l.starts_with("felhom_backup_status{") && l.ends_with(" 1"))
                .count(),
            7
        );
        // No backup, nothing proven: the 0/1 gauges are there, the ages are not.
        assert!(text.contains("felhom_backup_proven{vmid=\"103\"} 0\n"));
        assert!(
            !text.contains("felhom_backup_proven_age_seconds{"),
            "{text}"
        );
        assert!(
            !text.contains("felhom_backup_newest_age_seconds{"),
            "{text}"
        );
    }

    #[test]
    fn a_hostile_guest_name_is_escaped_and_clipped() {
        assert_eq!(guest_name_label("web-1").as_deref(), Some("web-1"));
        assert_eq!(
            guest_name_label("a\"b\\c\nd").as_deref(),
            Some("a\\\"b\\\\c\\nd")
        );
        // A closing quote and brace cannot end the label set early.
        assert_eq!(
            guest_name_label("x\"} 0\nfelhom_backup_guests_stale 9").as_deref(),
            Some("x\\\"} 0\\nfelhom_backup_guests_stale 9")
        );
        // Other control characters (carriage return, escape, tab) become U+FFFD.
        assert_eq!(
            guest_name_label("a\rb\u{1b}[31mc\td").as_deref(),
            Some("a\u{fffd}b\u{fffd}[31mc\u{fffd}d")
        );
        assert_eq!(guest_name_label(""), None);
        // Clipped to 64 bytes before escaping, at a character boundary.
        let long = "x".repeat(300);
        assert_eq!(guest_name_label(&long), Some("x".repeat(64)));
        assert_eq!(guest_name_label(&"é".repeat(40)), Some("é".repeat(32)));
        assert_eq!(
            guest_name_label(&format!("{}€", "y".repeat(62))),
            Some("y".repeat(62))
        );
        let quotes = "\"".repeat(100);
        assert_eq!(guest_name_label(&quotes), Some("\\\"".repeat(64)));

        let hostile = format!("evil\"}} 1\n# TYPE x\\{}", "z".repeat(200));
        let text = coverage_text(&[row(4242, &hostile, "overdue")], 0);
        assert_exposition(&text);
        assert_eq!(publish::validate(COVERAGE_FILE, &text), Ok(()));
        let info: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("felhom_guest_info{"))
            .collect();
        assert_eq!(
            info,
            [format!(
                "felhom_guest_info{{vmid=\"4242\",name=\"evil\\\"}} 1\\n# TYPE x\\\\{}\"}} 1",
                "z".repeat(64 - 18)
            )]
        );
        assert_eq!(
            text.lines().filter(|l| l.starts_with("# TYPE ")).count(),
            8,
            "{text}"
        );
    }

    #[test]
    fn hub_and_restore_test_texts() {
        assert_exposition(&hub_text(true, true, 3));
        assert_exposition(&(hub_text(false, false, 3) + &outbox_dropped_text(5)));
        assert!(outbox_dropped_text(5).contains("\nfelhom_outbox_dropped_total 5\n"));
        assert!(hub_text(true, false, 3).contains("felhom_hub_connected 0\n"));
        assert!(hub_text(false, false, 3).contains("felhom_hub_configured 0\n"));
        assert!(hub_text(true, false, 3).contains("felhom_hub_configured 1\n"));
        let t = restore_test_text(&RestoreTestFigures {
            outcome: "skipped",
            duration_s: 1.5,
            now: 1_700_000_100,
            last_success: Some(1_700_000_000),
            skipped_total: 2,
            runs_total: 5,
        });
        assert_exposition(&t);
        assert!(t.contains("felhom_restore_test_outcome{outcome=\"skipped\"} 1"));
        assert!(t.contains("felhom_restore_test_outcome{outcome=\"ok\"} 0"));
        assert!(t.contains("felhom_restore_test_skipped_total 2"));
        assert!(t.contains("felhom_restore_test_outcome{outcome=\"interrupted\"} 0"));
        use hub_protocol::CheckStatus::{Pass, Skipped};
        let c = restore_test_checks_text(&[Pass, Skipped, Pass]);
        assert_exposition(&c);
        for line in [
            "felhom_restore_test_checks{status=\"pass\"} 2\n",
            "felhom_restore_test_checks{status=\"skipped\"} 1\n",
            "felhom_restore_test_checks{status=\"fail\"} 0\n",
            "felhom_restore_test_checks{status=\"error\"} 0\n",
        ] {
            assert!(c.contains(line), "{c}");
        }
    }
}
