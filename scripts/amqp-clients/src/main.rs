//! What one bus hop costs the client, with two AMQP clients side by side: lapin (the bus's
//! client today, which runs every connection's I/O on a thread of its own, `lapin-io-loop`)
//! and amqprs (whose connection reader and writer are Tokio tasks).
//!
//! One hop as the bus makes it: a persistent, mandatory publish to a quorum queue on a channel
//! in confirm mode, its delivery to a consumer on another channel of the same connection, and
//! that delivery's ack. `N` messages with `INFLIGHT` of them in flight (published, not yet
//! acked); the confirms are counted by one task (lapin) or the channel's callback (amqprs).
//! Prints the messages per second, this process's CPU (user + system, `getrusage`) and
//! context switches per message (both ends of the hop are this process), the broker's CPU per
//! message (`beam.smp`, from `/proc`) and the publish-to-delivery p50.
//!
//! ```text
//! cargo run --release --manifest-path scripts/amqp-clients/Cargo.toml -- lapin 20000 64
//! cargo run --release --manifest-path scripts/amqp-clients/Cargo.toml -- amqprs 20000 64
//! cargo run --release --manifest-path scripts/amqp-clients/Cargo.toml -- lapin 20000 64 16
//! ```
//!
//! The optional fourth argument acks every that many deliveries at once (`multiple`), as the
//! bus coalesces the acks of what is settled together (`common/src/bus/amqp/settle.rs`).
//!
//! Run it on the broker's machine (127.0.0.1:5672, guest/guest), quiet. It declares the
//! quorum queues `amqp_clients_lapin` and `amqp_clients_amqprs`, purges them first and
//! deletes them at the end.
use std::time::Instant;

/// This process's CPU seconds (user + system) and context switches (voluntary + not).
fn rusage() -> (f64, i64) {
    // SAFETY: `getrusage` fills the zeroed struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let secs = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    (
        secs(u.ru_utime) + secs(u.ru_stime),
        u.ru_nvcsw + u.ru_nivcsw,
    )
}

/// The broker's CPU seconds so far (the oldest `beam.smp`'s utime + stime).
fn broker_cpu() -> f64 {
    let pid = std::process::Command::new("pgrep")
        .args(["-o", "-x", "beam.smp"])
        .output()
        .expect("pgrep runs");
    let pid = String::from_utf8_lossy(&pid.stdout).trim().to_owned();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the broker runs here");
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    // SAFETY: `sysconf` has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let field = |i: usize| fields[i].parse::<f64>().expect("a number");
    (field(11) + field(12)) / ticks
}

/// The messages in flight: at most `inflight` published and not yet delivered, each with the
/// time it was published (a queue delivers in publish order).
#[derive(Clone)]
struct Flight {
    permits: std::sync::Arc<tokio::sync::Semaphore>,
    published: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<Instant>>>,
}

impl Flight {
    fn new(inflight: usize) -> Self {
        Self {
            permits: std::sync::Arc::new(tokio::sync::Semaphore::new(inflight)),
            published: std::sync::Arc::default(),
        }
    }

    /// Waits for room, then notes a message about to be published.
    async fn take_off(&self) {
        self.permits.acquire().await.expect("never closed").forget();
        self.published.lock().unwrap().push_back(Instant::now());
    }

    /// The oldest message in flight was delivered: its latency goes to `latencies`.
    fn landed(&self, latencies: &mut Vec<f64>) {
        if let Some(published) = self.published.lock().unwrap().pop_front() {
            latencies.push(published.elapsed().as_secs_f64());
        }
        self.permits.add_permits(1);
    }
}

/// The measured window: what the counters read when it opened.
struct Window {
    name: &'static str,
    inflight: usize,
    opened: Instant,
    process: (f64, i64),
    broker: f64,
}

impl Window {
    fn open(name: &'static str, inflight: usize) -> Self {
        Self {
            name,
            inflight,
            opened: Instant::now(),
            process: rusage(),
            broker: broker_cpu(),
        }
    }

    /// Prints the window's figures per message; `latencies` are publish-to-delivery seconds.
    fn report(self, n: usize, latencies: &mut [f64]) {
        let wall = self.opened.elapsed().as_secs_f64();
        let (cpu, switches) = rusage();
        let broker = broker_cpu();
        latencies.sort_by(f64::total_cmp);
        let p50 = latencies
            .get(latencies.len() / 2)
            .copied()
            .unwrap_or_default();
        let per = |v: f64| v / n as f64;
        println!(
            "{:7} inflight {:3}: {:7.0} msg/s  client cpu {:6.1} us/msg  ctx sw {:5.2}/msg  broker cpu {:6.1} us/msg  p50 {:6.3} ms",
            self.name,
            self.inflight,
            n as f64 / wall,
            per((cpu - self.process.0) * 1e6),
            per((switches - self.process.1) as f64),
            per((broker - self.broker) * 1e6),
            p50 * 1e3
        );
    }
}

mod lap {
    use super::*;
    use futures::StreamExt;
    use lapin::options::*;
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::{BasicProperties, Connection, ConnectionProperties};

    const NAME: &str = "lapin";

    pub async fn run(n: usize, inflight: usize, ack_every: usize) {
        let props = ConnectionProperties::default()
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio::current());
        let conn = Connection::connect("amqp://guest:guest@127.0.0.1:5672/%2f", props)
            .await
            .unwrap();
        let pubch = conn.create_channel().await.unwrap();
        pubch
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let conch = conn.create_channel().await.unwrap();
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        let q = "amqp_clients_lapin";
        pubch
            .queue_declare(
                q,
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            )
            .await
            .unwrap();
        pubch
            .queue_purge(q, QueuePurgeOptions::default())
            .await
            .unwrap();
        conch
            .basic_qos(inflight.max(1) as u16 * 2, BasicQosOptions::default())
            .await
            .unwrap();
        let mut consumer = conch
            .basic_consume(
                q,
                "c",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let body = vec![b'x'; 300];
        let flight = Flight::new(inflight);
        let window = Window::open(NAME, inflight);
        let consume = {
            let flight = flight.clone();
            tokio::spawn(async move {
                let mut lat = Vec::new();
                for received in 1..=n {
                    let d = consumer.next().await.unwrap().unwrap();
                    if received % ack_every == 0 || received == n {
                        let multiple = ack_every > 1;
                        d.ack(BasicAckOptions { multiple }).await.unwrap();
                    }
                    flight.landed(&mut lat);
                }
                lat
            })
        };
        // Confirms awaited in order by one task (as a callback would count them).
        let (ctx, mut crx) =
            tokio::sync::mpsc::unbounded_channel::<lapin::publisher_confirm::PublisherConfirm>();
        let confirms = tokio::spawn(async move {
            while let Some(c) = crx.recv().await {
                c.await.unwrap();
            }
        });
        for _ in 0..n {
            flight.take_off().await;
            let confirm = pubch
                .basic_publish(
                    "",
                    q,
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &body,
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap();
            if inflight == 1 {
                confirm.await.unwrap();
            } else {
                ctx.send(confirm).unwrap();
            }
        }
        drop(ctx);
        confirms.await.unwrap();
        let mut lat = consume.await.unwrap();
        window.report(n, &mut lat);
        let _ = pubch.queue_delete(q, QueueDeleteOptions::default()).await;
        let _ = conn.close(0, "bye").await;
    }
}

mod rs {
    use super::*;
    use amqprs::callbacks::{ChannelCallback, DefaultConnectionCallback};
    use amqprs::channel::*;
    use amqprs::connection::{Connection, OpenConnectionArguments};
    use amqprs::{Ack, Cancel, CloseChannel, Nack, Return};

    const NAME: &str = "amqprs";

    /// Counts confirms (multiple acks included) and wakes the waiter.
    struct Confirms(std::sync::Arc<(std::sync::atomic::AtomicU64, tokio::sync::Notify)>);
    #[async_trait::async_trait]
    impl ChannelCallback for Confirms {
        async fn close(
            &mut self,
            _: &Channel,
            _: CloseChannel,
        ) -> Result<(), amqprs::error::Error> {
            Ok(())
        }
        async fn cancel(&mut self, _: &Channel, _: Cancel) -> Result<(), amqprs::error::Error> {
            Ok(())
        }
        async fn flow(&mut self, _: &Channel, a: bool) -> Result<bool, amqprs::error::Error> {
            Ok(a)
        }
        async fn publish_ack(&mut self, _: &Channel, ack: Ack) {
            self.0
                .0
                .store(ack.delivery_tag(), std::sync::atomic::Ordering::SeqCst);
            self.0.1.notify_waiters();
        }
        async fn publish_nack(&mut self, _: &Channel, _: Nack) {
            panic!("nack")
        }
        async fn publish_return(&mut self, _: &Channel, _: Return, _: BasicProperties, _: Vec<u8>) {
            panic!("returned")
        }
    }
    use amqprs::{BasicProperties, FieldTable, FieldValue};

    pub async fn run(n: usize, inflight: usize, ack_every: usize) {
        let conn = Connection::open(&OpenConnectionArguments::new(
            "127.0.0.1",
            5672,
            "guest",
            "guest",
        ))
        .await
        .unwrap();
        conn.register_callback(DefaultConnectionCallback)
            .await
            .unwrap();
        let pubch = conn.open_channel(None).await.unwrap();
        let confirmed = std::sync::Arc::new((
            std::sync::atomic::AtomicU64::new(0),
            tokio::sync::Notify::new(),
        ));
        pubch
            .register_callback(Confirms(confirmed.clone()))
            .await
            .unwrap();
        pubch
            .confirm_select(ConfirmSelectArguments::default())
            .await
            .unwrap();
        let conch = conn.open_channel(None).await.unwrap();
        let q = "amqp_clients_amqprs";
        let mut args = FieldTable::new();
        args.insert(
            "x-queue-type".try_into().unwrap(),
            FieldValue::from(String::from("quorum")),
        );
        let mut decl = QueueDeclareArguments::durable_client_named(q);
        decl.arguments(args);
        pubch.queue_declare(decl).await.unwrap();
        pubch
            .queue_purge(QueuePurgeArguments::new(q))
            .await
            .unwrap();
        conch
            .basic_qos(BasicQosArguments::new(0, inflight.max(1) as u16 * 2, false))
            .await
            .unwrap();
        let (_tag, mut rx) = conch
            .basic_consume_rx(BasicConsumeArguments::new(q, "c").manual_ack(true).finish())
            .await
            .unwrap();
        let body = vec![b'x'; 300];
        let flight = Flight::new(inflight);
        let window = Window::open(NAME, inflight);
        let consume = {
            let flight = flight.clone();
            let conch = conch.clone();
            tokio::spawn(async move {
                let mut lat = Vec::new();
                for received in 1..=n {
                    let msg = rx.recv().await.unwrap();
                    let tag = msg.deliver.unwrap().delivery_tag();
                    if received % ack_every == 0 || received == n {
                        conch
                            .basic_ack(BasicAckArguments::new(tag, ack_every > 1))
                            .await
                            .unwrap();
                    }
                    flight.landed(&mut lat);
                }
                lat
            })
        };
        let mut props = BasicProperties::default();
        props.with_delivery_mode(2);
        for i in 0..n {
            flight.take_off().await;
            let waiting = confirmed.1.notified();
            pubch
                .basic_publish(
                    props.clone(),
                    body.clone(),
                    BasicPublishArguments::new("", q).mandatory(true).finish(),
                )
                .await
                .unwrap();
            if inflight == 1 {
                let mut waiting = std::pin::pin!(waiting);
                while confirmed.0.load(std::sync::atomic::Ordering::SeqCst) < (i + 1) as u64 {
                    waiting.as_mut().await;
                    waiting.set(confirmed.1.notified());
                }
            }
        }
        let mut lat = consume.await.unwrap();
        window.report(n, &mut lat);
        let _ = pubch.queue_delete(QueueDeleteArguments::new(q)).await;
        let _ = conn.close().await;
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage =
        "usage: amqp-clients lapin|amqprs MESSAGES INFLIGHT [ACK_EVERY=1 [RUNTIME_THREADS=2]]";
    let which = args.get(1).expect(usage).clone();
    let n: usize = args.get(2).expect(usage).parse().expect(usage);
    let inflight: usize = args.get(3).expect(usage).parse().expect(usage);
    // Ack every delivery, or every ACK_EVERY-th with `multiple` (as the bus coalesces acks).
    let ack_every: usize = args.get(4).map_or(1, |s| s.parse().expect(usage)).max(1);
    let threads: usize = args.get(5).map_or(2, |s| s.parse().expect(usage));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        match which.as_str() {
            "lapin" => lap::run(n, inflight, ack_every).await,
            "amqprs" => rs::run(n, inflight, ack_every).await,
            _ => panic!("{usage}"),
        }
    });
}
