//! The resource registry routes (`/v1/models`, `/v1/tools`, `/v1/knowledge-bases`): the real
//! router on in-memory SQLite, the memory bus and the memory session store.

use std::time::Duration;

use axum::http::StatusCode;
use sb_common::config::{EgressConfig, SecretsConfig};
use sb_common::egress::EgressPolicy;
use sb_common::secrets::SecretPolicy;
use sb_gateway::GatewayOptions;
use sb_protocol::ids::WorkspaceId;
use sb_store::resources::MAX_DOCUMENT_BYTES;
use sb_store::{ArtifactContent, ArtifactScope, KbHit, KbSearch, NewArtifact};
use serde_json::{Value, json};

mod support;

use support::Harness;

/// The secrets the registrations below reference.
const ALLOWED_SECRETS: [&str; 2] = ["SB_TEST_OPENAI_KEY", "SB_TEST_WEATHER_KEY"];

async fn harness() -> Harness {
    harness_with(GatewayOptions::default()).await
}

/// A gateway with `options`, allowing loopback (`egress.allow`) and [`ALLOWED_SECRETS`]
/// (`secrets.allow`), as a deployment with a local model server would.
async fn harness_with(mut options: GatewayOptions) -> Harness {
    options.providers.egress = EgressPolicy::from_config(&EgressConfig {
        allow: vec!["127.0.0.0/8".into()],
    });
    options.providers.secrets = SecretPolicy::from_config(&SecretsConfig {
        allow: ALLOWED_SECRETS.iter().map(|s| (*s).to_owned()).collect(),
    });
    Harness::start(options).await
}

impl Harness {
    /// Creates knowledge base `name`; panics unless the API answers `201`. Returns its id.
    async fn create_kb(&self, name: &str) -> String {
        let (status, kb) = self
            .call("POST", "/v1/knowledge-bases", Some(&json!({"name": name})))
            .await;
        assert_eq!(status, StatusCode::CREATED, "{kb}");
        kb["kb_id"].as_str().expect("kb_id").to_owned()
    }

    /// The store's top 5 hits for `query` in knowledge base `kb_id` of workspace `default`:
    /// what a run's `retrieve_knowledge` would find.
    async fn search(&self, kb_id: &str, query: &str) -> Vec<KbHit> {
        self.stores
            .resources
            .search_kb(KbSearch {
                workspace_id: WorkspaceId::default_workspace(),
                kb_id: kb_id.parse().unwrap(),
                query: query.into(),
                top_k: 5,
                document_ids: vec![],
            })
            .await
            .unwrap()
    }
}

#[tokio::test]
async fn models_register_list_and_never_hold_a_key() {
    let h = harness().await;
    let body = json!({
        "name": "gpt", "kind": "llm", "base_url": "http://127.0.0.1:9/v1",
        "model_name": "gpt-4o-mini", "api_key_env": "SB_TEST_OPENAI_KEY",
        "context_window": 128000, "extra_args": {"temperature": 0.2}
    });
    let (status, created) = h.call("POST", "/v1/models", Some(&body)).await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert!(created["model_id"].as_str().is_some());
    assert_eq!(created["kind"], "llm");
    assert_eq!(created["context_window"], 128000);
    assert_eq!(created["api_key_env"], "SB_TEST_OPENAI_KEY");
    let (status, dup) = h.call("POST", "/v1/models", Some(&body)).await;
    assert_eq!(status, StatusCode::CONFLICT, "{dup}");

    // A pasted key instead of a variable name is refused, not stored.
    let mut leaked = body.clone();
    leaked["name"] = json!("other");
    leaked["api_key_env"] = json!("sk-live-1234 secret");
    let (status, err) = h.call("POST", "/v1/models", Some(&leaked)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{err}");
    assert!(!err.to_string().contains("sk-live-1234"), "{err}");
    let mut bad = body.clone();
    bad["name"] = json!("x");
    bad["kind"] = json!("embedding");
    assert_eq!(
        h.call("POST", "/v1/models", Some(&bad)).await.0,
        StatusCode::BAD_REQUEST
    );
    let mut bad = body.clone();
    bad["name"] = json!("y");
    bad["base_url"] = json!("ftp://x");
    assert_eq!(
        h.call("POST", "/v1/models", Some(&bad)).await.0,
        StatusCode::BAD_REQUEST
    );

    let (status, list) = h.call("GET", "/v1/models", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    assert_eq!(list["items"][0]["model_id"], created["model_id"]);
}

#[tokio::test]
async fn tools_register_with_http_settings() {
    let h = harness().await;
    let body = json!({
        "name": "weather", "description": "current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "kind": "http", "url": "http://127.0.0.1:9/weather", "timeout_ms": 2000,
        "headers_env": {"X-Api-Key": "SB_TEST_WEATHER_KEY"}
    });
    let (status, created) = h.call("POST", "/v1/tools", Some(&body)).await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["name"], "weather");
    assert_eq!(created["timeout_ms"], 2000);
    assert_eq!(created["max_response_bytes"], 1024 * 1024);
    assert_eq!(created["headers_env"]["X-Api-Key"], "SB_TEST_WEATHER_KEY");
    for (field, value) in [
        ("kind", json!("mcp")),
        ("url", json!("not a url")),
        ("timeout_ms", json!(0)),
        ("headers_env", json!({"X-Api-Key": "literal value"})),
        ("name", json!("has space")),
    ] {
        let mut bad = body.clone();
        bad[field] = value;
        if field != "name" {
            bad["name"] = json!(format!("t-{field}"));
        }
        let (status, err) = h.call("POST", "/v1/tools", Some(&bad)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{field}: {err}");
    }
    let (_, list) = h.call("GET", "/v1/tools", None).await;
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
}

/// `POST path` with `body` must be a `400 invalid_argument` whose message contains `needle`.
async fn refused(h: &Harness, path: &str, body: Value, needle: &str) {
    let (status, err) = h.call("POST", path, Some(&body)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {err}");
    assert_eq!(err["code"], "invalid_argument", "{err}");
    let message = err["message"].as_str().unwrap_or_default();
    assert!(message.contains(needle), "{body}: {message}");
}

/// The attacks of the security review, at registration: a tenant naming the host's own
/// configuration (or any secret the operator did not make available), and model or tool
/// URLs aimed at metadata, loopback, unspecified, private addresses or carrying
/// credentials. Each is a `400 invalid_argument` naming the rule, and nothing is stored.
#[tokio::test]
async fn registrations_cannot_name_host_secrets_or_reach_internal_addresses() {
    // The production default: public addresses only, no secret allowed.
    let strict = Harness::start(GatewayOptions::default()).await;
    // What `switchboard dev` allows, plus the two test secrets.
    let dev = harness().await;
    let model = |name: &str, base_url: &str, key: Option<&str>| {
        json!({"name": name, "kind": "llm", "base_url": base_url, "model_name": "m",
               "api_key_env": key})
    };
    let tool = |name: &str, url: &str, header_env: &str| {
        json!({"name": name, "kind": "http", "url": url,
               "headers_env": {"Authorization": header_env}})
    };
    // 1. Environment exfiltration: the host's variables can never be named, anything else
    //    only when allowed.
    for (env, needle) in [
        ("SWITCHBOARD__BUS__URL", "host's own configuration"),
        ("SWITCHBOARD__DATABASE__URL", "host's own configuration"),
        ("SWITCHBOARD__SESSIONS__URL", "host's own configuration"),
        ("HOME", "secrets.allow"),
    ] {
        refused(
            &dev,
            "/v1/models",
            model("m", "https://api.example.com/v1", Some(env)),
            needle,
        )
        .await;
        refused(
            &dev,
            "/v1/tools",
            tool("t", "https://api.example.com/t", env),
            needle,
        )
        .await;
    }
    refused(
        &strict,
        "/v1/models",
        model(
            "m",
            "https://api.example.com/v1",
            Some("SB_TEST_OPENAI_KEY"),
        ),
        "secrets.allow",
    )
    .await;
    // 2. SSRF targets, refused in every mode (metadata, link-local, credentials) or unless
    //    allowed (loopback, unspecified, private).
    for (h, url, needle) in [
        (&dev, "http://169.254.169.254/latest/meta-data/", "metadata"),
        (&dev, "http://[fd00:ec2::254]/", "metadata"),
        (&dev, "http://metadata.google.internal/", "metadata"),
        (&dev, "http://169.254.10.10:8080/", "link-local"),
        (&dev, "http://user:secret@127.0.0.1:9/v1", "credentials"),
        (&dev, "http://0.0.0.0:6379/", "unspecified"),
        (&dev, "http://10.0.0.7/", "private"),
        (&dev, "http://192.168.1.1/", "private"),
        (&dev, "http://[::1]:5432/", "loopback"),
        (&strict, "http://127.0.0.1:6379/", "loopback"),
        (&strict, "http://127.1:5672/", "loopback"),
        (&strict, "http://[::ffff:127.0.0.1]:5432/", "loopback"),
        (&dev, "ftp://example.com/", "http or https"),
    ] {
        refused(h, "/v1/models", model("m", url, None), needle).await;
        refused(
            h,
            "/v1/tools",
            tool("t", url, "SB_TEST_WEATHER_KEY"),
            needle,
        )
        .await;
    }
    for h in [&strict, &dev] {
        for path in ["/v1/models", "/v1/tools"] {
            let (_, list) = h.call("GET", path, None).await;
            assert_eq!(list["items"], json!([]), "nothing stored: {list}");
        }
    }
    // What the policy allows still registers.
    let (status, created) = dev
        .call(
            "POST",
            "/v1/models",
            Some(&model(
                "local",
                "http://127.0.0.1:11434/v1",
                Some("SB_TEST_OPENAI_KEY"),
            )),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
}

/// `limits.tool_timeout_max` and `limits.tool_response_bytes_max` bound registrations: a
/// value at the ceiling is taken, one above is refused naming the field and the ceiling,
/// and the defaults of an omitted field are lowered to a smaller ceiling.
#[tokio::test]
async fn tool_registrations_stay_within_the_configured_ceilings() {
    let h = harness_with(GatewayOptions {
        tool_timeout_max: Duration::from_secs(5),
        tool_response_bytes_max: 4096,
        ..GatewayOptions::default()
    })
    .await;
    let tool = |name: &str, timeout_ms: u64, max_response_bytes: u64| {
        json!({"name": name, "kind": "http", "url": "http://127.0.0.1:9/t",
               "timeout_ms": timeout_ms, "max_response_bytes": max_response_bytes})
    };
    for (body, field, ceiling) in [
        (
            tool("slow", 5001, 4096),
            "timeout_ms",
            "5000 (limits.tool_timeout_max)",
        ),
        (
            tool("wordy", 5000, 4097),
            "max_response_bytes",
            "4096 (limits.tool_response_bytes_max)",
        ),
    ] {
        let (status, err) = h.call("POST", "/v1/tools", Some(&body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{field}: {err}");
        assert_eq!(err["code"], "invalid_argument", "{err}");
        assert_eq!(
            err["message"],
            format!("{field} must be between 1 and {ceiling}"),
        );
    }
    let (status, created) = h
        .call("POST", "/v1/tools", Some(&tool("at-cap", 5000, 4096)))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["timeout_ms"], 5000);
    assert_eq!(created["max_response_bytes"], 4096);
    let defaults = json!({"name": "defaults", "kind": "http", "url": "http://127.0.0.1:9/t"});
    let (status, created) = h.call("POST", "/v1/tools", Some(&defaults)).await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["timeout_ms"], 5000);
    assert_eq!(created["max_response_bytes"], 4096);
    let (_, list) = h.call("GET", "/v1/tools", None).await;
    assert_eq!(list["items"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn knowledge_bases_take_documents_that_become_searchable() {
    let h = harness().await;
    let kb_id = h.create_kb("handbook").await;
    let (status, doc) = h
        .call(
            "POST",
            &format!("/v1/knowledge-bases/{kb_id}/documents"),
            Some(&json!({"title": "leave", "text": "Annual leave is 25 days.\n\nSick leave is separate."})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{doc}");
    assert_eq!(doc["chunks"], 1);
    let (status, _) = h
        .call(
            "POST",
            "/v1/knowledge-bases/not-a-uuid/documents",
            Some(&json!({"title": "t", "text": "x"})),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = h
        .call(
            "POST",
            &format!("/v1/knowledge-bases/{}/documents", uuid::Uuid::now_v7()),
            Some(&json!({"title": "t", "text": "x"})),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = h
        .call(
            "POST",
            &format!("/v1/knowledge-bases/{kb_id}/documents"),
            Some(&json!({"title": "t", "text": "   "})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let hits = h.search(&kb_id, "annual leave").await;
    assert_eq!(hits.len(), 1);
    assert_eq!(hits[0].title, "leave");
    let (_, list) = h.call("GET", "/v1/knowledge-bases", None).await;
    assert_eq!(list["items"][0]["kb_id"], kb_id.as_str());
}

/// An inline artifact of `workspace`, scoped to the workspace, from `source`, holding `bytes`.
fn inline_artifact(workspace: &str, source: &str, bytes: &[u8]) -> NewArtifact {
    NewArtifact::inline(
        WorkspaceId::new(workspace).unwrap(),
        "file",
        source,
        ArtifactScope::Workspace,
        bytes.to_vec(),
    )
}

/// Stores `artifact`; returns its id.
async fn put(h: &Harness, artifact: NewArtifact) -> String {
    h.stores.artifacts.put(artifact).await.unwrap().id
}

/// Registers an inline artifact holding `bytes` in `workspace`; returns its id.
async fn artifact(h: &Harness, workspace: &str, bytes: &[u8]) -> String {
    put(h, inline_artifact(workspace, "api", bytes)).await
}

/// `POST {docs}`: a document titled `title` read from artifact `artifact_id`.
async fn document_from(
    h: &Harness,
    docs: &str,
    title: &str,
    artifact_id: &str,
) -> (StatusCode, Value) {
    h.call(
        "POST",
        docs,
        Some(&json!({"title": title, "artifact_id": artifact_id})),
    )
    .await
}

#[tokio::test]
async fn documents_can_be_read_from_an_artifact_of_the_workspace() {
    let h = harness().await;
    let kb_id = h.create_kb("handbook").await;
    let docs = format!("/v1/knowledge-bases/{kb_id}/documents");

    let text = "Parental leave is 16 weeks.\n\nIt can be split in two.";
    let ours = artifact(&h, "default", text.as_bytes()).await;
    let (status, doc) = document_from(&h, &docs, "parental", &ours).await;
    assert_eq!(status, StatusCode::CREATED, "{doc}");
    assert_eq!(doc["artifact_id"], ours.as_str(), "the source is recorded");
    assert_eq!(doc["size_bytes"], text.len());
    let hits = h.search(&kb_id, "parental leave").await;
    assert_eq!(hits.len(), 1);
    assert_eq!(hits[0].title, "parental");
    assert_eq!(hits[0].content, text);
    assert_eq!(
        hits[0].document_id.to_string(),
        doc["document_id"].as_str().unwrap()
    );

    // Another workspace's artifact, an unknown one and an expired one look alike: 404.
    let foreign = artifact(&h, "elsewhere", b"not yours").await;
    let mut expired = inline_artifact("default", "api", b"too late");
    expired.expires_at = Some(chrono::Utc::now() - chrono::TimeDelta::minutes(1));
    let expired = put(&h, expired).await;
    for id in [foreign.as_str(), "no-such-artifact", expired.as_str()] {
        let (status, err) = document_from(&h, &docs, "t", id).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{id}: {err}");
        assert_eq!(err["code"], "not_found", "{err}");
        assert_eq!(err["message"], format!("artifact {id} not found"));
    }

    // Binary content is refused with the reason; so is content the host does not hold.
    let binary = artifact(&h, "default", &[0x89, b'P', b'N', b'G', 0xff, 0xfe, 0]).await;
    let (status, err) = document_from(&h, &docs, "t", &binary).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{err}");
    assert_eq!(err["code"], "invalid_argument");
    assert!(
        err["message"].as_str().unwrap().contains("not UTF-8 text"),
        "{err}"
    );
    let mut external = inline_artifact("default", "platform", &[]);
    external.content = ArtifactContent::Url("https://example.com/a.txt".into());
    let external = put(&h, external).await;
    let (status, err) = document_from(&h, &docs, "t", &external).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{err}");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("no content stored by the host"),
        "{err}"
    );

    // The size limit of text documents holds for artifacts too.
    let big = artifact(&h, "default", &vec![b'a'; MAX_DOCUMENT_BYTES + 1]).await;
    let (status, err) = document_from(&h, &docs, "t", &big).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{err}");
    assert_eq!(err["code"], "payload_too_large");

    // Exactly one of `text` and `artifact_id`.
    for body in [
        json!({"title": "t", "text": "x", "artifact_id": ours}),
        json!({"title": "t"}),
    ] {
        let (status, err) = h.call("POST", &docs, Some(&body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {err}");
        assert_eq!(err["code"], "invalid_argument");
        assert!(
            err["message"].as_str().unwrap().contains("exactly one of"),
            "{err}"
        );
    }
    let (_, list) = h.call("GET", "/v1/knowledge-bases", None).await;
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
}
