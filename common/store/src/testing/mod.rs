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
//!
//! The tests themselves live in `suite/`, one file per store area (events, turns, outbox, runs,
//! run items, transcript, artifacts, state, agents, schedules, knowledge), and are all
//! re-exported by [`suite`].

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

/// The Postgres texts of the hot path's two largest statements, for tests that read their
/// plans: the result sink's (a batch's run items, their runs' updates and transcript rows)
/// and the runs' starts (run rows, user transcript rows, the events' dispatch, the reads of
/// cursor and state).
#[must_use]
pub fn hot_statements_sql() -> [(&'static str, &'static str); 2] {
    [
        (
            "insert_events",
            crate::sql::runs::INSERT_EVENTS_SQL.as_str(),
        ),
        ("start_runs", crate::sql::runs::START_RUNS_SQL.as_str()),
    ]
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
            event_append_batch_answers_each_request,
            event_append_batch_leases_only_when_asked,
            event_input_summary_is_truncated,
            event_update_status_merges_metadata,
            event_routing_follows_the_status,
            event_get_many_answers_by_position,
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
            run_start_writes_the_run_the_user_row_and_the_dispatch_at_once,
            run_starts_of_many_events_fail_alone,
            run_start_reads_the_cursor_before_its_user_row_and_the_state,
            run_claim_race_has_exactly_one_winner,
            run_claims_of_many_runs_at_once,
            run_terminal_states_are_final,
            run_finish_race_has_exactly_one_winner,
            run_finalize_stores_the_item_with_the_status,
            run_finalize_races_the_runs_own_terminal_item,
            run_items_after_the_terminal_item_are_not_stored,
            run_items_that_end_their_run_end_it_with_the_insert,
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
pub mod suite;
