//! State store and blob storage contract tests: revisions and compare-and-set, the value
//! limit, deletes, prefix listings, concurrent writes; storage isolation and cap.

use sb_protocol::error::{ErrorCode, HasErrorCode};
use serde_json::{Value, json};

use super::assert_code;
use crate::testing::SUITE_MAX_STORAGE_VALUE_BYTES;
use crate::testing::TestDb;
use crate::*;

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
