//! Crash safety of a restore-test run with several copies at once: the agent is SIGKILLed
//! after every journal record of the run (counted over the whole process, so each kill point is
//! one moment of the run, whichever copy wrote the record), with restore tasks that take time
//! so that two copies are under way at once. Then the next run takes up what the killed one
//! left (the settle every writing command does first) and proves what is still due. Every
//! transaction must settle without a person; no copy may be left in the band; no foreign or
//! pool guest is written; and every guest's backup ends proven: nothing is left for a human
//! where a proof can exist.
//!
//! The busybox bed on purpose: the walk restores a pair of copies per kill point.

use std::time::Instant;

use felhom_tests::agent::AgentRun;
use felhom_tests::world::World;
use serde_json::{json, Value};

const FOREIGN: [u32; 3] = [101, 990000, 990001];
const POOL: [u32; 2] = [200, 210];

fn world() -> World {
    let w = World::new(felhom_tests::fakepve::pool_with_backups(&[(210, "shop")]));
    // Restores of 2 real seconds: the two copies' tasks overlap.
    w.pve
        .set(json!({"time_scale": 0.01, "ct_secs": {"create": 200}}));
    w
}

fn run(w: &World, args: &[&str], kill_at: Option<&str>) -> AgentRun {
    let mut cmd = w.command();
    cmd.args(args)
        .env("FELHOM_AGENT_SUBMIT_SPACING_MS", "300")
        .env("FELHOM_AGENT_SUBMIT_SETTLE_MS", "3000");
    if let Some(k) = kill_at {
        cmd.env("FELHOM_AGENT_KILL_AT", k);
    }
    cmd.output().expect("run the agent").into()
}

/// Kill the run at `<when>:k` (`after-journal`: right after its `k`th journal record;
/// `before-journal`: right before it, the effect it records done and not yet journaled);
/// `None` when it ended before that record.
fn kill_and_settle(when: &str, k: u32) -> Option<()> {
    let w = world();
    let point = format!("{when}:{k}");
    let first = run(&w, &["--selftest=restore", "--json"], Some(&point));
    if first.code.is_some() {
        assert_eq!(
            first.code,
            Some(0),
            "{point}: {}\n{}",
            first.stdout,
            first.stderr
        );
        return None;
    }
    // The next run settles what the killed one left, then proves what is still due.
    let second = run(&w, &["--selftest=restore", "--json"], None);
    assert_eq!(
        second.code,
        Some(0),
        "{point}: the next run: {}\n{}",
        second.stdout,
        second.stderr
    );
    let journal = run(&w, &["journal", "--all", "--json"], None).json();
    let txns = journal["transactions"].as_array().expect("transactions");
    for t in txns {
        assert!(!t["outcome"].is_null(), "{point}: left open: {t:#}");
        assert_ne!(
            t["outcome"], "needs_human",
            "{point}: left for a person: {t:#}"
        );
    }
    for vmid in FOREIGN.into_iter().chain(POOL) {
        assert!(
            w.pve.writes_for(vmid).is_empty(),
            "{point}: guest {vmid} written"
        );
        assert!(w.pve.guest(vmid).is_some(), "{point}: guest {vmid} gone");
    }
    // No copy left in the band: only the foreign guests parked there.
    for vmid in 990002..=990009 {
        assert!(
            w.pve.guest(vmid).is_none(),
            "{point}: copy {vmid} left behind"
        );
    }
    // Every guest's backup ends proven.
    let report = run(&w, &["restore-report", "--json"], None);
    let doc: Value = report.json();
    assert_eq!(report.code, Some(0), "{point}: {doc:#}");
    for row in doc["guests"].as_array().expect("rows") {
        assert_eq!(row["status"], "proven", "{point}: {row:#}");
    }
    Some(())
}

/// Walk the kill points `<when>:first` on, two worlds at once, until the run ends before one
/// or `last` is passed; the kill points covered.
fn walk(when: &'static str, first: u32, last: u32) -> usize {
    let started = Instant::now();
    let mut covered = 0;
    let mut k = first;
    'walk: while k <= last {
        let ends: Vec<Option<()>> = std::thread::scope(|s| {
            let a = s.spawn(move || kill_and_settle(when, k));
            let b = s.spawn(move || (k < last).then(|| kill_and_settle(when, k + 1)).flatten());
            vec![a.join().expect("kill point"), b.join().expect("kill point")]
        });
        for (i, e) in ends.into_iter().enumerate() {
            match e {
                Some(()) => covered += 1,
                None if k + (i as u32) <= last => break 'walk,
                None => {}
            }
        }
        k += 2;
    }
    felhom_tests::report(&format!(
        "restore crash walk (2 copies at once), {when} {first}..: covered {covered}; {:.0}s",
        started.elapsed().as_secs_f64()
    ));
    covered
}

// The walk is two tests (the run's first records, then the rest), so that each stays within a
// minute and the runner runs them side by side; together they are the whole walk.

#[test]
fn sigkill_after_each_of_the_first_14_journal_records_of_a_two_copy_run_leaves_nothing_for_a_person(
) {
    // Every one of them is reached: two copies write about 13 records each.
    assert_eq!(walk("after-journal", 1, 14), 14);
}

#[test]
fn sigkill_after_each_later_journal_record_of_a_two_copy_run_leaves_nothing_for_a_person() {
    // Fewer means the run's journal changed under the walk; look before lowering it.
    let covered = walk("after-journal", 15, 60);
    assert!(
        covered >= 10,
        "only {covered} kill points past the 14th were reached"
    );
}

/// Killed right before each of the run's first 14 journal records: what the record would
/// have said is done (a restore submitted, a marker written, a start, a destroy) but the
/// journal does not know it yet. The next run still finds every copy and settles it.
#[test]
fn sigkill_before_each_of_the_first_14_journal_records_of_a_two_copy_run_leaves_nothing_for_a_person(
) {
    assert_eq!(walk("before-journal", 1, 14), 14);
}
