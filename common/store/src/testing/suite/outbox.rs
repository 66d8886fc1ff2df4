//! Outbox contract tests: claims and their leases, release and publish, delayed rows and
//! cleanup.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{TimeDelta, Utc};
use serde_json::json;

use super::outbox_msg;
use crate::testing::TestDb;

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
