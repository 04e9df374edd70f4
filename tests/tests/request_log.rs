//! `-v` is worth turning on: a command-line provision at debug prints one line per PVE
//! request (method, path, status, milliseconds) and never the token secret, a header, a query
//! or a body.

use felhom_tests::world::World;

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
