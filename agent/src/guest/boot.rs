//! The boot wait: after the launch proof (an exec answers) and before the bootstrap and the
//! checks, wait until the guest's boot has ended, so the checks judge a booted guest.
//!
//! Right after a container is RUNNING its systemd says `initializing` and no unit has failed
//! yet; a unit that fails a few seconds into the boot would pass `no-failed-units` if the checks
//! ran then. With systemd (`/run/systemd/system` exists: sd_booted(3)) the wait is
//! `systemctl is-system-running --wait`, which returns once the manager left `initializing`
//! and `starting` (systemd `src/systemctl/systemctl-is-system-running.c`); `running` and
//! `degraded` end it (a degraded guest is then judged by the checks, which name the failed
//! units), any other state (`maintenance`, `stopping`, `offline`) is a boot that did not
//! complete. A guest without systemd (busybox or another init) has no boot state to ask for:
//! the launch proof's answering exec is all that is waited for, and the report says so.
//!
//! The wait is bounded; at its end the state seen and the jobs systemd still runs are named
//! (error code `boot_unfinished`). Guest output is hostile: only a closed set of state words is
//! read, and what is quoted is escaped and clipped.

use std::time::{Duration, Instant};

use super::exec::{ExecError, ExecRequest, GuestExec, GuestExit};

pub use crate::config::{BOOT_TIMEOUT, BOOT_TIMEOUT_SECS};
/// The time the final read of the state (after the timeout) may take.
const STATE_READ_TIMEOUT: Duration = Duration::from_secs(20);
/// The pause between two asks when the answer was not final (a systemd older than `--wait`).
const POLL: Duration = Duration::from_secs(1);

/// What the guest runs: whether systemd is its init, and if so the wait's answer. systemd
/// makes `/run/systemd/system` in `mount_setup()` (`src/shared/mount-setup.c`), after its
/// early mounts: an exec can answer before that, while PID 1 is already systemd and its bus not
/// yet there. So PID 1's own binary (`/proc/1/exe`, `/proc/1/comm`) also says systemd; then
/// `systemctl` prints no state word ("Failed to connect to bus") and the wait asks again.
const WAIT_SCRIPT: &str =
    "command -v systemctl >/dev/null 2>&1 && { [ -d /run/systemd/system ] || \
case \"$(readlink /proc/1/exe 2>/dev/null) $(cat /proc/1/comm 2>/dev/null)\" in \
*/systemd\\ *|*\\ systemd) true;; *) false;; esac; } && \
{ printf 'systemd '; systemctl is-system-running --wait 2>/dev/null; exit 0; }; echo no-systemd";
/// The read after the timeout: the state, then up to five jobs systemd still runs.
const STATE_SCRIPT: &str = "printf 'systemd '; systemctl is-system-running 2>/dev/null; \
systemctl list-jobs --no-legend --no-pager 2>/dev/null | head -n 5";

/// systemd's answer to `is-system-running`, as read from the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootState {
    /// Not systemd: no boot state to ask for.
    NoSystemd,
    /// `running`.
    Running,
    /// `degraded`: booted, some unit failed.
    Degraded,
    /// `initializing` or `starting` (still booting), or no answer yet.
    Booting(&'static str),
    /// `maintenance`, `stopping`, `offline`: the boot did not complete.
    Other(&'static str),
}

/// The closed set of states `is-system-running` answers (systemd `src/core/manager.c`
/// `manager_state_table`), mapped from the guest's first output line.
pub fn parse_state(stdout: &str) -> BootState {
    let first = stdout.lines().next().unwrap_or("").trim();
    if first == "no-systemd" {
        return BootState::NoSystemd;
    }
    let word = first.strip_prefix("systemd").map(str::trim).unwrap_or("");
    match word {
        "running" => BootState::Running,
        "degraded" => BootState::Degraded,
        "initializing" => BootState::Booting("initializing"),
        "starting" => BootState::Booting("starting"),
        "maintenance" => BootState::Other("maintenance"),
        "stopping" => BootState::Other("stopping"),
        "offline" => BootState::Other("offline"),
        "unknown" => BootState::Booting("unknown"),
        _ => BootState::Booting("no answer"),
    }
}

/// The jobs systemd still runs, from the state read's lines after the first (escaped, clipped).
fn pending_jobs(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().nth(1))
        .take(5)
        .map(crate::error::outside_text)
        .collect()
}

/// Wait until the guest's boot has ended, at most `timeout`. `Ok`: what was waited for and
/// seen, for the report. `Err`: the state seen at the end (and the jobs still running), or why
/// the guest could not be asked.
pub async fn wait_boot<E: GuestExec>(exec: &E, timeout: Duration) -> Result<String, String> {
    let started = Instant::now();
    let deadline = started + timeout;
    let mut last = BootState::Booting("no answer");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let req = ExecRequest::new(["/bin/sh", "-c", WAIT_SCRIPT])
            .timeout(left)
            .output_cap(4096);
        match exec.exec(&req).await {
            Ok(out) if out.exit == GuestExit::TimedOut => break,
            Ok(out) => {
                last = parse_state(&out.stdout.text());
                let took = started.elapsed().as_secs_f64();
                match last {
                    BootState::NoSystemd => {
                        return Ok("no systemd in the guest (/run/systemd/system is absent): \
                             its answering exec (the launch proof) is all that was waited for"
                            .to_string())
                    }
                    BootState::Running => {
                        return Ok(format!("systemd: running after {took:.1}s"));
                    }
                    BootState::Degraded => {
                        return Ok(format!(
                            "systemd: degraded after {took:.1}s (units failed; the checks judge them)"
                        ));
                    }
                    BootState::Other(state) => {
                        return Err(format!(
                            "the guest's systemd is {state} after {took:.1}s: its boot did not complete"
                        ));
                    }
                    BootState::Booting(_) => {}
                }
            }
            Err(e @ ExecError::NotRunning { .. }) => {
                return Err(format!("the guest stopped during its boot: {e}"));
            }
            Err(e) => return Err(format!("the guest's boot state could not be read: {e}")),
        }
        tokio::time::sleep(POLL.min(deadline.saturating_duration_since(Instant::now()))).await;
    }
    // The timeout: read the state and what still runs, to name them.
    let req = ExecRequest::new(["/bin/sh", "-c", STATE_SCRIPT])
        .timeout(STATE_READ_TIMEOUT)
        .output_cap(16 * 1024);
    let (state, jobs) = match exec.exec(&req).await {
        Ok(out) if out.exit != GuestExit::TimedOut => {
            let text = out.stdout.text();
            (parse_state(&text), pending_jobs(&text))
        }
        _ => (last, Vec::new()),
    };
    let word = match state {
        BootState::NoSystemd => "no systemd",
        BootState::Running => "running",
        BootState::Degraded => "degraded",
        BootState::Booting(w) | BootState::Other(w) => w,
    };
    let jobs = if jobs.is_empty() {
        String::new()
    } else {
        format!("; jobs still running: {}", jobs.join(", "))
    };
    Err(format!(
        "the guest's boot did not end within {}s ([provision] boot_timeout_secs): its systemd is {word}{jobs}",
        timeout.as_secs()
    ))
}

/// What the copy runs to be given its stored interfaces (argv), in four steps.
///
/// 1. The guard: the copy's network namespace must hold nothing but `lo` (and what an earlier
///    run gave it), as an isolated copy without NICs does; anything else (a NIC, or a namespace
///    that is not the copy's own) and nothing at all is done.
/// 2. For each name, unless the copy has it, a veth pair whose both ends stay in the copy's own
///    network namespace (`<name>` and `felabN`, the peer set up).
/// 3. With `FELHOM_LAB_USERNS` (restore-test copies), given or not: when
///    `sys-kernel-debug.mount` is failed and the copy runs in a user namespace that is not the
///    initial one (its `/proc/self/uid_map` is not the single line `0 0 4294967295`), that
///    mount's failed state is reset: debugfs cannot be mounted there.
/// 4. When one was given: the failed units that can have failed for the missing interface are
///    restarted, each answered with its state afterwards: first the network's own
///    (`networking.service`, `systemd-networkd.service`,
///    `systemd-networkd-wait-online.service`), then every unit ordered after `network.target`,
///    `network-online.target` or `network-pre.target`. Any other failed unit is named and left
///    failed: it failed for a reason of its own, and a restart that happens to succeed must not
///    hide that. Then, with `FELHOM_LAB_DHCP`, `networking.service` still failed and every
///    other given interface up (`ifquery --state`), its failed state is reset (no lease can come
///    in a copy that reaches nothing).
///    Likewise `systemd-networkd-wait-online.service`, still failed after its restart, is
///    reset when every given interface networkd manages (DHCP ones left aside) is online by
///    networkd's own reckoning (`ONLINE_STATE=online` in `/run/systemd/netif/links/<ifindex>`:
///    its required operational state and address reached) and only its setup state is short of
///    `configured`: networkd then waits for a router advertisement or a lease, which cannot
///    come in a copy that reaches nothing (`tests/data/guest-units-facts.md` §2).
const LAB_SCRIPT: &str = r#"
for l in $(awk -F: 'NR>2{gsub(/ /,"",$1); print $1}' /proc/net/dev); do
  case " lo $* " in *" $l "*) continue;; esac
  case $l in felab*) continue;; esac
  echo "foreign $l"; exit 0
done
i=0; given=0
for n in "$@"; do
  if ip link show dev "$n" >/dev/null 2>&1; then echo "present $n"
  elif ip link add "$n" type veth peer name "felab$i" 2>/dev/null && ip link set "felab$i" up; then
    echo "given $n felab$i"; given=1
  else echo "refused $n"; fi
  i=$((i+1))
done
if [ -n "${FELHOM_LAB_USERNS:-}" ] && [ "$(systemctl is-failed sys-kernel-debug.mount 2>/dev/null)" = failed ]; then
  map=$(awk '{$1=$1; print}' /proc/self/uid_map 2>/dev/null)
  if [ -n "$map" ] && [ "$map" != "0 0 4294967295" ]; then
    systemctl reset-failed sys-kernel-debug.mount && echo "userns-reset sys-kernel-debug.mount"
  fi
fi
if [ "$given" = 1 ]; then
  failed=" $(systemctl list-units --state=failed --no-legend --plain --no-pager 2>/dev/null | awk '{printf "%s ", $1}')"
  net=
  for u in networking.service systemd-networkd.service systemd-networkd-wait-online.service; do
    case $failed in *" $u "*) net="$net $u";; esac
  done
  after=
  for u in $failed; do
    case " $net " in *" $u "*) continue;; esac
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
  if [ -n "${FELHOM_LAB_DHCP:-}" ] && [ "$(systemctl is-active networking.service 2>/dev/null)" = failed ]; then
    up=1
    for n in "$@"; do
      case " $FELHOM_LAB_DHCP " in *" $n "*) continue;; esac
      ifquery --state "$n" >/dev/null 2>&1 || { echo "dhcp-kept $n"; up=0; break; }
    done
    [ "$up" = 1 ] && systemctl reset-failed networking.service && echo "dhcp-reset networking.service"
  fi
  if [ "$(systemctl is-active systemd-networkd-wait-online.service 2>/dev/null)" = failed ]; then
    up=1
    for n in "$@"; do
      case " ${FELHOM_LAB_DHCP:-} " in *" $n "*) continue;; esac
      f=/run/systemd/netif/links/$(cat "/sys/class/net/$n/ifindex" 2>/dev/null)
      grep -qx ADMIN_STATE=unmanaged "$f" 2>/dev/null && continue
      grep -qx ONLINE_STATE=online "$f" 2>/dev/null || { echo "online-kept $n"; up=0; break; }
    done
    [ "$up" = 1 ] && systemctl reset-failed systemd-networkd-wait-online.service && echo "online-reset systemd-networkd-wait-online.service"
  fi
fi
exit 0
"#;

/// The variable naming (space-separated) the interfaces the backup stores with `ip=dhcp`.
const LAB_DHCP_VAR: &str = "FELHOM_LAB_DHCP";
/// The variable that lets the script reset `sys-kernel-debug.mount` in a user namespace.
const LAB_USERNS_VAR: &str = "FELHOM_LAB_USERNS";

/// What the report says of `sys-kernel-debug.mount` when its failed state was reset.
pub const DEBUGFS_RESET_NOTE: &str = "sys-kernel-debug.mount failed as in every unprivileged \
container (debugfs cannot be mounted in a user namespace); its failed state reset";

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
    /// The names stored with `ip=dhcp`.
    pub dhcp: &'a [String],
    /// A copy of the agent's own (a restore test's or a selftest's, never a customer's guest):
    /// `sys-kernel-debug.mount`, failed in a user namespace that is not the initial one, has its
    /// failed state reset (`tests/data/guest-units-facts.md` §1).
    pub reset_userns_debugfs: bool,
}

/// Give an isolated copy its stored interfaces (`lab.names`, from the backup's `netN`), each as
/// a veth pair whose other end is also inside the copy, so it boots as its production guest
/// boots without reaching anything; then restart the failed units that can have failed for
/// the missing interface (the network's own and those ordered after a network target; the
/// others are named and stay failed). `Ok`: what the isolation changed, for the report
/// (`None`: nothing). Names that are not plain interface names are left out and said.
/// `lab.dhcp`: the names stored with `ip=dhcp`; when `networking.service` is still failed after
/// the restart and every other given interface is up (`ifquery --state`), its failure is the
/// DHCP stanza's (no lease can come in a copy that reaches nothing): its failed state is reset,
/// and the report says so. `lab.reset_userns_debugfs`: see [`LabRequest`], done also when no
/// interface is to be given.
pub async fn give_lab_interfaces<E: GuestExec>(
    exec: &E,
    lab: &LabRequest<'_>,
    timeout: Duration,
) -> Result<Option<String>, String> {
    let (ok, bad): (Vec<&String>, Vec<&String>) = lab.names.iter().partition(|n| valid_ifname(n));
    if ok.is_empty() && bad.is_empty() && !lab.reset_userns_debugfs {
        return Ok(None);
    }
    let mut argv: Vec<String> = vec![
        "/bin/sh".into(),
        "-c".into(),
        LAB_SCRIPT.into(),
        "sh".into(),
    ];
    argv.extend(ok.iter().map(|n| n.to_string()));
    let dhcp: Vec<&str> = lab
        .dhcp
        .iter()
        .filter(|n| valid_ifname(n) && ok.contains(n))
        .map(String::as_str)
        .collect();
    let mut req = ExecRequest::new(argv)
        .timeout(timeout)
        .output_cap(16 * 1024);
    if !dhcp.is_empty() {
        req = req.env(LAB_DHCP_VAR, dhcp.join(" "));
    }
    if lab.reset_userns_debugfs {
        req = req.env(LAB_USERNS_VAR, "1");
    }
    let out = exec
        .exec(&req)
        .await
        .map_err(|e| format!("the copy's stored interfaces could not be given: {e}"))?;
    let parts = lab_report(&out.stdout.text(), &dhcp, !ok.is_empty(), &bad);
    Ok((!parts.is_empty()).then(|| parts.join("; ")))
}

/// The report's parts from the lab script's output (hostile: only its closed set of line
/// words is read, every name escaped and clipped). `asked`: interfaces were to be given (a
/// foreign link is then worth saying; without, the run was for the debugfs reset alone).
fn lab_report(stdout: &str, dhcp: &[&str], asked: bool, bad: &[&String]) -> Vec<String> {
    let clip = crate::error::outside_text_max;
    let mut given = Vec::new();
    let mut restarted = Vec::new();
    let mut kept = Vec::new();
    let mut notes = Vec::new();
    for line in stdout.lines().take(256) {
        let mut w = line.split_whitespace();
        match (w.next(), w.next(), w.next()) {
            (Some("given"), Some(n), Some(p)) => given.push(format!(
                "{} given as an unconnected veth pair (peer {} inside the copy)",
                clip(n, 32),
                clip(p, 32)
            )),
            (Some("present"), Some(n), _) => {
                notes.push(format!("{} was there already", clip(n, 32)))
            }
            (Some("foreign"), Some(n), _) if asked => notes.push(format!(
                "nothing given: the copy's network namespace holds {}, which an isolated copy \
                 does not",
                clip(n, 32)
            )),
            (Some("refused"), Some(n), _) => notes.push(format!(
                "{} could not be made (no `ip`, or the kernel refused a veth)",
                clip(n, 32)
            )),
            (Some("dhcp-reset"), Some(u), _) => notes.push(format!(
                "{} failed for the DHCP stanza of {} (no lease in an isolated copy; every other \
                 stored interface is up): its failed state was reset",
                clip(u, 128),
                dhcp.join(", ")
            )),
            (Some("online-reset"), Some(u), _) => notes.push(format!(
                "{} failed although every given interface networkd manages is online (its \
                 address set): networkd waits for a router advertisement or a DHCP lease, which \
                 cannot come in an isolated copy; its failed state was reset",
                clip(u, 128)
            )),
            (Some("online-kept"), Some(n), _) => notes.push(format!(
                "systemd-networkd-wait-online.service left failed: {} is not online",
                clip(n, 32)
            )),
            (Some("dhcp-kept"), Some(n), _) => notes.push(format!(
                "networking.service left failed: {} (not DHCP) is not up",
                clip(n, 32)
            )),
            (Some("restarted"), Some(u), st) if restarted.len() < 32 => restarted.push(format!(
                "{} ({})",
                clip(u, 128),
                clip(st.unwrap_or("unknown"), 32)
            )),
            (Some("kept"), Some(u), _) if kept.len() < 32 => kept.push(clip(u, 128)),
            (Some("userns-reset"), Some("sys-kernel-debug.mount"), _) => {
                notes.push(DEBUGFS_RESET_NOTE.to_string())
            }
            _ => {}
        }
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
mod tests {
    use super::*;

    #[test]
    fn states_are_read_from_a_closed_set() {
        assert_eq!(parse_state("no-systemd\n"), BootState::NoSystemd);
        assert_eq!(parse_state("systemd running\n"), BootState::Running);
        assert_eq!(parse_state("systemd degraded\n"), BootState::Degraded);
        assert_eq!(
            parse_state("systemd starting\n"),
            BootState::Booting("starting")
        );
        assert_eq!(
            parse_state("systemd maintenance\n"),
            BootState::Other("maintenance")
        );
        // Anything else (older systemd without --wait, a guest's own words) is no answer.
        assert_eq!(parse_state("systemd \n"), BootState::Booting("no answer"));
        assert_eq!(
            parse_state("systemd running; rm -rf /\n"),
            BootState::Booting("no answer")
        );
        assert_eq!(parse_state(""), BootState::Booting("no answer"));
    }

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
    fn the_lab_report_names_what_was_restarted_what_was_left_failed_and_the_debugfs_reset() {
        let out = "given eth0 felab0\n\
                   kept flaky.service\n\
                   restarted networking.service active\n\
                   restarted shop.service active\n\
                   userns-reset sys-kernel-debug.mount\n\
                   userns-reset other.mount\n\
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
            text.contains(
                "left failed (no network ordering: its failure is its own): flaky.service"
            ),
            "{text}"
        );
        assert!(text.contains(DEBUGFS_RESET_NOTE), "{text}");
        // Only the one mount is ever named as reset.
        assert!(!text.contains("other.mount"), "{text}");
        assert!(!text.contains("whatever"), "{text}");
    }

    #[test]
    fn a_lab_run_for_the_debugfs_reset_alone_says_nothing_of_foreign_links() {
        assert!(lab_report("foreign eth0\n", &[], false, &[]).is_empty());
        let asked = lab_report("foreign eth0\n", &[], true, &[]);
        assert_eq!(asked.len(), 1);
        assert!(asked[0].starts_with("nothing given: the copy's network namespace holds eth0"));
        let bad = "eth0;reboot".to_string();
        let out = lab_report("", &[], true, &[&bad]);
        assert_eq!(
            out,
            vec!["eth0;reboot left out (not a plain interface name)".to_string()]
        );
    }

    #[test]
    fn pending_jobs_are_the_unit_column_clipped_to_five() {
        let text = "systemd starting\n\
                    12 slow.service start running\n\
                    13 a.service start waiting\n\
                    14 b.service start waiting\n\
                    15 c.service start waiting\n\
                    16 d.service start waiting\n\
                    17 e.service start waiting\n";
        let jobs = pending_jobs(text);
        assert_eq!(jobs.len(), 5);
        assert_eq!(jobs[0], "slow.service");
    }
}
