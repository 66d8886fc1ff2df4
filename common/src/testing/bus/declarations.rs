//! Declarations: idempotence and conflicts, bindings of a live exclusive queue, and the
//! exclusive queue's life.

use std::time::Duration;

use super::{
    WAIT, assert_idle, assert_unroutable, exchange, publish, recv, subscribe, text, wait_unconsumed,
};
use crate::bus::{
    Binding, BusError, ExchangeKind, ExchangeSpec, PublishOptions, QueueSpec, QueueUse,
};
use crate::testing::BusFixture;

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
    assert_unroutable(fx, &ex, "ws.conv.run2").await;
    let d = recv(&mut sub).await;
    assert_eq!(text(&d), "for run1");
    d.ack().await.expect("ack");

    fx.bus.unbind(&spec.name, &run1).await.expect("unbind");
    fx.bus
        .unbind(&spec.name, &run1)
        .await
        .expect("unbind is idempotent");
    assert_unroutable(fx, &ex, "ws.conv.run1").await;
    fx.bus
        .bind(&spec.name, &Binding::new(&ex, "*.*.run2"))
        .await
        .expect("bind");
    publish(fx, &ex, "ws._.run2", "for run2").await;
    let d = recv(&mut sub).await;
    assert_eq!(text(&d), "for run2");
    d.ack().await.expect("ack");

    // A key without wildcards matches itself only, and goes with its unbinding too.
    let exact = Binding::new(&ex, "ws.conv.run3");
    fx.bus.bind(&spec.name, &exact).await.expect("bind");
    publish(fx, &ex, "ws.conv.run3", "for run3").await;
    let d = recv(&mut sub).await;
    assert_eq!(text(&d), "for run3");
    d.ack().await.expect("ack");
    fx.bus.unbind(&spec.name, &exact).await.expect("unbind");
    assert_unroutable(fx, &ex, "ws.conv.run3").await;
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

/// A queue is inspected without being created, and retired only while nothing waits in it
/// and nobody consumes it.
pub async fn retiring_a_queue_spares_one_in_use(fx: &BusFixture) {
    let name = fx.name("retired");
    assert_eq!(fx.bus.inspect_queue(&name).await.expect("inspect"), None);
    assert_eq!(
        fx.bus.inspect_queue(&name).await.expect("inspect"),
        None,
        "inspecting created nothing"
    );
    fx.bus.retire_queue(&name).await.expect("a missing queue");

    let ex = exchange(fx, "ex", ExchangeKind::Direct).await;
    let spec = QueueSpec::durable(&name).bind(&ex, "k");
    fx.bus.declare_queue(&spec).await.expect("declare");
    let idle = QueueUse::default();
    assert_eq!(
        fx.bus.inspect_queue(&name).await.expect("inspect"),
        Some(idle)
    );
    publish(fx, &ex, "k", "waiting").await;
    let waiting = fx.bus.inspect_queue(&name).await.expect("inspect");
    assert_eq!(waiting.map(|u| u.messages), Some(1), "{waiting:?}");
    let err = fx.bus.retire_queue(&name).await.unwrap_err();
    assert!(
        matches!(err, BusError::DeclarationConflict { .. }),
        "{err:?}"
    );

    // Consumed: refused as well, and the message is still there.
    let mut sub = subscribe(fx, &spec, 10).await;
    let consumed = fx.bus.inspect_queue(&name).await.expect("inspect");
    assert_eq!(consumed.map(|u| u.consumers), Some(1), "{consumed:?}");
    let err = fx.bus.retire_queue(&name).await.unwrap_err();
    assert!(
        matches!(err, BusError::DeclarationConflict { .. }),
        "{err:?}"
    );
    let d = recv(&mut sub).await;
    assert_eq!(text(&d), "waiting");
    d.ack().await.expect("ack");
    drop(sub);
    wait_unconsumed(fx, &name).await;

    fx.bus
        .retire_queue(&name)
        .await
        .expect("retire an idle queue");
    assert_eq!(fx.bus.inspect_queue(&name).await.expect("inspect"), None);
}
