//! The session-store conformance suite against a real Redis (`SWITCHBOARD_TEST_REDIS_URL`,
//! default `redis://127.0.0.1:6379`). Every test uses its own key prefix and deletes its keys
//! afterwards.

use std::sync::Arc;

use sb_common::session::SessionStore;
use sb_common::session::redis::{RedisOptions, RedisSessionStore};
use sb_common::testing::{SessionFixture, run_detached, unique_prefix};

fn redis_url() -> String {
    std::env::var("SWITCHBOARD_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

async fn redis_fixture() -> SessionFixture {
    let options = RedisOptions::new(redis_url(), unique_prefix());
    let store = RedisSessionStore::connect(&options)
        .await
        .expect("connect to the test redis");
    SessionFixture::new(Arc::new(store)).with_teardown(Box::new(move || {
        run_detached(move || async move {
            match RedisSessionStore::connect(&options).await {
                Ok(store) => {
                    if let Err(e) = store.delete_all().await {
                        eprintln!("teardown: {e}");
                    }
                }
                Err(e) => eprintln!("teardown: {e}"),
            }
        })
    }))
}

sb_common::session_suite!(redis_session, redis_fixture);

/// Teardown really removes the keys of a prefix (and only those).
#[tokio::test]
async fn delete_all_removes_only_the_prefix() {
    let a = RedisSessionStore::connect(&RedisOptions::new(redis_url(), unique_prefix()))
        .await
        .unwrap();
    let b = RedisSessionStore::connect(&RedisOptions::new(redis_url(), unique_prefix()))
        .await
        .unwrap();
    for store in [&a, &b] {
        store.counter_incr("c", 1, None).await.unwrap();
        store.set_add("s", "m", None).await.unwrap();
    }
    assert_eq!(a.delete_all().await.unwrap(), 2);
    assert_eq!(a.counter_get("c").await.unwrap(), 0);
    assert_eq!(b.counter_get("c").await.unwrap(), 1);
    assert_eq!(b.delete_all().await.unwrap(), 2);
    assert!(
        RedisSessionStore::connect(&RedisOptions::new(redis_url(), ""))
            .await
            .unwrap()
            .delete_all()
            .await
            .is_err()
    );
}

/// An unreachable server is `Unavailable`, not a hang.
#[tokio::test]
async fn unreachable_server_is_unavailable() {
    let mut options = RedisOptions::new("redis://127.0.0.1:1", "x:");
    options.connect_timeout = std::time::Duration::from_millis(500);
    let err = RedisSessionStore::connect(&options).await.unwrap_err();
    assert!(
        matches!(err, sb_common::session::SessionError::Unavailable(_)),
        "{err:?}"
    );
}

/// After the server drops the connection, the store reconnects by itself: calls may fail with
/// `Unavailable` for a moment, then succeed, and the data is still there.
#[tokio::test]
async fn reconnects_after_the_server_drops_the_connection() {
    let store = RedisSessionStore::connect(&RedisOptions::new(redis_url(), unique_prefix()))
        .await
        .unwrap();
    store
        .set_ex("k", b"v", std::time::Duration::from_secs(60))
        .await
        .unwrap();
    store.sever_connection().await.unwrap();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    let value = loop {
        match store.get("k").await {
            Ok(value) => break value,
            Err(sb_common::session::SessionError::Unavailable(_))
                if tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => panic!("store did not recover: {e}"),
        }
    };
    assert_eq!(value.as_deref(), Some(&b"v"[..]));
    store.ping().await.unwrap();
    store.delete_all().await.unwrap();
}
