//! The hub restarted 20 times while a batch of dispatched provisions is under way (their PVE
//! tasks take time): every dispatch gets exactly one applied answer (a result per
//! transaction, an inventory per request), nothing is lost, nothing is applied twice, and PVE
//! received exactly one restore per provision. Re-deliveries of the same message id after a
//! reconnect are expected (at-least-once) and de-duplicated by the hub; they are counted and
//! printed beside the lost and applied-twice counts.
//!
//! The size is set by `FELHOM_HUB_RESTARTS` (rounds, one hub restart each; default 20),
//! `FELHOM_HUB_PROVISIONS_PER_ROUND` (default 1; one more is queued while the hub is down in
//! every other round) and `FELHOM_HUB_INVENTORY_REQUESTS_PER_ROUND` (default 4). The README's
//! figure is `FELHOM_HUB_RESTARTS=50 FELHOM_HUB_PROVISIONS_PER_ROUND=4
//! FELHOM_HUB_INVENTORY_REQUESTS_PER_ROUND=2` (225 provisions).
//!
//! The suite's size, 20 restarts with 30 provisions and 80 inventory requests (110 dispatches),
//! was 20 restarts with 70 provisions and 40 inventory requests (the same 110 dispatches) until
//! that took 80 to 176 s on the 2-core CI machine. What it proves is the same: the 20 restarts,
//! the hub dying at the same moments of each round, the same rounds losing the agent's acks or
//! the hub's, work queued while the hub is down, and every check below (nothing lost, nothing
//! applied twice, one restore per provision, re-sends seen both ways, the outbox drained). The
//! provisions are still under way at every restart: the agent runs two at a time and each one
//! takes over a second (its restore alone 0.3 s), while a round lasts well under one. Only the
//! queue of provisions left to run after the last restart, in which no hub restarts, is shorter.
/// Printed straight to stderr, past the test harness's capture, so the figures show in every
/// run and not only in failing ones.
macro_rules! report {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
use felhom_tests::fakepve::{AgentFiles, AgentOptions, FakePve};
use felhom_tests::guestbed::GuestBed;
use hub_protocol::{DispatchAction, TxnId};

/// How long the agent may take to reconnect, and the outbox to drain once all is acknowledged.
const SETTLE: Duration = Duration::from_secs(60);
/// The batch fails only when no answer arrived for this long.
const STALL: Duration = Duration::from_secs(60);

fn env_or(name: &str, default: u32) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(default)
}

/// The transaction dispatch of the batch, on its own vmid.
fn transaction_dispatch(vmid: u32) -> DispatchAction {
    DispatchAction::Provision {
        vmid,
        from: "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst".to_string(),
        storage: "local-lvm".to_string(),
        keep: false,
        profile: None,
        isolate_network: None,
    }
}

#[test]
fn twenty_hub_restarts_lose_nothing_and_apply_nothing_twice() {
    let restarts = env_or("FELHOM_HUB_RESTARTS", 20) as usize;
    let per_round = env_or("FELHOM_HUB_PROVISIONS_PER_ROUND", 1);
    let inventory_requests_per_round = env_or("FELHOM_HUB_INVENTORY_REQUESTS_PER_ROUND", 4);
    // Real provisions: guests as root filesystems the fake makes as it restores them, behind
    // the `pct` stand-in; the package's bootstrap profile and check pack.
    let bed = GuestBed::new();
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    felhom_tests::world::tasks_take_time(&mut scenario);
    bed.join_scenario(&mut scenario);
    let pve = FakePve::start(scenario);
    let mut hub = DevHub::start(DevHubOptions::default());
    let files = AgentFiles::write(
        &pve,
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    );
    felhom_tests::world::install_default_profile_and_checks(&files);
    let path = felhom_tests::world::bed_path(&bed);
    // The agent's execs into containers go through the root exec helper, as on a node.
    let helper = files
        .exec_socket
        .as_deref()
        .map(|socket| felhom_tests::agent::ExecHelper::start(&files.config_path, socket, &path));
    let mut agent = AgentDaemon::spawn(&files.config_path, FAST_TIMING, &[("PATH", path.as_str())]);
    hub.wait_for("the first session", SETTLE, |s| s.sessions >= 1);

    let mut transactions: Vec<TxnId> = Vec::new();
    let mut requests: Vec<TxnId> = Vec::new();
    let mut vmid = 5000u32;
    let started = Instant::now();
    for round in 0..restarts {
        // In some rounds the hub loses the agent's acks of its dispatches (so it dispatches
        // them again after the restart), in others the agent loses the hub's acks (so it sends
        // its answers again): both sides' de-duplication is exercised every run.
        // The last round loses nothing, so its restart settles everything still open.
        let last = round == restarts - 1;
        hub.set_ignore_dispatch_acks(!last && round % 2 == 0);
        hub.set_ack(last || round % 3 != 1);
        // Work arrives while the hub runs ...
        for _ in 0..per_round {
            vmid += 1;
            transactions.push(hub.dispatch(transaction_dispatch(vmid)));
        }
        for _ in 0..inventory_requests_per_round {
            requests.push(hub.dispatch(DispatchAction::InventoryRequest));
        }
        // ... the hub dies at a different moment of each round (sometimes before the agent
        // answered, sometimes before the hub's acks reached it) ...
        std::thread::sleep(Duration::from_millis(10 + (round as u64 * 37) % 140));
        hub.stop();
        // ... more work is queued at the hub while it is down ...
        if round % 2 == 0 {
            vmid += 1;
            transactions.push(hub.dispatch(transaction_dispatch(vmid)));
        }
        std::thread::sleep(Duration::from_millis(20 + (round as u64 * 53) % 100));
        // ... and it comes back on the same port.
        hub.restart();
        assert!(agent.alive(), "the agent died during hub restart {round}");
        hub.wait_for("the agent to reconnect", SETTLE, |s| {
            s.sessions as usize >= round + 2
        });
        // Answers of this round arrive (and may or may not be acknowledged).
        std::thread::sleep(Duration::from_millis(30));
    }

    let rounds_took = started.elapsed();
    // Provisions take as long as the machine lets them: wait while answers keep coming.
    let state = hub.wait_while_progressing(
        "an answer to every dispatch",
        STALL,
        |s| {
            transactions.iter().all(|t| s.results.contains_key(t))
                && requests.iter().all(|r| s.inventory_replies(*r) >= 1)
                && s.dispatches.iter().all(|d| d.acked)
        },
        |s| s.results.len() + s.inventories.len() + s.dispatches.iter().filter(|d| d.acked).count(),
    );
    // Give late re-deliveries a moment to show up before counting.
    std::thread::sleep(Duration::from_millis(500));
    let state = {
        let later = hub.snapshot();
        assert!(later.frames.len() >= state.frames.len());
        later
    };

    let per_txn: BTreeMap<TxnId, usize> = state.results_per_txn();
    let lost_results = transactions
        .iter()
        .filter(|t| per_txn.get(t).copied().unwrap_or(0) == 0)
        .count();
    let twice_results = transactions
        .iter()
        .filter(|t| per_txn.get(t).copied().unwrap_or(0) > 1)
        .count();
    let lost_inventories = requests
        .iter()
        .filter(|r| state.inventory_replies(**r) == 0)
        .count();
    let twice_inventories = requests
        .iter()
        .filter(|r| state.inventory_replies(**r) > 1)
        .count();
    let unexpected_results = per_txn.keys().filter(|t| !transactions.contains(t)).count();
    let lost = lost_results + lost_inventories;
    let applied_twice = twice_results + twice_inventories;
    let dispatch_resends: u32 = state
        .dispatches
        .iter()
        .map(|d| d.sends.saturating_sub(1))
        .sum();
    let restores = pve
        .requests()
        .iter()
        .filter(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/lxc")
        .count();
    report!(
        "hub restarts: {restarts}; dispatched: {} provisions + {} inventory requests; \
         sessions: {}; restores at PVE: {restores}; took {:.1} s ({:.1} s of them the \
         restarts)",
        transactions.len(),
        requests.len(),
        state.sessions,
        started.elapsed().as_secs_f32(),
        rounds_took.as_secs_f32()
    );
    report!(
        "lost: {lost}; duplicates applied: {applied_twice}; re-deliveries de-duplicated by \
         message id: {}; dispatches re-sent by the hub: {dispatch_resends}",
        state.duplicates
    );

    assert_eq!(lost, 0, "answers lost");
    // Every provision really ran once, went green and cleaned up its own guest only.
    let not_ok: Vec<_> = state
        .results
        .iter()
        .filter(|(t, _)| transactions.contains(t))
        .filter(|(_, r)| {
            r.iter()
                .any(|(_, res)| res.outcome != hub_protocol::Outcome::Ok || !res.destroyed)
        })
        .collect();
    assert!(not_ok.is_empty(), "provisions not ok: {not_ok:?}");
    assert_eq!(
        restores,
        transactions.len(),
        "each dispatched provision restored exactly once"
    );
    for vmid in [101, 200, 300, 990000, 990001] {
        assert!(pve.writes_for(vmid).is_empty(), "{vmid} was written");
    }
    // The run really exercised re-sending both ways.
    assert!(state.duplicates > 0, "no message was delivered twice");
    assert!(dispatch_resends > 0, "no dispatch was sent twice");
    assert_eq!(applied_twice, 0, "answers applied twice");
    assert_eq!(
        unexpected_results, 0,
        "results for transactions never dispatched"
    );
    assert!(
        state.sessions as usize > restarts,
        "sessions: {}",
        state.sessions
    );
    assert!(agent.alive(), "the agent died");
    assert!(state.undecodable.is_empty(), "{:?}", state.undecodable);

    // After everything was acknowledged the outbox drains to nothing.
    let outbox_log = files.state_dir.join("outbox").join("outbox.log");
    let deadline = Instant::now() + SETTLE;
    loop {
        let bytes = std::fs::metadata(&outbox_log).map(|m| m.len()).unwrap_or(0);
        if bytes == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the outbox still holds {bytes} bytes after every ack"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, log) = agent.terminate(Duration::from_secs(30));
    assert!(status.success(), "run exited {status}:\n{log}");
    assert!(!log.contains(hub.token()), "the agent logged the hub token");
    // Every exec and push into the guests came from the exec helper, never from the agent.
    let helper = helper.expect("the exec helper");
    let strays: Vec<_> = bed
        .pct_calls()
        .into_iter()
        .filter(|c| (c.sub == "exec" || c.sub == "push") && c.parent_pid != helper.pid())
        .collect();
    assert!(
        strays.is_empty(),
        "pct not started by the helper: {strays:#?}"
    );
}
