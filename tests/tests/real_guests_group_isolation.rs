//! An application group's lab on real containers holds its members and nothing else
//! (`[[restore_test.group]]`, `agent/src/guest/group_lab.rs`): the shop and its database of
//! `felhom_tests::groups`, proven as a group.
//!
//! - A hostile member (a unit of the shop's backup, root in its copy) takes an address in each
//!   of the node's subnets, makes every destination on-link (default routes through its stored
//!   NIC, so that it asks for the node's addresses by ARP and neighbour discovery on the lab's
//!   bridge) and knocks on a TCP and UDP port the test opens on every address of the node, once
//!   a second for its whole life. The node counts what arrives: nothing may. (Were the lab's
//!   bridge a link of the node's own namespace, even without an address, the node would answer
//!   the ARP for its own address on it and take the datagrams: Linux answers ARP for any of its
//!   addresses on any link, `arp_ignore = 0`.) The same member still reaches its database.
//! - Another group proven at the same time by another agent (on the same subnet, with the same
//!   group name and copy vmids, in a bed of its own) holds its members up while the first group
//!   runs: the first group's shop reaches its own database and neither member of the other.
//!
//! Each test needs LXC (`tests/tests/real_guests.rs`).

use std::io::BufRead as _;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use felhom_tests::fakepve::AgentOptions;
use felhom_tests::groups::{add_group, copy_of, Shop, SHOP};
use felhom_tests::verdict::check_is;
use felhom_tests::world::World;
use serde_json::{json, Value};

/// The other group's shop and database: the same subnet, other addresses.
const OTHER: Shop = Shop { db: 40, shop: 41 };

/// One address of the node: its text and prefix length, and whether it is IPv6.
#[derive(Debug, Clone)]
struct NodeAddr {
    ip: std::net::IpAddr,
    len: u8,
}

/// The node's own global addresses (`ip -o addr show`: every link but loopback).
fn node_addrs() -> Vec<NodeAddr> {
    let out = std::process::Command::new("ip")
        .args(["-o", "addr", "show"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run ip: {e}"));
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .filter(|l| l.contains("scope global"))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (ip, len) = f.get(3)?.split_once('/')?;
            Some(NodeAddr {
                ip: ip.parse().ok()?,
                len: len.parse().ok()?,
            })
        })
        .filter(|a| !a.ip.is_loopback())
        .collect()
}

/// An address of `a`'s subnet that is not `a`'s (the hostile member takes it), with its
/// prefix: `None` for a subnet too small to share.
fn neighbour_in_subnet(a: &NodeAddr) -> Option<String> {
    match a.ip {
        std::net::IpAddr::V4(v4) if a.len <= 30 => {
            let bits = 32 - u32::from(a.len);
            let size = 1u32 << bits;
            let host = u32::from(v4) & (size - 1);
            let mut pick = (host + size / 2) % size;
            if pick == 0 || pick == size - 1 || pick == host {
                pick = if host == 1 { 2 } else { 1 };
            }
            let ip = std::net::Ipv4Addr::from((u32::from(v4) & !(size - 1)) | pick);
            Some(format!("{ip}/{}", a.len))
        }
        std::net::IpAddr::V6(v6) if a.len <= 112 => {
            let mut seg = v6.segments();
            seg[7] ^= 0x5a5a;
            Some(format!("{}/{}", std::net::Ipv6Addr::from(seg), a.len))
        }
        _ => None,
    }
}

/// What the node received on its port: TCP connections accepted, UDP datagrams, and from
/// whom.
struct Listener {
    port: u16,
    tcp: Arc<AtomicUsize>,
    udp: Arc<AtomicUsize>,
    from: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Listener {
    /// A TCP listener and a UDP socket on one free port of every address of the node
    /// (`[::]`, dual-stack, and `0.0.0.0` where the dual-stack socket does not take IPv4).
    fn open() -> Listener {
        let tcp6 = std::net::TcpListener::bind("[::]:0").unwrap_or_else(|e| panic!("bind: {e}"));
        let port = tcp6.local_addr().map(|a| a.port()).unwrap_or(0);
        let mut tcps = vec![tcp6];
        let mut udps =
            vec![std::net::UdpSocket::bind(("::", port)).unwrap_or_else(|e| panic!("bind: {e}"))];
        // With net.ipv6.bindv6only = 0 the sockets above take IPv4 too and these binds fail.
        if let Ok(t) = std::net::TcpListener::bind(("0.0.0.0", port)) {
            tcps.push(t);
        }
        if let Ok(u) = std::net::UdpSocket::bind(("0.0.0.0", port)) {
            udps.push(u);
        }
        let mut l = Listener {
            port,
            tcp: Arc::new(AtomicUsize::new(0)),
            udp: Arc::new(AtomicUsize::new(0)),
            from: Arc::new(Mutex::new(Vec::new())),
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
        };
        let mut threads = Vec::new();
        for t in tcps {
            t.set_nonblocking(true)
                .unwrap_or_else(|e| panic!("nonblocking: {e}"));
            let (count, from, stop) = (l.tcp.clone(), l.from.clone(), l.stop.clone());
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    match t.accept() {
                        Ok((_, peer)) => {
                            count.fetch_add(1, Ordering::SeqCst);
                            if let Ok(mut f) = from.lock() {
                                f.push(format!("tcp from {peer}"));
                            }
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            }));
        }
        for u in udps {
            u.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap_or_else(|e| panic!("timeout: {e}"));
            let (count, from, stop) = (l.udp.clone(), l.from.clone(), l.stop.clone());
            threads.push(std::thread::spawn(move || {
                let mut buf = [0u8; 512];
                while !stop.load(Ordering::SeqCst) {
                    if let Ok((_, peer)) = u.recv_from(&mut buf) {
                        count.fetch_add(1, Ordering::SeqCst);
                        if let Ok(mut f) = from.lock() {
                            f.push(format!("udp from {peer}"));
                        }
                    }
                }
            }));
        }
        l.threads = threads;
        l
    }

    /// (TCP connections, UDP datagrams, from whom) so far.
    fn seen(&self) -> (usize, usize, Vec<String>) {
        (
            self.tcp.load(Ordering::SeqCst),
            self.udp.load(Ordering::SeqCst),
            self.from.lock().map(|f| f.clone()).unwrap_or_default(),
        )
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Knock once from the node itself on `addr`:`port` (TCP and UDP): the listener counts it.
fn knock_from_the_node(addr: std::net::IpAddr, port: u16) {
    let to = std::net::SocketAddr::new(addr, port);
    let _ = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(2));
    let bind = if addr.is_ipv6() {
        "[::]:0"
    } else {
        "0.0.0.0:0"
    };
    let u = std::net::UdpSocket::bind(bind).unwrap_or_else(|e| panic!("bind: {e}"));
    let _ = u.send_to(b"knock", to);
}

/// The hostile member's script (root in its copy): every half second, take `taken`
/// (addresses in the node's subnets) on eth0, make every destination on-link, write what it
/// holds to `/srv/www/hostile.txt` (the shop's httpd serves it: the proof that it ran as root
/// with its addresses and routes), and knock on every node address's `port` over UDP and TCP.
fn hostile_script(taken: &[String], node: &[NodeAddr], port: u16) -> String {
    let mut s = String::from(
        "#!/bin/bash\n# Root in the copy: reach the node through the lab.\nwhile :; do\n",
    );
    for t in taken {
        s.push_str(&format!(
            "  ip addr replace {t} dev eth0 nodad || ip addr replace {t} dev eth0\n"
        ));
    }
    s.push_str("  ip route replace default dev eth0\n  ip -6 route replace default dev eth0\n");
    s.push_str(
        "  { ip -o addr show dev eth0; ip route show; ip -6 route show; } >/srv/www/hostile.new\n  mv /srv/www/hostile.new /srv/www/hostile.txt\n",
    );
    for a in node {
        s.push_str(&format!(
            "  echo knock >/dev/udp/{ip}/{port}\n  timeout 1 bash -c 'echo knock >/dev/tcp/{ip}/{port}' &\n",
            ip = a.ip
        ));
    }
    s.push_str("  sleep 0.5\ndone >/dev/null 2>&1\n");
    s
}

/// The hostile unit: root, from the network's start to the copy's end.
const HOSTILE_UNIT: &str = "[Unit]\nDescription=A hostile tenant\nWants=network-online.target\nAfter=network-online.target\n\n[Service]\nExecStart=/bin/bash /usr/local/sbin/hostile\n";

/// A check of the shop: `sql`'s rows judged by `expect`.
fn shop_check(name: &str, sql: &str, expect: &str) -> String {
    format!(
        "\n[[check]]\nname = \"{name}\"\nsql = \"{sql}\"\nexpect = \"{expect}\"\nguests = [201]\n"
    )
}

/// A check of the shop that `url` does not answer (osquery's `curl` gives response code 0
/// when nothing answered).
fn unreachable_check(name: &str, url: &str) -> String {
    shop_check(
        name,
        &format!("SELECT response_code FROM curl WHERE url = '{url}'"),
        "response_code == '0'",
    )
}

/// The world of `shop`'s pair, grouped as `shop` with no boot delay, with the pack `pack`.
fn world(shop: Shop, db_files: Value, shop_files: Value, pack: &str) -> Option<World> {
    let w = World::real_or_skip(
        shop.scenario(&shop.db_unit(), db_files, shop_files),
        &AgentOptions::default(),
    )?;
    std::fs::write(w.files.checks_dir.join("shop.toml"), pack)
        .unwrap_or_else(|e| panic!("cannot write the pack: {e}"));
    add_group(&w.files.config_path, "shop", &[200, 201], 0);
    Some(w)
}

/// `--selftest=restore --guest 201 --json` to its end ([`groups::prove`]).
fn prove(w: &World) -> (Option<i32>, Vec<Value>, String) {
    felhom_tests::groups::prove(w, 201)
}

/// A hostile member cannot reach the node through its lab: nothing it sends arrives at any of
/// the node's addresses, while it reaches its database and holds the addresses and routes it
/// took.
#[test]
fn a_hostile_member_cannot_reach_the_node_through_its_lab() {
    let node = node_addrs();
    assert!(!node.is_empty(), "the node has no global address");
    let listener = Listener::open();
    // The listener counts what arrives: a knock from the node itself on each address.
    for a in &node {
        knock_from_the_node(a.ip, listener.port);
    }
    std::thread::sleep(Duration::from_millis(300));
    let (tcp, udp, _) = listener.seen();
    assert!(
        tcp >= node.len() && udp >= node.len(),
        "the listener did not count the node's own knocks: {tcp} tcp, {udp} udp"
    );
    let taken: Vec<String> = node.iter().filter_map(neighbour_in_subnet).collect();
    let first_v4 = taken
        .iter()
        .find(|t| !t.contains(':'))
        .cloned()
        .unwrap_or_else(|| panic!("the node has no IPv4 subnet to take an address in: {node:?}"));
    let mut pack = SHOP.pack();
    pack.push_str(&shop_check(
        "shop-reaches-its-database",
        &format!(
            "SELECT response_code FROM curl WHERE url = 'http://{}/stock'",
            SHOP.db_ip()
        ),
        "response_code == '200'",
    ));
    pack.push_str(&shop_check(
        "hostile-file",
        &format!(
            "SELECT response_code, result FROM curl WHERE url = 'http://{}/hostile.txt'",
            SHOP.shop_ip()
        ),
        "response_code == '200'",
    ));
    pack.push_str(&shop_check(
        "hostile-took-the-node-subnet-and-routes",
        &format!(
            "SELECT response_code, result FROM curl WHERE url = 'http://{}/hostile.txt' AND result LIKE '%{first_v4}%' AND result LIKE '%default dev eth0%'",
            SHOP.shop_ip()
        ),
        "rows == 1",
    ));
    for (i, a) in node.iter().enumerate() {
        let host = match a.ip {
            std::net::IpAddr::V4(v4) => v4.to_string(),
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        };
        pack.push_str(&unreachable_check(
            &format!("node-address-{i}-unreachable"),
            &format!("http://{host}:{}/", listener.port),
        ));
    }
    let shop_files = json!({
        "/usr/local/sbin/hostile": hostile_script(&taken, &node, listener.port),
        "/etc/systemd/system/hostile.service": HOSTILE_UNIT,
        "/etc/systemd/system/multi-user.target.d/hostile.conf": "[Unit]\nWants=hostile.service\n",
        // Each query of the shop's checks 3 s late: the hostile has knocked for a while
        // before and during them.
        "/etc/osquery-standin/delay": "3\n",
    });
    let Some(w) = world(SHOP, json!({}), shop_files, &pack) else {
        return;
    };
    let before = listener.seen();
    let (code, copies, out) = prove(&w);
    // Datagrams in flight at the copy's end have arrived by now.
    std::thread::sleep(Duration::from_secs(1));
    let after = listener.seen();
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (0, 0),
        "the hostile member reached the node: {:?}\n{out}",
        &after.2[before.2.len()..]
    );
    let (db, shop) = (copy_of(&copies, 200), copy_of(&copies, 201));
    assert!(
        check_is(shop, "hostile-took-the-node-subnet-and-routes", "pass"),
        "the hostile unit did not run as root with its addresses (the test proves nothing): {shop:#}"
    );
    assert!(
        check_is(shop, "shop-reaches-its-database", "pass"),
        "{shop:#}"
    );
    assert!(check_is(shop, "order-page", "pass"), "{shop:#}");
    for i in 0..node.len() {
        assert!(
            check_is(shop, &format!("node-address-{i}-unreachable"), "pass"),
            "{shop:#}"
        );
    }
    assert_eq!(db["outcome"], "ok", "{db:#}");
    assert_eq!(shop["outcome"], "ok", "{shop:#}");
    assert_eq!(code, Some(0), "{out}");
}

/// An agent process stopped (SIGTERM, then SIGKILL after a minute) and reaped when a failed
/// assertion drops it first.
struct Running(Option<std::process::Child>);

impl Running {
    fn child(&mut self) -> &mut std::process::Child {
        self.0
            .as_mut()
            .unwrap_or_else(|| panic!("the agent was already waited for"))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            // SIGTERM first: the agent stops the run, destroys its copies and removes its lab.
            if let Ok(pid) = i32::try_from(c.id()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            let asked = Instant::now();
            while matches!(c.try_wait(), Ok(None)) && asked.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// An agent's stderr read as it comes: its JSON log lines.
struct LogTail {
    lines: Arc<Mutex<Vec<Value>>>,
    reader: std::thread::JoinHandle<()>,
}

impl LogTail {
    fn start(stderr: std::process::ChildStderr) -> LogTail {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let reader = {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(stderr)
                    .lines()
                    .map_while(Result::ok)
                {
                    let v = serde_json::from_str::<Value>(&line).unwrap_or(json!({"text": line}));
                    if let Ok(mut l) = lines.lock() {
                        l.push(v);
                    }
                }
            })
        };
        LogTail { lines, reader }
    }

    /// The copies (vmids) whose journal reached one of `steps` so far.
    fn copies_at(&self, steps: &[&str]) -> std::collections::BTreeSet<u64> {
        self.lines
            .lock()
            .map(|l| {
                l.iter()
                    .filter(|v| {
                        let msg = v["message"].as_str().unwrap_or_default();
                        let step = msg.split_whitespace().skip_while(|w| *w != "step").nth(1);
                        step.is_some_and(|s| steps.contains(&s))
                    })
                    .filter_map(|v| v["vmid"].as_u64())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn text(&self) -> String {
        self.lines
            .lock()
            .map(|l| {
                l.iter()
                    .map(Value::to_string)
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default()
    }
}

/// Another group proven at the same time cannot be reached from this one: with the other
/// group's members up (booted, not yet destroyed) for this group's whole run, this group's
/// shop reaches its own database and neither of the other group's members, which sit on the
/// same subnet under the same group name and copy vmids.
#[test]
fn another_group_running_at_the_same_time_cannot_reach_either_member() {
    // The other group: its database answers each query 15 s late (its 7 checks, 4 at a time:
    // about 30 s, where this group's whole run takes about 10 s), so both of its members stay
    // up while this group runs.
    let Some(other) = world(
        OTHER,
        json!({"/etc/osquery-standin/delay": "15\n"}),
        json!({}),
        &OTHER.pack(),
    ) else {
        return;
    };
    let mut pack = SHOP.pack();
    for (name, url) in [
        (
            "other-database-unreachable",
            format!("http://{}/stock", OTHER.db_ip()),
        ),
        (
            "other-shop-unreachable",
            format!("http://{}/cgi-bin/order", OTHER.shop_ip()),
        ),
    ] {
        pack.push_str(&unreachable_check(name, &url));
    }
    let Some(this) = world(SHOP, json!({}), json!({}), &pack) else {
        return;
    };
    let mut child = Running(Some(
        other
            .command()
            .args([
                "--selftest=restore",
                "--guest",
                "201",
                "--json",
                "--log-format",
                "json",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run the other agent: {e}")),
    ));
    let tail = LogTail::start(
        child
            .child()
            .stderr
            .take()
            .unwrap_or_else(|| panic!("no stderr")),
    );
    // Both of the other group's members booted (their journals past the boot wait).
    let waited = Instant::now();
    while tail.copies_at(&["bootstrap", "checks"]).len() < 2 {
        if waited.elapsed() > Duration::from_secs(240) {
            panic!("the other group's members did not boot:\n{}", tail.text());
        }
        if let Ok(Some(status)) = child.child().try_wait() {
            panic!(
                "the other group's run ended ({status}) before both members booted:\n{}",
                tail.text()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let (code, copies, out) = prove(&this);
    // The other group's members were up for this whole run: none of them has gone on to its
    // report or destroy yet.
    let gone_on = tail.copies_at(&["report", "destroy", "confirm_destroyed", "done"]);
    let still_running = matches!(child.child().try_wait(), Ok(None));
    assert!(
        gone_on.is_empty() && still_running,
        "the other group ended (or began its destroy) before this group's run ended; the test proves nothing:\n{}",
        tail.text()
    );
    let (db, shop) = (copy_of(&copies, 200), copy_of(&copies, 201));
    assert!(
        check_is(shop, "other-database-unreachable", "pass"),
        "this group's shop reached the other group's database: {shop:#}"
    );
    assert!(
        check_is(shop, "other-shop-unreachable", "pass"),
        "this group's shop reached the other group's shop: {shop:#}"
    );
    assert!(check_is(shop, "order-page", "pass"), "{shop:#}");
    assert!(check_is(db, "database-serves", "pass"), "{db:#}");
    assert_eq!(code, Some(0), "{out}");
    // The other group was green too: its shop's order page reached its own database in its
    // own lab, and its database still served when its late checks ran.
    let other_out = child
        .0
        .take()
        .unwrap_or_else(|| panic!("the other agent was already waited for"))
        .wait_with_output()
        .unwrap_or_else(|e| panic!("the other agent: {e}"));
    let _ = tail.reader.join();
    let other_doc: Value = serde_json::from_slice(&other_out.stdout).unwrap_or_else(|e| {
        panic!(
            "the other agent's output is not JSON ({e}): {}",
            String::from_utf8_lossy(&other_out.stdout)
        )
    });
    let other_copies = other_doc["copies"].as_array().cloned().unwrap_or_default();
    let (odb, oshop) = (copy_of(&other_copies, 200), copy_of(&other_copies, 201));
    assert!(check_is(oshop, "order-page", "pass"), "{oshop:#}");
    assert!(check_is(odb, "database-serves", "pass"), "{odb:#}");
    assert_ne!(
        odb["group"]["lab"], db["group"]["lab"],
        "the two groups' runs shared a lab"
    );
}
