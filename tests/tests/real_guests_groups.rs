//! Application groups on real containers (`[[restore_test.group]]`): a database guest (200,
//! busybox httpd on its stored address 10.20.0.30) and a shop guest (201, whose order page is a
//! CGI that asks the database over the network and answers 502 when it cannot). The shop's
//! check of its order page is red when the shop is proven alone (its copy reaches nothing) and
//! green when the two are proven as a group (their stored NICs joined to the group's lab, a
//! bridge in a network namespace of its own that the root helper makes); a group whose
//! database is broken is red, and the shop's failing check names the database member. The
//! lab's namespace is gone after the run. Each test needs LXC (`tests/tests/real_guests.rs`).

use felhom_tests::fakepve::AgentOptions;
use felhom_tests::groups::{add_group, copy_of, BROKEN_DB_UNIT, SHOP};
use felhom_tests::verdict::{check, check_is};
use felhom_tests::world::World;
use serde_json::{json, Value};

/// The pool with the database (its unit `db_unit`) and the shop.
fn scenario(db_unit: &str) -> Value {
    SHOP.scenario(db_unit, json!({}), json!({}))
}

/// The world of `scenario` with the shop's pack, and the group when `grouped`.
fn world(scenario: Value, grouped: bool) -> Option<World> {
    let w = World::real_or_skip(scenario, &AgentOptions::default())?;
    std::fs::write(w.files.checks_dir.join("shop.toml"), SHOP.pack())
        .unwrap_or_else(|e| panic!("cannot write the pack: {e}"));
    if grouped {
        add_group(&w.files.config_path, "shop", &[200, 201], 1);
    }
    Some(w)
}

/// `--selftest=restore --guest 201 --json`: the copies' documents.
fn prove_shop(w: &World) -> (Option<i32>, Vec<Value>, String) {
    let run: felhom_tests::agent::AgentRun = w
        .command()
        .args(["--selftest=restore", "--guest", "201", "--json"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run the agent: {e}"))
        .into();
    let doc: Value = serde_json::from_str(&run.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", run.stdout, run.stderr));
    let copies = doc["copies"].as_array().cloned().unwrap_or_default();
    (run.code, copies, format!("{}\n{}", run.stdout, run.stderr))
}

/// The lab's namespace named in a copy's document is gone.
fn assert_lab_gone(copy: &Value) {
    let lab = copy["group"]["lab"]
        .as_str()
        .unwrap_or_else(|| panic!("no group lab in {copy:#}"));
    assert!(lab.starts_with("felhom-g-"), "{lab}");
    assert!(
        !std::path::Path::new("/run/netns").join(lab).exists(),
        "the group's lab {lab} is left"
    );
}

/// Proven alone, the shop's copy reaches no database: its order page answers 502, red.
#[test]
fn the_shop_proven_alone_cannot_reach_its_database() {
    let Some(w) = world(scenario(&SHOP.db_unit()), false) else {
        return;
    };
    let (code, copies, out) = prove_shop(&w);
    assert_eq!(code, Some(5), "{out}");
    assert_eq!(copies.len(), 1, "{out}");
    let shop = copy_of(&copies, 201);
    assert!(check_is(shop, "order-page", "fail"), "{shop:#}");
    assert!(shop.get("group").is_none(), "{shop:#}");
}

/// Proven as a group, the database's copy is started first, the shop's after it; the shop's
/// order page reaches the database's copy at its stored address: both green, the lab removed.
#[test]
fn the_shop_and_its_database_proven_as_a_group_are_green() {
    let Some(w) = world(scenario(&SHOP.db_unit()), true) else {
        return;
    };
    let (code, copies, out) = prove_shop(&w);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(copies.len(), 2, "{out}");
    let (db, shop) = (copy_of(&copies, 200), copy_of(&copies, 201));
    for (c, member) in [(db, 1), (shop, 2)] {
        assert_eq!(c["outcome"], "ok", "{c:#}");
        assert_eq!(c["group"]["name"], "shop", "{c:#}");
        assert_eq!(c["group"]["member"], member, "{c:#}");
        assert!(
            c["isolation"]
                .as_str()
                .is_some_and(|i| i.contains("joined to the group's lab")),
            "{c:#}"
        );
    }
    assert!(check_is(shop, "order-page", "pass"), "{shop:#}");
    assert!(check_is(db, "database-serves", "pass"), "{db:#}");
    assert_eq!(db["group"]["lab"], shop["group"]["lab"]);
    assert_lab_gone(shop);
}

/// A group whose database backup is broken is red, and the shop's failing order page names
/// the database member that failed before it.
#[test]
fn a_group_whose_database_is_broken_is_red_naming_the_database() {
    let Some(w) = world(scenario(BROKEN_DB_UNIT), true) else {
        return;
    };
    let (code, copies, out) = prove_shop(&w);
    assert_eq!(code, Some(5), "{out}");
    let (db, shop) = (copy_of(&copies, 200), copy_of(&copies, 201));
    assert_eq!(db["outcome"], "failed", "{db:#}");
    assert_eq!(shop["outcome"], "failed", "{shop:#}");
    let said = check(shop, "order-page")["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        said.contains("member 200 (db) of group shop failed before it"),
        "{said}"
    );
    assert_lab_gone(shop);
}
