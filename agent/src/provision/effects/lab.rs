//! The lab's part of the executor: what an isolated container copy is given before its boot
//! wait, and what is settled after it (`crate::guest::lab` runs both steps in the guest).

use super::{Executor, State, StoredConfig, TxnKind};
use crate::guest::lab::LabRequest;
use crate::pve::GuestKind;

/// The lab of one isolated copy, read from its backup's stored config.
#[derive(Debug, Default)]
pub(super) struct Lab {
    /// The stored interface names (`netN`'s `name`).
    names: Vec<String>,
    /// The names stored with DHCP.
    dhcp: Vec<String>,
    /// The names stored with `ip6=dhcp`.
    dhcp6: Vec<String>,
    /// The names whose `dhclient -6` the boot wait stopped, and what the report says of it.
    pub(super) dhcp6_stopped: (Vec<String>, Vec<String>),
    /// The agent's own throwaway copy: the node's failures are reset.
    own_copy: bool,
    /// Why nothing could be given (the stored config could not be read).
    unread: Option<String>,
    /// What the step before the boot wait gave, for the report.
    pub(super) given: Vec<String>,
}

impl Lab {
    pub(super) fn request(&self) -> LabRequest<'_> {
        LabRequest {
            names: &self.names,
            dhcp: &self.dhcp,
            dhcp6: &self.dhcp6,
            dhcp6_stopped: &self.dhcp6_stopped.0,
            reset_node_failures: self.own_copy,
        }
    }

    /// What the boot wait runs for this copy (`None`: the plain wait).
    pub(super) fn boot_watch(&self) -> Option<crate::guest::boot::BootWatch> {
        crate::guest::lab::dhcp6_watch(&self.request(), dhcp6_give_up())
    }
}

/// How long a copy's `dhclient -6` may wait for a lease (a test build may shorten it through
/// the environment).
#[cfg(not(feature = "test-hooks"))]
fn dhcp6_give_up() -> std::time::Duration {
    crate::guest::lab::DHCP6_GIVE_UP
}

/// Test hook (only with the `test-hooks` feature): the seconds a copy's `dhclient -6` may wait,
/// instead of [`crate::guest::lab::DHCP6_GIVE_UP`].
#[cfg(feature = "test-hooks")]
pub const DHCP6_GIVE_UP_ENV: &str = "FELHOM_AGENT_DHCP6_GIVE_UP_SECS";

#[cfg(feature = "test-hooks")]
fn dhcp6_give_up() -> std::time::Duration {
    std::env::var(DHCP6_GIVE_UP_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(
            crate::guest::lab::DHCP6_GIVE_UP,
            std::time::Duration::from_secs,
        )
}

impl Executor<'_> {
    /// The lab of an isolated container copy (a restore test, a throwaway
    /// `--selftest=provision`, a hub provision told to isolate): the interfaces its backup
    /// stores (and which of them use DHCP), read from the stored config. `None`: not an
    /// isolated container.
    pub(super) async fn lab_for(&mut self, state: &State, guest: GuestKind) -> Option<Lab> {
        let req = state.request();
        if !req.isolate_network || guest != GuestKind::Lxc {
            return None;
        }
        let mut lab = Lab {
            // The agent's own throwaway copies (a restore test's, a selftest's), never a
            // customer's guest provisioned isolated.
            own_copy: matches!(
                state.kind(),
                TxnKind::SelftestRestore | TxnKind::SelftestProvision
            ),
            ..Lab::default()
        };
        match self
            .stored_config_text(&self.cfg.node.clone(), &req.volid)
            .await
        {
            Ok(text) => {
                let stored = StoredConfig::parse(&text);
                for nic in stored.nics(GuestKind::Lxc) {
                    let Some(name) = nic.name.clone() else {
                        continue;
                    };
                    // `ip=dhcp` and `ip6=dhcp` (pve-container `Setup/Debian.pm`
                    // `setup_network` writes `inet dhcp` and `inet6 dhcp`): no lease can come
                    // in a copy that reaches nothing.
                    let dhcp = |key: &str| {
                        stored.get(&nic.key).is_some_and(|v| {
                            crate::pve::guest_config::property_items(v)
                                .iter()
                                .any(|(k, v)| k == key && v.as_deref() == Some("dhcp"))
                        })
                    };
                    if dhcp("ip6") {
                        lab.dhcp6.push(name.clone());
                    }
                    if dhcp("ip") || dhcp("ip6") {
                        lab.dhcp.push(name.clone());
                    }
                    lab.names.push(name);
                }
            }
            Err(e) => {
                lab.unread = Some(format!(
                    "nothing given: the stored config of {} could not be read ({e})",
                    req.volid
                ));
            }
        }
        Some(lab)
    }

    /// After the boot of an isolated container copy with systemd: reset what the node made
    /// fail in the agent's own copies, restart the failed units that can have failed for the
    /// missing interface, and wait for the boot to settle again; what changed goes to the
    /// report (after what was given before the boot). Anything else is left as it booted.
    pub(super) async fn lab_settle(
        &mut self,
        state: &State,
        vmid: u32,
        guest: GuestKind,
        seen: String,
        lab: Lab,
    ) -> Result<String, String> {
        let mut parts: Vec<String> = lab.unread.clone().into_iter().collect();
        parts.extend(lab.given.iter().cloned());
        parts.extend(lab.dhcp6_stopped.1.iter().cloned());
        let exec = self.exec_for(vmid, guest, state.txn());
        let settled = if seen.starts_with("systemd") {
            crate::guest::lab::settle(&exec, &lab.request(), self.timeouts.boot).await?
        } else {
            Vec::new()
        };
        if settled.is_empty() {
            self.isolation = (!parts.is_empty()).then(|| parts.join("; "));
            return Ok(seen);
        }
        tracing::info!(vmid, "isolation: {}", settled.join("; "));
        // The guard's word on a namespace it could not give to is said once.
        for part in settled {
            if !parts.contains(&part) {
                parts.push(part);
            }
        }
        // The boot as first seen stays first: the second wait only follows the restarts.
        let settled = crate::guest::boot::wait_boot(&exec, self.timeouts.boot)
            .await
            .map(|after| format!("{seen}; after the isolation, {after}"));
        drop(exec);
        self.isolation = Some(parts.join("; "));
        settled
    }
}
