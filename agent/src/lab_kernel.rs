//! The lab bridge as the kernel has it: what an isolated VM copy's NICs would reach there.
//!
//! PVE's list of the node's bridges (pve-manager `PVE/API2/Network.pm` `index`) is read from
//! `/etc/network/interfaces`: a port plugged in by hand or by another guest, a device stacked
//! on the bridge, an address added by a `post-up` line, IPv6 left on and the node's IPv4
//! routing do not show there. So the preflight of every isolated VM copy and `doctor` read the
//! kernel's own files (world-readable; the agent runs unprivileged):
//! - `/sys/class/net/<bridge>/brif/`: the bridge's ports, none but this copy's own taps;
//! - `/sys/class/net/<bridge>/upper_*`: no device on top of the bridge (a VLAN device, a
//!   macvlan), which would take the copy's frames into the node's IP stack or another bridge;
//! - `/proc/sys/net/ipv6/conf/<bridge>/disable_ipv6` = 1 (no `/proc/sys/net/ipv6`: the node
//!   booted with `ipv6.disable=1`, IPv6 is off everywhere);
//! - the IPv4 reverse-path filter on: max(`conf/all/rp_filter`, `conf/<bridge>/rp_filter`)
//!   ≥ 1, together with no IPv4 address on the bridge (on a device with no IPv4 address the
//!   filter, strict or loose, drops a packet whose source the node would not route back
//!   through that device: every packet the copy sends to the node or through it);
//! - `/proc/sys/net/ipv4/conf/<bridge>/forwarding` = 0;
//! - no address on the bridge (IPv4: `getifaddrs`, a netlink dump; IPv6: `/proc/net/if_inet6`).
//!
//! Kernel facts (Documentation/networking/ip-sysctl.rst) and why each check: see
//! `tests/data/lab-bridge-kernel-facts.md`.

use std::path::{Path, PathBuf};

/// Test hook (only with the `test-hooks` feature): the folder the kernel's files are read
/// under instead of `/` (`<root>/sys/class/net/…`, `<root>/proc/sys/net/…`,
/// `<root>/proc/net/if_inet6`). IPv4 addresses are always those of the process's network
/// namespace.
#[cfg(feature = "test-hooks")]
pub const KERNEL_ROOT_ENV: &str = "FELHOM_AGENT_KERNEL_ROOT";

/// Where the kernel's files are read: `/`.
#[cfg(not(feature = "test-hooks"))]
pub fn kernel_root() -> PathBuf {
    PathBuf::from("/")
}

/// Where the kernel's files are read: `/`, or [`KERNEL_ROOT_ENV`].
#[cfg(feature = "test-hooks")]
pub fn kernel_root() -> PathBuf {
    std::env::var_os(KERNEL_ROOT_ENV).map_or_else(|| PathBuf::from("/"), PathBuf::from)
}

/// Which ports the bridge may have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ports {
    /// None at all (before the restore; `doctor`).
    None,
    /// Only the taps of the VM copy `vmid` (`tap<vmid>i<n>`: qemu-server
    /// `print_netdev_full`), from its start on.
    TapsOf(u32),
    /// Only the taps of these VM copies: the VM members of one application group, which
    /// share the group's lab bridge; and the link of the group's containers' lab to it
    /// (`Some`: its port's name, [`crate::guest::group_lab::link_port_name`]).
    TapsOfAny(Vec<u32>, Option<String>),
}

/// Whether `port` is a tap of VM `vmid` (`tap<vmid>i<n>`).
pub fn is_tap_of(port: &str, vmid: u32) -> bool {
    port.strip_prefix(&format!("tap{vmid}i"))
        .is_some_and(|n| !n.is_empty() && n.len() <= 3 && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The `post-up` lines of the lab bridge's stanza that set what the kernel checks need
/// (ifupdown2 runs them at every `ifreload -a`).
pub fn post_up_lines(bridge: &str) -> [String; 3] {
    [
        format!("post-up sysctl -w net.ipv6.conf.{bridge}.disable_ipv6=1"),
        format!("post-up sysctl -w net.ipv4.conf.{bridge}.rp_filter=1"),
        format!("post-up sysctl -w net.ipv4.conf.{bridge}.forwarding=0"),
    ]
}

/// One file of the kernel, read: its first line, trimmed.
fn read_value(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path)
        .map(|s| s.lines().next().unwrap_or("").trim().to_string())
        .map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// The devices stacked on `dev` (`<root>/sys/class/net/<dev>/upper_<name>` links), sorted.
fn uppers(root: &Path, dev: &str) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(root.join("sys/class/net").join(dev))
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| {
                    e.file_name()
                        .to_str()
                        .and_then(|n| n.strip_prefix("upper_"))
                        .map(str::to_string)
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// The IPv4 addresses of `dev` in this process's network namespace (`getifaddrs`: a netlink
/// `RTM_GETADDR` dump, no privilege needed); an alias label `dev:N` counts as `dev`.
fn ipv4_addresses(dev: &str) -> Result<Vec<String>, String> {
    let all = nix::ifaddrs::getifaddrs()
        .map_err(|e| format!("cannot list the node's addresses (getifaddrs): {e}"))?;
    let alias = format!("{dev}:");
    Ok(all
        .filter(|a| a.interface_name == dev || a.interface_name.starts_with(&alias))
        .filter_map(|a| {
            a.address
                .as_ref()
                .and_then(|s| s.as_sockaddr_in())
                .map(|s| s.ip().to_string())
        })
        .collect())
}

/// The IPv6 addresses of `dev` (`<root>/proc/net/if_inet6`: address, ifindex, prefix length,
/// scope, flags, name). `Ok(empty)` when the node has no IPv6 at all.
fn ipv6_addresses(root: &Path, dev: &str) -> Result<Vec<String>, String> {
    if !root.join("proc/sys/net/ipv6").exists() {
        return Ok(Vec::new());
    }
    let path = root.join("proc/net/if_inet6");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 6 && f[5] == dev).then(|| {
                let hex = f[0];
                let groups: Vec<&str> = (0..8).filter_map(|i| hex.get(i * 4..i * 4 + 4)).collect();
                let addr = groups
                    .join(":")
                    .parse::<std::net::Ipv6Addr>()
                    .map_or_else(|_| hex.to_string(), |a| a.to_string());
                format!("{addr}/{}", u8::from_str_radix(f[2], 16).unwrap_or(0))
            })
        })
        .collect())
}

/// What is wrong with the lab bridge `bridge` in the kernel read under `root`, each with the
/// file read, the value found and the fix; empty when a copy on it reaches neither the node
/// nor anything beyond it.
pub fn faults(root: &Path, bridge: &str, ports: Ports) -> Vec<String> {
    let show = |p: &Path| -> String {
        // The path as it is on a node (the root is a test's folder only).
        let rel = p.strip_prefix(root).unwrap_or(p);
        format!("/{}", rel.display())
    };
    let stanza = "its stanza in /etc/network/interfaces, then `ifreload -a`";
    let dev = root.join("sys/class/net").join(bridge);
    if !dev.exists() {
        return vec![format!(
            "bridge {bridge} is not in the kernel ({} is missing): a VM copy's start onto it would fail; bring it up: `ifreload -a` (or `ifup {bridge}`)",
            show(&dev)
        )];
    }
    if !dev.join("bridge").is_dir() {
        return vec![format!(
            "{bridge} is not a Linux bridge in the kernel ({} is missing); make it one (`bridge-ports none` in {stanza})",
            show(&dev.join("bridge"))
        )];
    }
    let mut out = Vec::new();
    // Ports.
    let brif = dev.join("brif");
    match std::fs::read_dir(&brif) {
        Err(e) => out.push(format!(
            "cannot read {} ({e}), so the ports of bridge {bridge} are unknown; check that the bridge is up (`ip link show {bridge}`)",
            show(&brif)
        )),
        Ok(rd) => {
            let mut foreign: Vec<String> = rd
                .filter_map(Result::ok)
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|p| match &ports {
                    Ports::None => true,
                    Ports::TapsOf(vmid) => !is_tap_of(p, *vmid),
                    Ports::TapsOfAny(vmids, link) => {
                        !vmids.iter().any(|v| is_tap_of(p, *v)) && link.as_deref() != Some(p)
                    }
                })
                .collect();
            foreign.sort();
            if !foreign.is_empty() {
                let whose = match &ports {
                    Ports::None => "no port may be on it before a copy's restore".to_string(),
                    Ports::TapsOf(vmid) => {
                        format!("only the taps of the copy {vmid} (tap{vmid}iN) may be on it")
                    }
                    Ports::TapsOfAny(vmids, link) => format!(
                        "only the taps of the group's copies {}{} may be on it",
                        vmids
                            .iter()
                            .map(u32::to_string)
                            .collect::<Vec<_>>()
                            .join(", "),
                        link.as_deref()
                            .map(|l| format!(" and the link of its containers' lab ({l})"))
                            .unwrap_or_default()
                    ),
                };
                out.push(format!(
                    "{} lists port(s) {} of bridge {bridge}: a VM copy on it would reach them (another guest's tap, a kept copy, a NIC); {whose}; take each off (`ip link set <port> nomaster`, remove it from `bridge-ports` in {stanza}, move a guest's NIC to another bridge)",
                    show(&brif),
                    foreign.join(", ")
                ));
            }
        }
    }
    // Devices on top of it.
    let mut stacked = Vec::new();
    let mut todo = uppers(root, bridge);
    while let Some(up) = todo.pop() {
        if stacked.contains(&up) || stacked.len() >= 32 {
            continue;
        }
        todo.extend(uppers(root, &up));
        stacked.push(up);
    }
    stacked.sort();
    for up in &stacked {
        let mut addrs = ipv4_addresses(up).unwrap_or_default();
        addrs.extend(ipv6_addresses(root, up).unwrap_or_default());
        let has = if addrs.is_empty() {
            String::new()
        } else {
            format!(", with address(es) {} of the node", addrs.join(", "))
        };
        out.push(format!(
            "{} shows device {up} on top of bridge {bridge}{has}: the copy's frames reach the node's IP stack (or the bridge {up} is a port of) through it; remove it (`ip link del {up}`, and its stanza or `vlan-raw-device {bridge}` line from /etc/network/interfaces, then `ifreload -a`)",
            show(&dev.join(format!("upper_{up}")))
        ));
    }
    // IPv6.
    let v6 = root.join("proc/sys/net/ipv6");
    if v6.exists() {
        let f = v6.join("conf").join(bridge).join("disable_ipv6");
        match read_value(&f) {
            Ok(v) if v == "1" => {}
            Ok(v) => out.push(format!(
                "{} is {v}: IPv6 is on on bridge {bridge}, so the node has a link-local address there (its services on `::` answer a copy) and takes a copy's Router Advertisement (a default route through the copy); add `post-up sysctl -w net.ipv6.conf.{bridge}.disable_ipv6=1` to {stanza}",
                show(&f)
            )),
            Err(e) => out.push(format!("{e}: whether IPv6 is off on bridge {bridge} is unknown")),
        }
    }
    // IPv4: no address, strict reverse-path filter, no forwarding.
    let v4 = root.join("proc/sys/net/ipv4/conf");
    match ipv4_addresses(bridge) {
        Ok(a) if a.is_empty() => {}
        Ok(a) => out.push(format!(
            "bridge {bridge} has IPv4 address(es) {} of the node: a copy on it reaches the node there, and the reverse-path filter lets through what it sends to that network; remove them (`ip addr flush dev {bridge}`; `iface {bridge} inet manual` with no `address` or `up ip addr` line in /etc/network/interfaces, then `ifreload -a`)",
            a.join(", ")
        )),
        Err(e) => out.push(format!("{e}: whether bridge {bridge} has an IPv4 address is unknown")),
    }
    let all_rp = v4.join("all/rp_filter");
    let dev_rp = v4.join(bridge).join("rp_filter");
    match (read_value(&all_rp), read_value(&dev_rp)) {
        (Ok(a), Ok(d)) => {
            let num = |s: &str| s.parse::<u32>().ok();
            let max = num(&a).zip(num(&d)).map(|(a, d)| a.max(d));
            // 1 (strict) and 2 (loose) both drop every packet arriving on a device with no
            // IPv4 address whose source the node does not route through that device
            // (fib_frontend.c __fib_validate_source: `no_addr` → `last_resort` → drop when
            // rpf is set): with the address check above, all a copy sends there.
            if !matches!(max, Some(1 | 2)) {
                out.push(format!(
                    "the IPv4 reverse-path filter on bridge {bridge} is max({} = {a}, {} = {d}) = {}: without it the node takes a copy's packets to any of its addresses (it answers ARP there) and routes them on when forwarding is on; add `post-up sysctl -w net.ipv4.conf.{bridge}.rp_filter=1` to {stanza}",
                    show(&all_rp),
                    show(&dev_rp),
                    max.map_or_else(|| "not a number".to_string(), |m| m.to_string())
                ));
            }
        }
        (Err(e), _) | (_, Err(e)) => out.push(format!(
            "{e}: the IPv4 reverse-path filter on bridge {bridge} is unknown"
        )),
    }
    let fwd = v4.join(bridge).join("forwarding");
    match read_value(&fwd) {
        Ok(v) if v == "0" => {}
        Ok(v) => out.push(format!(
            "{} is {v}: the node routes what a copy sends on bridge {bridge} on to its other networks; add `post-up sysctl -w net.ipv4.conf.{bridge}.forwarding=0` to {stanza} (turning net.ipv4.ip_forward or net.ipv4.conf.all.forwarding on sets every device's forwarding again; ifupdown2's `ip-forward off` in the stanza is applied again only at the next `ifreload -a`)",
            show(&fwd)
        )),
        Err(e) => out.push(format!("{e}: whether the node forwards from bridge {bridge} is unknown")),
    }
    // The bridge's own IPv6 addresses (IPv6 on: a link-local once a port is up).
    match ipv6_addresses(root, bridge) {
        Ok(a) if a.is_empty() => {}
        Ok(a) => out.push(format!(
            "{} lists IPv6 address(es) {} on bridge {bridge}: a copy reaches the node there; remove them (`ip -6 addr flush dev {bridge}`) and turn IPv6 off on it (`post-up sysctl -w net.ipv6.conf.{bridge}.disable_ipv6=1` in {stanza})",
            show(&root.join("proc/net/if_inet6")),
            a.join(", ")
        )),
        Err(e) => out.push(format!("{e}: whether bridge {bridge} has an IPv6 address is unknown")),
    }
    out
}

/// [`faults`] under [`kernel_root`].
pub fn faults_now(bridge: &str, ports: Ports) -> Vec<String> {
    faults(&kernel_root(), bridge, ports)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel tree with a lab bridge `vmbr9` as the README sets it.
    fn good_tree() -> tempfile::TempDir {
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        let w = |p: &str, v: &str| {
            let p = r.join(p);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(p, format!("{v}\n")).expect("write");
        };
        std::fs::create_dir_all(r.join("sys/class/net/vmbr9/brif")).expect("mkdir");
        std::fs::create_dir_all(r.join("sys/class/net/vmbr9/bridge")).expect("mkdir");
        w("proc/sys/net/ipv6/conf/vmbr9/disable_ipv6", "1");
        w("proc/sys/net/ipv4/conf/all/rp_filter", "0");
        w("proc/sys/net/ipv4/conf/vmbr9/rp_filter", "1");
        w("proc/sys/net/ipv4/conf/vmbr9/forwarding", "0");
        w("proc/net/if_inet6", "");
        d
    }

    #[test]
    fn a_bridge_set_as_the_readme_says_has_no_fault_and_each_setting_is_one() {
        let d = good_tree();
        let r = d.path();
        assert_eq!(faults(r, "felhomlab0", Ports::None).len(), 1);
        assert_eq!(faults(r, "vmbr9", Ports::None), Vec::<String>::new());
        let set = |p: &str, v: &str| std::fs::write(r.join(p), v).expect("write");
        let one = |needle: &str| {
            let f = faults(r, "vmbr9", Ports::None);
            assert_eq!(f.len(), 1, "{f:?}");
            assert!(f[0].contains(needle), "{f:?}");
            assert!(f[0].contains("vmbr9"), "{f:?}");
        };
        set("proc/sys/net/ipv6/conf/vmbr9/disable_ipv6", "0\n");
        one("post-up sysctl -w net.ipv6.conf.vmbr9.disable_ipv6=1");
        set("proc/sys/net/ipv6/conf/vmbr9/disable_ipv6", "1\n");
        set("proc/sys/net/ipv4/conf/vmbr9/rp_filter", "0\n");
        one("/proc/sys/net/ipv4/conf/vmbr9/rp_filter = 0");
        // The kernel takes the larger of all and the device: all = 1 (or 2) holds.
        set("proc/sys/net/ipv4/conf/all/rp_filter", "2\n");
        assert!(faults(r, "vmbr9", Ports::None).is_empty());
        set("proc/sys/net/ipv4/conf/vmbr9/rp_filter", "1\n");
        set("proc/sys/net/ipv4/conf/all/rp_filter", "0\n");
        assert!(faults(r, "vmbr9", Ports::None).is_empty());
        set("proc/sys/net/ipv4/conf/vmbr9/forwarding", "1\n");
        one("net.ipv4.conf.vmbr9.forwarding=0");
        set("proc/sys/net/ipv4/conf/vmbr9/forwarding", "0\n");
        set(
            "proc/net/if_inet6",
            "fe800000000000000000000000000001 0007 40 20 80 vmbr9\n",
        );
        one("fe80::1/64");
        set("proc/net/if_inet6", "");
        // No IPv6 at all (ipv6.disable=1): nothing to check for it.
        std::fs::remove_dir_all(r.join("proc/sys/net/ipv6")).expect("rm");
        assert!(faults(r, "vmbr9", Ports::None).is_empty());
    }

    #[test]
    fn ports_before_the_restore_none_after_the_start_only_the_copys_taps() {
        let d = good_tree();
        let r = d.path();
        let brif = r.join("sys/class/net/vmbr9/brif");
        std::fs::create_dir(brif.join("tap120i0")).expect("mkdir");
        let f = faults(r, "vmbr9", Ports::None);
        assert!(f.len() == 1 && f[0].contains("tap120i0"), "{f:?}");
        assert!(faults(r, "vmbr9", Ports::TapsOf(120)).is_empty());
        std::fs::create_dir(brif.join("tap121i0")).expect("mkdir");
        let f = faults(r, "vmbr9", Ports::TapsOf(120));
        assert!(
            f.len() == 1 && f[0].contains("tap121i0") && !f[0].contains("tap120i0,"),
            "{f:?}"
        );
        // A group's VM copies share the bridge: each one's taps, and nobody else's.
        assert!(faults(r, "vmbr9", Ports::TapsOfAny(vec![120, 121], None)).is_empty());
        std::fs::create_dir(brif.join("tap122i0")).expect("mkdir");
        let f = faults(r, "vmbr9", Ports::TapsOfAny(vec![120, 121], None));
        assert!(
            f.len() == 1 && f[0].contains("tap122i0") && f[0].contains("copies 120, 121"),
            "{f:?}"
        );
        std::fs::remove_dir(brif.join("tap122i0")).expect("rmdir");
        // The link of the group's containers' lab: its own, and no other group's.
        std::fs::create_dir(brif.join("fglAAAAAAAAAAAA")).expect("mkdir");
        let ours = Some("fglAAAAAAAAAAAA".to_string());
        assert!(faults(r, "vmbr9", Ports::TapsOfAny(vec![120, 121], ours)).is_empty());
        let f = faults(
            r,
            "vmbr9",
            Ports::TapsOfAny(vec![120, 121], Some("fglBBBBBBBBBBBB".to_string())),
        );
        assert!(
            f.len() == 1 && f[0].contains("fglAAAAAAAAAAAA") && f[0].contains("(fglBBBBBBBBBBBB)"),
            "{f:?}"
        );
        let f = faults(r, "vmbr9", Ports::TapsOfAny(vec![120, 121], None));
        assert!(f.len() == 1 && f[0].contains("fglAAAAAAAAAAAA"), "{f:?}");
        std::fs::remove_dir(brif.join("fglAAAAAAAAAAAA")).expect("rmdir");
        assert!(is_tap_of("tap120i3", 120) && !is_tap_of("tap1200i3", 120));
        assert!(!is_tap_of("tap120i", 120) && !is_tap_of("veth120i0", 120));
    }

    #[test]
    fn a_device_on_top_of_the_bridge_is_a_fault_naming_it() {
        let d = good_tree();
        let r = d.path();
        std::fs::create_dir_all(r.join("sys/class/net/vmbr9.5")).expect("mkdir");
        std::os::unix::fs::symlink("../vmbr9.5", r.join("sys/class/net/vmbr9/upper_vmbr9.5"))
            .expect("link");
        std::fs::write(
            r.join("proc/net/if_inet6"),
            "20010db8000000000000000000000001 0008 40 00 80 vmbr9.5\n",
        )
        .expect("write");
        let f = faults(r, "vmbr9", Ports::None);
        assert!(
            f.len() == 1 && f[0].contains("vmbr9.5") && f[0].contains("2001:db8::1/64"),
            "{f:?}"
        );
    }
}
