//! `-v` is worth turning on: a command-line provision at debug prints one line per PVE
//! request (method, path, status, milliseconds) and never the token secret, a header, a query
//! or a body.
//!
//! And no request twice: a provision reads the backup's stored config once (the preflight
//! hands it to the restore), sends its privilege reads together, and reads the guest's config
//! only where a proof needs it.

use felhom_tests::fakepve::RecordedRequest;
use felhom_tests::world::World;
use serde_json::json;

#[test]
fn verbose_selftest_prints_each_pve_request_and_no_secret() {
    let w = World::new(felhom_tests::fakepve::demo_scenario());
    let out = w
        .command()
        .args(["-v", "--selftest=provision", "-vmid", "120"])
        .output()
        .expect("run the agent");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("PVE request"))
        .collect();
    // Every request the fake received is one line of the log (the selftest's restore among
    // them), with its status and its time.
    let sent = w.pve.requests();
    assert!(!sent.is_empty());
    assert!(
        lines.len() >= sent.len(),
        "{} request lines for {} requests",
        lines.len(),
        sent.len()
    );
    assert!(
        lines.iter().any(|l| l.contains("method=\"POST\"")
            && l.contains("path=/nodes/pve1/lxc ")
            && l.contains("status=200")
            && l.contains("ms=")),
        "no line for the restore POST: {lines:#?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("method=\"DELETE\"") && l.contains("path=/nodes/pve1/lxc/120 ")),
        "no line for the destroy: {lines:#?}"
    );
    // No query string, no secret.
    assert!(lines.iter().all(|l| !l.contains('?')), "{lines:#?}");
    let secret = w.pve.token_secret();
    assert!(!secret.is_empty());
    assert!(
        !stderr.contains(&secret) && !stdout.contains(&secret),
        "the PVE token secret appears in the output"
    );
    assert!(
        !stderr.contains("PVEAPIToken"),
        "an Authorization header was printed"
    );
}

#[test]
fn a_provision_asks_pve_nothing_twice_and_its_privilege_reads_together() {
    let w = World::new(felhom_tests::fakepve::demo_scenario());
    // Each privilege read is held 2 s: one after the other they would take 8 s and never
    // overlap; sent together, every one begins before the first one ends.
    w.pve
        .set(json!({"answer_delay": {"GET /api2/json/access/permissions": 2.0}}));
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let sent = w.pve.requests();
    let list = |what: &dyn Fn(&RecordedRequest) -> bool| -> Vec<String> {
        sent.iter()
            .filter(|r| what(r))
            .map(|r| format!("{} {}?{}", r.method, r.path, r.query))
            .collect()
    };
    let extract = list(&|r| r.path.ends_with("/vzdump/extractconfig"));
    assert_eq!(
        extract.len(),
        1,
        "the backup's stored config read {extract:#?}"
    );
    // The guest's config: the marker write's read, its read-back (which is also the read
    // before the start), and the destroy's two proofs (before the stop, before the DELETE).
    let configs = list(&|r| r.method == "GET" && r.path == "/api2/json/nodes/pve1/lxc/120/config");
    assert_eq!(
        configs.len(),
        4,
        "config reads: {configs:#?}\nall: {:#?}",
        list(&|_| true)
    );

    // PVE's status: only the destroy's (is it running, to stop it); the launch is proven by
    // the exec answering from the running guest.
    let status = list(&|r| r.path == "/api2/json/nodes/pve1/lxc/120/status/current");
    assert_eq!(status.len(), 1, "status reads: {status:#?}");

    let perms: Vec<_> = w
        .pve
        .timings()
        .into_iter()
        .filter(|t| t.path == "/api2/json/access/permissions")
        .collect();
    assert!(perms.len() >= 2, "privilege reads: {perms:#?}");
    let last_start = perms.iter().map(|t| t.start).fold(f64::MIN, f64::max);
    let first_end = perms.iter().map(|t| t.end).fold(f64::MAX, f64::min);
    assert!(
        last_start < first_end,
        "the privilege reads went out one after the other: {perms:#?}"
    );
}
