//! `felhom-agent run` against fakepve (demo scenario) and the development hub: the session
//! comes up with hello and welcome, heartbeats flow, the inventory is sent on connect, on
//! change and on request, and no frame the hub ever receives holds the name of a foreign guest.

use std::time::Duration;

use felhom_tests::devhub::{AgentDaemon, DevHub, DevHubOptions, FAST_TIMING};
use felhom_tests::fakepve::{AgentFiles, AgentOptions, FakePve};
use hub_protocol::{DispatchAction, GuestStatus, GuestType};

const WAIT: Duration = Duration::from_secs(30);

/// The names of the demo scenario's foreign guests (101, 990000, 990001).
const FOREIGN_NAMES: &[&str] = &["someone-elses-ct", "someone-elses-vm", "someone-elses-ct2"];

fn files_for(pve: &FakePve, hub: &DevHub) -> AgentFiles {
    AgentFiles::write(
        pve,
        &AgentOptions {
            hub: Some(hub.hub_options()),
            ..AgentOptions::default()
        },
    )
}

#[test]
fn the_inventory_never_names_a_foreign_guest() {
    let pve = FakePve::demo();
    let hub = DevHub::start(DevHubOptions::default());
    let files = files_for(&pve, &hub);
    let agent = AgentDaemon::spawn(&files.config_path, FAST_TIMING, &[]);

    let state = hub.wait_for("the inventory sent on connect", WAIT, |s| {
        !s.inventories.is_empty() && s.heartbeats >= 1
    });
    let hello = &state.hellos[0];
    assert_eq!(hello.node, "pve1");
    assert_eq!(hello.pool, "felhom");
    assert!(hello.protocol_versions.contains(&1));
    assert!(hello.capabilities.contains(&"inventory".to_string()));
    assert!(hello.host.cpu_count >= 1 && hello.host.memory_total_bytes > 0);

    let (_, inv) = &state.inventories[0];
    assert_eq!(inv.request, None);
    let pool: Vec<(u32, GuestType, Option<&str>, GuestStatus)> = inv
        .guests
        .iter()
        .map(|g| (g.vmid, g.guest_type, g.name.as_deref(), g.status))
        .collect();
    assert_eq!(
        pool,
        vec![
            (200, GuestType::Lxc, Some("felhom-ct"), GuestStatus::Running),
            (
                300,
                GuestType::Qemu,
                Some("felhom-vm"),
                GuestStatus::Stopped
            ),
        ]
    );
    assert_eq!(inv.foreign_vmids, vec![101, 990000, 990001]);

    // A foreign guest appears on the node (in the full list only: the token cannot see it).
    let mut entries = pve.vmlist_entries();
    entries.push((4242u32, "pve1", "qemu").into());
    files.write_vmlist(&entries);
    let state = hub.wait_for("an inventory after the change", WAIT, |s| {
        s.inventories
            .iter()
            .any(|(_, i)| i.request.is_none() && i.foreign_vmids.contains(&4242))
    });
    let unsolicited = state
        .inventories
        .iter()
        .filter(|(_, i)| i.request.is_none())
        .count();

    // And on request.
    let txn = hub.dispatch(DispatchAction::InventoryRequest);
    let state = hub.wait_for("the inventory answering the request", WAIT, |s| {
        s.inventory_replies(txn) == 1 && s.dispatches.iter().all(|d| d.acked)
    });

    // Polls without a change send nothing new.
    std::thread::sleep(Duration::from_millis(1500));
    let later = hub.snapshot();
    assert_eq!(
        later
            .inventories
            .iter()
            .filter(|(_, i)| i.request.is_none())
            .count(),
        unsolicited,
        "an unchanged inventory was sent again"
    );

    let (status, log) = agent.terminate(WAIT);
    assert!(status.success(), "run exited {status}:\n{log}");

    let all = hub.snapshot();
    assert!(all.frames.len() >= state.frames.len());
    for frame in &all.frames {
        for name in FOREIGN_NAMES {
            assert!(
                !frame.text.contains(name),
                "the hub received a foreign guest's name {name:?} in {}",
                frame.text
            );
        }
    }
    // The pool guests are there, so the check above looked at real inventories.
    assert!(all.frames.iter().any(|f| f.text.contains("felhom-ct")));
    for name in FOREIGN_NAMES {
        assert!(
            !log.contains(name),
            "the agent logged a foreign guest's name {name:?}"
        );
    }
    assert!(!log.contains(hub.token()), "the agent logged the hub token");
    assert_eq!(
        all.duplicates, 0,
        "nothing should be re-sent without a reconnect"
    );
    assert_eq!(
        all.undecodable.len(),
        0,
        "the agent sent frames the hub cannot decode"
    );
}
