//! Bootstrap profiles run in a real container of the test bed.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use felhom_agent::error::ErrorCode;
use felhom_agent::guest::bootstrap::{BootstrapMarker, MARKER_PATH};
use felhom_agent::guest::{
    load_profile, run_bootstrap, BootstrapSettings, BootstrapStatus, LxcExec,
};
use felhom_tests::guestbed::{
    kill_processes_with_marker, repo_root, unique_marker, wait_processes_gone, GuestBed,
};

fn write_profile(root: &Path, name: &str, run: &str, files: &[(&str, &str, u32)]) {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("profile folder");
    std::fs::write(dir.join("run"), run).expect("run script");
    std::fs::set_permissions(dir.join("run"), std::fs::Permissions::from_mode(0o755))
        .expect("run script mode");
    for (rel, text, mode) in files {
        let path = dir.join("files").join(rel);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("files folder");
        std::fs::write(&path, text).expect("profile file");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(*mode))
            .expect("profile file mode");
    }
}

/// A profile that leaves a trace of every run, shows its environment and installs a file.
const COUNTING_RUN: &str = r#"#!/bin/sh
set -e
echo "run $FELHOM_TXN $FELHOM_VMID $FELHOM_PROFILE" >> /root/bootstrap-runs
cp "$FELHOM_FILES_DIR/etc/app/app.conf" /etc/app.conf
echo "cwd=$(pwd)"
echo "to stderr" >&2
"#;

fn settings() -> BootstrapSettings {
    BootstrapSettings {
        timeout: Duration::from_secs(30),
        output_cap: 4096,
        step_timeout: Duration::from_secs(30),
    }
}

fn guest_marker(bed: &GuestBed, vmid: u32) -> BootstrapMarker {
    let text = std::fs::read_to_string(bed.guest_path(vmid, MARKER_PATH)).expect("the marker");
    serde_json::from_str(&text).expect("a marker in the marker format")
}

fn runs(bed: &GuestBed, vmid: u32) -> Vec<String> {
    std::fs::read_to_string(bed.guest_path(vmid, "/root/bootstrap-runs"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn a_profile_runs_once_per_transaction() {
    let bed = GuestBed::new();
    bed.add_ct(120);
    let ct: LxcExec = bed.lxc(120);
    let profiles = tempfile::tempdir().unwrap();
    write_profile(
        profiles.path(),
        "web",
        COUNTING_RUN,
        &[("etc/app/app.conf", "answer=42\n", 0o640)],
    );
    let profile = load_profile(profiles.path(), "web").unwrap();

    let first = run_bootstrap(&ct, &profile, "01TXNAAAA", &settings())
        .await
        .unwrap();
    assert!(!first.reused);
    assert!(first.succeeded(), "{:?}", first.marker.outcome);
    assert_eq!(first.marker.outcome.exit_code, Some(0));
    assert_eq!(
        first.marker.outcome.stdout,
        "cwd=/var/lib/felhom/bootstrap/01TXNAAAA\n"
    );
    assert_eq!(first.marker.outcome.stderr, "to stderr\n");
    assert_eq!(runs(&bed, 120), ["run 01TXNAAAA 120 web"]);
    assert_eq!(
        std::fs::read_to_string(bed.guest_path(120, "/etc/app.conf")).unwrap(),
        "answer=42\n"
    );
    // The marker in the guest is the report's, with a UTC time.
    let marker = guest_marker(&bed, 120);
    assert_eq!(marker, first.marker);
    assert!(marker.time.ends_with('Z'), "{}", marker.time);
    // The pushed payload is gone; the marker stays.
    assert!(!bed
        .guest_path(120, "/var/lib/felhom/bootstrap/01TXNAAAA")
        .exists());

    // The same transaction again: nothing runs, the recorded outcome comes back.
    let again = run_bootstrap(&ct, &profile, "01TXNAAAA", &settings())
        .await
        .unwrap();
    assert!(again.reused);
    assert_eq!(again.marker, first.marker);
    assert_eq!(runs(&bed, 120).len(), 1, "the profile ran a second time");

    // Another transaction (e.g. a guest restored from a bootstrapped backup) runs it.
    let other = run_bootstrap(&ct, &profile, "01TXNBBBB", &settings())
        .await
        .unwrap();
    assert!(!other.reused);
    assert_eq!(runs(&bed, 120).len(), 2);
    assert_eq!(guest_marker(&bed, 120).txn, "01TXNBBBB");
}

#[tokio::test]
async fn a_failing_profile_is_recorded_with_its_exit_code_and_output_and_not_rerun() {
    let bed = GuestBed::new();
    bed.add_ct(121);
    let ct = bed.lxc(121);
    let profiles = tempfile::tempdir().unwrap();
    write_profile(
        profiles.path(),
        "broken",
        "#!/bin/sh\necho run >> /root/bootstrap-runs\necho 'partial work'\necho 'cannot reach the mirror' >&2\nexit 3\n",
        &[],
    );
    let profile = load_profile(profiles.path(), "broken").unwrap();
    let report = run_bootstrap(&ct, &profile, "01TXNFAIL", &settings())
        .await
        .unwrap();
    assert_eq!(report.marker.outcome.status, BootstrapStatus::Failed);
    assert_eq!(report.marker.outcome.exit_code, Some(3));
    assert_eq!(report.marker.outcome.stdout, "partial work\n");
    assert_eq!(report.marker.outcome.stderr, "cannot reach the mirror\n");
    assert_eq!(guest_marker(&bed, 121), report.marker);

    let again = run_bootstrap(&ct, &profile, "01TXNFAIL", &settings())
        .await
        .unwrap();
    assert!(again.reused);
    assert_eq!(again.marker.outcome.exit_code, Some(3));
    assert_eq!(runs(&bed, 121).len(), 1);

    let err = again.into_result().unwrap_err();
    assert_eq!(err.code(), ErrorCode::BootstrapFailed);
    assert!(err.to_string().contains("status 3"), "{err}");
}

#[tokio::test]
async fn a_profile_past_its_timeout_is_killed_and_recorded() {
    let bed = GuestBed::new();
    bed.add_ct(122);
    let ct = bed.lxc(122);
    let profiles = tempfile::tempdir().unwrap();
    let marker = unique_marker("slowboot");
    write_profile(
        profiles.path(),
        "slow",
        &format!("#!/bin/sh\necho started\nexec sh -c 'while :; do sleep 1; done' {marker}\n"),
        &[],
    );
    let profile = load_profile(profiles.path(), "slow").unwrap();
    let settings = BootstrapSettings {
        timeout: Duration::from_secs(1),
        ..settings()
    };
    let report = run_bootstrap(&ct, &profile, "01TXNSLOW", &settings)
        .await
        .unwrap();
    assert_eq!(report.marker.outcome.status, BootstrapStatus::TimedOut);
    assert_eq!(report.marker.outcome.stdout, "started\n");
    let left = wait_processes_gone(&marker, Duration::from_secs(3));
    if !left.is_empty() {
        kill_processes_with_marker(&marker);
        panic!("bootstrap processes left behind: {left:?}");
    }
    let again = run_bootstrap(&ct, &profile, "01TXNSLOW", &settings)
        .await
        .unwrap();
    assert!(again.reused);
    assert_eq!(again.marker.outcome.status, BootstrapStatus::TimedOut);
}

#[tokio::test]
async fn bootstrap_output_is_bounded_in_report_and_marker() {
    let bed = GuestBed::new();
    bed.add_ct(123);
    let ct = bed.lxc(123);
    let profiles = tempfile::tempdir().unwrap();
    write_profile(
        profiles.path(),
        "chatty",
        "#!/bin/sh\nhead -c 500000 /dev/zero | tr '\\000' x\n",
        &[],
    );
    let profile = load_profile(profiles.path(), "chatty").unwrap();
    let report = run_bootstrap(&ct, &profile, "01TXNLOUD", &settings())
        .await
        .unwrap();
    assert!(report.succeeded());
    assert_eq!(report.marker.outcome.stdout.len(), 4096);
    assert!(report.marker.outcome.stdout_truncated);
    let on_disk = std::fs::metadata(bed.guest_path(123, MARKER_PATH)).unwrap();
    assert!(on_disk.len() < 8192, "marker is {} bytes", on_disk.len());
}

#[tokio::test]
async fn the_packaged_default_profile_runs_in_a_guest() {
    let bed = GuestBed::new();
    bed.add_ct(124);
    let ct = bed.lxc(124);
    let profile = load_profile(&repo_root().join("packaging/bootstrap.d"), "default").unwrap();
    let report = run_bootstrap(&ct, &profile, "01TXNDEFAULT", &settings())
        .await
        .unwrap();
    assert!(report.succeeded(), "{:?}", report.marker.outcome);
    let recorded =
        std::fs::read_to_string(bed.guest_path(124, "/var/lib/felhom/provisioned.env")).unwrap();
    assert!(recorded.contains("FELHOM_TXN=01TXNDEFAULT"), "{recorded}");
    assert!(recorded.contains("FELHOM_VMID=124"), "{recorded}");
    assert!(recorded.contains("FELHOM_PROFILE=default"), "{recorded}");
}

#[tokio::test]
async fn a_guest_that_is_not_running_cannot_be_bootstrapped() {
    let bed = GuestBed::new();
    bed.add_ct(125);
    bed.set_running(125, false);
    let profile = load_profile(&repo_root().join("packaging/bootstrap.d"), "default").unwrap();
    let err = run_bootstrap(&bed.lxc(125), &profile, "01TXNDOWN", &settings())
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::LaunchUnproven, "{err}");
}
