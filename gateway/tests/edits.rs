//! Editing and deleting registered resources and schedules (`PATCH`/`DELETE` of
//! `/v1/models/{id}`, `/v1/tools/{id}`, `/v1/knowledge-bases/{id}` and its documents,
//! `/v1/schedules/{id}`): the real router on in-memory SQLite. The store methods behind
//! them run on Postgres as well in `sb-store`'s `edits` suite.

use axum::http::StatusCode;
use chrono::Utc;
use sb_common::config::{EgressConfig, SecretsConfig};
use sb_common::egress::EgressPolicy;
use sb_common::secrets::SecretPolicy;
use sb_gateway::GatewayOptions;
use sb_protocol::ids::WorkspaceId;
use sb_store::KbSearch;
use sb_store::agents::NewAgent;
use serde_json::{Value, json};

mod support;

use support::Harness;

const SECRET: &str = "SB_TEST_EDIT_KEY";

async fn harness() -> Harness {
    let mut options = GatewayOptions::default();
    options.providers.egress = EgressPolicy::from_config(&EgressConfig {
        allow: vec!["127.0.0.0/8".into()],
    });
    options.providers.secrets = SecretPolicy::from_config(&SecretsConfig {
        allow: vec![SECRET.into()],
    });
    Harness::start(options).await
}

impl Harness {
    async fn created(&self, path: &str, body: Value) -> Value {
        let (status, answer) = self.call("POST", path, Some(&body)).await;
        assert_eq!(status, StatusCode::CREATED, "{path}: {answer}");
        answer
    }

    /// An agent of workspace `default` with `resource_policy` and `runner_config`, written
    /// to the store directly (what it refers to is all that matters here).
    async fn agent_using(&self, name: &str, resource_policy: Value, runner_config: Value) {
        self.stores
            .agents
            .create(NewAgent {
                id: None,
                workspace_id: WorkspaceId::default_workspace(),
                name: name.into(),
                description: None,
                runner_id: "plugin:acme/echo".into(),
                runner_config,
                event_types: json!(["message.received"]),
                scope: json!({"conversation_id": name}),
                filters: json!([]),
                resource_policy,
                state_policy: json!({}),
                delivery_policy: json!({}),
                budgets: json!({}),
                enabled: true,
                routing: sb_store::AgentRouting::Scope,
            })
            .await
            .unwrap();
    }
}

fn model_body(name: &str) -> Value {
    json!({"name": name, "kind": "llm", "base_url": "http://127.0.0.1:9/v1",
           "model_name": "m", "api_key_env": SECRET})
}

#[tokio::test]
async fn a_model_patch_is_validated_like_a_registration_and_answers_the_view() {
    let h = harness().await;
    let m = h.created("/v1/models", model_body("gpt")).await;
    let path = format!("/v1/models/{}", m["model_id"].as_str().unwrap());

    let (status, updated) = h
        .call(
            "PATCH",
            &path,
            Some(&json!({"context_window": 4096, "model_name": "m2"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{updated}");
    assert_eq!(updated["model_id"], m["model_id"]);
    assert_eq!(updated["context_window"], 4096);
    assert_eq!(updated["model_name"], "m2");
    assert_eq!(
        updated["api_key_env"], SECRET,
        "fields not in the patch stay"
    );
    let (_, read) = h.call("GET", &path, None).await;
    assert_eq!(read, updated);

    // The checks of create: egress, secrets, unknown fields, types.
    for (patch, needle) in [
        (json!({"base_url": "http://169.254.169.254/v1"}), "base_url"),
        (json!({"api_key_env": "HOME"}), "api_key_env"),
        (json!({"colour": "blue"}), "colour"),
        (json!({"kind": "vision"}), "kind"),
        (json!({"model_id": "x"}), "model_id"),
    ] {
        let (status, error) = h.call("PATCH", &path, Some(&patch)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{patch}: {error}");
        assert_eq!(error["code"], "invalid_argument", "{error}");
        assert!(
            error["message"].as_str().unwrap().contains(needle),
            "{patch}: {error}"
        );
    }
    // `null` clears an optional field.
    let (status, cleared) = h
        .call("PATCH", &path, Some(&json!({"api_key_env": null})))
        .await;
    assert_eq!(status, StatusCode::OK, "{cleared}");
    assert_eq!(cleared["api_key_env"], Value::Null);
    // A taken name is a conflict; an unknown id is 404.
    h.created("/v1/models", model_body("other")).await;
    let (status, _) = h
        .call("PATCH", &path, Some(&json!({"name": "other"})))
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    let unknown = format!("/v1/models/{}", uuid::Uuid::now_v7());
    assert_eq!(
        h.call("PATCH", &unknown, Some(&json!({}))).await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        h.call("DELETE", &unknown, None).await.0,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn deleting_what_an_agent_uses_is_a_conflict_naming_the_agent() {
    let h = harness().await;
    let m = h.created("/v1/models", model_body("gpt")).await;
    let model_id = m["model_id"].as_str().unwrap().to_owned();
    let t = h
        .created(
            "/v1/tools",
            json!({"name": "weather", "kind": "http", "url": "http://127.0.0.1:9/w"}),
        )
        .await;
    let kb = h
        .created("/v1/knowledge-bases", json!({"name": "docs"}))
        .await;
    let kb_id = kb["kb_id"].as_str().unwrap().to_owned();
    h.agent_using(
        "assistant",
        json!({"allowed_tool_names": ["weather"], "allowed_kb_uuids": [kb_id]}),
        json!({"model": {"primary": model_id}}),
    )
    .await;

    let tool_path = format!("/v1/tools/{}", t["tool_id"].as_str().unwrap());
    for path in [
        format!("/v1/models/{model_id}"),
        tool_path.clone(),
        format!("/v1/knowledge-bases/{kb_id}"),
    ] {
        let (status, error) = h.call("DELETE", &path, None).await;
        assert_eq!(status, StatusCode::CONFLICT, "{path}: {error}");
        assert_eq!(error["code"], "conflict");
        assert!(
            error["message"].as_str().unwrap().contains("assistant"),
            "{error}"
        );
        assert_eq!(
            h.call("GET", &path, None).await.0,
            StatusCode::OK,
            "still there"
        );
    }
    // Agents grant tools by name: a rename is refused too; other edits are not.
    let (status, error) = h
        .call("PATCH", &tool_path, Some(&json!({"name": "weather2"})))
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{error}");
    let (status, tool) = h
        .call(
            "PATCH",
            &tool_path,
            Some(&json!({"url": "http://127.0.0.1:10/w", "timeout_ms": 500})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{tool}");
    assert_eq!(tool["url"], "http://127.0.0.1:10/w");
    assert_eq!(tool["timeout_ms"], 500);
    let (status, error) = h
        .call(
            "PATCH",
            &tool_path,
            Some(&json!({"url": "http://10.1.2.3/w"})),
        )
        .await;
    assert_eq!(
        status,
        StatusCode::BAD_REQUEST,
        "egress applies to edits: {error}"
    );

    // An unused resource is deleted: 204, then 404.
    let spare = h.created("/v1/models", model_body("spare")).await;
    let spare_path = format!("/v1/models/{}", spare["model_id"].as_str().unwrap());
    assert_eq!(
        h.call("DELETE", &spare_path, None).await.0,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        h.call("GET", &spare_path, None).await.0,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn documents_are_listed_retitled_and_deleted_out_of_the_index() {
    let h = harness().await;
    let kb = h
        .created("/v1/knowledge-bases", json!({"name": "docs"}))
        .await;
    let kb_id = kb["kb_id"].as_str().unwrap().to_owned();
    let doc = h
        .created(
            &format!("/v1/knowledge-bases/{kb_id}/documents"),
            json!({"title": "Refunds", "text": "refunds take five days"}),
        )
        .await;
    let doc_path = format!(
        "/v1/knowledge-bases/{kb_id}/documents/{}",
        doc["document_id"].as_str().unwrap()
    );
    let (status, list) = h
        .call(
            "GET",
            &format!("/v1/knowledge-bases/{kb_id}/documents"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{list}");
    assert_eq!(list["items"][0]["chunks"], 1);

    let (status, edited) = h
        .call(
            "PATCH",
            &doc_path,
            Some(&json!({"title": "Refund policy", "metadata": {"lang": "en"}})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{edited}");
    assert_eq!(edited["title"], "Refund policy");
    assert_eq!(edited["metadata"], json!({"lang": "en"}));
    assert_eq!(edited["chunks"], 1);
    let (status, error) = h
        .call("PATCH", &doc_path, Some(&json!({"text": "x"})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");

    let search = || {
        h.stores.resources.search_kb(KbSearch {
            workspace_id: WorkspaceId::default_workspace(),
            kb_id: kb_id.parse().unwrap(),
            query: "refunds".into(),
            top_k: 5,
            document_ids: vec![],
        })
    };
    assert_eq!(search().await.unwrap()[0].title, "Refund policy");
    assert_eq!(
        h.call("DELETE", &doc_path, None).await.0,
        StatusCode::NO_CONTENT
    );
    assert!(
        search().await.unwrap().is_empty(),
        "no chunk of a deleted document"
    );
    assert_eq!(
        h.call("DELETE", &doc_path, None).await.0,
        StatusCode::NOT_FOUND
    );

    let (status, renamed) = h
        .call(
            "PATCH",
            &format!("/v1/knowledge-bases/{kb_id}"),
            Some(&json!({"name": "manuals"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{renamed}");
    assert_eq!(renamed["name"], "manuals");
    assert_eq!(
        h.call("DELETE", &format!("/v1/knowledge-bases/{kb_id}"), None)
            .await
            .0,
        StatusCode::NO_CONTENT
    );
}

#[tokio::test]
async fn a_paused_schedule_is_not_due_and_resumes_from_now() {
    let h = harness().await;
    let created = h
        .created(
            "/v1/schedules",
            json!({"kind": "interval", "spec": "1h", "event": {
                "event_type": "message.received", "source": "api",
                "conversation_id": "daily", "input": {"text": "tick"}}}),
        )
        .await;
    let path = format!("/v1/schedules/{}", created["schedule_id"].as_str().unwrap());

    let (status, paused) = h
        .call("PATCH", &path, Some(&json!({"enabled": false})))
        .await;
    assert_eq!(status, StatusCode::OK, "{paused}");
    assert_eq!(paused["enabled"], false);
    assert_eq!(paused["next_fire_at"], Value::Null);
    let later = Utc::now() + chrono::TimeDelta::hours(3);
    assert!(
        h.stores.schedules.due(later, 10).await.unwrap().is_empty(),
        "a paused schedule is never due"
    );

    let before = Utc::now().timestamp();
    let (status, resumed) = h
        .call("PATCH", &path, Some(&json!({"enabled": true})))
        .await;
    assert_eq!(status, StatusCode::OK, "{resumed}");
    let next = resumed["next_fire_at"].as_i64().unwrap();
    assert!(
        (before + 3600..=Utc::now().timestamp() + 3600).contains(&next),
        "{resumed}"
    );

    // Edits are validated like a create body.
    for patch in [
        json!({"spec": "soon"}),
        json!({"event": {"event_type": "message.received"}}),
        json!({"event": {"event_id": "e1", "event_type": "message.received", "source": "api",
                         "conversation_id": "c", "input": {"text": "x"}}}),
        json!({"paused": true}),
    ] {
        let (status, error) = h.call("PATCH", &path, Some(&patch)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{patch}: {error}");
    }
    let (status, respec) = h
        .call(
            "PATCH",
            &path,
            Some(&json!({"spec": "2h", "name": "two-hourly"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{respec}");
    assert_eq!(respec["name"], "two-hourly");
    assert!(respec["next_fire_at"].as_i64().unwrap() >= before + 7200);
    assert_eq!(respec["event"]["input"]["text"], "tick", "the event stays");
}
