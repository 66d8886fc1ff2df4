//! Settling deliveries: ack, nack with and without requeue, dropped deliveries and
//! subscriptions, and the delivery limit.

use tokio::time::timeout;

use super::{IDLE, assert_idle, direct_pair, exchange, publish, recv, subscribe, text};
use crate::bus::{ExchangeKind, QueueSpec};
use crate::testing::BusFixture;

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
    let (ex, spec, dead) = dead_lettering_pair(fx).await;
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

/// An exchange, a queue bound to it with key `k` whose rejected messages go to a
/// dead-letter exchange, and the queue that collects them (declared).
async fn dead_lettering_pair(fx: &BusFixture) -> (String, QueueSpec, QueueSpec) {
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
    (ex, spec, dead)
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

/// Deliveries settled out of order, in a burst, while an older one is still being handled
/// (a worker holds a long run's job): each settles as asked and the held one is untouched —
/// a backend that coalesces acks must not ack past it, nor past a nack. Settlements made
/// just before a subscription goes away still count.
pub async fn settles_in_a_burst_leave_a_held_delivery_alone(fx: &BusFixture) {
    let (ex, spec, dead) = dead_lettering_pair(fx).await;
    fx.bus.declare_queue(&spec).await.expect("declare queue");
    for body in ["m1", "m2", "m3", "m4", "m5", "m6"] {
        publish(fx, &ex, "k", body).await;
    }
    let mut first = subscribe(fx, &spec, 10).await;
    let mut got = Vec::new();
    for _ in 0..6 {
        got.push(recv(&mut first).await);
    }
    let mut got = got.into_iter();
    let [m1, m2, m3, m4, m5, m6] = std::array::from_fn(|_| got.next().expect("six"));
    assert_eq!(text(&m6), "m6");
    // m2 is held; the others are settled at once, newest first, m4 dead-lettered.
    m6.ack().await.expect("ack m6");
    m4.nack(false).await.expect("nack m4");
    m5.ack().await.expect("ack m5");
    m3.ack().await.expect("ack m3");
    m1.ack().await.expect("ack m1");
    // Gone while m2 is still held (a crash): only m2 comes again.
    drop(first);
    let mut second = subscribe(fx, &spec, 10).await;
    let again = recv(&mut second).await;
    assert_eq!(text(&again), "m2");
    assert!(again.redelivered);
    again.ack().await.expect("ack m2 again");
    assert_idle(&mut second).await;
    drop(m2);
    let mut dead_sub = subscribe(fx, &dead, 10).await;
    let d = recv(&mut dead_sub).await;
    assert_eq!(text(&d), "m4", "the nack was not swallowed by an ack");
    d.ack().await.expect("ack");
    assert_idle(&mut dead_sub).await;
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
