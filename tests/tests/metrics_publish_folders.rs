//! `metrics-publish` names the folder it could not use: node_exporter's (`--to`) apart from the
//! agent's (`--from`, `[metrics] dir`), each with what to do about it.

use std::path::Path;

use felhom_tests::agent::agent_command;
use felhom_tests::guestbed::repo_root;

fn publish(config: &Path, from: &Path, to: &Path) -> (Option<i32>, String) {
    let out = agent_command(config)
        .arg("metrics-publish")
        .arg("--from")
        .arg(from)
        .arg("--to")
        .arg(to)
        .output()
        .expect("metrics-publish");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn a_missing_folder_is_named_as_the_one_it_is() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("agent.toml");
    let example = std::fs::read_to_string(repo_root().join("packaging/agent.toml.example"))
        .expect("the example config");
    // `metrics-publish` publishes only `[metrics] dir`: the config names the --from of each run.
    let with_dir = |from: &Path| {
        let line = format!("dir = \"{}\"", from.display());
        let text = example.replacen("# dir = \"/var/lib/felhom-agent-metrics\"", &line, 1);
        assert!(
            text.contains(&line),
            "the example config has no [metrics] dir line"
        );
        std::fs::write(&config, text).expect("config");
    };
    let present = dir.path().join("present");
    std::fs::create_dir(&present).expect("mkdir");
    let missing = dir.path().join("missing");

    // node_exporter's folder is missing: named as that, with --to; the agent's folder is fine
    // and not blamed.
    with_dir(&present);
    let (code, err) = publish(&config, &present, &missing);
    assert_eq!(code, Some(6), "{err}");
    assert!(
        err.contains(&format!(
            "node_exporter's textfile folder {}",
            missing.display()
        )) && err.contains("--to"),
        "{err}"
    );
    assert!(
        !err.contains("[metrics] dir"),
        "the agent's folder blamed: {err}"
    );

    // The agent's folder is missing: named as that, with [metrics] dir / --from.
    with_dir(&missing);
    let (code, err) = publish(&config, &missing, &present);
    assert_eq!(code, Some(6), "{err}");
    assert!(
        err.contains(&missing.display().to_string()) && err.contains("[metrics] dir"),
        "{err}"
    );
    assert!(!err.contains("node_exporter's textfile folder"), "{err}");
}
