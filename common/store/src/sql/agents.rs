//! [`AgentStore`], [`RunnerRegistry`] and [`Tenancy`] on SQL.

use async_trait::async_trait;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rand::RngCore as _;
use sb_protocol::ids::{AgentId, WorkspaceId};
use sea_orm::sea_query::{Expr, OnConflict};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, EntityTrait, IntoActiveModel, QueryFilter, QueryOrder, Set,
};
use serde_json::Value;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::entity::{agent, api_key, runner, workspace as workspace_entity};
use super::{ID_LEN, SqlStore, UniqueRow, check_len_opt, check_required, now, workspace};
use crate::agents::{
    AgentRow, AgentStore, ApiKeyRecord, ApiKeyRole, AuthenticatedKey, NewAgent, NewApiKey,
    RunnerRegistry, RunnerRow, Tenancy,
};
use crate::error::{Result, StoreError, is_unique_violation};

/// Text prefix of every API key, so leaked keys are recognisable by secret scanners.
const API_KEY_PREFIX: &str = "sb_";
/// Characters of the key stored (and shown) to tell keys apart.
const API_KEY_SHOWN_CHARS: usize = 11;

fn agent_row(m: agent::Model) -> Result<AgentRow> {
    Ok(AgentRow {
        id: AgentId::from_uuid(m.id),
        workspace_id: workspace(m.workspace_id)?,
        name: m.name,
        description: m.description,
        runner_id: m.runner_id,
        runner_config: m.runner_config,
        event_types: m.event_types,
        scope: m.scope,
        bot_id: m.bot_id,
        channel: m.channel,
        conversation_id: m.conversation_id,
        actor_id: m.actor_id,
        filters: m.filters,
        resource_policy: m.resource_policy,
        state_policy: m.state_policy,
        delivery_policy: m.delivery_policy,
        budgets: m.budgets,
        enabled: m.enabled,
        routing: m.routing.parse()?,
        created_at: m.created_at,
        updated_at: m.updated_at,
    })
}

fn agent_rows(rows: Vec<agent::Model>) -> Result<Vec<AgentRow>> {
    rows.into_iter().map(agent_row).collect()
}

/// The denormalised scope columns: string members of the scope object.
fn scope_columns(scope: &Value) -> Result<[Option<String>; 4]> {
    let object = match scope {
        Value::Null => return Ok([None, None, None, None]),
        Value::Object(map) => map,
        _ => return Err(StoreError::invalid("scope must be a JSON object")),
    };
    let field = |name: &str| -> Result<Option<String>> {
        match object.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => {
                check_len_opt(name, Some(s), ID_LEN)?;
                Ok(Some(s.clone()))
            }
            Some(_) => Err(StoreError::invalid(format!(
                "scope.{name} must be a string"
            ))),
        }
    };
    Ok([
        field("bot_id")?,
        field("channel")?,
        field("conversation_id")?,
        field("actor_id")?,
    ])
}

/// The stored budget overrides: an object, `null` meaning none (the column is not null).
/// Their members are the gateway's to validate, as for the policies.
fn budgets_column(budgets: Value) -> Result<Value> {
    match budgets {
        Value::Null => Ok(Value::Object(serde_json::Map::new())),
        v @ Value::Object(_) => Ok(v),
        _ => Err(StoreError::invalid("budgets must be a JSON object")),
    }
}

fn name_taken(workspace_id: &str, name: &str) -> impl Fn(sea_orm::DbErr) -> StoreError {
    let msg = format!("an agent named {name:?} already exists in workspace {workspace_id}");
    move |e| {
        if is_unique_violation(&e) {
            StoreError::Conflict(msg.clone())
        } else {
            e.into()
        }
    }
}

fn hash_key(plaintext: &str) -> String {
    hex::encode(Sha256::digest(plaintext.as_bytes()))
}

#[async_trait]
impl AgentStore for SqlStore {
    async fn create(&self, new: NewAgent) -> Result<AgentRow> {
        check_required("name", &new.name, ID_LEN)?;
        check_required("runner_id", &new.runner_id, ID_LEN)?;
        let [bot_id, channel, conversation_id, actor_id] = scope_columns(&new.scope)?;
        let now = now();
        let row = agent::ActiveModel {
            id: Set(new.id.unwrap_or_default().into_uuid()),
            workspace_id: Set(new.workspace_id.as_str().to_owned()),
            name: Set(new.name.clone()),
            description: Set(new.description),
            runner_id: Set(new.runner_id),
            runner_config: Set(new.runner_config),
            event_types: Set(new.event_types),
            scope: Set(new.scope),
            bot_id: Set(bot_id),
            channel: Set(channel),
            conversation_id: Set(conversation_id),
            actor_id: Set(actor_id),
            filters: Set(new.filters),
            resource_policy: Set(new.resource_policy),
            state_policy: Set(new.state_policy),
            delivery_policy: Set(new.delivery_policy),
            budgets: Set(budgets_column(new.budgets)?),
            enabled: Set(new.enabled),
            routing: Set(new.routing.as_str().to_owned()),
            created_at: Set(now),
            updated_at: Set(now),
        };
        let model = agent::Entity::insert(row)
            .exec_with_returning(self.writer())
            .await
            .map_err(name_taken(new.workspace_id.as_str(), &new.name))?;
        agent_row(model)
    }

    async fn get(&self, workspace_id: &WorkspaceId, id: AgentId) -> Result<Option<AgentRow>> {
        agent::Entity::find_by_id(id.into_uuid())
            .filter(agent::Column::WorkspaceId.eq(workspace_id.as_str()))
            .all(&self.db)
            .await?
            .unique_row()
            .map(agent_row)
            .transpose()
    }

    async fn list(&self, workspace_id: &WorkspaceId) -> Result<Vec<AgentRow>> {
        agent_rows(
            agent::Entity::find()
                .filter(agent::Column::WorkspaceId.eq(workspace_id.as_str()))
                .order_by_asc(agent::Column::Name)
                .all(&self.db)
                .await?,
        )
    }

    async fn list_enabled(&self, workspace_id: &WorkspaceId) -> Result<Vec<AgentRow>> {
        agent_rows(
            agent::Entity::find()
                .filter(agent::Column::WorkspaceId.eq(workspace_id.as_str()))
                .filter(agent::Column::Enabled.eq(true))
                .order_by_asc(agent::Column::Name)
                .all(&self.db)
                .await?,
        )
    }

    async fn update(&self, row: AgentRow) -> Result<AgentRow> {
        check_required("name", &row.name, ID_LEN)?;
        check_required("runner_id", &row.runner_id, ID_LEN)?;
        let [bot_id, channel, conversation_id, actor_id] = scope_columns(&row.scope)?;
        let existing = agent::Entity::find_by_id(row.id.into_uuid())
            .filter(agent::Column::WorkspaceId.eq(row.workspace_id.as_str()))
            .all(&self.db)
            .await?
            .unique_row()
            .ok_or_else(|| StoreError::not_found(format!("agent {}", row.id)))?;
        let mut active = existing.into_active_model();
        active.name = Set(row.name.clone());
        active.description = Set(row.description);
        active.runner_id = Set(row.runner_id);
        active.runner_config = Set(row.runner_config);
        active.event_types = Set(row.event_types);
        active.scope = Set(row.scope);
        active.bot_id = Set(bot_id);
        active.channel = Set(channel);
        active.conversation_id = Set(conversation_id);
        active.actor_id = Set(actor_id);
        active.filters = Set(row.filters);
        active.resource_policy = Set(row.resource_policy);
        active.state_policy = Set(row.state_policy);
        active.delivery_policy = Set(row.delivery_policy);
        active.budgets = Set(budgets_column(row.budgets)?);
        active.enabled = Set(row.enabled);
        active.routing = Set(row.routing.as_str().to_owned());
        active.updated_at = Set(now());
        let model = active.update(self.writer()).await.map_err(|e| match e {
            sea_orm::DbErr::RecordNotUpdated => StoreError::not_found(format!("agent {}", row.id)),
            e => name_taken(row.workspace_id.as_str(), &row.name)(e),
        })?;
        agent_row(model)
    }

    async fn delete(&self, workspace_id: &WorkspaceId, id: AgentId) -> Result<bool> {
        let res = agent::Entity::delete_many()
            .filter(agent::Column::Id.eq(id.into_uuid()))
            .filter(agent::Column::WorkspaceId.eq(workspace_id.as_str()))
            .exec(self.writer())
            .await?;
        Ok(res.rows_affected > 0)
    }
}

#[async_trait]
impl RunnerRegistry for SqlStore {
    async fn upsert(&self, row: RunnerRow) -> Result<()> {
        check_required("id", &row.id, ID_LEN)?;
        check_required("plugin_id", &row.plugin_id, ID_LEN)?;
        check_required("pool", &row.pool, ID_LEN)?;
        check_len_opt("version", Some(&row.version), 64)?;
        runner::Entity::insert(runner::ActiveModel {
            id: Set(row.id),
            plugin_id: Set(row.plugin_id),
            pool: Set(row.pool),
            version: Set(row.version),
            descriptor: Set(row.descriptor),
            seen_at: Set(super::micros(row.seen_at)),
        })
        .on_conflict(
            OnConflict::column(runner::Column::Id)
                .update_columns([
                    runner::Column::PluginId,
                    runner::Column::Pool,
                    runner::Column::Version,
                    runner::Column::Descriptor,
                    runner::Column::SeenAt,
                ])
                .to_owned(),
        )
        .exec_without_returning(self.writer())
        .await?;
        Ok(())
    }

    async fn get(&self, id: &str) -> Result<Option<RunnerRow>> {
        Ok(runner::Entity::find_by_id(id.to_owned())
            .all(&self.db)
            .await?
            .unique_row()
            .map(runner_row))
    }

    async fn list(&self) -> Result<Vec<RunnerRow>> {
        Ok(runner::Entity::find()
            .order_by_asc(runner::Column::Id)
            .all(&self.db)
            .await?
            .into_iter()
            .map(runner_row)
            .collect())
    }
}

fn runner_row(m: runner::Model) -> RunnerRow {
    RunnerRow {
        id: m.id,
        plugin_id: m.plugin_id,
        pool: m.pool,
        version: m.version,
        descriptor: m.descriptor,
        seen_at: m.seen_at,
    }
}

fn api_key_record(m: api_key::Model) -> Result<ApiKeyRecord> {
    Ok(ApiKeyRecord {
        id: m.id,
        workspace_id: workspace(m.workspace_id)?,
        name: m.name,
        role: role(&m.role)?,
        prefix: m.prefix,
        created_at: m.created_at,
        revoked_at: m.revoked_at,
    })
}

/// A stored role. An unknown one is refused rather than read as either role: a key whose
/// power cannot be told must not authenticate at all.
fn role(text: &str) -> Result<ApiKeyRole> {
    text.parse()
        .map_err(|e: crate::agents::UnknownApiKeyRole| StoreError::Corrupt(e.to_string()))
}

#[async_trait]
impl Tenancy for SqlStore {
    async fn ensure_workspace(&self, id: &WorkspaceId) -> Result<()> {
        workspace_entity::Entity::insert(workspace_entity::ActiveModel {
            id: Set(id.as_str().to_owned()),
            created_at: Set(now()),
        })
        .on_conflict(
            OnConflict::column(workspace_entity::Column::Id)
                .do_nothing()
                .to_owned(),
        )
        .exec_without_returning(self.writer())
        .await?;
        Ok(())
    }

    async fn create_api_key(
        &self,
        workspace_id: &WorkspaceId,
        name: Option<&str>,
        role: ApiKeyRole,
    ) -> Result<NewApiKey> {
        check_len_opt("name", name, ID_LEN)?;
        self.ensure_workspace(workspace_id).await?;
        let mut secret = [0u8; 32];
        rand::rng().fill_bytes(&mut secret);
        let plaintext = format!("{API_KEY_PREFIX}{}", URL_SAFE_NO_PAD.encode(secret));
        let prefix: String = plaintext.chars().take(API_KEY_SHOWN_CHARS).collect();
        let record = ApiKeyRecord {
            id: Uuid::now_v7(),
            workspace_id: workspace_id.clone(),
            name: name.map(str::to_owned),
            role,
            prefix,
            created_at: now(),
            revoked_at: None,
        };
        api_key::Entity::insert(api_key::ActiveModel {
            id: Set(record.id),
            workspace_id: Set(workspace_id.as_str().to_owned()),
            name: Set(record.name.clone()),
            key_hash: Set(hash_key(&plaintext)),
            prefix: Set(record.prefix.clone()),
            created_at: Set(record.created_at),
            revoked_at: Set(None),
            role: Set(role.as_str().to_owned()),
        })
        .exec_without_returning(self.writer())
        .await?;
        Ok(NewApiKey { plaintext, record })
    }

    async fn authenticate(&self, plaintext: &str) -> Result<Option<AuthenticatedKey>> {
        // Cheap rejection of anything that cannot be one of our keys.
        if !plaintext.starts_with(API_KEY_PREFIX) || plaintext.len() > 128 {
            return Ok(None);
        }
        api_key::Entity::find()
            .filter(api_key::Column::KeyHash.eq(hash_key(plaintext)))
            .filter(api_key::Column::RevokedAt.is_null())
            .all(&self.db)
            .await?
            .unique_row()
            .map(|m| {
                Ok(AuthenticatedKey {
                    key_id: m.id,
                    role: role(&m.role)?,
                    workspace_id: workspace(m.workspace_id)?,
                })
            })
            .transpose()
    }

    async fn get_api_key(
        &self,
        workspace_id: &WorkspaceId,
        key_id: Uuid,
    ) -> Result<Option<ApiKeyRecord>> {
        api_key::Entity::find_by_id(key_id)
            .filter(api_key::Column::WorkspaceId.eq(workspace_id.as_str()))
            .one(&self.db)
            .await?
            .map(api_key_record)
            .transpose()
    }

    async fn revoke(&self, workspace_id: &WorkspaceId, key_id: Uuid) -> Result<bool> {
        let res = api_key::Entity::update_many()
            .col_expr(api_key::Column::RevokedAt, Expr::value(now()))
            .filter(api_key::Column::Id.eq(key_id))
            .filter(api_key::Column::WorkspaceId.eq(workspace_id.as_str()))
            .filter(api_key::Column::RevokedAt.is_null())
            .exec(self.writer())
            .await?;
        Ok(res.rows_affected == 1)
    }

    async fn list_api_keys(&self, workspace_id: &WorkspaceId) -> Result<Vec<ApiKeyRecord>> {
        api_key::Entity::find()
            .filter(api_key::Column::WorkspaceId.eq(workspace_id.as_str()))
            .order_by_asc(api_key::Column::CreatedAt)
            .order_by_asc(api_key::Column::Id)
            .all(&self.db)
            .await?
            .into_iter()
            .map(api_key_record)
            .collect()
    }
}
