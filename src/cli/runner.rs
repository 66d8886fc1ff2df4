//! `switchboard runner <NAME>` (hidden): serves a runner built into the binary
//! ([`crate::builtin`]) on stdin/stdout, for the worker that starts it.

use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, ValueEnum};

/// `switchboard runner <NAME>` (hidden): serves a runner built into this binary on
/// stdin/stdout. The worker starts it; nothing else may be written to stdout.
#[derive(Debug, Clone, Args)]
pub struct RunnerArgs {
    /// The built-in runner.
    #[arg(value_enum)]
    pub name: BuiltinRunner,
}

/// Runners built into the binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BuiltinRunner {
    /// The echo runner (`plugin:switchboard/echo/default`).
    Echo,
    /// The local agent (`plugin:switchboard/local-agent/default`).
    LocalAgent,
}

/// Serves a built-in runner until the host ends it.
pub async fn runner(args: RunnerArgs) -> anyhow::Result<ExitCode> {
    let serve = match args.name {
        BuiltinRunner::Echo => crate::builtin::serve_echo,
        BuiltinRunner::LocalAgent => crate::builtin::serve_local_agent,
    };
    tokio::task::spawn_blocking(serve)
        .await
        .context("the runner thread failed")?
        .context("runner i/o")?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    #[test]
    fn the_hidden_runner_command_parses() {
        let cli = Cli::try_parse_from(["switchboard", "runner", "echo"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Runner(RunnerArgs {
                name: BuiltinRunner::Echo
            })
        ));
        let cli = Cli::try_parse_from(["switchboard", "runner", "local-agent"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Runner(RunnerArgs {
                name: BuiltinRunner::LocalAgent
            })
        ));
        assert!(Cli::try_parse_from(["switchboard", "runner", "nope"]).is_err());
    }
}
