//! The least-privilege role of the agent's token on its pool (`FelhomAgent`): the README's
//! `pveum role add` lines, `doctor`'s lists (`ROLE_PRIVS_PVE9`, `ROLE_PRIVS_PVE8`) and the table
//! of `tests/data/pve-api-facts.md` §2.6 (each privilege with the agent's request that needs it
//! and PVE's check) hold exactly the same privileges; none of them is one the agent never uses
//! (`VM.Console` above all); the README names no broader role. And the test bed's token and user
//! hold exactly that role on the pool (the demo scenario), so every end-to-end test runs with
//! it: a provision, with its bootstrap and checks through the helper, and a restore test pass
//! here with nothing more, and `doctor` finds nothing in excess.

use std::collections::BTreeSet;

use felhom_agent::doctor::{ROLE_NAME, ROLE_PRIVS_PVE8, ROLE_PRIVS_PVE9};
use felhom_tests::guestbed::repo_root;
use felhom_tests::world::World;
use serde_json::Value;

/// Privileges the agent never uses; none may be in the role.
const NEVER: &[&str] = &[
    "VM.Console",
    "VM.Config.Disk",
    "VM.Config.CPU",
    "VM.Config.Memory",
    "VM.Config.HWType",
    "VM.Migrate",
    "VM.Clone",
    "VM.Snapshot",
    "VM.Snapshot.Rollback",
    "VM.Replicate",
    "Pool.Allocate",
    "Sys.Modify",
    "Sys.Console",
    "Datastore.Allocate",
];

fn set(privs: &[&str]) -> BTreeSet<String> {
    privs.iter().map(|p| (*p).to_string()).collect()
}

/// The privileges of every `pveum role add FelhomAgent -privs "…"` line of the README (a
/// commented line too), in order.
fn readme_roles() -> Vec<BTreeSet<String>> {
    let text = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let prefix = format!("pveum role add {ROLE_NAME} -privs \"");
    text.lines()
        .filter_map(|l| {
            let l = l.trim().trim_start_matches('#').trim();
            let rest = l.strip_prefix(&prefix)?;
            let list = rest.split('"').next()?;
            Some(
                list.split([',', ' ', ';'])
                    .filter(|p| !p.is_empty())
                    .map(str::to_string)
                    .collect(),
            )
        })
        .collect()
}

/// The rows of pve-api-facts §2.6: (privilege, releases, request, check).
fn facts_rows() -> Vec<(String, String, String, String)> {
    let text = std::fs::read_to_string(felhom_tests::guestbed::test_data("pve-api-facts.md"))
        .expect("facts");
    let start = text
        .find("### 2.6 The agent's role on its pool")
        .expect("pve-api-facts.md has §2.6");
    let section = &text[start..];
    let end = section[4..].find("\n### ").map_or(section.len(), |i| i + 4);
    section[..end]
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cells: Vec<String> = l
                .trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().to_string())
                .collect();
            assert_eq!(cells.len(), 4, "a row of §2.6 has four cells: {l}");
            (
                cells[0].trim_matches('`').to_string(),
                cells[1].clone(),
                cells[2].clone(),
                cells[3].clone(),
            )
        })
        .collect()
}

#[test]
fn the_role_is_exactly_what_the_agents_requests_need_in_readme_doctor_and_the_facts() {
    let rows = facts_rows();
    assert!(!rows.is_empty());
    for (privilege, releases, request, check) in &rows {
        // Each privilege is named by a request of the agent and by PVE's check, with its source.
        assert!(
            request.contains('`') && (request.contains('/') || request.contains("restore")),
            "{privilege}: no request named: {request}"
        );
        assert!(
            (check.contains("src/") || check.contains("PVE/")) && check.contains('`'),
            "{privilege}: no PVE source cited: {check}"
        );
        assert!(
            matches!(releases.as_str(), "8, 9" | "9" | "8"),
            "{privilege}: {releases}"
        );
    }
    let of = |release: &str| -> BTreeSet<String> {
        rows.iter()
            .filter(|(_, r, _, _)| r.split(", ").any(|x| x == release))
            .map(|(p, _, _, _)| p.clone())
            .collect()
    };
    let (facts9, facts8) = (of("9"), of("8"));
    let readme = readme_roles();
    assert_eq!(
        readme.len(),
        2,
        "the README's `pveum role add {ROLE_NAME}` lines: {readme:?}"
    );
    assert_eq!(
        readme[0], facts9,
        "README (PVE 9) versus pve-api-facts §2.6"
    );
    assert_eq!(
        readme[1], facts8,
        "README (PVE 8) versus pve-api-facts §2.6"
    );
    assert_eq!(
        set(ROLE_PRIVS_PVE9),
        facts9,
        "doctor (PVE 9) versus pve-api-facts §2.6"
    );
    assert_eq!(
        set(ROLE_PRIVS_PVE8),
        facts8,
        "doctor (PVE 8) versus pve-api-facts §2.6"
    );
    for p in NEVER {
        assert!(
            !facts9.contains(*p) && !facts8.contains(*p),
            "{p} is in the role, and the agent never uses it"
        );
    }
    let readme_text = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    assert!(
        !readme_text.contains("PVEVMAdmin"),
        "the README still names PVEVMAdmin"
    );
    assert!(
        readme_text.contains(&format!("--roles {ROLE_NAME}")),
        "the README grants no {ROLE_NAME}"
    );
}

/// The pool grants of the demo scenario (what every end-to-end test's token and user hold).
fn demo_pool_grants() -> Vec<(String, BTreeSet<String>)> {
    let s = felhom_tests::fakepve::demo_scenario();
    s["grants"]
        .as_array()
        .expect("grants")
        .iter()
        .filter(|g| g[1] == "/pool/felhom")
        .map(|g| {
            (
                g[0].as_str().unwrap_or("").to_string(),
                g[2].as_array()
                    .expect("privileges")
                    .iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn a_token_holding_only_the_role_provisions_restore_tests_and_passes_doctor() {
    let grants = demo_pool_grants();
    let who: BTreeSet<&str> = grants.iter().map(|(w, _)| w.as_str()).collect();
    assert_eq!(who, BTreeSet::from(["felhom@pve", "felhom@pve!agent"]));
    for (w, privs) in &grants {
        assert_eq!(
            privs,
            &set(ROLE_PRIVS_PVE9),
            "{w} on /pool/felhom in the demo scenario"
        );
    }
    let w = World::demo();
    let doc = w.agent(&["doctor", "--json"]).json();
    let checks = doc["checks"].as_array().expect("checks");
    let status = |name: &str| {
        checks
            .iter()
            .find(|c| c["name"] == name)
            .map(|c| c["status"].clone())
            .unwrap_or(Value::Null)
    };
    assert_eq!(status("privileges"), "pass", "{doc:#}");
    assert_eq!(status("least_privilege"), "pass", "{doc:#}");

    let run = w.agent(&["--selftest=provision", "-vmid", "170", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["outcome"], "ok", "{doc:#}");
    // The demo's one pool guest with a backup (200): one copy, proven.
    let run = w.agent(&["--selftest=restore", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["run"]["outcome"], "ok", "{doc:#}");
    let copy = run.restore_copy();
    assert_eq!(copy["guest"], 200, "{doc:#}");
    assert_eq!(copy["outcome"], "ok", "{doc:#}");
    // The LXC execs of both went through the helper.
    assert!(w.assert_pct_only_from_helper() > 0);
}

#[test]
fn doctor_warns_when_the_token_holds_vm_console_or_more_than_the_role() {
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    let mut more: Vec<Value> = ROLE_PRIVS_PVE9.iter().map(|p| Value::from(*p)).collect();
    more.push(Value::from("VM.Console"));
    more.push(Value::from("VM.Snapshot"));
    for g in scenario["grants"].as_array_mut().expect("grants") {
        if g[1] == "/pool/felhom" {
            g[2] = Value::Array(more.clone());
        }
    }
    let w = World::new(scenario);
    let doc = w.agent(&["doctor", "--json"]).json();
    let check = doc["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["name"] == "least_privilege")
        .cloned()
        .unwrap_or_else(|| panic!("no least_privilege check: {doc:#}"));
    assert_eq!(check["status"], "warn", "{check:#}");
    let msg = check["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("VM.Console")
            && msg.contains("VM.Snapshot")
            && msg.contains("root shell")
            && msg.contains("/pool/felhom")
            && msg.contains(&format!("--roles {ROLE_NAME}"))
            && msg.contains(&format!("pveum role add {ROLE_NAME}")),
        "{msg}"
    );
}

#[test]
fn no_readme_line_grants_a_built_in_role_on_a_guest() {
    // A guest outside the pool whose backups are restored needs VM.Backup there and nothing
    // else (pve-storage check_volume_access, pve-manager extractconfig): the README grants a
    // role of that one privilege, as the preflight's and doctor's advice do.
    use felhom_agent::preflight::restorable::BACKUP_OWNER_ROLE;
    let text = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let mut on_guests = 0;
    for line in text
        .lines()
        .filter(|l| l.contains("acl modify /vms/") || l.contains("acl modify \"/vms/"))
    {
        on_guests += 1;
        let roles = line
            .split("--roles")
            .nth(1)
            .unwrap_or_else(|| panic!("no --roles: {line}"));
        let role = roles
            .trim()
            .split(|c: char| c.is_whitespace() || c == '`' || c == ')')
            .next()
            .unwrap_or("");
        assert_eq!(role, BACKUP_OWNER_ROLE, "{line}");
    }
    assert!(
        on_guests >= 1,
        "the README says nothing of backups outside the pool"
    );
    assert!(
        text.contains(&format!(
            "pveum role add {BACKUP_OWNER_ROLE} -privs \"VM.Backup\""
        )),
        "the README does not create {BACKUP_OWNER_ROLE}"
    );
    for builtin in ["PVEVMUser", "PVEVMAdmin", "PVEAdmin", "Administrator"] {
        assert!(
            !text.contains(&format!("--roles {builtin}")),
            "the README grants {builtin}"
        );
    }
}

#[test]
fn doctor_fails_a_token_without_pool_audit() {
    // Without Pool.Audit on the pool, /cluster/resources drops each guest's `pool` (pve-manager
    // PVE/API2/Cluster.pm resources) and the inventory cannot tell the pool's guests, while
    // `/pools?poolid=` still answers (its check is made with noerr).
    let mut s = felhom_tests::fakepve::demo_scenario();
    for g in s["grants"].as_array_mut().expect("grants") {
        if g[1] == "/pool/felhom" {
            let privs: Vec<Value> = g[2]
                .as_array()
                .expect("privileges")
                .iter()
                .filter(|p| *p != "Pool.Audit")
                .cloned()
                .collect();
            g[2] = Value::Array(privs);
        }
    }
    let w = World::new(s);
    let doc = w.agent(&["doctor", "--json"]).json();
    let check = doc["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["name"] == "privileges")
        .cloned()
        .expect("privileges");
    assert_eq!(check["status"], "fail", "{check:#}");
    assert!(
        check["message"]
            .as_str()
            .unwrap_or("")
            .contains("Pool.Audit on /pool/felhom"),
        "{check:#}"
    );
}
