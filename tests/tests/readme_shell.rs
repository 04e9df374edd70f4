//! Every shell block of README.md works pasted into an interactive bash: no `!` that bash's
//! history expansion would take (`!agent: event not found` drops the whole line), and each
//! block parses (`bash -n`). A shell block is a fenced block marked `sh`, `bash` or `shell`.

use std::fs;
use std::process::Command;

use felhom_tests::fakepve::workspace_root;

/// A fenced shell block: the README line its first line is on, and its text.
struct Block {
    first_line: usize,
    lines: Vec<String>,
}

fn shell_blocks(text: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut current: Option<Block> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim_start();
        match &mut current {
            None => {
                if let Some(lang) = line.strip_prefix("```") {
                    if matches!(lang.trim(), "sh" | "bash" | "shell") {
                        current = Some(Block {
                            first_line: i + 2,
                            lines: Vec::new(),
                        });
                    }
                }
            }
            Some(b) => {
                if line.starts_with("```") {
                    blocks.extend(current.take());
                } else {
                    // Blocks indented under a list item: the indentation is Markdown's.
                    b.lines.push(line.to_string());
                }
            }
        }
    }
    blocks
}

/// Columns (0-based, in chars) of the `!`s on `line` that an interactive bash history-expands,
/// with the quoting state carried from the lines before (`in_single`, `in_double`). Bash
/// expands `!` outside single quotes (double quotes do not protect it) unless a backslash
/// escapes it or a blank, `=` or `(` follows it (bash(1), HISTORY EXPANSION).
fn history_bangs(line: &str, in_single: &mut bool, in_double: &mut bool) -> Vec<usize> {
    let chars: Vec<char> = line.chars().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if *in_single {
            if c == '\'' {
                *in_single = false;
            }
        } else if c == '\\' {
            i += 1;
        } else if c == '\'' && !*in_double {
            *in_single = true;
        } else if c == '"' {
            *in_double = !*in_double;
        } else if c == '#' && !*in_double && (i == 0 || chars[i - 1].is_whitespace()) {
            // A comment: bash still expands `!` in it when typed, so go on scanning it, but
            // quotes in a comment do not open strings.
            found.extend(
                chars[i..]
                    .iter()
                    .enumerate()
                    .filter(|(k, ch)| {
                        **ch == '!'
                            && !matches!(chars.get(i + k + 1), None | Some(' ' | '\t' | '=' | '('))
                            && (i + k)
                                .checked_sub(1)
                                .and_then(|p| chars.get(p))
                                .is_none_or(|p| *p != '\\')
                    })
                    .map(|(k, _)| i + k),
            );
            return found;
        } else if c == '!' && !matches!(chars.get(i + 1), None | Some(' ' | '\t' | '=' | '(')) {
            found.push(i);
        }
        i += 1;
    }
    found
}

#[test]
fn readme_shell_blocks_survive_history_expansion_and_parse() {
    let path = workspace_root().join("README.md");
    let text = fs::read_to_string(&path).expect("read README.md");
    let blocks = shell_blocks(&text);
    assert!(!blocks.is_empty(), "README.md has no shell block");
    let mut problems = Vec::new();
    for b in &blocks {
        let (mut single, mut double) = (false, false);
        for (k, line) in b.lines.iter().enumerate() {
            for col in history_bangs(line, &mut single, &mut double) {
                problems.push(format!(
                    "README.md:{}:{}: `!` is history-expanded in an interactive bash (quote it in single quotes): {line}",
                    b.first_line + k,
                    col + 1
                ));
            }
        }
        let script = b.lines.join("\n") + "\n";
        let out = Command::new("bash")
            .args(["-n", "-c", &script])
            .output()
            .expect("run bash -n");
        if !out.status.success() {
            problems.push(format!(
                "README.md:{}: the block does not parse (bash -n): {}",
                b.first_line,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_scanner_finds_what_bash_expands() {
    let bangs = |l: &str| history_bangs(l, &mut false, &mut false);
    assert_eq!(bangs("for who in --tokens=felhom@pve!agent; do"), vec![30]);
    assert_eq!(bangs("echo \"felhom@pve!agent\""), vec![16]);
    assert!(bangs("echo 'felhom@pve!agent'").is_empty());
    assert!(bangs("echo felhom@pve\\!agent").is_empty());
    assert!(bangs("[ ! -e x ] && echo a != b").is_empty());
    assert_eq!(bangs("# see felhom@pve!agent"), vec![16]);
}

/// The set-up's `systemctl enable --now` line (step 8) names every unit the package's
/// postinst enables (its `UNITS`), so a node set up by hand from the README runs all of them:
/// the metrics publishing too (`felhom-agent-metrics.path`).
#[test]
fn the_setup_enables_every_unit_the_package_enables() {
    let readme = fs::read_to_string(workspace_root().join("README.md")).expect("README.md");
    let postinst =
        fs::read_to_string(workspace_root().join("packaging/maintainer-scripts/postinst"))
            .expect("postinst");
    let units: Vec<&str> = postinst
        .lines()
        .find_map(|l| l.strip_prefix("UNITS=\""))
        .and_then(|l| l.strip_suffix('"'))
        .expect("UNITS= in postinst")
        .split_whitespace()
        .collect();
    assert!(units.len() >= 4, "{units:?}");
    let enable: Vec<String> = shell_blocks(&readme)
        .iter()
        .flat_map(|b| b.lines.clone())
        .filter_map(|l| {
            l.strip_prefix("systemctl enable --now ")
                .map(|r| r.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        })
        .flatten()
        .collect();
    let missing: Vec<&&str> = units
        .iter()
        .filter(|u| !enable.iter().any(|e| e == **u))
        .collect();
    assert!(
        missing.is_empty(),
        "the README's `systemctl enable --now` leaves out {missing:?} (it names {enable:?})"
    );
}
