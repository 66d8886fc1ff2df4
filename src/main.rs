//! The `switchboard` binary: parses the command line and hands over to
//! [`switchboard::cli::run`].
//!
//! Everything else lives in the library (`switchboard::cli` and the role crates); this file
//! only wires.

use std::process::ExitCode;

use clap::Parser;
use switchboard::cli;

#[tokio::main]
async fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args).await {
        Ok(code) => code,
        Err(error) => {
            // `{:#}` prints the whole context chain on one line: "cannot connect: …: …".
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
