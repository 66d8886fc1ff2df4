//! Dead-letter conformance tests: one function per point of the
//! [`DeadLetters`] contract, run against every backend with
//! [`dead_letters_suite!`](crate::dead_letters_suite).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::{Instant, timeout};

use super::BusFixture;
use crate::bus::dead_letters::{
    DeadLetterList, DeadLetters, DeathReason, ReplayOptions, content_id,
};
use crate::bus::memory::MemoryBus;
use crate::bus::{
    BusError, ConsumeOptions, Delivery, ExchangeKind, ExchangeSpec, PublishOptions, QueueSpec,
    QueueType, Subscription,
};

/// How long a test waits for something that must happen (RabbitMQ dead-letters
/// asynchronously).
const WAIT: Duration = Duration::from_secs(10);
/// How long a test watches for a delivery that must not come.
const IDLE: Duration = Duration::from_millis(400);

/// A bus and its dead-letter capability (the same backend) for one test.
pub struct DeadLettersFixture {
    /// The bus, its name prefix and its teardown.
    pub fx: BusFixture,
    /// The capability under test.
    pub dead_letters: Arc<dyn DeadLetters>,
}

impl DeadLettersFixture {
    /// A fixture on `fx` whose bus is also `dead_letters`.
    pub fn new(fx: BusFixture, dead_letters: Arc<dyn DeadLetters>) -> Self {
        Self { fx, dead_letters }
    }

    /// A fixture on a fresh [`MemoryBus`].
    pub fn memory() -> Self {
        let bus = MemoryBus::new();
        Self::new(
            BusFixture::new(Arc::new(bus.clone()), super::unique_prefix()),
            Arc::new(bus),
        )
    }
}

/// A work queue whose rejected and over-limit messages go to a dead queue, as in the
/// topology: direct exchange `ex`, queue `q` bound with `k`, fanout `dead` → `dead-q`.
struct Setup {
    ex: String,
    dlx: String,
    work: QueueSpec,
    dead: QueueSpec,
}

async fn setup(dx: &DeadLettersFixture, dead_type: QueueType) -> Setup {
    let fx = &dx.fx;
    let ex = fx.name("ex");
    let dlx = fx.name("dead");
    fx.bus
        .declare_exchange(&ExchangeSpec::new(&ex, ExchangeKind::Direct))
        .await
        .expect("declare exchange");
    fx.bus
        .declare_exchange(&ExchangeSpec::new(&dlx, ExchangeKind::Fanout))
        .await
        .expect("declare dead exchange");
    let dead = QueueSpec::durable(fx.name("dead-q"))
        .queue_type(dead_type)
        .bind(&dlx, "");
    fx.bus
        .declare_queue(&dead)
        .await
        .expect("declare dead queue");
    let work = QueueSpec::durable(fx.name("q"))
        .bind(&ex, "k")
        .delivery_limit(1)
        .dead_letter_exchange(&dlx);
    fx.bus
        .declare_queue(&work)
        .await
        .expect("declare work queue");
    Setup {
        ex,
        dlx,
        work,
        dead,
    }
}

async fn publish(dx: &DeadLettersFixture, exchange: &str, key: &str, body: &str) {
    dx.fx
        .bus
        .publish(
            exchange,
            key,
            Bytes::copy_from_slice(body.as_bytes()),
            PublishOptions::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("publish {body:?} to {exchange}/{key}: {e}"));
}

async fn subscribe(dx: &DeadLettersFixture, spec: &QueueSpec) -> Subscription {
    dx.fx
        .bus
        .subscribe(spec, ConsumeOptions::prefetch(1))
        .await
        .expect("subscribe")
}

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

fn text(body: &[u8]) -> &str {
    std::str::from_utf8(body).expect("utf-8 body")
}

fn bodies(list: &DeadLetterList) -> Vec<&str> {
    list.letters.iter().map(|l| text(&l.body)).collect()
}

/// Publishes `bodies` to the work queue and nacks each without requeue: dead, `rejected`.
async fn reject(dx: &DeadLettersFixture, s: &Setup, messages: &[&str]) {
    for body in messages {
        publish(dx, &s.ex, "k", body).await;
    }
    let mut sub = subscribe(dx, &s.work).await;
    for body in messages {
        let d = recv(&mut sub).await;
        assert_eq!(text(&d.body), *body);
        d.nack(false).await.expect("nack");
    }
}

/// Waits until the dead queue holds `n` messages (dead-lettering is asynchronous on a
/// broker), counting with `limit` 0 (which takes nothing), then peeks at all of them.
async fn peek_when(dx: &DeadLettersFixture, dead: &QueueSpec, n: usize) -> DeadLetterList {
    let deadline = Instant::now() + WAIT;
    loop {
        let counted = dx.dead_letters.peek(dead, 0).await.expect("count");
        assert!(counted.letters.is_empty(), "limit 0 shows nothing");
        if counted.total == n {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the dead queue holds {} messages, not {n}",
            counted.total
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let list = dx.dead_letters.peek(dead, 100).await.expect("peek");
    assert_eq!(list.total, n);
    list
}

/// A message returned past the delivery limit lands in the dead queue, where a peek shows it
/// with its origin and reason, and leaves it there.
pub async fn over_limit_message_is_peeked_with_its_origin(dx: &DeadLettersFixture) {
    let s = setup(dx, QueueType::Quorum).await;
    let body = r#"{"schema":"test.poison/1","n":1}"#;
    publish(dx, &s.ex, "k", body).await;
    let mut sub = subscribe(dx, &s.work).await;
    // Limit 1: the first delivery and one redelivery, then dead.
    for _ in 0..2 {
        recv(&mut sub).await.nack(true).await.expect("nack");
    }
    assert_idle(&mut sub).await;

    let list = peek_when(dx, &s.dead, 1).await;
    assert_eq!(list.letters.len(), 1);
    let letter = &list.letters[0];
    assert_eq!(letter.position, 1);
    assert_eq!(text(&letter.body), body);
    assert_eq!(letter.id, content_id(body.as_bytes()));
    assert_eq!(letter.schema().as_deref(), Some("test.poison/1"));
    let death = letter.death.as_ref().expect("the death is recorded");
    assert_eq!(death.exchange, s.ex);
    assert_eq!(death.routing_key, "k");
    assert_eq!(death.queue, s.work.name);
    assert_eq!(death.reason, DeathReason::DeliveryLimit);
    assert_eq!(death.count, 1);

    // Peeking changed nothing.
    let again = dx.dead_letters.peek(&s.dead, 100).await.expect("peek");
    assert_eq!(again, list);
    let mut dead = subscribe(dx, &s.dead).await;
    let d = recv(&mut dead).await;
    assert_eq!(text(&d.body), body);
    assert_idle(&mut dead).await;
    d.ack().await.expect("ack");
}

/// Peeks leave every message in place, in order, whatever the dead queue's type; only
/// consuming the dead queue takes them, each exactly once.
pub async fn peek_keeps_messages_and_order(dx: &DeadLettersFixture) {
    for queue_type in [QueueType::Quorum, QueueType::Classic] {
        let s = setup(dx, queue_type).await;
        reject(dx, &s, &["a", "b", "c"]).await;
        let all = peek_when(dx, &s.dead, 3).await;
        assert_eq!(bodies(&all), ["a", "b", "c"], "{queue_type:?}");
        assert!(all.letters.iter().all(|l| {
            l.death
                .as_ref()
                .is_some_and(|d| d.reason == DeathReason::Rejected && d.queue == s.work.name)
        }));
        assert_eq!(
            all.letters.iter().map(|l| l.position).collect::<Vec<_>>(),
            [1, 2, 3]
        );

        // A smaller peek after a whole one, and the other way round: a quorum queue would
        // rotate if only the head were given back.
        let head = dx.dead_letters.peek(&s.dead, 2).await.expect("peek");
        assert_eq!(
            (head.total, bodies(&head)),
            (3, vec!["a", "b"]),
            "{queue_type:?}"
        );
        assert_eq!(head.letters[..], all.letters[..2], "{queue_type:?}");
        let again = dx.dead_letters.peek(&s.dead, 2).await.expect("peek");
        assert_eq!(again, head, "{queue_type:?}");
        let whole = dx.dead_letters.peek(&s.dead, 10).await.expect("peek");
        assert_eq!(whole, all, "{queue_type:?}");
        let one = dx.dead_letters.peek(&s.dead, 1).await.expect("peek");
        assert_eq!(bodies(&one), ["a"], "{queue_type:?}");
        assert_eq!(
            dx.dead_letters.peek(&s.dead, 0).await.expect("peek").total,
            3
        );

        let mut dead = subscribe(dx, &s.dead).await;
        for expected in ["a", "b", "c"] {
            let d = recv(&mut dead).await;
            assert_eq!(text(&d.body), expected, "{queue_type:?}");
            d.ack().await.expect("ack");
        }
        assert_idle(&mut dead).await;
        drop(dead);
        // The next round declares the same names with another dead-queue type.
        dx.fx.bus.delete_queue(&s.work.name).await.expect("delete");
        dx.fx.bus.delete_queue(&s.dead.name).await.expect("delete");
    }
}

/// A replayed message goes back to the queue it died in, as a first delivery, and leaves the
/// dead queue.
pub async fn replay_returns_a_message_to_its_queue(dx: &DeadLettersFixture) {
    let s = setup(dx, QueueType::Quorum).await;
    reject(dx, &s, &["again"]).await;
    peek_when(dx, &s.dead, 1).await;

    let report = dx
        .dead_letters
        .replay(&s.dead, &ReplayOptions::default())
        .await
        .expect("replay");
    assert_eq!((report.examined, report.replayed), (1, 1));
    assert!(report.is_complete(), "{report:?}");
    assert_eq!(
        dx.dead_letters.peek(&s.dead, 10).await.expect("peek").total,
        0
    );

    let mut sub = subscribe(dx, &s.work).await;
    let d = recv(&mut sub).await;
    assert_eq!(text(&d.body), "again");
    assert_eq!(d.exchange, s.ex);
    assert_eq!(d.routing_key, "k");
    assert_eq!(d.delivery_count, 0, "a replay is a first delivery");
    assert!(!d.redelivered);
    d.ack().await.expect("ack");
    assert_idle(&mut sub).await;
}

/// `limit` replays from the head; `id` replays only the matching messages; the others stay
/// in order.
pub async fn replay_selects_by_limit_and_id(dx: &DeadLettersFixture) {
    let s = setup(dx, QueueType::Quorum).await;
    reject(dx, &s, &["a", "b", "c"]).await;
    peek_when(dx, &s.dead, 3).await;

    let first = ReplayOptions {
        limit: Some(1),
        id: None,
    };
    let report = dx
        .dead_letters
        .replay(&s.dead, &first)
        .await
        .expect("replay");
    assert_eq!(report.replayed, 1);
    assert_eq!(bodies(&peek_when(dx, &s.dead, 2).await), ["b", "c"]);

    let only_c = ReplayOptions {
        limit: None,
        id: Some(content_id(b"c")),
    };
    let report = dx
        .dead_letters
        .replay(&s.dead, &only_c)
        .await
        .expect("replay");
    assert_eq!((report.examined, report.replayed), (2, 1));
    assert!(report.is_complete(), "{report:?}");
    assert_eq!(bodies(&peek_when(dx, &s.dead, 1).await), ["b"]);

    let nobody = ReplayOptions {
        limit: None,
        id: Some("no-such-id".into()),
    };
    let report = dx
        .dead_letters
        .replay(&s.dead, &nobody)
        .await
        .expect("replay");
    assert_eq!((report.examined, report.replayed), (1, 0));
    assert!(
        report.is_complete(),
        "nothing selected, nothing left behind"
    );
    assert_eq!(bodies(&peek_when(dx, &s.dead, 1).await), ["b"]);

    let mut sub = subscribe(dx, &s.work).await;
    for expected in ["a", "c"] {
        let d = recv(&mut sub).await;
        assert_eq!(text(&d.body), expected);
        d.ack().await.expect("ack");
    }
    assert_idle(&mut sub).await;
}

/// A message without a recorded origin, or whose origin refuses it, stays dead and is
/// reported; the others are replayed.
pub async fn replay_leaves_what_it_cannot_send_back(dx: &DeadLettersFixture) {
    let s = setup(dx, QueueType::Quorum).await;
    let gone = QueueSpec::durable(dx.fx.name("gone"))
        .bind(&s.ex, "gone")
        .dead_letter_exchange(&s.dlx);
    dx.fx.bus.declare_queue(&gone).await.expect("declare");
    publish(dx, &s.ex, "gone", "stuck").await;
    let mut sub = subscribe(dx, &gone).await;
    recv(&mut sub).await.nack(false).await.expect("nack");
    drop(sub);
    reject(dx, &s, &["fine"]).await;
    publish(dx, &s.dlx, "", "orphan").await;
    peek_when(dx, &s.dead, 3).await;
    // Nothing is bound for `gone` anymore: replaying `stuck` is unroutable.
    dx.fx.bus.delete_queue(&gone.name).await.expect("delete");

    let report = dx
        .dead_letters
        .replay(&s.dead, &ReplayOptions::default())
        .await
        .expect("replay");
    assert_eq!((report.examined, report.replayed), (3, 1));
    assert!(report.interrupted.is_none(), "{report:?}");
    assert_eq!(report.left_in_place(), 2);
    assert_eq!(report.failed.len(), 1);
    assert_eq!(text(&report.failed[0].0.body), "stuck");
    assert!(
        matches!(&report.failed[0].1, BusError::Unroutable { routing_key, .. } if routing_key == "gone"),
        "{:?}",
        report.failed[0].1
    );
    assert_eq!(report.without_origin.len(), 1);
    assert_eq!(text(&report.without_origin[0].body), "orphan");
    assert_eq!(
        bodies(&peek_when(dx, &s.dead, 2).await),
        ["stuck", "orphan"]
    );

    let mut work = subscribe(dx, &s.work).await;
    assert_eq!(text(&recv(&mut work).await.body), "fine");
}

/// What a replay leaves stays in order: a message kept before the limit was reached stays
/// ahead of the ones the replay did not get to.
pub async fn replay_keeps_the_order_of_what_it_leaves(dx: &DeadLettersFixture) {
    let s = setup(dx, QueueType::Quorum).await;
    publish(dx, &s.dlx, "", "orphan").await;
    peek_when(dx, &s.dead, 1).await;
    reject(dx, &s, &["x", "y"]).await;
    peek_when(dx, &s.dead, 3).await;

    let one = ReplayOptions {
        limit: Some(1),
        id: None,
    };
    let report = dx.dead_letters.replay(&s.dead, &one).await.expect("replay");
    assert_eq!((report.examined, report.replayed), (2, 1));
    assert_eq!(report.without_origin.len(), 1);
    assert_eq!(bodies(&peek_when(dx, &s.dead, 2).await), ["orphan", "y"]);
    let mut work = subscribe(dx, &s.work).await;
    assert_eq!(text(&recv(&mut work).await.body), "x");
}

/// A replayed message that dies again at once is not replayed again by the same call.
pub async fn replay_is_one_pass(dx: &DeadLettersFixture) {
    let s = setup(dx, QueueType::Quorum).await;
    reject(dx, &s, &["poison"]).await;
    peek_when(dx, &s.dead, 1).await;
    // A consumer that still rejects everything.
    let mut sub = subscribe(dx, &s.work).await;
    let rejecter = tokio::spawn(async move {
        while let Ok(d) = sub.next().await {
            let _ = d.nack(false).await;
        }
    });
    let report = dx
        .dead_letters
        .replay(&s.dead, &ReplayOptions::default())
        .await
        .expect("replay");
    assert_eq!(report.replayed, 1, "{report:?}");
    // It died again, once.
    let list = peek_when(dx, &s.dead, 1).await;
    assert_eq!(bodies(&list), ["poison"]);
    rejecter.abort();
}

/// Purge deletes every dead letter and says how many.
pub async fn purge_empties_the_dead_queue(dx: &DeadLettersFixture) {
    let s = setup(dx, QueueType::Quorum).await;
    reject(dx, &s, &["a", "b"]).await;
    peek_when(dx, &s.dead, 2).await;
    assert_eq!(dx.dead_letters.purge(&s.dead).await.expect("purge"), 2);
    let list = dx.dead_letters.peek(&s.dead, 10).await.expect("peek");
    assert_eq!((list.total, list.letters.len()), (0, 0));
    assert_eq!(dx.dead_letters.purge(&s.dead).await.expect("purge"), 0);
    let mut dead = subscribe(dx, &s.dead).await;
    assert_idle(&mut dead).await;
}

/// Every operation on a missing queue is `NotFound`.
pub async fn missing_queue_is_not_found(dx: &DeadLettersFixture) {
    let missing = QueueSpec::durable(dx.fx.name("missing"));
    let err = dx.dead_letters.peek(&missing, 10).await.unwrap_err();
    assert!(matches!(err, BusError::NotFound(_)), "{err:?}");
    let err = dx
        .dead_letters
        .replay(&missing, &ReplayOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, BusError::NotFound(_)), "{err:?}");
    let err = dx.dead_letters.purge(&missing).await.unwrap_err();
    assert!(matches!(err, BusError::NotFound(_)), "{err:?}");
}
