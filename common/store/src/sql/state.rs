//! [`StateStore`] and [`BlobStorage`] on SQL.

use std::collections::BTreeMap;

use async_trait::async_trait;
use sea_orm::sea_query::{Expr, ExprTrait as _, Func, OnConflict};
use sea_orm::{
    ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect, Set,
};
use serde_json::Value;

use super::entity::{agent_state, storage};
use super::{ID_LEN, SqlStore, UniqueRow, check_required, now};
use crate::error::{Result, StoreError};
use crate::page::{CursorKind, MAX_PAGE_LIMIT, Page, clamp_limit, decode_key, encode_key};
use crate::state::{
    BlobStorage, DEFAULT_STATE_LIST_LIMIT, MAX_KEY_CHARS, MAX_SCOPE_KEY_CHARS, StateEntry,
    StateStore, StateWrite,
};

fn check_state_key(scope_key: &str, key: &str) -> Result<()> {
    check_required("scope_key", scope_key, MAX_SCOPE_KEY_CHARS)?;
    check_required("key", key, MAX_KEY_CHARS)
}

fn check_storage_key(owner_type: &str, owner: &str, key: &str) -> Result<()> {
    check_required("owner_type", owner_type, 32)?;
    check_required("owner", owner, ID_LEN)?;
    check_required("key", key, MAX_KEY_CHARS)
}

/// Filters `column` to values that start with `prefix`, literally and bytewise: a range
/// scan start plus an exact comparison of the leading characters (no `LIKE`, whose
/// wildcards and case rules differ between backends).
fn starts_with<C: ColumnTrait>(column: C, prefix: &str) -> sea_orm::Condition {
    // Callers reject prefixes longer than a key, so this fits (and PG wants `integer`).
    let len = i32::try_from(prefix.chars().count()).unwrap_or(i32::MAX);
    sea_orm::Condition::all().add(column.gte(prefix)).add(
        Func::cust("substr")
            .arg(Expr::col(column))
            .arg(1)
            .arg(len)
            .eq(prefix),
    )
}

#[async_trait]
impl StateStore for SqlStore {
    async fn get(&self, scope_key: &str, key: &str) -> Result<Option<StateEntry>> {
        check_state_key(scope_key, key)?;
        Ok(
            agent_state::Entity::find_by_id((scope_key.to_owned(), key.to_owned()))
                .all(&self.db)
                .await?
                .unique_row()
                .map(|m| StateEntry {
                    value: m.value,
                    revision: m.revision,
                    updated_at: m.updated_at,
                }),
        )
    }

    async fn set(&self, write: StateWrite) -> Result<i64> {
        check_state_key(&write.scope_key, &write.key)?;
        check_required("scope", &write.scope, 32)?;
        // serde_json writes compact JSON and leaves non-ASCII unescaped: exactly the size
        // the limit is defined on.
        let size = serde_json::to_vec(&write.value)
            .map_err(|e| StoreError::invalid(format!("value is not JSON-serializable: {e}")))?
            .len();
        let max = self.limits.max_state_value_bytes;
        if size > max {
            return Err(StoreError::PayloadTooLarge(format!(
                "value size {size} bytes exceeds limit {max} bytes"
            )));
        }
        let now = now();
        let conflict = || {
            StoreError::Conflict(format!(
                "state key {} was modified concurrently (revision mismatch)",
                write.key
            ))
        };
        match write.if_revision {
            Some(n) if n < 0 => Err(StoreError::invalid("if_revision must be >= 0")),
            Some(0) => {
                let row = agent_state::ActiveModel {
                    scope_key: Set(write.scope_key.clone()),
                    key: Set(write.key.clone()),
                    scope: Set(write.scope.clone()),
                    value: Set(write.value),
                    revision: Set(1),
                    created_at: Set(now),
                    updated_at: Set(now),
                };
                let inserted = agent_state::Entity::insert(row)
                    .on_conflict(
                        OnConflict::columns([
                            agent_state::Column::ScopeKey,
                            agent_state::Column::Key,
                        ])
                        .do_nothing()
                        .to_owned(),
                    )
                    .exec_without_returning(self.writer())
                    .await?;
                if inserted == 1 {
                    Ok(1)
                } else {
                    Err(conflict())
                }
            }
            Some(expected) => {
                let rows = agent_state::Entity::update_many()
                    .col_expr(agent_state::Column::Value, Expr::value(write.value))
                    .col_expr(agent_state::Column::Scope, Expr::value(write.scope.clone()))
                    .col_expr(agent_state::Column::Revision, Expr::value(expected + 1))
                    .col_expr(agent_state::Column::UpdatedAt, Expr::value(now))
                    .filter(agent_state::Column::ScopeKey.eq(write.scope_key.clone()))
                    .filter(agent_state::Column::Key.eq(write.key.clone()))
                    .filter(agent_state::Column::Revision.eq(expected))
                    .exec(self.writer())
                    .await?;
                if rows.rows_affected == 1 {
                    Ok(expected + 1)
                } else {
                    Err(conflict())
                }
            }
            None => {
                // One statement: insert, or bump the existing row's revision. Two concurrent
                // first writes both succeed (one inserts, the other updates).
                let row = agent_state::ActiveModel {
                    scope_key: Set(write.scope_key.clone()),
                    key: Set(write.key.clone()),
                    scope: Set(write.scope.clone()),
                    value: Set(write.value),
                    revision: Set(1),
                    created_at: Set(now),
                    updated_at: Set(now),
                };
                let model = agent_state::Entity::insert(row)
                    .on_conflict(
                        OnConflict::columns([
                            agent_state::Column::ScopeKey,
                            agent_state::Column::Key,
                        ])
                        .update_columns([
                            agent_state::Column::Value,
                            agent_state::Column::Scope,
                            agent_state::Column::UpdatedAt,
                        ])
                        .value(
                            agent_state::Column::Revision,
                            Expr::col((agent_state::Entity, agent_state::Column::Revision)).add(1),
                        )
                        .to_owned(),
                    )
                    .exec_with_returning(self.writer())
                    .await?;
                Ok(model.revision)
            }
        }
    }

    async fn delete(&self, scope_key: &str, key: &str, if_revision: Option<i64>) -> Result<bool> {
        check_state_key(scope_key, key)?;
        let mut delete = agent_state::Entity::delete_many()
            .filter(agent_state::Column::ScopeKey.eq(scope_key))
            .filter(agent_state::Column::Key.eq(key));
        if let Some(expected) = if_revision {
            delete = delete.filter(agent_state::Column::Revision.eq(expected));
        }
        let res = delete.exec(self.writer()).await?;
        if if_revision.is_some() && res.rows_affected == 0 {
            return Err(StoreError::Conflict(format!(
                "state key {key} does not have the expected revision"
            )));
        }
        Ok(res.rows_affected > 0)
    }

    async fn list(
        &self,
        scope_key: &str,
        prefix: Option<&str>,
        cursor: Option<&str>,
        limit: Option<i64>,
    ) -> Result<Page<String>> {
        check_required("scope_key", scope_key, MAX_SCOPE_KEY_CHARS)?;
        let limit = clamp_limit(limit, DEFAULT_STATE_LIST_LIMIT, MAX_PAGE_LIMIT);
        let mut select = agent_state::Entity::find()
            .select_only()
            .column(agent_state::Column::Key)
            .filter(agent_state::Column::ScopeKey.eq(scope_key));
        if let Some(prefix) = prefix.filter(|p| !p.is_empty()) {
            if prefix.chars().count() > MAX_KEY_CHARS {
                return Ok(Page::empty());
            }
            select = select.filter(starts_with(agent_state::Column::Key, prefix));
        }
        if let Some(cursor) = cursor {
            let after = decode_key(CursorKind::StateKey, cursor)?;
            select = select.filter(agent_state::Column::Key.gt(after));
        }
        let keys: Vec<String> = select
            .order_by_asc(agent_state::Column::Key)
            .limit(limit + 1)
            .into_tuple()
            .all(&self.db)
            .await?;
        Ok(Page::from_overfetch(keys, limit, |k| {
            encode_key(CursorKind::StateKey, k)
        }))
    }

    async fn snapshot(&self, scope_key: &str) -> Result<BTreeMap<String, Value>> {
        check_required("scope_key", scope_key, MAX_SCOPE_KEY_CHARS)?;
        let rows: Vec<(String, Value)> = agent_state::Entity::find()
            .select_only()
            .column(agent_state::Column::Key)
            .column(agent_state::Column::Value)
            .filter(agent_state::Column::ScopeKey.eq(scope_key))
            .into_tuple()
            .all(&self.db)
            .await?;
        Ok(rows.into_iter().collect())
    }

    async fn snapshots(
        &self,
        scope_keys: &[String],
    ) -> Result<BTreeMap<String, BTreeMap<String, Value>>> {
        check_scope_keys(scope_keys)?;
        scope_values(&self.db, scope_keys).await
    }
}

#[async_trait]
impl BlobStorage for SqlStore {
    async fn get(&self, owner_type: &str, owner: &str, key: &str) -> Result<Option<Vec<u8>>> {
        check_storage_key(owner_type, owner, key)?;
        Ok(
            storage::Entity::find_by_id((owner_type.to_owned(), owner.to_owned(), key.to_owned()))
                .all(&self.db)
                .await?
                .unique_row()
                .map(|m| m.value),
        )
    }

    async fn set(&self, owner_type: &str, owner: &str, key: &str, value: Vec<u8>) -> Result<()> {
        check_storage_key(owner_type, owner, key)?;
        if let Some(max) = self.limits.max_storage_value_bytes {
            if value.len() > max {
                return Err(StoreError::PayloadTooLarge(format!(
                    "storage value exceeds limit ({} > {max} bytes)",
                    value.len()
                )));
            }
        }
        storage::Entity::insert(storage::ActiveModel {
            owner_type: Set(owner_type.to_owned()),
            owner: Set(owner.to_owned()),
            key: Set(key.to_owned()),
            value: Set(value),
            updated_at: Set(now()),
        })
        .on_conflict(
            OnConflict::columns([
                storage::Column::OwnerType,
                storage::Column::Owner,
                storage::Column::Key,
            ])
            .update_columns([storage::Column::Value, storage::Column::UpdatedAt])
            .to_owned(),
        )
        .exec_without_returning(self.writer())
        .await?;
        Ok(())
    }

    async fn delete(&self, owner_type: &str, owner: &str, key: &str) -> Result<bool> {
        check_storage_key(owner_type, owner, key)?;
        let res = storage::Entity::delete_many()
            .filter(storage::Column::OwnerType.eq(owner_type))
            .filter(storage::Column::Owner.eq(owner))
            .filter(storage::Column::Key.eq(key))
            .exec(self.writer())
            .await?;
        Ok(res.rows_affected > 0)
    }

    async fn keys(&self, owner_type: &str, owner: &str) -> Result<Vec<String>> {
        check_required("owner_type", owner_type, 32)?;
        check_required("owner", owner, ID_LEN)?;
        Ok(storage::Entity::find()
            .select_only()
            .column(storage::Column::Key)
            .filter(storage::Column::OwnerType.eq(owner_type))
            .filter(storage::Column::Owner.eq(owner))
            .order_by_asc(storage::Column::Key)
            .into_tuple()
            .all(&self.db)
            .await?)
    }
}

/// Checks scope keys as [`StateStore::snapshots`] takes them.
pub(super) fn check_scope_keys(scope_keys: &[String]) -> Result<()> {
    scope_keys
        .iter()
        .try_for_each(|scope_key| check_required("scope_key", scope_key, MAX_SCOPE_KEY_CHARS))
}

/// Every value of each of `scope_keys` (checked), on `db` (also read by a run start); a
/// scope without values is present and empty.
pub(super) async fn scope_values<C: ConnectionTrait>(
    db: &C,
    scope_keys: &[String],
) -> Result<BTreeMap<String, BTreeMap<String, Value>>> {
    let mut out: BTreeMap<String, BTreeMap<String, Value>> = scope_keys
        .iter()
        .map(|scope_key| (scope_key.clone(), BTreeMap::new()))
        .collect();
    if scope_keys.is_empty() {
        return Ok(out);
    }
    let rows: Vec<(String, String, Value)> = scope_rows_select(scope_keys.iter().cloned())
        .into_tuple()
        .all(db)
        .await?;
    for (scope_key, key, value) in rows {
        out.entry(scope_key).or_default().insert(key, value);
    }
    Ok(out)
}

/// The select of [`scope_values`]: the `scope_key`, `key` and `value` of every row of the
/// scopes.
pub(super) fn scope_rows_select(
    scope_keys: impl IntoIterator<Item = String>,
) -> sea_orm::Select<agent_state::Entity> {
    agent_state::Entity::find()
        .select_only()
        .column(agent_state::Column::ScopeKey)
        .column(agent_state::Column::Key)
        .column(agent_state::Column::Value)
        .filter(agent_state::Column::ScopeKey.is_in(scope_keys))
}
