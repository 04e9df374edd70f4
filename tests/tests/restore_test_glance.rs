//! The restore test at a glance: its text output lists each check with pass, fail or error and
//! why; `journal` has an OUTCOME column (ok, failed, interrupted, …), `journal --kind` lists
//! one kind, and `journal --last restore-test` shows the last restore test in full, its checks
//! included, after the run's own output is gone.

use felhom_tests::world::World;
use serde_json::Value;

/// The columns of `txn`'s row in `journal`'s table (TXN KIND VMID OUTCOME PHASE …).
fn row_of(table: &str, txn: &str) -> Vec<String> {
    table
        .lines()
        .find(|l| l.starts_with(txn))
        .unwrap_or_else(|| panic!("no row for {txn}:\n{table}"))
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

#[test]
fn a_restore_test_lists_its_checks_and_the_journal_shows_its_outcome() {
    let w = World::demo();
    // An application check of the backed-up guest 200 that cannot hold, and one of another
    // guest, which the copy of 200 does not run.
    std::fs::write(
        w.files.checks_dir.join("zz-app.toml"),
        "[[check]]\nname = \"app-impossible\"\nsql = \"SELECT name FROM os_version\"\nexpect = \"rows == 0\"\nguests = [200]\n\n\
         [[check]]\nname = \"other-guest\"\nsql = \"SELECT name FROM os_version\"\nguests = [4242]\n",
    )
    .expect("write pack");

    let run = w.agent(&["--selftest=restore"]);
    assert_eq!(run.code, Some(5), "{}\n{}", run.stdout, run.stderr);
    let last = w.agent(&["journal", "--last", "restore-test", "--json"]);
    assert_eq!(last.code, Some(0), "{}\n{}", last.stdout, last.stderr);
    let doc = last.json();
    let txn = doc["transaction"]["txn"].as_str().expect("txn").to_string();
    assert_eq!(doc["transaction"]["outcome"], "failed", "{doc:#}");
    let checks = doc["checks"].as_array().expect("checks").clone();
    assert!(checks.len() >= 5, "{doc:#}");
    // Every check the run judged is a line of its text output: name, verdict, why.
    for c in &checks {
        let name = c["name"].as_str().expect("name");
        let line = run
            .stdout
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(name))
            .unwrap_or_else(|| panic!("no line for check {name}:\n{}", run.stdout));
        let status = c["status"].as_str().expect("status");
        assert_eq!(
            line.split_whitespace()
                .nth(2)
                .map(|s| s.trim_end_matches(':')),
            Some(status),
            "{line}"
        );
        if let Some(why) = c["message"].as_str() {
            assert!(line.ends_with(why), "{line} does not say why: {why}");
        }
    }
    let failed = run
        .stdout
        .lines()
        .find(|l| l.contains("app-impossible"))
        .expect("the failed check's line");
    assert!(
        failed.contains("fail: expected rows == 0, the query returned 1"),
        "{failed}"
    );
    assert!(
        !run.stdout.contains("other-guest"),
        "a check of another guest is not the copy's: {}",
        run.stdout
    );
    let passed = checks.iter().filter(|c| c["status"] == "pass").count();
    assert!(
        run.stdout.contains(&format!(
            "checks: {passed} passed, 1 failed, 0 could not run"
        )),
        "{}",
        run.stdout
    );
    // The copy's line names the guest, the backup, the copy and the transaction.
    assert!(
        run.stdout.lines().any(|l| l.starts_with("guest 200 (")
            && l.contains(": backup local:backup/vzdump-lxc-200-")
            && l.ends_with(&format!(" in copy 990002 (txn {txn}): failed"))),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout
            .contains(": 1 due, 1 copies, 0 proven, 1 failed, 0 left;"),
        "{}",
        run.stdout
    );

    // The last restore test, in full, after the fact.
    let text = w.agent(&["journal", "--last", "restore-test"]);
    assert_eq!(text.code, Some(0), "{}", text.stderr);
    for part in [
        txn.as_str(),
        "failed in phase",
        "guest:      200 (the copy is vmid 990002)",
        "backup:     local:backup/vzdump-lxc-200-",
        "why:        [check_failed]",
        "app-impossible",
        "fail: expected rows == 0, the query returned 1",
        &format!("checks: {passed} passed, 1 failed, 0 could not run"),
    ] {
        assert!(
            text.stdout.contains(part),
            "no {part:?} in:\n{}",
            text.stdout
        );
    }
    assert_eq!(text.stderr, "", "a failed run's why is a result here");

    // A provision that ends ok, and one stopped for good: each OUTCOME says how it ended.
    // (The application check would run in a provision from 200's backup too.)
    std::fs::remove_file(w.files.checks_dir.join("zz-app.toml")).expect("remove the pack");
    let ok = w.agent(&["--selftest=provision", "-vmid", "121", "--json"]);
    assert_eq!(ok.code, Some(0), "{}", ok.stderr);
    let ok_txn = ok.json()["txn"].as_str().expect("txn").to_string();
    let killed = w
        .command()
        .args(["--selftest=provision", "-vmid", "122"])
        .env("FELHOM_AGENT_KILL_AT", "after-journal:5")
        .output()
        .expect("run the agent");
    assert_eq!(killed.status.code(), None, "not killed");
    let open: Value = w
        .journal()
        .into_iter()
        .find(|t| t["vmid"] == 122)
        .expect("the open transaction");
    let open_txn = open["txn"].as_str().expect("txn").to_string();

    let table = w.agent(&["journal"]);
    assert_eq!(table.code, Some(0), "{}", table.stderr);
    let head: Vec<&str> = table
        .stdout
        .lines()
        .next()
        .expect("header")
        .split_whitespace()
        .collect();
    assert_eq!(&head[..5], ["TXN", "KIND", "VMID", "OUTCOME", "PHASE"]);
    for (t, outcome, phase) in [
        (&txn, "failed", None),
        (&ok_txn, "ok", Some("destroyed")),
        (&open_txn, "interrupted", Some("created")),
    ] {
        let row = row_of(&table.stdout, t);
        assert_eq!(row[3], outcome, "{row:?}\n{}", table.stdout);
        if let Some(p) = phase {
            assert_eq!(row[4], p, "{row:?}");
        }
    }

    // --kind lists one kind only; restore-test is the self-restore-test's name.
    let only = w.agent(&["journal", "--kind", "restore-test"]);
    assert_eq!(only.code, Some(0), "{}", only.stderr);
    row_of(&only.stdout, &txn);
    assert!(
        !only.stdout.contains(&ok_txn) && !only.stdout.contains(&open_txn),
        "{}",
        only.stdout
    );
    let doc = w
        .agent(&["journal", "--kind", "selftest-provision", "--json"])
        .json();
    let kinds: Vec<&str> = doc["transactions"]
        .as_array()
        .expect("transactions")
        .iter()
        .map(|t| t["kind"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        kinds,
        ["selftest-provision", "selftest-provision"],
        "{doc:#}"
    );
    let bad = w.agent(&["journal", "--kind", "restore"]);
    assert_eq!(bad.code, Some(2), "{}", bad.stderr);
    assert!(bad.stderr.contains("restore-test"), "{}", bad.stderr);

    // The help names both.
    let help = w.agent(&["journal", "--help"]);
    for part in ["--kind", "--last", "OUTCOME", "journal --last restore-test"] {
        assert!(
            help.stdout.contains(part),
            "no {part:?} in:\n{}",
            help.stdout
        );
    }
}
