//! The daemon stopped in the middle of a provision, with the hub dispatching work:
//! - SIGTERM while the restore task runs at PVE: the agent stops waiting (never the task: no
//!   `DELETE /nodes/{node}/tasks/{upid}`), journals where the transaction stands and exits
//!   promptly, also when the SIGTERM comes while a start follows the journaled UPID; the next
//!   start resumes the transaction from its journal: it follows the UPID to its end, marks,
//!   starts, bootstraps and checks the guest and destroys it, exactly as if it had not been
//!   stopped; the restore is never sent again, and the provision's one result reaches the hub:
//!   `ok`, every check passed.
//! - SIGKILL during the bootstrap: the next start runs the bootstrap again from its start (the
//!   profile is idempotent) and the provision ends `ok`.
//! - A stop during a long restore: the restarted daemon is READY within seconds while it
//!   follows the task, and the provision ends `ok`.
//! - SIGKILL right after a phase's journal record: the phase's event reaches the hub after the
//!   restart, applied exactly once (its id derives from the transaction and the record).
//!
//! Counted at the fake PVE (the requests it received) and at the development hub (what it
//! applied).

use std::time::{Duration, Instant};

use felhom_agent::hub::outbox::event_message_id;
use felhom_agent::provision::Journal;
use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
use felhom_tests::fakepve::{AgentOptions, RecordedRequest};
use felhom_tests::world::World;
use hub_protocol::{DispatchAction, ErrorCode, Event, Outcome, TxnId};

const WAIT: Duration = Duration::from_secs(60);

fn provision(vmid: u32, keep: bool) -> DispatchAction {
    DispatchAction::Provision {
        vmid,
        from: "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst".to_string(),
        storage: "local-lvm".to_string(),
        keep,
        profile: None,
        isolate_network: None,
    }
}

fn world_with_hub(hub: &DevHub) -> World {
    World::with_options(
        felhom_tests::fakepve::demo_scenario(),
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    )
}

fn is_restore(r: &RecordedRequest) -> bool {
    r.method == "POST" && r.api_path() == "/nodes/pve1/lxc"
}

/// `DELETE /nodes/{node}/tasks/{upid}`: PVE's task stop.
fn is_task_stop(r: &RecordedRequest) -> bool {
    r.method == "DELETE" && r.api_path().starts_with("/nodes/pve1/tasks/")
}

fn journal_upid(w: &World, vmid: u32) -> Option<String> {
    let journal = w.agent(&["journal", "--json"]).json();
    journal["transactions"]
        .as_array()?
        .iter()
        .find(|t| t["vmid"] == vmid)
        .and_then(|t| t["upid"].as_str())
        .map(str::to_string)
}

fn task_status(w: &World, upid: &str) -> Option<String> {
    w.pve
        .tasks()
        .iter()
        .find(|t| t["upid"].as_str() == Some(upid))
        .and_then(|t| t["status"].as_str().map(str::to_string))
}

#[test]
fn sigterm_during_a_restore_aborts_no_task_and_the_next_start_resumes_it_to_ok() {
    let hub = DevHub::start(DevHubOptions::default());
    let w = world_with_hub(&hub);
    // A restore of 8 real seconds, so SIGTERM lands inside it.
    w.pve
        .set(serde_json::json!({"time_scale": 0.02, "ct_secs": {"create": 400}}));
    let path = w.path();
    let env = [("PATH", path.as_str())];
    let agent = AgentDaemon::spawn(&w.files.config_path, FAST_TIMING, &env);
    hub.wait_for("the session", WAIT, |s| s.sessions == 1);

    let txn = hub.dispatch(provision(6200, false));
    // Wait until the restore's UPID is journaled, then SIGTERM.
    let deadline = Instant::now() + WAIT;
    let upid = loop {
        if let Some(u) = journal_upid(&w, 6200) {
            break u;
        }
        assert!(Instant::now() < deadline, "no UPID journaled for 6200");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        task_status(&w, &upid).as_deref(),
        Some("running"),
        "the restore task ended before the SIGTERM: the test proves nothing"
    );
    let term = Instant::now();
    let (status, log) = agent.terminate(Duration::from_secs(20));
    let took = term.elapsed();
    assert!(status.success(), "run exited {status}:\n{log}");
    // Prompt: well before the restore ends, and without waiting out the grace (5 s here).
    assert!(
        took < Duration::from_secs(4),
        "took {took:?} to stop:\n{log}"
    );
    assert_eq!(
        task_status(&w, &upid).as_deref(),
        Some("running"),
        "the agent waited for the task instead of stopping"
    );
    assert!(
        log.contains(&format!("stopped waiting for PVE task {upid}")),
        "the shutdown does not say where the transaction stands:\n{log}"
    );
    assert!(!hub.snapshot().results.contains_key(&txn));
    assert_eq!(journal_upid(&w, 6200).as_deref(), Some(upid.as_str()));

    // The next start follows the journaled UPID; a SIGTERM while it does stops that waiting
    // too, just as promptly, and still aborts nothing.
    let agent = AgentDaemon::spawn(&w.files.config_path, FAST_TIMING, &env);
    agent.wait_for_log("resuming a transaction a previous run left open", WAIT);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        task_status(&w, &upid).as_deref(),
        Some("running"),
        "the restore task ended before the second SIGTERM: the test proves nothing"
    );
    let term = Instant::now();
    let (status, log) = agent.terminate(Duration::from_secs(20));
    let took = term.elapsed();
    assert!(status.success(), "run exited {status}:\n{log}");
    assert!(
        took < Duration::from_secs(4),
        "took {took:?} to stop:\n{log}"
    );
    assert_eq!(task_status(&w, &upid).as_deref(), Some("running"));
    assert!(!hub.snapshot().results.contains_key(&txn));

    // The start after that resumes the transaction: the journaled UPID followed to its end,
    // then the marker, start, launch proof, bootstrap, checks, report and the gated destroy,
    // as if it had never been stopped.
    let agent = AgentDaemon::spawn(&w.files.config_path, FAST_TIMING, &env);
    let state = hub.wait_for("the result after the restart", WAIT, |s| {
        s.results.contains_key(&txn)
    });
    assert_eq!(state.results[&txn].len(), 1, "the result was applied twice");
    // Each stop was told to the hub before the result: an event of the open transaction with
    // the code `interrupted`, one per stop (the resume's own stop is a second one).
    let stops: Vec<&Event> = state
        .events
        .iter()
        .map(|(_, e)| e)
        .filter(|e| {
            e.txn == txn
                && e.error
                    .as_ref()
                    .is_some_and(|x| x.code == ErrorCode::Interrupted)
        })
        .collect();
    assert_eq!(stops.len(), 2, "{:#?}", state.events);
    assert!(
        stops.iter().all(|e| e
            .detail
            .as_deref()
            .is_some_and(|d| d.contains("journal resume"))),
        "{stops:#?}"
    );
    let result = &state.results[&txn][0].1;
    assert_eq!(result.vmid, Some(6200));
    assert_eq!(result.outcome, Outcome::Ok, "{result:?}\n{}", agent.log());
    assert!(result.error.is_none(), "{result:?}");
    assert!(!result.checks.is_empty(), "no checks ran: {result:?}");
    assert!(
        result
            .checks
            .iter()
            .all(|c| c.status == felhom_agent::guest::checks::CheckStatus::Pass),
        "{:?}",
        result.checks
    );
    assert!(
        result.destroyed,
        "the provision did not destroy its guest at its end: {result:?}"
    );
    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");

    let requests = w.pve.requests();
    assert_eq!(
        requests.iter().filter(|r| is_restore(r)).count(),
        1,
        "the restore was sent again"
    );
    let stops: Vec<&RecordedRequest> = requests.iter().filter(|r| is_task_stop(r)).collect();
    assert!(stops.is_empty(), "a PVE task was stopped: {stops:?}");
    assert_eq!(task_status(&w, &upid).as_deref(), Some("stopped"));
    assert!(w.pve.guest(6200).is_none(), "the guest is still there");
    assert_eq!(
        w.pve.deletes_for(6200).len(),
        1,
        "the guest was not deleted exactly once"
    );
    for vmid in [101, 200, 300, 990000, 990001] {
        assert!(w.pve.writes_for(vmid).is_empty(), "{vmid} was written");
    }
}

#[test]
fn a_phase_event_survives_a_sigkill_right_after_its_journal_record() {
    let hub = DevHub::start(DevHubOptions::default());
    let w = world_with_hub(&hub);
    let path = w.path();
    // The third journal record of the provision: the daemon is killed right after it, before
    // anything else happens.
    const RECORD: u32 = 3;
    let kill = format!("after-journal:{RECORD}");
    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str()), ("FELHOM_AGENT_KILL_AT", &kill)],
    );
    hub.wait_for("the session", WAIT, |s| s.sessions == 1);
    let txn = hub.dispatch(provision(6300, true));
    let deadline = Instant::now() + WAIT;
    let mut agent = agent;
    while agent.alive() {
        assert!(
            Instant::now() < deadline,
            "the kill switch did not fire:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let killed_log = agent.log();
    assert!(killed_log.contains("SIGKILL now"), "{killed_log}");

    // What the journal holds: the record the kill followed.
    let journaled = Journal::open(&w.state_dir())
        .expect("journal")
        .get(txn.ulid())
        .expect("read")
        .expect("the transaction is journaled");
    assert_eq!(journaled.records, u64::from(RECORD));
    let phase = journaled.state.phase();
    let id = event_message_id(TxnId::from_ulid(txn.ulid()), journaled.records);

    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str())],
    );
    let state = hub.wait_for("the result after the restart", WAIT, |s| {
        s.results.contains_key(&txn)
    });
    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
    drop(state);
    let state = hub.snapshot();
    let applied: Vec<_> = state.events.iter().filter(|(m, _)| *m == id).collect();
    assert_eq!(
        applied.len(),
        1,
        "the event of journal record {RECORD} was applied {} times; events: {:?}",
        applied.len(),
        state
            .events
            .iter()
            .filter(|(_, e)| e.txn == txn)
            .map(|(m, e)| (m, e.phase, e.detail.clone()))
            .collect::<Vec<_>>()
    );
    // It was stored by the next start (the kill came before the first run could store it).
    let sessions: Vec<u64> = state
        .frames
        .iter()
        .filter(|f| f.id == Some(id))
        .map(|f| f.session)
        .collect();
    assert!(
        !sessions.is_empty() && sessions.iter().all(|s| *s == 2),
        "the event of record {RECORD} came in sessions {sessions:?}"
    );
    let event = &applied[0].1;
    assert_eq!(event.txn, txn);
    assert_eq!(event.phase, phase);
    assert_eq!(event.vmid, Some(6300));
    assert_eq!(state.results[&txn].len(), 1);
    assert_eq!(
        w.pve.requests().iter().filter(|r| is_restore(r)).count(),
        1,
        "the restore was sent again"
    );
}

fn journaled_step(w: &World, txn: TxnId) -> String {
    let journaled = Journal::open(&w.state_dir())
        .expect("journal")
        .get(txn.ulid())
        .expect("read")
        .expect("the transaction is journaled");
    journaled.state.step().as_str().to_string()
}

fn wait_dead(agent: &mut AgentDaemon) -> String {
    let deadline = Instant::now() + WAIT;
    while agent.alive() {
        assert!(
            Instant::now() < deadline,
            "the kill switch did not fire:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    agent.log()
}

/// SIGKILL while the bootstrap runs in the guest (the profile ran, its result not journaled):
/// the guest carries its marker and birth identity and still runs, so its state can be
/// trusted; the next start runs the (idempotent) bootstrap again from its start, then the
/// checks, and the provision ends `ok` with its guest destroyed. One result, one restore.
#[test]
fn sigkill_during_the_bootstrap_reruns_it_and_the_provision_ends_ok() {
    let hub = DevHub::start(DevHubOptions::default());
    let w = world_with_hub(&hub);
    let path = w.path();
    let mut agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[
            ("PATH", path.as_str()),
            ("FELHOM_AGENT_KILL_AT", "during-bootstrap"),
        ],
    );
    hub.wait_for("the session", WAIT, |s| s.sessions == 1);
    let txn = hub.dispatch(provision(6400, false));
    let killed_log = wait_dead(&mut agent);
    assert!(killed_log.contains("SIGKILL now"), "{killed_log}");
    assert_eq!(journaled_step(&w, txn), "bootstrap");
    assert!(!hub.snapshot().results.contains_key(&txn));
    // Between the runs `journal` shows it interrupted, with the command that resumes it.
    let listing = w.agent(&["journal"]);
    assert!(
        listing.stdout.contains("interrupted")
            && listing
                .stdout
                .contains(&format!("felhom-agent journal resume {}", txn.ulid())),
        "{}",
        listing.stdout
    );

    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str())],
    );
    let state = hub.wait_for("the result after the restart", WAIT, |s| {
        s.results.contains_key(&txn)
    });
    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
    assert!(
        log.contains("resuming a transaction a previous run left open"),
        "{log}"
    );
    assert_eq!(state.results[&txn].len(), 1, "the result was applied twice");
    let result = &state.results[&txn][0].1;
    assert_eq!(result.outcome, Outcome::Ok, "{result:?}\n{log}");
    assert!(result.error.is_none(), "{result:?}");
    assert!(
        !result.checks.is_empty()
            && result
                .checks
                .iter()
                .all(|c| c.status == felhom_agent::guest::checks::CheckStatus::Pass),
        "{:?}",
        result.checks
    );
    assert!(result.destroyed, "{result:?}");
    let requests = w.pve.requests();
    assert_eq!(requests.iter().filter(|r| is_restore(r)).count(), 1);
    assert!(!requests.iter().any(is_task_stop), "a PVE task was stopped");
    assert_eq!(w.pve.deletes_for(6400).len(), 1);
    assert!(w.pve.guest(6400).is_none(), "the guest is still there");
}
