//! Crash safety, with tasks that take time: the agent is SIGKILLed at every phase boundary of a
//! provision (just before and just after each journal record) and in the middle of each PVE
//! write of the transaction (the fake holds the answer; the request, and the task it starts,
//! are already in PVE), for an LXC and a QEMU guest. Then a later writing command takes up what
//! it left: it resumes the provision from its last journaled step where it can (most kill
//! points now end `ok`, the guest destroyed at the provision's normal end) and settles it
//! through the gate where it cannot. Every transaction must settle; a guest is destroyed only
//! with proof of ownership; no
//! foreign guest is ever written; no guest is left without a record; and no `needs_human`
//! may be left: [`ALLOWED_NEEDS_HUMAN`] is empty, so every kill point settles without a person.
//!
//! The busybox bed on purpose: the walk restores a guest per kill point (dozens), and a real
//! Debian restore costs seconds each; the real bed's start and stop are shown in `real_guests.rs`.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use felhom_tests::agent::AgentRun;
use felhom_tests::world::World;
use serde_json::{json, Value};

const VMID: u32 = 140;
const FOREIGN: [u32; 3] = [101, 990000, 990001];
/// Real seconds the fake holds the answer to a write of the transaction in the mid-request walk.
const ANSWER_DELAY: f64 = 1.0;
/// The settle window of the task search in the settling run, in milliseconds.
const SETTLE_MS: u64 = 3000;

/// The `needs_human` reasons a crash may leave, each recognised by a phrase of its message:
/// none. The restore request itself carries the marker's description line, so a guest whose
/// restore ended while the agent was stopped still proves its owner (own UPID ended OK plus the
/// line) and is cleaned up through the gate; every kill point settles without a person.
const ALLOWED_NEEDS_HUMAN: [(&str, &str); 0] = [];

/// Other `needs_human` reasons, recognised for the printed tally only (a crash must not cause
/// them).
const OTHER_NEEDS_HUMAN: [(&str, &str); 8] = [
    (
        "task_ok_unmarked",
        "ended OK while the agent was stopped, before it could mark",
    ),
    (
        "marker_unverified",
        "stopped before it had read back its marker",
    ),
    (
        "unknown_answer_guest",
        "got no certain answer, but nothing proves",
    ),
    ("unknown_answer_unsearched", "but the create may still land"),
    ("restore_leftover", "left behind"),
    ("task_status_unknown", "is unknown ("),
    ("marker_lost", "no longer shows marker"),
    ("destroy_unconfirmed", "destroy is unconfirmed"),
];

fn reason_of(message: &str) -> &'static str {
    ALLOWED_NEEDS_HUMAN
        .iter()
        .chain(OTHER_NEEDS_HUMAN.iter())
        .find(|(_, phrase)| message.contains(phrase))
        .map_or("unrecognised", |(name, _)| name)
}

struct Kind {
    name: &'static str,
    /// `lxc` or `qemu` (the API path segment).
    segment: &'static str,
    world: fn() -> World,
}

fn lxc_world() -> World {
    World::demo()
}

fn qemu_world() -> World {
    World::qemu(
        30,
        json!({"agent": true, "boot_secs": 2, "start_secs": 2, "stop_secs": 1}),
    )
}

const KINDS: [Kind; 2] = [
    Kind {
        name: "lxc",
        segment: "lxc",
        world: lxc_world,
    },
    Kind {
        name: "qemu",
        segment: "qemu",
        world: qemu_world,
    },
];

/// The writes of the transaction whose answers the mid-request walk holds: the restore, the
/// marker, the start, the stop and the destroy (`METHOD /api2/json/...`).
fn held_writes(kind: &Kind) -> Vec<String> {
    let base = format!("/api2/json/nodes/pve1/{}", kind.segment);
    vec![
        format!("POST {base}"),
        format!("PUT {base}/{VMID}/config"),
        format!("POST {base}/{VMID}/status/start"),
        format!("POST {base}/{VMID}/status/stop"),
        format!("DELETE {base}/{VMID}"),
    ]
}

const PROVISION: [&str; 4] = ["--selftest=provision", "-vmid", "140", "--json"];

fn run(w: &World, args: &[&str], kill_at: Option<&str>) -> AgentRun {
    let mut cmd = w.command();
    cmd.args(args);
    if let Some(k) = kill_at {
        cmd.env("FELHOM_AGENT_KILL_AT", k);
    }
    cmd.output().expect("run agent").into()
}

/// Run the provision and SIGKILL it while the fake holds the answer to its `n`-th held write.
/// `None` when the provision ended before that write (every write is covered).
fn kill_in_request(w: &World, kind: &Kind, n: usize) -> Option<String> {
    let held = held_writes(kind);
    let delays: serde_json::Map<String, Value> = held
        .iter()
        .map(|k| (k.clone(), json!(ANSWER_DELAY)))
        .collect();
    w.pve.set(json!({ "answer_delay": delays }));
    let mut child = w
        .command()
        .args(PROVISION)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn agent");
    let deadline = Instant::now() + Duration::from_secs(120);
    let killed = loop {
        let seen: Vec<String> = w
            .pve
            .requests()
            .into_iter()
            .map(|r| format!("{} {}", r.method, r.path))
            .filter(|r| held.contains(r))
            .collect();
        if seen.len() >= n {
            // The request is in the fake and its answer is held; let its handler finish (for
            // the restore: until PVE runs its task) before the kill.
            if n == 1 {
                let until = Instant::now() + Duration::from_secs(10);
                while restore_task(w).is_none() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            std::thread::sleep(Duration::from_millis(300));
            let _ = child.kill();
            let _ = child.wait();
            break Some(seen[n - 1].clone());
        }
        if child.try_wait().expect("wait agent").is_some() {
            break None;
        }
        assert!(Instant::now() < deadline, "the provision did not end");
        std::thread::sleep(Duration::from_millis(20));
    };
    let off: serde_json::Map<String, Value> = held.iter().map(|k| (k.clone(), json!(0))).collect();
    w.pve.set(json!({ "answer_delay": off }));
    killed
}

/// The restore task PVE ran for the transaction, if any.
fn restore_task(w: &World) -> Option<Value> {
    w.pve.tasks().into_iter().find(|t| {
        t["id"] == VMID.to_string().as_str()
            && t["type"].as_str().is_some_and(|ty| ty.ends_with("restore"))
    })
}

/// The vmids in the node's full guest list (the live `.vmlist`).
fn full_list(w: &World) -> Vec<u32> {
    let text = std::fs::read_to_string(&w.files.vmlist_path).expect("read .vmlist");
    let doc: Value = serde_json::from_str(&text).expect(".vmlist is JSON");
    doc["ids"]
        .as_object()
        .map(|ids| ids.keys().filter_map(|k| k.parse().ok()).collect())
        .unwrap_or_default()
}

#[derive(Default)]
struct Tally {
    covered: usize,
    destroyed_with_proof: usize,
    /// Kill points after which the provision was resumed and ended `ok`.
    resumed_ok: usize,
    needs_human: BTreeMap<&'static str, usize>,
}

/// Settle after a kill at `point` and check everything the walk promises.
fn settle_and_check(w: &World, initial: &[u32], point: &str, tally: &mut Tally) {
    let pve = &w.pve;
    // Any writing command settles the open transaction first; a gated destroy of a vmid this
    // agent never created settles, then is refused (exit 7) with nothing sent for it, or, when
    // no guest is left at the vmid, says there is nothing to destroy (exit 0).
    // A kill after the restore's intent but before its POST left nothing in PVE: the search for
    // its task ends after a settle window, shortened here.
    let mut cmd = w.command();
    cmd.args(["destroy", "-vmid", "141", "--json"])
        .env("FELHOM_AGENT_SUBMIT_SETTLE_MS", SETTLE_MS.to_string());
    let second: AgentRun = cmd.output().expect("run agent").into();
    assert!(
        second.code == Some(7)
            || (second.code == Some(0) && second.stdout.contains("nothing to destroy")),
        "{point}: the settling run: {:?}\n{}\n{}",
        second.code,
        second.stdout,
        second.stderr
    );

    let journal = run(w, &["journal", "--json"], None).json();
    let txns = journal["transactions"].as_array().expect("transactions");
    let crashed: Vec<&Value> = txns.iter().filter(|t| t["vmid"] == VMID).collect();
    assert!(crashed.len() <= 1, "{point}: {journal:#}");
    for t in &crashed {
        assert!(
            !t["outcome"].is_null(),
            "{point}: transaction left open: {t:#}"
        );
    }

    // Nothing foreign written, ever; the pool's own guests neither.
    for vmid in FOREIGN.into_iter().chain([200, 300]) {
        assert!(
            pve.writes_for(vmid).is_empty(),
            "{point}: guest {vmid} written"
        );
        assert!(pve.guest(vmid).is_some(), "{point}: guest {vmid} gone");
    }

    // A DELETE of 140 only happened with proof: the crashed transaction was armed.
    let deleted = pve
        .deletes_for(VMID)
        .iter()
        .any(|r| !r.path.contains("/tasks/"));
    if deleted {
        let t = crashed.first().expect("a transaction");
        assert_eq!(
            t["destroy_armed"],
            Value::Bool(true),
            "{point}: destroyed without proof: {t:#}"
        );
        tally.destroyed_with_proof += 1;
    }

    // No guest without a record: every guest the walk added to the full list has a journaled
    // transaction that hands it to a human.
    for vmid in full_list(w) {
        if initial.contains(&vmid) {
            continue;
        }
        assert_eq!(vmid, VMID, "{point}: an unexpected guest {vmid}");
        let t = crashed.first().unwrap_or_else(|| {
            panic!("{point}: guest {vmid} exists but no transaction records it")
        });
        assert_eq!(
            t["outcome"], "needs_human",
            "{point}: guest {vmid} left behind silently by {t:#}"
        );
    }
    // Every exec into a guest went through the helper, and nothing it started still runs (a
    // killed agent's command is stopped with its connection).
    w.assert_pct_only_from_helper();
    let helper = w.helper().pid();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !felhom_tests::guestbed::children_of(helper).is_empty() {
        assert!(
            Instant::now() < deadline,
            "{point}: the exec helper still runs {:?}",
            felhom_tests::guestbed::children_of(helper)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for t in &crashed {
        if t["outcome"] == "ok" {
            tally.resumed_ok += 1;
        }
        if t["outcome"] == "needs_human" {
            let msg = t["error"]["message"].as_str().unwrap_or("");
            let reason = reason_of(msg);
            *tally.needs_human.entry(reason).or_default() += 1;
            assert!(
                ALLOWED_NEEDS_HUMAN.iter().any(|(name, _)| *name == reason),
                "{point}: needs_human for a reason a crash must not cause ({reason}): {msg}"
            );
            assert!(
                msg.contains("destroy 140"),
                "{point}: the operator gets the command: {msg}"
            );
        }
    }
}

/// Journal boundaries to walk, for a run by hand: `FELHOM_CRASH_WALK=<first>-<last>` walks only
/// those (the mid-request tests ignore it). Unset (the suite): every boundary.
fn walk_range() -> Option<(u32, u32)> {
    let v = std::env::var("FELHOM_CRASH_WALK").ok()?;
    let (a, b) = v.split_once('-').unwrap_or((&v, &v));
    Some((
        a.parse().expect("FELHOM_CRASH_WALK: first boundary"),
        b.parse().expect("FELHOM_CRASH_WALK: last boundary"),
    ))
}

/// Kill points walked at once, each in a world of its own (its own fake PVE, guest bed and
/// exec helper, as each kill point always had): part of a kill point's time is the fake's tasks
/// and held answers and the settle window, not computing. tests/nextest.toml counts each of
/// these tests as that many of the runner's slots.
const WORLDS_AT_ONCE: usize = 2;

/// Walk the kill points `1..=last` (those `wanted` lets through) in [`WORLDS_AT_ONCE`] worlds at
/// once. `at(k)` kills the provision at point `k` in a fresh world, settles and checks it:
/// `Some` with its tally, or `None` when the provision ended before reaching that point. No point
/// after the first `None` is started, as in a walk one point after the other; points already
/// under way past it are still settled and checked, and counted apart.
///
/// The tally counts the points before the first that the provision did not reach: all of them
/// are walked, whatever the order they end in.
fn walk_points(
    last: u32,
    wanted: impl Fn(u32) -> bool + Sync,
    at: impl Fn(u32) -> Option<Tally> + Sync,
) -> (Tally, usize) {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    use std::sync::Mutex;

    let next = AtomicU32::new(1);
    let ended_at = AtomicU32::new(u32::MAX);
    let failed = AtomicBool::new(false);
    let outcomes: Mutex<BTreeMap<u32, Option<Tally>>> = Mutex::new(BTreeMap::new());
    /// Stops the other worlds from taking new points once one panicked.
    struct OnPanic<'a>(&'a AtomicBool);
    impl Drop for OnPanic<'_> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                self.0.store(true, Ordering::SeqCst);
            }
        }
    }
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..WORLDS_AT_ONCE)
            .map(|_| {
                scope.spawn(|| {
                    let _guard = OnPanic(&failed);
                    loop {
                        let k = next.fetch_add(1, Ordering::SeqCst);
                        if k > last || k > ended_at.load(Ordering::SeqCst) {
                            break;
                        }
                        if failed.load(Ordering::SeqCst) {
                            break;
                        }
                        if !wanted(k) {
                            continue;
                        }
                        let outcome = at(k);
                        if outcome.is_none() {
                            ended_at.fetch_min(k, Ordering::SeqCst);
                        }
                        outcomes
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(k, outcome);
                    }
                })
            })
            .collect();
        // The first failure is the test's, with its own message.
        let mut panic = None;
        for worker in workers {
            if let Err(payload) = worker.join() {
                panic.get_or_insert(payload);
            }
        }
        if let Some(payload) = panic {
            std::panic::resume_unwind(payload);
        }
    });
    let ended = ended_at.into_inner();
    let mut tally = Tally::default();
    let mut past_the_end = 0;
    for (k, outcome) in outcomes.into_inner().unwrap_or_else(|e| e.into_inner()) {
        match outcome {
            Some(part) if k < ended => tally.add(part),
            Some(_) => past_the_end += 1,
            None => {}
        }
    }
    (tally, past_the_end)
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.covered += other.covered;
        self.destroyed_with_proof += other.destroyed_with_proof;
        self.resumed_ok += other.resumed_ok;
        for (reason, n) in other.needs_human {
            *self.needs_human.entry(reason).or_default() += n;
        }
    }
}

/// Kills at every journal boundary on one side of the record (`before-journal` or
/// `after-journal`), until the provision ends before the kill point.
fn walk_boundaries(kind: &Kind, when: &str) -> (Tally, usize) {
    let range = walk_range();
    walk_points(
        40,
        |k| !range.is_some_and(|(a, b)| k < a || k > b),
        |k| {
            let mut tally = Tally::default();
            let w = (kind.world)();
            let initial = full_list(&w);
            let point = format!("{} {when}:{k}", kind.name);
            let first = run(&w, &PROVISION, Some(&format!("{when}:{k}")));
            if first.code.is_some() {
                // The provision ended before reaching this kill point: every boundary is
                // covered.
                assert_eq!(
                    first.code,
                    Some(0),
                    "{point}: {}\n{}",
                    first.stdout,
                    first.stderr
                );
                return None;
            }
            tally.covered += 1;
            settle_and_check(&w, &initial, &point, &mut tally);
            Some(tally)
        },
    )
}

/// Kills in the middle of each PVE write of the transaction.
fn walk_mid_request(kind: &Kind) -> (Tally, usize) {
    walk_points(
        held_writes(kind).len() as u32,
        |_| true,
        |n| {
            let n = n as usize;
            let mut tally = Tally::default();
            let w = (kind.world)();
            let initial = full_list(&w);
            let request = kill_in_request(&w, kind, n)?;
            tally.covered += 1;
            let point = format!("{} in {request}", kind.name);
            settle_and_check(&w, &initial, &point, &mut tally);
            if n == 1 {
                // Killed while PVE held the restore's answer: the settling run found the task
                // in the node's task list and recorded its UPID.
                let task =
                    restore_task(&w).unwrap_or_else(|| panic!("{point}: PVE ran no restore task"));
                let journal = run(&w, &["journal", "--json"], None).json();
                let row = journal["transactions"]
                    .as_array()
                    .and_then(|a| a.iter().find(|t| t["vmid"] == VMID).cloned())
                    .unwrap_or_else(|| panic!("{point}: no transaction: {journal:#}"));
                assert_eq!(row["upid"], task["upid"], "{point}: {row:#}");
            }
            Some(tally)
        },
    )
}

/// Print a part's tally and check that it reached at least `minimum` kill points (fewer means
/// the provision's journal or its writes changed under the walk: look before lowering it).
fn report_part(
    kind: &Kind,
    part: &str,
    started: Instant,
    (tally, past_the_end): &(Tally, usize),
    minimum: usize,
) {
    let reasons: Vec<String> = tally
        .needs_human
        .iter()
        .map(|(r, n)| format!("{r}={n}"))
        .collect();
    felhom_tests::report(&format!(
        "crash walk {} {part}: kill points covered: {}; resumed to ok: {}; a gated destroy: {}; \
         needs_human per reason: [{}]; also checked, started beside the point the provision \
         ended before: {past_the_end}; {:.0}s",
        kind.name,
        tally.covered,
        tally.resumed_ok,
        tally.destroyed_with_proof,
        reasons.join(", "),
        started.elapsed().as_secs_f64()
    ));
    if walk_range().is_none() || part == "mid-request" {
        assert!(
            tally.covered >= minimum,
            "{} {part}: only {} kill points were reached (at least {minimum} expected)",
            kind.name,
            tally.covered
        );
    }
}

/// Journal boundaries a provision passes on each side of its records before it ends (13 for
/// either kind today: every one is a kill point).
const BOUNDARIES_REACHED: usize = 13;

// The walk is six tests (each kind: before each journal record, after it, in the middle of each
// write), so that the test runner runs them side by side; together they are the whole walk.
// Each walks its kill points in [`WORLDS_AT_ONCE`] worlds at once.

/// Walk one part (`before-journal`, `after-journal` or `mid-request`) for one kind and check
/// its tally.
fn walk_part(kind: &Kind, part: &str) {
    let started = Instant::now();
    let (walked, minimum) = match part {
        "mid-request" => (walk_mid_request(kind), held_writes(kind).len()),
        when => (walk_boundaries(kind, when), BOUNDARIES_REACHED),
    };
    report_part(kind, part, started, &walked, minimum);
}

#[test]
fn sigkill_before_every_journal_record_of_a_container_provision_settles_safely() {
    walk_part(&KINDS[0], "before-journal");
}

#[test]
fn sigkill_after_every_journal_record_of_a_container_provision_settles_safely() {
    walk_part(&KINDS[0], "after-journal");
}

#[test]
fn sigkill_mid_request_in_every_write_of_a_container_provision_settles_safely() {
    walk_part(&KINDS[0], "mid-request");
}

#[test]
fn sigkill_before_every_journal_record_of_a_vm_provision_settles_safely() {
    walk_part(&KINDS[1], "before-journal");
}

#[test]
fn sigkill_after_every_journal_record_of_a_vm_provision_settles_safely() {
    walk_part(&KINDS[1], "after-journal");
}

#[test]
fn sigkill_mid_request_in_every_write_of_a_vm_provision_settles_safely() {
    walk_part(&KINDS[1], "mid-request");
}

/// The agent is SIGKILLed while a bootstrap it runs through the exec helper is still running in
/// the container: the helper stops that command at once (nothing of it keeps running, the
/// helper has no child left) and stays up for the next agent. The next writing command resumes
/// the provision: the bootstrap (now the packaged, idempotent default profile) runs again from
/// its start through the helper, then the checks, and the provision ends `ok`, its guest
/// destroyed through the gate, without a person. (Before resuming existed, the settling run
/// destroyed the guest without an exec and the provision ended `failed`.)
#[test]
fn a_killed_agent_leaves_no_exec_running_in_the_helper() {
    use felhom_tests::guestbed::{
        children_of, kill_processes_with_marker, processes_with_marker, unique_marker,
        wait_processes_gone,
    };
    let mut w = lxc_world();
    let marker = unique_marker("killed-agent");
    let run_script = w.files.bootstrap_dir.join("default/run");
    std::fs::write(
        &run_script,
        format!("#!/bin/sh\necho started\nexec sh -c 'while :; do sleep 1; done' {marker}\n"),
    )
    .expect("write the slow profile");
    let mut child = w
        .command()
        .args(PROVISION)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn agent");
    let deadline = Instant::now() + Duration::from_secs(120);
    while processes_with_marker(&marker).is_empty() {
        if child.try_wait().expect("wait agent").is_some() {
            panic!("the provision ended before its bootstrap ran");
        }
        assert!(
            Instant::now() < deadline,
            "the bootstrap did not start in the guest"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let helper_pid = w.helper().pid();
    assert!(
        !children_of(helper_pid).is_empty(),
        "the bootstrap runs under the helper"
    );
    let _ = child.kill();
    let _ = child.wait();

    let left = wait_processes_gone(&marker, Duration::from_secs(10));
    if !left.is_empty() {
        kill_processes_with_marker(&marker);
        panic!("the killed agent's bootstrap still runs in the guest: {left:?}");
    }
    // The helper stops the request as at its timeout: the kill, then the sweep of its tag in
    // the container; it logs the hang-up after both.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !w.helper().log().contains("stopped and swept") {
        assert!(
            Instant::now() < deadline,
            "the helper did not stop the request: {}",
            w.helper().log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !children_of(helper_pid).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the helper still runs {:?}",
            children_of(helper_pid)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        w.helper.as_mut().expect("helper").alive(),
        "the helper outlives a killed agent"
    );

    // The next writing command resumes the provision; the slow profile is replaced by the
    // packaged default one first (a profile that never ends would hold the resume until its
    // timeout).
    std::fs::copy(
        felhom_tests::fakepve::workspace_root().join("packaging/bootstrap.d/default/run"),
        &run_script,
    )
    .expect("restore the default profile");
    let execs_before = w.bed.pct_calls().len();
    let mut cmd = w.command();
    cmd.args(["destroy", "-vmid", "141", "--json"])
        .env("FELHOM_AGENT_SUBMIT_SETTLE_MS", SETTLE_MS.to_string());
    let second: AgentRun = cmd.output().expect("run agent").into();
    // The resume destroyed the guest: nothing is left to destroy at the vmid.
    assert!(
        second.code == Some(7)
            || (second.code == Some(0) && second.stdout.contains("nothing to destroy")),
        "{:?}\n{}\n{}",
        second.code,
        second.stdout,
        second.stderr
    );
    let t = w
        .journal()
        .into_iter()
        .find(|t| t["vmid"] == VMID)
        .expect("the transaction");
    assert_eq!(t["outcome"], "ok", "{t:#}");
    assert!(t["error"].is_null(), "{t:#}");
    assert!(w.pve.guest(VMID).is_none(), "the guest is destroyed: {t:#}");
    assert!(
        w.pve
            .deletes_for(VMID)
            .iter()
            .any(|r| !r.path.contains("/tasks/")),
        "through the gate"
    );
    let after: Vec<_> = w.bed.pct_calls().split_off(execs_before);
    assert!(
        after.iter().any(|c| c.sub == "exec"),
        "the resumed run did not run the bootstrap again: {after:#?}"
    );
    w.assert_pct_only_from_helper();
}
