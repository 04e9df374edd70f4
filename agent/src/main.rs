//! The `felhom-agent` binary: parse, init tracing, run, map the outcome to an exit code.

#![deny(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = match felhom_agent::cli::parse_from(std::env::args_os()) {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    felhom_agent::cli::init_tracing_for(&cli);
    felhom_agent::cli::harden_process();
    let status = felhom_agent::cli::run(cli);
    ExitCode::from(status.code())
}
