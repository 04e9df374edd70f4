//! An error goes whole to stderr, whatever its lines; stdout holds results only, so
//! `felhom-agent guests > list.txt` never hides part of an error in the file. A mistyped key
//! in the config is the case of several lines: TOML's caret under the key and the keys it
//! expected come after the first line of the message.

use felhom_tests::agent::run_agent;
use felhom_tests::guestbed::repo_root;

/// The packaged example config with `storage` in `[provision]` mistyped as `storge`.
fn typo_config(dir: &std::path::Path) -> std::path::PathBuf {
    let example = std::fs::read_to_string(repo_root().join("packaging/agent.toml.example"))
        .expect("packaging/agent.toml.example");
    assert!(
        example.lines().any(|l| l.starts_with("storage = ")),
        "the example no longer sets `storage = …` on a line of its own"
    );
    let text: String = example
        .lines()
        .map(|l| match l.strip_prefix("storage = ") {
            Some(rest) => format!("storge = {rest}\n"),
            None => format!("{l}\n"),
        })
        .collect();
    let path = dir.join("agent.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

#[test]
fn a_config_error_of_several_lines_goes_whole_to_stderr() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = typo_config(dir.path());
    for args in [
        &["guests"][..],
        &["journal"],
        &["vmid-check", "120"],
        &["doctor"],
    ] {
        let run = run_agent(&config, args);
        assert_eq!(
            run.code,
            Some(6),
            "{args:?}: {}\n{}",
            run.stdout,
            run.stderr
        );
        if args == ["doctor"] {
            // doctor's report is its result: the failing check is a line of it, on stdout;
            // it holds the whole message too.
            assert!(run.stdout.contains("expected one of"), "{}", run.stdout);
            continue;
        }
        assert_eq!(
            run.stdout, "",
            "{args:?}: stdout must hold nothing of the error; stderr: {}",
            run.stderr
        );
        for part in [
            "error [config_invalid]",
            "storge",
            "^",
            "expected one of",
            "`storage`",
        ] {
            assert!(
                run.stderr.contains(part),
                "{args:?}: no {part:?} on stderr: {}",
                run.stderr
            );
        }
    }
}

#[test]
fn usage_mistakes_stay_off_stdout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = typo_config(dir.path());
    // Usage is judged before the config is read.
    for args in [
        &["--selftest=provision"][..],
        &["--selftest=restore", "-vmid", "120"],
        &["guests", "--keep"],
    ] {
        let run = run_agent(&config, args);
        assert_eq!(
            run.code,
            Some(2),
            "{args:?}: {}\n{}",
            run.stdout,
            run.stderr
        );
        assert_eq!(run.stdout, "", "{args:?}: {}", run.stderr);
        assert!(
            run.stderr.to_lowercase().contains("usage"),
            "{args:?}: {}",
            run.stderr
        );
    }
}
