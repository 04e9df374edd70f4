//! osquery checks in a real container of the test bed, against the `osqueryi` stand-in: each
//! status is reached for the reason it claims.
//!
//! The busybox bed on purpose: each status is forced through the stand-in's controls (its unit
//! list, its delay), which a real guest's systemd does not take.

use std::path::Path;
use std::time::{Duration, Instant};

use felhom_agent::error::ErrorCode;
use felhom_agent::guest::checks::verdict;
use felhom_agent::guest::{
    load_packs, parse_pack, run_checks, Check, CheckContext, CheckResult, CheckSettings,
    CheckStatus, GuestExec,
};
use felhom_tests::guestbed::{
    kill_processes_with_marker, repo_root, wait_processes_gone, GuestBed, PctFault,
};

fn default_pack() -> Vec<Check> {
    load_packs(&repo_root().join("packaging/checks.d")).expect("the packaged check pack")
}

fn ctx(hostname: &str) -> CheckContext {
    CheckContext::new()
        .with("hostname", hostname)
        .with("vmid", "130")
        .with("node", "pve1")
        .with("txn", "01TXN")
}

fn by_name<'a>(results: &'a [CheckResult], name: &str) -> &'a CheckResult {
    results
        .iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("no result for {name}: {results:?}"))
}

/// Panic (after killing them) when processes whose command line holds `marker` are still
/// there after `within`.
fn assert_gone(marker: &str, within: Duration, what: &str) {
    let left = wait_processes_gone(marker, within);
    if !left.is_empty() {
        kill_processes_with_marker(marker);
        panic!("{what}: {left:?}");
    }
}

fn statuses(results: &[CheckResult]) -> Vec<(String, CheckStatus)> {
    results.iter().map(|r| (r.name.clone(), r.status)).collect()
}

#[tokio::test]
async fn the_default_pack_passes_in_a_healthy_guest() {
    let bed = GuestBed::new();
    bed.add_ct(130);
    let ct = bed.lxc(130);
    let checks = default_pack();
    assert_eq!(checks.len(), 5);
    let results = run_checks(&ct, &checks, &ctx("testbed"), &CheckSettings::default()).await;
    for r in &results {
        assert_eq!(r.status, CheckStatus::Pass, "{r:?}");
        assert!(r.message.is_none());
    }
    assert!(verdict(ct.guest(), &results).is_ok());
    // The rows seen are reported, as osquery printed them.
    let os = by_name(&results, "os-identified");
    assert_eq!(os.rows[0]["name"], "Debian GNU/Linux");
    assert_eq!(os.rows[0]["platform"], "debian");
    assert_eq!(by_name(&results, "hostname").rows[0]["hostname"], "testbed");
    assert_eq!(
        by_name(&results, "osquery-version").rows[0]["version"],
        "5.23.1"
    );
    assert_eq!(by_name(&results, "no-failed-units").row_count, 0);
    // The report shape of DESIGN section 3.
    let json = serde_json::to_value(&results).unwrap();
    assert_eq!(json[0]["status"], "pass");
    assert!(json[0]["rows"].is_array());
}

#[tokio::test]
async fn a_failed_unit_fails_its_check_with_the_rows_seen() {
    let bed = GuestBed::new();
    bed.add_ct(131);
    let units = bed.guest_path(131, "/usr/share/osquery-standin/systemd_units");
    let mut text = std::fs::read_to_string(&units).unwrap();
    text.push_str(
        "nginx.service\tA high performance web server\tloaded\tfailed\tfailed\tenabled\n",
    );
    std::fs::write(&units, text).unwrap();
    let ct = bed.lxc(131);
    let results = run_checks(
        &ct,
        &default_pack(),
        &ctx("testbed"),
        &CheckSettings::default(),
    )
    .await;
    let units = by_name(&results, "no-failed-units");
    assert_eq!(units.status, CheckStatus::Fail, "{units:?}");
    assert_eq!(units.row_count, 1);
    assert_eq!(units.rows[0]["id"], "nginx.service");
    assert!(
        units.message.as_deref().unwrap_or("").contains("rows == 0"),
        "{units:?}"
    );
    // Everything else still passes: the failure is that check's alone.
    assert_eq!(
        results
            .iter()
            .filter(|r| r.status == CheckStatus::Pass)
            .count(),
        4,
        "{:?}",
        statuses(&results)
    );
    let err = verdict(ct.guest(), &results).unwrap_err();
    assert_eq!(err.code(), ErrorCode::CheckFailed);
    assert!(err.to_string().contains("failed: no-failed-units"), "{err}");
}

#[tokio::test]
async fn a_wrong_hostname_fails_the_hostname_check() {
    let bed = GuestBed::new();
    bed.add_ct(132);
    let results = run_checks(
        &bed.lxc(132),
        &default_pack(),
        &ctx("web-132"),
        &CheckSettings::default(),
    )
    .await;
    let host = by_name(&results, "hostname");
    assert_eq!(host.status, CheckStatus::Fail, "{host:?}");
    let msg = host.message.as_deref().unwrap_or("");
    assert!(msg.contains("web-132") && msg.contains("testbed"), "{msg}");
}

#[tokio::test]
async fn a_read_only_root_filesystem_fails_its_check() {
    let bed = GuestBed::new();
    bed.add_ct(133);
    bed.add_fault(133, PctFault::RootfsReadOnly);
    let results = run_checks(
        &bed.lxc(133),
        &default_pack(),
        &ctx("testbed"),
        &CheckSettings::default(),
    )
    .await;
    let rootfs = by_name(&results, "root-fs-read-write");
    assert_eq!(rootfs.status, CheckStatus::Fail, "{rootfs:?}");
    assert_eq!(rootfs.row_count, 0);
    assert_eq!(by_name(&results, "os-identified").status, CheckStatus::Pass);
}

#[tokio::test]
async fn an_unknown_table_is_an_error_not_a_failure() {
    let bed = GuestBed::new();
    bed.add_ct(134);
    let checks = parse_pack(
        r#"
        [[check]]
        name = "bogus"
        sql = "SELECT * FROM no_such_table"
        expect = "rows == 0"

        [[check]]
        name = "bad-column"
        sql = "SELECT nonexistent FROM os_version"
        "#,
        Path::new("test.toml"),
    )
    .unwrap();
    let results = run_checks(
        &bed.lxc(134),
        &checks,
        &ctx("testbed"),
        &CheckSettings::default(),
    )
    .await;
    // "rows == 0" would hold for the empty array osquery prints on error: the exit status
    // decides, so this is an error.
    let bogus = by_name(&results, "bogus");
    assert_eq!(bogus.status, CheckStatus::Error, "{bogus:?}");
    let msg = bogus.message.as_deref().unwrap_or("");
    assert!(msg.contains("no such table: no_such_table"), "{msg}");
    let col = by_name(&results, "bad-column");
    assert_eq!(col.status, CheckStatus::Error, "{col:?}");
    assert!(
        col.message
            .as_deref()
            .unwrap_or("")
            .contains("no such column: nonexistent"),
        "{col:?}"
    );
}

#[tokio::test]
async fn missing_osquery_makes_every_check_an_error() {
    let bed = GuestBed::new();
    bed.add_ct(135);
    std::fs::remove_file(bed.guest_path(135, "/usr/bin/osqueryi")).unwrap();
    std::fs::remove_file(bed.guest_path(135, "/opt/osquery/bin/osqueryd")).unwrap();
    let results = run_checks(
        &bed.lxc(135),
        &default_pack(),
        &ctx("testbed"),
        &CheckSettings::default(),
    )
    .await;
    assert_eq!(results.len(), 5);
    for r in &results {
        assert_eq!(r.status, CheckStatus::Error, "{r:?}");
        assert!(
            r.message
                .as_deref()
                .unwrap_or("")
                .contains("osquery is not installed in CT 135"),
            "{r:?}"
        );
    }
}

#[tokio::test]
async fn osqueryd_in_shell_mode_is_the_fallback() {
    let bed = GuestBed::new();
    bed.add_ct(136);
    // Only the package's real binary is left: found with test -x, run with -S.
    std::fs::remove_file(bed.guest_path(136, "/usr/bin/osqueryi")).unwrap();
    let results = run_checks(
        &bed.lxc(136),
        &default_pack(),
        &ctx("testbed"),
        &CheckSettings::default(),
    )
    .await;
    for r in &results {
        assert_eq!(r.status, CheckStatus::Pass, "{r:?}");
    }
}

#[tokio::test]
async fn osquery_that_does_not_answer_in_time_is_an_error_and_is_killed() {
    let bed = GuestBed::new();
    bed.add_ct(137);
    let control = bed.guest_path(137, "/etc/osquery-standin");
    std::fs::create_dir_all(&control).unwrap();
    std::fs::write(control.join("delay"), "613.37\n").unwrap();
    let checks = parse_pack(
        "[[check]]\nname = \"slow\"\nsql = \"SELECT version FROM osquery_info\"\ntimeout_secs = 1\n",
        Path::new("test.toml"),
    )
    .unwrap();
    let started = Instant::now();
    let results = run_checks(
        &bed.lxc(137),
        &checks,
        &ctx("testbed"),
        &CheckSettings::default(),
    )
    .await;
    // The stand-in would sleep for ten minutes: ending well before that shows the timeout
    // worked, with room for a loaded machine.
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "{:?}",
        started.elapsed()
    );
    let slow = by_name(&results, "slow");
    assert_eq!(slow.status, CheckStatus::Error, "{slow:?}");
    assert!(
        slow.message
            .as_deref()
            .unwrap_or("")
            .contains("did not answer within 1s"),
        "{slow:?}"
    );
    // The stand-in sleeps with "613.37" on its command line; nothing of it may be left.
    assert_gone(
        "sleep 613.37",
        Duration::from_secs(3),
        "osquery left behind",
    );
}

#[tokio::test]
async fn a_check_that_never_returns_fails_alone_named_within_its_timeout() {
    let bed = GuestBed::new();
    bed.add_ct(136);
    let control = bed.guest_path(136, "/etc/osquery-standin");
    std::fs::create_dir_all(&control).unwrap();
    std::fs::write(control.join("hang-on"), "FROM mounts").unwrap();
    // The default pack (five checks, one of them on `mounts`), that check given 2 s; a failing
    // check beside it.
    let mut checks = default_pack();
    let hung = checks
        .iter_mut()
        .find(|c| c.sql.contains("FROM mounts"))
        .expect("the default pack reads the mounts");
    hung.timeout = Duration::from_secs(2);
    let hung = hung.name.clone();
    checks.extend(
        parse_pack(
            "[[check]]\nname = \"no-such-host\"\nsql = \"SELECT hostname FROM system_info\"\nexpect = \"hostname == 'elsewhere'\"\n",
            Path::new("test.toml"),
        )
        .unwrap(),
    );
    let started = Instant::now();
    let results = run_checks(
        &bed.lxc(136),
        &checks,
        &ctx("testbed"),
        &CheckSettings::default(),
    )
    .await;
    let took = started.elapsed();
    // Every other check's own 30 s default would be far longer than this.
    assert!(took < Duration::from_secs(25), "{took:?}");
    let r = by_name(&results, &hung);
    assert_eq!(r.status, CheckStatus::Error, "{r:?}");
    assert!(
        r.message
            .as_deref()
            .unwrap_or("")
            .contains("did not answer within 2s"),
        "{r:?}"
    );
    for other in &results {
        if other.name == hung {
            continue;
        }
        let want = if other.name == "no-such-host" {
            CheckStatus::Fail
        } else {
            CheckStatus::Pass
        };
        assert_eq!(other.status, want, "{other:?}");
    }
    let err = verdict(bed.lxc(136).guest(), &results)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&hung) && err.contains("no-such-host"), "{err}");
    // The hung stand-in sleeps with "613.41" on its command line: stopped with it.
    assert_gone(
        "sleep 613.41",
        Duration::from_secs(5),
        "the hung check was left running",
    );
}

#[tokio::test]
async fn in_a_guest_without_systemd_the_failed_units_check_could_not_run_and_says_so() {
    let bed = GuestBed::new();
    bed.add_ct(135);
    // The bed's guests carry sd_booted(3)'s folder; this one, like an Alpine or Devuan guest,
    // does not. osquery's systemd_units is then empty (the stand-in's file still lists units:
    // the verdict must not come from that table).
    std::fs::remove_dir(bed.guest_path(135, "/run/systemd/system")).expect("the bed's marker");
    let ct = bed.lxc(135);
    let results = run_checks(
        &ct,
        &default_pack(),
        &ctx("testbed"),
        &CheckSettings::default(),
    )
    .await;
    let units = by_name(&results, "no-failed-units");
    assert_eq!(units.status, CheckStatus::Error, "{units:?}");
    let message = units.message.as_deref().unwrap_or("");
    assert!(
        message.starts_with("could not run: systemd is not the init of CT 135")
            && message.contains("systemd_units"),
        "{units:?}"
    );
    for other in results.iter().filter(|r| r.name != "no-failed-units") {
        assert_eq!(other.status, CheckStatus::Pass, "{other:?}");
    }
    let err = verdict(ct.guest(), &results).unwrap_err().to_string();
    assert!(err.contains("no-failed-units"), "{err}");
}

#[tokio::test]
async fn a_placeholder_without_a_value_is_an_error() {
    let bed = GuestBed::new();
    bed.add_ct(138);
    let results = run_checks(
        &bed.lxc(138),
        &default_pack(),
        &CheckContext::new(),
        &CheckSettings::default(),
    )
    .await;
    let host = by_name(&results, "hostname");
    assert_eq!(host.status, CheckStatus::Error, "{host:?}");
    assert!(host.message.as_deref().unwrap_or("").contains("{hostname}"));
}

#[tokio::test]
async fn rows_are_capped_in_the_result_but_counted_in_full() {
    let bed = GuestBed::new();
    bed.add_ct(139);
    let units = bed.guest_path(139, "/usr/share/osquery-standin/systemd_units");
    let mut text = String::new();
    for i in 0..30 {
        text.push_str(&format!(
            "u{i}.service\tunit {i}\tloaded\tactive\trunning\tenabled\n"
        ));
    }
    std::fs::write(&units, text).unwrap();
    let checks = parse_pack(
        "[[check]]\nname = \"many\"\nsql = \"SELECT id FROM systemd_units\"\nexpect = \"rows == 30\"\n",
        Path::new("test.toml"),
    )
    .unwrap();
    let settings = CheckSettings {
        max_rows: 5,
        ..CheckSettings::default()
    };
    let results = run_checks(&bed.lxc(139), &checks, &ctx("testbed"), &settings).await;
    let many = by_name(&results, "many");
    assert_eq!(many.status, CheckStatus::Pass, "{many:?}");
    assert_eq!(many.row_count, 30);
    assert_eq!(many.rows.len(), 5);
    assert!(many.rows_truncated);
}
