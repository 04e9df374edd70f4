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

use felhom_tests::crashwalk::kill_and_settle;
use felhom_tests::world::World;
use serde_json::json;

const POOL: [u32; 2] = [200, 210];

fn world() -> World {
    let w = World::new(felhom_tests::fakepve::pool_with_backups(&[(210, "shop")]));
    // Restores of 2 real seconds: the two copies' tasks overlap.
    w.pve
        .set(json!({"time_scale": 0.01, "ct_secs": {"create": 200}}));
    w
}

/// Walk the kill points `<when>:first..=last` (`after-journal`: right after the run's `k`th
/// journal record; `before-journal`: right before it, the effect it records done and not yet
/// journaled), two worlds at once; the kill points covered.
fn walk(when: &'static str, first: u32, last: u32) -> usize {
    felhom_tests::crashwalk::walk(
        "restore crash walk (2 copies at once)",
        when,
        first,
        last,
        |when, k| kill_and_settle(&world(), &format!("{when}:{k}"), &POOL),
    )
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
