//! `guests` and `vmid-check` against fakepve: the full list (the fake's live `.vmlist`, plus a
//! guest on another node only the list knows) joined with what the pool token sees.

use felhom_tests::agent::run_agent;
use felhom_tests::fakepve::{AgentFiles, FakePve};
use serde_json::{json, Value};

fn world() -> (FakePve, AgentFiles) {
    let mut scenario = felhom_tests::fakepve::demo_scenario();
    scenario["vmlist_extra"] = json!([{"vmid": 4100, "node": "pve2", "type": "qemu"}]);
    let pve = FakePve::start(scenario);
    let files = AgentFiles::for_fake(&pve);
    (pve, files)
}

#[test]
fn vmid_check_verdicts_against_the_full_list() {
    let (pve, files) = world();
    let check = |vmid: &str| {
        let run = run_agent(&files.config_path, &["vmid-check", vmid, "--json"]);
        let doc = run.json();
        (run.code, doc)
    };

    let (code, doc) = check("101");
    assert_eq!(code, Some(3), "{doc:#}");
    assert_eq!(doc["verdict"], "in_use");
    assert_eq!(doc["code"], "vmid_in_use");
    assert_eq!(
        doc["holder"],
        json!({"type": "lxc", "node": "pve1", "foreign": true})
    );
    assert!(
        !doc.to_string().contains("someone-elses"),
        "a foreign name leaked: {doc}"
    );

    let (code, doc) = check("200");
    assert_eq!(code, Some(3));
    assert_eq!(doc["holder"]["foreign"], json!(false), "{doc:#}");

    let (code, doc) = check("4100");
    assert_eq!(code, Some(3));
    assert_eq!(
        doc["holder"],
        json!({"type": "qemu", "node": "pve2", "foreign": true}),
        "{doc:#}"
    );
    assert!(doc["message"].as_str().unwrap_or("").contains("pve2"));

    let (code, doc) = check("120");
    assert_eq!(code, Some(0), "{doc:#}");
    assert_eq!(doc["verdict"], "free");
    assert_eq!(doc["holder"], Value::Null);

    let (code, doc) = check("9999");
    assert_eq!(
        (code, doc["verdict"].clone(), doc["code"].clone()),
        (Some(3), json!("reserved"), json!("vmid_reserved"))
    );
    let (code, doc) = check("990005");
    assert_eq!((code, doc["verdict"].clone()), (Some(3), json!("reserved")));
    let (code, doc) = check("99");
    assert_eq!(
        (code, doc["verdict"].clone(), doc["vmid"].clone()),
        (Some(3), json!("invalid"), Value::Null)
    );

    assert!(
        pve.writes().is_empty(),
        "vmid-check wrote to PVE: {:?}",
        pve.writes()
    );
}

#[test]
fn guests_lists_everything_with_pool_membership() {
    let (pve, files) = world();
    let run = run_agent(&files.config_path, &["guests", "--json"]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    let rows = doc["guests"].as_array().expect("guests");
    let row = |vmid: u32| {
        rows.iter()
            .find(|r| r["vmid"] == vmid)
            .unwrap_or_else(|| panic!("no {vmid} in {doc:#}"))
    };
    for (vmid, in_pool, node) in [
        (200, true, "pve1"),
        (300, true, "pve1"),
        (101, false, "pve1"),
        (990000, false, "pve1"),
        (990001, false, "pve1"),
        (4100, false, "pve2"),
    ] {
        assert_eq!(row(vmid)["in_pool"], json!(in_pool), "{vmid}");
        assert_eq!(row(vmid)["node"], node, "{vmid}");
    }
    assert_eq!(rows.len(), 6);
    assert!(
        !doc.to_string().contains("someone-elses"),
        "foreign names stay on the node"
    );
    assert!(pve.writes().is_empty());
}
