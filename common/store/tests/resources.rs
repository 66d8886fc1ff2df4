//! The resource registry (models, tools, knowledge bases) on Postgres and SQLite.

use sb_protocol::ids::WorkspaceId;
use sb_store::testing::{TestDb, postgres_db, sqlite_file_db, sqlite_memory_db};
use sb_store::{KbSearch, ModelKind, NewKbDocument, NewModel, NewTool, StoreError};
use serde_json::json;
use uuid::Uuid;

fn ws(s: &str) -> WorkspaceId {
    WorkspaceId::new(s).unwrap()
}

fn new_model(w: &WorkspaceId, name: &str) -> NewModel {
    NewModel {
        workspace_id: w.clone(),
        name: name.into(),
        kind: ModelKind::Llm,
        base_url: "http://127.0.0.1:9/v1".into(),
        model_name: "gpt-test".into(),
        api_key_env: Some("SB_TEST_KEY".into()),
        context_window: Some(8192),
        extra_args: Some(json!({"temperature": 0})),
    }
}

async fn models_tools_kbs(db: TestDb) {
    let r = &db.stores.resources;
    let (a, b) = (ws("a"), ws("b"));
    let m = r.create_model(new_model(&a, "m1")).await.unwrap();
    assert_eq!(m.kind, ModelKind::Llm);
    assert_eq!(m.api_key_env.as_deref(), Some("SB_TEST_KEY"));
    assert_eq!(r.get_model(&a, m.model_id).await.unwrap(), m);
    assert!(matches!(
        r.get_model(&b, m.model_id).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        r.create_model(new_model(&a, "m1")).await,
        Err(StoreError::Conflict(_))
    ));
    let mut bad = new_model(&a, "m2");
    bad.api_key_env = Some("sk-literal key".into());
    assert!(matches!(
        r.create_model(bad).await,
        Err(StoreError::InvalidArgument(_))
    ));
    let found = r
        .models_by_ids(&a, &[m.model_id, Uuid::now_v7()])
        .await
        .unwrap();
    assert_eq!(found, vec![m.clone()]);
    assert!(r.models_by_ids(&b, &[m.model_id]).await.unwrap().is_empty());
    assert_eq!(r.list_models(&a).await.unwrap().len(), 1);

    let t = r
        .create_tool(NewTool {
            workspace_id: a.clone(),
            name: "weather".into(),
            kind: "http".into(),
            description: "the weather".into(),
            parameters: json!({"type": "object"}),
            config: json!({"url": "http://127.0.0.1:9/w", "timeout_ms": 1000}),
        })
        .await
        .unwrap();
    assert_eq!(r.get_tool(&a, "weather").await.unwrap(), t);
    assert!(r.get_tool(&b, "weather").await.is_err());
    assert_eq!(
        r.tools_by_names(&a, &["weather".into(), "nope".into()])
            .await
            .unwrap()
            .len(),
        1
    );

    let kb = r.create_kb(&a, "docs", None).await.unwrap();
    assert_eq!(r.get_kb(&a, kb.kb_id).await.unwrap(), kb);
    assert!(r.kbs_by_ids(&b, &[kb.kb_id]).await.unwrap().is_empty());
    assert!(matches!(
        r.create_kb(&a, "docs", None).await,
        Err(StoreError::Conflict(_))
    ));
}

async fn kb_ranking(db: TestDb) {
    let r = &db.stores.resources;
    let a = ws("a");
    let kb = r.create_kb(&a, "corpus", None).await.unwrap();
    let other = r.create_kb(&a, "other", None).await.unwrap();
    let doc = |kb_id: Uuid, title: &str, text: &str| NewKbDocument {
        workspace_id: a.clone(),
        kb_id,
        title: title.into(),
        text: text.into(),
        artifact_id: None,
        metadata: json!({}),
    };
    let rust = r
        .add_document(doc(
            kb.kb_id,
            "rust",
            "Rust ownership and borrowing. Ownership rules: each value has one owner; \
             ownership moves. Borrowing lends ownership temporarily.",
        ))
        .await
        .unwrap();
    assert_eq!(rust.chunks, 1);
    let cooking = r
        .add_document(doc(
            kb.kb_id,
            "cooking",
            "Bread needs flour, water, salt and yeast. Ownership of a bakery is not covered.",
        ))
        .await
        .unwrap();
    r.add_document(doc(
        other.kb_id,
        "elsewhere",
        "ownership ownership ownership",
    ))
    .await
    .unwrap();
    let long = "paragraph about sourdough starters.\n\n".repeat(100);
    let many = r.add_document(doc(kb.kb_id, "long", &long)).await.unwrap();
    assert!(many.chunks > 1, "{}", many.chunks);

    let search = |q: &str, top_k: u64, docs: Vec<Uuid>| KbSearch {
        workspace_id: a.clone(),
        kb_id: kb.kb_id,
        query: q.into(),
        top_k,
        document_ids: docs,
    };
    let hits = r.search_kb(search("ownership", 5, vec![])).await.unwrap();
    assert_eq!(hits.len(), 2, "{hits:?}");
    assert_eq!(hits[0].document_id, rust.document_id);
    assert_eq!(hits[0].title, "rust");
    assert_eq!(hits[1].document_id, cooking.document_id);
    assert!(hits[0].score > hits[1].score, "{hits:?}");
    let only = r
        .search_kb(search("ownership", 5, vec![cooking.document_id]))
        .await
        .unwrap();
    assert_eq!(only.len(), 1);
    assert_eq!(only[0].document_id, cooking.document_id);
    assert_eq!(
        r.search_kb(search("sourdough", 3, vec![]))
            .await
            .unwrap()
            .len(),
        3
    );
    // Hostile text is neither an error nor a match.
    assert!(
        r.search_kb(search("\"*( OR", 5, vec![]))
            .await
            .unwrap()
            .is_empty()
    );
    assert!(r.search_kb(search("", 5, vec![])).await.unwrap().is_empty());
    assert!(matches!(
        r.search_kb(KbSearch {
            kb_id: Uuid::now_v7(),
            ..search("x", 5, vec![])
        })
        .await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        r.add_document(doc(Uuid::now_v7(), "t", "text")).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        r.add_document(doc(kb.kb_id, "t", "  \n ")).await,
        Err(StoreError::InvalidArgument(_))
    ));
    assert!(matches!(
        r.add_document(doc(
            kb.kb_id,
            "t",
            &"x".repeat(sb_store::resources::MAX_DOCUMENT_BYTES + 1)
        ))
        .await,
        Err(StoreError::PayloadTooLarge(_))
    ));
}

/// `update_model` replaces a registration in place (same id), within its workspace only.
async fn model_updates(db: TestDb) {
    let r = &db.stores.resources;
    let (a, b) = (ws("a"), ws("b"));
    let m = r.create_model(new_model(&a, "m1")).await.unwrap();
    r.create_model(new_model(&a, "m2")).await.unwrap();
    let mut changed = new_model(&a, "m1");
    changed.base_url = "https://models.example/v1".into();
    changed.model_name = "other-model".into();
    changed.api_key_env = None;
    changed.context_window = None;
    changed.extra_args = None;
    let updated = r.update_model(m.model_id, changed).await.unwrap();
    assert_eq!(updated.model_id, m.model_id);
    assert_eq!(updated.created_at, m.created_at);
    assert_eq!(updated.base_url, "https://models.example/v1");
    assert_eq!(updated.model_name, "other-model");
    assert_eq!(updated.api_key_env, None);
    assert_eq!(updated.context_window, None);
    assert_eq!(updated.extra_args, json!({}));
    assert_eq!(r.get_model(&a, m.model_id).await.unwrap(), updated);
    assert_eq!(
        r.list_models(&a).await.unwrap().len(),
        2,
        "replaced, not added"
    );

    assert!(matches!(
        r.update_model(m.model_id, new_model(&a, "m2")).await,
        Err(StoreError::Conflict(_))
    ));
    assert!(matches!(
        r.update_model(m.model_id, new_model(&b, "m1")).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        r.update_model(Uuid::now_v7(), new_model(&a, "m3")).await,
        Err(StoreError::NotFound(_))
    ));
    let mut bad = new_model(&a, "m1");
    bad.base_url = "ftp://x".into();
    assert!(matches!(
        r.update_model(m.model_id, bad).await,
        Err(StoreError::InvalidArgument(_))
    ));
}

macro_rules! both {
    ($name:ident, $body:ident) => {
        mod $name {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                $body(postgres_db().await).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite_file() {
                $body(sqlite_file_db().await).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite_memory() {
                $body(sqlite_memory_db().await).await;
            }
        }
    };
}

both!(registry, models_tools_kbs);
both!(model_update, model_updates);
both!(knowledge, kb_ranking);
