//! The checks judge a booted guest: after the launch proof the agent waits for the guest's boot
//! to end (systemd's `is-system-running`) before the bootstrap and the checks, for
//! provisions and restore tests alike, bounded by `[provision] boot_timeout_secs`; the wait is
//! its own phase (`launched` lasts as long as the boot, `booted` starts when it ended).
//!
//! The bed's guests are busybox root filesystems; a backup here carries a stand-in `systemctl`
//! and `/run/systemd/system` (what sd_booted(3) looks for), so the copy "boots" as a systemd
//! guest would: a unit that fails seconds into the boot is failed only once the boot has gone
//! that far. A guest without either has no boot state to wait for, and the report says so.

use felhom_tests::fakepve::AgentOptions;
use felhom_tests::world::World;
use serde_json::{json, Value};

/// The stand-in's answer to `is-system-running --wait`: the boot takes 3 s, and at its end
/// `late.service` (a unit that sleeps, then fails) is failed, as `systemctl list-units --all` and
/// `systemctl show --all` (what the guest's osqueryi reads for `systemd_units`) then report it.
const SYSTEMCTL_LATE_FAILURE: &str = r#"#!/bin/sh
# The boot's clock starts at the first ask; `starting` for 3 s, then `degraded`, late.service
# failed (with --wait: the answer once the 3 s are over). The clock is the uptime in hundredths
# of a second (whole seconds of `date +%s` made the 3 s anything from 2 s up).
now() { read -r u _ </proc/uptime; echo "${u%.*}${u#*.}"; }
[ -e /run/boot-started ] || now >/run/boot-started
booted() { [ $(( $(now) - $(cat /run/boot-started) )) -ge 300 ] && : >/run/late-failed; }
case "$1 $2" in
  "is-system-running --wait")
    until booted; do sleep 1; done
    echo degraded
    exit 1 ;;
  "is-system-running ")
    if booted; then echo degraded; else echo starting; fi
    exit 1 ;;
  "list-units --all")
    [ -e /run/late-failed ] || exit 0
    printf 'late.service loaded failed failed Sleeps 5 s, then fails\n' ;;
  "show --all")
    [ -e /run/late-failed ] || exit 0
    printf 'Id=late.service\nDescription=Sleeps 5 s, then fails\nLoadState=loaded\n'
    printf 'ActiveState=failed\nSubState=failed\nUnitFileState=enabled\nFollowing=\n'
    printf 'FragmentPath=/etc/systemd/system/late.service\nSourcePath=\n\n' ;;
  *) exit 0 ;;
esac
"#;

/// A boot that never ends: `slow.service` is still starting.
const SYSTEMCTL_NEVER_BOOTED: &str = r#"#!/bin/sh
case "$*" in
  "is-system-running --wait") exec sleep 600 ;;
  "is-system-running") echo starting; exit 1 ;;
  "list-jobs --no-legend --no-pager") printf '12 slow.service start running\n' ;;
  *) exit 0 ;;
esac
"#;

/// The demo scenario whose LXC backup (of guest 200) restores a guest holding `systemctl`.
fn scenario_with_systemctl(systemctl: &str) -> Value {
    let mut s = felhom_tests::fakepve::demo_scenario();
    let vols = s["volumes"]["local"].as_array_mut().expect("volumes");
    let vol = vols
        .iter_mut()
        .find(|v| v["vmid"] == 200)
        .expect("the backup of 200");
    vol["guest"] = json!({"files": {
        "/run/systemd/system/": "",
        "/usr/bin/systemctl": systemctl,
    }});
    s
}

/// The longest `launched` phase of `kind` in `journal --stats --json`, in seconds.
fn launched_max(w: &World, kind: &str) -> f64 {
    let run = w.agent(&["journal", "--stats", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    doc["kinds"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|k| k["kind"] == kind)
        .flat_map(|k| k["phases"].as_array().cloned().unwrap_or_default())
        .find(|p| p["phase"] == "launched")
        .and_then(|p| p["max"].as_f64())
        .unwrap_or_else(|| panic!("no launched phase for {kind} in {doc:#}"))
}

#[test]
fn a_unit_failing_seconds_into_the_boot_turns_the_restore_test_red_naming_it() {
    let w = World::new(scenario_with_systemctl(SYSTEMCTL_LATE_FAILURE));
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(5), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.json()["run"]["outcome"], "failed", "{}", run.stdout);
    // The copy of guest 200's backup, the one pool guest with a backup.
    let doc = run.restore_copy();
    assert_eq!(doc["guest"], 200, "{doc:#}");
    assert_eq!(doc["outcome"], "failed", "{doc:#}");
    assert_eq!(doc["verdict"], "failed", "{doc:#}");
    assert_eq!(doc["error"]["code"], "check_failed", "{doc:#}");
    let message = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("no-failed-units") && message.contains("late.service"),
        "the failure names the check and the unit: {message}"
    );
    assert!(
        doc["boot"]
            .as_str()
            .is_some_and(|b| b.starts_with("systemd: degraded")),
        "{doc:#}"
    );
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    // This bed's guests have a network namespace of their own, as LXC gives every container,
    // and busybox's `ip`, which makes no veth: the report says the stored interface could not
    // be made, and nothing is made on the host.
    assert!(
        doc["isolation"]
            .as_str()
            .is_some_and(|i| i.starts_with("eth0 could not be made")),
        "{doc:#}"
    );
    // The wait is its own phase figure: `launched` lasted the boot (3 s).
    let launched = launched_max(&w, "restore-test");
    assert!(launched >= 2.5, "launched lasted {launched}s");
}

#[test]
fn a_boot_that_does_not_end_in_time_names_the_state_and_what_still_runs() {
    let opts = AgentOptions {
        extra_toml: "boot_timeout_secs = 5\n".to_string(),
        ..AgentOptions::default()
    };
    let w = World::with_options(scenario_with_systemctl(SYSTEMCTL_NEVER_BOOTED), &opts);
    let started = std::time::Instant::now();
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let took = started.elapsed();
    let doc = run.json();
    assert_eq!(run.code, Some(5), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["error"]["code"], "boot_unfinished", "{doc:#}");
    let message = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("starting")
            && message.contains("slow.service")
            && message.contains("120")
            && message.contains("boot_timeout_secs"),
        "{message}"
    );
    assert_eq!(doc["destroyed"], json!(true), "{doc:#}");
    assert!(
        took < std::time::Duration::from_secs(60),
        "the wait was not bounded: {took:?}"
    );
}

#[test]
fn a_guest_without_systemd_is_waited_for_by_its_launch_proof_and_the_report_says_so() {
    let w = World::demo();
    let run = w.agent(&["--selftest=restore", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.restore_copy();
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    assert!(
        doc["boot"]
            .as_str()
            .is_some_and(|b| b.starts_with("no systemd in the guest")),
        "{doc:#}"
    );
    // The backup is proven now: `--guest 200` restores it again, for the text.
    let text = w.agent(&["--selftest=restore", "--guest", "200"]);
    assert_eq!(text.code, Some(0), "{}\n{}", text.stdout, text.stderr);
    assert!(
        text.stdout.contains("guest 200 (") && text.stdout.contains("\n  boot: no systemd"),
        "{}",
        text.stdout
    );
}
