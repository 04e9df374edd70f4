//! An application group's lab (`[[restore_test.group]]`): the one network its members' copies
//! share, and nothing else. Root's work (the exec helper's, or the agent's own on the direct
//! route); the agent's user asks for it by transaction.
//!
//! The lab is a network namespace of the node holding one bridge, `felg`, with no address (not
//! even an IPv6 link-local one) and no port but the members' own. A member container's copy
//! joins it with one veth pair per interface its backup stores: the pair is made in the lab's
//! namespace, its one end a port of `felg` (`fg<vmid>n<i>`), the other moved into the copy's
//! network namespace under the stored name (`eth0`), where the copy's own network units bring
//! it up with its stored address, as in production. The copy's network namespace is the one
//! root's LXC monitor names for the container (its init's, held open while the pair is made:
//! [`crate::guest::lxc_monitor::container_init`]), never one a path in the guest could name.
//! Nothing is made in the node's own namespace: no bridge of the node gains a port, no address
//! of the node is reachable, and the copies of other groups are in labs of their own.
//!
//! Where the namespace lives ([`Home`]): on a node booted with systemd, an instance of the
//! packaged template unit `felhom-lab@<lab>.service` holds it (systemd makes it for the unit's
//! `PrivateNetwork=`; the exec helper's sandbox allows no `ip netns add`: `/run` is read-only
//! to it and its mounts are private), found through the unit's main process once that process
//! is checked to be in the unit's cgroup; elsewhere (a machine without systemd, as the test
//! bed) a namespace named `felhom-g-<lab>` under /run/netns. Either way every link of the lab
//! is made by entering the namespace through a descriptor held open (`nsenter --net=`), never
//! by a name another process could swap. The lab id is the ULID the group's run journaled in
//! each member's request.
//!
//! A copy's namespace is checked from outside after the join: no link in it may have a peer
//! in another namespace but the pairs just made (the lab's guard inside the copy, which the
//! guest could lie to, is told that these names are the lab's).
//!
//! The lab is removed at the group's end (the unit stopped, or `ip netns del`: the pairs go
//! with their ends), and by the next command when a killed run left it: only a lab of the form
//! above with a ULID, and only a lab a journaled transaction names.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use ulid::Ulid;

/// The prefix of a lab's network namespace name (where labs are named namespaces).
pub const NETNS_PREFIX: &str = "felhom-g-";
/// The prefix of the template unit's instances that hold labs (where systemd runs).
pub const UNIT_PREFIX: &str = "felhom-lab@";
/// The lab's bridge, inside its namespace.
pub const BRIDGE: &str = "felg";
/// The most bytes of a copy's link listing read.
const LINKS_MAX: u64 = 1 << 20;
/// Where `ip netns` keeps its names.
const NETNS_DIR: &str = "/run/netns";
/// Where systemd keeps the cgroups of the template's instances (cgroup v2; v1's named
/// hierarchy second): systemd puts a template's instances in a slice named after the template.
const UNIT_CGROUP_DIRS: [&str; 2] = [
    r"/sys/fs/cgroup/system.slice/system-felhom\x2dlab.slice",
    r"/sys/fs/cgroup/systemd/system.slice/system-felhom\x2dlab.slice",
];

/// Joins and removals one at a time in this process: two members joining at once would both
/// make the namespace.
static LAB_LOCK: Mutex<()> = Mutex::new(());

/// Where this node keeps labs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Home {
    /// An instance of `felhom-lab@.service` holds each lab's namespace (systemd runs).
    Unit,
    /// A namespace named `felhom-g-<lab>` under /run/netns (no systemd).
    Named,
}

impl Home {
    /// This node's: systemd's own test of a system booted with it (sd_booted(3)).
    pub fn of_node() -> Self {
        if Path::new("/run/systemd/system").is_dir() {
            Self::Unit
        } else {
            Self::Named
        }
    }
}

/// The namespace name of lab `lab` (where labs are named namespaces).
pub fn netns_name(lab: Ulid) -> String {
    format!("{NETNS_PREFIX}{lab}")
}

/// The unit that holds lab `lab` (where systemd runs).
pub fn unit_name(lab: Ulid) -> String {
    format!("{UNIT_PREFIX}{lab}.service")
}

/// How lab `lab` is named to an operator on this node: its unit, or its namespace.
pub fn lab_name(lab: Ulid) -> String {
    match Home::of_node() {
        Home::Unit => unit_name(lab),
        Home::Named => netns_name(lab),
    }
}

/// The labs that exist on this node (names that are not of a lab's form with a ULID are never
/// anyone's lab). Readable by any user: the agent's user asks before it has root remove one.
pub fn existing() -> Vec<Ulid> {
    let (dirs, prefix, suffix): (&[&str], &str, &str) = match Home::of_node() {
        Home::Unit => (&UNIT_CGROUP_DIRS, UNIT_PREFIX, ".service"),
        Home::Named => (&[NETNS_DIR], NETNS_PREFIX, ""),
    };
    let mut labs = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        labs.extend(entries.filter_map(Result::ok).filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix(prefix))
                .and_then(|n| n.strip_suffix(suffix))
                .and_then(|id| Ulid::from_string(id).ok())
        }));
    }
    labs.sort();
    labs.dedup();
    labs
}

/// The host end in the lab of member `vmid`'s interface number `i` (15 characters at most).
fn port_name(vmid: u32, i: usize) -> String {
    format!("fg{vmid}n{i}")
}

/// Run `program args`; `Ok`: its output. Its error output (clipped) in the error otherwise.
fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run `{program} {}`: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            crate::error::outside_text_max(String::from_utf8_lossy(&out.stderr).trim(), 300)
        ))
    }
}

fn ip(args: &[&str]) -> Result<String, String> {
    run("ip", args)
}

/// A lab's network namespace, held open by this process while its links are made.
struct LabNs {
    file: File,
    /// How an operator finds it: its unit or its name.
    name: String,
}

impl LabNs {
    /// `ip args` run inside the lab's namespace, entered through the descriptor held.
    fn ip(&self, args: &[&str]) -> Result<String, String> {
        let net = format!("--net={}", fd_path(&self.file).display());
        let mut all = vec![net.as_str(), "ip"];
        all.extend_from_slice(args);
        run("nsenter", &all).map_err(|e| format!("in the lab {}: {e}", self.name))
    }

    /// The namespace's inode (what `ls -iL /proc/<pid>/ns/net` shows of a process in it).
    fn inode(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        self.file.metadata().map(|m| m.ino()).unwrap_or(0)
    }
}

/// Refuse a namespace that is the node's own (this process's or init's): a lab made there
/// would put the members' pairs among the node's links.
fn not_the_nodes(file: &File, what: &str) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let m = file
        .metadata()
        .map_err(|e| format!("cannot read {what}'s network namespace: {e}"))?;
    for shared in ["/proc/self/ns/net", "/proc/1/ns/net"] {
        if let Ok(node) = std::fs::metadata(shared) {
            if (node.dev(), node.ino()) == (m.dev(), m.ino()) {
                return Err(format!(
                    "{what} is in the node's own network namespace ({shared}); nothing was made in it"
                ));
            }
        }
    }
    Ok(())
}

/// Lab `lab`'s namespace, made first when `make` (an unmade lab: `Ok(None)`).
fn open_lab(lab: Ulid, make: bool) -> Result<Option<LabNs>, String> {
    match Home::of_node() {
        Home::Unit => {
            let unit = unit_name(lab);
            if make {
                run("systemctl", &["start", "--quiet", &unit]).map_err(|e| {
                    format!("{e}; is felhom-lab@.service installed (the felhom-agent package ships it)?")
                })?;
            }
            let pid = run(
                "systemctl",
                &["show", "--property=MainPID", "--value", &unit],
            )?;
            let pid: u32 = pid.trim().parse().unwrap_or(0);
            if pid == 0 {
                return if make {
                    Err(format!("{unit} started, but has no main process"))
                } else {
                    Ok(None)
                };
            }
            let file = File::open(format!("/proc/{pid}/ns/net")).map_err(|e| {
                format!("cannot open the network namespace of {unit}'s process {pid}: {e}")
            })?;
            // Opened first, checked after: if the process at that pid is (still) in the unit's
            // cgroup, the namespace held is the unit's (only the unit's processes are there).
            let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
            if !cgroup.lines().any(|l| l.ends_with(&format!("/{unit}"))) {
                return Err(format!(
                    "process {pid}, {unit}'s main process by systemd's word, is not in the unit's cgroup; the lab was not used"
                ));
            }
            not_the_nodes(&file, &unit)?;
            Ok(Some(LabNs { file, name: unit }))
        }
        Home::Named => {
            let ns = netns_name(lab);
            let path = Path::new(NETNS_DIR).join(&ns);
            if !path.exists() {
                if !make {
                    return Ok(None);
                }
                ip(&["netns", "add", &ns])?;
            }
            let file = File::open(&path)
                .map_err(|e| format!("cannot open the lab's namespace {}: {e}", path.display()))?;
            not_the_nodes(&file, &ns)?;
            Ok(Some(LabNs { file, name: ns }))
        }
    }
}

/// Make lab `lab` unless it exists: its namespace and its bridge, up, without an address.
fn ensure(lab: Ulid) -> Result<LabNs, String> {
    let ns = open_lab(lab, true)?.ok_or_else(|| format!("the lab {lab} was not made"))?;
    if ns.ip(&["link", "show", BRIDGE]).is_err() {
        ns.ip(&["link", "add", BRIDGE, "type", "bridge"])?;
    }
    // addrgenmode none: not even an IPv6 link-local address on the bridge.
    ns.ip(&["link", "set", BRIDGE, "addrgenmode", "none"])?;
    ns.ip(&["link", "set", BRIDGE, "up"])?;
    Ok(ns)
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
    if let Err(e) = not_the_nodes(net.file(), &format!("the copy {vmid}")) {
        return Err(format!("{e}; nothing was joined"));
    }
    copy_owns_its_network(&init, vmid).map_err(|e| format!("{e}; nothing was joined"))?;
    let net_path = fd_path(net.file());
    let net_arg = net_path.to_string_lossy().into_owned();
    let ns = ensure(lab)?;
    let mut made = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let port = port_name(vmid, i);
        // A port left by an earlier try of this copy goes first.
        let _ = ns.ip(&["link", "del", &port]);
        ns.ip(&[
            "link", "add", &port, "type", "veth", "peer", "name", name, "netns", &net_arg,
        ])?;
        ns.ip(&["link", "set", &port, "master", BRIDGE])?;
        ns.ip(&["link", "set", &port, "up"])?;
        made.push(format!("{name} (lab port {port})"));
    }
    check_copy_links(&net_arg, vmid, names)?;
    Ok(format!(
        "joined to the group's lab {} (network namespace inode {}: a bridge in a namespace of its own, no address, no port but the members'): {}",
        ns.name,
        ns.inode(),
        made.join(", ")
    ))
}

/// The node's end of the pair that links lab `lab` to its group's lab bridge (15 characters:
/// `fgl` and the last 12 of the lab's id, its random part).
pub fn link_port_name(lab: Ulid) -> String {
    let id = lab.to_string();
    format!("fgl{}", &id[id.len() - 12..])
}

/// The lab's end of that pair, a port of the lab's bridge.
const LINK_INSIDE: &str = "fglink";

/// Link lab `lab` (made by a member's join) to `bridge`, its group's lab bridge in the node's
/// namespace (a group with containers and VMs): one veth pair, its node end
/// ([`link_port_name`]) a port of `bridge` with no address (not even an IPv6 link-local one),
/// its other end a port of the lab's bridge. Made once; a second member's join finds it.
/// `bridge` must be a Linux bridge of the node; the caller checked that it is the group's (one
/// of `[restore_test] lab_bridges`, journaled). The pair goes with the lab.
pub fn link(lab: Ulid, bridge: &str) -> Result<String, String> {
    if !crate::guest::lab::valid_ifname(bridge) {
        return Err(format!(
            "{} is not a bridge name the lab links to",
            crate::error::outside_text_max(bridge, 20)
        ));
    }
    let _one = LAB_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let ns = open_lab(lab, false)?.ok_or_else(|| {
        format!(
            "the lab {} does not exist; nothing was linked",
            lab_name(lab)
        )
    })?;
    let sys = Path::new("/sys/class/net");
    if !sys.join(bridge).join("bridge").is_dir() {
        return Err(format!(
            "{bridge} is not a Linux bridge of node's namespace ({} is missing); nothing was linked",
            sys.join(bridge).join("bridge").display()
        ));
    }
    let port = link_port_name(lab);
    let master = || {
        std::fs::read_link(sys.join(&port).join("master"))
            .ok()
            .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
    };
    if sys.join(&port).exists() {
        return match master() {
            Some(m) if m == bridge => Ok(format!(
                "the lab {} is linked to the group's lab bridge {bridge} (port {port})",
                ns.name
            )),
            other => Err(format!(
                "{port}, the lab's link, is on {} instead of the group's lab bridge {bridge}; nothing was linked",
                other.unwrap_or_else(|| "no bridge".to_string())
            )),
        };
    }
    let net_arg = fd_path(&ns.file).to_string_lossy().into_owned();
    ip(&[
        "link",
        "add",
        &port,
        "type",
        "veth",
        "peer",
        "name",
        LINK_INSIDE,
        "netns",
        &net_arg,
    ])?;
    // addrgenmode none before it is up: the node gets no address on the lab's wire.
    let made = (|| {
        ip(&["link", "set", &port, "addrgenmode", "none"])?;
        ip(&["link", "set", &port, "master", bridge])?;
        ip(&["link", "set", &port, "up"])?;
        ns.ip(&["link", "set", LINK_INSIDE, "master", BRIDGE])?;
        ns.ip(&["link", "set", LINK_INSIDE, "up"])
    })();
    if let Err(e) = made {
        let _ = ip(&["link", "del", &port]);
        return Err(e);
    }
    Ok(format!(
        "the lab {} is linked to the group's lab bridge {bridge} (port {port}, no address), where the group's VM copies are",
        ns.name
    ))
}

/// The idmap pve-container writes for an unprivileged container without a custom one (the
/// exec helper refuses raw `lxc.` keys, `lxc.idmap` among them): pve-container
/// `src/PVE/LXC.pm` `update_lxc_config`, `lxc.idmap = u 0 100000 65536` and `g` alike.
const PVE_IDMAP: &str = "0 100000 65536";

/// Test hook (only with the `test-hooks` feature): `1` says that the containers are the test
/// bed's busybox stand-ins, which run in the node's user namespace: neither that nor PVE's
/// idmap is required of them (the real bed's containers are checked in full).
#[cfg(feature = "test-hooks")]
pub const BED_HOST_USERNS_ENV: &str = "FELHOM_AGENT_BED_HOST_USERNS";

/// Whether [`BED_HOST_USERNS_ENV`] is set (never in a build without the test hooks).
fn bed_host_userns() -> bool {
    #[cfg(feature = "test-hooks")]
    if std::env::var(BED_HOST_USERNS_ENV).is_ok_and(|v| v == "1") {
        return true;
    }
    false
}

/// The copy's init (whose network namespace is held) runs in a user namespace that is not the
/// node's and maps exactly PVE's idmap of an unprivileged container. The maps are read through
/// the init's pid, then its user namespace is checked to be the one held open (`init`): a pid
/// reused meanwhile names another, and is refused. (The network namespace's owner itself is
/// only told by the NS_GET_USERNS ioctl, which this code does not make; util-linux `lsns`,
/// which makes it, scans every process and exits 1 when one ends during its scan.)
fn copy_owns_its_network(
    init: &crate::guest::lxc_monitor::ContainerInit,
    vmid: u32,
) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let held = |name: &str| {
        init.namespaces
            .iter()
            .find(|n| n.name == name)
            .map(|n| n.ino)
            .ok_or_else(|| format!("the copy {vmid}'s {name} namespace was not opened"))
    };
    let user = held("user")?;
    let stand_in = bed_host_userns();
    if !stand_in && std::fs::metadata("/proc/1/ns/user").is_ok_and(|m| m.ino() == user) {
        return Err(format!(
            "the copy {vmid}'s init runs in the node's user namespace (a privileged container)"
        ));
    }
    let pid = init.pid.to_string();
    for map in ["uid_map", "gid_map"].into_iter().filter(|_| !stand_in) {
        let text = std::fs::read_to_string(format!("/proc/{pid}/{map}")).unwrap_or_default();
        let lines: Vec<String> = text
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|l| !l.is_empty())
            .collect();
        if lines != [PVE_IDMAP] {
            return Err(format!(
                "the copy {vmid}'s user namespace maps {} in {map}, not PVE's idmap of an unprivileged container ({PVE_IDMAP})",
                crate::error::outside_text_max(&lines.join("; "), 120)
            ));
        }
    }
    // Still the same init (its user namespace the one held): what was read was its.
    if !std::fs::metadata(format!("/proc/{pid}/ns/user")).is_ok_and(|m| m.ino() == user) {
        return Err(format!(
            "the copy {vmid}'s init {pid} ended while its namespaces were read; retry"
        ));
    }
    Ok(())
}

/// [`join`], then [`link`] when the group's journaled request names a lab bridge: the notes of
/// both.
pub fn join_and_link(
    lxc_path: &Path,
    lab: Ulid,
    vmid: u32,
    names: &[String],
    bridge: Option<&str>,
) -> Result<String, String> {
    let joined = join(lxc_path, lab, vmid, names)?;
    match bridge {
        None => Ok(joined),
        Some(b) => Ok(format!("{joined}; {}", link(lab, b)?)),
    }
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

/// Remove lab `lab` (its unit stopped or its namespace deleted; the pairs go with it).
/// `Ok(false)`: there was none.
pub fn remove(lab: Ulid) -> Result<bool, String> {
    let _one = LAB_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    remove_locked(lab)
}

fn remove_locked(lab: Ulid) -> Result<bool, String> {
    let had = existing().contains(&lab);
    // The link to a group's lab bridge first, by its node end: the kernel frees a namespace
    // (and the pairs in it) some time after its last holder is gone, and the lab bridge must
    // hold no port of this lab once it is removed.
    let link = link_port_name(lab);
    if Path::new("/sys/class/net").join(&link).exists() {
        ip(&["link", "del", &link])?;
    }
    match Home::of_node() {
        // Stopping an instance that does not run changes nothing: always asked.
        Home::Unit => {
            run("systemctl", &["stop", "--quiet", &unit_name(lab)])?;
        }
        Home::Named => {
            if had {
                ip(&["netns", "del", &netns_name(lab)])?;
            }
        }
    }
    if existing().contains(&lab) {
        return Err(format!(
            "the lab {} is still there after its removal",
            lab_name(lab)
        ));
    }
    Ok(had)
}

/// Whether this node can make a group's lab, as a group's run would (doctor asks it through the
/// exec helper, under the helper's own sandbox): a lab of a fresh id made, found among the
/// node's labs, given its bridge and a pair with one end on it, checked to hold no address,
/// then removed and checked gone. `Ok`: what was done.
pub fn probe() -> Result<String, String> {
    let _one = LAB_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let lab = Ulid::new();
    let tried = (|| -> Result<String, String> {
        let ns = ensure(lab)?;
        if !existing().contains(&lab) {
            return Err(format!(
                "the lab {} was made but is not among the node's labs: a stopped run's lab could not be found to be removed",
                ns.name
            ));
        }
        ns.ip(&[
            "link", "add", "fgprobe0", "type", "veth", "peer", "name", "fgprobe1",
        ])?;
        ns.ip(&["link", "set", "fgprobe0", "master", BRIDGE])?;
        ns.ip(&["link", "set", "fgprobe0", "up"])?;
        let addrs = ns.ip(&["-o", "addr", "show", "dev", BRIDGE])?;
        if !addrs.trim().is_empty() {
            return Err(format!(
                "the lab's bridge {BRIDGE} in {} holds an address: {}",
                ns.name,
                crate::error::outside_text_max(addrs.trim(), 200)
            ));
        }
        Ok(format!(
            "made the lab {} (network namespace inode {}), its bridge {BRIDGE} with a port and no address",
            ns.name,
            ns.inode()
        ))
    })();
    let removed = remove_locked(lab);
    match (tried, removed) {
        (Ok(made), Ok(_)) => Ok(format!("{made}, and removed it")),
        (Err(e), Ok(_)) => Err(e),
        (Ok(made), Err(e)) => Err(format!("{made}, but its removal failed: {e}")),
        (Err(e), Err(r)) => Err(format!("{e}; its removal failed too: {r}")),
    }
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
    fn a_links_name_fits_an_interface_name_and_differs_per_lab() {
        let a = Ulid::new();
        let b = Ulid::from_parts(a.timestamp_ms(), a.random() ^ 1);
        assert_eq!(link_port_name(a).len(), 15);
        assert!(crate::guest::lab::valid_ifname(&link_port_name(a)));
        assert_ne!(link_port_name(a), link_port_name(b));
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
