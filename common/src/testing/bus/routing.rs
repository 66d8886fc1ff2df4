//! Routing: topic wildcards, fanout, and the SPEC §3 topology end to end.

use super::{
    assert_idle, assert_unroutable, exchange, publish, recv, subscribe, text, wait_unconsumed,
};
use crate::bus::{Binding, BusError, ExchangeKind, PublishOptions, QueueSpec, QueueType};
use crate::testing::BusFixture;

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
    assert_unroutable(fx, &ex, "b.c.d").await;
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

/// Lowering a shard count: a shard queue above the new count that still holds a message
/// stops the declaration (nothing is deleted); once drained, the queues above the count are
/// deleted.
pub async fn a_lowered_shard_count_retires_the_shards_above_it(fx: &BusFixture) {
    use crate::bus::topology::{TopologyOptions, declare_topology, shard_routing_key};
    use std::num::NonZeroU32;

    let shards = |events: u32, results: u32| TopologyOptions {
        name_prefix: format!("{}switchboard", fx.prefix()),
        events_shards: NonZeroU32::new(events).expect("non-zero"),
        results_shards: NonZeroU32::new(results).expect("non-zero"),
        pools: vec!["default".into()],
        queue_type: QueueType::Quorum,
        delivery_limit: Some(3),
    };
    let wide = declare_topology(fx.bus.as_ref(), &shards(3, 2))
        .await
        .expect("declare 3 + 2 shards");
    for exchange in wide.exchanges() {
        fx.remember(exchange.name);
    }
    for queue in wide.durable_queues() {
        fx.remember(queue.name);
    }
    publish(
        fx,
        &wide.events_exchange(),
        &shard_routing_key(2),
        "stranded",
    )
    .await;

    let err = declare_topology(fx.bus.as_ref(), &shards(1, 1))
        .await
        .unwrap_err();
    let stranded = wide.events_queue(2).name;
    assert!(
        matches!(&err, BusError::DeclarationConflict { name, .. } if *name == stranded),
        "{err:?}"
    );
    for queue in wide.durable_queues() {
        let found = fx.bus.inspect_queue(&queue.name).await.expect("inspect");
        assert!(found.is_some(), "{} was deleted", queue.name);
    }

    let mut sub = subscribe(fx, &wide.events_queue(2), 10).await;
    let d = recv(&mut sub).await;
    assert_eq!(text(&d), "stranded");
    d.ack().await.expect("ack");
    drop(sub);
    wait_unconsumed(fx, &stranded).await;

    let narrow = declare_topology(fx.bus.as_ref(), &shards(1, 1))
        .await
        .expect("declare 1 + 1 shards once drained");
    for gone in [
        wide.events_queue(1),
        wide.events_queue(2),
        wide.results_queue(1),
    ] {
        let found = fx.bus.inspect_queue(&gone.name).await.expect("inspect");
        assert_eq!(found, None, "{} is left", gone.name);
    }
    for kept in [narrow.events_queue(0), narrow.results_queue(0)] {
        let found = fx.bus.inspect_queue(&kept.name).await.expect("inspect");
        assert!(found.is_some(), "{} is gone", kept.name);
    }
}
