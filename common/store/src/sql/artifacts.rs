//! [`ArtifactStore`] on SQL: metadata in `artifacts`, inline bytes in `artifact_blobs`.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sb_protocol::ids::RunId;
use sea_orm::sea_query::Expr;
use sea_orm::{
    ColumnTrait, Condition, DbBackend, EntityTrait, QueryFilter, QueryOrder, QuerySelect, Set,
};
use sha2::{Digest, Sha256};

use super::entity::{artifact, artifact_blob};
use super::{
    ID_LEN, SqlStore, UniqueRow, check_len_opt, check_required, metadata_in, metadata_out, now,
    workspace,
};
use crate::artifacts::{
    ArtifactContent, ArtifactRead, ArtifactRecord, ArtifactStore, DEFAULT_ARTIFACT_READ_BYTES,
    MAX_ARTIFACT_READ_BYTES, NewArtifact, STORAGE_INLINE,
};
use crate::error::{Result, StoreError, is_unique_violation};

fn record(m: artifact::Model) -> Result<ArtifactRecord> {
    Ok(ArtifactRecord {
        id: m.id,
        workspace_id: workspace(m.workspace_id)?,
        artifact_type: m.artifact_type,
        mime_type: m.mime_type,
        name: m.name,
        size_bytes: m.size_bytes,
        sha256: m.sha256,
        source: m.source,
        scope: m
            .scope
            .parse()
            .map_err(|e: StoreError| StoreError::Corrupt(e.to_string()))?,
        storage_type: m.storage_type,
        storage_key: m.storage_key,
        conversation_id: m.conversation_id,
        thread_id: m.thread_id,
        bot_id: m.bot_id,
        run_id: m.run_id.map(RunId::from_uuid),
        runner_id: m.runner_id,
        metadata: metadata_out(m.metadata),
        expires_at: m.expires_at,
        created_at: m.created_at,
    })
}

fn is_hex_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

impl SqlStore {
    /// A live (not expired) artifact row.
    async fn live_artifact(&self, id: &str) -> Result<artifact::Model> {
        let now = now();
        artifact::Entity::find_by_id(id.to_owned())
            .filter(
                Condition::any()
                    .add(artifact::Column::ExpiresAt.is_null())
                    .add(artifact::Column::ExpiresAt.gt(now)),
            )
            .all(&self.db)
            .await?
            .unique_row()
            .ok_or_else(|| StoreError::not_found(format!("artifact {id}")))
    }
}

#[async_trait]
impl ArtifactStore for SqlStore {
    async fn put(&self, new: NewArtifact) -> Result<ArtifactRecord> {
        check_required("artifact_type", &new.artifact_type, 50)?;
        check_required("source", &new.source, 50)?;
        for (field, value) in [
            ("mime_type", &new.mime_type),
            ("name", &new.name),
            ("conversation_id", &new.conversation_id),
            ("thread_id", &new.thread_id),
            ("bot_id", &new.bot_id),
            ("runner_id", &new.runner_id),
        ] {
            check_len_opt(field, value.as_deref(), ID_LEN)?;
        }
        let declared_sha = new.declared_sha256.map(|s| s.to_ascii_lowercase());
        if let Some(sha) = &declared_sha {
            if !is_hex_sha256(sha) {
                return Err(StoreError::invalid(
                    "sha256 must be 64 hexadecimal characters",
                ));
            }
        }
        if matches!(new.declared_size, Some(n) if n < 0) {
            return Err(StoreError::invalid("size must be >= 0"));
        }
        let (storage_type, storage_key) = new.content.storage();
        let (sha256, size_bytes, bytes) = match new.content {
            ArtifactContent::Inline(bytes) => {
                if bytes.len() > self.limits.max_artifact_bytes {
                    return Err(StoreError::PayloadTooLarge(format!(
                        "artifact content size {} bytes exceeds limit {} bytes",
                        bytes.len(),
                        self.limits.max_artifact_bytes
                    )));
                }
                let computed = hex::encode(Sha256::digest(&bytes));
                if let Some(declared) = &declared_sha {
                    if *declared != computed {
                        return Err(StoreError::invalid(format!(
                            "sha256 mismatch: declared {declared}, content has {computed}"
                        )));
                    }
                }
                let size = bytes.len() as i64;
                if let Some(declared) = new.declared_size {
                    if declared != size {
                        return Err(StoreError::invalid(format!(
                            "size mismatch: declared {declared} bytes, content has {size} bytes"
                        )));
                    }
                }
                (Some(computed), Some(size), Some(bytes))
            }
            // External content cannot be verified here; declared values are kept as given.
            _ => (declared_sha, new.declared_size, None),
        };
        let id = match new.id {
            Some(id) => {
                check_required("artifact id", &id, ID_LEN)?;
                id
            }
            None => uuid::Uuid::new_v4().to_string(),
        };
        let row = artifact::ActiveModel {
            id: Set(id.clone()),
            workspace_id: Set(new.workspace_id.as_str().to_owned()),
            artifact_type: Set(new.artifact_type),
            mime_type: Set(new.mime_type),
            name: Set(new.name),
            size_bytes: Set(size_bytes),
            sha256: Set(sha256),
            source: Set(new.source),
            scope: Set(new.scope.as_str().to_owned()),
            storage_type: Set(storage_type.to_owned()),
            storage_key: Set(storage_key),
            conversation_id: Set(new.conversation_id),
            thread_id: Set(new.thread_id),
            bot_id: Set(new.bot_id),
            run_id: Set(new.run_id.map(RunId::into_uuid)),
            runner_id: Set(new.runner_id),
            metadata: Set(metadata_in("metadata", new.metadata)?),
            expires_at: Set(new.expires_at.map(super::micros)),
            created_at: Set(now()),
        };
        let conflict = |e: sea_orm::DbErr| {
            if is_unique_violation(&e) {
                StoreError::Conflict(format!("artifact {id} already exists"))
            } else {
                e.into()
            }
        };
        let txn = self.write_txn().await?;
        let model = artifact::Entity::insert(row)
            .exec_with_returning(&txn)
            .await
            .map_err(conflict)?;
        if let Some(bytes) = bytes {
            artifact_blob::Entity::insert(artifact_blob::ActiveModel {
                artifact_id: Set(model.id.clone()),
                data: Set(bytes),
            })
            .exec_without_returning(&txn)
            .await?;
        }
        txn.commit().await?;
        record(model)
    }

    async fn metadata(&self, id: &str) -> Result<ArtifactRecord> {
        record(self.live_artifact(id).await?)
    }

    async fn read(&self, id: &str, offset: i64, limit: Option<i64>) -> Result<ArtifactRead> {
        if offset < 0 {
            return Err(StoreError::invalid("offset must be >= 0"));
        }
        let limit = match limit {
            None => DEFAULT_ARTIFACT_READ_BYTES,
            Some(n) if n <= 0 => return Err(StoreError::invalid("limit must be > 0")),
            Some(n) => (n as u64).min(MAX_ARTIFACT_READ_BYTES),
        };
        let model = self.live_artifact(id).await?;
        let artifact = record(model)?;
        if artifact.storage_type != STORAGE_INLINE {
            return Ok(ArtifactRead {
                file_key: artifact.storage_key.clone(),
                artifact,
                offset: offset as u64,
                content: None,
                has_more: false,
            });
        }
        // Read only the requested range from the database, never the whole blob. SQL
        // `substr` is 1-based and counts bytes on blobs (bytea) on both backends.
        let (p1, p2) = match self.backend() {
            DbBackend::Postgres => ("$1", "$2"),
            _ => ("?", "?"),
        };
        let start = offset.min(i64::from(i32::MAX) - 1) + 1;
        let range = Expr::cust_with_values(
            format!(r#"substr("data", CAST({p1} AS integer), CAST({p2} AS integer))"#),
            [start, limit as i64],
        );
        let row: Option<(Vec<u8>, i64)> = artifact_blob::Entity::find_by_id(id.to_owned())
            .select_only()
            .column_as(range, "chunk")
            .column_as(Expr::cust(r#"CAST(length("data") AS bigint)"#), "total")
            .into_tuple()
            .all(&self.db)
            .await?
            .unique_row();
        let (chunk, total) =
            row.ok_or_else(|| StoreError::Corrupt(format!("artifact {id} has no content")))?;
        let end = offset.saturating_add(chunk.len() as i64);
        Ok(ArtifactRead {
            artifact,
            offset: offset as u64,
            has_more: end < total,
            content: Some(chunk),
            file_key: None,
        })
    }

    async fn delete_expired(&self, now: DateTime<Utc>, batch: u64) -> Result<u64> {
        let txn = self.write_txn().await?;
        let ids: Vec<String> = artifact::Entity::find()
            .select_only()
            .column(artifact::Column::Id)
            .filter(artifact::Column::ExpiresAt.lte(now))
            .order_by_asc(artifact::Column::ExpiresAt)
            .limit(batch.clamp(1, super::IN_CHUNK as u64))
            .into_tuple()
            .all(&txn)
            .await?;
        if ids.is_empty() {
            return Ok(0);
        }
        // Blobs first: the foreign key would cascade, but not every SQLite connection
        // necessarily enforces foreign keys.
        artifact_blob::Entity::delete_many()
            .filter(artifact_blob::Column::ArtifactId.is_in(ids.iter().cloned()))
            .exec(&txn)
            .await?;
        let res = artifact::Entity::delete_many()
            .filter(artifact::Column::Id.is_in(ids))
            .exec(&txn)
            .await?;
        txn.commit().await?;
        Ok(res.rows_affected)
    }
}
