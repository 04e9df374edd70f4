//! Crash safety of an application group's run (`[[restore_test.group]]`): the agent is
//! SIGKILLed after (and before) each journal record of a run of a two-member group of
//! containers, with restore tasks that take time so that both members are under way at once.
//! The next run settles what the killed one left and proves the group again. Every transaction
//! must settle without a person; no copy is left in the band; no foreign or pool guest is
//! written; no lab a journaled member names is left on the node (the settle step removes a
//! stopped run's group lab); and both members' backups end proven.
//!
//! The busybox bed: its containers run in network namespaces of their own behind the LXC
//! monitor stand-in, so root's join of the group's lab is the real one.

use std::time::Instant;

use felhom_tests::agent::AgentRun;
use felhom_tests::world::World;
use serde_json::{json, Value};

const FOREIGN: [u32; 3] = [101, 990000, 990001];
const POOL: [u32; 2] = [200, 210];

fn world() -> World {
    let w = World::new(felhom_tests::fakepve::pool_with_backups(&[(210, "shop")]));
    // Restores of 2 real seconds: the two members' tasks overlap.
    w.pve
        .set(json!({"time_scale": 0.01, "ct_secs": {"create": 200}}));
    let mut cfg = std::fs::read_to_string(&w.files.config_path).expect("agent.toml");
    cfg.push_str("\n[[restore_test.group]]\nname = \"shop\"\nguests = [200, 210]\n");
    std::fs::write(&w.files.config_path, cfg).expect("agent.toml");
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

/// The group labs the journal's records name (`"lab":"<ULID>"` of a member's request).
fn journaled_labs(w: &World) -> Vec<String> {
    let mut labs = Vec::new();
    let dir = w.state_dir().join("journal");
    for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        for part in text.split("\"lab\":\"").skip(1) {
            let id: String = part.chars().take(26).collect();
            if id.len() == 26 && !labs.contains(&id) {
                labs.push(id);
            }
        }
    }
    labs
}

/// Kill the run at `<when>:k`, then settle and prove; `None` when it ended before that record.
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
    let second = run(&w, &["--selftest=restore", "--json"], None);
    assert_eq!(
        second.code,
        Some(0),
        "{point}: the next run: {}\n{}",
        second.stdout,
        second.stderr
    );
    let journal = run(&w, &["journal", "--all", "--json"], None).json();
    for t in journal["transactions"].as_array().expect("transactions") {
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
    for vmid in 990002..=990009 {
        assert!(
            w.pve.guest(vmid).is_none(),
            "{point}: copy {vmid} left behind"
        );
    }
    let labs = journaled_labs(&w);
    assert!(!labs.is_empty(), "{point}: no group lab journaled");
    for lab in labs {
        assert!(
            !std::path::Path::new("/run/netns")
                .join(format!("felhom-g-{lab}"))
                .exists(),
            "{point}: the group lab felhom-g-{lab} is left"
        );
    }
    let report = run(&w, &["restore-report", "--json"], None);
    let doc: Value = report.json();
    assert_eq!(report.code, Some(0), "{point}: {doc:#}");
    for row in doc["guests"].as_array().expect("rows") {
        assert_eq!(row["status"], "proven", "{point}: {row:#}");
    }
    Some(())
}

/// Walk the kill points `<when>:first..=last`, two worlds at once, until the run ends before
/// one; the kill points covered.
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
        "group crash walk (2 members), {when} {first}..: covered {covered}; {:.0}s",
        started.elapsed().as_secs_f64()
    ));
    covered
}

#[test]
fn sigkill_after_each_of_the_first_14_journal_records_of_a_group_run_leaves_nothing_behind() {
    assert_eq!(walk("after-journal", 1, 14), 14);
}

#[test]
fn sigkill_after_each_later_journal_record_of_a_group_run_leaves_nothing_behind() {
    let covered = walk("after-journal", 15, 60);
    assert!(
        covered >= 10,
        "only {covered} kill points past the 14th were reached"
    );
}

#[test]
fn sigkill_before_each_of_the_first_14_journal_records_of_a_group_run_leaves_nothing_behind() {
    assert_eq!(walk("before-journal", 1, 14), 14);
}
