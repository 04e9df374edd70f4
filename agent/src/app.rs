//! Command dispatch: turns a parsed [`Cli`] into work and an [`ExitStatus`].
//!
//! Each command returns a [`CommandOutput`]: a JSON document (printed with `--json`), the
//! human text (printed otherwise) and the exit status. Progress goes to stderr through tracing.

use std::io::IsTerminal;

use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::cli::{Cli, Command, GlobalOpts, LogFormat, SelftestKind};
use crate::config::Config;
use crate::error::{ExitStatus, Failure};

/// What a command produced.
#[derive(Debug)]
pub struct CommandOutput {
    /// The `--json` document.
    pub json: serde_json::Value,
    /// What a person reads on stdout.
    pub human: String,
    /// The exit status.
    pub status: ExitStatus,
}

impl CommandOutput {
    /// The output of a failure that ended a command before it produced its own document.
    pub fn failure(f: &Failure) -> Self {
        Self {
            json: json!({"error": {"code": f.code.as_str(), "message": f.message}}),
            human: format!("error [{}]: {}", f.code, f.message),
            status: f.code.exit_status(),
        }
    }
}

/// Set up tracing on stderr: human lines (colour only on a terminal) or JSON lines, UTC
/// RFC 3339 timestamps; `-v` debug, `-vv` trace; `FELHOM_AGENT_LOG` overrides the filter.
pub fn init_tracing(global: &GlobalOpts) {
    use tracing_subscriber::fmt::time::UtcTime;
    use tracing_subscriber::EnvFilter;
    let level = match global.verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_env("FELHOM_AGENT_LOG")
        .unwrap_or_else(|_| EnvFilter::new(format!("warn,felhom_agent={level}")));
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .with_timer(UtcTime::rfc_3339());
    let _ = match global.log_format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Human | LogFormat::Auto => builder
            .with_ansi(std::io::stderr().is_terminal())
            .with_target(false)
            .try_init(),
    };
}

/// A token cancelled on SIGINT or SIGTERM.
pub fn shutdown_token() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return,
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::warn!("interrupted: stopping what runs and leaving the journal consistent");
        t.cancel();
    });
    token
}

fn usage(msg: &str) -> CommandOutput {
    CommandOutput {
        json: json!({"error": {"code": "usage", "message": msg}}),
        human: format!("usage error: {msg}\nsee `felhom-agent --help`"),
        status: ExitStatus::Usage,
    }
}

/// Load the config or produce the failure output.
pub fn load_config(global: &GlobalOpts) -> Result<Config, CommandOutput> {
    Config::load(&global.config).map_err(|f| CommandOutput::failure(&f))
}

/// Run the command line, print its output, and return the exit status.
pub fn run(cli: Cli) -> ExitStatus {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return ExitStatus::Environment;
        }
    };
    let json_out = cli.global.json;
    let out = runtime.block_on(dispatch(cli));
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(&out.json).unwrap_or_else(|_| "{}".to_string())
        );
    } else if !out.human.is_empty() {
        println!("{}", out.human.trim_end());
    }
    out.status
}

async fn dispatch(cli: Cli) -> CommandOutput {
    let selftest_opts_given = cli.selftest_opts.vmid.is_some()
        || cli.selftest_opts.from.is_some()
        || cli.selftest_opts.storage.is_some()
        || cli.selftest_opts.keep
        || cli.selftest_opts.dry_run;
    match (cli.selftest, cli.command) {
        (Some(_), Some(_)) => usage("--selftest cannot be combined with a command"),
        (None, None) => usage("no command given"),
        (None, Some(_)) if selftest_opts_given => {
            usage("--vmid/--from/--storage/--keep/--dry-run belong to --selftest (destroy takes its own --vmid after the command)")
        }
        (Some(kind), None) => {
            let cfg = match load_config(&cli.global) {
                Ok(c) => c,
                Err(out) => return out,
            };
            let reporter = crate::hub::runner::SpoolReporter::new(cfg.state_dir.clone());
            match kind {
                SelftestKind::Provision => {
                    crate::selftest::provision(&cfg, &cli.selftest_opts, &reporter, shutdown_token()).await
                }
                SelftestKind::Restore => {
                    if cli.selftest_opts.vmid.is_some() || cli.selftest_opts.from.is_some() || cli.selftest_opts.keep {
                        return usage("--selftest=restore picks its own vmid in the restore-test band and its backup from the rotation; it takes only --dry-run (and --storage is set in [restore_test])");
                    }
                    crate::restore_test::run(&cfg, cli.selftest_opts.dry_run, &reporter, shutdown_token()).await
                }
            }
        }
        (None, Some(cmd)) => {
            if let Command::Doctor = cmd {
                return crate::doctor::run(&cli.global).await;
            }
            let cfg = match load_config(&cli.global) {
                Ok(c) => c,
                Err(out) => return out,
            };
            let reporter = crate::hub::runner::SpoolReporter::new(cfg.state_dir.clone());
            match cmd {
                Command::Doctor => crate::doctor::run(&cli.global).await,
                Command::Guests => crate::commands::guests(&cfg).await,
                Command::VmidCheck { vmid } => crate::commands::vmid_check(&cfg, &vmid).await,
                Command::Journal => crate::commands::journal(&cfg),
                Command::Destroy { vmid } => crate::selftest::destroy(&cfg, &vmid, &reporter, shutdown_token()).await,
                Command::Run => crate::hub::run_command(&cfg).await,
            }
        }
    }
}
