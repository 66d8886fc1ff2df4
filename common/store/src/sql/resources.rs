//! [`ResourceRegistry`] on SQL; knowledge search is backend-specific full-text search built by
//! [`super::kb_search`].

use async_trait::async_trait;
use sb_protocol::ids::WorkspaceId;
use sea_orm::{
    ActiveModelTrait, ActiveValue::NotSet, ColumnTrait, EntityTrait, FromQueryResult,
    IntoActiveModel, PaginatorTrait, QueryFilter, QueryOrder, QuerySelect, Set,
};
use serde_json::Value;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::entity::{kb_chunk, kb_document, knowledge_base, model, tool};
use super::kb_search;
use super::{
    ID_LEN, IN_CHUNK, SqlStore, check_len_opt, check_required, metadata_in, metadata_out, now,
    workspace,
};
use crate::error::{Result, StoreError, is_foreign_key_violation, is_unique_violation};
use crate::resources::{
    CHUNK_CHARS, DocumentEdit, KbDocumentRecord, KbHit, KbSearch, KnowledgeBaseRecord,
    MAX_DOCUMENT_BYTES, MAX_FILTER_DOCUMENTS, MAX_KB_TOP_K, ModelKind, ModelRecord, NewKbDocument,
    NewModel, NewTool, ResourceRegistry, ToolRecord, chunk_text,
};

fn model_record(m: model::Model) -> Result<ModelRecord> {
    Ok(ModelRecord {
        model_id: m.id,
        workspace_id: workspace(m.workspace_id)?,
        kind: ModelKind::parse(&m.kind)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown model kind {:?}", m.kind)))?,
        name: m.name,
        base_url: m.base_url,
        model_name: m.model,
        api_key_env: m.api_key_env,
        context_window: m.context_window,
        extra_args: m
            .extra_args
            .unwrap_or_else(|| Value::Object(serde_json::Map::new())),
        enabled: m.enabled,
        created_at: m.created_at,
    })
}

fn tool_record(m: tool::Model) -> Result<ToolRecord> {
    Ok(ToolRecord {
        tool_id: m.id,
        workspace_id: workspace(m.workspace_id)?,
        name: m.name,
        kind: m.kind,
        description: m.description,
        parameters: m.parameters,
        config: m.config,
        enabled: m.enabled,
        created_at: m.created_at,
    })
}

fn kb_record(m: knowledge_base::Model) -> Result<KnowledgeBaseRecord> {
    Ok(KnowledgeBaseRecord {
        kb_id: m.id,
        workspace_id: workspace(m.workspace_id)?,
        name: m.name,
        description: m.description,
        created_at: m.created_at,
    })
}

fn document_record(m: kb_document::Model, chunks: u64) -> KbDocumentRecord {
    KbDocumentRecord {
        document_id: m.id,
        kb_id: m.kb_id,
        title: m.name,
        size_bytes: m.size_bytes,
        sha256: m.sha256,
        chunks,
        artifact_id: m.artifact_id,
        metadata: metadata_out(m.metadata),
        created_at: m.created_at,
    }
}

fn duplicate(kind: &str, name: &str) -> impl FnOnce(sea_orm::DbErr) -> StoreError {
    let msg = format!("{kind} {name} already exists");
    move |e| {
        if is_unique_violation(&e) {
            StoreError::Conflict(msg)
        } else {
            e.into()
        }
    }
}

fn object_or_empty(field: &str, v: Value) -> Result<Value> {
    match v {
        Value::Null => Ok(Value::Object(serde_json::Map::new())),
        v @ Value::Object(_) => Ok(v),
        _ => Err(StoreError::invalid(format!(
            "{field} must be a JSON object"
        ))),
    }
}

#[derive(Debug, FromQueryResult)]
struct HitRow {
    content: String,
    /// How many of the query's terms the chunk contains.
    matched: i64,
    /// The backend's relevance (≥ 0, higher is better).
    relevance: f64,
    document_id: Uuid,
    title: String,
    chunk_index: i64,
}

impl SqlStore {
    async fn kb_exists(&self, workspace_id: &WorkspaceId, kb_id: Uuid) -> Result<()> {
        let n = knowledge_base::Entity::find()
            .filter(knowledge_base::Column::WorkspaceId.eq(workspace_id.as_str()))
            .filter(knowledge_base::Column::Id.eq(kb_id))
            .count(&self.db)
            .await?;
        if n == 0 {
            return Err(StoreError::not_found(format!("knowledge base {kb_id}")));
        }
        Ok(())
    }
}

/// The checks of a tool registration, shared by create and update.
fn check_tool(t: &NewTool) -> Result<()> {
    check_required("name", &t.name, ID_LEN)?;
    check_required("kind", &t.kind, 32)?;
    if !matches!(t.parameters, Value::Object(_)) {
        return Err(StoreError::invalid(
            "parameters must be a JSON schema object",
        ));
    }
    Ok(())
}

impl SqlStore {
    /// Chunk counts of the documents of `kb_id` (all of them when `document_id` is `None`).
    async fn chunk_counts(
        &self,
        kb_id: Uuid,
        document_id: Option<Uuid>,
    ) -> Result<std::collections::HashMap<Uuid, u64>> {
        let mut select = kb_chunk::Entity::find()
            .select_only()
            .column(kb_chunk::Column::DocumentId)
            .column_as(kb_chunk::Column::Seq.count(), "n")
            .filter(kb_chunk::Column::KbId.eq(kb_id))
            .group_by(kb_chunk::Column::DocumentId);
        if let Some(id) = document_id {
            select = select.filter(kb_chunk::Column::DocumentId.eq(id));
        }
        let rows: Vec<(Uuid, i64)> = select.into_tuple().all(&self.db).await?;
        Ok(rows
            .into_iter()
            .map(|(id, n)| (id, u64::try_from(n).unwrap_or(0)))
            .collect())
    }
}

/// The checks of a model registration, shared by create and update.
fn check_model(m: &NewModel) -> Result<()> {
    check_required("name", &m.name, ID_LEN)?;
    check_required("model_name", &m.model_name, ID_LEN)?;
    check_required("base_url", &m.base_url, 2048)?;
    if !(m.base_url.starts_with("http://") || m.base_url.starts_with("https://")) {
        return Err(StoreError::invalid("base_url must be an http or https URL"));
    }
    check_len_opt("api_key_env", m.api_key_env.as_deref(), ID_LEN)?;
    if let Some(env) = m.api_key_env.as_deref()
        && (env.is_empty() || !env.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
    {
        return Err(StoreError::invalid(
            "api_key_env must be an environment variable name ([A-Za-z0-9_]+)",
        ));
    }
    if m.context_window.is_some_and(|w| w <= 0) {
        return Err(StoreError::invalid("context_window must be positive"));
    }
    Ok(())
}

#[async_trait]
impl ResourceRegistry for SqlStore {
    async fn create_model(&self, m: NewModel) -> Result<ModelRecord> {
        check_model(&m)?;
        let extra = metadata_in("extra_args", m.extra_args.unwrap_or(Value::Null))?;
        let at = now();
        let row = model::ActiveModel {
            id: Set(Uuid::now_v7()),
            workspace_id: Set(m.workspace_id.as_str().to_owned()),
            name: Set(m.name.clone()),
            kind: Set(m.kind.as_str().to_owned()),
            base_url: Set(m.base_url),
            model: Set(m.model_name),
            api_key_env: Set(m.api_key_env),
            context_window: Set(m.context_window),
            abilities: Set(Value::Array(Vec::new())),
            extra_args: Set(extra),
            enabled: Set(true),
            created_at: Set(at),
            updated_at: Set(at),
        };
        let model = model::Entity::insert(row)
            .exec_with_returning(self.writer())
            .await
            .map_err(duplicate("model", &m.name))?;
        model_record(model)
    }

    async fn update_model(&self, model_id: Uuid, m: NewModel) -> Result<ModelRecord> {
        check_model(&m)?;
        let extra = metadata_in("extra_args", m.extra_args.unwrap_or(Value::Null))?;
        let missing = || StoreError::not_found(format!("model {model_id}"));
        let existing = model::Entity::find_by_id(model_id)
            .filter(model::Column::WorkspaceId.eq(m.workspace_id.as_str()))
            .all(&self.db)
            .await?
            .into_iter()
            .next()
            .ok_or_else(missing)?;
        let mut active = existing.into_active_model();
        active.name = Set(m.name.clone());
        active.kind = Set(m.kind.as_str().to_owned());
        active.base_url = Set(m.base_url);
        active.model = Set(m.model_name);
        active.api_key_env = Set(m.api_key_env);
        active.context_window = Set(m.context_window);
        active.extra_args = Set(extra);
        active.enabled = Set(true);
        active.updated_at = Set(now());
        let row = active.update(self.writer()).await.map_err(|e| match e {
            sea_orm::DbErr::RecordNotUpdated => missing(),
            e => duplicate("model", &m.name)(e),
        })?;
        model_record(row)
    }

    async fn delete_model(&self, workspace_id: &WorkspaceId, model_id: Uuid) -> Result<bool> {
        let res = model::Entity::delete_many()
            .filter(model::Column::Id.eq(model_id))
            .filter(model::Column::WorkspaceId.eq(workspace_id.as_str()))
            .exec(self.writer())
            .await?;
        Ok(res.rows_affected > 0)
    }

    async fn get_model(&self, workspace_id: &WorkspaceId, model_id: Uuid) -> Result<ModelRecord> {
        let row = model::Entity::find_by_id(model_id)
            .filter(model::Column::WorkspaceId.eq(workspace_id.as_str()))
            .one(&self.db)
            .await?
            .ok_or_else(|| StoreError::not_found(format!("model {model_id}")))?;
        model_record(row)
    }

    async fn list_models(&self, workspace_id: &WorkspaceId) -> Result<Vec<ModelRecord>> {
        model::Entity::find()
            .filter(model::Column::WorkspaceId.eq(workspace_id.as_str()))
            .order_by_asc(model::Column::Name)
            .all(&self.db)
            .await?
            .into_iter()
            .map(model_record)
            .collect()
    }

    async fn models_by_ids(
        &self,
        workspace_id: &WorkspaceId,
        ids: &[Uuid],
    ) -> Result<Vec<ModelRecord>> {
        let mut out = Vec::new();
        for chunk in ids.chunks(IN_CHUNK) {
            for row in model::Entity::find()
                .filter(model::Column::WorkspaceId.eq(workspace_id.as_str()))
                .filter(model::Column::Id.is_in(chunk.iter().copied()))
                .all(&self.db)
                .await?
            {
                out.push(model_record(row)?);
            }
        }
        Ok(out)
    }

    async fn create_tool(&self, t: NewTool) -> Result<ToolRecord> {
        check_tool(&t)?;
        let config = object_or_empty("config", t.config)?;
        let at = now();
        let row = tool::ActiveModel {
            id: Set(Uuid::now_v7()),
            workspace_id: Set(t.workspace_id.as_str().to_owned()),
            name: Set(t.name.clone()),
            kind: Set(t.kind),
            description: Set(t.description),
            parameters: Set(t.parameters),
            config: Set(config),
            enabled: Set(true),
            created_at: Set(at),
            updated_at: Set(at),
        };
        let tool = tool::Entity::insert(row)
            .exec_with_returning(self.writer())
            .await
            .map_err(duplicate("tool", &t.name))?;
        tool_record(tool)
    }

    async fn update_tool(&self, tool_id: Uuid, t: NewTool) -> Result<ToolRecord> {
        check_tool(&t)?;
        let config = object_or_empty("config", t.config)?;
        let missing = || StoreError::not_found(format!("tool {tool_id}"));
        let existing = tool::Entity::find_by_id(tool_id)
            .filter(tool::Column::WorkspaceId.eq(t.workspace_id.as_str()))
            .one(&self.db)
            .await?
            .ok_or_else(missing)?;
        let mut active = existing.into_active_model();
        active.name = Set(t.name.clone());
        active.kind = Set(t.kind);
        active.description = Set(t.description);
        active.parameters = Set(t.parameters);
        active.config = Set(config);
        active.updated_at = Set(now());
        let row = active.update(self.writer()).await.map_err(|e| match e {
            sea_orm::DbErr::RecordNotUpdated => missing(),
            e => duplicate("tool", &t.name)(e),
        })?;
        tool_record(row)
    }

    async fn delete_tool(&self, workspace_id: &WorkspaceId, tool_id: Uuid) -> Result<bool> {
        let res = tool::Entity::delete_many()
            .filter(tool::Column::Id.eq(tool_id))
            .filter(tool::Column::WorkspaceId.eq(workspace_id.as_str()))
            .exec(self.writer())
            .await?;
        Ok(res.rows_affected > 0)
    }

    async fn get_tool(&self, workspace_id: &WorkspaceId, name: &str) -> Result<ToolRecord> {
        let row = tool::Entity::find()
            .filter(tool::Column::WorkspaceId.eq(workspace_id.as_str()))
            .filter(tool::Column::Name.eq(name))
            .one(&self.db)
            .await?
            .ok_or_else(|| StoreError::not_found(format!("tool {name}")))?;
        tool_record(row)
    }

    async fn list_tools(&self, workspace_id: &WorkspaceId) -> Result<Vec<ToolRecord>> {
        tool::Entity::find()
            .filter(tool::Column::WorkspaceId.eq(workspace_id.as_str()))
            .order_by_asc(tool::Column::Name)
            .all(&self.db)
            .await?
            .into_iter()
            .map(tool_record)
            .collect()
    }

    async fn tools_by_names(
        &self,
        workspace_id: &WorkspaceId,
        names: &[String],
    ) -> Result<Vec<ToolRecord>> {
        let mut out = Vec::new();
        for chunk in names.chunks(IN_CHUNK) {
            for row in tool::Entity::find()
                .filter(tool::Column::WorkspaceId.eq(workspace_id.as_str()))
                .filter(tool::Column::Name.is_in(chunk.iter().cloned()))
                .all(&self.db)
                .await?
            {
                out.push(tool_record(row)?);
            }
        }
        Ok(out)
    }

    async fn create_kb(
        &self,
        workspace_id: &WorkspaceId,
        name: &str,
        description: Option<String>,
    ) -> Result<KnowledgeBaseRecord> {
        check_required("name", name, ID_LEN)?;
        let at = now();
        let row = knowledge_base::ActiveModel {
            id: Set(Uuid::now_v7()),
            workspace_id: Set(workspace_id.as_str().to_owned()),
            name: Set(name.to_owned()),
            description: Set(description),
            config: Set(None),
            created_at: Set(at),
            updated_at: Set(at),
        };
        let kb = knowledge_base::Entity::insert(row)
            .exec_with_returning(self.writer())
            .await
            .map_err(duplicate("knowledge base", name))?;
        kb_record(kb)
    }

    async fn update_kb(
        &self,
        workspace_id: &WorkspaceId,
        kb_id: Uuid,
        name: &str,
        description: Option<String>,
    ) -> Result<KnowledgeBaseRecord> {
        check_required("name", name, ID_LEN)?;
        let missing = || StoreError::not_found(format!("knowledge base {kb_id}"));
        let existing = knowledge_base::Entity::find_by_id(kb_id)
            .filter(knowledge_base::Column::WorkspaceId.eq(workspace_id.as_str()))
            .one(&self.db)
            .await?
            .ok_or_else(missing)?;
        let mut active = existing.into_active_model();
        active.name = Set(name.to_owned());
        active.description = Set(description);
        active.updated_at = Set(now());
        let row = active.update(self.writer()).await.map_err(|e| match e {
            sea_orm::DbErr::RecordNotUpdated => missing(),
            e => duplicate("knowledge base", name)(e),
        })?;
        kb_record(row)
    }

    async fn delete_kb(&self, workspace_id: &WorkspaceId, kb_id: Uuid) -> Result<bool> {
        let txn = self.write_txn().await?;
        // Chunks and documents first and explicitly (not only by the foreign keys' cascade),
        // so the FTS index triggers see every chunk row go on both backends.
        kb_chunk::Entity::delete_many()
            .filter(kb_chunk::Column::KbId.eq(kb_id))
            .filter(kb_chunk::Column::WorkspaceId.eq(workspace_id.as_str()))
            .exec(&txn)
            .await?;
        kb_document::Entity::delete_many()
            .filter(kb_document::Column::KbId.eq(kb_id))
            .filter(kb_document::Column::WorkspaceId.eq(workspace_id.as_str()))
            .exec(&txn)
            .await?;
        let res = knowledge_base::Entity::delete_many()
            .filter(knowledge_base::Column::Id.eq(kb_id))
            .filter(knowledge_base::Column::WorkspaceId.eq(workspace_id.as_str()))
            .exec(&txn)
            .await?;
        txn.commit().await?;
        Ok(res.rows_affected > 0)
    }

    async fn get_kb(&self, workspace_id: &WorkspaceId, kb_id: Uuid) -> Result<KnowledgeBaseRecord> {
        let row = knowledge_base::Entity::find_by_id(kb_id)
            .filter(knowledge_base::Column::WorkspaceId.eq(workspace_id.as_str()))
            .one(&self.db)
            .await?
            .ok_or_else(|| StoreError::not_found(format!("knowledge base {kb_id}")))?;
        kb_record(row)
    }

    async fn list_kbs(&self, workspace_id: &WorkspaceId) -> Result<Vec<KnowledgeBaseRecord>> {
        knowledge_base::Entity::find()
            .filter(knowledge_base::Column::WorkspaceId.eq(workspace_id.as_str()))
            .order_by_asc(knowledge_base::Column::Name)
            .all(&self.db)
            .await?
            .into_iter()
            .map(kb_record)
            .collect()
    }

    async fn kbs_by_ids(
        &self,
        workspace_id: &WorkspaceId,
        ids: &[Uuid],
    ) -> Result<Vec<KnowledgeBaseRecord>> {
        let mut out = Vec::new();
        for chunk in ids.chunks(IN_CHUNK) {
            for row in knowledge_base::Entity::find()
                .filter(knowledge_base::Column::WorkspaceId.eq(workspace_id.as_str()))
                .filter(knowledge_base::Column::Id.is_in(chunk.iter().copied()))
                .all(&self.db)
                .await?
            {
                out.push(kb_record(row)?);
            }
        }
        Ok(out)
    }

    async fn add_document(&self, doc: NewKbDocument) -> Result<KbDocumentRecord> {
        check_required("title", &doc.title, ID_LEN)?;
        check_len_opt("artifact_id", doc.artifact_id.as_deref(), ID_LEN)?;
        if doc.text.len() > MAX_DOCUMENT_BYTES {
            return Err(StoreError::PayloadTooLarge(format!(
                "document text is larger than {MAX_DOCUMENT_BYTES} bytes"
            )));
        }
        // Postgres rejects NUL in text; it carries no searchable content.
        let text = doc.text.replace('\0', " ");
        let chunks = chunk_text(&text, CHUNK_CHARS);
        if chunks.is_empty() {
            return Err(StoreError::invalid("document text is empty"));
        }
        let metadata = metadata_in("metadata", doc.metadata)?;
        self.kb_exists(&doc.workspace_id, doc.kb_id).await?;
        let at = now();
        let document_id = Uuid::now_v7();
        let sha256 = hex::encode(Sha256::digest(doc.text.as_bytes()));
        let size = i64::try_from(doc.text.len()).unwrap_or(i64::MAX);
        let txn = self.write_txn().await?;
        let row = kb_document::ActiveModel {
            id: Set(document_id),
            kb_id: Set(doc.kb_id),
            workspace_id: Set(doc.workspace_id.as_str().to_owned()),
            name: Set(doc.title.clone()),
            mime_type: Set(Some("text/plain".to_owned())),
            size_bytes: Set(size),
            sha256: Set(sha256.clone()),
            artifact_id: Set(doc.artifact_id.clone()),
            status: Set("ready".to_owned()),
            error: Set(None),
            metadata: Set(metadata.clone()),
            created_at: Set(at),
            updated_at: Set(at),
        };
        kb_document::Entity::insert(row)
            .exec_without_returning(&txn)
            .await
            .map_err(|e| {
                if is_foreign_key_violation(&e) {
                    StoreError::not_found(format!("knowledge base {}", doc.kb_id))
                } else {
                    e.into()
                }
            })?;
        let n = chunks.len() as u64;
        let rows: Vec<kb_chunk::ActiveModel> = chunks
            .into_iter()
            .enumerate()
            .map(|(i, content)| kb_chunk::ActiveModel {
                seq: NotSet,
                id: Set(Uuid::now_v7()),
                document_id: Set(document_id),
                kb_id: Set(doc.kb_id),
                workspace_id: Set(doc.workspace_id.as_str().to_owned()),
                chunk_index: Set(i64::try_from(i).unwrap_or(i64::MAX)),
                content: Set(content),
                metadata: Set(None),
                created_at: Set(at),
            })
            .collect();
        // Each chunk row binds 8 values; stay below SQLite's parameter limit.
        let mut rows = rows.into_iter().peekable();
        while rows.peek().is_some() {
            let batch: Vec<_> = rows.by_ref().take(100).collect();
            kb_chunk::Entity::insert_many(batch)
                .exec_without_returning(&txn)
                .await?;
        }
        txn.commit().await?;
        Ok(KbDocumentRecord {
            document_id,
            kb_id: doc.kb_id,
            title: doc.title,
            size_bytes: size,
            sha256,
            chunks: n,
            artifact_id: doc.artifact_id,
            metadata: metadata_out(metadata),
            created_at: at,
        })
    }

    async fn list_documents(
        &self,
        workspace_id: &WorkspaceId,
        kb_id: Uuid,
    ) -> Result<Vec<KbDocumentRecord>> {
        self.kb_exists(workspace_id, kb_id).await?;
        let counts = self.chunk_counts(kb_id, None).await?;
        let rows = kb_document::Entity::find()
            .filter(kb_document::Column::KbId.eq(kb_id))
            .filter(kb_document::Column::WorkspaceId.eq(workspace_id.as_str()))
            .order_by_asc(kb_document::Column::Id)
            .all(&self.db)
            .await?;
        Ok(rows
            .into_iter()
            .map(|m| {
                let n = counts.get(&m.id).copied().unwrap_or(0);
                document_record(m, n)
            })
            .collect())
    }

    async fn update_document(
        &self,
        workspace_id: &WorkspaceId,
        kb_id: Uuid,
        document_id: Uuid,
        edit: DocumentEdit,
    ) -> Result<KbDocumentRecord> {
        check_required("title", &edit.title, ID_LEN)?;
        let metadata = metadata_in("metadata", edit.metadata)?;
        let missing = || StoreError::not_found(format!("document {document_id}"));
        let existing = kb_document::Entity::find_by_id(document_id)
            .filter(kb_document::Column::KbId.eq(kb_id))
            .filter(kb_document::Column::WorkspaceId.eq(workspace_id.as_str()))
            .one(&self.db)
            .await?
            .ok_or_else(missing)?;
        let mut active = existing.into_active_model();
        active.name = Set(edit.title);
        active.metadata = Set(metadata);
        active.updated_at = Set(now());
        let row = active.update(self.writer()).await.map_err(|e| match e {
            sea_orm::DbErr::RecordNotUpdated => missing(),
            e => e.into(),
        })?;
        let chunks = self
            .chunk_counts(kb_id, Some(document_id))
            .await?
            .get(&document_id)
            .copied()
            .unwrap_or(0);
        Ok(document_record(row, chunks))
    }

    async fn delete_document(
        &self,
        workspace_id: &WorkspaceId,
        kb_id: Uuid,
        document_id: Uuid,
    ) -> Result<bool> {
        let txn = self.write_txn().await?;
        kb_chunk::Entity::delete_many()
            .filter(kb_chunk::Column::DocumentId.eq(document_id))
            .filter(kb_chunk::Column::KbId.eq(kb_id))
            .filter(kb_chunk::Column::WorkspaceId.eq(workspace_id.as_str()))
            .exec(&txn)
            .await?;
        let res = kb_document::Entity::delete_many()
            .filter(kb_document::Column::Id.eq(document_id))
            .filter(kb_document::Column::KbId.eq(kb_id))
            .filter(kb_document::Column::WorkspaceId.eq(workspace_id.as_str()))
            .exec(&txn)
            .await?;
        txn.commit().await?;
        Ok(res.rows_affected > 0)
    }

    async fn search_kb(&self, search: KbSearch) -> Result<Vec<KbHit>> {
        if search.document_ids.len() > MAX_FILTER_DOCUMENTS {
            return Err(StoreError::invalid(format!(
                "at most {MAX_FILTER_DOCUMENTS} document ids may be filtered on"
            )));
        }
        self.kb_exists(&search.workspace_id, search.kb_id).await?;
        let top_k = search.top_k.clamp(1, MAX_KB_TOP_K);
        let terms = kb_search::query_terms(&search.query);
        if terms.is_empty() {
            return Ok(Vec::new());
        }
        let statement = kb_search::statement(self.backend(), &search, &terms, top_k)?;
        let rows = HitRow::find_by_statement(statement).all(&self.db).await?;
        Ok(rows
            .into_iter()
            .map(|r| KbHit {
                score: kb_search::score(r.matched, r.relevance),
                content: r.content,
                document_id: r.document_id,
                title: r.title,
                chunk_index: r.chunk_index,
            })
            .collect())
    }
}
