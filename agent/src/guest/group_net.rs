//! What an application group's members' stored addresses allow in the group's lab, read from
//! their backups' stored configs (the guest's owner wrote them: hostile, bounded).
//!
//! The lab is a bridge with nothing else on it: no DHCP server, no router advertisement, no
//! router, no DNS. A member's copy has the addresses its backup stores (pve-container's
//! `Setup/Debian.pm` `setup_network` wrote them into the guest at its last start, from each
//! `netN`'s `ip=`/`ip6=`), and nothing else. So:
//! - a member without a static stored address (`ip=dhcp`, `ip6=auto`/`dhcp`, no `ip=`) comes
//!   up without an address in the lab, and no other member reaches it;
//! - two members that share no subnet need a router to reach each other, and the lab has none.
//!
//! Both are warnings ([`address_warnings`]): doctor names them, and a group's run says them.
//!
//! And PVE writes the guest's `/etc/hosts` at every start from `net0` only (pve-container
//! `Setup/Base.pm` `set_hostname` → `update_etc_hosts`, the address from `PVE::LXC`
//! `get_primary_ips`): a copy has no `net0`, so PVE writes `127.0.1.1 <names>` there. What
//! PVE would have written for the stored `net0` is [`hosts_entry`] (the lab writes it back:
//! `crate::guest::lab`). Sources: `tests/data/groups-facts.md`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::pve::guest_config::{property_items, StoredConfig};
use crate::pve::GuestKind;

/// One family's setting of a stored NIC (`ip=` or `ip6=`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Setting<A> {
    /// Not set.
    Unset,
    /// `dhcp`: a lease that cannot come in the lab.
    Dhcp,
    /// `auto` (IPv6 SLAAC): a router advertisement that cannot come in the lab.
    Auto,
    /// `manual`: the guest sets its address itself; not judged.
    Manual,
    /// An address with its prefix length.
    Static(A, u8),
    /// A value PVE's formats refuse (not judged).
    Unreadable,
}

impl<A: std::str::FromStr> Setting<A> {
    fn parse(value: Option<&str>, max_prefix: u8, auto: bool) -> Self {
        let Some(v) = value else {
            return Self::Unset;
        };
        match v {
            "dhcp" => Self::Dhcp,
            "manual" => Self::Manual,
            "auto" if auto => Self::Auto,
            _ => {
                let Some((addr, prefix)) = v.split_once('/') else {
                    return Self::Unreadable;
                };
                match (addr.parse::<A>(), prefix.parse::<u8>()) {
                    (Ok(a), Ok(p)) if p <= max_prefix => Self::Static(a, p),
                    _ => Self::Unreadable,
                }
            }
        }
    }
}

/// One stored NIC's addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicAddr {
    /// `net0`, `net1`, …
    pub key: String,
    /// `ip=`.
    pub v4: Setting<Ipv4Addr>,
    /// `ip6=`.
    pub v6: Setting<Ipv6Addr>,
}

impl NicAddr {
    /// It has a static address (either family).
    fn is_static(&self) -> bool {
        matches!(self.v4, Setting::Static(..)) || matches!(self.v6, Setting::Static(..))
    }

    /// The guest sets an address itself, or PVE would refuse the value: not judged.
    fn unjudged(&self) -> bool {
        matches!(self.v4, Setting::Manual | Setting::Unreadable)
            || matches!(self.v6, Setting::Manual | Setting::Unreadable)
    }

    /// `net0 (ip=dhcp, ip6=auto)`, `net1 (no ip=)`.
    fn describe(&self) -> String {
        let mut parts = Vec::new();
        match &self.v4 {
            Setting::Unset => parts.push("no ip=".to_string()),
            Setting::Dhcp => parts.push("ip=dhcp".to_string()),
            Setting::Static(a, p) => parts.push(format!("ip={a}/{p}")),
            Setting::Manual => parts.push("ip=manual".to_string()),
            Setting::Auto | Setting::Unreadable => parts.push("ip= unreadable".to_string()),
        }
        match &self.v6 {
            Setting::Unset => {}
            Setting::Dhcp => parts.push("ip6=dhcp".to_string()),
            Setting::Auto => parts.push("ip6=auto".to_string()),
            Setting::Static(a, p) => parts.push(format!("ip6={a}/{p}")),
            Setting::Manual => parts.push("ip6=manual".to_string()),
            Setting::Unreadable => parts.push("ip6= unreadable".to_string()),
        }
        format!("{} ({})", self.key, parts.join(", "))
    }

    /// Its static addresses, described (`net0 10.20.0.30/24`).
    fn statics(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Setting::Static(a, p) = &self.v4 {
            out.push(format!("{} {a}/{p}", self.key));
        }
        if let Setting::Static(a, p) = &self.v6 {
            out.push(format!("{} {a}/{p}", self.key));
        }
        out
    }
}

/// The addresses of each NIC a container's stored config holds (`ip=`, `ip6=` of each `netN`,
/// as pve-container's `parse_lxc_network` reads them), in key order.
pub fn nic_addresses(stored: &StoredConfig) -> Vec<NicAddr> {
    stored
        .nics(GuestKind::Lxc)
        .into_iter()
        .map(|nic| {
            let items = stored.get(&nic.key).map(property_items).unwrap_or_default();
            let item = |key: &str| {
                items
                    .iter()
                    .find(|(k, _)| k == key)
                    .and_then(|(_, v)| v.as_deref())
            };
            NicAddr {
                v4: Setting::parse(item("ip"), 32, false),
                v6: Setting::parse(item("ip6"), 128, true),
                key: nic.key,
            }
        })
        .collect()
}

/// A member of a group as its stored config shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The guest's vmid.
    pub vmid: u32,
    /// Its name (escaped), or empty.
    pub name: String,
    /// Its stored NICs' addresses.
    pub nics: Vec<NicAddr>,
}

impl Member {
    /// `200 (db)`.
    fn shown(&self) -> String {
        if self.name.is_empty() {
            self.vmid.to_string()
        } else {
            format!("{} ({})", self.vmid, self.name)
        }
    }
}

/// Whether `a/pa` and `b/pb` see each other on one link: each address is in the other's subnet.
fn same_subnet(a: IpAddr, pa: u8, b: IpAddr, pb: u8) -> bool {
    fn within(net: IpAddr, prefix: u8, addr: IpAddr) -> bool {
        match (net, addr) {
            (IpAddr::V4(n), IpAddr::V4(x)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
                u32::from(n) & mask == u32::from(x) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(x)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
                u128::from(n) & mask == u128::from(x) & mask
            }
            _ => false,
        }
    }
    within(a, pa, b) && within(b, pb, a)
}

/// Every static address of `m` with its prefix.
fn static_addrs(m: &Member) -> Vec<(IpAddr, u8)> {
    let mut out = Vec::new();
    for n in &m.nics {
        if let Setting::Static(a, p) = n.v4 {
            out.push((IpAddr::V4(a), p));
        }
        if let Setting::Static(a, p) = n.v6 {
            out.push((IpAddr::V6(a), p));
        }
    }
    out
}

/// What the group `group`'s members' stored addresses cannot do in the group's lab, one
/// sentence each, naming the member, its `netN` and the fix: a member without a NIC, a member
/// without any static address (none `manual`), two members (each with a static address) that
/// share no subnet.
pub fn address_warnings(group: &str, members: &[Member]) -> Vec<String> {
    let mut out = Vec::new();
    for m in members {
        if m.nics.is_empty() {
            out.push(format!(
                "group {group}: member {} stores no NIC: nothing of its copy joins the group's lab and no member can reach it; give it a NIC with a static address in its config, or take it out of the group",
                m.shown()
            ));
            continue;
        }
        if m.nics.iter().any(NicAddr::is_static) || m.nics.iter().any(NicAddr::unjudged) {
            continue;
        }
        let first = &m.nics[0].key;
        out.push(format!(
            "group {group}: member {} has no static stored address ({}): the group's lab has no DHCP server and no router, so its copy comes up without an address there and no member can reach it; give it a static address (`pct set {} -{first} <its value with ip=ADDRESS/PREFIX>`), or take it out of the group",
            m.shown(),
            m.nics.iter().map(NicAddr::describe).collect::<Vec<_>>().join(", "),
            m.vmid
        ));
    }
    for (i, a) in members.iter().enumerate() {
        let aa = static_addrs(a);
        if aa.is_empty() {
            continue;
        }
        for b in &members[i + 1..] {
            let bb = static_addrs(b);
            if bb.is_empty() {
                continue;
            }
            let shared = aa
                .iter()
                .any(|(x, px)| bb.iter().any(|(y, py)| same_subnet(*x, *px, *y, *py)));
            if shared {
                continue;
            }
            let list = |m: &Member| {
                m.nics
                    .iter()
                    .flat_map(NicAddr::statics)
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            out.push(format!(
                "group {group}: members {} ({}) and {} ({}) share no subnet: the group's lab has no router, so they cannot reach each other there; give them addresses of one subnet, or take one of them out of the group",
                a.shown(),
                list(a),
                b.shown(),
                list(b)
            ));
        }
    }
    out
}

/// What a member's vmid is when it is reserved (the restore-test band, where copies are made,
/// or the selftest's scratch vmid): never a guest whose backups are proven.
pub fn reserved_member(vmid: u32) -> Option<String> {
    use crate::vmid::{ReservedBand, RESTORE_TEST_BAND, SELFTEST_SCRATCH_VMID};
    Some(match ReservedBand::of(vmid)? {
        ReservedBand::SelftestScratch => {
            format!("the selftest's scratch vmid {SELFTEST_SCRATCH_VMID}")
        }
        ReservedBand::RestoreTestBand => format!(
            "a vmid of the restore-test band {}-{}, where the copies are made",
            RESTORE_TEST_BAND.start(),
            RESTORE_TEST_BAND.end()
        ),
    })
}

/// The line PVE writes into a container's `/etc/hosts` for its stored `net0`: the address
/// `get_primary_ips` returns (`ip=` unless `dhcp`/`manual`, else `ip6=` unless
/// `auto`/`dhcp`/`manual`, the prefix length cut off) and the hostname's first label, which
/// `update_etc_hosts` writes last on the line (`<fqdn> <name>` or `<name>.<domain>… <name>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostsEntry {
    /// The stored `net0` address.
    pub ip: IpAddr,
    /// The hostname's first label (what ends PVE's line).
    pub name: String,
}

/// Whether `name` is a hostname as PVE takes one (pve-common `JSONSchema.pm`
/// `pve_verify_dns_name`: labels of letters, digits and inner `-`, joined by `.`), at most 255
/// characters.
fn dns_name(name: &str) -> bool {
    name.len() <= 255
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

/// What PVE would have written into `/etc/hosts` for this stored config's `net0` (`None`: no
/// `net0`, no static address on it, no hostname, or the hostname `localhost`: PVE writes
/// `127.0.1.1` then in production too, or a line of no use).
pub fn hosts_entry(stored: &StoredConfig) -> Option<HostsEntry> {
    let hostname = stored.get("hostname")?;
    if !dns_name(hostname) {
        return None;
    }
    let name = hostname.split('.').next()?.to_string();
    if name == "localhost" {
        return None;
    }
    let net0 = nic_addresses(stored)
        .into_iter()
        .find(|n| n.key == "net0")?;
    let ip = match (net0.v4, net0.v6) {
        (Setting::Static(a, _), _) => IpAddr::V4(a),
        (_, Setting::Static(a, _)) => IpAddr::V6(a),
        _ => return None,
    };
    Some(HostsEntry { ip, name })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(vmid: u32, name: &str, config: &str) -> Member {
        Member {
            vmid,
            name: name.to_string(),
            nics: nic_addresses(&StoredConfig::parse(config)),
        }
    }

    #[test]
    fn members_on_one_subnet_with_static_addresses_warn_of_nothing() {
        let db = member(200, "db", "net0: name=eth0,bridge=vmbr0,ip=10.20.0.30/24\n");
        let shop = member(
            201,
            "shop",
            "net0: name=eth0,bridge=vmbr0,ip=10.20.0.31/24,ip6=auto\n",
        );
        assert!(address_warnings("shop", &[db, shop]).is_empty());
    }

    #[test]
    fn a_member_with_only_dhcp_or_slaac_is_named_with_its_nics_and_the_fix() {
        let db = member(
            200,
            "db",
            "net0: name=eth0,bridge=vmbr0,ip=dhcp,ip6=auto\nnet1: name=eth1,bridge=vmbr1\n",
        );
        let shop = member(
            201,
            "shop",
            "net0: name=eth0,bridge=vmbr0,ip=10.20.0.31/24\n",
        );
        let w = address_warnings("shop", &[db, shop]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].starts_with("group shop: member 200 (db) has no static stored address (net0 (ip=dhcp, ip6=auto), net1 (no ip=))"),
            "{}",
            w[0]
        );
        assert!(w[0].contains("`pct set 200 -net0 "), "{}", w[0]);
    }

    #[test]
    fn a_manual_address_is_not_judged_and_a_member_without_nics_is_named() {
        let a = member(200, "", "net0: name=eth0,bridge=vmbr0,ip=manual\n");
        let b = member(201, "b", "memory: 512\n");
        let w = address_warnings("g", &[a, b]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("member 201 (b) stores no NIC"), "{}", w[0]);
    }

    #[test]
    fn members_on_different_subnets_are_named_with_their_addresses() {
        let db = member(200, "db", "net0: name=eth0,bridge=vmbr0,ip=10.20.0.30/24\n");
        let shop = member(
            201,
            "shop",
            "net0: name=eth0,bridge=vmbr0,ip=10.30.0.31/24\n",
        );
        let w = address_warnings("shop", &[db.clone(), shop]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("members 200 (db) (net0 10.20.0.30/24) and 201 (shop) (net0 10.30.0.31/24) share no subnet"),
            "{}",
            w[0]
        );
        // A wider prefix on one side is not enough: the other must see it too.
        let wide = member(202, "w", "net0: name=eth0,bridge=vmbr0,ip=10.30.0.5/8\n");
        assert_eq!(address_warnings("g", &[db.clone(), wide]).len(), 1);
        let both = member(203, "b", "net0: name=eth0,bridge=vmbr0,ip=10.20.0.5/16\n");
        assert!(address_warnings("g", &[db, both]).is_empty());
        // IPv6 on one subnet joins members whose IPv4 subnets differ.
        let a = member(
            1,
            "",
            "net0: name=eth0,bridge=vmbr0,ip=10.1.0.1/24,ip6=fd00::1/64\n",
        );
        let b = member(
            2,
            "",
            "net0: name=eth0,bridge=vmbr0,ip=10.2.0.1/24,ip6=fd00::2/64\n",
        );
        assert!(address_warnings("g", &[a, b]).is_empty());
    }

    #[test]
    fn the_hosts_entry_is_pves_for_net0_only() {
        let entry = |c: &str| hosts_entry(&StoredConfig::parse(c));
        assert_eq!(
            entry("hostname: db.example.com\nnet0: name=eth0,bridge=vmbr0,ip=10.20.0.30/24\n"),
            Some(HostsEntry {
                ip: "10.20.0.30"
                    .parse()
                    .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
                name: "db".to_string()
            })
        );
        // ip=dhcp: ip6 then, as get_primary_ips ($ipv4 || $ipv6).
        assert_eq!(
            entry("hostname: db\nnet0: name=eth0,ip=dhcp,ip6=fd00::30/64\n").map(|e| e.ip),
            "fd00::30".parse().ok()
        );
        for none in [
            "hostname: db\nnet0: name=eth0,ip=dhcp,ip6=auto\n",
            "hostname: db\nnet1: name=eth1,ip=10.20.0.30/24\n",
            "net0: name=eth0,ip=10.20.0.30/24\n",
            "hostname: localhost\nnet0: name=eth0,ip=10.20.0.30/24\n",
            "hostname: db;reboot\nnet0: name=eth0,ip=10.20.0.30/24\n",
            "hostname: -db\nnet0: name=eth0,ip=10.20.0.30/24\n",
            "hostname: db\nnet0: name=eth0,ip=10.20.0.300/24\n",
        ] {
            assert_eq!(entry(none), None, "{none}");
        }
    }
}
