//! Agent store, runner registry and tenancy contract tests: agents, runner announcements,
//! API keys.

use chrono::{TimeDelta, Utc};
use sb_protocol::error::ErrorCode;
use sb_protocol::ids::{AgentId, WorkspaceId};
use sea_orm::{ConnectionTrait, Statement};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::{assert_code, other_ws, ws};
use crate::testing::TestDb;
use crate::*;

fn agent(name: &str, workspace_id: WorkspaceId) -> NewAgent {
    NewAgent {
        id: None,
        workspace_id,
        name: name.into(),
        description: Some("d".into()),
        runner_id: "plugin:acme/echo/echo".into(),
        runner_config: json!({"timeout": 30}),
        event_types: json!(["message.received"]),
        scope: json!({"bot_id": "bot-1", "conversation_id": "c1"}),
        filters: json!([]),
        resource_policy: json!({"models": []}),
        state_policy: json!({"enabled": true}),
        delivery_policy: json!({"concurrency": "parallel"}),
        budgets: json!({"max_tool_calls": 1, "max_model_output_chars": 0}),
        enabled: true,
        routing: crate::AgentRouting::Scope,
    }
}

/// Create, read, list, update (with scope denormalisation and budget overrides), rename
/// conflicts, delete.
pub async fn agents_crud(db: &TestDb) {
    let a = db.stores.agents.create(agent("alpha", ws())).await.unwrap();
    assert_eq!(a.bot_id.as_deref(), Some("bot-1"));
    assert_eq!(a.conversation_id.as_deref(), Some("c1"));
    assert_eq!(a.channel, None);
    assert_eq!(a.runner_config, json!({"timeout": 30}));
    assert_eq!(
        a.budgets,
        json!({"max_tool_calls": 1, "max_model_output_chars": 0})
    );
    let mut disabled = agent("beta", ws());
    disabled.enabled = false;
    // No overrides at all: stored (and read back) as an empty object.
    disabled.budgets = Value::Null;
    disabled.routing = crate::AgentRouting::Direct;
    let b = db.stores.agents.create(disabled).await.unwrap();
    assert_eq!(b.budgets, json!({}));
    assert_eq!(a.routing, crate::AgentRouting::Scope);
    assert_eq!(b.routing, crate::AgentRouting::Direct, "routing is stored");
    assert_code(
        db.stores.agents.create(agent("alpha", ws())).await,
        ErrorCode::Conflict,
    );
    let other = db
        .stores
        .agents
        .create(agent("alpha", other_ws()))
        .await
        .unwrap();

    assert_eq!(db.stores.agents.get(&ws(), a.id).await.unwrap().unwrap(), a);
    assert!(
        db.stores
            .agents
            .get(&other_ws(), a.id)
            .await
            .unwrap()
            .is_none()
    );
    let names = |rows: Vec<AgentRow>| rows.into_iter().map(|r| r.name).collect::<Vec<_>>();
    assert_eq!(
        names(db.stores.agents.list(&ws()).await.unwrap()),
        vec!["alpha", "beta"]
    );
    assert_eq!(
        names(db.stores.agents.list_enabled(&ws()).await.unwrap()),
        vec!["alpha"]
    );

    let mut changed = a.clone();
    changed.name = "alpha-2".into();
    changed.scope = json!({"channel": "web", "actor_id": "u1"});
    changed.enabled = false;
    changed.delivery_policy = json!({"concurrency": "reject"});
    changed.budgets = json!({"max_model_calls": 3});
    changed.routing = crate::AgentRouting::Direct;
    changed.created_at = Utc::now() + TimeDelta::days(1); // ignored
    let updated = db.stores.agents.update(changed).await.unwrap();
    assert_eq!(updated.name, "alpha-2");
    assert_eq!(updated.routing, crate::AgentRouting::Direct);
    assert_eq!(updated.budgets, json!({"max_model_calls": 3}));
    assert_eq!(updated.bot_id, None);
    assert_eq!(updated.channel.as_deref(), Some("web"));
    assert_eq!(updated.actor_id.as_deref(), Some("u1"));
    assert_eq!(updated.created_at, a.created_at);
    assert!(updated.updated_at >= a.updated_at);
    assert_eq!(
        db.stores.agents.get(&ws(), a.id).await.unwrap().unwrap(),
        updated
    );
    assert!(
        db.stores
            .agents
            .list_enabled(&ws())
            .await
            .unwrap()
            .is_empty()
    );

    let mut clash = b.clone();
    clash.name = "alpha-2".into();
    assert_code(db.stores.agents.update(clash).await, ErrorCode::Conflict);
    let mut ghost = b.clone();
    ghost.id = AgentId::new();
    assert_code(db.stores.agents.update(ghost).await, ErrorCode::NotFound);
    let mut wrong_ws = b.clone();
    wrong_ws.workspace_id = other_ws();
    assert_code(db.stores.agents.update(wrong_ws).await, ErrorCode::NotFound);
    let mut bad_scope = agent("gamma", ws());
    bad_scope.scope = json!(["not", "an", "object"]);
    assert_code(
        db.stores.agents.create(bad_scope).await,
        ErrorCode::InvalidArgument,
    );
    let mut bad_budgets = agent("gamma", ws());
    bad_budgets.budgets = json!([1]);
    assert_code(
        db.stores.agents.create(bad_budgets).await,
        ErrorCode::InvalidArgument,
    );
    let mut bad_budgets = b.clone();
    bad_budgets.budgets = json!(7);
    assert_code(
        db.stores.agents.update(bad_budgets).await,
        ErrorCode::InvalidArgument,
    );

    assert!(
        !db.stores.agents.delete(&ws(), other.id).await.unwrap(),
        "other workspace"
    );
    assert!(db.stores.agents.delete(&ws(), b.id).await.unwrap());
    assert!(!db.stores.agents.delete(&ws(), b.id).await.unwrap());
    assert_eq!(
        names(db.stores.agents.list(&ws()).await.unwrap()),
        vec!["alpha-2"]
    );
    assert_eq!(
        names(db.stores.agents.list(&other_ws()).await.unwrap()),
        vec!["alpha"]
    );
}

/// The last announcement of a runner wins.
pub async fn runner_upsert_replaces(db: &TestDb) {
    let row = |id: &str, pool: &str, version: &str| RunnerRow {
        id: id.into(),
        plugin_id: "acme/echo".into(),
        pool: pool.into(),
        version: version.into(),
        descriptor: json!({"id": id, "capabilities": {"streaming": true}}),
        seen_at: Utc::now(),
    };
    db.stores
        .runners
        .upsert(row("plugin:acme/echo/b", "default", "1.0.0"))
        .await
        .unwrap();
    db.stores
        .runners
        .upsert(row("plugin:acme/echo/a", "default", "1.0.0"))
        .await
        .unwrap();
    let replacement = row("plugin:acme/echo/b", "gpu", "2.0.0");
    db.stores.runners.upsert(replacement.clone()).await.unwrap();
    let got = db
        .stores
        .runners
        .get("plugin:acme/echo/b")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.pool, "gpu");
    assert_eq!(got.version, "2.0.0");
    assert_eq!(got.descriptor, replacement.descriptor);
    assert_eq!(
        got.seen_at.timestamp_micros(),
        replacement.seen_at.timestamp_micros()
    );
    let ids: Vec<_> = db
        .stores
        .runners
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(ids, vec!["plugin:acme/echo/a", "plugin:acme/echo/b"]);
    assert!(
        db.stores
            .runners
            .get("plugin:x/y/z")
            .await
            .unwrap()
            .is_none()
    );
}

/// Keys authenticate (with their id, workspace and role) until revoked; only the SHA-256
/// is stored; keys are addressed within their workspace.
pub async fn api_keys_create_authenticate_revoke(db: &TestDb) {
    db.stores.tenancy.ensure_workspace(&ws()).await.unwrap();
    db.stores.tenancy.ensure_workspace(&ws()).await.unwrap();
    let key = db
        .stores
        .tenancy
        .create_api_key(&ws(), Some("ci"), ApiKeyRole::Client)
        .await
        .unwrap();
    assert!(key.plaintext.starts_with("sb_"));
    assert_eq!(key.plaintext.len(), 3 + 43);
    assert!(key.plaintext.starts_with(&key.record.prefix));
    assert_eq!(key.record.workspace_id, ws());
    assert_eq!(key.record.role, ApiKeyRole::Client);
    assert_eq!(key.record.name.as_deref(), Some("ci"));
    assert!(key.record.revoked_at.is_none());
    let second = db
        .stores
        .tenancy
        .create_api_key(&other_ws(), None, ApiKeyRole::Admin)
        .await
        .unwrap();
    assert_ne!(key.plaintext, second.plaintext);

    assert_eq!(
        db.stores
            .tenancy
            .authenticate(&key.plaintext)
            .await
            .unwrap(),
        Some(AuthenticatedKey {
            key_id: key.record.id,
            workspace_id: ws(),
            role: ApiKeyRole::Client,
        })
    );
    assert_eq!(
        db.stores
            .tenancy
            .authenticate(&second.plaintext)
            .await
            .unwrap(),
        Some(AuthenticatedKey {
            key_id: second.record.id,
            workspace_id: other_ws(),
            role: ApiKeyRole::Admin,
        })
    );
    for wrong in [
        "",
        "sb_",
        "nope",
        &key.plaintext[..key.plaintext.len() - 1],
        &format!("{}x", key.plaintext),
    ] {
        assert_eq!(
            db.stores.tenancy.authenticate(wrong).await.unwrap(),
            None,
            "{wrong}"
        );
    }

    // Only the hash is stored, next to the role.
    let backend = db.store.backend();
    let row = db
        .store
        .connection()
        .query_one_raw(Statement::from_string(
            backend,
            "SELECT key_hash, prefix, role FROM api_keys ORDER BY created_at, id",
        ))
        .await
        .unwrap()
        .unwrap();
    let hash: String = row.try_get("", "key_hash").unwrap();
    assert_eq!(hash, hex::encode(Sha256::digest(key.plaintext.as_bytes())));
    assert!(!hash.contains(&key.plaintext[3..]));
    let role: String = row.try_get("", "role").unwrap();
    assert_eq!(role, "client");

    let listed = db.stores.tenancy.list_api_keys(&ws()).await.unwrap();
    assert_eq!(listed, vec![key.record.clone()]);

    // Addressed within the workspace: another workspace's key is not there.
    assert_eq!(
        db.stores
            .tenancy
            .get_api_key(&ws(), key.record.id)
            .await
            .unwrap(),
        Some(key.record.clone())
    );
    assert_eq!(
        db.stores
            .tenancy
            .get_api_key(&other_ws(), key.record.id)
            .await
            .unwrap(),
        None
    );
    assert!(
        !db.stores
            .tenancy
            .revoke(&other_ws(), key.record.id)
            .await
            .unwrap()
    );
    assert!(
        db.stores
            .tenancy
            .authenticate(&key.plaintext)
            .await
            .unwrap()
            .is_some(),
        "a revoke through another workspace leaves the key alone"
    );

    assert!(
        db.stores
            .tenancy
            .revoke(&ws(), key.record.id)
            .await
            .unwrap()
    );
    assert!(
        !db.stores
            .tenancy
            .revoke(&ws(), key.record.id)
            .await
            .unwrap()
    );
    assert_eq!(
        db.stores
            .tenancy
            .authenticate(&key.plaintext)
            .await
            .unwrap(),
        None
    );
    assert!(
        db.stores
            .tenancy
            .authenticate(&second.plaintext)
            .await
            .unwrap()
            .is_some()
    );
    let revoked = db
        .stores
        .tenancy
        .get_api_key(&ws(), key.record.id)
        .await
        .unwrap()
        .unwrap();
    assert!(revoked.revoked_at.is_some());
    assert_eq!(
        db.stores.tenancy.list_api_keys(&ws()).await.unwrap(),
        vec![revoked]
    );
    assert!(
        !db.stores
            .tenancy
            .revoke(&ws(), uuid::Uuid::now_v7())
            .await
            .unwrap()
    );
    assert_eq!(
        db.stores
            .tenancy
            .get_api_key(&ws(), uuid::Uuid::now_v7())
            .await
            .unwrap(),
        None
    );

    // A stored role this version does not know never authenticates.
    let third = db
        .stores
        .tenancy
        .create_api_key(&ws(), None, ApiKeyRole::Admin)
        .await
        .unwrap();
    db.store
        .connection()
        .execute_unprepared("UPDATE api_keys SET role = 'root' WHERE role = 'admin'")
        .await
        .unwrap();
    assert!(matches!(
        db.stores.tenancy.authenticate(&third.plaintext).await,
        Err(StoreError::Corrupt(_))
    ));
}
