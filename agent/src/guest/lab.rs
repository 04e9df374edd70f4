//! The lab: what an isolated copy of a container is given so it boots as its production guest
//! boots without reaching anything, and which of its failures are the isolation's or the node's
//! doing rather than its backup's.
//!
//! An isolated copy starts with no NIC (the restore test's copies, a throwaway
//! `--selftest=provision` guest, a hub provision told to isolate). Two steps, both in the boot wait's one exec
//! ([`boot_plan`]):
//!
//! 1. [`GIVE`], as soon as the copy answers (after the launch proof, before the boot
//!    wait): the guard, then each interface the backup stores as a veth pair whose other end
//!    stays inside the copy (it reaches nothing; no bridge gains a port). The copy's own network
//!    units then find the devices they wait for, as in production. A network unit that already
//!    failed for the missing device is restarted without waiting, so a boot held on
//!    `network-online.target` goes on.
//! 2. [`SETTLE`], once the boot has ended: in the agent's own throwaway copies only, the failed
//!    units that are the node's doing are reset and named (a filesystem a user namespace cannot
//!    mount; journald's audit socket on a systemd that cannot tell it is refused); then the
//!    failed units the missing interface can explain are restarted (the network's own, and those
//!    ordered after a network target), and what fails only for a DHCP lease or a router
//!    advertisement that cannot come is reset. Any other failed unit stays failed and is named:
//!    it failed for a reason of its own, and a restart that happens to succeed must not hide it.
//!
//! What both steps print is hostile (the guest runs them): only a closed set of line words is
//! read, every name escaped and clipped. Sources: `tests/data/guest-units-facts.md`.

use std::time::Duration;

use super::boot::{BootPlan, BootTrip};

/// The guard, shared by both steps: the copy's network namespace may hold, besides `lo` and
/// what the lab gave it (a stored name whose veth peer is `felabN`, and the `felabN` ends),
/// only links that reach nothing:
/// - the fallback devices of the node's tunnel modules, made in every new network namespace
///   (`sit0`, `tunl0`, `gre0`, `gretap0`, `erspan0`, `ip6tnl0`, `ip6gre0`, `ip_vti0`, …:
///   Linux `net_has_fallback_tunnels`, `net.core.fb_tunnels_only_for_init_net` 0 by default),
///   known by their kind in `ip -d` (the ethernet-typed ones, `gretap` and `erspan`, too);
/// - any other link that is not an ethernet device and has no peer outside.
///
/// A link whose peer is in another namespace (`link-netns`/`link-netnsid` in `ip -d -o link`:
/// iproute2 prints it from `IFLA_LINK_NETNSID`) or an ethernet device the lab did not make (a
/// NIC, a bridge, the guest's own veth) stops the lab: "foreign <name> outside|ether". An `ip`
/// without `-d` (busybox's) gives no kinds: every ethernet device but the lab's own stops it
/// then. A listing without `lo` (no `ip`, or one that cannot read links) stops it too:
/// "unreadable". After the boot (`lab_strict=0`), only a peer outside stops it: the guest's own
/// boot may have made bridges (`docker0`), which reach nothing, and a device that reaches the
/// wire without a peer (a physical NIC moved in at the start) was there, and stopped the lab,
/// before the boot.
const GUARD: &str = r#"
links=$(ip -d -o link show 2>/dev/null)
case "$links" in *" lo: "*) ;; *) links=$(ip -o link show 2>/dev/null);; esac
case "$links" in *" lo: "*) ;; *) echo unreadable; exit 0;; esac
verdict=$(printf '%s\n' "$links" | awk -v names=" $* " -v joined=" ${FELHOM_LAB_JOINED:-} " -v strict="${lab_strict:-1}" '
{
  name = $2; sub(/:$/, "", name); peer = ""
  at = index(name, "@")
  if (at) { peer = substr(name, at + 1); name = substr(name, 1, at - 1) }
  n = split($0, seg, /\\/)
  type = ""; kind = ""
  if (n >= 2) { split(seg[2], w, " "); type = w[1] }
  if (n >= 3) { split(seg[3], w, " "); kind = w[1] }
  if ($0 ~ / link-netns/) {
    if (index(joined, " " name " ")) next
    print "foreign " name " outside"; exit
  }
  if (name == "lo") next
  lab = (kind == "veth" || kind == "")
  if (lab && name ~ /^felab[0-9]+$/) next
  if (lab && index(names, " " name " ") && peer ~ /^felab[0-9]+$/) next
  if (kind ~ /^(ipip|sit|ip6tnl|gre|gretap|erspan|ip6gre|ip6gretap|ip6erspan|vti|vti6)$/) next
  if (strict && type == "link/ether") { print "foreign " name " ether"; exit }
}')
[ -z "$verdict" ] || { echo "$verdict"; exit 0; }
"#;

/// Step 1's work after the guard, in a guest whose init is systemd (as the boot wait knows it:
/// `/run/systemd/system`, or PID 1's own binary before systemd made that folder; otherwise
/// "no-systemd" and nothing is done, as the boot wait then has no boot to wait for): each stored name, unless the copy has it (then the guard
/// saw it as the lab's own), becomes a veth pair `<name>`/`felabN` with both ends in the copy,
/// the peer set up. Then a network unit of the copy's that already failed (it ran before the
/// device was there) is restarted without waiting (`--no-block`): the boot goes on toward its
/// stored network. ifupdown2's `networking.service` never fails (`start-networking` ends
/// `exit 0` whatever `ifup -a` did), so in an ifupdown2 guest (`/usr/share/ifupdown2`) it is
/// restarted when it already ran or runs: it may have run before the device was there.
/// ifupdown's `networking.service` still `activating` may be an `ifup -a` that already failed on
/// the missing devices (it fails on one within a second) and ends failed a moment later: it is
/// watched for up to 10 s (`FELHOM_LAB_ACTIVATING_TRIES` steps of 0.2 s, 50 unless the tests
/// set it), and restarted when it failed by then; still `activating` after that, it is an
/// `ifup` that found the devices (waiting for a lease) and is left alone.
///
/// In a guest with NetworkManager (`/usr/sbin/NetworkManager`: this early in the boot
/// `systemctl` may not reach systemd yet), the `felabN` ends are made unmanaged by it
/// before they exist: in production they are on the node, and NetworkManager, which manages
/// every device it finds that no `iface` stanza (Debian's `[ifupdown] managed=false`) or
/// setting leaves out, would run DHCP on each through a default wired profile, so its startup
/// never completes and `NetworkManager-wait-online.service` fails
/// (`tests/data/guest-units-facts.md` §2). The lab's own config file,
/// `/run/NetworkManager/conf.d/90-felhom-lab.conf` (`[device-felhom-lab]`,
/// `match-device=interface-name:felab*`, `managed=0`; volatile, read before `/etc`'s files),
/// is read when NetworkManager starts; one that runs already (or is starting: waited for until
/// it is on the bus) is told to reload its configuration (D-Bus `Reload`, flag 1: the
/// configuration files only) before the pairs are made, as NetworkManager reads `managed` when
/// a device appears. The unit is `active` once the daemon holds its bus name, a moment before
/// it registers its objects ("No such interface" until then, measured on Debian 11), so the
/// reload is tried again every 0.2 s; the wait and the tries together last at most 30 s
/// (`FELHOM_LAB_NM_TRIES` steps of 0.2 s, 150 unless the tests set it). "nm-unmanaged" ("nm-unmanaged reloaded" after a reload), or
/// "nm-unreloaded" when the reload was refused.
const GIVE: &str = r#"
i=0; given=0; nm=
command -v systemctl >/dev/null 2>&1 && { [ -d /run/systemd/system ] ||
  case "$(readlink /proc/1/exe 2>/dev/null) $(cat /proc/1/comm 2>/dev/null)" in
    */systemd\ *|*\ systemd) true;; *) false;; esac; } || { echo no-systemd; exit 0; }
if { [ -x /usr/sbin/NetworkManager ] || [ -x /sbin/NetworkManager ]; } &&
  mkdir -p /run/NetworkManager/conf.d 2>/dev/null &&
  printf '[device-felhom-lab]\nmatch-device=interface-name:felab*\nmanaged=0\n' \
    >/run/NetworkManager/conf.d/90-felhom-lab.conf 2>/dev/null; then
  nm=nm-unmanaged; w=0; tries=${FELHOM_LAB_NM_TRIES:-150}
  st=$(systemctl is-active NetworkManager.service 2>/dev/null)
  while [ "$st" = activating ] && [ "$w" -lt "$tries" ]; do
    sleep 0.2; w=$((w+1)); st=$(systemctl is-active NetworkManager.service 2>/dev/null)
  done
  if [ "$st" = active ]; then
    nm=nm-unreloaded
    while [ "$w" -lt "$tries" ]; do
      if busctl call org.freedesktop.NetworkManager /org/freedesktop/NetworkManager \
        org.freedesktop.NetworkManager Reload u 1 >/dev/null 2>&1; then
        nm="nm-unmanaged reloaded"; break
      fi
      sleep 0.2; w=$((w+1))
    done
  fi
fi
for n in "$@"; do
  if ip link show dev "$n" >/dev/null 2>&1; then
    case " ${FELHOM_LAB_JOINED:-} " in
      *" $n "*) echo "joined $n"; given=1;;
      *) echo "present $n";;
    esac
  elif ip link add "$n" type veth peer name "felab$i" 2>/dev/null && ip link set "felab$i" up; then
    echo "given $n felab$i"; given=1
  else echo "refused $n"; fi
  i=$((i+1))
done
[ "$given" = 1 ] && [ -n "$nm" ] && echo "$nm"
if [ "$given" = 1 ] && command -v systemctl >/dev/null 2>&1; then
  for u in networking.service systemd-networkd.service; do
    st=$(systemctl is-active "$u" 2>/dev/null); n=0
    while [ "$u" = networking.service ] && [ "$st" = activating ] && [ ! -d /usr/share/ifupdown2 ] &&
      [ "$n" -lt "${FELHOM_LAB_ACTIVATING_TRIES:-50}" ]; do
      sleep 0.2; n=$((n+1)); st=$(systemctl is-active "$u" 2>/dev/null)
    done
    if [ "$st" = failed ] || { [ "$u" = networking.service ] && [ -d /usr/share/ifupdown2 ] &&
      { [ "$st" = active ] || [ "$st" = activating ]; }; }; then
      systemctl reset-failed "$u" 2>/dev/null
      systemctl restart --no-block "$u" >/dev/null 2>&1 && echo "early-restart $u"
    fi
  done
fi
exit 0
"#;

/// Step 1's first work in a member of an application group whose stored `net0` has a static
/// address (before [`GIVE`], so before any network unit is restarted): PVE's section of
/// `/etc/hosts` given the line PVE writes for that `net0`. pve-container's pre-start hook writes
/// `/etc/hosts` at every start (`Setup/Base.pm` `pre_start_hook` → `set_hostname` →
/// `update_etc_hosts`, inside `# --- BEGIN PVE ---` … `# --- END PVE ---`: `ct_modify_file`),
/// the address from `net0` only (`PVE::LXC::get_primary_ips`), and `127.0.1.1` when there is none;
/// a copy has no `net0`, so its hostname resolves to loopback and a service bound to it listens
/// there, out of the other members' reach. The line PVE wrote for the copy, `127.0.1.1 <names>`
/// ending with the stored hostname's first label (`FELHOM_LAB_HOSTS_NAME`), gets the stored
/// address (`FELHOM_LAB_HOSTS_IP`) instead, its names as PVE wrote them (the search domains are
/// the node's, as in production); the first section only, as `ct_modify_file` finds it (its
/// `BEGIN` case-sensitive, its `END` not). Nothing else of the file changes; a file PVE is told
/// to leave alone (`/etc/.pve-ignore.hosts`: `ct_is_file_ignored`) is left alone. Prints one of
/// "hosts-written", "hosts-present" (the line is there already: a resumed wait),
/// "hosts-ignored", "hosts-nosection", "hosts-unmatched", "hosts-unread", "hosts-unwritten".
/// Both values are the agent's own (an address it printed, a checked DNS label), quoted.
const HOSTS: &str = r#"
if [ -n "${FELHOM_LAB_HOSTS_IP:-}" ] && [ -n "${FELHOM_LAB_HOSTS_NAME:-}" ]; then
  hosts_file=/etc/hosts
  if [ -e /etc/.pve-ignore.hosts ]; then echo hosts-ignored
  elif hosts_new=$(awk -v ip="$FELHOM_LAB_HOSTS_IP" -v name="$FELHOM_LAB_HOSTS_NAME" '
    !seen && !inside && /^#[ \t]*---[ \t]*BEGIN[ \t]*PVE/ { inside = 1; print; next }
    inside && toupper($0) ~ /^#[ \t]*---[ \t]*END[ \t]*PVE/ { inside = 0; seen = 1; print; next }
    inside && !done && $1 == "127.0.1.1" && $NF == name {
      print ip substr($0, index($0, "127.0.1.1") + 9); done = 1; next }
    inside && $1 == ip && $NF == name { present = 1 }
    { print }
    END { if (!seen) exit 3; if (done) exit 0; if (present) exit 4; exit 5 }' "$hosts_file" 2>/dev/null); then
    if printf '%s\n' "$hosts_new" >"$hosts_file" 2>/dev/null; then echo hosts-written
    else echo hosts-unwritten; fi
  else
    case $? in 3) echo hosts-nosection;; 4) echo hosts-present;; 5) echo hosts-unmatched;;
      *) echo hosts-unread;; esac
  fi
fi
"#;

/// Step 2, after the guard (when the guard stops it, nothing is reset or restarted).
///
/// 1. With `FELHOM_LAB_USERNS` (the agent's own copies) and a user namespace that is not the
///    initial one (`/proc/self/uid_map` is not the single line `0 0 4294967295`): a failed mount
///    unit whose `Type=` is one of the filesystems named in the variable (none of them can be
///    mounted in a user namespace) is reset, "userns-reset <unit> <type>"; a failed
///    `systemd-journald-audit.socket` under a systemd without the audit check (before 254, and
///    its backports in 251.17, 252.11 and 253.5: [`audit_socket_unchecked`]'s range; it then
///    takes the audit netlink socket for usable in a user namespace, and its bind is refused)
///    likewise, "userns-reset systemd-journald-audit.socket audit <major>.<minor>".
/// 2. When the copy holds a `felabN` end (the lab gave it an interface), or is a VM copy whose
///    NICs are on the lab bridge (`FELHOM_LAB_VM`, after [`VM_NICS`]: then nothing is
///    restarted, its devices were there from QEMU's start, and only the DHCP and wait-online
///    resets below apply): first a `networking.service` still `activating` (restarted without
///    waiting by the give step or the boot wait, its `ifup -a` waiting for a lease) is waited
///    for, up to 120 s (`FELHOM_LAB_SETTLE_TRIES` steps of 0.2 s, 600 unless the tests set
///    it), the boot wait's tick ([`DHCP6_WATCH`], [`NET_WATCH`]) run once a second meanwhile as
///    `felhom_lab_tick` (after the boot the wait runs it no more, and a `dhclient -6` it did
///    not stop holds that `ifup -a` for ever): judged before its end, it is neither failed nor
///    up, and a stanza of its that fails afterwards would never be seen. Then the failed units
///    the
///    missing interface can explain are restarted, each answered with its state afterwards:
///    first the network's own (`networking.service`, `systemd-networkd.service`,
///    `systemd-networkd-wait-online.service`), then every unit ordered after `network.target`,
///    `network-online.target` or `network-pre.target`; any other failed unit is named, "kept".
///    Then, with `FELHOM_LAB_DHCP`, `networking.service` still failed and every interface
///    its `ifup -a` brings up that is not up (`ifquery --state`) one the lab explains by name (a
///    stored DHCP one: no lease can come in a copy that reaches nothing), its failed state is
///    reset. The interfaces are the given names and every `auto` stanza (`ifquery --list`:
///    those `ifup -a` brings up, `interfaces.d` and `source` included; guest output: the first
///    64 plain names of at most 32 characters, none starting with `-`), each once. One that is not up and not a
///    stored DHCP one keeps the unit failed and is named: "dhcp-kept <name>" for a given
///    interface, "stanza-failed <name>" for a stanza of the guest's own (a VLAN, bond or
///    bridge that failed on its own, as it would in production); a stanza list that cannot be
///    read (no `ifquery`, a file it refuses) keeps it failed too, "stanzas-unread
///    networking.service". `allow-hotplug` stanzas are left aside: Debian's
///    `networking.service` brings them up only in its second, failure-ignoring `ExecStart=-`
///    (`tests/data/guest-units-facts.md` §2). Likewise `systemd-networkd-wait-online.service`, still failed after
///    its restart, when every given interface networkd manages (DHCP ones left aside) is online
///    by networkd's own reckoning (`ONLINE_STATE=online` in `/run/systemd/netif/links/<ifindex>`;
///    networkd before v249 writes no `ONLINE_STATE=`, and there the same reckoning is made from
///    what it writes: `REQUIRED_FOR_ONLINE=yes` and `OPER_STATE` within
///    `REQUIRED_OPER_STATE_FOR_ONLINE`, `<min>[:<max>]`, `routable` the maximum when none is
///    written, in networkd's order of operational states)
///    and only its setup state is short of `configured`: networkd then waits for a router
///    advertisement or a lease (`tests/data/guest-units-facts.md` §2).
const SETTLE: &str = r#"
if [ -n "${FELHOM_LAB_USERNS:-}" ]; then
  map=$(awk '{$1=$1; print}' /proc/self/uid_map 2>/dev/null)
  if [ -n "$map" ] && [ "$map" != "0 0 4294967295" ]; then
    for u in $(systemctl list-units --state=failed --no-legend --plain --no-pager 2>/dev/null | awk '{print $1}'); do
      case $u in
        *.mount)
          t=$(systemctl show -p Type --value "$u" 2>/dev/null)
          case " $FELHOM_LAB_USERNS " in
            *" $t "*) [ -n "$t" ] && systemctl reset-failed "$u" && echo "userns-reset $u $t";;
          esac;;
        systemd-journald-audit.socket)
          v=$(systemctl --version 2>/dev/null | awk 'NR == 1 {
            full = $3; gsub(/[()]/, "", full); split(full, p, /[^0-9]+/)
            min = (p[2] ~ /^[0-9]+$/) ? p[2] : 0
            if ($1 == "systemd" && $2 ~ /^[0-9]+$/ && ($2 < 251 || ($2 == 251 && min < 17) ||
              ($2 == 252 && min < 11) || ($2 == 253 && min < 5))) print $2 "." min }')
          [ -n "$v" ] && systemctl reset-failed "$u" && echo "userns-reset $u audit $v";;
      esac
    done
  fi
fi
if [ -n "${FELHOM_LAB_VM:-}" ] || [ -n "${FELHOM_LAB_JOINED:-}" ] ||
  ip -o link show 2>/dev/null | awk '$2 ~ /^felab[0-9]+[@:]/ {f = 1} END {exit !f}'; then
  # A networking.service the give step or the boot wait restarted without waiting may still
  # be at its `ifup -a` (a DHCP stanza waits for its lease): judged only once it ended, else
  # it is neither failed nor up and nothing below would look at it.
  # The boot wait's tick goes on meanwhile (once a second): after the boot it runs no more,
  # and a `dhclient -6` it would stop after its 60 s holds that `ifup -a` for ever.
  felhom_w=0
  while [ "$(systemctl is-active networking.service 2>/dev/null)" = activating ] &&
    [ "$felhom_w" -lt "${FELHOM_LAB_SETTLE_TRIES:-600}" ]; do
    if [ $((felhom_w % 5)) -eq 0 ] && command -v felhom_lab_tick >/dev/null 2>&1; then
      felhom_lab_tick
    fi
    sleep 0.2; felhom_w=$((felhom_w+1))
  done
  if [ -z "${FELHOM_LAB_VM:-}" ]; then
  failed=" $(systemctl list-units --state=failed --no-legend --plain --no-pager 2>/dev/null | awk '{printf "%s ", $1}')"
  net=
  for u in networking.service systemd-networkd.service systemd-networkd-wait-online.service; do
    case $failed in *" $u "*) ;; *) continue;; esac
    if [ "$u" = networking.service ] && [ -n "${FELHOM_LAB_DHCP6_STOPPED:-}" ]; then
      echo "dhcp6-kept $u"; continue
    fi
    net="$net $u"
  done
  after=
  for u in $failed; do
    case " $net networking.service " in *" $u "*) continue;; esac
    case " $(systemctl show -p After --value "$u" 2>/dev/null) " in
      *" network.target "*|*" network-online.target "*|*" network-pre.target "*) after="$after $u";;
      *) echo "kept $u";;
    esac
  done
  for u in $net $after; do
    systemctl reset-failed "$u" 2>/dev/null
    timeout 120 systemctl restart "$u" >/dev/null 2>&1
    echo "restarted $u $(systemctl is-active "$u" 2>/dev/null)"
  done
  fi
  if [ -n "${FELHOM_LAB_DHCP:-}" ] && [ "$(systemctl is-active networking.service 2>/dev/null)" = failed ]; then
    up=1
    if stanzas=$(ifquery --list 2>/dev/null); then
      stanzas=$(printf '%s\n' "$stanzas" | awk 'n < 64 && length($0) <= 32 && $0 ~ /^[A-Za-z0-9_][A-Za-z0-9_.:@-]*$/ {print; n++}')
    else
      echo "stanzas-unread networking.service"; up=0; stanzas=
    fi
    seen=" "
    for n in "$@" $stanzas; do
      case $seen in *" $n "*) continue;; esac
      seen="$seen$n "
      case " $FELHOM_LAB_DHCP " in *" $n "*) continue;; esac
      ifquery --state "$n" >/dev/null 2>&1 && continue
      up=0
      case " $* " in *" $n "*) echo "dhcp-kept $n";; *) echo "stanza-failed $n";; esac
    done
    [ "$up" = 1 ] && systemctl reset-failed networking.service && echo "dhcp-reset networking.service"
  fi
  if [ "$(systemctl is-active systemd-networkd-wait-online.service 2>/dev/null)" = failed ]; then
    up=1
    for n in "$@"; do
      case " ${FELHOM_LAB_DHCP:-} " in *" $n "*) continue;; esac
      f=/run/systemd/netif/links/$(cat "/sys/class/net/$n/ifindex" 2>/dev/null)
      grep -qx ADMIN_STATE=unmanaged "$f" 2>/dev/null && continue
      awk -F= '$1 == "ONLINE_STATE" {online = $2; seen = 1}
        $1 == "REQUIRED_FOR_ONLINE" {req = $2}
        $1 == "OPER_STATE" {oper = $2}
        $1 == "REQUIRED_OPER_STATE_FOR_ONLINE" {range = $2}
        END {
          if (seen) exit online != "online"
          split("missing off no-carrier dormant degraded-carrier carrier degraded enslaved routable", w, " ")
          for (i = 1; i <= 9; i++) rank[w[i]] = i
          lo = "degraded"; hi = "routable"
          if (range != "") { n = split(range, r, ":"); lo = r[1]; if (n > 1) hi = r[2] }
          exit !(req == "yes" && (oper in rank) && (lo in rank) && (hi in rank) &&
            rank[oper] >= rank[lo] && rank[oper] <= rank[hi])
        }' "$f" 2>/dev/null || { echo "online-kept $n"; up=0; break; }
    done
    [ "$up" = 1 ] && systemctl reset-failed systemd-networkd-wait-online.service && echo "online-reset systemd-networkd-wait-online.service"
  fi
fi
exit 0
"#;

/// A VM copy whose NICs are on the lab bridge, once its boot has ended, before [`SETTLE`]
/// (`FELHOM_LAB_VM` set): the copy has each stored NIC from QEMU's start, with its stored MAC
/// (`FELHOM_LAB_MACS`, lower case), so nothing is given or restarted; what the isolation can
/// still make fail is a DHCP stanza (the lab bridge has no DHCP server) and a wait for a lease
/// or a router advertisement. Each stored MAC is found among the guest's links
/// ("nic <mac> <name>"); an ifupdown guest's own stanzas (`/etc/network/interfaces` and
/// `interfaces.d`) say which of them use DHCP (`inet dhcp`, `inet6 dhcp` or `inet6 auto`:
/// "dhcp <name>", into `FELHOM_LAB_DHCP` for [`SETTLE`]); a name ifupdown has no stanza for
/// (`ifquery <name>` fails) is left out of [`SETTLE`]'s "every other interface up". An
/// `allow-hotplug` DHCP stanza is brought up by `ifup@<name>.service` (Debian's ifupdown,
/// started by udev), which fails when no lease comes: its failed state is reset,
/// "hotplug-dhcp-reset <unit> <name>". Then the names found become [`SETTLE`]'s arguments.
const VM_NICS: &str = r#"
names=
for m in ${FELHOM_LAB_MACS:-}; do
  for d in /sys/class/net/*; do
    [ "$(cat "$d/address" 2>/dev/null)" = "$m" ] || continue
    n=${d##*/}; echo "nic $m $n"; names="$names $n"
  done
done
dhcp=; known=
for n in $names; do
  if cat /etc/network/interfaces /etc/network/interfaces.d/* 2>/dev/null |
    grep -Eq "^[[:space:]]*iface[[:space:]]+$n[[:space:]]+inet6?[[:space:]]+(dhcp|auto)([[:space:]]|\$)"; then
    dhcp="$dhcp $n"; echo "dhcp $n"
  fi
  if command -v ifquery >/dev/null 2>&1 && ! ifquery "$n" >/dev/null 2>&1; then continue; fi
  known="$known $n"
done
if [ -n "$dhcp" ]; then FELHOM_LAB_DHCP=$dhcp; export FELHOM_LAB_DHCP; fi
for n in $dhcp; do
  u="ifup@$n.service"
  [ "$(systemctl is-active "$u" 2>/dev/null)" = failed ] && systemctl reset-failed "$u" 2>/dev/null &&
    echo "hotplug-dhcp-reset $u $n"
done
set -- $known
"#;

/// The boot wait's tick in an agent's own VM copy on the lab bridge, before [`DHCP6_WATCH`]:
/// which names that watch looks for. A VM's `inet6 dhcp` stanzas are the guest's own
/// (`/etc/network/interfaces`, `interfaces.d`; cloud-init writes its own there before the
/// network starts), and ifupdown runs `dhclient -6` for them without `-1` as for a container's
/// `ip6=dhcp`: nothing answers on the lab bridge, so it solicits for ever and `ifup -a`
/// (`networking.service`, the boot) waits on it. So, at the first tick that finds a process
/// whose `comm` is `dhclient` (read by the shell itself: a tick starts no process until then;
/// by then the stanzas are written and the NICs named, as `ifup` started it), each link whose
/// MAC is a stored one (`FELHOM_LAB_MACS`, read from `/sys/class/net`) and that has an
/// `iface <name> inet6 dhcp` stanza becomes one of `FELHOM_LAB_DHCP6`, once for the whole trip;
/// a name that is not plain (guest output) is left out.
const VM_DHCP6_NAMES: &str = r#"
if [ -z "${felhom_v6_read:-}" ]; then
  for felhom_v6_p in /proc/[0-9]*; do
    { read -r felhom_v6_c <"$felhom_v6_p/comm"; } 2>/dev/null || continue
    [ "$felhom_v6_c" = dhclient ] || continue
    felhom_v6_read=1; FELHOM_LAB_DHCP6=
    for felhom_v6_m in ${FELHOM_LAB_MACS:-}; do
      for felhom_v6_d in /sys/class/net/*; do
        { read -r felhom_v6_a <"$felhom_v6_d/address"; } 2>/dev/null || continue
        [ "$felhom_v6_a" = "$felhom_v6_m" ] || continue
        felhom_v6_n=${felhom_v6_d##*/}
        case $felhom_v6_n in ''|-*|*[!A-Za-z0-9_.-]*) continue;; esac
        case " $FELHOM_LAB_DHCP6 " in *" $felhom_v6_n "*) continue;; esac
        cat /etc/network/interfaces /etc/network/interfaces.d/* 2>/dev/null |
          grep -Eq "^[[:space:]]*iface[[:space:]]+$felhom_v6_n[[:space:]]+inet6[[:space:]]+dhcp([[:space:]]|\$)" &&
          FELHOM_LAB_DHCP6="$FELHOM_LAB_DHCP6 $felhom_v6_n"
      done
    done
    break
  done
fi
"#;

/// A VM copy that started with no NIC (no lab bridge configured), once its boot has ended:
/// nothing can be given to it (a VM's NIC must exist when QEMU starts), so the failed units
/// the missing NICs can explain are only named, "unjudged <unit>": the network's own
/// (`networking.service`, `ifup@*`, `systemd-networkd-wait-online.service`,
/// `NetworkManager-wait-online.service`) and every unit ordered after `network.target`,
/// `network-online.target` or `network-pre.target`. They stay failed.
const VM_NICLESS: &str = r#"
for u in $(systemctl list-units --state=failed --no-legend --plain --no-pager 2>/dev/null | awk '{print $1}'); do
  case $u in
    networking.service|ifup@*|systemd-networkd-wait-online.service|NetworkManager-wait-online.service)
      echo "unjudged $u"; continue;;
  esac
  case " $(systemctl show -p After --value "$u" 2>/dev/null) " in
    *" network.target "*|*" network-online.target "*|*" network-pre.target "*) echo "unjudged $u";;
  esac
done
exit 0
"#;

/// The boot wait's tick in an agent's own copy whose backup stores `ip6=dhcp` (those interface
/// names in `FELHOM_LAB_DHCP6`). pve-container writes `iface <name> inet6 dhcp`
/// (`Setup/Debian.pm` `setup_network`), and ifupdown runs `dhclient -6` for it without `-1`
/// (`inet6.defn`): with no DHCPv6 server it solicits for ever and `ifup`, so
/// `networking.service` and the whole boot, waits for it until the unit's 5-minute start
/// timeout (`tests/data/guest-units-facts.md` §2). In production a server answers; in a copy
/// that reaches nothing none can. So, once a second while systemd is still starting, a
/// `dhclient -6` for a stored name (found by its command line: the program `dhclient`, ` -6 `
/// and the name as its last word; never the boot trip itself, whose program is `sh`; only a
/// process whose `comm` is `dhclient`, read by the shell itself, has its command line read, so a
/// tick starts no process per process of the guest) that has
/// run `FELHOM_LAB_DHCP6_GIVE_UP` seconds is stopped (TERM), "dhcp6-stopped <name> <secs>",
/// and its name added to `FELHOM_LAB_DHCP6_STOPPED` for the settle step: as IPv4's `dhclient`
/// gives up by itself after its 60 seconds.
const DHCP6_WATCH: &str = r#"
now=$(date +%s); i=0
for n in $FELHOM_LAB_DHCP6; do
  i=$((i+1)); pid=
  for p in /proc/[0-9]*; do
    { read -r comm <"$p/comm"; } 2>/dev/null || continue
    [ "$comm" = dhclient ] || continue
    c=$(tr '\0' ' ' <"$p/cmdline" 2>/dev/null)
    case ${c%% *} in dhclient|*/dhclient) ;; *) continue;; esac
    case " $c" in *" -6 "*" $n ") pid=${p#/proc/}; break;; esac
  done
  if [ -z "$pid" ]; then eval "seen_$i="; continue; fi
  eval "t=\${seen_$i:-}"
  if [ -z "$t" ]; then eval "seen_$i=$now"; continue; fi
  if [ $((now - t)) -ge "${FELHOM_LAB_DHCP6_GIVE_UP:-60}" ] && kill "$pid" 2>/dev/null; then
    echo "dhcp6-stopped $n $((now - t))"; eval "seen_$i="
    FELHOM_LAB_DHCP6_STOPPED="${FELHOM_LAB_DHCP6_STOPPED:-} $n"; export FELHOM_LAB_DHCP6_STOPPED
  fi
done
"#;

/// The boot wait's tick in every copy the lab gives interfaces to, after [`DHCP6_WATCH`] when
/// both run. ifupdown's `networking.service` can still be `activating` when the give step's
/// watch ends: an `ifup -a` that failed on a stored name before its device was given, then
/// found the next ones and waits for their DHCP leases (60 s per stanza with isc-dhcp's
/// default `timeout`, one after the other). It then ends failed, without the interfaces it
/// failed on, and a unit that waits for their addresses (a service bound to the stored address,
/// ordered after `network-online.target`) holds the boot until its own limit, before the settle
/// step can restart anything. So once a second while systemd is still starting, a
/// `networking.service` found `failed` while the copy holds a `felabN` end is restarted
/// without waiting, once in the trip ("late-restart networking.service"); not when the DHCPv6
/// watch stopped a client (its failure is that client's, and a restart would wait on it again),
/// and never a second time (a unit failing for a reason of its own is judged after the boot).
/// ifupdown2's unit never fails (see [`GIVE`]); networkd and NetworkManager take a device that
/// appears without a restart.
const NET_WATCH: &str = r#"
if [ -z "${felhom_late:-}" ] && [ -z "${FELHOM_LAB_DHCP6_STOPPED:-}" ] &&
  [ "$(systemctl is-active networking.service 2>/dev/null)" = failed ] &&
  ip -o link show 2>/dev/null | awk '$2 ~ /^felab[0-9]+[@:]/ {f = 1} END {exit !f}'; then
  felhom_late=1
  systemctl reset-failed networking.service 2>/dev/null
  systemctl restart --no-block networking.service >/dev/null 2>&1 && echo "late-restart networking.service"
fi
"#;

/// How long a copy's `dhclient -6` may wait for a lease before the lab stops it: the 60 s after
/// which IPv4's `dhclient` gives up by itself (isc-dhcp `clparse.c`: `timeout 60`).
pub const DHCP6_GIVE_UP: Duration = Duration::from_secs(60);

/// The variable naming the stored `ip6=dhcp` interfaces whose `dhclient -6` the boot wait
/// watches.
const LAB_DHCP6_VAR: &str = "FELHOM_LAB_DHCP6";
/// The variable holding the seconds the watch lets a `dhclient -6` wait.
const LAB_DHCP6_GIVE_UP_VAR: &str = "FELHOM_LAB_DHCP6_GIVE_UP";

/// The variable naming (space-separated) the interfaces the backup stores with DHCP.
const LAB_DHCP_VAR: &str = "FELHOM_LAB_DHCP";
/// The variable naming the stored interfaces root joined to the group's lab: the guard lets
/// their peer be outside the copy, and the give step counts them as given.
const LAB_JOINED_VAR: &str = "FELHOM_LAB_JOINED";
/// The variable naming the filesystems whose failed mount units are the user namespace's doing.
const LAB_USERNS_VAR: &str = "FELHOM_LAB_USERNS";
/// The variables holding the line [`HOSTS`] writes: the stored `net0` address, and the
/// hostname's first label.
const LAB_HOSTS_IP_VAR: &str = "FELHOM_LAB_HOSTS_IP";
const LAB_HOSTS_NAME_VAR: &str = "FELHOM_LAB_HOSTS_NAME";

/// The filesystems a user namespace that is not the initial one cannot mount: their
/// `file_system_type` has no `FS_USERNS_MOUNT` (Linux `fs/super.c` `mount_capable` then asks
/// for `CAP_SYS_ADMIN` in the initial user namespace), while an unprivileged container keeps
/// the capabilities systemd's units ask for (LXC's `userns.conf` clears `lxc.cap.drop`;
/// pve-container's `update_lxc_config` adds none back), so systemd tries the mount and it
/// fails. Each type with its kernel source: `tests/data/guest-units-facts.md` §1.
pub const USERNS_UNMOUNTABLE: &[&str] = &[
    // fs/debugfs/inode.c debug_fs_type: sys-kernel-debug.mount
    "debugfs",
    // fs/tracefs/inode.c trace_fs_type: sys-kernel-tracing.mount
    "tracefs",
    // fs/configfs/mount.c configfs_fs_type: sys-kernel-config.mount (a PVE node loads configfs)
    "configfs",
    // security/inode.c fs_type (securityfs)
    "securityfs",
    // fs/pstore/inode.c pstore_fs_type
    "pstore",
    // fs/fuse/control.c fuse_ctl_fs_type: sys-fs-fuse-connections.mount
    "fusectl",
    // fs/hugetlbfs/inode.c hugetlbfs_fs_type: dev-hugepages.mount
    "hugetlbfs",
    // fs/efivarfs/super.c efivarfs_type
    "efivarfs",
    // fs/autofs/init.c autofs_fs_type
    "autofs",
    // fs/nfsd/nfsctl.c nfsd_fs_type: proc-fs-nfsd.mount
    "nfsd",
    // net/sunrpc/rpc_pipe.c rpc_pipe_fs_type: run-rpc_pipefs.mount
    "rpc_pipefs",
    // kernel/bpf/inode.c: FS_USERNS_MOUNT since 6.9, but bpf_fill_super() still refuses a
    // user namespace other than the initial one
    "bpf",
];

/// Whether systemd `major`.`minor` lacks the audit check that skips
/// `systemd-journald-audit.socket` in a user namespace (systemd `src/basic/audit-util.c`
/// `use_audit`: an `AUDIT_GET_FEATURE` request answered `ECONNREFUSED` means no audit; commit
/// 362235bf59f8, first in v254, cherry-picked into the stable series as 589771d117 (v251.17),
/// 741808893f (v252.11) and 4be604e75a (v253.5); `tests/data/guest-units-facts.md` section 1a).
/// [`SETTLE`]'s awk holds the same range.
pub fn audit_socket_unchecked(major: u32, minor: u32) -> bool {
    match major {
        ..=250 => true,
        251 => minor < 17,
        252 => minor < 11,
        253 => minor < 5,
        _ => false,
    }
}

/// What the report says of a mount unit the user namespace made fail, its failed state reset.
pub fn userns_mount_note(unit: &str, fstype: &str) -> String {
    format!(
        "{unit} failed as in every unprivileged container ({fstype} cannot be mounted in a user \
         namespace); its failed state reset"
    )
}

/// Whether `name` can be an interface name the copy is given (IFNAMSIZ, no shell or path
/// meaning): it comes from the backup's stored config, which the guest's owner wrote.
pub fn valid_ifname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 15
        && !name.starts_with('-')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        && !name.starts_with("felab")
}

/// What the lab is asked to do in an isolated copy.
#[derive(Debug, Clone, Default)]
pub struct LabRequest<'a> {
    /// The stored interface names (the backup's `netN`).
    pub names: &'a [String],
    /// The names stored with DHCP (`ip=dhcp`, `ip6=dhcp`): no lease can come in the copy.
    pub dhcp: &'a [String],
    /// The names stored with `ip6=dhcp`: in the agent's own copies, the boot wait stops their
    /// `dhclient -6` ([`DHCP6_WATCH`]); `networking.service`, failed for them, is then not
    /// restarted (its restart would wait on them again).
    pub dhcp6: &'a [String],
    /// A copy of the agent's own (a restore test's or a selftest's, never a customer's guest):
    /// the failed units that are the node's doing in a user namespace are reset
    /// ([`USERNS_UNMOUNTABLE`], journald's audit socket).
    pub reset_node_failures: bool,
    /// The names were joined to an application group's lab by root before the boot wait
    /// ([`crate::guest::group_lab::join`]): each is there, its peer in the lab's namespace (which
    /// root checked from outside), and counts as given.
    pub joined: bool,
    /// A joined member's `/etc/hosts` line as PVE writes it for its stored `net0` ([`HOSTS`]).
    pub hosts: Option<&'a crate::guest::group_net::HostsEntry>,
}

impl LabRequest<'_> {
    fn plain_names(&self) -> (Vec<&String>, Vec<&String>) {
        self.names.iter().partition(|n| valid_ifname(n))
    }

    fn dhcp_names(&self) -> Vec<&str> {
        let ok = self.plain_names().0;
        self.dhcp
            .iter()
            .filter(|n| ok.contains(n))
            .map(String::as_str)
            .collect()
    }
}

/// The boot trip of an isolated copy ([`crate::guest::boot::boot_trip`]): the guard and
/// [`GIVE`] before the wait, [`DHCP6_WATCH`] as its tick in the agent's own copies with
/// `ip6=dhcp` interfaces (`give_up`: [`DHCP6_GIVE_UP`]), the guard and [`SETTLE`] after it.
pub fn boot_plan(lab: &LabRequest<'_>, give_up: Duration) -> BootPlan {
    let (ok, bad) = lab.plain_names();
    let mut plan = BootPlan {
        args: ok.iter().map(|n| n.to_string()).collect(),
        ..BootPlan::default()
    };
    if !ok.is_empty() || !bad.is_empty() {
        plan.before = Some(format!("{GUARD}{GIVE}"));
    }
    if lab.joined && !ok.is_empty() {
        plan.env.push((
            LAB_JOINED_VAR,
            ok.iter().map(|n| n.as_str()).collect::<Vec<_>>().join(" "),
        ));
        if let Some(h) = lab.hosts {
            plan.before = Some(format!("{GUARD}{HOSTS}{GIVE}"));
            plan.env.push((LAB_HOSTS_IP_VAR, h.ip.to_string()));
            plan.env.push((LAB_HOSTS_NAME_VAR, h.name.clone()));
        }
    }
    let dhcp6: Vec<&str> = lab
        .dhcp6
        .iter()
        .filter(|n| ok.contains(n))
        .map(String::as_str)
        .collect();
    let mut tick = String::new();
    if !dhcp6.is_empty() && lab.reset_node_failures {
        tick.push_str(DHCP6_WATCH);
        plan.env.push((LAB_DHCP6_VAR, dhcp6.join(" ")));
        plan.env
            .push((LAB_DHCP6_GIVE_UP_VAR, give_up.as_secs().max(1).to_string()));
    }
    if !ok.is_empty() {
        tick.push_str(NET_WATCH);
    }
    // The tick, also as a function the settle step calls while it waits for a
    // networking.service still activating (the boot wait runs the tick only during the boot).
    let tick_fn = if tick.is_empty() {
        String::new()
    } else {
        format!("felhom_lab_tick() {{\n{tick}:\n}}\n")
    };
    plan.tick = (!tick.is_empty()).then_some(tick);
    if !ok.is_empty() || lab.reset_node_failures {
        plan.after = Some(format!("lab_strict=0\n{tick_fn}{GUARD}{SETTLE}"));
        let dhcp = lab.dhcp_names();
        if !dhcp.is_empty() {
            plan.env.push((LAB_DHCP_VAR, dhcp.join(" ")));
        }
        if lab.reset_node_failures {
            plan.env
                .push((LAB_USERNS_VAR, USERNS_UNMOUNTABLE.join(" ")));
        }
    }
    plan
}

/// What the lab does in an isolated VM copy.
#[derive(Debug, Clone, Default)]
pub struct VmLabRequest<'a> {
    /// The stored NICs' MACs (well-formed: [`crate::pve::guest_config::valid_mac`]).
    pub macs: &'a [String],
    /// The NICs are on the lab bridge; `false`: the copy started with no NIC.
    pub on_bridge: bool,
    /// A copy of the agent's own (a restore test's or a selftest's, never a customer's guest):
    /// on the lab bridge, the boot wait stops the `dhclient -6` of its `inet6 dhcp` stanzas
    /// ([`VM_DHCP6_NAMES`], [`DHCP6_WATCH`]).
    pub own_copy: bool,
}

/// The variable naming the stored MACs of a VM copy on the lab bridge.
const LAB_MACS_VAR: &str = "FELHOM_LAB_MACS";
/// The variable that turns [`SETTLE`] to a VM copy's (nothing restarted).
const LAB_VM_VAR: &str = "FELHOM_LAB_VM";

/// The boot trip of an isolated VM copy: after the wait, [`VM_NICS`] and [`SETTLE`] when its
/// NICs are on the lab bridge, [`VM_NICLESS`] when it started with none though its backup
/// stores some; nothing before the wait (a VM's devices are QEMU's, from its start). In the
/// agent's own copy on the lab bridge, [`VM_DHCP6_NAMES`] and [`DHCP6_WATCH`] are the wait's
/// tick (`give_up`: [`DHCP6_GIVE_UP`]), also run by [`SETTLE`] while it waits for an
/// activating `networking.service`.
pub fn vm_boot_plan(lab: &VmLabRequest<'_>, stored_nics: usize, give_up: Duration) -> BootPlan {
    let mut plan = BootPlan::default();
    if lab.on_bridge {
        let macs: Vec<String> = lab
            .macs
            .iter()
            .filter(|m| crate::pve::guest_config::valid_mac(m))
            .map(|m| m.to_ascii_lowercase())
            .collect();
        let mut tick_fn = String::new();
        if lab.own_copy && !macs.is_empty() {
            let tick = format!(
                "{VM_DHCP6_NAMES}if [ -n \"${{FELHOM_LAB_DHCP6:-}}\" ]; then\n{DHCP6_WATCH}fi\n"
            );
            tick_fn = format!("felhom_lab_tick() {{\n{tick}:\n}}\n");
            plan.tick = Some(tick);
            plan.env
                .push((LAB_DHCP6_GIVE_UP_VAR, give_up.as_secs().max(1).to_string()));
        }
        plan.after = Some(format!("{tick_fn}{VM_NICS}{SETTLE}"));
        plan.env.push((LAB_VM_VAR, "1".to_string()));
        plan.env.push((LAB_MACS_VAR, macs.join(" ")));
    } else if stored_nics > 0 {
        plan.after = Some(VM_NICLESS.to_string());
    }
    plan
}

/// What the after-step of an isolated VM copy printed (hostile: only its closed set of line
/// words is read, every name escaped and clipped): which link each stored MAC is in the copy,
/// what was reset, and, in a copy with no NIC, the failed units that cannot be judged.
pub fn read_vm_trip(lab: &VmLabRequest<'_>, trip: &BootTrip) -> LabDone {
    let clip = crate::error::outside_text_max;
    let Some((lines, _)) = &trip.after else {
        return LabDone::default();
    };
    let text = lines.join("\n");
    let mut nics = Vec::new();
    let mut dhcp: Vec<String> = Vec::new();
    let mut notes = Vec::new();
    let mut unjudged = Vec::new();
    for line in text.lines().take(256) {
        let mut w = line.split_whitespace();
        match (w.next(), w.next(), w.next()) {
            (Some("nic"), Some(mac), Some(name))
                if lab.macs.iter().any(|m| m.eq_ignore_ascii_case(mac)) && nics.len() < 32 =>
            {
                nics.push(format!(
                    "{} is {}",
                    clip(name, 32),
                    mac.to_ascii_lowercase()
                ))
            }
            (Some("dhcp"), Some(name), _) if dhcp.len() < 32 => dhcp.push(clip(name, 32)),
            (Some("hotplug-dhcp-reset"), Some(u), Some(n)) => notes.push(format!(
                "{} failed for the DHCP stanza of {} (the lab bridge has no DHCP server): its \
                 failed state was reset",
                clip(u, 128),
                clip(n, 32)
            )),
            (Some("unjudged"), Some(u), _) if unjudged.len() < 32 => unjudged.push(clip(u, 128)),
            _ => {}
        }
    }
    let mut settled = Vec::new();
    if !nics.is_empty() {
        settled.push(format!("in the copy, {}", nics.join(", ")));
    }
    let dhcp_refs: Vec<&str> = dhcp.iter().map(String::as_str).collect();
    settled.extend(notes);
    settled.extend(lab_report(&text, &dhcp_refs, false, &[]));
    if !unjudged.is_empty() {
        settled.push(format!(
            "cannot be judged without the stored NICs (set [restore_test] lab_bridge to give a \
             VM copy its NICs on a bridge that reaches nothing): {} failed, as a unit that needs \
             its network does in a VM started with no NIC",
            unjudged.join(", ")
        ));
    }
    LabDone {
        during: vm_dhcp6_stopped(trip),
        settled,
        kept: network_kept(&text),
        ..LabDone::default()
    }
}

/// What the report says of each `dhcp6-stopped <name> <secs>` line of a VM copy's trip, during
/// the wait or from the settle step's own wait (hostile: a plain interface name and a number
/// only, each name once).
fn vm_dhcp6_stopped(trip: &BootTrip) -> Vec<String> {
    let after: &[String] = trip.after.as_ref().map_or(&[], |(l, _)| l.as_slice());
    let mut names: Vec<&str> = Vec::new();
    let mut notes = Vec::new();
    for line in trip.tick.iter().chain(after.iter()).take(512) {
        let mut w = line.split_whitespace();
        let (Some("dhcp6-stopped"), Some(n), Some(secs)) = (w.next(), w.next(), w.next()) else {
            continue;
        };
        let Ok(secs) = secs.parse::<u64>() else {
            continue;
        };
        if !valid_ifname(n) || names.contains(&n) || names.len() >= 32 {
            continue;
        }
        names.push(n);
        notes.push(format!(
            "the DHCPv6 client of {n} (its `iface {n} inet6 dhcp` stanza) waited {secs}s for a \
             lease that cannot come on the lab bridge, holding networking.service and the boot: \
             stopped"
        ));
    }
    notes
}

/// What the report says of [`NET_WATCH`]'s restart.
pub const LATE_RESTART_NOTE: &str = "networking.service failed during the boot, after its \
     devices were given (an ifup that had begun before them): restarted once";

/// What the lab did in one boot trip, for the report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabDone {
    /// Before the wait: what was given.
    pub given: Vec<String>,
    /// During the wait: the DHCPv6 clients stopped, and a late restart of the network.
    pub during: Vec<String>,
    /// After the wait: what was reset and restarted (empty: nothing, or the step did not run).
    pub settled: Vec<String>,
    /// After the wait: the units the lab left failed on purpose, each with why and what to do
    /// (for the message of a failing check that names the unit).
    pub kept: Vec<(String, String)>,
}

/// Read what the lab's steps printed in `trip` (hostile: only their closed sets of words).
pub fn read_trip(lab: &LabRequest<'_>, trip: &BootTrip) -> LabDone {
    let (ok, bad) = lab.plain_names();
    let mut given = if ok.is_empty() && bad.is_empty() {
        Vec::new()
    } else {
        lab_report(&trip.before.join("\n"), &[], true, &bad)
    };
    if let (Some(h), true) = (lab.hosts, lab.joined) {
        given.extend(hosts_note(h, &trip.before));
    }
    let (settled, kept) = match &trip.after {
        Some((lines, _)) => {
            let text = lines.join("\n");
            (
                lab_report(&text, &lab.dhcp_names(), !ok.is_empty(), &[]),
                network_kept(&text),
            )
        }
        None => (Vec::new(), Vec::new()),
    };
    let mut during = dhcp6_stopped(lab, &trip.tick).1;
    if trip
        .tick
        .iter()
        .any(|l| l.trim() == "late-restart networking.service")
    {
        during.push(LATE_RESTART_NOTE.to_string());
    }
    LabDone {
        given,
        during,
        settled,
        kept,
    }
}

/// [`HOSTS`] alone, for a group member's copy before root joins its interfaces: no service of
/// the copy can then have resolved its hostname with its interface up (the give step runs it
/// again, and finds the line there). Its output goes to [`hosts_note`].
pub fn hosts_request(h: &crate::guest::group_net::HostsEntry) -> super::exec::ExecRequest {
    let mut r = super::exec::ExecRequest::new(["/bin/sh", "-c", HOSTS]);
    r.env = vec![
        (LAB_HOSTS_IP_VAR.to_string(), h.ip.to_string()),
        (LAB_HOSTS_NAME_VAR.to_string(), h.name.clone()),
    ];
    r.timeout = Duration::from_secs(30);
    r.output_cap = 4096;
    r
}

/// What the report says of [`HOSTS`]' word in the give step's lines (hostile: only its closed
/// set of words is read; the address and name said are the agent's own).
pub fn hosts_note(h: &crate::guest::group_net::HostsEntry, lines: &[String]) -> Option<String> {
    let (ip, name) = (h.ip, &h.name);
    let word = lines.iter().take(256).map(|l| l.trim()).find(|l| {
        [
            "hosts-written",
            "hosts-present",
            "hosts-ignored",
            "hosts-nosection",
            "hosts-unmatched",
            "hosts-unwritten",
            "hosts-unread",
        ]
        .contains(l)
    })?;
    Some(match word {
        "hosts-written" => format!(
            "/etc/hosts: {name} given its stored address {ip} in PVE's section, as PVE writes it for the stored net0 (PVE wrote 127.0.1.1 for the copy, which has no net0)"
        ),
        "hosts-present" => format!("/etc/hosts: {name} has its stored address {ip} in PVE's section"),
        "hosts-ignored" => "/etc/hosts left as the guest keeps it (/etc/.pve-ignore.hosts: PVE does not write it either)".to_string(),
        "hosts-nosection" => format!(
            "/etc/hosts has no section of PVE's (# --- BEGIN PVE --- … # --- END PVE ---): left as it is; {name} may not resolve to its stored address {ip} in the copy"
        ),
        "hosts-unmatched" => format!(
            "/etc/hosts: PVE's section has no 127.0.1.1 line for {name}: left as it is; {name} may not resolve to its stored address {ip} in the copy"
        ),
        "hosts-unwritten" => format!(
            "/etc/hosts could not be written: {name} resolves to 127.0.1.1 in the copy, not to its stored address {ip}, and a service bound to it listens on loopback only"
        ),
        _ => format!(
            "/etc/hosts could not be read (no awk in the copy?): {name} resolves to 127.0.1.1 in the copy, not to its stored address {ip}"
        ),
    })
}

/// The names the watch stopped a `dhclient -6` for, and what the report says of each (from its
/// lines: hostile, only "dhcp6-stopped <plain name> <secs>" of a stored name is read).
pub fn dhcp6_stopped(lab: &LabRequest<'_>, lines: &[String]) -> (Vec<String>, Vec<String>) {
    let mut names: Vec<String> = Vec::new();
    let mut notes = Vec::new();
    for line in lines {
        let mut w = line.split_whitespace();
        if let (Some("dhcp6-stopped"), Some(n), Some(secs)) = (w.next(), w.next(), w.next()) {
            let Some(n) = lab.dhcp6.iter().find(|d| d.as_str() == n) else {
                continue;
            };
            let Ok(secs) = secs.parse::<u64>() else {
                continue;
            };
            if !names.contains(n) {
                names.push(n.clone());
                notes.push(format!(
                    "the DHCPv6 client of {n} (ip6=dhcp) waited {secs}s for a lease that cannot \
                     come in an isolated copy, holding networking.service and the boot: stopped"
                ));
            }
        }
    }
    (names, notes)
}

/// Why `networking.service` stays failed when [`SETTLE`] could not list the stanzas
/// `ifup -a` brings up.
const STANZAS_UNREAD: &str = "the interfaces its `ifup -a` brings up could not be listed \
     (`ifquery --list` failed in the copy: no ifupdown, or an interfaces file it refuses), so \
     its failure cannot be put down to a DHCP stanza; see `journalctl -u networking.service` \
     in the guest";

/// Why `networking.service` stays failed when the `auto` stanzas of `names` (none a stored
/// DHCP interface) did not come up.
fn stanzas_failed_note(names: &[String]) -> String {
    format!(
        "the stanza of {} did not come up, and {} no DHCP interface of the backup (the \
         isolation explains only those): it failed on its own, as it would in production (a \
         VLAN, bond or bridge whose device or kernel support is missing, a wrong option); see \
         `ifup {}` and `journalctl -u networking.service` in the guest and fix its stanza in \
         /etc/network/interfaces",
        names.join(", "),
        if names.len() == 1 {
            "it is"
        } else {
            "they are"
        },
        names[0]
    )
}

/// The units the settle step left failed on purpose, with why (hostile: only its closed set
/// of line words is read, every name escaped and clipped): `networking.service` when an
/// interface it brings up failed for a reason the isolation does not explain.
fn network_kept(stdout: &str) -> Vec<(String, String)> {
    let clip = crate::error::outside_text_max;
    let mut given = Vec::new();
    let mut stanzas = Vec::new();
    let mut unread = false;
    for line in stdout.lines().take(256) {
        let mut w = line.split_whitespace();
        match (w.next(), w.next()) {
            (Some("dhcp-kept"), Some(n)) if given.len() < 32 => given.push(clip(n, 32)),
            (Some("stanza-failed"), Some(n)) if stanzas.len() < 32 => stanzas.push(clip(n, 32)),
            (Some("stanzas-unread"), Some("networking.service")) => unread = true,
            _ => {}
        }
    }
    let mut why = Vec::new();
    if !stanzas.is_empty() {
        why.push(stanzas_failed_note(&stanzas));
    }
    if !given.is_empty() {
        why.push(format!(
            "{} (given to the copy, not DHCP) did not come up: see `ifup {}` in the guest",
            given.join(", "),
            given[0]
        ));
    }
    if unread {
        why.push(STANZAS_UNREAD.to_string());
    }
    if why.is_empty() {
        Vec::new()
    } else {
        vec![("networking.service".to_string(), why.join("; "))]
    }
}

/// The report's parts from a lab step's output (hostile: only its closed set of line words is
/// read, every name escaped and clipped). `asked`: interfaces were to be given (a foreign link
/// is then worth saying; without, the run was for the node's failures alone).
fn lab_report(stdout: &str, dhcp: &[&str], asked: bool, bad: &[&String]) -> Vec<String> {
    let clip = crate::error::outside_text_max;
    let mut given = Vec::new();
    let mut restarted = Vec::new();
    let mut kept = Vec::new();
    let mut notes = Vec::new();
    let mut stanzas = Vec::new();
    for line in stdout.lines().take(256) {
        let mut w = line.split_whitespace();
        match (w.next(), w.next(), w.next(), w.next()) {
            (Some("given"), Some(n), Some(p), _) => given.push(format!(
                "{} given as an unconnected veth pair (peer {} inside the copy)",
                clip(n, 32),
                clip(p, 32)
            )),
            (Some("present"), Some(n), _, _) => {
                notes.push(format!("{} was there already", clip(n, 32)))
            }
            (Some("joined"), Some(n), _, _) => given.push(format!(
                "{} joined to the group's lab (its peer a port of the lab's bridge)",
                clip(n, 32)
            )),
            (Some("foreign"), Some(n), why, _) if asked => notes.push(format!(
                "nothing given: the copy's network namespace holds {}, {}",
                clip(n, 32),
                match why {
                    Some("outside") => "whose peer is outside the copy",
                    _ => "an ethernet device the isolation did not make",
                }
            )),
            (Some("unreadable"), _, _, _) if asked => notes.push(
                "nothing given: the copy's links could not be read (`ip -d -o link show`)"
                    .to_string(),
            ),
            (Some("refused"), Some(n), _, _) => notes.push(format!(
                "{} could not be made (no `ip`, or the kernel refused a veth)",
                clip(n, 32)
            )),
            (Some("nm-unmanaged"), how, _, _) => notes.push(format!(
                "the veth peers (felabN) left unmanaged by NetworkManager \
                 (/run/NetworkManager/conf.d/90-felhom-lab.conf{}): in production they are on \
                 the node",
                if how == Some("reloaded") {
                    ", reloaded by the running daemon"
                } else {
                    ""
                }
            )),
            (Some("nm-unreloaded"), _, _, _) => notes.push(
                "NetworkManager refused to reload its configuration: it may manage the veth \
                 peers (felabN) and wait for a DHCP lease on them"
                    .to_string(),
            ),
            (Some("early-restart"), Some(u), _, _) => notes.push(format!(
                "{} had failed before its device was given: restarted at once",
                clip(u, 128)
            )),
            (Some("dhcp-reset"), Some(u), _, _) => notes.push(format!(
                "{} failed for the DHCP stanza of {} (no lease in an isolated copy; every other \
                 interface its `ifup -a` brings up is up): its failed state was reset",
                clip(u, 128),
                dhcp.join(", ")
            )),
            (Some("online-reset"), Some(u), _, _) => notes.push(format!(
                "{} failed although every given interface networkd manages is online (its \
                 address set): networkd waits for a router advertisement or a DHCP lease, which \
                 cannot come in an isolated copy; its failed state was reset",
                clip(u, 128)
            )),
            (Some("online-kept"), Some(n), _, _) => notes.push(format!(
                "systemd-networkd-wait-online.service left failed: {} is not online",
                clip(n, 32)
            )),
            (Some("dhcp6-kept"), Some("networking.service"), _, _) => notes.push(
                "networking.service failed for the stopped DHCPv6 client: not restarted (it \
                 would wait on it again)"
                    .to_string(),
            ),
            (Some("dhcp-kept"), Some(n), _, _) => notes.push(format!(
                "networking.service left failed: {} (not DHCP) is not up",
                clip(n, 32)
            )),
            (Some("stanza-failed"), Some(n), _, _) if stanzas.len() < 32 => {
                stanzas.push(clip(n, 32))
            }
            (Some("stanzas-unread"), Some("networking.service"), _, _) => {
                notes.push(format!("networking.service left failed: {STANZAS_UNREAD}"))
            }
            (Some("restarted"), Some(u), st, _) if restarted.len() < 32 => restarted.push(format!(
                "{} ({})",
                clip(u, 128),
                clip(st.unwrap_or("unknown"), 32)
            )),
            (Some("kept"), Some(u), _, _) if kept.len() < 32 => kept.push(clip(u, 128)),
            (
                Some("userns-reset"),
                Some("systemd-journald-audit.socket"),
                Some("audit"),
                Some(v),
            ) => notes.push(format!(
                "systemd-journald-audit.socket failed as under every systemd older than 254 \
                     without its audit check (backported to 251.17, 252.11 and 253.5) in an \
                     unprivileged container (systemd {} takes the audit socket for usable in a \
                     user namespace; the kernel refuses it); its failed state reset",
                clip(v, 16)
            )),
            (Some("userns-reset"), Some(u), Some(t), _)
                if u.ends_with(".mount") && USERNS_UNMOUNTABLE.contains(&t) =>
            {
                notes.push(userns_mount_note(&clip(u, 128), t))
            }
            _ => {}
        }
    }
    if !stanzas.is_empty() {
        notes.push(format!(
            "networking.service left failed: {}",
            stanzas_failed_note(&stanzas)
        ));
    }
    for n in bad {
        notes.push(format!(
            "{} left out (not a plain interface name)",
            clip(n, 32)
        ));
    }
    let mut parts = given;
    if !restarted.is_empty() {
        parts.push(format!("restarted {}", restarted.join(", ")));
    }
    if !kept.is_empty() {
        parts.push(format!(
            "not restarted, left failed (no network ordering: its failure is its own): {}",
            kept.join(", ")
        ));
    }
    parts.extend(notes);
    parts
}

#[cfg(test)]
mod tests;
