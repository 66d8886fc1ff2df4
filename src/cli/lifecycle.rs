//! What every long-running command (`dev`, `gateway`, `orchestrator`, `worker`) does around
//! its roles once they run: a second ctrl-c during the drain exits at once, and the exit
//! status says whether a role failed on its own.

use std::process::ExitCode;

use sb_common::shutdown::Shutdown;

use crate::embedded::StopReport;

/// A second ctrl-c during the drain exits at once (runner processes see their stdin close
/// and stop on their own).
pub fn exit_on_second_signal(shutdown: &Shutdown) {
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        shutdown.cancelled().await;
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("interrupted again: exiting without finishing the drain");
            std::process::exit(130);
        }
    });
}

/// Success unless a role failed on its own.
pub fn exit_code(report: &StopReport) -> ExitCode {
    match &report.failure {
        Some(failure) => {
            eprintln!("error: {failure}");
            ExitCode::FAILURE
        }
        None => ExitCode::SUCCESS,
    }
}
