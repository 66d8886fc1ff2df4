//! Bus conformance tests: one function per point of the [`Bus`](crate::bus::Bus) contract.
//! Instantiate them with [`bus_suite!`](crate::bus_suite).
//!
//! The tests are grouped by part of the contract, one file each: `publishing`, `settling`,
//! `consumers`, `declarations`, `routing`; every test is re-exported here, where the macro
//! finds it as `testing::bus::<name>`. The helpers they share (waiting for a delivery,
//! declaring and publishing with fixture names) live in this file.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::timeout;

use super::BusFixture;
use crate::bus::{
    BusError, ConsumeOptions, Delivery, ExchangeKind, ExchangeSpec, PublishOptions, QueueSpec,
    Subscription,
};

mod consumers;
mod declarations;
mod publishing;
mod routing;
mod settling;

pub use consumers::*;
pub use declarations::*;
pub use publishing::*;
pub use routing::*;
pub use settling::*;

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

/// Waits until `queue` has no consumer (RabbitMQ cancels a dropped subscription's consumer
/// asynchronously).
async fn wait_unconsumed(fx: &BusFixture, queue: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let used = fx.bus.inspect_queue(queue).await.expect("inspect");
        if used.is_none_or(|u| u.consumers == 0) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{queue} kept its consumer"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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

/// Publishing to `exchange` with `key` is refused as unroutable: no queue is bound for it.
async fn assert_unroutable(fx: &BusFixture, exchange: &str, key: &str) {
    let err = fx
        .bus
        .publish(exchange, key, "x".into(), PublishOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, BusError::Unroutable { .. }), "{key}: {err:?}");
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
