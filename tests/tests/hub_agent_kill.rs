//! The agent killed with SIGKILL and started again: what the hub had not acknowledged is sent
//! again, unchanged (same id, same timestamp), and applied once; dispatches accepted but not
//! finished are resumed; a record torn by the kill is cut off and the rest is delivered. A
//! report spooled by another command reaches the hub through the running daemon.

use std::io::Write;
use std::time::{Duration, Instant};

use felhom_agent::hub::outbox::Outbox;
use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
use felhom_tests::fakepve::{AgentFiles, AgentOptions, FakePve};
use hub_protocol::{
    AgentMessage, Dispatch, DispatchAction, ErrorCode, Outcome, Phase, TxnId, TxnKind, TxnResult,
};

const WAIT: Duration = Duration::from_secs(30);

fn files_for(pve: &FakePve, hub: &DevHub) -> AgentFiles {
    AgentFiles::write(
        pve,
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    )
}

fn provision(vmid: u32) -> DispatchAction {
    DispatchAction::Provision {
        vmid,
        from: "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst".to_string(),
        storage: "local-lvm".to_string(),
        keep: false,
        profile: None,
        isolate_network: None,
    }
}

fn outbox_bytes(files: &AgentFiles) -> u64 {
    std::fs::metadata(files.state_dir.join("outbox").join("outbox.log"))
        .map(|m| m.len())
        .unwrap_or(0)
}

fn wait_until_drained(files: &AgentFiles) {
    let deadline = Instant::now() + WAIT;
    while outbox_bytes(files) > 0 {
        assert!(
            Instant::now() < deadline,
            "the outbox was not drained after the hub acknowledged everything"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn unacknowledged_messages_are_sent_again_after_sigkill() {
    let pve = FakePve::demo();
    let hub = DevHub::start(DevHubOptions {
        ack: false,
        ..DevHubOptions::default()
    });
    let files = files_for(&pve, &hub);
    let agent = AgentDaemon::spawn(&files.config_path, FAST_TIMING, &[]);
    hub.wait_for("the session", WAIT, |s| s.sessions == 1);

    let transactions: Vec<TxnId> = (0..8).map(|i| hub.dispatch(provision(6000 + i))).collect();
    let requests: Vec<TxnId> = (0..4)
        .map(|_| hub.dispatch(DispatchAction::InventoryRequest))
        .collect();
    let first = hub.wait_for("every answer, unacknowledged", WAIT, |s| {
        transactions.iter().all(|t| s.results.contains_key(t))
            && requests.iter().all(|r| s.inventory_replies(*r) == 1)
    });
    assert_eq!(first.duplicates, 0);
    assert!(outbox_bytes(&files) > 0, "nothing waits in the outbox");

    // Killed with every answer still unacknowledged.
    let log = agent.kill();
    assert!(!log.contains(hub.token()));

    hub.set_ack(true);
    let agent = AgentDaemon::spawn(&files.config_path, FAST_TIMING, &[]);
    let answers = transactions.len() + requests.len();
    let state = hub.wait_for("the answers sent again", WAIT, |s| {
        let resent = s
            .frames
            .iter()
            .filter(|f| {
                f.session == 2 && f.duplicate && matches!(f.type_name, Some("result" | "inventory"))
            })
            .count();
        s.sessions == 2 && resent >= answers
    });
    // Applied once each.
    for t in &transactions {
        assert_eq!(state.results[t].len(), 1, "result of {t} applied twice");
    }
    for r in &requests {
        assert_eq!(
            state.inventory_replies(*r),
            1,
            "inventory for {r} applied twice"
        );
    }
    // Sent again unchanged: every copy of a message id has the same text, and the copies came
    // in the order of the first sending.
    let mut first_order = Vec::new();
    let mut second_order = Vec::new();
    for f in &state.frames {
        let (Some(id), Some(ty)) = (f.id, f.type_name) else {
            continue;
        };
        if ty != "result" && ty != "inventory" {
            continue;
        }
        let copies: Vec<&str> = state
            .frames
            .iter()
            .filter(|g| g.id == Some(id))
            .map(|g| g.text.as_str())
            .collect();
        assert!(
            copies.windows(2).all(|w| w[0] == w[1]),
            "message {id} changed when sent again"
        );
        if f.session == 1 {
            first_order.push(id);
        } else if f.duplicate {
            second_order.push(id);
        }
    }
    let resent_in_first_order: Vec<_> = first_order
        .iter()
        .filter(|id| second_order.contains(id))
        .copied()
        .collect();
    assert_eq!(second_order, resent_in_first_order, "not re-sent in order");
    assert!(second_order.len() >= answers);

    wait_until_drained(&files);
    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
}

#[test]
fn open_dispatches_resume_and_a_torn_record_is_cut_off_after_a_kill() {
    let pve = FakePve::demo();
    let hub = DevHub::start(DevHubOptions::default());
    let files = files_for(&pve, &hub);
    // The package's profile and pack, so the resumed provision's preflight gets as far as the
    // exec helper (which this bed does not run).
    felhom_tests::world::install_default_profile_and_checks(&files);

    // The state a killed agent leaves: a dispatch accepted (and acknowledged to the hub) but
    // not finished, a result stored but not acknowledged, and half a record.
    let open_txn = TxnId::from_ulid(ulid::Ulid::new());
    let stored_txn = TxnId::from_ulid(ulid::Ulid::new());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (outbox, _) = Outbox::open(&files.state_dir).expect("open the outbox");
        outbox
            .accept_dispatch(&Dispatch {
                txn: open_txn,
                action: provision(7001),
            })
            .await
            .expect("accept");
        outbox
            .push(AgentMessage::Result(TxnResult {
                txn: stored_txn,
                kind: TxnKind::Provision,
                vmid: Some(7002),
                outcome: Outcome::Ok,
                phase: Phase::Reported,
                destroy_armed: true,
                destroyed: true,
                checks: vec![],
                isolation: None,
                error: None,
                guest: None,
                backup: None,
                group: None,
            }))
            .await
            .expect("push");
        outbox.close().await;
    });
    let log_path = files.state_dir.join("outbox").join("outbox.log");
    let whole = std::fs::metadata(&log_path).expect("outbox.log").len();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&log_path)
        .expect("open");
    f.write_all(b"{\"v\":1,\"sum\":\"00ff").expect("torn write");
    drop(f);

    let agent = AgentDaemon::spawn(&files.config_path, FAST_TIMING, &[]);
    let state = hub.wait_for("the stored and the resumed result", WAIT, |s| {
        s.results.contains_key(&stored_txn) && s.results.contains_key(&open_txn)
    });
    assert_eq!(state.results[&stored_txn].len(), 1);
    assert_eq!(state.results[&open_txn].len(), 1);
    // The resumed dispatch really ran: this bed has no exec helper, so its preflight (which
    // probes the helper before a container provision) refused it with the environment's code,
    // and PVE received no write for it.
    let resumed = &state.results[&open_txn][0].1;
    assert_eq!(resumed.outcome, Outcome::Failed, "{resumed:?}");
    assert_eq!(
        resumed.error.as_ref().map(|e| e.code),
        Some(ErrorCode::ExecHelperUnavailable),
        "{resumed:?}"
    );
    assert!(!resumed.destroyed, "{resumed:?}");
    assert_eq!(state.results[&open_txn][0].1.vmid, Some(7001));
    assert!(
        pve.writes_for(7001).is_empty(),
        "{:#?}",
        pve.writes_for(7001)
    );
    agent.wait_for_log("torn last record", WAIT);

    // Another command reports while the daemon runs: through the spool.
    let spooled_txn = TxnId::from_ulid(ulid::Ulid::new());
    felhom_agent::hub::spool(
        &files.state_dir,
        AgentMessage::Result(TxnResult {
            txn: spooled_txn,
            kind: TxnKind::SelftestRestore,
            vmid: None,
            outcome: Outcome::Skipped,
            phase: Phase::Skipped,
            destroy_armed: false,
            destroyed: false,
            checks: vec![],
            isolation: None,
            error: None,
            guest: None,
            backup: None,
            group: None,
        }),
    )
    .expect("spool");
    hub.wait_for("the spooled result", WAIT, |s| {
        s.results.get(&spooled_txn).map(Vec::len) == Some(1)
    });
    assert!(whole > 0);
    wait_until_drained(&files);
    let inbox = files.state_dir.join("outbox").join("inbox.log");
    let deadline = Instant::now() + WAIT;
    while std::fs::metadata(&inbox).map(|m| m.len()).unwrap_or(0) > 0 {
        assert!(
            Instant::now() < deadline,
            "the open dispatch was not closed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
}

#[test]
fn killed_mid_provision_the_dispatch_resumes_and_its_result_arrives_once() {
    let hub = DevHub::start(DevHubOptions::default());
    let scenario = felhom_tests::fakepve::demo_scenario();
    let opts = AgentOptions {
        hub: Some(hub.hub_options()),
        ..AgentOptions::default()
    };
    let w = felhom_tests::world::World::with_options(scenario, &opts);
    // A restore that takes a few real seconds, so the kill lands inside it.
    w.pve
        .set(serde_json::json!({"time_scale": 0.02, "ct_secs": {"create": 150}}));
    let path = w.path();
    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str())],
    );
    hub.wait_for("the session", WAIT, |s| s.sessions == 1);

    let txn = hub.dispatch(provision(6100));
    // Wait until PVE has the restore request, then kill the agent mid-provision.
    let deadline = Instant::now() + WAIT;
    while !w
        .pve
        .requests()
        .iter()
        .any(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/lxc")
    {
        assert!(Instant::now() < deadline, "the provision never reached PVE");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let log = agent.kill();
    assert!(!log.contains(hub.token()));

    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str())],
    );
    let state = hub.wait_for(
        "the resumed provision's result",
        Duration::from_secs(60),
        |s| s.results.contains_key(&txn),
    );
    std::thread::sleep(Duration::from_millis(500));
    let state = {
        let later = hub.snapshot();
        assert!(later.frames.len() >= state.frames.len());
        later
    };
    assert_eq!(state.results[&txn].len(), 1, "the result was applied once");
    let result = &state.results[&txn][0].1;
    // The restore was not sent again: the journal held its UPID and the run resumed it.
    let restores = w
        .pve
        .requests()
        .iter()
        .filter(|r| r.method == "POST" && r.api_path() == "/nodes/pve1/lxc")
        .count();
    assert_eq!(restores, 1, "the restore was sent again after the kill");
    assert_eq!(result.vmid, Some(6100));
    assert!(
        matches!(result.outcome, Outcome::Ok | Outcome::Failed),
        "{result:?}"
    );
    assert!(
        result.destroyed,
        "the resumed transaction cleaned up its own guest: {result:?}"
    );
    assert!(w.pve.guest(6100).is_none());
    for vmid in [101, 200, 300, 990000, 990001] {
        assert!(w.pve.writes_for(vmid).is_empty(), "{vmid} was written");
    }
    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
}
