//! Steering claims and the conversation concurrency policy (SPEC §7), end to end through
//! the orchestrator's event router and result sink.
//!
//! Every scenario is a plain `async fn` over [`Backends`] (trait objects only: no
//! memory-backend specifics), and `suite!` instantiates them per backend. The embedded
//! backends (`MemoryBus`, `MemorySessionStore`, in-memory SQLite) always run; a RabbitMQ /
//! Redis / Postgres instantiation only needs another constructor returning [`Backends`].

use sb_common::session::announce_routing_change;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sb_common::bus::topology::Topology;
use sb_common::bus::{Bus, ConsumeOptions, PublishOptions, QueueSpec, Subscription};
use sb_common::retry::RetryPolicy;
use sb_common::session::{PullMode, SessionStore, cancel_flag_key};
use sb_common::shutdown::Shutdown;
use sb_orchestrator::concurrency::ConversationKey;
use sb_orchestrator::events::{EventRouter, RouteOutcome};
use sb_orchestrator::reaper::Reaper;
use sb_orchestrator::sink::ResultSink;
use sb_orchestrator::{Orchestrator, OrchestratorDeps, OrchestratorError, OrchestratorOptions};
use sb_protocol::context::{ActorContext, AgentInput, DeliveryContext};
use sb_protocol::host::AgentEventEnvelope;
use sb_protocol::ids::{EventId, RunId, WorkspaceId};
use sb_protocol::messages::{self, ControlMessage, EventMessage, ResultMessage, RunJob};
use sb_protocol::proxy::SteeringItem;
use sb_protocol::result::AgentRunResult;
use sb_store::{
    EventQuery, EventStatus, NewAgent, NewEvent, RunFilter, RunStatus, RunnerRow, Stores,
    TranscriptQuery,
};
use serde_json::{Value, json};

mod support;

use support::eventually;

const WS: &str = "default";
const STEERING_RUNNER: &str = "plugin:acme/steer/default";
const PLAIN_RUNNER: &str = "plugin:acme/echo/default";

/// The backends one scenario runs on.
struct Backends {
    bus: Arc<dyn Bus>,
    sessions: Arc<dyn SessionStore>,
    stores: Stores,
    topology: Topology,
    /// Cleans up shared servers when the scenario ends (also on panic).
    _teardown: Option<Box<dyn std::any::Any + Send>>,
}

async fn memory() -> Backends {
    let b = support::memory_backends(2).await;
    Backends {
        bus: b.bus,
        sessions: b.sessions,
        stores: b.stores,
        topology: b.topology,
        _teardown: None,
    }
}

/// RabbitMQ + Redis + Postgres, each test with its own names, key prefix and schema.
#[cfg(feature = "cluster-tests")]
async fn cluster() -> Backends {
    use sb_common::bus::amqp::{AmqpBus, AmqpOptions};
    use sb_common::session::redis::{RedisOptions, RedisSessionStore};
    use sb_common::testing::{run_detached, unique_prefix};

    struct Teardown {
        amqp: AmqpOptions,
        redis: RedisOptions,
        names: Vec<String>,
        _db: sb_store::testing::TestDb,
    }
    impl Drop for Teardown {
        fn drop(&mut self) {
            let (amqp, redis, names) = (
                self.amqp.clone(),
                self.redis.clone(),
                std::mem::take(&mut self.names),
            );
            run_detached(move || async move {
                if let Ok(bus) = AmqpBus::connect(amqp).await {
                    for name in &names {
                        let _ = bus.delete_queue(name).await;
                        let _ = bus.delete_exchange(name).await;
                    }
                    let _ = bus.close().await;
                }
                if let Ok(store) = RedisSessionStore::connect(&redis).await {
                    let _ = store.delete_all().await;
                }
            });
        }
    }

    let amqp_url = std::env::var("SWITCHBOARD_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let redis_url = std::env::var("SWITCHBOARD_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let prefix = unique_prefix();
    let amqp = AmqpOptions::new(amqp_url, format!("{prefix}orchestrator-test"));
    let redis = RedisOptions::new(redis_url, prefix);
    let bus: Arc<dyn Bus> = Arc::new(AmqpBus::connect(amqp.clone()).await.expect("rabbitmq"));
    let sessions = Arc::new(RedisSessionStore::connect(&redis).await.expect("redis"));
    let topology = support::declare(bus.as_ref(), &support::sharded_topology(2)).await;
    let db = sb_store::testing::postgres_db().await;
    let names = topology
        .durable_queues()
        .into_iter()
        .map(|q| q.name)
        .chain(topology.exchanges().into_iter().map(|e| e.name))
        .collect();
    Backends {
        bus,
        sessions,
        stores: db.stores.clone(),
        topology,
        _teardown: Some(Box::new(Teardown {
            amqp,
            redis,
            names,
            _db: db,
        })),
    }
}

/// Instantiates every scenario for one backend constructor.
macro_rules! suite {
    ($backend:ident: $($scenario:ident),* $(,)?) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(super::$backend().await).await;
                }
            )*
        }
    };
}

#[cfg(feature = "cluster-tests")]
suite!(cluster:
    message_is_claimed_into_the_active_steering_run,
    full_steering_queue_dispatches_normally,
    runner_without_steering_starts_a_new_run,
    thread_mismatch_starts_a_new_run,
    concurrent_routers_claim_once,
    concurrent_routers_start_one_run,
    parallel_policy_runs_both,
    reject_policy_rejects_while_busy,
    enqueue_policy_starts_in_arrival_order,
    interrupt_policy_cancels_then_starts,
    reaper_audits_unpulled_steering_items,
    sweep_releases_a_stranded_queue,
    finishing_a_run_releases_the_parked_head,
);

suite!(memory:
    message_is_claimed_into_the_active_steering_run,
    full_steering_queue_dispatches_normally,
    runner_without_steering_starts_a_new_run,
    thread_mismatch_starts_a_new_run,
    concurrent_routers_claim_once,
    concurrent_routers_start_one_run,
    parallel_policy_runs_both,
    reject_policy_rejects_while_busy,
    enqueue_policy_starts_in_arrival_order,
    interrupt_policy_cancels_then_starts,
    reaper_audits_unpulled_steering_items,
    sweep_releases_a_stranded_queue,
    finishing_a_run_releases_the_parked_head,
);

struct Harness {
    b: Backends,
    options: OrchestratorOptions,
}

fn ws() -> WorkspaceId {
    WorkspaceId::new(WS).unwrap()
}

impl Harness {
    fn new(b: Backends) -> Self {
        Self {
            b,
            options: OrchestratorOptions {
                retry: RetryPolicy::new(Duration::from_millis(10), Duration::from_millis(50)),
                ..OrchestratorOptions::default()
            },
        }
    }

    fn deps(&self) -> OrchestratorDeps {
        support::deps(
            self.b.bus.clone(),
            self.b.sessions.clone(),
            self.b.stores.clone(),
            self.b.topology.clone(),
        )
    }

    fn router(&self) -> EventRouter {
        EventRouter::new(self.deps(), Arc::new(self.options.clone()))
    }

    async fn spawn(&self, shutdown: &Shutdown) -> Orchestrator {
        Orchestrator::spawn(self.deps(), self.options.clone(), shutdown)
            .await
            .unwrap()
    }

    async fn register_runner(&self, id: &str, steering: bool) {
        let parsed: sb_protocol::manifest::RunnerId = id.parse().unwrap();
        let descriptor = json!({
            "id": id,
            "label": {"en_US": "Runner"},
            "plugin_author": parsed.author(),
            "plugin_name": parsed.plugin(),
            "runner_name": parsed.runner(),
            "pool": "default",
            "permissions": {"history": ["page"]},
            "capabilities": {"streaming": true, "steering": steering},
        });
        self.b
            .stores
            .runners
            .upsert(RunnerRow {
                id: id.into(),
                plugin_id: parsed.plugin_id(),
                pool: "default".into(),
                version: "1.0.0".into(),
                descriptor,
                seen_at: Utc::now(),
            })
            .await
            .unwrap();
        // As a worker's registration does: routing caches reload.
        announce_routing_change(self.b.sessions.as_ref())
            .await
            .unwrap();
    }

    /// One agent for `runner` handling the whole workspace with `concurrency`.
    async fn agent(&self, runner: &str, steering: bool, concurrency: &str, runner_config: Value) {
        self.register_runner(runner, steering).await;
        self.b
            .stores
            .agents
            .create(NewAgent {
                id: None,
                workspace_id: ws(),
                name: "agent".into(),
                description: None,
                runner_id: runner.into(),
                runner_config,
                event_types: json!(["message.received"]),
                scope: json!({}),
                filters: json!([]),
                resource_policy: json!({}),
                state_policy: json!({}),
                delivery_policy: json!({"concurrency": concurrency}),
                budgets: json!({}),
                enabled: true,
                routing: sb_store::AgentRouting::Scope,
            })
            .await
            .unwrap();
        // As the gateway's agent routes do: routing caches reload.
        announce_routing_change(self.b.sessions.as_ref())
            .await
            .unwrap();
    }

    /// Appends a `message.received` (as the gateway would) and returns its id.
    async fn ingest(&self, conversation: &str, thread: Option<&str>, text: &str) -> EventId {
        let event_id = EventId::new();
        let envelope = AgentEventEnvelope {
            event_id,
            workspace_id: ws(),
            event_type: "message.received".into(),
            event_time: Some(Utc::now().timestamp()),
            source: "api".into(),
            source_event_type: None,
            bot_id: Some("bot1".into()),
            conversation_id: Some(conversation.into()),
            thread_id: thread.map(Into::into),
            actor: Some(ActorContext {
                actor_type: "user".into(),
                actor_id: Some("alice".into()),
                actor_name: None,
                metadata: Default::default(),
            }),
            subject: None,
            input: AgentInput {
                text: Some(text.into()),
                ..Default::default()
            },
            delivery: DeliveryContext::new("api"),
            raw_ref: None,
            data: Default::default(),
            metadata: Default::default(),
        };
        let mut event = NewEvent::new(ws(), "message.received", "api");
        event.id = Some(event_id);
        event.conversation_id = Some(conversation.into());
        event.thread_id = thread.map(Into::into);
        event.input_summary = Some(text.into());
        event.envelope = Some(serde_json::to_value(&envelope).unwrap());
        self.b
            .stores
            .events
            .append(event, Vec::new())
            .await
            .unwrap();
        event_id
    }

    async fn route(&self, event_id: EventId) -> RouteOutcome {
        self.router()
            .route(&EventMessage::new(ws(), event_id))
            .await
            .unwrap()
    }

    async fn dispatched(&self, conversation: &str, text: &str) -> RunId {
        let event_id = self.ingest(conversation, None, text).await;
        match self.route(event_id).await {
            RouteOutcome::Dispatched { run_id, .. } => run_id,
            other => panic!("expected a dispatch, got {other:?}"),
        }
    }

    async fn publish_event(&self, event_id: EventId, conversation: &str) {
        self.b
            .bus
            .publish(
                &self.b.topology.events_exchange(),
                &self.b.topology.events_routing_key(WS, Some(conversation)),
                messages::encode(&EventMessage::new(ws(), event_id)).into(),
                PublishOptions::default(),
            )
            .await
            .unwrap();
    }

    /// What a worker would do for a run that completes: claim it, publish its terminal item,
    /// end its session (the sink applies the terminal).
    async fn complete(&self, run_id: RunId, conversation: &str) {
        assert!(self.b.stores.runs.claim_run(run_id, "w1").await.unwrap());
        let result: AgentRunResult =
            serde_json::from_value(json!({"type": "run.completed", "data": {"message": {"role": "assistant", "content": "done"}}}))
                .unwrap();
        let msg = ResultMessage::new(run_id, ws(), Some(conversation.into()), 1, result);
        self.b
            .bus
            .publish(
                &self.b.topology.results_exchange(),
                &self.b.topology.results_routing_key(&run_id),
                messages::encode(&msg).into(),
                PublishOptions::default(),
            )
            .await
            .unwrap();
        self.b.sessions.end_session(&run_id).await.unwrap();
        eventually("the run to complete", || async {
            self.run_status(run_id).await == RunStatus::Completed
        })
        .await;
    }

    async fn run_status(&self, run_id: RunId) -> RunStatus {
        self.b
            .stores
            .runs
            .get_run(run_id)
            .await
            .unwrap()
            .unwrap()
            .status
    }

    async fn run_count(&self) -> usize {
        self.b
            .stores
            .runs
            .list_runs(RunFilter::workspace(ws()), None, Some(100))
            .await
            .unwrap()
            .items
            .len()
    }

    async fn event(&self, event_id: EventId) -> sb_store::EventRecord {
        self.b.stores.events.get(event_id).await.unwrap().unwrap()
    }

    async fn jobs(&self) -> Subscription {
        self.b
            .bus
            .subscribe(
                &self.b.topology.runs_queue("default"),
                ConsumeOptions::prefetch(100),
            )
            .await
            .unwrap()
    }

    async fn cancels(&self) -> Subscription {
        let queue = QueueSpec::exclusive(format!("{}.test", self.b.topology.control_exchange()))
            .bind(self.b.topology.control_exchange(), "cancel.*");
        self.b
            .bus
            .subscribe(&queue, ConsumeOptions::prefetch(100))
            .await
            .unwrap()
    }
}

async fn next_job(sub: &mut Subscription) -> RunJob {
    let d = tokio::time::timeout(Duration::from_secs(5), sub.next())
        .await
        .expect("a job in time")
        .unwrap();
    let job = messages::decode::<RunJob>(&d.body).unwrap();
    d.ack().await.unwrap();
    job
}

async fn no_job(sub: &mut Subscription, quiet: Duration) {
    if let Ok(d) = tokio::time::timeout(quiet, sub.next()).await {
        let job = messages::decode::<RunJob>(&d.unwrap().body).unwrap();
        panic!("unexpected job for event {}", job.context.event.event_id);
    }
}

fn conversation_key(conversation: &str) -> ConversationKey {
    ConversationKey::new(&ws(), Some(conversation)).unwrap()
}

// ---------------------------------------------------------------------------------------
// Steering
// ---------------------------------------------------------------------------------------

async fn message_is_claimed_into_the_active_steering_run(b: Backends) {
    let h = Harness::new(b);
    h.agent(STEERING_RUNNER, true, "parallel", json!({})).await;
    let run = h.dispatched("c1", "start").await;

    let follow_up = h.ingest("c1", None, "and also this").await;
    assert_eq!(
        h.route(follow_up).await,
        RouteOutcome::Claimed { run_id: run }
    );
    assert_eq!(h.run_count().await, 1, "a claimed message starts no run");

    let event = h.event(follow_up).await;
    assert_eq!(event.status, EventStatus::Claimed);
    assert_eq!(event.claimed_by_run_id, Some(run));
    assert_eq!(event.run_id, None);
    let steering = &event.metadata["steering"];
    assert_eq!(steering["status"], "queued");
    assert_eq!(steering["trigger_behavior"], "absorbed_into_active_run");
    assert_eq!(steering["claimed_by_run_id"], run.to_string());
    assert_eq!(steering["claimed_runner_id"], STEERING_RUNNER);

    // written to the transcript like any user message
    let page =
        h.b.stores
            .transcript
            .page(TranscriptQuery::new(ws(), "c1"))
            .await
            .unwrap();
    assert!(
        page.items
            .iter()
            .any(|i| i.role == "user" && i.content.as_deref() == Some("and also this"))
    );

    // a redelivery claims nothing more
    assert_eq!(h.route(follow_up).await, RouteOutcome::AlreadyHandled);
    assert_eq!(h.b.sessions.steering_len(&run).await.unwrap(), 1);

    // the item is the protocol shape the worker's steering_pull returns
    let items =
        h.b.sessions
            .steering_pull(&run, 100, PullMode::All)
            .await
            .unwrap();
    assert_eq!(items.len(), 1);
    let item: SteeringItem = serde_json::from_value(items[0].clone()).unwrap();
    assert_eq!(item.claimed_run_id, run.to_string());
    assert_eq!(item.runner_id, STEERING_RUNNER);
    assert_eq!(item.event.event_id, follow_up.to_string());
    assert_eq!(item.input.text.as_deref(), Some("and also this"));
    assert_eq!(item.conversation.conversation_id.as_deref(), Some("c1"));
    assert_eq!(item.conversation.workspace_id.as_deref(), Some(WS));
    assert_eq!(steering["claimed_at"], item.claimed_at);

    // once the run has ended, the next message starts a new run
    h.b.sessions.end_session(&run).await.unwrap();
    let after = h.ingest("c1", None, "new topic").await;
    assert!(matches!(
        h.route(after).await,
        RouteOutcome::Dispatched { run_id, .. } if run_id != run
    ));
}

async fn full_steering_queue_dispatches_normally(b: Backends) {
    let mut h = Harness::new(b);
    h.options.steering_queue_cap = 2;
    h.agent(STEERING_RUNNER, true, "parallel", json!({})).await;
    let run = h.dispatched("c1", "start").await;
    for i in 0..2 {
        let e = h.ingest("c1", None, &format!("more {i}")).await;
        assert_eq!(h.route(e).await, RouteOutcome::Claimed { run_id: run });
    }
    let overflow = h.ingest("c1", None, "one too many").await;
    let RouteOutcome::Dispatched { run_id: second, .. } = h.route(overflow).await else {
        panic!("a full queue dispatches normally");
    };
    assert_ne!(second, run);
    assert_eq!(h.b.sessions.steering_len(&run).await.unwrap(), 2);
    let event = h.event(overflow).await;
    assert_eq!(event.status, EventStatus::Dispatched);
    assert_eq!(event.claimed_by_run_id, None);
    assert_eq!(h.run_count().await, 2);
}

async fn runner_without_steering_starts_a_new_run(b: Backends) {
    let h = Harness::new(b);
    h.agent(PLAIN_RUNNER, false, "parallel", json!({})).await;
    let first = h.dispatched("c1", "one").await;
    let second = h.dispatched("c1", "two").await;
    assert_ne!(first, second);
    assert_eq!(h.b.sessions.steering_len(&first).await.unwrap(), 0);
    assert_eq!(h.run_count().await, 2);
}

async fn thread_mismatch_starts_a_new_run(b: Backends) {
    let h = Harness::new(b);
    h.agent(STEERING_RUNNER, true, "parallel", json!({})).await;
    let first = h.ingest("c1", Some("t1"), "in thread one").await;
    let RouteOutcome::Dispatched { run_id: run, .. } = h.route(first).await else {
        panic!()
    };
    let other_thread = h.ingest("c1", Some("t2"), "in thread two").await;
    assert!(matches!(
        h.route(other_thread).await,
        RouteOutcome::Dispatched { run_id, .. } if run_id != run
    ));
    let no_thread = h.ingest("c1", None, "no thread").await;
    assert!(matches!(
        h.route(no_thread).await,
        RouteOutcome::Dispatched { run_id, .. } if run_id != run
    ));
    // the same thread is claimed
    let same = h.ingest("c1", Some("t1"), "same thread").await;
    assert_eq!(h.route(same).await, RouteOutcome::Claimed { run_id: run });
}

/// Routes one event on two routers at once (two orchestrator processes that both received
/// it); a router told that the other is busy with it retries, as the requeue would.
async fn route_on_two_routers(h: &Harness, event_id: EventId) -> Vec<RouteOutcome> {
    let routers = [Arc::new(h.router()), Arc::new(h.router())];
    let tasks: Vec<_> = routers
        .iter()
        .map(|router| {
            let router = Arc::clone(router);
            tokio::spawn(async move {
                let message = EventMessage::new(ws(), event_id);
                loop {
                    match router.route(&message).await {
                        Ok(outcome) => return outcome,
                        Err(OrchestratorError::RouteInProgress(_)) => {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        Err(e) => panic!("routing failed: {e}"),
                    }
                }
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.unwrap());
    }
    outcomes
}

async fn concurrent_routers_claim_once(b: Backends) {
    let h = Harness::new(b);
    h.agent(STEERING_RUNNER, true, "parallel", json!({})).await;
    let run = h.dispatched("c1", "start").await;
    for i in 0..20 {
        let e = h.ingest("c1", None, &format!("steer {i}")).await;
        let mut outcomes = route_on_two_routers(&h, e).await;
        outcomes.sort_by_key(|o| matches!(o, RouteOutcome::AlreadyHandled));
        assert_eq!(
            outcomes,
            [
                RouteOutcome::Claimed { run_id: run },
                RouteOutcome::AlreadyHandled
            ],
            "event {i}"
        );
    }
    assert_eq!(h.b.sessions.steering_len(&run).await.unwrap(), 20);
    assert_eq!(h.run_count().await, 1);
    let items =
        h.b.sessions
            .steering_pull(&run, 100, PullMode::All)
            .await
            .unwrap();
    let texts: Vec<_> = items
        .iter()
        .map(|i| i["input"]["text"].as_str().unwrap().to_owned())
        .collect();
    let expected: Vec<_> = (0..20).map(|i| format!("steer {i}")).collect();
    assert_eq!(texts, expected, "one item per event, FIFO");
}

async fn concurrent_routers_start_one_run(b: Backends) {
    let h = Harness::new(b);
    // A steering runner with `enqueue`: the second router must neither claim the event into
    // the run the first one just started for it, nor park it behind that run.
    h.agent(STEERING_RUNNER, true, "enqueue", json!({})).await;
    let mut jobs = h.jobs().await;

    // While another orchestrator routes an event, a copy of it is sent back to the queue.
    let held = h.ingest("held", None, "hello").await;
    let lock = format!("route:{held}");
    assert!(
        h.b.sessions
            .acquire_lease(&lock, "other-orchestrator", Duration::from_secs(30))
            .await
            .unwrap()
    );
    assert!(matches!(
        h.router().route(&EventMessage::new(ws(), held)).await,
        Err(OrchestratorError::RouteInProgress(id)) if id == held
    ));
    assert_eq!(h.event(held).await.status, EventStatus::Received);
    assert!(
        h.b.sessions
            .release_lease(&lock, "other-orchestrator")
            .await
            .unwrap()
    );
    assert!(matches!(
        h.route(held).await,
        RouteOutcome::Dispatched { created: true, .. }
    ));
    next_job(&mut jobs).await;
    assert_eq!(
        h.b.sessions.lease_holder(&lock).await.unwrap(),
        None,
        "the router releases the event when done"
    );

    for i in 0..20 {
        let conversation = format!("c{i}");
        let e = h.ingest(&conversation, None, "hello").await;
        let outcomes = route_on_two_routers(&h, e).await;
        // The second router finds the run created and still queued, and republishes its
        // job (harmless: one worker claims a run) — never a second run, a claim or a park.
        let created: Vec<RunId> = outcomes
            .iter()
            .filter_map(|o| match o {
                RouteOutcome::Dispatched {
                    run_id,
                    created: true,
                } => Some(*run_id),
                _ => None,
            })
            .collect();
        assert_eq!(created.len(), 1, "{outcomes:?}");
        let run_id = created[0];
        for o in &outcomes {
            assert!(
                matches!(o, RouteOutcome::Dispatched { run_id: r, .. } if *r == run_id)
                    || *o == RouteOutcome::AlreadyHandled,
                "{outcomes:?}"
            );
        }
        assert_eq!(next_job(&mut jobs).await.run_id, run_id);
        while let Ok(d) = tokio::time::timeout(Duration::from_millis(20), jobs.next()).await {
            let d = d.unwrap();
            assert_eq!(messages::decode::<RunJob>(&d.body).unwrap().run_id, run_id);
            d.ack().await.unwrap();
        }
        assert_eq!(h.b.sessions.steering_len(&run_id).await.unwrap(), 0);
        let event = h.event(e).await;
        assert_eq!(event.status, EventStatus::Dispatched);
        assert_eq!(event.metadata.get("concurrency"), None, "never parked");
        assert!(
            h.deps()
                .conversations(&h.options)
                .parked(&conversation_key(&conversation))
                .await
                .unwrap()
                .is_empty(),
            "not parked behind its own run"
        );
    }
    assert_eq!(h.run_count().await, 21);
}

// ---------------------------------------------------------------------------------------
// Concurrency policies
// ---------------------------------------------------------------------------------------

async fn parallel_policy_runs_both(b: Backends) {
    let h = Harness::new(b);
    h.agent(PLAIN_RUNNER, false, "parallel", json!({})).await;
    let first = h.dispatched("c1", "one").await;
    let second = h.dispatched("c1", "two").await;
    assert_ne!(first, second);
    let active = h
        .deps()
        .conversations(&h.options)
        .active(&conversation_key("c1"), None)
        .await
        .unwrap();
    assert_eq!(
        active.iter().map(|r| r.run_id).collect::<Vec<_>>(),
        [first, second]
    );
    for run in [first, second] {
        assert_eq!(h.run_status(run).await, RunStatus::Queued);
    }
}

async fn reject_policy_rejects_while_busy(b: Backends) {
    let h = Harness::new(b);
    h.agent(PLAIN_RUNNER, false, "reject", json!({})).await;
    let shutdown = Shutdown::new();
    let orchestrator = h.spawn(&shutdown).await;
    let first = h.dispatched("c1", "one").await;

    let busy = h.ingest("c1", None, "two").await;
    assert_eq!(
        h.route(busy).await,
        RouteOutcome::Rejected {
            active: vec![first]
        }
    );
    let event = h.event(busy).await;
    assert_eq!(event.status, EventStatus::Rejected);
    assert_eq!(event.reason.as_deref(), Some("conversation.busy"));
    assert_eq!(event.metadata["concurrency"]["policy"], "reject");
    assert_eq!(
        event.metadata["concurrency"]["active_run_ids"],
        json!([first.to_string()])
    );
    assert_eq!(h.run_count().await, 1);
    assert_eq!(h.route(busy).await, RouteOutcome::AlreadyHandled);

    // another conversation is not busy
    let elsewhere = h.ingest("c2", None, "hi").await;
    assert!(matches!(
        h.route(elsewhere).await,
        RouteOutcome::Dispatched { .. }
    ));

    // once the run ended, the conversation accepts again
    h.complete(first, "c1").await;
    let later = h.ingest("c1", None, "three").await;
    assert!(matches!(
        h.route(later).await,
        RouteOutcome::Dispatched { .. }
    ));

    shutdown.trigger();
    orchestrator.join().await;
}

async fn enqueue_policy_starts_in_arrival_order(b: Backends) {
    let mut h = Harness::new(b);
    // Only the sink's wake-up may start the next run here, not the reaper's sweep.
    h.options.reaper_interval = Duration::from_secs(3600);
    h.agent(PLAIN_RUNNER, false, "enqueue", json!({})).await;
    let shutdown = Shutdown::new();
    let orchestrator = h.spawn(&shutdown).await;
    let mut jobs = h.jobs().await;

    let e1 = h.ingest("c1", None, "first").await;
    h.publish_event(e1, "c1").await;
    let job1 = next_job(&mut jobs).await;
    assert_eq!(job1.context.event.event_id, e1.to_string());

    let e2 = h.ingest("c1", None, "second").await;
    h.publish_event(e2, "c1").await;
    let e3 = h.ingest("c1", None, "third").await;
    h.publish_event(e3, "c1").await;
    for e in [e2, e3] {
        eventually("the event to be parked", || async {
            h.event(e).await.metadata["concurrency"]["status"] == "queued"
        })
        .await;
    }
    no_job(&mut jobs, Duration::from_millis(100)).await;
    let parked = h.event(e2).await;
    assert_eq!(
        parked.status,
        EventStatus::Received,
        "a parked event stays received"
    );
    assert_eq!(
        parked.metadata["concurrency"]["queued_behind"],
        json!([job1.run_id.to_string()])
    );
    assert_eq!(h.run_count().await, 1);

    // the first run ends → the second starts (and only the second)
    h.complete(job1.run_id, "c1").await;
    let job2 = next_job(&mut jobs).await;
    assert_eq!(job2.context.event.event_id, e2.to_string());
    no_job(&mut jobs, Duration::from_millis(100)).await;
    let started = h.event(e2).await;
    assert_eq!(started.status, EventStatus::Dispatched);
    assert_eq!(started.run_id, Some(job2.run_id));
    assert_eq!(started.metadata["concurrency"]["status"], "started");
    assert_eq!(h.event(e3).await.status, EventStatus::Received);

    // a message arriving now waits behind the third
    let e4 = h.ingest("c1", None, "fourth").await;
    h.publish_event(e4, "c1").await;
    eventually("the fourth to be parked", || async {
        h.event(e4).await.metadata["concurrency"]["status"] == "queued"
    })
    .await;

    h.complete(job2.run_id, "c1").await;
    let job3 = next_job(&mut jobs).await;
    assert_eq!(job3.context.event.event_id, e3.to_string());
    no_job(&mut jobs, Duration::from_millis(100)).await;
    h.complete(job3.run_id, "c1").await;
    let job4 = next_job(&mut jobs).await;
    assert_eq!(job4.context.event.event_id, e4.to_string());
    h.complete(job4.run_id, "c1").await;
    no_job(&mut jobs, Duration::from_millis(100)).await;
    assert_eq!(h.run_count().await, 4);
    assert!(
        h.deps()
            .conversations(&h.options)
            .parked(&conversation_key("c1"))
            .await
            .unwrap()
            .is_empty()
    );

    shutdown.trigger();
    orchestrator.join().await;
}

async fn interrupt_policy_cancels_then_starts(b: Backends) {
    let h = Harness::new(b);
    h.agent(PLAIN_RUNNER, false, "interrupt", json!({})).await;
    let mut cancels = h.cancels().await;
    let first = h.dispatched("c1", "one").await;
    assert!(h.b.stores.runs.claim_run(first, "w1").await.unwrap());

    let next = h.ingest("c1", None, "actually, this").await;
    let RouteOutcome::Dispatched { run_id: second, .. } = h.route(next).await else {
        panic!("interrupt starts the new run");
    };
    assert_ne!(second, first);

    // the first run receives the cancel: ledger intent, flag, control message
    let d = tokio::time::timeout(Duration::from_secs(5), cancels.next())
        .await
        .expect("a cancel message")
        .unwrap();
    let ControlMessage::Cancel { run_id, reason } =
        messages::decode::<ControlMessage>(&d.body).unwrap();
    d.ack().await.unwrap();
    assert_eq!(run_id, first);
    assert!(reason.contains(&next.to_string()), "{reason}");
    let flag =
        h.b.sessions
            .get(&cancel_flag_key(&first))
            .await
            .unwrap()
            .expect("the cancel flag is set for a worker that has not bound yet");
    assert_eq!(String::from_utf8(flag).unwrap(), reason);
    let run = h.b.stores.runs.get_run(first).await.unwrap().unwrap();
    assert!(run.cancel_requested_at.is_some());
    let event = h.event(next).await;
    assert_eq!(
        event.metadata["concurrency"]["interrupted_run_ids"],
        json!([first.to_string()])
    );
    // the second run is not cancelled
    assert!(
        h.b.sessions
            .get(&cancel_flag_key(&second))
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(100), cancels.next())
            .await
            .is_err()
    );
}

// ---------------------------------------------------------------------------------------
// Run end
// ---------------------------------------------------------------------------------------

async fn reaper_audits_unpulled_steering_items(b: Backends) {
    let h = Harness::new(b);
    h.agent(STEERING_RUNNER, true, "parallel", json!({"timeout": 0.05}))
        .await;
    let run = h.dispatched("c1", "start").await;
    let follow = h.ingest("c1", None, "left unread").await;
    assert_eq!(h.route(follow).await, RouteOutcome::Claimed { run_id: run });

    let options = Arc::new(OrchestratorOptions {
        session_grace: Duration::ZERO,
        ..h.options.clone()
    });
    let sink = Arc::new(ResultSink::new(h.deps(), Arc::clone(&options)));
    let reaper = Reaper::new(h.deps(), options, sink);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(reaper.reap_once().await.unwrap(), [run]);

    let page =
        h.b.stores
            .events
            .page(EventQuery {
                event_types: vec!["steering.dropped".into()],
                ..EventQuery::new(ws())
            })
            .await
            .unwrap();
    assert_eq!(page.items.len(), 1);
    let row = &page.items[0];
    assert_eq!(row.run_id, Some(run));
    assert_eq!(row.source, "host");
    assert_eq!(row.conversation_id.as_deref(), Some("c1"));
    assert_eq!(row.input_summary.as_deref(), Some("left unread"));
    assert_eq!(row.metadata["steering"]["status"], "dropped");
    assert_eq!(row.metadata["steering"]["reason"], "run_ended");
    assert_eq!(
        row.metadata["steering"]["source_event_id"],
        follow.to_string()
    );
    // the run left the conversation's index
    assert!(
        h.deps()
            .conversations(&h.options)
            .active(&conversation_key("c1"), None)
            .await
            .unwrap()
            .is_empty()
    );
}

async fn sweep_releases_a_stranded_queue(b: Backends) {
    let h = Harness::new(b);
    h.agent(PLAIN_RUNNER, false, "enqueue", json!({})).await;
    let mut events =
        h.b.bus
            .subscribe(
                &h.b.topology
                    .events_queue(sb_common::bus::topology::events_shard(
                        WS,
                        Some("c1"),
                        NonZeroU32::new(2).unwrap(),
                    )),
                ConsumeOptions::prefetch(10),
            )
            .await
            .unwrap();
    let first = h.dispatched("c1", "one").await;
    let waiting = h.ingest("c1", None, "two").await;
    assert_eq!(
        h.route(waiting).await,
        RouteOutcome::Parked {
            behind: vec![first]
        }
    );
    // The run's worker vanished: its session expired and no terminal ever reached the sink.
    h.b.sessions.end_session(&first).await.unwrap();
    let conversations = h.deps().conversations(&h.options);
    assert_eq!(conversations.sweep().await.unwrap(), 1);
    let d = tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .expect("the parked event is published again")
        .unwrap();
    let message = messages::decode::<EventMessage>(&d.body).unwrap();
    d.ack().await.unwrap();
    assert_eq!(message.event_id, waiting);
    let RouteOutcome::Dispatched { run_id, .. } = h.route(waiting).await else {
        panic!("the released event starts");
    };
    assert_ne!(run_id, first);
    // nothing left to release; the conversation is forgotten by the next sweep
    assert_eq!(conversations.sweep().await.unwrap(), 0);
    assert!(
        h.b.sessions
            .set_members(sb_orchestrator::concurrency::PARKED_CONVERSATIONS_SET)
            .await
            .unwrap()
            .is_empty()
    );
}

/// The sink's end of a run: `finish_run` removes the run from the active index and, with no
/// other run active, publishes the parked head (removal and queue read are one store step).
async fn finishing_a_run_releases_the_parked_head(b: Backends) {
    let h = Harness::new(b);
    h.agent(PLAIN_RUNNER, false, "enqueue", json!({})).await;
    let mut events =
        h.b.bus
            .subscribe(
                &h.b.topology
                    .events_queue(sb_common::bus::topology::events_shard(
                        WS,
                        Some("c1"),
                        NonZeroU32::new(2).unwrap(),
                    )),
                ConsumeOptions::prefetch(10),
            )
            .await
            .unwrap();
    let first = h.dispatched("c1", "one").await;
    let waiting = h.ingest("c1", None, "two").await;
    assert_eq!(
        h.route(waiting).await,
        RouteOutcome::Parked {
            behind: vec![first]
        }
    );
    let conversations = h.deps().conversations(&h.options);
    let key = conversation_key("c1");
    // Another run's end leaves `first` active: the head stays parked.
    assert!(!conversations.finish_run(&key, RunId::new()).await.unwrap());
    let active = conversations.active(&key, None).await.unwrap();
    assert_eq!(active.iter().map(|r| r.run_id).collect::<Vec<_>>(), [first]);
    assert!(conversations.finish_run(&key, first).await.unwrap());
    assert!(conversations.active(&key, None).await.unwrap().is_empty());
    let d = tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .expect("the parked event is published again")
        .unwrap();
    let message = messages::decode::<EventMessage>(&d.body).unwrap();
    d.ack().await.unwrap();
    assert_eq!(message.event_id, waiting);
    assert_eq!(
        conversations.parked(&key).await.unwrap().len(),
        1,
        "the head stays parked until it is routed"
    );
}
