//! Consumers: prefetch, shared queues, single active consumer, and a closed bus.

use tokio::time::timeout;

use super::{WAIT, assert_idle, direct_pair, exchange, publish, recv, subscribe, text};
use crate::bus::{BusError, ExchangeKind, PublishOptions, QueueSpec};
use crate::testing::BusFixture;

/// No more than `prefetch` deliveries are unacked at once.
pub async fn prefetch_bounds_unacked_deliveries(fx: &BusFixture) {
    let (ex, spec) = direct_pair(fx).await;
    for i in 0..5 {
        publish(fx, &ex, "k", &format!("m{i}")).await;
    }
    let mut sub = subscribe(fx, &spec, 2).await;
    let a = recv(&mut sub).await;
    let b = recv(&mut sub).await;
    assert_eq!((text(&a), text(&b)), ("m0", "m1"));
    assert_idle(&mut sub).await;
    a.ack().await.expect("ack");
    let c = recv(&mut sub).await;
    assert_eq!(text(&c), "m2");
    assert_idle(&mut sub).await;
    for d in [b, c] {
        d.ack().await.expect("ack");
    }
    let d = recv(&mut sub).await;
    let e = recv(&mut sub).await;
    assert_eq!((text(&d), text(&e)), ("m3", "m4"));
}

/// Without single active consumer, subscriptions share a queue's messages.
pub async fn shared_queue_round_robins(fx: &BusFixture) {
    let (ex, spec) = direct_pair(fx).await;
    let mut a = subscribe(fx, &spec, 1).await;
    let mut b = subscribe(fx, &spec, 1).await;
    publish(fx, &ex, "k", "x").await;
    publish(fx, &ex, "k", "y").await;
    // Prefetch 1 each and nothing acked: each subscription must hold exactly one.
    let da = recv(&mut a).await;
    let db = recv(&mut b).await;
    let mut got = vec![text(&da).to_owned(), text(&db).to_owned()];
    got.sort();
    assert_eq!(got, ["x", "y"]);
    da.ack().await.expect("ack");
    db.ack().await.expect("ack");
}

/// A single-active-consumer queue feeds one subscription; the next takes over in queue order
/// (the returned deliveries ahead of the messages still in the queue).
pub async fn single_active_consumer_exclusive_and_takeover(fx: &BusFixture) {
    let ex = exchange(fx, "ex", ExchangeKind::Direct).await;
    let spec = QueueSpec::durable(fx.name("sac"))
        .bind(&ex, "k")
        .single_active_consumer();
    let mut active = subscribe(fx, &spec, 2).await;
    let mut standby = subscribe(fx, &spec, 10).await;
    for i in 1..=5 {
        publish(fx, &ex, "k", &format!("m{i}")).await;
    }
    let d = recv(&mut active).await;
    assert_eq!(text(&d), "m1");
    d.ack().await.expect("ack");
    let held2 = recv(&mut active).await;
    let held3 = recv(&mut active).await;
    assert_eq!((text(&held2), text(&held3)), ("m2", "m3"));
    // m4 and m5 wait in the queue (prefetch 2); the standby gets nothing.
    assert_idle(&mut standby).await;
    drop(active);
    for expected in ["m2", "m3", "m4", "m5"] {
        let d = recv(&mut standby).await;
        assert_eq!(text(&d), expected, "takeover keeps queue order");
        assert_eq!(d.redelivered, expected == "m2" || expected == "m3");
        d.ack().await.expect("ack");
    }
    drop((held2, held3));
    publish(fx, &ex, "k", "m6").await;
    let d = recv(&mut standby).await;
    assert_eq!(text(&d), "m6");
    d.ack().await.expect("ack");
    assert_idle(&mut standby).await;
}

/// Closing the bus ends subscriptions and refuses further calls.
pub async fn closed_bus_ends_subscriptions(fx: &BusFixture) {
    let (ex, spec) = direct_pair(fx).await;
    let mut sub = subscribe(fx, &spec, 10).await;
    publish(fx, &ex, "k", "last").await;
    recv(&mut sub).await.ack().await.expect("ack");
    fx.bus.close().await.expect("close");
    let end = timeout(WAIT, sub.next())
        .await
        .expect("subscription ends after close");
    assert!(matches!(end, Err(BusError::Closed)), "{end:?}");
    let err = fx
        .bus
        .publish(&ex, "k", "x".into(), PublishOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, BusError::Closed), "{err:?}");
    assert!(fx.bus.ping().await.is_err());
}
