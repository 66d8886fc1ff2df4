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
