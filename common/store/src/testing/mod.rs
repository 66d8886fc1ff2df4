//! The store conformance suite (quickwit's `metastore_test_suite!` pattern).
//!
//! [`store_suite!`](crate::store_suite) expands to one `#[tokio::test]` per contract test in
//! [`suite`], each running against a fresh, migrated, empty database made by the constructor
//! expression you pass. Every backend runs the same tests:
//!
//! ```ignore
//! // tests/sqlite.rs
//! sb_store::store_suite!(sb_store::testing::sqlite_file_db());
//! ```
//!
//! The constructors here give each test its own database: a temporary SQLite file (WAL, so
//! concurrency is real), an in-memory SQLite database, or a fresh Postgres schema on
//! `SWITCHBOARD_TEST_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`) that
//! is dropped when the [`TestDb`] is dropped, also when the test panics.

use crate::{SqlStore, SqlStoreOptions, StoreLimits, Stores};

/// Env var naming the Postgres database the tests use.
pub const TEST_DATABASE_URL_ENV: &str = "SWITCHBOARD_TEST_DATABASE_URL";
/// Used when [`TEST_DATABASE_URL_ENV`] is unset.
pub const DEFAULT_TEST_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// Storage cap of suite databases (small, so the cap test stays cheap).
pub const SUITE_MAX_STORAGE_VALUE_BYTES: usize = 64 * 1024;
/// Artifact cap of suite databases: above the 10 MiB read cap, so the cap is observable.
pub const SUITE_MAX_ARTIFACT_BYTES: usize = 12 * 1024 * 1024;

/// The Postgres URL tests use.
#[must_use]
pub fn postgres_url() -> String {
    std::env::var(TEST_DATABASE_URL_ENV).unwrap_or_else(|_| DEFAULT_TEST_DATABASE_URL.to_owned())
}

/// Options of suite databases: migrated on connect, small storage cap.
#[must_use]
pub fn suite_options() -> SqlStoreOptions {
    SqlStoreOptions {
        max_connections: 5,
        min_connections: 0,
        migrate: true,
        limits: StoreLimits {
            max_storage_value_bytes: Some(SUITE_MAX_STORAGE_VALUE_BYTES),
            max_artifact_bytes: SUITE_MAX_ARTIFACT_BYTES,
            ..StoreLimits::default()
        },
        ..SqlStoreOptions::default()
    }
}

enum Cleanup {
    None,
    TempDir(#[allow(dead_code)] tempfile::TempDir),
    PostgresSchema { url: String, schema: String },
}

/// A fresh database for one test; cleans up after itself when dropped.
pub struct TestDb {
    /// The concrete store (for raw checks).
    pub store: SqlStore,
    /// The same store as trait objects (what the tests exercise).
    pub stores: Stores,
    cleanup: Cleanup,
}

impl TestDb {
    fn new(store: SqlStore, cleanup: Cleanup) -> Self {
        Self {
            stores: Stores::from_sql(store.clone()),
            store,
            cleanup,
        }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Cleanup::PostgresSchema { url, schema } = &self.cleanup {
            let (url, schema) = (url.clone(), schema.clone());
            // Drop may run inside the test's runtime (or during a panic): do the async
            // cleanup on a separate thread with its own runtime.
            let result = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())?;
                rt.block_on(SqlStore::drop_schema(&url, &schema))
                    .map_err(|e| e.to_string())
            })
            .join();
            if let Ok(Err(err)) = result {
                eprintln!("warning: could not drop test schema: {err}");
            }
        }
    }
}

/// A migrated SQLite database in a temporary file (WAL journal, pooled connections).
pub async fn sqlite_file_db() -> TestDb {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("store.db").display()
    );
    let store = SqlStore::connect(&url, &suite_options())
        .await
        .expect("connect sqlite file");
    TestDb::new(store, Cleanup::TempDir(dir))
}

/// A migrated in-memory SQLite database (one connection).
pub async fn sqlite_memory_db() -> TestDb {
    let store = SqlStore::connect("sqlite::memory:", &suite_options())
        .await
        .expect("connect sqlite memory");
    TestDb::new(store, Cleanup::None)
}

/// A migrated, fresh Postgres schema on [`postgres_url`], dropped with the [`TestDb`].
pub async fn postgres_db() -> TestDb {
    let url = postgres_url();
    let schema = format!("sbt_{}", uuid::Uuid::new_v4().simple());
    let store = SqlStore::connect_with_schema(&url, &schema, &suite_options())
        .await
        .unwrap_or_else(|e| panic!("connect postgres ({url}): {e}"));
    TestDb::new(store, Cleanup::PostgresSchema { url, schema })
}

/// Generates one `#[tokio::test]` per conformance test, each on a fresh database made by
/// `$make` (an expression evaluating to a future of [`TestDb`]).
#[macro_export]
macro_rules! store_suite {
    ($make:expr) => {
        $crate::store_suite!(@tests $make;
            migrations_are_idempotent,
            health_ping,
            event_append_roundtrips_and_orders,
            event_append_dedupes_on_idempotency_key,
            event_append_refuses_a_key_with_another_fingerprint,
            turn_sessions_and_turn_identities,
            event_append_concurrent_same_key_creates_one,
            event_append_failure_writes_no_outbox,
            event_input_summary_is_truncated,
            event_update_status_merges_metadata,
            event_routing_follows_the_status,
            event_update_status_merge_replaces_whole_values,
            event_update_status_concurrent_merges_keep_all_keys,
            event_page_orders_filters_and_follows_cursors,
            event_page_clamps_limits_and_rejects_bad_cursors,
            event_delete_older_than,
            event_with_status_pages_across_workspaces,
            outbox_claim_leases_release_and_publish,
            outbox_lease_expires,
            outbox_concurrent_claims_are_disjoint,
            outbox_respects_available_at_and_cleanup,
            run_create_is_idempotent_on_event,
            run_claim_race_has_exactly_one_winner,
            run_terminal_states_are_final,
            run_finish_race_has_exactly_one_winner,
            run_finalize_stores_the_item_with_the_status,
            run_finalize_races_the_runs_own_terminal_item,
            run_items_after_the_terminal_item_are_not_stored,
            run_request_cancel,
            run_events_are_idempotent_and_ordered,
            run_insert_events_batch_reports_new_rows,
            run_list_filters_and_pages,
            run_with_status_pages_across_workspaces,
            run_deadlines_and_active_runs,
            run_expire_events,
            transcript_append_truncates_and_roundtrips,
            transcript_pages_in_both_directions,
            transcript_search_matches_and_ranks,
            transcript_search_survives_hostile_queries,
            transcript_delete_older_than_updates_search,
            artifact_put_verifies_sha_and_size,
            artifact_range_reads_and_cap,
            artifact_expiry_and_external_content,
            state_revisions_and_cas,
            state_value_limit_measures_unescaped_utf8,
            state_delete_with_and_without_revision,
            state_list_prefix_is_literal_and_paged,
            state_concurrent_unconditional_writes_all_succeed,
            storage_roundtrip_isolation_and_cap,
            agents_crud,
            runner_upsert_replaces,
            api_keys_create_authenticate_revoke,
            schedule_crud_is_workspace_scoped_and_paged,
            schedule_fire_advances_and_ingests_once,
            schedule_once_fires_then_is_disabled,
            schedule_concurrent_fires_have_one_winner,
            schedule_fire_with_invalid_event_writes_nothing,
            kb_search_matches_the_way_users_ask,
            kb_search_ranks_coverage_then_relevance,
        );
    };
    (@tests $make:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let db = $make.await;
                $crate::testing::suite::$name(&db).await;
            }
        )*
    };
}

/// The contract tests. Each takes a fresh [`TestDb`].
#[allow(clippy::missing_panics_doc)]
pub mod suite {
    use std::collections::HashSet;
    use std::time::Duration;

    use chrono::{TimeDelta, Utc};
    use sb_protocol::error::{ErrorCode, HasErrorCode};
    use sb_protocol::ids::{AgentId, EventId, RunId, WorkspaceId};
    use sea_orm::{ConnectionTrait, Statement};
    use serde_json::{Value, json};
    use sha2::{Digest, Sha256};

    use super::{SUITE_MAX_STORAGE_VALUE_BYTES, TestDb};
    use crate::artifacts::{ArtifactContent, ArtifactScope, NewArtifact};
    use crate::*;

    fn ws() -> WorkspaceId {
        WorkspaceId::new("ws-test").unwrap()
    }

    fn other_ws() -> WorkspaceId {
        WorkspaceId::new("ws-other").unwrap()
    }

    #[track_caller]
    fn assert_code<T: std::fmt::Debug>(result: Result<T>, code: ErrorCode) {
        match result {
            Ok(v) => panic!("expected {code:?}, got Ok({v:?})"),
            Err(e) => assert_eq!(e.code(), code, "unexpected error: {e}"),
        }
    }

    fn message(conv: &str, text: &str) -> NewEvent {
        let mut e = NewEvent::new(ws(), "message.received", "host_adapter");
        e.conversation_id = Some(conv.to_owned());
        e.input_summary = Some(text.to_owned());
        e
    }

    fn outbox_msg(key: &str) -> NewOutboxMessage {
        NewOutboxMessage::new(
            "switchboard.events",
            key,
            format!("body-{key}").into_bytes(),
        )
    }

    async fn drain_outbox(db: &TestDb) -> Vec<OutboxMessage> {
        db.stores
            .outbox
            .claim(1000, Duration::from_secs(60))
            .await
            .unwrap()
    }

    fn new_run(conv: Option<&str>) -> NewRun {
        NewRun {
            id: None,
            workspace_id: ws(),
            event_id: EventId::new(),
            agent_id: Some(AgentId::new()),
            runner_id: "plugin:acme/echo/echo".into(),
            pool: "default".into(),
            conversation_id: conv.map(str::to_owned),
            thread_id: None,
            bot_id: Some("bot-1".into()),
            deadline_at: None,
            attempt: 1,
        }
    }

    async fn create_run(db: &TestDb, conv: Option<&str>) -> RunRecord {
        db.stores.runs.create_run(new_run(conv)).await.unwrap().0
    }

    fn run_event(run_id: RunId, sequence: i64, text: &str) -> NewRunEvent {
        NewRunEvent {
            run_id,
            sequence,
            result_type: "message.delta".into(),
            data: json!({"type": "message.delta", "data": {"chunk": text}}),
        }
    }

    // ---------------------------------------------------------------- general

    /// Migrating an up-to-date database is a no-op, not an error.
    pub async fn migrations_are_idempotent(db: &TestDb) {
        db.store.migrate().await.unwrap();
        db.store.migrate().await.unwrap();
    }

    /// The health probe answers.
    pub async fn health_ping(db: &TestDb) {
        db.stores.health.ping().await.unwrap();
    }

    // ---------------------------------------------------------------- event log

    /// Appended events read back field for field, with increasing seqs and opaque cursors.
    pub async fn event_append_roundtrips_and_orders(db: &TestDb) {
        let mut first = message("c1", "hello");
        first.bot_id = Some("bot".into());
        first.thread_id = Some("t".into());
        first.actor_type = Some("user".into());
        first.actor_id = Some("u1".into());
        first.actor_name = Some("Ada".into());
        first.subject_type = Some("message".into());
        first.subject_id = Some("m1".into());
        first.event_time = Some(Utc::now());
        first.envelope = Some(json!({"input": {"text": "hello"}}));
        first.raw_ref = Some("artifact-1".into());
        first.metadata = json!({"k": "v"});
        first.runner_id = Some("plugin:a/b/c".into());
        let (a, created) = db
            .stores
            .events
            .append(first.clone(), vec![])
            .await
            .unwrap();
        assert!(created);
        let (b, _) = db
            .stores
            .events
            .append(message("c1", "second"), vec![])
            .await
            .unwrap();
        let (c, _) = db
            .stores
            .events
            .append(message("c2", "third"), vec![])
            .await
            .unwrap();
        assert!(a.seq < b.seq && b.seq < c.seq);
        assert_ne!(a.cursor, a.seq.to_string(), "cursors are opaque");

        let got = db.stores.events.get(a.id).await.unwrap().unwrap();
        assert_eq!(got, a);
        assert_eq!(got.workspace_id, ws());
        assert_eq!(got.event_type, "message.received");
        assert_eq!(got.source, "host_adapter");
        assert_eq!(got.status, EventStatus::Received);
        assert_eq!(got.bot_id.as_deref(), Some("bot"));
        assert_eq!(got.thread_id.as_deref(), Some("t"));
        assert_eq!(got.actor_name.as_deref(), Some("Ada"));
        assert_eq!(got.subject_id.as_deref(), Some("m1"));
        assert_eq!(got.envelope, first.envelope);
        assert_eq!(got.raw_ref.as_deref(), Some("artifact-1"));
        assert_eq!(got.metadata, json!({"k": "v"}));
        assert_eq!(got.runner_id.as_deref(), Some("plugin:a/b/c"));
        assert_eq!(
            got.event_time.unwrap().timestamp_micros(),
            first.event_time.unwrap().timestamp_micros()
        );
        // A missing event is None; an empty metadata object reads back as `{}`.
        assert!(
            db.stores
                .events
                .get(EventId::new())
                .await
                .unwrap()
                .is_none()
        );
        assert_eq!(
            db.stores.events.get(b.id).await.unwrap().unwrap().metadata,
            json!({})
        );
    }

    /// The same idempotency key in the same workspace writes nothing the second time.
    pub async fn event_append_dedupes_on_idempotency_key(db: &TestDb) {
        let mut event = message("c1", "hi");
        event.idempotency_key = Some("key-1".into());
        let (first, created) = db
            .stores
            .events
            .append(event.clone(), vec![outbox_msg("a")])
            .await
            .unwrap();
        assert!(created);
        event.input_summary = Some("different payload".into());
        let (second, created) = db
            .stores
            .events
            .append(event.clone(), vec![outbox_msg("b")])
            .await
            .unwrap();
        assert!(!created);
        assert_eq!(second, first);
        let claimed = drain_outbox(db).await;
        assert_eq!(claimed.len(), 1, "the duplicate enqueued nothing");
        assert_eq!(claimed[0].routing_key, "a");
        assert_eq!(claimed[0].body, b"body-a");

        // Keys are per workspace.
        event.workspace_id = other_ws();
        let (third, created) = db.stores.events.append(event, vec![]).await.unwrap();
        assert!(created);
        assert_ne!(third.id, first.id);

        // Invalid keys are rejected.
        let mut bad = message("c1", "x");
        bad.idempotency_key = Some("no spaces allowed".into());
        assert_code(
            db.stores.events.append(bad, vec![]).await,
            ErrorCode::InvalidArgument,
        );
    }

    /// Same key + same fingerprint → the first event; another fingerprint → `conflict`,
    /// nothing written. Without a fingerprint on either side, the key alone decides.
    pub async fn event_append_refuses_a_key_with_another_fingerprint(db: &TestDb) {
        let mut event = message("c1", "hi");
        event.idempotency_key = Some("fp-1".into());
        event.request_hash = Some("a".repeat(64));
        let (first, created) = db
            .stores
            .events
            .append(event.clone(), vec![outbox_msg("a")])
            .await
            .unwrap();
        assert!(created);
        let (again, created) = db
            .stores
            .events
            .append(event.clone(), vec![outbox_msg("b")])
            .await
            .unwrap();
        assert!(!created);
        assert_eq!(again.id, first.id);
        let mut other = event.clone();
        other.request_hash = Some("b".repeat(64));
        assert_code(
            db.stores.events.append(other, vec![outbox_msg("c")]).await,
            ErrorCode::Conflict,
        );
        let mut unhashed = event;
        unhashed.request_hash = None;
        let (old_style, created) = db.stores.events.append(unhashed, vec![]).await.unwrap();
        assert!(!created);
        assert_eq!(old_style.id, first.id);
        assert_eq!(drain_outbox(db).await.len(), 1, "only the first enqueued");
    }

    /// Sessions are per workspace and paged; a turn identity commits with its event; the
    /// same key replays or conflicts; a closed session takes no new turn.
    pub async fn turn_sessions_and_turn_identities(db: &TestDb) {
        let turns = &db.stores.turns;
        let new_session = |workspace_id: WorkspaceId| NewTurnSession {
            workspace_id,
            agent_id: AgentId::new(),
            runner_id: "plugin:acme/echo/default".into(),
            metadata: Some(json!({"app": "x"})),
        };
        let a = turns.create_session(new_session(ws())).await.unwrap();
        let b = turns.create_session(new_session(ws())).await.unwrap();
        let theirs = turns.create_session(new_session(other_ws())).await.unwrap();
        assert_eq!(a.conversation_id, session_conversation_id(a.id));
        assert_eq!(a.runner_id.as_deref(), Some("plugin:acme/echo/default"));
        assert!(turns.get_session(&ws(), theirs.id).await.unwrap().is_none());
        let page = turns.list_sessions(&ws(), None, Some(1)).await.unwrap();
        assert_eq!(page.items, vec![a.clone()]);
        assert!(page.has_more);
        let page = turns
            .list_sessions(&ws(), page.next_cursor, Some(10))
            .await
            .unwrap();
        assert_eq!(page.items, vec![b.clone()]);
        assert!(!page.has_more);

        let turn = |key: &str, hash: char| {
            let mut event = message(&a.conversation_id, "hi");
            event.id = Some(EventId::new());
            NewTurn {
                session_id: a.id,
                idempotency_key: key.into(),
                request_hash: hash.to_string().repeat(64),
                run_id: RunId::new(),
                event,
                outbox: vec![outbox_msg("turn")],
            }
        };
        let first = turn("k1", 'a');
        let (record, created) = turns.start_turn(first.clone()).await.unwrap();
        assert!(created);
        assert_eq!(record.run_id, first.run_id);
        assert_eq!(record.event_id, first.event.id);
        assert!(
            db.stores
                .events
                .get(first.event.id.unwrap())
                .await
                .unwrap()
                .is_some()
        );
        assert_eq!(
            turns.get_turn(first.run_id).await.unwrap(),
            Some(record.clone())
        );
        let (replayed, created) = turns.start_turn(turn("k1", 'a')).await.unwrap();
        assert!(!created);
        assert_eq!(replayed, record);
        assert_code(turns.start_turn(turn("k1", 'b')).await, ErrorCode::Conflict);
        assert_code(
            turns.start_turn(turn("bad key", 'a')).await,
            ErrorCode::InvalidArgument,
        );
        assert_eq!(drain_outbox(db).await.len(), 1, "one event announced");

        // Another workspace's session is not found.
        let mut foreign = turn("k2", 'a');
        foreign.session_id = theirs.id;
        assert_code(turns.start_turn(foreign).await, ErrorCode::NotFound);

        // Closed: idempotent; replays still answer, new turns conflict.
        let closed = turns.close_session(&ws(), a.id).await.unwrap().unwrap();
        assert!(closed.closed_at.is_some());
        let again = turns.close_session(&ws(), a.id).await.unwrap().unwrap();
        assert_eq!(again.closed_at, closed.closed_at);
        assert_eq!(turns.start_turn(turn("k1", 'a')).await.unwrap().0, record);
        assert_code(turns.start_turn(turn("k3", 'a')).await, ErrorCode::Conflict);
        assert!(
            turns
                .close_session(&other_ws(), a.id)
                .await
                .unwrap()
                .is_none()
        );
    }

    /// Racing appends with one key create exactly one event and one outbox row.
    pub async fn event_append_concurrent_same_key_creates_one(db: &TestDb) {
        let mut tasks = Vec::new();
        for i in 0..8 {
            let stores = db.stores.clone();
            tasks.push(tokio::spawn(async move {
                let mut event = message("c1", &format!("attempt {i}"));
                event.idempotency_key = Some("same".into());
                stores
                    .events
                    .append(event, vec![outbox_msg("k")])
                    .await
                    .unwrap()
            }));
        }
        let mut ids = HashSet::new();
        let mut created = 0;
        for task in tasks {
            let (record, was_created) = task.await.unwrap();
            ids.insert(record.id);
            created += usize::from(was_created);
        }
        assert_eq!(created, 1);
        assert_eq!(ids.len(), 1);
        assert_eq!(drain_outbox(db).await.len(), 1);
    }

    /// An append that fails leaves neither the event nor its outbox rows behind.
    pub async fn event_append_failure_writes_no_outbox(db: &TestDb) {
        let (first, _) = db
            .stores
            .events
            .append(message("c1", "a"), vec![])
            .await
            .unwrap();
        let mut again = message("c1", "b");
        again.id = Some(first.id);
        assert_code(
            db.stores.events.append(again, vec![outbox_msg("x")]).await,
            ErrorCode::Conflict,
        );
        assert!(drain_outbox(db).await.is_empty());
        let before = db.stores.events.page(EventQuery::new(ws())).await.unwrap();
        assert_eq!(before.items.len(), 1);
        // Invalid outbox rows fail the whole append.
        assert_code(
            db.stores
                .events
                .append(
                    message("c1", "c"),
                    vec![NewOutboxMessage::new("", "k", vec![])],
                )
                .await,
            ErrorCode::InvalidArgument,
        );
        let after = db.stores.events.page(EventQuery::new(ws())).await.unwrap();
        assert_eq!(after.items.len(), before.items.len());
    }

    /// `input_summary` keeps 1000 characters and cuts longer text to 997 + `...`.
    pub async fn event_input_summary_is_truncated(db: &TestDb) {
        let exact = "é".repeat(1000);
        let (a, _) = db
            .stores
            .events
            .append(message("c", &exact), vec![])
            .await
            .unwrap();
        assert_eq!(a.input_summary.as_deref(), Some(exact.as_str()));
        let (b, _) = db
            .stores
            .events
            .append(message("c", &"x".repeat(5000)), vec![])
            .await
            .unwrap();
        let summary = b.input_summary.unwrap();
        assert_eq!(summary.chars().count(), 1000);
        assert_eq!(summary, format!("{}...", "x".repeat(997)));
    }

    /// Status updates set the given fields and merge metadata keys.
    pub async fn event_update_status_merges_metadata(db: &TestDb) {
        let mut event = message("c1", "hi");
        event.metadata = json!({"keep": 1, "drop": 2});
        let (e, _) = db.stores.events.append(event, vec![]).await.unwrap();
        let run = RunId::new();
        let updated = db
            .stores
            .events
            .update_status(
                e.id,
                EventStatusUpdate {
                    status: EventStatus::Claimed,
                    reason: Some("steering".into()),
                    run_id: Some(run),
                    claimed_by_run_id: Some(run),
                    metadata_merge: Some(json!({"drop": null, "steering": {"status": "queued"}})),
                },
            )
            .await
            .unwrap();
        assert_eq!(updated.status, EventStatus::Claimed);
        assert_eq!(updated.reason.as_deref(), Some("steering"));
        assert_eq!(updated.run_id, Some(run));
        assert_eq!(updated.claimed_by_run_id, Some(run));
        assert_eq!(
            updated.metadata,
            json!({"keep": 1, "steering": {"status": "queued"}})
        );
        assert!(updated.updated_at >= e.updated_at);
        assert_eq!(db.stores.events.get(e.id).await.unwrap().unwrap(), updated);

        // Fields left None are kept.
        let again = db
            .stores
            .events
            .update_status(e.id, EventStatusUpdate::status(EventStatus::Dispatched))
            .await
            .unwrap();
        assert_eq!(again.status, EventStatus::Dispatched);
        assert_eq!(again.reason.as_deref(), Some("steering"));
        assert_eq!(again.metadata, updated.metadata);

        assert_code(
            db.stores
                .events
                .update_status(
                    EventId::new(),
                    EventStatusUpdate::status(EventStatus::Unrouted),
                )
                .await,
            ErrorCode::NotFound,
        );
        let mut bad = EventStatusUpdate::status(EventStatus::Unrouted);
        bad.metadata_merge = Some(json!([1]));
        assert_code(
            db.stores.events.update_status(e.id, bad).await,
            ErrorCode::InvalidArgument,
        );
    }

    /// A metadata merge replaces each top-level value whole (nested nulls and arrays are
    /// kept as given), takes any key (dots, quotes, backslashes, non-ASCII), and removing
    /// every key leaves `{}`.
    pub async fn event_update_status_merge_replaces_whole_values(db: &TestDb) {
        let events = &db.stores.events;
        let mut event = message("c1", "hi");
        event.metadata = json!({"a.b": 1, "keep": {"x": 1, "y": 2}});
        let (e, _) = events.append(event, vec![]).await.unwrap();
        let merge = |m: Value| EventStatusUpdate {
            metadata_merge: Some(m),
            ..EventStatusUpdate::status(EventStatus::Dispatched)
        };
        let updated = events
            .update_status(
                e.id,
                merge(json!({
                    "a.b": null,
                    "keep": {"x": 3},
                    "new": {"n": null, "list": [1, null, "s"]},
                    "ünï": "v",
                    "": 0,
                })),
            )
            .await
            .unwrap();
        let expected = json!({
            "keep": {"x": 3},
            "new": {"n": null, "list": [1, null, "s"]},
            "ünï": "v",
            "": 0,
        });
        assert_eq!(updated.metadata, expected);
        assert_eq!(events.get(e.id).await.unwrap().unwrap().metadata, expected);

        let updated = events
            .update_status(
                e.id,
                merge(json!({"quo\"te": 1, "back\\slash": [2], "ünï": null})),
            )
            .await
            .unwrap();
        assert_eq!(
            updated.metadata,
            json!({
                "keep": {"x": 3},
                "new": {"n": null, "list": [1, null, "s"]},
                "": 0,
                "quo\"te": 1,
                "back\\slash": [2],
            })
        );

        let emptied = events
            .update_status(
                e.id,
                merge(json!({"keep": null, "new": null, "": null, "quo\"te": null, "back\\slash": null})),
            )
            .await
            .unwrap();
        assert_eq!(emptied.metadata, json!({}));
        assert_eq!(events.get(e.id).await.unwrap().unwrap(), emptied);
        assert_eq!(emptied.status, EventStatus::Dispatched);
    }

    /// `routing` says what `get` says about the routing, as the status changes.
    pub async fn event_routing_follows_the_status(db: &TestDb) {
        let events = &db.stores.events;
        let (e, _) = events.append(message("c1", "hi"), vec![]).await.unwrap();
        let routing = events.routing(e.id).await.unwrap().unwrap();
        assert_eq!(routing.status, EventStatus::Received);
        assert_eq!(routing, EventRouting::from(&e));

        let run = RunId::new();
        let mut update = EventStatusUpdate::status(EventStatus::Dispatched);
        update.run_id = Some(run);
        update.metadata_merge = Some(json!({"authorization": {"big": "document"}}));
        let dispatched = events.update_status(e.id, update).await.unwrap();
        let routing = events.routing(e.id).await.unwrap().unwrap();
        assert_eq!(routing.run_id, Some(run));
        assert_eq!(routing, EventRouting::from(&dispatched));

        let mut update = EventStatusUpdate::status(EventStatus::Unrouted);
        update.reason = Some("binding.not_found".into());
        update.claimed_by_run_id = Some(run);
        let unrouted = events.update_status(e.id, update).await.unwrap();
        let routing = events.routing(e.id).await.unwrap().unwrap();
        assert_eq!(routing.reason.as_deref(), Some("binding.not_found"));
        assert_eq!(routing, EventRouting::from(&unrouted));

        assert_eq!(events.routing(EventId::new()).await.unwrap(), None);
    }

    /// Concurrent metadata merges do not lose each other's keys.
    pub async fn event_update_status_concurrent_merges_keep_all_keys(db: &TestDb) {
        let (e, _) = db
            .stores
            .events
            .append(message("c1", "hi"), vec![])
            .await
            .unwrap();
        let mut tasks = Vec::new();
        for i in 0..10 {
            let stores = db.stores.clone();
            tasks.push(tokio::spawn(async move {
                let mut update = EventStatusUpdate::status(EventStatus::Dispatched);
                update.metadata_merge = Some(json!({ format!("k{i}"): i }));
                stores.events.update_status(e.id, update).await.unwrap();
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let meta = db.stores.events.get(e.id).await.unwrap().unwrap().metadata;
        for i in 0..10 {
            assert_eq!(meta[format!("k{i}")], json!(i), "{meta}");
        }
    }

    /// Pages: newest first, `after_cursor` oldest first, filters, strict threads.
    pub async fn event_page_orders_filters_and_follows_cursors(db: &TestDb) {
        let mut seqs = Vec::new();
        for i in 0..7 {
            let mut e = message("conv-a", &format!("a{i}"));
            e.thread_id = (i % 2 == 1).then(|| "t1".to_owned());
            e.bot_id = Some(if i < 5 { "bot-1" } else { "bot-2" }.into());
            if i == 6 {
                e.event_type = "artifact.created".into();
            }
            seqs.push(db.stores.events.append(e, vec![]).await.unwrap().0.seq);
        }
        db.stores
            .events
            .append(message("conv-b", "b"), vec![])
            .await
            .unwrap();

        // Backward pages of 3 until the end.
        let mut query = EventQuery::new(ws());
        query.conversation_id = Some("conv-a".into());
        query.limit = Some(3);
        let mut seen = Vec::new();
        loop {
            let page = db.stores.events.page(query.clone()).await.unwrap();
            assert!(page.items.len() <= 3);
            seen.extend(page.items.iter().map(|e| e.seq));
            assert_eq!(
                page.prev_cursor,
                page.items.first().map(|e| e.cursor.clone())
            );
            if !page.has_more {
                assert!(page.next_cursor.is_none());
                break;
            }
            query.before_cursor = page.next_cursor;
        }
        let mut expected = seqs.clone();
        expected.reverse();
        assert_eq!(seen, expected);

        // Forward from a cursor.
        let all = db
            .stores
            .events
            .page({
                let mut q = EventQuery::new(ws());
                q.conversation_id = Some("conv-a".into());
                q
            })
            .await
            .unwrap();
        let third_oldest = all.items.iter().find(|e| e.seq == seqs[2]).unwrap();
        let mut q = EventQuery::new(ws());
        q.conversation_id = Some("conv-a".into());
        q.after_cursor = Some(third_oldest.cursor.clone());
        q.limit = Some(2);
        let page = db.stores.events.page(q).await.unwrap();
        assert_eq!(
            page.items.iter().map(|e| e.seq).collect::<Vec<_>>(),
            seqs[3..5]
        );
        assert!(page.has_more);

        // Strict thread filter: None matches only rows without a thread.
        let mut q = EventQuery::new(ws());
        q.conversation_id = Some("conv-a".into());
        q.thread = ThreadFilter::Exactly(None);
        let page = db.stores.events.page(q.clone()).await.unwrap();
        assert_eq!(page.items.len(), 4);
        assert!(page.items.iter().all(|e| e.thread_id.is_none()));
        q.thread = ThreadFilter::Exactly(Some("t1".into()));
        assert_eq!(db.stores.events.page(q).await.unwrap().items.len(), 3);

        // Bot, type and workspace filters.
        let mut q = EventQuery::new(ws());
        q.bot_id = Some("bot-2".into());
        assert_eq!(db.stores.events.page(q).await.unwrap().items.len(), 2);
        let mut q = EventQuery::new(ws());
        q.event_types = vec!["artifact.created".into()];
        let page = db.stores.events.page(q).await.unwrap();
        assert_eq!(page.items.len(), 1);
        assert_eq!(page.items[0].seq, seqs[6]);
        assert!(
            db.stores
                .events
                .page(EventQuery::new(other_ws()))
                .await
                .unwrap()
                .items
                .is_empty()
        );
        // Whole workspace: 8 events.
        assert_eq!(
            db.stores
                .events
                .page(EventQuery::new(ws()))
                .await
                .unwrap()
                .items
                .len(),
            8
        );
    }

    /// Limits are clamped to [1, 100]; foreign or malformed cursors are invalid_argument.
    pub async fn event_page_clamps_limits_and_rejects_bad_cursors(db: &TestDb) {
        for i in 0..101 {
            db.stores
                .events
                .append(message("c", &format!("{i}")), vec![])
                .await
                .unwrap();
        }
        let mut q = EventQuery::new(ws());
        q.limit = Some(0);
        assert_eq!(
            db.stores.events.page(q.clone()).await.unwrap().items.len(),
            1
        );
        q.limit = Some(-5);
        assert_eq!(
            db.stores.events.page(q.clone()).await.unwrap().items.len(),
            1
        );
        q.limit = Some(1000);
        let page = db.stores.events.page(q.clone()).await.unwrap();
        assert_eq!(page.items.len(), 100);
        assert!(page.has_more);
        q.limit = None;
        assert_eq!(
            db.stores.events.page(q.clone()).await.unwrap().items.len(),
            50
        );

        for bad in ["garbage", "42", "", "%%%"] {
            let mut q = EventQuery::new(ws());
            q.before_cursor = Some(bad.into());
            assert_code(db.stores.events.page(q).await, ErrorCode::InvalidArgument);
        }
        // A transcript cursor is not an event cursor.
        let item = db
            .stores
            .transcript
            .append(NewTranscriptItem::message(ws(), "c", "e", "user", "x"))
            .await
            .unwrap();
        let mut q = EventQuery::new(ws());
        q.after_cursor = Some(item.cursor);
        assert_code(db.stores.events.page(q).await, ErrorCode::InvalidArgument);
    }

    /// Retention deletes old events in bounded batches.
    pub async fn event_delete_older_than(db: &TestDb) {
        for i in 0..5 {
            db.stores
                .events
                .append(message("c", &format!("{i}")), vec![])
                .await
                .unwrap();
        }
        let future = Utc::now() + TimeDelta::seconds(5);
        assert_eq!(
            db.stores
                .events
                .delete_older_than(Utc::now() - TimeDelta::hours(1), 10)
                .await
                .unwrap(),
            0
        );
        assert_eq!(
            db.stores.events.delete_older_than(future, 3).await.unwrap(),
            3
        );
        assert_eq!(
            db.stores.events.delete_older_than(future, 3).await.unwrap(),
            2
        );
        assert!(
            db.stores
                .events
                .page(EventQuery::new(ws()))
                .await
                .unwrap()
                .items
                .is_empty()
        );
    }

    /// Every event [`EventLog::with_status`] returns from `cursor` on, following
    /// `next_cursor` with pages of `limit`; checks the shape of each page on the way.
    async fn events_with_status(
        db: &TestDb,
        status: EventStatus,
        mut cursor: Option<String>,
        limit: i64,
    ) -> Vec<EventId> {
        let mut seen = Vec::new();
        loop {
            let page = db
                .stores
                .events
                .with_status(status, cursor, Some(limit))
                .await
                .unwrap();
            assert!(page.items.len() as i64 <= limit, "{page:?}");
            assert!(page.items.iter().all(|e| e.status == status), "{page:?}");
            assert!(
                page.items.windows(2).all(|w| w[0].seq < w[1].seq),
                "{page:?}"
            );
            seen.extend(page.items.iter().map(|e| e.id));
            let Some(next) = page.next_cursor else {
                assert!(!page.has_more);
                return seen;
            };
            assert!(page.has_more);
            assert_eq!(Some(&next), page.items.last().map(|e| &e.cursor));
            cursor = Some(next);
        }
    }

    /// `with_status` reads one status across every workspace, oldest first, in bounded
    /// pages that neither skip nor repeat an event when statuses change between pages.
    pub async fn event_with_status_pages_across_workspaces(db: &TestDb) {
        let to = |status| EventStatusUpdate::status(status);
        // Workspaces alternate; every third event is routed.
        let (mut received, mut dispatched) = (Vec::new(), Vec::new());
        for i in 0..9 {
            let mut e = message("c", &format!("{i}"));
            if i % 2 == 1 {
                e.workspace_id = other_ws();
            }
            let (event, _) = db.stores.events.append(e, vec![]).await.unwrap();
            if i % 3 == 2 {
                db.stores
                    .events
                    .update_status(event.id, to(EventStatus::Dispatched))
                    .await
                    .unwrap();
                dispatched.push(event.id);
            } else {
                received.push(event.id);
            }
        }
        assert_eq!(
            events_with_status(db, EventStatus::Received, None, 2).await,
            received
        );
        assert_eq!(
            events_with_status(db, EventStatus::Dispatched, None, 100).await,
            dispatched
        );
        assert!(
            events_with_status(db, EventStatus::Claimed, None, 10)
                .await
                .is_empty()
        );

        // Statuses change after the first page: an event already read and one not read yet
        // leave `received`, a routed one further on returns to it, and a new one arrives.
        let first = db
            .stores
            .events
            .with_status(EventStatus::Received, None, Some(2))
            .await
            .unwrap();
        assert_eq!(
            first.items.iter().map(|e| e.id).collect::<Vec<_>>(),
            received[..2]
        );
        for (id, status) in [
            (received[0], EventStatus::Dispatched),
            (received[3], EventStatus::Unrouted),
            (dispatched[1], EventStatus::Received),
        ] {
            db.stores
                .events
                .update_status(id, to(status))
                .await
                .unwrap();
        }
        let (late, _) = db
            .stores
            .events
            .append(message("c", "late"), vec![])
            .await
            .unwrap();
        assert_eq!(
            events_with_status(db, EventStatus::Received, first.next_cursor, 2).await,
            [
                received[2],
                dispatched[1],
                received[4],
                received[5],
                late.id
            ]
        );

        // Limits are clamped to [1, 100]; foreign or malformed cursors are invalid_argument.
        let one = db
            .stores
            .events
            .with_status(EventStatus::Received, None, Some(0))
            .await
            .unwrap();
        assert_eq!(one.items.len(), 1);
        assert!(one.has_more);
        for bad in ["garbage", "42", ""] {
            assert_code(
                db.stores
                    .events
                    .with_status(EventStatus::Received, Some(bad.into()), None)
                    .await,
                ErrorCode::InvalidArgument,
            );
        }
        let item = db
            .stores
            .transcript
            .append(NewTranscriptItem::message(ws(), "c", "e", "user", "x"))
            .await
            .unwrap();
        assert_code(
            db.stores
                .events
                .with_status(EventStatus::Received, Some(item.cursor), None)
                .await,
            ErrorCode::InvalidArgument,
        );
    }

    // ---------------------------------------------------------------- outbox

    /// Claims lease rows; release and publish end the lease.
    pub async fn outbox_claim_leases_release_and_publish(db: &TestDb) {
        let ids = db
            .stores
            .outbox
            .enqueue(vec![outbox_msg("a"), outbox_msg("b"), outbox_msg("c")])
            .await
            .unwrap();
        assert_eq!(ids.len(), 3);
        assert!(ids.windows(2).all(|w| w[0] < w[1]));

        let lease = Duration::from_secs(60);
        let claimed = db.stores.outbox.claim(10, lease).await.unwrap();
        assert_eq!(claimed.iter().map(|m| m.id).collect::<Vec<_>>(), ids);
        assert!(
            claimed
                .iter()
                .all(|m| m.attempts == 1 && m.locked_until.is_some())
        );
        assert_eq!(claimed[1].routing_key, "b");
        assert_eq!(claimed[1].exchange, "switchboard.events");
        assert!(
            db.stores.outbox.claim(10, lease).await.unwrap().is_empty(),
            "leased"
        );

        db.stores.outbox.release(&ids[..2]).await.unwrap();
        let again = db.stores.outbox.claim(10, lease).await.unwrap();
        assert_eq!(again.iter().map(|m| m.id).collect::<Vec<_>>(), ids[..2]);
        assert!(again.iter().all(|m| m.attempts == 2));

        db.stores.outbox.mark_published(&ids).await.unwrap();
        db.stores.outbox.mark_published(&ids).await.unwrap(); // idempotent
        db.stores.outbox.release(&ids).await.unwrap(); // no effect on published rows
        assert!(db.stores.outbox.claim(10, lease).await.unwrap().is_empty());
        // Claim limits are clamped, never an error.
        assert!(db.stores.outbox.claim(0, lease).await.unwrap().is_empty());
    }

    /// An expired lease makes the row claimable again (at-least-once).
    pub async fn outbox_lease_expires(db: &TestDb) {
        db.stores
            .outbox
            .enqueue(vec![outbox_msg("a")])
            .await
            .unwrap();
        let first = db
            .stores
            .outbox
            .claim(10, Duration::from_millis(200))
            .await
            .unwrap();
        assert_eq!(first.len(), 1);
        assert!(
            db.stores
                .outbox
                .claim(10, Duration::from_secs(60))
                .await
                .unwrap()
                .is_empty()
        );
        tokio::time::sleep(Duration::from_millis(400)).await;
        let second = db
            .stores
            .outbox
            .claim(10, Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(second.len(), 1);
        assert_eq!(second[0].id, first[0].id);
        assert_eq!(second[0].attempts, 2);
    }

    /// Concurrent relays never receive the same row.
    pub async fn outbox_concurrent_claims_are_disjoint(db: &TestDb) {
        let messages = (0..60).map(|i| outbox_msg(&format!("m{i}"))).collect();
        db.stores.outbox.enqueue(messages).await.unwrap();
        let mut tasks = Vec::new();
        for _ in 0..6 {
            let stores = db.stores.clone();
            tasks.push(tokio::spawn(async move {
                stores
                    .outbox
                    .claim(15, Duration::from_secs(60))
                    .await
                    .unwrap()
            }));
        }
        let mut seen = HashSet::new();
        let mut total = 0;
        for task in tasks {
            for m in task.await.unwrap() {
                total += 1;
                assert!(seen.insert(m.id), "row {} claimed twice", m.id);
            }
        }
        // Nothing was lost either: a final sweep picks up whatever the racing claims
        // skipped (SKIP LOCKED may leave rows for later).
        for m in db
            .stores
            .outbox
            .claim(100, Duration::from_secs(60))
            .await
            .unwrap()
        {
            total += 1;
            assert!(seen.insert(m.id), "row {} claimed twice", m.id);
        }
        assert_eq!(total, 60);
    }

    /// Delayed rows wait for `available_at`; published rows can be cleaned up.
    pub async fn outbox_respects_available_at_and_cleanup(db: &TestDb) {
        let mut later = outbox_msg("later");
        later.available_at = Some(Utc::now() + TimeDelta::hours(1));
        later.headers = Some(json!({"content_type": "application/json"}));
        let ids = db
            .stores
            .outbox
            .enqueue(vec![later, outbox_msg("now")])
            .await
            .unwrap();
        let claimed = db
            .stores
            .outbox
            .claim(10, Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(claimed.len(), 1);
        assert_eq!(claimed[0].id, ids[1]);
        db.stores.outbox.mark_published(&[ids[1]]).await.unwrap();
        let soon = Utc::now() + TimeDelta::seconds(5);
        assert_eq!(
            db.stores
                .outbox
                .delete_published_before(soon, 10)
                .await
                .unwrap(),
            1
        );
        assert_eq!(
            db.stores
                .outbox
                .delete_published_before(soon, 10)
                .await
                .unwrap(),
            0
        );
    }

    // ---------------------------------------------------------------- runs

    /// One event has one run; a redelivered event gets the same run back.
    pub async fn run_create_is_idempotent_on_event(db: &TestDb) {
        let mut new = new_run(Some("c1"));
        new.deadline_at = Some(Utc::now() + TimeDelta::seconds(300));
        let (run, created) = db.stores.runs.create_run(new.clone()).await.unwrap();
        assert!(created);
        assert_eq!(run.status, RunStatus::Queued);
        assert_eq!(run.last_sequence, 0);
        assert_eq!(run.attempt, 1);
        assert_eq!(run.event_id, new.event_id);
        assert_eq!(run.conversation_id.as_deref(), Some("c1"));
        assert_eq!(run.runner_id, "plugin:acme/echo/echo");
        let (again, created) = db.stores.runs.create_run(new.clone()).await.unwrap();
        assert!(!created);
        assert_eq!(again, run);
        assert_eq!(db.stores.runs.get_run(run.id).await.unwrap().unwrap(), run);
        assert!(
            db.stores
                .runs
                .get_run(RunId::new())
                .await
                .unwrap()
                .is_none()
        );

        // Reusing the run id for another event is a conflict.
        let mut clash = new_run(Some("c1"));
        clash.id = Some(run.id);
        assert_code(db.stores.runs.create_run(clash).await, ErrorCode::Conflict);
    }

    /// Among many concurrent claimers exactly one wins.
    pub async fn run_claim_race_has_exactly_one_winner(db: &TestDb) {
        let run = create_run(db, Some("c1")).await;
        let mut tasks = Vec::new();
        for i in 0..16 {
            let stores = db.stores.clone();
            tasks.push(tokio::spawn(async move {
                let worker = format!("worker-{i}");
                let won = stores.runs.claim_run(run.id, &worker).await.unwrap();
                (worker, won)
            }));
        }
        let mut winners = Vec::new();
        for task in tasks {
            let (worker, won) = task.await.unwrap();
            if won {
                winners.push(worker);
            }
        }
        assert_eq!(winners.len(), 1);
        let stored = db.stores.runs.get_run(run.id).await.unwrap().unwrap();
        assert_eq!(stored.status, RunStatus::Running);
        assert_eq!(stored.worker_id.as_deref(), Some(winners[0].as_str()));
        assert!(stored.started_at.is_some());
        assert!(!db.stores.runs.claim_run(RunId::new(), "w").await.unwrap());
    }

    /// Terminal states never change.
    pub async fn run_terminal_states_are_final(db: &TestDb) {
        let run = create_run(db, None).await;
        assert!(db.stores.runs.claim_run(run.id, "w1").await.unwrap());
        let mut done = RunOutcome::completed();
        done.usage = Some(json!({"tokens": 3}));
        assert!(db.stores.runs.finish_run(run.id, done).await.unwrap());
        let failed = RunOutcome::with_error(RunStatus::Failed, "runtime_error", "late");
        assert!(!db.stores.runs.finish_run(run.id, failed).await.unwrap());
        assert!(!db.stores.runs.claim_run(run.id, "w2").await.unwrap());
        let stored = db.stores.runs.get_run(run.id).await.unwrap().unwrap();
        assert_eq!(stored.status, RunStatus::Completed);
        assert_eq!(stored.error_code, None);
        assert_eq!(stored.usage, Some(json!({"tokens": 3})));
        assert!(stored.ended_at.is_some());
        assert_eq!(stored.worker_id.as_deref(), Some("w1"));

        // A queued run can end without ever running (cancel before start, reaper).
        let queued = create_run(db, None).await;
        let cancelled = RunOutcome::with_error(RunStatus::Cancelled, "cancelled", "user");
        assert!(
            db.stores
                .runs
                .finish_run(queued.id, cancelled)
                .await
                .unwrap()
        );
        let stored = db.stores.runs.get_run(queued.id).await.unwrap().unwrap();
        assert_eq!(stored.status, RunStatus::Cancelled);
        assert_eq!(stored.error_code.as_deref(), Some("cancelled"));
        assert_eq!(stored.error_message.as_deref(), Some("user"));
        assert!(!db.stores.runs.claim_run(queued.id, "w").await.unwrap());

        let not_terminal = RunOutcome {
            status: RunStatus::Running,
            ..RunOutcome::completed()
        };
        assert_code(
            db.stores.runs.finish_run(run.id, not_terminal).await,
            ErrorCode::InvalidArgument,
        );
    }

    /// Concurrent finishers: the first wins, the others change nothing.
    pub async fn run_finish_race_has_exactly_one_winner(db: &TestDb) {
        let run = create_run(db, None).await;
        let statuses = [
            RunStatus::Completed,
            RunStatus::Failed,
            RunStatus::Cancelled,
            RunStatus::Timeout,
            RunStatus::Interrupted,
        ];
        let mut tasks = Vec::new();
        for status in statuses {
            let stores = db.stores.clone();
            tasks.push(tokio::spawn(async move {
                let outcome = RunOutcome::with_error(status, status.as_str(), "race");
                (
                    status,
                    stores.runs.finish_run(run.id, outcome).await.unwrap(),
                )
            }));
        }
        let mut winners = Vec::new();
        for task in tasks {
            let (status, won) = task.await.unwrap();
            if won {
                winners.push(status);
            }
        }
        assert_eq!(winners.len(), 1);
        let stored = db.stores.runs.get_run(run.id).await.unwrap().unwrap();
        assert_eq!(stored.status, winners[0]);
        assert_eq!(stored.error_code.as_deref(), Some(winners[0].as_str()));
    }

    fn terminal_event(run_id: RunId, sequence: i64, result_type: &str) -> NewRunEvent {
        NewRunEvent {
            run_id,
            sequence,
            result_type: result_type.to_owned(),
            data: json!({"type": result_type, "data": {}}),
        }
    }

    fn is_terminal_type(result_type: &str) -> bool {
        matches!(result_type, "run.completed" | "run.failed")
    }

    /// `finalize_run` stores the host-made terminal item and the terminal status in one
    /// commit; it writes nothing for a run that already has a terminal item or already ended;
    /// a second terminal item is never stored, at whatever sequence (issue 15, findings 4, 6).
    pub async fn run_finalize_stores_the_item_with_the_status(db: &TestDb) {
        use sb_protocol::result::AgentRunResult;
        let interrupted =
            || RunOutcome::with_error(RunStatus::Interrupted, "interrupted", "worker lost");
        let item = || AgentRunResult::run_failed("interrupted", "worker lost", true);

        let run = create_run(db, None).await;
        assert!(db.stores.runs.claim_run(run.id, "w1").await.unwrap());
        db.stores
            .runs
            .insert_event(run_event(run.id, 1, "a"))
            .await
            .unwrap();
        assert_eq!(
            db.stores
                .runs
                .finalize_run(run.id, interrupted(), item())
                .await
                .unwrap(),
            Finalized::Ended { sequence: 2 }
        );
        let stored = db.stores.runs.get_run(run.id).await.unwrap().unwrap();
        assert_eq!(stored.status, RunStatus::Interrupted);
        assert_eq!(stored.error_code.as_deref(), Some("interrupted"));
        assert_eq!(stored.last_sequence, 2);
        assert!(stored.ended_at.is_some());
        let items = db.stores.runs.events_after(run.id, 1, 10).await.unwrap();
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].sequence, 2);
        assert_eq!(items[0].result_type, "run.failed");
        assert_eq!(items[0].data["sequence"], json!(2));
        assert_eq!(items[0].data["run_id"], json!(run.id.to_string()));
        assert_eq!(items[0].data["data"]["code"], json!("interrupted"));
        assert_eq!(
            db.stores
                .runs
                .finalize_run(run.id, interrupted(), item())
                .await
                .unwrap(),
            Finalized::AlreadyEnded(RunStatus::Interrupted)
        );
        assert_eq!(
            db.stores
                .runs
                .events_after(run.id, 0, 10)
                .await
                .unwrap()
                .len(),
            2,
            "nothing written for an ended run"
        );

        // The run's own terminal item is stored but not applied yet: it is kept, not doubled.
        let own = create_run(db, None).await;
        assert!(db.stores.runs.claim_run(own.id, "w1").await.unwrap());
        assert!(
            db.stores
                .runs
                .insert_event(terminal_event(own.id, 1, "run.completed"))
                .await
                .unwrap()
        );
        assert_eq!(
            db.stores
                .runs
                .finalize_run(own.id, interrupted(), item())
                .await
                .unwrap(),
            Finalized::TerminalStored { sequence: 1 }
        );
        assert_eq!(
            db.stores
                .runs
                .get_run(own.id)
                .await
                .unwrap()
                .unwrap()
                .status,
            RunStatus::Running
        );
        // A second terminal item, alone or in a batch, is "not new" and not stored; nor is
        // anything after the terminal item.
        assert!(
            !db.stores
                .runs
                .insert_event(terminal_event(own.id, 2, "run.failed"))
                .await
                .unwrap()
        );
        assert_eq!(
            db.stores
                .runs
                .insert_events(vec![
                    run_event(own.id, 2, "late"),
                    terminal_event(own.id, 3, "run.failed"),
                ])
                .await
                .unwrap(),
            vec![false, false]
        );
        let items = db.stores.runs.events_after(own.id, 0, 10).await.unwrap();
        assert_eq!(
            items.iter().map(|e| e.sequence).collect::<Vec<_>>(),
            vec![1]
        );

        // A queued run can be finalized too (the reaper's deployment maximum).
        let queued = create_run(db, None).await;
        let timeout = RunOutcome::with_error(RunStatus::Timeout, "timeout", "too long");
        assert_eq!(
            db.stores
                .runs
                .finalize_run(
                    queued.id,
                    timeout.clone(),
                    AgentRunResult::run_failed("timeout", "too long", true)
                )
                .await
                .unwrap(),
            Finalized::Ended { sequence: 1 }
        );

        assert_code(
            db.stores
                .runs
                .finalize_run(RunId::new(), timeout.clone(), item())
                .await,
            ErrorCode::NotFound,
        );
        let delta = AgentRunResult {
            result_type: "message.delta".into(),
            ..item()
        };
        assert_code(
            db.stores.runs.finalize_run(own.id, timeout, delta).await,
            ErrorCode::InvalidArgument,
        );
    }

    /// A finalizer (the reaper) racing the run's own last items (the worker finishing at the
    /// same moment): exactly one terminal item is stored, and a terminal status always comes
    /// with it.
    /// A worker that resumes after the host ended its run (stopped past its lease, then
    /// continued) publishes items after the host's terminal item: none is stored, singly or
    /// in a batch, and items up to the terminal one still are.
    pub async fn run_items_after_the_terminal_item_are_not_stored(db: &TestDb) {
        use sb_protocol::result::AgentRunResult;
        let run = create_run(db, None).await;
        assert!(db.stores.runs.claim_run(run.id, "w1").await.unwrap());
        db.stores
            .runs
            .insert_event(run_event(run.id, 1, "a"))
            .await
            .unwrap();
        db.stores
            .runs
            .finalize_run(
                run.id,
                RunOutcome::with_error(RunStatus::Interrupted, "interrupted", "lease lost"),
                AgentRunResult::run_failed("interrupted", "lease lost", true),
            )
            .await
            .unwrap();
        // The worker's own items 2.. arrive late: 2 collides with the host's terminal item,
        // 3 and 4 come after it.
        let inserted = db
            .stores
            .runs
            .insert_events(vec![
                run_event(run.id, 2, "b"),
                run_event(run.id, 3, "c"),
                terminal_event(run.id, 4, "run.completed"),
            ])
            .await
            .unwrap();
        assert_eq!(inserted, vec![false, false, false]);
        assert!(
            !db.stores
                .runs
                .insert_event(run_event(run.id, 5, "d"))
                .await
                .unwrap()
        );
        let items = db.stores.runs.events_after(run.id, 0, 100).await.unwrap();
        let types: Vec<&str> = items.iter().map(|e| e.result_type.as_str()).collect();
        assert_eq!(types, ["message.delta", "run.failed"], "{items:?}");
        let stored = db.stores.runs.get_run(run.id).await.unwrap().unwrap();
        assert_eq!(stored.last_sequence, 2);

        // Another run in the same batch is unaffected.
        let other = create_run(db, None).await;
        let inserted = db
            .stores
            .runs
            .insert_events(vec![run_event(run.id, 6, "e"), run_event(other.id, 1, "x")])
            .await
            .unwrap();
        assert_eq!(inserted, vec![false, true]);
    }

    pub async fn run_finalize_races_the_runs_own_terminal_item(db: &TestDb) {
        use sb_protocol::result::AgentRunResult;
        for _ in 0..8 {
            let run = create_run(db, None).await;
            assert!(db.stores.runs.claim_run(run.id, "w1").await.unwrap());
            db.stores
                .runs
                .insert_event(run_event(run.id, 1, "a"))
                .await
                .unwrap();
            let stores = db.stores.clone();
            let reaper = tokio::spawn(async move {
                stores
                    .runs
                    .finalize_run(
                        run.id,
                        RunOutcome::with_error(RunStatus::Timeout, "timeout", "late"),
                        AgentRunResult::run_failed("timeout", "late", true),
                    )
                    .await
                    .unwrap()
            });
            let stores = db.stores.clone();
            let worker = tokio::spawn(async move {
                stores
                    .runs
                    .insert_events(vec![
                        run_event(run.id, 2, "b"),
                        terminal_event(run.id, 3, "run.completed"),
                    ])
                    .await
                    .unwrap()
            });
            let finalized = reaper.await.unwrap();
            let inserted = worker.await.unwrap();
            let items = db.stores.runs.events_after(run.id, 0, 100).await.unwrap();
            let terminals: Vec<_> = items
                .iter()
                .filter(|e| is_terminal_type(&e.result_type))
                .collect();
            assert_eq!(terminals.len(), 1, "{finalized:?} {inserted:?} {items:?}");
            let status = db
                .stores
                .runs
                .get_run(run.id)
                .await
                .unwrap()
                .unwrap()
                .status;
            match finalized {
                Finalized::Ended { sequence } => {
                    assert_eq!(terminals[0].sequence, i64::try_from(sequence).unwrap());
                    assert_eq!(status, RunStatus::Timeout);
                }
                Finalized::TerminalStored { sequence } => {
                    assert_eq!(sequence, 3);
                    assert_eq!(inserted, vec![true, true]);
                    assert_eq!(status, RunStatus::Running);
                }
                Finalized::AlreadyEnded(status) => panic!("unexpected end: {status}"),
            }
        }
    }

    /// The first cancel request is recorded; later ones report what they found.
    pub async fn run_request_cancel(db: &TestDb) {
        let run = create_run(db, None).await;
        assert_eq!(
            db.stores
                .runs
                .request_cancel(run.id, Some("user".into()))
                .await
                .unwrap(),
            CancelOutcome::Requested
        );
        assert_eq!(
            db.stores
                .runs
                .request_cancel(run.id, Some("again".into()))
                .await
                .unwrap(),
            CancelOutcome::AlreadyRequested
        );
        let stored = db.stores.runs.get_run(run.id).await.unwrap().unwrap();
        assert!(stored.cancel_requested_at.is_some());
        assert_eq!(stored.cancel_reason.as_deref(), Some("user"));
        assert_eq!(
            stored.status,
            RunStatus::Queued,
            "a request does not end the run"
        );

        let done = create_run(db, None).await;
        db.stores
            .runs
            .finish_run(done.id, RunOutcome::completed())
            .await
            .unwrap();
        assert_eq!(
            db.stores.runs.request_cancel(done.id, None).await.unwrap(),
            CancelOutcome::AlreadyFinished(RunStatus::Completed)
        );
        assert!(
            db.stores
                .runs
                .get_run(done.id)
                .await
                .unwrap()
                .unwrap()
                .cancel_requested_at
                .is_none()
        );
        assert_code(
            db.stores.runs.request_cancel(RunId::new(), None).await,
            ErrorCode::NotFound,
        );
    }

    /// `(run_id, sequence)` is stored once; reads are ordered and start after the cursor.
    pub async fn run_events_are_idempotent_and_ordered(db: &TestDb) {
        let run = create_run(db, None).await;
        for seq in [2, 1, 3] {
            assert!(
                db.stores
                    .runs
                    .insert_event(run_event(run.id, seq, &format!("s{seq}")))
                    .await
                    .unwrap()
            );
        }
        assert!(
            !db.stores
                .runs
                .insert_event(run_event(run.id, 2, "duplicate"))
                .await
                .unwrap()
        );
        assert_eq!(
            db.stores
                .runs
                .get_run(run.id)
                .await
                .unwrap()
                .unwrap()
                .last_sequence,
            3
        );
        // A late lower sequence does not lower last_sequence.
        assert!(
            !db.stores
                .runs
                .insert_event(run_event(run.id, 1, "dup"))
                .await
                .unwrap()
        );
        assert_eq!(
            db.stores
                .runs
                .get_run(run.id)
                .await
                .unwrap()
                .unwrap()
                .last_sequence,
            3
        );

        let all = db.stores.runs.events_after(run.id, 0, 100).await.unwrap();
        assert_eq!(
            all.iter().map(|e| e.sequence).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        assert_eq!(
            all[1].data,
            json!({"type": "message.delta", "data": {"chunk": "s2"}}),
            "first write wins"
        );
        assert_eq!(all[1].result_type, "message.delta");
        let after = db.stores.runs.events_after(run.id, 1, 1).await.unwrap();
        assert_eq!(
            after.iter().map(|e| e.sequence).collect::<Vec<_>>(),
            vec![2]
        );
        assert!(
            db.stores
                .runs
                .events_after(run.id, 3, 10)
                .await
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            db.stores
                .runs
                .events_after(run.id, 0, 0)
                .await
                .unwrap()
                .len(),
            1,
            "limit clamps to 1"
        );

        assert_code(
            db.stores
                .runs
                .insert_event(run_event(RunId::new(), 1, "x"))
                .await,
            ErrorCode::NotFound,
        );
        assert_code(
            db.stores.runs.insert_event(run_event(run.id, 0, "x")).await,
            ErrorCode::InvalidArgument,
        );
    }

    /// A batch reports per row whether it was new and bumps every run's last_sequence.
    pub async fn run_insert_events_batch_reports_new_rows(db: &TestDb) {
        let a = create_run(db, None).await;
        let b = create_run(db, None).await;
        db.stores
            .runs
            .insert_event(run_event(a.id, 1, "old"))
            .await
            .unwrap();
        let flags = db
            .stores
            .runs
            .insert_events(vec![
                run_event(a.id, 1, "dup of stored"),
                run_event(a.id, 2, "new"),
                run_event(b.id, 5, "new"),
                run_event(a.id, 2, "dup in batch"),
                run_event(b.id, 4, "new"),
            ])
            .await
            .unwrap();
        assert_eq!(flags, vec![false, true, true, false, true]);
        assert_eq!(
            db.stores
                .runs
                .get_run(a.id)
                .await
                .unwrap()
                .unwrap()
                .last_sequence,
            2
        );
        assert_eq!(
            db.stores
                .runs
                .get_run(b.id)
                .await
                .unwrap()
                .unwrap()
                .last_sequence,
            5
        );
        let b_events = db.stores.runs.events_after(b.id, 0, 10).await.unwrap();
        assert_eq!(
            b_events.iter().map(|e| e.sequence).collect::<Vec<_>>(),
            vec![4, 5]
        );
        assert!(
            db.stores
                .runs
                .insert_events(vec![])
                .await
                .unwrap()
                .is_empty()
        );
        // A large batch crosses the chunk boundary.
        let many: Vec<_> = (10..1210).map(|s| run_event(a.id, s, "bulk")).collect();
        let flags = db.stores.runs.insert_events(many).await.unwrap();
        assert_eq!(flags.len(), 1200);
        assert!(flags.iter().all(|f| *f));
        assert_eq!(
            db.stores
                .runs
                .get_run(a.id)
                .await
                .unwrap()
                .unwrap()
                .last_sequence,
            1209
        );
    }

    /// Runs are listed newest first with filters and opaque cursors.
    pub async fn run_list_filters_and_pages(db: &TestDb) {
        let mut ids = Vec::new();
        for i in 0..5 {
            let run = create_run(db, Some(if i < 3 { "c1" } else { "c2" })).await;
            ids.push(run.id);
        }
        db.stores
            .runs
            .finish_run(ids[0], RunOutcome::completed())
            .await
            .unwrap();
        let mut other = new_run(Some("c1"));
        other.workspace_id = other_ws();
        db.stores.runs.create_run(other).await.unwrap();

        let mut seen = Vec::new();
        let mut cursor = None;
        loop {
            let page = db
                .stores
                .runs
                .list_runs(RunFilter::workspace(ws()), cursor.clone(), Some(2))
                .await
                .unwrap();
            seen.extend(page.items.iter().map(|r| r.id));
            if !page.has_more {
                break;
            }
            cursor = page.next_cursor;
        }
        let mut expected = ids.clone();
        expected.reverse();
        assert_eq!(seen, expected);

        let mut filter = RunFilter::workspace(ws());
        filter.conversation_id = Some("c1".into());
        filter.statuses = vec![RunStatus::Queued];
        let page = db.stores.runs.list_runs(filter, None, None).await.unwrap();
        assert_eq!(
            page.items.iter().map(|r| r.id).collect::<Vec<_>>(),
            vec![ids[2], ids[1]]
        );
        let mut filter = RunFilter::workspace(ws());
        filter.runner_id = Some("nope".into());
        assert!(
            db.stores
                .runs
                .list_runs(filter, None, None)
                .await
                .unwrap()
                .items
                .is_empty()
        );
        assert_code(
            db.stores
                .runs
                .list_runs(RunFilter::workspace(ws()), Some("bad".into()), None)
                .await,
            ErrorCode::InvalidArgument,
        );
    }

    /// Every run [`RunLedger::runs_with_status`] returns, following `next_cursor` with pages
    /// of `limit` and calling `each` on every run before reading the next page (the caller
    /// may change the run); checks the shape of each page on the way.
    async fn runs_with_status<F, Fut>(
        db: &TestDb,
        status: RunStatus,
        limit: i64,
        mut each: F,
    ) -> Vec<RunId>
    where
        F: FnMut(RunRecord) -> Fut,
        Fut: Future<Output = ()>,
    {
        let mut seen = Vec::new();
        let mut cursor = None;
        loop {
            let page = db
                .stores
                .runs
                .runs_with_status(status, cursor, Some(limit))
                .await
                .unwrap();
            assert!(page.items.len() as i64 <= limit, "{page:?}");
            assert!(page.items.iter().all(|r| r.status == status), "{page:?}");
            for run in page.items {
                seen.push(run.id);
                each(run).await;
            }
            let Some(next) = page.next_cursor else {
                assert!(!page.has_more);
                return seen;
            };
            cursor = Some(next);
        }
    }

    /// `runs_with_status` reads one status across every workspace, oldest first, in bounded
    /// pages that neither skip nor repeat a run when the caller finishes the runs it reads.
    pub async fn run_with_status_pages_across_workspaces(db: &TestDb) {
        // Workspaces alternate; runs are left queued, running or completed in turn.
        let (mut queued, mut running, mut completed) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..9 {
            let mut new = new_run(Some("c"));
            if i % 2 == 1 {
                new.workspace_id = other_ws();
            }
            let (run, _) = db.stores.runs.create_run(new).await.unwrap();
            match i % 3 {
                0 => queued.push(run.id),
                1 => {
                    assert!(db.stores.runs.claim_run(run.id, "w").await.unwrap());
                    running.push(run.id);
                }
                _ => {
                    let done = RunOutcome::completed();
                    assert!(db.stores.runs.finish_run(run.id, done).await.unwrap());
                    completed.push(run.id);
                }
            }
        }
        let ignore = |_| async {};
        assert_eq!(
            runs_with_status(db, RunStatus::Queued, 2, ignore).await,
            queued
        );
        assert_eq!(
            runs_with_status(db, RunStatus::Completed, 100, ignore).await,
            completed
        );
        assert!(
            runs_with_status(db, RunStatus::Timeout, 10, ignore)
                .await
                .is_empty()
        );

        // Finishing every run as it is read (what the start-up recovery does) reaches each
        // running run exactly once, however the pages fall.
        let interrupt = |run: RunRecord| async move {
            let outcome = RunOutcome::with_error(RunStatus::Interrupted, "interrupted", "gone");
            assert!(db.stores.runs.finish_run(run.id, outcome).await.unwrap());
        };
        assert_eq!(
            runs_with_status(db, RunStatus::Running, 1, interrupt).await,
            running
        );
        assert!(
            runs_with_status(db, RunStatus::Running, 10, ignore)
                .await
                .is_empty()
        );
        assert_eq!(
            runs_with_status(db, RunStatus::Interrupted, 2, ignore).await,
            running
        );

        // Limits are clamped to [1, 100]; foreign or malformed cursors are invalid_argument.
        let one = db
            .stores
            .runs
            .runs_with_status(RunStatus::Queued, None, Some(0))
            .await
            .unwrap();
        assert_eq!(one.items.len(), 1);
        assert!(one.has_more);
        let event = db
            .stores
            .events
            .append(message("c", "x"), vec![])
            .await
            .unwrap()
            .0;
        for bad in [String::from("garbage"), String::new(), event.cursor] {
            assert_code(
                db.stores
                    .runs
                    .runs_with_status(RunStatus::Queued, Some(bad), None)
                    .await,
                ErrorCode::InvalidArgument,
            );
        }
    }

    /// Only active runs past their deadline are reported; conversation lookups see active runs.
    pub async fn run_deadlines_and_active_runs(db: &TestDb) {
        let now = Utc::now();
        let mk = |conv: &str, deadline: Option<TimeDelta>| {
            let mut r = new_run(Some(conv));
            r.deadline_at = deadline.map(|d| now + d);
            r
        };
        let (late_running, _) = db
            .stores
            .runs
            .create_run(mk("c1", Some(TimeDelta::seconds(-20))))
            .await
            .unwrap();
        db.stores
            .runs
            .claim_run(late_running.id, "w")
            .await
            .unwrap();
        let (late_queued, _) = db
            .stores
            .runs
            .create_run(mk("c1", Some(TimeDelta::seconds(-10))))
            .await
            .unwrap();
        let (late_done, _) = db
            .stores
            .runs
            .create_run(mk("c1", Some(TimeDelta::seconds(-30))))
            .await
            .unwrap();
        db.stores
            .runs
            .finish_run(late_done.id, RunOutcome::completed())
            .await
            .unwrap();
        db.stores
            .runs
            .create_run(mk("c1", Some(TimeDelta::seconds(60))))
            .await
            .unwrap();
        db.stores.runs.create_run(mk("c2", None)).await.unwrap();

        let late = db.stores.runs.runs_past_deadline(now, 10).await.unwrap();
        assert_eq!(
            late.iter().map(|r| r.id).collect::<Vec<_>>(),
            vec![late_running.id, late_queued.id]
        );
        assert_eq!(
            db.stores
                .runs
                .runs_past_deadline(now, 1)
                .await
                .unwrap()
                .len(),
            1
        );

        let active = db
            .stores
            .runs
            .active_runs_for_conversation(&ws(), "c1")
            .await
            .unwrap();
        assert_eq!(active.len(), 3);
        assert!(active.iter().all(|r| !r.status.is_terminal()));
        assert!(
            active
                .windows(2)
                .all(|w| w[0].created_at <= w[1].created_at)
        );
        assert!(
            db.stores
                .runs
                .active_runs_for_conversation(&other_ws(), "c1")
                .await
                .unwrap()
                .is_empty()
        );
    }

    /// Retention removes the result items of ended runs and marks them expired.
    pub async fn run_expire_events(db: &TestDb) {
        let ended = create_run(db, None).await;
        let active = create_run(db, None).await;
        for run in [ended.id, active.id] {
            db.stores
                .runs
                .insert_events(vec![run_event(run, 1, "a"), run_event(run, 2, "b")])
                .await
                .unwrap();
        }
        db.stores
            .runs
            .finish_run(ended.id, RunOutcome::completed())
            .await
            .unwrap();
        let cutoff = Utc::now() + TimeDelta::seconds(5);
        assert_eq!(
            db.stores
                .runs
                .expire_events(Utc::now() - TimeDelta::hours(1), 10)
                .await
                .unwrap(),
            0
        );
        assert_eq!(db.stores.runs.expire_events(cutoff, 10).await.unwrap(), 1);
        assert_eq!(
            db.stores.runs.expire_events(cutoff, 10).await.unwrap(),
            0,
            "already expired"
        );
        assert!(
            db.stores
                .runs
                .events_after(ended.id, 0, 10)
                .await
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            db.stores
                .runs
                .events_after(active.id, 0, 10)
                .await
                .unwrap()
                .len(),
            2
        );
        let stored = db.stores.runs.get_run(ended.id).await.unwrap().unwrap();
        assert!(stored.events_expired_at.is_some());
        assert_eq!(stored.last_sequence, 2);
    }

    // ---------------------------------------------------------------- transcript

    /// Content is cut at 4000 chars; `content_json` keeps everything.
    pub async fn transcript_append_truncates_and_roundtrips(db: &TestDb) {
        let long = "y".repeat(4001);
        let mut item = NewTranscriptItem::message(ws(), "c1", "ev-1", "assistant", long.clone());
        item.id = Some("t-1".into());
        item.thread_id = Some("th".into());
        item.bot_id = Some("bot".into());
        item.run_id = Some(RunId::new());
        item.runner_id = Some("plugin:a/b/c".into());
        item.content_json = Some(json!({"role": "assistant", "content": long}));
        item.artifact_refs = Some(json!([{"artifact_id": "a1"}]));
        item.metadata = json!({"run_id": "r"});
        let rec = db.stores.transcript.append(item.clone()).await.unwrap();
        assert_eq!(rec.id, "t-1");
        let content = rec.content.clone().unwrap();
        assert_eq!(content.chars().count(), 4000);
        assert_eq!(content, format!("{}...", "y".repeat(3997)));
        assert_eq!(rec.content_json, item.content_json);
        assert_eq!(rec.artifact_refs, item.artifact_refs);
        assert_eq!(rec.metadata, json!({"run_id": "r"}));
        assert_eq!(rec.run_id, item.run_id);
        assert_eq!(rec.thread_id.as_deref(), Some("th"));

        let exact = "z".repeat(4000);
        let rec2 = db
            .stores
            .transcript
            .append(NewTranscriptItem::message(
                ws(),
                "c1",
                "ev-2",
                "user",
                exact.clone(),
            ))
            .await
            .unwrap();
        assert_eq!(rec2.content.as_deref(), Some(exact.as_str()));
        assert_eq!(rec2.metadata, json!({}));
        assert!(rec2.seq > rec.seq);
        assert_code(db.stores.transcript.append(item).await, ErrorCode::Conflict);
        let empty_conv = NewTranscriptItem::message(ws(), "", "e", "user", "x");
        assert_code(
            db.stores.transcript.append(empty_conv).await,
            ErrorCode::InvalidArgument,
        );
    }

    /// Backward / forward paging, ranges, thread filter, latest cursor, bad cursors.
    pub async fn transcript_pages_in_both_directions(db: &TestDb) {
        let mut seqs = Vec::new();
        for i in 0..5 {
            let mut item =
                NewTranscriptItem::message(ws(), "c1", format!("e{i}"), "user", format!("m{i}"));
            item.thread_id = (i == 4).then(|| "t".to_owned());
            seqs.push(db.stores.transcript.append(item).await.unwrap());
        }
        db.stores
            .transcript
            .append(NewTranscriptItem::message(ws(), "c2", "x", "user", "other"))
            .await
            .unwrap();
        let seq =
            |page: &Page<TranscriptRecord>| page.items.iter().map(|r| r.seq).collect::<Vec<_>>();

        let mut q = TranscriptQuery::new(ws(), "c1");
        q.limit = Some(2);
        let p1 = db.stores.transcript.page(q.clone()).await.unwrap();
        assert_eq!(seq(&p1), vec![seqs[4].seq, seqs[3].seq]);
        assert!(p1.has_more);
        q.before_cursor = p1.next_cursor.clone();
        let p2 = db.stores.transcript.page(q.clone()).await.unwrap();
        assert_eq!(seq(&p2), vec![seqs[2].seq, seqs[1].seq]);
        q.before_cursor = p2.next_cursor.clone();
        let p3 = db.stores.transcript.page(q.clone()).await.unwrap();
        assert_eq!(seq(&p3), vec![seqs[0].seq]);
        assert!(!p3.has_more && p3.next_cursor.is_none());

        // Forward: from the start without a cursor, after a cursor with one.
        let mut f = TranscriptQuery::new(ws(), "c1");
        f.direction = Direction::Forward;
        f.limit = Some(2);
        let fp = db.stores.transcript.page(f.clone()).await.unwrap();
        assert_eq!(seq(&fp), vec![seqs[0].seq, seqs[1].seq]);
        f.after_cursor = fp.next_cursor.clone();
        f.limit = None;
        let fp2 = db.stores.transcript.page(f.clone()).await.unwrap();
        assert_eq!(seq(&fp2), vec![seqs[2].seq, seqs[3].seq, seqs[4].seq]);
        assert!(!fp2.has_more);
        // Both cursors bound a range.
        f.after_cursor = Some(seqs[0].cursor.clone());
        f.before_cursor = Some(seqs[3].cursor.clone());
        assert_eq!(
            seq(&db.stores.transcript.page(f).await.unwrap()),
            vec![seqs[1].seq, seqs[2].seq]
        );

        // Strict thread.
        let mut t = TranscriptQuery::new(ws(), "c1");
        t.thread = ThreadFilter::Exactly(None);
        assert_eq!(
            db.stores
                .transcript
                .page(t.clone())
                .await
                .unwrap()
                .items
                .len(),
            4
        );
        t.thread = ThreadFilter::Exactly(Some("t".into()));
        assert_eq!(
            seq(&db.stores.transcript.page(t).await.unwrap()),
            vec![seqs[4].seq]
        );

        // Limit clamp, latest cursor, other workspace.
        let mut l = TranscriptQuery::new(ws(), "c1");
        l.limit = Some(0);
        assert_eq!(db.stores.transcript.page(l).await.unwrap().items.len(), 1);
        assert_eq!(
            db.stores
                .transcript
                .latest_cursor(&ws(), "c1")
                .await
                .unwrap(),
            Some(seqs[4].cursor.clone())
        );
        assert_eq!(
            db.stores
                .transcript
                .latest_cursor(&ws(), "none")
                .await
                .unwrap(),
            None
        );
        assert!(
            db.stores
                .transcript
                .page(TranscriptQuery::new(other_ws(), "c1"))
                .await
                .unwrap()
                .items
                .is_empty()
        );

        // Bad and foreign cursors.
        let (event, _) = db
            .stores
            .events
            .append(message("c1", "x"), vec![])
            .await
            .unwrap();
        for bad in ["nope".to_owned(), "1".to_owned(), event.cursor] {
            let mut b = TranscriptQuery::new(ws(), "c1");
            b.before_cursor = Some(bad);
            assert_code(
                db.stores.transcript.page(b).await,
                ErrorCode::InvalidArgument,
            );
        }
    }

    async fn seed_search(db: &TestDb) -> Vec<TranscriptRecord> {
        let texts = [
            ("user", "The quick brown fox jumps over the lazy dog"),
            ("assistant", "Quick answer: quick thinking wins, quick!"),
            ("user", "a lazy afternoon with a brown cat"),
            ("assistant", "nothing relevant here"),
        ];
        let mut out = Vec::new();
        for (role, text) in texts {
            out.push(
                db.stores
                    .transcript
                    .append(NewTranscriptItem::message(ws(), "c1", "e", role, text))
                    .await
                    .unwrap(),
            );
        }
        db.stores
            .transcript
            .append(NewTranscriptItem::message(
                ws(),
                "c2",
                "e",
                "user",
                "quick fox elsewhere",
            ))
            .await
            .unwrap();
        out
    }

    async fn search(db: &TestDb, query: &str) -> Vec<String> {
        db.stores
            .transcript
            .search(TranscriptSearch::new(ws(), "c1", query))
            .await
            .unwrap_or_else(|e| panic!("search {query:?} failed: {e}"))
            .into_iter()
            .map(|r| r.id)
            .collect()
    }

    /// Whole words, case-insensitive, best match first, phrases, OR, exclusion, filters.
    pub async fn transcript_search_matches_and_ranks(db: &TestDb) {
        let items = seed_search(db).await;
        let id = |i: usize| items[i].id.clone();
        assert_eq!(
            search(db, "quick").await,
            vec![id(1), id(0)],
            "more matches rank first"
        );
        assert_eq!(search(db, "QUICK").await, vec![id(1), id(0)]);
        assert_eq!(search(db, "brown lazy").await.len(), 2);
        let phrase = search(db, "\"brown fox\"").await;
        assert_eq!(phrase, vec![id(0)]);
        let mut either = search(db, "cat or fox").await;
        either.sort();
        let mut expected = vec![id(0), id(2)];
        expected.sort();
        assert_eq!(either, expected);
        assert_eq!(search(db, "lazy -cat").await, vec![id(0)]);
        assert!(search(db, "qui").await.is_empty(), "whole words only");
        assert!(
            search(db, "elsewhere").await.is_empty(),
            "other conversations are not searched"
        );

        let mut s = TranscriptSearch::new(ws(), "c1", "quick");
        s.roles = vec!["user".into()];
        let hits = db.stores.transcript.search(s).await.unwrap();
        assert_eq!(
            hits.iter().map(|r| r.id.clone()).collect::<Vec<_>>(),
            vec![id(0)]
        );
        let mut s = TranscriptSearch::new(ws(), "c1", "quick");
        s.top_k = Some(1);
        assert_eq!(db.stores.transcript.search(s).await.unwrap().len(), 1);
        let mut s = TranscriptSearch::new(ws(), "c1", "quick");
        s.item_types = vec!["tool_call".into()];
        assert!(db.stores.transcript.search(s).await.unwrap().is_empty());
        let mut s = TranscriptSearch::new(other_ws(), "c1", "quick");
        s.top_k = Some(1000);
        assert!(db.stores.transcript.search(s).await.unwrap().is_empty());
    }

    /// No user text produces a SQL or FTS syntax error.
    pub async fn transcript_search_survives_hostile_queries(db: &TestDb) {
        let items = seed_search(db).await;
        for query in [
            "\"",
            "\"\"",
            "*",
            "quick*",
            "OR",
            "AND",
            "NOT",
            "NEAR",
            "NEAR(quick fox)",
            "(",
            ")",
            "()",
            "'",
            "';",
            "'; drop table transcript; --",
            "' OR 1=1 --",
            "-",
            "--",
            "- -",
            "\\",
            "%",
            "_",
            "^quick",
            "content:quick",
            "{quick}",
            "[quick]",
            "quick AND",
            "quick OR",
            "OR quick",
            "-quick",
            "\"unterminated quick",
            "quick\"",
            "a\"b\"c",
            "!@#$%^&*()",
            "\u{0}",
            "💥",
            "日本語",
            "   ",
            "",
        ] {
            search(db, query).await;
        }
        // Still works afterwards, and still contains what it contained.
        assert_eq!(
            search(db, "quick").await,
            vec![items[1].id.clone(), items[0].id.clone()]
        );
        assert_eq!(
            search(db, "'; drop table transcript; --").await,
            Vec::<String>::new()
        );
    }

    /// Retention deletes items and search forgets them.
    pub async fn transcript_delete_older_than_updates_search(db: &TestDb) {
        seed_search(db).await;
        assert_eq!(search(db, "quick").await.len(), 2);
        let cutoff = Utc::now() + TimeDelta::seconds(5);
        assert_eq!(
            db.stores
                .transcript
                .delete_older_than(cutoff, 3)
                .await
                .unwrap(),
            3
        );
        assert_eq!(
            db.stores
                .transcript
                .delete_older_than(cutoff, 10)
                .await
                .unwrap(),
            2
        );
        assert!(search(db, "quick").await.is_empty());
        // New items after deletion are searchable (the index stayed consistent).
        db.stores
            .transcript
            .append(NewTranscriptItem::message(
                ws(),
                "c1",
                "e",
                "user",
                "quick again",
            ))
            .await
            .unwrap();
        assert_eq!(search(db, "quick").await.len(), 1);
    }

    // ---------------------------------------------------------------- artifacts

    fn inline(bytes: &[u8]) -> NewArtifact {
        let mut a = NewArtifact::inline(
            ws(),
            "file",
            "runner",
            ArtifactScope::Conversation,
            bytes.to_vec(),
        );
        a.conversation_id = Some("c1".into());
        a.mime_type = Some("text/plain".into());
        a.name = Some("a.txt".into());
        a
    }

    /// Declared sha256/size are verified; absent ones are computed.
    pub async fn artifact_put_verifies_sha_and_size(db: &TestDb) {
        let bytes = b"hello artifact";
        let sha = hex::encode(Sha256::digest(bytes));
        let rec = db.stores.artifacts.put(inline(bytes)).await.unwrap();
        assert_eq!(rec.sha256.as_deref(), Some(sha.as_str()));
        assert_eq!(rec.size_bytes, Some(bytes.len() as i64));
        assert_eq!(rec.storage_type, "inline");
        assert_eq!(rec.scope, ArtifactScope::Conversation);
        assert_eq!(db.stores.artifacts.metadata(&rec.id).await.unwrap(), rec);

        let mut ok = inline(bytes);
        ok.declared_sha256 = Some(sha.to_uppercase());
        ok.declared_size = Some(bytes.len() as i64);
        ok.id = Some("declared-ok".into());
        assert_eq!(
            db.stores.artifacts.put(ok).await.unwrap().sha256.as_deref(),
            Some(sha.as_str())
        );

        let mut wrong_sha = inline(bytes);
        wrong_sha.id = Some("wrong-sha".into());
        wrong_sha.declared_sha256 = Some(hex::encode(Sha256::digest(b"other")));
        assert_code(
            db.stores.artifacts.put(wrong_sha).await,
            ErrorCode::InvalidArgument,
        );
        assert_code(
            db.stores.artifacts.metadata("wrong-sha").await,
            ErrorCode::NotFound,
        );

        let mut wrong_size = inline(bytes);
        wrong_size.id = Some("wrong-size".into());
        wrong_size.declared_size = Some(3);
        assert_code(
            db.stores.artifacts.put(wrong_size).await,
            ErrorCode::InvalidArgument,
        );
        assert_code(
            db.stores.artifacts.metadata("wrong-size").await,
            ErrorCode::NotFound,
        );

        let mut malformed = inline(bytes);
        malformed.declared_sha256 = Some("xyz".into());
        assert_code(
            db.stores.artifacts.put(malformed).await,
            ErrorCode::InvalidArgument,
        );

        let mut dup = inline(bytes);
        dup.id = Some("declared-ok".into());
        assert_code(db.stores.artifacts.put(dup).await, ErrorCode::Conflict);

        let too_big = inline(&vec![0u8; super::SUITE_MAX_ARTIFACT_BYTES + 1]);
        assert_code(
            db.stores.artifacts.put(too_big).await,
            ErrorCode::PayloadTooLarge,
        );
        assert_code(
            db.stores.artifacts.metadata("missing").await,
            ErrorCode::NotFound,
        );
    }

    /// Ranged reads with default and capped limits, `has_more`, and argument checks.
    pub async fn artifact_range_reads_and_cap(db: &TestDb) {
        let bytes: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
        let rec = db.stores.artifacts.put(inline(&bytes)).await.unwrap();
        let read = |offset: i64, limit: Option<i64>| {
            let stores = db.stores.clone();
            let id = rec.id.clone();
            async move { stores.artifacts.read(&id, offset, limit).await }
        };
        let all = read(0, None).await.unwrap();
        assert_eq!(all.content.as_deref(), Some(bytes.as_slice()));
        assert!(!all.has_more);
        assert_eq!(all.artifact.id, rec.id);
        let head = read(0, Some(1000)).await.unwrap();
        assert_eq!(head.content.as_deref(), Some(&bytes[..1000]));
        assert!(head.has_more);
        let mid = read(1000, Some(1000)).await.unwrap();
        assert_eq!(mid.content.as_deref(), Some(&bytes[1000..2000]));
        assert_eq!(mid.offset, 1000);
        assert!(mid.has_more);
        let tail = read(2500, Some(1000)).await.unwrap();
        assert_eq!(tail.content.as_deref(), Some(&bytes[2500..]));
        assert!(!tail.has_more);
        let exact_end = read(2000, Some(1000)).await.unwrap();
        assert_eq!(exact_end.content.as_deref(), Some(&bytes[2000..]));
        assert!(!exact_end.has_more);
        for past in [3000, 5000, i64::MAX] {
            let r = read(past, None).await.unwrap();
            assert_eq!(r.content.as_deref(), Some(&[][..]));
            assert!(!r.has_more);
        }
        assert_code(read(-1, None).await, ErrorCode::InvalidArgument);
        assert_code(read(0, Some(0)).await, ErrorCode::InvalidArgument);
        assert_code(read(0, Some(-3)).await, ErrorCode::InvalidArgument);
        assert_code(
            db.stores.artifacts.read("missing", 0, None).await,
            ErrorCode::NotFound,
        );

        // Default 1 MiB and the 10 MiB cap.
        let big: Vec<u8> = (0..11 * 1024 * 1024u32).map(|i| (i % 253) as u8).collect();
        let big_rec = db.stores.artifacts.put(inline(&big)).await.unwrap();
        let default = db
            .stores
            .artifacts
            .read(&big_rec.id, 0, None)
            .await
            .unwrap();
        assert_eq!(default.content.as_ref().map(Vec::len), Some(1024 * 1024));
        assert!(default.has_more);
        let capped = db
            .stores
            .artifacts
            .read(&big_rec.id, 5, Some(100 * 1024 * 1024))
            .await
            .unwrap();
        let capped_bytes = capped.content.unwrap();
        assert_eq!(capped_bytes.len(), 10 * 1024 * 1024);
        assert_eq!(capped_bytes[..], big[5..5 + 10 * 1024 * 1024]);
        assert!(capped.has_more);
    }

    /// Expired artifacts are missing everywhere; cleanup deletes only expired ones; external
    /// content reads return the reference.
    pub async fn artifact_expiry_and_external_content(db: &TestDb) {
        let mut expired = inline(b"old");
        expired.id = Some("expired".into());
        expired.expires_at = Some(Utc::now() - TimeDelta::seconds(1));
        db.stores.artifacts.put(expired).await.unwrap();
        let mut live = inline(b"new");
        live.id = Some("live".into());
        live.expires_at = Some(Utc::now() + TimeDelta::hours(1));
        let live_rec = db.stores.artifacts.put(live).await.unwrap();
        assert!(live_rec.expires_at.is_some());

        assert_code(
            db.stores.artifacts.metadata("expired").await,
            ErrorCode::NotFound,
        );
        assert_code(
            db.stores.artifacts.read("expired", 0, None).await,
            ErrorCode::NotFound,
        );
        assert_eq!(
            db.stores
                .artifacts
                .delete_expired(Utc::now(), 10)
                .await
                .unwrap(),
            1
        );
        assert_eq!(
            db.stores
                .artifacts
                .delete_expired(Utc::now(), 10)
                .await
                .unwrap(),
            0
        );
        assert!(db.stores.artifacts.metadata("live").await.is_ok());
        // The live one expires later.
        assert_eq!(
            db.stores
                .artifacts
                .delete_expired(Utc::now() + TimeDelta::hours(2), 10)
                .await
                .unwrap(),
            1
        );

        let mut url = inline(b"");
        url.content = ArtifactContent::Url("https://example.com/x.png".into());
        url.declared_size = Some(1234);
        let url_rec = db.stores.artifacts.put(url).await.unwrap();
        assert_eq!(url_rec.storage_type, "url");
        assert_eq!(url_rec.size_bytes, Some(1234));
        assert_eq!(url_rec.sha256, None);
        let read = db
            .stores
            .artifacts
            .read(&url_rec.id, 0, None)
            .await
            .unwrap();
        assert_eq!(read.content, None);
        assert_eq!(read.file_key.as_deref(), Some("https://example.com/x.png"));
        assert!(!read.has_more);
        let mut meta_only = inline(b"");
        meta_only.content = ArtifactContent::MetadataOnly;
        let rec = db.stores.artifacts.put(meta_only).await.unwrap();
        let read = db.stores.artifacts.read(&rec.id, 0, None).await.unwrap();
        assert_eq!((read.content, read.file_key), (None, None));
    }

    // ---------------------------------------------------------------- state

    fn write(key: &str, value: Value, if_revision: Option<i64>) -> StateWrite {
        StateWrite {
            scope_key: "conversation:v2:abc".into(),
            scope: "conversation".into(),
            key: key.into(),
            value,
            if_revision,
        }
    }

    /// Revisions count writes; compare-and-set conflicts change nothing.
    pub async fn state_revisions_and_cas(db: &TestDb) {
        let sk = "conversation:v2:abc";
        assert!(db.stores.state.get(sk, "k").await.unwrap().is_none());
        assert_eq!(
            db.stores
                .state
                .set(write("k", json!(1), None))
                .await
                .unwrap(),
            1
        );
        assert_eq!(
            db.stores
                .state
                .set(write("k", json!({"a": [1, 2]}), None))
                .await
                .unwrap(),
            2
        );
        let entry = db.stores.state.get(sk, "k").await.unwrap().unwrap();
        assert_eq!(entry.value, json!({"a": [1, 2]}));
        assert_eq!(entry.revision, 2);

        assert_eq!(
            db.stores
                .state
                .set(write("k", json!("cas"), Some(2)))
                .await
                .unwrap(),
            3
        );
        assert_code(
            db.stores
                .state
                .set(write("k", json!("stale"), Some(2)))
                .await,
            ErrorCode::Conflict,
        );
        assert_code(
            db.stores
                .state
                .set(write("k", json!("exists"), Some(0)))
                .await,
            ErrorCode::Conflict,
        );
        let entry = db.stores.state.get(sk, "k").await.unwrap().unwrap();
        assert_eq!((entry.value, entry.revision), (json!("cas"), 3));

        assert_eq!(
            db.stores
                .state
                .set(write("fresh", json!(null), Some(0)))
                .await
                .unwrap(),
            1
        );
        assert_eq!(
            db.stores
                .state
                .get(sk, "fresh")
                .await
                .unwrap()
                .unwrap()
                .value,
            json!(null)
        );
        assert_code(
            db.stores
                .state
                .set(write("missing", json!(1), Some(5)))
                .await,
            ErrorCode::Conflict,
        );
        assert!(db.stores.state.get(sk, "missing").await.unwrap().is_none());
        assert_code(
            db.stores.state.set(write("k", json!(1), Some(-1))).await,
            ErrorCode::InvalidArgument,
        );
        assert_code(
            db.stores
                .state
                .set(write(&"k".repeat(256), json!(1), None))
                .await,
            ErrorCode::InvalidArgument,
        );
        assert_code(
            db.stores.state.set(write("", json!(1), None)).await,
            ErrorCode::InvalidArgument,
        );
        // Scope keys isolate.
        assert!(
            db.stores
                .state
                .get("actor:v2:zzz", "k")
                .await
                .unwrap()
                .is_none()
        );

        let snapshot = db.stores.state.snapshot(sk).await.unwrap();
        assert_eq!(snapshot.len(), 2);
        assert_eq!(snapshot["k"], json!("cas"));
        // Several scopes in one read: the same values, and an empty map for an empty scope.
        let both = db
            .stores
            .state
            .snapshots(&[sk.to_owned(), "actor:v2:zzz".to_owned()])
            .await
            .unwrap();
        assert_eq!(both.len(), 2);
        assert_eq!(both[sk], snapshot);
        assert!(both["actor:v2:zzz"].is_empty());
        assert!(db.stores.state.snapshots(&[]).await.unwrap().is_empty());
        assert!(
            db.stores
                .state
                .snapshot("actor:v2:zzz")
                .await
                .unwrap()
                .is_empty()
        );
    }

    /// The 256 KiB limit is on compact UTF-8 JSON with non-ASCII unescaped.
    pub async fn state_value_limit_measures_unescaped_utf8(db: &TestDb) {
        let limit = crate::state::DEFAULT_MAX_STATE_VALUE_BYTES;
        // "é" is 2 UTF-8 bytes (6 if it were escaped as \u00e9): quotes + 2n = limit.
        let fits = Value::String("é".repeat((limit - 2) / 2));
        assert_eq!(serde_json::to_vec(&fits).unwrap().len(), limit);
        assert_eq!(
            db.stores
                .state
                .set(write("big", fits.clone(), None))
                .await
                .unwrap(),
            1
        );
        assert_eq!(
            db.stores
                .state
                .get("conversation:v2:abc", "big")
                .await
                .unwrap()
                .unwrap()
                .value,
            fits
        );
        let over = Value::String("x".repeat(limit - 1));
        let err = db
            .stores
            .state
            .set(write("big", over, None))
            .await
            .unwrap_err();
        assert_eq!(err.code(), ErrorCode::PayloadTooLarge);
        assert_eq!(
            err.to_string(),
            format!("value size {} bytes exceeds limit {limit} bytes", limit + 1)
        );
        assert_eq!(
            db.stores
                .state
                .get("conversation:v2:abc", "big")
                .await
                .unwrap()
                .unwrap()
                .revision,
            1
        );
    }

    /// Deletes: plain, missing, and compare-and-set.
    pub async fn state_delete_with_and_without_revision(db: &TestDb) {
        let sk = "conversation:v2:abc";
        assert!(!db.stores.state.delete(sk, "k", None).await.unwrap());
        db.stores
            .state
            .set(write("k", json!(1), None))
            .await
            .unwrap();
        db.stores
            .state
            .set(write("k", json!(2), None))
            .await
            .unwrap();
        assert_code(
            db.stores.state.delete(sk, "k", Some(1)).await,
            ErrorCode::Conflict,
        );
        assert!(db.stores.state.get(sk, "k").await.unwrap().is_some());
        assert!(db.stores.state.delete(sk, "k", Some(2)).await.unwrap());
        assert!(db.stores.state.get(sk, "k").await.unwrap().is_none());
        assert_code(
            db.stores.state.delete(sk, "k", Some(2)).await,
            ErrorCode::Conflict,
        );
        db.stores
            .state
            .set(write("j", json!(1), None))
            .await
            .unwrap();
        assert!(db.stores.state.delete(sk, "j", None).await.unwrap());
        // A deleted key starts over at revision 1.
        assert_eq!(
            db.stores
                .state
                .set(write("j", json!(1), Some(0)))
                .await
                .unwrap(),
            1
        );
    }

    /// Prefixes match literally and case-sensitively; keys come in bytewise order, paged.
    pub async fn state_list_prefix_is_literal_and_paged(db: &TestDb) {
        let sk = "conversation:v2:abc";
        for key in ["a.2", "a.1", "a_b", "a%c", "b.1", "A.1", "a.10", "é.1"] {
            db.stores
                .state
                .set(write(key, json!(key), None))
                .await
                .unwrap();
        }
        let list = |prefix: Option<&'static str>, cursor: Option<String>, limit: Option<i64>| {
            let stores = db.stores.clone();
            async move {
                stores
                    .state
                    .list(sk, prefix, cursor.as_deref(), limit)
                    .await
            }
        };
        let all = list(None, None, None).await.unwrap();
        assert_eq!(
            all.items,
            vec!["A.1", "a%c", "a.1", "a.10", "a.2", "a_b", "b.1", "é.1"]
        );
        assert!(!all.has_more);
        assert_eq!(
            list(Some("a."), None, None).await.unwrap().items,
            vec!["a.1", "a.10", "a.2"]
        );
        assert_eq!(
            list(Some("a%"), None, None).await.unwrap().items,
            vec!["a%c"]
        );
        assert_eq!(
            list(Some("a_"), None, None).await.unwrap().items,
            vec!["a_b"]
        );
        assert_eq!(
            list(Some("é"), None, None).await.unwrap().items,
            vec!["é.1"]
        );
        assert!(
            list(Some("zzz"), None, None)
                .await
                .unwrap()
                .items
                .is_empty()
        );

        let p1 = list(Some("a"), None, Some(2)).await.unwrap();
        assert_eq!(p1.items, vec!["a%c", "a.1"]);
        assert!(p1.has_more);
        let p2 = list(Some("a"), p1.next_cursor.clone(), Some(2))
            .await
            .unwrap();
        assert_eq!(p2.items, vec!["a.10", "a.2"]);
        let p3 = list(Some("a"), p2.next_cursor.clone(), Some(2))
            .await
            .unwrap();
        assert_eq!(p3.items, vec!["a_b"]);
        assert!(!p3.has_more);
        assert_eq!(list(None, None, Some(0)).await.unwrap().items.len(), 1);
        assert_eq!(list(None, None, Some(10_000)).await.unwrap().items.len(), 8);
        assert_code(
            list(None, Some("bad".into()), None).await,
            ErrorCode::InvalidArgument,
        );
        assert!(
            db.stores
                .state
                .list("actor:v2:zzz", None, None, None)
                .await
                .unwrap()
                .items
                .is_empty()
        );
    }

    /// Concurrent unconditional first writes all succeed and each counts one revision.
    pub async fn state_concurrent_unconditional_writes_all_succeed(db: &TestDb) {
        let mut tasks = Vec::new();
        for i in 0..10 {
            let stores = db.stores.clone();
            tasks.push(tokio::spawn(async move {
                stores
                    .state
                    .set(write("hot", json!(i), None))
                    .await
                    .unwrap()
            }));
        }
        let mut revisions = Vec::new();
        for task in tasks {
            revisions.push(task.await.unwrap());
        }
        revisions.sort_unstable();
        assert_eq!(revisions, (1..=10).collect::<Vec<_>>());
        let entry = db
            .stores
            .state
            .get("conversation:v2:abc", "hot")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(entry.revision, 10);
    }

    // ---------------------------------------------------------------- storage

    /// Get/set/overwrite/delete/keys, owner isolation, and the size cap.
    pub async fn storage_roundtrip_isolation_and_cap(db: &TestDb) {
        let s = &db.stores.storage;
        assert!(s.get("plugin", "acme/echo", "k").await.unwrap().is_none());
        s.set("plugin", "acme/echo", "k", b"v1".to_vec())
            .await
            .unwrap();
        s.set("plugin", "acme/echo", "k", b"v2".to_vec())
            .await
            .unwrap();
        s.set("plugin", "acme/echo", "a", vec![0, 255, 1])
            .await
            .unwrap();
        s.set("workspace", "acme/echo", "k", b"ws".to_vec())
            .await
            .unwrap();
        s.set("plugin", "other/plugin", "z", b"o".to_vec())
            .await
            .unwrap();
        assert_eq!(
            s.get("plugin", "acme/echo", "k").await.unwrap().as_deref(),
            Some(&b"v2"[..])
        );
        assert_eq!(
            s.get("plugin", "acme/echo", "a").await.unwrap(),
            Some(vec![0, 255, 1])
        );
        assert_eq!(
            s.get("workspace", "acme/echo", "k")
                .await
                .unwrap()
                .as_deref(),
            Some(&b"ws"[..])
        );
        assert_eq!(s.keys("plugin", "acme/echo").await.unwrap(), vec!["a", "k"]);
        assert_eq!(s.keys("plugin", "other/plugin").await.unwrap(), vec!["z"]);
        assert!(s.delete("plugin", "acme/echo", "k").await.unwrap());
        assert!(!s.delete("plugin", "acme/echo", "k").await.unwrap());
        assert_eq!(s.keys("plugin", "acme/echo").await.unwrap(), vec!["a"]);
        assert_eq!(
            s.get("workspace", "acme/echo", "k")
                .await
                .unwrap()
                .as_deref(),
            Some(&b"ws"[..])
        );

        let max = SUITE_MAX_STORAGE_VALUE_BYTES;
        s.set("plugin", "acme/echo", "max", vec![7; max])
            .await
            .unwrap();
        assert_eq!(
            s.get("plugin", "acme/echo", "max")
                .await
                .unwrap()
                .map(|v| v.len()),
            Some(max)
        );
        assert_code(
            s.set("plugin", "acme/echo", "over", vec![7; max + 1]).await,
            ErrorCode::PayloadTooLarge,
        );
        assert!(
            s.get("plugin", "acme/echo", "over")
                .await
                .unwrap()
                .is_none()
        );
        assert_code(
            s.set("plugin", "acme/echo", "", vec![]).await,
            ErrorCode::InvalidArgument,
        );
    }

    // ---------------------------------------------------------------- agents, runners, keys

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

    // ---------------------------------------------------------------- schedules

    fn new_schedule(workspace_id: WorkspaceId, kind: ScheduleKind, spec: &str) -> NewSchedule {
        NewSchedule {
            workspace_id,
            name: Some("tick".into()),
            kind,
            spec: spec.into(),
            event: json!({"request": {}}),
            enabled: true,
        }
    }

    /// The firing of `schedule` due now, as the scheduler builds it.
    fn firing(schedule: &ScheduleRecord, next: Option<chrono::DateTime<Utc>>) -> ScheduleFiring {
        let fire_at = schedule.next_fire_at.expect("a due schedule");
        let mut event = message("c-sched", "tick");
        event.workspace_id = schedule.workspace_id.clone();
        event.idempotency_key = Some(crate::schedules::firing_key(schedule.id, fire_at));
        ScheduleFiring {
            schedule_id: schedule.id,
            fire_at,
            next_fire_at: next,
            event,
            outbox: vec![outbox_msg("sched")],
        }
    }

    /// Create computes the first fire time; get, list and delete see one workspace only;
    /// lists page in creation order; bad specs and cursors are `invalid_argument`.
    pub async fn schedule_crud_is_workspace_scoped_and_paged(db: &TestDb) {
        let store = &db.stores.schedules;
        let before = Utc::now();
        let first = store
            .create(new_schedule(ws(), ScheduleKind::Interval, "15m"))
            .await
            .unwrap();
        let next = first.next_fire_at.unwrap();
        assert!(next >= before + TimeDelta::minutes(15));
        assert!(next <= Utc::now() + TimeDelta::minutes(15));
        assert_eq!(first.kind, ScheduleKind::Interval);
        assert_eq!(first.name.as_deref(), Some("tick"));
        assert!(first.enabled);
        assert_eq!(first.last_fired_at, None);
        let second = store
            .create(new_schedule(ws(), ScheduleKind::Cron, "*/5 * * * *"))
            .await
            .unwrap();
        let third = store
            .create(new_schedule(
                ws(),
                ScheduleKind::Once,
                "2030-01-01T00:00:00Z",
            ))
            .await
            .unwrap();
        let foreign = store
            .create(new_schedule(other_ws(), ScheduleKind::Interval, "1h"))
            .await
            .unwrap();

        assert_eq!(
            store.get(&ws(), first.id).await.unwrap(),
            Some(first.clone())
        );
        assert_eq!(store.get(&ws(), foreign.id).await.unwrap(), None);

        let page = store.list(&ws(), None, Some(2)).await.unwrap();
        assert_eq!(
            page.items.iter().map(|s| s.id).collect::<Vec<_>>(),
            vec![first.id, second.id]
        );
        assert!(page.has_more);
        let rest = store.list(&ws(), page.next_cursor, Some(2)).await.unwrap();
        assert_eq!(
            rest.items.iter().map(|s| s.id).collect::<Vec<_>>(),
            vec![third.id]
        );
        assert!(!rest.has_more);
        assert_code(
            store.list(&ws(), Some("nope".into()), None).await,
            ErrorCode::InvalidArgument,
        );

        for (kind, spec) in [
            (ScheduleKind::Interval, "often"),
            (ScheduleKind::Cron, "* * *"),
            (ScheduleKind::Once, "later"),
        ] {
            assert_code(
                store.create(new_schedule(ws(), kind, spec)).await,
                ErrorCode::InvalidArgument,
            );
        }

        assert!(!store.delete(&ws(), foreign.id).await.unwrap());
        assert!(store.delete(&ws(), first.id).await.unwrap());
        assert!(!store.delete(&ws(), first.id).await.unwrap());
        assert_eq!(store.get(&ws(), first.id).await.unwrap(), None);
        assert!(store.get(&other_ws(), foreign.id).await.unwrap().is_some());
    }

    /// A due schedule fires once per fire time: the compare-and-set advances it and the
    /// event with its outbox row is written with it; firing the same time again writes
    /// nothing.
    pub async fn schedule_fire_advances_and_ingests_once(db: &TestDb) {
        let store = &db.stores.schedules;
        let created = store
            .create(new_schedule(ws(), ScheduleKind::Interval, "1s"))
            .await
            .unwrap();
        let fire_at = created.next_fire_at.unwrap();
        assert!(store.due(Utc::now(), 10).await.unwrap().is_empty());
        let due = store.due(fire_at, 10).await.unwrap();
        assert_eq!(
            due.iter().map(|s| s.id).collect::<Vec<_>>(),
            vec![created.id]
        );

        let next = fire_at + TimeDelta::seconds(1);
        let (event, was_created) = store
            .fire(firing(&due[0], Some(next)))
            .await
            .unwrap()
            .expect("the first firing wins");
        assert!(was_created);
        assert_eq!(
            event.idempotency_key,
            Some(crate::schedules::firing_key(created.id, fire_at))
        );
        assert_eq!(db.stores.events.get(event.id).await.unwrap(), Some(event));
        assert_eq!(drain_outbox(db).await.len(), 1);

        let after = store.get(&ws(), created.id).await.unwrap().unwrap();
        assert_eq!(after.next_fire_at, Some(next));
        assert_eq!(after.last_fired_at, Some(fire_at));
        assert!(after.enabled);
        assert!(store.due(fire_at, 10).await.unwrap().is_empty());

        // The same firing again (a scheduler with a stale read): nothing is written.
        assert_eq!(store.fire(firing(&due[0], Some(next))).await.unwrap(), None);
        assert!(drain_outbox(db).await.is_empty());
        let events = db.stores.events.page(EventQuery::new(ws())).await.unwrap();
        assert_eq!(events.items.len(), 1);

        // A deleted schedule does not fire.
        store.delete(&ws(), created.id).await.unwrap();
        assert_eq!(store.fire(firing(&after, None)).await.unwrap(), None);
    }

    /// A firing without a next time disables the schedule: it is never due again.
    pub async fn schedule_once_fires_then_is_disabled(db: &TestDb) {
        let store = &db.stores.schedules;
        let created = store
            .create(new_schedule(
                ws(),
                ScheduleKind::Once,
                "2020-01-01T00:00:00Z",
            ))
            .await
            .unwrap();
        let due = store.due(Utc::now(), 10).await.unwrap();
        assert_eq!(due.len(), 1, "a past one-shot is due at once");
        assert!(store.fire(firing(&due[0], None)).await.unwrap().is_some());
        let after = store.get(&ws(), created.id).await.unwrap().unwrap();
        assert!(!after.enabled);
        assert_eq!(after.next_fire_at, None);
        assert!(after.last_fired_at.is_some());
        assert!(
            store
                .due(Utc::now() + TimeDelta::days(3650), 10)
                .await
                .unwrap()
                .is_empty()
        );
    }

    /// Schedulers racing on the same firing: exactly one wins, one event is written.
    pub async fn schedule_concurrent_fires_have_one_winner(db: &TestDb) {
        let created = db
            .stores
            .schedules
            .create(new_schedule(ws(), ScheduleKind::Interval, "1s"))
            .await
            .unwrap();
        let next = created.next_fire_at.unwrap() + TimeDelta::seconds(1);
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let stores = db.stores.clone();
            let firing = firing(&created, Some(next));
            tasks.push(tokio::spawn(async move {
                stores.schedules.fire(firing).await.unwrap()
            }));
        }
        let mut winners = 0;
        for task in tasks {
            if task.await.unwrap().is_some() {
                winners += 1;
            }
        }
        assert_eq!(winners, 1);
        assert_eq!(drain_outbox(db).await.len(), 1);
        let events = db.stores.events.page(EventQuery::new(ws())).await.unwrap();
        assert_eq!(events.items.len(), 1);
    }

    /// An event the log refuses rolls the claim back: the schedule stays due.
    pub async fn schedule_fire_with_invalid_event_writes_nothing(db: &TestDb) {
        let store = &db.stores.schedules;
        let created = store
            .create(new_schedule(ws(), ScheduleKind::Interval, "1s"))
            .await
            .unwrap();
        let mut bad = firing(
            &created,
            Some(created.next_fire_at.unwrap() + TimeDelta::seconds(1)),
        );
        bad.event.event_type = String::new();
        assert_code(store.fire(bad).await, ErrorCode::InvalidArgument);
        assert_eq!(
            store.get(&ws(), created.id).await.unwrap(),
            Some(created.clone())
        );
        assert!(drain_outbox(db).await.is_empty());
        assert_eq!(
            store
                .due(created.next_fire_at.unwrap(), 10)
                .await
                .unwrap()
                .len(),
            1
        );
    }

    // ---------------------------------------------------------------- knowledge bases

    /// A small help-centre corpus, one chunk per document (see [`kb_titles`]).
    const KB_CORPUS: [(&str, &str); 5] = [
        (
            "returns",
            "To return an item, open your orders page and choose Return. Refunds are issued \
             to the original payment method within five business days.",
        ),
        (
            "shipping",
            "Orders ship within two business days. Shipping is free for orders over fifty \
             dollars; express delivery costs extra.",
        ),
        (
            "passwords",
            "Forgot your password? Use the reset link on the sign-in page. Each reset link \
             expires after one hour.",
        ),
        (
            "accounts",
            "You can delete your account from the settings page. Deleting an account removes \
             every saved address.",
        ),
        (
            "newsletter",
            "Every newsletter ends with an unsubscribe link. The link works on any device, \
             and the link never expires.",
        ),
    ];

    async fn kb_with(db: &TestDb, docs: &[(&str, &str)]) -> uuid::Uuid {
        let r = &db.stores.resources;
        let kb = r.create_kb(&ws(), "help", None).await.unwrap();
        for (title, text) in docs {
            let stored = r
                .add_document(NewKbDocument {
                    workspace_id: ws(),
                    kb_id: kb.kb_id,
                    title: (*title).to_owned(),
                    text: (*text).to_owned(),
                    artifact_id: None,
                    metadata: json!({}),
                })
                .await
                .unwrap();
            assert_eq!(stored.chunks, 1);
        }
        kb.kb_id
    }

    async fn kb_hits(db: &TestDb, kb_id: uuid::Uuid, query: &str, top_k: u64) -> Vec<KbHit> {
        let hits = db
            .stores
            .resources
            .search_kb(KbSearch {
                workspace_id: ws(),
                kb_id,
                query: query.to_owned(),
                top_k,
                document_ids: Vec::new(),
            })
            .await
            .unwrap();
        assert!(
            hits.windows(2).all(|w| w[0].score >= w[1].score),
            "scores fall in rank order: {hits:?}"
        );
        hits
    }

    /// The titles of the hits for `query`, best first.
    async fn kb_titles(db: &TestDb, kb_id: uuid::Uuid, query: &str) -> Vec<String> {
        kb_hits(db, kb_id, query, 10)
            .await
            .into_iter()
            .map(|h| h.title)
            .collect()
    }

    /// Knowledge search matches questions in the user's words: any query word counts, words
    /// are stemmed (plural/singular, verb forms), case and stop words do not matter, and no
    /// text is a syntax error.
    pub async fn kb_search_matches_the_way_users_ask(db: &TestDb) {
        let kb = kb_with(db, &KB_CORPUS).await;
        // Paraphrased questions: the chunk shares only some (stemmed) words with them.
        assert_eq!(
            kb_titles(db, kb, "When will my refund arrive?").await,
            ["returns"]
        );
        assert_eq!(
            kb_titles(db, kb, "I forgot the password I use to sign in").await,
            ["passwords"]
        );
        assert_eq!(
            kb_titles(db, kb, "how long until my delivery gets here").await,
            ["shipping"]
        );
        // Plural and singular, verb forms, either way round.
        assert_eq!(kb_titles(db, kb, "password resets").await, ["passwords"]);
        assert_eq!(kb_titles(db, kb, "deleting accounts").await, ["accounts"]);
        assert_eq!(kb_titles(db, kb, "saved addresses").await, ["accounts"]);
        assert_eq!(kb_titles(db, kb, "returning items").await, ["returns"]);
        assert_eq!(kb_titles(db, kb, "shipping cost").await, ["shipping"]);
        // Partial: words the corpus does not have do not spoil the ones it has.
        assert_eq!(
            kb_titles(db, kb, "express shipping to Canada").await,
            ["shipping"]
        );
        assert_eq!(kb_titles(db, kb, "PASSWORD").await, ["passwords"]);
        // Nothing to match: stop words only, unknown words, query syntax, empty text.
        for query in ["how do I", "quantum chromodynamics", "\"*( OR -", "", "  "] {
            assert!(kb_titles(db, kb, query).await.is_empty(), "{query:?}");
        }
        // Filters and limits still apply.
        let one = kb_hits(db, kb, "link", 1).await;
        assert_eq!(one.len(), 1);
        assert_eq!(one, kb_hits(db, kb, "link", 10).await[..1]);
    }

    /// The ranking contract, the same on every backend: chunks containing more of the
    /// query's words first; then relevance; then earlier chunks. A hit's score has the number
    /// of matched words as its integer part.
    pub async fn kb_search_ranks_coverage_then_relevance(db: &TestDb) {
        let mut docs = KB_CORPUS.to_vec();
        docs.push(("gift-a", "Gift cards never expire."));
        docs.push(("gift-b", "Gift cards never expire."));
        let kb = kb_with(db, &docs).await;
        // "link" is three times in the newsletter, but only the password page has both words.
        let hits = kb_hits(db, kb, "reset link", 10).await;
        let titles: Vec<&str> = hits.iter().map(|h| h.title.as_str()).collect();
        assert_eq!(titles, ["passwords", "newsletter"], "{hits:?}");
        assert_eq!(hits[0].score.floor(), 2.0, "{hits:?}");
        assert_eq!(hits[1].score.floor(), 1.0, "{hits:?}");
        let hits = kb_hits(db, kb, "never expires: gift card links", 10).await;
        let titles: Vec<&str> = hits.iter().map(|h| h.title.as_str()).collect();
        // gift-a and gift-b match gift, card, never, expire (4); the newsletter never,
        // expire, link (3); the password page expire, link (2). Equal chunks: earlier first.
        assert_eq!(
            titles,
            ["gift-a", "gift-b", "newsletter", "passwords"],
            "{hits:?}"
        );
        assert_eq!(hits[0].score, hits[1].score);
        assert_eq!(
            hits.iter().map(|h| h.score.floor()).collect::<Vec<_>>(),
            [4.0, 4.0, 3.0, 2.0]
        );
        // A document filter narrows the same ranking.
        let gift_b = hits[1].document_id;
        let only = db
            .stores
            .resources
            .search_kb(KbSearch {
                workspace_id: ws(),
                kb_id: kb,
                query: "gift cards".into(),
                top_k: 10,
                document_ids: vec![gift_b],
            })
            .await
            .unwrap();
        assert_eq!(only.len(), 1);
        assert_eq!(only[0].title, "gift-b");
    }
}
