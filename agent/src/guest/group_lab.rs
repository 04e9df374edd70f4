//! An application group's lab (`[[restore_test.group]]`): the one network its members' copies
//! share, and nothing else. Root's work (the exec helper's, or the agent's own on the direct
//! route); the agent's user asks for it by transaction.
//!
//! The lab is a network namespace of the node, `felhom-g-<lab>` (the lab id is the ULID the
//! group's run journaled in each member's request), holding one bridge, `felg`, with no address
//! (not even an IPv6 link-local one) and no port but the members' own. A member container's
//! copy joins it with one veth pair per interface its backup stores: the pair is made in the
//! lab's namespace, its one end a port of `felg` (`fg<vmid>n<i>`), the other moved into the
//! copy's network namespace under the stored name (`eth0`), where the copy's own network units
//! bring it up with its stored address, as in production. The copy's network namespace is the
//! one root's LXC monitor names for the container (its init's, held open while the pair is
//! made: [`crate::guest::lxc_monitor::container_init`]), never one a path in the guest could
//! name. Nothing is made in the node's own namespace: no bridge of the node gains a port, no
//! address of the node is reachable, and the copies of other groups are in labs of their own.
//!
//! A copy's namespace is checked from outside after the join: no link in it may have a peer
//! in another namespace but the pairs just made (the lab's guard inside the copy, which the
//! guest could lie to, is told that these names are the lab's).
//!
//! The lab is removed at the group's end (`ip netns del`: the pairs go with their ends), and
//! by the next command when a killed run left it: only a name of the form `felhom-g-<ULID>`,
//! and only a lab a journaled transaction names.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use ulid::Ulid;

/// The prefix of a lab's network namespace name.
pub const NETNS_PREFIX: &str = "felhom-g-";
/// The lab's bridge, inside its namespace.
pub const BRIDGE: &str = "felg";
/// The most bytes of a copy's link listing read.
const LINKS_MAX: u64 = 1 << 20;
/// Where `ip netns` keeps its names.
const NETNS_DIR: &str = "/run/netns";

/// Joins and removals one at a time in this process: two members joining at once would both
/// make the namespace.
static LAB_LOCK: Mutex<()> = Mutex::new(());

/// The namespace name of lab `lab`.
pub fn netns_name(lab: Ulid) -> String {
    format!("{NETNS_PREFIX}{lab}")
}

/// The labs whose namespaces exist on this node (names that are not `felhom-g-<ULID>` are
/// never anyone's lab).
pub fn existing() -> Vec<Ulid> {
    let Ok(dir) = std::fs::read_dir(NETNS_DIR) else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix(NETNS_PREFIX))
                .and_then(|id| Ulid::from_string(id).ok())
        })
        .collect()
}

/// The host end in the lab of member `vmid`'s interface number `i` (15 characters at most).
fn port_name(vmid: u32, i: usize) -> String {
    format!("fg{vmid}n{i}")
}

fn ip(args: &[&str]) -> Result<String, String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run `ip {}`: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            crate::error::outside_text_max(String::from_utf8_lossy(&out.stderr).trim(), 300)
        ))
    }
}

/// Make lab `lab` unless it exists: its namespace and its bridge, up, without an address.
fn ensure(lab: Ulid) -> Result<(), String> {
    let ns = netns_name(lab);
    if !Path::new(NETNS_DIR).join(&ns).exists() {
        ip(&["netns", "add", &ns])?;
    }
    if ip(&["-n", &ns, "link", "show", BRIDGE]).is_err() {
        ip(&["-n", &ns, "link", "add", BRIDGE, "type", "bridge"])?;
    }
    // addrgenmode none: not even an IPv6 link-local address on the bridge.
    ip(&["-n", &ns, "link", "set", BRIDGE, "addrgenmode", "none"])?;
    ip(&["-n", &ns, "link", "set", BRIDGE, "up"])?;
    Ok(())
}

/// The path through which this process's open file `file` can be named to a child (`ip`
/// opens a namespace given as a path).
fn fd_path(file: &impl std::os::fd::AsRawFd) -> PathBuf {
    PathBuf::from(format!(
        "/proc/{}/fd/{}",
        std::process::id(),
        file.as_raw_fd()
    ))
}

/// Join container `vmid`'s running copy to lab `lab` with one pair per stored interface name
/// (`names`, plain interface names, at most 8). `lxc_path` is LXC's lxcpath (root's monitor
/// of the container is asked for its init). `Ok`: what was made, for the report.
pub fn join(lxc_path: &Path, lab: Ulid, vmid: u32, names: &[String]) -> Result<String, String> {
    if names.is_empty() || names.len() > 8 {
        return Err(format!(
            "{} interface names given for the copy {vmid}; 1 to 8 join a lab",
            names.len()
        ));
    }
    if let Some(bad) = names.iter().find(|n| !crate::guest::lab::valid_ifname(n)) {
        return Err(format!(
            "{} is not an interface name the lab gives",
            crate::error::outside_text_max(bad, 20)
        ));
    }
    let _one = LAB_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let init = crate::guest::lxc_monitor::container_init(lxc_path, vmid).map_err(|m| {
        format!("the copy {vmid}'s init could not be found through root's LXC monitor: {m:?}")
    })?;
    let net = init
        .namespaces
        .iter()
        .find(|n| n.name == "net")
        .ok_or_else(|| format!("the copy {vmid}'s network namespace was not opened"))?;
    // A container that shares the node's network namespace (LXC's `lxc.net.0.type = none`)
    // would have its pairs made among the node's own links: refused.
    for shared in ["/proc/self/ns/net", "/proc/1/ns/net"] {
        use std::os::unix::fs::MetadataExt;
        if let Ok(m) = std::fs::metadata(shared) {
            if (m.dev(), m.ino()) == (net.dev, net.ino) {
                return Err(format!(
                    "the copy {vmid} shares the node's network namespace ({shared}); nothing was joined"
                ));
            }
        }
    }
    let net_path = fd_path(net.file());
    let net_arg = net_path.to_string_lossy().into_owned();
    ensure(lab)?;
    let ns = netns_name(lab);
    let mut made = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let port = port_name(vmid, i);
        // A port left by an earlier try of this copy goes first.
        let _ = ip(&["-n", &ns, "link", "del", &port]);
        ip(&[
            "-n", &ns, "link", "add", &port, "type", "veth", "peer", "name", name, "netns",
            &net_arg,
        ])?;
        ip(&["-n", &ns, "link", "set", &port, "master", BRIDGE])?;
        ip(&["-n", &ns, "link", "set", &port, "up"])?;
        made.push(format!("{name} (lab port {port})"));
    }
    check_copy_links(&net_arg, vmid, names)?;
    Ok(format!(
        "joined to the group's lab {ns} (a bridge in a network namespace of its own, no address, no port but the members'): {}",
        made.join(", ")
    ))
}

/// From outside: in the copy's network namespace, no link but `names` has a peer in another
/// namespace.
fn check_copy_links(net_path: &str, vmid: u32, names: &[String]) -> Result<(), String> {
    use std::io::Read;
    // The copy's links are the guest's doing: their listing is read up to a bound.
    let mut child = Command::new("nsenter")
        .arg(format!("--net={net_path}"))
        .args(["ip", "-d", "-o", "link", "show"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot list the copy {vmid}'s links with nsenter: {e}"))?;
    let mut listing = Vec::new();
    let read = child
        .stdout
        .take()
        .map(|out| out.take(LINKS_MAX + 1).read_to_end(&mut listing));
    let _ = child.kill();
    let status = child
        .wait()
        .map_err(|e| format!("cannot list the copy {vmid}'s links: {e}"))?;
    if listing.len() as u64 > LINKS_MAX {
        return Err(format!(
            "the copy {vmid} lists more than {LINKS_MAX} bytes of links; it is not joined"
        ));
    }
    if !matches!(read, Some(Ok(_))) || (!status.success() && listing.is_empty()) {
        return Err(format!("cannot list the copy {vmid}'s links"));
    }
    let out = std::process::Output {
        status,
        stdout: listing,
        stderr: Vec::new(),
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if !line.contains(" link-netns") {
            continue;
        }
        let name = line
            .split_whitespace()
            .nth(1)
            .unwrap_or("")
            .trim_end_matches(':');
        let name = name.split('@').next().unwrap_or("");
        if !names.iter().any(|n| n == name) {
            return Err(format!(
                "the copy {vmid} holds {}, a link to another network namespace that is not the group lab's; it is not joined",
                crate::error::outside_text_max(name, 20)
            ));
        }
    }
    Ok(())
}

/// Remove lab `lab` (its namespace; the pairs go with it). `Ok(false)`: there was none.
pub fn remove(lab: Ulid) -> Result<bool, String> {
    let _one = LAB_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let ns = netns_name(lab);
    if !Path::new(NETNS_DIR).join(&ns).exists() {
        return Ok(false);
    }
    ip(&["netns", "del", &ns])?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_name_fits_an_interface_name() {
        assert!(port_name(999_999_999, 7).len() <= 15);
        assert_eq!(port_name(990_000, 0), "fg990000n0");
    }

    #[test]
    fn only_ulid_names_are_labs() {
        let lab = Ulid::new();
        let name = netns_name(lab);
        assert_eq!(
            name.strip_prefix(NETNS_PREFIX)
                .and_then(|i| Ulid::from_string(i).ok()),
            Some(lab)
        );
    }
}
