//! `--selftest=provision` end to end: fakepve over HTTPS for PVE, the `pct` stand-in with a real
//! root filesystem for the guest, the real agent binary.

use std::path::Path;

use felhom_tests::agent::{agent_command, AgentRun};
use felhom_tests::fakepve::{AgentFiles, FakePve};
use felhom_tests::guestbed::GuestBed;
use serde_json::{json, Value};

/// One provision world: the fake PVE, the guest bed, the agent's files with the package's
/// default bootstrap profile and check pack.
struct World {
    pve: FakePve,
    bed: GuestBed,
    files: AgentFiles,
}

fn copy_dir(from: &Path, to: &Path) {
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .expect("cp");
    assert!(
        status.success(),
        "cp -a {} {}",
        from.display(),
        to.display()
    );
}

impl World {
    fn new(scenario: Value) -> World {
        let pve = FakePve::start(scenario);
        let bed = GuestBed::autocreate();
        let files = AgentFiles::for_fake(&pve);
        let root = felhom_tests::fakepve::workspace_root();
        copy_dir(
            &root.join("packaging/bootstrap.d/default"),
            &files.bootstrap_dir.join("default"),
        );
        copy_dir(
            &root.join("packaging/checks.d/default.toml"),
            &files.checks_dir.join("default.toml"),
        );
        World { pve, bed, files }
    }

    fn demo() -> World {
        World::new(felhom_tests::fakepve::demo_scenario())
    }

    fn agent(&self, args: &[&str]) -> AgentRun {
        let path = format!(
            "{}:{}",
            self.bed.bin_dir().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        agent_command(&self.files.config_path)
            .env("PATH", path)
            .args(args)
            .output()
            .expect("run agent")
            .into()
    }
}

#[test]
fn happy_path_is_ok_and_cleans_up() {
    let w = World::demo();
    let run = w.agent(&["--selftest=provision", "-vmid", "120", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok");
    assert_eq!(doc["destroyed"], json!(true));
    assert_eq!(doc["kind"], "selftest-provision");
    let checks = doc["checks"].as_array().expect("checks");
    assert!(
        !checks.is_empty() && checks.iter().all(|c| c["status"] == "pass"),
        "{doc:#}"
    );
    assert!(w.pve.guest(120).is_none(), "the selftest guest is gone");
    let deletes: Vec<_> = w
        .pve
        .requests()
        .into_iter()
        .filter(|r| r.method == "DELETE" && r.targets_vmid(0) == false && r.path.contains("/lxc/"))
        .collect();
    assert!(
        deletes.iter().all(|r| r.targets_vmid(120)),
        "only vmid 120 was deleted: {deletes:?}"
    );
}
