//! Error codes shared by every crate, and the errors owned by `sb-common` itself.
//!
//! The closed [`ErrorCode`] set, its two mappings ([`ErrorCode::http_status`],
//! [`ErrorCode::disposition`]) and the [`HasErrorCode`] trait live in `sb-protocol` (runners
//! need them without tokio); they are re-exported here so host crates import one path.

pub use sb_protocol::error::{Disposition, ErrorCode, HasErrorCode};

/// A task was refused because the process is shutting down.
///
/// Returned by [`crate::shutdown::Shutdown::spawn`] once shutdown has begun, so work that
/// arrives late (a delivery consumed during the drain, a new HTTP request) is not started only
/// to be aborted moments later. Its code is `unavailable`: a message being handled is requeued
/// for another process, an HTTP caller gets 503 and may retry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("shutting down: refused to start task `{task}`")]
pub struct ShutdownError {
    /// Name of the task that was not started.
    pub task: String,
}

impl HasErrorCode for ShutdownError {
    fn code(&self) -> ErrorCode {
        ErrorCode::Unavailable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shutdown_error_is_retryable_elsewhere() {
        let err = ShutdownError {
            task: "relay".into(),
        };
        assert_eq!(err.code(), ErrorCode::Unavailable);
        assert_eq!(err.code().disposition(), Disposition::Retry);
        assert_eq!(
            err.to_string(),
            "shutting down: refused to start task `relay`"
        );
    }
}
