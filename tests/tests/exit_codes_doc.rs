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
}
