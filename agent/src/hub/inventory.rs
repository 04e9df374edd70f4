//! The inventory the hub sees, read from this node: the token's pool view from the PVE API
//! joined with the full guest list read locally ([`crate::inventory`]). Only
//! [`crate::inventory::HubInventory`] is turned into the wire form, so a foreign guest reaches
//! the hub as a bare vmid, never with its name, type or node.

use std::path::PathBuf;

use hub_protocol::{GuestStatus, GuestType, Inventory, PoolGuest};

use super::dispatch::InventoryRead;
use crate::error::{ErrorCode, Failure};
use crate::exec_helper::client::VmlistRoute;
use crate::inventory::{self as inv, HubInventory, PoolView, ResourceRow, SystemListCommands};
use crate::pve::{GuestKind, PveClient};

/// Reads the inventory through the pool-scoped PVE client and the node's full guest list.
#[derive(Debug, Clone)]
pub struct PveInventory {
    client: PveClient,
    vmlist_path: PathBuf,
    vmlist: VmlistRoute,
    node: String,
    pool: String,
}

impl PveInventory {
    /// A reader for this node and pool; `.vmlist` is read through `vmlist` (the exec helper in
    /// its mode, see [`crate::exec_helper::client::vmlist_reader`]).
    pub fn new(
        client: PveClient,
        vmlist_path: PathBuf,
        vmlist: VmlistRoute,
        node: String,
        pool: String,
    ) -> Self {
        Self {
            client,
            vmlist_path,
            vmlist,
            node,
            pool,
        }
    }
}

impl InventoryRead for PveInventory {
    async fn read(&self) -> Result<Inventory, Failure> {
        let vms = self
            .client
            .cluster_vms()
            .await
            .map_err(|e| Failure::new(e.code(), e.to_string()))?;
        let rows = vms.into_iter().map(|vm| ResourceRow {
            vmid: vm.vmid,
            kind: match vm.kind {
                GuestKind::Lxc => inv::GuestType::Lxc,
                GuestKind::Qemu => inv::GuestType::Qemu,
            },
            node: vm.node,
            name: vm.name,
            status: vm.status,
            pool: vm.pool,
        });
        let pool_view = PoolView::from_resources(&self.pool, rows);
        let (path, node, via) = (
            self.vmlist_path.clone(),
            self.node.clone(),
            self.vmlist.clone(),
        );
        let full = tokio::task::spawn_blocking(move || {
            inv::read_full_list_with(&path, &node, &SystemListCommands::default(), &via)
        })
        .await
        .map_err(|e| {
            Failure::new(
                ErrorCode::PveUnreachable,
                format!("reading the full guest list stopped: {e}"),
            )
        })?
        .map_err(|e| Failure::new(e.code(), e.to_string()))?;
        Ok(to_wire(&inv::join(&full, &pool_view).hub_inventory()))
    }
}

/// The wire form of the hub's view. A pool guest of a type the protocol has no name for
/// (a legacy OpenVZ container) is sent as a bare vmid, like a foreign one.
pub fn to_wire(view: &HubInventory) -> Inventory {
    let mut guests = Vec::with_capacity(view.pool_guests.len());
    let mut foreign_vmids = view.foreign_vmids.clone();
    for g in &view.pool_guests {
        let guest_type = match g.kind {
            inv::GuestType::Lxc => GuestType::Lxc,
            inv::GuestType::Qemu => GuestType::Qemu,
            inv::GuestType::OpenVz => {
                foreign_vmids.push(g.vmid);
                continue;
            }
        };
        guests.push(PoolGuest {
            vmid: g.vmid,
            guest_type,
            node: g.node.clone(),
            name: g.name.clone(),
            status: status_of(g.status.as_deref()),
        });
    }
    foreign_vmids.sort_unstable();
    foreign_vmids.dedup();
    Inventory {
        request: None,
        guests,
        foreign_vmids,
    }
}

/// PVE's status word as the protocol's run state.
pub fn status_of(status: Option<&str>) -> GuestStatus {
    match status {
        Some("running") => GuestStatus::Running,
        Some("stopped") => GuestStatus::Stopped,
        Some("paused" | "suspended" | "prelaunch") => GuestStatus::Paused,
        _ => GuestStatus::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::HubPoolGuest;

    #[test]
    fn foreign_guests_stay_numbers_and_openvz_is_not_named() {
        let view = HubInventory {
            pool_guests: vec![
                HubPoolGuest {
                    vmid: 200,
                    kind: inv::GuestType::Lxc,
                    node: "pve1".into(),
                    name: Some("felhom-ct".into()),
                    status: Some("running".into()),
                },
                HubPoolGuest {
                    vmid: 250,
                    kind: inv::GuestType::OpenVz,
                    node: "pve1".into(),
                    name: Some("old-ct".into()),
                    status: None,
                },
            ],
            foreign_vmids: vec![990000, 101],
            cluster_wide: true,
        };
        let wire = to_wire(&view);
        assert_eq!(wire.foreign_vmids, vec![101, 250, 990000]);
        assert_eq!(wire.guests.len(), 1);
        assert_eq!(wire.guests[0].status, GuestStatus::Running);
        let text = serde_json::to_string(&wire).expect("json");
        assert!(!text.contains("old-ct"), "{text}");
    }

    #[test]
    fn statuses() {
        assert_eq!(status_of(Some("running")), GuestStatus::Running);
        assert_eq!(status_of(Some("stopped")), GuestStatus::Stopped);
        assert_eq!(status_of(Some("paused")), GuestStatus::Paused);
        assert_eq!(status_of(Some("weird")), GuestStatus::Unknown);
        assert_eq!(status_of(None), GuestStatus::Unknown);
    }
}
