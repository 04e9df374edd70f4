//! Command dispatch: turns a parsed [`Cli`] into work and an [`ExitStatus`].

use crate::cli::{Cli, GlobalOpts};
use crate::error::ExitStatus;

/// Set up tracing on stderr.
pub fn init_tracing(_global: &GlobalOpts) {}

/// Run the command line and return the exit status.
pub fn run(_cli: Cli) -> ExitStatus {
    ExitStatus::Usage
}
