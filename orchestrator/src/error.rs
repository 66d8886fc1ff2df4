//! [`OrchestratorError`]: everything that can go wrong while handling one message, and its
//! protocol code. What happens to the message is decided from the code alone
//! ([`ErrorCode::disposition`], the project's one disposition mapping) by the consumer
//! loops' `sb_common::bus::consumer::settle_outcome`.

use sb_common::bus::{BatchPublishError, BusError};
use sb_common::error::ShutdownError;
use sb_common::group_commit::GroupCommitClosed;
use sb_common::session::SessionError;
use sb_protocol::error::{ErrorCode, HasErrorCode};
use sb_protocol::ids::{EventId, RunId};
use sb_protocol::messages::DecodeError;
use sb_store::StoreError;

use crate::catalog::CatalogError;

/// Result alias of the orchestrator.
pub type Result<T, E = OrchestratorError> = std::result::Result<T, E>;

/// Why handling a message failed.
#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    /// The database.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The message bus.
    #[error(transparent)]
    Bus(#[from] BusError),
    /// A batch publish.
    #[error(transparent)]
    BatchPublish(#[from] BatchPublishError),
    /// The session store.
    #[error(transparent)]
    Session(#[from] SessionError),
    /// An undecodable bus body.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The resource catalog.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    /// A task was refused because shutdown has begun.
    #[error(transparent)]
    Shutdown(#[from] ShutdownError),
    /// A group commit's task did not answer (its batch panicked, or shutdown).
    #[error(transparent)]
    GroupCommit(#[from] GroupCommitClosed),
    /// The event a message points to does not exist (in its workspace).
    #[error("event {0} not found")]
    EventNotFound(EventId),
    /// The stored event has no envelope, or one that does not decode.
    #[error("event {event_id} has no valid envelope: {reason}")]
    BadEnvelope {
        /// The event.
        event_id: EventId,
        /// What is wrong.
        reason: String,
    },
    /// A result names a run that does not exist.
    #[error("run {0} not found")]
    RunNotFound(RunId),
    /// Another orchestrator is routing the same event right now; the message is requeued
    /// and, by the time it comes back, that routing has finished (or its holder died).
    #[error("event {0} is being routed by another consumer")]
    RouteInProgress(EventId),
    /// Not handled because an earlier message of the same batch failed transiently; it is
    /// requeued so the items of a run are still applied in order.
    #[error("deferred behind an earlier message of the batch that failed")]
    Deferred,
}

impl OrchestratorError {
    /// Whether this failure means the ledger or the session store is unreachable right now
    /// (a connection failure, a restart in progress): retrying the same work later succeeds,
    /// and nothing else can succeed meanwhile. The result sink waits in place on these
    /// instead of requeueing (which would spend the message's delivery limit).
    #[must_use]
    pub fn is_backend_outage(&self) -> bool {
        match self {
            Self::Store(e) => e.is_transient(),
            Self::Session(e) => matches!(e, SessionError::Unavailable(_)),
            _ => false,
        }
    }
}

impl HasErrorCode for OrchestratorError {
    fn code(&self) -> ErrorCode {
        match self {
            Self::Store(e) => e.code(),
            Self::Bus(e) => e.code(),
            Self::BatchPublish(e) => e.code(),
            Self::Session(e) => e.code(),
            Self::Decode(e) => e.code(),
            Self::Catalog(e) => e.code(),
            Self::Shutdown(e) => e.code(),
            Self::GroupCommit(e) => e.code(),
            // A pointer to nothing: nothing to do, ever.
            Self::EventNotFound(_) | Self::RunNotFound(_) => ErrorCode::NotFound,
            // The message points to a broken record: keep it for an operator.
            Self::BadEnvelope { .. } => ErrorCode::InvalidArgument,
            Self::Deferred | Self::RouteInProgress(_) => ErrorCode::Unavailable,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sb_protocol::error::Disposition;

    #[test]
    fn dispositions() {
        let cases: [(OrchestratorError, Disposition); 5] = [
            (
                OrchestratorError::EventNotFound(EventId::new()),
                Disposition::Ack,
            ),
            (
                OrchestratorError::BadEnvelope {
                    event_id: EventId::new(),
                    reason: "x".into(),
                },
                Disposition::DeadLetter,
            ),
            (
                OrchestratorError::Bus(BusError::Unavailable("down".into())),
                Disposition::Retry,
            ),
            (
                OrchestratorError::Catalog(CatalogError("x".into())),
                Disposition::Retry,
            ),
            (
                OrchestratorError::Store(StoreError::Conflict("x".into())),
                Disposition::Ack,
            ),
        ];
        for (err, expected) in cases {
            assert_eq!(err.code().disposition(), expected, "{err}");
        }
    }
}
