//! Host-generated identifiers.
//!
//! Run, event and agent ids are UUID v7 newtypes: v7 is time ordered, so ids sort by creation
//! time and B-tree indexes on them stay append-mostly. They are separate types so a `RunId`
//! can never be passed where an `EventId` is expected. On the wire every id is a plain string
//! (`serde(transparent)`).
//!
//! Artifact ids, transcript ids and runner ids are *not* here: artifact and transcript ids are
//! plain strings (they can be caller supplied), and runner ids are structured
//! ([`crate::manifest::RunnerId`]).
//!
//! ```
//! use sb_protocol::ids::RunId;
//! let a = RunId::new();
//! let parsed: RunId = a.to_string().parse().unwrap();
//! assert_eq!(a, parsed);
//! ```

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

macro_rules! uuid_id {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
        #[serde(transparent)]
        pub struct $name(Uuid);

        impl $name {
            /// A fresh, time-ordered (UUID v7) id.
            #[must_use]
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }

            /// Wraps an existing UUID (e.g. one read back from the database).
            #[must_use]
            pub const fn from_uuid(uuid: Uuid) -> Self {
                Self(uuid)
            }

            /// The underlying UUID.
            #[must_use]
            pub const fn as_uuid(&self) -> &Uuid {
                &self.0
            }

            /// The underlying UUID, by value.
            #[must_use]
            pub const fn into_uuid(self) -> Uuid {
                self.0
            }
        }

        impl Default for $name {
            /// Same as [`Self::new`]: a fresh id, never a nil one.
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                // Hyphenated lowercase, the same text serde writes.
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl FromStr for $name {
            type Err = uuid::Error;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s).map(Self)
            }
        }

        impl From<Uuid> for $name {
            fn from(uuid: Uuid) -> Self {
                Self(uuid)
            }
        }

        impl From<$name> for Uuid {
            fn from(id: $name) -> Uuid {
                id.0
            }
        }
    };
}

uuid_id!(
    /// Identifies one run (`one event -> one binding -> one run_id -> one runner`).
    ///
    /// Also used as `runtime.trace_id` and as the key of the active-run session.
    RunId
);
uuid_id!(
    /// Identifies one event in the event log. Always host generated: a client-supplied
    /// `event_id` is only an idempotency key, never this primary key.
    EventId
);
uuid_id!(
    /// Identifies one product-level Agent (row of the `agents` table).
    AgentId
);

/// Maximum length of a workspace id, in bytes (the id columns are `varchar(255)`).
pub const MAX_WORKSPACE_ID_LEN: usize = 255;

/// A tenant. Free-form text chosen by the operator (e.g. `default`), validated to be
/// non-empty, at most [`MAX_WORKSPACE_ID_LEN`] bytes and free of whitespace and control
/// characters, because it appears in routing keys and log fields.
///
/// Deserialization applies the same validation, so an invalid id never enters the system.
///
/// ```
/// use sb_protocol::ids::WorkspaceId;
/// let ws: WorkspaceId = "default".parse().unwrap();
/// assert_eq!(ws, WorkspaceId::default_workspace());
/// assert!("".parse::<WorkspaceId>().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct WorkspaceId(String);

/// Why a workspace id was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkspaceIdError {
    /// The id was the empty string.
    #[error("workspace id must not be empty")]
    Empty,
    /// The id was longer than [`MAX_WORKSPACE_ID_LEN`] bytes.
    #[error("workspace id is {0} bytes long, the limit is {MAX_WORKSPACE_ID_LEN}")]
    TooLong(usize),
    /// The id contained whitespace or a control character.
    #[error("workspace id must not contain whitespace or control characters")]
    InvalidChar,
}

impl WorkspaceId {
    /// The id of the workspace that single-tenant deployments use.
    pub const DEFAULT: &'static str = "default";

    /// Validates and wraps `id`.
    pub fn new(id: impl Into<String>) -> Result<Self, WorkspaceIdError> {
        let id = id.into();
        if id.is_empty() {
            return Err(WorkspaceIdError::Empty);
        }
        if id.len() > MAX_WORKSPACE_ID_LEN {
            return Err(WorkspaceIdError::TooLong(id.len()));
        }
        if id.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(WorkspaceIdError::InvalidChar);
        }
        Ok(Self(id))
    }

    /// The `default` workspace.
    #[must_use]
    pub fn default_workspace() -> Self {
        Self(Self::DEFAULT.to_owned())
    }

    /// The id as text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkspaceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for WorkspaceId {
    type Err = WorkspaceIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl TryFrom<String> for WorkspaceId {
    type Error = WorkspaceIdError;

    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl From<WorkspaceId> for String {
    fn from(id: WorkspaceId) -> String {
        id.0
    }
}

impl AsRef<str> for WorkspaceId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_ids_are_v7_and_roundtrip_as_strings() {
        let id = RunId::new();
        assert_eq!(id.as_uuid().get_version_num(), 7);
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, format!("\"{id}\""));
        let back: RunId = serde_json::from_str(&json).unwrap();
        assert_eq!(back, id);
        assert_eq!(id.to_string().parse::<RunId>().unwrap(), id);
    }

    #[test]
    fn uuid_ids_are_time_ordered() {
        let a = EventId::new();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = EventId::new();
        assert!(a < b);
    }

    #[test]
    fn uuid_id_rejects_garbage() {
        assert!("not-a-uuid".parse::<AgentId>().is_err());
        assert!(serde_json::from_str::<AgentId>("\"nope\"").is_err());
    }

    #[test]
    fn workspace_id_validation() {
        assert_eq!(WorkspaceId::new("").unwrap_err(), WorkspaceIdError::Empty);
        assert_eq!(
            WorkspaceId::new("a b").unwrap_err(),
            WorkspaceIdError::InvalidChar
        );
        assert_eq!(
            WorkspaceId::new("a\n").unwrap_err(),
            WorkspaceIdError::InvalidChar
        );
        assert_eq!(
            WorkspaceId::new("x".repeat(256)).unwrap_err(),
            WorkspaceIdError::TooLong(256)
        );
        assert!(WorkspaceId::new("x".repeat(255)).is_ok());
        assert!(serde_json::from_str::<WorkspaceId>("\"\"").is_err());
        let ws: WorkspaceId = serde_json::from_str("\"acme\"").unwrap();
        assert_eq!(ws.as_str(), "acme");
        assert_eq!(serde_json::to_string(&ws).unwrap(), "\"acme\"");
    }
}
