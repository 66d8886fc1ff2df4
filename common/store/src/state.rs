//! Scoped agent state (small JSON values with a compare-and-set revision) and plugin /
//! workspace binary storage.

use std::collections::BTreeMap;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::Result;
use crate::page::Page;

/// Default cap of one state value: 256 KiB of UTF-8 JSON.
pub const DEFAULT_MAX_STATE_VALUE_BYTES: usize = 256 * 1024;
/// Default cap of one storage value: 10 MiB.
pub const DEFAULT_MAX_STORAGE_VALUE_BYTES: usize = 10 * 1024 * 1024;
/// Longest state key / storage key, in characters.
pub const MAX_KEY_CHARS: usize = 255;
/// Longest state scope key, in characters.
pub const MAX_SCOPE_KEY_CHARS: usize = 512;
/// Page size of `StateStore::list` when the caller gives none (also its cap).
pub const DEFAULT_STATE_LIST_LIMIT: u64 = 100;

/// A stored state value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateEntry {
    /// The value.
    pub value: Value,
    /// Its revision: 1 when created, +1 on every write.
    pub revision: i64,
    /// Last write.
    pub updated_at: DateTime<Utc>,
}

/// A state write.
#[derive(Debug, Clone, PartialEq)]
pub struct StateWrite {
    /// `<scope>:v2:<sha256>` (≤ 512 chars); computed by the caller from the run's identity.
    pub scope_key: String,
    /// `conversation`, `actor`, `subject` or `runner`.
    pub scope: String,
    /// The key (1–255 chars).
    pub key: String,
    /// The value (≤ the configured cap, measured as UTF-8 JSON).
    pub value: Value,
    /// Compare-and-set: `None` = unconditional; `Some(0)` = the key must not exist;
    /// `Some(n)` = the stored revision must be `n`.
    pub if_revision: Option<i64>,
}

/// Scoped, small JSON state of agents (SPEC §9; host-behaviour §10).
///
/// # Contract
///
/// - **Revisions.** Every write returns the new revision: 1 for a new key, the previous
///   revision + 1 otherwise. Writes with `if_revision` are compare-and-set: when the stored
///   revision (0 for a missing key) differs, the write is `conflict` and changes nothing.
///   Unconditional writes never fail because of a concurrent writer.
/// - **Size.** A value larger than the cap (default 256 KiB), measured as compact UTF-8 JSON
///   with non-ASCII characters unescaped, is `payload_too_large`.
/// - **Listing** returns keys in bytewise ascending order, optionally only those starting
///   with `prefix` (matched literally: `%` and `_` are not wildcards), paged by an opaque
///   cursor; the limit is clamped to [1, 100], default 100.
#[async_trait]
pub trait StateStore: Send + Sync + 'static {
    /// The entry, if any.
    async fn get(&self, scope_key: &str, key: &str) -> Result<Option<StateEntry>>;

    /// Writes a value (see the contract). Returns the new revision.
    async fn set(&self, write: StateWrite) -> Result<i64>;

    /// Deletes a key. With `if_revision = Some(n)` the stored revision must be `n`
    /// (otherwise `conflict`, also when the key is missing). `true` if a value was deleted.
    async fn delete(&self, scope_key: &str, key: &str, if_revision: Option<i64>) -> Result<bool>;

    /// One page of keys of a scope.
    async fn list(
        &self,
        scope_key: &str,
        prefix: Option<&str>,
        cursor: Option<&str>,
        limit: Option<i64>,
    ) -> Result<Page<String>>;

    /// Every value of a scope, for the context builder's state snapshot.
    async fn snapshot(&self, scope_key: &str) -> Result<BTreeMap<String, Value>>;

    /// [`snapshot`](Self::snapshot) of each of `scope_keys` in one read (routing reads up to
    /// one scope per state scope for every event): a scope without values maps to an empty
    /// map, so the result has an entry for every key asked for.
    async fn snapshots(
        &self,
        scope_keys: &[String],
    ) -> Result<BTreeMap<String, BTreeMap<String, Value>>>;
}

/// Binary key/value storage owned by a plugin or a workspace (SPEC §9 `storage`).
///
/// # Contract
///
/// - Values are opaque bytes up to the configured cap (default 10 MiB; `None` = no cap);
///   a larger value is `payload_too_large` and nothing is written.
/// - `set` overwrites; `keys` returns the owner's keys in bytewise ascending order.
/// - Owners never see each other's keys: every operation is scoped by
///   `(owner_type, owner)`.
#[async_trait]
pub trait BlobStorage: Send + Sync + 'static {
    /// The value, if any.
    async fn get(&self, owner_type: &str, owner: &str, key: &str) -> Result<Option<Vec<u8>>>;

    /// Writes a value.
    async fn set(&self, owner_type: &str, owner: &str, key: &str, value: Vec<u8>) -> Result<()>;

    /// Deletes a value; `true` if one existed.
    async fn delete(&self, owner_type: &str, owner: &str, key: &str) -> Result<bool>;

    /// The owner's keys.
    async fn keys(&self, owner_type: &str, owner: &str) -> Result<Vec<String>>;
}
