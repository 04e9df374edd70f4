//! Dispatches from the hub run the real provision transaction: a named bootstrap profile runs,
//! a kept guest is destroyed by a later destroy dispatch through the ownership gate, and a
//! re-dispatch of a finished transaction answers with its result without touching PVE again.

use std::time::Duration;

use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
use felhom_tests::fakepve::AgentOptions;
use felhom_tests::world::{copy_tree, World};
use hub_protocol::{Dispatch, DispatchAction, Outcome};

const WAIT: Duration = Duration::from_secs(60);

#[test]
fn a_named_profile_runs_and_destroy_and_re_dispatch_go_through_the_gate() {
    let hub = DevHub::start(DevHubOptions::default());
    let opts = AgentOptions {
        hub: Some(hub.hub_options()),
        ..AgentOptions::default()
    };
    let w = World::with_options(felhom_tests::fakepve::demo_scenario(), &opts);
    // A second profile, `web`, that leaves its own trace in the guest.
    let web = w.files.bootstrap_dir.join("web");
    copy_tree(&w.files.bootstrap_dir.join("default"), &web);
    std::fs::create_dir_all(web.join("files/etc")).expect("mkdir");
    std::fs::write(web.join("files/etc/felhom-web"), "web profile\n").expect("write");
    let path = w.path();
    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str())],
    );
    hub.wait_for("the session", WAIT, |s| s.sessions == 1);

    let provision = hub.dispatch(DispatchAction::Provision {
        vmid: 6200,
        from: "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst".to_string(),
        storage: "local-lvm".to_string(),
        keep: true,
        profile: Some("web".to_string()),
        isolate_network: None,
    });
    let state = hub.wait_for("the provision's result", WAIT, |s| {
        s.results.contains_key(&provision)
    });
    let result = &state.results[&provision][0].1;
    assert_eq!(result.outcome, Outcome::Ok, "{result:?}");
    assert!(!result.destroyed && result.destroy_armed, "{result:?}");
    let marker = std::fs::read_to_string(w.bed.guest_path(6200, "/var/lib/felhom/bootstrap.json"))
        .expect("bootstrap marker");
    assert!(
        marker.contains("\"profile\":\"web\"") || marker.contains("\"profile\": \"web\""),
        "{marker}"
    );
    assert!(
        w.bed.guest_path(6200, "/etc/felhom-web").exists(),
        "the web profile's files arrived"
    );
    assert!(w.pve.guest(6200).is_some(), "kept");

    // A destroy dispatch removes it through the gate.
    let destroy = hub.dispatch(DispatchAction::Destroy { vmid: 6200 });
    let state = hub.wait_for("the destroy's result", WAIT, |s| {
        s.results.contains_key(&destroy)
    });
    let result = &state.results[&destroy][0].1;
    assert_eq!(result.outcome, Outcome::Ok, "{result:?}");
    assert!(result.destroyed, "{result:?}");
    assert!(w.pve.guest(6200).is_none());
    assert_eq!(w.pve.deletes_for(6200).len(), 1);

    // The same destroy dispatched again: its result again, and no second DELETE.
    hub.dispatch_txn(Dispatch {
        txn: destroy,
        action: DispatchAction::Destroy { vmid: 6200 },
    });
    std::thread::sleep(Duration::from_millis(1500));
    let state = hub.snapshot();
    assert_eq!(
        state.results[&destroy].len(),
        1,
        "the result is applied once"
    );
    assert_eq!(w.pve.deletes_for(6200).len(), 1, "no second DELETE");

    // A destroy of a pool guest this agent never created is refused and sends nothing.
    let refused = hub.dispatch(DispatchAction::Destroy { vmid: 200 });
    let state = hub.wait_for("the refused destroy's result", WAIT, |s| {
        s.results.contains_key(&refused)
    });
    let result = &state.results[&refused][0].1;
    assert_eq!(result.outcome, Outcome::Refused, "{result:?}");
    assert!(w.pve.deletes_for(200).is_empty());

    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
    // The daemon's execs into the guest went through the exec helper only.
    assert!(
        w.assert_pct_only_from_helper() >= 1,
        "{:#?}",
        w.bed.pct_calls()
    );
}

#[test]
fn a_refused_dispatch_sent_again_is_answered_from_the_journal_even_once_the_vmid_is_free() {
    let hub = DevHub::start(DevHubOptions::default());
    let opts = AgentOptions {
        hub: Some(hub.hub_options()),
        ..AgentOptions::default()
    };
    // 4300 is held by a guest on another node: only the local full list knows it.
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    scenario["vmlist_extra"] = serde_json::json!([{"vmid": 4300, "node": "pve2", "type": "lxc"}]);
    let w = World::with_options(scenario, &opts);
    let path = w.path();
    let agent = AgentDaemon::spawn(
        &w.files.config_path,
        FAST_TIMING,
        &[("PATH", path.as_str())],
    );
    hub.wait_for("the session", WAIT, |s| s.sessions == 1);

    let action = DispatchAction::Provision {
        vmid: 4300,
        from: "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst".to_string(),
        storage: "local-lvm".to_string(),
        keep: false,
        profile: None,
        isolate_network: None,
    };
    let txn = hub.dispatch(action.clone());
    let state = hub.wait_for("the refusal", WAIT, |s| s.results.contains_key(&txn));
    let result = &state.results[&txn][0].1;
    assert_eq!(result.outcome, Outcome::Refused, "{result:?}");
    assert!(w.pve.writes().is_empty(), "{:?}", w.pve.writes());

    // The other node's guest goes away, then the hub sends the same transaction again (its
    // ack was lost): the agent answers with the journaled refusal and does not provision.
    w.pve.set(serde_json::json!({"vmlist_extra": []}));
    let frames_before = hub.snapshot().frames.len();
    hub.dispatch_txn(Dispatch { txn, action });
    hub.wait_for("the re-dispatch's answer", WAIT, |s| {
        s.frames.len() > frames_before && s.dispatches.iter().all(|d| d.acked)
    });
    std::thread::sleep(Duration::from_millis(1500));
    let state = hub.snapshot();
    assert_eq!(state.results[&txn].len(), 1, "the result is applied once");
    assert_eq!(state.results[&txn][0].1.outcome, Outcome::Refused);
    assert!(
        w.pve.writes().is_empty(),
        "the re-dispatch ran a provision: {:?}",
        w.pve.writes()
    );
    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");
}
