//! Updates and deletes of resources and schedules, on Postgres and SQLite.

use chrono::{TimeDelta, Utc};
use sb_protocol::ids::WorkspaceId;
use sb_store::testing::{TestDb, postgres_db, sqlite_file_db, sqlite_memory_db};
use sb_store::{
    DocumentEdit, KbSearch, ModelKind, NewKbDocument, NewModel, NewSchedule, NewTool, ScheduleEdit,
    ScheduleKind, StoreError,
};
use serde_json::json;
use uuid::Uuid;

fn ws(s: &str) -> WorkspaceId {
    WorkspaceId::new(s).unwrap()
}

fn tool(w: &WorkspaceId, name: &str) -> NewTool {
    NewTool {
        workspace_id: w.clone(),
        name: name.into(),
        kind: "http".into(),
        description: "d".into(),
        parameters: json!({"type": "object"}),
        config: json!({"url": "http://127.0.0.1:9/t"}),
    }
}

async fn resources(db: TestDb) {
    let r = &db.stores.resources;
    let (a, b) = (ws("a"), ws("b"));
    let m = r
        .create_model(NewModel {
            workspace_id: a.clone(),
            name: "m".into(),
            kind: ModelKind::Llm,
            base_url: "http://127.0.0.1:9/v1".into(),
            model_name: "x".into(),
            api_key_env: None,
            context_window: None,
            extra_args: None,
        })
        .await
        .unwrap();
    assert!(
        !r.delete_model(&b, m.model_id).await.unwrap(),
        "other workspace"
    );
    assert!(r.delete_model(&a, m.model_id).await.unwrap());
    assert!(!r.delete_model(&a, m.model_id).await.unwrap());

    let t = r.create_tool(tool(&a, "t1")).await.unwrap();
    r.create_tool(tool(&a, "t2")).await.unwrap();
    let mut changed = tool(&a, "t3");
    changed.description = "new".into();
    let updated = r.update_tool(t.tool_id, changed).await.unwrap();
    assert_eq!(
        (updated.tool_id, updated.created_at),
        (t.tool_id, t.created_at)
    );
    assert_eq!(
        (updated.name.as_str(), updated.description.as_str()),
        ("t3", "new")
    );
    assert!(matches!(
        r.update_tool(t.tool_id, tool(&a, "t2")).await,
        Err(StoreError::Conflict(_))
    ));
    assert!(matches!(
        r.update_tool(t.tool_id, tool(&b, "t9")).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(r.delete_tool(&a, t.tool_id).await.unwrap());
    assert_eq!(r.list_tools(&a).await.unwrap().len(), 1);

    let kb = r.create_kb(&a, "kb", None).await.unwrap();
    r.create_kb(&a, "kb2", None).await.unwrap();
    let renamed = r
        .update_kb(&a, kb.kb_id, "manuals", Some("d".into()))
        .await
        .unwrap();
    assert_eq!(
        (renamed.name.as_str(), renamed.description.as_deref()),
        ("manuals", Some("d"))
    );
    assert!(matches!(
        r.update_kb(&a, kb.kb_id, "kb2", None).await,
        Err(StoreError::Conflict(_))
    ));
    assert!(matches!(
        r.update_kb(&b, kb.kb_id, "x", None).await,
        Err(StoreError::NotFound(_))
    ));
    let doc = |title: &str, text: &str| NewKbDocument {
        workspace_id: a.clone(),
        kb_id: kb.kb_id,
        title: title.into(),
        text: text.into(),
        artifact_id: None,
        metadata: json!({}),
    };
    let d1 = r
        .add_document(doc("one", "refunds take five days"))
        .await
        .unwrap();
    let d2 = r
        .add_document(doc("two", "refunds need a receipt"))
        .await
        .unwrap();
    let docs = r.list_documents(&a, kb.kb_id).await.unwrap();
    assert_eq!(
        docs.iter()
            .map(|d| (d.document_id, d.chunks))
            .collect::<Vec<_>>(),
        vec![(d1.document_id, 1), (d2.document_id, 1)]
    );
    assert!(matches!(
        r.list_documents(&b, kb.kb_id).await,
        Err(StoreError::NotFound(_))
    ));
    let edited = r
        .update_document(
            &a,
            kb.kb_id,
            d1.document_id,
            DocumentEdit {
                title: "first".into(),
                metadata: json!({"lang": "en"}),
            },
        )
        .await
        .unwrap();
    assert_eq!((edited.title.as_str(), edited.chunks), ("first", 1));
    assert_eq!(edited.metadata, json!({"lang": "en"}));
    assert_eq!(edited.sha256, d1.sha256, "the text is untouched");
    let search = || {
        r.search_kb(KbSearch {
            workspace_id: a.clone(),
            kb_id: kb.kb_id,
            query: "refunds".into(),
            top_k: 10,
            document_ids: vec![],
        })
    };
    assert_eq!(search().await.unwrap().len(), 2);
    assert!(
        !r.delete_document(&b, kb.kb_id, d1.document_id)
            .await
            .unwrap()
    );
    assert!(
        r.delete_document(&a, kb.kb_id, d1.document_id)
            .await
            .unwrap()
    );
    let hits = search().await.unwrap();
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert_eq!(hits[0].document_id, d2.document_id);

    assert!(!r.delete_kb(&b, kb.kb_id).await.unwrap());
    assert!(r.delete_kb(&a, kb.kb_id).await.unwrap());
    assert!(matches!(
        r.get_kb(&a, kb.kb_id).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(search().await, Err(StoreError::NotFound(_))));
    assert_eq!(r.list_kbs(&a).await.unwrap().len(), 1);
}

async fn schedules(db: TestDb) {
    let s = &db.stores.schedules;
    let a = ws("a");
    let event = json!({"request": {}});
    let created = s
        .create(NewSchedule {
            workspace_id: a.clone(),
            name: None,
            kind: ScheduleKind::Interval,
            spec: "1h".into(),
            event: event.clone(),
            enabled: true,
        })
        .await
        .unwrap();
    let edit = |enabled: bool, spec: &str| ScheduleEdit {
        name: Some("n".into()),
        kind: ScheduleKind::Interval,
        spec: spec.into(),
        event: event.clone(),
        enabled,
    };
    let renamed = s
        .update(&a, created.id, edit(true, "1h"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(renamed.name.as_deref(), Some("n"));
    assert_eq!(
        renamed.next_fire_at, created.next_fire_at,
        "a rename keeps the time"
    );

    let paused = s
        .update(&a, created.id, edit(false, "1h"))
        .await
        .unwrap()
        .unwrap();
    assert!(!paused.enabled);
    assert_eq!(paused.next_fire_at, None);
    let far = Utc::now() + TimeDelta::days(2);
    assert!(
        s.due(far, 10).await.unwrap().is_empty(),
        "paused is never due"
    );

    let before = Utc::now();
    let resumed = s
        .update(&a, created.id, edit(true, "1h"))
        .await
        .unwrap()
        .unwrap();
    let next = resumed.next_fire_at.unwrap();
    assert!(
        next >= before + TimeDelta::hours(1) - TimeDelta::seconds(1),
        "{next}"
    );
    assert_eq!(s.due(far, 10).await.unwrap().len(), 1);

    assert!(matches!(
        s.update(&a, created.id, edit(true, "soon")).await,
        Err(StoreError::InvalidArgument(_))
    ));
    assert!(
        s.update(&ws("b"), created.id, edit(true, "1h"))
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        s.update(&a, Uuid::now_v7(), edit(true, "1h"))
            .await
            .unwrap()
            .is_none()
    );
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

both!(resource_edits, resources);
both!(schedule_edits, schedules);
