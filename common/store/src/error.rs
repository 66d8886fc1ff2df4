//! The one error type of the store boundary and its mapping to protocol error codes.

use sb_protocol::error::{ErrorCode, HasErrorCode};
use sea_orm::{DbErr, RuntimeErr};

/// Result alias for store operations.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Every way a store operation can fail.
///
/// The variants other than [`StoreError::Database`] and [`StoreError::Corrupt`] are
/// *expected* outcomes that callers branch on (a missing row, a lost compare-and-set, a value
/// over its cap); their messages are written for the end user and are safe to return as is.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The addressed row does not exist (or has expired, for artifacts).
    #[error("{0}")]
    NotFound(String),
    /// The write collides with existing state: a duplicate unique key, or a
    /// compare-and-set whose expected revision did not match.
    #[error("{0}")]
    Conflict(String),
    /// An argument is malformed: a bad cursor, a negative offset, an over-long key, a
    /// declared sha256/size that does not match the bytes.
    #[error("{0}")]
    InvalidArgument(String),
    /// A value is over its configured size cap.
    #[error("{0}")]
    PayloadTooLarge(String),
    /// A stored row cannot be decoded (an unknown status string, a malformed id): a bug or
    /// a schema written by something else.
    #[error("stored data is invalid: {0}")]
    Corrupt(String),
    /// The database failed. Connection-level failures map to `unavailable` (retry later);
    /// anything else to `internal`.
    #[error("database error: {0}")]
    Database(#[from] DbErr),
}

impl StoreError {
    pub(crate) fn not_found(what: impl std::fmt::Display) -> Self {
        Self::NotFound(format!("{what} not found"))
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        Self::InvalidArgument(msg.into())
    }

    /// Whether retrying the same operation later can succeed (the database was unreachable,
    /// busy, or aborted the transaction because of a concurrent one).
    #[must_use]
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Database(err) if db_err_is_transient(err))
    }
}

impl HasErrorCode for StoreError {
    fn code(&self) -> ErrorCode {
        match self {
            Self::NotFound(_) => ErrorCode::NotFound,
            Self::Conflict(_) => ErrorCode::Conflict,
            Self::InvalidArgument(_) => ErrorCode::InvalidArgument,
            Self::PayloadTooLarge(_) => ErrorCode::PayloadTooLarge,
            Self::Corrupt(_) => ErrorCode::Internal,
            Self::Database(err) if db_err_is_transient(err) => ErrorCode::Unavailable,
            Self::Database(_) => ErrorCode::Internal,
        }
    }
}

/// Connection loss, pool exhaustion, SQLite `BUSY`/`LOCKED`, and Postgres serialization
/// failures / deadlocks / admin shutdowns are transient; everything else is not.
fn db_err_is_transient(err: &DbErr) -> bool {
    match err {
        DbErr::ConnectionAcquire(_) | DbErr::Conn(_) => true,
        DbErr::Exec(RuntimeErr::SqlxError(e)) | DbErr::Query(RuntimeErr::SqlxError(e)) => {
            use sea_orm::sqlx::Error as E;
            match e.as_ref() {
                E::Io(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed => true,
                E::Database(db) => {
                    let code = db.code().unwrap_or_default();
                    matches!(
                        code.as_ref(),
                        // SQLite: BUSY, LOCKED (primary codes and extended variants).
                        "5" | "6" | "261" | "517" | "262"
                        // Postgres: serialization_failure, deadlock_detected,
                        // admin/crash shutdown, cannot_connect_now.
                        | "40001" | "40P01" | "57P01" | "57P02" | "57P03"
                    ) || code.starts_with("08")
                }
                _ => false,
            }
        }
        _ => false,
    }
}

/// The unique-constraint violation inside `err`, if that is what it is.
pub(crate) fn is_unique_violation(err: &DbErr) -> bool {
    matches!(
        err.sql_err(),
        Some(sea_orm::SqlErr::UniqueConstraintViolation(_))
    )
}

/// The foreign-key violation inside `err`, if that is what it is.
pub(crate) fn is_foreign_key_violation(err: &DbErr) -> bool {
    matches!(
        err.sql_err(),
        Some(sea_orm::SqlErr::ForeignKeyConstraintViolation(_))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_outcomes_map_to_their_codes() {
        assert_eq!(StoreError::not_found("run x").code(), ErrorCode::NotFound);
        assert_eq!(
            StoreError::not_found("run x").to_string(),
            "run x not found"
        );
        assert_eq!(StoreError::Conflict("c".into()).code(), ErrorCode::Conflict);
        assert_eq!(
            StoreError::invalid("bad").code(),
            ErrorCode::InvalidArgument
        );
        assert_eq!(
            StoreError::PayloadTooLarge("big".into()).code(),
            ErrorCode::PayloadTooLarge
        );
        assert_eq!(StoreError::Corrupt("x".into()).code(), ErrorCode::Internal);
    }

    #[test]
    fn connection_failures_are_unavailable_and_others_internal() {
        let acquire =
            StoreError::Database(DbErr::ConnectionAcquire(sea_orm::ConnAcquireErr::Timeout));
        assert_eq!(acquire.code(), ErrorCode::Unavailable);
        assert!(acquire.is_transient());
        let other = StoreError::Database(DbErr::Custom("boom".into()));
        assert_eq!(other.code(), ErrorCode::Internal);
        assert!(!other.is_transient());
    }
}
