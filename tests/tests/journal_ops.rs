//! The journal verbs of a node that runs for years: `journal refresh` compares the journal's
//! claims with PVE (kept guests removed behind the agent's back lose their claim, a
//! `needs_human` whose guest is gone is closed), `journal resolve` closes a `needs_human` an
//! operator handled by hand, `journal cancel` settles one transaction a dead process left open
//! through the ownership gate. Every request PVE received is counted at fakepve.

use std::collections::BTreeMap;
use std::time::Duration;

use felhom_agent::provision::VmidLock;
use felhom_tests::agent::AgentRun;
use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
use felhom_tests::fakepve::{demo_scenario, AgentOptions, RecordedRequest};
use felhom_tests::world::World;
use serde_json::{json, Value};

fn text(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

/// The writes PVE received after request number `from`.
fn writes_since(w: &World, from: usize) -> Vec<RecordedRequest> {
    w.pve.requests()[from..]
        .iter()
        .filter(|r| r.is_write())
        .cloned()
        .collect()
}

/// A kept provision of `vmid`; returns its transaction id.
fn keep(w: &World, vmid: u32) -> String {
    let vmid = vmid.to_string();
    let run = w.agent(&["--selftest=provision", "-vmid", &vmid, "--keep", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["destroy_armed"], json!(true), "{doc:#}");
    text(&doc["txn"])
}

/// Root removes guest `vmid` outside the agent; the live `.vmlist` is rewritten as pmxcfs does.
fn remove_by_hand(w: &World, vmid: u32) {
    w.pve.call("remove_guest", json!([vmid]), json!({}));
    w.pve.call("write_vmlist", json!([]), json!({}));
}

/// Root swaps guest `vmid` for a copy carrying its tags and description but a new MAC.
fn swap_for_copy(w: &World, vmid: u32) {
    let cfg = w.pve.guest(vmid).expect("guest")["config"].clone();
    w.pve.call("remove_guest", json!([vmid]), json!({}));
    w.pve.call(
        "add_ct",
        json!([vmid, "copy"]),
        json!({"pool": "felhom", "status": "running", "config": {
            "hostname": "copy",
            "tags": cfg["tags"],
            "description": cfg["description"],
            "net0": "name=eth0,bridge=vmbr0,hwaddr=BC:24:11:0C:0F:0A,ip=dhcp,type=veth",
        }}),
    );
    w.pve.call("write_vmlist", json!([]), json!({}));
}

/// A `needs_human` transaction: a destroy of a kept guest that was swapped for a copy.
fn needs_human(w: &World, vmid: u32) -> (String, String) {
    let origin = keep(w, vmid);
    swap_for_copy(w, vmid);
    let run = w.agent(&["destroy", "-vmid", &vmid.to_string(), "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(7), "{doc:#}\n{}", run.stderr);
    assert_eq!(
        w.journal_txn(&text(&doc["txn"]))["outcome"],
        "needs_human",
        "{doc:#}"
    );
    assert!(w.pve.deletes_for(vmid).is_empty());
    (origin, text(&doc["txn"]))
}

fn refresh(w: &World) -> (AgentRun, Value) {
    let run = w.agent(&["journal", "refresh", "--json"]);
    let doc = run.json();
    (run, doc)
}

fn row<'a>(doc: &'a Value, txn: &str) -> &'a Value {
    doc["transactions"]
        .as_array()
        .expect("transactions")
        .iter()
        .find(|r| r["txn"] == txn)
        .unwrap_or_else(|| panic!("{txn} not looked at: {doc:#}"))
}

fn run_killed(w: &World, args: &[&str], kill_at: &str) -> AgentRun {
    let mut cmd = w.command();
    cmd.args(args).env("FELHOM_AGENT_KILL_AT", kill_at);
    cmd.output().expect("run agent").into()
}

#[test]
fn refresh_disarms_a_kept_guest_removed_behind_the_agents_back_and_destroy_is_refused() {
    let w = World::demo();
    let gone = keep(&w, 160);
    let stays = keep(&w, 161);
    remove_by_hand(&w, 160);

    // A passing PVE error on the guest that stays changes nothing for it.
    w.pve.fail(
        "GET",
        "/nodes/pve1/lxc/161/config",
        503,
        "Service Unavailable",
        Some(4),
    );
    let before = w.pve.requests().len();
    let (run, doc) = refresh(&w);
    assert_eq!(run.code, Some(6), "{doc:#}\n{}", run.stderr);
    let r = row(&doc, &gone);
    assert_eq!(r["finding"], "absent", "{doc:#}");
    assert!(text(&r["change"]).contains("disarmed"), "{doc:#}");
    let r = row(&doc, &stays);
    assert!(r["finding"].is_null(), "{doc:#}");
    assert!(r["change"].is_null(), "{doc:#}");
    assert!(text(&r["skipped"]).contains("161"), "{doc:#}");
    assert!(writes_since(&w, before).is_empty());
    let o = w.journal_txn(&stays);
    assert_eq!(o["destroy_armed"], json!(true), "{o:#}");

    // A token PVE does not accept says nothing about the guest either.
    w.pve.fail(
        "GET",
        "/nodes/pve1/lxc/161/config",
        401,
        "authentication failure",
        // A 401 is not retried: one answer.
        Some(1),
    );
    let (run, doc) = refresh(&w);
    assert_eq!(run.code, Some(6), "{doc:#}\n{}", run.stderr);
    assert!(row(&doc, &stays)["change"].is_null(), "{doc:#}");
    assert_eq!(w.journal_txn(&stays)["destroy_armed"], json!(true));
    assert!(w.journal_txn(&stays)["disarmed"].is_null());

    // Once PVE answers, the kept guest that is still there keeps its claim.
    let (run, doc) = refresh(&w);
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(
        row(&doc, &stays)["finding"],
        "present_with_proof",
        "{doc:#}"
    );
    assert_eq!(doc["changed"], json!(0), "{doc:#}");
    assert!(
        doc["transactions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["txn"] != gone.as_str()),
        "a withdrawn claim is no longer looked at: {doc:#}"
    );
    assert!(writes_since(&w, before).is_empty());

    let o = w.journal_txn(&gone);
    assert_eq!(o["destroy_armed"], json!(false), "{o:#}");
    assert!(text(&o["disarmed"]).contains("journal refresh"), "{o:#}");
    let human = w.agent(&["journal"]);
    assert!(
        human
            .stdout
            .contains("disarmed: guest 160 was not in the full guest list"),
        "{}",
        human.stdout
    );
    assert_eq!(w.journal_txn(&stays)["destroy_armed"], json!(true));

    // A guest put back at 160 later is never destroyed on the withdrawn claim.
    w.pve.call(
        "add_ct",
        json!([160, "back"]),
        json!({"pool": "felhom", "config": {"hostname": "back"}}),
    );
    w.pve.call("write_vmlist", json!([]), json!({}));
    let run = w.agent(&["destroy", "-vmid", "160", "--json"]);
    assert_eq!(run.code, Some(7), "{}\n{}", run.stdout, run.stderr);
    assert!(w.pve.deletes_for(160).is_empty());
    assert!(w.pve.guest(160).is_some());
}

#[test]
fn a_copy_with_the_marker_is_present_without_proof_and_disarms_the_claim() {
    let w = World::demo();
    let origin = keep(&w, 162);
    swap_for_copy(&w, 162);
    let before = w.pve.requests().len();
    let human = w.agent(&["journal", "refresh"]);
    assert_eq!(human.code, Some(0), "{}\n{}", human.stdout, human.stderr);
    assert!(
        human.stdout.contains("present WITHOUT its proof")
            && human.stdout.contains("changed: destroy disarmed")
            && human
                .stdout
                .contains("1 changed; nothing was written to PVE"),
        "{}",
        human.stdout
    );
    // Already withdrawn: a second refresh does not look at it again.
    let (run, doc) = refresh(&w);
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["changed"], json!(0), "{doc:#}");
    let o = w.journal_txn(&origin);
    assert!(text(&o["disarmed"]).contains("copy"), "{o:#}");
    assert!(writes_since(&w, before).is_empty());
    let run = w.agent(&["destroy", "-vmid", "162", "--json"]);
    assert_eq!(run.code, Some(7), "{}\n{}", run.stdout, run.stderr);
    assert!(w.pve.deletes_for(162).is_empty());
}

#[test]
fn resolve_closes_a_needs_human_and_refuses_anything_else() {
    let w = World::demo();
    let (origin, stuck) = needs_human(&w, 163);
    let before = w.pve.requests().len();

    // The origin settled `ok`: not a needs_human.
    let run = w.agent(&["journal", "resolve", &origin, "--reason", "x", "--json"]);
    assert_eq!(run.code, Some(3), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.json()["error"]["code"], "not_needs_human");

    let unknown = ulid::Ulid::new().to_string();
    let run = w.agent(&["journal", "resolve", &unknown, "--reason", "x", "--json"]);
    assert_eq!(run.code, Some(3), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.json()["error"]["code"], "txn_unknown");

    // While another process holds the vmid's lock, it waits its turn.
    {
        let _held = VmidLock::try_acquire(&w.state_dir(), 163, None).expect("lock");
        let run = w.agent(&["journal", "resolve", &stuck, "--reason", "x", "--json"]);
        assert_eq!(run.code, Some(3), "{}\n{}", run.stdout, run.stderr);
        assert_eq!(run.json()["error"]["code"], "vmid_in_use");
        assert!(w.journal_txn(&stuck)["resolution"].is_null());
    }

    // The metrics show it waiting for a person (the alert `felhom_needs_human > 0` fires).
    let needs_human_gauge = || {
        let text = std::fs::read_to_string(w.files.metrics_dir.join("felhom_transactions.prom"))
            .expect("felhom_transactions.prom");
        text.lines()
            .find_map(|l| l.strip_prefix("felhom_needs_human "))
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| panic!("no felhom_needs_human in:\n{text}"))
    };
    assert_eq!(needs_human_gauge(), "1");

    let long = format!("removed by hand{}", "!".repeat(2000));
    let run = w.agent(&["journal", "resolve", &stuck, "--reason", &long, "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    // Closed: the gauge drops at once, so the alert clears.
    assert_eq!(needs_human_gauge(), "0");
    let t = w.journal_txn(&stuck);
    assert_eq!(t["outcome"], "needs_human", "{t:#}");
    let reason = text(&t["resolution"]["reason"]);
    assert!(reason.starts_with("removed by hand"), "{t:#}");
    assert_eq!(reason.len(), 512, "the reason is clipped: {t:#}");
    assert_eq!(t["resolution"]["by"], "operator", "{t:#}");
    assert!(text(&t["resolution"]["at"]).ends_with('Z'), "{t:#}");

    // Closed once: a second resolve is refused, and a refresh no longer looks at it.
    let run = w.agent(&["journal", "resolve", &stuck, "--reason", "again", "--json"]);
    assert_eq!(run.code, Some(3), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.json()["error"]["code"], "not_needs_human");
    let (run, doc) = refresh(&w);
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert!(
        doc["transactions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["txn"] != stuck.as_str()),
        "{doc:#}"
    );
    assert!(
        w.pve.requests()[before..]
            .iter()
            .all(|r| !r.targets_vmid(163) || r.method == "GET"),
        "resolve and refresh only read"
    );
    assert!(writes_since(&w, before).is_empty());
    assert!(
        w.pve.guest(163).is_some(),
        "the copy is left to the operator"
    );
}

#[test]
fn refresh_closes_a_needs_human_whose_guest_is_gone() {
    let w = World::demo();
    let (_origin, stuck) = needs_human(&w, 164);
    // Still there: nothing changes.
    let (run, doc) = refresh(&w);
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(row(&doc, &stuck)["finding"], "present_without_proof");
    assert!(row(&doc, &stuck)["change"].is_null(), "{doc:#}");
    assert!(w.journal_txn(&stuck)["resolution"].is_null());

    remove_by_hand(&w, 164);
    let before = w.pve.requests().len();
    let (run, doc) = refresh(&w);
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(row(&doc, &stuck)["finding"], "absent");
    assert!(writes_since(&w, before).is_empty());
    let t = w.journal_txn(&stuck);
    assert_eq!(t["resolution"]["by"], "refresh", "{t:#}");
    assert!(
        text(&t["resolution"]["reason"]).contains("guest gone"),
        "{t:#}"
    );
}

#[test]
fn cancel_settles_a_crash_left_transaction_through_the_gate() {
    let w = World::demo();
    let crash = |vmid: u32| {
        // Record 5 is the armed state before the start (created, marker read back).
        let first = run_killed(
            &w,
            &["--selftest=provision", "-vmid", &vmid.to_string(), "--json"],
            "after-journal:5",
        );
        assert_eq!(first.code, None, "not killed: {}", first.stdout);
        let t = w
            .journal()
            .into_iter()
            .find(|t| t["vmid"] == vmid)
            .expect("open transaction");
        assert!(t["outcome"].is_null(), "{t:#}");
        assert_eq!(t["destroy_armed"], json!(true), "{t:#}");
        text(&t["txn"])
    };
    let proven = crash(165);
    let swapped = {
        // While 165's lock is held, the next provision's settle leaves 165 open.
        let held = VmidLock::try_acquire(&w.state_dir(), 165, None).expect("lock");
        let swapped = crash(166);
        swap_for_copy(&w, 166);
        // A held lock: cancel is refused, nothing done.
        let run = w.agent(&["journal", "cancel", &proven, "--json"]);
        assert_eq!(run.code, Some(3), "{}\n{}", run.stdout, run.stderr);
        assert_eq!(run.json()["error"]["code"], "vmid_in_use");
        drop(held);
        swapped
    };
    assert!(w.pve.deletes_for(165).is_empty());
    assert!(w.journal_txn(&proven)["outcome"].is_null());

    // The swapped guest has no proof: needs_human, no write to the copy.
    let before = w.pve.requests().len();
    let run = w.agent(&["journal", "cancel", &swapped, "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(7), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "needs_human", "{doc:#}");
    let sent: Vec<RecordedRequest> = w.pve.requests()[before..]
        .iter()
        .filter(|r| r.is_write())
        .cloned()
        .collect();
    assert!(sent.is_empty(), "cancel wrote: {sent:?}");
    assert!(w.pve.guest(166).is_some());
    // Only the named transaction was settled.
    assert!(w.journal_txn(&proven)["outcome"].is_null());

    // Proven: the gated destroy runs, one DELETE. The command succeeded: the transaction's
    // recorded failure (why it had stopped) is a result, never an `error` line.
    let run = w.agent(&["journal", "cancel", &proven]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("destroyed: true"),
        "{}\n{}",
        run.stdout,
        run.stderr
    );
    for (name, text) in [("stdout", &run.stdout), ("stderr", &run.stderr)] {
        assert!(
            !text.lines().any(|l| l.starts_with("error [")),
            "an error line on {name} of a successful cancel: {text}"
        );
    }
    assert_eq!(w.pve.deletes_for(165).len(), 1);
    assert!(w.pve.guest(165).is_none());

    // Settled: a second cancel is refused.
    let run = w.agent(&["journal", "cancel", &proven, "--json"]);
    assert_eq!(run.code, Some(3), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.json()["error"]["code"], "txn_not_open");
    assert_eq!(w.pve.deletes_for(165).len(), 1);
    assert!(w.pve.deletes_for(166).is_empty());
}

#[test]
fn the_hub_receives_a_resolution() {
    let hub = DevHub::start(DevHubOptions::default());
    let w = World::with_options(
        demo_scenario(),
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    );
    let (_origin, stuck) = needs_human(&w, 167);
    let run = w.agent(&[
        "journal",
        "resolve",
        &stuck,
        "--reason",
        "removed by hand",
        "--json",
    ]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.json()["hub"], "queued for the hub");

    let agent = AgentDaemon::spawn(&w.files.config_path, FAST_TIMING, &[]);
    let state = hub.wait_for("the resolution event", Duration::from_secs(60), |s| {
        s.events.iter().any(|(_, e)| {
            e.txn.to_string() == stuck
                && e.detail
                    .as_deref()
                    .is_some_and(|d| d.contains("removed by hand"))
        })
    });
    let closures = state
        .events
        .iter()
        .filter(|(_, e)| e.txn.to_string() == stuck)
        .count();
    assert_eq!(closures, 1, "the closure arrives once");
    let (status, log) = agent.terminate(Duration::from_secs(30));
    assert!(status.success(), "run exited {status}:\n{log}");
}

/// The series of a metrics file: `name{labels}` to value.
fn series(w: &World) -> BTreeMap<String, f64> {
    let text = std::fs::read_to_string(w.files.metrics_dir.join("felhom_transactions.prom"))
        .expect("felhom_transactions.prom");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (name, v) = l.rsplit_once(' ')?;
            Some((name.to_string(), v.parse().ok()?))
        })
        .collect()
}

#[test]
fn a_resolution_killed_before_its_spool_reaches_the_hub_once_after_a_restart() {
    let hub = DevHub::start(DevHubOptions::default());
    let w = World::with_options(
        demo_scenario(),
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    );
    let (_origin, stuck) = needs_human(&w, 166);
    let run = run_killed(
        &w,
        &[
            "journal",
            "resolve",
            &stuck,
            "--reason",
            "restored by hand",
            "--json",
        ],
        "after-resolve-journal",
    );
    assert_eq!(run.code, None, "killed: {}\n{}", run.stdout, run.stderr);
    let t = w.journal_txn(&stuck);
    assert_eq!(t["resolution"]["reason"], "restored by hand", "{t:#}");
    let spool = w.state_dir().join("outbox").join("spool");
    let spooled = std::fs::read_dir(&spool)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    std::fs::read_to_string(e.path()).is_ok_and(|f| f.contains("restored by hand"))
                })
                .count()
        })
        .unwrap_or(0);
    assert_eq!(spooled, 0, "the kill came before the spool");

    let closures = |s: &felhom_tests::devhub::HubState| {
        s.events
            .iter()
            .filter(|(_, e)| {
                e.txn.to_string() == stuck
                    && e.detail
                        .as_deref()
                        .is_some_and(|d| d.contains("restored by hand"))
            })
            .count()
    };
    for start in 0..2 {
        let agent = AgentDaemon::spawn(&w.files.config_path, FAST_TIMING, &[]);
        // This start's session is up (its spool moved into the outbox and sent).
        let state = hub.wait_for("the resolution event", Duration::from_secs(60), |s| {
            closures(s) > 0 && s.hellos.len() > start
        });
        assert_eq!(closures(&state), 1, "start {start}: applied once");
        agent.wait_for_log("connected to the hub", Duration::from_secs(30));
        let (status, log) = agent.terminate(Duration::from_secs(30));
        assert!(status.success(), "run exited {status}:\n{log}");
        let notes = std::fs::read_dir(w.state_dir().join("unreported"))
            .map(|d| d.count())
            .unwrap_or(0);
        assert_eq!(notes, 0, "nothing left to report after start {start}");
    }
    let state = hub.wait_for("the state", Duration::from_secs(1), |_| true);
    assert_eq!(closures(&state), 1);
}

#[test]
fn old_settled_transactions_move_to_the_archive_and_claims_stay() {
    let w = World::demo();
    let mut config = std::fs::read_to_string(&w.files.config_path).expect("config");
    config.push_str("\n[journal]\nkeep_days = 0\n");
    std::fs::write(&w.files.config_path, config).expect("config");

    // Five green provisions: each writing command first moves the settled ones before it to
    // the archive. The counters never go down for it.
    let mut done = Vec::new();
    let mut seen: BTreeMap<String, f64> = BTreeMap::new();
    for vmid in 170..175 {
        let run = w.agent(&["--selftest=provision", "-vmid", &vmid.to_string(), "--json"]);
        assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
        done.push(text(&run.json()["txn"]));
        let now = series(&w);
        for (name, before) in &seen {
            let after = now.get(name).copied().unwrap_or(0.0);
            assert!(
                after >= *before,
                "{name} went down from {before} to {after} after the provision of {vmid}"
            );
        }
        seen = now;
    }
    let ok = "felhom_transactions_total{kind=\"selftest-provision\",outcome=\"ok\"}";
    assert_eq!(seen.get(ok), Some(&5.0), "{seen:#?}");
    let validated = seen
        .iter()
        .filter(|(k, _)| {
            k.starts_with("felhom_phase_duration_seconds_count{kind=\"selftest-provision\"")
        })
        .map(|(_, v)| *v)
        .fold(0.0, f64::max);
    assert!(
        validated >= 5.0,
        "each provision's phases are counted: {seen:#?}"
    );

    // The next writing command compacts: the settled transactions move, the kept one stays.
    let kept = keep(&w, 175);
    let after = series(&w);
    for (name, before) in &seen {
        let now = after.get(name).copied().unwrap_or(0.0);
        assert!(now >= *before, "{name} went down from {before} to {now}");
    }
    // Five archived and the kept one (settled ok, its claim kept).
    assert_eq!(after.get(ok), Some(&6.0), "{after:#?}");
    // `journal --stats` counts the archived ones too, with their phase durations.
    let run = w.agent(&["journal", "--stats", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let stats = run.json();
    assert_eq!(stats["transactions"], json!(6), "{stats:#}");
    let kind = stats["kinds"]
        .as_array()
        .expect("kinds")
        .iter()
        .find(|k| k["kind"] == "selftest-provision")
        .unwrap_or_else(|| panic!("{stats:#}"));
    assert_eq!(kind["outcomes"]["ok"], json!(6), "{stats:#}");
    assert!(
        kind["phases"]
            .as_array()
            .expect("phases")
            .iter()
            .any(|p| p["count"].as_u64() >= Some(6)),
        "the archived phase durations count: {stats:#}"
    );

    let journal_dir = w.state_dir().join("journal");
    let mut entries: Vec<String> = std::fs::read_dir(&journal_dir)
        .expect("journal dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    entries.sort();
    assert_eq!(
        entries,
        vec![format!("{kept}.log"), "archive".to_string()],
        "the kept transaction's file and the archive, nothing else"
    );
    let mut in_archive: Vec<String> = std::fs::read_dir(journal_dir.join("archive"))
        .expect("archive dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    in_archive.sort();
    assert_eq!(in_archive.len(), 3, "{in_archive:?}");
    assert_eq!(
        in_archive[0], ".lock",
        "the compaction lock: {in_archive:?}"
    );
    assert!(
        in_archive[1].len() == "YYYY-MM.log".len() && in_archive[1].ends_with(".log"),
        "one month's file: {in_archive:?}"
    );
    assert_eq!(in_archive[2], "totals.json", "{in_archive:?}");

    // `journal` lists the kept one and, having fewer than 50 settled ones, the five from the
    // archive; `--all` lists the same six.
    let run = w.agent(&["journal", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    let listed: Vec<String> = doc["transactions"]
        .as_array()
        .expect("transactions")
        .iter()
        .map(|t| text(&t["txn"]))
        .collect();
    let mut six = done.clone();
    six.push(kept.clone());
    assert_eq!(listed, six, "{doc:#}");
    assert_eq!(doc["not_shown"], json!(0), "{doc:#}");
    let run = w.agent(&["journal", "--all", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    let live: Vec<String> = doc["transactions"]
        .as_array()
        .expect("transactions")
        .iter()
        .map(|t| text(&t["txn"]))
        .collect();
    assert_eq!(live, vec![kept.clone()], "{doc:#}");
    let archived = doc["archived"].as_array().expect("archived");
    let ids: Vec<String> = archived.iter().map(|t| text(&t["txn"])).collect();
    assert_eq!(ids, done, "{doc:#}");
    assert!(
        archived.iter().all(|t| t["destroyed"] == json!(true)),
        "{doc:#}"
    );

    // The kept guest's claim is untouched: its gated destroy still runs.
    let run = w.agent(&["destroy", "-vmid", "175", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(w.pve.deletes_for(175).len(), 1);
    let last = series(&w);
    for (name, before) in &after {
        let now = last.get(name).copied().unwrap_or(0.0);
        assert!(now >= *before, "{name} went down from {before} to {now}");
    }
}

#[test]
fn journal_lists_what_may_own_a_guest_and_the_last_50_settled_and_says_what_it_leaves_out() {
    let w = World::demo();
    let kept = keep(&w, 176);
    // Sixty settled transactions after it: destroys of a guest the agent never created (the
    // foreign container 101), each refused and journaled. (A vmid no guest holds is "nothing
    // to destroy" and journals nothing.)
    let mut refused = Vec::new();
    for _ in 600..660 {
        let run = w.agent(&["destroy", "-vmid", "101", "--json"]);
        assert_eq!(run.code, Some(7), "{}\n{}", run.stdout, run.stderr);
        refused.push(text(&run.json()["txn"]));
    }
    let run = w.agent(&["journal", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    let listed: Vec<String> = doc["transactions"]
        .as_array()
        .expect("transactions")
        .iter()
        .map(|t| text(&t["txn"]))
        .collect();
    let mut want = vec![kept.clone()];
    want.extend(refused[10..].iter().cloned());
    assert_eq!(listed.len(), 51, "{doc:#}");
    assert_eq!(listed, want, "the kept one and the 50 newest settled");
    assert_eq!(doc["not_shown"], json!(10), "{doc:#}");

    let run = w.agent(&["journal"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout
            .contains("10 older settled transaction(s) not shown")
            && run.stdout.contains("journal --all"),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains(&kept) && !run.stdout.contains(&refused[9]));

    let run = w.agent(&["journal", "--all", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    assert_eq!(doc["transactions"].as_array().expect("rows").len(), 61);
    assert_eq!(doc["archived"].as_array().expect("archived").len(), 0);
}

#[test]
fn the_help_of_each_journal_verb_says_what_it_does_never_does_and_its_exit_codes() {
    for (verb, never, refused) in [
        ("refresh", "Never writes to PVE", ", 6 "),
        ("resolve", "Never touches PVE", ", 3 refused"),
        ("cancel", "ownership gate", ", 3 refused"),
    ] {
        let out = std::process::Command::new(felhom_tests::agent::agent_bin())
            .args(["journal", verb, "--help"])
            .output()
            .expect("run agent");
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{verb}: {help}");
        assert!(help.contains(never), "{verb}: {help}");
        assert!(help.contains("Exit codes: 0"), "{verb}: {help}");
        assert!(help.contains(refused), "{verb}: {help}");
    }
}

#[test]
fn the_daemon_refreshes_the_journal_and_tells_the_hub_of_a_closure() {
    let hub = DevHub::start(DevHubOptions::default());
    let w = World::with_options(
        demo_scenario(),
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    );
    let (_origin, stuck) = needs_human(&w, 168);
    let kept = keep(&w, 169);
    remove_by_hand(&w, 168);
    remove_by_hand(&w, 169);
    let before = w.pve.requests().len();

    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("FELHOM_AGENT_REFRESH_MS", "300")],
    );
    hub.wait_for("the closure by the refresh", Duration::from_secs(60), |s| {
        s.events.iter().any(|(_, e)| {
            e.txn.to_string() == stuck
                && e.detail
                    .as_deref()
                    .is_some_and(|d| d.contains("guest gone"))
        })
    });
    let t = w.journal_txn(&stuck);
    assert_eq!(t["resolution"]["by"], "refresh", "{t:#}");
    let k = w.journal_txn(&kept);
    assert_eq!(k["destroy_armed"], json!(false), "{k:#}");
    assert!(text(&k["disarmed"]).contains("journal refresh"), "{k:#}");
    let (status, log) = agent.terminate(Duration::from_secs(30));
    assert!(status.success(), "run exited {status}:\n{log}");
    assert!(
        writes_since(&w, before).is_empty(),
        "the refresh wrote to PVE"
    );
}

/// A `journal resolve` killed after its journal record and before its spool, while the daemon
/// runs: the running daemon (no restart) spools the closure on its periodic pass and the hub
/// applies it once; the note is gone afterwards.
#[test]
fn a_resolution_killed_before_its_spool_reaches_the_hub_while_the_daemon_runs() {
    let hub = DevHub::start(DevHubOptions::default());
    let w = World::with_options(
        demo_scenario(),
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    );
    let (_origin, stuck) = needs_human(&w, 168);
    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("FELHOM_AGENT_UNREPORTED_MS", "300")],
    );
    hub.wait_for("the session", Duration::from_secs(30), |s| s.sessions == 1);
    let run = run_killed(
        &w,
        &[
            "journal",
            "resolve",
            &stuck,
            "--reason",
            "handled while the daemon ran",
            "--json",
        ],
        "after-resolve-journal",
    );
    assert_eq!(run.code, None, "killed: {}\n{}", run.stdout, run.stderr);
    let closures = |s: &felhom_tests::devhub::HubState| {
        s.events
            .iter()
            .filter(|(_, e)| {
                e.txn.to_string() == stuck
                    && e.detail
                        .as_deref()
                        .is_some_and(|d| d.contains("handled while the daemon ran"))
            })
            .count()
    };
    let state = hub.wait_for("the resolution event", Duration::from_secs(30), |s| {
        closures(s) > 0
    });
    assert_eq!(closures(&state), 1, "applied once");
    assert_eq!(state.sessions, 1, "it took a restart");
    let (status, log) = agent.terminate(Duration::from_secs(30));
    assert!(status.success(), "run exited {status}:\n{log}");
    let notes = std::fs::read_dir(w.state_dir().join("unreported"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(notes, 0, "the note is still there");
}

/// A provision killed after its marker was read back (armed, before the start): `journal`
/// shows it `interrupted` with the command that resumes it, never as failed; `journal resume
/// TXN` runs it on from there (start, launch proof, bootstrap, checks, report, gated destroy)
/// and exits 0 with `ok`; a second resume is refused as not open.
#[test]
fn resume_runs_an_interrupted_provision_to_its_end() {
    let w = World::demo();
    let first = run_killed(
        &w,
        &["--selftest=provision", "-vmid", "169", "--json"],
        "after-journal:5",
    );
    assert_eq!(first.code, None, "not killed: {}", first.stdout);
    let t = w
        .journal()
        .into_iter()
        .find(|t| t["vmid"] == 169)
        .expect("open transaction");
    let txn = text(&t["txn"]);
    assert_eq!(t["interrupted"], json!(true), "{t:#}");
    assert_eq!(
        text(&t["resume"]),
        format!("felhom-agent journal resume {txn}"),
        "{t:#}"
    );
    assert!(t["outcome"].is_null() && t["error"].is_null(), "{t:#}");
    let human = w.agent(&["journal"]);
    let row = human
        .stdout
        .lines()
        .find(|l| l.starts_with(&txn))
        .unwrap_or_default()
        .to_string();
    assert!(row.contains("interrupted"), "{}", human.stdout);
    assert!(
        human
            .stdout
            .contains(&format!("felhom-agent journal resume {txn}")),
        "{}",
        human.stdout
    );
    let help = w.agent(&["journal", "resume", "--help"]);
    assert_eq!(help.code, Some(0), "{}", help.stderr);
    assert!(
        help.stdout.contains("from its last")
            && help.stdout.contains("Exit codes")
            && help.stdout.contains("txn_not_open"),
        "{}",
        help.stdout
    );

    let run = w.agent(&["journal", "resume", &txn, "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    assert_eq!(w.pve.deletes_for(169).len(), 1);
    let t = w.journal_txn(&txn);
    assert_eq!(t["interrupted"], json!(false), "{t:#}");
    assert_eq!(
        w.pve
            .requests()
            .iter()
            .filter(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/lxc")
            .count(),
        1,
        "the restore was sent again"
    );

    let run = w.agent(&["journal", "resume", &txn, "--json"]);
    assert_eq!(run.code, Some(3), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.json()["error"]["code"], "txn_not_open");
}

/// A restore test stopped before its transaction ended shows as `interrupted` in `journal`
/// (and `--kind restore-test`) as soon as no process holds its vmid's lock, even while the pid
/// its lock file names is alive: the daemon that ran it lives on, or after a reboot another
/// process has that pid (a `sleep` stands for either here). While a process holds the lock
/// for it, it is open (a run in progress), not interrupted.
#[test]
fn a_stopped_restore_test_shows_interrupted_at_once_even_while_the_pid_of_its_lock_lives() {
    let w = World::demo();
    let killed = run_killed(&w, &["--selftest=restore", "--json"], "after-journal:3");
    assert_eq!(killed.code, None, "not killed: {}", killed.stdout);
    let t = w
        .journal()
        .into_iter()
        .find(|t| t["kind"] == "restore-test" && t["outcome"].is_null())
        .expect("the open restore test");
    let txn = text(&t["txn"]);
    let vmid = u32::try_from(t["vmid"].as_u64().expect("vmid")).expect("vmid");
    assert!((990_000..=990_009).contains(&vmid), "{t:#}");
    // The demo's one pool guest with a backup: the copy proves guest 200's.
    assert_eq!(t["guest"], json!(200), "{t:#}");

    // A live process named in the lock file, holding no lock (ended when the test ends).
    struct Sleeper(std::process::Child);
    impl Drop for Sleeper {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let alive = Sleeper(
        std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .expect("sleep"),
    );
    let lock = w
        .state_dir()
        .join("locks")
        .join(format!("vmid-{vmid}.lock"));
    std::fs::write(&lock, format!("pid {}\ntxn {txn}\n", alive.0.id())).expect("lock file");
    let t = w.journal_txn(&txn);
    assert_eq!(t["interrupted"], json!(true), "{t:#}");
    assert_eq!(
        text(&t["resume"]),
        format!("felhom-agent journal resume {txn}"),
        "{t:#}"
    );
    let table = w.agent(&["journal", "--kind", "restore-test"]);
    assert_eq!(table.code, Some(0), "{}", table.stderr);
    let row: Vec<&str> = table
        .stdout
        .lines()
        .find(|l| l.starts_with(&txn))
        .unwrap_or_else(|| panic!("no row for {txn}:\n{}", table.stdout))
        .split_whitespace()
        .collect();
    assert_eq!(row[3], "interrupted", "{row:?}\n{}", table.stdout);

    // A process holding the lock for it: running, so open.
    {
        let txn_ulid = ulid::Ulid::from_string(&txn).expect("ulid");
        let _held = VmidLock::try_acquire(&w.state_dir(), vmid, Some(txn_ulid)).expect("lock");
        let t = w.journal_txn(&txn);
        assert_eq!(t["interrupted"], json!(false), "{t:#}");
        let table = w.agent(&["journal", "--kind", "restore-test"]);
        let row: Vec<&str> = table
            .stdout
            .lines()
            .find(|l| l.starts_with(&txn))
            .unwrap_or_default()
            .split_whitespace()
            .collect();
        assert_eq!(row.get(3), Some(&"open"), "{row:?}\n{}", table.stdout);
    }
    drop(alive);
}
