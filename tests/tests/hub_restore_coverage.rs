//! The restore test as the hub sees it: every result and event of a restore-test copy names
//! the guest and the backup it proves, and after every run the hub of protocol version 2
//! receives the coverage table (the rows `restore-report --json` shows), whether the hub
//! dispatched the run or the command line (the timer) ran it. A hub of version 1 gets the same
//! results and events, no coverage, and a session that works.

use std::time::Duration;

use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, HubState, FAST_TIMING};
use felhom_tests::fakepve::AgentOptions;
use felhom_tests::world::World;
use hub_protocol::{
    AgentEnvelope, CoverageStatus, DispatchAction, Outcome, TxnId, TxnKind, PROTOCOL_VERSION,
};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(120);

/// The backup of the demo's container 200.
const BACKUP_200: &str = "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst";

/// The demo pool without its VM, and three more containers, each with a backup made an hour
/// ago: four guests whose backups are due.
fn pool_of_four() -> Value {
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let guests = scenario["guests"].as_array_mut().expect("guests");
    guests.retain(|g| g["vmid"] != json!(300));
    for (vmid, name) in [(210, "shop"), (220, "shop-db"), (230, "mail")] {
        guests.push(json!({"vmid": vmid, "type": "lxc", "name": name, "node": "pve1",
            "status": "running", "pool": "felhom", "config": {"unprivileged": "1", "memory": "512"}}));
    }
    let volumes = scenario["volumes"]["local"]
        .as_array_mut()
        .expect("volumes");
    for v in volumes.iter_mut() {
        v["ctime"] = json!(now - 3600);
    }
    for vmid in [210, 220, 230] {
        volumes.push(json!({
            "volname": format!("backup/vzdump-lxc-{vmid}-2026_12_01-00_00_00.tar.zst"),
            "vmid": vmid, "ctime": now - 3600, "config": {"unprivileged": "1", "memory": "512"}}));
    }
    scenario
}

fn backup_of(vmid: u32) -> String {
    if vmid == 200 {
        BACKUP_200.to_string()
    } else {
        format!("local:backup/vzdump-lxc-{vmid}-2026_12_01-00_00_00.tar.zst")
    }
}

fn world_for(hub: &DevHub, scenario: Value) -> World {
    let opts = AgentOptions {
        hub: Some(hub.hub_options()),
        ..AgentOptions::default()
    };
    World::with_options(scenario, &opts)
}

fn daemon(w: &World) -> AgentDaemon {
    let path = w.path();
    AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str())],
    )
}

/// The restore-test results the hub applied, by the guest they name: (guest, txn, backup,
/// outcome).
fn restore_results(state: &HubState) -> Vec<(Option<u32>, TxnId, Option<String>, Outcome)> {
    let mut out: Vec<_> = state
        .results
        .values()
        .flatten()
        .map(|(_, r)| r)
        .filter(|r| r.kind == TxnKind::SelftestRestore)
        .map(|r| (r.guest, r.txn, r.backup.clone(), r.outcome))
        .collect();
    out.sort_by_key(|(g, t, _, _)| (*g, *t));
    out
}

/// Every event of a restore-test copy names the guest and backup its result names.
fn assert_events_name_their_copy(state: &HubState) {
    let copies: std::collections::BTreeMap<TxnId, (Option<u32>, Option<String>)> = state
        .results
        .values()
        .flatten()
        .map(|(_, r)| (r.txn, (r.guest, r.backup.clone())))
        .collect();
    let events: Vec<_> = state
        .events
        .iter()
        .map(|(_, e)| e)
        .filter(|e| e.kind == TxnKind::SelftestRestore)
        .collect();
    assert!(!events.is_empty(), "no restore-test event reached the hub");
    for e in events {
        assert!(e.guest.is_some() && e.backup.is_some(), "{e:?}");
        if let Some(named) = copies.get(&e.txn) {
            assert_eq!(&(e.guest, e.backup.clone()), named, "{e:?}");
        }
    }
}

/// The frames of a type the hub received.
fn frames_of(state: &HubState, type_name: &str) -> usize {
    state
        .frames
        .iter()
        .filter(|f| {
            f.type_name == Some(type_name)
                || serde_json::from_str::<Value>(&f.text)
                    .is_ok_and(|v| v["type"] == json!(type_name))
        })
        .count()
}

/// `restore-report --json`'s rows, without what changes by the second (the ages).
fn report_rows(w: &World) -> Value {
    let run = w.agent(&["restore-report", "--json"]);
    let mut doc = run.json();
    strip_ages(&mut doc["guests"]);
    doc["guests"].take()
}

fn strip_ages(rows: &mut Value) {
    for row in rows.as_array_mut().expect("rows") {
        let row = row.as_object_mut().expect("row");
        row.remove("backup_age");
        if let Some(p) = row.get_mut("proven").and_then(Value::as_object_mut) {
            p.remove("age_seconds");
        }
    }
}

#[test]
fn a_dispatched_restore_test_names_guest_and_backup_and_a_v2_hub_gets_the_coverage() {
    let hub = DevHub::start(DevHubOptions::default());
    let w = world_for(&hub, pool_of_four());
    let agent = daemon(&w);
    let state = hub.wait_for("the session", WAIT, |s| s.sessions == 1);
    assert_eq!(state.session_versions, vec![PROTOCOL_VERSION]);

    let txn = hub.dispatch(DispatchAction::RestoreTest { dry_run: false });
    let state = hub.wait_for("the coverage table and four copies' results", WAIT, |s| {
        !s.coverages.is_empty() && restore_results(s).len() == 4
    });

    // The dispatch's own copy proves the longest unproven guest's newest backup: 200's.
    let own = &state.results[&txn][0].1;
    assert_eq!(own.outcome, Outcome::Ok, "{own:?}");
    assert_eq!(own.guest, Some(200), "{own:?}");
    assert_eq!(own.backup.as_deref(), Some(BACKUP_200), "{own:?}");
    // Each frame carried them as it was sent.
    let frame = state
        .frames
        .iter()
        .find(|f| f.type_name == Some("result") && f.text.contains(&txn.to_string()))
        .expect("the result frame");
    let wire: Value = serde_json::from_str(&frame.text).expect("json");
    assert_eq!(wire["body"]["guest"], json!(200), "{wire}");
    assert_eq!(wire["body"]["backup"], json!(BACKUP_200), "{wire}");
    assert_eq!(wire["v"], json!(PROTOCOL_VERSION));

    // Every copy's result names its guest and the backup it proved.
    let results = restore_results(&state);
    let named: Vec<(Option<u32>, Option<String>, Outcome)> = results
        .iter()
        .map(|(g, _, b, o)| (*g, b.clone(), *o))
        .collect();
    assert_eq!(
        named,
        [200, 210, 220, 230]
            .into_iter()
            .map(|g| (Some(g), Some(backup_of(g)), Outcome::Ok))
            .collect::<Vec<_>>()
    );
    assert_events_name_their_copy(&state);

    // The table: every pool guest proven, each by the copy whose result the hub holds.
    let (id, table) = state.coverages.last().expect("a table").clone();
    assert_eq!(state.coverages.len(), 1, "one table per run");
    assert_eq!(table.node, "pve1");
    assert_eq!(table.guest_count, 4);
    let frame = state
        .frames
        .iter()
        .find(|f| f.id == Some(id))
        .expect("the coverage frame");
    let env: AgentEnvelope = hub_protocol::decode(&frame.text).expect("decodes");
    assert_eq!(env.v, 2);
    for row in &table.guests {
        assert_eq!(row.status, CoverageStatus::Proven, "{row:?}");
        assert!(!row.due, "{row:?}");
        let copy = results
            .iter()
            .find(|(g, _, _, _)| *g == Some(row.vmid))
            .expect("a copy of each guest");
        let proven = row.proven.as_ref().expect("proven");
        assert_eq!(proven.volid, backup_of(row.vmid));
        let test = row.last_test.as_ref().expect("its test");
        assert_eq!(
            (test.txn, test.volid.as_str()),
            (copy.1, proven.volid.as_str())
        );
    }
    assert_eq!(
        table.guests.iter().map(|r| r.vmid).collect::<Vec<_>>(),
        vec![200, 210, 220, 230]
    );
    // The same rows `restore-report --json` shows on the node (but the ages, which grew).
    let mut sent = serde_json::to_value(&table.guests).expect("json");
    strip_ages(&mut sent);
    assert_eq!(sent, report_rows(&w));

    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
    assert!(hub.snapshot().undecodable.is_empty());
}

#[test]
fn a_hub_of_protocol_version_1_gets_no_coverage_and_its_session_works() {
    let hub = DevHub::start(DevHubOptions {
        versions: vec![1],
        ..DevHubOptions::default()
    });
    let w = world_for(&hub, felhom_tests::fakepve::demo_scenario());
    let agent = daemon(&w);
    let state = hub.wait_for("the session", WAIT, |s| s.sessions == 1);
    assert_eq!(state.session_versions, vec![1]);
    assert!(state.hellos[0].protocol_versions.contains(&2));

    let txn = hub.dispatch(DispatchAction::RestoreTest { dry_run: false });
    let state = hub.wait_for("the restore test's result", WAIT, |s| {
        s.results.contains_key(&txn)
    });
    let result = &state.results[&txn][0].1;
    assert_eq!(result.outcome, Outcome::Ok, "{result:?}");
    // Optional fields of version 1: its hub gets them too.
    assert_eq!(
        (result.guest, result.backup.as_deref()),
        (Some(200), Some(BACKUP_200))
    );
    assert_events_name_their_copy(&state);

    // The table is dropped unsent, and the session goes on.
    agent.wait_for_log("which has no `coverage` message", WAIT);
    let inventory = hub.dispatch(DispatchAction::InventoryRequest);
    let state = hub.wait_for("the inventory", WAIT, |s| {
        s.inventory_replies(inventory) == 1
    });
    assert_eq!(frames_of(&state, "coverage"), 0);
    assert!(state.coverages.is_empty());
    assert!(state.undecodable.is_empty(), "{:?}", state.undecodable);
    assert!(
        state.protocol_errors.is_empty(),
        "{:?}",
        state.protocol_errors
    );
    assert_eq!(state.sessions, 1, "the session held");
    assert!(state.frames.iter().all(|f| f.session == 0
        || serde_json::from_str::<Value>(&f.text).is_ok_and(|v| v["v"] == json!(1))));

    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
    // Nothing waits for that hub.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let pending = rt.block_on(async {
        let (outbox, _) = felhom_agent::hub::Outbox::open(&w.state_dir()).expect("open the outbox");
        let pending = outbox.pending_after(0).await.expect("read");
        outbox.close().await;
        pending
    });
    assert!(
        pending
            .iter()
            .all(|o| !o.frame.contains("\"type\":\"coverage\"")),
        "{pending:?}"
    );
}

#[test]
fn a_restore_test_of_the_command_line_spools_its_coverage_for_the_daemon() {
    let hub = DevHub::start(DevHubOptions::default());
    let w = world_for(&hub, felhom_tests::fakepve::demo_scenario());
    let agent = daemon(&w);
    hub.wait_for("the session", WAIT, |s| s.sessions == 1);

    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.restore_copy()["guest"], json!(200));
    // The run's id is its first copy's transaction.
    let txn = TxnId::parse(run.json()["run"]["id"].as_str().expect("run id")).expect("a txn id");
    let state = hub.wait_for("the spooled result and table", WAIT, |s| {
        s.results.contains_key(&txn) && !s.coverages.is_empty()
    });
    let result = &state.results[&txn][0].1;
    assert_eq!(
        (result.guest, result.backup.as_deref(), result.outcome),
        (Some(200), Some(BACKUP_200), Outcome::Ok)
    );
    let table = &state.coverages[0].1;
    let row = table
        .guests
        .iter()
        .find(|r| r.vmid == 200)
        .expect("guest 200");
    assert_eq!(row.status, CoverageStatus::Proven, "{row:?}");
    assert_eq!(row.last_test.as_ref().map(|t| t.txn), Some(txn));
    // The run's own `--json` names the same coverage.
    let mut printed = run.json()["coverage"].take();
    strip_ages(&mut printed);
    let mut sent = serde_json::to_value(&table.guests).expect("json");
    strip_ages(&mut sent);
    assert_eq!(sent, printed);

    // A dry run works out no coverage and spools none.
    let dry = w.agent(&["--selftest=restore", "--dry-run", "--json"]);
    assert_eq!(dry.code, Some(0), "{}\n{}", dry.stdout, dry.stderr);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(hub.snapshot().coverages.len(), 1);
    assert!(w.spooled().is_empty(), "{:?}", w.spooled());

    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
}
