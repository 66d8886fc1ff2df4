//! Bus conformance tests: one function per point of the [`Bus`](crate::bus::Bus) contract.
//! Instantiate them with [`bus_suite!`](crate::bus_suite).

use std::time::Duration;

use bytes::Bytes;
use tokio::time::timeout;

use super::BusFixture;
use crate::bus::{
    Binding, BusError, ConsumeOptions, Delivery, ExchangeKind, ExchangeSpec, Outgoing,
    PublishOptions, QueueSpec, QueueType, Subscription,
};

/// How long a test waits for a delivery that must come.
const WAIT: Duration = Duration::from_secs(10);
/// How long a test watches for a delivery that must not come.
const IDLE: Duration = Duration::from_millis(400);

async fn recv(sub: &mut Subscription) -> Delivery {
    timeout(WAIT, sub.next())
        .await
        .unwrap_or_else(|_| panic!("no delivery on {} within {WAIT:?}", sub.queue()))
        .expect("subscription failed")
}

async fn assert_idle(sub: &mut Subscription) {
    if let Ok(item) = timeout(IDLE, sub.next()).await {
        panic!("unexpected delivery on {}: {item:?}", sub.queue());
    }
}

async fn exchange(fx: &BusFixture, base: &str, kind: ExchangeKind) -> String {
    let name = fx.name(base);
    fx.bus
        .declare_exchange(&ExchangeSpec::new(&name, kind))
        .await
        .expect("declare exchange");
    name
}

async fn publish(fx: &BusFixture, exchange: &str, key: &str, body: &str) {
    fx.bus
        .publish(
            exchange,
            key,
            Bytes::copy_from_slice(body.as_bytes()),
            PublishOptions::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("publish {body:?} to {exchange}/{key}: {e}"));
}

async fn subscribe(fx: &BusFixture, spec: &QueueSpec, prefetch: u16) -> Subscription {
    fx.bus
        .subscribe(spec, ConsumeOptions::prefetch(prefetch))
        .await
        .expect("subscribe")
}

fn text(d: &Delivery) -> &str {
    std::str::from_utf8(&d.body).expect("utf-8 body")
}

/// A direct exchange with one quorum queue bound with key `k`.
async fn direct_pair(fx: &BusFixture) -> (String, QueueSpec) {
    let ex = exchange(fx, "ex", ExchangeKind::Direct).await;
    let spec = QueueSpec::durable(fx.name("q")).bind(&ex, "k");
    fx.bus.declare_queue(&spec).await.expect("declare queue");
    (ex, spec)
}

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

/// Redeclaring with the same spec is a no-op; a different spec is a conflict.
pub async fn declare_is_idempotent_and_detects_conflicts(fx: &BusFixture) {
    let ex = exchange(fx, "ex", ExchangeKind::Direct).await;
    fx.bus
        .declare_exchange(&ExchangeSpec::new(&ex, ExchangeKind::Direct))
        .await
        .expect("redeclare exchange");
    let err = fx
        .bus
        .declare_exchange(&ExchangeSpec::new(&ex, ExchangeKind::Topic))
        .await
        .unwrap_err();
    assert!(
        matches!(err, BusError::DeclarationConflict { .. }),
        "{err:?}"
    );

    let spec = QueueSpec::durable(fx.name("q")).bind(&ex, "k");
    fx.bus.declare_queue(&spec).await.expect("declare queue");
    fx.bus.declare_queue(&spec).await.expect("redeclare queue");
    publish(fx, &ex, "k", "one").await;
    // Redeclaring did not purge or duplicate anything.
    fx.bus.declare_queue(&spec).await.expect("redeclare queue");
    let err = fx
        .bus
        .declare_queue(&spec.clone().single_active_consumer())
        .await
        .unwrap_err();
    assert!(
        matches!(err, BusError::DeclarationConflict { .. }),
        "{err:?}"
    );
    // The bus is still usable after a conflict (RabbitMQ closes the channel on one).
    let mut sub = subscribe(fx, &spec, 10).await;
    let d = recv(&mut sub).await;
    assert_eq!(text(&d), "one");
    d.ack().await.expect("ack");
    assert_idle(&mut sub).await;

    // Binding to a missing exchange is NotFound.
    let err = fx
        .bus
        .declare_queue(&QueueSpec::durable(fx.name("q2")).bind(fx.name("missing"), "k"))
        .await
        .unwrap_err();
    assert!(matches!(err, BusError::NotFound(_)), "{err:?}");
}

/// An acked message is gone for good.
pub async fn ack_removes_the_message(fx: &BusFixture) {
    let (ex, spec) = direct_pair(fx).await;
    publish(fx, &ex, "k", "once").await;
    let mut sub = subscribe(fx, &spec, 10).await;
    recv(&mut sub).await.ack().await.expect("ack");
    drop(sub);
    let mut sub = subscribe(fx, &spec, 10).await;
    assert_idle(&mut sub).await;
}

/// `nack(requeue = true)` delivers the message again, flagged and counted.
pub async fn nack_with_requeue_redelivers(fx: &BusFixture) {
    let (ex, spec) = direct_pair(fx).await;
    publish(fx, &ex, "k", "again").await;
    let mut sub = subscribe(fx, &spec, 10).await;
    let d = recv(&mut sub).await;
    assert!(!d.redelivered);
    d.nack(true).await.expect("nack");
    let d = recv(&mut sub).await;
    assert_eq!(text(&d), "again");
    assert!(d.redelivered);
    assert_eq!(d.delivery_count, 1);
    d.nack(true).await.expect("nack");
    let d = recv(&mut sub).await;
    assert_eq!(d.delivery_count, 2);
    d.ack().await.expect("ack");
    assert_idle(&mut sub).await;
}

/// A requeued message is delivered again, nothing is lost or duplicated, and the messages it
/// did not overtake keep their order (its own position may be behind them; see the contract).
pub async fn requeued_message_comes_again_without_loss(fx: &BusFixture) {
    let (ex, spec) = direct_pair(fx).await;
    for body in ["a", "b", "c"] {
        publish(fx, &ex, "k", body).await;
    }
    let mut sub = subscribe(fx, &spec, 1).await;
    let d = recv(&mut sub).await;
    assert_eq!(text(&d), "a");
    d.nack(true).await.expect("nack");
    let mut order = Vec::new();
    for _ in 0..3 {
        let d = recv(&mut sub).await;
        assert_eq!(
            d.redelivered,
            text(&d) == "a",
            "only the requeued message is flagged"
        );
        order.push(text(&d).to_owned());
        d.ack().await.expect("ack");
    }
    assert_idle(&mut sub).await;
    let others: Vec<_> = order.iter().filter(|m| *m != "a").collect();
    assert_eq!(others, ["b", "c"]);
    assert!(order.contains(&"a".to_owned()), "{order:?}");
}

/// `nack(requeue = false)` moves the message to the dead-letter exchange.
pub async fn nack_without_requeue_dead_letters(fx: &BusFixture) {
    let ex = exchange(fx, "ex", ExchangeKind::Direct).await;
    let dlx = exchange(fx, "dead", ExchangeKind::Fanout).await;
    let dead = QueueSpec::durable(fx.name("dead-q")).bind(&dlx, "");
    fx.bus
        .declare_queue(&dead)
        .await
        .expect("declare dead queue");
    let spec = QueueSpec::durable(fx.name("q"))
        .bind(&ex, "k")
        .dead_letter_exchange(&dlx);
    let mut sub = subscribe(fx, &spec, 10).await;
    publish(fx, &ex, "k", "poison").await;
    recv(&mut sub).await.nack(false).await.expect("nack");
    assert_idle(&mut sub).await;
    let mut dead_sub = subscribe(fx, &dead, 10).await;
    let d = recv(&mut dead_sub).await;
    assert_eq!(text(&d), "poison");
    assert_eq!(d.routing_key, "k", "dead-lettering keeps the routing key");
    d.ack().await.expect("ack");
}

/// Deliveries a dropped subscription did not settle go to the next subscription, in order.
pub async fn dropped_subscription_redelivers_unacked(fx: &BusFixture) {
    let (ex, spec) = direct_pair(fx).await;
    for body in ["m1", "m2", "m3"] {
        publish(fx, &ex, "k", body).await;
    }
    let mut first = subscribe(fx, &spec, 10).await;
    let d1 = recv(&mut first).await;
    assert_eq!(text(&d1), "m1");
    d1.ack().await.expect("ack");
    let d2 = recv(&mut first).await;
    let d3 = recv(&mut first).await;
    assert_eq!((text(&d2), text(&d3)), ("m2", "m3"));
    // Handler still holds the deliveries when the subscription goes away (a crash).
    drop(first);
    let mut second = subscribe(fx, &spec, 10).await;
    for expected in ["m2", "m3"] {
        let d = recv(&mut second).await;
        assert_eq!(text(&d), expected);
        assert!(d.redelivered);
        assert!(d.delivery_count >= 1);
        d.ack().await.expect("ack");
    }
    // The deliveries of the dropped subscription can no longer be settled (already requeued).
    assert!(d2.ack().await.is_err());
    drop(d3);
    assert_idle(&mut second).await;
}

/// Dropping a delivery without settling it requeues it.
pub async fn dropped_delivery_is_requeued(fx: &BusFixture) {
    let (ex, spec) = direct_pair(fx).await;
    publish(fx, &ex, "k", "dropped").await;
    let mut sub = subscribe(fx, &spec, 1).await;
    drop(recv(&mut sub).await);
    let d = recv(&mut sub).await;
    assert_eq!(text(&d), "dropped");
    assert!(d.redelivered);
    d.ack().await.expect("ack");
}

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

/// Topic bindings: `*` is one word, `#` zero or more.
pub async fn topic_wildcards_route(fx: &BusFixture) {
    let ex = exchange(fx, "topic", ExchangeKind::Topic).await;
    let star = QueueSpec::durable(fx.name("star")).bind(&ex, "a.*.c");
    let hash = QueueSpec::durable(fx.name("hash")).bind(&ex, "a.#");
    let exact = QueueSpec::durable(fx.name("exact"))
        .bind(&ex, "a.b.c")
        .bind(&ex, "#.c");
    let mut subs = Vec::new();
    for spec in [&star, &hash, &exact] {
        subs.push(subscribe(fx, spec, 20).await);
    }
    for key in ["a.b.c", "a", "a.x.y.c", "a.b"] {
        publish(fx, &ex, key, key).await;
    }
    let expected: [&[&str]; 3] = [
        &["a.b.c"],
        &["a.b.c", "a", "a.x.y.c", "a.b"],
        &["a.b.c", "a.x.y.c"],
    ];
    for (sub, expected) in subs.iter_mut().zip(expected) {
        for key in expected {
            let d = recv(sub).await;
            assert_eq!(d.routing_key, *key, "queue {}", sub.queue());
            d.ack().await.expect("ack");
        }
        // `exact` matches "a.b.c" through two bindings but stores it once.
        assert_idle(sub).await;
    }
    let err = fx
        .bus
        .publish(&ex, "b.c.d", "x".into(), PublishOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, BusError::Unroutable { .. }), "{err:?}");
}

/// A fanout exchange copies to every bound queue whatever the key.
pub async fn fanout_reaches_every_bound_queue(fx: &BusFixture) {
    let ex = exchange(fx, "fan", ExchangeKind::Fanout).await;
    let q1 = QueueSpec::durable(fx.name("f1")).bind(&ex, "");
    let q2 = QueueSpec::durable(fx.name("f2"))
        .queue_type(QueueType::Classic)
        .bind(&ex, "ignored");
    let mut s1 = subscribe(fx, &q1, 10).await;
    let mut s2 = subscribe(fx, &q2, 10).await;
    publish(fx, &ex, "any.key", "hello").await;
    for sub in [&mut s1, &mut s2] {
        let d = recv(sub).await;
        assert_eq!(text(&d), "hello");
        assert_eq!(d.routing_key, "any.key");
        d.ack().await.expect("ack");
    }
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

/// Bindings of a consumed exclusive queue can be added and removed.
pub async fn bind_and_unbind_on_a_live_exclusive_queue(fx: &BusFixture) {
    let ex = exchange(fx, "deliveries", ExchangeKind::Topic).await;
    let spec = QueueSpec::exclusive(fx.name("gateway-1"));
    let mut sub = subscribe(fx, &spec, 10).await;
    let run1 = Binding::new(&ex, "*.*.run1");
    fx.bus.bind(&spec.name, &run1).await.expect("bind");
    fx.bus
        .bind(&spec.name, &run1)
        .await
        .expect("bind is idempotent");
    publish(fx, &ex, "ws.conv.run1", "for run1").await;
    let err = fx
        .bus
        .publish(&ex, "ws.conv.run2", "x".into(), PublishOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, BusError::Unroutable { .. }), "{err:?}");
    let d = recv(&mut sub).await;
    assert_eq!(text(&d), "for run1");
    d.ack().await.expect("ack");

    fx.bus.unbind(&spec.name, &run1).await.expect("unbind");
    fx.bus
        .unbind(&spec.name, &run1)
        .await
        .expect("unbind is idempotent");
    let err = fx
        .bus
        .publish(&ex, "ws.conv.run1", "x".into(), PublishOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, BusError::Unroutable { .. }), "{err:?}");
    fx.bus
        .bind(&spec.name, &Binding::new(&ex, "*.*.run2"))
        .await
        .expect("bind");
    publish(fx, &ex, "ws._.run2", "for run2").await;
    let d = recv(&mut sub).await;
    assert_eq!(text(&d), "for run2");
    d.ack().await.expect("ack");
    assert_idle(&mut sub).await;
}

/// An exclusive queue disappears with its last subscription (its bindings too).
pub async fn exclusive_queue_is_deleted_with_its_subscription(fx: &BusFixture) {
    let ex = exchange(fx, "control", ExchangeKind::Topic).await;
    let spec = QueueSpec::exclusive(fx.name("worker-1")).bind(&ex, "cancel.*");
    let sub = subscribe(fx, &spec, 10).await;
    publish(fx, &ex, "cancel.r1", "c").await;
    drop(sub);
    // Deletion is asynchronous on a broker: poll.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match fx
            .bus
            .publish(&ex, "cancel.r2", "x".into(), PublishOptions::default())
            .await
        {
            Err(BusError::Unroutable { .. }) => break,
            Ok(()) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => {
                panic!("exclusive queue still routable after its subscription dropped: {other:?}")
            }
        }
    }
}

/// A message returned more than `delivery_limit` times is dead-lettered (quorum queues).
pub async fn delivery_limit_dead_letters_poison_messages(fx: &BusFixture) {
    let ex = exchange(fx, "ex", ExchangeKind::Direct).await;
    let dlx = exchange(fx, "dead", ExchangeKind::Fanout).await;
    let dead = QueueSpec::durable(fx.name("dead-q")).bind(&dlx, "");
    fx.bus
        .declare_queue(&dead)
        .await
        .expect("declare dead queue");
    let spec = QueueSpec::durable(fx.name("q"))
        .bind(&ex, "k")
        .delivery_limit(2)
        .dead_letter_exchange(&dlx);
    fx.bus.declare_queue(&spec).await.expect("declare queue");
    publish(fx, &ex, "k", "poison").await;
    let mut sub = subscribe(fx, &spec, 1).await;
    let mut attempts = 0;
    while let Ok(next) = timeout(IDLE, sub.next()).await {
        let d = next.expect("subscription failed");
        assert_eq!(text(&d), "poison");
        assert_eq!(d.delivery_count, attempts);
        attempts += 1;
        d.nack(true).await.expect("nack");
        assert!(attempts <= 10, "never dead-lettered");
    }
    assert_eq!(
        attempts, 3,
        "limit 2 allows the first delivery and 2 redeliveries"
    );
    publish(fx, &ex, "k", "healthy").await;
    let d = recv(&mut sub).await;
    assert_eq!((text(&d), d.delivery_count), ("healthy", 0));
    d.ack().await.expect("ack");
    let mut dead_sub = subscribe(fx, &dead, 10).await;
    let d = recv(&mut dead_sub).await;
    assert_eq!(text(&d), "poison");
    d.ack().await.expect("ack");
}

/// The SPEC §3 topology declared by [`declare_topology`](crate::bus::topology::declare_topology): each message kind reaches its queue,
/// and a dead-lettered job reaches the dead queue.
pub async fn topology_routes_every_message_kind(fx: &BusFixture) {
    use crate::bus::topology::{
        self, Topology, TopologyOptions, control_routing_key, declare_topology,
        deliveries_routing_key, deliveries_run_pattern,
    };
    use sb_protocol::ids::RunId;
    use std::num::NonZeroU32;

    let options = TopologyOptions {
        name_prefix: format!("{}switchboard", fx.prefix()),
        events_shards: NonZeroU32::new(2).expect("non-zero"),
        results_shards: NonZeroU32::new(3).expect("non-zero"),
        pools: vec!["default".into(), "gpu".into()],
        queue_type: QueueType::Quorum,
        delivery_limit: Some(3),
    };
    let planned = Topology::new(options.clone()).expect("valid options");
    for exchange in planned.exchanges() {
        fx.remember(exchange.name);
    }
    for queue in planned.durable_queues() {
        fx.remember(queue.name);
    }
    let t = declare_topology(fx.bus.as_ref(), &options)
        .await
        .expect("declare topology");
    declare_topology(fx.bus.as_ref(), &options)
        .await
        .expect("declaring again is a no-op");
    assert_eq!(
        t.events_exchange(),
        format!("{}switchboard.events", fx.prefix())
    );

    // Events land on the conversation's shard.
    let key = t.events_routing_key("default", Some("conv-1"));
    let shard = topology::events_shard("default", Some("conv-1"), options.events_shards);
    fx.bus
        .publish(
            &t.events_exchange(),
            &key,
            "event".into(),
            PublishOptions::default(),
        )
        .await
        .expect("event");
    let mut events = subscribe(fx, &t.events_queue(shard), 10).await;
    assert_eq!(text(&recv(&mut events).await), "event");
    let mut other = subscribe(fx, &t.events_queue(1 - shard), 10).await;
    assert_idle(&mut other).await;

    // Results land on the run's shard.
    let run = RunId::new();
    fx.bus
        .publish(
            &t.results_exchange(),
            &t.results_routing_key(&run),
            "result".into(),
            PublishOptions::default(),
        )
        .await
        .expect("result");
    let shard = topology::results_shard(&run, options.results_shards);
    let mut results = subscribe(fx, &t.results_queue(shard), 10).await;
    assert_eq!(text(&recv(&mut results).await), "result");

    // Jobs land on their pool; a job nacked for good is dead-lettered.
    fx.bus
        .publish(
            &t.runs_exchange(),
            "gpu",
            "job".into(),
            PublishOptions::default(),
        )
        .await
        .expect("job");
    let err = fx
        .bus
        .publish(
            &t.runs_exchange(),
            "nopool",
            "x".into(),
            PublishOptions::default(),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, BusError::Unroutable { .. }), "{err:?}");
    let mut gpu = subscribe(fx, &t.runs_queue("gpu"), 10).await;
    recv(&mut gpu).await.nack(false).await.expect("nack");
    let mut dead = subscribe(fx, &t.dead_queue(), 10).await;
    let d = recv(&mut dead).await;
    assert_eq!((text(&d), d.routing_key.as_str()), ("job", "gpu"));
    d.ack().await.expect("ack");

    // Live deliveries follow a gateway's per-run binding; cancels a worker's.
    let gateway = t.deliveries_queue("gw-1");
    fx.remember(gateway.name.clone());
    let mut live = subscribe(fx, &gateway, 10).await;
    fx.bus
        .bind(
            &gateway.name,
            &Binding::new(t.deliveries_exchange(), deliveries_run_pattern(&run)),
        )
        .await
        .expect("bind");
    let key = deliveries_routing_key("default", Some("conv.1"), &run);
    fx.bus
        .publish(
            &t.deliveries_exchange(),
            &key,
            "item".into(),
            PublishOptions::best_effort(),
        )
        .await
        .expect("delivery");
    assert_eq!(recv(&mut live).await.routing_key, key);
    let worker = t
        .control_queue("worker-1")
        .bind(t.control_exchange(), control_routing_key(&run));
    fx.remember(worker.name.clone());
    let mut control = subscribe(fx, &worker, 10).await;
    fx.bus
        .publish(
            &t.control_exchange(),
            &control_routing_key(&run),
            "cancel".into(),
            PublishOptions::best_effort(),
        )
        .await
        .expect("cancel");
    assert_eq!(text(&recv(&mut control).await), "cancel");
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
