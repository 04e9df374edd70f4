//! The lab bridge as the kernel has it, in network namespaces this test builds (it runs as
//! root).
//!
//! Each case runs on a thread of its own that leaves this process's network and mount
//! namespaces (`unshare(CLONE_NEWNET | CLONE_NEWNS)`) and mounts a sysfs of its own on
//! `/sys`, as `ip netns exec` does: that thread's namespace is the node, and what it starts
//! (the fake PVE, the agent, `ip`) runs there, so the agent reads the node's real
//! `/sys/class/net`, `/proc/sys/net` and netlink. The copy and the network beyond the node are
//! namespaces of `unshare --net` children (a veth `tap<vmid>i0` on the lab bridge stands for
//! the copy's tap; a veth `up0` for the node's production NIC). Every namespace is unnamed and
//! dies with its last process: the children are killed when a case ends, failed or not, and the
//! node's with its thread.
//!
//! - The agent's preflight refuses a lab bridge with IPv6 on, with rp_filter 0, with forwarding
//!   1, with a foreign port, or with an addressed device on top (this kernel has no 802.1Q, so
//!   a VLAN device cannot be made: a macvlan on the bridge stands for it), each before any
//!   write, naming the file, the value and the fix; set as the README says, the copy's restore
//!   test runs to its end.
//! - From inside the copy (UDP to the node's address and to a host beyond it, UDP to IPv6's
//!   all-nodes group, a Router Advertisement): with the README's settings (and with rp_filter
//!   2 instead of 1) nothing reaches the node's sockets or beyond, nor gives the node a route;
//!   with IPv6 on, rp_filter 0, or rp_filter 0 and forwarding 1, the same sending reaches
//!   them.

use std::io::{BufRead, BufReader};
use std::net::UdpSocket;
use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use felhom_tests::agent::KERNEL_ROOT_ENV;
use felhom_tests::fakepve::{
    add_qemu_backup, demo_scenario, fakepve_python, qemu_backup_config, AgentOptions, QEMU_BACKUP,
};
use felhom_tests::guestbed::repo_root;
use felhom_tests::world::{World, TIME_SCALE};
use serde_json::{json, Value};

/// The copy's vmid (its tap: `tap120i0`).
const VMID: u32 = 120;
/// The lab bridge.
const LAB: &str = "vmbr9";
/// The lab bridge's MAC (the copy sends to it as if it had learnt it).
const LAB_MAC: &str = "02:00:00:00:09:09";
/// The node's production address (on `up0`) and the host beyond it.
const NODE_ADDR: &str = "192.0.2.1";
const BEYOND_ADDR: &str = "192.0.2.2";
/// The copy's own address (its stored one, on the lab).
const COPY_ADDR: &str = "10.99.0.2";
/// The UDP port the IPv4 listeners bind, and the node's IPv6 one (`::`, another port: a
/// dual-stack socket there would take the IPv4 port too).
const PORT: u16 = 5399;
const PORT6: u16 = 5398;

/// Run `args` (a command line) from this thread, which must succeed.
fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Write a sysctl of this thread's network namespace.
fn sysctl(path: &str, value: &str) {
    let p = format!("/proc/sys/net/{path}");
    std::fs::write(&p, value).unwrap_or_else(|e| panic!("{p}: {e}"));
}

/// Run `f` as the node: on a thread of its own in new network and mount namespaces, with a
/// sysfs of that network namespace on `/sys` and loopback up. Its panic is this one's.
fn as_node<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        use nix::mount::{mount, MsFlags};
        use nix::sched::{unshare, CloneFlags};
        unshare(CloneFlags::CLONE_NEWNET | CloneFlags::CLONE_NEWNS).expect("unshare (root)");
        // The fake PVE this thread starts runs here, in the node's namespaces (tests/run.sh's
        // zygote forks it in the namespaces it was started in, which the agent cannot reach).
        felhom_tests::fakeproc::spawn_fakes_on_this_thread();
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None::<&str>,
        )
        .expect("make / private");
        mount(
            Some("sysfs"),
            "/sys",
            Some("sysfs"),
            MsFlags::empty(),
            None::<&str>,
        )
        .expect("a sysfs of the node's namespace");
        run(&["ip", "link", "set", "lo", "up"]);
        let names: Vec<String> = std::fs::read_dir("/sys/class/net")
            .expect("/sys/class/net")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["lo"], "not a fresh namespace's /sys");
        f()
    })
    .join()
    .unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// A network namespace of an `unshare --net` child (the copy, the network beyond the node):
/// killed, and its namespace gone, when dropped.
struct Peer {
    child: Child,
}

impl Peer {
    fn new() -> Peer {
        let mut child = Command::new("unshare")
            .args(["--net", "sh", "-c", "echo ready; exec sleep 600"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("unshare --net");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("ready line");
        assert_eq!(line.trim(), "ready");
        Peer { child }
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    fn ns(&self) -> String {
        format!("/proc/{}/ns/net", self.child.id())
    }

    /// Run `args` inside it.
    fn run(&self, args: &[&str]) {
        let net = format!("--net={}", self.ns());
        let mut all = vec!["nsenter", net.as_str(), "--"];
        all.extend_from_slice(args);
        run(&all);
    }

    /// Whether its `eth0` has a usable IPv6 link-local address.
    fn has_link_local(&self) -> bool {
        let out = Command::new("nsenter")
            .args([format!("--net={}", self.ns()).as_str(), "--"])
            .args(["ip", "-6", "addr", "show", "dev", "eth0", "scope", "link"])
            .output()
            .expect("ip -6 addr");
        let text = String::from_utf8_lossy(&out.stdout);
        text.contains("fe80::") && !text.contains("tentative")
    }

    /// A UDP socket bound to `0.0.0.0:port` inside it.
    fn udp(&self, port: u16) -> UdpSocket {
        let ns = std::fs::File::open(self.ns()).expect("its namespace");
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
                UdpSocket::bind(("0.0.0.0", port)).expect("bind")
            })
            .join()
            .expect("bind in the namespace")
        })
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The README's lab bridge stanza: its lines for `bridge` (`vmbr9` replaced).
fn readme_stanza(bridge: &str) -> Vec<String> {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let lines: Vec<String> = readme
        .lines()
        .skip_while(|l| l.trim() != "auto vmbr9")
        .take_while(|l| !l.trim().starts_with("```"))
        .map(|l| l.trim().replace("vmbr9", bridge))
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l == &format!("iface {bridge} inet manual")),
        "no lab bridge stanza in README.md: {lines:?}"
    );
    lines
}

/// Make the lab bridge in the node's namespace as the README's stanza does (`bridge-ports
/// none`: no port; `inet manual`: no address; each `post-up` line run), after
/// `net.ipv4.ip_forward=1` (which sets every device's forwarding: the node routes), with
/// `all.rp_filter` 0 (the bridge's own value decides).
fn readme_bridge() {
    sysctl("ipv4/ip_forward", "1");
    sysctl("ipv4/conf/all/rp_filter", "0");
    run(&[
        "ip",
        "link",
        "add",
        LAB,
        "address",
        LAB_MAC,
        "type",
        "bridge",
        "stp_state",
        "0",
        "forward_delay",
        "0",
    ]);
    run(&["ip", "link", "set", LAB, "up"]);
    let stanza = readme_stanza(LAB);
    let post_up: Vec<&String> = stanza
        .iter()
        .filter(|l| l.starts_with("post-up "))
        .collect();
    assert_eq!(post_up.len(), 3, "{stanza:?}");
    for line in post_up {
        run(&["sh", "-c", &line["post-up ".len()..]]);
    }
}

/// The scenario of a VM backup whose restore test puts its NICs on the lab bridge (PVE lists
/// it as the README's stanza makes it; the token holds SDN.Use on it).
fn lab_world() -> World {
    lab_world_starting_in(2)
}

/// [`lab_world`] whose VM's start task takes `start_secs` PVE seconds.
fn lab_world_starting_in(start_secs: u32) -> World {
    let mut s = demo_scenario();
    s["time_scale"] = json!(TIME_SCALE);
    s["attrs"] = json!({"qemu_restore_secs": 30});
    add_qemu_backup(
        &mut s,
        qemu_backup_config(),
        json!({"agent": true, "boot_secs": 5, "start_secs": start_secs, "stop_secs": 2}),
    );
    let options: Vec<String> = readme_stanza(LAB)
        .into_iter()
        .filter(|l| l.starts_with("post-up "))
        .collect();
    s["node_network"] = json!([
        {"iface": "vmbr0", "type": "bridge", "bridge_ports": "eno1", "method": "static",
         "address": "192.0.2.1", "cidr": "192.0.2.1/24", "active": 1},
        {"iface": LAB, "type": "bridge", "bridge_ports": "", "method": "manual",
         "method6": "manual", "active": 1, "options": options},
    ]);
    for who in ["felhom@pve!agent", "felhom@pve"] {
        s["grants"].as_array_mut().expect("grants").push(json!([
            who,
            format!("/sdn/zones/localnetwork/{LAB}"),
            ["PVESDNUser"]
        ]));
    }
    let opts = AgentOptions {
        selftest_source: Some(QEMU_BACKUP.to_string()),
        extra_toml: format!(
            "[restore_test]\nsources = [\"{QEMU_BACKUP}\"]\nlab_bridge = \"{LAB}\"\n"
        ),
        ..AgentOptions::default()
    };
    World::with_options(s, &opts)
}

/// The restore test of the lab world's VM backup, the agent reading the node's own kernel.
fn restore_test(w: &World) -> (Option<i32>, Value, String) {
    let out = w
        .command()
        .env_remove(KERNEL_ROOT_ENV)
        .args(["--selftest=restore", "--json"])
        .output()
        .expect("the agent");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let doc: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{stdout}\n{stderr}"));
    (out.status.code(), doc, stderr)
}

/// The README's bridge with `spoil` done to it: the copy's restore test leaves its guest at
/// the preflight (`lab_bridge_open`, exit 6: the node's set-up, the guest stays due), nothing written; why, which must name each of
/// `names`.
fn refused(spoil: impl FnOnce() + Send + 'static, names: &'static [&'static str]) {
    as_node(move || {
        readme_bridge();
        spoil();
        let w = lab_world();
        let (code, doc, stderr) = restore_test(&w);
        assert_eq!(doc["copies"], json!([]), "{doc:#}\n{stderr}");
        let left = doc["left"].as_array().expect("left");
        assert_eq!(left.len(), 1, "{doc:#}");
        assert_eq!(left[0]["code"], "lab_bridge_open", "{doc:#}");
        assert_eq!(code, Some(6), "{doc:#}\n{stderr}");
        assert!(w.pve.writes().is_empty(), "{:#?}", w.pve.writes());
        let why = left[0]["reason"].as_str().expect("reason");
        for name in names {
            assert!(why.contains(name), "{name:?} not in: {why}");
        }
    });
}

#[test]
fn a_lab_bridge_open_in_the_kernel_refuses_the_copy_before_any_write_naming_the_fix() {
    // IPv6 on.
    refused(
        || sysctl(&format!("ipv6/conf/{LAB}/disable_ipv6"), "0"),
        &[
            "/proc/sys/net/ipv6/conf/vmbr9/disable_ipv6 is 0",
            "post-up sysctl -w net.ipv6.conf.vmbr9.disable_ipv6=1",
        ],
    );
    // No reverse-path filter.
    refused(
        || sysctl(&format!("ipv4/conf/{LAB}/rp_filter"), "0"),
        &[
            "/proc/sys/net/ipv4/conf/vmbr9/rp_filter = 0",
            "post-up sysctl -w net.ipv4.conf.vmbr9.rp_filter=1",
        ],
    );
    // Forwarding on again: turning ip_forward on (off, then on) sets every device's.
    refused(
        || {
            sysctl("ipv4/ip_forward", "0");
            sysctl("ipv4/ip_forward", "1");
        },
        &[
            "/proc/sys/net/ipv4/conf/vmbr9/forwarding is 1",
            "post-up sysctl -w net.ipv4.conf.vmbr9.forwarding=0",
        ],
    );
    // A port PVE's list does not show (another guest's tap).
    refused(
        || {
            run(&[
                "ip", "link", "add", "tap130i0", "type", "veth", "peer", "name", "other",
            ]);
            run(&["ip", "link", "set", "tap130i0", "master", LAB]);
        },
        &[
            "/sys/class/net/vmbr9/brif lists port(s) tap130i0",
            "ip link set <port> nomaster",
        ],
    );
    // An addressed device on top of it: this kernel has no 802.1Q (`type vlan` is unknown),
    // so a macvlan on the bridge stands for a VLAN device `vmbr9.5`.
    refused(
        || {
            let vlan = Command::new("ip")
                .args([
                    "link", "add", "link", LAB, "name", "vmbr9.5", "type", "vlan", "id", "5",
                ])
                .status()
                .expect("ip");
            let upper = if vlan.success() {
                "vmbr9.5"
            } else {
                run(&[
                    "ip", "link", "add", "link", LAB, "name", "vmbr9.5", "type", "macvlan", "mode",
                    "bridge",
                ]);
                "vmbr9.5"
            };
            run(&["ip", "addr", "add", "10.99.5.1/24", "dev", upper]);
            run(&["ip", "link", "set", upper, "up"]);
        },
        &[
            "/sys/class/net/vmbr9/upper_vmbr9.5 shows device vmbr9.5 on top of bridge vmbr9",
            "10.99.5.1",
            "ip link del vmbr9.5",
        ],
    );
}

#[test]
fn on_the_readme_lab_bridge_the_copys_restore_test_runs_to_its_end() {
    as_node(|| {
        readme_bridge();
        let w = lab_world();
        let (code, doc, stderr) = restore_test(&w);
        assert_eq!(code, Some(0), "{doc:#}\n{stderr}");
        let copy = &doc["copies"][0];
        assert_eq!(copy["outcome"], "ok", "{doc:#}");
        let lab = copy["preflight"]["checks"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["name"] == "lab_bridge"))
            .unwrap_or_else(|| panic!("no lab_bridge check: {doc:#}"));
        assert_eq!(lab["status"], "pass", "{lab:#}");
    });
}

/// `ip_forward` turned on again while the copy's start task runs (after the read right before
/// the start): every device's forwarding is 1 again, the lab bridge's included. The read right
/// after the start finds it, the copy is stopped at once and destroyed, and its restore test
/// is not ok, naming the file, the value and the fix.
#[test]
fn ip_forward_turned_on_during_the_copys_start_stops_the_copy_at_once() {
    as_node(|| {
        readme_bridge();
        let w = lab_world_starting_in(300);
        let agent = w
            .command()
            .env_remove(KERNEL_ROOT_ENV)
            .args(["--selftest=restore", "--json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the agent");
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !w.pve.tasks().iter().any(|t| t["type"] == "qmstart") {
            assert!(std::time::Instant::now() < deadline, "no start task");
            std::thread::sleep(Duration::from_millis(20));
        }
        sysctl("ipv4/ip_forward", "0");
        sysctl("ipv4/ip_forward", "1");
        let out = agent.wait_with_output().expect("the agent's end");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let doc: Value = serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}):\n{stdout}\n{stderr}"));
        let copy = &doc["copies"][0];
        assert_ne!(copy["outcome"], "ok", "{doc:#}");
        let message = copy["error"]["message"].as_str().unwrap_or_default();
        for part in [
            "was no longer isolated right after its start",
            "/proc/sys/net/ipv4/conf/vmbr9/forwarding is 1",
            "post-up sysctl -w net.ipv4.conf.vmbr9.forwarding=0",
            "it was stopped at once",
        ] {
            assert!(message.contains(part), "{part:?} not in: {doc:#}");
        }
        let stops: Vec<_> = w
            .pve
            .requests()
            .into_iter()
            .filter(|r| r.method == "POST" && r.path.ends_with("/status/stop"))
            .collect();
        assert!(!stops.is_empty(), "no stop request");
        assert_eq!(copy["destroyed"], json!(true), "{doc:#}");
        // Nothing ran in the copy after its start (no exec through its guest agent).
        assert!(
            !w.pve
                .requests()
                .iter()
                .any(|r| r.path.contains("/agent/exec")),
            "the copy was used after its start"
        );
    });
}

/// What the copy's sending reached.
#[derive(Debug, Default, PartialEq, Eq)]
struct Reached {
    /// Datagrams at the node's IPv4 socket (sent to its production address).
    node_v4: bool,
    /// Datagrams at the node's IPv6 socket (sent to the all-nodes group on the lab).
    node_v6: bool,
    /// A default route of the node through the lab bridge (the copy's Router Advertisement).
    node_ra_route: bool,
    /// Datagrams at the host beyond the node.
    beyond: bool,
}

/// Whether `sock` has a datagram within `wait`.
fn got(sock: &UdpSocket, wait: Duration) -> bool {
    sock.set_read_timeout(Some(wait)).expect("timeout");
    let mut buf = [0u8; 64];
    matches!(sock.recv_from(&mut buf), Ok((n, _)) if &buf[..n] == b"from-the-copy")
}

/// The sending from inside the copy: UDP to the node's and the far host's addresses (through
/// the lab bridge's MAC, as a copy that learnt it sends), UDP to ff02::1 on its NIC, and a
/// Router Advertisement (hop limit 255, router lifetime 1800 s), repeated for 2 s.
const SEND: &str = r#"
import socket, struct, sys, time
node, beyond, port, port6 = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
idx = socket.if_nametoindex("eth0")
errors = set()
end = time.time() + 2.0
while time.time() < end:
    for dst in (node, beyond):
        try:
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"from-the-copy", (dst, port))
        except OSError as e:
            errors.add("udp4 %s: %s" % (dst, e))
    try:
        s6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        s6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, idx)
        s6.sendto(b"from-the-copy", ("ff02::1", port6, 0, idx))
    except OSError as e:
        errors.add("udp6: %s" % e)
    try:
        ra = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
        ra.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, 255)
        ra.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, idx)
        ra.sendto(struct.pack("!BBHBBHII", 134, 0, 0, 64, 0, 1800, 0, 0), ("ff02::1", 0, 0, idx))
    except OSError as e:
        errors.add("ra: %s" % e)
    time.sleep(0.2)
print("; ".join(sorted(errors)))
"#;

/// The node with the README's lab bridge, `spoil` done to it (after the README's lines), a copy
/// behind `tap120i0` on it and a host beyond the node's `up0`: what the copy's sending reached.
fn reached(spoil: impl FnOnce() + Send + 'static) -> Reached {
    as_node(move || {
        let copy = Peer::new();
        let beyond = Peer::new();
        readme_bridge();
        spoil();
        // The node's production side: its address on up0, the host beyond at .2, and a
        // default route there (so every source is routable: loose rp_filter passes all).
        run(&[
            "ip",
            "link",
            "add",
            "up0",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &beyond.pid(),
        ]);
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{NODE_ADDR}/24"),
            "dev",
            "up0",
        ]);
        run(&["ip", "link", "set", "up0", "up"]);
        run(&["ip", "route", "add", "default", "via", BEYOND_ADDR]);
        beyond.run(&["sh", "-c", "echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter && echo 0 > /proc/sys/net/ipv4/conf/default/rp_filter"]);
        beyond.run(&[
            "ip",
            "addr",
            "add",
            &format!("{BEYOND_ADDR}/24"),
            "dev",
            "eth0",
        ]);
        beyond.run(&["ip", "link", "set", "lo", "up"]);
        beyond.run(&["ip", "link", "set", "eth0", "up"]);
        // The copy: its tap on the lab bridge, its stored address, everything sent to the
        // bridge's MAC.
        let tap = format!("tap{VMID}i0");
        run(&[
            "ip",
            "link",
            "add",
            &tap,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &copy.pid(),
        ]);
        run(&["ip", "link", "set", &tap, "master", LAB]);
        run(&["ip", "link", "set", &tap, "up"]);
        copy.run(&[
            "sh",
            "-c",
            "echo 0 > /proc/sys/net/ipv6/conf/default/accept_dad",
        ]);
        copy.run(&["ip", "link", "set", "lo", "up"]);
        copy.run(&[
            "ip",
            "addr",
            "add",
            &format!("{COPY_ADDR}/24"),
            "dev",
            "eth0",
        ]);
        copy.run(&["ip", "link", "set", "eth0", "up"]);
        copy.run(&["ip", "route", "add", "default", "dev", "eth0"]);
        for dst in [NODE_ADDR, BEYOND_ADDR] {
            copy.run(&[
                "ip", "neigh", "replace", dst, "lladdr", LAB_MAC, "dev", "eth0",
            ]);
        }
        // The node's services and the host beyond listen.
        let node_v4 = UdpSocket::bind(("0.0.0.0", PORT)).expect("bind");
        let node_v6 = UdpSocket::bind(("::", PORT6)).expect("bind ::");
        let far = beyond.udp(PORT);
        // The copy's link-local address is there before it sends (no DAD on it).
        let mut tries = 0;
        while !copy.has_link_local() {
            tries += 1;
            assert!(tries < 50, "the copy's eth0 got no link-local address");
            std::thread::sleep(Duration::from_millis(100));
        }
        let net = format!("--net={}", copy.ns());
        let sent = Command::new("nsenter")
            .args([net.as_str(), "--"])
            .arg(fakepve_python())
            .args([
                "-c",
                SEND,
                NODE_ADDR,
                BEYOND_ADDR,
                &PORT.to_string(),
                &PORT6.to_string(),
            ])
            .output()
            .expect("the copy's sending");
        assert!(
            sent.status.success(),
            "{}",
            String::from_utf8_lossy(&sent.stderr)
        );
        let wait = Duration::from_millis(200);
        let routes = Command::new("ip")
            .args(["-6", "route", "show", "default"])
            .output()
            .expect("ip -6 route");
        let r = Reached {
            node_v4: got(&node_v4, wait),
            node_v6: got(&node_v6, wait),
            node_ra_route: String::from_utf8_lossy(&routes.stdout).contains(LAB),
            beyond: got(&far, wait),
        };
        eprintln!(
            "reached: {r:?} (the copy's send errors: {})",
            String::from_utf8_lossy(&sent.stdout).trim()
        );
        r
    })
}

#[test]
fn from_inside_the_copy_the_readme_bridge_reaches_nothing_and_each_open_setting_reaches() {
    // The README's settings (ip_forward on): nothing.
    assert_eq!(reached(|| {}), Reached::default());
    // IPv6 on: the all-nodes datagram reaches the node's socket on `::`, and the copy's RA
    // gives the node a default route through the copy.
    let r = reached(|| sysctl(&format!("ipv6/conf/{LAB}/disable_ipv6"), "0"));
    assert!(r.node_v6 && r.node_ra_route, "{r:?}");
    assert!(!r.node_v4 && !r.beyond, "{r:?}");
    // No reverse-path filter: the node takes the datagram to its production address.
    let r = reached(|| sysctl(&format!("ipv4/conf/{LAB}/rp_filter"), "0"));
    assert!(r.node_v4 && !r.beyond, "{r:?}");
    // Loose mode (2) holds as strict does on a bridge with no IPv4 address, even on a node
    // with a default route (so `rp_filter` ≥ 1 is what is checked).
    assert_eq!(
        reached(|| sysctl(&format!("ipv4/conf/{LAB}/rp_filter"), "2")),
        Reached::default()
    );
    // No reverse-path filter and forwarding on: the host beyond the node is reached too.
    let r = reached(|| {
        sysctl(&format!("ipv4/conf/{LAB}/rp_filter"), "0");
        sysctl(&format!("ipv4/conf/{LAB}/forwarding"), "1");
    });
    assert!(r.node_v4 && r.beyond, "{r:?}");
}
