//! The crash walks of restore-test runs (`tests/tests/restore_crash.rs`, `group_crash.rs`):
//! the agent is SIGKILLed at one journal record of a run (`FELHOM_AGENT_KILL_AT`), the next
//! run settles what the killed one left and proves what is still due, and what the node then
//! holds is checked at the source.

use std::time::Instant;

use crate::agent::AgentRun;
use crate::world::World;
use serde_json::Value;

/// Guests of others in the demo pool's cluster: never written, never gone.
pub const FOREIGN: [u32; 3] = [101, 990000, 990001];

/// `args` run in `w` with restore requests 0.3 s apart and a 3 s settle window, killed at
/// `kill_at` (`<after|before>-journal:<k>`) when given.
pub fn run(w: &World, args: &[&str], kill_at: Option<&str>) -> AgentRun {
    let mut cmd = w.command();
    cmd.args(args)
        .env("FELHOM_AGENT_SUBMIT_SPACING_MS", "300")
        .env("FELHOM_AGENT_SUBMIT_SETTLE_MS", "3000");
    if let Some(k) = kill_at {
        cmd.env("FELHOM_AGENT_KILL_AT", k);
    }
    cmd.output().expect("run the agent").into()
}

/// Kill a restore-test run of `w` at `point`, then run it again: `None` when the first run
/// ended before that record (it must have ended ok). Otherwise the next run must end ok, every
/// transaction settle without a person, no foreign or `pool` guest be written or gone, no copy
/// be left in the band, and every guest's backup end proven.
pub fn kill_and_settle(w: &World, point: &str, pool: &[u32]) -> Option<()> {
    let started = Instant::now();
    let first = run(w, &["--selftest=restore", "--json"], Some(point));
    let first_secs = started.elapsed().as_secs_f64();
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
    let started = Instant::now();
    let second = run(w, &["--selftest=restore", "--json"], None);
    slow_run_said(point, first_secs, started.elapsed().as_secs_f64(), &second);
    assert_eq!(
        second.code,
        Some(0),
        "{point}: the next run: {}\n{}",
        second.stdout,
        second.stderr
    );
    let journal = run(w, &["journal", "--all", "--json"], None).json();
    for t in journal["transactions"].as_array().expect("transactions") {
        assert!(!t["outcome"].is_null(), "{point}: left open: {t:#}");
        assert_ne!(
            t["outcome"], "needs_human",
            "{point}: left for a person: {t:#}"
        );
    }
    for vmid in FOREIGN.iter().chain(pool) {
        assert!(
            w.pve.writes_for(*vmid).is_empty(),
            "{point}: guest {vmid} written"
        );
        assert!(w.pve.guest(*vmid).is_some(), "{point}: guest {vmid} gone");
    }
    // No copy left in the band: only the foreign guests parked there.
    for vmid in 990002..=990009 {
        assert!(
            w.pve.guest(vmid).is_none(),
            "{point}: copy {vmid} left behind"
        );
    }
    // Every guest's backup ends proven.
    let report = run(w, &["restore-report", "--json"], None);
    let doc: Value = report.json();
    assert_eq!(report.code, Some(0), "{point}: {doc:#}");
    for row in doc["guests"].as_array().expect("rows") {
        assert_eq!(row["status"], "proven", "{point}: {row:#}");
    }
    Some(())
}

/// A kill point whose runs took long (a run of the walk takes a few seconds): its figures and
/// the end of the next run's log, among the figures the tests measured, for whoever reads why.
fn slow_run_said(point: &str, first: f64, second: f64, next: &AgentRun) {
    if first + second < 30.0 {
        return;
    }
    let tail: Vec<&str> = next.stderr.lines().rev().take(12).collect();
    crate::report(&format!(
        "crash walk {point}: the killed run {first:.0}s, the next run {second:.0}s; the next run's log ended: {}",
        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
    ));
}

/// Walk the kill points `<when>:first..=last` with `point` (a kill point's whole check, `None`
/// when the run ended before it), two at once, until the run ends before one; the kill points
/// covered. `what` names the walk in the printed figure.
pub fn walk(
    what: &str,
    when: &'static str,
    first: u32,
    last: u32,
    point: impl Fn(&'static str, u32) -> Option<()> + Sync,
) -> usize {
    let started = Instant::now();
    let mut covered = 0;
    let mut k = first;
    let point = &point;
    'walk: while k <= last {
        let ends: Vec<Option<()>> = std::thread::scope(|s| {
            let a = s.spawn(move || point(when, k));
            let b = s.spawn(move || (k < last).then(|| point(when, k + 1)).flatten());
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
    crate::report(&format!(
        "{what}, {when} {first}..: covered {covered}; {:.0}s",
        started.elapsed().as_secs_f64()
    ));
    covered
}
