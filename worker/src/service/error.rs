//! [`WorkerError`]: why a worker could not start (once started, every failure is a run's
//! terminal item or a delivery's settlement instead).

use sb_common::bus::BusError;
use sb_common::error::ShutdownError;
use sb_protocol::error::{ErrorCode, HasErrorCode};
use sb_store::StoreError;

use crate::runner::SandboxError;

/// Why the worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A runner could not be registered in the `runners` table.
    #[error("cannot register runner {runner_id}: {source}")]
    Register {
        /// The runner.
        runner_id: String,
        /// The store failure.
        #[source]
        source: StoreError,
    },
    /// A runner's manifest does not make a valid descriptor.
    #[error("runner {runner_id} has an invalid descriptor: {reason}")]
    Descriptor {
        /// The runner.
        runner_id: String,
        /// What is wrong.
        reason: String,
    },
    /// The topology could not be declared or a queue consumed.
    #[error("cannot set up {what}: {source}")]
    Bus {
        /// Which queue or step.
        what: String,
        /// The bus failure.
        #[source]
        source: BusError,
    },
    /// The worker could not protect itself from its runners (SPEC §14).
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    /// Shutdown had already begun.
    #[error(transparent)]
    Shutdown(#[from] ShutdownError),
}

impl HasErrorCode for WorkerError {
    fn code(&self) -> ErrorCode {
        match self {
            Self::Register { source, .. } => source.code(),
            Self::Descriptor { .. } => ErrorCode::InvalidArgument,
            Self::Bus { source, .. } => source.code(),
            Self::Sandbox(source) => source.code(),
            Self::Shutdown(_) => ErrorCode::Unavailable,
        }
    }
}
