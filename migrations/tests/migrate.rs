//! The migration set applies, rolls back completely, and re-applies on both backends.

use sb_migrations::{Migrator, MigratorTrait, migrate};
use sea_orm_migration::SchemaManager;
use sea_orm_migration::sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DatabaseTransaction, DbBackend,
    Statement, TransactionTrait,
};

const TABLES: &[&str] = &[
    "workspaces",
    "api_keys",
    "runners",
    "agents",
    "event_log",
    "outbox",
    "runs",
    "run_events",
    "transcript",
    "artifacts",
    "artifact_blobs",
    "agent_state",
    "storage",
    "schedules",
    "turn_sessions",
    "turn_idempotency",
    "models",
    "tools",
    "knowledge_bases",
    "kb_documents",
    "kb_chunks",
];

async fn tables_present(db: &DatabaseConnection) -> Vec<&'static str> {
    let manager = SchemaManager::new(db);
    let mut present = Vec::new();
    for table in TABLES {
        if manager.has_table(*table).await.unwrap() {
            present.push(*table);
        }
    }
    present
}

/// The query plan's text for `sql` (`EXPLAIN QUERY PLAN` on SQLite, `EXPLAIN` on Postgres).
async fn plan_of(db: &impl ConnectionTrait, sql: &str) -> String {
    let backend = db.get_database_backend();
    let (explain, column) = match backend {
        DbBackend::Sqlite => ("EXPLAIN QUERY PLAN", "detail"),
        _ => ("EXPLAIN", "QUERY PLAN"),
    };
    let rows = db
        .query_all_raw(Statement::from_string(backend, format!("{explain} {sql}")))
        .await
        .unwrap();
    rows.iter()
        .map(|row| row.try_get::<String>("", column).unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The reaper's and the recovery's queries for runs in flight (which state `ended_at IS
/// NULL`, as every active run has it) are answered from the entries of `ix_runs_ended`
/// without an end, not from a scan of every run ever made.
async fn active_runs_are_found_through_the_ended_index(db: &impl ConnectionTrait) {
    let plan = plan_of(
        db,
        "SELECT id FROM runs WHERE ended_at IS NULL AND status IN ('queued', 'running') \
         ORDER BY created_at, id",
    )
    .await;
    assert!(plan.contains("ix_runs_ended"), "{plan}");
    assert!(!plan.contains("ix_runs_status_deadline"), "{plan}");
}

/// Postgres: a run's claim (`queued → running`, with its worker and start time) changes no
/// indexed column and finds room in its page, so it is a heap-only update that writes no
/// index entry; the end (an indexed `ended_at`) is not. Counted inside one transaction
/// (`pg_stat_get_xact_tuples_hot_updated`), so nothing else on the server can disturb it.
async fn a_claim_is_a_heap_only_update(db: &DatabaseConnection) {
    let txn = db.begin().await.unwrap();
    txn.execute_unprepared(
        "INSERT INTO runs (id, workspace_id, event_id, runner_id, pool, status, created_at) \
         VALUES ('00000000-0000-7000-8000-000000000001', 'w', \
                 '00000000-0000-7000-8000-000000000002', 'echo', 'default', 'queued', now())",
    )
    .await
    .unwrap();
    txn.execute_unprepared(
        "UPDATE runs SET status = 'running', worker_id = 'w1', started_at = now() \
         WHERE status = 'queued'",
    )
    .await
    .unwrap();
    assert_eq!(
        hot_updates(&txn, "runs").await,
        1,
        "the claim is a heap-only update"
    );
    txn.execute_unprepared("UPDATE runs SET status = 'completed', ended_at = now()")
        .await
        .unwrap();
    assert_eq!(
        hot_updates(&txn, "runs").await,
        1,
        "the end writes index entries"
    );
    txn.rollback().await.unwrap();
}

/// Postgres: an event's dispatch (its status, run id and routing metadata, as the run's
/// start writes them) changes no indexed column, so it is a heap-only update too.
async fn an_event_dispatch_is_a_heap_only_update(db: &DatabaseConnection) {
    let txn = db.begin().await.unwrap();
    txn.execute_unprepared(
        "INSERT INTO event_log (id, workspace_id, event_type, source, status, envelope, \
                                created_at, updated_at) \
         VALUES ('00000000-0000-7000-8000-000000000003', 'w', 'message.received', 'api', \
                 'received', '{\"text\": \"hello\"}', now(), now())",
    )
    .await
    .unwrap();
    txn.execute_unprepared(
        "UPDATE event_log SET status = 'dispatched', updated_at = now(), \
                run_id = '00000000-0000-7000-8000-000000000004', \
                metadata = '{\"routing\": {\"pool\": \"default\"}}'",
    )
    .await
    .unwrap();
    assert_eq!(
        hot_updates(&txn, "event_log").await,
        1,
        "the dispatch is a heap-only update"
    );
    txn.rollback().await.unwrap();
}

/// Heap-only updates of `table` made by this transaction so far.
async fn hot_updates(txn: &DatabaseTransaction, table: &str) -> i64 {
    let row = txn
        .query_one_raw(Statement::from_string(
            txn.get_database_backend(),
            format!("SELECT pg_stat_get_xact_tuples_hot_updated('{table}'::regclass) AS n"),
        ))
        .await
        .unwrap()
        .unwrap();
    row.try_get::<i64>("", "n").unwrap()
}

async fn roundtrip(db: &DatabaseConnection) {
    migrate(db).await.unwrap();
    assert_eq!(tables_present(db).await, TABLES);
    // Applying again is a no-op.
    migrate(db).await.unwrap();
    assert!(
        Migrator::get_pending_migrations(db)
            .await
            .unwrap()
            .is_empty()
    );

    // Full rollback removes every table (and the SQLite FTS tables and triggers).
    Migrator::down(db, None).await.unwrap();
    assert!(tables_present(db).await.is_empty());
    migrate(db).await.unwrap();
    assert_eq!(tables_present(db).await, TABLES);
}

/// Agents stored before `agents.budgets` existed get `{}` (no override) when it is added.
async fn budgets_default_for_existing_agents(db: &DatabaseConnection) {
    Migrator::up(db, Some(9)).await.unwrap();
    let backend = db.get_database_backend();
    db.execute_unprepared(
        "INSERT INTO agents (id, workspace_id, name, runner_id, runner_config, event_types, scope, \
         filters, resource_policy, state_policy, delivery_policy, enabled, created_at, updated_at) \
         VALUES ('0190f7a6-0000-7000-8000-000000000001', 'w', 'old', 'plugin:a/b/c', '{}', '[]', \
         '{}', '[]', '{}', '{}', '{}', true, '2025-01-01T00:00:00+00:00', '2025-01-01T00:00:00+00:00')",
    )
    .await
    .unwrap();
    migrate(db).await.unwrap();
    let row = db
        .query_one_raw(Statement::from_string(
            backend,
            "SELECT CAST(budgets AS TEXT) AS budgets FROM agents WHERE name = 'old'",
        ))
        .await
        .unwrap()
        .unwrap();
    let budgets: String = row.try_get("", "budgets").unwrap();
    assert_eq!(budgets, "{}");
}

/// Keys stored before `api_keys.role` existed keep the power they had: `admin`.
async fn roles_default_to_admin_for_existing_keys(db: &DatabaseConnection) {
    Migrator::up(db, Some(10)).await.unwrap();
    let backend = db.get_database_backend();
    db.execute_unprepared(
        "INSERT INTO workspaces (id, created_at) VALUES ('w', '2025-01-01T00:00:00+00:00')",
    )
    .await
    .unwrap();
    db.execute_unprepared(
        "INSERT INTO api_keys (id, workspace_id, name, key_hash, prefix, created_at) \
         VALUES ('0190f7a6-0000-7000-8000-000000000002', 'w', 'old', \
         '0000000000000000000000000000000000000000000000000000000000000000', 'sb_old', \
         '2025-01-01T00:00:00+00:00')",
    )
    .await
    .unwrap();
    migrate(db).await.unwrap();
    let row = db
        .query_one_raw(Statement::from_string(
            backend,
            "SELECT role FROM api_keys WHERE name = 'old'",
        ))
        .await
        .unwrap()
        .unwrap();
    let role: String = row.try_get("", "role").unwrap();
    assert_eq!(role, "admin");
}

/// How many chunks the knowledge base full-text index finds for `word` (the backend's own
/// query syntax: what the store's search builds on). On Postgres the query must be parsed
/// with the index's configuration: `english` once `stemmed`, `simple` before; FTS5 applies
/// the table's tokenizer to the query by itself.
async fn kb_matches(db: &DatabaseConnection, word: &str, stemmed: bool) -> usize {
    let backend = db.get_database_backend();
    let config = if stemmed { "english" } else { "simple" };
    let sql = match backend {
        sea_orm_migration::sea_orm::DbBackend::Postgres => format!(
            "SELECT seq FROM kb_chunks WHERE content_tsv @@ plainto_tsquery('{config}', '{word}')"
        ),
        _ => format!("SELECT rowid FROM kb_chunks_fts WHERE kb_chunks_fts MATCH '\"{word}\"'"),
    };
    db.query_all_raw(Statement::from_string(backend, sql))
        .await
        .unwrap()
        .len()
}

/// Chunks stored before knowledge base search was stemmed are re-indexed by the migration
/// that brings stemming (and again, without it, when it is rolled back).
async fn kb_chunks_are_reindexed_with_stemming(db: &DatabaseConnection) {
    Migrator::up(db, Some(11)).await.unwrap();
    for sql in [
        "INSERT INTO knowledge_bases (id, workspace_id, name, created_at, updated_at) \
         VALUES ('0190f7a6-0000-7000-8000-000000000010', 'w', 'kb', \
         '2025-01-01T00:00:00+00:00', '2025-01-01T00:00:00+00:00')",
        "INSERT INTO kb_documents (id, kb_id, workspace_id, name, size_bytes, sha256, status, \
         created_at, updated_at) VALUES ('0190f7a6-0000-7000-8000-000000000011', \
         '0190f7a6-0000-7000-8000-000000000010', 'w', 'returns', 30, \
         '0000000000000000000000000000000000000000000000000000000000000000', 'ready', \
         '2025-01-01T00:00:00+00:00', '2025-01-01T00:00:00+00:00')",
        "INSERT INTO kb_chunks (id, document_id, kb_id, workspace_id, chunk_index, content, \
         created_at) VALUES ('0190f7a6-0000-7000-8000-000000000012', \
         '0190f7a6-0000-7000-8000-000000000011', '0190f7a6-0000-7000-8000-000000000010', 'w', \
         0, 'Refunds are issued within five days', '2025-01-01T00:00:00+00:00')",
    ] {
        db.execute_unprepared(sql).await.unwrap();
    }
    // Before: whole words only.
    assert_eq!(kb_matches(db, "refunds", false).await, 1);
    assert_eq!(kb_matches(db, "refund", false).await, 0);
    migrate(db).await.unwrap();
    assert_eq!(
        kb_matches(db, "refund", true).await,
        1,
        "the old chunk was re-indexed"
    );
    assert_eq!(kb_matches(db, "issue", true).await, 1);
    // New rows follow the new index too.
    db.execute_unprepared(
        "INSERT INTO kb_chunks (id, document_id, kb_id, workspace_id, chunk_index, content, \
         created_at) VALUES ('0190f7a6-0000-7000-8000-000000000013', \
         '0190f7a6-0000-7000-8000-000000000011', '0190f7a6-0000-7000-8000-000000000010', 'w', \
         1, 'One refund per order', '2025-01-01T00:00:00+00:00')",
    )
    .await
    .unwrap();
    assert_eq!(kb_matches(db, "refunded", true).await, 2);
    // Rolled back (to before the stemming migration, the 12th): whole words again, for
    // every row.
    let after_stemming = u32::try_from(Migrator::migrations().len()).unwrap() - 11;
    Migrator::down(db, Some(after_stemming)).await.unwrap();
    assert_eq!(kb_matches(db, "refunded", false).await, 0);
    assert_eq!(kb_matches(db, "refund", false).await, 1);
    migrate(db).await.unwrap();
    assert_eq!(kb_matches(db, "refunded", true).await, 2);
}

#[tokio::test]
async fn sqlite_kb_chunks_are_reindexed_with_stemming() {
    let db = Database::connect("sqlite::memory:").await.unwrap();
    kb_chunks_are_reindexed_with_stemming(&db).await;
}

#[tokio::test]
async fn sqlite_up_down_up() {
    let db = Database::connect("sqlite::memory:").await.unwrap();
    roundtrip(&db).await;
    active_runs_are_found_through_the_ended_index(&db).await;
    // The FTS5 index follows the table through its triggers.
    db.execute_unprepared(
        "INSERT INTO transcript (id, workspace_id, conversation_id, event_id, role, item_type, content, created_at) \
         VALUES ('t1', 'w', 'c', 'e', 'user', 'message', 'hello searchable world', '2025-01-01T00:00:00+00:00')",
    )
    .await
    .unwrap();
    let hits = db
        .query_all_raw(sea_orm_migration::sea_orm::Statement::from_string(
            db.get_database_backend(),
            "SELECT rowid FROM transcript_fts WHERE transcript_fts MATCH 'searchable'",
        ))
        .await
        .unwrap();
    assert_eq!(hits.len(), 1);
    db.execute_unprepared("DELETE FROM transcript")
        .await
        .unwrap();
    let hits = db
        .query_all_raw(sea_orm_migration::sea_orm::Statement::from_string(
            db.get_database_backend(),
            "SELECT rowid FROM transcript_fts WHERE transcript_fts MATCH 'searchable'",
        ))
        .await
        .unwrap();
    assert!(hits.is_empty());
}

#[tokio::test]
async fn sqlite_existing_agents_get_default_budgets() {
    let db = Database::connect("sqlite::memory:").await.unwrap();
    budgets_default_for_existing_agents(&db).await;
}

#[tokio::test]
async fn sqlite_existing_keys_get_the_admin_role() {
    let db = Database::connect("sqlite::memory:").await.unwrap();
    roles_default_to_admin_for_existing_keys(&db).await;
}

#[tokio::test]
async fn postgres_up_down_up() {
    let url = std::env::var("SWITCHBOARD_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let schema = format!("sbm_{}", std::process::id());
    let admin = Database::connect(&url).await.unwrap();
    admin
        .execute_unprepared(&format!(
            "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE; CREATE SCHEMA \"{schema}\""
        ))
        .await
        .unwrap();
    let mut opts = ConnectOptions::new(url.clone());
    opts.set_schema_search_path(schema.clone());
    let db = Database::connect(opts).await.unwrap();
    roundtrip(&db).await;
    {
        // Without statistics an empty table is scanned whatever its indexes: ask whether the
        // index can serve the query, not whether it wins on no rows.
        let txn = db.begin().await.unwrap();
        txn.execute_unprepared("SET LOCAL enable_seqscan = off")
            .await
            .unwrap();
        active_runs_are_found_through_the_ended_index(&txn).await;
        txn.rollback().await.unwrap();
    }
    a_claim_is_a_heap_only_update(&db).await;
    an_event_dispatch_is_a_heap_only_update(&db).await;
    Migrator::down(&db, None).await.unwrap();
    budgets_default_for_existing_agents(&db).await;
    Migrator::down(&db, None).await.unwrap();
    roles_default_to_admin_for_existing_keys(&db).await;
    Migrator::down(&db, None).await.unwrap();
    kb_chunks_are_reindexed_with_stemming(&db).await;
    // The generated tsvector column exists and is indexed.
    let row = db
        .query_one_raw(sea_orm_migration::sea_orm::Statement::from_string(
            db.get_database_backend(),
            "SELECT count(*) AS n FROM pg_indexes WHERE schemaname = current_schema() \
             AND indexname IN ('ix_transcript_content_tsv', 'ix_kb_chunks_content_tsv')",
        ))
        .await
        .unwrap()
        .unwrap();
    let n: i64 = row.try_get("", "n").unwrap();
    assert_eq!(n, 2);
    db.close().await.unwrap();
    admin
        .execute_unprepared(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await
        .unwrap();
}
