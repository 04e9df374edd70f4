//! Application groups on the busybox bed (`[[restore_test.group]]`): what the run does before
//! any write, the start order, and a member whose backup does not restore. Counted at the
//! source: the requests the fake PVE received and the guests it holds.

use felhom_tests::agent::AgentRun;
use felhom_tests::world::World;
use serde_json::{json, Value};

/// The pool of guests 200 and 210 (containers, each with a backup), grouped as `group`.
fn world(group: &str) -> World {
    let w = World::new(felhom_tests::fakepve::pool_with_backups(&[(210, "shop")]));
    w.pve
        .set(json!({"time_scale": 0.01, "ct_secs": {"create": 200}}));
    let mut cfg = std::fs::read_to_string(&w.files.config_path).expect("agent.toml");
    cfg.push_str(group);
    std::fs::write(&w.files.config_path, cfg).expect("agent.toml");
    w
}

fn prove(w: &World, guest: &str) -> (AgentRun, Value) {
    let run: AgentRun = w
        .command()
        .args(["--selftest=restore", "--guest", guest, "--json"])
        // Restore requests 0.3 s apart (2 s on a node): both members' 2 s restores overlap.
        .env("FELHOM_AGENT_SUBMIT_SPACING_MS", "300")
        .output()
        .expect("run the agent")
        .into();
    let doc: Value = serde_json::from_str(&run.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", run.stdout, run.stderr));
    (run, doc)
}

/// The restore requests (`POST …/lxc`) and start requests the fake received.
fn writes(w: &World) -> Vec<String> {
    w.pve
        .requests()
        .into_iter()
        .filter(|r| r.method != "GET")
        .map(|r| format!("{} {}", r.method, r.path))
        .collect()
}

/// A group naming a guest that is no pool guest is left before any write, naming the member;
/// its other member is never proven alone.
#[test]
fn a_group_with_a_member_that_is_no_pool_guest_is_left_before_any_write() {
    let w = world("\n[[restore_test.group]]\nname = \"shop\"\nguests = [200, 220]\n");
    let (run, doc) = prove(&w, "200");
    assert!(
        doc["copies"].as_array().is_some_and(Vec::is_empty),
        "{doc:#}"
    );
    let left = doc["left"].as_array().expect("left");
    assert_eq!(left.len(), 2, "{doc:#}");
    for l in left {
        let reason = l["reason"].as_str().unwrap_or_default();
        assert!(
            reason.starts_with("group shop: member 220 is not a pool guest"),
            "{reason}"
        );
    }
    assert!(writes(&w).is_empty(), "{:?}\n{}", writes(&w), run.stderr);
}

/// A group runs all its members at once: one larger than `[restore_test] at_once` is left
/// before any write, saying what to raise.
#[test]
fn a_group_larger_than_at_once_is_left_before_any_write() {
    let w = world("\n[restore_test]\nat_once = 1\n\n[[restore_test.group]]\nname = \"shop\"\nguests = [200, 210]\n");
    let (_run, doc) = prove(&w, "210");
    let left = doc["left"].as_array().expect("left");
    assert_eq!(left.len(), 2, "{doc:#}");
    assert!(
        left[0]["reason"].as_str().is_some_and(
            |r| r.contains("its 2 members run at once and [restore_test] at_once is 1")
        ),
        "{doc:#}"
    );
    assert!(writes(&w).is_empty(), "{:?}", writes(&w));
}

/// The members' copies start in the group's order: the second member's start is asked for only
/// after the first member's boot ended and the group's boot delay passed.
#[test]
fn members_start_in_order_after_the_boot_delay() {
    let w =
        world("\n[[restore_test.group]]\nname = \"shop\"\nguests = [210, 200]\nboot_delay = 2\n");
    let started = std::time::Instant::now();
    let (run, doc) = prove(&w, "200");
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let copies = doc["copies"].as_array().expect("copies");
    assert_eq!(copies.len(), 2, "{doc:#}");
    // Listed in start order, each naming its place.
    assert_eq!(copies[0]["guest"], 210, "{doc:#}");
    assert_eq!(copies[0]["group"]["member"], 1, "{doc:#}");
    assert_eq!(copies[1]["guest"], 200, "{doc:#}");
    assert_eq!(copies[1]["group"]["member"], 2, "{doc:#}");
    let vmid = |c: &Value| c["vmid"].as_u64().expect("vmid");
    let (first, second) = (vmid(&copies[0]), vmid(&copies[1]));
    let seen = writes(&w);
    let start_of = |v: u64| {
        seen.iter()
            .position(|r| r.starts_with("POST") && r.ends_with(&format!("/lxc/{v}/status/start")))
            .unwrap_or_else(|| panic!("no start of {v}: {seen:?}"))
    };
    assert!(start_of(first) < start_of(second), "{seen:?}");
    // Both restores were asked for before either start: restored at once.
    let restores: Vec<usize> = seen
        .iter()
        .enumerate()
        .filter(|(_, r)| r.starts_with("POST") && r.ends_with("/lxc"))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(restores.len(), 2, "{seen:?}");
    assert!(restores[1] < start_of(first), "{seen:?}");
    assert!(started.elapsed() >= std::time::Duration::from_secs(2));
    // The second start came at least the boot delay after the first start was answered.
    let timings = w.pve.timings();
    let answer = |v: u64| {
        timings
            .iter()
            .find(|t| t.method == "POST" && t.path.ends_with(&format!("/lxc/{v}/status/start")))
            .unwrap_or_else(|| panic!("no start of {v}"))
            .clone()
    };
    let gap = answer(second).start - answer(first).end;
    assert!(
        gap >= 2.0,
        "the second member started {gap:.2}s after the first"
    );
    for v in 990002..=990009 {
        assert!(w.pve.guest(v).is_none(), "copy {v} left");
    }
}

/// A member whose restore PVE refuses fails the group, named; the other member's copy is still
/// made, judged and destroyed, and nothing is left.
#[test]
fn a_member_whose_backup_does_not_restore_fails_naming_it_and_nothing_is_left() {
    let w = world("\n[[restore_test.group]]\nname = \"shop\"\nguests = [200, 210]\n");
    // The first restore request (member 200's, admitted first) is refused.
    w.pve.fail(
        "POST",
        "/nodes/pve1/lxc",
        400,
        "unable to restore CT - archive is corrupt",
        Some(1),
    );
    let (run, doc) = prove(&w, "210");
    assert_ne!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let copies = doc["copies"].as_array().expect("copies");
    assert_eq!(copies.len(), 2, "{doc:#}");
    let member = |g: u32| {
        copies
            .iter()
            .find(|c| c["guest"] == g)
            .unwrap_or_else(|| panic!("no copy of {g}: {doc:#}"))
    };
    assert_ne!(member(200)["outcome"], "ok", "{doc:#}");
    assert!(
        member(200)["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("archive is corrupt")),
        "{doc:#}"
    );
    assert_eq!(member(210)["outcome"], "ok", "{doc:#}");
    for v in 990002..=990009 {
        assert!(w.pve.guest(v).is_none(), "copy {v} left");
    }
}
