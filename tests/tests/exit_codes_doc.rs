//! The exit codes an operator reads agree with the code: the README's table, `--help` (and so
//! the man page, which clap_mangen renders from the same text) and `ExitStatus::ALL` name the
//! same statuses.

use std::collections::BTreeSet;
use std::process::Command;

use felhom_agent::error::ExitStatus;
use felhom_tests::agent::agent_bin;
use felhom_tests::guestbed::repo_root;

fn code_statuses() -> BTreeSet<u8> {
    ExitStatus::ALL.iter().map(|s| s.code()).collect()
}

/// The rows of the README's exit-code table: the number in the first cell, the second cell.
fn readme_table() -> Vec<(u8, String)> {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let mut lines = readme
        .lines()
        .skip_while(|l| l.trim() != "| exit | meaning |");
    assert!(
        lines.next().is_some(),
        "README.md has no `| exit | meaning |` table"
    );
    lines
        .skip(1) // |---|---|
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
            let code = cells[0]
                .trim_matches('`')
                .parse()
                .unwrap_or_else(|_| panic!("not an exit code: {l}"));
            (code, cells.get(1).unwrap_or(&"").to_string())
        })
        .collect()
}

/// The statuses `felhom-agent --help` lists after "Exit codes:".
fn help_statuses() -> BTreeSet<u8> {
    let out = Command::new(agent_bin())
        .arg("--help")
        .output()
        .expect("--help");
    let help = String::from_utf8_lossy(&out.stdout).to_string();
    let (_, tail) = help
        .split_once("Exit codes:")
        .unwrap_or_else(|| panic!("no `Exit codes:` in --help: {help}"));
    let tail = tail.split("\n\n").next().unwrap_or("");
    tail.split([',', '\n'])
        .filter_map(|item| item.split_whitespace().next()?.parse().ok())
        .collect()
}

#[test]
fn readme_help_and_code_name_the_same_exit_codes() {
    let code = code_statuses();
    let table = readme_table();
    let readme: BTreeSet<u8> = table.iter().map(|(c, _)| *c).collect();
    assert_eq!(
        readme.len(),
        table.len(),
        "a code twice in the README: {table:?}"
    );
    assert_eq!(
        readme, code,
        "README's exit-code table versus ExitStatus::ALL"
    );
    assert_eq!(help_statuses(), code, "--help versus ExitStatus::ALL");
    let meaning = |c: u8| {
        table
            .iter()
            .find(|(n, _)| *n == c)
            .map(|(_, m)| m.clone())
            .unwrap_or_default()
    };
    assert!(meaning(130).contains("interrupted"), "{table:?}");
    assert!(meaning(2).contains("usage"), "{table:?}");
    assert!(meaning(6).contains("environment"), "{table:?}");
    // Exit 5 says what it covers: every error code that ends a transaction with it is named
    // in its row of the table and the `--help` line, and so is the missing `pct` (found only
    // after the restore and the start: `doctor`'s exec check finds it before).
    let help = help_text();
    let help_5 = help
        .split_once("Exit codes:")
        .map(|(_, t)| t.split("\n\n").next().unwrap_or(""))
        .and_then(|t| t.split(", ").find(|i| i.trim_start().starts_with("5 ")))
        .unwrap_or_else(|| panic!("no exit 5 in --help: {help}"))
        .to_string();
    let five = meaning(5);
    for code in felhom_agent::error::ErrorCode::ALL
        .iter()
        .filter(|c| felhom_agent::error::exit_status(**c) == ExitStatus::GuestFailed)
    {
        assert!(
            five.contains(code.as_str()),
            "README's exit 5 does not name {code}: {five}"
        );
    }
    for part in ["launch proof", "boot", "bootstrap", "checks"] {
        assert!(
            five.contains(part),
            "README's exit 5 does not say {part:?}: {five}"
        );
        assert!(
            help_5.contains(part),
            "--help's exit 5 does not say {part:?}: {help_5}"
        );
    }
    assert!(five.contains("`pct`") && five.contains("doctor"), "{five}");
}

fn help_text() -> String {
    let out = Command::new(agent_bin())
        .arg("--help")
        .output()
        .expect("--help");
    String::from_utf8_lossy(&out.stdout).to_string()
}
