//! Errors of the runner host boundary.

use sb_protocol::error::{ErrorCode, HasErrorCode};
use sb_protocol::ids::RunId;

use super::sandbox::SandboxError;

/// Why a run could not be started (once started, every failure is a `run.failed` item in
/// the run's stream instead).
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    /// The runner executable could not be started.
    #[error("cannot start runner program `{program}`: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// The runner process could not be confined (SPEC §14), so it was not started.
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    /// The host is shutting down and takes no new runs.
    #[error("runner host is shutting down")]
    ShuttingDown,
    /// The run id is already active on this host.
    #[error("run {0} is already active")]
    DuplicateRun(RunId),
}

impl HasErrorCode for RunnerError {
    fn code(&self) -> ErrorCode {
        match self {
            // Both are transient from the job's point of view: another worker (or this one,
            // later) can take the run.
            Self::Spawn { .. } | Self::ShuttingDown => ErrorCode::Unavailable,
            Self::DuplicateRun(_) => ErrorCode::Conflict,
            Self::Sandbox(e) => e.code(),
        }
    }
}
