//! The Host API actions (SPEC §8 steps 4–7 and the actions themselves), served by
//! `ActionDispatcher` over an in-memory SQLite store and the memory session store, called
//! directly with hand-built authorization snapshots (the gate's steps 1–3 are covered by
//! `tests/api_gate.rs`; one test here goes through the gate to show the wiring).

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use chrono::Utc;
use sb_common::session::SessionStore;
use sb_common::session::memory::MemorySessionStore;
use sb_host_api::actions::{ActionDispatcher, ActionLimits, RateLimit};
use sb_host_api::api::{ApiStream, CallerIdentity, HostApi};
use sb_host_api::api_gate::{ApiGate, Dispatcher, GatedCall};
use sb_protocol::context::StateScope;
use sb_protocol::error::AgentApiError;
use sb_protocol::host::AuthorizationSnapshot;
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::manifest::RunnerId;
use sb_protocol::state_keys::{StateKeyParts, scope_key};
use sb_protocol::wire::HostToRunner;
use sb_store::{
    ArtifactContent, ArtifactScope, EventQuery, NewArtifact, NewEvent, NewTranscriptItem, SqlStore,
    SqlStoreOptions, Stores,
};
use serde_json::{Value, json};
use tokio::sync::mpsc;

const RUNNER: &str = "plugin:acme/agent/default";
const WS: &str = "default";
const CONV: &str = "conv-1";

struct Fx {
    dispatcher: ActionDispatcher,
    stores: Stores,
    sessions: Arc<MemorySessionStore>,
    caller: CallerIdentity,
    stream: ApiStream,
    _chunks: mpsc::Receiver<HostToRunner>,
}

async fn fixture() -> Fx {
    fixture_with(|_| {}).await
}

async fn fixture_with(tune: impl FnOnce(&mut ActionLimits)) -> Fx {
    let sql = SqlStore::connect(
        "sqlite::memory:",
        &SqlStoreOptions {
            migrate: true,
            ..SqlStoreOptions::default()
        },
    )
    .await
    .expect("in-memory sqlite");
    let stores = Stores::from_sql(sql);
    let sessions = Arc::new(MemorySessionStore::new());
    let mut limits = ActionLimits {
        rate_limit: None,
        ..ActionLimits::default()
    };
    tune(&mut limits);
    let dispatcher = ActionDispatcher::new(stores.clone(), sessions.clone(), limits);
    let runner: RunnerId = RUNNER.parse().unwrap();
    let (tx, rx) = mpsc::channel(8);
    Fx {
        dispatcher,
        stores,
        sessions,
        caller: CallerIdentity::for_runner(&runner),
        stream: ApiStream::new("1", tx),
        _chunks: rx,
    }
}

fn ws() -> WorkspaceId {
    WorkspaceId::new(WS).unwrap()
}

fn all_apis() -> Value {
    json!({
        "history_page": true, "history_search": true, "event_get": true, "event_page": true,
        "artifact_metadata": true, "artifact_read": true, "state": true, "storage": true,
        "steering_pull": true, "prompt_get": false
    })
}

/// A snapshot of a fresh run of `RUNNER` in `CONV` with every context API granted and
/// plugin storage; `patch` overrides top-level fields.
fn snap(patch: Value) -> AuthorizationSnapshot {
    let runner: RunnerId = RUNNER.parse().unwrap();
    let mut v = json!({
        "run_id": RunId::new(),
        "plugin_id": runner.plugin_id(),
        "runner_id": RUNNER,
        "binding_id": format!("agent_default_{RUNNER}"),
        "workspace_id": WS,
        "conversation_id": CONV,
        "actor": {"actor_type": "user", "actor_id": "u1"},
        "resources": {"storage": {"plugin_storage": true, "workspace_storage": false}},
        "available_apis": all_apis(),
        "state_policy": {"enable_state": true, "state_scopes": ["conversation", "actor", "runner"]},
        "budgets": {},
    });
    for (k, val) in patch.as_object().unwrap() {
        v[k] = val.clone();
    }
    serde_json::from_value(v).expect("valid snapshot")
}

/// `snap` with one `available_apis` flag turned off.
fn without_api(flag: &str) -> AuthorizationSnapshot {
    let mut apis = all_apis();
    apis[flag] = json!(false);
    snap(json!({ "available_apis": apis }))
}

impl Fx {
    async fn call(
        &self,
        snapshot: &AuthorizationSnapshot,
        action: &str,
        params: Value,
    ) -> Result<Value, AgentApiError> {
        let call = GatedCall {
            caller: &self.caller,
            run_id: snapshot.run_id,
            action,
            snapshot,
        };
        self.dispatcher.dispatch(call, params, &self.stream).await
    }

    async fn ok(&self, snapshot: &AuthorizationSnapshot, action: &str, params: Value) -> Value {
        self.call(snapshot, action, params)
            .await
            .unwrap_or_else(|e| panic!("{action} failed: {e:?}"))
    }

    async fn err(
        &self,
        snapshot: &AuthorizationSnapshot,
        action: &str,
        params: Value,
    ) -> AgentApiError {
        match self.call(snapshot, action, params).await {
            Ok(v) => panic!("{action} unexpectedly succeeded: {v}"),
            Err(e) => e,
        }
    }

    async fn transcript(&self, conversation: &str, thread: Option<&str>, role: &str, text: &str) {
        let mut item =
            NewTranscriptItem::message(ws(), conversation, format!("ev-{text}"), role, text);
        item.thread_id = thread.map(str::to_owned);
        item.run_id = Some(RunId::new());
        item.artifact_refs =
            Some(json!([{"artifact_id": format!("art-{text}"), "artifact_type": "file"}]));
        self.stores.transcript.append(item).await.unwrap();
    }

    async fn event(
        &self,
        conversation: Option<&str>,
        thread: Option<&str>,
        event_type: &str,
        run: Option<RunId>,
    ) -> String {
        let mut event = NewEvent::new(ws(), event_type, "api");
        event.conversation_id = conversation.map(str::to_owned);
        event.thread_id = thread.map(str::to_owned);
        event.input_summary = Some(format!("{event_type} in {conversation:?}"));
        event.run_id = run;
        event.envelope = Some(json!({"secret": "host only"}));
        let (record, _) = self.stores.events.append(event, Vec::new()).await.unwrap();
        record.id.to_string()
    }

    async fn artifact(&self, id: &str, bytes: &[u8], edit: impl FnOnce(&mut NewArtifact)) {
        let mut a = NewArtifact::inline(
            ws(),
            "file",
            "runner",
            ArtifactScope::Conversation,
            bytes.to_vec(),
        );
        a.id = Some(id.to_owned());
        a.conversation_id = Some(CONV.to_owned());
        a.mime_type = Some("text/plain".into());
        edit(&mut a);
        self.stores.artifacts.put(a).await.unwrap();
    }
}

fn assert_code(e: &AgentApiError, code: &str) {
    assert_eq!(e.code, code, "{e:?}");
}

// ---------------------------------------------------------------- history_page

#[tokio::test]
async fn history_page_reads_the_run_conversation_only() {
    let f = fixture().await;
    for text in ["one", "two", "three"] {
        f.transcript(CONV, None, "user", text).await;
    }
    f.transcript("conv-2", None, "user", "elsewhere").await;
    f.transcript(CONV, Some("t1"), "user", "in a thread").await;
    let s = snap(json!({}));

    let page = f.ok(&s, "history_page", json!({})).await;
    let texts: Vec<&str> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["content"].as_str().unwrap())
        .collect();
    assert_eq!(
        texts,
        ["three", "two", "one"],
        "newest first, same conversation, no thread"
    );
    let item = &page["items"][0];
    assert_eq!(item["conversation_id"], CONV);
    assert_eq!(item["role"], "user");
    assert_eq!(item["item_type"], "message");
    assert!(
        item.get("run_id").is_none() && item.get("runner_id").is_none(),
        "host-only fields leaked: {item}"
    );
    assert_eq!(
        item["artifact_refs"],
        json!([]),
        "artifacts only on request"
    );
    assert_eq!(page["has_more"], false);

    // Paging backwards with the opaque cursor, then forwards from the first page.
    let first = f.ok(&s, "history_page", json!({"limit": 2})).await;
    assert_eq!(first["items"].as_array().unwrap().len(), 2);
    assert_eq!(first["has_more"], true);
    let next = first["next_cursor"].as_str().unwrap();
    let second = f
        .ok(
            &s,
            "history_page",
            json!({"limit": 2, "before_cursor": next}),
        )
        .await;
    assert_eq!(second["items"][0]["content"], "one");
    assert_eq!(second["has_more"], false);
    let oldest = second["items"][0]["cursor"].as_str().unwrap();
    let forward = f
        .ok(
            &s,
            "history_page",
            json!({"direction": "forward", "after_cursor": oldest}),
        )
        .await;
    let texts: Vec<&str> = forward["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["content"].as_str().unwrap())
        .collect();
    assert_eq!(texts, ["two", "three"]);

    let with_refs = f
        .ok(
            &s,
            "history_page",
            json!({"include_artifacts": true, "limit": 1}),
        )
        .await;
    assert_eq!(
        with_refs["items"][0]["artifact_refs"][0]["artifact_id"],
        "art-three"
    );

    // A run in the thread sees only the thread.
    let threaded = snap(json!({"thread_id": "t1"}));
    let page = f.ok(&threaded, "history_page", json!({})).await;
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    assert_eq!(page["items"][0]["content"], "in a thread");
}

#[tokio::test]
async fn history_page_refusals() {
    let f = fixture().await;
    f.transcript(CONV, None, "user", "x").await;

    let e = f
        .err(&without_api("history_page"), "history_page", json!({}))
        .await;
    assert_code(&e, "unauthorized");
    assert_eq!(e.message, "history page access not authorized");

    let s = snap(json!({}));
    let e = f
        .err(&s, "history_page", json!({"conversation_id": "conv-2"}))
        .await;
    assert_code(&e, "unauthorized");
    assert_eq!(
        e.message,
        "conversation conv-2 is not accessible by this run"
    );
    // naming its own conversation is fine
    f.ok(&s, "history_page", json!({"conversation_id": CONV}))
        .await;

    let no_conv = snap(json!({"conversation_id": null}));
    let e = f
        .err(&no_conv, "history_page", json!({"conversation_id": CONV}))
        .await;
    assert_eq!(
        e.message,
        "history page is not available without a run conversation"
    );
    let empty = f.ok(&no_conv, "history_page", json!({})).await;
    assert_eq!(empty["items"], json!([]));
    assert_eq!(empty["has_more"], false);

    for bad in [
        json!({"before_cursor": "not-a-cursor"}),
        json!({"after_cursor": "42"}),
        json!({"before_cursor": 42}),
    ] {
        assert_code(&f.err(&s, "history_page", bad).await, "invalid_argument");
    }
    // An event-log cursor is not a history cursor.
    let ev = f.event(Some(CONV), None, "message.received", None).await;
    let event_cursor = f
        .stores
        .events
        .get(ev.parse().unwrap())
        .await
        .unwrap()
        .unwrap()
        .cursor;
    assert_code(
        &f.err(&s, "history_page", json!({"before_cursor": event_cursor}))
            .await,
        "invalid_argument",
    );

    assert_code(
        &f.err(&s, "history_page", json!({"direction": "sideways"}))
            .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&s, "history_page", json!({"limit": "ten"})).await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&s, "history_page", json!({"include_artifacts": "yes"}))
            .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&s, "history_page", json!([1, 2])).await,
        "invalid_argument",
    );
    // Scope is checked before arguments.
    let e = f
        .err(
            &s,
            "history_page",
            json!({"conversation_id": "conv-2", "before_cursor": "bad"}),
        )
        .await;
    assert_code(&e, "unauthorized");
}

#[tokio::test]
async fn page_limits_are_clamped_to_1_100() {
    let f = fixture().await;
    for i in 0..105 {
        f.transcript(CONV, None, "user", &format!("m{i}")).await;
    }
    let s = snap(json!({}));
    for (limit, expected) in [
        (json!(0), 1),
        (json!(-5), 1),
        (json!(1000), 100),
        (json!(7), 7),
        (Value::Null, 50),
    ] {
        let page = f.ok(&s, "history_page", json!({ "limit": limit })).await;
        assert_eq!(
            page["items"].as_array().unwrap().len(),
            expected,
            "limit {limit}"
        );
        assert_eq!(page["has_more"], true);
    }
}

// ---------------------------------------------------------------- history_search

#[tokio::test]
async fn history_search_is_full_text_in_scope() {
    let f = fixture().await;
    f.transcript(CONV, None, "user", "the quick brown fox")
        .await;
    f.transcript(CONV, None, "assistant", "a lazy dog and a fox")
        .await;
    f.transcript(CONV, None, "user", "nothing here").await;
    f.transcript("conv-2", None, "user", "another fox").await;
    let s = snap(json!({}));

    let found = f.ok(&s, "history_search", json!({"query": "fox"})).await;
    assert_eq!(found["query"], "fox");
    assert_eq!(found["total_count"], 2);
    assert_eq!(found["items"].as_array().unwrap().len(), 2);
    assert!(
        found["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["conversation_id"] == CONV)
    );
    assert_eq!(
        found["items"][0]["artifact_refs"].as_array().unwrap().len(),
        1,
        "search results carry refs"
    );

    let users = f
        .ok(
            &s,
            "history_search",
            json!({"query": "fox", "filters": {"roles": ["user"], "conversation_id": CONV}}),
        )
        .await;
    assert_eq!(users["total_count"], 1);
    assert_eq!(users["items"][0]["content"], "the quick brown fox");

    let one = f
        .ok(&s, "history_search", json!({"query": "fox", "top_k": 0}))
        .await;
    assert_eq!(
        one["items"].as_array().unwrap().len(),
        1,
        "top_k clamps to at least 1"
    );
    f.ok(&s, "history_search", json!({"query": "fox", "top_k": 5000}))
        .await;

    let no_conv = snap(json!({"conversation_id": null}));
    let empty = f
        .ok(&no_conv, "history_search", json!({"query": "fox"}))
        .await;
    assert_eq!(
        (empty["items"].clone(), empty["total_count"].clone()),
        (json!([]), json!(0))
    );

    // refusals
    assert_code(
        &f.err(
            &without_api("history_search"),
            "history_search",
            json!({"query": "fox"}),
        )
        .await,
        "unauthorized",
    );
    let e = f
        .err(
            &s,
            "history_search",
            json!({"query": "fox", "filters": {"conversation_id": "conv-2"}}),
        )
        .await;
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        (
            "unauthorized",
            "conversation conv-2 is not accessible by this run"
        )
    );
    assert_code(
        &f.err(&s, "history_search", json!({})).await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&s, "history_search", json!({"query": "  "})).await,
        "invalid_argument",
    );
    assert_code(
        &f.err(
            &s,
            "history_search",
            json!({"query": "fox", "filters": {"since": 1}}),
        )
        .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(
            &s,
            "history_search",
            json!({"query": "fox", "filters": {"roles": "user"}}),
        )
        .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&s, "history_search", json!({"query": "fox", "top_k": 1.5}))
            .await,
        "invalid_argument",
    );
}

// ---------------------------------------------------------------- events

#[tokio::test]
async fn event_get_applies_the_run_scope() {
    let f = fixture().await;
    let s = snap(json!({}));
    let here = f.event(Some(CONV), None, "message.received", None).await;
    let other_conv = f
        .event(Some("conv-2"), None, "message.received", None)
        .await;
    let mine_elsewhere = f
        .event(Some("conv-9"), None, "artifact.created", Some(s.run_id))
        .await;
    let other_thread = f
        .event(Some(CONV), Some("t1"), "message.received", None)
        .await;

    let ev = f.ok(&s, "event_get", json!({"event_id": here})).await;
    assert_eq!(ev["event_id"], here.as_str());
    assert_eq!(ev["event_type"], "message.received");
    assert_eq!(ev["conversation_id"], CONV);
    assert_eq!(ev["workspace_id"], WS);
    assert!(ev["cursor"].is_string() && ev["seq"].is_i64());
    for hidden in ["envelope", "run_id", "runner_id", "input_json"] {
        assert!(ev.get(hidden).is_none(), "{hidden} leaked: {ev}");
    }
    // Events of the run itself are visible across conversations.
    f.ok(&s, "event_get", json!({"event_id": mine_elsewhere}))
        .await;

    for denied in [&other_conv, &other_thread] {
        let e = f.err(&s, "event_get", json!({"event_id": denied})).await;
        assert_code(&e, "unauthorized");
        assert_eq!(
            e.message,
            format!("event {denied} is not accessible by this run")
        );
    }
    // A run without a conversation sees only its own events.
    let no_conv = snap(json!({"conversation_id": null}));
    assert_code(
        &f.err(&no_conv, "event_get", json!({"event_id": here}))
            .await,
        "unauthorized",
    );
    // Another workspace's event does not exist for this run.
    let foreign = snap(json!({"workspace_id": "other"}));
    assert_code(
        &f.err(&foreign, "event_get", json!({"event_id": here}))
            .await,
        "not_found",
    );

    let missing = RunId::new().to_string();
    let e = f.err(&s, "event_get", json!({"event_id": missing})).await;
    assert_eq!(
        (e.code.as_str(), e.message.clone()),
        ("not_found", format!("event {missing} not found"))
    );
    assert_code(
        &f.err(&s, "event_get", json!({"event_id": "not-a-uuid"}))
            .await,
        "not_found",
    );
    assert_code(&f.err(&s, "event_get", json!({})).await, "invalid_argument");
    assert_code(
        &f.err(
            &without_api("event_get"),
            "event_get",
            json!({"event_id": here}),
        )
        .await,
        "unauthorized",
    );
}

#[tokio::test]
async fn event_page_filters_pages_and_refuses() {
    let f = fixture().await;
    for _ in 0..3 {
        f.event(Some(CONV), None, "message.received", None).await;
    }
    f.event(Some(CONV), None, "artifact.created", None).await;
    f.event(Some("conv-2"), None, "message.received", None)
        .await;
    f.event(Some(CONV), Some("t1"), "message.received", None)
        .await;
    let s = snap(json!({}));

    let page = f.ok(&s, "event_page", json!({})).await;
    assert_eq!(page["items"].as_array().unwrap().len(), 4);
    assert_eq!(page["prev_cursor"], Value::Null);
    assert_eq!(
        page["items"][0]["event_type"], "artifact.created",
        "newest first"
    );

    let typed = f
        .ok(
            &s,
            "event_page",
            json!({"event_types": ["message.received"], "limit": 2}),
        )
        .await;
    assert_eq!(typed["items"].as_array().unwrap().len(), 2);
    assert_eq!(typed["has_more"], true);
    let rest = f
        .ok(
            &s,
            "event_page",
            json!({"event_types": ["message.received"], "before_cursor": typed["next_cursor"]}),
        )
        .await;
    assert_eq!(rest["items"].as_array().unwrap().len(), 1);
    assert_eq!(rest["has_more"], false);

    let one = f.ok(&s, "event_page", json!({"limit": 0})).await;
    assert_eq!(one["items"].as_array().unwrap().len(), 1);

    assert_code(
        &f.err(&without_api("event_page"), "event_page", json!({}))
            .await,
        "unauthorized",
    );
    assert_code(
        &f.err(&s, "event_page", json!({"conversation_id": "conv-2"}))
            .await,
        "unauthorized",
    );
    assert_code(
        &f.err(&s, "event_page", json!({"before_cursor": "garbage"}))
            .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&s, "event_page", json!({"event_types": "message.received"}))
            .await,
        "invalid_argument",
    );
    let empty = f
        .ok(
            &snap(json!({"conversation_id": null})),
            "event_page",
            json!({}),
        )
        .await;
    assert_eq!(empty["items"], json!([]));
}

// ---------------------------------------------------------------- artifacts

#[tokio::test]
async fn artifact_metadata_follows_the_access_matrix() {
    let f = fixture().await;
    let s = snap(json!({}));
    f.artifact("in-conv", b"hello", |_| {}).await;
    f.artifact("other-conv", b"x", |a| {
        a.conversation_id = Some("conv-2".into())
    })
    .await;
    f.artifact("mine", b"x", |a| {
        a.conversation_id = Some("conv-9".into());
        a.scope = ArtifactScope::Run;
        a.run_id = Some(s.run_id);
    })
    .await;
    f.artifact("expired", b"x", |a| {
        a.expires_at = Some(Utc::now() - chrono::Duration::hours(1))
    })
    .await;
    f.artifact("later", b"x", |a| {
        a.expires_at = Some(Utc::now() + chrono::Duration::hours(1))
    })
    .await;

    let meta = f
        .ok(&s, "artifact_metadata", json!({"artifact_id": "in-conv"}))
        .await;
    assert_eq!(meta["artifact_id"], "in-conv");
    assert_eq!(meta["size_bytes"], 5);
    assert_eq!(meta["mime_type"], "text/plain");
    assert_eq!(meta["sha256"].as_str().unwrap().len(), 64);
    for hidden in [
        "storage_key",
        "storage_type",
        "workspace_id",
        "bot_id",
        "thread_id",
        "scope",
    ] {
        assert!(meta.get(hidden).is_none(), "{hidden} leaked: {meta}");
    }
    f.ok(&s, "artifact_metadata", json!({"artifact_id": "mine"}))
        .await;
    let later = f
        .ok(&s, "artifact_metadata", json!({"artifact_id": "later"}))
        .await;
    assert!(later["expires_at"].is_i64());

    let e = f
        .err(
            &s,
            "artifact_metadata",
            json!({"artifact_id": "other-conv"}),
        )
        .await;
    assert_code(&e, "unauthorized");
    assert!(
        e.message.starts_with("artifact metadata access denied"),
        "{}",
        e.message
    );
    assert_code(
        &f.err(&s, "artifact_metadata", json!({"artifact_id": "expired"}))
            .await,
        "not_found",
    );
    assert_code(
        &f.err(&s, "artifact_metadata", json!({"artifact_id": "nope"}))
            .await,
        "not_found",
    );
    assert_code(
        &f.err(&s, "artifact_metadata", json!({})).await,
        "invalid_argument",
    );
    assert_code(
        &f.err(
            &without_api("artifact_metadata"),
            "artifact_metadata",
            json!({"artifact_id": "in-conv"}),
        )
        .await,
        "unauthorized",
    );
    // another workspace: not found, not "denied"
    let foreign = snap(json!({"workspace_id": "other"}));
    assert_code(
        &f.err(
            &foreign,
            "artifact_metadata",
            json!({"artifact_id": "in-conv"}),
        )
        .await,
        "not_found",
    );
}

#[tokio::test]
async fn artifact_read_ranges_and_refusals() {
    let f = fixture_with(|l| l.artifact_read_max_bytes = 8).await;
    let s = snap(json!({}));
    f.artifact("doc", b"0123456789abcdef", |_| {}).await;
    f.artifact("expired", b"x", |a| {
        a.expires_at = Some(Utc::now() - chrono::Duration::seconds(1))
    })
    .await;
    f.artifact("other-conv", b"x", |a| {
        a.conversation_id = Some("conv-2".into())
    })
    .await;
    f.artifact("link", b"", |a| {
        a.content = ArtifactContent::Url("https://example.test/f".into())
    })
    .await;

    let decode = |v: &Value| {
        STANDARD
            .decode(v["content_base64"].as_str().unwrap())
            .unwrap()
    };
    let r = f
        .ok(
            &s,
            "artifact_read",
            json!({"artifact_id": "doc", "offset": 2, "limit": 4}),
        )
        .await;
    assert_eq!(decode(&r), b"2345");
    assert_eq!(
        (
            r["offset"].clone(),
            r["length"].clone(),
            r["size_bytes"].clone()
        ),
        (json!(2), json!(4), json!(16))
    );
    assert_eq!(r["has_more"], true);
    // the default read is capped by the configured maximum (8 bytes here)
    let r = f
        .ok(&s, "artifact_read", json!({"artifact_id": "doc"}))
        .await;
    assert_eq!(decode(&r), b"01234567");
    assert_eq!(r["has_more"], true);
    let r = f
        .ok(
            &s,
            "artifact_read",
            json!({"artifact_id": "doc", "offset": 12, "limit": 1000}),
        )
        .await;
    assert_eq!(decode(&r), b"cdef");
    assert_eq!(r["has_more"], false);
    let r = f
        .ok(
            &s,
            "artifact_read",
            json!({"artifact_id": "doc", "offset": 99}),
        )
        .await;
    assert_eq!(decode(&r), b"");
    assert_eq!(r["has_more"], false);
    // the documented `length` spelling of a range read
    let r = f
        .ok(
            &s,
            "artifact_read",
            json!({"artifact_id": "doc", "offset": 1, "length": 2}),
        )
        .await;
    assert_eq!(decode(&r), b"12");
    // external content comes back as a file key
    let r = f
        .ok(&s, "artifact_read", json!({"artifact_id": "link"}))
        .await;
    assert_eq!(r["file_key"], "https://example.test/f");
    assert_eq!(r["content_base64"], Value::Null);

    let e = f
        .err(
            &s,
            "artifact_read",
            json!({"artifact_id": "doc", "offset": -1}),
        )
        .await;
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        ("invalid_argument", "offset must be >= 0")
    );
    let e = f
        .err(
            &s,
            "artifact_read",
            json!({"artifact_id": "doc", "limit": 0}),
        )
        .await;
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        ("invalid_argument", "limit must be > 0")
    );
    assert_code(
        &f.err(
            &s,
            "artifact_read",
            json!({"artifact_id": "doc", "offset": "1"}),
        )
        .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&s, "artifact_read", json!({"artifact_id": "expired"}))
            .await,
        "not_found",
    );
    assert_code(
        &f.err(&s, "artifact_read", json!({"artifact_id": "other-conv"}))
            .await,
        "unauthorized",
    );
    assert_code(
        &f.err(
            &without_api("artifact_read"),
            "artifact_read",
            json!({"artifact_id": "doc"}),
        )
        .await,
        "unauthorized",
    );
    // grant before arguments
    assert_code(
        &f.err(
            &without_api("artifact_read"),
            "artifact_read",
            json!({"offset": -1}),
        )
        .await,
        "unauthorized",
    );
}

// ---------------------------------------------------------------- state

#[tokio::test]
async fn state_roundtrip_with_revisions_and_deterministic_keys() {
    let f = fixture().await;
    let s = snap(json!({}));

    let got = f
        .ok(
            &s,
            "state_get",
            json!({"scope": "conversation", "key": "k"}),
        )
        .await;
    assert_eq!(got, json!({"value": null, "revision": 0}));
    let set = f
        .ok(
            &s,
            "state_set",
            json!({"scope": "conversation", "key": "k", "value": {"n": 1}}),
        )
        .await;
    assert_eq!(set, json!({"success": true, "revision": 1}));
    let got = f
        .ok(
            &s,
            "state_get",
            json!({"scope": "conversation", "key": "k"}),
        )
        .await;
    assert_eq!(got, json!({"value": {"n": 1}, "revision": 1}));

    // The row lives under the deterministic scope key the orchestrator computes too.
    let key = scope_key(StateScope::Conversation, &StateKeyParts::from_snapshot(&s)).unwrap();
    assert!(key.starts_with("conversation:v2:"));
    let row = f.stores.state.get(&key, "k").await.unwrap().unwrap();
    assert_eq!(row.value, json!({"n": 1}));

    // Another run of the same binding and conversation shares the row; another binding,
    // another conversation or another scope do not.
    let same = snap(json!({}));
    assert_eq!(
        f.ok(
            &same,
            "state_get",
            json!({"scope": "conversation", "key": "k"})
        )
        .await["value"],
        json!({"n": 1})
    );
    let other_binding = snap(json!({"binding_id": "agent_other"}));
    assert_eq!(
        f.ok(
            &other_binding,
            "state_get",
            json!({"scope": "conversation", "key": "k"})
        )
        .await["value"],
        Value::Null
    );
    let other_conv = snap(json!({"conversation_id": "conv-2"}));
    assert_eq!(
        f.ok(
            &other_conv,
            "state_get",
            json!({"scope": "conversation", "key": "k"})
        )
        .await["value"],
        Value::Null
    );
    assert_eq!(
        f.ok(&s, "state_get", json!({"scope": "runner", "key": "k"}))
            .await["value"],
        Value::Null
    );

    // Compare-and-set.
    let cas = f
        .ok(
            &s,
            "state_set",
            json!({"scope": "conversation", "key": "k", "value": 2, "if_revision": 1}),
        )
        .await;
    assert_eq!(cas["revision"], 2);
    let e = f
        .err(
            &s,
            "state_set",
            json!({"scope": "conversation", "key": "k", "value": 3, "if_revision": 1}),
        )
        .await;
    assert_code(&e, "conflict");
    assert!(!e.retryable);
    assert_eq!(
        f.ok(
            &s,
            "state_get",
            json!({"scope": "conversation", "key": "k"})
        )
        .await["value"],
        2
    );
    // if_revision 0: create only
    f.ok(
        &s,
        "state_set",
        json!({"scope": "runner", "key": "fresh", "value": true, "if_revision": 0}),
    )
    .await;
    assert_code(
        &f.err(
            &s,
            "state_set",
            json!({"scope": "runner", "key": "fresh", "value": 1, "if_revision": 0}),
        )
        .await,
        "conflict",
    );
    assert_code(
        &f.err(
            &s,
            "state_delete",
            json!({"scope": "runner", "key": "fresh", "if_revision": 7}),
        )
        .await,
        "conflict",
    );

    // The public alias `conversation_id` is stored as `external.conversation_id`.
    f.ok(
        &s,
        "state_set",
        json!({"scope": "conversation", "key": "conversation_id", "value": "x"}),
    )
    .await;
    assert_eq!(
        f.stores
            .state
            .get(&key, "external.conversation_id")
            .await
            .unwrap()
            .unwrap()
            .value,
        "x"
    );

    // Delete.
    assert_eq!(
        f.ok(
            &s,
            "state_delete",
            json!({"scope": "conversation", "key": "k"})
        )
        .await,
        json!({"success": true})
    );
    assert_eq!(
        f.ok(
            &s,
            "state_delete",
            json!({"scope": "conversation", "key": "k"})
        )
        .await,
        json!({"success": false})
    );
    // A null value is a value.
    f.ok(
        &s,
        "state_set",
        json!({"scope": "actor", "key": "nothing", "value": null}),
    )
    .await;
    assert_eq!(
        f.ok(&s, "state_get", json!({"scope": "actor", "key": "nothing"}))
            .await["revision"],
        1
    );
}

#[tokio::test]
async fn state_list_prefix_and_limits() {
    let f = fixture().await;
    let s = snap(json!({}));
    for key in ["a.1", "a.2", "a.3", "b.1"] {
        f.ok(
            &s,
            "state_set",
            json!({"scope": "runner", "key": key, "value": 1}),
        )
        .await;
    }
    let all = f.ok(&s, "state_list", json!({"scope": "runner"})).await;
    assert_eq!(all["keys"], json!(["a.1", "a.2", "a.3", "b.1"]));
    assert_eq!(all["has_more"], false);
    let a = f
        .ok(
            &s,
            "state_list",
            json!({"scope": "runner", "prefix": "a.", "limit": 2}),
        )
        .await;
    assert_eq!(a["keys"], json!(["a.1", "a.2"]));
    assert_eq!(a["has_more"], true);
    let rest = f
        .ok(
            &s,
            "state_list",
            json!({"scope": "runner", "prefix": "a.", "cursor": a["next_cursor"]}),
        )
        .await;
    assert_eq!(rest["keys"], json!(["a.3"]));
    let one = f
        .ok(&s, "state_list", json!({"scope": "runner", "limit": 0}))
        .await;
    assert_eq!(one["keys"], json!(["a.1"]));
    assert_code(
        &f.err(
            &s,
            "state_list",
            json!({"scope": "runner", "cursor": "bad"}),
        )
        .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&s, "state_list", json!({"scope": "runner", "limit": "all"}))
            .await,
        "invalid_argument",
    );
}

#[tokio::test]
async fn state_refusals() {
    let f = fixture_with(|l| l.state_value_bytes = 256 * 1024).await;
    let s = snap(json!({}));
    let set = |scope: &str| json!({"scope": scope, "key": "k", "value": 1});

    let e = f
        .err(&without_api("state"), "state_set", set("conversation"))
        .await;
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        ("unauthorized", "state set access not authorized")
    );
    let disabled = snap(json!({"state_policy": {"enable_state": false}}));
    let e = f
        .err(
            &disabled,
            "state_get",
            json!({"scope": "conversation", "key": "k"}),
        )
        .await;
    assert_eq!(e.message, "state access is disabled by binding policy");
    let e = f.err(&s, "state_set", set("subject")).await;
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        (
            "unauthorized",
            "scope \"subject\" is not enabled by binding policy"
        )
    );
    let e = f.err(&s, "state_set", set("galaxy")).await;
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        (
            "unauthorized",
            "scope \"galaxy\" is not enabled by binding policy"
        )
    );
    // The actor scope is enabled, but this run has no actor: no key, nothing shared.
    let anonymous = snap(json!({"actor": null}));
    let e = f.err(&anonymous, "state_set", set("actor")).await;
    assert_code(&e, "invalid_argument");
    assert!(
        e.message
            .starts_with("scope key not available for scope \"actor\""),
        "{}",
        e.message
    );

    assert_code(
        &f.err(&s, "state_set", json!({"key": "k", "value": 1}))
            .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&s, "state_set", json!({"scope": "runner", "value": 1}))
            .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&s, "state_set", json!({"scope": "runner", "key": "k"}))
            .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(
            &s,
            "state_set",
            json!({"scope": "runner", "key": "k".repeat(256), "value": 1}),
        )
        .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(
            &s,
            "state_set",
            json!({"scope": "runner", "key": "k", "value": 1, "if_revision": -1}),
        )
        .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&s, "state_get", json!({"scope": 3, "key": "k"}))
            .await,
        "invalid_argument",
    );

    // 256 KiB of UTF-8 JSON: a string of n chars is n + 2 bytes.
    let max = 256 * 1024;
    f.ok(
        &s,
        "state_set",
        json!({"scope": "runner", "key": "big", "value": "x".repeat(max - 2)}),
    )
    .await;
    let e = f
        .err(
            &s,
            "state_set",
            json!({"scope": "runner", "key": "big", "value": "x".repeat(max - 1)}),
        )
        .await;
    assert_code(&e, "payload_too_large");
    assert_eq!(
        e.message,
        format!("value size {} bytes exceeds limit {max} bytes", max + 1)
    );
    assert_eq!(e.details["limit"], max);
    // non-ASCII counts as its UTF-8 bytes
    let e = f
        .err(
            &s,
            "state_set",
            json!({"scope": "runner", "key": "big", "value": "é".repeat(max / 2)}),
        )
        .await;
    assert_code(&e, "payload_too_large");
}

// ---------------------------------------------------------------- storage

#[tokio::test]
async fn plugin_storage_roundtrip_and_isolation() {
    let f = fixture().await;
    let s = snap(json!({}));
    let b64 = |b: &[u8]| STANDARD.encode(b);

    assert_eq!(
        f.ok(
            &s,
            "set_binary_storage",
            json!({"owner_type": "plugin", "key": "blob", "value_base64": b64(b"\x00\x01bytes")})
        )
        .await,
        json!({})
    );
    f.ok(
        &s,
        "storage_set",
        json!({"owner_type": "plugin", "key": "other", "value_base64": b64(b"2")}),
    )
    .await;
    let got = f
        .ok(
            &s,
            "get_binary_storage",
            json!({"owner_type": "plugin", "key": "blob"}),
        )
        .await;
    assert_eq!(
        STANDARD
            .decode(got["value_base64"].as_str().unwrap())
            .unwrap(),
        b"\x00\x01bytes"
    );
    let keys = f
        .ok(
            &s,
            "get_binary_storage_keys",
            json!({"owner_type": "plugin"}),
        )
        .await;
    assert_eq!(keys["keys"], json!(["blob", "other"]));
    // the owner may be named, but only as the caller's own plugin
    f.ok(
        &s,
        "storage_get",
        json!({"owner_type": "plugin", "owner": "acme/agent", "key": "blob"}),
    )
    .await;
    let e = f
        .err(
            &s,
            "storage_get",
            json!({"owner_type": "plugin", "owner": "rival/plugin", "key": "blob"}),
        )
        .await;
    assert_code(&e, "unauthorized");

    // Stored per plugin: the owner row is the caller's plugin identity.
    assert!(
        f.stores
            .storage
            .get("plugin", "acme/agent", "blob")
            .await
            .unwrap()
            .is_some()
    );
    let rival_runner: RunnerId = "plugin:rival/plugin/default".parse().unwrap();
    let rival = CallerIdentity::for_runner(&rival_runner);
    let rival_snap =
        snap(json!({"plugin_id": "rival/plugin", "runner_id": "plugin:rival/plugin/default"}));
    let call = GatedCall {
        caller: &rival,
        run_id: rival_snap.run_id,
        action: "get_binary_storage_keys",
        snapshot: &rival_snap,
    };
    let theirs = f
        .dispatcher
        .dispatch(call, json!({"owner_type": "plugin"}), &f.stream)
        .await
        .unwrap();
    assert_eq!(theirs["keys"], json!([]));

    assert_eq!(
        f.ok(
            &s,
            "delete_binary_storage",
            json!({"owner_type": "plugin", "key": "blob"})
        )
        .await,
        json!({})
    );
    let e = f
        .err(
            &s,
            "get_binary_storage",
            json!({"owner_type": "plugin", "key": "blob"}),
        )
        .await;
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        ("not_found", "storage with key blob not found")
    );
}

#[tokio::test]
async fn storage_refusals_and_cap() {
    let f = fixture_with(|l| l.storage_value_bytes = 16).await;
    let s = snap(json!({}));

    let e = f
        .err(
            &s,
            "get_binary_storage_keys",
            json!({"owner_type": "workspace"}),
        )
        .await;
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        (
            "unauthorized",
            "storage workspace is not authorized for this agent run"
        )
    );
    assert_code(
        &f.err(
            &s,
            "get_binary_storage_keys",
            json!({"owner_type": "global"}),
        )
        .await,
        "unauthorized",
    );
    let no_storage = snap(json!({"resources": {}}));
    assert_code(
        &f.err(&no_storage, "get_binary_storage_keys", json!({}))
            .await,
        "unauthorized",
    );
    assert_code(
        &f.err(
            &no_storage,
            "get_binary_storage",
            json!({"owner_type": "plugin", "key": "k"}),
        )
        .await,
        "unauthorized",
    );
    // workspace storage when granted: owned by the run's workspace
    let ws_snap = snap(json!({"resources": {"storage": {"workspace_storage": true}}}));
    f.ok(
        &ws_snap,
        "set_binary_storage",
        json!({"owner_type": "workspace", "key": "k", "value_base64": "AA=="}),
    )
    .await;
    assert!(
        f.stores
            .storage
            .get("workspace", WS, "k")
            .await
            .unwrap()
            .is_some()
    );

    assert_code(
        &f.err(&s, "get_binary_storage", json!({"key": "k"})).await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&s, "get_binary_storage", json!({"owner_type": "plugin"}))
            .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(
            &s,
            "set_binary_storage",
            json!({"owner_type": "plugin", "key": "k"}),
        )
        .await,
        "invalid_argument",
    );
    let e = f
        .err(
            &s,
            "set_binary_storage",
            json!({"owner_type": "plugin", "key": "k", "value_base64": "!!not base64"}),
        )
        .await;
    assert_code(&e, "invalid_argument");

    // 16 bytes fit, 17 do not.
    f.ok(
        &s,
        "set_binary_storage",
        json!({"owner_type": "plugin", "key": "k", "value_base64": STANDARD.encode([7u8; 16])}),
    )
    .await;
    let e = f
        .err(
            &s,
            "set_binary_storage",
            json!({"owner_type": "plugin", "key": "k", "value_base64": STANDARD.encode([7u8; 17])}),
        )
        .await;
    assert_code(&e, "payload_too_large");
    assert_eq!(
        e.message,
        "binary storage value exceeds limit (17 > 16 bytes)"
    );
    let e = f.err(&s, "set_binary_storage", json!({"owner_type": "plugin", "key": "k", "value_base64": STANDARD.encode([7u8; 4000])})).await;
    assert_code(&e, "payload_too_large");
    // nothing was overwritten by the refused writes
    let got = f
        .ok(
            &s,
            "get_binary_storage",
            json!({"owner_type": "plugin", "key": "k"}),
        )
        .await;
    assert_eq!(
        STANDARD
            .decode(got["value_base64"].as_str().unwrap())
            .unwrap(),
        [7u8; 16]
    );
}

#[tokio::test]
async fn storage_cap_default_is_ten_mib() {
    let f = fixture().await;
    let s = snap(json!({}));
    let mib = 1024 * 1024;
    f.ok(&s, "set_binary_storage", json!({"owner_type": "plugin", "key": "k", "value_base64": STANDARD.encode(vec![1u8; 10 * mib])})).await;
    let e = f.err(&s, "set_binary_storage", json!({"owner_type": "plugin", "key": "k", "value_base64": STANDARD.encode(vec![1u8; 10 * mib + 1])})).await;
    assert_code(&e, "payload_too_large");
}

// ---------------------------------------------------------------- steering

fn steering_item(run_id: RunId, n: u32) -> Value {
    json!({
        "claimed_run_id": run_id.to_string(),
        "runner_id": RUNNER,
        "claimed_at": 1_700_000_000 + n,
        "event": {"event_id": format!("follow-up-{n}"), "event_type": "message.received", "source": "api"},
        "conversation": {"conversation_id": CONV, "workspace_id": WS},
        "actor": {"actor_type": "user", "actor_id": "u1", "actor_name": "Ann"},
        "input": {"text": format!("follow-up {n}")},
    })
}

#[tokio::test]
async fn steering_pull_is_fifo_with_modes_limits_and_audit() {
    let f = fixture().await;
    let s = snap(json!({}));
    f.sessions
        .put_session(
            &s.run_id,
            &serde_json::to_value(&s).unwrap(),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    for n in 1..=5 {
        assert!(
            f.sessions
                .steering_push(&s.run_id, &steering_item(s.run_id, n), 100)
                .await
                .unwrap()
                .is_accepted()
        );
    }
    let texts = |v: &Value| -> Vec<String> {
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["input"]["text"].as_str().unwrap().to_owned())
            .collect()
    };

    // `one` takes exactly one item, whatever the limit.
    let one = f
        .ok(&s, "steering_pull", json!({"mode": "one", "limit": 10}))
        .await;
    assert_eq!(texts(&one), ["follow-up 1"]);
    let two = f.ok(&s, "steering_pull", json!({"limit": 2})).await;
    assert_eq!(texts(&two), ["follow-up 2", "follow-up 3"]);
    let clamped = f.ok(&s, "steering_pull", json!({"limit": 0})).await;
    assert_eq!(texts(&clamped), ["follow-up 4"]);
    let rest = f.ok(&s, "steering_pull", json!({})).await;
    assert_eq!(texts(&rest), ["follow-up 5"]);
    assert_eq!(
        f.ok(&s, "steering_pull", json!({"mode": "all"})).await,
        json!({"items": []})
    );

    // Every pulled item is audited as `steering.injected` in the event log.
    let mut q = EventQuery::new(ws());
    q.event_types = vec!["steering.injected".into()];
    let audits = f.stores.events.page(q).await.unwrap();
    assert_eq!(audits.items.len(), 5);
    let first = audits.items.last().unwrap();
    assert_eq!(first.source, "agent_runner");
    assert_eq!(first.run_id, Some(s.run_id));
    assert_eq!(first.conversation_id.as_deref(), Some(CONV));
    assert_eq!(
        first.input_summary.as_deref(),
        Some("steering injected from follow-up-1")
    );
    assert_eq!(first.metadata["steering"]["status"], "injected");
    assert_eq!(first.metadata["steering"]["source_event_id"], "follow-up-1");
    assert_eq!(first.metadata["steering"]["pull_mode"], "one");
    assert_eq!(first.actor_id.as_deref(), Some("u1"));
    assert_eq!(
        first.metadata["steering"]["claimed_by_run_id"],
        s.run_id.to_string()
    );

    // refusals
    assert_code(
        &f.err(&without_api("steering_pull"), "steering_pull", json!({}))
            .await,
        "unauthorized",
    );
    assert_code(
        &f.err(&s, "steering_pull", json!({"mode": "some"})).await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&s, "steering_pull", json!({"limit": "2"})).await,
        "invalid_argument",
    );
}

#[tokio::test]
async fn steering_pull_limit_is_capped() {
    let f = fixture_with(|l| l.steering_pull_max = 3).await;
    let s = snap(json!({}));
    f.sessions
        .put_session(
            &s.run_id,
            &serde_json::to_value(&s).unwrap(),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    for n in 0..5 {
        f.sessions
            .steering_push(&s.run_id, &steering_item(s.run_id, n), 100)
            .await
            .unwrap();
    }
    assert_eq!(
        f.ok(&s, "steering_pull", json!({"limit": 5000})).await["items"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    assert_eq!(
        f.ok(&s, "steering_pull", json!({})).await["items"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
}

// ---------------------------------------------------------------- step 7

#[tokio::test]
async fn oversize_requests_are_refused_before_the_rate_limit() {
    let f = fixture_with(|l| {
        l.max_request_bytes = 200;
        l.rate_limit = Some(RateLimit {
            max_calls: 1,
            window: Duration::from_secs(60),
        });
    })
    .await;
    let s = snap(json!({}));
    let e = f
        .err(&s, "history_search", json!({"query": "q".repeat(300)}))
        .await;
    assert_code(&e, "payload_too_large");
    assert!(e.details["size"].as_u64().unwrap() > 200);
    // arguments are validated before the size
    assert_code(
        &f.err(
            &s,
            "history_search",
            json!({"query": 5, "pad": "x".repeat(300)}),
        )
        .await,
        "invalid_argument",
    );
    // the refused calls did not use the run's single admitted call
    f.ok(&s, "history_search", json!({"query": "q"})).await;
}

#[tokio::test]
async fn rate_limit_is_per_run_and_retryable() {
    let f = fixture_with(|l| {
        l.rate_limit = Some(RateLimit {
            max_calls: 3,
            window: Duration::from_secs(60),
        })
    })
    .await;
    let s = snap(json!({}));
    for _ in 0..3 {
        f.ok(&s, "get_host_version", json!({})).await;
    }
    let e = f
        .err(&s, "state_get", json!({"scope": "runner", "key": "k"}))
        .await;
    assert_code(&e, "rate_limited");
    assert!(e.retryable);
    assert_eq!(e.details["limit"], 3);
    // another run has its own budget
    let other = snap(json!({}));
    f.ok(&other, "ping", json!({})).await;
    // Steps 4–6 come before the rate limit: an exhausted run still hears why a call is wrong.
    let mut no_state = s.clone();
    no_state.available_apis.state = false;
    assert_code(
        &f.err(
            &no_state,
            "state_get",
            json!({"scope": "runner", "key": "k"}),
        )
        .await,
        "unauthorized",
    );
    assert_code(
        &f.err(&s, "state_get", json!({"scope": "runner"})).await,
        "invalid_argument",
    );
}

// ---------------------------------------------------------------- resources and misc

#[tokio::test]
async fn models_tools_and_knowledge_check_grants_honestly() {
    let f = fixture().await;
    let none = snap(json!({}));
    // Nothing of the kind granted: refused before the arguments are even read.
    let e = f.err(&none, "call_tool", json!({})).await;
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        (
            "unauthorized",
            "no tool is authorized for operation call for this agent run"
        )
    );
    for (action, params) in [
        (
            "invoke_llm",
            json!({"llm_model_uuid": "m1", "messages": []}),
        ),
        (
            "invoke_rerank",
            json!({"rerank_model_uuid": "m1", "query": "q", "documents": []}),
        ),
        ("get_tool_detail", json!({"tool_name": "search"})),
        (
            "retrieve_knowledge",
            json!({"kb_id": "kb", "query_text": "q"}),
        ),
        ("get_config_file", json!({"file_key": "f"})),
        ("get_prompt", json!({})),
    ] {
        assert_code(&f.err(&none, action, params).await, "unauthorized");
    }

    let granted = snap(json!({"resources": {
        "models": [{"model_id": "m1", "operations": ["invoke"]}],
        "tools": [{"tool_name": "search", "operations": ["detail", "call"]}],
        "knowledge_bases": [{"kb_id": "kb", "operations": ["retrieve"]}],
    }}));
    // Another id than the granted one: the seed's wording.
    let e = f
        .err(
            &granted,
            "call_tool",
            json!({"tool_name": "shell", "parameters": {}}),
        )
        .await;
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        (
            "unauthorized",
            "tool shell is not authorized for operation call for this agent run"
        )
    );
    let e = f
        .err(
            &granted,
            "invoke_llm",
            json!({"llm_model_uuid": "m2", "messages": []}),
        )
        .await;
    assert_eq!(
        e.message,
        "model m2 is not authorized for operation invoke for this agent run"
    );
    // Granted for another operation only.
    assert_code(
        &f.err(
            &granted,
            "invoke_llm_stream",
            json!({"model_id": "m1", "messages": []}),
        )
        .await,
        "unauthorized",
    );
    assert_code(
        &f.err(
            &granted,
            "invoke_rerank",
            json!({"model_id": "m1", "query": "q", "documents": []}),
        )
        .await,
        "unauthorized",
    );

    // Granted, but the registry has no such model, tool or knowledge base (ids that are not
    // even UUIDs cannot name one).
    assert_code(
        &f.err(
            &granted,
            "invoke_llm",
            json!({"model_id": "m1", "messages": []}),
        )
        .await,
        "not_found",
    );
    assert_code(
        &f.err(
            &granted,
            "call_tool",
            json!({"tool_name": "search", "parameters": {}}),
        )
        .await,
        "not_found",
    );
    assert_code(
        &f.err(&granted, "get_tool_detail", json!({"tool_name": "search"}))
            .await,
        "not_found",
    );
    assert_code(
        &f.err(
            &granted,
            "retrieve_knowledge",
            json!({"kb_id": "kb", "query_text": "q"}),
        )
        .await,
        "not_found",
    );

    // With some grant of the kind, missing or malformed arguments are argument errors.
    let e = f
        .err(&granted, "call_tool", json!({"tool_name": "search"}))
        .await;
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        (
            "invalid_argument",
            "parameters is required for agent runner tool calls"
        )
    );
    assert_code(
        &f.err(&granted, "call_tool", json!({"parameters": {}}))
            .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&granted, "invoke_llm", json!({"model_id": "m1"}))
            .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(
            &granted,
            "invoke_llm",
            json!({"model_id": "m1", "messages": "hi"}),
        )
        .await,
        "invalid_argument",
    );
    assert_code(
        &f.err(&granted, "retrieve_knowledge", json!({"kb_id": "kb"}))
            .await,
        "invalid_argument",
    );
}

#[tokio::test]
async fn host_version_ping_and_unknown_actions() {
    let f = fixture().await;
    let s = snap(json!({"available_apis": {}, "resources": {}}));
    let v = f.ok(&s, "get_host_version", json!({})).await;
    assert_eq!(v["protocol"], "v1");
    assert!(v["version"].is_string());
    assert_eq!(f.ok(&s, "ping", Value::Null).await, json!({}));
    let e = f.err(&s, "teleport", json!({})).await;
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        ("not_found", "unknown host api action `teleport`")
    );
    assert!(e.details.is_empty());
}

#[tokio::test]
async fn served_through_the_gate() {
    let f = fixture().await;
    let s = snap(json!({}));
    f.sessions
        .put_session(
            &s.run_id,
            &serde_json::to_value(&s).unwrap(),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    let gate = ApiGate::new(f.sessions.clone(), f.dispatcher.clone());
    let set = json!({"scope": "conversation", "key": "k", "value": "v"});
    gate.call(&f.caller, s.run_id, "state_set", set, &f.stream)
        .await
        .unwrap();
    let got = gate
        .call(
            &f.caller,
            s.run_id,
            "state_get",
            json!({"scope": "conversation", "key": "k"}),
            &f.stream,
        )
        .await
        .unwrap();
    assert_eq!(got["value"], "v");
    f.sessions.end_session(&s.run_id).await.unwrap();
    let e = gate
        .call(
            &f.caller,
            s.run_id,
            "state_get",
            json!({"scope": "conversation", "key": "k"}),
            &f.stream,
        )
        .await
        .unwrap_err();
    assert_code(&e, "not_found");
}
