//! `artifact_metadata` and `artifact_read`: public metadata (never storage keys, scope or
//! tenant fields) and ranged reads of live artifacts. Expired artifacts are missing (the
//! store's contract).
//!
//! The access matrix, first match wins (host-behaviour §22.2, extended by the artifact's
//! stored visibility scope, SPEC §9):
//!
//! | artifact | visible to the run when |
//! | --- | --- |
//! | in another workspace | never (answered `not_found`) |
//! | created by this run | always, across conversations |
//! | scope `workspace` | always |
//! | scope `runner` | the run's runner created it |
//! | scope `conversation` | both have a conversation, equal, and bot and thread are exactly equal (`null` only equals `null`) |
//! | scope `run` | never (only the creating run) |
//!
//! Artifacts without a conversation are thus never readable by other runs unless their
//! scope says so explicitly.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use sb_protocol::error::AgentApiError;
use sb_protocol::host::AuthorizationSnapshot;
use sb_protocol::proxy::{ArtifactMetadata, ArtifactReadResult};
use sb_store::{ArtifactRecord, ArtifactScope};
use serde_json::Value;

use super::events::Access;
use super::{
    ActionDispatcher, Cx, answer, api_not_granted, invalid, not_found, store_error, unauthorized,
};

/// The artifact access matrix (see the module docs).
pub(crate) fn artifact_access(
    artifact: &ArtifactRecord,
    snapshot: &AuthorizationSnapshot,
) -> Access {
    if artifact.workspace_id != snapshot.workspace_id {
        return Access::Hidden;
    }
    if artifact.run_id == Some(snapshot.run_id) {
        return Access::Allowed;
    }
    let allowed = match artifact.scope {
        ArtifactScope::Workspace => true,
        ArtifactScope::Runner => {
            artifact.runner_id.as_deref() == Some(snapshot.runner_id.to_string().as_str())
        }
        ArtifactScope::Conversation => {
            artifact.conversation_id.is_some()
                && artifact.conversation_id == snapshot.conversation_id
                && artifact.bot_id == snapshot.bot_id
                && artifact.thread_id == snapshot.thread_id
        }
        ArtifactScope::Run => false,
    };
    if allowed {
        Access::Allowed
    } else {
        Access::Denied
    }
}

/// The public metadata of an artifact.
pub(crate) fn artifact_metadata(record: ArtifactRecord) -> ArtifactMetadata {
    ArtifactMetadata {
        artifact_id: record.id,
        artifact_type: record.artifact_type,
        mime_type: record.mime_type,
        name: record.name,
        size_bytes: record.size_bytes.and_then(|s| u64::try_from(s).ok()),
        sha256: record.sha256,
        source: record.source,
        conversation_id: record.conversation_id,
        run_id: record.run_id.map(|r| r.to_string()),
        runner_id: record.runner_id,
        created_at: Some(record.created_at.timestamp()),
        expires_at: record.expires_at.map(|t| t.timestamp()),
        metadata: match record.metadata {
            Value::Object(map) => map,
            _ => serde_json::Map::new(),
        },
    }
}

impl ActionDispatcher {
    /// Loads a live artifact and applies the access matrix (step 5, which needs the row).
    async fn visible_artifact(
        &self,
        snapshot: &AuthorizationSnapshot,
        artifact_id: &str,
        api_name: &str,
    ) -> Result<ArtifactRecord, AgentApiError> {
        let record = self
            .stores
            .artifacts
            .metadata(artifact_id)
            .await
            .map_err(|e| store_error(&e))?;
        match artifact_access(&record, snapshot) {
            Access::Allowed => Ok(record),
            Access::Denied => Err(unauthorized(format!(
                "{api_name} access denied: artifact not in session conversation and not created by this run"
            ))),
            Access::Hidden => Err(not_found(format!("artifact {artifact_id} not found"))),
        }
    }

    pub(super) async fn artifact_metadata(&self, cx: &Cx<'_, '_>) -> Result<Value, AgentApiError> {
        let snap = cx.call.snapshot;
        // 4
        if !snap.available_apis.artifact_metadata {
            return Err(api_not_granted("artifact metadata"));
        }
        // 6
        let artifact_id = cx.p.req_str("artifact_id")?;
        // 7
        self.admit(cx).await?;
        // 5 + action
        let record = self
            .visible_artifact(snap, artifact_id, "artifact metadata")
            .await?;
        answer(&artifact_metadata(record))
    }

    pub(super) async fn artifact_read(&self, cx: &Cx<'_, '_>) -> Result<Value, AgentApiError> {
        let snap = cx.call.snapshot;
        let p = cx.p;
        // 4
        if !snap.available_apis.artifact_read {
            return Err(api_not_granted("artifact read"));
        }
        // 6
        let artifact_id = p.req_str("artifact_id")?;
        let offset = p.opt_i64("offset")?.unwrap_or(0);
        if offset < 0 {
            return Err(invalid("offset must be >= 0"));
        }
        // `length` is the documented name of the range read (`artifact_read_range`).
        let limit = match p.opt_i64("limit")? {
            Some(limit) => Some(limit),
            None => p.opt_i64("length")?,
        };
        let max = i64::try_from(self.limits.artifact_read_max_bytes).unwrap_or(i64::MAX);
        let limit = match limit {
            Some(n) if n <= 0 => return Err(invalid("limit must be > 0")),
            Some(n) => n.min(max),
            None => i64::try_from(self.limits.artifact_read_default_bytes)
                .unwrap_or(max)
                .min(max),
        };
        // 7
        self.admit(cx).await?;
        // 5
        self.visible_artifact(snap, artifact_id, "artifact read")
            .await?;

        let read = self
            .stores
            .artifacts
            .read(artifact_id, offset, Some(limit))
            .await
            .map_err(|e| store_error(&e))?;
        let length = read.content.as_ref().map(|c| c.len() as u64);
        answer(&ArtifactReadResult {
            artifact_id: read.artifact.id,
            mime_type: read.artifact.mime_type,
            size_bytes: read.artifact.size_bytes.and_then(|s| u64::try_from(s).ok()),
            offset: read.offset,
            length,
            content_base64: read.content.map(|c| STANDARD.encode(c)),
            file_key: read.file_key,
            has_more: read.has_more,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use sb_protocol::ids::{RunId, WorkspaceId};
    use serde_json::json;

    fn snapshot() -> AuthorizationSnapshot {
        serde_json::from_value(json!({
            "run_id": RunId::new(), "plugin_id": "a/b", "runner_id": "plugin:a/b/c",
            "binding_id": "x", "workspace_id": "w1", "conversation_id": "c1", "bot_id": "bot",
            "resources": {}, "available_apis": {}, "state_policy": {}, "budgets": {}
        }))
        .unwrap()
    }

    fn record(scope: ArtifactScope) -> ArtifactRecord {
        ArtifactRecord {
            id: "a".into(),
            workspace_id: WorkspaceId::new("w1").unwrap(),
            artifact_type: "file".into(),
            mime_type: None,
            name: None,
            size_bytes: Some(1),
            sha256: None,
            source: "runner".into(),
            scope,
            storage_type: "inline".into(),
            storage_key: None,
            conversation_id: Some("c1".into()),
            thread_id: None,
            bot_id: Some("bot".into()),
            run_id: Some(RunId::new()),
            runner_id: Some("plugin:x/y/z".into()),
            metadata: json!({}),
            expires_at: None,
            created_at: Utc::now(),
        }
    }

    #[test]
    fn access_matrix() {
        let snap = snapshot();
        use Access::*;
        assert_eq!(
            artifact_access(&record(ArtifactScope::Conversation), &snap),
            Allowed
        );
        assert_eq!(artifact_access(&record(ArtifactScope::Run), &snap), Denied);
        assert_eq!(
            artifact_access(&record(ArtifactScope::Workspace), &snap),
            Allowed
        );
        assert_eq!(
            artifact_access(&record(ArtifactScope::Runner), &snap),
            Denied
        );
        let mine = ArtifactRecord {
            runner_id: Some("plugin:a/b/c".into()),
            ..record(ArtifactScope::Runner)
        };
        assert_eq!(artifact_access(&mine, &snap), Allowed);
        // created by this run: visible whatever the scope and conversation
        let own = ArtifactRecord {
            run_id: Some(snap.run_id),
            conversation_id: None,
            ..record(ArtifactScope::Run)
        };
        assert_eq!(artifact_access(&own, &snap), Allowed);
        // conversation scope needs exact bot and thread equality
        let other_thread = ArtifactRecord {
            thread_id: Some("t".into()),
            ..record(ArtifactScope::Conversation)
        };
        assert_eq!(artifact_access(&other_thread, &snap), Denied);
        let other_bot = ArtifactRecord {
            bot_id: None,
            ..record(ArtifactScope::Conversation)
        };
        assert_eq!(artifact_access(&other_bot, &snap), Denied);
        let no_conv = ArtifactRecord {
            conversation_id: None,
            ..record(ArtifactScope::Conversation)
        };
        assert_eq!(artifact_access(&no_conv, &snap), Denied);
        // another tenant: hidden, even if it was "created by this run"
        let foreign = ArtifactRecord {
            workspace_id: WorkspaceId::new("w2").unwrap(),
            run_id: Some(snap.run_id),
            ..record(ArtifactScope::Workspace)
        };
        assert_eq!(artifact_access(&foreign, &snap), Hidden);
    }
}
