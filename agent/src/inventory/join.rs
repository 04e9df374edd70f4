//! The join of the full guest list with the pool view: [`PoolView`] (the pool guests the
//! pool-scoped token sees, built from [`ResourceRow`]s the caller fetched), [`join`] and the
//! [`Inventory`] it gives, which marks every guest as a pool guest or a foreign one
//! ([`Membership`]); the documents built from it, [`GuestsReport`] (shown on this node) and
//! [`HubInventory`] (the only form meant for the hub); and the guest that holds a vmid as the
//! vmid policy sees it ([`Holder`], answered by a [`GuestLookup`]).
//!
//! It may use only the shared types of [`crate::inventory`], std and serde. It never talks to
//! the PVE API and does not decide whether a vmid may be used: that is the vmid policy's job,
//! which builds on the types here.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::{FullGuestList, GuestEntry, GuestType, ListSource};

/// Whether a guest is in the fleet's pool (visible to the agent's token, and so to the hub) or
/// foreign. Only a pool guest can carry a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Membership {
    /// In the pool: the API showed it to the token.
    Pool {
        /// The guest's name as the API gave it.
        name: Option<String>,
        /// The guest's status as the API gave it (`running`, `stopped`, `unknown`, ...).
        status: Option<String>,
    },
    /// Not visible to the token. Its name stays on this node.
    Foreign,
}

/// One guest row of the token's `GET /cluster/resources?type=vm`, as the caller maps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceRow {
    /// `vmid`.
    pub vmid: u32,
    /// `type` (`lxc` / `qemu`).
    pub kind: GuestType,
    /// `node`.
    pub node: String,
    /// `name`, when present.
    pub name: Option<String>,
    /// `status`, when present.
    pub status: Option<String>,
    /// `pool`, when present (PVE removes it without `Pool.Audit` on that pool).
    pub pool: Option<String>,
}

/// One pool guest as the token sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolGuest {
    /// The vmid.
    pub vmid: u32,
    /// Container or virtual machine.
    pub kind: GuestType,
    /// The node it is on.
    pub node: String,
    /// Its name, when the API gave one.
    pub name: Option<String>,
    /// Its status, when the API gave one.
    pub status: Option<String>,
}

/// The guests of the fleet's pool, as the pool-scoped token sees them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolView {
    guests: BTreeMap<u32, PoolGuest>,
    outside_pool: BTreeSet<u32>,
}

impl PoolView {
    /// The pool view from the token's cluster resources. A row counts as a pool guest only when
    /// its `pool` is `pool`. Rows the token can see that are not in the pool (a token with more
    /// rights than it should have, or without `Pool.Audit`, which hides the `pool` field) are
    /// treated as foreign: their names are dropped here, only their vmids are kept
    /// ([`PoolView::outside_pool`]) so `doctor` can warn.
    pub fn from_resources(pool: &str, rows: impl IntoIterator<Item = ResourceRow>) -> Self {
        let mut view = Self::default();
        for row in rows {
            if row.pool.as_deref() == Some(pool) {
                view.guests.insert(
                    row.vmid,
                    PoolGuest {
                        vmid: row.vmid,
                        kind: row.kind,
                        node: row.node,
                        name: row.name,
                        status: row.status,
                    },
                );
            } else {
                view.outside_pool.insert(row.vmid);
            }
        }
        for vmid in view.guests.keys() {
            view.outside_pool.remove(vmid);
        }
        view
    }

    /// The pool guest at `vmid`, if any.
    pub fn get(&self, vmid: u32) -> Option<&PoolGuest> {
        self.guests.get(&vmid)
    }

    /// Every pool guest, by ascending vmid.
    pub fn guests(&self) -> impl Iterator<Item = &PoolGuest> {
        self.guests.values()
    }

    /// The vmids the token could see that are not in the pool.
    pub fn outside_pool(&self) -> impl Iterator<Item = u32> + '_ {
        self.outside_pool.iter().copied()
    }
}

/// One guest of the joined inventory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InventoryRow {
    /// The vmid.
    pub vmid: u32,
    /// Container or virtual machine.
    pub kind: GuestType,
    /// The node it is on.
    pub node: String,
    /// Pool guest (with its name) or foreign (without).
    pub membership: Membership,
    /// False for a pool guest the full list did not have (see [`join`]).
    pub in_full_list: bool,
}

impl InventoryRow {
    /// True for a pool guest.
    pub fn in_pool(&self) -> bool {
        matches!(self.membership, Membership::Pool { .. })
    }

    /// The guest as the vmid policy sees it.
    pub fn holder(&self) -> Holder {
        Holder {
            kind: self.kind,
            node: self.node.clone(),
            membership: self.membership.clone(),
        }
    }
}

/// The full guest list joined with the pool view: every vmid that is taken, and by whom.
///
/// It borrows both sides and builds rows only when asked, so a vmid check against a
/// 100,000-guest list costs two lookups, not a copy of the list.
#[derive(Debug, Clone, Copy)]
pub struct Inventory<'a> {
    full: &'a FullGuestList,
    pool: &'a PoolView,
}

/// Join the full guest list with the pool view.
///
/// Every guest of the full list is a row, `in_pool` when the pool view has its vmid (kind and
/// node come from the full list, which is read locally; the name from the pool view). A pool
/// guest that the full list does not have (created after the list was read, or on another node
/// when the list came from the local commands) is a row too, from the pool view, with
/// `in_full_list: false`: a vmid that either source shows as taken is taken.
pub fn join<'a>(full: &'a FullGuestList, pool: &'a PoolView) -> Inventory<'a> {
    Inventory { full, pool }
}

fn pool_membership(g: &PoolGuest) -> Membership {
    Membership::Pool {
        name: g.name.clone(),
        status: g.status.clone(),
    }
}

impl Inventory<'_> {
    /// Where the full guest list came from.
    pub fn source(&self) -> &ListSource {
        self.full.source()
    }

    fn full_row(&self, e: &GuestEntry) -> InventoryRow {
        InventoryRow {
            vmid: e.vmid,
            kind: e.kind,
            node: e.node.to_string(),
            membership: self
                .pool
                .get(e.vmid)
                .map_or(Membership::Foreign, pool_membership),
            in_full_list: true,
        }
    }

    fn pool_only_row(g: &PoolGuest) -> InventoryRow {
        InventoryRow {
            vmid: g.vmid,
            kind: g.kind,
            node: g.node.clone(),
            membership: pool_membership(g),
            in_full_list: false,
        }
    }

    /// The row at `vmid`, if any guest holds it.
    pub fn get(&self, vmid: u32) -> Option<InventoryRow> {
        match self.full.lookup(vmid) {
            Some(e) => Some(self.full_row(e)),
            None => self.pool.get(vmid).map(Self::pool_only_row),
        }
    }

    /// Every row, by ascending vmid.
    pub fn rows(&self) -> Vec<InventoryRow> {
        let mut rows: Vec<InventoryRow> = self.full.entries().map(|e| self.full_row(e)).collect();
        let before = rows.len();
        rows.extend(
            self.pool
                .guests()
                .filter(|g| !self.full.contains(g.vmid))
                .map(Self::pool_only_row),
        );
        if rows.len() > before {
            rows.sort_by_key(|r| r.vmid);
        }
        rows
    }

    /// The document `felhom-agent guests --json` prints (shown on this node only).
    pub fn guests_report(&self) -> GuestsReport {
        let source = self.source();
        GuestsReport {
            guests: self
                .rows()
                .into_iter()
                .map(|r| GuestsReportRow {
                    vmid: r.vmid,
                    kind: r.kind,
                    in_pool: r.in_pool(),
                    in_full_list: r.in_full_list,
                    name: match r.membership {
                        Membership::Pool { name, .. } => name,
                        Membership::Foreign => None,
                    },
                    node: r.node,
                })
                .collect(),
            source: source.kind_str(),
            cluster_wide: source.cluster_wide(),
            source_description: source.describe(),
        }
    }

    /// The form meant for the hub: pool guests with their names, foreign guests as bare vmids.
    pub fn hub_inventory(&self) -> HubInventory {
        let mut pool_guests = Vec::new();
        let mut foreign_vmids = Vec::new();
        for r in self.rows() {
            match r.membership {
                Membership::Pool { name, status } => pool_guests.push(HubPoolGuest {
                    vmid: r.vmid,
                    kind: r.kind,
                    node: r.node,
                    name,
                    status,
                }),
                Membership::Foreign => foreign_vmids.push(r.vmid),
            }
        }
        HubInventory {
            pool_guests,
            foreign_vmids,
            cluster_wide: self.source().cluster_wide(),
        }
    }
}

impl GuestLookup for Inventory<'_> {
    fn holder(&self, vmid: u32) -> Option<Holder> {
        self.get(vmid).map(|r| r.holder())
    }

    fn is_held(&self, vmid: u32) -> bool {
        self.full.contains(vmid) || self.pool.get(vmid).is_some()
    }
}

/// One guest of `guests --json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GuestsReportRow {
    /// The vmid.
    pub vmid: u32,
    /// `lxc`, `qemu` or `openvz`.
    #[serde(rename = "type")]
    pub kind: GuestType,
    /// The node it is on.
    pub node: String,
    /// True for a pool guest (visible to the hub), false for a foreign one.
    pub in_pool: bool,
    /// False for a pool guest the full list did not have yet.
    pub in_full_list: bool,
    /// The name, for pool guests only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// The document `felhom-agent guests --json` prints:
/// `{"guests": [{"vmid", "type", "node", "in_pool", "in_full_list", "name"?}], "source":
/// "vmlist|local_commands", "cluster_wide": bool, "source_description": "…"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GuestsReport {
    /// Every guest, by ascending vmid.
    pub guests: Vec<GuestsReportRow>,
    /// `vmlist` or `local_commands`.
    pub source: &'static str,
    /// False when the list came from `pct list` + `qm list` (this node only).
    pub cluster_wide: bool,
    /// The source in words, for the operator.
    pub source_description: String,
}

/// A pool guest as the hub may see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HubPoolGuest {
    /// The vmid.
    pub vmid: u32,
    /// `lxc` or `qemu`.
    #[serde(rename = "type")]
    pub kind: GuestType,
    /// The node it is on.
    pub node: String,
    /// Its name.
    pub name: Option<String>,
    /// Its status.
    pub status: Option<String>,
}

/// The inventory as the hub may see it: pool guests in full, and the vmids held by foreign
/// guests with nothing else about them. Built only by [`Inventory::hub_inventory`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HubInventory {
    /// The pool guests, by ascending vmid.
    pub pool_guests: Vec<HubPoolGuest>,
    /// The vmids held by guests outside the pool, ascending.
    pub foreign_vmids: Vec<u32>,
    /// False when the full list saw only this node.
    pub cluster_wide: bool,
}

// ---------------------------------------------------------------------------------------------
// The holder of a vmid, as the vmid policy sees it

/// The guest that holds a vmid, as the vmid policy needs to know it.
///
/// A foreign guest's name is not part of it: [`Membership::Foreign`] has no room for one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Container, virtual machine or legacy OpenVZ container.
    pub kind: GuestType,
    /// The cluster node the guest is on.
    pub node: String,
    /// Whether the guest is in the fleet's pool (and then its name, if the API gave one).
    pub membership: Membership,
}

impl Holder {
    /// True when the agent's pool-scoped token cannot see this guest.
    pub fn foreign(&self) -> bool {
        matches!(self.membership, Membership::Foreign)
    }
}

/// Answers "which guest holds this vmid?" for the vmid policy (`vmid::check`,
/// `vmid::restore_band_pick`).
///
/// [`Inventory`] (the full guest list joined with the pool view) is the implementation the
/// agent uses.
pub trait GuestLookup {
    /// The guest holding `vmid`, if any.
    fn holder(&self, vmid: u32) -> Option<Holder>;

    /// True when some guest holds `vmid`.
    fn is_held(&self, vmid: u32) -> bool {
        self.holder(vmid).is_some()
    }
}

impl GuestLookup for BTreeMap<u32, Holder> {
    fn holder(&self, vmid: u32) -> Option<Holder> {
        self.get(&vmid).cloned()
    }

    fn is_held(&self, vmid: u32) -> bool {
        self.contains_key(&vmid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::fixtures::{row, sample_parts};

    #[test]
    fn join_marks_pool_and_foreign_and_adds_late_pool_guests() {
        let (full, pool) = sample_parts();
        let inv = join(&full, &pool);
        let rows: Vec<(u32, bool, bool)> = inv
            .rows()
            .iter()
            .map(|r| (r.vmid, r.in_pool(), r.in_full_list))
            .collect();
        assert_eq!(
            rows,
            vec![
                (101, false, true),
                (120, true, true),
                (121, true, false),
                (300, false, true)
            ]
        );
        assert_eq!(
            inv.get(120).map(|r| r.membership),
            Some(Membership::Pool {
                name: Some("web".into()),
                status: Some("running".into())
            })
        );
        assert_eq!(
            inv.get(300).map(|r| r.membership),
            Some(Membership::Foreign)
        );
        assert_eq!(inv.get(121).map(|r| r.node), Some("pve1".to_owned()));
        assert_eq!(inv.get(122), None);
    }

    #[test]
    fn guests_report_json() {
        let (full, pool) = sample_parts();
        let json = serde_json::to_value(join(&full, &pool).guests_report()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "guests": [
                    {"vmid": 101, "type": "lxc", "node": "pve2", "in_pool": false, "in_full_list": true},
                    {"vmid": 120, "type": "lxc", "node": "pve1", "in_pool": true, "in_full_list": true, "name": "web"},
                    {"vmid": 121, "type": "qemu", "node": "pve1", "in_pool": true, "in_full_list": false, "name": "new"},
                    {"vmid": 300, "type": "qemu", "node": "pve3", "in_pool": false, "in_full_list": true}
                ],
                "source": "vmlist",
                "cluster_wide": true,
                "source_description": "/etc/pve/.vmlist (cluster-wide)"
            })
        );
    }

    #[test]
    fn hub_inventory_carries_no_foreign_detail() {
        let (full, pool) = sample_parts();
        let hub = join(&full, &pool).hub_inventory();
        assert_eq!(hub.foreign_vmids, vec![101, 300]);
        assert_eq!(
            hub.pool_guests.iter().map(|g| g.vmid).collect::<Vec<_>>(),
            vec![120, 121]
        );
        let text = serde_json::to_string(&hub).unwrap();
        assert!(!text.contains("secret-name"), "{text}");
        assert!(
            !text.contains("pve2"),
            "a foreign guest's node leaked: {text}"
        );
    }

    #[test]
    fn pool_view_drops_rows_outside_the_pool() {
        let view = PoolView::from_resources(
            "felhom",
            vec![
                row(120, GuestType::Lxc, "pve1", "web", Some("felhom")),
                row(130, GuestType::Lxc, "pve1", "x", None),
                row(140, GuestType::Lxc, "pve1", "y", Some("other")),
            ],
        );
        assert_eq!(view.guests().map(|g| g.vmid).collect::<Vec<_>>(), vec![120]);
        assert_eq!(view.outside_pool().collect::<Vec<_>>(), vec![130, 140]);
    }
}
