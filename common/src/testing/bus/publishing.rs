//! Publishing: order and metadata, unroutable and missing targets, best effort, batches.

use std::time::Duration;

use tokio::time::timeout;

use super::{IDLE, assert_idle, direct_pair, exchange, publish, recv, subscribe, text};
use crate::bus::{BusError, ExchangeKind, Outgoing, PublishOptions, QueueSpec};
use crate::testing::BusFixture;

/// Messages published before and after subscribing arrive in order with their metadata.
pub async fn publish_then_consume(fx: &BusFixture) {
    let (ex, spec) = direct_pair(fx).await;
    for body in ["m1", "m2", "m3"] {
        publish(fx, &ex, "k", body).await;
    }
    let mut sub = subscribe(fx, &spec, 10).await;
    assert_eq!(sub.queue(), spec.name);
    for expected in ["m1", "m2", "m3"] {
        let d = recv(&mut sub).await;
        assert_eq!(text(&d), expected);
        assert_eq!(d.exchange, ex);
        assert_eq!(d.routing_key, "k");
        assert!(!d.redelivered);
        assert_eq!(d.delivery_count, 0);
        d.ack().await.expect("ack");
    }
    publish(fx, &ex, "k", "m4").await;
    let d = recv(&mut sub).await;
    assert_eq!(text(&d), "m4");
    d.ack().await.expect("ack");
    assert_idle(&mut sub).await;
}

/// A mandatory message nobody is bound for fails; a non-mandatory one is dropped.
pub async fn unroutable_mandatory_message_fails(fx: &BusFixture) {
    let (ex, spec) = direct_pair(fx).await;
    let err = fx
        .bus
        .publish(&ex, "other", "x".into(), PublishOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, BusError::Unroutable { exchange, routing_key } if *exchange == ex && routing_key == "other"),
        "{err:?}"
    );
    fx.bus
        .publish(
            &ex,
            "other",
            "x".into(),
            PublishOptions {
                mandatory: false,
                ..PublishOptions::default()
            },
        )
        .await
        .expect("non-mandatory unroutable publish succeeds");
    fx.bus
        .publish(&ex, "other", "x".into(), PublishOptions::best_effort())
        .await
        .expect("best effort");
    // The bus is still usable afterwards.
    publish(fx, &ex, "k", "routable").await;
    let mut sub = subscribe(fx, &spec, 10).await;
    let d = recv(&mut sub).await;
    assert_eq!(text(&d), "routable");
    d.ack().await.expect("ack");
    assert_idle(&mut sub).await;
}

/// Publishing to an exchange that does not exist fails, and the bus recovers.
pub async fn publish_to_missing_exchange_fails(fx: &BusFixture) {
    let missing = fx.name("missing");
    let err = fx
        .bus
        .publish(&missing, "k", "x".into(), PublishOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, BusError::NotFound(_)), "{err:?}");
    let (ex, spec) = direct_pair(fx).await;
    publish(fx, &ex, "k", "after").await;
    let mut sub = subscribe(fx, &spec, 10).await;
    recv(&mut sub).await.ack().await.expect("ack");
}

/// Best-effort publishes (not confirmed) keep their order, also in a batch beside confirmed
/// messages; one to a missing exchange is dropped without an error, and best-effort
/// publishing recovers from it (RabbitMQ closes the channel; the bus reopens it).
pub async fn best_effort_publishes_keep_order_and_never_wedge(fx: &BusFixture) {
    let (ex, spec) = direct_pair(fx).await;
    let other = QueueSpec::durable(fx.name("confirmed")).bind(&ex, "c");
    fx.bus.declare_queue(&other).await.expect("declare");
    let mut sub = subscribe(fx, &spec, 200).await;

    fx.bus
        .publish(
            &fx.name("missing"),
            "k",
            "x".into(),
            PublishOptions::best_effort(),
        )
        .await
        .expect("a best-effort publish to a missing exchange is dropped");
    // Messages sent before the broker's channel error arrives may be dropped with it: publish
    // until one gets through.
    let mut through = None;
    for attempt in 0..100 {
        fx.bus
            .publish(
                &ex,
                "k",
                format!("probe {attempt}").into(),
                PublishOptions::best_effort(),
            )
            .await
            .expect("best-effort publish");
        if let Ok(delivery) = timeout(Duration::from_millis(100), sub.next()).await {
            through = Some(delivery.expect("subscription"));
            break;
        }
    }
    through
        .expect("best-effort publishing recovered")
        .ack()
        .await
        .expect("ack");
    while let Ok(probe) = timeout(IDLE, sub.next()).await {
        probe.expect("subscription").ack().await.expect("ack");
    }

    for i in 0..50 {
        fx.bus
            .publish(
                &ex,
                "k",
                format!("{i}").into(),
                PublishOptions::best_effort(),
            )
            .await
            .expect("best-effort publish");
    }
    let batch: Vec<Outgoing> = (50..100)
        .flat_map(|i| {
            [
                Outgoing::new(&ex, "k", format!("{i}")).with_options(PublishOptions::best_effort()),
                Outgoing::new(&ex, "c", format!("c{i}")),
            ]
        })
        .collect();
    fx.bus.publish_batch(batch).await.expect("mixed batch");
    for i in 0..100 {
        let d = recv(&mut sub).await;
        assert_eq!(text(&d), i.to_string());
        d.ack().await.expect("ack");
    }
    assert_idle(&mut sub).await;
    let mut confirmed = subscribe(fx, &other, 100).await;
    for i in 50..100 {
        let d = recv(&mut confirmed).await;
        assert_eq!(text(&d), format!("c{i}"));
        d.ack().await.expect("ack");
    }
}

/// A batch is confirmed as a whole and keeps publish order per queue.
pub async fn batch_publish_confirms_every_message(fx: &BusFixture) {
    let ex = exchange(fx, "ex", ExchangeKind::Direct).await;
    let qa = QueueSpec::durable(fx.name("qa")).bind(&ex, "a");
    let qb = QueueSpec::durable(fx.name("qb")).bind(&ex, "b");
    fx.bus.declare_queue(&qa).await.expect("declare");
    fx.bus.declare_queue(&qb).await.expect("declare");
    let batch: Vec<Outgoing> = (0..200)
        .map(|i| Outgoing::new(&ex, if i % 2 == 0 { "a" } else { "b" }, format!("{i}")))
        .collect();
    fx.bus.publish_batch(batch).await.expect("batch");
    fx.bus.publish_batch(Vec::new()).await.expect("empty batch");
    for (spec, parity) in [(&qa, 0), (&qb, 1)] {
        let mut sub = subscribe(fx, spec, 100).await;
        for i in (0..200).filter(|i| i % 2 == parity) {
            let d = recv(&mut sub).await;
            assert_eq!(text(&d), i.to_string());
            d.ack().await.expect("ack");
        }
        assert_idle(&mut sub).await;
    }
}

/// Returned (unroutable) messages are told to their own publisher, whatever order the broker
/// acknowledges in and however many publishers share the connection: batches and single
/// publishes run concurrently, every other message of each is unroutable, and each caller is
/// told exactly which of its own failed (the broker may cover several messages with one ack,
/// and the client pairs a return with whichever ack it reads next, not with its owner).
pub async fn returns_reach_their_own_publisher(fx: &BusFixture) {
    const BATCHES: usize = 6;
    const SINGLES: usize = 40;
    const LEN: usize = 40;
    let (ex, spec) = direct_pair(fx).await;
    let key = |i: usize| if i % 2 == 0 { "k" } else { "nobody" };
    let batches = (0..BATCHES).map(|b| {
        let bus = fx.bus.clone();
        let batch: Vec<Outgoing> = (0..LEN)
            .map(|i| Outgoing::new(&ex, key(i), format!("b{b}-{i}")))
            .collect();
        async move {
            let failed = bus.publish_batch(batch).await.unwrap_err().failed;
            failed.into_iter().map(|(i, _)| i).collect::<Vec<_>>()
        }
    });
    let singles = (0..SINGLES).map(|i| {
        let bus = fx.bus.clone();
        let ex = ex.clone();
        async move {
            let body = bytes::Bytes::from(format!("s{i}"));
            bus.publish(&ex, key(i), body, PublishOptions::default())
                .await
        }
    });
    let (batches, singles) = tokio::join!(
        futures::future::join_all(batches),
        futures::future::join_all(singles)
    );
    let odd: Vec<usize> = (0..LEN).filter(|i| i % 2 == 1).collect();
    for failed in batches {
        assert_eq!(failed, odd);
    }
    for (i, result) in singles.into_iter().enumerate() {
        match (i % 2, result) {
            (0, Ok(())) | (1, Err(BusError::Unroutable { .. })) => {}
            (_, other) => panic!("single publish {i}: {other:?}"),
        }
    }
    let mut sub = subscribe(fx, &spec, 200).await;
    let routed = BATCHES * LEN / 2 + SINGLES / 2;
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..routed {
        let d = recv(&mut sub).await;
        assert!(seen.insert(text(&d).to_owned()), "duplicate {}", text(&d));
        d.ack().await.expect("ack");
    }
    assert_idle(&mut sub).await;
}

/// A failed message of a batch is reported by index; the others are durable.
pub async fn batch_publish_reports_failed_indices(fx: &BusFixture) {
    let (ex, spec) = direct_pair(fx).await;
    let batch = vec![
        Outgoing::new(&ex, "k", "0"),
        Outgoing::new(&ex, "nobody", "1"),
        Outgoing::new(&ex, "k", "2"),
        Outgoing::new(&ex, "nobody", "3"),
        Outgoing::new(&ex, "k", "4"),
    ];
    let err = fx.bus.publish_batch(batch).await.unwrap_err();
    assert_eq!(err.total, 5);
    assert_eq!(
        err.failed.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        [1, 3]
    );
    assert!(
        err.failed
            .iter()
            .all(|(_, e)| matches!(e, BusError::Unroutable { .. }))
    );
    let mut sub = subscribe(fx, &spec, 10).await;
    for expected in ["0", "2", "4"] {
        let d = recv(&mut sub).await;
        assert_eq!(text(&d), expected);
        d.ack().await.expect("ack");
    }
    assert_idle(&mut sub).await;
}
