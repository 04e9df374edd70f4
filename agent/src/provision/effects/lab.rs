//! The lab's part of the executor: what an isolated container copy is given before its boot
//! wait, and what is settled after it (`crate::guest::lab` runs both steps in the guest); for
//! an isolated VM copy, what is settled after its boot (its NICs are on the lab bridge from
//! QEMU's start, or it has none).

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
    /// The agent's own throwaway copy: the node's failures are reset.
    own_copy: bool,
    /// Why nothing could be given (the stored config could not be read).
    unread: Option<String>,
    /// The names were joined to the group's lab by root (what root said).
    pub(super) joined: Option<String>,
    /// What the group's stored addresses cannot do in its lab (journaled with the member).
    group_warnings: Vec<String>,
    /// A group member's `/etc/hosts` line as PVE writes it for its stored `net0`.
    hosts: Option<crate::guest::group_net::HostsEntry>,
    /// An isolated VM copy's lab.
    vm: Option<VmLab>,
}

/// The lab of an isolated VM copy.
#[derive(Debug, Default)]
struct VmLab {
    /// The stored NICs' MACs (those well-formed).
    macs: Vec<String>,
    /// The lab bridge its NICs were restored onto; `None`: it started with no NIC.
    bridge: Option<String>,
    /// The stored NICs, described (`net0 (bridge=vmbr0)`).
    stored: Vec<String>,
    /// The group's VM copies sharing the bridge (none for a copy alone).
    group_peers: Vec<u32>,
    /// The agent's own throwaway copy: its `dhclient -6` is stopped during the boot.
    own_copy: bool,
}

impl VmLab {
    fn request(&self) -> crate::guest::lab::VmLabRequest<'_> {
        crate::guest::lab::VmLabRequest {
            macs: &self.macs,
            on_bridge: self.bridge.is_some(),
            own_copy: self.own_copy,
        }
    }

    /// What the report says of the NICs, before what the after-step did.
    fn given(&self) -> Option<String> {
        if self.stored.is_empty() {
            return None;
        }
        Some(match &self.bridge {
            Some(bridge) if self.group_peers.len() > 1 => format!(
                "the stored NIC(s) {} restored onto the group's lab bridge {bridge} with their stored models and MACs, off their stored bridges: shared with the group's VM copies {} and nothing else (no other port, no node address, no DHCP)",
                self.stored.join(", "),
                self.group_peers
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Some(bridge) => format!(
                "the stored NIC(s) {} restored onto the lab bridge {bridge} (no ports, no node address: nothing answers there, no DHCP) with their stored models and MACs, off their stored bridges (one VM copy at a time on each lab bridge)",
                self.stored.join(", ")
            ),
            None => format!(
                "started with no NIC: the stored NIC(s) {} were removed ([restore_test] lab_bridge is not set)",
                self.stored.join(", ")
            ),
        })
    }
}

impl Lab {
    /// A group member's `/etc/hosts` line as PVE writes it for its stored `net0`.
    pub(super) fn hosts_entry(&self) -> Option<&crate::guest::group_net::HostsEntry> {
        self.hosts.as_ref()
    }

    /// The stored interface names that can be given (plain names).
    pub(super) fn plain_names(&self) -> Vec<String> {
        self.names
            .iter()
            .filter(|n| crate::guest::lab::valid_ifname(n))
            .cloned()
            .collect()
    }

    pub(super) fn request(&self) -> LabRequest<'_> {
        LabRequest {
            names: &self.names,
            dhcp: &self.dhcp,
            dhcp6: &self.dhcp6,
            reset_node_failures: self.own_copy,
            joined: self.joined.is_some(),
            hosts: self.hosts.as_ref(),
        }
    }

    /// What the boot wait's exec runs beside the wait for this copy.
    pub(super) fn plan(&self) -> crate::guest::boot::BootPlan {
        match &self.vm {
            Some(vm) => {
                crate::guest::lab::vm_boot_plan(&vm.request(), vm.stored.len(), dhcp6_give_up())
            }
            None => crate::guest::lab::boot_plan(&self.request(), dhcp6_give_up()),
        }
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
        if !req.isolate_network {
            return None;
        }
        if guest == GuestKind::Qemu {
            return Some(self.vm_lab_for(state).await);
        }
        let mut lab = Lab {
            // The agent's own throwaway copies (a restore test's, a selftest's), never a
            // customer's guest provisioned isolated.
            own_copy: matches!(
                state.kind(),
                TxnKind::SelftestRestore | TxnKind::SelftestProvision
            ),
            group_warnings: req
                .group
                .as_ref()
                .map(|g| g.warnings.clone())
                .unwrap_or_default(),
            ..Lab::default()
        };
        match self
            .stored_config_text(&self.cfg.node.clone(), &req.volid)
            .await
        {
            Ok(text) => {
                let stored = StoredConfig::parse(&text);
                // A member of an application group: the line PVE would have written into its
                // /etc/hosts for its stored net0 (the copy has none).
                if req.group.is_some() {
                    lab.hosts = crate::guest::group_net::hosts_entry(&stored);
                }
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

    /// The lab of an isolated VM copy: its stored NICs (read from the stored config) and the
    /// lab bridge they were restored onto.
    async fn vm_lab_for(&mut self, state: &State) -> Lab {
        let req = state.request();
        let mut vm = VmLab {
            bridge: self.lab_bridge(state, GuestKind::Qemu).map(str::to_string),
            group_peers: req
                .group
                .as_ref()
                .map(|g| g.bridge_peers.clone())
                .unwrap_or_default(),
            // The agent's own throwaway copies, as for a container.
            own_copy: matches!(
                state.kind(),
                TxnKind::SelftestRestore | TxnKind::SelftestProvision
            ),
            ..VmLab::default()
        };
        let mut lab = Lab::default();
        match self
            .stored_config_text(&self.cfg.node.clone(), &req.volid)
            .await
        {
            Ok(text) => {
                let stored = StoredConfig::parse(&text);
                for nic in stored.nics(GuestKind::Qemu) {
                    vm.stored.push(nic.describe());
                    if let Some(mac) = nic.mac {
                        vm.macs.push(mac);
                    }
                }
            }
            Err(e) => {
                lab.unread = Some(format!(
                    "the stored config of {} could not be read ({e}): the copy's NICs are not named",
                    req.volid
                ));
            }
        }
        lab.vm = Some(vm);
        lab
    }

    /// The boot of an isolated container copy as the boot trip saw it, with what its lab did:
    /// given before the wait, the DHCPv6 clients stopped during it, and what was reset and
    /// restarted after it (then the second wait is the one that counts: the boot as first seen
    /// stays first in the report). All of it goes to the report's `isolation`.
    pub(super) fn lab_done(
        &mut self,
        vmid: u32,
        lab: &Lab,
        trip: crate::guest::boot::BootTrip,
    ) -> Result<String, String> {
        let (done, mut parts) = match &lab.vm {
            Some(vm) => (
                crate::guest::lab::read_vm_trip(&vm.request(), &trip),
                vm.given().into_iter().collect(),
            ),
            None => (
                crate::guest::lab::read_trip(&lab.request(), &trip),
                Vec::new(),
            ),
        };
        parts.extend(lab.unread.clone());
        parts.extend(lab.joined.clone());
        parts.extend(lab.group_warnings.iter().cloned());
        parts.extend(done.given.iter().cloned());
        if !done.given.is_empty() {
            tracing::info!(vmid, "isolation: {}", done.given.join("; "));
        }
        parts.extend(done.during.iter().cloned());
        self.lab_kept = done.kept.clone();
        let waited = match (trip.first, trip.after) {
            (Ok(seen), Some((_, again))) if !done.settled.is_empty() => {
                tracing::info!(vmid, "isolation: {}", done.settled.join("; "));
                // The guard's word on a namespace it could not give to is said once.
                for part in done.settled {
                    if !parts.contains(&part) {
                        parts.push(part);
                    }
                }
                again.map(|after| format!("{seen}; after the isolation, {after}"))
            }
            (first, _) => first,
        };
        self.isolation = (!parts.is_empty()).then(|| parts.join("; "));
        waited
    }
}
