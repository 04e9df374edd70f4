use super::*;

use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::Command;

/// What the report says of `sys-kernel-debug.mount` when its failed state was reset.
const DEBUGFS_RESET_NOTE: &str = "sys-kernel-debug.mount failed as in every unprivileged \
container (debugfs cannot be mounted in a user namespace); its failed state reset";

#[test]
fn interface_names_from_a_backup_are_plain_or_left_out() {
    for ok in ["eth0", "ens18", "eth0.20", "br-lan", "a_b"] {
        assert!(valid_ifname(ok), "{ok}");
    }
    for bad in [
        "",
        "-x",
        "eth0;reboot",
        "a/b",
        "$(x)",
        "abcdefghijklmnop",
        "felab0",
        "e th",
    ] {
        assert!(!valid_ifname(bad), "{bad}");
    }
}

#[test]
fn the_lab_report_names_what_was_restarted_what_was_left_failed_and_the_node_resets() {
    let out = "given eth0 felab0\n\
               kept flaky.service\n\
               restarted networking.service active\n\
               restarted shop.service active\n\
               userns-reset sys-kernel-debug.mount debugfs\n\
               userns-reset sys-kernel-config.mount configfs\n\
               userns-reset other.mount ext4\n\
               userns-reset systemd-journald-audit.socket audit 247.3\n\
               userns-reset flaky.service audit 247.3\n\
               whatever the guest prints\n";
    let parts = lab_report(out, &[], true, &[]);
    let text = parts.join("; ");
    assert_eq!(
        parts[0],
        "eth0 given as an unconnected veth pair (peer felab0 inside the copy)"
    );
    assert!(
        text.contains("restarted networking.service (active), shop.service (active)"),
        "{text}"
    );
    assert!(
        text.contains("left failed (no network ordering: its failure is its own): flaky.service"),
        "{text}"
    );
    assert!(text.contains(DEBUGFS_RESET_NOTE), "{text}");
    assert!(
        text.contains(&userns_mount_note("sys-kernel-config.mount", "configfs")),
        "{text}"
    );
    assert!(
        text.contains(
            "systemd-journald-audit.socket failed as under every systemd older than 254 \
             without its audit check (backported to 251.17, 252.11 and 253.5)"
        ) && text.contains("systemd 247.3 takes"),
        "{text}"
    );
    // Only a mount of a filesystem a user namespace cannot mount, and only the audit socket,
    // are ever named as reset, whatever the guest prints.
    assert!(!text.contains("other.mount"), "{text}");
    assert!(!text.contains("flaky.service failed as"), "{text}");
    assert!(!text.contains("whatever"), "{text}");
    assert_eq!(
        userns_mount_note("sys-kernel-debug.mount", "debugfs"),
        DEBUGFS_RESET_NOTE
    );
}

#[test]
fn a_lab_run_for_the_node_failures_alone_says_nothing_of_foreign_links() {
    assert!(lab_report("foreign eth0 ether\n", &[], false, &[]).is_empty());
    let asked = lab_report("foreign eth0 outside\n", &[], true, &[]);
    assert_eq!(
        asked,
        vec![
            "nothing given: the copy's network namespace holds eth0, whose peer is outside the copy"
                .to_string()
        ]
    );
    let bad = "eth0;reboot".to_string();
    let out = lab_report("", &[], true, &[&bad]);
    assert_eq!(
        out,
        vec!["eth0;reboot left out (not a plain interface name)".to_string()]
    );
}

/// A folder of stand-ins for the guest's commands, put first on the PATH of a real shell that
/// runs the lab's real scripts.
struct Guest {
    dir: tempfile::TempDir,
}

impl Guest {
    /// `links`: what `ip -d -o link show` prints (iproute2's one-line form: the lines of one
    /// link joined by a backslash); `ip -o link show` prints the same, and any other `ip` call
    /// succeeds and is logged. `systemctl`: a script body answering the calls the lab makes (its
    /// calls are logged first; `$log` names the log).
    fn new(links: &str, systemctl: &str) -> Self {
        Self::with_ip_details(links, systemctl, true)
    }

    /// `details`: whether `ip` knows `-d` (busybox's does not: it prints its usage instead).
    fn with_ip_details(links: &str, systemctl: &str, details: bool) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("links"), links).expect("links");
        let no_details = if details {
            ""
        } else {
            "'-d '*) echo 'Usage: ip [OPTIONS] address|route|link'; exit 0;;\n"
        };
        write_exec(
            &dir.path().join("ip"),
            &format!(
                "#!/bin/sh\necho \"ip $*\" >>'{log}'\ncase \"$*\" in\n{no_details}\
                 '-d -o link show'|'-o link show') cat '{links}';;\n\
                 'link show dev '*) grep -q \"^[0-9]*: $4[@:]\" '{links}';;\n\
                 *) exit 0;;\nesac\n",
                log = dir.path().join("log").display(),
                links = dir.path().join("links").display()
            ),
        );
        write_exec(
            &dir.path().join("systemctl"),
            &format!(
                "#!/bin/sh\nlog='{log}'\necho \"systemctl $*\" >>\"$log\"\n{systemctl}\n",
                log = dir.path().join("log").display()
            ),
        );
        Guest { dir }
    }

    /// Run `script` with the stored `names` in a real shell (see [`Init`]).
    fn run(&self, script: &str, names: &[&str], env: &[(&str, &str)], init: Init) -> String {
        let path = path_before(self.dir.path());
        let mut cmd = match init {
            Init::Host => Command::new("/bin/sh"),
            Init::Userns => {
                let mut c = Command::new("unshare");
                c.args(["--user", "--map-root-user", "/bin/sh"]);
                c
            }
            Init::Systemd | Init::Other => {
                // The shell itself is PID 1 of a new PID namespace, under the name an init has.
                let name = if init == Init::Systemd {
                    "systemd"
                } else {
                    "init"
                };
                let shell = self.dir.path().join(name);
                std::fs::copy("/bin/sh", &shell).expect("copy of /bin/sh");
                let mut c = Command::new("unshare");
                c.args(["--pid", "--fork", "--mount-proc"]).arg(shell);
                c
            }
        };
        // An init's shell runs with a /run of its own (a tmpfs of its own mount namespace,
        // which `--mount-proc` made): what the give step writes there never reaches this
        // machine's, and this machine's systemd folder is not taken for the guest's.
        let script = if matches!(init, Init::Systemd | Init::Other) {
            format!("mount -t tmpfs felhom-test /run || exit 1\n{script}")
        } else {
            script.to_string()
        };
        cmd.args(["-c", &script, "sh"]);
        let out = cmd
            .args(names)
            .env("PATH", path)
            .envs(env.iter().copied())
            .output()
            .expect("sh runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }
}

/// Where a lab script runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Init {
    /// This process's own namespaces (the initial user namespace).
    Host,
    /// A user namespace that is not the initial one, as an unprivileged container's.
    Userns,
    /// PID 1 of its own PID namespace, whose binary is named `systemd` (before systemd made
    /// `/run/systemd/system`, that is how the lab knows it), with an empty `/run` of its own.
    Systemd,
    /// PID 1 of its own PID namespace, an init that is not systemd, with an empty `/run` of its
    /// own.
    Other,
}

fn write_exec(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).expect("write");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

const LO: &str = "1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN mode DEFAULT group default qlen 1000\\    link/loopback 00:00:00:00:00:00 brd 00:00:00:00:00:00 promiscuity 0  allmulti 0 minmtu 0 maxmtu 0 addrgenmode eui64 numtxqueues 1 numrxqueues 1 gso_max_size 65536 gso_max_segs 65535 tso_max_size 524280 tso_max_segs 65535 gro_max_size 65536 \n";

/// The fallback devices of the node's tunnel modules, as a new network namespace holds them
/// (iproute2 6.1's `ip -d -o link show`; the peer of a tunnel with no lower device is `NONE`).
const FALLBACK_TUNNELS: &str = "\
2: tunl0@NONE: <NOARP> mtu 1480 qdisc noop state DOWN mode DEFAULT group default qlen 1000\\    link/ipip 0.0.0.0 brd 0.0.0.0 promiscuity 0  allmulti 0 minmtu 0 maxmtu 0 \\    ipip any remote any local any ttl inherit nopmtudisc addrgenmode eui64 numtxqueues 1 numrxqueues 1 gso_max_size 65536 gso_max_segs 65535 \n\
3: gre0@NONE: <NOARP> mtu 1476 qdisc noop state DOWN mode DEFAULT group default qlen 1000\\    link/gre 0.0.0.0 brd 0.0.0.0 promiscuity 0  allmulti 0 minmtu 0 maxmtu 0 \\    gre remote any local any ttl inherit nopmtudisc addrgenmode eui64 numtxqueues 1 numrxqueues 1 gso_max_size 65536 gso_max_segs 65535 \n\
4: gretap0@NONE: <BROADCAST,MULTICAST> mtu 1462 qdisc noop state DOWN mode DEFAULT group default qlen 1000\\    link/ether 00:00:00:00:00:00 brd ff:ff:ff:ff:ff:ff promiscuity 0  allmulti 0 minmtu 68 maxmtu 0 \\    gretap remote any local any ttl inherit nopmtudisc addrgenmode eui64 numtxqueues 1 numrxqueues 1 gso_max_size 65536 gso_max_segs 65535 \n\
5: erspan0@NONE: <BROADCAST,MULTICAST> mtu 1450 qdisc noop state DOWN mode DEFAULT group default qlen 1000\\    link/ether 00:00:00:00:00:00 brd ff:ff:ff:ff:ff:ff promiscuity 0  allmulti 0 minmtu 68 maxmtu 0 \\    erspan remote any local any ttl inherit nopmtudisc erspan_ver 1 erspan_index 0 addrgenmode eui64 numtxqueues 1 numrxqueues 1 gso_max_size 65536 gso_max_segs 65535 \n\
6: ip_vti0@NONE: <NOARP> mtu 1480 qdisc noop state DOWN mode DEFAULT group default qlen 1000\\    link/ipip 0.0.0.0 brd 0.0.0.0 promiscuity 0  allmulti 0 minmtu 0 maxmtu 0 \\    vti remote any local any ikey 0.0.0.0 okey 0.0.0.0 addrgenmode eui64 numtxqueues 1 numrxqueues 1 gso_max_size 65536 gso_max_segs 65535 \n\
7: ip6_vti0@NONE: <NOARP> mtu 1332 qdisc noop state DOWN mode DEFAULT group default qlen 1000\\    link/tunnel6 :: brd :: permaddr 36ea:c5a7:b0c8:: promiscuity 0  allmulti 0 minmtu 1280 maxmtu 65535 \\    vti6 remote any local any hoplimit 0 encaplimit 0 tclass 0x00 flowlabel 0x00000 (flowinfo 0x00000000) addrgenmode eui64 numtxqueues 1 numrxqueues 1 gso_max_size 65536 gso_max_segs 65535 \n\
8: sit0@NONE: <NOARP> mtu 1480 qdisc noop state DOWN mode DEFAULT group default qlen 1000\\    link/sit 0.0.0.0 brd 0.0.0.0 promiscuity 0  allmulti 0 minmtu 1280 maxmtu 65555 \\    sit remote any local any ttl 64 nopmtudisc 6rd-prefix 2002::/16 addrgenmode eui64 numtxqueues 1 numrxqueues 1 gso_max_size 65536 gso_max_segs 65535 \n\
9: ip6tnl0@NONE: <NOARP> mtu 1452 qdisc noop state DOWN mode DEFAULT group default qlen 1000\\    link/tunnel6 :: brd :: permaddr 6e1b:4a7:4c4a:: promiscuity 0  allmulti 0 minmtu 68 maxmtu 65407 \\    ip6tnl ip6ip6 remote any local any hoplimit 0 encaplimit 0 tclass 0x00 flowlabel 0x00000 (flowinfo 0x00000000) addrgenmode eui64 numtxqueues 1 numrxqueues 1 gso_max_size 65536 gso_max_segs 65535 \n\
10: ip6gre0@NONE: <NOARP> mtu 1448 qdisc noop state DOWN mode DEFAULT group default qlen 1000\\    link/gre6 :: brd :: promiscuity 0  allmulti 0 minmtu 1280 maxmtu 65535 \\    ip6gre remote any local any hoplimit inherit encaplimit 4 tclass 0x00 flowlabel 0x00000 (flowinfo 0x00000000) addrgenmode eui64 numtxqueues 1 numrxqueues 1 gso_max_size 65536 gso_max_segs 65535 \n";

/// `eth0` and its peer `felab0`, as the lab makes them (both ends in the copy: no link-netnsid).
const LAB_PAIR: &str = "\
11: felab0@eth0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP mode DEFAULT group default qlen 1000\\    link/ether 86:97:25:17:f6:29 brd ff:ff:ff:ff:ff:ff promiscuity 0  allmulti 0 minmtu 68 maxmtu 65535 \\    veth addrgenmode eui64 numtxqueues 2 numrxqueues 2 gso_max_size 65536 gso_max_segs 65535 \n\
12: eth0@felab0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP mode DEFAULT group default qlen 1000\\    link/ether e6:44:0f:55:ba:aa brd ff:ff:ff:ff:ff:ff promiscuity 0  allmulti 0 minmtu 68 maxmtu 65535 \\    veth addrgenmode eui64 numtxqueues 2 numrxqueues 2 gso_max_size 65536 gso_max_segs 65535 \n";

/// A NIC wired as PVE wires a container's: a veth whose peer is on the node (iproute2 prints
/// `link-netnsid` for a peer in another namespace).
const WIRED_ETH0: &str = "2: eth0@if14: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP mode DEFAULT group default qlen 1000\\    link/ether bc:24:11:00:02:00 brd ff:ff:ff:ff:ff:ff link-netnsid 0 promiscuity 0  allmulti 0 minmtu 68 maxmtu 65535 \\    veth addrgenmode eui64 numtxqueues 2 numrxqueues 2 gso_max_size 65536 gso_max_segs 65535 \n";

/// The guard alone: what it prints, then `passed` when it let the script go on.
fn guard(links: &str, names: &[&str]) -> String {
    let g = Guest::new(links, "exit 0");
    g.run(&format!("{GUARD}echo passed\n"), names, &[], Init::Host)
}

/// The guard after the boot (`lab_strict=0`).
fn guard_after_boot(links: &str, names: &[&str]) -> String {
    let g = Guest::new(links, "exit 0");
    g.run(
        &format!("lab_strict=0\n{GUARD}echo passed\n"),
        names,
        &[],
        Init::Host,
    )
}

#[test]
fn after_the_boot_the_guard_stops_only_at_a_peer_outside() {
    let bridge = "13: docker0: <NO-CARRIER,BROADCAST,MULTICAST,UP> mtu 1500 qdisc noqueue state DOWN mode DEFAULT group default\\    link/ether 3a:c4:c6:50:a5:0e brd ff:ff:ff:ff:ff:ff promiscuity 0  allmulti 0 minmtu 68 maxmtu 65535 \\    bridge forward_delay 1500 addrgenmode eui64 \n";
    let links = format!("{LO}{FALLBACK_TUNNELS}{LAB_PAIR}{bridge}");
    // Before the boot a bridge stops the lab; the guest's own boot may make one.
    assert_eq!(guard(&links, &["eth0"]), "foreign docker0 ether\n");
    assert_eq!(guard_after_boot(&links, &["eth0"]), "passed\n");
    let links = format!("{LO}{WIRED_ETH0}");
    assert_eq!(
        guard_after_boot(&links, &["eth0"]),
        "foreign eth0 outside\n"
    );
}

#[test]
fn an_ip_without_details_still_guards_by_peer_and_ethernet_type() {
    // busybox's `ip -o link`: no kind, no link-netnsid.
    let busybox_pair = "2: felab0@eth0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue qlen 1000\\    link/ether 86:97:25:17:f6:29 brd ff:ff:ff:ff:ff:ff\n\
3: eth0@felab0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue qlen 1000\\    link/ether e6:44:0f:55:ba:aa brd ff:ff:ff:ff:ff:ff\n";
    let busybox_lo = "1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue qlen 1000\\    link/loopback 00:00:00:00:00:00 brd 00:00:00:00:00:00\n";
    let run = |links: &str| {
        let g = Guest::with_ip_details(links, "exit 0", false);
        g.run(&format!("{GUARD}echo passed\n"), &["eth0"], &[], Init::Host)
    };
    assert_eq!(run(&format!("{busybox_lo}{busybox_pair}")), "passed\n");
    let nic = "2: ifb0: <BROADCAST,NOARP> mtu 1500 qdisc noop qlen 32\\    link/ether 7e:50:de:46:1a:f5 brd ff:ff:ff:ff:ff:ff\n";
    assert_eq!(run(&format!("{busybox_lo}{nic}")), "foreign ifb0 ether\n");
}

#[test]
fn the_guard_lets_fallback_tunnels_and_the_labs_own_pair_pass() {
    let links = format!("{LO}{FALLBACK_TUNNELS}");
    assert_eq!(guard(&links, &["eth0"]), "passed\n");
    let links = format!("{LO}{FALLBACK_TUNNELS}{LAB_PAIR}");
    assert_eq!(guard(&links, &["eth0"]), "passed\n");
}

#[test]
fn the_guard_stops_at_a_peer_outside_an_ethernet_device_it_did_not_make_or_no_listing() {
    // The production wiring, even under a stored name.
    let links = format!("{LO}{FALLBACK_TUNNELS}{WIRED_ETH0}");
    assert_eq!(guard(&links, &["eth0"]), "foreign eth0 outside\n");
    // A named network namespace prints its name instead of its id.
    let named = WIRED_ETH0.replace("link-netnsid 0", "link-netns pve");
    assert_eq!(
        guard(&format!("{LO}{named}"), &["eth0"]),
        "foreign eth0 outside\n"
    );
    // The lab's pair under a name the backup does not store is not the lab's.
    let links = format!("{LO}{LAB_PAIR}");
    assert_eq!(guard(&links, &["eth1"]), "foreign eth0 ether\n");
    // A physical NIC (no kind), a bridge.
    let nic = "2: ens18: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc pfifo_fast state UP mode DEFAULT group default qlen 1000\\    link/ether 02:fc:00:00:00:01 brd ff:ff:ff:ff:ff:ff promiscuity 0  allmulti 0 minmtu 68 maxmtu 65535 addrgenmode eui64 numtxqueues 1 numrxqueues 1 gso_max_size 65536 gso_max_segs 65535 parentbus virtio parentdev virtio2 \n";
    assert_eq!(
        guard(&format!("{LO}{nic}"), &["eth0"]),
        "foreign ens18 ether\n"
    );
    let bridge = "2: docker0: <NO-CARRIER,BROADCAST,MULTICAST,UP> mtu 1500 qdisc noqueue state DOWN mode DEFAULT group default\\    link/ether 3a:c4:c6:50:a5:0e brd ff:ff:ff:ff:ff:ff promiscuity 0  allmulti 0 minmtu 68 maxmtu 65535 \\    bridge forward_delay 1500 hello_time 200 max_age 2000 addrgenmode eui64 numtxqueues 1 numrxqueues 1 \n";
    assert_eq!(
        guard(&format!("{LO}{FALLBACK_TUNNELS}{bridge}"), &["eth0"]),
        "foreign docker0 ether\n"
    );
    // A tunnel device whose lower end is in another namespace is no fallback device.
    let tunnel_out = "2: gretap1@if5: <BROADCAST,MULTICAST> mtu 1462 qdisc noop state DOWN mode DEFAULT group default qlen 1000\\    link/ether 00:00:00:00:00:00 brd ff:ff:ff:ff:ff:ff link-netnsid 0 promiscuity 0 \\    gretap remote 192.0.2.1 local any ttl inherit addrgenmode eui64 \n";
    assert_eq!(
        guard(&format!("{LO}{tunnel_out}"), &["eth0"]),
        "foreign gretap1 outside\n"
    );
    // No listing (no `ip`, or it could not read the links): nothing is done.
    assert_eq!(guard("", &["eth0"]), "unreadable\n");
}

#[test]
fn the_give_step_makes_each_missing_name_a_pair_and_restarts_a_network_unit_that_already_failed() {
    let links = format!("{LO}{FALLBACK_TUNNELS}");
    let systemctl = "case \"$*\" in\n\
                     'is-active networking.service') echo failed;;\n\
                     'is-active '*) echo inactive;;\n\
                     esac\nexit 0";
    let g = Guest::new(&links, systemctl);
    let out = g.run(
        &format!("{GUARD}{GIVE}"),
        &["eth0", "eth1"],
        &[],
        Init::Systemd,
    );
    assert_eq!(
        out,
        "given eth0 felab0\ngiven eth1 felab1\nearly-restart networking.service\n"
    );
    let log = g.log();
    assert!(
        log.contains("ip link add eth0 type veth peer name felab0")
            && log.contains("ip link set felab1 up")
            && log.contains("systemctl restart --no-block networking.service")
            && !log.contains("restart --no-block systemd-networkd"),
        "{log}"
    );
    // Behind a foreign link nothing is made and nothing restarted.
    let g = Guest::new(&format!("{LO}{WIRED_ETH0}"), systemctl);
    let out = g.run(&format!("{GUARD}{GIVE}"), &["eth0"], &[], Init::Systemd);
    assert_eq!(out, "foreign eth0 outside\n");
    let log = g.log();
    assert!(
        !log.contains("link add") && !log.contains("restart"),
        "{log}"
    );
    // A guest whose init is not systemd gets nothing.
    let g = Guest::new(&links, systemctl);
    let out = g.run(&format!("{GUARD}{GIVE}"), &["eth0"], &[], Init::Other);
    assert_eq!(out, "no-systemd\n");
    assert!(!g.log().contains("link add"), "{}", g.log());
}

/// A guest's `systemctl` that lists `failed` units, answers `show -p Type` from `types`
/// (unit=type), prints `version` for `--version`, and logs every reset.
fn failed_units_systemctl(failed: &[&str], types: &[(&str, &str)], version: &str) -> String {
    let mut s = String::from("case \"$1 $2\" in\n");
    s.push_str(&format!(
        "'list-units --state=failed') for u in {}; do echo \"$u loaded failed failed x\"; done;;\n",
        failed.join(" ")
    ));
    s.push_str(&format!(
        "'--version ') echo '{version}'; echo '+PAM +AUDIT';;\n"
    ));
    s.push_str("'show -p') case \"$5\" in\n");
    for (unit, t) in types {
        s.push_str(&format!("  {unit}) echo {t};;\n"));
    }
    s.push_str("  esac;;\nesac\nexit 0");
    s
}

fn userns_env() -> String {
    USERNS_UNMOUNTABLE.join(" ")
}

#[test]
fn the_settle_step_resets_the_mounts_a_user_namespace_cannot_make_and_the_audit_socket_of_an_old_systemd(
) {
    let failed = [
        "sys-kernel-config.mount",
        "sys-kernel-debug.mount",
        "srv-data.mount",
        "systemd-journald-audit.socket",
        "shop.service",
    ];
    let types = [
        ("sys-kernel-config.mount", "configfs"),
        ("sys-kernel-debug.mount", "debugfs"),
        ("srv-data.mount", "ext4"),
    ];
    let env = userns_env();
    let env = [("FELHOM_LAB_USERNS", env.as_str())];
    let links = format!("{LO}{FALLBACK_TUNNELS}");
    // Debian 11's systemd 247 cannot tell; the node's failures are reset, the guest's own
    // (an ext4 mount, a service) are not.
    let g = Guest::new(
        &links,
        &failed_units_systemctl(&failed, &types, "systemd 247 (247.3-7+deb11u6)"),
    );
    let out = g.run(&format!("{GUARD}{SETTLE}"), &[], &env, Init::Userns);
    assert_eq!(
        out,
        "userns-reset sys-kernel-config.mount configfs\n\
         userns-reset sys-kernel-debug.mount debugfs\n\
         userns-reset systemd-journald-audit.socket audit 247.3\n",
    );
    let log = g.log();
    assert!(
        !log.contains("reset-failed srv-data.mount") && !log.contains("reset-failed shop"),
        "{log}"
    );
    // The audit check came with 254 and was cherry-picked into 251.17, 252.11 and 253.5: from
    // those on the socket is skipped in a user namespace, and a failed one is not the node's
    // doing. Each boundary, as `systemctl --version` prints it on the distributions that ship
    // those series (Debian, Ubuntu, Fedora, Arch).
    for (version, reset) in [
        ("systemd 245 (245.4-4ubuntu3.24)", true),
        ("systemd 250 (250.14-1)", true),
        ("systemd 251 (251.16-1.fc37)", true),
        ("systemd 251 (251.17-1)", false),
        ("systemd 252 (252.6-1)", true),
        ("systemd 252 (252.10-1)", true),
        ("systemd 252 (252.11-1)", false),
        ("systemd 252 (252.39-1~deb12u2)", false),
        ("systemd 253 (253)", true),
        ("systemd 253 (253.4-1-arch)", true),
        ("systemd 253 (253.5-1.fc38)", false),
        ("systemd 253 (253.26-1)", false),
        ("systemd 254 (254)", false),
        ("systemd 254 (254.1-1)", false),
        ("systemd 257 (257.9-1~deb13u1)", false),
        ("systemd 249 (249.11-0ubuntu3.12)", true),
        ("not a version", false),
    ] {
        let g = Guest::new(
            &links,
            &failed_units_systemctl(&["systemd-journald-audit.socket"], &[], version),
        );
        let out = g.run(&format!("{GUARD}{SETTLE}"), &[], &env, Init::Userns);
        assert_eq!(
            out.contains("userns-reset systemd-journald-audit.socket"),
            reset,
            "{version}: {out}"
        );
        // The same range as the documented one.
        let parts: Vec<u32> = version
            .split(['(', '.', '-', ')', ' '])
            .filter_map(|p| p.parse().ok())
            .collect();
        if let [major, _, rest @ ..] = parts.as_slice() {
            let minor = rest.first().copied().unwrap_or(0);
            assert_eq!(audit_socket_unchecked(*major, minor), reset, "{version}");
        }
    }
    // In the initial user namespace (a privileged container), nothing is the user namespace's.
    let g = Guest::new(
        &links,
        &failed_units_systemctl(&failed, &types, "systemd 247 (247.3-7+deb11u6)"),
    );
    assert_eq!(
        g.run(&format!("{GUARD}{SETTLE}"), &[], &env, Init::Host),
        ""
    );
    // A customer's guest (no variable): nothing is reset.
    let g = Guest::new(
        &links,
        &failed_units_systemctl(&failed, &types, "systemd 247 (247.3-7+deb11u6)"),
    );
    assert_eq!(
        g.run(&format!("{GUARD}{SETTLE}"), &[], &[], Init::Userns),
        ""
    );
    assert!(!g.log().contains("reset-failed"), "{}", g.log());
}

#[test]
fn only_a_stored_ip6_dhcp_name_is_read_as_stopped_from_the_watch() {
    let names = ["eth0".to_string(), "eth1".to_string()];
    let dhcp6 = ["eth0".to_string()];
    let lab = LabRequest {
        names: &names,
        dhcp: &dhcp6,
        dhcp6: &dhcp6,
        reset_node_failures: true,
        joined: false,
        hosts: None,
    };
    let lines: Vec<String> = [
        "dhcp6-stopped eth1 61",
        "dhcp6-stopped eth0 notanumber",
        "dhcp6-stopped eth0 61",
        "dhcp6-stopped eth0 62",
        "systemd running",
    ]
    .iter()
    .map(|l| l.to_string())
    .collect();
    let (stopped, notes) = dhcp6_stopped(&lab, &lines);
    assert_eq!(stopped, vec!["eth0".to_string()]);
    assert_eq!(
        notes,
        vec![
            "the DHCPv6 client of eth0 (ip6=dhcp) waited 61s for a lease that cannot come in an \
             isolated copy, holding networking.service and the boot: stopped"
                .to_string()
        ]
    );
    // The watch runs only in the agent's own copies, and only for stored ip6=dhcp names.
    let plan = boot_plan(&lab, DHCP6_GIVE_UP);
    assert_eq!(plan.tick, Some(format!("{DHCP6_WATCH}{NET_WATCH}")));
    assert_eq!(plan.args, vec!["eth0".to_string(), "eth1".to_string()]);
    assert!(
        plan.env.contains(&("FELHOM_LAB_DHCP6", "eth0".to_string())),
        "{:?}",
        plan.env
    );
    assert!(
        plan.env
            .contains(&("FELHOM_LAB_DHCP6_GIVE_UP", "60".to_string())),
        "{:?}",
        plan.env
    );
    let customer = LabRequest {
        reset_node_failures: false,
        joined: false,
        ..lab.clone()
    };
    let plan = boot_plan(&customer, DHCP6_GIVE_UP);
    assert_eq!(plan.tick.as_deref(), Some(NET_WATCH));
    assert!(
        !plan
            .env
            .iter()
            .any(|(k, _)| k.starts_with("FELHOM_LAB_DHCP6")),
        "{:?}",
        plan.env
    );
    let none = LabRequest { dhcp6: &[], ..lab };
    assert_eq!(
        boot_plan(&none, DHCP6_GIVE_UP).tick.as_deref(),
        Some(NET_WATCH)
    );
    // Nothing to give: no watch at all.
    let nothing = LabRequest {
        names: &[],
        dhcp: &[],
        dhcp6: &[],
        reset_node_failures: true,
        joined: false,
        hosts: None,
    };
    assert!(boot_plan(&nothing, DHCP6_GIVE_UP).tick.is_none());
}

/// The boot trip's script with the DHCPv6 watch as its tick, as an agent's own copy with
/// `ip6=dhcp` on `name` runs it; its init taken for systemd (this machine's is not).
fn watch_script(name: &str) -> String {
    let names = [name.to_string()];
    let lab = LabRequest {
        names: &names,
        dhcp: &names,
        dhcp6: &names,
        reset_node_failures: true,
        joined: false,
        hosts: None,
    };
    tick_script(&lab)
}

/// An agent's own copy given `names`, with no DHCP.
fn own_copy(names: &[String]) -> LabRequest<'_> {
    LabRequest {
        names,
        dhcp: &[],
        dhcp6: &[],
        reset_node_failures: true,
        joined: false,
        hosts: None,
    }
}

/// The boot trip's script of `lab` without its before and after steps (the wait and its tick
/// alone), its init taken for systemd (this machine's is not).
fn tick_script(lab: &LabRequest<'_>) -> String {
    let plan = crate::guest::boot::BootPlan {
        before: None,
        after: None,
        ..boot_plan(lab, DHCP6_GIVE_UP)
    };
    let script = crate::guest::boot::script(&plan, 60);
    let init = "felhom_init() {\n";
    assert!(script.contains(init));
    script.replace(init, "felhom_init() {\n  return 0\n")
}

/// The DHCPv6 watch in a real shell beside a real process named `dhclient` (a copy of `/bin/sh`
/// sleeping under the command line ifupdown gives `dhclient -6`): it stops that process once it
/// has run the give-up time, never itself (its own command line holds the same words), and ends
/// with systemd's answer.
#[test]
fn the_dhcp6_watch_stops_the_waiting_client_and_not_itself() {
    let dir = tempfile::tempdir().expect("temp dir");
    let fake = dir.path().join("dhclient");
    std::fs::copy("/bin/sh", &fake).expect("copy of /bin/sh");
    // A name no real client of this machine serves.
    let name = "feltst6";
    // The watch of `name` given a second, in a guest whose `systemctl` script is `systemctl`.
    let watch = |systemctl: &str| {
        Guest::new(LO, systemctl).run(
            &watch_script(name),
            &[name],
            &[
                ("FELHOM_LAB_DHCP6", name),
                ("FELHOM_LAB_DHCP6_GIVE_UP", "1"),
            ],
            Init::Host,
        )
    };
    let mut client = Command::new(&fake)
        .args([
            "-c",
            "sleep 300; :",
            "-6",
            "-v",
            "-pf",
            "/run/dhclient6.x.pid",
            name,
        ])
        // Its own process group, with none of the test's output: its `sleep` goes with it.
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .expect("the fake client starts");
    let pid = client.id();
    // systemd says `starting` while the client runs, `degraded` once it is gone (a zombie
    // until this test waits for it). Alive is any state but zombie or dead: on a loaded machine
    // the fresh client can be in `D` (its pages read in) at the first ask.
    let systemctl = format!(
        "case \"$1\" in is-system-running) if [ -e /proc/{pid}/status ] && \
         ! grep -q '^State:[[:space:]]*[ZX]' /proc/{pid}/status 2>/dev/null; then echo starting; \
         else echo degraded; fi;; esac\nexit 0"
    );
    let started = std::time::Instant::now();
    let out = watch(&systemctl);
    // The script ends once systemd says `degraded`, i.e. once the client is a zombie; a client
    // still there (the wait timed out) fails the test now, its group killed, not after its
    // 300 s sleep.
    let still_there = client
        .try_wait()
        .expect("the fake client's state")
        .is_none();
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{pid}")])
        .stderr(std::process::Stdio::null())
        .status();
    let status = client.wait().expect("the fake client was waited for");
    assert!(!still_there, "the watch left the client running: {out}");
    let mut lines = out.lines().filter(|l| !l.starts_with("felhom-took "));
    assert_eq!(lines.next(), Some("felhom-step wait"), "{out}");
    let stopped = lines.next().unwrap_or("");
    assert!(
        stopped.starts_with(&format!("dhcp6-stopped {name} ")),
        "{out}"
    );
    assert_eq!(lines.next(), Some("systemd degraded"), "{out}");
    assert_eq!(lines.next(), None, "{out}");
    assert!(!status.success(), "the client was not stopped: {status:?}");
    assert!(started.elapsed() < std::time::Duration::from_secs(60));

    // No client at all for three seconds of a boot: the watch finds nothing to stop (its own
    // command line holds `dhclient`, ` -6 ` and the name last, and stays alive).
    let count = dir.path().join("count");
    let systemctl = format!(
        "case \"$1\" in is-system-running) echo x >>'{c}'; \
         if [ \"$(wc -l <'{c}')\" -lt 4 ]; then echo starting; else echo running; fi;; esac\nexit 0",
        c = count.display()
    );
    let out = watch(&systemctl);
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| !l.starts_with("felhom-took "))
        .collect();
    assert_eq!(lines, ["felhom-step wait", "systemd running"], "{out}");
}

/// The give step in a guest whose `systemctl` answers `nm_state` for
/// `is-active NetworkManager.service` (`None`: NetworkManager is not installed) and whose
/// `busctl` fails its first `busctl_fails` calls (as before the daemon registered its objects),
/// given 5 tries (`FELHOM_LAB_NM_TRIES`), with `/run` and `/usr/sbin` tmpfs of the step's own
/// mount namespace ([`Init::Systemd`]; `/usr/sbin/NetworkManager` an empty executable when
/// installed): what it printed, the lab's NetworkManager file (empty: none), and the log of
/// `ip`, `systemctl` and `busctl`.
fn give_beside_network_manager(
    nm_state: Option<&str>,
    busctl_fails: u8,
) -> (String, String, String) {
    let links = format!("{LO}{FALLBACK_TUNNELS}");
    let systemctl = match nm_state {
        Some(state) => format!(
            "case \"$*\" in\n\
             'is-active NetworkManager.service') echo {state};;\n\
             'is-active '*) echo inactive;;\n\
             esac\nexit 0"
        ),
        None => "case \"$*\" in\n'is-active '*) echo inactive;;\nesac\nexit 0".to_string(),
    };
    let g = Guest::new(&links, &systemctl);
    write_exec(
        &g.dir.path().join("busctl"),
        &format!(
            "#!/bin/sh\necho \"busctl $*\" >>'{log}'\n\
             [ \"$(grep -c '^busctl ' '{log}')\" -gt {busctl_fails} ]\n",
            log = g.dir.path().join("log").display()
        ),
    );
    let file = "/run/NetworkManager/conf.d/90-felhom-lab.conf";
    let install = if nm_state.is_some() {
        ": >/usr/sbin/NetworkManager && chmod 755 /usr/sbin/NetworkManager || exit 1\n"
    } else {
        ""
    };
    // The step ends with `exit`: a subshell, so that the file can be read after it in the same
    // mount namespace.
    let out = g.run(
        &format!(
            "mount -t tmpfs felhom-test /usr/sbin || exit 1\n\
             {install}({GUARD}{GIVE})\n\
             echo ---\ncat {file} 2>/dev/null\nexit 0\n"
        ),
        &["eth0", "eth1"],
        &[("FELHOM_LAB_NM_TRIES", "5")],
        Init::Systemd,
    );
    let (printed, written) = out.split_once("---\n").expect("the step ran");
    (printed.to_string(), written.to_string(), g.log())
}

#[test]
fn beside_network_manager_the_give_step_leaves_the_peers_unmanaged_before_it_makes_them() {
    let conf = "[device-felhom-lab]\nmatch-device=interface-name:felab*\nmanaged=0\n";
    let reload = "busctl call org.freedesktop.NetworkManager /org/freedesktop/NetworkManager \
                  org.freedesktop.NetworkManager Reload u 1";
    // A running NetworkManager: the file, then its reload (tried again while the daemon has
    // not registered its objects), then the pairs.
    let (printed, written, log) = give_beside_network_manager(Some("active"), 2);
    assert_eq!(
        printed,
        "given eth0 felab0\ngiven eth1 felab1\nnm-unmanaged reloaded\n"
    );
    assert_eq!(written, conf);
    assert_eq!(log.matches(reload).count(), 3, "{log}");
    let reloaded = log
        .rfind(reload)
        .unwrap_or_else(|| panic!("no reload: {log}"));
    let made = log.find("ip link add eth0").expect("eth0 made");
    assert!(reloaded < made, "{log}");
    // One not started yet reads the file when it starts: no reload.
    let (printed, written, log) = give_beside_network_manager(Some("inactive"), 0);
    assert!(printed.ends_with("nm-unmanaged\n"), "{printed}");
    assert_eq!(written, conf);
    assert!(!log.contains("busctl"), "{log}");
    // A reload refused at every try is said; the pairs are made after the last.
    let (printed, _, log) = give_beside_network_manager(Some("active"), 9);
    assert!(printed.ends_with("nm-unreloaded\n"), "{printed}");
    assert_eq!(log.matches(reload).count(), 5, "{log}");
    assert!(log.rfind(reload) < log.find("ip link add eth0"), "{log}");
    // Without NetworkManager nothing is written.
    let (printed, written, log) = give_beside_network_manager(None, 0);
    assert_eq!(printed, "given eth0 felab0\ngiven eth1 felab1\n");
    assert_eq!(written, "");
    assert!(!log.contains("busctl"), "{log}");
    // What the report says of each.
    let text = lab_report(&printed_lines("nm-unmanaged"), &[], true, &[]).join("; ");
    assert!(
        text.contains("the veth peers (felabN) left unmanaged by NetworkManager"),
        "{text}"
    );
    assert!(!text.contains("reloaded by the running daemon"), "{text}");
    let text = lab_report(&printed_lines("nm-unmanaged reloaded"), &[], true, &[]).join("; ");
    assert!(
        text.contains("90-felhom-lab.conf, reloaded by the running daemon)"),
        "{text}"
    );
    let text = lab_report(&printed_lines("nm-unreloaded"), &[], true, &[]).join("; ");
    assert!(
        text.contains("NetworkManager refused to reload its configuration"),
        "{text}"
    );
}

fn printed_lines(word: &str) -> String {
    format!("given eth0 felab0\n{word}\n")
}

/// The give step where ifupdown's `networking.service` answers `activating` to its first
/// `activating_answers` questions and then `then` (a count kept in the guest's log), given 5
/// steps (`FELHOM_LAB_ACTIVATING_TRIES`): what it printed and the log.
fn give_while_networking_activating(activating_answers: u8, then: &str) -> (String, String) {
    let links = format!("{LO}{FALLBACK_TUNNELS}");
    let g = Guest::new(
        &links,
        &format!(
            "case \"$*\" in\n\
             'is-active networking.service')\n\
             if [ \"$(grep -c '^systemctl is-active networking.service' \"$log\")\" -gt \
             {activating_answers} ]; then echo {then}; else echo activating; fi;;\n\
             'is-active '*) echo inactive;;\n\
             esac\nexit 0"
        ),
    );
    let out = g.run(
        &format!("{GUARD}{GIVE}"),
        &["eth0"],
        &[("FELHOM_LAB_ACTIVATING_TRIES", "5")],
        Init::Systemd,
    );
    (out, g.log())
}

#[test]
fn an_ifupdown_networking_service_still_activating_is_watched_and_restarted_once_it_failed() {
    // `ifup -a` ran before the device was there and fails a moment after the pair is made.
    let (out, log) = give_while_networking_activating(2, "failed");
    assert_eq!(out, "given eth0 felab0\nearly-restart networking.service\n");
    assert_eq!(
        log.matches("systemctl is-active networking.service")
            .count(),
        3,
        "{log}"
    );
    assert!(
        log.contains("systemctl restart --no-block networking.service"),
        "{log}"
    );
    // Still activating after the watch: an `ifup` that found the devices, left alone.
    let (out, log) = give_while_networking_activating(9, "failed");
    assert_eq!(out, "given eth0 felab0\n");
    assert_eq!(
        log.matches("systemctl is-active networking.service")
            .count(),
        6,
        "{log}"
    );
    assert!(!log.contains("restart"), "{log}");
    // Activating, then active: it ran with the devices.
    let (out, log) = give_while_networking_activating(1, "active");
    assert_eq!(out, "given eth0 felab0\n");
    assert!(!log.contains("restart"), "{log}");
}

/// The boot trip's script with the late-restart watch as its tick (a copy given `eth0`, no
/// `ip6=dhcp`), its init taken for systemd: a guest whose systemd says `starting` for its first
/// `starting` asks, then `degraded`, and whose `networking.service` answers `net_state`.
fn late_restart_run(links: &str, net_state: &str, env: &[(&str, &str)]) -> (String, String) {
    let names = ["eth0".to_string()];
    let script = tick_script(&own_copy(&names));
    let g = Guest::new(
        links,
        &format!(
            "case \"$*\" in\n\
             is-system-running) if [ \"$(grep -c '^systemctl is-system-running' \"$log\")\" -gt 2 ]; \
             then echo degraded; else echo starting; fi;;\n\
             'is-active networking.service') echo {net_state};;\n\
             esac\nexit 0"
        ),
    );
    let out = g.run(&script, &["eth0"], env, Init::Host);
    let out = out
        .lines()
        .filter(|l| !l.starts_with("felhom-took "))
        .collect::<Vec<_>>()
        .join("\n");
    (out, g.log())
}

/// `networking.service` failed during the boot after the give step's watch ended (an `ifup`
/// that had begun before the devices, then waited on DHCP stanzas): restarted once from the
/// wait's tick, not at every tick; not without the lab's pair, not when the DHCPv6 watch
/// stopped a client, not when the unit is not failed.
#[test]
fn a_networking_service_failed_during_the_boot_is_restarted_once_from_the_wait() {
    let given = format!("{LO}{LAB_PAIR}");
    let (out, log) = late_restart_run(&given, "failed", &[]);
    assert_eq!(
        out, "felhom-step wait\nlate-restart networking.service\nsystemd degraded",
        "{log}"
    );
    assert_eq!(
        log.matches("systemctl restart --no-block networking.service")
            .count(),
        1,
        "{log}"
    );
    assert!(
        log.contains("systemctl reset-failed networking.service"),
        "{log}"
    );
    // What the report says of it.
    let names = ["eth0".to_string()];
    let lab = own_copy(&names);
    let trip = crate::guest::boot::BootTrip {
        first: Ok("systemd degraded".to_string()),
        before: Vec::new(),
        tick: vec!["late-restart networking.service".to_string()],
        after: None,
    };
    assert_eq!(
        read_trip(&lab, &trip).during,
        vec![LATE_RESTART_NOTE.to_string()]
    );
    for (links, state, env) in [
        (format!("{LO}{FALLBACK_TUNNELS}"), "failed", &[][..]),
        (given.clone(), "activating", &[][..]),
        (given.clone(), "active", &[][..]),
        (
            given.clone(),
            "failed",
            &[("FELHOM_LAB_DHCP6_STOPPED", " eth0")][..],
        ),
    ] {
        let (out, log) = late_restart_run(&links, state, env);
        assert_eq!(
            out, "felhom-step wait\nsystemd degraded",
            "{state} {env:?}: {log}"
        );
        assert!(!log.contains("restart"), "{state} {env:?}: {log}");
    }
}

#[test]
fn a_vm_copy_on_the_lab_bridge_settles_without_restarts_and_its_report_reads_only_known_words() {
    let macs = vec![
        "BC:24:11:00:03:00".to_string(),
        "BC:24:11:00:03:01".to_string(),
    ];
    let lab = VmLabRequest {
        macs: &macs,
        on_bridge: true,
        own_copy: false,
    };
    let plan = vm_boot_plan(&lab, 2, DHCP6_GIVE_UP);
    // Nothing before the wait: QEMU made the devices; after it, the VM step and the settle
    // step with the restarts turned off, the MACs as Linux prints them.
    assert!(plan.before.is_none() && plan.tick.is_none());
    let after = plan.after.as_deref().expect("after");
    assert!(
        after.starts_with(VM_NICS) && after.ends_with(SETTLE),
        "{after}"
    );
    assert!(plan.env.contains(&("FELHOM_LAB_VM", "1".to_string())));
    assert!(plan.env.contains(&(
        "FELHOM_LAB_MACS",
        "bc:24:11:00:03:00 bc:24:11:00:03:01".to_string()
    )));
    let trip = BootTrip {
        first: Ok("running".to_string()),
        before: Vec::new(),
        tick: Vec::new(),
        after: Some((
            [
                "nic bc:24:11:00:03:00 ens18",
                "nic 02:00:00:00:00:01 evil0",
                "dhcp ens18",
                "hotplug-dhcp-reset ifup@ens18.service ens18",
                "dhcp-reset networking.service",
                "restarted shop.service active",
                "unjudged shop.service",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            Ok("running".to_string()),
        )),
    };
    let text = read_vm_trip(&lab, &trip).settled.join("; ");
    assert!(
        text.contains("in the copy, ens18 is bc:24:11:00:03:00"),
        "{text}"
    );
    assert!(
        !text.contains("evil0"),
        "a MAC not stored is not named: {text}"
    );
    assert!(
        text.contains("ifup@ens18.service failed for the DHCP stanza of ens18")
            && text.contains("networking.service failed for the DHCP stanza of ens18"),
        "{text}"
    );
    // The words of the container lab's restarts and of a NIC-less copy are no words here
    // unless that step printed them; the reader names what it read.
    assert!(text.contains("restarted shop.service"), "{text}");
    assert!(text.contains("cannot be judged"), "{text}");

    // No lab bridge: the copy has no NIC; the after-step only names what it cannot judge.
    let nicless = VmLabRequest {
        macs: &macs,
        on_bridge: false,
        own_copy: true,
    };
    let plan = vm_boot_plan(&nicless, 2, DHCP6_GIVE_UP);
    assert_eq!(plan.after.as_deref(), Some(VM_NICLESS));
    assert!(plan.env.is_empty() && plan.tick.is_none());
    assert!(vm_boot_plan(&nicless, 0, DHCP6_GIVE_UP).after.is_none());
}

#[test]
fn the_vm_nicless_step_names_the_network_units_and_those_ordered_after_the_network() {
    // The script itself, with a systemctl stand-in: failed units and their After=.
    let dir = tempfile::tempdir().expect("tmp");
    let bin = dir.path();
    std::fs::write(
        bin.join("systemctl"),
        "#!/bin/sh\ncase \"$1\" in\n\
         list-units) printf '%s\\n' 'networking.service loaded failed failed x' \
         'shop.service loaded failed failed x' 'cron.service loaded failed failed x' \
         'ifup@ens18.service loaded failed failed x';;\n\
         show) case \"$5\" in shop.service) echo 'basic.target network-online.target';; \
         *) echo 'basic.target';; esac;;\nesac\n",
    )
    .expect("write");
    std::fs::set_permissions(
        bin.join("systemctl"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    let out = Command::new("/bin/sh")
        .arg("-c")
        .arg(VM_NICLESS)
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .output()
        .expect("sh");
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        [
            "unjudged networking.service",
            "unjudged shop.service",
            "unjudged ifup@ens18.service"
        ],
        "{text}"
    );
}

/// A guest whose `networking.service` is failed after its restart, with `ifquery` answering
/// `--list` from `stanzas` (`None`: it fails, as with no ifupdown) and `--state <name>` with
/// success for the names in `up` only (its calls logged). The settle step runs in it as a VM
/// copy's (`vm`: nothing restarted, so every `reset-failed` in the log is the DHCP rule's) or a
/// container copy's holding the lab's pair, with `eth0` stored with DHCP and `names` given.
fn dhcp_rule_run(stanzas: Option<&str>, up: &[&str], names: &[&str], vm: bool) -> (String, String) {
    let links = format!("{LO}{LAB_PAIR}");
    let systemctl = "case \"$1 $2\" in\n\
                     'list-units --state=failed') echo 'networking.service loaded failed failed x';;\n\
                     'is-active networking.service') echo failed;;\n\
                     'is-active '*) echo inactive;;\n\
                     esac\nexit 0";
    let g = Guest::new(&links, systemctl);
    let list = match stanzas {
        Some(s) => format!("printf '%s' '{s}'; exit 0"),
        None => "echo 'ifquery: couldn'\\''t read interfaces file' >&2; exit 1".to_string(),
    };
    write_exec(
        &g.dir.path().join("ifquery"),
        &format!(
            "#!/bin/sh\necho \"ifquery $*\" >>'{log}'\ncase \"$1\" in\n\
             --list) {list};;\n\
             --state) case \" {up} \" in *\" $2 \"*) echo \"$2=$2\"; exit 0;; esac; exit 1;;\n\
             esac\nexit 1\n",
            log = g.dir.path().join("log").display(),
            up = up.join(" "),
        ),
    );
    let mut env = vec![("FELHOM_LAB_DHCP", "eth0")];
    if vm {
        env.push(("FELHOM_LAB_VM", "1"));
    }
    let out = g.run(
        &format!("lab_strict=0\n{GUARD}{SETTLE}"),
        names,
        &env,
        Init::Host,
    );
    (out, g.log())
}

#[test]
fn the_dhcp_reset_names_an_auto_stanza_that_failed_on_its_own_and_keeps_networking_failed() {
    // A DHCP eth0 (no lease can come) and a VLAN stanza of the guest's own that failed: the
    // unit stays failed, the stanza named.
    let stanzas = "lo\neth0\neth0.5\n";
    for vm in [true, false] {
        let (out, log) = dhcp_rule_run(Some(stanzas), &["lo"], &["eth0"], vm);
        assert!(out.contains("stanza-failed eth0.5\n"), "vm {vm}: {out}");
        assert!(!out.contains("dhcp-reset"), "vm {vm}: {out}");
        assert!(!out.contains("stanza-failed eth0\n"), "vm {vm}: {out}");
        assert!(log.contains("ifquery --list"), "vm {vm}: {log}");
        if vm {
            assert!(!log.contains("reset-failed"), "{log}");
        }
    }
    // The control: every auto stanza that is not up is the DHCP one: reset, as before.
    for vm in [true, false] {
        let (out, log) = dhcp_rule_run(Some("lo\neth0\n"), &["lo"], &["eth0"], vm);
        assert!(
            out.contains("dhcp-reset networking.service\n") && !out.contains("stanza-failed"),
            "vm {vm}: {out}"
        );
        assert!(
            log.contains("systemctl reset-failed networking.service"),
            "{log}"
        );
    }
    // A VLAN stanza that came up changes nothing.
    let (out, _) = dhcp_rule_run(Some(stanzas), &["lo", "eth0.5"], &["eth0"], true);
    assert!(out.contains("dhcp-reset networking.service\n"), "{out}");
    // A given interface that is not DHCP and not up is named as before, each name once, and
    // every failed one is named (not only the first).
    let (out, _) = dhcp_rule_run(
        Some("lo\neth0\neth1\nbond0\n"),
        &["lo"],
        &["eth0", "eth1"],
        true,
    );
    assert_eq!(
        printed(&out, &["dhcp-kept", "stanza-failed", "dhcp-reset"]),
        ["dhcp-kept eth1", "stanza-failed bond0"],
        "{out}"
    );
    // No stanza list (no ifupdown's ifquery, a file it refuses): nothing can be put down to
    // DHCP; the unit stays failed, named.
    let (out, log) = dhcp_rule_run(None, &["lo"], &["eth0"], true);
    assert!(
        out.contains("stanzas-unread networking.service\n") && !out.contains("dhcp-reset"),
        "{out}"
    );
    assert!(!log.contains("reset-failed"), "{log}");
}

/// The lines of `out` that start with one of `words`.
fn printed<'a>(out: &'a str, words: &[&str]) -> Vec<&'a str> {
    out.lines()
        .filter(|l| words.iter().any(|w| l.starts_with(&format!("{w} "))))
        .collect()
}

#[test]
fn the_stanza_list_is_guest_output_only_plain_names_are_asked_and_at_most_64() {
    let mut hostile = String::from("*\n$(touch /tmp/x)\n-a\neth0 eth9\nfelhom;reboot\n");
    hostile.push_str(&format!("{}\n", "x".repeat(40)));
    for i in 0..100 {
        hostile.push_str(&format!("v{i}\n"));
    }
    let (out, log) = dhcp_rule_run(Some(&hostile), &["lo"], &["eth0"], true);
    let asked: Vec<&str> = log
        .lines()
        .filter_map(|l| l.strip_prefix("ifquery --state "))
        .collect();
    assert!(!asked.is_empty(), "{log}");
    // The first 64 plain names of the list (eth0, given with DHCP, is not asked); `-a` would
    // be an option of ifquery (`--all`), the others are no names.
    assert_eq!(asked.len(), 64, "{asked:?}");
    assert_eq!((asked[0], asked[63]), ("v0", "v63"), "{asked:?}");
    assert!(
        asked.iter().all(|n| !n.starts_with('-')
            && n.len() <= 32
            && n.chars()
                .all(|c| c.is_ascii_alphanumeric() || "_.:@-".contains(c))),
        "{asked:?}"
    );
    assert!(
        out.contains("stanza-failed v0\n") && !out.contains("dhcp-reset"),
        "{out}"
    );
}

#[test]
fn the_report_and_the_kept_unit_name_the_stanzas_that_failed_on_their_own() {
    let names = vec!["eth0".to_string()];
    let lab = LabRequest {
        names: &names,
        dhcp: &names,
        dhcp6: &[],
        reset_node_failures: true,
        joined: false,
        hosts: None,
    };
    let trip = |after: &[&str]| BootTrip {
        first: Ok("running".to_string()),
        before: Vec::new(),
        tick: Vec::new(),
        after: Some((
            after.iter().map(|s| s.to_string()).collect(),
            Ok("running".to_string()),
        )),
    };
    let done = read_trip(
        &lab,
        &trip(&[
            "stanza-failed eth0.5",
            "stanza-failed bond0",
            "stanza-failed evil\u{1b}[31m",
            "stanza-failed",
            "dhcp-reset",
        ]),
    );
    let text = done.settled.join("; ");
    assert!(
        text.contains("networking.service left failed: the stanza of eth0.5, bond0, evil")
            && text.contains("they are no DHCP interface of the backup")
            && text.contains("`ifup eth0.5`"),
        "{text}"
    );
    assert!(!text.contains('\u{1b}'), "guest text is escaped: {text}");
    assert_eq!(done.kept.len(), 1, "{:?}", done.kept);
    let (unit, why) = &done.kept[0];
    assert_eq!(unit, "networking.service");
    assert!(
        why.starts_with("the stanza of eth0.5, bond0, evil")
            && why.contains("/etc/network/interfaces"),
        "{why}"
    );
    // A given interface not up, and a list that could not be read, are kept and said too.
    let done = read_trip(
        &lab,
        &trip(&["dhcp-kept eth1", "stanzas-unread networking.service"]),
    );
    let (_, why) = &done.kept[0];
    assert!(
        why.contains("eth1 (given to the copy, not DHCP) did not come up")
            && why.contains("`ifquery --list` failed"),
        "{why}"
    );
    // The DHCP reset alone keeps nothing.
    let done = read_trip(&lab, &trip(&["dhcp-reset networking.service"]));
    assert!(done.kept.is_empty(), "{:?}", done.kept);
    assert!(
        done.settled
            .join("; ")
            .contains("networking.service failed for the DHCP stanza of eth0"),
        "{:?}",
        done.settled
    );
    // A VM copy's after-step says the same.
    let macs = vec!["bc:24:11:00:03:00".to_string()];
    let vm = VmLabRequest {
        macs: &macs,
        on_bridge: true,
        own_copy: true,
    };
    let done = read_vm_trip(&vm, &trip(&["dhcp ens18", "stanza-failed ens18.7"]));
    assert!(
        done.kept
            .first()
            .is_some_and(|(u, w)| u == "networking.service" && w.contains("ens18.7")),
        "{:?}",
        done.kept
    );
}

/// A `networking.service` still `activating` when the settle step begins (restarted without
/// waiting, its `ifup -a` at a DHCP client) is waited for, the boot wait's tick run once a
/// second meanwhile (after the boot nothing else would stop a `dhclient -6`), and judged once
/// it ended: here it fails, and the VLAN stanza that failed on its own is named. Judged at
/// once, it was neither failed nor up and nothing was named.
#[test]
fn the_settle_step_waits_for_an_activating_networking_service_running_the_tick() {
    let links = format!("{LO}{LAB_PAIR}");
    let g = Guest::new(&links, "exit 0");
    let count = g.dir.path().join("count");
    // `is-active networking.service`: activating for its first 8 answers, then failed.
    write_exec(
        &g.dir.path().join("systemctl"),
        &format!(
            "#!/bin/sh\necho \"systemctl $*\" >>'{log}'\ncase \"$1 $2\" in\n\
             'list-units --state=failed') echo 'networking.service loaded failed failed x';;\n\
             'is-active networking.service') c=$(cat '{count}' 2>/dev/null || echo 0); c=$((c+1)); echo $c >'{count}';\n\
               if [ $c -le 8 ]; then echo activating; else echo failed; fi;;\n\
             'is-active '*) echo inactive;;\n\
             esac\nexit 0\n",
            log = g.dir.path().join("log").display(),
            count = count.display(),
        ),
    );
    write_exec(
        &g.dir.path().join("ifquery"),
        &format!(
            "#!/bin/sh\necho \"ifquery $*\" >>'{log}'\ncase \"$1\" in\n\
             --list) printf 'lo\\neth0\\neth0.5\\n'; exit 0;;\n\
             --state) [ \"$2\" = lo ] && {{ echo lo=lo; exit 0; }}; exit 1;;\n\
             esac\nexit 1\n",
            log = g.dir.path().join("log").display(),
        ),
    );
    let tick = format!(
        "felhom_lab_tick() {{\necho tick >>'{}'\n}}\n",
        g.dir.path().join("log").display()
    );
    let out = g.run(
        &format!("lab_strict=0\n{tick}{GUARD}{SETTLE}"),
        &["eth0"],
        &[("FELHOM_LAB_DHCP", "eth0"), ("FELHOM_LAB_VM", "1")],
        Init::Host,
    );
    let log = g.log();
    assert!(out.contains("stanza-failed eth0.5\n"), "{out}\n{log}");
    assert!(!out.contains("dhcp-reset"), "{out}");
    assert!(
        log.matches("tick\n").count() >= 2,
        "the tick did not run while it waited: {log}"
    );
}

/// In an agent's own VM copy on the lab bridge the boot wait's tick finds the names of the
/// guest's own `inet6 dhcp` stanzas on the stored NICs and runs the DHCPv6 watch for them (also
/// as the settle step's `felhom_lab_tick`); a customer's guest, or a copy without the lab
/// bridge, has no tick. What the report says of a stopped client is read from the tick's and
/// the settle step's lines, a plain name and a number only.
#[test]
fn a_vm_copy_on_the_lab_bridge_watches_the_dhcpv6_client_of_its_own_stanzas() {
    let macs = vec!["BC:24:11:00:03:00".to_string()];
    let own = VmLabRequest {
        macs: &macs,
        on_bridge: true,
        own_copy: true,
    };
    let plan = vm_boot_plan(&own, 1, std::time::Duration::from_secs(7));
    let tick = plan.tick.as_deref().expect("a tick");
    assert!(
        tick.starts_with(VM_DHCP6_NAMES) && tick.contains(DHCP6_WATCH),
        "{tick}"
    );
    assert!(plan
        .env
        .contains(&("FELHOM_LAB_DHCP6_GIVE_UP", "7".to_string())));
    // The names are the guest's: none is given by the agent.
    assert!(!plan.env.iter().any(|(k, _)| *k == "FELHOM_LAB_DHCP6"));
    let after = plan.after.as_deref().expect("after");
    assert!(
        after.starts_with("felhom_lab_tick() {") && after.contains(tick) && after.ends_with(SETTLE),
        "{after}"
    );
    for other in [
        VmLabRequest {
            own_copy: false,
            ..own.clone()
        },
        VmLabRequest {
            macs: &[],
            ..own.clone()
        },
    ] {
        let plan = vm_boot_plan(&other, 1, DHCP6_GIVE_UP);
        assert!(plan.tick.is_none(), "{other:?}");
        assert!(!plan
            .after
            .unwrap_or_default()
            .contains("felhom_lab_tick() {"));
    }

    let line = |l: &str| l.to_string();
    let trip = BootTrip {
        first: Ok("degraded".to_string()),
        before: Vec::new(),
        tick: vec![
            line("dhcp6-stopped ens18 61"),
            line("dhcp6-stopped ens18 62"),
            line("dhcp6-stopped ens19 notanumber"),
            line("dhcp6-stopped $(reboot) 5"),
        ],
        after: Some((
            vec![line("dhcp6-stopped ens19 60"), line("dhcp ens18")],
            Ok("running".to_string()),
        )),
    };
    let during = read_vm_trip(&own, &trip).during;
    assert_eq!(
        during,
        [
            "the DHCPv6 client of ens18 (its `iface ens18 inet6 dhcp` stanza) waited 61s for a \
             lease that cannot come on the lab bridge, holding networking.service and the boot: \
             stopped",
            "the DHCPv6 client of ens19 (its `iface ens19 inet6 dhcp` stanza) waited 60s for a \
             lease that cannot come on the lab bridge, holding networking.service and the boot: \
             stopped"
        ],
        "{during:?}"
    );
}

/// The real `ip`, for setting up a network namespace (the stand-ins' folder is not on its
/// PATH).
fn real_ip() -> String {
    ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
        .iter()
        .find(|p| Path::new(p).exists())
        .expect("iproute2's ip")
        .to_string()
}

/// `PATH` with `dir` ahead of this process's own.
fn path_before(dir: &Path) -> String {
    format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// `script` in a real `/bin/sh` (`args` after it: `$0`, `$1`…) under `unshare` with
/// `namespaces` (its options), `env` set and the stand-ins of `bin` first on PATH: what it
/// printed, or `None` where user namespaces are refused. Any other failure fails the test.
fn unshared_shell(
    namespaces: &[&str],
    script: &str,
    args: &[&str],
    bin: &Path,
    env: &[(&str, String)],
) -> Option<String> {
    let out = Command::new("unshare")
        .args(namespaces)
        .args(["/bin/sh", "-c", script])
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env("PATH", path_before(bin))
        .output()
        .expect("unshare runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("unshare failed") {
        eprintln!("user namespaces refused here: {stderr}");
        return None;
    }
    assert!(out.status.success(), "{stderr}");
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The boot trip of an own VM copy on the lab bridge whose stored NIC is
/// `bc:24:11:00:03:00`, in a real shell inside its own user, PID, mount and network
/// namespaces: a veth `felvm6` with that MAC (and `felvm7` with a MAC not stored), the guest's
/// `/etc/network` (an overlay over this machine's `/etc`) holding `interfaces` and
/// `interfaces.d/50-cloud-init` (`stanza`), and a process named `dhclient` (a copy of
/// `/bin/sh` sleeping under the command line ifupdown gives `dhclient -6 … <name>`) for
/// `client_for`. systemd says `starting` while that client is alive, `degraded` once it is not;
/// the wait's bound is 4 s. Its output, or `None` where user namespaces are refused.
fn vm_dhcp6_boot(own_copy: bool, stanza: &str, client_for: &str) -> Option<String> {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    for sub in ["up", "work", "bin"] {
        std::fs::create_dir(d.join(sub)).expect("mkdir");
    }
    std::fs::copy("/bin/sh", d.join("dhclient")).expect("copy of /bin/sh");
    write_exec(
        &d.join("bin/systemctl"),
        &format!(
            "#!/bin/sh\ncase \"$1\" in is-system-running) pid=$(cat '{pid}'); \
             if [ -e /proc/$pid/status ] && ! grep -q '^State:[[:space:]]*[ZX]' /proc/$pid/status; \
             then echo starting; else echo degraded; fi;; esac\nexit 0\n",
            pid = d.join("pid").display()
        ),
    );
    let macs = vec!["bc:24:11:00:03:00".to_string()];
    let lab = VmLabRequest {
        macs: &macs,
        on_bridge: true,
        own_copy,
    };
    let plan = crate::guest::boot::BootPlan {
        after: None,
        ..vm_boot_plan(&lab, 1, std::time::Duration::from_secs(1))
    };
    let script = crate::guest::boot::script(&plan, 4)
        .replace("felhom_init() {\n", "felhom_init() {\n  return 0\n");
    let ip = real_ip();
    let setup = format!(
        "set -e\nmount -t sysfs sysfs /sys\n\
         mount -t overlay overlay -o lowerdir=/etc,upperdir={d}/up,workdir={d}/work /etc\n\
         mkdir -p /etc/network/interfaces.d\n\
         printf 'auto lo\\niface lo inet loopback\\n' >/etc/network/interfaces\n\
         printf '%s' '{stanza}' >/etc/network/interfaces.d/50-cloud-init\n\
         {ip} link add felvm6 type veth peer name felvm6p\n\
         {ip} link set felvm6 address bc:24:11:00:03:00\n\
         {ip} link add felvm7 type veth peer name felvm7p\n\
         {ip} link set felvm7 address bc:24:11:00:03:07\n\
         '{d}/dhclient' -c 'sleep 30; :' -6 -v -pf /run/dhclient6.{c}.pid {c} </dev/null >/dev/null 2>&1 &\n\
         echo $! >'{d}/pid'\nset +e\n",
        d = d.display(),
        c = client_for,
    );
    unshared_shell(
        &[
            "--user",
            "--map-root-user",
            "--pid",
            "--fork",
            "--mount-proc",
            "--mount",
            "--net",
        ],
        &format!("{setup}{script}"),
        &[],
        &d.join("bin"),
        &plan.env,
    )
}

/// The tick in a real shell: the `dhclient -6` of a stored NIC's `inet6 dhcp` stanza
/// (`interfaces.d`, as cloud-init writes it) is stopped after the give-up time and the boot
/// ends; a client of a link whose MAC is not stored, of a stored NIC whose stanza is `inet
/// dhcp` only, or in a customer's copy is left alone (the wait runs out).
#[test]
fn the_vm_tick_stops_the_dhcpv6_client_of_a_stored_nics_inet6_dhcp_stanza_only() {
    let lines = |out: &str| -> Vec<String> {
        out.lines()
            .filter(|l| !l.starts_with("felhom-took "))
            .map(str::to_string)
            .collect()
    };
    let Some(out) = vm_dhcp6_boot(true, "auto felvm6\niface felvm6 inet6 dhcp\n", "felvm6") else {
        return;
    };
    let got = lines(&out);
    assert_eq!(got.len(), 3, "{out}");
    assert_eq!(got[0], "felhom-step wait", "{out}");
    assert!(got[1].starts_with("dhcp6-stopped felvm6 "), "{out}");
    assert_eq!(got[2], "systemd degraded", "{out}");
    for (own, stanza, client) in [
        (true, "auto felvm7\niface felvm7 inet6 dhcp\n", "felvm7"),
        (true, "auto felvm6\niface felvm6 inet dhcp\n", "felvm6"),
        (false, "auto felvm6\niface felvm6 inet6 dhcp\n", "felvm6"),
    ] {
        let out = vm_dhcp6_boot(own, stanza, client).expect("namespaces worked above");
        assert!(!out.contains("dhcp6-stopped"), "{own} {stanza:?}: {out}");
        assert!(out.contains("felhom-timeout"), "{own} {stanza:?}: {out}");
    }
}

/// The settle step's wait-online rule in a real shell in its own user, mount and network
/// namespaces: `eth0` a veth (peer `felab0`), networkd's state file for it
/// (`/run/systemd/netif/links/<its ifindex>`, `/run` a tmpfs of the step's own) holding
/// `state`, `systemd-networkd-wait-online.service` failed after its restart. What it printed
/// of the rule: `online-reset …` or `online-kept eth0`. `None` where user namespaces are
/// refused.
fn wait_online_rule(state: &str) -> Option<String> {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    std::fs::create_dir(d.join("bin")).expect("mkdir");
    std::fs::write(d.join("state"), state).expect("state");
    write_exec(
        &d.join("bin/systemctl"),
        "#!/bin/sh\ncase \"$1 $2\" in\n\
         'is-active systemd-networkd-wait-online.service') echo failed;;\n\
         'is-active '*) echo inactive;;\n\
         esac\nexit 0\n",
    );
    let ip = real_ip();
    let setup = format!(
        "set -e\nmount -t tmpfs felhom-test /run\nmount -t sysfs sysfs /sys\n\
         {ip} link add eth0 type veth peer name felab0\n\
         mkdir -p /run/systemd/netif/links\n\
         cp '{state}' /run/systemd/netif/links/$(cat /sys/class/net/eth0/ifindex)\nset +e\n",
        state = d.join("state").display(),
    );
    let out = unshared_shell(
        &["--user", "--map-root-user", "--mount", "--net"],
        &format!("{setup}{SETTLE}"),
        &["sh", "eth0"],
        &d.join("bin"),
        &[("FELHOM_LAB_VM", "1".to_string())],
    )?;
    Some(
        out.lines()
            .filter(|l| l.starts_with("online-"))
            .collect::<Vec<_>>()
            .join("\n"),
    )
}

/// networkd's link state file as `link_save()` writes it, up to the lines the rule reads (the
/// rest, DNS and the like, follows): v245 to v248 (`src/network/networkd-link.c`, from v248
/// `networkd-state-file.c`) write no `ONLINE_STATE=`; v248 adds `ACTIVATION_POLICY=`; v249
/// writes `ONLINE_STATE=` (only for a link with `RequiredForOnline=yes`), the address states by
/// family and `REQUIRED_FAMILY_FOR_ONLINE=`. Read in systemd/systemd-stable v245.7, v247.3,
/// v248.3 and v249.4 (`tests/data/guest-units-facts.md` section 2).
fn networkd_links_file(version: u32, oper: &str, required: &str, range: &str) -> String {
    let mut f = format!(
        "# This is private data. Do not parse.\nADMIN_STATE=configuring\nOPER_STATE={oper}\n\
         CARRIER_STATE=carrier\nADDRESS_STATE={}\n",
        if oper == "routable" {
            "routable"
        } else {
            "off"
        }
    );
    if version >= 249 {
        f.push_str("IPV4_ADDRESS_STATE=routable\nIPV6_ADDRESS_STATE=off\n");
        if required == "yes" {
            f.push_str("ONLINE_STATE=online\n");
        }
    }
    f.push_str(&format!(
        "REQUIRED_FOR_ONLINE={required}\nREQUIRED_OPER_STATE_FOR_ONLINE={range}\n"
    ));
    if version >= 249 {
        f.push_str("REQUIRED_FAMILY_FOR_ONLINE=any\n");
    }
    if version >= 248 {
        f.push_str("ACTIVATION_POLICY=up\n");
    }
    f.push_str("NETWORK_FILE=/etc/systemd/network/eth0.network\nDNS=\nNTP=\nSIP=\nDOMAINS=\n");
    f
}

/// networkd before v249 (Ubuntu 20.04's 245, Debian 11's 247, 248) writes no `ONLINE_STATE=`:
/// the rule reckons online from what it writes, as v249 does, so a copy whose given link is
/// routable has wait-online's failure reset, and one that is not, or not required for online,
/// or outside its required range, keeps it failed, named. A v249 file's own `ONLINE_STATE=`
/// is what counts there.
#[test]
fn the_wait_online_rule_reads_online_from_what_networkd_before_v249_writes() {
    let reset = "online-reset systemd-networkd-wait-online.service";
    let kept = "online-kept eth0";
    let Some(out) = wait_online_rule(&networkd_links_file(247, "routable", "yes", "degraded"))
    else {
        return;
    };
    assert_eq!(out, reset);
    for (version, oper, required, range, want) in [
        (245, "routable", "yes", "degraded", reset),
        (248, "routable", "yes", "degraded", reset),
        (247, "degraded", "yes", "degraded", reset),
        (247, "carrier", "yes", "degraded", kept),
        (247, "no-carrier", "yes", "degraded", kept),
        (247, "routable", "no", "degraded", kept),
        (247, "degraded", "yes", "routable", kept),
        (247, "routable", "yes", "degraded:degraded", kept),
        (247, "carrier", "yes", "carrier:routable", reset),
        (247, "routable", "yes", "", reset),
        (247, "routable", "yes", "bogus", kept),
        (249, "routable", "yes", "degraded", reset),
        (252, "routable", "no", "degraded", kept),
    ] {
        let file = networkd_links_file(version, oper, required, range);
        let out = wait_online_rule(&file).expect("namespaces worked above");
        assert_eq!(out, want, "{version} {oper} {required} {range:?}:\n{file}");
    }
    // v249 and later: its own word, even where the older reckoning would say online (an
    // address family it requires is missing).
    let file = networkd_links_file(249, "routable", "yes", "degraded")
        .replace("ONLINE_STATE=online", "ONLINE_STATE=offline");
    assert_eq!(wait_online_rule(&file).as_deref(), Some(kept));
    // An unmanaged link is left aside.
    let file = networkd_links_file(247, "carrier", "yes", "degraded")
        .replace("ADMIN_STATE=configuring", "ADMIN_STATE=unmanaged");
    assert_eq!(wait_online_rule(&file).as_deref(), Some(reset));
}

/// [`HOSTS`] run on a file of this machine standing in for the copy's `/etc/hosts` (and its
/// `.pve-ignore.hosts` beside it): what it printed, and the file afterwards.
fn run_hosts(text: &str, ignored: bool, ip: &str, name: &str) -> (String, String) {
    let dir = std::env::temp_dir().join(format!(
        "felhom-lab-hosts-{}-{}",
        std::process::id(),
        ulid::Ulid::new()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("hosts");
    std::fs::write(&file, text).expect("hosts");
    if ignored {
        std::fs::write(dir.join(".pve-ignore.hosts"), "").expect("ignore");
    }
    let script = HOSTS
        .replace(
            "/etc/.pve-ignore.hosts",
            &dir.join(".pve-ignore.hosts").to_string_lossy(),
        )
        .replace("/etc/hosts", &file.to_string_lossy());
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .env("FELHOM_LAB_HOSTS_IP", ip)
        .env("FELHOM_LAB_HOSTS_NAME", name)
        .output()
        .expect("sh");
    let after = std::fs::read_to_string(&file).expect("hosts after");
    let _ = std::fs::remove_dir_all(&dir);
    (
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        after,
    )
}

/// What pve-container's `update_etc_hosts` writes for a copy without `net0`, hostname
/// `db.example.com`, after the guest's own lines (`ct_modify_file` appends the section; `::1`
/// added as the guest's lines have none): `tests/data/groups-facts.md`.
const PVE_HOSTS_NO_NET0: &str = "127.0.0.1\tlocalhost\n127.0.1.1\ttestbed\n# --- BEGIN PVE ---\n::1 localhost.localnet localhost\n127.0.1.1 db.example.com db\n# --- END PVE ---\n";

/// The line PVE writes for the copy without `net0` gets the stored `net0` address, names as
/// PVE wrote them; nothing else of the file changes (the guest's own `127.0.1.1` line outside
/// PVE's section stays). Run again (a resumed wait), it finds the line written.
#[test]
fn the_hosts_step_gives_pves_line_the_stored_address_and_nothing_else() {
    let (said, after) = run_hosts(PVE_HOSTS_NO_NET0, false, "10.20.0.30", "db");
    assert_eq!(said, "hosts-written");
    assert_eq!(
        after,
        PVE_HOSTS_NO_NET0.replace(
            "127.0.1.1 db.example.com db",
            "10.20.0.30 db.example.com db"
        )
    );
    let (said, again) = run_hosts(&after, false, "10.20.0.30", "db");
    assert_eq!(said, "hosts-present");
    assert_eq!(again, after);
    // IPv6: net0 with ip=dhcp and a static ip6.
    let (said, after) = run_hosts(PVE_HOSTS_NO_NET0, false, "fd00::30", "db");
    assert_eq!(said, "hosts-written");
    assert!(after.contains("\nfd00::30 db.example.com db\n"), "{after}");
}

/// Only PVE's first section counts (`ct_modify_file`'s), its END matched in any case; a line
/// of another name, a file without PVE's section, and a file PVE is told to leave alone are
/// left as they are.
#[test]
fn the_hosts_step_touches_only_pves_first_section_and_its_own_line() {
    let lower = PVE_HOSTS_NO_NET0.replace("# --- END PVE ---", "# --- end pve ---")
        + "# --- BEGIN PVE ---\n127.0.1.1 db\n# --- END PVE ---\n";
    let (said, after) = run_hosts(&lower, false, "10.20.0.30", "db");
    assert_eq!(said, "hosts-written");
    assert!(
        after.contains("\n10.20.0.30 db.example.com db\n"),
        "{after}"
    );
    assert!(
        after.ends_with("# --- BEGIN PVE ---\n127.0.1.1 db\n# --- END PVE ---\n"),
        "{after}"
    );
    for (text, ignored, word) in [
        (PVE_HOSTS_NO_NET0, false, "hosts-unmatched"),
        (
            "127.0.0.1 localhost\n127.0.1.1 db\n",
            false,
            "hosts-nosection",
        ),
        (PVE_HOSTS_NO_NET0, true, "hosts-ignored"),
    ] {
        let name = if word == "hosts-unmatched" {
            "shop"
        } else {
            "db"
        };
        let (said, after) = run_hosts(text, ignored, "10.20.0.30", name);
        assert_eq!(said, word);
        assert_eq!(after, text);
    }
}

/// Only a joined member with an entry gets the step and its variables; the report says the
/// agent's own address and name for the step's word, and nothing for a word it does not know.
#[test]
fn the_hosts_step_runs_for_a_joined_member_and_its_word_is_reported_in_the_agents_terms() {
    let names = ["eth0".to_string()];
    let entry = crate::guest::group_net::HostsEntry {
        ip: "10.20.0.30".parse().expect("ip"),
        name: "db".to_string(),
    };
    let lab = LabRequest {
        joined: true,
        hosts: Some(&entry),
        ..own_copy(&names)
    };
    let plan = boot_plan(&lab, DHCP6_GIVE_UP);
    let before = plan.before.clone().unwrap_or_default();
    assert!(before.contains(HOSTS), "{before}");
    assert!(before.find(HOSTS) < before.find(GIVE));
    assert!(plan
        .env
        .contains(&("FELHOM_LAB_HOSTS_IP", "10.20.0.30".to_string())));
    assert!(plan
        .env
        .contains(&("FELHOM_LAB_HOSTS_NAME", "db".to_string())));
    let alone = boot_plan(
        &LabRequest {
            hosts: Some(&entry),
            ..own_copy(&names)
        },
        DHCP6_GIVE_UP,
    );
    assert!(!alone.before.unwrap_or_default().contains(HOSTS));
    assert!(!alone
        .env
        .iter()
        .any(|(k, _)| k.starts_with("FELHOM_LAB_HOSTS")));
    let trip = |lines: &[&str]| BootTrip {
        first: Ok("running".to_string()),
        before: lines.iter().map(|s| s.to_string()).collect(),
        tick: Vec::new(),
        after: None,
    };
    let done = read_trip(&lab, &trip(&["joined eth0", "hosts-written"]));
    assert!(
        done.given.iter().any(|g| g
            .starts_with("/etc/hosts: db given its stored address 10.20.0.30 in PVE's section")),
        "{:?}",
        done.given
    );
    let done = read_trip(&lab, &trip(&["joined eth0", "hosts-written 1.2.3.4 evil"]));
    assert!(
        !done.given.iter().any(|g| g.contains("/etc/hosts")),
        "{:?}",
        done.given
    );
}
