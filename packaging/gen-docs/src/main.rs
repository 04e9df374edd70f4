//! Writes the man page and the shell completions of `felhom-agent` from its clap definitions,
//! for the Debian package (`tests/package.sh`, `packaging/README.md`).
//!
//! ```text
//! cargo run -p felhom-gen-docs -- OUT_DIR
//! ```
//!
//! Creates in `OUT_DIR`: `felhom-agent.1` (roff), `felhom-agent.bash`, `_felhom-agent` (zsh)
//! and `felhom-agent.fish`. The output depends only on the sources (no date, no host), so two
//! runs give the same bytes.
//!
//! The man page is one page: clap_mangen renders the title, name, synopsis, description and
//! options; the commands, examples, exit status and files sections are written here, because
//! clap_mangen would point every subcommand to a page of its own and reflow the aligned
//! examples.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::CommandFactory;
use clap_complete::Shell;
use roff::{bold, italic, roman, Inline, Roff};

/// The name of the binary, as the man page and the completions call it.
const BIN: &str = "felhom-agent";

/// The files the package installs or the agent uses, for the FILES section.
const FILES: &[(&str, &str)] = &[
    (
        "/etc/felhom-agent/agent.toml",
        "The configuration (unknown keys are errors). Not shipped: copy agent.toml.example. \
         The systemd units do not start before it exists.",
    ),
    (
        "/etc/felhom-agent/agent.toml.example",
        "The commented example configuration.",
    ),
    (
        "/etc/felhom-agent/checks.d/",
        "osquery check packs (*.toml) run inside every provisioned guest.",
    ),
    (
        "/etc/felhom-agent/bootstrap.d/",
        "Bootstrap profiles, one folder per profile with an executable run script.",
    ),
    (
        "/var/lib/felhom-agent/",
        "State (mode 0700): the transaction journal, the outbox for the hub, the locks, the \
         restore-test proofs (restore-proofs.json: one record per backup volid).",
    ),
    (
        "/lib/systemd/system/felhom-agent.service",
        "The daemon (felhom-agent run).",
    ),
    (
        "/lib/systemd/system/felhom-restore-test.timer",
        "Starts felhom-restore-test.service (felhom-agent --selftest=restore) once a day.",
    ),
];

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let (Some(out), None) = (args.next(), args.next()) else {
        eprintln!("usage: gen-docs OUT_DIR");
        return ExitCode::from(2);
    };
    match generate(&PathBuf::from(out)) {
        Ok(files) => {
            for f in files {
                println!("{}", f.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gen-docs: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Write every file into `out` (created if missing); returns the paths written.
/// clap_complete 4.6.12's bash script names its states after the binary with `-` as `__`
/// while walking the words (`felhom__agent__subcmd__journal`) but labels the cases that
/// complete them with `-` as `__subcmd__` (`felhom__subcmd__agent__subcmd__journal`), so
/// nothing below the top level ever completes. The labels are put back to the walk's names.
fn fix_bash_state_names(script: &[u8]) -> Vec<u8> {
    let walked = format!("{}__", BIN.replace('-', "__"));
    let labelled = format!("{}__", BIN.replace('-', "__subcmd__"));
    String::from_utf8_lossy(script)
        .replace(&labelled, &walked)
        .into_bytes()
}

fn generate(out: &Path) -> io::Result<Vec<PathBuf>> {
    fs::create_dir_all(out)?;
    let mut written = Vec::new();

    let cmd = felhom_agent::cli::Cli::command().name(BIN).bin_name(BIN);
    let man_path = out.join(format!("{BIN}.1"));
    fs::write(&man_path, man_page(&cmd)?)?;
    written.push(man_path);

    for (shell, file) in [
        (Shell::Bash, format!("{BIN}.bash")),
        (Shell::Zsh, format!("_{BIN}")),
        (Shell::Fish, format!("{BIN}.fish")),
    ] {
        let mut cmd = cmd.clone();
        let mut text = Vec::new();
        clap_complete::generate(shell, &mut cmd, BIN, &mut text);
        if shell == Shell::Bash {
            text = fix_bash_state_names(&text);
        }
        let path = out.join(file);
        fs::write(&path, text)?;
        written.push(path);
    }
    Ok(written)
}

/// The whole man page, roff source.
fn man_page(cmd: &clap::Command) -> io::Result<Vec<u8>> {
    let man = clap_mangen::Man::new(cmd.clone())
        .section("1")
        .manual("felhom-agent manual")
        .source(concat!("felhom-agent ", env!("CARGO_PKG_VERSION")));
    let mut page = Vec::new();
    man.render_title(&mut page)?;
    man.render_name_section(&mut page)?;
    man.render_synopsis_section(&mut page)?;
    man.render_description_section(&mut page)?;
    man.render_options_section(&mut page)?;

    let mut roff = Roff::new();
    commands_section(&mut roff, cmd);
    after_help_sections(&mut roff, cmd);
    files_section(&mut roff);
    roff.control("SH", ["SEE ALSO"]);
    roff.text([
        bold("pct"),
        roman("(1), "),
        bold("qm"),
        roman("(1), "),
        bold("systemctl"),
        roman("(1), "),
        bold("systemd.service"),
        roman("(5); /usr/share/doc/felhom-agent/ for the README files."),
    ]);
    roff.to_writer(&mut page)?;
    man.render_version_section(&mut page)?;
    Ok(page)
}

/// COMMANDS: each subcommand with its own arguments and its help text (no `help`), and the
/// verbs below it (`journal refresh`, …) the same way.
fn commands_section(roff: &mut Roff, cmd: &clap::Command) {
    roff.control("SH", ["COMMANDS"]);
    command_entries(roff, cmd, "");
}

fn command_entries(roff: &mut Roff, cmd: &clap::Command, prefix: &str) {
    for sub in cmd.get_subcommands() {
        let name = sub.get_name();
        if name == "help" {
            continue;
        }
        let mut head: Vec<Inline> = vec![bold(format!("{prefix}{name}"))];
        for arg in sub.get_arguments() {
            if arg.is_global_set() || arg.is_hide_set() {
                continue;
            }
            head.push(roman(" "));
            if let Some(long) = arg.get_long() {
                head.push(bold(format!("--{long}")));
            }
            // A flag (--all, --stats, --keep) takes no value; only an option or a positional
            // argument shows one.
            if arg.get_action().takes_values() {
                let value = arg.get_value_names().and_then(|v| v.first()).map_or_else(
                    || arg.get_id().to_string().to_uppercase(),
                    |v| v.to_string(),
                );
                if arg.get_long().is_some() {
                    head.push(roman(" "));
                }
                head.push(italic(value));
            }
        }
        roff.control("TP", []);
        roff.text(head);
        let about = sub
            .get_long_about()
            .or_else(|| sub.get_about())
            .map(|s| s.to_string())
            .unwrap_or_default();
        roff.text([roman(about)]);
        command_entries(roff, sub, &format!("{prefix}{name} "));
    }
}

/// EXAMPLES (kept as aligned lines) and EXIT STATUS, from the command's after-help text:
/// "Examples:" and its lines, then the paragraphs after the first blank line.
fn after_help_sections(roff: &mut Roff, cmd: &clap::Command) {
    let Some(text) = cmd.get_after_long_help().or_else(|| cmd.get_after_help()) else {
        return;
    };
    let text = text.to_string();
    let mut blocks = text.split("\n\n");
    if let Some(first) = blocks.next() {
        let examples = first.strip_prefix("Examples:\n").unwrap_or(first);
        roff.control("SH", ["EXAMPLES"]);
        roff.control("nf", []);
        for line in examples.lines() {
            roff.text([roman(line.trim_start())]);
        }
        roff.control("fi", []);
    }
    let rest: Vec<&str> = blocks.collect();
    if !rest.is_empty() {
        roff.control("SH", ["EXIT STATUS"]);
        for (i, para) in rest.iter().enumerate() {
            if i > 0 {
                roff.control("PP", []);
            }
            roff.text([roman(para.replace('\n', " "))]);
        }
    }
}

/// FILES: what the package installs and where the agent keeps its state.
fn files_section(roff: &mut Roff) {
    roff.control("SH", ["FILES"]);
    for (path, what) in FILES {
        roff.control("TP", []);
        roff.text([italic(*path)]);
        roff.text([roman(*what)]);
    }
}
