//! The store conformance suite on PostgreSQL: every test gets a fresh schema on
//! `SWITCHBOARD_TEST_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`),
//! dropped at the end of the test.

use sb_protocol::ids::WorkspaceId;
use sb_store::testing::{postgres_db, postgres_url, suite_options};
use sb_store::{EventLog, EventQuery, NewEvent, SqlStore};
use sea_orm::{ConnectionTrait, Statement};

sb_store::store_suite!(postgres_db());

/// Every pooled connection uses the test's schema, and two schemas do not see each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemas_isolate_tests() {
    let a = postgres_db().await;
    let b = postgres_db().await;
    let ws = WorkspaceId::new("ws").unwrap();
    a.store
        .append(NewEvent::new(ws.clone(), "message.received", "api"), vec![])
        .await
        .unwrap();
    assert_eq!(
        a.store
            .page(EventQuery::new(ws.clone()))
            .await
            .unwrap()
            .items
            .len(),
        1
    );
    assert!(
        b.store
            .page(EventQuery::new(ws))
            .await
            .unwrap()
            .items
            .is_empty()
    );

    // Hold several connections at once so the check covers more than one pooled connection.
    let mut txns = Vec::new();
    for _ in 0..3 {
        txns.push(
            sea_orm::TransactionTrait::begin(a.store.connection())
                .await
                .unwrap(),
        );
    }
    let mut schemas = std::collections::HashSet::new();
    for txn in &txns {
        let row = txn
            .query_one_raw(Statement::from_string(
                sea_orm::DbBackend::Postgres,
                "SELECT current_schema() AS s, pg_backend_pid() AS pid",
            ))
            .await
            .unwrap()
            .unwrap();
        let schema: String = row.try_get("", "s").unwrap();
        let pid: i32 = row.try_get("", "pid").unwrap();
        assert!(schema.starts_with("sbt_"), "{schema}");
        schemas.insert((schema, pid));
    }
    assert_eq!(
        schemas.len(),
        3,
        "three distinct connections, same schema: {schemas:?}"
    );
    assert_eq!(
        schemas
            .iter()
            .map(|(s, _)| s)
            .collect::<std::collections::HashSet<_>>()
            .len(),
        1
    );
}

/// `connect_with_schema` refuses names that could escape the quoted identifier.
#[tokio::test]
async fn schema_names_are_validated() {
    for bad in ["", "Upper", "a-b", "a\"b", "1abc", &"x".repeat(64)] {
        let err = SqlStore::connect_with_schema(&postgres_url(), bad, &suite_options())
            .await
            .unwrap_err();
        assert!(
            matches!(err, sb_store::StoreError::InvalidArgument(_)),
            "{bad}: {err}"
        );
    }
}

/// The hot path's statements read the ledger by key, never a whole ledger table, in a ledger
/// of a few thousand runs with fresh statistics: their cost per batch must grow with the
/// batch, not with the ledger. (Joins the planner preferred made each one-run batch of the
/// result sink read every run and every terminal item.)
#[tokio::test]
async fn hot_statements_read_the_ledger_by_key() {
    let db = postgres_db().await;
    let conn = db.store.connection();
    conn.execute_unprepared(
        "INSERT INTO event_log (id, workspace_id, event_type, source, status, created_at,
             updated_at)
         SELECT gen_random_uuid(), 'ws', 'message.received', 'api', 'dispatched', now(), now()
         FROM generate_series(1, 5000);
         INSERT INTO runs (id, workspace_id, event_id, runner_id, pool, status, created_at)
         SELECT gen_random_uuid(), 'ws', id, 'echo', 'default', 'completed', now()
         FROM event_log;
         INSERT INTO run_events (run_id, sequence, result_type, data, created_at)
         SELECT id, s, CASE WHEN s = 3 THEN 'run.completed' ELSE 'message.delta' END, '{}', now()
         FROM runs, generate_series(1, 3) AS s;
         INSERT INTO transcript (id, workspace_id, conversation_id, event_id, role, item_type,
             created_at)
         SELECT gen_random_uuid()::text, 'ws', 'c' || (s % 100), 'e', 'user', 'message', now()
         FROM generate_series(1, 5000) AS s;
         INSERT INTO agent_state (scope_key, key, scope, value, revision, created_at, updated_at)
         SELECT 'conversation:' || s, 'k', 'conversation', '1', 1, now(), now()
         FROM generate_series(1, 5000) AS s;
         ANALYZE event_log, runs, run_events, transcript, agent_state;",
    )
    .await
    .unwrap();
    for (name, sql, input) in hot_statements() {
        let row = conn
            .query_one_raw(Statement::from_sql_and_values(
                sea_orm::DbBackend::Postgres,
                format!("EXPLAIN (FORMAT JSON) {sql}"),
                [input.into(), chrono::Utc::now().into()],
            ))
            .await
            .unwrap()
            .unwrap();
        let plan: serde_json::Value = row.try_get("", "QUERY PLAN").unwrap();
        assert_reads_by_key(name, &plan);
    }
}

/// The same on a young ledger that was never analyzed (a database without autovacuum, or
/// before its first run), with the plan Postgres keeps for a prepared statement: the generic
/// one, made once per connection while the ledger is small and used however large it grows.
/// A plan that reads a small table whole is cheap when made and costs a full read of the
/// grown ledger at every call later.
#[tokio::test]
async fn hot_statements_read_a_young_ledger_by_key_in_their_generic_plans() {
    let db = postgres_db().await;
    let conn = db.store.connection();
    let txn = sea_orm::TransactionTrait::begin(conn).await.unwrap();
    txn.execute_unprepared(
        "INSERT INTO event_log (id, workspace_id, event_type, source, status, created_at,
             updated_at)
         SELECT gen_random_uuid(), 'ws', 'message.received', 'api', 'received', now(), now()
         FROM generate_series(1, 20);
         SET LOCAL plan_cache_mode = force_generic_plan;",
    )
    .await
    .unwrap();
    for (i, (name, sql, input)) in hot_statements().into_iter().enumerate() {
        txn.execute_unprepared(&format!(
            "PREPARE young_hot_{i} (jsonb, timestamptz) AS {sql}"
        ))
        .await
        .unwrap();
        let input = input.to_string().replace('\'', "''");
        let row = txn
            .query_one_raw(Statement::from_string(
                sea_orm::DbBackend::Postgres,
                format!("EXPLAIN (FORMAT JSON) EXECUTE young_hot_{i} ('{input}', now())"),
            ))
            .await
            .unwrap()
            .unwrap();
        let plan: serde_json::Value = row.try_get("", "QUERY PLAN").unwrap();
        txn.execute_unprepared(&format!("DEALLOCATE young_hot_{i}"))
            .await
            .unwrap();
        assert_reads_by_key(name, &plan);
    }
    txn.rollback().await.unwrap();
}

/// The hot statements with an input of one row each: `(name, sql, input)`.
fn hot_statements() -> Vec<(&'static str, &'static str, serde_json::Value)> {
    let id = || serde_json::Value::from(uuid::Uuid::new_v4().to_string());
    let inputs = [
        serde_json::json!([{
            "run_id": id(), "sequence": 1, "result_type": "run.started", "data": {},
            "status": null, "error_code": null, "error_message": null, "usage": null,
            "transcript": null,
        }]),
        serde_json::json!([{
            "id": id(), "workspace_id": "ws", "event_id": id(), "runner_id": "echo",
            "pool": "default", "conversation_id": "c1", "attempt": 1,
            "event_status": "dispatched", "read_cursor": true,
            "state_scopes": ["conversation:1"],
        }]),
    ];
    sb_store::testing::hot_statements_sql()
        .into_iter()
        .zip(inputs)
        .map(|((name, sql), input)| (name, sql, input))
        .collect()
}

/// Fails unless `plan` (EXPLAIN's JSON of statement `name`) reads no ledger table whole.
fn assert_reads_by_key(name: &str, plan: &serde_json::Value) {
    const LEDGER: [&str; 6] = [
        "event_log",
        "runs",
        "run_events",
        "transcript",
        "agent_state",
        "outbox",
    ];
    let mut scans = Vec::new();
    seq_scans(plan, &mut scans);
    assert!(
        !scans
            .iter()
            .any(|relation| LEDGER.contains(&relation.as_str())),
        "{name} scans a ledger table ({scans:?}): {plan:#}"
    );
}
/// The relations a plan (EXPLAIN's JSON) reads with a sequential scan.
fn seq_scans(node: &serde_json::Value, out: &mut Vec<String>) {
    match node {
        serde_json::Value::Object(map) => {
            if map.get("Node Type").and_then(|t| t.as_str()) == Some("Seq Scan") {
                if let Some(relation) = map.get("Relation Name").and_then(|r| r.as_str()) {
                    out.push(relation.to_owned());
                }
            }
            map.values().for_each(|v| seq_scans(v, out));
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| seq_scans(v, out)),
        _ => {}
    }
}
