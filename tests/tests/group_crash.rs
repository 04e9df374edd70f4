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

use felhom_tests::crashwalk::kill_and_settle;
use felhom_tests::world::World;
use serde_json::json;

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

/// Kill the group's run at `<when>:k`, then settle and prove
/// ([`felhom_tests::crashwalk::kill_and_settle`]); and no lab a journaled member names is left.
fn kill_point(when: &str, k: u32) -> Option<()> {
    let w = world();
    let point = format!("{when}:{k}");
    kill_and_settle(&w, &point, &POOL)?;
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
    Some(())
}

fn walk(when: &'static str, first: u32, last: u32) -> usize {
    felhom_tests::crashwalk::walk(
        "group crash walk (2 members)",
        when,
        first,
        last,
        kill_point,
    )
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
